/* test_lc_http.c — the lifecycle's outbound HTTP pool (services/lifecycle/lc_http.c) against a
 * slow local server: who gets the pool's threads when several tenants' instances ask at once.
 * The allowlist and the header rules are tested through real instances in
 * tests/integration/test_lc_host.c. */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "lc_http.h"
#include "pie_testutil.h"

TestSuite(lc_http, .fini = pie_test_leak_check, .timeout = 60);

/* Answers each connection, one at a time, after delay_ms with "ok". */
typedef struct slow_server {
    int fd, port, delay_ms;
    pthread_t thread;
} slow_server;

static void *serve(void *arg) {
    slow_server *s = arg;
    for (;;) {
        int c = accept(s->fd, NULL, NULL);
        if (c < 0) return NULL; /* closed: the test is over */
        char req[4096];
        ssize_t n = read(c, req, sizeof req); /* the request fits one read here */
        (void)n;
        pie_test_sleep_ms(s->delay_ms);
        static const char resp[] =
            "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok";
        ssize_t w = write(c, resp, sizeof resp - 1);
        (void)w;
        close(c);
    }
}

static void server_start(slow_server *s, int delay_ms) {
    s->delay_ms = delay_ms;
    s->fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert(s->fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    cr_assert_eq(bind(s->fd, (struct sockaddr *)&a, sizeof a), 0);
    cr_assert_eq(listen(s->fd, 64), 0);
    cr_assert_eq(getsockname(s->fd, (struct sockaddr *)&a, &len), 0);
    s->port = ntohs(a.sin_port);
    cr_assert_eq(pthread_create(&s->thread, NULL, serve, s), 0);
}

static void server_stop(slow_server *s) {
    shutdown(s->fd, SHUT_RDWR);
    close(s->fd);
    pthread_join(s->thread, NULL);
}

/* The order in which requests completed, by tenant. */
typedef struct done_log {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    char order[16][16];
    int n;
} done_log;

typedef struct done_ctx {
    done_log *log;
    const char *tenant;
} done_ctx;

static void on_done(void *ctx, pie_code code, const char *msg, uint8_t *payload, size_t len) {
    (void)len;
    done_ctx *d = ctx;
    cr_expect_eq(code, PIE_OK, "%s", msg ? msg : "");
    free(payload);
    pthread_mutex_lock(&d->log->mu);
    snprintf(d->log->order[d->log->n++], sizeof d->log->order[0], "%s", d->tenant);
    pthread_cond_broadcast(&d->log->cv);
    pthread_mutex_unlock(&d->log->mu);
}

static pie_code submit(lc_http *h, const char *url, const char *tenant, done_ctx *d,
                       pie_status *st) {
    lc_http_request r = {
        .method = "GET", .method_len = 3, .url = url, .url_len = strlen(url), .tenant = tenant};
    return lc_http_submit(h, &r, NULL, on_done, d, st);
}

/* One thread and a server that takes 150 ms a request: bob queues 4, then alice 1. Her request
 * ran after all of bob's (FIFO), so one tenant's slow requests held every other tenant's for
 * as long as his took; now the thread goes to the tenant with the fewest running, and a
 * tenant's requests waiting or running are at most half of max_queued. */
Test(lc_http, a_tenants_requests_do_not_wait_behind_another_tenants) {
    slow_server s;
    server_start(&s, 150);
    char allow[64], url[96];
    snprintf(allow, sizeof allow, "http://127.0.0.1:%d/", s.port);
    snprintf(url, sizeof url, "http://127.0.0.1:%d/x", s.port);
    lc_http_config cfg = {.allow = allow, .threads = 1, .max_queued = 8};
    pie_status st;
    lc_http *h = lc_http_create(&cfg, &st);
    cr_assert(h, "%s", st.msg);
    done_log log = {.n = 0};
    pthread_mutex_init(&log.mu, NULL);
    pthread_cond_init(&log.cv, NULL);
    done_ctx bob = {&log, "bob"}, alice = {&log, "alice"};
    for (int i = 0; i < 4; i++)
        cr_assert_eq(submit(h, url, "bob", &bob, &st), PIE_OK, "%s", st.msg);
    cr_expect_eq(submit(h, url, "bob", &bob, &st), PIE_RESOURCE_EXHAUSTED);
    cr_expect(strstr(st.msg, "tenant \"bob\""), "%s", st.msg);
    cr_assert_eq(submit(h, url, "alice", &alice, &st), PIE_OK, "%s", st.msg);
    pthread_mutex_lock(&log.mu);
    while (log.n < 5) pthread_cond_wait(&log.cv, &log.mu);
    pthread_mutex_unlock(&log.mu);
    int alice_at = -1;
    for (int i = 0; i < log.n; i++)
        if (strcmp(log.order[i], "alice") == 0) alice_at = i;
    cr_expect_leq(alice_at, 1, "alice's request completed #%d of 5 (after bob's)", alice_at + 1);
    lc_http_destroy(h);
    pthread_cond_destroy(&log.cv);
    pthread_mutex_destroy(&log.mu);
    server_stop(&s);
}
