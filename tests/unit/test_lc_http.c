/* test_lc_http.c — the lifecycle's outbound HTTP requests (services/lifecycle/lc_http.c) against
 * slow local servers: how many run at once, whose run first when several tenants' instances ask
 * at once, and cancellation.
 * The allowlist and the header rules are tested through real instances in
 * tests/integration/test_lc_host.c. */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "lc_http.h"
#include "pie_metrics.h"
#include "pie_testutil.h"

TestSuite(lc_http, .fini = pie_test_leak_check, .timeout = 60);

/* Answers each connection, one at a time, after delay_ms with "ok" (or with body bytes of 'x'
 * when body > 0). */
typedef struct slow_server {
    int fd, port, delay_ms;
    size_t body;
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
        size_t blen = s->body ? s->body : 2;
        char head[128];
        int hl =
            snprintf(head, sizeof head,
                     "HTTP/1.1 200 OK\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n", blen);
        char *resp = malloc((size_t)hl + blen);
        cr_assert(resp);
        memcpy(resp, head, (size_t)hl);
        if (s->body)
            memset(resp + hl, 'x', blen);
        else
            memcpy(resp + hl, "ok", 2);
        for (size_t at = 0; at < (size_t)hl + blen;) { /* the client may hang up: stop then */
            ssize_t w = write(c, resp + at, (size_t)hl + blen - at);
            if (w <= 0) break;
            at += (size_t)w;
        }
        free(resp);
        close(c);
    }
}

/* A listening loopback socket on a free port. */
static int listen_loopback(int *port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert(fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    cr_assert_eq(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    cr_assert_eq(listen(fd, 64), 0);
    cr_assert_eq(getsockname(fd, (struct sockaddr *)&a, &len), 0);
    *port = ntohs(a.sin_port);
    return fd;
}

/* Closes a listener and joins the thread accepting on it (its accept fails). */
static void listener_stop(int fd, pthread_t thread) {
    shutdown(fd, SHUT_RDWR);
    close(fd);
    pthread_join(thread, NULL);
}

static void server_start(slow_server *s, int delay_ms) {
    s->delay_ms = delay_ms;
    s->fd = listen_loopback(&s->port);
    cr_assert_eq(pthread_create(&s->thread, NULL, serve, s), 0);
}

static void server_stop(slow_server *s) { listener_stop(s->fd, s->thread); }

/* The allowlist admitting a local server's port, and a URL on it. */
static void urls_of(int port, char allow[64], char url[96]) {
    snprintf(allow, 64, "http://127.0.0.1:%d/", port);
    snprintf(url, 96, "http://127.0.0.1:%d/x", port);
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

/* One request at a time and a server that takes 150 ms a request: bob queues 4, then alice 1.
 * Her request ran after all of bob's (FIFO), so one tenant's slow requests held every other
 * tenant's for as long as his took; now the next start goes to the tenant with the fewest
 * running, and a tenant's requests waiting or running are at most half of max_queued. */
Test(lc_http, a_tenants_requests_do_not_wait_behind_another_tenants) {
    slow_server s = {.body = 0};
    server_start(&s, 150);
    char allow[64], url[96];
    urls_of(s.port, allow, url);
    lc_http_config cfg = {.allow = allow, .max_running = 1, .max_queued = 8};
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

/* A server that answers each connection on its own thread once `want` connections are open
 * at the same time (or after 3 s without them): how many requests the pool runs at once. */
typedef struct gate_server {
    int fd, port, want;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int open, most;
    pthread_t answering[32]; /* joined by gate_stop */
    int n_answering;
} gate_server;

typedef struct gate_conn {
    gate_server *s;
    int fd;
} gate_conn;

static void *gate_answer(void *arg) {
    gate_conn *c = arg;
    gate_server *s = c->s;
    char req[4096];
    ssize_t n = read(c->fd, req, sizeof req);
    (void)n;
    pthread_mutex_lock(&s->mu);
    s->open++;
    if (s->open > s->most) s->most = s->open;
    pthread_cond_broadcast(&s->cv);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 3;
    while (s->most < s->want && pthread_cond_timedwait(&s->cv, &s->mu, &until) == 0) continue;
    s->open--;
    pthread_mutex_unlock(&s->mu);
    static const char resp[] =
        "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok";
    ssize_t w = write(c->fd, resp, sizeof resp - 1);
    (void)w;
    close(c->fd);
    free(c);
    return NULL;
}

static void *gate_serve(void *arg) {
    gate_server *s = arg;
    for (;;) {
        int fd = accept(s->fd, NULL, NULL);
        if (fd < 0) return NULL;
        gate_conn *c = malloc(sizeof *c);
        cr_assert(c && s->n_answering < 32);
        *c = (gate_conn){s, fd};
        cr_assert_eq(pthread_create(&s->answering[s->n_answering++], NULL, gate_answer, c), 0);
    }
}

static void gate_start(gate_server *s, int want) {
    *s = (gate_server){.want = want};
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->fd = listen_loopback(&s->port);
    cr_assert_eq(pthread_create(&s->thread, NULL, gate_serve, s), 0);
}

static void gate_stop(gate_server *s) {
    listener_stop(s->fd, s->thread);
    for (int i = 0; i < s->n_answering; i++) pthread_join(s->answering[i], NULL);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
}

static void wait_done(done_log *log, int n) {
    pthread_mutex_lock(&log->mu);
    while (log->n < n) pthread_cond_wait(&log->cv, &log->mu);
    pthread_mutex_unlock(&log->mu);
}

/* The replica ran two requests at a time (a pool of two threads, each blocked in one request),
 * so the third of an agent's tool calls waited for one of the first two to end; with the
 * defaults six requests of one tenant run at once now (an event loop over libcurl's multi
 * interface: a slow endpoint holds no thread). */
Test(lc_http, requests_run_at_once_not_two_at_a_time) {
    gate_server s;
    gate_start(&s, 6);
    char allow[64], url[96];
    urls_of(s.port, allow, url);
    lc_http_config cfg = {.allow = allow};
    pie_status st;
    lc_http *h = lc_http_create(&cfg, &st);
    cr_assert(h, "%s", st.msg);
    done_log log = {.n = 0};
    pthread_mutex_init(&log.mu, NULL);
    pthread_cond_init(&log.cv, NULL);
    done_ctx d = {&log, "carol"};
    for (int i = 0; i < 6; i++) cr_assert_eq(submit(h, url, "", &d, &st), PIE_OK, "%s", st.msg);
    wait_done(&log, 6);
    pthread_mutex_lock(&s.mu);
    int most = s.most;
    pthread_mutex_unlock(&s.mu);
    cr_expect_eq(most, 6, "%d of 6 requests were open at once", most);
    lc_http_destroy(h);
    gate_stop(&s);
    pthread_cond_destroy(&log.cv);
    pthread_mutex_destroy(&log.mu);
}

/* Two requests at once (so one each for a tenant): bob submits two, then, a little later, alice
 * one. Her request starts beside bob's first, not after his second: a tenant runs at most half
 * of max_running, so a tenant arriving later finds room. */
Test(lc_http, a_tenant_runs_at_most_half_of_the_requests_at_once) {
    gate_server s;
    gate_start(&s, 2);
    char allow[64], url[96];
    urls_of(s.port, allow, url);
    lc_http_config cfg = {.allow = allow, .max_running = 2};
    pie_status st;
    lc_http *h = lc_http_create(&cfg, &st);
    cr_assert(h, "%s", st.msg);
    done_log log = {.n = 0};
    pthread_mutex_init(&log.mu, NULL);
    pthread_cond_init(&log.cv, NULL);
    done_ctx bob = {&log, "bob"}, alice = {&log, "alice"};
    cr_assert_eq(submit(h, url, "bob", &bob, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(submit(h, url, "bob", &bob, &st), PIE_OK, "%s", st.msg);
    pie_test_sleep_ms(200); /* bob's may start now: without a share both would */
    cr_assert_eq(submit(h, url, "alice", &alice, &st), PIE_OK, "%s", st.msg);
    wait_done(&log, 3);
    cr_expect_str_eq(log.order[2], "bob", "bob's second request ran before alice's");
    lc_http_destroy(h);
    gate_stop(&s);
    pthread_cond_destroy(&log.cv);
    pthread_mutex_destroy(&log.mu);
}

/* One completion's code and message. */
typedef struct one_result {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done;
    pie_code code;
    char msg[256];
    size_t len;
} one_result;

static void on_one(void *ctx, pie_code code, const char *msg, uint8_t *payload, size_t len) {
    one_result *r = ctx;
    free(payload);
    pthread_mutex_lock(&r->mu);
    cr_expect(!r->done, "a request's completion ran twice");
    r->done = true;
    r->code = code;
    r->len = len;
    snprintf(r->msg, sizeof r->msg, "%s", msg ? msg : "");
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

static void one_init(one_result *r) {
    memset(r, 0, sizeof *r);
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
}

static void one_wait(one_result *r) {
    pthread_mutex_lock(&r->mu);
    while (!r->done) pthread_cond_wait(&r->cv, &r->mu);
    pthread_mutex_unlock(&r->mu);
    pthread_cond_destroy(&r->cv);
    pthread_mutex_destroy(&r->mu);
}

/* A running request whose instance cancels it ends CANCELLED (the server would answer OK after
 * 3 s), and destroying the pool ends what runs and what waits, each completion once. */
Test(lc_http, cancelled_and_stopped_requests_end_cancelled_once) {
    slow_server s = {.body = 0};
    server_start(&s, 3000);
    char allow[64], url[96];
    urls_of(s.port, allow, url);
    lc_http_config cfg = {.allow = allow, .max_running = 1};
    pie_status st;
    lc_http *h = lc_http_create(&cfg, &st);
    cr_assert(h, "%s", st.msg);
    lc_http_request r = {.method = "GET", .method_len = 3, .url = url, .url_len = strlen(url)};
    atomic_bool cancel;
    atomic_init(&cancel, false);
    one_result a;
    one_init(&a);
    cr_assert_eq(lc_http_submit(h, &r, &cancel, on_one, &a, &st), PIE_OK, "%s", st.msg);
    pie_test_sleep_ms(200); /* running: the server holds it */
    atomic_store(&cancel, true);
    one_wait(&a);
    cr_expect_eq(a.code, PIE_CANCELLED, "%s", a.msg);
    one_result running, waiting;
    one_init(&running);
    one_init(&waiting);
    cr_assert_eq(lc_http_submit(h, &r, NULL, on_one, &running, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(lc_http_submit(h, &r, NULL, on_one, &waiting, &st), PIE_OK, "%s", st.msg);
    pie_test_sleep_ms(100);
    lc_http_destroy(h);
    one_wait(&running);
    one_wait(&waiting);
    cr_expect_eq(running.code, PIE_CANCELLED, "%s", running.msg);
    cr_expect_eq(waiting.code, PIE_CANCELLED, "%s", waiting.msg);
    server_stop(&s);
}

/* A response is charged to the replica's memory budget while it fills: one that does not fit
 * fails RESOURCE_EXHAUSTED naming limits.replica_memory, and every byte comes back; the
 * metrics count both outcomes. */
Test(lc_http, a_response_is_charged_to_the_replica_budget_while_it_fills) {
    slow_server s = {.body = 256 * 1024};
    server_start(&s, 0);
    char allow[64], url[96];
    urls_of(s.port, allow, url);
    pie_budget budget = {.max = 64 * 1024};
    pie_metrics *reg = pie_metrics_create();
    cr_assert(reg);
    lc_http_config cfg = {.allow = allow, .budget = &budget, .metrics = reg};
    pie_status st;
    lc_http *h = lc_http_create(&cfg, &st);
    cr_assert(h, "%s", st.msg);
    lc_http_request r = {.method = "GET", .method_len = 3, .url = url, .url_len = strlen(url)};
    one_result small;
    one_init(&small);
    cr_assert_eq(lc_http_submit(h, &r, NULL, on_one, &small, &st), PIE_OK, "%s", st.msg);
    one_wait(&small);
    cr_expect_eq(small.code, PIE_RESOURCE_EXHAUSTED, "%s", small.msg);
    cr_expect(strstr(small.msg, "replica_memory"), "%s", small.msg);
    cr_expect_eq(pie_budget_used(&budget), 0, "%llu bytes still charged",
                 (unsigned long long)pie_budget_used(&budget));
    budget.max = 1024 * 1024; /* room now: the same response arrives whole */
    one_result big;
    one_init(&big);
    cr_assert_eq(lc_http_submit(h, &r, NULL, on_one, &big, &st), PIE_OK, "%s", st.msg);
    one_wait(&big);
    cr_expect_eq(big.code, PIE_OK, "%s", big.msg);
    cr_expect_eq(big.len, 4 + 256 * 1024);
    cr_expect_eq(pie_budget_used(&budget), 0, "the payload handed over is no longer charged");
    char *text = NULL;
    size_t len = 0;
    cr_assert_eq(pie_metrics_render(reg, &text, &len), PIE_OK);
    static const char *const want[] = {
        "pie_lifecycle_http_requests_total{code=\"OK\"} 1\n",
        "pie_lifecycle_http_requests_total{code=\"RESOURCE_EXHAUSTED\"} 1\n",
        "pie_lifecycle_http_pending{state=\"waiting\"} 0\n",
        "pie_lifecycle_http_pending{state=\"running\"} 0\n"};
    for (size_t i = 0; i < sizeof want / sizeof *want; i++)
        cr_expect(strstr(text, want[i]), "no %s in the metrics:\n%s", want[i], text);
    free(text);
    lc_http_destroy(h);
    pie_metrics_destroy(reg);
    server_stop(&s);
}
