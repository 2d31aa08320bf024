/* test_lc_host.c — the `pie` host API (services/lifecycle/lc_host*.c) end to end: inferlets
 * (tests/wasm/lc_host_abi.c, raw ABI) run in this process on lc_wasm, with an lc_session and an
 * lc_host connected to a real pie-controller and a real CPU pie-worker (tiny-f32) on loopback.
 *
 * Covers: greedy generation through embed_text/forward/next_dist gives, at every step, the
 * top-k distribution of a fresh forward of the whole context (tests/support/pie_testref.h:
 * tiny-f32's greedy tokens repeat the last token whatever came before, its probabilities do
 * not); tokenize/detokenize/token_bytes round trip against the tokenizer loaded here; futures
 * (poll, wait with timeout, wait_any, result with a short buffer then retry, drop, end of
 * input); a deferred error delivered by synchronize exactly once; invalid arguments return the
 * right code and message; an out-of-bounds pointer traps naming the function; an oversize send
 * is refused; HTTP to an allowed URL (a local test server) and a refused one; broadcast and
 * subscribe between two instances; an instance terminated for contention reaches
 * cb->terminated, and so does every instance when the Session is lost. The times of these calls
 * are measured by bench/lifecycle/bench_lifecycle.c, not here. */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "lc_host.h"
#include "lc_session.h"
#include "lc_wasm.h"
#include "pie_abi.h"
#include "pie_log.h"
#include "pie_proc.h"
#include "pie_testref.h"
#include "pie_testutil.h"
#include "svc.h"
#include "tok.h"

#define START_MS 30000
#define STOP_MS  20000
#define WAIT_MS  60000
#define MODEL    "tiny-f32"

TestSuite(lc_host, .fini = pie_test_leak_check, .timeout = 300);

/* ---- the cluster: controller + worker processes, session + host + runtime in this process ---- */

typedef struct cluster {
    pie_proc *ctl, *wrk;
    svc_config svc_cfg; /* svc keeps a pointer to it */
    svc *sv;
    lc_session *session;
    lc_host *host;
    lc_wasm_rt *rt;
    lc_wasm_module *mod;
    char *cache;
    uint64_t next_id;
} cluster;

static pie_proc *start_worker(const pie_proc *ctl, unsigned kv_pages) {
    static char ctl_env[96], pages_env[64];
    pie_proc_env_controller(ctl, ctl_env, sizeof ctl_env);
    snprintf(pages_env, sizeof pages_env, "PIE_POOL_KV_PAGES=%u", kv_pages);
    const char *env[] = {ctl_env,
                         pages_env,
                         "PIE_BACKEND=cpu",
                         "PIE_WORKER_GROUP_ID=w1",
                         "PIE_MODEL_PATH=" PIE_MODELS_DIR "/" MODEL,
                         "PIE_ENGINE_THREADS=1",
                         "PIE_POOL_EMBED_SLOTS=512",
                         NULL};
    pie_proc_opts o = {.env = env};
    pie_status st;
    pie_proc *p = pie_proc_start("pie-worker", &o, START_MS, &st);
    cr_assert(p, "%s", st.msg);
    return p;
}

static void *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    cr_assert(f, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    void *b = malloc((size_t)n);
    cr_assert(b && fread(b, 1, (size_t)n, f) == (size_t)n);
    fclose(f);
    *len = (size_t)n;
    return b;
}

static void cluster_start(cluster *c, unsigned kv_pages, const char *http_allow) {
    memset(c, 0, sizeof *c);
    pie_status st;
    c->ctl = pie_proc_start("pie-controller", NULL, START_MS, &st);
    cr_assert(c->ctl, "%s", st.msg);
    c->wrk = start_worker(c->ctl, kv_pages);
    c->svc_cfg = (svc_config){.listen = "127.0.0.1:0",
                     .threads = 1,
                     .max_message_bytes = 64u << 20,
                     .auth_token = "",
                     .auth_token_file = "",
                     .metrics_listen = "",
                     .log_level = PIE_LOG_WARN};
    c->sv = svc_create("lifecycle", &c->svc_cfg, &st);
    cr_assert(c->sv, "%s", st.msg);
    lc_session_config lsc = {.replica_id = "test-lc-host", .advertise = ""};
    c->session = lc_session_create(&lsc, svc_metrics(c->sv), &st);
    cr_assert(c->session, "%s", st.msg);
    size_t nm;
    const rpc_method *m = lc_session_methods(c->session, &nm);
    cr_assert_eq(svc_serve(c->sv, m, nm, &st), PIE_OK, "%s", st.msg);
    lc_host_config hc = {.tokenizer_path = PIE_MODELS_DIR,
                         .http_allow = http_allow,
                         .http_timeout_ms = 5000,
                         .http_max_bytes = 4096};
    c->host = lc_host_create(&hc, c->session, svc_metrics(c->sv), &st);
    cr_assert(c->host, "%s", st.msg);
    char addr[64];
    snprintf(addr, sizeof addr, "%s", pie_proc_addr(c->ctl));
    svc_dial_config dc = {.address = addr, .reconnect_initial_ms = 50, .reconnect_max_ms = 200};
    cr_assert_eq(lc_session_start(c->session, c->sv, &dc, &st), PIE_OK, "%s", st.msg);
    int64_t deadline = pie_test_now_ms() + WAIT_MS;
    char model[130];
    while (lc_session_epoch(c->session) == 0 || lc_session_replica_index(c->session) == 0 ||
           lc_session_resolve_model(c->session, MODEL, model, sizeof model, NULL) != PIE_OK) {
        cr_assert(pie_test_now_ms() < deadline, "the session did not connect and learn %s", MODEL);
        pie_test_sleep_ms(20);
    }
    c->cache = pie_proc_tmpdir(&st);
    cr_assert(c->cache, "%s", st.msg);
    size_t n_fns;
    const lc_wasm_host_fn *fns = lc_host_fns(&n_fns);
    lc_wasm_rt_opts ro = {.cache_dir = c->cache, .host_fns = fns, .n_host_fns = n_fns};
    cr_assert_eq(lc_wasm_rt_create(&ro, &c->rt, &st), PIE_OK, "%s", st.msg);
    size_t len;
    void *wasm = read_file(PIE_WASM_FIXTURES "/lc_host_abi.wasm", &len);
    cr_assert_eq(lc_wasm_module_load(c->rt, wasm, len, &c->mod, &st), PIE_OK, "%s", st.msg);
    free(wasm);
}

static void rm_rf(const char *dir) {
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}

static void stop_ok(pie_proc *p) {
    pie_status st;
    int rc = pie_proc_stop(p, STOP_MS, &st);
    cr_assert_eq(rc, 0, "%s exited with %d: %s", pie_proc_name(p), rc, st.msg);
    pie_proc_destroy(p);
}

static void cluster_stop(cluster *c) {
    lc_wasm_module_release(c->mod);
    lc_wasm_rt_destroy(c->rt);
    svc_drain(c->sv);
    lc_session_destroy(c->session); /* stops the Session thread: no callback into the host after */
    lc_host_destroy(c->host);
    svc_stop(c->sv);
    rm_rf(c->cache);
    free(c->cache);
    stop_ok(c->wrk);
    if (c->ctl) stop_ok(c->ctl);
}

/* ---- one instance on its own thread ------------------------------------------------------------ */

typedef struct run {
    cluster *c;
    const char *argv[8];
    size_t argc;
    uint64_t message_bytes;
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    char *msgs[64]; /* what the inferlet sent */
    size_t n_msgs;
    bool done;
    lc_wasm_outcome out;
    lc_host_inst *hi;
    lc_wasm_instance *inst;
    pie_code term_code;
    char term_msg[256];
    bool terminated;
} run;

static void on_send(void *ctx, const void *msg, size_t len) {
    run *r = ctx;
    pthread_mutex_lock(&r->mu);
    if (r->n_msgs < 64) r->msgs[r->n_msgs++] = strndup(msg, len);
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

static void on_terminated(void *ctx, pie_code code, const char *msg) {
    run *r = ctx;
    pthread_mutex_lock(&r->mu);
    r->terminated = true;
    r->term_code = code;
    snprintf(r->term_msg, sizeof r->term_msg, "%s", msg);
    lc_wasm_instance *inst = r->inst;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    if (inst) lc_wasm_instance_interrupt(inst); /* what the instance manager does */
}

static void *run_main(void *arg) {
    run *r = arg;
    cluster *c = r->c;
    pie_status st;
    Pie__V1__ResourceLimits lim = PIE__V1__RESOURCE_LIMITS__INIT;
    lim.memory_bytes = 64u << 20;
    lim.kv_pages = 64;
    lim.embeddings = 256;
    lim.queues = 8;
    lim.message_bytes = r->message_bytes ? r->message_bytes : 4096;
    lim.cpu_ms = 60000;
    lim.wall_ms = 120000;
    lc_host_inst_cb cb = {.ctx = r, .send = on_send, .terminated = on_terminated};
    uint64_t id = ((uint64_t)lc_session_replica_index(c->session) << 48) |
                  __atomic_add_fetch(&c->next_id, 1, __ATOMIC_SEQ_CST);
    lc_host_inst *hi = lc_host_inst_begin(c->host, id, "lc_host_abi", MODEL, &lim, NULL, &cb,
                                          &st);
    cr_assert(hi, "%s", st.msg);
    lc_wasm_instance_opts o = {.argv = r->argv,
                               .argc = r->argc,
                               .limits = {.wall_ms = 120000},
                               .host = hi,
                               .on_interrupt = lc_host_inst_wake};
    lc_wasm_instance *inst;
    cr_assert_eq(lc_wasm_instance_create(c->mod, &o, &inst, &st), PIE_OK, "%s", st.msg);
    pthread_mutex_lock(&r->mu);
    r->hi = hi;
    r->inst = inst;
    bool term = r->terminated;
    pthread_mutex_unlock(&r->mu);
    if (term) lc_wasm_instance_interrupt(inst);
    cr_assert_eq(lc_wasm_instance_run(inst, &r->out, &st), PIE_OK, "%s", st.msg);
    lc_host_inst_end(hi, r->out.end == LC_WASM_EXITED && r->out.exit_code == 0 ? PIE_OK : PIE_ABORTED,
                     r->out.message);
    pthread_mutex_lock(&r->mu);
    r->inst = NULL;
    r->done = true;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    lc_wasm_instance_free(inst);
    return NULL;
}

static run *run_start5(cluster *c, uint64_t message_bytes, const char *a0, const char *a1,
                       const char *a2, const char *a3) {
    run *r = calloc(1, sizeof *r);
    cr_assert(r);
    r->c = c;
    r->message_bytes = message_bytes;
    const char *v[] = {"lc_host_abi", a0, a1, a2, a3};
    for (size_t i = 0; i < 5 && v[i]; i++) r->argv[r->argc++] = v[i];
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    pthread_attr_t attr;
    cr_assert_eq(lc_wasm_thread_attr_init(&attr, 0), 0);
    cr_assert_eq(pthread_create(&r->th, &attr, run_main, r), 0);
    pthread_attr_destroy(&attr);
    return r;
}

#define run_start(c, mb, a0, a1, a2) run_start5(c, mb, a0, a1, a2, NULL)

/* Waits until the inferlet sent a message starting with prefix; returns it (owned by r). */
static const char *run_wait_msg(run *r, const char *prefix) {
    int64_t deadline = pie_test_now_ms() + WAIT_MS;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        for (size_t i = 0; i < r->n_msgs; i++)
            if (strncmp(r->msgs[i], prefix, strlen(prefix)) == 0) {
                pthread_mutex_unlock(&r->mu);
                return r->msgs[i];
            }
        if (r->done || pie_test_now_ms() > deadline) break;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 20000000;
        if (ts.tv_nsec >= 1000000000) ts.tv_sec++, ts.tv_nsec -= 1000000000;
        pthread_cond_timedwait(&r->cv, &r->mu, &ts);
    }
    pthread_mutex_unlock(&r->mu);
    /* One last look: the message may have come with the end. */
    for (size_t i = 0; i < r->n_msgs; i++)
        if (strncmp(r->msgs[i], prefix, strlen(prefix)) == 0) return r->msgs[i];
    cr_assert_fail("no message \"%s...\" from the inferlet (%s; %zu messages, first: %s)", prefix,
                   r->done ? r->out.message : "still running", r->n_msgs,
                   r->n_msgs ? r->msgs[0] : "-");
    return NULL;
}

/* The value after "name=" of a report ("name=code|last_error"). */
static const char *val(run *r, const char *name) {
    char prefix[64];
    snprintf(prefix, sizeof prefix, "%s=", name);
    return run_wait_msg(r, prefix) + strlen(prefix);
}

static void expect(run *r, const char *name, int code, const char *err_part) {
    const char *v = val(r, name);
    cr_assert_eq(atoi(v), code, "%s: got %s, wanted code %d", name, v, code);
    if (err_part) cr_assert(strstr(v, err_part), "%s: \"%s\" does not mention \"%s\"", name, v, err_part);
}

static void run_message(run *r, const char *m) {
    pthread_mutex_lock(&r->mu);
    lc_host_inst *hi = r->hi;
    pthread_mutex_unlock(&r->mu);
    cr_assert(hi);
    pie_status st;
    cr_assert_eq(lc_host_inst_message(hi, m, strlen(m), &st), PIE_OK, "%s", st.msg);
}

/* Joins the instance thread, frees its host state and returns its outcome. */
static lc_wasm_outcome run_join(run *r) {
    cr_assert_eq(pthread_join(r->th, NULL), 0);
    lc_host_inst_free(r->hi);
    lc_wasm_outcome o = r->out;
    for (size_t i = 0; i < r->n_msgs; i++) free(r->msgs[i]);
    pthread_cond_destroy(&r->cv);
    pthread_mutex_destroy(&r->mu);
    free(r);
    return o;
}

static void join_exited_0(run *r) {
    lc_wasm_outcome o = run_join(r);
    cr_assert_eq(o.end, LC_WASM_EXITED, "the inferlet did not exit: %s", o.message);
    cr_assert_eq(o.exit_code, 0, "%s", o.message);
}

/* ---- the inferlet's distributions ----------------------------------------------------------- */

/* Parses "id:p,id:p,...;id:p,..." (lc_host_abi's "dists=") into out[0..); returns the steps. */
static size_t parse_dists(const char *s, pie_testref_dist *out, size_t cap) {
    size_t n = 0;
    while (*s) {
        cr_assert_lt(n, cap, "more than %zu distributions", cap);
        pie_testref_dist *d = &out[n++];
        d->k = 0;
        for (;;) {
            char *end;
            cr_assert_lt(d->k, PIE_TESTREF_MAX_K, "distribution %zu is too long", n - 1);
            d->ids[d->k] = (uint32_t)strtoul(s, &end, 10);
            cr_assert_eq(*end, ':', "distribution %zu: \"%s\"", n - 1, s);
            d->probs[d->k++] = strtof(end + 1, &end);
            s = end;
            if (*s != ',') break;
            s++;
        }
        cr_assert(*s == ';' || *s == '\0', "distribution %zu: \"%s\"", n - 1, s);
        if (*s == ';') s++;
    }
    return n;
}

/* ---- a tiny HTTP server ---------------------------------------------------------------------------- */

typedef struct httpd {
    int fd, port;
    atomic_bool stop;
    pthread_t th;
} httpd;

static void *httpd_main(void *arg) {
    httpd *h = arg;
    while (!atomic_load(&h->stop)) {
        struct pollfd p = {.fd = h->fd, .events = POLLIN};
        if (poll(&p, 1, 50) <= 0) continue;
        int c = accept(h->fd, NULL, NULL);
        if (c < 0) continue;
        char req[4096];
        size_t n = 0;
        while (n < sizeof req - 1 && !memmem(req, n, "\r\n\r\n", 4)) {
            ssize_t k = read(c, req + n, sizeof req - 1 - n);
            if (k <= 0) break;
            n += (size_t)k;
        }
        req[n] = '\0';
        char resp[8192];
        int len;
        if (strncmp(req, "GET /ok ", 8) == 0 && strstr(req, "X-Test: 1")) {
            len = snprintf(resp, sizeof resp,
                           "HTTP/1.1 200 OK\r\nContent-Length: 15\r\nConnection: close\r\n\r\n"
                           "hello from http");
        } else if (strncmp(req, "GET /big ", 9) == 0) {
            len = snprintf(resp, sizeof resp,
                           "HTTP/1.1 200 OK\r\nContent-Length: 6000\r\nConnection: close\r\n\r\n");
            memset(resp + len, 'x', 6000);
            len += 6000;
        } else {
            len = snprintf(resp, sizeof resp,
                           "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        }
        for (int off = 0; off < len;) {
            ssize_t k = write(c, resp + off, (size_t)(len - off));
            if (k <= 0) break;
            off += (int)k;
        }
        close(c);
    }
    return NULL;
}

static void httpd_start(httpd *h) {
    h->fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert(h->fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    cr_assert_eq(bind(h->fd, (struct sockaddr *)&a, sizeof a), 0);
    cr_assert_eq(listen(h->fd, 16), 0);
    socklen_t al = sizeof a;
    cr_assert_eq(getsockname(h->fd, (struct sockaddr *)&a, &al), 0);
    h->port = ntohs(a.sin_port);
    atomic_init(&h->stop, false);
    cr_assert_eq(pthread_create(&h->th, NULL, httpd_main, h), 0);
}

static void httpd_stop(httpd *h) {
    atomic_store(&h->stop, true);
    pthread_join(h->th, NULL);
    close(h->fd);
}

/* ---- tests ------------------------------------------------------------------------------------------ */

Test(lc_host, greedy_generation_through_the_abi_has_the_reference_distributions) {
    cluster c;
    cluster_start(&c, 256, "");
    const uint32_t prompt[] = {17, 300, 41, 7, 99, 250, 3, 12, 480, 77, 5, 6, 150, 200, 33, 44, 8, 9};
    const size_t n_prompt = sizeof prompt / sizeof prompt[0], n_new = 12;
    char csv[256] = "", nnew[8];
    for (size_t i = 0; i < n_prompt; i++)
        snprintf(csv + strlen(csv), sizeof csv - strlen(csv), "%s%u", i ? "," : "", prompt[i]);
    snprintf(nnew, sizeof nnew, "%zu", n_new);
    run *r = run_start(&c, 1 << 16, "greedy", nnew, csv);
    const char *got = val(r, "tokens");
    uint32_t gen[64];
    size_t n_gen = 0;
    for (const char *p = got; *p; n_gen++) {
        char *end;
        cr_assert_lt(n_gen, 64);
        gen[n_gen] = (uint32_t)strtoul(p, &end, 10);
        p = *end == ',' ? end + 1 : end;
    }
    cr_assert_eq(n_gen, n_new, "tokens=%s", got);
    pie_testref_dist dists[64];
    cr_assert_eq(parse_dists(val(r, "dists"), dists, 64), n_new);
    for (size_t i = 0; i < n_new; i++)
        cr_assert_eq(gen[i], dists[i].ids[0], "token %zu is not its distribution's most likely", i);
    pie_testref *ref = pie_testref_open(PIE_MODELS_DIR "/" MODEL);
    pie_testref_expect_gen(ref, "through the host API", prompt, n_prompt, gen, dists, n_new);
    pie_testref_close(ref);
    join_exited_0(r);
    cluster_stop(&c);
}

Test(lc_host, tokenize_and_detokenize_round_trip_in_process) {
    cluster c;
    cluster_start(&c, 64, "");
    const char *text = "Hello world, tokenizers split text.";
    run *r = run_start(&c, 0, "tokenize", text, NULL);
    tok *t;
    pie_status st;
    cr_assert_eq(tok_load(PIE_MODELS_DIR "/" MODEL "/tokenizer.json", &t, &st), PIE_OK, "%s", st.msg);
    uint32_t *ids;
    size_t n;
    cr_assert_eq(tok_encode(t, text, strlen(text), false, &ids, &n, &st), PIE_OK, "%s", st.msg);
    char want[1024] = "";
    for (size_t i = 0; i < n; i++)
        snprintf(want + strlen(want), sizeof want - strlen(want), "%s%u", i ? "," : "", ids[i]);
    cr_assert_str_eq(val(r, "ids"), want);
    cr_assert_str_eq(val(r, "short"), "1", "a short buffer gets the first ids and the full count");
    cr_assert_str_eq(val(r, "text"), text);
    cr_assert_str_eq(val(r, "detok_needed"), "1");
    size_t bl;
    const uint8_t *b = tok_token_bytes(t, ids[0], &bl);
    char first[64];
    snprintf(first, sizeof first, "%.*s", (int)bl, (const char *)b);
    cr_assert_str_eq(val(r, "first"), first);
    expect(r, "unknown_id", PIE_ABI_E_OUT_OF_RANGE, "2147483647");
    free(ids);
    tok_free(t);
    join_exited_0(r);
    cluster_stop(&c);
}

Test(lc_host, futures_poll_wait_wait_any_short_buffers_and_drop) {
    cluster c;
    cluster_start(&c, 64, "");
    run *r = run_start(&c, 0, "futures", NULL, NULL);
    expect(r, "receive", 0, NULL);
    expect(r, "poll_pending", 0, NULL);
    expect(r, "wait_timeout", 0, NULL);
    expect(r, "busy", PIE_ABI_E_ALREADY_EXISTS, "future 1 is busy");
    expect(r, "wait_any_unarmed", PIE_ABI_E_NOT_FOUND, "future 2 is not armed");
    expect(r, "receive2", 0, NULL);
    expect(r, "wait_any_timeout", PIE_ABI_E_DEADLINE_EXCEEDED, "none of 2 futures");
    val(r, "ready");
    run_message(r, "first message");
    run_message(r, "second");
    expect(r, "wait_any", 0, NULL);
    expect(r, "wait", 1, NULL);
    expect(r, "poll_done", 1, NULL);
    expect(r, "result_short", 13, NULL);
    cr_assert_str_eq(val(r, "short_bytes"), "first");
    expect(r, "result_full", 13, NULL);
    cr_assert_str_eq(val(r, "full_bytes"), "first message");
    expect(r, "poll_released", PIE_ABI_E_NOT_FOUND, "future 1 is not armed");
    expect(r, "wait2", 1, NULL);
    expect(r, "drop", 0, NULL);
    expect(r, "drop_again", PIE_ABI_E_NOT_FOUND, "future 2");
    expect(r, "result_unarmed", PIE_ABI_E_NOT_FOUND, "future 3");
    expect(r, "receive4", 0, NULL);
    val(r, "closing");
    lc_host_inst_close_input(r->hi);
    expect(r, "after_close", PIE_ABI_E_OUT_OF_RANGE, "input closed");
    join_exited_0(r);
    cluster_stop(&c);
}

Test(lc_host, deferred_error_is_delivered_once_by_synchronize) {
    cluster c;
    cluster_start(&c, 64, "");
    run *r = run_start(&c, 0, "deferred", NULL, NULL);
    expect(r, "dealloc", 0, NULL);
    expect(r, "sync_call", 0, NULL);
    expect(r, "sync1", PIE_ABI_E_INVALID_ARGUMENT, "12345");
    expect(r, "sync2", 0, NULL);
    join_exited_0(r);
    cluster_stop(&c);
}

Test(lc_host, invalid_arguments_return_codes_and_messages) {
    cluster c;
    cluster_start(&c, 64, "");
    run *r = run_start(&c, 0, "invalid", NULL, NULL);
    expect(r, "queue0", PIE_ABI_E_INVALID_ARGUMENT, "create_queue: queue id 0 is reserved");
    expect(r, "unknown_model", PIE_ABI_E_NOT_FOUND, "model \"no-such-model\" is not served");
    expect(r, "no_queue", PIE_ABI_E_NOT_FOUND, "alloc_kv_pages: queue 9 does not exist");
    expect(r, "dup_queue", PIE_ABI_E_ALREADY_EXISTS, "queue 1 already exists");
    expect(r, "n0", PIE_ABI_E_INVALID_ARGUMENT, "alloc_kv_pages: ids is empty");
    expect(r, "nan", PIE_ABI_E_INVALID_ARGUMENT, "next_dist: temperature nan");
    expect(r, "negative_temp", PIE_ABI_E_INVALID_ARGUMENT, "temperature -1");
    expect(r, "future0", PIE_ABI_E_INVALID_ARGUMENT, "future id 0 is reserved");
    expect(r, "poll_unknown", PIE_ABI_E_NOT_FOUND, "future 77 is not armed");
    expect(r, "topk", PIE_ABI_E_INVALID_ARGUMENT, "top_k 1000000 is out of range [0, ");
    expect(r, "model_info_unknown", PIE_ABI_E_NOT_FOUND, "model \"zz\"");
    join_exited_0(r);
    cluster_stop(&c);
}

Test(lc_host, out_of_bounds_pointer_traps_naming_the_function_and_oversize_send_is_refused) {
    cluster c;
    cluster_start(&c, 64, "");
    run *r = run_start(&c, 0, "oob", NULL, NULL);
    lc_wasm_outcome o = run_join(r);
    cr_assert_eq(o.end, LC_WASM_TRAPPED, "%s", o.message);
    cr_assert_eq(o.trap, LC_WASM_TRAP_HOST);
    cr_assert(strstr(o.message, "send: memory range"), "%s", o.message);
    r = run_start(&c, 100, "oversize", "101", NULL);
    expect(r, "send", PIE_ABI_E_INVALID_ARGUMENT,
           "send: message of 101 bytes exceeds the instance's message_bytes limit 100");
    join_exited_0(r);
    cluster_stop(&c);
}

Test(lc_host, http_allowed_refused_and_capped) {
    httpd h;
    httpd_start(&h);
    char allow[128], ok[128], big[128], other[128], url_q[160];
    snprintf(allow, sizeof allow, "http://127.0.0.1:%d/ok,http://127.0.0.1:%d/big", h.port, h.port);
    snprintf(ok, sizeof ok, "http://127.0.0.1:%d/ok", h.port);
    snprintf(big, sizeof big, "http://127.0.0.1:%d/big", h.port);
    snprintf(other, sizeof other, "http://127.0.0.1:%d/okay", h.port);
    cluster c;
    cluster_start(&c, 64, allow);
    run *r = run_start(&c, 0, "http", ok, NULL);
    cr_assert_str_eq(val(r, "http"), "0|200|hello from http");
    join_exited_0(r);
    r = run_start(&c, 0, "http", other, NULL);
    expect(r, "http", PIE_ABI_E_PERMISSION_DENIED, "is not allowed (allowlist: http://127.0.0.1:");
    join_exited_0(r);
    r = run_start(&c, 0, "http", "file:///etc/passwd", NULL);
    expect(r, "http", PIE_ABI_E_PERMISSION_DENIED, "file:///etc/passwd is not allowed");
    join_exited_0(r);
    /* dot segments: curl (and servers) resolve them, so /ok/../secret would leave the prefix
     * /ok (before: curl asked for /secret) */
    const char *escapes[] = {"/ok/../secret", "/ok/%2e%2E/secret", "/ok/./../secret", "/ok/.."};
    for (size_t i = 0; i < sizeof escapes / sizeof *escapes; i++) {
        char url[160];
        snprintf(url, sizeof url, "http://127.0.0.1:%d%s", h.port, escapes[i]);
        r = run_start(&c, 0, "http", url, NULL);
        expect(r, "http", PIE_ABI_E_PERMISSION_DENIED, "dot segment");
        join_exited_0(r);
    }
    snprintf(url_q, sizeof url_q, "http://127.0.0.1:%d/ok?next=/../x", h.port);
    r = run_start(&c, 0, "http", url_q, NULL); /* in the query: allowed (the server says 404) */
    cr_assert_str_eq(val(r, "http"), "0|404|");
    join_exited_0(r);
    /* headers that choose where the request goes or how it is framed are curl's: Host would
     * reach another virtual host behind the allowed address, Content-Length or
     * Transfer-Encoding could smuggle a second request through a proxy */
    const char *owned[] = {"Host: internal.example", "content-length: 0",
                           "Transfer-Encoding: chunked", "Connection: keep-alive, Upgrade"};
    for (size_t i = 0; i < sizeof owned / sizeof *owned; i++) {
        r = run_start(&c, 0, "http", ok, owned[i]);
        expect(r, "http", PIE_ABI_E_PERMISSION_DENIED, "is set by the replica");
        join_exited_0(r);
    }
    r = run_start(&c, 0, "http", ok, "Bad Name: x");
    expect(r, "http", PIE_ABI_E_INVALID_ARGUMENT, "is not \"Name: value\"");
    join_exited_0(r);
    r = run_start(&c, 0, "http", ok, "Accept: text/plain");
    cr_assert_str_eq(val(r, "http"), "0|200|hello from http");
    join_exited_0(r);
    r = run_start(&c, 0, "http", big, NULL); /* 6000 bytes over a cap of 4096 */
    expect(r, "http", PIE_ABI_E_RESOURCE_EXHAUSTED, "exceeds the cap of 4096 bytes");
    join_exited_0(r);
    cluster_stop(&c);
    httpd_stop(&h);
}

Test(lc_host, broadcast_reaches_a_subscriber) {
    cluster c;
    cluster_start(&c, 64, "");
    run *s = run_start(&c, 0, "sub", "news", NULL);
    val(s, "subscribed");
    run *p = run_start(&c, 0, "pub", "news", "hello subscribers");
    cr_assert_str_eq(val(s, "got"), "news|hello subscribers");
    run_message(p, "stop");
    join_exited_0(s);
    join_exited_0(p);
    cluster_stop(&c);
}

/* Waits until the instance's run ended. */
static void run_wait_done(run *r) {
    int64_t deadline = pie_test_now_ms() + WAIT_MS;
    pthread_mutex_lock(&r->mu);
    while (!r->done && pie_test_now_ms() < deadline) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 20000000;
        if (ts.tv_nsec >= 1000000000) ts.tv_sec++, ts.tv_nsec -= 1000000000;
        pthread_cond_timedwait(&r->cv, &r->mu, &ts);
    }
    bool done = r->done;
    pthread_mutex_unlock(&r->mu);
    cr_assert(done, "the instance did not end");
}

Test(lc_host, contention_termination_reaches_the_instance_manager) {
    cluster c;
    cluster_start(&c, 6, "");
    run *a = run_start(&c, 0, "hold", "2", "4"); /* older: 2 pages now, 4 more later */
    expect(a, "held", 0, NULL);
    run *b = run_start(&c, 0, "hold", "4", "0"); /* newer: the other 4 of 6 pages */
    expect(b, "held", 0, NULL);
    run_message(a, "more"); /* a wants 4 more: the controller ends the newest instance, b */
    expect(a, "more", 0, NULL);
    run_wait_done(b);
    cr_assert(b->terminated, "cb->terminated was not called for the newer instance");
    cr_assert_eq(b->term_code, PIE_RESOURCE_EXHAUSTED);
    cr_assert(strstr(b->term_msg, "contention"), "%s", b->term_msg);
    lc_wasm_outcome o = run_join(b);
    cr_assert_eq(o.end, LC_WASM_INTERRUPTED, "%s", o.message);
    run_message(a, "bye");
    join_exited_0(a);
    cluster_stop(&c);
}

Test(lc_host, a_lost_session_terminates_every_instance_with_unavailable) {
    cluster c;
    cluster_start(&c, 64, "");
    run *a = run_start(&c, 0, "futures", NULL, NULL);
    run *b = run_start(&c, 0, "hold", "1", "0");
    val(a, "ready");
    expect(b, "held", 0, NULL);
    /* The controller dies (no goodbye events): the Session ends, the replica fails them all. */
    pie_status st;
    cr_assert_eq(pie_proc_signal(c.ctl, SIGKILL, &st), PIE_OK, "%s", st.msg);
    pie_proc_wait(c.ctl, STOP_MS, &st);
    pie_proc_destroy(c.ctl);
    c.ctl = NULL;
    run_wait_done(a);
    run_wait_done(b);
    cr_assert(a->terminated && b->terminated);
    cr_assert_eq(a->term_code, PIE_UNAVAILABLE);
    cr_assert_eq(b->term_code, PIE_UNAVAILABLE);
    /* "controller session lost: <why the stream ended>" */
    cr_assert(strncmp(a->term_msg, "controller session lost: ", 25) == 0 && a->term_msg[25],
              "%s", a->term_msg);
    cr_assert(strncmp(b->term_msg, "controller session lost: ", 25) == 0 && b->term_msg[25],
              "%s", b->term_msg);
    cr_assert_eq(run_join(a).end, LC_WASM_INTERRUPTED);
    cr_assert_eq(run_join(b).end, LC_WASM_INTERRUPTED);
    cluster_stop(&c);
}
