/* test_drain.c — graceful drain and controller restarts on a local cluster (issue 15, items 4
 * and 5): a real pie-controller on a fixed loopback port, CPU pie-workers (small-f32) and a
 * pie-lifecycle, stopped and restarted the way Kubernetes does it (SIGTERM, then a new process).
 *
 * Covers: a lifecycle replica that gets SIGTERM turns NOT_SERVING, refuses launches
 * (UNAVAILABLE, naming the drain), lets a running instance finish (its Run client gets every
 * output and exit OK) and exits 0; an instance that outlives server.shutdown_grace ends
 * UNAVAILABLE "lifecycle replica shutting down ..." at the grace. A worker that gets SIGTERM is
 * shown DRAINING and placed on no more (the next instance runs on the other worker) while the
 * instance on it finishes, then exits 0 once the controller releases it; past its grace the
 * instance ends UNAVAILABLE "worker ... shut down ...". A controller restarted on its port gets
 * its worker and replica back by themselves, an instance running across the restart ends
 * UNAVAILABLE "controller session lost", and a launch succeeds within 5 s of the controller
 * being ready (default reconnect settings). */
#include <criterion/criterion.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "e2e_support.h"
#include "pie/v1/controller.pb-c.h"
#include "pie/v1/lifecycle.pb-c.h"
#include "pie_testutil.h"

#define START_MS 60000
#define STOP_MS  60000
#define WAIT_MS  60000 /* hang guard of every poll: sanitizer builds on 2 shared cores */

TestSuite(drain, .fini = pie_test_leak_check, .timeout = 600);

/* ---- the cluster -------------------------------------------------------------------------- */

typedef struct world {
    pie_proc *ctl, *wrk[2], *lc;
    int ctl_port;       /* fixed, so that a restarted controller is found again */
    char ctl_sock[128]; /* the controller's Unix socket too, dialled by all ("": TCP links) */
    char ctl_env[192];  /* PIE_CONTROLLER_ADDRESS=... */
    rpc_channel *ctl_ch, *lc_ch;
    e2e_cluster view; /* only .ch is set: what e2e_upload / e2e_run_* use */
    char *cache;
} world;

static pie_proc *start(const char *bin, const char *const *env) {
    pie_proc_opts o = {.env = env};
    pie_status st;
    pie_proc *p = pie_proc_start(bin, &o, START_MS, &st);
    cr_assert(p, "%s: %s", bin, st.msg);
    return p;
}

static pie_proc *start_controller(world *w) {
    char listen[256];
    snprintf(listen, sizeof listen, "PIE_SERVER_LISTEN=127.0.0.1:%d%s%s", w->ctl_port,
             w->ctl_sock[0] ? ",unix:" : "", w->ctl_sock);
    const char *env[] = {listen, NULL};
    return start("pie-controller", env);
}

/* Worker `name` (its group id) with server.shutdown_grace `grace`. */
static pie_proc *start_worker(world *w, const char *name, const char *grace) {
    char group[64], grace_env[64];
    snprintf(group, sizeof group, "PIE_WORKER_GROUP_ID=%s", name);
    snprintf(grace_env, sizeof grace_env, "PIE_SERVER_SHUTDOWN_GRACE=%s", grace);
    const char *env[] = {w->ctl_env,
                         group,
                         grace_env,
                         "PIE_MODEL_PATH=" PIE_MODELS_DIR "/" E2E_MODEL,
                         "PIE_BACKEND=cpu",
                         "PIE_ENGINE_THREADS=1",
                         "PIE_POOL_KV_PAGES=512",
                         "PIE_POOL_EMBED_SLOTS=1024",
                         NULL};
    return start("pie-worker", env);
}

/* The replica with server.shutdown_grace `grace`; fast_redial: 50ms..200ms instead of the
 * defaults. Waits until it knows the model. */
static void start_replica(world *w, const char *grace, bool fast_redial) {
    char cache_env[4200], grace_env[64];
    snprintf(cache_env, sizeof cache_env, "PIE_RUNTIME_CACHE_DIR=%s", w->cache);
    snprintf(grace_env, sizeof grace_env, "PIE_SERVER_SHUTDOWN_GRACE=%s", grace);
    const char *env[] = {w->ctl_env,
                         cache_env,
                         grace_env,
                         "PIE_RUNTIME_TIER1=false",
                         "PIE_TOKENIZER_PATH=" PIE_MODELS_DIR "/" E2E_MODEL,
                         fast_redial ? "PIE_CONTROLLER_RECONNECT_INITIAL=50ms" : NULL,
                         "PIE_CONTROLLER_RECONNECT_MAX=200ms", /* not read without the above */
                         NULL};
    w->lc = start("pie-lifecycle", env);
    pie_status st;
    w->lc_ch = rpc_channel_create(pie_proc_addr(w->lc), NULL, &st);
    cr_assert(w->lc_ch, "%s", st.msg);
    w->view.ch = w->lc_ch;
    cr_assert_gt(pie_test_wait_models(w->lc_ch, START_MS), 0, "the replica never learned a model");
}

/* Controller, n_workers workers ("w-a", "w-b") with worker_grace, one replica; unix_links: the
 * workers and the replica dial the controller's Unix socket instead of its port. */
static void world_start(world *w, int n_workers, const char *worker_grace, const char *lc_grace,
                        bool fast_redial, bool unix_links) {
    *w = (world){0};
    w->ctl_port = pie_proc_free_port();
    cr_assert_gt(w->ctl_port, 0);
    if (unix_links)
        snprintf(w->ctl_sock, sizeof w->ctl_sock, "/tmp/test_drain.%d.%d.sock", (int)getpid(),
                 w->ctl_port);
    w->ctl = start_controller(w);
    if (unix_links)
        snprintf(w->ctl_env, sizeof w->ctl_env, "PIE_CONTROLLER_ADDRESS=unix:%s", w->ctl_sock);
    else
        snprintf(w->ctl_env, sizeof w->ctl_env, "PIE_CONTROLLER_ADDRESS=127.0.0.1:%d", w->ctl_port);
    pie_status st;
    w->ctl_ch = rpc_channel_create(pie_proc_addr(w->ctl), NULL, &st);
    cr_assert(w->ctl_ch, "%s", st.msg);
    const char *names[2] = {"w-a", "w-b"};
    for (int i = 0; i < n_workers; i++) w->wrk[i] = start_worker(w, names[i], worker_grace);
    static char *cache; /* reachable if an assertion ends the test */
    w->cache = cache = pie_proc_tmpdir(&st);
    cr_assert(w->cache, "%s", st.msg);
    start_replica(w, lc_grace, fast_redial);
}

/* Waits for p to exit (it was signalled or released) and asserts exit status 0 and a clean
 * sanitizer report. */
static void wait_exit_ok(pie_proc *p, const char *what) {
    pie_status st;
    int rc = pie_proc_wait(p, STOP_MS, &st);
    static char *tail; /* reachable if the assertion ends the test */
    tail = pie_proc_log_tail(p, 4000);
    cr_expect_eq(rc, 0, "%s exited with %d: %s\nlog:\n%s", what, rc, st.msg, tail ? tail : "");
    cr_expect_eq(pie_proc_log_count(p, "AddressSanitizer") +
                     pie_proc_log_count(p, "LeakSanitizer") +
                     pie_proc_log_count(p, "runtime error:"),
                 0, "%s reported a sanitizer error:\n%s", what, tail ? tail : "");
    free(tail);
    tail = NULL;
}

static void stop_ok(pie_proc **p) {
    if (*p == NULL) return;
    pie_status st;
    cr_assert_eq(pie_proc_signal(*p, SIGTERM, &st), PIE_OK, "%s", st.msg);
    wait_exit_ok(*p, pie_proc_name(*p));
    pie_proc_destroy(*p);
    *p = NULL;
}

static void world_stop(world *w) {
    rpc_channel_destroy(w->lc_ch);
    stop_ok(&w->lc);
    for (int i = 0; i < 2; i++) stop_ok(&w->wrk[i]);
    rpc_channel_destroy(w->ctl_ch);
    stop_ok(&w->ctl);
    pie_proc_rmdir(w->cache);
    free(w->cache);
}

/* ---- probes ------------------------------------------------------------------------------- */

static rpc_health_status readiness(rpc_channel *ch) {
    rpc_health_status hs = RPC_HEALTH_UNKNOWN;
    pie_status st;
    if (rpc_health_check(ch, "pie.v1.Lifecycle", 5000, &hs, &st) != PIE_OK)
        return RPC_HEALTH_UNKNOWN;
    return hs;
}

/* Controller.ClusterStatus (free with rpc_msg_free), or NULL while it does not answer. */
static Pie__V1__ClusterStatusResponse *cluster_status(rpc_channel *ch) {
    Pie__V1__ClusterStatusRequest req = PIE__V1__CLUSTER_STATUS_REQUEST__INIT;
    ProtobufCMessage *m = NULL;
    pie_status st;
    rpc_call_opts o = {.timeout_ms = 5000};
    if (rpc_unary(ch, "/pie.v1.Controller/ClusterStatus", &req.base,
                  &pie__v1__cluster_status_response__descriptor, &m, &o, &st) != PIE_OK)
        return NULL;
    return (Pie__V1__ClusterStatusResponse *)m;
}

/* The worker with this group id in s, or NULL. */
static const Pie__V1__WorkerStatus *worker_in(const Pie__V1__ClusterStatusResponse *s,
                                              const char *group) {
    for (size_t i = 0; s && i < s->n_workers; i++)
        if (strcmp(s->workers[i]->group_id, group) == 0) return s->workers[i];
    return NULL;
}

static pie_code launch(world *w, const char *prog, uint64_t *inst, pie_status *st) {
    const char *args[] = {"--prompt", "Once upon a time", "--max-tokens", "8", "--ignore-eos"};
    Pie__V1__LaunchRequest req = PIE__V1__LAUNCH_REQUEST__INIT;
    req.program_id = (char *)prog;
    req.args = (char **)args;
    req.n_args = sizeof args / sizeof args[0];
    ProtobufCMessage *m = NULL;
    rpc_call_opts o = {.timeout_ms = WAIT_MS};
    pie_code rc = rpc_unary(w->lc_ch, "/pie.v1.Lifecycle/Launch", &req.base,
                            &pie__v1__launch_response__descriptor, &m, &o, st);
    if (rc == PIE_OK) *inst = ((Pie__V1__LaunchResponse *)m)->instance_id;
    rpc_msg_free(m);
    return rc;
}

/* Run of text_completion with no --prompt: the instance starts and waits for its first client
 * message (the prompt). Returns once `started` arrived. */
static rpc_stream *run_waiting(world *w, const char *prog, const char *max_tokens) {
    pie_status st;
    rpc_call_opts o = {.timeout_ms = 600000};
    rpc_stream *s = rpc_stream_open(w->lc_ch, "/pie.v1.Lifecycle/Run",
                                    &pie__v1__attach_response__descriptor, &o, &st);
    cr_assert(s, "Run: %s", st.msg);
    const char *args[] = {"--max-tokens", max_tokens, "--ignore-eos"};
    Pie__V1__LaunchRequest l = PIE__V1__LAUNCH_REQUEST__INIT;
    l.program_id = (char *)prog;
    l.args = (char **)args;
    l.n_args = 3;
    Pie__V1__RunRequest req = PIE__V1__RUN_REQUEST__INIT;
    req.msg_case = PIE__V1__RUN_REQUEST__MSG_LAUNCH;
    req.launch = &l;
    cr_assert_eq(rpc_stream_send(s, &req.base, &st), PIE_OK, "Run launch: %s", st.msg);
    ProtobufCMessage *m = NULL;
    cr_assert_eq(rpc_stream_recv(s, &m, WAIT_MS), RPC_RECV_MESSAGE, "Run: no `started`");
    cr_assert_eq(((Pie__V1__AttachResponse *)m)->msg_case, PIE__V1__ATTACH_RESPONSE__MSG_STARTED);
    rpc_msg_free(m);
    return s;
}

/* Sends the prompt and closes the input of a run_waiting instance. */
static void send_prompt(rpc_stream *s) {
    pie_status st;
    const char *prompt = "The quick brown fox jumps over the lazy dog. Once upon a time";
    Pie__V1__RunRequest m = PIE__V1__RUN_REQUEST__INIT;
    m.msg_case = PIE__V1__RUN_REQUEST__MSG_MESSAGE;
    m.message.data = (uint8_t *)prompt;
    m.message.len = strlen(prompt);
    cr_assert_eq(rpc_stream_send(s, &m.base, &st), PIE_OK, "Run message: %s", st.msg);
    Pie__V1__CloseInput ci = PIE__V1__CLOSE_INPUT__INIT;
    Pie__V1__RunRequest close = PIE__V1__RUN_REQUEST__INIT;
    close.msg_case = PIE__V1__RUN_REQUEST__MSG_CLOSE_INPUT;
    close.close_input = &ci;
    cr_assert_eq(rpc_stream_send(s, &close.base, &st), PIE_OK, "Run close_input: %s", st.msg);
}

/* text_completion's two messages: the text, then its statistics. */
static void assert_completed(const e2e_run *r, const char *what) {
    e2e_assert_success(r, what);
    cr_assert_eq(r->n_msgs, 2, "%s: %zu messages", what, r->n_msgs);
}

static void assert_unavailable(const e2e_run *r, const char *reason, const char *what) {
    cr_assert(r->exited, "%s: no exit status", what);
    cr_assert_eq(r->status_code, PIE_UNAVAILABLE, "%s: status %u \"%s\"", what, r->status_code,
                 r->status_msg ? r->status_msg : "");
    cr_assert(r->status_msg && strstr(r->status_msg, reason), "%s: \"%s\" does not say \"%s\"",
              what, r->status_msg ? r->status_msg : "", reason);
}

/* ---- lifecycle replicas ------------------------------------------------------------------- */

Test(drain, a_terminated_replica_refuses_launches_and_lets_its_running_instance_finish) {
    world w;
    world_start(&w, 1, "5s", "60s", true, false);
    char *prog = e2e_upload(&w.view, "text_completion");
    rpc_stream *s = run_waiting(&w, prog, "16");

    pie_status st;
    cr_assert_eq(pie_proc_signal(w.lc, SIGTERM, &st), PIE_OK, "%s", st.msg);
    int64_t until = pie_test_now_ms() + WAIT_MS;
    while (readiness(w.lc_ch) == RPC_HEALTH_SERVING && pie_test_now_ms() < until)
        pie_test_sleep_ms(5);
    cr_assert_eq(readiness(w.lc_ch), RPC_HEALTH_NOT_SERVING, "readiness while draining");
    uint64_t inst = 0;
    pie_code rc = launch(&w, prog, &inst, &st);
    cr_expect_eq(rc, PIE_UNAVAILABLE, "Launch while draining: %s (%s)", pie_code_name(rc), st.msg);
    cr_expect(strstr(st.msg, "draining"), "the refusal does not name the drain: %s", st.msg);

    send_prompt(s); /* the instance does its work only now, during the drain */
    e2e_run r;
    e2e_run_collect(s, &r);
    assert_completed(&r, "the instance running when the replica got SIGTERM");
    e2e_run_free(&r);
    wait_exit_ok(w.lc, "the drained replica");
    cr_expect(pie_proc_log_count(w.lc, "event=lc.drained instances_cut=0") == 1,
              "the replica cut an instance");
    pie_proc_destroy(w.lc);
    w.lc = NULL;
    free(prog);
    world_stop(&w);
}

Test(drain, an_instance_outliving_the_replicas_grace_ends_unavailable_at_the_grace) {
    world w;
    world_start(&w, 1, "5s", "1s", true, false);
    char *prog = e2e_upload(&w.view, "text_completion");
    rpc_stream *s = run_waiting(&w, prog, "16"); /* never gets its prompt */

    pie_status st;
    int64_t t0 = pie_test_now_ms();
    cr_assert_eq(pie_proc_signal(w.lc, SIGTERM, &st), PIE_OK, "%s", st.msg);
    e2e_run r;
    e2e_run_collect(s, &r);
    int64_t ms = pie_test_now_ms() - t0;
    assert_unavailable(&r, "lifecycle replica shutting down", "the instance past the grace");
    cr_expect(strstr(r.status_msg, "server.shutdown_grace"), "%s", r.status_msg);
    cr_expect_geq(ms, 1000, "the instance was ended %lld ms after SIGTERM, before the grace",
                  (long long)ms);
    e2e_run_free(&r);
    wait_exit_ok(w.lc, "the replica");
    cr_expect(pie_proc_log_count(w.lc, "event=lc.drained instances_cut=1") == 1,
              "lc.drained does not count the cut instance");
    pie_proc_destroy(w.lc);
    w.lc = NULL;
    free(prog);
    world_stop(&w);
}

/* ---- workers ------------------------------------------------------------------------------ */

/* Polls ClusterStatus until a worker has `n` instances; returns its index in w->wrk. */
static int worker_with_instances(world *w, uint32_t n) {
    int64_t until = pie_test_now_ms() + WAIT_MS;
    while (pie_test_now_ms() < until) {
        Pie__V1__ClusterStatusResponse *cs = cluster_status(w->ctl_ch);
        const Pie__V1__WorkerStatus *a = worker_in(cs, "w-a"), *b = worker_in(cs, "w-b");
        int found = a && a->instances == n ? 0 : b && b->instances == n ? 1 : -1;
        rpc_msg_free(cs ? &cs->base : NULL);
        if (found >= 0) return found;
        pie_test_sleep_ms(2);
    }
    cr_assert_fail("no worker shows %u instances", n);
    return -1;
}

/* Polls until the worker `group` shows state DRAINING. */
static void wait_worker_draining(world *w, const char *group) {
    int64_t until = pie_test_now_ms() + WAIT_MS;
    bool draining = false;
    while (!draining && pie_test_now_ms() < until) {
        Pie__V1__ClusterStatusResponse *cs = cluster_status(w->ctl_ch);
        const Pie__V1__WorkerStatus *ws = worker_in(cs, group);
        draining = ws && ws->state == PIE__V1__WORKER_STATE__WORKER_STATE_DRAINING;
        rpc_msg_free(cs ? &cs->base : NULL);
        if (!draining) pie_test_sleep_ms(10);
    }
    cr_assert(draining, "ClusterStatus never showed %s DRAINING", group);
}

/* The cumulative batches ClusterStatus reports for worker `group` (its heartbeat's). */
static uint64_t worker_batches(world *w, const char *group) {
    Pie__V1__ClusterStatusResponse *cs = cluster_status(w->ctl_ch);
    const Pie__V1__WorkerStatus *ws = worker_in(cs, group);
    uint64_t n = ws && ws->stats ? ws->stats->batches : 0;
    rpc_msg_free(cs ? &cs->base : NULL);
    return n;
}

Test(drain, a_terminated_worker_gets_no_new_instances_and_exits_once_its_instance_finished) {
    world w;
    world_start(&w, 2, "120s", "5s", true, false);
    char *prog = e2e_upload(&w.view, "text_completion");
    const char *groups[2] = {"w-a", "w-b"};
    /* The instance is placed at its first allocation, after the prompt: a long completion. */
    rpc_stream *s = run_waiting(&w, prog, "96");
    send_prompt(s);
    int busy = worker_with_instances(&w, 1), idle = 1 - busy;
    pie_status st;
    cr_assert_eq(pie_proc_signal(w.wrk[busy], SIGTERM, &st), PIE_OK, "%s", st.msg);
    char needle[96];
    snprintf(needle, sizeof needle, "event=ctl.worker.leaving worker_index=");
    cr_assert(pie_proc_wait_log(w.ctl, needle, 1, WAIT_MS), "the controller never heard the drain");
    snprintf(needle, sizeof needle, "group=%s instances=1", groups[busy]);
    cr_assert(pie_proc_log_count(w.ctl, needle) == 1,
              "the instance ended before its worker got SIGTERM (raise --max-tokens)");
    wait_worker_draining(&w, groups[busy]);

    /* A new instance runs on the other worker while the first one still runs. */
    uint64_t before = worker_batches(&w, groups[idle]);
    const char *args[] = {"--prompt", "Once upon a time", "--max-tokens",
                          "4",        "--ignore-eos",     NULL};
    e2e_run r2;
    e2e_run_program(&w.view, prog, args, NULL, &r2);
    assert_completed(&r2, "the instance launched while a worker drains");
    e2e_run_free(&r2);
    int64_t until = pie_test_now_ms() + WAIT_MS;
    while (worker_batches(&w, groups[idle]) == before && pie_test_now_ms() < until)
        pie_test_sleep_ms(20);
    cr_assert_gt(worker_batches(&w, groups[idle]), before,
                 "the other worker ran nothing: the new instance went to the draining one");

    e2e_run r;
    e2e_run_collect(s, &r);
    assert_completed(&r, "the instance on the draining worker");
    e2e_run_free(&r);
    wait_exit_ok(w.wrk[busy], "the drained worker"); /* released by the controller, no signal */
    cr_expect(pie_proc_log_count(w.wrk[busy], "event=wrk.drained released=true") == 1,
              "the worker was not released by the controller");
    pie_proc_destroy(w.wrk[busy]);
    w.wrk[busy] = NULL;
    free(prog);
    world_stop(&w);
}

Test(drain, an_instance_outliving_the_workers_grace_ends_unavailable_naming_the_shutdown) {
    world w;
    world_start(&w, 1, "1ms", "5s", true, false);
    char *prog = e2e_upload(&w.view, "text_completion");
    rpc_stream *s = run_waiting(&w, prog, "256");
    send_prompt(s);
    (void)worker_with_instances(&w, 1);
    pie_status st;
    cr_assert_eq(pie_proc_signal(w.wrk[0], SIGTERM, &st), PIE_OK, "%s", st.msg);
    e2e_run r;
    e2e_run_collect(s, &r);
    assert_unavailable(&r, "shut down: the instance was still placed on it",
                       "the instance past the grace");
    cr_expect(strstr(r.status_msg, "worker w-a ("), "%s", r.status_msg);
    e2e_run_free(&r);
    wait_exit_ok(w.wrk[0], "the worker");
    cr_expect(pie_proc_log_count(w.wrk[0], "event=wrk.drained released=false") == 1,
              "the worker's drain did not time out");
    pie_proc_destroy(w.wrk[0]);
    w.wrk[0] = NULL;
    free(prog);
    world_stop(&w);
}

/* ---- controller restarts ------------------------------------------------------------------ */

/* The controller stops with an instance running and starts again on the same address(es): the
 * instance ends UNAVAILABLE, the worker and the replica (redialling with the defaults) come
 * back, and a launch succeeds within 5 s. */
static void assert_controller_restart_is_survived(bool unix_links) {
    world w;
    world_start(&w, 1, "5s", "5s", false, unix_links);
    char *prog = e2e_upload(&w.view, "text_completion");
    rpc_stream *s = run_waiting(&w, prog, "8");

    pie_status st;
    rpc_channel_destroy(w.ctl_ch);
    w.ctl_ch = NULL;
    cr_assert_eq(pie_proc_stop(w.ctl, STOP_MS, &st), 0, "controller: %s", st.msg);
    pie_proc_destroy(w.ctl);
    e2e_run r;
    e2e_run_collect(s, &r);
    assert_unavailable(&r, "controller session lost", "the instance across the restart");
    e2e_run_free(&r);

    w.ctl = start_controller(&w);
    int64_t ready_ms = pie_test_now_ms();
    w.ctl_ch = rpc_channel_create(pie_proc_addr(w.ctl), NULL, &st);
    cr_assert(w.ctl_ch, "%s", st.msg);
    uint64_t inst = 0;
    pie_code rc;
    while ((rc = launch(&w, prog, &inst, &st)) != PIE_OK && pie_test_now_ms() < ready_ms + WAIT_MS)
        pie_test_sleep_ms(20);
    int64_t ms = pie_test_now_ms() - ready_ms;
    cr_assert_eq(rc, PIE_OK, "no launch succeeded after the restart: %s", st.msg);
    cr_log_info("the first launch succeeded %lld ms after the controller was ready", (long long)ms);
    cr_expect_leq(ms, 5000, "the first launch succeeded %lld ms after the controller was ready",
                  (long long)ms);
    /* What an operator sees: the worker and the replica are registered again. */
    const char *argv[] = {"--addr", pie_proc_addr(w.ctl), "status", NULL};
    pie_proc_opts o = {.args = argv};
    pie_proc *ctl = pie_proc_spawn("piectl", &o, &st);
    cr_assert(ctl, "%s", st.msg);
    cr_assert_eq(pie_proc_wait(ctl, WAIT_MS, &st), 0, "piectl status: %s", st.msg);
    char *out = pie_proc_log(ctl);
    pie_proc_destroy(ctl);
    cr_expect(out && strstr(out, "w-a") && strstr(out, "lifecycle replicas (1)"),
              "piectl status after the restart:\n%s", out ? out : "");
    free(out);
    free(prog);
    world_stop(&w);
}

Test(drain, after_a_controller_restart_workers_and_replicas_come_back_and_launches_succeed) {
    assert_controller_restart_is_survived(false);
}

Test(drain, after_a_controller_restart_on_a_unix_socket_its_links_come_back_too) {
    assert_controller_restart_is_survived(true);
}
