/* bench_lifecycle.c — the lifecycle service's launch latency, concurrency, host-call and
 * GPU-call overhead, and memory, measured through real processes (pie-controller, a pie-worker
 * with the null backend, pie-lifecycle) over the public API. Results: bench/results/lifecycle.md.
 *
 *   bench_lifecycle [--quick] [--no-tier1] [--cold-only]
 *                                    (release build: build-lc-rel/bench/bench_lifecycle)
 * --no-tier1 keeps the background cc -O2 from competing with the cold launches measured
 * (2 cores); --cold-only measures nothing else.
 *
 * Measures: warm launch (Run of a stored trivial program → started → exit observed, p50/p90);
 * cold launch (upload of a never-seen ~200 KB module — tests/wasm/big.c with a fresh custom
 * section, so translate + tier-0 compile run — then Run to exit); 512 concurrent launches until
 * all are RUNNING; an in-process host call (pie.model_count, timed inside the inferlet); an
 * awaited GPU call (synchronize: lifecycle → controller → worker → back, timed inside the
 * inferlet); lifecycle RSS with 1,000 idle instances; lifecycle RSS over 10,000 launches. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "pie/v1/lifecycle.pb-c.h"
#include "pie_proc.h"
#include "pie_testutil.h"
#include "rpc.h"

#define DIE(...)                                          \
    do {                                                  \
        fprintf(stderr, "bench_lifecycle: " __VA_ARGS__); \
        fputc('\n', stderr);                              \
        exit(1);                                          \
    } while (0)

static pie_proc *g_ctl, *g_wrk, *g_lc;
static rpc_channel *g_ch;

static pie_proc *start(const char *bin, const char *const *env) {
    pie_proc_opts o = {.env = env};
    pie_status st;
    pie_proc *p = pie_proc_start(bin, &o, 30000, &st);
    if (p == NULL) DIE("%s", st.msg);
    return p;
}

static double now_us(void) { return (double)rpc_now_ns() / 1e3; }

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(double *v, int n, double p) {
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    int i = (int)(p * (n - 1) + 0.5);
    return v[i];
}

static long rss_kib(pie_proc *p) {
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", pie_proc_pid(p));
    FILE *f = fopen(path, "r");
    long kib = -1;
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, "VmRSS:", 6) == 0) kib = atol(line + 6);
    if (f) fclose(f);
    return kib;
}

/* CPU time of the process and its reaped children (wasm2c, tcc, cc run as children), ms. */
static double cpu_ms(pie_proc *p) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", pie_proc_pid(p));
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f) fclose(f);
    buf[n] = 0;
    char *s = strrchr(buf, ')'); /* the fields after the command name */
    unsigned long long v[4] = {0};
    if (s == NULL ||
        sscanf(s + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu %llu %llu", &v[0],
               &v[1], &v[2], &v[3]) != 4)
        return 0;
    return (double)(v[0] + v[1] + v[2] + v[3]) * 1000.0 / (double)sysconf(_SC_CLK_TCK);
}

static uint8_t *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) DIE("cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc((size_t)n + 64);
    if (b == NULL || fread(b, 1, (size_t)n, f) != (size_t)n) DIE("cannot read %s", path);
    fclose(f);
    *len = (size_t)n;
    return b;
}

static void upload(const uint8_t *data, size_t len, char id[65]) {
    pie_status st;
    rpc_call_opts o = {.timeout_ms = 60000};
    rpc_stream *s = rpc_stream_open(g_ch, "/pie.v1.Lifecycle/UploadProgram",
                                    &pie__v1__upload_program_response__descriptor, &o, &st);
    if (s == NULL) DIE("%s", st.msg);
    Pie__V1__ProgramMetadata md = PIE__V1__PROGRAM_METADATA__INIT;
    md.name = "bench";
    md.size_bytes = len;
    Pie__V1__UploadProgramRequest r = PIE__V1__UPLOAD_PROGRAM_REQUEST__INIT;
    r.part_case = PIE__V1__UPLOAD_PROGRAM_REQUEST__PART_METADATA;
    r.metadata = &md;
    rpc_stream_send(s, &r.base, &st);
    Pie__V1__UploadProgramRequest c = PIE__V1__UPLOAD_PROGRAM_REQUEST__INIT;
    c.part_case = PIE__V1__UPLOAD_PROGRAM_REQUEST__PART_CHUNK;
    c.chunk.data = (uint8_t *)data;
    c.chunk.len = len;
    rpc_stream_send(s, &c.base, &st);
    rpc_stream_close_send(s, &st);
    ProtobufCMessage *m = NULL;
    if (rpc_stream_recv(s, &m, 60000) == RPC_RECV_MESSAGE) {
        snprintf(id, 65, "%s", ((Pie__V1__UploadProgramResponse *)m)->program_id);
        rpc_msg_free(m);
    }
    if (rpc_stream_finish(s, &st) != PIE_OK) DIE("upload: %s", st.msg);
    rpc_stream_destroy(s);
}

/* Run to exit; stdout (if out) collected. Returns the exit code, dies on a non-OK status. */
static int run(const char *id, const char *const *args, char *out, size_t cap) {
    pie_status st;
    rpc_call_opts o = {.timeout_ms = 120000};
    rpc_stream *s = rpc_stream_open(g_ch, "/pie.v1.Lifecycle/Run",
                                    &pie__v1__attach_response__descriptor, &o, &st);
    if (s == NULL) DIE("%s", st.msg);
    Pie__V1__LaunchRequest lr = PIE__V1__LAUNCH_REQUEST__INIT;
    lr.program_id = (char *)id;
    while (args && args[lr.n_args]) lr.n_args++;
    lr.args = (char **)args;
    Pie__V1__RunRequest r = PIE__V1__RUN_REQUEST__INIT;
    r.msg_case = PIE__V1__RUN_REQUEST__MSG_LAUNCH;
    r.launch = &lr;
    if (rpc_stream_send(s, &r.base, &st) != PIE_OK) DIE("run: %s", st.msg);
    int code = -1;
    size_t used = 0;
    for (;;) {
        ProtobufCMessage *m = NULL;
        if (rpc_stream_recv(s, &m, 120000) != RPC_RECV_MESSAGE) break;
        Pie__V1__AttachResponse *a = (Pie__V1__AttachResponse *)m;
        if (a->msg_case == PIE__V1__ATTACH_RESPONSE__MSG_STDOUT_DATA && out &&
            used + a->stdout_data.len < cap) {
            memcpy(out + used, a->stdout_data.data, a->stdout_data.len);
            used += a->stdout_data.len;
            out[used] = 0;
        }
        if (a->msg_case == PIE__V1__ATTACH_RESPONSE__MSG_EXIT_STATUS) {
            if (a->exit_status->status && a->exit_status->status->code)
                DIE("instance ended %s: %s", pie_code_name((int)a->exit_status->status->code),
                    a->exit_status->status->message);
            code = a->exit_status->exit_code;
        }
        rpc_msg_free(m);
    }
    if (rpc_stream_finish(s, &st) != PIE_OK) DIE("run: %s", st.msg);
    rpc_stream_destroy(s);
    return code;
}

static uint64_t launch(const char *id, const char *const *args) {
    Pie__V1__LaunchRequest lr = PIE__V1__LAUNCH_REQUEST__INIT;
    lr.program_id = (char *)id;
    while (args && args[lr.n_args]) lr.n_args++;
    lr.args = (char **)args;
    rpc_call_opts o = {.timeout_ms = 60000};
    ProtobufCMessage *m = NULL;
    pie_status st;
    if (rpc_unary(g_ch, "/pie.v1.Lifecycle/Launch", &lr.base, &pie__v1__launch_response__descriptor,
                  &m, &o, &st) != PIE_OK)
        DIE("launch: %s", st.msg);
    uint64_t iid = ((Pie__V1__LaunchResponse *)m)->instance_id;
    rpc_msg_free(m);
    return iid;
}

static void terminate(uint64_t iid) {
    Pie__V1__TerminateRequest t = PIE__V1__TERMINATE_REQUEST__INIT;
    t.instance_id = iid;
    rpc_call_opts o = {.timeout_ms = 60000};
    pie_status st;
    ProtobufCMessage *m = NULL;
    if (rpc_unary(g_ch, "/pie.v1.Lifecycle/Terminate", &t.base,
                  &pie__v1__terminate_response__descriptor, &m, &o, &st) != PIE_OK)
        DIE("terminate: %s", st.msg);
    rpc_msg_free(m);
}

/* Instances in the given state. */
static size_t count_state(int state) {
    Pie__V1__ListInstancesRequest req = PIE__V1__LIST_INSTANCES_REQUEST__INIT;
    rpc_call_opts o = {.timeout_ms = 60000};
    ProtobufCMessage *m = NULL;
    pie_status st;
    if (rpc_unary(g_ch, "/pie.v1.Lifecycle/ListInstances", &req.base,
                  &pie__v1__list_instances_response__descriptor, &m, &o, &st) != PIE_OK)
        DIE("list: %s", st.msg);
    Pie__V1__ListInstancesResponse *l = (Pie__V1__ListInstancesResponse *)m;
    size_t n = 0;
    for (size_t i = 0; i < l->n_instances; i++) n += (int)l->instances[i]->state == state;
    rpc_msg_free(m);
    return n;
}

static void wait_count(int state, size_t want, int64_t timeout_ms) {
    int64_t deadline = pie_test_now_ms() + timeout_ms;
    while (count_state(state) < want)
        if (pie_test_now_ms() > deadline) DIE("fewer than %zu instances in state %d", want, state);
}

/* ---- measurements ------------------------------------------------------------------------- */

static void bench_warm(const char *id, int n) {
    const char *args[] = {"exit", "0", NULL};
    double *t = malloc(sizeof(double) * (size_t)n);
    for (int i = 0; i < 20; i++) run(id, args, NULL, 0); /* warm-up */
    for (int i = 0; i < n; i++) {
        double t0 = now_us();
        run(id, args, NULL, 0);
        t[i] = now_us() - t0;
    }
    printf("warm launch (Run → exit observed, trivial program), %d runs: p50 %.2f ms, p90 %.2f "
           "ms\n",
           n, pct(t, n, 0.5) / 1e3, pct(t, n, 0.9) / 1e3);
    free(t);
}

static void bench_cold(int n, bool tier1) {
    size_t len;
    uint8_t *base = read_file(PIE_WASM_FIXTURES "/big.wasm", &len);
    double *tu = malloc(sizeof(double) * (size_t)n), *tt = malloc(sizeof(double) * (size_t)n);
    double *tc = malloc(sizeof(double) * (size_t)n);
    for (int i = 0; i < n; i++) {
        /* a custom section "b" with 16 random bytes: new content hash, same code */
        uint8_t *w = base + len;
        w[0] = 0;  /* custom section id */
        w[1] = 18; /* size: name length byte + name + 16 bytes */
        w[2] = 1;
        w[3] = 'b';
        if (getrandom(w + 4, 16, 0) != 16) DIE("getrandom");
        char id[65];
        /* tier 1 of the previous module compiles in the background: let it finish first */
        pie_test_sleep_ms(i && tier1 ? 4000 : 0);
        double c0 = cpu_ms(g_lc), t0 = now_us();
        upload(base, len + 20, id);
        double t1 = now_us();
        tc[i] = cpu_ms(g_lc) - c0; /* translate + tier-0 compile, as CPU time */
        run(id, NULL, NULL, 0);
        tu[i] = t1 - t0;
        tt[i] = now_us() - t0;
    }
    printf("cold launch of a new %zu-byte module (upload with translate + tier-0 compile, then "
           "Run → exit), %d runs: p50 %.1f ms (upload p50 %.1f ms, its CPU time p50 %.1f ms), "
           "p90 %.1f ms\n",
           len + 20, n, pct(tt, n, 0.5) / 1e3, pct(tu, n, 0.5) / 1e3, pct(tc, n, 0.5),
           pct(tt, n, 0.9) / 1e3);
    free(tc);
    free(tu);
    free(tt);
    free(base);
}

static void bench_concurrent(const char *id, int n) {
    const char *args[] = {"wait", NULL};
    uint64_t *ids = malloc(sizeof(uint64_t) * (size_t)n);
    double t0 = now_us();
    for (int i = 0; i < n; i++) ids[i] = launch(id, args);
    double t1 = now_us();
    wait_count(PIE__V1__INSTANCE_STATE__INSTANCE_STATE_RUNNING, (size_t)n, 30000);
    double t2 = now_us();
    printf("%d concurrent launches: all RUNNING %.0f ms after the first Launch (launch RPCs "
           "took %.0f ms)\n",
           n, (t2 - t0) / 1e3, (t1 - t0) / 1e3);
    for (int i = 0; i < n; i++) terminate(ids[i]);
    free(ids);
}

static void bench_calls(const char *id) {
    char out[512];
    const char *h[] = {"bench-host", "200000", NULL};
    run(id, h, out, sizeof out);
    printf("in-process host call (pie.model_count, timed in the inferlet): %s", out);
    const char *g[] = {"bench-gpu", "3000", NULL};
    run(id, g, out, sizeof out);
    printf("awaited GPU call (synchronize, null backend, timed in the inferlet): %s", out);
}

/* Waits until no instance is starting or running (exited ones vanish: retention is 0). */
static void wait_idle(void) {
    int64_t deadline = pie_test_now_ms() + 60000;
    while (count_state(PIE__V1__INSTANCE_STATE__INSTANCE_STATE_RUNNING) +
               count_state(PIE__V1__INSTANCE_STATE__INSTANCE_STATE_STARTING) >
           0)
        if (pie_test_now_ms() > deadline) DIE("instances still running after 60 s");
}

static void bench_idle_rss(const char *id, int n) {
    const char *args[] = {"wait", NULL};
    wait_idle();
    long before = rss_kib(g_lc);
    uint64_t *ids = malloc(sizeof(uint64_t) * (size_t)n);
    for (int i = 0; i < n; i++) ids[i] = launch(id, args);
    wait_count(PIE__V1__INSTANCE_STATE__INSTANCE_STATE_RUNNING, (size_t)n, 60000);
    pie_test_sleep_ms(500);
    long during = rss_kib(g_lc);
    printf("%d idle instances (waiting in receive): lifecycle RSS %.1f MiB (%.1f MiB before; "
           "%.1f KiB per instance)\n",
           n, during / 1024.0, before / 1024.0, (double)(during - before) / n);
    for (int i = 0; i < n; i++) terminate(ids[i]);
    wait_idle();
    free(ids);
}

static void bench_rss_launches(const char *id, int n) {
    const char *args[] = {"exit", "0", NULL};
    printf("RSS over %d launches (retention 0):", n);
    for (int i = 0; i <= n; i++) {
        if (i % (n / 10) == 0) printf(" %d:%.1fMiB", i, rss_kib(g_lc) / 1024.0);
        if (i < n) run(id, args, NULL, 0);
    }
    printf("\n");
}

int main(int argc, char **argv) {
    bool quick = false, tier1 = true, cold_only = false;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0)
            quick = true;
        else if (strcmp(argv[i], "--no-tier1") == 0)
            tier1 = false;
        else if (strcmp(argv[i], "--cold-only") == 0)
            cold_only = true;
        else
            DIE("unknown option %s (--quick, --no-tier1, --cold-only)", argv[i]);
    }
    setvbuf(stdout, NULL, _IOLBF, 0); // results appear as they are measured
    pie_status st;
    char *dir = pie_proc_tmpdir(&st);
    if (dir == NULL) DIE("%s", st.msg);
    g_ctl = start("pie-controller", NULL);
    char ctl_env[96], dir_env[4200];
    pie_proc_env_controller(g_ctl, ctl_env, sizeof ctl_env);
    snprintf(dir_env, sizeof dir_env, "PIE_RUNTIME_CACHE_DIR=%s/cache", dir);
    const char *wenv[] = {ctl_env, "PIE_BACKEND=null", NULL};
    g_wrk = start("pie-worker", wenv);
    const char *lenv[] = {ctl_env, dir_env, "PIE_INSTANCES_RETENTION=0s",
                          tier1 ? "PIE_RUNTIME_TIER1=true" : "PIE_RUNTIME_TIER1=false", NULL};
    g_lc = start("pie-lifecycle", lenv);
    rpc_channel_opts co = {.max_recv_bytes = -1, .max_send_bytes = -1};
    g_ch = rpc_channel_create(pie_proc_addr(g_lc), &co, &st);
    if (g_ch == NULL) DIE("%s", st.msg);
    pie_test_sleep_ms(1000); /* session + model list */

    size_t len;
    uint8_t *echo = read_file(PIE_WASM_FIXTURES "/lc_echo.wasm", &len);
    char id[65];
    upload(echo, len, id);
    free(echo);
    printf("bench_lifecycle: controller + worker (null backend) + lifecycle, release build, "
           "tier 1 %s\n",
           tier1 ? "on" : "off");
    if (!cold_only) bench_warm(id, quick ? 50 : 500);
    bench_cold(quick ? 3 : 15, tier1);
    if (!cold_only) {
        bench_concurrent(id, 512);
        bench_calls(id);
        bench_idle_rss(id, quick ? 200 : 1000);
        bench_rss_launches(id, quick ? 1000 : 10000);
    }

    rpc_channel_destroy(g_ch);
    pie_proc_stop(g_lc, 30000, &st);
    pie_proc_stop(g_wrk, 30000, &st);
    pie_proc_stop(g_ctl, 30000, &st);
    pie_proc_destroy(g_lc);
    pie_proc_destroy(g_wrk);
    pie_proc_destroy(g_ctl);
    char cmd[4300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "bench_lifecycle: could not remove %s\n", dir);
    free(dir);
    return 0;
}
