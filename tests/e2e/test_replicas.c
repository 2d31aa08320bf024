/* test_replicas.c — two lifecycle replicas sharing one controller (issue 15, defects 2 and 3):
 * a real pie-controller, a CPU pie-worker (small-f32) and two pie-lifecycle processes on
 * loopback, each with a cache directory of its own (no shared volume).
 *
 * Covers: a replica started without model files (no tokenizer.path) fetches the tokenizer from
 * the controller, caches it under its cache dir (the file hashes to the announced SHA-256),
 * reports ready only after that, and runs text_completion exactly like a replica that has the
 * file and like the engine; a tampered cache file is refused (removed, fetched again); a
 * program uploaded to one replica launches on the other (Run), and again after that replica
 * restarts with an empty cache (Launch + Attach); ListPrograms shows what a replica fetched;
 * DeleteProgram on one replica removes the program from the other and from the registry
 * (launch: NOT_FOUND naming both places); after a controller restart the replicas put their
 * programs back, so a replica that never held a program launches it again. */
#include <criterion/criterion.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "e2e_support.h"
#include "pie/v1/lifecycle.pb-c.h"
#include "pie_sha256.h"
#include "pie_testutil.h"

#define START_MS 60000
#define STOP_MS  30000
#define WAIT_MS  60000 /* hang guard of every poll: sanitizer builds on 2 shared cores */

TestSuite(replicas, .fini = pie_test_leak_check, .timeout = 600);

/* ---- the cluster: one controller, one worker, replicas added one by one -------------------- */

typedef struct world {
    pie_proc *ctl, *wrk;
    int ctl_port;     /* fixed, so that a restarted controller is found again */
    char ctl_env[96]; /* PIE_CONTROLLER_ADDRESS=... */
} world;

typedef struct replica {
    pie_proc *p;
    e2e_cluster view; /* only .ch is set: what e2e_upload / e2e_run_* use */
    char cache[4096];
} replica;

static pie_proc *start_controller(world *w) {
    char listen[64];
    snprintf(listen, sizeof listen, "PIE_SERVER_LISTEN=127.0.0.1:%d", w->ctl_port);
    const char *env[] = {listen, NULL};
    pie_proc_opts o = {.env = env};
    pie_status st;
    pie_proc *p = pie_proc_start("pie-controller", &o, START_MS, &st);
    cr_assert(p, "%s", st.msg);
    return p;
}

static void world_start(world *w) {
    *w = (world){0};
    w->ctl_port = pie_proc_free_port();
    cr_assert_gt(w->ctl_port, 0);
    w->ctl = start_controller(w);
    snprintf(w->ctl_env, sizeof w->ctl_env, "PIE_CONTROLLER_ADDRESS=127.0.0.1:%d", w->ctl_port);
    w->wrk = e2e_worker_start(w->ctl_env);
}

static void stop_ok(pie_proc *p) {
    if (p == NULL) return;
    pie_status st;
    int rc = pie_proc_stop(p, STOP_MS, &st);
    static char *tail; /* reachable if the assertion ends the test */
    tail = pie_proc_log_tail(p, 4000);
    cr_expect_eq(rc, 0, "%s exited with %d: %s\nlog:\n%s", pie_proc_name(p), rc, st.msg,
                 tail ? tail : "");
    cr_expect_eq(pie_proc_log_count(p, "AddressSanitizer") +
                     pie_proc_log_count(p, "runtime error:") +
                     pie_proc_log_count(p, "LeakSanitizer"),
                 0, "%s reported a sanitizer error:\n%s", pie_proc_name(p), tail ? tail : "");
    free(tail);
    tail = NULL;
    pie_proc_destroy(p);
}

static void world_stop(world *w) {
    stop_ok(w->wrk);
    stop_ok(w->ctl);
}

/* Starts a replica on cache dir `cache` (created by the caller, kept); with_path: it gets the
 * model directory as its tokenizer.path, else it has no model files at all. */
static void replica_start(world *w, replica *r, const char *cache, bool with_path) {
    *r = (replica){0};
    snprintf(r->cache, sizeof r->cache, "%s", cache);
    char cache_env[4200];
    snprintf(cache_env, sizeof cache_env, "PIE_RUNTIME_CACHE_DIR=%s", cache);
    const char *env[] = {w->ctl_env,
                         cache_env,
                         "PIE_RUNTIME_TIER1=false",
                         "PIE_CONTROLLER_RECONNECT_INITIAL=50ms",
                         "PIE_CONTROLLER_RECONNECT_MAX=200ms",
                         with_path ? "PIE_TOKENIZER_PATH=" PIE_MODELS_DIR "/" E2E_MODEL : NULL,
                         NULL};
    pie_proc_opts o = {.env = env};
    pie_status st;
    r->p = pie_proc_start("pie-lifecycle", &o, START_MS, &st);
    cr_assert(r->p, "%s", st.msg);
    r->view.ch = rpc_channel_create(pie_proc_addr(r->p), NULL, &st);
    cr_assert(r->view.ch, "%s", st.msg);
    cr_assert_gt(pie_test_wait_models(r->view.ch, START_MS), 0,
                 "the replica never learned a model");
}

static void replica_stop(replica *r) {
    rpc_channel_destroy(r->view.ch);
    r->view.ch = NULL;
    stop_ok(r->p);
    r->p = NULL;
}

static char *tmpdir(void) {
    pie_status st;
    char *d = pie_proc_tmpdir(&st);
    cr_assert(d, "%s", st.msg);
    return d;
}

static void rmdir_all(char *dir) {
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_expect_eq(system(cmd), 0, "could not remove %s", dir);
    free(dir);
}

/* Whether the replica's readiness (health "pie.v1.Lifecycle") is SERVING within timeout_ms. */
static bool wait_ready(replica *r, int64_t timeout_ms) {
    int64_t until = pie_test_now_ms() + timeout_ms;
    do {
        rpc_health_status hs = RPC_HEALTH_UNKNOWN;
        pie_status st;
        if (rpc_health_check(r->view.ch, "pie.v1.Lifecycle", 5000, &hs, &st) == PIE_OK &&
            hs == RPC_HEALTH_SERVING)
            return true;
        pie_test_sleep_ms(20);
    } while (pie_test_now_ms() < until);
    return false;
}

/* The served model's TokenizerInfo.tokenizer_sha256, as the replica lists it. */
static void model_tokenizer_sha(replica *r, char sha[65]) {
    Pie__V1__ListModelsRequest req = PIE__V1__LIST_MODELS_REQUEST__INIT;
    ProtobufCMessage *m = NULL;
    pie_status st;
    rpc_call_opts o = {.timeout_ms = WAIT_MS};
    cr_assert_eq(rpc_unary(r->view.ch, "/pie.v1.Lifecycle/ListModels", &req.base,
                           &pie__v1__list_models_response__descriptor, &m, &o, &st),
                 PIE_OK, "ListModels: %s", st.msg);
    Pie__V1__ListModelsResponse *l = (Pie__V1__ListModelsResponse *)m;
    cr_assert_eq(l->n_models, 1);
    cr_assert(l->models[0]->tokenizer && l->models[0]->tokenizer->tokenizer_sha256);
    snprintf(sha, 65, "%s", l->models[0]->tokenizer->tokenizer_sha256);
    rpc_msg_free(m);
    cr_assert(pie_sha256_is_hex(sha), "tokenizer_sha256 \"%s\"", sha);
}

/* SHA-256 of a whole file into got; false if it cannot be read. */
static bool file_sha(const char *path, char got[65]) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) return false;
    cr_assert_eq(fseek(f, 0, SEEK_END), 0);
    long n = ftell(f);
    cr_assert_eq(fseek(f, 0, SEEK_SET), 0);
    char *b = malloc((size_t)n + 1);
    cr_assert(b);
    cr_assert_eq(fread(b, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    cr_assert_eq(pie_sha256_hex(b, (size_t)n, got, NULL), PIE_OK);
    free(b);
    return true;
}

/* Offset of the last occurrence of needle in the replica's log, or -1. */
static long log_last(replica *r, const char *needle) {
    char *log = pie_proc_log(r->p);
    cr_assert(log);
    long at = -1;
    for (char *p = strstr(log, needle); p; p = strstr(p + 1, needle)) at = p - log;
    free(log);
    return at;
}

/* ---- programs over the public API --------------------------------------------------------- */

static pie_code launch(replica *r, const char *id, uint64_t *inst, pie_status *st) {
    const char *args[] = {"--prompt", "Once upon a time", "--max-tokens", "8", "--ignore-eos"};
    Pie__V1__LaunchRequest req = PIE__V1__LAUNCH_REQUEST__INIT;
    req.program_id = (char *)id;
    req.args = (char **)args;
    req.n_args = sizeof args / sizeof args[0];
    ProtobufCMessage *m = NULL;
    rpc_call_opts o = {.timeout_ms = WAIT_MS};
    pie_code rc = rpc_unary(r->view.ch, "/pie.v1.Lifecycle/Launch", &req.base,
                            &pie__v1__launch_response__descriptor, &m, &o, st);
    if (rc == PIE_OK) *inst = ((Pie__V1__LaunchResponse *)m)->instance_id;
    rpc_msg_free(m);
    return rc;
}

/* Attaches to inst and collects everything to its exit. */
static void attach_all(replica *r, uint64_t inst, e2e_run *out) {
    pie_status st;
    rpc_call_opts o = {.timeout_ms = 240000};
    rpc_stream *s = rpc_stream_open(r->view.ch, "/pie.v1.Lifecycle/Attach",
                                    &pie__v1__attach_response__descriptor, &o, &st);
    cr_assert(s, "Attach: %s", st.msg);
    Pie__V1__AttachStart a = PIE__V1__ATTACH_START__INIT;
    a.instance_id = inst;
    Pie__V1__AttachRequest req = PIE__V1__ATTACH_REQUEST__INIT;
    req.msg_case = PIE__V1__ATTACH_REQUEST__MSG_START;
    req.start = &a;
    cr_assert_eq(rpc_stream_send(s, &req.base, &st), PIE_OK, "Attach start: %s", st.msg);
    e2e_run_collect(s, out); /* reads to the end (the exit status ends the call) */
}

/* Whether the replica's ListPrograms lists id. */
static bool lists(replica *r, const char *id) {
    Pie__V1__ListProgramsRequest req = PIE__V1__LIST_PROGRAMS_REQUEST__INIT;
    ProtobufCMessage *m = NULL;
    pie_status st;
    rpc_call_opts o = {.timeout_ms = WAIT_MS};
    cr_assert_eq(rpc_unary(r->view.ch, "/pie.v1.Lifecycle/ListPrograms", &req.base,
                           &pie__v1__list_programs_response__descriptor, &m, &o, &st),
                 PIE_OK, "ListPrograms: %s", st.msg);
    Pie__V1__ListProgramsResponse *l = (Pie__V1__ListProgramsResponse *)m;
    bool found = false;
    for (size_t i = 0; i < l->n_programs; i++)
        found = found || strcmp(l->programs[i]->program_id, id) == 0;
    rpc_msg_free(m);
    return found;
}

static void delete_program(replica *r, const char *id) {
    Pie__V1__DeleteProgramRequest req = PIE__V1__DELETE_PROGRAM_REQUEST__INIT;
    req.program_id = (char *)id;
    ProtobufCMessage *m = NULL;
    pie_status st;
    rpc_call_opts o = {.timeout_ms = WAIT_MS};
    cr_assert_eq(rpc_unary(r->view.ch, "/pie.v1.Lifecycle/DeleteProgram", &req.base,
                           &pie__v1__delete_program_response__descriptor, &m, &o, &st),
                 PIE_OK, "DeleteProgram: %s", st.msg);
    rpc_msg_free(m);
}

/* Runs text_completion on the replica and asserts success; the messages are in *out. */
static void complete(replica *r, const char *prog, e2e_run *out, const char *what) {
    const char *args[] = {
        "--prompt",     "The quick brown fox jumps over the lazy dog. Once upon a time",
        "--max-tokens", "24",
        "--ignore-eos", NULL};
    e2e_run_program(&r->view, prog, args, NULL, out);
    e2e_assert_success(out, what);
    cr_assert_eq(out->n_msgs, 2, "%s: %zu messages", what, out->n_msgs);
}

/* ---- defect 2: lifecycle replicas need no model files ----------------------------------- */

Test(
    replicas,
    a_replica_without_model_files_fetches_the_tokenizer_before_it_is_ready_and_completes_like_one_with_them) {
    world w;
    world_start(&w);
    char *dir_a = tmpdir(), *dir_b = tmpdir();
    replica a, b;
    replica_start(&w, &a, dir_a, true);
    replica_start(&w, &b, dir_b, false);
    cr_assert(wait_ready(&a, WAIT_MS), "the replica with the tokenizer file never became ready");
    cr_assert(wait_ready(&b, WAIT_MS), "the replica without model files never became ready");

    char sha[65], got[65], cached[4300];
    /* text_completion gives the same text on both, and the engine's (the prompt is tokenized
     * and the output detokenized by each replica's own tokenizer). */
    e2e_ref *ref = e2e_ref_open();
    char *prog_a = e2e_upload(&a.view, "text_completion");
    char *prog_b = e2e_upload(&b.view, "text_completion");
    cr_assert_str_eq(prog_a, prog_b);
    e2e_run ra, rb;
    complete(&a, prog_a, &ra, "text_completion on the replica with the file");
    complete(&b, prog_b, &rb, "text_completion on the replica without model files");
    cr_expect(ra.msg_lens[0] == rb.msg_lens[0] &&
                  memcmp(ra.msgs[0], rb.msgs[0], ra.msg_lens[0]) == 0,
              "with the file: \"%s\"\nwithout it: \"%s\"", ra.msgs[0], rb.msgs[0]);
    const char *prompt = "The quick brown fox jumps over the lazy dog. Once upon a time";
    uint32_t p[E2E_MAX_TOKENS], want[E2E_MAX_TOKENS];
    size_t np = e2e_ref_prompt(ref, &prompt, 1, p);
    size_t nw = e2e_ref_greedy(ref, p, np, 24, true, want);
    size_t len;
    char *text = e2e_ref_text(ref, want, nw, &len);
    cr_expect(rb.msg_lens[0] == len && memcmp(rb.msgs[0], text, len) == 0,
              "without model files: \"%s\"\nthe engine's greedy decoding: \"%s\"", rb.msgs[0],
              text);
    free(text);
    e2e_run_free(&ra);
    e2e_run_free(&rb);

    /* It became ready after it fetched the tokenizer, and keeps it under its cache dir. */
    model_tokenizer_sha(&b, sha);
    long fetched = log_last(&b, "event=lc.tokreg.loaded source=controller");
    long ready = log_last(&b, "service=pie.v1.Lifecycle ready=true");
    cr_assert_geq(fetched, 0, "the replica without model files never fetched the tokenizer");
    cr_assert_gt(ready, fetched, "the replica reported ready before it had the tokenizer");
    snprintf(cached, sizeof cached, "%s/tokenizers/%s.json", dir_b, sha);
    cr_assert(file_sha(cached, got), "no cached tokenizer at %s", cached);
    cr_assert_str_eq(got, sha, "the cached tokenizer does not hash to its name");

    /* A tampered cache file is refused: removed, fetched again, and the replica is ready and
     * completes as before. */
    replica_stop(&b);
    FILE *f = fopen(cached, "wb");
    cr_assert(f, "cannot rewrite %s", cached);
    cr_assert_gt(fputs("{\"model\": {\"type\": \"BPE\", \"vocab\": {}, \"merges\": []}}", f), 0);
    fclose(f);
    replica_start(&w, &b, dir_b, false);
    cr_assert(wait_ready(&b, WAIT_MS), "the restarted replica never became ready");
    cr_expect_geq(log_last(&b, "event=lc.tokreg.cache_refused"), 0,
                  "the tampered cache file was not refused");
    cr_expect_geq(log_last(&b, "event=lc.tokreg.loaded source=controller"), 0,
                  "the tokenizer was not fetched again");
    cr_assert(file_sha(cached, got) && strcmp(got, sha) == 0,
              "the cache does not hold the right tokenizer again");
    complete(&b, prog_b, &rb, "text_completion after the tampered cache");
    e2e_run_free(&rb);

    free(prog_a);
    free(prog_b);
    e2e_ref_close(ref);
    replica_stop(&b);
    replica_stop(&a);
    world_stop(&w);
    rmdir_all(dir_a);
    rmdir_all(dir_b);
}

/* ---- defect 3: any replica launches any uploaded program -------------------------------- */

Test(replicas, a_program_uploaded_to_one_replica_launches_on_any_other_even_after_restarts) {
    world w;
    world_start(&w);
    char *dir_a = tmpdir(), *dir_b = tmpdir();
    replica a, b;
    replica_start(&w, &a, dir_a, true);
    replica_start(&w, &b, dir_b, true);

    /* Upload to A, Run on B: the same output as on A. */
    char *prog = e2e_upload(&a.view, "text_completion");
    cr_assert(!lists(&b, prog), "B holds a program it was never sent");
    e2e_run ra, rb;
    complete(&a, prog, &ra, "text_completion on the replica it was uploaded to");
    complete(&b, prog, &rb, "text_completion on the other replica");
    cr_expect_str_eq(rb.msgs[0], ra.msgs[0]);
    cr_expect(lists(&b, prog), "B does not list the program it fetched");
    e2e_run_free(&ra);
    e2e_run_free(&rb);

    /* B restarts with an empty cache: Launch + Attach still work. */
    replica_stop(&b);
    char *dir_b2 = tmpdir();
    replica_start(&w, &b, dir_b2, true);
    cr_assert(!lists(&b, prog));
    uint64_t inst = 0;
    pie_status st;
    cr_assert_eq(launch(&b, prog, &inst, &st), PIE_OK, "Launch on the restarted replica: %s",
                 st.msg);
    attach_all(&b, inst, &rb);
    e2e_assert_success(&rb, "text_completion launched on the restarted replica");
    e2e_run_free(&rb);

    /* Delete on A removes it everywhere. */
    delete_program(&a, prog);
    int64_t until = pie_test_now_ms() + WAIT_MS;
    while (lists(&b, prog) && pie_test_now_ms() < until) pie_test_sleep_ms(20);
    cr_assert(!lists(&b, prog), "B still holds the program deleted on A");
    cr_assert_eq(launch(&b, prog, &inst, &st), PIE_NOT_FOUND, "Launch after the delete: %s",
                 st.msg);
    cr_expect(strstr(st.msg, "nor in the controller's program registry") != NULL, "%s", st.msg);

    /* A restarted controller starts with an empty registry and learns the program back from
     * A (uploaded again), so B, which never held it since, launches it. */
    free(prog);
    prog = e2e_upload(&a.view, "text_completion");
    cr_assert_eq(pie_proc_stop(w.ctl, STOP_MS, &st), 0, "controller: %s", st.msg);
    pie_proc_destroy(w.ctl);
    w.ctl = start_controller(&w);
    char needle[160];
    snprintf(needle, sizeof needle, "event=ctl.registry.program_stored program=%s", prog);
    cr_assert(pie_proc_wait_log(w.ctl, needle, 1, WAIT_MS),
              "A did not put its program into the restarted controller's registry");
    cr_assert(wait_ready(&b, WAIT_MS), "B did not come back after the controller restart");
    cr_assert(!lists(&b, prog));
    cr_assert_eq(launch(&b, prog, &inst, &st), PIE_OK, "Launch after the controller restart: %s",
                 st.msg);
    attach_all(&b, inst, &rb);
    e2e_assert_success(&rb, "text_completion after the controller restart");
    e2e_run_free(&rb);

    free(prog);
    replica_stop(&b);
    replica_stop(&a);
    world_stop(&w);
    rmdir_all(dir_a);
    rmdir_all(dir_b);
    rmdir_all(dir_b2);
}
