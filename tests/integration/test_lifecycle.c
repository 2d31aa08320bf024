/* test_lifecycle.c — the public API pie.v1.Lifecycle through real processes: pie-controller, a
 * CPU pie-worker (tiny-f32) and pie-lifecycle on loopback, driven over gRPC from C.
 *
 * Covers: upload (stored, idempotent, size mismatch, over the limit, hash mismatch, corrupt and
 * non-wasm modules rejected with lc_wasm's reason), list and delete; launch + attach (stdout,
 * stderr, exit code), run with messages both ways, end of input, oversize client messages,
 * one attachment at a time, terminate, a cancelled Run, dropped output, list instances
 * (states, limits, usage), retention, foreign ids; hostile instances (out-of-bounds access, an
 * infinite loop against cpu_ms, deep recursion, a memory storm) each end alone with a clear
 * status, and API abuse (a KV-page allocation storm, ids never allocated, an oversize message, a
 * URL outside the allowlist, a future storm) is refused with a reason the inferlet can read,
 * while a well-behaved instance finishes and the services stay healthy; piectl
 * (run with exit codes, ps, programs, readable errors).
 *
 * Fixtures: tests/wasm/lc_echo.c (raw pie ABI) and tests/wasm/hostile.c. Deadlines are
 * generous: sanitizer builds are slow. */
#include <criterion/criterion.h>

#include <dirent.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "lc_wasm.h"
#include "pie/v1/lifecycle.pb-c.h"
#include "pie_proc.h"
#include "pie_sha256.h"
#include "pie_testutil.h"
#include "rpc.h"

#define START_MS 30000
#define STOP_MS  20000
#define WAIT_MS  30000
#define MODEL    "tiny-f32"

TestSuite(lifecycle, .fini = pie_test_leak_check, .timeout = 240);

/* ---- cluster ------------------------------------------------------------------------------ */

typedef struct cluster {
    pie_proc *ctl, *wrk, *lc;
    rpc_channel *ch; /* to the lifecycle */
    char *dir;       /* runtime cache dir */
} cluster;

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(path);
}

static pie_proc *start(const char *bin, const char *const *env) {
    pie_proc_opts o = {.env = env};
    pie_status st;
    pie_proc *p = pie_proc_start(bin, &o, START_MS, &st);
    cr_assert(p, "%s", st.msg);
    return p;
}

/* extra: more lifecycle environment entries (NULL-terminated) or NULL. with_worker: start a
 * worker (launches need a model). */
static void cluster_start(cluster *c, const char *const *extra, bool with_worker) {
    memset(c, 0, sizeof *c);
    pie_status st;
    static char *dir; /* reachable from here if an assertion ends the test early */
    c->dir = dir = pie_proc_tmpdir(&st);
    cr_assert(c->dir, "%s", st.msg);
    c->ctl = start("pie-controller", NULL);
    static char ctl_env[96], dir_env[4200];
    pie_proc_env_controller(c->ctl, ctl_env, sizeof ctl_env);
    snprintf(dir_env, sizeof dir_env, "PIE_RUNTIME_CACHE_DIR=%s/cache", c->dir);
    if (with_worker) {
        const char *wenv[] = {ctl_env, "PIE_MODEL_PATH=" PIE_MODELS_DIR "/" MODEL,
                              "PIE_BACKEND=cpu", "PIE_ENGINE_THREADS=1", NULL};
        c->wrk = start("pie-worker", wenv);
    }
    const char *env[24] = {ctl_env, dir_env, "PIE_TOKENIZER_PATH=" PIE_MODELS_DIR,
                           "PIE_CONTROLLER_RECONNECT_INITIAL=50ms",
                           "PIE_CONTROLLER_RECONNECT_MAX=200ms"};
    size_t n = 5;
    bool tier1_set = false;
    for (size_t i = 0; extra && extra[i] && n < 22; i++) {
        env[n++] = extra[i];
        tier1_set |= strncmp(extra[i], "PIE_RUNTIME_TIER1=", 18) == 0;
    }
    if (!tier1_set) env[n++] = "PIE_RUNTIME_TIER1=false"; /* no cc -O2 beside the tests */
    env[n] = NULL;
    c->lc = start("pie-lifecycle", env);
    rpc_channel_opts co = {.max_recv_bytes = -1, .max_send_bytes = -1};
    c->ch = rpc_channel_create(pie_proc_addr(c->lc), &co, &st);
    cr_assert(c->ch, "%s", st.msg);
    if (with_worker)
        cr_assert_gt(pie_test_wait_models(c->ch, WAIT_MS), 0,
                     "the lifecycle never learned a model");
}

static void stop_ok(pie_proc *p) {
    if (p == NULL) return;
    pie_status st;
    int rc = pie_proc_stop(p, STOP_MS, &st);
    static char *tail; /* reachable if the assertion ends the test */
    tail = pie_proc_log_tail(p, 3000);
    cr_assert_eq(rc, 0, "%s exited with %d: %s\nlog:\n%s", pie_proc_name(p), rc, st.msg,
                 tail ? tail : "");
    free(tail);
    pie_proc_destroy(p);
}

static void cluster_stop(cluster *c) {
    rpc_channel_destroy(c->ch);
    stop_ok(c->lc);
    stop_ok(c->wrk);
    stop_ok(c->ctl);
    nftw(c->dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    free(c->dir);
}

static rpc_health_status health_of(cluster *c, const char *service) {
    pie_status st;
    rpc_health_status hs = RPC_HEALTH_UNKNOWN;
    if (rpc_health_check(c->ch, service, 5000, &hs, &st) != PIE_OK) return RPC_HEALTH_UNKNOWN;
    return hs;
}

/* The process serves (liveness) and, where a worker serves a model, the public API is ready
 * (readiness: the Session is up and knows a model). */
static bool healthy(cluster *c) {
    bool live = health_of(c, "") == RPC_HEALTH_SERVING;
    return live && (c->wrk == NULL || health_of(c, "pie.v1.Lifecycle") == RPC_HEALTH_SERVING);
}

/* ---- calls ------------------------------------------------------------------------------- */

static pie_code unary(cluster *c, const char *method, const ProtobufCMessage *req,
                      const ProtobufCMessageDescriptor *rd, ProtobufCMessage **resp,
                      pie_status *st) {
    char path[128];
    snprintf(path, sizeof path, "/pie.v1.Lifecycle/%s", method);
    rpc_call_opts o = {.timeout_ms = WAIT_MS};
    ProtobufCMessage *r = NULL;
    pie_code rc = rpc_unary(c->ch, path, req, rd, &r, &o, st);
    if (resp)
        *resp = r;
    else
        rpc_msg_free(r);
    return rc;
}

static uint8_t *read_fixture(const char *name, size_t *len) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", PIE_WASM_FIXTURES, name);
    FILE *f = fopen(path, "rb");
    cr_assert(f, "cannot open fixture %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc((size_t)n);
    cr_assert(b);
    cr_assert_eq(fread(b, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    *len = (size_t)n;
    return b;
}

/* Uploads data as name in chunks of `chunk` bytes, declaring `declared` bytes. */
static pie_code upload_ex(cluster *c, const void *data, size_t len, uint64_t declared,
                          const char *name, const char *sha, size_t chunk, char id[65],
                          bool *already, pie_status *st) {
    rpc_call_opts o = {.timeout_ms = WAIT_MS};
    rpc_stream *s = rpc_stream_open(c->ch, "/pie.v1.Lifecycle/UploadProgram",
                                    &pie__v1__upload_program_response__descriptor, &o, st);
    cr_assert(s, "%s", st->msg);
    Pie__V1__ProgramMetadata md = PIE__V1__PROGRAM_METADATA__INIT;
    md.name = (char *)name;
    md.size_bytes = declared;
    md.expected_sha256 = (char *)(sha ? sha : "");
    Pie__V1__UploadProgramRequest r = PIE__V1__UPLOAD_PROGRAM_REQUEST__INIT;
    r.part_case = PIE__V1__UPLOAD_PROGRAM_REQUEST__PART_METADATA;
    r.metadata = &md;
    pie_code rc = rpc_stream_send(s, &r.base, st);
    for (size_t off = 0; rc == PIE_OK && off < len; off += chunk) {
        Pie__V1__UploadProgramRequest cr = PIE__V1__UPLOAD_PROGRAM_REQUEST__INIT;
        cr.part_case = PIE__V1__UPLOAD_PROGRAM_REQUEST__PART_CHUNK;
        cr.chunk.data = (uint8_t *)data + off;
        cr.chunk.len = len - off < chunk ? len - off : chunk;
        rc = rpc_stream_send(s, &cr.base, st);
    }
    rpc_stream_close_send(s, st);
    ProtobufCMessage *m = NULL;
    if (rpc_stream_recv(s, &m, WAIT_MS) == RPC_RECV_MESSAGE) {
        Pie__V1__UploadProgramResponse *u = (Pie__V1__UploadProgramResponse *)m;
        if (id) snprintf(id, 65, "%s", u->program_id);
        if (already) *already = u->already_cached;
        cr_assert_eq(u->size_bytes, len);
        rpc_msg_free(m);
    }
    rc = rpc_stream_finish(s, st);
    rpc_stream_destroy(s);
    return rc;
}

static void upload_ok(cluster *c, const char *fixture, const char *name, char id[65]) {
    size_t len;
    uint8_t *b = read_fixture(fixture, &len);
    pie_status st;
    cr_assert_eq(upload_ex(c, b, len, len, name, NULL, 64 << 10, id, NULL, &st), PIE_OK,
                 "upload %s: %s", fixture, st.msg);
    free(b);
}

typedef struct launch_opts {
    const char *const *args;
    uint64_t cpu_ms, memory_bytes, message_bytes, wall_ms;
} launch_opts;

static void fill_launch(Pie__V1__LaunchRequest *req, Pie__V1__ResourceLimits *lim, const char *id,
                        const launch_opts *o) {
    pie__v1__launch_request__init(req);
    pie__v1__resource_limits__init(lim);
    req->program_id = (char *)id;
    size_t n = 0;
    while (o->args && o->args[n]) n++;
    req->n_args = n;
    req->args = (char **)o->args;
    lim->cpu_ms = o->cpu_ms;
    lim->memory_bytes = o->memory_bytes;
    lim->message_bytes = o->message_bytes;
    lim->wall_ms = o->wall_ms;
    req->limits = lim;
}

static pie_code launch(cluster *c, const char *id, const launch_opts *o, uint64_t *inst,
                       pie_status *st) {
    Pie__V1__LaunchRequest req;
    Pie__V1__ResourceLimits lim;
    fill_launch(&req, &lim, id, o);
    ProtobufCMessage *r = NULL;
    pie_code rc = unary(c, "Launch", &req.base, &pie__v1__launch_response__descriptor, &r, st);
    if (rc == PIE_OK) {
        Pie__V1__LaunchResponse *lr = (Pie__V1__LaunchResponse *)r;
        *inst = lr->instance_id;
        cr_assert(lr->limits && lr->limits->cpu_ms > 0 && lr->limits->memory_bytes > 0 &&
                      lr->limits->kv_pages > 0 && lr->limits->message_bytes > 0,
                  "effective limits must be non-zero");
        rpc_msg_free(r);
    }
    return rc;
}

static uint64_t launch_ok(cluster *c, const char *id, const launch_opts *o) {
    uint64_t inst = 0;
    pie_status st;
    if (launch(c, id, o, &inst, &st) != PIE_OK) {
        static char *tail; /* reachable when the assertion ends the test */
        tail = pie_proc_log_tail(c->lc, 4000);
        cr_assert_fail("Launch: %s\nlifecycle log:\n%s", st.msg, tail ? tail : "");
    }
    cr_assert_neq(inst, 0);
    return inst;
}

/* What an Attach or Run stream delivered. */
typedef struct seen {
    uint64_t started_id;
    char out[64 << 10], err[4096];
    size_t n_out, n_err;
    char msgs[16][256];
    int n_msgs;
    uint64_t dropped;
    int dropped_at; /* index of the dropped_bytes message among all messages, or -1 */
    int n_total;
    bool exited;
    uint32_t exit_code_status;
    char exit_msg[512];
    int32_t exit_code;
    pie_code call_code;
    char call_msg[512];
} seen;

static void take(seen *s, Pie__V1__AttachResponse *r) {
    switch (r->msg_case) {
    case PIE__V1__ATTACH_RESPONSE__MSG_STARTED: s->started_id = r->started->instance_id; break;
    case PIE__V1__ATTACH_RESPONSE__MSG_MESSAGE:
        cr_assert_lt(s->n_msgs, 16);
        snprintf(s->msgs[s->n_msgs++], 256, "%.*s", (int)r->message.len, r->message.data);
        break;
    case PIE__V1__ATTACH_RESPONSE__MSG_STDOUT_DATA:
        if (s->n_out + r->stdout_data.len < sizeof s->out) {
            memcpy(s->out + s->n_out, r->stdout_data.data, r->stdout_data.len);
            s->n_out += r->stdout_data.len;
        } else {
            s->n_out += r->stdout_data.len; /* counted, not kept */
        }
        break;
    case PIE__V1__ATTACH_RESPONSE__MSG_STDERR_DATA:
        cr_assert_lt(s->n_err + r->stderr_data.len, sizeof s->err);
        memcpy(s->err + s->n_err, r->stderr_data.data, r->stderr_data.len);
        s->n_err += r->stderr_data.len;
        break;
    case PIE__V1__ATTACH_RESPONSE__MSG_DROPPED_BYTES:
        cr_assert_eq(s->dropped_at, -1, "dropped_bytes sent twice");
        s->dropped = r->dropped_bytes;
        s->dropped_at = s->n_total;
        break;
    case PIE__V1__ATTACH_RESPONSE__MSG_EXIT_STATUS:
        s->exited = true;
        s->exit_code_status = r->exit_status->status ? r->exit_status->status->code : 0;
        snprintf(s->exit_msg, sizeof s->exit_msg, "%s",
                 r->exit_status->status ? r->exit_status->status->message : "");
        s->exit_code = r->exit_status->exit_code;
        cr_assert_gt(r->exit_status->exited_unix_ms, 0);
        break;
    default: cr_assert_fail("unexpected AttachResponse case %d", r->msg_case);
    }
    s->n_total++;
}

/* Reads until the stream ends (or n_msgs reaches want_msgs when want_msgs > 0). */
static void collect(rpc_stream *s, seen *out, int want_msgs) {
    for (;;) {
        if (want_msgs > 0 && out->n_msgs >= want_msgs) return;
        ProtobufCMessage *m = NULL;
        rpc_recv_result r = rpc_stream_recv(s, &m, WAIT_MS);
        cr_assert_neq(r, RPC_RECV_TIMEOUT, "no output within %d ms", WAIT_MS);
        if (r == RPC_RECV_END) break;
        cr_assert(!out->exited, "a message came after exit_status");
        take(out, (Pie__V1__AttachResponse *)m);
        rpc_msg_free(m);
    }
    pie_status st;
    out->call_code = rpc_stream_finish(s, &st);
    snprintf(out->call_msg, sizeof out->call_msg, "%s", st.msg);
}

static rpc_stream *open_stream(cluster *c, const char *method) {
    char path[128];
    snprintf(path, sizeof path, "/pie.v1.Lifecycle/%s", method);
    pie_status st;
    rpc_call_opts o = {.timeout_ms = 120000};
    rpc_stream *s = rpc_stream_open(c->ch, path, &pie__v1__attach_response__descriptor, &o, &st);
    cr_assert(s, "%s", st.msg);
    return s;
}

static rpc_stream *attach_open(cluster *c, uint64_t inst) {
    rpc_stream *s = open_stream(c, "Attach");
    Pie__V1__AttachStart a = PIE__V1__ATTACH_START__INIT;
    a.instance_id = inst;
    Pie__V1__AttachRequest r = PIE__V1__ATTACH_REQUEST__INIT;
    r.msg_case = PIE__V1__ATTACH_REQUEST__MSG_START;
    r.start = &a;
    pie_status st;
    cr_assert_eq(rpc_stream_send(s, &r.base, &st), PIE_OK, "%s", st.msg);
    return s;
}

static void attach_all(cluster *c, uint64_t inst, seen *out) {
    memset(out, 0, sizeof *out);
    out->dropped_at = -1;
    rpc_stream *s = attach_open(c, inst);
    collect(s, out, 0);
    rpc_stream_destroy(s);
}

static void send_msg(rpc_stream *s, bool run, const char *text) {
    pie_status st;
    ProtobufCBinaryData b = {.len = strlen(text), .data = (uint8_t *)text};
    pie_code rc;
    if (run) {
        Pie__V1__RunRequest r = PIE__V1__RUN_REQUEST__INIT;
        r.msg_case = PIE__V1__RUN_REQUEST__MSG_MESSAGE;
        r.message = b;
        rc = rpc_stream_send(s, &r.base, &st);
    } else {
        Pie__V1__AttachRequest r = PIE__V1__ATTACH_REQUEST__INIT;
        r.msg_case = PIE__V1__ATTACH_REQUEST__MSG_MESSAGE;
        r.message = b;
        rc = rpc_stream_send(s, &r.base, &st);
    }
    cr_assert_eq(rc, PIE_OK, "send: %s", st.msg);
}

static void close_input_run(rpc_stream *s) {
    Pie__V1__CloseInput ci = PIE__V1__CLOSE_INPUT__INIT;
    Pie__V1__RunRequest r = PIE__V1__RUN_REQUEST__INIT;
    r.msg_case = PIE__V1__RUN_REQUEST__MSG_CLOSE_INPUT;
    r.close_input = &ci;
    pie_status st;
    cr_assert_eq(rpc_stream_send(s, &r.base, &st), PIE_OK, "%s", st.msg);
}

static rpc_stream *run_open(cluster *c, const char *id, const launch_opts *o) {
    rpc_stream *s = open_stream(c, "Run");
    Pie__V1__LaunchRequest req;
    Pie__V1__ResourceLimits lim;
    fill_launch(&req, &lim, id, o);
    Pie__V1__RunRequest r = PIE__V1__RUN_REQUEST__INIT;
    r.msg_case = PIE__V1__RUN_REQUEST__MSG_LAUNCH;
    r.launch = &req;
    pie_status st;
    cr_assert_eq(rpc_stream_send(s, &r.base, &st), PIE_OK, "%s", st.msg);
    return s;
}

static Pie__V1__ListInstancesResponse *list_instances(cluster *c) {
    Pie__V1__ListInstancesRequest req = PIE__V1__LIST_INSTANCES_REQUEST__INIT;
    ProtobufCMessage *r = NULL;
    pie_status st;
    cr_assert_eq(unary(c, "ListInstances", &req.base, &pie__v1__list_instances_response__descriptor,
                       &r, &st),
                 PIE_OK, "%s", st.msg);
    return (Pie__V1__ListInstancesResponse *)r;
}

/* The instance's state in ListInstances (0 when not listed). */
static int state_of(cluster *c, uint64_t inst) {
    Pie__V1__ListInstancesResponse *l = list_instances(c);
    int s = 0;
    for (size_t i = 0; i < l->n_instances; i++)
        if (l->instances[i]->instance_id == inst) s = (int)l->instances[i]->state;
    rpc_msg_free(&l->base);
    return s;
}

static void wait_state(cluster *c, uint64_t inst, int state) {
    int64_t deadline = pie_test_now_ms() + WAIT_MS;
    while (state_of(c, inst) != state) {
        cr_assert(pie_test_now_ms() < deadline, "instance %llx never reached state %d",
                  (unsigned long long)inst, state);
        pie_test_sleep_ms(20);
    }
}

#define EXITED  PIE__V1__INSTANCE_STATE__INSTANCE_STATE_EXITED
#define RUNNING PIE__V1__INSTANCE_STATE__INSTANCE_STATE_RUNNING

/* ---- programs ----------------------------------------------------------------------------- */

/* ListPrograms; free with rpc_msg_free. */
static Pie__V1__ListProgramsResponse *list_programs(cluster *c) {
    Pie__V1__ListProgramsRequest req = PIE__V1__LIST_PROGRAMS_REQUEST__INIT;
    ProtobufCMessage *r = NULL;
    pie_status st;
    cr_assert_eq(
        unary(c, "ListPrograms", &req.base, &pie__v1__list_programs_response__descriptor, &r, &st),
        PIE_OK, "%s", st.msg);
    return (Pie__V1__ListProgramsResponse *)r;
}

Test(lifecycle, upload_validates_stores_lists_and_deletes_programs) {
    cluster c;
    const char *extra[] = {"PIE_PROGRAMS_MAX_SIZE=64KiB", NULL};
    cluster_start(&c, extra, false);
    size_t len;
    uint8_t *wasm = read_fixture("lc_echo.wasm", &len);
    cr_assert_lt(len, 64 << 10, "the fixture must fit the limit this test sets");
    char want[65], id[65] = "", sha_bad[65];
    cr_assert_eq(pie_sha256_hex(wasm, len, want, NULL), PIE_OK);
    pie_status st;
    bool already = true;

    /* stored, in odd-sized chunks, with the right expected hash */
    cr_assert_eq(upload_ex(&c, wasm, len, len, "echo", want, 1000, id, &already, &st), PIE_OK, "%s",
                 st.msg);
    cr_assert_str_eq(id, want);
    cr_assert(!already, "the first upload stores the bytes");
    /* the same bytes again: idempotent, already cached, the newest name wins */
    cr_assert_eq(upload_ex(&c, wasm, len, len, "echo2", NULL, 64 << 10, id, &already, &st), PIE_OK,
                 "%s", st.msg);
    cr_assert(already);

    /* size mismatch both ways */
    cr_assert_eq(upload_ex(&c, wasm, len - 1, len, "short", NULL, 4096, NULL, NULL, &st),
                 PIE_INVALID_ARGUMENT, "%s", st.msg);
    cr_assert(strstr(st.msg, "size_bytes"), "%s", st.msg);
    cr_assert_eq(upload_ex(&c, wasm, len, len - 1, "long", NULL, 4096, NULL, NULL, &st),
                 PIE_INVALID_ARGUMENT, "%s", st.msg);
    /* over the limit: refused from the metadata alone */
    uint8_t *big = calloc(1, 70 << 10);
    cr_assert(big);
    cr_assert_eq(upload_ex(&c, big, 70 << 10, 70 << 10, "big", NULL, 64 << 10, NULL, NULL, &st),
                 PIE_RESOURCE_EXHAUSTED, "%s", st.msg);
    cr_assert(strstr(st.msg, "limit"), "%s", st.msg);
    free(big);
    /* hash mismatch */
    snprintf(sha_bad, sizeof sha_bad, "%s", want);
    sha_bad[0] = sha_bad[0] == '0' ? '1' : '0';
    cr_assert_eq(upload_ex(&c, wasm, len, len, "sha", sha_bad, 4096, NULL, NULL, &st),
                 PIE_INVALID_ARGUMENT, "%s", st.msg);
    cr_assert(strstr(st.msg, "expected_sha256"), "%s", st.msg);
    /* non-wasm and corrupt modules, with lc_wasm's reason */
    const char *text = "#!/bin/sh\necho not a module\n";
    cr_assert_eq(upload_ex(&c, text, strlen(text), strlen(text), "sh", NULL, 4096, NULL, NULL, &st),
                 PIE_INVALID_ARGUMENT, "%s", st.msg);
    cr_assert(strstr(st.msg, "not a WebAssembly") || strstr(st.msg, "magic") ||
                  strstr(st.msg, "wasm"),
              "reason: %s", st.msg);
    uint8_t *corrupt = malloc(len);
    cr_assert(corrupt);
    memcpy(corrupt, wasm, len);
    memset(corrupt + 8, 0xff, 64); /* section headers become nonsense */
    cr_assert_eq(upload_ex(&c, corrupt, len, len, "corrupt", NULL, 4096, NULL, NULL, &st),
                 PIE_INVALID_ARGUMENT, "%s", st.msg);
    cr_assert_gt(strlen(st.msg), 10, "a reason is given: %s", st.msg);
    free(corrupt);

    /* a second program; list is ordered by id and shows names and sizes */
    char id2[65];
    upload_ok(&c, "hostile.wasm", "hostile", id2);
    Pie__V1__ListProgramsResponse *lp = list_programs(&c);
    cr_assert_eq(lp->n_programs, 2, "only the accepted uploads are stored");
    cr_assert_lt(strcmp(lp->programs[0]->program_id, lp->programs[1]->program_id), 0);
    for (size_t i = 0; i < 2; i++) {
        Pie__V1__ProgramInfo *p = lp->programs[i];
        bool is_echo = strcmp(p->program_id, want) == 0;
        cr_assert_str_eq(p->name, is_echo ? "echo2" : "hostile");
        if (is_echo) cr_assert_eq(p->size_bytes, len);
        cr_assert_eq(p->tier, PIE__V1__PROGRAM_TIER__PROGRAM_TIER_QUICK,
                     "validated uploads are compiled at tier 0");
        cr_assert_gt(p->uploaded_unix_ms, 0);
    }
    rpc_msg_free(&lp->base);

    /* delete, then delete again and launch: NOT_FOUND */
    char native[4400]; /* its native code goes with it (it stayed on disk for good) */
    snprintf(native, sizeof native, "%s/cache/native/%s", c.dir, id2);
    cr_assert_eq(access(native, F_OK), 0, "no native code at %s", native);
    Pie__V1__DeleteProgramRequest dreq = PIE__V1__DELETE_PROGRAM_REQUEST__INIT;
    dreq.program_id = id2;
    cr_assert_eq(unary(&c, "DeleteProgram", &dreq.base,
                       &pie__v1__delete_program_response__descriptor, NULL, &st),
                 PIE_OK, "%s", st.msg);
    cr_expect_neq(access(native, F_OK), 0, "a deleted program's native code stayed at %s", native);
    cr_assert_eq(unary(&c, "DeleteProgram", &dreq.base,
                       &pie__v1__delete_program_response__descriptor, NULL, &st),
                 PIE_NOT_FOUND, "%s", st.msg);
    uint64_t inst;
    launch_opts lo = {0};
    cr_assert_eq(launch(&c, id2, &lo, &inst, &st), PIE_NOT_FOUND, "%s", st.msg);
    cr_assert(healthy(&c));
    /* no worker, no model: alive, but not ready to launch (what a readiness probe asks) */
    cr_assert_eq(health_of(&c, "pie.v1.Lifecycle"), RPC_HEALTH_NOT_SERVING,
                 "a replica that knows no model reports ready");
    free(wasm);
    cluster_stop(&c);
}

/* ---- instances ---------------------------------------------------------------------------- */

Test(lifecycle, launch_then_attach_reads_output_exit_code_and_retention) {
    cluster c;
    /* Retention far longer than any run of this test, so the checks below, which need the
     * exited instance, hold however slow the machine is. Dropping it afterwards is the
     * next test's. */
    const char *extra[] = {"PIE_INSTANCES_RETENTION=1h", NULL};
    cluster_start(&c, extra, true);
    char id[65];
    upload_ok(&c, "lc_echo.wasm", "echo", id);
    const char *args[] = {"exit", "3", "a b", NULL};
    launch_opts lo = {.args = args};
    uint64_t inst = launch_ok(&c, id, &lo);
    wait_state(&c, inst, EXITED);

    /* ListInstances: exited, with its exit status, limits and usage */
    Pie__V1__ListInstancesResponse *l = list_instances(&c);
    Pie__V1__InstanceInfo *info = NULL;
    for (size_t i = 0; i < l->n_instances; i++)
        if (l->instances[i]->instance_id == inst) info = l->instances[i];
    cr_assert(info);
    cr_assert_str_eq(info->program_id, id);
    cr_assert_str_eq(info->program_name, "echo");
    cr_assert_str_eq(info->model, MODEL);
    cr_assert(info->exit_status && info->exit_status->status);
    cr_assert_eq(info->exit_status->status->code, 0);
    cr_assert_eq(info->exit_status->exit_code, 3);
    cr_assert(info->limits && info->limits->wall_ms > 0);
    cr_assert(info->usage && info->usage->memory_bytes > 0, "final linear memory is reported");
    cr_assert(!info->attached);
    rpc_msg_free(&l->base);

    /* the output was buffered; attach gets it in order, then the exit status */
    seen s;
    attach_all(&c, inst, &s);
    cr_assert_eq(s.call_code, PIE_OK, "%s", s.call_msg);
    cr_assert_eq(s.dropped_at, -1, "nothing was dropped");
    cr_assert_eq(s.n_out, strlen("hello exit 3 a b\n"));
    cr_assert(memcmp(s.out, "hello exit 3 a b\n", s.n_out) == 0, "stdout: %.*s", (int)s.n_out,
              s.out);
    cr_assert(s.n_err == strlen("to stderr\n") && memcmp(s.err, "to stderr\n", s.n_err) == 0);
    cr_assert(s.exited);
    cr_assert_eq(s.exit_code_status, 0);
    cr_assert_eq(s.exit_code, 3);
    /* a second attach within retention: no output left, the exit status again */
    attach_all(&c, inst, &s);
    cr_assert(s.exited && s.n_out == 0 && s.exit_code == 3);

    /* an id of another replica and an unknown one */
    pie_status st;
    uint64_t foreign = (((inst >> 48) + 1) << 48) | 12345;
    rpc_stream *fs = attach_open(&c, foreign);
    memset(&s, 0, sizeof s);
    s.dropped_at = -1;
    collect(fs, &s, 0);
    rpc_stream_destroy(fs);
    cr_assert_eq(s.call_code, PIE_NOT_FOUND, "%s", s.call_msg);
    char want[64];
    snprintf(want, sizeof want, "replica %llu", (unsigned long long)((inst >> 48) + 1));
    cr_assert(strstr(s.call_msg, want), "names the owning replica: %s", s.call_msg);
    Pie__V1__TerminateRequest tr = PIE__V1__TERMINATE_REQUEST__INIT;
    tr.instance_id = inst ^ 1;
    cr_assert_eq(
        unary(&c, "Terminate", &tr.base, &pie__v1__terminate_response__descriptor, NULL, &st),
        PIE_NOT_FOUND, "%s", st.msg);
    cluster_stop(&c);
}

Test(lifecycle, exited_instances_are_dropped_after_the_retention_period) {
    cluster c;
    const char *extra[] = {"PIE_INSTANCES_RETENTION=100ms", NULL};
    cluster_start(&c, extra, true);
    char id[65];
    upload_ok(&c, "lc_echo.wasm", "echo", id);
    /* "wait" runs until its input ends or it is terminated: listed while it runs, whatever
     * the retention */
    const char *args[] = {"wait", NULL};
    launch_opts lo = {.args = args};
    uint64_t inst = launch_ok(&c, id, &lo);
    wait_state(&c, inst, RUNNING);
    Pie__V1__TerminateRequest tr = PIE__V1__TERMINATE_REQUEST__INIT;
    tr.instance_id = inst;
    pie_status st;
    cr_assert_eq(
        unary(&c, "Terminate", &tr.base, &pie__v1__terminate_response__descriptor, NULL, &st),
        PIE_OK, "%s", st.msg);
    /* Gone once the retention has passed: polled, not slept for (WAIT_MS only guards a hang). */
    int64_t deadline = pie_test_now_ms() + WAIT_MS;
    int state;
    while ((state = state_of(&c, inst)) != 0) {
        cr_assert(pie_test_now_ms() < deadline,
                  "instance %llx still listed (state %d) %d ms after it was terminated with a "
                  "retention of 100 ms",
                  (unsigned long long)inst, state, WAIT_MS);
        pie_test_sleep_ms(20);
    }
    seen s;
    attach_all(&c, inst, &s);
    cr_assert_eq(s.call_code, PIE_NOT_FOUND, "attach after the retention: %s", s.call_msg);
    cluster_stop(&c);
}

/* The mappings of a process (lines of /proc/<pid>/maps): a loaded module's native code adds
 * a few. */
static size_t maps_of(const pie_proc *p) {
    char path[64], line[512];
    snprintf(path, sizeof path, "/proc/%d/maps", pie_proc_pid(p));
    FILE *f = fopen(path, "r");
    cr_assert(f, "cannot open %s", path);
    size_t n = 0;
    while (fgets(line, sizeof line, f))
        if (strchr(line, '\n')) n++;
    fclose(f);
    return n;
}

/* pie_test_wasm_variant number of lc_echo: a distinct program. */
static pie_code upload_variant(cluster *c, int number, char id[65], bool *already,
                               pie_status *st) {
    size_t len;
    uint8_t *base = read_fixture("lc_echo.wasm", &len);
    uint8_t *v = pie_test_wasm_variant(base, len, number);
    cr_assert(v);
    size_t k = len + PIE_TEST_WASM_VARIANT_EXTRA;
    pie_code rc = upload_ex(c, v, k, k, "variant", NULL, 64 << 10, id, already, st);
    free(v);
    free(base);
    return rc;
}

/* Uploads distinct programs first..first+n-1 (upload_variant) into ids[0..n). */
static void upload_variants(cluster *c, int first, int n, char ids[][65]) {
    for (int i = 0; i < n; i++) {
        pie_status st;
        cr_assert_eq(upload_variant(c, first + i, ids[i], NULL, &st), PIE_OK, "upload %d: %s",
                     first + i, st.msg);
    }
}

/* A replica kept every program it ever stored or launched loaded — its native code mapped
 * (~3.5 mappings and ~140 KiB each) — so uploads of distinct programs grew it without bound,
 * towards the kernel's mapping limit (vm.max_map_count, 65,530), past which nothing loads. At
 * most programs.max_loaded stay loaded, the least recently used unloaded first; a launch of an
 * unloaded one loads it again from the store. */
static size_t native_entries(const cluster *c) {
    char path[4200];
    snprintf(path, sizeof path, "%s/cache/native", c->dir);
    DIR *d = opendir(path);
    cr_assert(d, "opendir %s", path);
    size_t n = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;) n += strlen(e->d_name) == 64;
    closedir(d);
    return n;
}

static void expect_at_most_max_loaded(bool tier1) {
    cluster c;
    /* and the disk: 1 MiB of native code is room for ~3 programs beside the 4 loaded */
    const char *extra[] = {"PIE_PROGRAMS_MAX_LOADED=4", "PIE_RUNTIME_CACHE_SIZE=1MiB",
                           tier1 ? "PIE_RUNTIME_TIER1=true" : "PIE_RUNTIME_TIER1=false", NULL};
    cluster_start(&c, extra, true);
#define N_PROGRAMS 24
    char ids[N_PROGRAMS][65];
    upload_variants(&c, 0, 4, ids);
    size_t maps0 = maps_of(c.lc); /* four loaded: what the bound allows */
    upload_variants(&c, 4, N_PROGRAMS - 4, ids + 4);
    const char *first = ids[0];
    size_t maps1 = maps_of(c.lc);
    cr_expect_lt(maps1, maps0 + 24,
                 "%zu mappings after %d distinct programs, %zu after 4 (programs.max_loaded 4)",
                 maps1, N_PROGRAMS, maps0);
    size_t on_disk = native_entries(&c);
    cr_expect_leq(on_disk, 4 + 4,
                  "native code of %zu programs of %d kept (runtime.cache_size 1MiB)", on_disk,
                  N_PROGRAMS);
    /* what an operator sees of it */
    double loaded = -1, compiles = -1, removals = -1, bytes = -1;
    pie_status mst;
    cr_assert_eq(pie_proc_metric(c.lc, "pie_lifecycle_programs_loaded", &loaded, &mst), PIE_OK,
                 "%s", mst.msg);
    cr_assert_eq(pie_proc_metric(c.lc, "pie_lifecycle_compiles_total{tier=\"0\"}", &compiles, &mst),
                 PIE_OK, "%s", mst.msg);
    cr_assert_eq(
        pie_proc_metric(c.lc, "pie_lifecycle_native_cache_removals_total", &removals, &mst), PIE_OK,
        "%s", mst.msg);
    cr_assert_eq(pie_proc_metric(c.lc, "pie_lifecycle_native_cache_bytes", &bytes, &mst), PIE_OK,
                 "%s", mst.msg);
    cr_expect(loaded >= 1 && loaded <= 5, "pie_lifecycle_programs_loaded %g (max_loaded 4)",
              loaded);
    cr_expect_eq(compiles, N_PROGRAMS, "pie_lifecycle_compiles_total{tier=\"0\"} %g", compiles);
    cr_expect_geq(removals, (double)(N_PROGRAMS - on_disk),
                  "pie_lifecycle_native_cache_removals_total %g, %zu of %d entries left", removals,
                  on_disk, N_PROGRAMS);
    cr_expect_gt(bytes, 0, "pie_lifecycle_native_cache_bytes %g", bytes);
    const char *args[] = {"exit", "5", NULL};
    launch_opts lo = {.args = args};
    uint64_t inst = launch_ok(&c, first, &lo); /* unloaded since: loaded again */
    wait_state(&c, inst, EXITED);
    seen s;
    attach_all(&c, inst, &s);
    cr_expect(s.exited && s.exit_code == 5, "the reloaded program exited %d", s.exit_code);
    cluster_stop(&c);
}

Test(lifecycle, at_most_programs_max_loaded_modules_stay_loaded) {
    expect_at_most_max_loaded(false);
}

/* The tier-1 queue held every module it was to compile, so with tier 1 on (the default) a burst
 * of distinct uploads stayed loaded past programs.max_loaded until cc -O2 had got through it
 * (a soak: 60 uploads, 703 mappings with a bound of 16, against 570 with tier 1 off). */
Test(lifecycle, the_tier1_compiler_keeps_no_program_loaded_past_programs_max_loaded) {
    expect_at_most_max_loaded(true);
}

/* Waits for each instance of insts[0..n) on c and expects it to have exited 5. */
static void expect_all_exit_5(cluster *c, const uint64_t *insts, int n, const char *where) {
    for (int k = 0; k < n; k++) {
        wait_state(c, insts[k], EXITED);
        seen s;
        attach_all(c, insts[k], &s);
        cr_expect(s.exited && s.exit_code == 5, "%s: launch %d exited %d: %.300s", where, k,
                  s.exit_code, s.exit_msg);
    }
}

/* A launch loaded its program into the set programs.max_loaded bounds and then looked it up
 * there — by which time a concurrent launch of another program could have unloaded it: the
 * launch failed "program_id: ... was deleted". More distinct programs launched at once than the
 * bound allows all start. */
Test(lifecycle, launches_of_more_programs_at_once_than_programs_max_loaded_all_start) {
    cluster c;
    const char *extra[] = {"PIE_PROGRAMS_MAX_LOADED=1", NULL};
    cluster_start(&c, extra, true);
    enum { N_PROG = 6, ROUNDS = 16 };
    char ids[N_PROG][65];
    upload_variants(&c, 0, N_PROG, ids);
    const char *args[] = {"exit", "5", NULL};
    launch_opts lo = {.args = args};
    uint64_t insts[ROUNDS * N_PROG];
    for (int k = 0; k < ROUNDS * N_PROG; k++) insts[k] = launch_ok(&c, ids[k % N_PROG], &lo);
    expect_all_exit_5(&c, insts, ROUNDS * N_PROG, "programs.max_loaded 1");
    cluster_stop(&c);
}

/* A second lifecycle replica of c's cluster, with its cache at c->dir/<cache> (c's own is
 * "cache": shared) and the extra environment entries (NULL-terminated, at most 4, or NULL).
 * The helpers talk to it through the returned view; stop it with stop_second_replica. */
static cluster second_replica(const cluster *c, const char *cache, const char *const *extra) {
    static char ctl_env[96], dir_env[4300]; /* reachable if an assertion ends the test */
    pie_proc_env_controller(c->ctl, ctl_env, sizeof ctl_env);
    snprintf(dir_env, sizeof dir_env, "PIE_RUNTIME_CACHE_DIR=%s/%s", c->dir, cache);
    const char *env[10] = {ctl_env, dir_env, "PIE_TOKENIZER_PATH=" PIE_MODELS_DIR,
                           "PIE_RUNTIME_TIER1=false"};
    for (size_t i = 0, n = 4; extra && extra[i]; i++) {
        cr_assert_lt(n, 9, "more than 5 extra settings");
        env[n++] = extra[i];
    }
    cluster c2 = *c;
    c2.lc = start("pie-lifecycle", env);
    pie_status st;
    c2.ch = rpc_channel_create(pie_proc_addr(c2.lc), NULL, &st);
    cr_assert(c2.ch, "%s", st.msg);
    cr_assert_gt(pie_test_wait_models(c2.ch, WAIT_MS), 0, "the second replica learned no model");
    return c2;
}

static void stop_second_replica(cluster *c2) {
    rpc_channel_destroy(c2->ch);
    stop_ok(c2->lc);
}

/* Replicas may share the cache directory, and each prunes it by its own count, removing entries
 * the other is loading or has loaded. Two replicas on one directory with room for no entry
 * beside the loaded one, launching six programs in turn on both at once: every launch loads its
 * program (compiling it again when the other removed it) and exits as asked. */
Test(lifecycle, two_replicas_pruning_one_shared_cache_launch_every_program) {
    cluster c;
    const char *extra[] = {"PIE_PROGRAMS_MAX_LOADED=1", "PIE_RUNTIME_CACHE_SIZE=1KiB", NULL};
    cluster_start(&c, extra, true);
    cluster c2 = second_replica(&c, "cache", extra);
    pie_status st;

    enum { N_PROG = 6, ROUNDS = 4 };
    char ids[N_PROG][65];
    upload_variants(&c, 0, N_PROG, ids);
    const char *args[] = {"exit", "5", NULL};
    launch_opts lo = {.args = args};
    uint64_t insts[2][ROUNDS * N_PROG];
    for (int k = 0; k < ROUNDS * N_PROG; k++) { /* without waiting: both replicas load at once */
        insts[0][k] = launch_ok(&c, ids[k % N_PROG], &lo);
        insts[1][k] = launch_ok(&c2, ids[(k + 3) % N_PROG], &lo);
    }
    expect_all_exit_5(&c, insts[0], ROUNDS * N_PROG, "replica 1");
    expect_all_exit_5(&c2, insts[1], ROUNDS * N_PROG, "replica 2");
    double removals[2] = {0, 0};
    for (int side = 0; side < 2; side++)
        cr_assert_eq(pie_proc_metric(side ? c2.lc : c.lc,
                                     "pie_lifecycle_native_cache_removals_total", &removals[side],
                                     &st),
                     PIE_OK, "%s", st.msg);
    cr_expect_gt(removals[0] + removals[1], 0, "nothing was pruned: the test tested nothing");
    stop_second_replica(&c2);
    cluster_stop(&c);
}

/* The stored programs had no bound: every distinct upload took its size on the replica's disk
 * for good, until the disk (in Kubernetes: the pod's emptyDir, whose limit evicts the pod with
 * every running instance) was full. programs.store_size bounds them: an upload that would pass
 * it is refused RESOURCE_EXHAUSTED, naming the key, and loses nothing stored; a re-upload of a
 * stored program still answers; a delete makes room. */
static uint64_t metric_of(const pie_proc *p, const char *name) {
    double v = -1;
    pie_status st;
    cr_assert_eq(pie_proc_metric(p, name, &v, &st), PIE_OK, "%s", st.msg);
    return (uint64_t)v;
}

Test(lifecycle, uploads_past_programs_store_size_are_refused_and_lose_nothing) {
    size_t len;
    free(read_fixture("lc_echo.wasm", &len));
    const size_t variant = len + PIE_TEST_WASM_VARIANT_EXTRA; /* upload_variant's size */
    char size_env[64];
    snprintf(size_env, sizeof size_env, "PIE_PROGRAMS_STORE_SIZE=%zu", 2 * variant + variant / 2);
    const char *extra[] = {size_env, NULL};
    cluster c;
    cluster_start(&c, extra, false);
    char ids[3][65];
    upload_variants(&c, 0, 2, ids);
    pie_status st;
    cr_assert_eq(upload_variant(&c, 2, ids[2], NULL, &st), PIE_RESOURCE_EXHAUSTED, "%s", st.msg);
    cr_expect(strstr(st.msg, "programs.store_size"), "the message names the bound: %s", st.msg);
    bool already = false;
    cr_assert_eq(upload_variant(&c, 0, ids[0], &already, &st), PIE_OK, "a stored one: %s", st.msg);
    cr_expect(already, "the re-upload stored it again");
    cr_expect_eq(metric_of(c.lc, "pie_lifecycle_programs_stored"), 2);
    cr_expect_eq(metric_of(c.lc, "pie_lifecycle_programs_stored_bytes"), 2 * variant);
    cr_expect_eq(metric_of(c.lc, "pie_lifecycle_programs_store_size_bytes"),
                 2 * variant + variant / 2);

    Pie__V1__DeleteProgramRequest dreq = PIE__V1__DELETE_PROGRAM_REQUEST__INIT;
    dreq.program_id = ids[0];
    cr_assert_eq(unary(&c, "DeleteProgram", &dreq.base,
                       &pie__v1__delete_program_response__descriptor, NULL, &st),
                 PIE_OK, "%s", st.msg);
    cr_assert_eq(upload_variant(&c, 2, ids[2], NULL, &st), PIE_OK, "after a delete: %s", st.msg);
    Pie__V1__ListProgramsResponse *lp = list_programs(&c);
    cr_expect_eq(lp->n_programs, 2);
    for (size_t i = 0; i < lp->n_programs; i++)
        cr_expect(strcmp(lp->programs[i]->program_id, ids[0]) != 0, "the deleted one is listed");
    rpc_msg_free(&lp->base);
    cluster_stop(&c);
}

/* A replica fetching a program from the registry for a launch stores it too, within the same
 * bound: a full store refuses the launch with the reason, and the replica that holds the
 * program launches it as before. */
Test(lifecycle, a_launch_that_would_fetch_past_programs_store_size_is_refused_clearly) {
    cluster c;
    cluster_start(&c, NULL, true);
    pie_status st;
    const char *extra[] = {"PIE_PROGRAMS_STORE_SIZE=1KiB", NULL};
    cluster c2 = second_replica(&c, "cache2", extra);

    char id[65];
    upload_variants(&c, 0, 1, &id);
    const char *args[] = {"exit", "5", NULL};
    launch_opts lo = {.args = args};
    uint64_t inst;
    cr_assert_eq(launch(&c2, id, &lo, &inst, &st), PIE_RESOURCE_EXHAUSTED, "%s", st.msg);
    cr_expect(strstr(st.msg, "programs.store_size"), "the message names the bound: %s", st.msg);
    cr_expect_eq(metric_of(c2.lc, "pie_lifecycle_programs_stored"), 0);
    inst = launch_ok(&c, id, &lo);
    expect_all_exit_5(&c, &inst, 1, "the replica holding it");
    stop_second_replica(&c2);
    cluster_stop(&c);
}

/* Replicas may share the directory; a delete through one removes the shared files, and the
 * other, told by the controller, found them gone and returned before unloading its copy: a
 * deleted program stayed loaded there (its native code mapped) until the loaded set's bound
 * pushed it out. */
Test(lifecycle, a_program_deleted_through_one_replica_is_unloaded_on_another_sharing_its_dir) {
    cluster c;
    cluster_start(&c, NULL, true);
    cluster c2 = second_replica(&c, "cache", NULL);
    char id[65];
    upload_variants(&c, 0, 1, &id);
    const char *args[] = {"exit", "5", NULL};
    launch_opts lo = {.args = args};
    uint64_t inst = launch_ok(&c2, id, &lo);
    expect_all_exit_5(&c2, &inst, 1, "the second replica");
    uint64_t before = metric_of(c2.lc, "pie_lifecycle_programs_loaded");
    cr_assert_geq(before, 1, "the launch loaded nothing");
    Pie__V1__DeleteProgramRequest dreq = PIE__V1__DELETE_PROGRAM_REQUEST__INIT;
    dreq.program_id = id;
    pie_status st;
    cr_assert_eq(unary(&c, "DeleteProgram", &dreq.base,
                       &pie__v1__delete_program_response__descriptor, NULL, &st),
                 PIE_OK, "%s", st.msg);
    uint64_t after = before;
    for (int k = 0; k < 100 && after >= before; k++) {
        pie_test_sleep_ms(50);
        after = metric_of(c2.lc, "pie_lifecycle_programs_loaded");
    }
    cr_expect_lt(after, before, "the deleted program stayed loaded on the other replica");
    uint64_t inst2;
    cr_expect_eq(launch(&c2, id, &lo, &inst2, &st), PIE_NOT_FOUND, "%s", st.msg);
    stop_second_replica(&c2);
    cluster_stop(&c);
}

/* Retention is by time and by count: a client launching short instances as fast as it can
 * made the replica keep every one that exited within instances.retention (60 s by default),
 * ~2 KiB each, with a table scanned at every launch — without bound. At most
 * instances.retention_max exited instances are kept; beyond it the earliest exits go first, so
 * a long-running instance that has just ended is kept over short ones launched after it. */
Test(lifecycle, at_most_retention_max_exited_instances_are_kept_the_latest_exits) {
    cluster c;
    const char *extra[] = {"PIE_INSTANCES_RETENTION=1h", "PIE_INSTANCES_RETENTION_MAX=8", NULL};
    cluster_start(&c, extra, true);
    char id[65];
    upload_ok(&c, "lc_echo.wasm", "echo", id);
    const char *wait_args[] = {"wait", NULL}, *exit_args[] = {"exit", "0", "x", NULL};
    launch_opts lw = {.args = wait_args}, le = {.args = exit_args};
    uint64_t longer = launch_ok(&c, id, &lw); /* launched first, ends last */
    wait_state(&c, longer, RUNNING);
#define N_SHORT 20
    uint64_t shorts[N_SHORT];
    for (int i = 0; i < N_SHORT; i++) {
        shorts[i] = launch_ok(&c, id, &le);
        wait_state(&c, shorts[i], EXITED);
    }
    Pie__V1__TerminateRequest tr = PIE__V1__TERMINATE_REQUEST__INIT;
    tr.instance_id = longer;
    pie_status st;
    cr_assert_eq(
        unary(&c, "Terminate", &tr.base, &pie__v1__terminate_response__descriptor, NULL, &st),
        PIE_OK, "%s", st.msg);
    wait_state(&c, longer, EXITED);
    uint64_t last = launch_ok(&c, id, &le); /* a launch makes room */
    wait_state(&c, last, EXITED);

    Pie__V1__ListInstancesResponse *l = list_instances(&c);
    size_t exited = 0;
    for (size_t i = 0; i < l->n_instances; i++)
        if (l->instances[i]->state == EXITED) exited++;
    rpc_msg_free(&l->base);
    cr_expect_leq(exited, 8, "%zu exited instances listed, instances.retention_max is 8", exited);
    cr_expect_eq(state_of(&c, longer), EXITED, "the latest exit was dropped before earlier ones");
    cr_expect_eq(state_of(&c, last), EXITED);
    cr_expect_eq(state_of(&c, shorts[N_SHORT - 1]), EXITED);
    cr_expect_eq(state_of(&c, shorts[0]), 0, "the earliest exit is still listed");
    cluster_stop(&c);
}

Test(lifecycle, run_exchanges_messages_and_attach_rules_hold) {
    cluster c;
    const char *extra[] = {"PIE_INSTANCES_OUTPUT_BUFFER=4KiB", NULL};
    cluster_start(&c, extra, true);
    char id[65];
    upload_ok(&c, "lc_echo.wasm", "echo", id);

    /* Run: started first, messages both ways, end of input, exit status last */
    const char *echo_args[] = {"echo", NULL};
    launch_opts lo = {.args = echo_args};
    rpc_stream *s = run_open(&c, id, &lo);
    seen sn;
    memset(&sn, 0, sizeof sn);
    sn.dropped_at = -1;
    const char *words[] = {"one", "two", "three"};
    for (int i = 0; i < 3; i++) {
        send_msg(s, true, words[i]);
        collect(s, &sn, i + 1);
        char want[32];
        snprintf(want, sizeof want, "echo:%s", words[i]);
        cr_assert_str_eq(sn.msgs[i], want);
    }
    cr_assert_neq(sn.started_id, 0, "started came first");
    close_input_run(s);
    collect(s, &sn, 0);
    rpc_stream_destroy(s);
    cr_assert_eq(sn.call_code, PIE_OK, "%s", sn.call_msg);
    cr_assert(sn.exited && sn.exit_code_status == 0 && sn.exit_code == 0, "%s", sn.exit_msg);
    cr_assert_str_eq(sn.out, "input closed after 3 messages\n");

    /* a client message above message_bytes ends the call with INVALID_ARGUMENT */
    launch_opts small = {.args = echo_args, .message_bytes = 8};
    s = run_open(&c, id, &small);
    memset(&sn, 0, sizeof sn);
    sn.dropped_at = -1;
    send_msg(s, true, "this is longer than eight bytes");
    collect(s, &sn, 0);
    rpc_stream_destroy(s);
    cr_assert_eq(sn.call_code, PIE_INVALID_ARGUMENT, "%s", sn.call_msg);
    cr_assert(strstr(sn.call_msg, "message_bytes"), "%s", sn.call_msg);
    /* ...and the Run call's end (a cancel from the server's side is not the client's) leaves
     * the instance to the Run rules: it was cancelled before exit, so it is terminated */
    wait_state(&c, sn.started_id, EXITED);

    /* one attachment at a time; Terminate ends it with CANCELLED */
    const char *wait_args[] = {"wait", NULL};
    launch_opts wo = {.args = wait_args};
    uint64_t inst = launch_ok(&c, id, &wo);
    wait_state(&c, inst, RUNNING);
    rpc_stream *a = attach_open(&c, inst);
    pie_status st;
    cr_assert_eq(rpc_stream_wait_ready(a, WAIT_MS, &st), PIE_OK, "%s", st.msg);
    int64_t deadline = pie_test_now_ms() + WAIT_MS;
    for (;;) { /* the first attach is registered once ListInstances says so */
        Pie__V1__ListInstancesResponse *l = list_instances(&c);
        bool att = false;
        for (size_t i = 0; i < l->n_instances; i++) {
            const Pie__V1__InstanceInfo *info = l->instances[i];
            if (info->instance_id != inst) continue;
            att = info->attached;
            cr_assert(info->usage && info->usage->memory_bytes > 0 &&
                          info->usage->memory_bytes % 65536 == 0,
                      "a running instance reports its linear memory now (%llu bytes)",
                      info->usage ? (unsigned long long)info->usage->memory_bytes : 0ull);
        }
        rpc_msg_free(&l->base);
        if (att) break;
        cr_assert(pie_test_now_ms() < deadline, "never attached");
        pie_test_sleep_ms(20);
    }
    seen second;
    attach_all(&c, inst, &second);
    cr_assert_eq(second.call_code, PIE_FAILED_PRECONDITION, "%s", second.call_msg);
    Pie__V1__TerminateRequest tr = PIE__V1__TERMINATE_REQUEST__INIT;
    tr.instance_id = inst;
    cr_assert_eq(
        unary(&c, "Terminate", &tr.base, &pie__v1__terminate_response__descriptor, NULL, &st),
        PIE_OK, "%s", st.msg);
    memset(&sn, 0, sizeof sn);
    sn.dropped_at = -1;
    collect(a, &sn, 0);
    rpc_stream_destroy(a);
    cr_assert(sn.exited);
    cr_assert_eq(sn.exit_code_status, PIE_CANCELLED);
    cr_assert_str_eq(sn.exit_msg, "terminated by client");

    /* a Run cancelled by its client terminates the instance */
    s = run_open(&c, id, &wo);
    memset(&sn, 0, sizeof sn);
    ProtobufCMessage *m = NULL;
    cr_assert_eq(rpc_stream_recv(s, &m, WAIT_MS), RPC_RECV_MESSAGE);
    take(&sn, (Pie__V1__AttachResponse *)m);
    rpc_msg_free(m);
    cr_assert_neq(sn.started_id, 0);
    rpc_stream_cancel(s);
    rpc_stream_finish(s, &st);
    rpc_stream_destroy(s);
    wait_state(&c, sn.started_id, EXITED);
    Pie__V1__ListInstancesResponse *l = list_instances(&c);
    for (size_t i = 0; i < l->n_instances; i++)
        if (l->instances[i]->instance_id == sn.started_id)
            cr_assert_eq(l->instances[i]->exit_status->status->code, PIE_CANCELLED);
    rpc_msg_free(&l->base);

    /* output beyond the 4 KiB buffer while detached: oldest dropped, reported once */
    const char *spam_args[] = {"spam", "10000", NULL};
    launch_opts so = {.args = spam_args};
    inst = launch_ok(&c, id, &so);
    wait_state(&c, inst, EXITED);
    attach_all(&c, inst, &sn);
    cr_assert_eq(sn.dropped_at, 0, "dropped_bytes comes first");
    cr_assert_eq(sn.dropped + sn.n_out, 10000, "dropped %llu + delivered %zu",
                 (unsigned long long)sn.dropped, sn.n_out);
    cr_assert_leq(sn.n_out, 4096);
    cr_assert(sn.exited && sn.exit_code == 0);
    cr_assert(healthy(&c));
    cluster_stop(&c);
}

Test(lifecycle, hostile_instances_end_alone_with_a_clear_reason) {
    cluster c;
    cluster_start(&c, NULL, true);
    char echo[65], hostile[65];
    upload_ok(&c, "lc_echo.wasm", "echo", echo);
    upload_ok(&c, "hostile.wasm", "hostile", hostile);

    /* a well-behaved instance runs throughout */
    const char *echo_args[] = {"echo", NULL};
    launch_opts eo = {.args = echo_args};
    rpc_stream *good = run_open(&c, echo, &eo);
    seen gs;
    memset(&gs, 0, sizeof gs);
    gs.dropped_at = -1;
    send_msg(good, true, "before");
    collect(good, &gs, 1);

    struct {
        const char *args[3];
        uint64_t cpu_ms, memory_bytes;
        pie_code want;
        const char *reason;
    } cases[] = {
        {{"oob-read", NULL}, 0, 0, PIE_ABORTED, "out-of-bounds"},
        {{"loop", NULL}, 300, 0, PIE_DEADLINE_EXCEEDED, "CPU"},
        {{"recurse", NULL}, 0, 0, PIE_ABORTED, "stack"},
        {{"storm", NULL}, 0, 16 << 20, PIE_RESOURCE_EXHAUSTED, "memory"},
        {{"div0", NULL}, 0, 0, PIE_ABORTED, "divide"},
    };
    size_t n = sizeof cases / sizeof cases[0];
    uint64_t ids[8];
    for (size_t i = 0; i < n; i++) {
        launch_opts o = {.args = cases[i].args,
                         .cpu_ms = cases[i].cpu_ms,
                         .memory_bytes = cases[i].memory_bytes};
        ids[i] = launch_ok(&c, hostile, &o);
    }
    for (size_t i = 0; i < n; i++) {
        seen s;
        attach_all(&c, ids[i], &s);
        cr_assert(s.exited, "%s: no exit status", cases[i].args[0]);
        cr_assert_eq(s.exit_code_status, (uint32_t)cases[i].want, "%s: status %u (%s)",
                     cases[i].args[0], s.exit_code_status, s.exit_msg);
        cr_assert(strcasestr(s.exit_msg, cases[i].reason), "%s: reason \"%s\" lacks \"%s\"",
                  cases[i].args[0], s.exit_msg, cases[i].reason);
    }
    /* wall_ms counts while the instance waits in a host call too */
    const char *wait_args[] = {"wait", NULL};
    launch_opts wo = {.args = wait_args, .wall_ms = 300};
    seen ws;
    attach_all(&c, launch_ok(&c, echo, &wo), &ws);
    cr_assert(ws.exited);
    cr_assert_eq(ws.exit_code_status, PIE_DEADLINE_EXCEEDED, "%s", ws.exit_msg);
    cr_assert(strstr(ws.exit_msg, "wall"), "%s", ws.exit_msg);

    /* API abuse: the host or the controller refuses, the inferlet reads why and exits 1 */
    struct {
        const char *kind, *reason;
    } abuse[] = {
        {"alloc-storm", "4096 more KV pages would exceed the instance's limit of 1024"},
        {"foreign-ids", "kv page 777 is not allocated in this instance"},
        {"oversize", "exceeds the instance's message_bytes limit"},
        {"bad-url", "is not allowed"},
        {"future-storm", "futures armed"},
    };
    for (size_t i = 0; i < sizeof abuse / sizeof abuse[0]; i++) {
        const char *args[] = {"abuse", abuse[i].kind, NULL};
        launch_opts o = {.args = args, .message_bytes = 64 << 10};
        seen s;
        attach_all(&c, launch_ok(&c, echo, &o), &s);
        cr_assert(s.exited, "%s: no exit status", abuse[i].kind);
        cr_assert(s.exit_code_status == 0 && s.exit_code == 1, "%s: status %u code %d (%s) %.*s",
                  abuse[i].kind, s.exit_code_status, s.exit_code, s.exit_msg, (int)s.n_err, s.err);
        cr_assert(memmem(s.err, s.n_err, abuse[i].reason, strlen(abuse[i].reason)),
                  "%s: stderr \"%.*s\" lacks \"%s\"", abuse[i].kind, (int)s.n_err, s.err,
                  abuse[i].reason);
    }

    /* the good one is untouched */
    send_msg(good, true, "after");
    collect(good, &gs, 2);
    cr_assert_str_eq(gs.msgs[1], "echo:after");
    close_input_run(good);
    collect(good, &gs, 0);
    rpc_stream_destroy(good);
    cr_assert(gs.exited && gs.exit_code_status == 0 && gs.exit_code == 0, "%s", gs.exit_msg);
    cr_assert(healthy(&c));
    cluster_stop(&c);
}

/* ---- piectl --------------------------------------------------------------------------------- */

/* Runs piectl against the cluster's lifecycle; returns its exit status, *log its output. */
static int piectl(cluster *c, const char *const *args, char **log) {
    const char *argv[16] = {"--addr", pie_proc_addr(c->lc), "--timeout", "30000"};
    size_t n = 4;
    for (size_t i = 0; args[i] && n < 15; i++) argv[n++] = args[i];
    argv[n] = NULL;
    pie_proc_opts o = {.args = argv};
    pie_status st;
    pie_proc *p = pie_proc_spawn("piectl", &o, &st);
    cr_assert(p, "%s", st.msg);
    int rc = pie_proc_wait(p, 60000, &st);
    *log = pie_proc_log(p);
    pie_proc_destroy(p);
    return rc;
}

Test(lifecycle, piectl_runs_inferlets_and_reports_their_exit) {
    cluster c;
    cluster_start(&c, NULL, true);
    char *log = NULL;
    /* a file is uploaded first; the inferlet's exit code becomes piectl's */
    const char *run_exit[] = {"run", PIE_WASM_FIXTURES "/lc_echo.wasm", "exit", "7", NULL};
    cr_assert_eq(piectl(&c, run_exit, &log), 7, "%s", log);
    cr_assert(strstr(log, "hello exit 7\n") && strstr(log, "to stderr\n"), "%s", log);
    free(log);
    /* stdin is /dev/null here: the input is closed at once */
    const char *run_echo[] = {"run", PIE_WASM_FIXTURES "/lc_echo.wasm", "echo", NULL};
    cr_assert_eq(piectl(&c, run_echo, &log), 0, "%s", log);
    cr_assert(strstr(log, "input closed after 0 messages"), "%s", log);
    free(log);
    /* a status other than OK: 100 + its code, with the reason on stderr */
    const char *run_loop[] = {"run",  "--cpu-ms", "200", PIE_WASM_FIXTURES "/hostile.wasm",
                              "loop", NULL};
    cr_assert_eq(piectl(&c, run_loop, &log), 100 + PIE_DEADLINE_EXCEEDED, "%s", log);
    cr_assert(strstr(log, "DEADLINE_EXCEEDED") && strstr(log, "CPU time"), "%s", log);
    free(log);
    /* ps lists them; programs lists both uploads; an unknown instance is a readable error */
    const char *ps[] = {"ps", NULL};
    cr_assert_eq(piectl(&c, ps, &log), 0, "%s", log);
    cr_assert(strstr(log, "exited") && strstr(log, "code 7") && strstr(log, "DEADLINE_EXCEEDED"),
              "%s", log);
    free(log);
    const char *programs[] = {"programs", NULL};
    cr_assert_eq(piectl(&c, programs, &log), 0, "%s", log);
    cr_assert(strstr(log, "lc_echo.wasm") && strstr(log, "hostile.wasm"), "%s", log);
    cr_expect(strstr(log, "held by anonymous"), "without tenants the one tenant holds all: %s",
              log);
    free(log);
    const char *kill[] = {"kill", "123", NULL};
    cr_assert_eq(piectl(&c, kill, &log), 1, "%s", log);
    cr_assert(strstr(log, "NOT_FOUND"), "%s", log);
    free(log);
    cluster_stop(&c);
}
