/* e2e_support.c — cluster, Lifecycle API client and reference engine of the end-to-end
 * inferlet tests (see e2e_support.h). */
#include "e2e_support.h"

#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "eng.h"
#include "mdl.h"
#include "pie/v1/controller.pb-c.h"
#include "pie/v1/lifecycle.pb-c.h"
#include "pie_testutil.h"
#include "tok.h"

#define START_MS 60000
#define STOP_MS  30000
#define RUN_MS   240000 /* sanitizer builds on 2 shared cores are slow */
#define WAIT_MS  60000  /* hang guard of every poll */

/* ---- cluster ------------------------------------------------------------------------------ */

/* Room in pie-lifecycle's environment: the 4 settings every e2e cluster gets, the caller's
 * extra ones and the terminating NULL. */
#define LC_ENV_MAX 16

/* Room in pie-worker's environment: the 6 settings every e2e worker gets, the caller's extra
 * ones and the terminating NULL. */
#define WRK_ENV_MAX 16

pie_proc *e2e_worker_start(const char *ctl_env) { return e2e_worker_start_env(ctl_env, NULL); }

pie_proc *e2e_worker_start_env(const char *ctl_env, const char *const *extra) {
    pie_proc *w = e2e_worker_spawn_env(ctl_env, extra);
    pie_status st;
    if (pie_proc_wait_ready(w, START_MS, &st) != PIE_OK) {
        pie_proc_destroy(w);
        cr_assert_fail("%s", st.msg);
    }
    return w;
}

pie_proc *e2e_worker_spawn_env(const char *ctl_env, const char *const *extra) {
    const char *wenv[WRK_ENV_MAX] = {ctl_env,
                                     "PIE_MODEL_PATH=" PIE_MODELS_DIR "/" E2E_MODEL,
                                     "PIE_BACKEND=cpu",
                                     "PIE_ENGINE_THREADS=1",
                                     "PIE_POOL_KV_PAGES=512",
                                     "PIE_POOL_EMBED_SLOTS=1024"};
    size_t n = 6;
    for (size_t i = 0; extra && extra[i]; i++) {
        cr_assert_lt(n, WRK_ENV_MAX - 1, "more than %d extra worker settings", WRK_ENV_MAX - 7);
        wenv[n++] = extra[i];
    }
    pie_proc_opts wo = {.env = wenv};
    pie_status st;
    pie_proc *w = pie_proc_spawn("pie-worker", &wo, &st);
    cr_assert(w, "%s", st.msg);
    return w;
}

void e2e_cluster_start_env(e2e_cluster *c, const char *const *lc_env) {
    e2e_cluster_start_token(c, lc_env, NULL);
}

void e2e_cluster_start_token(e2e_cluster *c, const char *const *lc_env, const char *token) {
    e2e_cluster_start_full(c, NULL, lc_env, token);
}

void e2e_cluster_start_full(e2e_cluster *c, const char *const *wrk_env, const char *const *lc_env,
                            const char *token) {
    e2e_cluster_start_ctl(c, NULL, wrk_env, lc_env, token);
}

void e2e_cluster_start_ctl(e2e_cluster *c, const char *const *ctl_env, const char *const *wrk_env,
                           const char *const *lc_env, const char *token) {
    pie_status st;
    *c = (e2e_cluster){0};
    pie_proc_opts co = {.env = ctl_env};
    c->ctl = pie_proc_start("pie-controller", &co, START_MS, &st);
    cr_assert(c->ctl, "%s", st.msg);
    char ctl_addr[96];
    pie_proc_env_controller(c->ctl, ctl_addr, sizeof ctl_addr);
    c->wrk = e2e_worker_start_env(ctl_addr, wrk_env);
    e2e_cluster_start_lifecycle(c, lc_env, token);
}

void e2e_cluster_start_lifecycle(e2e_cluster *c, const char *const *lc_env, const char *token) {
    pie_status st;
    char ctl_env[96];
    pie_proc_env_controller(c->ctl, ctl_env, sizeof ctl_env);
    c->cache_dir = pie_proc_tmpdir(&st);
    cr_assert(c->cache_dir, "%s", st.msg);
    char cache_env[600];
    snprintf(cache_env, sizeof cache_env, "PIE_RUNTIME_CACHE_DIR=%s", c->cache_dir);
    const char *lenv[LC_ENV_MAX] = {ctl_env, cache_env,
                                    "PIE_TOKENIZER_PATH=" PIE_MODELS_DIR "/" E2E_MODEL,
                                    "PIE_RUNTIME_TIER1=false"};
    size_t n = 4;
    for (size_t i = 0; lc_env && lc_env[i]; i++) {
        cr_assert_lt(n, LC_ENV_MAX - 1, "more than %d extra lifecycle settings", LC_ENV_MAX - 5);
        lenv[n++] = lc_env[i];
    }
    pie_proc_opts lo = {.env = lenv};
    c->lc = pie_proc_start("pie-lifecycle", &lo, START_MS, &st);
    cr_assert(c->lc, "%s", st.msg);
    rpc_channel_opts co = {.token = token};
    c->ch = rpc_channel_create(pie_proc_addr(c->lc), &co, &st);
    cr_assert(c->ch, "%s", st.msg);
    /* its first launch must not race the worker's registration */
    cr_assert_gt(pie_test_wait_models(c->ch, START_MS), 0, "the lifecycle never learned a model");
}

void e2e_cluster_start(e2e_cluster *c) { e2e_cluster_start_env(c, NULL); }

static void stop_one(pie_proc *p) {
    if (!p) return;
    pie_status st;
    int rc = pie_proc_stop(p, STOP_MS, &st);
    char *tail = pie_proc_log_tail(p, 4000);
    cr_expect_eq(rc, 0, "%s exited with %d: %s\nlog:\n%s", pie_proc_name(p), rc, st.msg,
                 tail ? tail : "");
    cr_expect_eq(pie_proc_log_count(p, "AddressSanitizer") +
                     pie_proc_log_count(p, "runtime error:") +
                     pie_proc_log_count(p, "LeakSanitizer"),
                 0, "%s reported a sanitizer error:\n%s", pie_proc_name(p), tail ? tail : "");
    free(tail);
    pie_proc_destroy(p);
}

void e2e_cluster_stop(e2e_cluster *c) {
    rpc_channel_destroy(c->ch);
    stop_one(c->lc);
    stop_one(c->wrk);
    stop_one(c->ctl);
    if (c->cache_dir) {
        /* the program cache has sub-directories: remove them with the shell */
        char cmd[700];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", c->cache_dir);
        cr_expect_eq(system(cmd), 0, "could not remove %s", c->cache_dir);
        free(c->cache_dir);
    }
    *c = (e2e_cluster){0};
}

Pie__V1__ClusterStatusResponse *e2e_cluster_status(rpc_channel *ctl, int64_t timeout_ms) {
    Pie__V1__ClusterStatusRequest req = PIE__V1__CLUSTER_STATUS_REQUEST__INIT;
    ProtobufCMessage *m = NULL;
    pie_status st;
    rpc_call_opts o = {.timeout_ms = timeout_ms};
    if (rpc_unary(ctl, "/pie.v1.Controller/ClusterStatus", &req.base,
                  &pie__v1__cluster_status_response__descriptor, &m, &o, &st) != PIE_OK)
        return NULL;
    return (Pie__V1__ClusterStatusResponse *)m;
}

Pie__V1__MemoryPolicy e2e_wait_worker(rpc_channel *ctl, const char *group) {
    int64_t until = pie_test_now_ms() + WAIT_MS;
    for (;;) {
        Pie__V1__ClusterStatusResponse *cs = e2e_cluster_status(ctl, WAIT_MS);
        bool ok = cs && cs->n_workers == 1 && strcmp(cs->workers[0]->group_id, group) == 0;
        Pie__V1__MemoryPolicy p = ok ? cs->workers[0]->memory_policy : 0;
        rpc_msg_free(cs ? &cs->base : NULL);
        if (ok) return p;
        cr_assert(pie_test_now_ms() < until, "worker %s never linked alone", group);
        pie_test_sleep_ms(10);
    }
}

Pie__V1__MemoryPolicy e2e_wait_serving(e2e_cluster *c, rpc_channel *ctl, const char *group) {
    Pie__V1__MemoryPolicy p = e2e_wait_worker(ctl, group);
    cr_assert_gt(pie_test_wait_models(c->ch, WAIT_MS), 0,
                 "the lifecycle never learned worker %s's model", group);
    return p;
}

void e2e_worker_replace(e2e_cluster *c, const char *what, const char *const *env) {
    pie_status st;
    int rc = pie_proc_stop(c->wrk, WAIT_MS, &st);
    cr_assert_eq(rc, 0, "%s exited with %d: %s", what, rc, st.msg);
    pie_proc_destroy(c->wrk);
    char ctl_env[96];
    pie_proc_env_controller(c->ctl, ctl_env, sizeof ctl_env);
    c->wrk = e2e_worker_start_env(ctl_env, env);
}

/* ---- Lifecycle API ------------------------------------------------------------------------ */

static uint8_t *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    cr_assert(f, "cannot open %s (is the inferlet built?)", path);
    cr_assert_eq(fseek(f, 0, SEEK_END), 0);
    long n = ftell(f);
    cr_assert_geq(n, 0);
    cr_assert_eq(fseek(f, 0, SEEK_SET), 0);
    uint8_t *b = malloc((size_t)n + 1);
    cr_assert(b);
    cr_assert_eq(fread(b, 1, (size_t)n, f), (size_t)n, "short read of %s", path);
    fclose(f);
    *len = (size_t)n;
    return b;
}

char *e2e_upload(e2e_cluster *c, const char *name) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s.wasm", PIE_INFERLETS_DIR, name);
    return e2e_upload_path(c, path, name);
}

/* Sends one request message of s: true if sent, false if the call has already ended (the server
 * finished it early: its status then comes from rpc_stream_finish). what names it in failures. */
static bool stream_send(rpc_stream *s, const ProtobufCMessage *m, const char *what) {
    pie_status st;
    pie_code rc = rpc_stream_send(s, m, &st);
    cr_assert(rc == PIE_OK || rc == PIE_UNAVAILABLE, "%s: %s", what, st.msg);
    return rc == PIE_OK;
}

rpc_stream *e2e_upload_begin(e2e_cluster *c, const char *name, uint64_t size_bytes,
                             const uint8_t *bytes, size_t len, int64_t timeout_ms) {
    pie_status st;
    rpc_call_opts o = {.timeout_ms = timeout_ms, .wait_for_ready = true};
    rpc_stream *s = rpc_stream_open(c->ch, "/pie.v1.Lifecycle/UploadProgram",
                                    &pie__v1__upload_program_response__descriptor, &o, &st);
    cr_assert(s, "UploadProgram: %s", st.msg);
    Pie__V1__ProgramMetadata md = PIE__V1__PROGRAM_METADATA__INIT;
    md.name = (char *)name;
    md.size_bytes = size_bytes;
    Pie__V1__UploadProgramRequest req = PIE__V1__UPLOAD_PROGRAM_REQUEST__INIT;
    req.part_case = PIE__V1__UPLOAD_PROGRAM_REQUEST__PART_METADATA;
    req.metadata = &md;
    if (!stream_send(s, &req.base, "upload metadata")) return s;
    for (size_t at = 0; at < len; at += 65536) {
        Pie__V1__UploadProgramRequest chunk = PIE__V1__UPLOAD_PROGRAM_REQUEST__INIT;
        chunk.part_case = PIE__V1__UPLOAD_PROGRAM_REQUEST__PART_CHUNK;
        chunk.chunk.data = (uint8_t *)bytes + at;
        chunk.chunk.len = len - at < 65536 ? len - at : 65536;
        if (!stream_send(s, &chunk.base, "upload chunk")) return s;
    }
    return s;
}

pie_code e2e_upload_end(rpc_stream *s, pie_status *st) {
    rpc_stream_close_send(s, st);
    ProtobufCMessage *m = NULL;
    while (rpc_stream_recv(s, &m, RUN_MS) == RPC_RECV_MESSAGE) rpc_msg_free(m);
    pie_code rc = rpc_stream_finish(s, st);
    rpc_stream_destroy(s);
    return rc;
}

char *e2e_upload_path(e2e_cluster *c, const char *path, const char *name) {
    size_t len;
    uint8_t *bytes = read_file(path, &len);
    pie_status st;
    rpc_stream *s = e2e_upload_begin(c, name, len, bytes, len, RUN_MS);
    cr_assert_eq(rpc_stream_close_send(s, &st), PIE_OK, "%s", st.msg);
    ProtobufCMessage *m = NULL;
    rpc_recv_result rr = rpc_stream_recv(s, &m, RUN_MS);
    pie_code fin = rr == RPC_RECV_MESSAGE ? PIE_OK : rpc_stream_finish(s, &st);
    cr_assert_eq(rr, RPC_RECV_MESSAGE, "UploadProgram %s: no response (%d: %s)", name, (int)fin,
                 st.msg);
    Pie__V1__UploadProgramResponse *resp = (Pie__V1__UploadProgramResponse *)m;
    cr_assert_eq(resp->size_bytes, len);
    char *id = strdup(resp->program_id);
    cr_assert_eq(strlen(id), 64, "program id \"%s\"", id);
    rpc_msg_free(m);
    cr_assert_eq(rpc_stream_finish(s, &st), PIE_OK, "UploadProgram %s: %s", name, st.msg);
    rpc_stream_destroy(s);
    free(bytes);
    return id;
}

uint64_t e2e_launch(e2e_cluster *c, const char *program_id, const char *const *args,
                    pie_code want, pie_status *st) {
    Pie__V1__LaunchRequest req = PIE__V1__LAUNCH_REQUEST__INIT;
    req.program_id = (char *)program_id;
    size_t n = 0;
    while (args && args[n]) n++;
    req.args = (char **)args;
    req.n_args = n;
    ProtobufCMessage *m = NULL;
    rpc_call_opts o = {.timeout_ms = RUN_MS};
    pie_code rc = rpc_unary(c->ch, "/pie.v1.Lifecycle/Launch", &req.base,
                            &pie__v1__launch_response__descriptor, &m, &o, st);
    cr_assert_eq(rc, want, "Launch: %s %s", pie_code_name(rc), st->msg);
    uint64_t id = rc == PIE_OK ? ((Pie__V1__LaunchResponse *)m)->instance_id : 0;
    rpc_msg_free(m);
    return id;
}

pie_code e2e_terminate(e2e_cluster *c, uint64_t id, pie_status *st) {
    Pie__V1__TerminateRequest req = PIE__V1__TERMINATE_REQUEST__INIT;
    req.instance_id = id;
    ProtobufCMessage *m = NULL;
    rpc_call_opts o = {.timeout_ms = RUN_MS};
    pie_code rc = rpc_unary(c->ch, "/pie.v1.Lifecycle/Terminate", &req.base,
                            &pie__v1__terminate_response__descriptor, &m, &o, st);
    rpc_msg_free(m);
    return rc;
}

const Pie__V1__InstanceInfo *e2e_instance(e2e_cluster *c, uint64_t id,
                                          Pie__V1__ListInstancesResponse **resp) {
    Pie__V1__ListInstancesRequest req = PIE__V1__LIST_INSTANCES_REQUEST__INIT;
    ProtobufCMessage *m = NULL;
    pie_status st;
    rpc_call_opts o = {.timeout_ms = RUN_MS};
    cr_assert_eq(rpc_unary(c->ch, "/pie.v1.Lifecycle/ListInstances", &req.base,
                           &pie__v1__list_instances_response__descriptor, &m, &o, &st),
                 PIE_OK, "ListInstances: %s", st.msg);
    *resp = (Pie__V1__ListInstancesResponse *)m;
    for (size_t i = 0; i < (*resp)->n_instances; i++)
        if ((*resp)->instances[i]->instance_id == id) return (*resp)->instances[i];
    return NULL;
}

void e2e_wait_memory(e2e_cluster *c, uint64_t id, uint64_t bytes) {
    int64_t deadline = pie_test_now_ms() + 20000;
    for (;;) {
        Pie__V1__ListInstancesResponse *r;
        const Pie__V1__InstanceInfo *in = e2e_instance(c, id, &r);
        uint64_t got = in && in->usage ? in->usage->memory_bytes : 0;
        rpc_msg_free(&r->base);
        if (got >= bytes) return;
        cr_assert_lt(pie_test_now_ms(), deadline, "instance %llx holds %llu bytes, wanted %llu",
                     (unsigned long long)id, (unsigned long long)got, (unsigned long long)bytes);
        pie_test_sleep_ms(20);
    }
}

static void append(char **buf, size_t *len, const uint8_t *p, size_t n) {
    char *b = realloc(*buf, *len + n + 1);
    cr_assert(b);
    memcpy(b + *len, p, n);
    *len += n;
    b[*len] = 0;
    *buf = b;
}

static void take_response(e2e_run *r, const Pie__V1__AttachResponse *a) {
    switch (a->msg_case) {
    case PIE__V1__ATTACH_RESPONSE__MSG_MESSAGE:
        r->msgs = realloc(r->msgs, (r->n_msgs + 1) * sizeof *r->msgs);
        r->msg_lens = realloc(r->msg_lens, (r->n_msgs + 1) * sizeof *r->msg_lens);
        cr_assert(r->msgs && r->msg_lens);
        r->msgs[r->n_msgs] = NULL;
        r->msg_lens[r->n_msgs] = 0;
        append(&r->msgs[r->n_msgs], &r->msg_lens[r->n_msgs], a->message.data, a->message.len);
        r->n_msgs++;
        break;
    case PIE__V1__ATTACH_RESPONSE__MSG_STDOUT_DATA:
        append(&r->out, &r->out_len, a->stdout_data.data, a->stdout_data.len);
        break;
    case PIE__V1__ATTACH_RESPONSE__MSG_STDERR_DATA:
        append(&r->err, &r->err_len, a->stderr_data.data, a->stderr_data.len);
        break;
    case PIE__V1__ATTACH_RESPONSE__MSG_EXIT_STATUS:
        r->exited = true;
        r->exit_code = a->exit_status->exit_code;
        if (a->exit_status->status) {
            r->status_code = a->exit_status->status->code;
            r->status_msg =
                strdup(a->exit_status->status->message ? a->exit_status->status->message : "");
        }
        break;
    default: break;
    }
}

rpc_stream *e2e_run_open(e2e_cluster *c, const char *program_id, const char *const *args,
                         const char *const *in) {
    pie_status st;
    rpc_call_opts o = {.timeout_ms = RUN_MS, .wait_for_ready = true};
    rpc_stream *s = rpc_stream_open(c->ch, "/pie.v1.Lifecycle/Run",
                                    &pie__v1__attach_response__descriptor, &o, &st);
    cr_assert(s, "Run: %s", st.msg);
    size_t n_args = 0;
    while (args && args[n_args]) n_args++;
    Pie__V1__LaunchRequest launch = PIE__V1__LAUNCH_REQUEST__INIT;
    launch.program_id = (char *)program_id;
    launch.args = (char **)args;
    launch.n_args = n_args;
    Pie__V1__RunRequest req = PIE__V1__RUN_REQUEST__INIT;
    req.msg_case = PIE__V1__RUN_REQUEST__MSG_LAUNCH;
    req.launch = &launch;
    /* An instance may end (and the server finish the call) before all its input is sent: the
     * sends then fail UNAVAILABLE and e2e_run_collect still reads everything it said. */
    if (!stream_send(s, &req.base, "Run launch")) return s;
    for (size_t i = 0; in && in[i]; i++) {
        Pie__V1__RunRequest m = PIE__V1__RUN_REQUEST__INIT;
        m.msg_case = PIE__V1__RUN_REQUEST__MSG_MESSAGE;
        m.message.data = (uint8_t *)in[i];
        m.message.len = strlen(in[i]);
        if (!stream_send(s, &m.base, "Run message")) return s;
    }
    Pie__V1__CloseInput ci = PIE__V1__CLOSE_INPUT__INIT;
    Pie__V1__RunRequest close = PIE__V1__RUN_REQUEST__INIT;
    close.msg_case = PIE__V1__RUN_REQUEST__MSG_CLOSE_INPUT;
    close.close_input = &ci;
    stream_send(s, &close.base, "Run close_input");
    return s;
}

void e2e_run_collect(rpc_stream *s, e2e_run *r) {
    *r = (e2e_run){0};
    for (;;) {
        ProtobufCMessage *m = NULL;
        rpc_recv_result rr = rpc_stream_recv(s, &m, RUN_MS);
        cr_assert_neq(rr, RPC_RECV_TIMEOUT, "Run: nothing for %d ms", RUN_MS);
        if (rr == RPC_RECV_END) break;
        take_response(r, (const Pie__V1__AttachResponse *)m);
        rpc_msg_free(m);
    }
    pie_status st;
    cr_assert_eq(rpc_stream_finish(s, &st), PIE_OK, "Run: %s", st.msg);
    rpc_stream_destroy(s);
    cr_assert(r->exited, "Run ended without an exit status; stderr:\n%s", r->err ? r->err : "");
}

void e2e_run_program(e2e_cluster *c, const char *program_id, const char *const *args,
                     const char *const *in, e2e_run *r) {
    e2e_run_collect(e2e_run_open(c, program_id, args, in), r);
    r->cluster = c;
}

/* The last lines of each service's log, on stderr: what a failed run's status alone hides (a
 * worker dropped, a replica refused, a sanitizer report). */
static void print_service_logs(const e2e_cluster *c) {
    const pie_proc *procs[] = {c->ctl, c->wrk, c->lc};
    for (size_t i = 0; i < sizeof procs / sizeof procs[0]; i++) {
        if (!procs[i]) continue;
        char *tail = pie_proc_log_tail(procs[i], 3000);
        fprintf(stderr, "---- %s log (tail) ----\n%s\n", pie_proc_name(procs[i]),
                tail ? tail : "(unreadable)");
        free(tail);
    }
}

void e2e_assert_success(const e2e_run *r, const char *what) {
    bool ok = r->exited && r->status_code == 0 && r->exit_code == 0;
    if (!ok && r->cluster) print_service_logs(r->cluster);
    cr_assert(ok, "%s: status %u \"%s\", exit code %d; stderr:\n%s", what, r->status_code,
              r->status_msg ? r->status_msg : "", r->exit_code, r->err ? r->err : "");
}

void e2e_run_free(e2e_run *r) {
    for (size_t i = 0; i < r->n_msgs; i++) free(r->msgs[i]);
    free(r->msgs);
    free(r->msg_lens);
    free(r->out);
    free(r->err);
    free(r->status_msg);
    *r = (e2e_run){0};
}

/* ---- the same programs on two workers ----------------------------------------------------- */

void e2e_upload_programs(e2e_cluster *c, char *ids[3]) {
    ids[0] = e2e_upload(c, "text_completion");
    ids[1] = e2e_upload(c, "parallel_generation");
    ids[2] = e2e_upload(c, "prefix_caching");
}

const char *const e2e_tc_args[] = {"--prompt", E2E_TC_PROMPT,  "--max-tokens",
                                   "32",       "--ignore-eos", NULL};

void e2e_run_programs(e2e_cluster *c, char *const ids[3], const char *prefix_name,
                      e2e_run out[E2E_N_RUNS]) {
    const char *const pg_args[] = {
        "--prompt",     "In a small village by the sea there lived an old fisherman who",
        "--n",          "3",
        "--suffixes",   " one day| never|",
        "--max-tokens", "20",
        "--ignore-eos", NULL};
    const char *const pc_args[] = {
        "--prefix",     "You are a helpful assistant who answers briefly and precisely.",
        "--prompt",     " Question: what is the color of the sky? Answer:",
        "--max-tokens", "16",
        "--ignore-eos", "--name",
        prefix_name,    NULL};
    const char *const pc_unexport[] = {"--unexport", "--name", prefix_name, NULL};
    const char *const *args[E2E_N_RUNS] = {e2e_tc_args, pg_args, pc_args, pc_args, pc_unexport};
    const int prog[E2E_N_RUNS] = {0, 1, 2, 2, 2};
    for (int i = 0; i < E2E_N_RUNS; i++) {
        e2e_run_program(c, ids[prog[i]], args[i], NULL, &out[i]);
        char what[32];
        snprintf(what, sizeof what, "run %d", i);
        e2e_assert_success(&out[i], what);
    }
}

void e2e_expect_same_msgs(const e2e_run *got, const e2e_run *want, const char *what,
                          const char *got_side, const char *want_side) {
    cr_expect_eq(got->n_msgs, want->n_msgs, "%s: %zu messages from %s, %zu from %s", what,
                 got->n_msgs, got_side, want->n_msgs, want_side);
    for (size_t j = 0; j < got->n_msgs && j < want->n_msgs; j++)
        cr_expect(got->msg_lens[j] == want->msg_lens[j] &&
                      memcmp(got->msgs[j], want->msgs[j], want->msg_lens[j]) == 0,
                  "%s, message %zu: %s sent\n  \"%s\"\n%s sent\n  \"%s\"", what, j, got_side,
                  got->msgs[j], want_side, want->msgs[j]);
}

/* ---- a memory policy against policy gpu -------------------------------------------------- */

void e2e_vs_gpu_run(e2e_vs_gpu *v, const char *group, const char *const *env,
                    Pie__V1__MemoryPolicy policy) {
    const char *gpu_env[] = {"PIE_WORKER_GROUP_ID=gpu", NULL};
    e2e_vs_gpu_run_at(v, gpu_env, group, env, policy);
}

void e2e_vs_gpu_run_at(e2e_vs_gpu *v, const char *const *gpu_env, const char *group,
                       const char *const *env, Pie__V1__MemoryPolicy policy) {
    *v = (e2e_vs_gpu){0};
    e2e_cluster_start_full(&v->c, gpu_env, NULL, NULL);
    pie_status st;
    v->ctl = rpc_channel_create(pie_proc_addr(v->c.ctl), NULL, &st);
    cr_assert(v->ctl, "%s", st.msg);
    e2e_upload_programs(&v->c, v->ids);
    cr_assert_eq(e2e_wait_worker(v->ctl, "gpu"), PIE__V1__MEMORY_POLICY__MEMORY_POLICY_GPU);
    char prefix[64];
    snprintf(prefix, sizeof prefix, "%s-prefix", group);
    e2e_run_programs(&v->c, v->ids, prefix, v->gpu);

    e2e_worker_replace(&v->c, "the worker", env);
    cr_assert_eq(e2e_wait_serving(&v->c, v->ctl, group), policy);
    e2e_run_programs(&v->c, v->ids, prefix, v->got);
    const char *what[E2E_N_RUNS] = {"text_completion", "parallel_generation",
                                    "prefix_caching (export)", "prefix_caching (import)",
                                    "prefix_caching (unexport)"};
    for (int i = 0; i < E2E_N_RUNS; i++)
        e2e_expect_same_msgs(&v->got[i], &v->gpu[i], what[i], group, "gpu");
    cr_expect_str_eq(v->got[2].msgs[0], "miss", "the first prefix_caching instance");
    cr_expect_str_eq(v->got[3].msgs[0], "hit", "the second prefix_caching instance");
}

double e2e_metric(const pie_proc *p, const char *series) {
    double v = 0;
    pie_status st;
    cr_assert_eq(pie_proc_metric(p, series, &v, &st), PIE_OK, "%s", st.msg);
    return v;
}

void e2e_wait_swap_traffic(rpc_channel *ctl) {
    uint64_t in = 0, out = 0;
    for (int64_t until = pie_test_now_ms() + WAIT_MS; (in == 0 || out == 0);) {
        Pie__V1__ClusterStatusResponse *cs = e2e_cluster_status(ctl, WAIT_MS);
        if (cs && cs->n_workers == 1 && cs->workers[0]->stats)
            in = cs->workers[0]->stats->swap_in_bytes, out = cs->workers[0]->stats->swap_out_bytes;
        rpc_msg_free(cs ? &cs->base : NULL);
        if (in == 0 || out == 0) {
            cr_assert(pie_test_now_ms() < until, "no swap traffic reported (in %llu, out %llu)",
                      (unsigned long long)in, (unsigned long long)out);
            pie_test_sleep_ms(50);
        }
    }
}

void e2e_vs_gpu_end(e2e_vs_gpu *v) {
    for (int i = 0; i < E2E_N_RUNS; i++) {
        e2e_run_free(&v->gpu[i]);
        e2e_run_free(&v->got[i]);
    }
    for (int i = 0; i < 3; i++) free(v->ids[i]);
    rpc_channel_destroy(v->ctl);
    e2e_cluster_stop(&v->c);
}

/* ---- reference engine --------------------------------------------------------------------- */

struct e2e_ref {
    eng *e;
    tok *t;
    const eng_info *info;
    mdl_config cfg; /* for the list of eos tokens */
};

e2e_ref *e2e_ref_open(void) {
    e2e_ref *r = calloc(1, sizeof *r);
    cr_assert(r);
    eng_opts o = {.model_dir = PIE_MODELS_DIR "/" E2E_MODEL,
                  .kv_page_size = E2E_PAGE,
                  .kv_pages = E2E_MAX_TOKENS / E2E_PAGE + 1,
                  .embed_slots = E2E_MAX_TOKENS,
                  .max_batch_tokens = E2E_MAX_TOKENS,
                  .n_threads = 1};
    pie_status st;
    cr_assert_eq(eng_open(&o, &r->e, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(tok_load(PIE_MODELS_DIR "/" E2E_MODEL "/tokenizer.json", &r->t, &st), PIE_OK, "%s",
                 st.msg);
    r->info = eng_get_info(r->e);
    cr_assert_eq(mdl_config_load(PIE_MODELS_DIR "/" E2E_MODEL, &r->cfg, &st), PIE_OK, "%s", st.msg);
    return r;
}

void e2e_ref_close(e2e_ref *r) {
    if (!r) return;
    eng_close(r->e);
    tok_free(r->t);
    free(r);
}

size_t e2e_ref_encode(e2e_ref *r, const char *text, uint32_t *out, size_t cap) {
    uint32_t *ids = NULL;
    size_t n = 0;
    pie_status st;
    cr_assert_eq(tok_encode(r->t, text, strlen(text), true, &ids, &n, &st), PIE_OK, "%s", st.msg);
    cr_assert_leq(n, cap, "\"%s\" has %zu tokens, room for %zu", text, n, cap);
    if (n) memcpy(out, ids, n * sizeof *ids);
    free(ids);
    return n;
}

size_t e2e_ref_prompt(e2e_ref *r, const char *const *parts, size_t n_parts, uint32_t *out) {
    size_t n = 0;
    if (r->info->bos_token_id >= 0) out[n++] = (uint32_t)r->info->bos_token_id;
    for (size_t i = 0; i < n_parts; i++)
        n += e2e_ref_encode(r, parts[i], out + n, E2E_MAX_TOKENS / 2 - n);
    return n;
}

/* Forwards toks[0..n) at positions at.. (appending their K/V to the pages that hold the first
 * `at` tokens) and writes the hidden states of the last n_out into slots base..base+n_out. */
static void ref_forward(e2e_ref *r, const uint32_t *toks, size_t n, size_t at, size_t n_out,
                        uint32_t *out_slots) {
    static uint32_t pages[E2E_MAX_TOKENS / E2E_PAGE + 1];
    uint32_t in_slots[E2E_MAX_TOKENS], pos[E2E_MAX_TOKENS];
    cr_assert_leq(at + n, E2E_MAX_TOKENS / 2);
    for (uint32_t i = 0; i < E2E_MAX_TOKENS / E2E_PAGE + 1; i++) pages[i] = i;
    for (size_t i = 0; i < n; i++) {
        in_slots[i] = (uint32_t)i;
        pos[i] = (uint32_t)(at + i);
    }
    for (size_t i = 0; i < n_out; i++) out_slots[i] = (uint32_t)(E2E_MAX_TOKENS / 2 + i);
    pie_status st;
    cr_assert_eq(eng_embed_text(r->e, in_slots, toks, pos, (uint32_t)n, &st), PIE_OK, "%s", st.msg);
    size_t total = at + n;
    eng_forward_item it = {
        .kv_pages = pages,
        .n_kv_pages = (uint32_t)((total + E2E_PAGE - 1) / E2E_PAGE),
        .kv_last_page_len = (uint32_t)((total - 1) % E2E_PAGE + 1),
        .append_kv = true,
        .in_slots = in_slots,
        .n_in = (uint32_t)n,
        .out_slots = out_slots,
        .n_out = (uint32_t)n_out,
    };
    cr_assert_eq(eng_forward(r->e, &it, 1, &st), PIE_OK, "%s", st.msg);
}

static uint32_t ref_argmax(e2e_ref *r, uint32_t slot) {
    uint32_t id;
    float p;
    eng_dist_item d = {.slot = slot, .top_k = 1, .temperature = 1.0f, .ids = &id, .probs = &p};
    pie_status st;
    cr_assert_eq(eng_next_dist(r->e, &d, 1, &st), PIE_OK, "%s", st.msg);
    return id;
}

static bool is_eos(const e2e_ref *r, uint32_t t) {
    for (uint32_t i = 0; i < r->cfg.n_eos_token_ids; i++)
        if ((int64_t)t == r->cfg.eos_token_ids[i]) return true;
    return r->cfg.eos_token_id >= 0 && (int64_t)t == r->cfg.eos_token_id;
}

size_t e2e_ref_greedy(e2e_ref *r, const uint32_t *prompt, size_t n_prompt, size_t max_new,
                      bool ignore_eos, uint32_t *out) {
    uint32_t slot;
    ref_forward(r, prompt, n_prompt, 0, 1, &slot);
    size_t at = n_prompt, n = 0;
    while (n < max_new) {
        uint32_t t = ref_argmax(r, slot);
        if (!ignore_eos && is_eos(r, t)) break;
        out[n++] = t;
        if (n == max_new) break;
        ref_forward(r, &t, 1, at, 1, &slot);
        at++;
    }
    return n;
}

char *e2e_ref_text(e2e_ref *r, const uint32_t *toks, size_t n, size_t *len) {
    char *s = NULL;
    pie_status st;
    cr_assert_eq(tok_decode(r->t, toks, n, &s, len, &st), PIE_OK, "%s", st.msg);
    return s;
}

double e2e_ref_logprob(e2e_ref *r, const uint32_t *prompt, size_t n_prompt, const uint32_t *toks,
                       size_t n) {
    uint32_t seq[E2E_MAX_TOKENS], slots[E2E_MAX_TOKENS];
    cr_assert_leq(n_prompt + n, E2E_MAX_TOKENS / 2);
    memcpy(seq, prompt, n_prompt * sizeof *seq);
    memcpy(seq + n_prompt, toks, n * sizeof *seq);
    /* outputs of inputs n_prompt-1 .. n_prompt+n-1: the last n+1 (the final one is unused) */
    ref_forward(r, seq, n_prompt + n, 0, n + 1, slots);
    float *logits = malloc(r->info->vocab_size * sizeof *logits);
    cr_assert(logits);
    double total = 0;
    pie_status st;
    for (size_t i = 0; i < n; i++) {
        cr_assert_eq(eng_logits(r->e, slots[i], logits, &st), PIE_OK, "%s", st.msg);
        double mx = -INFINITY, z = 0;
        for (uint32_t v = 0; v < r->info->vocab_size; v++) mx = fmax(mx, logits[v]);
        for (uint32_t v = 0; v < r->info->vocab_size; v++) z += exp((double)logits[v] - mx);
        total += (double)logits[toks[i]] - mx - log(z);
    }
    free(logits);
    return total;
}
