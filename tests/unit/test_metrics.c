/* test_metrics.c — pie_metrics (registry, hot-path updates, text format 0.0.4) and pie_httpd
 * (a real loopback HTTP server: /metrics, /healthz, errors, partial and concurrent clients). */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "pie_httpd.h"
#include "pie_log.h"
#include "pie_metrics.h"

static void quiet(void) { pie_log_set_level(PIE_LOG_WARN); }

TestSuite(metrics, .init = quiet);
TestSuite(httpd, .init = quiet);

static char *render(pie_metrics *m) {
    char *out;
    size_t len;
    cr_assert_eq(pie_metrics_render(m, &out, &len), PIE_OK);
    cr_assert_eq(strlen(out), len);
    return out;
}

#define ASSERT_RENDER(m, want)                                                                 \
    do {                                                                                       \
        char *got_ = render(m);                                                                \
        cr_assert_str_eq(got_, want, "render\n--- got ---\n%s--- want ---\n%s", got_, want);  \
        free(got_);                                                                            \
    } while (0)

/* ---- registry and format -------------------------------------------------------------------- */

Test(metrics, empty_registry_renders_nothing) {
    pie_metrics *m = pie_metrics_create();
    cr_assert_not_null(m);
    ASSERT_RENDER(m, "");
    pie_metrics_destroy(m);
}

Test(metrics, counter_renders_help_type_and_value) {
    pie_metrics *m = pie_metrics_create();
    pie_status st;
    pie_counter *c = pie_metrics_counter(m, "pie_requests_total", "Requests served.", NULL, 0, &st);
    cr_assert_not_null(c, "%s", st.msg);
    pie_counter_add(c, 1);
    pie_counter_add(c, 2);
    cr_assert_eq(pie_counter_value(c), 3);
    ASSERT_RENDER(m, "# HELP pie_requests_total Requests served.\n"
                     "# TYPE pie_requests_total counter\n"
                     "pie_requests_total 3\n");
    pie_metrics_destroy(m);
}

Test(metrics, labels_are_escaped_and_series_kept_in_creation_order) {
    pie_metrics *m = pie_metrics_create();
    pie_status st;
    pie_metric_label a[] = {{"method", "Launch"}, {"code", "OK"}};
    pie_metric_label b[] = {{"method", "we\"ird\\\nname"}, {"code", "é"}};
    pie_counter *ca = pie_metrics_counter(m, "rpc_total", "Calls by \\method\nand code.", a, 2, &st);
    pie_counter *cb = pie_metrics_counter(m, "rpc_total", "Calls by \\method\nand code.", b, 2, &st);
    pie_counter *ca2 = pie_metrics_counter(m, "rpc_total", "Calls by \\method\nand code.", a, 2, &st);
    cr_assert(ca && cb && ca != cb, "%s", st.msg);
    cr_assert_eq(ca, ca2, "same label values give the same series");
    pie_counter_add(ca, 5);
    pie_counter_add(cb, 7);
    ASSERT_RENDER(m, "# HELP rpc_total Calls by \\\\method\\nand code.\n"
                     "# TYPE rpc_total counter\n"
                     "rpc_total{method=\"Launch\",code=\"OK\"} 5\n"
                     "rpc_total{method=\"we\\\"ird\\\\\\nname\",code=\"é\"} 7\n");
    pie_metrics_destroy(m);
}

Test(metrics, gauge_set_add_and_float_text) {
    pie_metrics *m = pie_metrics_create();
    pie_status st;
    pie_gauge *g = pie_metrics_gauge(m, "kv_pages_free", "Free KV pages.", NULL, 0, &st);
    pie_gauge *h = pie_metrics_gauge(m, "ratio", "A ratio.", NULL, 0, &st);
    pie_gauge *n = pie_metrics_gauge(m, "odd:values", "NaN and infinities.",
                                     (pie_metric_label[]){{"which", "nan"}}, 1, &st);
    pie_gauge *i = pie_metrics_gauge(m, "odd:values", "NaN and infinities.",
                                     (pie_metric_label[]){{"which", "inf"}}, 1, &st);
    pie_gauge *j = pie_metrics_gauge(m, "odd:values", "NaN and infinities.",
                                     (pie_metric_label[]){{"which", "-inf"}}, 1, &st);
    cr_assert(g && h && n && i && j, "%s", st.msg);
    pie_gauge_set(g, 100);
    pie_gauge_add(g, -1.5);
    cr_assert_float_eq(pie_gauge_value(g), 98.5, 0);
    pie_gauge_set(h, 0.1);
    pie_gauge_set(n, NAN);
    pie_gauge_set(i, INFINITY);
    pie_gauge_set(j, -INFINITY);
    ASSERT_RENDER(m, "# HELP kv_pages_free Free KV pages.\n"
                     "# TYPE kv_pages_free gauge\n"
                     "kv_pages_free 98.5\n"
                     "# HELP ratio A ratio.\n"
                     "# TYPE ratio gauge\n"
                     "ratio 0.1\n"
                     "# HELP odd:values NaN and infinities.\n"
                     "# TYPE odd:values gauge\n"
                     "odd:values{which=\"nan\"} NaN\n"
                     "odd:values{which=\"inf\"} +Inf\n"
                     "odd:values{which=\"-inf\"} -Inf\n");
    pie_metrics_destroy(m);
}

Test(metrics, histogram_buckets_are_cumulative_with_sum_and_count) {
    pie_metrics *m = pie_metrics_create();
    pie_status st;
    const double bounds[] = {0.25, 0.5, 1};
    pie_histogram *h = pie_metrics_histogram(m, "batch_seconds", "Batch time.", bounds, 3,
                                             (pie_metric_label[]){{"kind", "forward"}}, 1, &st);
    cr_assert_not_null(h, "%s", st.msg);
    pie_histogram_observe(h, 0.125);
    pie_histogram_observe(h, 0.25); /* a bound is inclusive: le="0.25" */
    pie_histogram_observe(h, 0.5);
    pie_histogram_observe(h, 3);
    cr_assert_eq(pie_histogram_count(h), 4);
    cr_assert_float_eq(pie_histogram_sum(h), 3.875, 0);
    ASSERT_RENDER(m, "# HELP batch_seconds Batch time.\n"
                     "# TYPE batch_seconds histogram\n"
                     "batch_seconds_bucket{kind=\"forward\",le=\"0.25\"} 2\n"
                     "batch_seconds_bucket{kind=\"forward\",le=\"0.5\"} 3\n"
                     "batch_seconds_bucket{kind=\"forward\",le=\"1\"} 3\n"
                     "batch_seconds_bucket{kind=\"forward\",le=\"+Inf\"} 4\n"
                     "batch_seconds_sum{kind=\"forward\"} 3.875\n"
                     "batch_seconds_count{kind=\"forward\"} 4\n");
    pie_metrics_destroy(m);
}

Test(metrics, histogram_without_labels_and_exponential_bounds) {
    pie_metrics *m = pie_metrics_create();
    pie_status st;
    double bounds[4];
    pie_metrics_exponential_bounds(0.001, 10, 4, bounds);
    pie_histogram *h = pie_metrics_histogram(m, "lat", "Latency.", bounds, 4, NULL, 0, &st);
    cr_assert_not_null(h, "%s", st.msg);
    pie_histogram_observe(h, 0.05);
    ASSERT_RENDER(m, "# HELP lat Latency.\n"
                     "# TYPE lat histogram\n"
                     "lat_bucket{le=\"0.001\"} 0\n"
                     "lat_bucket{le=\"0.01\"} 0\n"
                     "lat_bucket{le=\"0.1\"} 1\n"
                     "lat_bucket{le=\"1\"} 1\n"
                     "lat_bucket{le=\"+Inf\"} 1\n"
                     "lat_sum 0.05\n"
                     "lat_count 1\n");
    pie_metrics_destroy(m);
}

static void reg_fails(pie_metrics *m, void *handle, pie_status *st, pie_code code,
                      const char *msg) {
    cr_assert_null(handle);
    cr_assert_eq(st->code, code, "code %s: %s", pie_code_name(st->code), st->msg);
    cr_assert_str_eq(st->msg, msg, "\n  got:  %s\n  want: %s", st->msg, msg);
    (void)m;
}

Test(metrics, bad_names_are_refused) {
    pie_metrics *m = pie_metrics_create();
    pie_status st;
    reg_fails(m, pie_metrics_counter(m, "1abc", "h", NULL, 0, &st), &st, PIE_INVALID_ARGUMENT,
              "metric name '1abc' is not valid (want [a-zA-Z_:][a-zA-Z0-9_:]*)");
    reg_fails(m, pie_metrics_counter(m, "a-b", "h", NULL, 0, &st), &st, PIE_INVALID_ARGUMENT,
              "metric name 'a-b' is not valid (want [a-zA-Z_:][a-zA-Z0-9_:]*)");
    reg_fails(m, pie_metrics_counter(m, "", "h", NULL, 0, &st), &st, PIE_INVALID_ARGUMENT,
              "metric name '' is not valid (want [a-zA-Z_:][a-zA-Z0-9_:]*)");
    reg_fails(m, pie_metrics_counter(m, "x", "h", (pie_metric_label[]){{"__x", "v"}}, 1, &st),
              &st, PIE_INVALID_ARGUMENT,
              "metric 'x': label name '__x' is not valid (want [a-zA-Z_][a-zA-Z0-9_]*, not "
              "starting with __)");
    reg_fails(m, pie_metrics_counter(m, "x", "h", (pie_metric_label[]){{"a:b", "v"}}, 1, &st),
              &st, PIE_INVALID_ARGUMENT,
              "metric 'x': label name 'a:b' is not valid (want [a-zA-Z_][a-zA-Z0-9_]*, not "
              "starting with __)");
    reg_fails(m,
              pie_metrics_counter(m, "x", "h", (pie_metric_label[]){{"a", "1"}, {"a", "2"}}, 2,
                                  &st),
              &st, PIE_INVALID_ARGUMENT, "metric 'x': label 'a' given twice");
    reg_fails(m, pie_metrics_counter(m, "x", "h", (pie_metric_label[]){{"a", "\xff"}}, 1, &st),
              &st, PIE_INVALID_ARGUMENT, "metric 'x': value of label 'a' is not UTF-8 text");
    reg_fails(m, pie_metrics_counter(m, "x", "bad \xc0\x80", NULL, 0, &st), &st,
              PIE_INVALID_ARGUMENT, "metric 'x': help is not UTF-8 text");
    const double b[] = {1, 1};
    reg_fails(m, pie_metrics_histogram(m, "h", "h", b, 2, (pie_metric_label[]){{"le", "1"}}, 1, &st),
              &st, PIE_INVALID_ARGUMENT, "metric 'h': label 'le' is reserved for histogram buckets");
    reg_fails(m, pie_metrics_histogram(m, "h", "h", b, 2, NULL, 0, &st), &st, PIE_INVALID_ARGUMENT,
              "metric 'h': bucket bounds must be finite and strictly increasing (bound 1)");
    const double nan_bound[] = {NAN};
    reg_fails(m, pie_metrics_histogram(m, "h", "h", nan_bound, 1, NULL, 0, &st), &st,
              PIE_INVALID_ARGUMENT,
              "metric 'h': bucket bounds must be finite and strictly increasing (bound 0)");
    reg_fails(m, pie_metrics_histogram(m, "h", "h", b, 0, NULL, 0, &st), &st, PIE_INVALID_ARGUMENT,
              "metric 'h': 0 bucket bounds (want 1..64)");
    reg_fails(m, pie_metrics_counter(m, "x", "h", NULL, 5, &st), &st, PIE_INVALID_ARGUMENT,
              "metric 'x': 5 labels (at most 4)");
    reg_fails(NULL, pie_metrics_counter(NULL, "x", "h", NULL, 0, &st), &st, PIE_INVALID_ARGUMENT,
              "metrics: registry is NULL");
    ASSERT_RENDER(m, "");
    pie_metrics_destroy(m);
}

Test(metrics, conflicting_registration_is_already_exists) {
    pie_metrics *m = pie_metrics_create();
    pie_status st;
    const double b1[] = {1, 2}, b2[] = {1, 3};
    cr_assert_not_null(pie_metrics_counter(m, "c", "C.", (pie_metric_label[]){{"k", "v"}}, 1, &st));
    cr_assert_not_null(pie_metrics_histogram(m, "lat", "L.", b1, 2, NULL, 0, &st));
    reg_fails(m, pie_metrics_gauge(m, "c", "C.", NULL, 0, &st), &st, PIE_ALREADY_EXISTS,
              "metric 'c' is already a counter");
    reg_fails(m, pie_metrics_counter(m, "c", "Other.", (pie_metric_label[]){{"k", "v"}}, 1, &st),
              &st, PIE_ALREADY_EXISTS, "metric 'c' is already registered with other help text");
    reg_fails(m, pie_metrics_counter(m, "c", "C.", (pie_metric_label[]){{"j", "v"}}, 1, &st), &st,
              PIE_ALREADY_EXISTS, "metric 'c' is already registered with other label names");
    reg_fails(m, pie_metrics_counter(m, "c", "C.", NULL, 0, &st), &st, PIE_ALREADY_EXISTS,
              "metric 'c' is already registered with other label names");
    reg_fails(m, pie_metrics_histogram(m, "lat", "L.", b2, 2, NULL, 0, &st), &st,
              PIE_ALREADY_EXISTS, "metric 'lat' is already registered with other bucket bounds");
    reg_fails(m, pie_metrics_counter(m, "lat_count", "C.", NULL, 0, &st), &st, PIE_ALREADY_EXISTS,
              "metric 'lat_count' clashes with the series of histogram 'lat'");
    cr_assert_not_null(pie_metrics_gauge(m, "q_sum", "Q.", NULL, 0, &st));
    reg_fails(m, pie_metrics_histogram(m, "q", "Q.", b1, 2, NULL, 0, &st), &st, PIE_ALREADY_EXISTS,
              "metric 'q_sum' clashes with the series of histogram 'q'");
    pie_metrics_destroy(m);
}

Test(metrics, label_sets_per_family_are_capped) {
    pie_metrics *m = pie_metrics_create();
    pie_status st;
    char v[16];
    for (int i = 0; i < PIE_METRICS_MAX_SERIES; i++) {
        snprintf(v, sizeof v, "%d", i);
        cr_assert_not_null(
            pie_metrics_counter(m, "many", "M.", (pie_metric_label[]){{"i", v}}, 1, &st), "%s",
            st.msg);
    }
    reg_fails(m, pie_metrics_counter(m, "many", "M.", (pie_metric_label[]){{"i", "x"}}, 1, &st),
              &st, PIE_RESOURCE_EXHAUSTED, "metric 'many' already has 1024 label sets");
    cr_assert_not_null(pie_metrics_counter(m, "many", "M.", (pie_metric_label[]){{"i", "7"}}, 1,
                                           &st),
                       "existing series are still found");
    pie_metrics_destroy(m);
}

Test(metrics, null_handles_are_no_ops) {
    pie_counter_add(NULL, 1);
    pie_gauge_set(NULL, 1);
    pie_gauge_add(NULL, 1);
    pie_histogram_observe(NULL, 1);
    cr_assert_eq(pie_counter_value(NULL), 0);
    cr_assert_eq(pie_histogram_count(NULL), 0);
    pie_metrics_destroy(NULL);
}

static void set_from_collector(void *arg) { pie_gauge_set(arg, 42); }

Test(metrics, collectors_run_before_each_render) {
    pie_metrics *m = pie_metrics_create();
    pie_status st;
    pie_gauge *g = pie_metrics_gauge(m, "sampled", "Sampled at scrape.", NULL, 0, &st);
    cr_assert_eq(pie_metrics_add_collector(m, set_from_collector, g, &st), PIE_OK);
    ASSERT_RENDER(m, "# HELP sampled Sampled at scrape.\n# TYPE sampled gauge\nsampled 42\n");
    pie_metrics_destroy(m);
}

Test(metrics, format_double_is_shortest_round_trip) {
    static const struct {
        double v;
        const char *text;
    } cases[] = {{0, "0"},         {-0.5, "-0.5"},  {0.1, "0.1"},
                 {100, "100"},     {1e21, "1e+21"}, {1.0 / 3, "0.3333333333333333"},
                 {123456789, "123456789"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char buf[40];
        pie_metrics_format_double(buf, sizeof buf, cases[i].v);
        cr_assert_str_eq(buf, cases[i].text);
    }
}

/* Updates race with each other and with rendering; totals must be exact. */
typedef struct hammer {
    pie_metrics *m;
    pie_counter *c;
    pie_gauge *g;
    pie_histogram *h;
} hammer;

#define HAMMER_THREADS 4
#define HAMMER_ITERS 50000

static void *hammer_main(void *arg) {
    hammer *x = arg;
    for (int i = 0; i < HAMMER_ITERS; i++) {
        pie_counter_add(x->c, 1);
        pie_gauge_add(x->g, 1);
        pie_histogram_observe(x->h, (double)(i % 4));
    }
    return NULL;
}

static void *render_main(void *arg) {
    hammer *x = arg;
    for (int i = 0; i < 50; i++) {
        char *out;
        size_t len;
        if (pie_metrics_render(x->m, &out, &len) != PIE_OK) return (void *)1;
        free(out);
    }
    return NULL;
}

Test(metrics, concurrent_updates_are_exact) {
    pie_status st;
    const double bounds[] = {0.5, 1.5, 2.5};
    hammer x = {.m = pie_metrics_create()};
    x.c = pie_metrics_counter(x.m, "n_total", "N.", NULL, 0, &st);
    x.g = pie_metrics_gauge(x.m, "g", "G.", NULL, 0, &st);
    x.h = pie_metrics_histogram(x.m, "h", "H.", bounds, 3, NULL, 0, &st);
    cr_assert(x.c && x.g && x.h);
    pthread_t t[HAMMER_THREADS + 1];
    for (int i = 0; i < HAMMER_THREADS; i++)
        cr_assert_eq(pthread_create(&t[i], NULL, hammer_main, &x), 0);
    cr_assert_eq(pthread_create(&t[HAMMER_THREADS], NULL, render_main, &x), 0);
    for (int i = 0; i <= HAMMER_THREADS; i++) {
        void *ret;
        cr_assert_eq(pthread_join(t[i], &ret), 0);
        cr_assert_null(ret);
    }
    const uint64_t n = (uint64_t)HAMMER_THREADS * HAMMER_ITERS;
    cr_assert_eq(pie_counter_value(x.c), n);
    cr_assert_float_eq(pie_gauge_value(x.g), (double)n, 0);
    cr_assert_eq(pie_histogram_count(x.h), n);
    cr_assert_float_eq(pie_histogram_sum(x.h), 1.5 * (double)n, 0);
    char *out = render(x.m);
    cr_assert_not_null(strstr(out, "h_bucket{le=\"0.5\"} 50000\n"), "%s", out);
    cr_assert_not_null(strstr(out, "h_bucket{le=\"2.5\"} 150000\n"), "%s", out);
    cr_assert_not_null(strstr(out, "h_count 200000\n"), "%s", out);
    free(out);
    pie_metrics_destroy(x.m);
}

/* ---- httpd over loopback -------------------------------------------------------------------- */

static int dial(uint16_t port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    cr_assert_geq(fd, 0, "socket: %s", strerror(errno));
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0, "connect: %s", strerror(errno));
    struct timeval tv = {.tv_sec = 10};
    cr_assert_eq(setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv), 0);
    int one = 1;
    cr_assert_eq(setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one), 0);
    return fd;
}

static void send_all(int fd, const char *s, size_t len) {
    while (len) {
        ssize_t w = send(fd, s, len, MSG_NOSIGNAL);
        cr_assert_gt(w, 0, "send: %s", strerror(errno));
        s += w;
        len -= (size_t)w;
    }
}

/* Everything until the server closes; NUL-terminated, malloc'd. */
static char *read_all(int fd) {
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    cr_assert_not_null(buf);
    for (;;) {
        if (len + 1 == cap) {
            cap *= 2;
            buf = realloc(buf, cap);
            cr_assert_not_null(buf);
        }
        ssize_t r = recv(fd, buf + len, cap - 1 - len, 0);
        cr_assert_geq(r, 0, "recv: %s", strerror(errno));
        if (r == 0) break;
        len += (size_t)r;
    }
    buf[len] = '\0';
    return buf;
}

static char *request(uint16_t port, const char *req) {
    int fd = dial(port);
    send_all(fd, req, strlen(req));
    char *resp = read_all(fd);
    close(fd);
    return resp;
}

static pie_httpd *serve(pie_metrics *m, pie_httpd_options o) {
    pie_status st;
    pie_httpd *h;
    o.metrics = m;
    cr_assert_eq(pie_httpd_start(&o, &h, &st), PIE_OK, "%s", st.msg);
    cr_assert_neq(pie_httpd_port(h), 0);
    return h;
}

static pie_metrics *sample_registry(void) {
    pie_metrics *m = pie_metrics_create();
    pie_status st;
    pie_counter *c = pie_metrics_counter(m, "pie_up_total", "Up.", NULL, 0, &st);
    cr_assert_not_null(c);
    pie_counter_add(c, 9);
    return m;
}

#define SAMPLE_BODY "# HELP pie_up_total Up.\n# TYPE pie_up_total counter\npie_up_total 9\n"

static void assert_response(const char *got, const char *want) {
    cr_assert_str_eq(got, want, "response\n--- got ---\n%s\n--- want ---\n%s", got, want);
}

static const char *text_404 = "HTTP/1.1 404 Not Found\r\n"
                              "Content-Type: text/plain; charset=utf-8\r\n"
                              "Content-Length: 10\r\n"
                              "Connection: close\r\n"
                              "\r\n"
                              "not found\n";

Test(httpd, metrics_over_loopback) {
    pie_metrics *m = sample_registry();
    pie_httpd *h = serve(m, (pie_httpd_options){0});
    char *r = request(pie_httpd_port(h), "GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n");
    char want[512];
    snprintf(want, sizeof want,
             "HTTP/1.1 200 OK\r\n"
             "Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
             "Content-Length: %zu\r\n"
             "Connection: close\r\n"
             "\r\n%s",
             strlen(SAMPLE_BODY), SAMPLE_BODY);
    assert_response(r, want);
    free(r);
    r = request(pie_httpd_port(h), "GET /metrics?name[]=x HTTP/1.0\n\n");
    assert_response(r, want);
    free(r);
    r = request(pie_httpd_port(h), "GET http://example:80/metrics HTTP/1.1\r\n\r\n");
    assert_response(r, want);
    free(r);
    pie_httpd_stop(h);
    pie_metrics_destroy(m);
}

Test(httpd, head_has_headers_only) {
    pie_metrics *m = sample_registry();
    pie_httpd *h = serve(m, (pie_httpd_options){0});
    char *r = request(pie_httpd_port(h), "HEAD /metrics HTTP/1.1\r\n\r\n");
    char want[512];
    snprintf(want, sizeof want,
             "HTTP/1.1 200 OK\r\n"
             "Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
             "Content-Length: %zu\r\n"
             "Connection: close\r\n"
             "\r\n",
             strlen(SAMPLE_BODY));
    assert_response(r, want);
    free(r);
    pie_httpd_stop(h);
    pie_metrics_destroy(m);
}

Test(httpd, healthz_and_not_found) {
    pie_httpd *h = serve(NULL, (pie_httpd_options){0});
    char *r = request(pie_httpd_port(h), "GET /healthz HTTP/1.1\r\n\r\n");
    assert_response(r, "HTTP/1.1 200 OK\r\n"
                       "Content-Type: text/plain; charset=utf-8\r\n"
                       "Content-Length: 2\r\n"
                       "Connection: close\r\n"
                       "\r\n"
                       "ok");
    free(r);
    r = request(pie_httpd_port(h), "GET /nope HTTP/1.1\r\n\r\n");
    assert_response(r, text_404);
    free(r);
    r = request(pie_httpd_port(h), "GET /metrics HTTP/1.1\r\n\r\n"); /* no registry */
    assert_response(r, text_404);
    free(r);
    r = request(pie_httpd_port(h), "GET /metricsx HTTP/1.1\r\n\r\n");
    assert_response(r, text_404);
    free(r);
    pie_httpd_stop(h);
}

static int draining(void *arg, char *reason, size_t n) {
    (void)arg;
    snprintf(reason, n, "draining");
    return 1;
}

Test(httpd, unhealthy_is_503_with_the_reason) {
    pie_httpd *h = serve(NULL, (pie_httpd_options){.health = draining});
    char *r = request(pie_httpd_port(h), "GET /healthz HTTP/1.1\r\n\r\n");
    assert_response(r, "HTTP/1.1 503 Service Unavailable\r\n"
                       "Content-Type: text/plain; charset=utf-8\r\n"
                       "Content-Length: 9\r\n"
                       "Connection: close\r\n"
                       "\r\n"
                       "draining\n");
    free(r);
    pie_httpd_stop(h);
}

Test(httpd, other_methods_are_405_even_with_a_body) {
    pie_httpd *h = serve(NULL, (pie_httpd_options){0});
    char *r = request(pie_httpd_port(h),
                      "POST /metrics HTTP/1.1\r\nContent-Length: 11\r\n\r\nhello world");
    assert_response(r, "HTTP/1.1 405 Method Not Allowed\r\n"
                       "Content-Type: text/plain; charset=utf-8\r\n"
                       "Content-Length: 19\r\n"
                       "Connection: close\r\n"
                       "Allow: GET, HEAD\r\n"
                       "\r\n"
                       "method not allowed\n");
    free(r);
    pie_httpd_stop(h);
}

Test(httpd, malformed_requests) {
    pie_httpd *h = serve(NULL, (pie_httpd_options){0});
    const char *bad400 = "HTTP/1.1 400 Bad Request\r\n"
                         "Content-Type: text/plain; charset=utf-8\r\n"
                         "Content-Length: 12\r\n"
                         "Connection: close\r\n"
                         "\r\n"
                         "bad request\n";
    const char *bad[] = {"GARBAGE\r\n\r\n", "GET /metrics\r\n\r\n", "get /metrics HTTP/1.1\r\n\r\n",
                         "GET  /metrics HTTP/1.1\r\n\r\n", "GET /metrics HTTP/1.1x\r\n\r\n",
                         "\r\n\r\n"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *r = request(pie_httpd_port(h), bad[i]);
        cr_assert_str_eq(r, bad400, "request %zu got:\n%s", i, r);
        free(r);
    }
    char *r = request(pie_httpd_port(h), "GET /metrics HTTP/2.0\r\n\r\n");
    assert_response(r, "HTTP/1.1 505 HTTP Version Not Supported\r\n"
                       "Content-Type: text/plain; charset=utf-8\r\n"
                       "Content-Length: 27\r\n"
                       "Connection: close\r\n"
                       "\r\n"
                       "http version not supported\n");
    free(r);
    pie_httpd_stop(h);
}

static void pause_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

Test(httpd, request_arriving_one_byte_at_a_time) {
    pie_httpd *h = serve(NULL, (pie_httpd_options){0});
    int fd = dial(pie_httpd_port(h));
    const char *req = "GET /healthz HTTP/1.1\r\nUser-Agent: slow\r\n\r\n";
    for (size_t i = 0; req[i]; i++) {
        send_all(fd, req + i, 1);
        if (i % 8 == 0) pause_ms(2);
    }
    char *r = read_all(fd);
    close(fd);
    cr_assert(strncmp(r, "HTTP/1.1 200 OK\r\n", 17) == 0, "%s", r);
    free(r);
    pie_httpd_stop(h);
}

Test(httpd, many_clients_at_once) {
    enum { N = 16 };
    pie_metrics *m = sample_registry();
    pie_httpd *h = serve(m, (pie_httpd_options){0});
    int fds[N];
    const char *head = "GET /metrics HT";
    const char *tail = "TP/1.1\r\nHost: x\r\n\r\n";
    for (int i = 0; i < N; i++) {
        fds[i] = dial(pie_httpd_port(h));
        send_all(fds[i], head, strlen(head));
    }
    pause_ms(20);
    for (int i = N - 1; i >= 0; i--) send_all(fds[i], tail, strlen(tail)); /* finish in reverse */
    for (int i = 0; i < N; i++) {
        char *r = read_all(fds[i]);
        close(fds[i]);
        cr_assert(strncmp(r, "HTTP/1.1 200 OK\r\n", 17) == 0, "client %d: %s", i, r);
        cr_assert_not_null(strstr(r, "\r\n\r\n" SAMPLE_BODY), "client %d: %s", i, r);
        free(r);
    }
    pie_httpd_stop(h);
    pie_metrics_destroy(m);
}

Test(httpd, large_metrics_body_is_sent_whole) {
    pie_metrics *m = pie_metrics_create();
    pie_status st;
    char v[16];
    for (int i = 0; i < 1000; i++) {
        snprintf(v, sizeof v, "%d", i);
        pie_counter *c = pie_metrics_counter(
            m, "wide_total", "A family with many series to make a body of tens of kilobytes.",
            (pie_metric_label[]){{"instance", v}, {"queue", "default"}}, 2, &st);
        cr_assert_not_null(c, "%s", st.msg);
        pie_counter_add(c, (uint64_t)i);
    }
    char *body = render(m);
    pie_httpd *h = serve(m, (pie_httpd_options){0});
    int fd = dial(pie_httpd_port(h));
    send_all(fd, "GET /metrics HTTP/1.1\r\n\r\n", 25);
    pause_ms(50); /* let the server fill the socket buffer before we read */
    char *r = read_all(fd);
    close(fd);
    char *got_body = strstr(r, "\r\n\r\n");
    cr_assert_not_null(got_body);
    cr_assert_str_eq(got_body + 4, body, "body differs (%zu vs %zu bytes)", strlen(got_body + 4),
                     strlen(body));
    free(r);
    free(body);
    pie_httpd_stop(h);
    pie_metrics_destroy(m);
}

Test(httpd, oversized_request_is_431) {
    pie_httpd *h = serve(NULL, (pie_httpd_options){.max_request_bytes = 256});
    int fd = dial(pie_httpd_port(h));
    char big[1024];
    memset(big, 'a', sizeof big);
    memcpy(big, "GET /metrics HTTP/1.1\r\nX-Pad: ", 30);
    send_all(fd, big, sizeof big); /* never ends the head */
    char *r = read_all(fd);
    close(fd);
    assert_response(r, "HTTP/1.1 431 Request Header Fields Too Large\r\n"
                       "Content-Type: text/plain; charset=utf-8\r\n"
                       "Content-Length: 32\r\n"
                       "Connection: close\r\n"
                       "\r\n"
                       "request header fields too large\n");
    free(r);
    pie_httpd_stop(h);
}

Test(httpd, silent_client_gets_408) {
    pie_httpd *h = serve(NULL, (pie_httpd_options){.timeout_ms = 100});
    int fd = dial(pie_httpd_port(h));
    send_all(fd, "GET /he", 7);
    char *r = read_all(fd);
    close(fd);
    assert_response(r, "HTTP/1.1 408 Request Timeout\r\n"
                       "Content-Type: text/plain; charset=utf-8\r\n"
                       "Content-Length: 16\r\n"
                       "Connection: close\r\n"
                       "\r\n"
                       "request timeout\n");
    free(r);
    pie_httpd_stop(h);
}

Test(httpd, clients_beyond_the_limit_wait_their_turn) {
    pie_httpd *h = serve(NULL, (pie_httpd_options){.max_clients = 2});
    int idle1 = dial(pie_httpd_port(h)), idle2 = dial(pie_httpd_port(h));
    pause_ms(20);
    int fd = dial(pie_httpd_port(h)); /* sits in the backlog */
    send_all(fd, "GET /healthz HTTP/1.1\r\n\r\n", 25);
    struct pollfd p = {.fd = fd, .events = POLLIN};
    cr_assert_eq(poll(&p, 1, 100), 0, "served although both slots are taken");
    close(idle1);
    char *r = read_all(fd);
    cr_assert(strncmp(r, "HTTP/1.1 200 OK\r\n", 17) == 0, "%s", r);
    free(r);
    close(fd);
    close(idle2);
    pie_httpd_stop(h);
}

Test(httpd, stop_closes_open_connections) {
    pie_httpd *h = serve(NULL, (pie_httpd_options){0});
    int fd = dial(pie_httpd_port(h));
    send_all(fd, "GET /", 5);
    pause_ms(20);
    pie_httpd_stop(h);
    /* EOF if the server had accepted us, a reset if we were still in the backlog: either way
     * no bytes and no hang. */
    char buf[64];
    ssize_t r = recv(fd, buf, sizeof buf, 0);
    cr_assert(r == 0 || (r < 0 && errno == ECONNRESET), "recv returned %zd (%s)", r,
              r < 0 ? strerror(errno) : "data");
    close(fd);
}

Test(httpd, port_in_use_is_unavailable) {
    pie_httpd *a = serve(NULL, (pie_httpd_options){0});
    pie_httpd *b = NULL;
    pie_status st;
    pie_httpd_options o = {.port = pie_httpd_port(a)};
    cr_assert_eq(pie_httpd_start(&o, &b, &st), PIE_UNAVAILABLE);
    cr_assert_null(b);
    char want[128];
    snprintf(want, sizeof want, "httpd: cannot listen on 127.0.0.1:%u: Address already in use",
             (unsigned)pie_httpd_port(a));
    cr_assert_str_eq(st.msg, want, "%s", st.msg);
    pie_httpd_stop(a);
}

Test(httpd, any_address_and_bad_options) {
    pie_httpd *h = serve(NULL, (pie_httpd_options){.host = "0.0.0.0"});
    char *r = request(pie_httpd_port(h), "GET /healthz HTTP/1.1\r\n\r\n");
    cr_assert(strncmp(r, "HTTP/1.1 200 OK\r\n", 17) == 0, "%s", r);
    free(r);
    pie_httpd_stop(h);
    pie_status st;
    pie_httpd_options o = {.max_request_bytes = 4};
    cr_assert_eq(pie_httpd_start(&o, &h, &st), PIE_INVALID_ARGUMENT);
    cr_assert_str_eq(st.msg, "httpd: max_request_bytes 4 is too small (at least 16)");
    cr_assert_null(h);
    o = (pie_httpd_options){.host = "not an address"};
    cr_assert_eq(pie_httpd_start(&o, &h, &st), PIE_INVALID_ARGUMENT);
    cr_assert(strncmp(st.msg, "httpd: cannot resolve 'not an address': ", 40) == 0, "%s", st.msg);
}
