/* bench_lifecycle.c — the lifecycle service's launch latency, concurrency, host-call and
 * GPU-call overhead, memory, and per-token serving overhead, measured through real processes
 * (pie-controller, a pie-worker, pie-lifecycle) over the public API. Results:
 * bench/results/lifecycle.md.
 *
 *   bench_lifecycle [--quick] [--no-tier1] [--cold-only | --calls-only]
 *   bench_lifecycle --serving [--model NAME] [--reps N] [--instances N] [--worker-credits N]
 *                             [--controller-env PIE_NAME=VALUE]... [--worker-env PIE_NAME=VALUE]...
 *                             [--lifecycle-bin PATH] [--unix]
 *                                    (release build: build-perf/bench/bench_lifecycle)
 * --no-tier1 keeps the background cc -O2 from competing with the cold launches measured
 * (2 cores); --cold-only measures nothing else, --calls-only only the host and GPU calls.
 *
 * Default mode, worker with the null backend: warm launch (Run of a stored trivial program →
 * started → exit observed, p50/p90); cold launch (upload of a never-seen ~200 KB module —
 * tests/wasm/big.c with a fresh custom section, so translate + tier-0 compile run — then Run to
 * exit); 512 concurrent launches until all are RUNNING; an in-process host call
 * (pie.model_count, timed inside the inferlet); an awaited GPU call (synchronize: lifecycle →
 * controller → worker → back, timed inside the inferlet) and an awaited next_dist (the same
 * path, with a distribution back); lifecycle RSS with 1,000 idle
 * instances; lifecycle RSS over 10,000 launches.
 *
 * --serving, worker with the CPU backend on a generated test model of the build (default
 * small-f32; one engine thread): the text_completion inferlet (the build's inferlets/, at tier 1)
 * run by 1 and by 32 concurrent clients, each generating exactly 16 and then 80 tokens; the
 * per-token serving overhead is defined and computed in bench_serving. --instances N runs only
 * that count; --worker-credits sets the worker's batch.credits (steps the controller may keep
 * outstanding on it; default 1); --controller-env passes a setting to the controller (e.g.
 * PIE_SCHEDULER_STRATEGY=k_only, at most 4); --worker-env passes a setting to the worker (e.g.
 * PIE_MEMORY_POLICY=offload, at most 6; with offload the run also prints the worker's offload
 * and deferral counters and the controller's deferred calls over the measured rounds);
 * --lifecycle-bin runs another build of pie-lifecycle (A/B comparisons); --unix links the worker
 * and the lifecycle to the controller over a Unix socket (its server.listen also has one). */
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/socket.h>
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

/* The build's generated test models and inferlets, next to its bin/ (PIE_BIN_DIR). */
#define MODELS_DIR    PIE_BIN_DIR "/../models"
#define INFERLETS_DIR PIE_BIN_DIR "/../inferlets"

/* The cluster under test and the client's channel: one of each per run of the benchmark. */
static pie_proc *g_ctl, *g_wrk, *g_lc;
static const char *g_lc_bin = "pie-lifecycle"; /* --lifecycle-bin: another build, for A/B runs */
static int g_credits;                          /* --worker-credits: batch.credits (0: default) */
static const char *g_ctl_env[5];               /* --controller-env NAME=VALUE, up to 4 */
static const char *g_wrk_env[7];               /* --worker-env NAME=VALUE, up to 6 */
static bool g_unix; /* --unix: worker and lifecycle reach the controller on a Unix socket */
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

/* What a client saw of one Run: when each stdout chunk arrived (µs, now_us), and the last
 * message the instance sent. */
typedef struct run_trace {
    double *chunk_us;
    int n_chunks, cap;
    char last_msg[128];
} run_trace;

static void trace_chunk(run_trace *tr, double t_us) {
    if (tr->n_chunks == tr->cap) {
        tr->cap = tr->cap ? 2 * tr->cap : 256;
        tr->chunk_us = realloc(tr->chunk_us, sizeof(double) * (size_t)tr->cap);
        if (tr->chunk_us == NULL) DIE("out of memory");
    }
    tr->chunk_us[tr->n_chunks++] = t_us;
}

/* Run to exit; stdout (if out) collected, arrivals traced (if tr). Returns the exit code, dies
 * on a non-OK status. */
static int run_traced(const char *id, const char *const *args, char *out, size_t cap,
                      run_trace *tr) {
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
        if (a->msg_case == PIE__V1__ATTACH_RESPONSE__MSG_STDOUT_DATA && tr)
            trace_chunk(tr, now_us());
        if (a->msg_case == PIE__V1__ATTACH_RESPONSE__MSG_MESSAGE && tr)
            snprintf(tr->last_msg, sizeof tr->last_msg, "%.*s", (int)a->message.len,
                     (const char *)a->message.data);
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

static int run(const char *id, const char *const *args, char *out, size_t cap) {
    return run_traced(id, args, out, cap, NULL);
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
    const char *d[] = {"bench-dist", "3000", NULL};
    run(id, d, out, sizeof out);
    printf("awaited next_dist (top_k 1, null backend, timed in the inferlet): %s", out);
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

/* ---- per-token serving overhead (CPU backend) ---------------------------------------------- */

/* Counters of the three services from their Prometheus endpoints: the worker's batch execution
 * time summed over all kinds and its forward batches; the controller's scheduling steps (one
 * WorkerDown each) and batches; the lifecycle's SessionUp messages. */
typedef struct svc_counters {
    double busy_s, forward_batches, ctl_steps, ctl_batches, lc_ups;
    double cpu_ms[4];   /* CPU time of lifecycle, controller, worker, this client */
    double switches[2]; /* voluntary context switches (a thread blocked) of lifecycle, controller */
} svc_counters;

/* Voluntary context switches (a thread blocked, and later had to be woken: what the serving
 * path pays for most on few cores) of every thread a process has had during a round. Instance
 * threads end with their instance, taking their counts with them, so a sampler thread reads
 * /proc/<pid>/task/ every few ms and keeps each thread's last count. */
typedef struct switch_count {
    int tid;
    double base, last; /* base: the count when sampling began (0 for threads born later) */
} switch_count;

typedef struct switch_sampler {
    pie_proc *p;
    switch_count t[4096];
    int n_t;
    bool started; /* after the first sample */
    atomic_bool stop;
    pthread_t th;
} switch_sampler;

static void switches_sample(switch_sampler *ss) {
    char dir[64];
    snprintf(dir, sizeof dir, "/proc/%d/task", pie_proc_pid(ss->p));
    DIR *d = opendir(dir);
    for (struct dirent *e; d && (e = readdir(d)) != NULL;) {
        if (e->d_name[0] == '.') continue;
        char path[400], line[256];
        snprintf(path, sizeof path, "%s/%.256s/status", dir, e->d_name);
        FILE *f = fopen(path, "r");
        double n = -1;
        while (f && fgets(line, sizeof line, f))
            if (strncmp(line, "voluntary_ctxt_switches:", 24) == 0) n = atof(line + 24);
        if (f) fclose(f);
        int tid = atoi(e->d_name), i = 0;
        while (i < ss->n_t && ss->t[i].tid != tid) i++;
        if (n < 0 || (i == ss->n_t && ss->n_t == (int)(sizeof ss->t / sizeof ss->t[0]))) continue;
        if (i == ss->n_t) ss->t[ss->n_t++] = (switch_count){tid, ss->started ? 0 : n, n};
        ss->t[i].last = n;
    }
    if (d) closedir(d);
}

static void *switches_main(void *arg) {
    switch_sampler *ss = arg;
    while (!atomic_load(&ss->stop)) {
        switches_sample(ss);
        pie_test_sleep_ms(5);
    }
    return NULL;
}

/* Starts sampling p; switches_stop returns the switches of its threads since the start. */
static switch_sampler *switches_start(pie_proc *p) {
    switch_sampler *ss = calloc(1, sizeof *ss);
    if (ss == NULL) DIE("out of memory");
    ss->p = p;
    switches_sample(ss);
    ss->started = true;
    atomic_init(&ss->stop, false);
    if (pthread_create(&ss->th, NULL, switches_main, ss) != 0) DIE("pthread_create");
    return ss;
}

static double switches_stop(switch_sampler *ss) {
    atomic_store(&ss->stop, true);
    pthread_join(ss->th, NULL);
    switches_sample(ss);
    double n = 0;
    for (int i = 0; i < ss->n_t; i++) n += ss->t[i].last - ss->t[i].base;
    free(ss);
    return n;
}

/* GET /metrics from 127.0.0.1:port into a malloc'ed string. */
static char *http_get_metrics(int port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0)
        DIE("metrics: connect to port %d: %s", port, strerror(errno));
    const char req[] = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (write(fd, req, sizeof req - 1) != (ssize_t)(sizeof req - 1)) DIE("metrics: write");
    size_t cap = 1 << 16, len = 0;
    char *b = malloc(cap);
    for (;;) {
        if (b == NULL) DIE("out of memory");
        ssize_t r = read(fd, b + len, cap - len - 1);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) DIE("metrics: read: %s", strerror(errno));
        if (r == 0) break;
        len += (size_t)r;
        if (cap - len < 4096) b = realloc(b, cap *= 2);
    }
    close(fd);
    b[len] = 0;
    return b;
}

/* Sum of the values of the series whose line starts with `prefix`. */
static double metric_sum(pie_proc *p, const char *prefix) {
    char *text = http_get_metrics(pie_proc_metrics_port(p));
    double sum = 0;
    size_t pl = strlen(prefix);
    for (char *save, *line = strtok_r(text, "\n", &save); line;
         line = strtok_r(NULL, "\n", &save)) {
        const char *sp = strrchr(line, ' ');
        if (sp != NULL && strncmp(line, prefix, pl) == 0) sum += atof(sp + 1);
    }
    free(text);
    return sum;
}

static svc_counters counters(void) {
    struct rusage self;
    getrusage(RUSAGE_SELF, &self);
    return (svc_counters){
        .busy_s = metric_sum(g_wrk, "pie_worker_batch_seconds_sum{"),
        .forward_batches = metric_sum(g_wrk, "pie_worker_batch_seconds_count{kind=\"forward\"}"),
        .ctl_steps = metric_sum(g_ctl, "pie_controller_steps_total"),
        .ctl_batches = metric_sum(g_ctl, "pie_controller_batches_total"),
        .lc_ups = metric_sum(g_lc, "pie_lifecycle_session_up_messages_total"),
        .cpu_ms = {cpu_ms(g_lc), cpu_ms(g_ctl), cpu_ms(g_wrk),
                   (double)(self.ru_utime.tv_sec + self.ru_stime.tv_sec) * 1e3 +
                       (double)(self.ru_utime.tv_usec + self.ru_stime.tv_usec) / 1e3},
    };
}

typedef struct serve_job {
    const char *id;
    const char *const *args;
    run_trace tr;
} serve_job;

static void *serve_thread(void *arg) {
    serve_job *j = arg;
    run_traced(j->id, j->args, NULL, 0, &j->tr);
    return NULL;
}

/* One round: n instances of text_completion, each generating exactly `tokens` tokens, launched
 * together. Returns the wall time until all exited and the counters over it, and (if gaps)
 * appends each instance's gaps between consecutive tokens' stdout chunks (the inferlet writes
 * and flushes every token's text as it is decided). */
typedef struct serve_round {
    double wall_us;
    svc_counters d; /* counters over the round */
} serve_round;

static serve_round serve_once(const char *id, int n, int tokens, double *gaps, int *n_gaps,
                              int gaps_cap) {
    char max_tokens[16];
    snprintf(max_tokens, sizeof max_tokens, "%d", tokens);
    const char *args[] = {
        "--prompt", "The cat sat on the mat and", "--max-tokens", max_tokens, "--ignore-eos", NULL};
    serve_job *jobs = calloc((size_t)n, sizeof *jobs);
    pthread_t *th = calloc((size_t)n, sizeof *th);
    if (jobs == NULL || th == NULL) DIE("out of memory");
    switch_sampler *sw_lc = switches_start(g_lc), *sw_ctl = switches_start(g_ctl);
    svc_counters c0 = counters();
    double t0 = now_us();
    for (int i = 0; i < n; i++) {
        jobs[i] = (serve_job){.id = id, .args = args};
        if (pthread_create(&th[i], NULL, serve_thread, &jobs[i]) != 0) DIE("pthread_create");
    }
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
    serve_round r = {.wall_us = now_us() - t0};
    svc_counters c1 = counters();
    r.d = (svc_counters){c1.busy_s - c0.busy_s,
                         c1.forward_batches - c0.forward_batches,
                         c1.ctl_steps - c0.ctl_steps,
                         c1.ctl_batches - c0.ctl_batches,
                         c1.lc_ups - c0.lc_ups,
                         {0},
                         {switches_stop(sw_lc), switches_stop(sw_ctl)}};
    for (int i = 0; i < 4; i++) r.d.cpu_ms[i] = c1.cpu_ms[i] - c0.cpu_ms[i];
    char want[64];
    snprintf(want, sizeof want, "reason=max_tokens tokens=%d", tokens);
    for (int i = 0; i < n; i++) {
        if (strcmp(jobs[i].tr.last_msg, want) != 0)
            DIE("text_completion ended with \"%s\", expected \"%s\"", jobs[i].tr.last_msg, want);
        /* the first chunk follows the prefill; the last is the inferlet's final newline */
        for (int k = 1; gaps && k + 1 < jobs[i].tr.n_chunks && *n_gaps < gaps_cap; k++)
            gaps[(*n_gaps)++] = jobs[i].tr.chunk_us[k] - jobs[i].tr.chunk_us[k - 1];
        free(jobs[i].tr.chunk_us);
    }
    free(jobs);
    free(th);
    return r;
}

/* Overhead per output token = (time per output token as a client sees it) − (the worker's step
 * time: its busy time per decode step, i.e. per token of each instance). Two estimates:
 *  p50:  the p50 of the gaps between consecutive tokens at the clients (all instances, all
 *        `hi` rounds) − the worker's busy time per decode step;
 *  mean: per round pair, (wall_hi − wall_lo)/(hi − lo) − (busy_hi − busy_lo)/(hi − lo): the
 *        difference of a `hi`-token and a `lo`-token round cancels launch, prefill and exit;
 *        shown as the p50 (min, max) over the round pairs.
 * The worker's busy time per decode step is (busy_hi − busy_lo)/(hi − lo) (median over round
 * pairs), from the worker's pie_worker_batch_seconds (all batch kinds: embed_text, forward,
 * next_dist, slots). What remains is the serving path: the inferlet's own work, lifecycle,
 * controller, four gRPC hops, thread wake-ups, and the worker waiting for the next batch. */
/* A metric series of p (0 when the page lacks it: a policy or service without it). */
static double metric_or_0(const pie_proc *p, const char *series) {
    double v = 0;
    pie_status st;
    return pie_proc_metric(p, series, &v, &st) == PIE_OK ? v : 0;
}

/* Offload's and deferral's counters now (all 0 under another memory policy). */
typedef struct defer_counters {
    double host_items, fwd_deferred, dist_deferred, ctl_deferred, ctl_failed, forced, two;
} defer_counters;

static defer_counters defer_now(void) {
    return (defer_counters){
        metric_or_0(g_wrk, "pie_worker_offload_host_instances_total"),
        metric_or_0(g_wrk, "pie_worker_deferred_items_total{kind=\"forward\"}"),
        metric_or_0(g_wrk, "pie_worker_deferred_items_total{kind=\"next_dist\"}"),
        metric_or_0(g_ctl, "pie_controller_deferred_calls_total"),
        metric_or_0(g_ctl, "pie_controller_deferral_failures_total"),
        metric_or_0(g_wrk, "pie_worker_offload_steps_total{decision=\"forced\"}"),
        metric_or_0(g_wrk, "pie_worker_offload_steps_total{decision=\"two_sub_batches\"}")};
}

static void bench_serving(const char *id, int n, int reps, int lo, int hi) {
    enum {
        TOK,
        STEP,
        OVER,
        FWD,
        STEPS,
        BATCHES,
        UPS,
        CPU_LC,
        CPU_CTL,
        CPU_WRK,
        CPU_CLI,
        SW_LC,
        SW_CTL,
        NV
    };
    double *v[NV];
    for (int i = 0; i < NV; i++)
        if ((v[i] = malloc(sizeof(double) * (size_t)reps)) == NULL) DIE("out of memory");
    int gaps_cap = reps * n * (hi + 8), n_gaps = 0;
    double *gaps = malloc(sizeof(double) * (size_t)gaps_cap);
    if (gaps == NULL) DIE("out of memory");
    serve_once(id, n, lo, NULL, NULL, 0); /* warm-up: pages, threads, caches */
    defer_counters d0 = defer_now();
    double wall = 0, tokens = 0;
    for (int r = 0; r < reps; r++) {
        serve_round a = serve_once(id, n, lo, NULL, NULL, 0);
        serve_round b = serve_once(id, n, hi, gaps, &n_gaps, gaps_cap);
        wall += a.wall_us + b.wall_us;
        tokens += (double)n * (lo + hi);
        double k = hi - lo;
        v[TOK][r] = (b.wall_us - a.wall_us) / k;
        v[STEP][r] = (b.d.busy_s - a.d.busy_s) * 1e6 / k;
        v[OVER][r] = v[TOK][r] - v[STEP][r];
        v[FWD][r] = (b.d.forward_batches - a.d.forward_batches) / k;
        v[STEPS][r] = (b.d.ctl_steps - a.d.ctl_steps) / k;
        v[BATCHES][r] = (b.d.ctl_batches - a.d.ctl_batches) / k;
        v[UPS][r] = (b.d.lc_ups - a.d.lc_ups) / k;
        for (int i = 0; i < 4; i++) v[CPU_LC + i][r] = (b.d.cpu_ms[i] - a.d.cpu_ms[i]) / k;
        for (int i = 0; i < 2; i++) v[SW_LC + i][r] = (b.d.switches[i] - a.d.switches[i]) / k;
    }
    if (n_gaps == 0) DIE("serving: no token gaps seen (does text_completion print each token?)");
    double gap50 = pct(gaps, n_gaps, 0.5), gap90 = pct(gaps, n_gaps, 0.9);
    double step = pct(v[STEP], reps, 0.5);
    double o50 = pct(v[OVER], reps, 0.5), omin = v[OVER][0], omax = v[OVER][reps - 1];
    printf("serving, %d instance%s (%d vs %d tokens, %d round pairs): client time per token p50 "
           "%.3f ms (p90 %.3f) - worker busy per decode step %.3f ms = overhead p50 %.3f ms; "
           "mean estimate %.3f ms (min %.3f, max %.3f)\n",
           n, n == 1 ? "" : "s", lo, hi, reps, gap50 / 1e3, gap90 / 1e3, step / 1e3,
           (gap50 - step) / 1e3, o50 / 1e3, omin / 1e3, omax / 1e3);
    printf("  per decode step: %.2f worker steps, %.2f batches (%.2f forward), %.2f SessionUp "
           "messages; thread blocks (voluntary context switches): lifecycle %.1f, controller "
           "%.1f\n",
           pct(v[STEPS], reps, 0.5), pct(v[BATCHES], reps, 0.5), pct(v[FWD], reps, 0.5),
           pct(v[UPS], reps, 0.5), pct(v[SW_LC], reps, 0.5), pct(v[SW_CTL], reps, 0.5));
    printf("  CPU time per decode step (10 ms ticks, averaged): lifecycle %.3f ms, controller "
           "%.3f ms, worker %.3f ms, this client %.3f ms\n",
           pct(v[CPU_LC], reps, 0.5), pct(v[CPU_CTL], reps, 0.5), pct(v[CPU_WRK], reps, 0.5),
           pct(v[CPU_CLI], reps, 0.5));
    defer_counters d1 = defer_now();
    printf("  throughput %.1f generated tokens/s over the measured rounds (%.0f tokens, %.2f s, "
           "launches and prefills included)\n",
           tokens / (wall / 1e6), tokens, wall / 1e6);
    if (d1.host_items > 0 || d1.forced > 0)
        printf("  offload over the measured rounds: %.0f decodes attended on the host, %.0f forced "
               "steps, %.0f two-sub-batch steps; deferred: %.0f forward and %.0f next_dist items "
               "(worker), %.0f calls taken back, %.0f failed at the bound (controller)\n",
               d1.host_items - d0.host_items, d1.forced - d0.forced, d1.two - d0.two,
               d1.fwd_deferred - d0.fwd_deferred, d1.dist_deferred - d0.dist_deferred,
               d1.ctl_deferred - d0.ctl_deferred, d1.ctl_failed - d0.ctl_failed);
    for (int i = 0; i < NV; i++) free(v[i]);
    free(gaps);
}

/* Waits until the program's tier-1 library is in use (the steady state of a served program). */
static void wait_optimized(const char *id) {
    int64_t deadline = pie_test_now_ms() + 600000;
    for (;;) {
        Pie__V1__ListProgramsRequest req = PIE__V1__LIST_PROGRAMS_REQUEST__INIT;
        rpc_call_opts o = {.timeout_ms = 60000};
        ProtobufCMessage *m = NULL;
        pie_status st;
        if (rpc_unary(g_ch, "/pie.v1.Lifecycle/ListPrograms", &req.base,
                      &pie__v1__list_programs_response__descriptor, &m, &o, &st) != PIE_OK)
            DIE("list programs: %s", st.msg);
        Pie__V1__ListProgramsResponse *l = (Pie__V1__ListProgramsResponse *)m;
        bool done = false;
        for (size_t i = 0; i < l->n_programs; i++)
            done |= strcmp(l->programs[i]->program_id, id) == 0 &&
                    l->programs[i]->tier == PIE__V1__PROGRAM_TIER__PROGRAM_TIER_OPTIMIZED;
        rpc_msg_free(m);
        if (done) return;
        if (pie_test_now_ms() > deadline) DIE("program %s not at tier 1 after 600 s", id);
        pie_test_sleep_ms(200);
    }
}

/* Starts controller, worker and lifecycle. cpu_model NULL: the null backend; otherwise the CPU
 * backend on that generated test model (one engine thread: the other core is the serving
 * path's), which is also the lifecycle's tokenizer. */
static void cluster_start(const char *dir, bool tier1, const char *cpu_model) {
    /* outlive the call */
    static char ctl_env[4200], dir_env[4200], model_env[4200], tok_env[4200], listen_env[4200];
    char sock[4100];
    snprintf(sock, sizeof sock, "unix:%s/ctl.sock", dir);
    const char *ctl_envs[6] = {0};
    size_t n_ctl = 0;
    while (g_ctl_env[n_ctl]) {
        ctl_envs[n_ctl] = g_ctl_env[n_ctl];
        n_ctl++;
    }
    if (g_unix) {
        snprintf(listen_env, sizeof listen_env, "PIE_SERVER_LISTEN=127.0.0.1:0,%s", sock);
        ctl_envs[n_ctl] = listen_env;
    }
    g_ctl = start("pie-controller", ctl_envs);
    if (g_unix)
        snprintf(ctl_env, sizeof ctl_env, "PIE_CONTROLLER_ADDRESS=%s", sock);
    else
        pie_proc_env_controller(g_ctl, ctl_env, sizeof ctl_env);
    snprintf(dir_env, sizeof dir_env, "PIE_RUNTIME_CACHE_DIR=%s/cache", dir);
    snprintf(model_env, sizeof model_env, "PIE_MODEL_PATH=%s/%s", MODELS_DIR,
             cpu_model ? cpu_model : "");
    snprintf(tok_env, sizeof tok_env, "PIE_TOKENIZER_PATH=%s/%s", MODELS_DIR,
             cpu_model ? cpu_model : "");
    const char *null_env[] = {ctl_env, "PIE_BACKEND=null", NULL};
    static char credits_env[48];
    snprintf(credits_env, sizeof credits_env, "PIE_BATCH_CREDITS=%d", g_credits);
    const char *cpu_env[16] = {ctl_env, "PIE_BACKEND=cpu", model_env, "PIE_ENGINE_THREADS=1"};
    size_t n_env = 4;
    if (g_credits) cpu_env[n_env++] = credits_env;
    for (size_t i = 0; g_wrk_env[i]; i++) cpu_env[n_env++] = g_wrk_env[i];
    cpu_env[n_env] = NULL;
    g_wrk = start("pie-worker", cpu_model ? cpu_env : null_env);
    const char *lenv[] = {ctl_env,
                          dir_env,
                          "PIE_INSTANCES_RETENTION=0s",
                          tier1 ? "PIE_RUNTIME_TIER1=true" : "PIE_RUNTIME_TIER1=false",
                          cpu_model ? tok_env : NULL,
                          NULL};
    g_lc = start(g_lc_bin, lenv);
    rpc_channel_opts co = {.max_recv_bytes = -1, .max_send_bytes = -1};
    pie_status st;
    g_ch = rpc_channel_create(pie_proc_addr(g_lc), &co, &st);
    if (g_ch == NULL) DIE("%s", st.msg);
    pie_test_sleep_ms(1000); /* session + model list */
}

static void cluster_stop(void) {
    pie_status st;
    rpc_channel_destroy(g_ch);
    pie_proc_stop(g_lc, 30000, &st);
    pie_proc_stop(g_wrk, 30000, &st);
    pie_proc_stop(g_ctl, 30000, &st);
    pie_proc_destroy(g_lc);
    pie_proc_destroy(g_wrk);
    pie_proc_destroy(g_ctl);
}

static void main_lifecycle(bool quick, bool tier1, bool cold_only, bool calls_only) {
    size_t len;
    uint8_t *echo = read_file(PIE_WASM_FIXTURES "/lc_echo.wasm", &len);
    char id[65];
    upload(echo, len, id);
    free(echo);
    printf("bench_lifecycle: controller + worker (null backend) + lifecycle, release build, "
           "tier 1 %s\n",
           tier1 ? "on" : "off");
    if (calls_only) {
        bench_calls(id);
        return;
    }
    if (!cold_only) bench_warm(id, quick ? 50 : 500);
    bench_cold(quick ? 3 : 15, tier1);
    if (!cold_only) {
        bench_concurrent(id, 512);
        bench_calls(id);
        bench_idle_rss(id, quick ? 200 : 1000);
        bench_rss_launches(id, quick ? 1000 : 10000);
    }
}

static void main_serving(const char *model, int reps, int only_n) {
    size_t len;
    uint8_t *tc = read_file(INFERLETS_DIR "/text_completion.wasm", &len);
    char id[65];
    upload(tc, len, id);
    free(tc);
    wait_optimized(id);
    printf("bench_lifecycle --serving: controller + worker (CPU backend, model %s, 1 engine "
           "thread, batch.credits %d) + lifecycle, release build; text_completion at tier 1\n",
           model, g_credits ? g_credits : 2);
    if (only_n != 32) bench_serving(id, only_n ? only_n : 1, reps, 16, 80);
    if (only_n == 0 || only_n == 32) bench_serving(id, 32, reps, 16, 80);
}

int main(int argc, char **argv) {
    bool quick = false, tier1 = true, cold_only = false, calls_only = false, serving = false;
    const char *model = "small-f32";
    int reps = 0, only_n = 0, n_ctl_env = 0, n_wrk_env = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0)
            quick = true;
        else if (strcmp(argv[i], "--no-tier1") == 0)
            tier1 = false;
        else if (strcmp(argv[i], "--cold-only") == 0)
            cold_only = true;
        else if (strcmp(argv[i], "--calls-only") == 0)
            calls_only = true;
        else if (strcmp(argv[i], "--serving") == 0)
            serving = true;
        else if (strcmp(argv[i], "--model") == 0 && i + 1 < argc)
            model = argv[++i];
        else if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (strcmp(argv[i], "--controller-env") == 0 && i + 1 < argc && n_ctl_env < 4)
            g_ctl_env[n_ctl_env++] = argv[++i];
        else if (strcmp(argv[i], "--worker-env") == 0 && i + 1 < argc && n_wrk_env < 6)
            g_wrk_env[n_wrk_env++] = argv[++i];
        else if (strcmp(argv[i], "--worker-credits") == 0 && i + 1 < argc)
            g_credits = atoi(argv[++i]);
        else if (strcmp(argv[i], "--instances") == 0 && i + 1 < argc)
            only_n = atoi(argv[++i]);
        else if (strcmp(argv[i], "--unix") == 0)
            g_unix = true;
        else if (strcmp(argv[i], "--lifecycle-bin") == 0 && i + 1 < argc)
            g_lc_bin = argv[++i];
        else
            DIE("unknown option %s (--quick, --no-tier1, --cold-only, --calls-only, --serving "
                "[--model NAME] "
                "[--reps N] [--instances N] [--worker-credits N] [--controller-env NAME=VALUE] "
                "[--worker-env NAME=VALUE], --lifecycle-bin PATH, --unix)",
                argv[i]);
    }
    if (reps <= 0) reps = quick ? 3 : 7;
    setvbuf(stdout, NULL, _IOLBF, 0); // results appear as they are measured
    pie_status st;
    char *dir = pie_proc_tmpdir(&st);
    if (dir == NULL) DIE("%s", st.msg);
    cluster_start(dir, serving || tier1, serving ? model : NULL);
    if (serving)
        main_serving(model, reps, only_n);
    else
        main_lifecycle(quick, tier1, cold_only, calls_only);
    cluster_stop();
    char cmd[4300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "bench_lifecycle: could not remove %s\n", dir);
    free(dir);
    return 0;
}
