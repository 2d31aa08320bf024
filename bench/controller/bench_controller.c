/* bench_controller.c — the control layer end to end: a real pie-controller and a real
 * pie-worker (backend null by default: well-formed results, no compute, so what is measured is
 * the control plane; or backend cpu with tools/tinymodel's tiny-f32) on loopback, driven over
 * the Session stream by this program acting as one lifecycle replica.
 *
 * Modes (--mode, default all):
 *   latency     one instance, one decode step at a time (embed_text, forward appending one
 *               token, next_dist): round trip p50 / p99 from sending the SessionUp to receiving
 *               the distribution.
 *   throughput  N concurrent instances (--instances, default 1,16,64,256), closed loop: an
 *               instance sends its next step as soon as its distribution arrives; the replica
 *               coalesces whatever is ready into one SessionUp, as a lifecycle replica does.
 *               Decode steps per second.
 *   strategies  the same at 128 instances under each scheduler.strategy (work_conserving,
 *               eager, k_only with several k, t_only with several t), one fresh controller each.
 *   memory      10,000 instances x 100 KV pages = 1,000,000 virtual pages; the controller's
 *               resident memory (VmRSS / VmHWM from /proc) before and after.
 *   soak        launch / finish cycles (64 instances each: allocate, prefill, a few decode
 *               steps, end) for --soak-seconds; controller RSS sampled every second.
 * Options: --seconds S (measured time per run, default 3), --backend null|cpu, --top-k K
 * (next_dist k; 0 = the model's default), --quick (shorter runs), --soak-seconds S (10),
 * --ctl-threads N (the controller's completion-queue threads, server.threads; default 1),
 * --worker-credits N (the worker's batch.credits: steps it accepts at once; default 2, the
 * worker's default).
 * --device-us B,T (backend null: an emulated device, a forward batch of n tokens takes
 * B + n*T microseconds, sleeping, as a GPU step costs time but no host core; default 0,0).
 * --replicas R (throughput / strategies: the instances spread over R Session streams, one
 * thread each, default 1). Each replica starts its instances in one SessionUp.
 * --only LIST (strategies: only the configurations named, comma-separated, as printed:
 * "work_conserving", "eager", "k_only K=16", "t_only T=200", ...), --repeat N (strategies: the
 * whole list N times over, interleaved, so that a loaded machine's drift hits every
 * configuration alike; default 1), --think-us MEAN (throughput / strategies: after each result
 * an instance waits an exponential think time of that mean, capped at 10x, from a fixed seed per
 * replica, before its next step — real inferlets do CPU work between steps and are not in
 * lockstep; default 0: the next step goes out the moment the result arrives).
 * --cpus BENCH/CTL/WRK (CPU lists, e.g. 0/0/0 or 0/1/1: where this program, the controller and
 * the worker run; default: wherever the scheduler puts them — on a 2-vCPU VM the latency is
 * bimodal with that placement, see bench/results/controller.md).
 * Binaries are taken from <this program's dir>/../bin, models from ../models. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <time.h>
#include <unistd.h>

#include "pie/v1/controller.pb-c.h"
#include "rpc.h"

#define PAGE           16
#define PAGES_PER_INST 8

/* Bench-only globals: set once from the command line in main, read by the modes. */
static char g_bin[PATH_MAX + 16], g_models[PATH_MAX + 16];
static const char *g_backend = "null";
static uint32_t g_top_k = 0;
static double g_seconds = 3.0;
static char g_ctl_threads[64] =
    "PIE_SERVER_THREADS=1"; /* completion-queue threads of the controller */
static char g_wrk_credits[64] = "PIE_BATCH_CREDITS=2"; /* steps the worker accepts at once */
static char g_dev_batch[64] = "PIE_NULL_BATCH_US=0", g_dev_token[64] = "PIE_NULL_TOKEN_US=0";
static struct rpc_channel *g_status_ch;
static uint32_t g_replicas = 1;
static const char *g_only;    /* strategies: comma-separated labels to run (NULL: all) */
static uint32_t g_repeat = 1; /* strategies: passes over the list */
static double g_think_us = 0; /* mean think time between a result and the next step (0: none) */
/* --cpus: where the controller and the worker may run (empty set: anywhere). */
static cpu_set_t g_ctl_cpus, g_wrk_cpus;
/* --unix: the controller listens on a Unix socket (its port's number names it: ctl_target). */
static bool g_unix;
/* lifecycle replicas (Session streams, one thread each) */ /* the running cluster's controller,
                                                               for worker counters */

static int64_t now_ns(void) { return rpc_now_ns(); }

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "bench_controller: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(1);
}

/* A CPU list ("0", "0-3", "0,2-3") into set; false when it names no CPU or is malformed. */
static bool parse_cpu_list(const char *list, cpu_set_t *set) {
    CPU_ZERO(set);
    const char *p = list;
    while (*p) {
        char *end;
        long lo = strtol(p, &end, 10), hi = lo;
        if (end == p || lo < 0) return false;
        p = end;
        if (*p == '-') {
            hi = strtol(p + 1, &end, 10);
            if (end == p + 1 || hi < lo) return false;
            p = end;
        }
        if (hi >= CPU_SETSIZE) return false;
        for (long c = lo; c <= hi; c++) CPU_SET((int)c, set);
        if (*p == ',')
            p++;
        else if (*p)
            return false;
    }
    return CPU_COUNT(set) > 0;
}

/* --cpus BENCH/CTL/WRK: this program (the lifecycle replicas' stand-in) pinned now, before gRPC
 * starts its threads (they inherit it); the controller and the worker when spawned. Cross-vCPU
 * wake-ups are what a control-plane step pays most for on a VM (bench/results/controller.md),
 * so the placement must be stated, not left to the scheduler. */
static void parse_cpus_option(const char *arg) {
    char parts[3][64];
    if (sscanf(arg, "%63[^/]/%63[^/]/%63s", parts[0], parts[1], parts[2]) != 3)
        die("--cpus %s: want BENCH/CTL/WRK, each a CPU list such as 0 or 0-1", arg);
    cpu_set_t self;
    if (!parse_cpu_list(parts[0], &self) || !parse_cpu_list(parts[1], &g_ctl_cpus) ||
        !parse_cpu_list(parts[2], &g_wrk_cpus))
        die("--cpus %s: each part must be a CPU list such as 0, 0-1 or 0,2", arg);
    if (sched_setaffinity(0, sizeof self, &self) != 0)
        die("--cpus %s: sched_setaffinity: %s", arg, strerror(errno));
}

/* ---- processes ----------------------------------------------------------------------------- */

/* The controller's address for port: its listen address and how clients dial it (--unix: a
 * socket named after the port, else loopback TCP). */
static void ctl_target(int port, char *out, size_t n) {
    if (g_unix)
        snprintf(out, n, "unix:/tmp/bench_controller.%d.sock", port);
    else
        snprintf(out, n, "127.0.0.1:%d", port);
}

typedef struct proc {
    pid_t pid;
    int port;
    char log[PATH_MAX];
} proc;

static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    int port = -1;
    if (bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    close(fd);
    return port;
}

extern char **environ;

/* Starts bin with the environment minus PIE_* plus extra (NULL-terminated). */
static void spawn(proc *p, const char *bin, const char *const *extra) {
    p->port = free_port();
    if (p->port < 0) die("no free port");
    snprintf(p->log, sizeof p->log, "/tmp/bench_controller.%d.%s.log", (int)getpid(), bin);
    char listen[128], addr[64], path[PATH_MAX + 96];
    if (strcmp(bin, "pie-controller") == 0)
        ctl_target(p->port, addr, sizeof addr);
    else
        snprintf(addr, sizeof addr, "127.0.0.1:%d", p->port);
    snprintf(listen, sizeof listen, "PIE_SERVER_LISTEN=%s", addr);
    snprintf(path, sizeof path, "%s/%s", g_bin, bin);
    char *env[256];
    size_t n = 0;
    for (char **e = environ; *e && n < 200; e++)
        if (strncmp(*e, "PIE_", 4) != 0) env[n++] = *e;
    env[n++] = listen;
    env[n++] = "PIE_METRICS_LISTEN=";
    env[n++] = "PIE_LOG_LEVEL=warn";
    for (size_t i = 0; extra && extra[i] && n < 255; i++) env[n++] = (char *)extra[i];
    env[n] = NULL;
    pid_t pid = fork();
    if (pid < 0) die("fork: %s", strerror(errno));
    if (pid == 0) {
        const cpu_set_t *cpus = strcmp(bin, "pie-worker") == 0 ? &g_wrk_cpus : &g_ctl_cpus;
        if (CPU_COUNT(cpus) > 0 && sched_setaffinity(0, sizeof *cpus, cpus) != 0) _exit(126);
        int fd = open(p->log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        char *argv[] = {path, NULL};
        execve(path, argv, env);
        _exit(127);
    }
    p->pid = pid;
}

static void stop(proc *p) {
    if (p->pid <= 0) return;
    kill(p->pid, SIGTERM);
    for (int i = 0; i < 200; i++) {
        int status;
        if (waitpid(p->pid, &status, WNOHANG) == p->pid) {
            p->pid = 0;
            unlink(p->log);
            return;
        }
        usleep(50000);
    }
    kill(p->pid, SIGKILL);
    waitpid(p->pid, NULL, 0);
    p->pid = 0;
}

/* Resident and peak memory of a process, kB. */
static void proc_mem(pid_t pid, long *rss_kb, long *hwm_kb) {
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    *rss_kb = *hwm_kb = -1;
    if (f == NULL) return;
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "VmRSS:", 6) == 0) *rss_kb = strtol(line + 6, NULL, 10);
        if (strncmp(line, "VmHWM:", 6) == 0) *hwm_kb = strtol(line + 6, NULL, 10);
    }
    fclose(f);
}

/* CPU time (user + system) a process used so far, microseconds. */
static double proc_cpu_us(pid_t pid) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL) return -1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    char *p = strrchr(buf, ')'); /* after the command name */
    if (p == NULL) return -1;
    unsigned long utime = 0, stime = 0;
    /* fields after ')': state(3) ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
     * utime(14) stime(15) */
    if (sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &utime, &stime) != 2)
        return -1;
    return (double)(utime + stime) * 1e6 / (double)sysconf(_SC_CLK_TCK);
}

static rpc_channel *channel(int port) {
    char target[64];
    ctl_target(port, target, sizeof target);
    rpc_channel_opts o = {.max_recv_bytes = 64 << 20,
                          .max_send_bytes = 64 << 20,
                          .reconnect_initial_ms = 20,
                          .reconnect_max_ms = 100};
    pie_status st;
    rpc_channel *ch = rpc_channel_create(target, &o, &st);
    if (ch == NULL) die("channel: %s", st.msg);
    return ch;
}

static Pie__V1__ClusterStatusResponse *cluster_status(rpc_channel *ch) {
    Pie__V1__ClusterStatusRequest req = PIE__V1__CLUSTER_STATUS_REQUEST__INIT;
    rpc_call_opts co = {.timeout_ms = 5000};
    ProtobufCMessage *out = NULL;
    pie_status st;
    if (rpc_unary(ch, "/pie.v1.Controller/ClusterStatus", &req.base,
                  &pie__v1__cluster_status_response__descriptor, &out, &co, &st) != PIE_OK)
        return NULL;
    return (Pie__V1__ClusterStatusResponse *)out;
}

typedef struct cluster {
    proc ctl, wrk;
    rpc_channel *ch;
} cluster;

/* A controller with extra config and one worker (kv_pages, embed_slots) linked to it. */
static void cluster_start(cluster *c, const char *const *ctl_env, uint32_t kv_pages, uint32_t emb) {
    memset(c, 0, sizeof *c);
    const char *base[16] = {"PIE_SERVER_MAX_MESSAGE=64MiB", g_ctl_threads};
    size_t n = 2;
    for (size_t i = 0; ctl_env && ctl_env[i] && n < 15; i++) base[n++] = ctl_env[i];
    base[n] = NULL;
    spawn(&c->ctl, "pie-controller", base);
    c->ch = channel(c->ctl.port);
    int64_t deadline = now_ns() + 20000000000LL;
    for (;;) {
        rpc_health_status hs;
        pie_status st;
        if (rpc_health_check(c->ch, "", 1000, &hs, &st) == PIE_OK && hs == RPC_HEALTH_SERVING)
            break;
        if (now_ns() > deadline) die("the controller did not start (log %s)", c->ctl.log);
        usleep(20000);
    }
    char addr[128], pages[64], embs[64], model_path[PATH_MAX + 64], backend[32];
    char target[64];
    ctl_target(c->ctl.port, target, sizeof target);
    snprintf(addr, sizeof addr, "PIE_CONTROLLER_ADDRESS=%s", target);
    snprintf(pages, sizeof pages, "PIE_POOL_KV_PAGES=%u", kv_pages);
    snprintf(embs, sizeof embs, "PIE_POOL_EMBED_SLOTS=%u", emb);
    snprintf(backend, sizeof backend, "PIE_BACKEND=%s", g_backend);
    snprintf(model_path, sizeof model_path, "PIE_MODEL_PATH=%s/tiny-f32", g_models);
    bool cpu = strcmp(g_backend, "cpu") == 0;
    const char *wenv[] = {addr,
                          pages,
                          embs,
                          backend,
                          cpu ? model_path : "PIE_MODEL_NAME=null-llama",
                          "PIE_WORKER_GROUP_ID=bench-w1",
                          "PIE_SERVER_MAX_MESSAGE=64MiB",
                          g_wrk_credits,
                          g_dev_batch,
                          g_dev_token,
                          "PIE_CONTROLLER_RECONNECT_INITIAL=20ms",
                          "PIE_CONTROLLER_RECONNECT_MAX=100ms",
                          NULL};
    spawn(&c->wrk, "pie-worker", wenv);
    g_status_ch = c->ch;
    for (;;) {
        Pie__V1__ClusterStatusResponse *s = cluster_status(c->ch);
        bool ok = s && s->n_workers == 1;
        if (s) rpc_msg_free(&s->base);
        if (ok) break;
        if (now_ns() > deadline) die("the worker did not link (log %s)", c->wrk.log);
        usleep(20000);
    }
}

static void cluster_stop(cluster *c) {
    g_status_ch = NULL;
    rpc_channel_destroy(c->ch);
    stop(&c->wrk);
    stop(&c->ctl);
}

/* ---- the replica -------------------------------------------------------------------------------
 */

typedef struct replica {
    rpc_stream *s;
    uint32_t index;
    char model[128];
    uint32_t vocab;
    uint64_t next_call;
} replica;

static void replica_open(replica *r, rpc_channel *ch) {
    memset(r, 0, sizeof *r);
    pie_status st;
    r->s = rpc_stream_open(ch, "/pie.v1.Controller/Session", &pie__v1__session_down__descriptor,
                           NULL, &st);
    if (r->s == NULL) die("session: %s", st.msg);
    Pie__V1__SessionHello h = PIE__V1__SESSION_HELLO__INIT;
    h.replica_id = "bench";
    h.version = "pie-c/0.1.0";
    Pie__V1__SessionUp up = PIE__V1__SESSION_UP__INIT;
    up.hello = &h;
    if (rpc_stream_send(r->s, &up.base, &st) != PIE_OK) die("hello: %s", st.msg);
    while (r->index == 0 || r->model[0] == '\0') {
        ProtobufCMessage *m;
        if (rpc_stream_recv(r->s, &m, 10000) != RPC_RECV_MESSAGE) die("no welcome");
        Pie__V1__SessionDown *d = (Pie__V1__SessionDown *)m;
        if (d->welcome) r->index = d->welcome->replica_index;
        for (size_t i = 0; i < d->n_events; i++)
            if (d->events[i]->event_case == PIE__V1__SESSION_EVENT__EVENT_MODELS_CHANGED &&
                d->events[i]->models_changed->n_models > 0) {
                snprintf(r->model, sizeof r->model, "%s",
                         d->events[i]->models_changed->models[0]->name);
                r->vocab = d->events[i]->models_changed->models[0]->vocab_size;
            }
        rpc_msg_free(m);
    }
}

static void replica_close(replica *r) {
    pie_status st;
    rpc_stream_cancel(r->s);
    rpc_stream_finish(r->s, &st);
    rpc_stream_destroy(r->s);
}

/* A SessionUp under construction: calls and their op messages in growable pools. */
typedef struct up_builder {
    Pie__V1__SessionUp up;
    Pie__V1__ApiCall *calls;
    Pie__V1__ApiCall **cp;
    size_t n_calls, cap_calls;
    Pie__V1__InstanceBegin *begins, **bp;
    Pie__V1__InstanceEnd *ends, **ep;
    size_t n_begins, n_ends, cap_be;
    unsigned char *store;
    size_t used, cap_store;
} up_builder;

static void ub_reset(up_builder *b) {
    b->n_calls = b->n_begins = b->n_ends = 0;
    b->used = 0;
}

static void *ub_alloc(up_builder *b, size_t n) {
    n = (n + 15) & ~(size_t)15;
    if (b->used + n > b->cap_store) die("builder store full (%zu bytes)", b->cap_store);
    void *p = b->store + b->used;
    b->used += n;
    return p;
}

static void ub_init(up_builder *b, size_t max_calls, size_t max_be, size_t store) {
    memset(b, 0, sizeof *b);
    b->cap_calls = max_calls;
    b->calls = calloc(max_calls, sizeof *b->calls);
    b->cp = calloc(max_calls, sizeof *b->cp);
    b->cap_be = max_be;
    b->begins = calloc(max_be, sizeof *b->begins);
    b->bp = calloc(max_be, sizeof *b->bp);
    b->ends = calloc(max_be, sizeof *b->ends);
    b->ep = calloc(max_be, sizeof *b->ep);
    b->cap_store = store;
    b->store = malloc(store);
    if (!b->calls || !b->cp || !b->begins || !b->bp || !b->ends || !b->ep || !b->store) die("oom");
}

static void ub_free(up_builder *b) {
    free(b->calls);
    free(b->cp);
    free(b->begins);
    free(b->bp);
    free(b->ends);
    free(b->ep);
    free(b->store);
}

static Pie__V1__ApiCall *ub_call(replica *r, up_builder *b, uint64_t inst, uint32_t q, int op,
                                 void *msg) {
    if (b->n_calls == b->cap_calls) die("builder: too many calls");
    Pie__V1__ApiCall *c = &b->calls[b->n_calls];
    pie__v1__api_call__init(c);
    c->instance_id = inst;
    c->queue_id = q;
    c->call_id = ++r->next_call;
    c->op_case = op;
    c->create_queue = msg; /* the oneof members share one pointer */
    b->cp[b->n_calls++] = c;
    return c;
}

static void ub_begin(up_builder *b, uint64_t id, const char *model) {
    if (b->n_begins == b->cap_be) die("builder: too many begins");
    Pie__V1__InstanceBegin *x = &b->begins[b->n_begins];
    pie__v1__instance_begin__init(x);
    x->instance_id = id;
    x->program_id = "bench";
    x->model = (char *)model;
    b->bp[b->n_begins++] = x;
}

static void ub_end(up_builder *b, uint64_t id) {
    if (b->n_ends == b->cap_be) die("builder: too many ends");
    Pie__V1__InstanceEnd *x = &b->ends[b->n_ends];
    pie__v1__instance_end__init(x);
    x->instance_id = id;
    b->ep[b->n_ends++] = x;
}

static void ub_send(replica *r, up_builder *b) {
    pie__v1__session_up__init(&b->up);
    b->up.calls = b->cp;
    b->up.n_calls = b->n_calls;
    b->up.begins = b->bp;
    b->up.n_begins = b->n_begins;
    b->up.ends = b->ep;
    b->up.n_ends = b->n_ends;
    pie_status st;
    if (rpc_stream_send(r->s, &b->up.base, &st) != PIE_OK) die("send: %s", st.msg);
    ub_reset(b);
}

#define OP(x) PIE__V1__API_CALL__OP_##x

static uint32_t *ub_u32(up_builder *b, size_t n) {
    return ub_alloc(b, (n ? n : 1) * sizeof(uint32_t));
}

/* Setup of one decode instance: queue 1, pages 0..n_pages-1, embedding 0. */
static void add_setup(replica *r, up_builder *b, uint64_t id, uint32_t n_pages) {
    ub_begin(b, id, r->model);
    Pie__V1__CreateQueue *cq = ub_alloc(b, sizeof *cq);
    pie__v1__create_queue__init(cq);
    ub_call(r, b, id, 1, OP(CREATE_QUEUE), cq);
    Pie__V1__AllocKvPages *ak = ub_alloc(b, sizeof *ak);
    pie__v1__alloc_kv_pages__init(ak);
    ak->kv_page_ids = ub_u32(b, n_pages);
    for (uint32_t i = 0; i < n_pages; i++) ak->kv_page_ids[i] = i;
    ak->n_kv_page_ids = n_pages;
    ub_call(r, b, id, 1, OP(ALLOC_KV_PAGES), ak);
    Pie__V1__AllocEmbeds *ae = ub_alloc(b, sizeof *ae);
    pie__v1__alloc_embeds__init(ae);
    ae->embed_ids = ub_u32(b, 1);
    ae->embed_ids[0] = 0;
    ae->n_embed_ids = 1;
    ub_call(r, b, id, 1, OP(ALLOC_EMBEDS), ae);
}

/* One decode step: the token at `pos` (PAGE <= pos < n_pages * PAGE), appended to the pages.
 * Returns the next_dist call id. */
static uint64_t add_step(replica *r, up_builder *b, uint64_t id, uint32_t pos, uint32_t tok) {
    Pie__V1__EmbedText *et = ub_alloc(b, sizeof *et);
    pie__v1__embed_text__init(et);
    uint32_t *v = ub_u32(b, 3);
    v[0] = 0;
    v[1] = tok;
    v[2] = pos;
    et->embed_ids = &v[0];
    et->token_ids = &v[1];
    et->positions = &v[2];
    et->n_embed_ids = et->n_token_ids = et->n_positions = 1;
    ub_call(r, b, id, 1, OP(EMBED_TEXT), et);
    Pie__V1__Forward *f = ub_alloc(b, sizeof *f);
    pie__v1__forward__init(f);
    uint32_t nctx = (pos + PAGE - 1) / PAGE;
    uint32_t *ctx = ub_u32(b, nctx + 2);
    for (uint32_t i = 0; i < nctx; i++) ctx[i] = i;
    f->kv_page_ids = ctx;
    f->n_kv_page_ids = nctx;
    f->kv_page_last_len = (pos - 1) % PAGE + 1;
    ctx[nctx] = pos / PAGE; /* the last context page (continuing) or a new one */
    ctx[nctx + 1] = 0;
    f->output_kv_page_ids = &ctx[nctx];
    f->n_output_kv_page_ids = 1;
    f->input_embed_ids = &ctx[nctx + 1];
    f->n_input_embed_ids = 1;
    f->output_embed_ids = &ctx[nctx + 1];
    f->n_output_embed_ids = 1;
    ub_call(r, b, id, 1, OP(FORWARD), f);
    Pie__V1__NextDist *d = ub_alloc(b, sizeof *d);
    pie__v1__next_dist__init(d);
    d->embed_ids = &ctx[nctx + 1];
    d->n_embed_ids = 1;
    d->top_k = g_top_k;
    return ub_call(r, b, id, 1, OP(NEXT_DIST), d)->call_id;
}

/* ---- closed-loop decode --------------------------------------------------------------------- */

/* The worker's cumulative batches and items, as last reported in ClusterStatus (its stats come
 * with every step's results and every heartbeat). */
static void worker_counts(uint64_t *batches, uint64_t *items) {
    *batches = *items = 0;
    if (g_status_ch == NULL) return;
    Pie__V1__ClusterStatusResponse *s = cluster_status(g_status_ch);
    if (s && s->n_workers && s->workers[0]->stats) {
        *batches = s->workers[0]->stats->batches;
        *items = s->workers[0]->stats->items;
    }
    if (s) rpc_msg_free(&s->base);
}

typedef struct dstate {
    uint64_t id, pending;
    uint32_t pos;
    int64_t sent_ns;
} dstate;

typedef struct dresult {
    double items_per_batch; /* worker counters over the measured time (all kinds) */
    double steps_per_s;
    double p50_us, p99_us, mean_us;
    uint64_t steps, messages_in;
} dresult;

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static uint32_t next_pos(uint32_t pos) {
    pos++;
    return pos >= PAGES_PER_INST * PAGE ? PAGE : pos; /* wrap: keep appending within the pages */
}

/* ---- think time -------------------------------------------------------------------------------
 * With --think-us, an instance waits a random think time after its result arrives before it
 * issues the next step (an inferlet's sampling, constraint checks, tool calls). The receiving
 * thread draws the time and pushes (due, instance, token) on a min-heap; one sender thread per
 * replica sleeps until the earliest due time (condition variable on CLOCK_MONOTONIC, the clock of
 * now_ns), then sends every step that is due in one SessionUp. So a replica is two threads, not
 * one per instance. */

typedef struct think_item {
    int64_t due_ns;
    uint32_t inst, tok;
} think_item;

typedef struct think_heap {
    think_item *a;
    size_t n, cap;
} think_heap;

static void th_push(think_heap *h, think_item it) {
    if (h->n == h->cap) die("think heap full (%zu items)", h->cap); /* cap = instances */
    size_t i = h->n++;
    while (i > 0 && h->a[(i - 1) / 2].due_ns > it.due_ns) {
        h->a[i] = h->a[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h->a[i] = it;
}

static think_item th_pop(think_heap *h) {
    think_item top = h->a[0], last = h->a[--h->n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= h->n) break;
        if (c + 1 < h->n && h->a[c + 1].due_ns < h->a[c].due_ns) c++;
        if (h->a[c].due_ns >= last.due_ns) break;
        h->a[i] = h->a[c];
        i = c;
    }
    if (h->n) h->a[i] = last;
    return top;
}

/* xorshift64*: a fixed-seed stream per replica, so every strategy sees the same draws. */
static uint64_t rng_next(uint64_t *x) {
    *x ^= *x >> 12;
    *x ^= *x << 25;
    *x ^= *x >> 27;
    return *x * 0x2545F4914F6CDD1DULL;
}

/* Exponential with mean g_think_us, capped at 10x the mean (so no instance sleeps through a
 * whole run), in ns. */
static int64_t think_draw_ns(uint64_t *x) {
    double u = (double)(rng_next(x) >> 11) / 9007199254740992.0; /* [0, 1) */
    double t = -log(1.0 - u) * g_think_us;
    if (t > 10 * g_think_us) t = 10 * g_think_us;
    return (int64_t)(t * 1e3);
}

typedef struct thinker {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    think_heap h;
    bool stop;
    replica *r;
    up_builder *b;
    dstate *st;
    pthread_t th;
} thinker;

/* The sender: sleeps until the earliest due step, sends all that are due in one SessionUp. The
 * call ids are recorded as pending (under mu, which the receiver also takes) before the send, so
 * a result can never arrive before its instance expects it. */
static void *thinker_main(void *arg) {
    thinker *t = arg;
    think_item due[1024];
    pthread_mutex_lock(&t->mu);
    while (!t->stop) {
        if (t->h.n == 0) {
            pthread_cond_wait(&t->cv, &t->mu);
            continue;
        }
        int64_t now = now_ns();
        if (t->h.a[0].due_ns > now) {
            struct timespec ts;
            int64_t at = t->h.a[0].due_ns;
            ts.tv_sec = (time_t)(at / 1000000000);
            ts.tv_nsec = (long)(at % 1000000000);
            int rc = pthread_cond_timedwait(&t->cv, &t->mu, &ts);
            if (rc != 0 && rc != ETIMEDOUT) die("think: pthread_cond_timedwait: %s", strerror(rc));
            continue;
        }
        size_t n = 0;
        while (t->h.n && t->h.a[0].due_ns <= now && n < sizeof due / sizeof due[0])
            due[n++] = th_pop(&t->h);
        pthread_mutex_unlock(&t->mu);
        uint64_t ids[1024];
        for (size_t k = 0; k < n; k++) {
            dstate *d = &t->st[due[k].inst];
            d->pos = next_pos(d->pos); /* only this thread touches pos once thinking is on */
            ids[k] = add_step(t->r, t->b, d->id, d->pos, due[k].tok);
        }
        pthread_mutex_lock(&t->mu);
        int64_t sent = now_ns();
        for (size_t k = 0; k < n; k++) {
            t->st[due[k].inst].pending = ids[k];
            t->st[due[k].inst].sent_ns = sent;
        }
        pthread_mutex_unlock(&t->mu);
        if (t->b->n_calls) ub_send(t->r, t->b);
        pthread_mutex_lock(&t->mu);
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

static void thinker_start(thinker *t, replica *r, up_builder *b, dstate *st, uint32_t n) {
    memset(t, 0, sizeof *t);
    pthread_condattr_t ca;
    if (pthread_condattr_init(&ca) != 0 || pthread_condattr_setclock(&ca, CLOCK_MONOTONIC) != 0 ||
        pthread_cond_init(&t->cv, &ca) != 0 || pthread_mutex_init(&t->mu, NULL) != 0)
        die("think: cannot create the sender's condition variable");
    pthread_condattr_destroy(&ca);
    t->h.a = malloc((size_t)n * sizeof *t->h.a);
    if (t->h.a == NULL) die("oom");
    t->h.cap = n;
    t->r = r;
    t->b = b;
    t->st = st;
    if (pthread_create(&t->th, NULL, thinker_main, t) != 0) die("think: pthread_create");
}

static void thinker_stop(thinker *t) {
    pthread_mutex_lock(&t->mu);
    t->stop = true;
    pthread_cond_signal(&t->cv);
    pthread_mutex_unlock(&t->mu);
    pthread_join(t->th, NULL);
    pthread_cond_destroy(&t->cv);
    pthread_mutex_destroy(&t->mu);
    free(t->h.a);
}

static uint32_t result_token(const Pie__V1__CallResult *res, uint32_t vocab) {
    return res->distributions && res->distributions->n_dists &&
                   res->distributions->dists[0]->n_token_ids
               ? res->distributions->dists[0]->token_ids[0] % (vocab ? vocab : 1)
               : 1;
}

/* The receiver's half with think time: each expected result schedules its instance's next step
 * at now + a think time. Returns the steps completed. */
static uint64_t think_results(thinker *t, const Pie__V1__SessionDown *d, uint32_t n,
                              uint64_t inst_base, int64_t now, uint64_t *seed, int64_t *lat,
                              size_t cap_lat, size_t *n_lat) {
    uint64_t steps = 0;
    pthread_mutex_lock(&t->mu);
    bool wake = false;
    for (size_t k = 0; k < d->n_results; k++) {
        const Pie__V1__CallResult *res = d->results[k];
        uint64_t i = (res->instance_id & 0xFFFFFFFFFFFFull) - inst_base - 1;
        if (i >= n) continue;
        if (res->code != 0)
            die("call %llu failed: %s", (unsigned long long)res->call_id, res->message);
        if (res->call_id != t->st[i].pending) continue;
        steps++;
        if (*n_lat < cap_lat) lat[(*n_lat)++] = now - t->st[i].sent_ns;
        t->st[i].pending = 0;
        int64_t due = now + think_draw_ns(seed);
        wake |= t->h.n == 0 || due < t->h.a[0].due_ns;
        th_push(&t->h, (think_item){due, (uint32_t)i, result_token(res, t->r->vocab)});
    }
    if (wake) pthread_cond_signal(&t->cv);
    pthread_mutex_unlock(&t->mu);
    return steps;
}

/* n instances decode in a closed loop: for `seconds` after `warm_s`, or (steps_each > 0) until
 * each has done steps_each steps. Ends the instances. */
static dresult run_decode(replica *r, uint32_t n, double warm_s, double seconds, uint64_t inst_base,
                          uint32_t steps_each) {
    dstate *st = calloc(n, sizeof *st);
    size_t cap_lat = 1 << 22, n_lat = 0;
    int64_t *lat = malloc(cap_lat * sizeof *lat);
    up_builder b;
    ub_init(&b, (size_t)n * 8 + 16, (size_t)n + 1, (size_t)n * 1024 + 65536);
    if (!st || !lat) die("oom");
    for (uint32_t i = 0; i < n; i++) {
        st[i].id = ((uint64_t)r->index << 48) | (inst_base + i + 1);
        st[i].pos = PAGE;
        add_setup(r, &b, st[i].id, PAGES_PER_INST);
        st[i].pending = add_step(r, &b, st[i].id, st[i].pos, 1);
        st[i].sent_ns = now_ns();
        if (b.n_calls + 8 > b.cap_calls || b.used + 4096 > b.cap_store) ub_send(r, &b);
    }
    if (b.n_calls) ub_send(r, &b);
    /* Think time only in the timed runs: the soak's fixed step counts keep the old loop. */
    bool think = g_think_us > 0 && steps_each == 0;
    thinker tk;
    uint64_t seed = 0x9E3779B97F4A7C15ULL ^ ((uint64_t)r->index * 0xD1B54A32D192ED03ULL);
    if (think) thinker_start(&tk, r, &b, st, n);
    int64_t t0 = now_ns(), t_measure = t0 + (int64_t)(warm_s * 1e9),
            t_end = steps_each ? t0 + 120000000000LL : t_measure + (int64_t)(seconds * 1e9);
    uint64_t steps = 0, msgs = 0, done_each = 0, *count = calloc(n, sizeof *count);
    uint64_t b0 = 0, i0 = 0, b1, i1;
    bool measuring = steps_each > 0;
    if (count == NULL) die("oom");
    while (now_ns() < t_end && (!steps_each || done_each < n)) {
        ProtobufCMessage *m;
        rpc_recv_result rr = rpc_stream_recv(r->s, &m, 1000);
        if (rr == RPC_RECV_TIMEOUT) continue;
        if (rr != RPC_RECV_MESSAGE) die("session ended");
        int64_t now = now_ns();
        if (!measuring && now >= t_measure) {
            measuring = true;
            t_measure = now;
            steps = 0;
            n_lat = 0;
            msgs = 0;
            worker_counts(&b0, &i0);
        }
        msgs++;
        Pie__V1__SessionDown *d = (Pie__V1__SessionDown *)m;
        if (think) {
            steps += think_results(&tk, d, n, inst_base, now, &seed, lat, cap_lat, &n_lat);
            rpc_msg_free(m);
            continue;
        }
        for (size_t k = 0; k < d->n_results; k++) {
            const Pie__V1__CallResult *res = d->results[k];
            uint64_t i = (res->instance_id & 0xFFFFFFFFFFFFull) - inst_base - 1;
            if (i >= n) continue;
            if (res->code != 0)
                die("call %llu failed: %s", (unsigned long long)res->call_id, res->message);
            if (res->call_id != st[i].pending) continue;
            steps++;
            if (n_lat < cap_lat) lat[n_lat++] = now - st[i].sent_ns;
            if (steps_each && ++count[i] >= steps_each) {
                done_each++;
                st[i].pending = 0;
                continue;
            }
            uint32_t tok =
                res->distributions && res->distributions->n_dists &&
                        res->distributions->dists[0]->n_token_ids
                    ? res->distributions->dists[0]->token_ids[0] % (r->vocab ? r->vocab : 1)
                    : 1;
            st[i].pos = next_pos(st[i].pos);
            st[i].pending = add_step(r, &b, st[i].id, st[i].pos, tok);
            st[i].sent_ns = now;
        }
        rpc_msg_free(m);
        if (b.n_calls) ub_send(r, &b);
    }
    int64_t elapsed = now_ns() - t_measure;
    if (think) thinker_stop(&tk); /* the builder is this thread's again */
    worker_counts(&b1, &i1);
    /* End the instances; drain what is in flight. */
    for (uint32_t i = 0; i < n; i++) {
        ub_end(&b, st[i].id);
        if (b.n_ends == b.cap_be) ub_send(r, &b);
    }
    if (b.n_ends) ub_send(r, &b);
    ProtobufCMessage *m;
    while (rpc_stream_recv(r->s, &m, steps_each ? 0 : 200) == RPC_RECV_MESSAGE) rpc_msg_free(m);
    free(count);
    dresult out = {0};
    out.items_per_batch = b1 > b0 ? (double)(i1 - i0) / (double)(b1 - b0) : 0;
    out.steps = steps;
    out.messages_in = msgs;
    out.steps_per_s = elapsed > 0 ? (double)steps * 1e9 / (double)elapsed : 0;
    if (n_lat) {
        qsort(lat, n_lat, sizeof *lat, cmp_i64);
        double sum = 0;
        for (size_t i = 0; i < n_lat; i++) sum += (double)lat[i];
        out.p50_us = (double)lat[n_lat / 2] / 1e3;
        out.p99_us = (double)lat[n_lat * 99 / 100] / 1e3;
        out.mean_us = sum / (double)n_lat / 1e3;
    }
    ub_free(&b);
    free(st);
    free(lat);
    return out;
}

/* n instances split over g_replicas Session streams, each driven by its own thread: arrivals
 * at the controller are then not one synchronized burst, as in a cluster of replicas. */
typedef struct rjob {
    rpc_channel *ch;
    uint32_t n;
    double warm_s, seconds;
    dresult out;
} rjob;

static void *rjob_main(void *arg) {
    rjob *j = arg;
    replica r;
    replica_open(&r, j->ch);
    j->out = run_decode(&r, j->n, j->warm_s, j->seconds, 0, 0);
    replica_close(&r);
    return NULL;
}

static dresult run_decode_replicas(rpc_channel *ch, uint32_t n, double warm_s, double seconds) {
    uint32_t k = g_replicas ? g_replicas : 1;
    rjob jobs[64];
    pthread_t th[64];
    if (k > 64) k = 64;
    for (uint32_t i = 0; i < k; i++) {
        jobs[i] = (rjob){ch, n / k + (i < n % k), warm_s, seconds, {0}};
        if (pthread_create(&th[i], NULL, rjob_main, &jobs[i]) != 0) die("pthread_create");
    }
    dresult sum = {0};
    for (uint32_t i = 0; i < k; i++) {
        pthread_join(th[i], NULL);
        sum.steps_per_s += jobs[i].out.steps_per_s;
        sum.steps += jobs[i].out.steps;
        sum.messages_in += jobs[i].out.messages_in;
        sum.p50_us += jobs[i].out.p50_us / k;
        sum.p99_us = jobs[i].out.p99_us > sum.p99_us ? jobs[i].out.p99_us : sum.p99_us;
        sum.mean_us += jobs[i].out.mean_us / k;
        sum.items_per_batch += jobs[i].out.items_per_batch / k;
    }
    return sum;
}

/* A one-byte round trip between two threads over pipes: the machine's wake-up floor. */
static int pipe_a[2], pipe_b[2];
static void *echo_main(void *arg) {
    (void)arg;
    char c;
    while (read(pipe_a[0], &c, 1) == 1)
        if (write(pipe_b[1], &c, 1) != 1) break;
    return NULL;
}

static double pipe_rtt_us(void) {
    if (pipe(pipe_a) != 0 || pipe(pipe_b) != 0) return -1;
    pthread_t t;
    pthread_create(&t, NULL, echo_main, NULL);
    int64_t lat[2000];
    for (int i = 0; i < 2000; i++) {
        char c = 'x';
        int64_t t0 = now_ns();
        if (write(pipe_a[1], &c, 1) != 1 || read(pipe_b[0], &c, 1) != 1) break;
        lat[i] = now_ns() - t0;
    }
    close(pipe_a[1]);
    pthread_join(t, NULL);
    close(pipe_a[0]);
    close(pipe_b[0]);
    close(pipe_b[1]);
    qsort(lat, 2000, sizeof lat[0], cmp_i64);
    return (double)lat[1000] / 1e3;
}

/* ---- modes ------------------------------------------------------------------------------------
 */

static void mode_latency(void) {
    cluster c;
    cluster_start(&c, NULL, 256, 256);
    replica r;
    replica_open(&r, c.ch);
    double c0 = proc_cpu_us(c.ctl.pid), w0 = proc_cpu_us(c.wrk.pid);
    dresult d = run_decode(&r, 1, 0.5, g_seconds, 0, 0);
    double c1 = proc_cpu_us(c.ctl.pid), w1 = proc_cpu_us(c.wrk.pid);
    /* CPU per step counts the warm-up's steps too: an estimate. */
    double steps_all = d.steps * (1 + 0.5 / g_seconds);
    printf("latency  backend=%s top_k=%u  1 instance: decode step p50 %.1f us, p99 %.1f us, mean "
           "%.1f us (%llu steps; pipe floor %.1f us; CPU per step: controller ~%.0f us, worker "
           "~%.0f us)\n",
           g_backend, g_top_k, d.p50_us, d.p99_us, d.mean_us, (unsigned long long)d.steps,
           pipe_rtt_us(), (c1 - c0) / steps_all, (w1 - w0) / steps_all);
    replica_close(&r);
    cluster_stop(&c);
}

static void mode_throughput(const uint32_t *ns, size_t k) {
    for (size_t i = 0; i < k; i++) {
        cluster c;
        cluster_start(&c, NULL, ns[i] * PAGES_PER_INST + 64, ns[i] + 64);
        dresult d = run_decode_replicas(c.ch, ns[i], 1.0, g_seconds);
        long rss, hwm;
        proc_mem(c.ctl.pid, &rss, &hwm);
        printf("throughput backend=%s top_k=%u replicas=%u %4u instances: %8.0f decode steps/s, "
               "step p50 %.0f "
               "us p99 %.0f us, %.1f steps per SessionDown, %.1f items per batch, controller RSS "
               "%ld kB\n",
               g_backend, g_top_k, g_replicas, ns[i], d.steps_per_s, d.p50_us, d.p99_us,
               d.messages_in ? (double)d.steps / (double)d.messages_in : 0, d.items_per_batch, rss);
        fflush(stdout);
        cluster_stop(&c);
    }
}

/* Whether label is in --only (every label when it is not given). */
static bool label_listed(const char *label) {
    if (g_only == NULL) return true;
    size_t n = strlen(label);
    for (const char *p = g_only; *p;) {
        const char *e = strchr(p, ',');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        if (len == n && strncmp(p, label, n) == 0) return true;
        if (!e) break;
        p = e + 1;
    }
    return false;
}

/* This process's CPU time (all threads), us. */
static double self_cpu_us(void) {
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0) return 0;
    return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1e6 +
           (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

static void mode_strategies(uint32_t n) {
    const char *confs[][3] = {
        {"PIE_SCHEDULER_STRATEGY=work_conserving", NULL, NULL},
        {"PIE_SCHEDULER_STRATEGY=eager", NULL, NULL},
        {"PIE_SCHEDULER_STRATEGY=k_only", "PIE_SCHEDULER_K=16", NULL},
        {"PIE_SCHEDULER_STRATEGY=k_only", "PIE_SCHEDULER_K=64", NULL},
        {"PIE_SCHEDULER_STRATEGY=k_only", "PIE_SCHEDULER_K=128", NULL},
        {"PIE_SCHEDULER_STRATEGY=t_only", "PIE_SCHEDULER_T=200", NULL},
        {"PIE_SCHEDULER_STRATEGY=t_only", "PIE_SCHEDULER_T=1000", NULL},
        {"PIE_SCHEDULER_STRATEGY=t_only", "PIE_SCHEDULER_T=5000", NULL},
        {"PIE_SCHEDULER_STRATEGY=work_conserving", NULL, NULL}, /* again: order effects */
    };
    const size_t n_confs = sizeof confs / sizeof confs[0];
    for (size_t pass = 0; pass < g_repeat * n_confs; pass++) {
        size_t i = pass % n_confs;
        char label[64];
        snprintf(label, sizeof label, "%s%s%s", confs[i][0] + 23, confs[i][1] ? " " : "",
                 confs[i][1] ? confs[i][1] + 14 : "");
        if (!label_listed(label)) continue;
        if (g_only && i == n_confs - 1) continue; /* the order-effect repeat: --repeat does it */
        cluster c;
        cluster_start(&c, confs[i], n * PAGES_PER_INST + 64, n + 64);
        double b0 = self_cpu_us(), c0 = proc_cpu_us(c.ctl.pid), w0 = proc_cpu_us(c.wrk.pid);
        int64_t t0 = now_ns();
        dresult d = run_decode_replicas(c.ch, n, 1.0, g_seconds);
        double wall = (double)(now_ns() - t0) / 1e3; /* us, warm-up and setup included */
        double b1 = self_cpu_us(), c1 = proc_cpu_us(c.ctl.pid), w1 = proc_cpu_us(c.wrk.pid);
        printf("strategy backend=%s device=%s,%sus %s replicas=%u think=%.0fus %u instances %-16s "
               "%-6s %8.0f "
               "steps/s, step p50 %.0f us p99 %.0f us, %.1f items per batch, %.1f steps per "
               "SessionDown, CPU %% of a core: bench %.0f controller %.0f worker %.0f\n",
               g_backend, g_dev_batch + 18, g_dev_token + 18, g_wrk_credits + 4, g_replicas,
               g_think_us, n, confs[i][0] + 23, confs[i][1] ? confs[i][1] + 14 : "", d.steps_per_s,
               d.p50_us, d.p99_us, d.items_per_batch,
               d.messages_in ? (double)d.steps / (double)d.messages_in : 0, 100 * (b1 - b0) / wall,
               100 * (c1 - c0) / wall, 100 * (w1 - w0) / wall);
        fflush(stdout);
        cluster_stop(&c);
    }
}

static void mode_memory(uint32_t n_inst, uint32_t pages) {
    const char *saved = g_backend;
    g_backend = "null";
    cluster c;
    cluster_start(&c, NULL, n_inst * pages + 1024, 64);
    replica r;
    replica_open(&r, c.ch);
    long rss0, hwm0;
    proc_mem(c.ctl.pid, &rss0, &hwm0);
    up_builder b;
    ub_init(&b, 256, 64, 1 << 20);
    int64_t t0 = now_ns();
    for (uint32_t i = 0; i < n_inst; i++) {
        uint64_t id = ((uint64_t)r.index << 48) | (i + 1);
        ub_begin(&b, id, r.model);
        Pie__V1__CreateQueue *cq = ub_alloc(&b, sizeof *cq);
        pie__v1__create_queue__init(cq);
        ub_call(&r, &b, id, 1, OP(CREATE_QUEUE), cq);
        Pie__V1__AllocKvPages *ak = ub_alloc(&b, sizeof *ak);
        pie__v1__alloc_kv_pages__init(ak);
        ak->kv_page_ids = ub_u32(&b, pages);
        for (uint32_t k = 0; k < pages; k++) ak->kv_page_ids[k] = k * 7 + 3; /* any ids */
        ak->n_kv_page_ids = pages;
        ub_call(&r, &b, id, 1, OP(ALLOC_KV_PAGES), ak);
        if (b.n_begins == 50) ub_send(&r, &b);
    }
    /* list_exports answers at once, after everything sent before it. */
    Pie__V1__ListExports *le = ub_alloc(&b, sizeof *le);
    pie__v1__list_exports__init(le);
    uint64_t last =
        ub_call(&r, &b, ((uint64_t)r.index << 48) | 1, 0, OP(LIST_EXPORTS), le)->call_id;
    ub_send(&r, &b);
    for (bool done = false; !done;) {
        ProtobufCMessage *m;
        if (rpc_stream_recv(r.s, &m, 60000) != RPC_RECV_MESSAGE) die("memory: no answer");
        Pie__V1__SessionDown *d = (Pie__V1__SessionDown *)m;
        for (size_t k = 0; k < d->n_results; k++) {
            if (d->results[k]->call_id == last)
                done = true;
            else if (d->results[k]->code)
                die("memory: %s", d->results[k]->message);
        }
        rpc_msg_free(m);
    }
    double setup_s = (double)(now_ns() - t0) / 1e9;
    /* Let the slot changes drain to the worker, then read status and memory. */
    uint64_t used = 0;
    for (int tries = 0; tries < 600; tries++) {
        Pie__V1__ClusterStatusResponse *s = cluster_status(c.ch);
        if (s && s->n_workers) used = s->workers[0]->kv_pages_used;
        bool drained = s && s->n_workers && s->workers[0]->batches_in_flight == 0;
        if (s) rpc_msg_free(&s->base);
        if (drained) break;
        usleep(100000);
    }
    long rss1, hwm1;
    proc_mem(c.ctl.pid, &rss1, &hwm1);
    printf("memory  %u instances x %u pages = %llu virtual pages (kv_pages_used %llu) in %.2f s: "
           "controller RSS %ld kB -> %ld kB (+%.1f MiB), peak %ld kB (%.1f MiB)\n",
           n_inst, pages, (unsigned long long)n_inst * pages, (unsigned long long)used, setup_s,
           rss0, rss1, (double)(rss1 - rss0) / 1024.0, hwm1, (double)hwm1 / 1024.0);
    ub_free(&b);
    replica_close(&r);
    cluster_stop(&c);
    g_backend = saved;
}

static void mode_soak(double seconds) {
    const uint32_t batch = 64, steps = 4;
    cluster c;
    cluster_start(&c, NULL, batch * PAGES_PER_INST + 64, batch + 64);
    replica r;
    replica_open(&r, c.ch);
    int64_t t0 = now_ns(), t_end = t0 + (int64_t)(seconds * 1e9), next_sample = t0;
    uint64_t cycles = 0, base = 0;
    long first_rss = -1, last_rss = -1, max_rss = 0;
    printf("soak  cycles of %u instances (setup, %u decode steps each, end) for %.0f s\n", batch,
           steps, seconds);
    while (now_ns() < t_end) {
        dresult d = run_decode(&r, batch, 0, 0, base, steps);
        if (d.steps != (uint64_t)batch * steps)
            die("soak: %llu steps of %u", (unsigned long long)d.steps, batch * steps);
        base += batch;
        cycles++;
        if (now_ns() >= next_sample) {
            long rss, hwm;
            proc_mem(c.ctl.pid, &rss, &hwm);
            if (first_rss < 0 && now_ns() - t0 > 1000000000LL) first_rss = rss;
            last_rss = rss;
            if (rss > max_rss) max_rss = rss;
            printf("soak  t=%5.1f s cycles=%llu instances=%llu controller RSS %ld kB\n",
                   (double)(now_ns() - t0) / 1e9, (unsigned long long)cycles,
                   (unsigned long long)base, rss);
            fflush(stdout);
            next_sample += 1000000000LL;
        }
    }
    printf("soak  done: %llu cycles, %llu instances launched and ended; RSS after 1 s %ld kB, at "
           "the end %ld kB, max %ld kB\n",
           (unsigned long long)cycles, (unsigned long long)base, first_rss, last_rss, max_rss);
    replica_close(&r);
    cluster_stop(&c);
}

int main(int argc, char **argv) {
    const char *mode = "all";
    double soak_s = 10;
    uint32_t ns[16] = {1, 16, 64, 256};
    size_t n_ns = 4;
    bool quick = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--mode") && i + 1 < argc)
            mode = argv[++i];
        else if (!strcmp(argv[i], "--seconds") && i + 1 < argc)
            g_seconds = atof(argv[++i]);
        else if (!strcmp(argv[i], "--soak-seconds") && i + 1 < argc)
            soak_s = atof(argv[++i]);
        else if (!strcmp(argv[i], "--backend") && i + 1 < argc)
            g_backend = argv[++i];
        else if (!strcmp(argv[i], "--top-k") && i + 1 < argc)
            g_top_k = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--quick"))
            quick = true;
        else if (!strcmp(argv[i], "--ctl-threads") && i + 1 < argc)
            snprintf(g_ctl_threads, sizeof g_ctl_threads, "PIE_SERVER_THREADS=%d", atoi(argv[++i]));
        else if (!strcmp(argv[i], "--only") && i + 1 < argc)
            g_only = argv[++i];
        else if (!strcmp(argv[i], "--repeat") && i + 1 < argc) {
            int r = atoi(argv[++i]);
            g_repeat = r > 0 ? (uint32_t)r : 1;
        } else if (!strcmp(argv[i], "--think-us") && i + 1 < argc) {
            g_think_us = atof(argv[++i]);
            if (!(g_think_us >= 0 && g_think_us <= 1e7))
                die("--think-us %s: want a mean in microseconds, 0 to 10000000", argv[i]);
        } else if (!strcmp(argv[i], "--replicas") && i + 1 < argc)
            g_replicas = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--device-us") && i + 1 < argc) {
            unsigned b, t;
            if (sscanf(argv[++i], "%u,%u", &b, &t) != 2)
                die("--device-us %s: want BATCH_US,TOKEN_US", argv[i]);
            snprintf(g_dev_batch, sizeof g_dev_batch, "PIE_NULL_BATCH_US=%u", b);
            snprintf(g_dev_token, sizeof g_dev_token, "PIE_NULL_TOKEN_US=%u", t);
        } else if (!strcmp(argv[i], "--worker-credits") && i + 1 < argc)
            snprintf(g_wrk_credits, sizeof g_wrk_credits, "PIE_BATCH_CREDITS=%d", atoi(argv[++i]));
        else if (!strcmp(argv[i], "--unix"))
            g_unix = true;
        else if (!strcmp(argv[i], "--cpus") && i + 1 < argc)
            parse_cpus_option(argv[++i]);
        else if (!strcmp(argv[i], "--instances") && i + 1 < argc) {
            n_ns = 0;
            for (char *t = strtok(argv[++i], ","); t && n_ns < 16; t = strtok(NULL, ","))
                ns[n_ns++] = (uint32_t)atoi(t);
        } else {
            fprintf(
                stderr,
                "usage: bench_controller [--mode all|latency|throughput|strategies|memory|soak] "
                "[--seconds S] [--instances N,N,...] [--backend null|cpu] [--top-k K] "
                "[--soak-seconds S] [--ctl-threads N] [--worker-credits N] [--device-us B,T] "
                "[--replicas R] "
                "[--only LABEL,...] [--repeat N] [--think-us MEAN] [--cpus BENCH/CTL/WRK] [--unix] "
                "[--quick]\n");
            return 2;
        }
    }
    if (quick) {
        g_seconds = 1;
        soak_s = 3;
    }
    char self[PATH_MAX];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    if (len <= 0) die("readlink /proc/self/exe");
    self[len] = '\0';
    char *slash = strrchr(self, '/');
    if (slash) *slash = '\0';
    snprintf(g_bin, sizeof g_bin, "%s/../bin", self);
    snprintf(g_models, sizeof g_models, "%s/../models", self);
    signal(SIGPIPE, SIG_IGN);
    bool all = !strcmp(mode, "all");
    if (all || !strcmp(mode, "latency")) mode_latency();
    if (all || !strcmp(mode, "throughput")) mode_throughput(ns, n_ns);
    if (all || !strcmp(mode, "strategies")) mode_strategies(n_ns == 1 ? ns[0] : 128);
    if (all || !strcmp(mode, "memory")) mode_memory(quick ? 1000 : 10000, 100);
    if (all || !strcmp(mode, "soak")) mode_soak(soak_s);
    return 0;
}
