/* test_tp.c — a tensor-parallel worker group end to end (issue 14): a real pie-controller and
 * pie-lifecycle on loopback with one pie-worker process started with tp.size 2 on the cpu
 * backend (small-f32), which forks two rank processes that hold half the model each.
 *
 * Covers: the group registers once, as one worker with tp_size 2 (ClusterStatus; rank 0's
 * Info); the example inferlets — greedy text completion, parallel generation (forks sharing
 * a prompt's KV pages, page copies, batched decoding) and prefix caching (export, then import
 * into a second instance, unexport) — send exactly the messages they send on a tp 1 worker
 * of the same cluster, and the completion equals the engine's greedy decoding; SIGTERM stops
 * the group in order (every rank and the launcher exit 0). A controller restart: rank 0's
 * link is lost, rank 1 frees its slots with rank 0's (RESET), the group registers again and
 * computes the same completion. Killing rank 1 or rank 0 (SIGKILL) while an instance holds a
 * KV page on the group, or rank 1 mid-decode, takes the group out: the instance ends
 * UNAVAILABLE naming the group, the group leaves ClusterStatus, and the launcher exits 1 after
 * its other rank ended; so does stopping rank 1 (SIGSTOP) mid-decode, through rank 0's
 * collective deadline (tp.timeout). Configurations this build cannot run (a LeaderWorkerSet
 * group of several pods, tp.rank, tp.size > 1 on cuda) are refused at start, exit 2, saying
 * why. A tp 4 group of small-bf16 and of small-f32 (8 heads, 2 KV heads: two ranks per KV
 * head) runs the raw-ABI fixture tp_decode (explicit attention masks on the prompt and every
 * other decode step, a KV page mask) and gives tp 1's 65 greedy tokens, with distributions
 * within 1e-4 (bf16, exact kernels), 5e-2 (bf16 on the AVX512-BF16 path, where the CPU has it)
 * and 1e-5 (f32) relative. */
#include <criterion/criterion.h>

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#include "e2e_support.h"
#include "krn_cpu.h"
#include "pie/v1/controller.pb-c.h"
#include "pie/v1/lifecycle.pb-c.h"
#include "pie/v1/worker.pb-c.h"
#include "pie_testutil.h"

#define START_MS  60000
#define STOP_MS   60000
#define WAIT_MS   60000 /* hang guard of every poll: sanitizer builds on 2 shared cores */
#define STATUS_MS 5000  /* one ClusterStatus call */

TestSuite(tp, .fini = pie_test_leak_check, .timeout = 600);

/* ---- probes ------------------------------------------------------------------------------- */

/* Polls ClusterStatus until it lists exactly the worker `group` (with tp_size), or none when
 * group is NULL. */
static void wait_workers(rpc_channel *ctl, const char *group, uint32_t tp_size) {
    int64_t until = pie_test_now_ms() + WAIT_MS;
    char seen[256] = "no answer";
    while (pie_test_now_ms() < until) {
        Pie__V1__ClusterStatusResponse *cs = e2e_cluster_status(ctl, STATUS_MS);
        bool ok = false;
        if (cs) {
            ok = group ? cs->n_workers == 1 && strcmp(cs->workers[0]->group_id, group) == 0 &&
                             cs->workers[0]->tp_size == tp_size
                       : cs->n_workers == 0;
            snprintf(seen, sizeof seen, "%zu workers, the first %s (tp_size %u)", cs->n_workers,
                     cs->n_workers ? cs->workers[0]->group_id : "-",
                     cs->n_workers ? cs->workers[0]->tp_size : 0);
            rpc_msg_free(&cs->base);
        }
        if (ok) return;
        pie_test_sleep_ms(10);
    }
    cr_assert_fail("ClusterStatus never listed %s%s (tp_size %u) alone: %s", group ? "worker " : "",
                   group ? group : "no worker", tp_size, seen);
}

/* The pid the launcher logged for `rank`. */
static int rank_pid(const pie_proc *launcher, uint32_t rank) {
    char needle[64];
    snprintf(needle, sizeof needle, "event=wrk.tp.rank_started rank=%u pid=", rank);
    char *log = pie_proc_log(launcher);
    cr_assert(log);
    const char *at = strstr(log, needle);
    int pid = at ? atoi(at + strlen(needle)) : 0;
    free(log);
    cr_assert_gt(pid, 0, "the launcher did not log rank %u's pid", rank);
    return pid;
}

/* Waits until the controller lists the worker `group` alone (with tp_size), and then until c's
 * lifecycle knows its model (it learns a new worker's model after the controller). */
static void wait_group(e2e_cluster *c, rpc_channel *ctl, const char *group, uint32_t tp_size) {
    wait_workers(ctl, group, tp_size);
    cr_assert_gt(pie_test_wait_models(c->ch, START_MS), 0,
                 "the lifecycle never learned the group's model");
}

/* ---- the same programs on a tp 1 and a tp 2 worker ---------------------------------------- */

/* The ranks a tp 2 group reports (Info, ClusterStatus): both, in order, each its own process
 * on this host with its own share of the cores. */
static void expect_ranks(Pie__V1__TpRank *const *r, size_t n, const char *where) {
    cr_assert_eq(n, 2, "%s lists %zu ranks", where, n);
    char host[65] = "";
    cr_assert_eq(gethostname(host, sizeof host - 1), 0);
    for (uint32_t i = 0; i < 2; i++) {
        cr_expect_eq(r[i]->rank, i, "%s: ranks[%u] is rank %u", where, i, r[i]->rank);
        cr_expect_str_eq(r[i]->host, host, "%s: rank %u's host", where, i);
        cr_expect(strncmp(r[i]->device, "cpu: ", 5) == 0 && strstr(r[i]->device, " threads"),
                  "%s: rank %u's device \"%s\"", where, i, r[i]->device);
        cr_expect(r[i]->pid > 0 && kill((pid_t)r[i]->pid, 0) == 0,
                  "%s: rank %u's pid %u is no live process", where, i, r[i]->pid);
    }
    cr_expect_neq(r[0]->pid, r[1]->pid, "%s: both ranks report pid %u", where, r[0]->pid);
}

/* Expects every run's messages in got (E2E_N_RUNS of them, from side) to be tp1's. */
static void expect_same_runs(const e2e_run *got, const e2e_run *tp1, const char *side) {
    for (int i = 0; i < E2E_N_RUNS; i++) {
        char what[16];
        snprintf(what, sizeof what, "run %d", i);
        e2e_expect_same_msgs(&got[i], &tp1[i], what, side, "tp 1");
    }
}

/* Expects r, a run of text_completion with e2e_tc_args, to have sent the engine's own greedy
 * decoding of the prompt. */
static void expect_greedy_completion(const e2e_run *r, const char *what) {
    e2e_ref *ref = e2e_ref_open();
    const char *prompt = E2E_TC_PROMPT;
    uint32_t p[E2E_MAX_TOKENS], want[E2E_MAX_TOKENS];
    size_t np = e2e_ref_prompt(ref, &prompt, 1, p);
    size_t nw = e2e_ref_greedy(ref, p, np, 32, true, want), len;
    char *text = e2e_ref_text(ref, want, nw, &len);
    cr_expect(r->n_msgs >= 1 && r->msg_lens[0] == len && memcmp(r->msgs[0], text, len) == 0,
              "%s:\n  \"%s\"\nthe engine's greedy decoding:\n  \"%s\"", what,
              r->n_msgs ? r->msgs[0] : "", text);
    free(text);
    e2e_ref_close(ref);
}

/* A cluster with a tp 1 worker (group tp1), the example programs uploaded (ids), and what they
 * print on it (tp1): the reference a group must reproduce. *ctl is a channel to the controller. */
static void tp1_reference(e2e_cluster *c, rpc_channel **ctl, char *ids[3], e2e_run tp1[]) {
    const char *tp1_env[] = {"PIE_WORKER_GROUP_ID=tp1", NULL};
    e2e_cluster_start_full(c, tp1_env, NULL, NULL);
    pie_status st;
    *ctl = rpc_channel_create(pie_proc_addr(c->ctl), NULL, &st);
    cr_assert(*ctl, "%s", st.msg);
    e2e_upload_programs(c, ids);
    wait_workers(*ctl, "tp1", 1);
    e2e_run_programs(c, ids, "tp-prefix", tp1);
}

Test(tp, a_tp2_group_is_one_worker_and_its_inferlets_say_what_a_tp1_worker_says) {
    e2e_cluster c;
    rpc_channel *ctl;
    char *ids[3];
    e2e_run tp1[E2E_N_RUNS], tp2[E2E_N_RUNS];
    tp1_reference(&c, &ctl, ids, tp1);
    pie_status st;

    /* the tp 1 worker leaves; a tp 2 group of the same model takes its place */
    const char *tp2_env[] = {"PIE_WORKER_GROUP_ID=tp2", "PIE_TP_SIZE=2", NULL};
    e2e_worker_replace(&c, "the tp 1 worker", tp2_env);
    wait_group(&c, ctl, "tp2", 2);
    cr_expect_eq(pie_proc_log_count(c.wrk, "event=wrk.tp.rank_started "), 2,
                 "the launcher did not start 2 ranks");
    cr_expect_eq(pie_proc_log_count(c.wrk, "event=wrk.tp.rank_loaded rank=1 "), 1,
                 "rank 0 registered before rank 1 had loaded its shard");

    /* rank 0's Info describes the group */
    rpc_channel *wch = rpc_channel_create(pie_proc_addr(c.wrk), NULL, &st);
    cr_assert(wch, "%s", st.msg);
    Pie__V1__InfoRequest ireq = PIE__V1__INFO_REQUEST__INIT;
    ProtobufCMessage *m = NULL;
    rpc_call_opts o = {.timeout_ms = WAIT_MS};
    cr_assert_eq(rpc_unary(wch, "/pie.v1.Worker/Info", &ireq.base,
                           &pie__v1__info_response__descriptor, &m, &o, &st),
                 PIE_OK, "Info: %s", st.msg);
    const Pie__V1__InfoResponse *info = (const Pie__V1__InfoResponse *)m;
    cr_expect_eq(info->rank, 0);
    cr_expect_eq(info->tp_size, 2);
    cr_expect_str_eq(info->group_id, "tp2");
    cr_expect_eq(info->state, PIE__V1__LOAD_STATE__LOAD_STATE_READY);
    cr_expect(strstr(info->device, "2 ranks"), "device \"%s\"", info->device);
    expect_ranks(info->ranks, info->n_ranks, "Info");
    rpc_msg_free(m);
    Pie__V1__ClusterStatusResponse *cs = e2e_cluster_status(ctl, STATUS_MS);
    cr_assert(cs && cs->n_workers == 1, "ClusterStatus");
    expect_ranks(cs->workers[0]->ranks, cs->workers[0]->n_ranks, "ClusterStatus");
    rpc_msg_free(&cs->base);
    rpc_channel_destroy(wch);

    e2e_run_programs(&c, ids, "tp-prefix", tp2);
    expect_same_runs(tp2, tp1, "tp 2");
    cr_expect_str_eq(tp2[2].msgs[0], "miss", "the first prefix_caching instance");
    cr_expect_str_eq(tp2[3].msgs[0], "hit", "the second prefix_caching instance");

    /* and the completion is the engine's own greedy decoding */
    expect_greedy_completion(&tp2[0], "text_completion at tp 2");

    for (int i = 0; i < E2E_N_RUNS; i++) {
        e2e_run_free(&tp1[i]);
        e2e_run_free(&tp2[i]);
    }
    for (int i = 0; i < 3; i++) free(ids[i]);
    rpc_channel_destroy(ctl);
    e2e_cluster_stop(&c); /* the group's launcher must exit 0: both ranks stopped in order */
}

/* ---- a lost controller link ---------------------------------------------------------------- */

/* Polls ClusterStatus until it lists worker `group` and `replicas` lifecycle replicas. */
static void wait_linked(rpc_channel *ctl, const char *group, size_t replicas) {
    int64_t until = pie_test_now_ms() + WAIT_MS;
    bool ok = false;
    while (!ok && pie_test_now_ms() < until) {
        Pie__V1__ClusterStatusResponse *cs = e2e_cluster_status(ctl, STATUS_MS);
        ok = cs && cs->n_workers == 1 && strcmp(cs->workers[0]->group_id, group) == 0 &&
             cs->n_replicas == replicas;
        rpc_msg_free(cs ? &cs->base : NULL);
        if (!ok) pie_test_sleep_ms(10);
    }
    cr_assert(ok, "the controller never saw worker %s and %zu replicas", group, replicas);
}

/* The controller restarts on its port: rank 0's link is lost (its executor frees every slot,
 * and the followers with it: RESET), the group registers again, and the same completion comes
 * out. */
Test(tp, a_group_whose_controller_restarts_registers_again_and_computes_the_same) {
    pie_status st;
    int port = pie_proc_free_port();
    cr_assert_gt(port, 0);
    char listen[64], ctl_env[96];
    snprintf(listen, sizeof listen, "PIE_SERVER_LISTEN=127.0.0.1:%d", port);
    snprintf(ctl_env, sizeof ctl_env, "PIE_CONTROLLER_ADDRESS=127.0.0.1:%d", port);
    const char *ctl_opts_env[] = {listen, NULL};
    pie_proc_opts co = {.env = ctl_opts_env};
    e2e_cluster c = {0};
    c.ctl = pie_proc_start("pie-controller", &co, START_MS, &st);
    cr_assert(c.ctl, "%s", st.msg);
    const char *wenv[] = {"PIE_WORKER_GROUP_ID=tp-r", "PIE_TP_SIZE=2",
                          "PIE_CONTROLLER_RECONNECT_INITIAL=50ms",
                          "PIE_CONTROLLER_RECONNECT_MAX=200ms", NULL};
    c.wrk = e2e_worker_start_env(ctl_env, wenv);
    c.cache_dir = pie_proc_tmpdir(&st);
    cr_assert(c.cache_dir, "%s", st.msg);
    char cache_env[600];
    snprintf(cache_env, sizeof cache_env, "PIE_RUNTIME_CACHE_DIR=%s", c.cache_dir);
    const char *lenv[] = {ctl_env,
                          cache_env,
                          "PIE_TOKENIZER_PATH=" PIE_MODELS_DIR "/" E2E_MODEL,
                          "PIE_RUNTIME_TIER1=false",
                          "PIE_CONTROLLER_RECONNECT_INITIAL=50ms",
                          "PIE_CONTROLLER_RECONNECT_MAX=200ms",
                          NULL};
    pie_proc_opts lo = {.env = lenv};
    c.lc = pie_proc_start("pie-lifecycle", &lo, START_MS, &st);
    cr_assert(c.lc, "%s", st.msg);
    c.ch = rpc_channel_create(pie_proc_addr(c.lc), NULL, &st);
    cr_assert(c.ch, "%s", st.msg);
    rpc_channel *ctl = rpc_channel_create(pie_proc_addr(c.ctl), NULL, &st);
    cr_assert(ctl, "%s", st.msg);
    wait_linked(ctl, "tp-r", 1);
    char *prog = e2e_upload(&c, "text_completion");
    e2e_run before, after;
    e2e_run_program(&c, prog, e2e_tc_args, NULL, &before);
    e2e_assert_success(&before, "text_completion before the restart");

    rpc_channel_destroy(ctl);
    cr_assert_eq(pie_proc_stop(c.ctl, STOP_MS, &st), 0, "controller: %s", st.msg);
    pie_proc_destroy(c.ctl);
    cr_assert(pie_proc_wait_log(c.wrk, "event=wrk.link.lost ", 1, WAIT_MS),
              "rank 0 never noticed the lost link");
    c.ctl = pie_proc_start("pie-controller", &co, START_MS, &st);
    cr_assert(c.ctl, "%s", st.msg);
    ctl = rpc_channel_create(pie_proc_addr(c.ctl), NULL, &st);
    cr_assert(ctl, "%s", st.msg);
    wait_linked(ctl, "tp-r", 1);
    cr_assert_gt(pie_test_wait_models(c.ch, START_MS), 0, "the lifecycle never learned a model");
    e2e_run_program(&c, prog, e2e_tc_args, NULL, &after);
    e2e_assert_success(&after, "text_completion after the restart");
    cr_expect(after.n_msgs == before.n_msgs && after.msg_lens[0] == before.msg_lens[0] &&
                  memcmp(after.msgs[0], before.msgs[0], before.msg_lens[0]) == 0,
              "after the restart:\n  \"%s\"\nbefore:\n  \"%s\"", after.msgs[0], before.msgs[0]);
    cr_expect_eq(pie_proc_log_count(c.wrk, "event=wrk.link.registered "), 2,
                 "the group did not register exactly twice");
    cr_expect_eq(pie_proc_log_count(c.wrk, "event=wrk.tp.rank_reset rank=1 "), 1,
                 "rank 1 did not free its slots once with rank 0's (%zu resets)",
                 pie_proc_log_count(c.wrk, "event=wrk.tp.rank_reset "));
    e2e_run_free(&before);
    e2e_run_free(&after);
    free(prog);
    rpc_channel_destroy(ctl);
    e2e_cluster_stop(&c); /* every rank exits 0 */
}

/* ---- a rank that dies --------------------------------------------------------------------- */

/* Opens Run of prog with args (input left open) and reads until a response of kind `until`,
 * asserting that the instance does not end first; returns that response (free it with
 * rpc_msg_free) and the stream in *s. `what`: the awaited event, for the failures. */
static Pie__V1__AttachResponse *launch_until(e2e_cluster *c, const char *prog,
                                             const char *const *args, size_t n_args,
                                             Pie__V1__AttachResponse__MsgCase until,
                                             const char *what, rpc_stream **s) {
    pie_status st;
    rpc_call_opts o = {.timeout_ms = 600000};
    *s = rpc_stream_open(c->ch, "/pie.v1.Lifecycle/Run", &pie__v1__attach_response__descriptor, &o,
                         &st);
    cr_assert(*s, "Run: %s", st.msg);
    Pie__V1__LaunchRequest l = PIE__V1__LAUNCH_REQUEST__INIT;
    l.program_id = (char *)prog;
    l.args = (char **)args;
    l.n_args = n_args;
    Pie__V1__RunRequest req = PIE__V1__RUN_REQUEST__INIT;
    req.msg_case = PIE__V1__RUN_REQUEST__MSG_LAUNCH;
    req.launch = &l;
    cr_assert_eq(rpc_stream_send(*s, &req.base, &st), PIE_OK, "Run launch: %s", st.msg);
    for (;;) {
        ProtobufCMessage *m = NULL;
        cr_assert_eq(rpc_stream_recv(*s, &m, WAIT_MS), RPC_RECV_MESSAGE,
                     "Run: the instance never %s", what);
        Pie__V1__AttachResponse *a = (Pie__V1__AttachResponse *)m;
        cr_assert_neq(a->msg_case, PIE__V1__ATTACH_RESPONSE__MSG_EXIT_STATUS,
                      "the instance ended before it %s", what);
        if (a->msg_case == until) return a;
        rpc_msg_free(m);
    }
}

/* Launches sec_export with `alloc:1 wait`: the instance is placed on the group by its KV page
 * and then waits for a client message. Returns once its allocation succeeded. */
static rpc_stream *hold_a_page(e2e_cluster *c, const char *prog) {
    const char *args[] = {"alloc:1", "wait"};
    rpc_stream *s;
    Pie__V1__AttachResponse *a = launch_until(
        c, prog, args, 2, PIE__V1__ATTACH_RESPONSE__MSG_MESSAGE, "reported its allocation", &s);
    cr_assert(a->message.len == 8 && memcmp(a->message.data, "alloc=0|", 8) == 0,
              "the allocation failed: %.*s", (int)a->message.len, a->message.data);
    rpc_msg_free(&a->base);
    return s;
}

/* Runs text_completion for up to 3000 tokens and returns once its first token streamed out:
 * the group is in the middle of its decode steps. */
static rpc_stream *generate_long(e2e_cluster *c, const char *prog) {
    const char *args[] = {"--prompt", "Once upon a time", "--max-tokens", "3000", "--ignore-eos"};
    rpc_stream *s;
    Pie__V1__AttachResponse *a = launch_until(
        c, prog, args, 5, PIE__V1__ATTACH_RESPONSE__MSG_STDOUT_DATA, "streamed a token", &s);
    rpc_msg_free(&a->base);
    return s;
}

/* The instance on stream s ends UNAVAILABLE, its status naming the worker group. */
static void expect_group_out(rpc_stream *s, const char *group) {
    e2e_run r;
    e2e_run_collect(s, &r);
    cr_expect_eq(r.status_code, PIE_UNAVAILABLE, "the instance ended with %u \"%s\"", r.status_code,
                 r.status_msg ? r.status_msg : "");
    char name[64];
    snprintf(name, sizeof name, "worker %s (", group);
    cr_expect(r.status_msg && strstr(r.status_msg, name),
              "the instance's status does not name the group: \"%s\"",
              r.status_msg ? r.status_msg : "");
    e2e_run_free(&r);
}

/* A group "tp-a" of 2 ranks with an instance placed on it (holding a page and waiting, or in
 * the middle of a long generation); signal `sig` to rank `victim`. Expected: the instance ends
 * UNAVAILABLE naming the group, the launcher says which rank took the group down (`culprit`)
 * and exits 1 once both ranks ended, and the group leaves the controller. SIGSTOP: the stopped
 * rank is alive, so rank 0's collective waits tp.timeout (1 s here), then rank 0 leaves (exit
 * 3) naming the deadline. */
static void signal_a_rank(uint32_t victim, int sig, bool mid_step, uint32_t culprit) {
    const char *env[] = {"PIE_WORKER_GROUP_ID=tp-a", "PIE_TP_SIZE=2", "PIE_TP_TIMEOUT=1s", NULL};
    e2e_cluster c;
    e2e_cluster_start_full(&c, env, NULL, NULL);
    pie_status st;
    rpc_channel *ctl = rpc_channel_create(pie_proc_addr(c.ctl), NULL, &st);
    cr_assert(ctl, "%s", st.msg);
    wait_workers(ctl, "tp-a", 2);
    char *prog = mid_step
                     ? e2e_upload(&c, "text_completion")
                     : e2e_upload_path(&c, PIE_WASM_FIXTURES_DIR "/sec_export.wasm", "sec_export");
    rpc_stream *s = mid_step ? generate_long(&c, prog) : hold_a_page(&c, prog);

    int pid = rank_pid(c.wrk, victim);
    cr_assert_eq(kill(pid, sig), 0, "signal %d to rank %u (pid %d)", sig, victim, pid);
    expect_group_out(s, "tp-a");

    int rc = pie_proc_wait(c.wrk, STOP_MS, &st);
    char *tail = pie_proc_log_tail(c.wrk, 3000);
    cr_expect_eq(rc, 1, "the launcher exited with %d (%s); log:\n%s", rc, st.msg, tail);
    char needle[64];
    snprintf(needle, sizeof needle, "event=wrk.tp.group_failed rank=%u tp_size=2 ", culprit);
    cr_expect_eq(pie_proc_log_count(c.wrk, needle), 1,
                 "the launcher did not say that rank %u took the group down; log:\n%s", culprit,
                 tail);
    if (sig == SIGSTOP)
        cr_expect_eq(pie_proc_log_count(c.wrk, "event=wrk.tp.group_failed group=tp-a rank=0 "
                                               "tp_size=2 code=DEADLINE_EXCEEDED "),
                     1, "rank 0 did not leave naming the deadline; log:\n%s", tail);
    cr_expect_eq(pie_proc_log_count(c.wrk, "event=wrk.tp.rank_exited "), 2,
                 "the launcher did not reap both ranks; log:\n%s", tail);
    cr_expect_eq(pie_proc_log_count(c.wrk, "AddressSanitizer") +
                     pie_proc_log_count(c.wrk, "runtime error:"),
                 0, "a sanitizer error:\n%s", tail);
    free(tail);
    wait_workers(ctl, NULL, 0); /* the group left the controller */
    pie_proc_destroy(c.wrk);
    c.wrk = NULL;
    free(prog);
    rpc_channel_destroy(ctl);
    e2e_cluster_stop(&c);
}

Test(tp, a_killed_follower_takes_its_idle_group_out_and_the_instance_ends_unavailable) {
    signal_a_rank(1, SIGKILL, false, 1);
}

Test(tp, a_killed_rank_0_takes_its_group_out_and_the_instance_ends_unavailable) {
    signal_a_rank(0, SIGKILL, false, 0);
}

Test(tp, a_follower_killed_in_the_middle_of_decoding_ends_the_instance_unavailable) {
    signal_a_rank(1, SIGKILL, true, 1);
}

Test(tp, a_follower_stalled_in_the_middle_of_decoding_fails_rank_0_at_the_timeout) {
    signal_a_rank(1, SIGSTOP, true, 0);
}

/* ---- configurations that cannot work ------------------------------------------------------ */

static void expect_exit_saying(pie_proc *p, int want, const char *says, const char *who);

/* pie-worker with env exits 2 before serving, saying `says`. */
static void refused(const char *const *env, const char *says) {
    pie_proc_opts o = {.env = env};
    pie_status st;
    pie_proc *w = pie_proc_spawn("pie-worker", &o, &st);
    cr_assert(w, "%s", st.msg);
    int rc = pie_proc_wait(w, STOP_MS, &st);
    char *log = pie_proc_log(w);
    cr_expect_eq(rc, 2, "exit status %d (%s); log:\n%s", rc, st.msg, log ? log : "");
    cr_expect(log && strstr(log, says), "the refusal does not say \"%s\":\n%s", says,
              log ? log : "");
    free(log);
    pie_proc_destroy(w);
}

Test(tp, groups_this_build_cannot_run_are_refused_with_a_reason) {
    const char *model = "PIE_MODEL_PATH=" PIE_MODELS_DIR "/" E2E_MODEL;
    const char *lws[] = {model,
                         "PIE_TP_SIZE=4",
                         "LWS_GROUP_SIZE=2",
                         "LWS_WORKER_INDEX=1",
                         "LWS_LEADER_ADDRESS=pie-worker-0.pie:50054",
                         NULL};
    refused(lws, "tp.size 4 in a LeaderWorkerSet group of 2 pods: a group across pods runs one "
                 "rank per pod, so tp.size must be 2");
    const char *huge[] = {model, "LWS_GROUP_SIZE=100", "LWS_WORKER_INDEX=1", NULL};
    refused(huge, "LWS_GROUP_SIZE 100 or LWS_WORKER_INDEX 1: a group has at most 64 ranks");
    const char *rank[] = {model, "PIE_TP_SIZE=2", "PIE_TP_RANK=1", NULL};
    refused(rank, "tp.rank 1 needs tp.leader");
    const char *leader[] = {model, "PIE_TP_SIZE=2", "PIE_TP_LEADER=127.0.0.1:1", NULL};
    refused(leader, "tp.leader \"127.0.0.1:1\" without tp.rank");
    const char *cuda[] = {model, "PIE_TP_SIZE=2", "PIE_BACKEND=cuda", NULL};
#if PIE_TEST_WORKER_HAS_NCCL
    /* the build runs cuda groups; a machine without a GPU per rank cannot form one: the ranks
     * check their GPUs before NCCL and the group exits 1 naming what is missing (CI has no GPU;
     * on a machine with two this group would form) */
    pie_proc_opts o = {.env = cuda};
    pie_status st;
    pie_proc *w = pie_proc_spawn("pie-worker", &o, &st);
    cr_assert(w, "%s", st.msg);
    expect_exit_saying(w, 1, "CUDA device", "a cuda group without GPUs");
    pie_proc_destroy(w);
    const char *gpus[] = {model, "PIE_TP_SIZE=4", "PIE_BACKEND=cuda", "CUDA_VISIBLE_DEVICES=0,1",
                          NULL};
    refused(gpus, "tp.size 4 needs 4 GPUs, one per rank, but CUDA_VISIBLE_DEVICES \"0,1\" lists 2");
#elif PIE_TEST_WORKER_HAS_CUDA
    refused(cuda, "tp.size 2 with backend cuda needs NCCL");
#else
    refused(cuda, "this pie-worker was built without the cuda backend");
#endif
    const char *null[] = {model, "PIE_TP_SIZE=2", "PIE_BACKEND=null", NULL};
    refused(null, "tp.size 2 needs backend cpu or cuda");
    const char *range[] = {model, "PIE_TP_RANK=1", NULL};
    refused(range, "tp.rank 1 is out of range");
}

/* ---- ranks started one by one (a LeaderWorkerSet group of pods) --------------------------- */

/* Where the ranks of a group started one by one meet: rank 0 serves on a free port, the others
 * join it there. */
typedef struct lws_addr {
    char listen[64]; /* rank 0's PIE_SERVER_LISTEN */
    char leader[64]; /* the others' PIE_TP_LEADER */
} lws_addr;

static lws_addr lws_addr_free_port(void) {
    int port = pie_proc_free_port();
    cr_assert_gt(port, 0);
    lws_addr a;
    snprintf(a.listen, sizeof a.listen, "PIE_SERVER_LISTEN=127.0.0.1:%d", port);
    snprintf(a.leader, sizeof a.leader, "PIE_TP_LEADER=127.0.0.1:%d", port);
    return a;
}

/* A rank of group "lws" started on its own: rank 0 serves on a's address, the others join it
 * there (TpJoin, then the collective over TCP). extra: more settings or NULL. */
static pie_proc *lws_rank(const char *ctl_env, const lws_addr *a, uint32_t rank,
                          const char *size_env, const char *extra) {
    char rank_env[32];
    snprintf(rank_env, sizeof rank_env, "PIE_TP_RANK=%u", rank);
    const char *env[] = {
        "PIE_WORKER_GROUP_ID=lws", size_env, rank_env, rank == 0 ? a->listen : a->leader,
        "PIE_TP_TIMEOUT=20s",      extra,    NULL};
    return e2e_worker_spawn_env(ctl_env, env);
}

/* p exits with status want and its log says `says`; failures name who. */
static void expect_exit_saying(pie_proc *p, int want, const char *says, const char *who) {
    pie_status st;
    int rc = pie_proc_wait(p, STOP_MS, &st);
    char *log = pie_proc_log(p);
    cr_expect_eq(rc, want, "%s exited with %d (%s); log:\n%s", who, rc, st.msg, log ? log : "");
    cr_expect(log && strstr(log, says), "%s does not say \"%s\":\n%s", who, says, log ? log : "");
    free(log);
}

/* A rank that Worker/TpJoin refuses exits 2 and its log says why. */
static void join_refused(pie_proc *p, const char *says) {
    expect_exit_saying(p, 2, says, "the refused rank");
    pie_proc_destroy(p);
}

/* Covers issue 14's LeaderWorkerSet case on loopback: rank 0 and rank 1 are separate pie-worker
 * processes started one by one (tp.rank, tp.leader; TpJoin; the TCP collective). Ranks of
 * another group size or model are refused with INVALID_ARGUMENT naming the field, and the group
 * still forms; its inferlets print what a tp 1 worker prints; a rank killed in the middle of
 * decoding takes the group out: the instance ends UNAVAILABLE naming the group and rank 0
 * exits. */
Test(tp, ranks_started_one_by_one_form_a_group_that_says_what_a_tp1_worker_says) {
    e2e_cluster c;
    rpc_channel *ctl;
    char *ids[3];
    e2e_run tp1[E2E_N_RUNS], grp[E2E_N_RUNS];
    tp1_reference(&c, &ctl, ids, tp1);
    pie_status st;
    cr_assert_eq(pie_proc_stop(c.wrk, STOP_MS, &st), 0, "the tp 1 worker: %s", st.msg);
    pie_proc_destroy(c.wrk);

    char ctl_env[96];
    pie_proc_env_controller(c.ctl, ctl_env, sizeof ctl_env);
    lws_addr a = lws_addr_free_port();
    c.wrk = lws_rank(ctl_env, &a, 0, "PIE_TP_SIZE=2", NULL);
    join_refused(lws_rank(ctl_env, &a, 1, "PIE_TP_SIZE=3", NULL),
                 "tp_size 3, but group lws has 2 ranks");
    join_refused(lws_rank(ctl_env, &a, 1, "PIE_TP_SIZE=2", "PIE_MODEL_NAME=another-model"),
                 "but group lws serves");
    pie_proc *r1 = lws_rank(ctl_env, &a, 1, "PIE_TP_SIZE=2", NULL);
    cr_assert_eq(pie_proc_wait_ready(c.wrk, START_MS, &st), PIE_OK, "rank 0: %s", st.msg);
    /* rank 1's own server answers health (its pod's probes): SERVING once the group formed */
    cr_assert_eq(pie_proc_wait_ready(r1, START_MS, &st), PIE_OK, "rank 1: %s", st.msg);
    wait_group(&c, ctl, "lws", 2);
    Pie__V1__ClusterStatusResponse *cs = e2e_cluster_status(ctl, STATUS_MS);
    cr_assert(cs && cs->n_workers == 1, "ClusterStatus");
    expect_ranks(cs->workers[0]->ranks, cs->workers[0]->n_ranks, "ClusterStatus");
    cr_expect_eq(cs->workers[0]->ranks[1]->pid, (uint32_t)pie_proc_pid(r1),
                 "rank 1's pid is not the process started as rank 1");
    rpc_msg_free(&cs->base);

    e2e_run_programs(&c, ids, "tp-prefix", grp);
    expect_same_runs(grp, tp1, "the group");

    /* rank 1 dies in the middle of decoding: the group is out */
    rpc_stream *s = generate_long(&c, ids[0]);
    cr_assert_eq(kill((pid_t)pie_proc_pid(r1), SIGKILL), 0);
    expect_group_out(s, "lws");
    int rc = pie_proc_wait(c.wrk, STOP_MS, &st);
    char *tail = pie_proc_log_tail(c.wrk, 3000);
    cr_expect_eq(rc, 3, "rank 0 exited with %d (%s); log:\n%s", rc, st.msg, tail);
    cr_expect(tail && strstr(tail, "rank 1 of 2 is gone"),
              "rank 0's log does not say that rank 1 is gone:\n%s", tail);
    free(tail);
    wait_workers(ctl, NULL, 0);
    pie_proc_destroy(c.wrk);
    c.wrk = NULL;
    pie_proc_destroy(r1);

    for (int i = 0; i < E2E_N_RUNS; i++) {
        e2e_run_free(&tp1[i]);
        e2e_run_free(&grp[i]);
    }
    for (int i = 0; i < 3; i++) free(ids[i]);
    rpc_channel_destroy(ctl);
    e2e_cluster_stop(&c);
}

/* Rank 0 of ranks started one by one whose other ranks never come exits (status 1, saying how
 * many joined), so that whoever restarts the group forms it again under a new epoch. */
Test(tp, a_rank_0_whose_ranks_never_join_exits_so_the_group_can_form_again) {
    lws_addr a = lws_addr_free_port();
    const char *env[] = {"PIE_WORKER_GROUP_ID=alone", "PIE_TP_SIZE=2", "PIE_TP_RANK=0",
                         "PIE_TP_TIMEOUT=1s",         a.listen,        NULL};
    pie_proc *r0 = e2e_worker_spawn_env("PIE_CONTROLLER_ADDRESS=127.0.0.1:1", env);
    expect_exit_saying(r0, 1, "1 of 2 ranks joined within 1000 ms", "rank 0");
    pie_proc_destroy(r0);
}

/* tp.form_timeout bounds the formation apart from a step's tp.timeout: rank 0 with tp.timeout
 * 1 s and tp.form_timeout 30 s still forms its group with a rank started 2 s after it (both
 * turn SERVING; the stop ends both with 0); with tp.form_timeout 2 s and no rank it exits 1
 * saying so after those 2 s. */
Test(tp, tp_form_timeout_lets_ranks_join_later_than_a_steps_timeout) {
    lws_addr a = lws_addr_free_port();
    const char *ctl = "PIE_CONTROLLER_ADDRESS=127.0.0.1:1";
    const char *r0_env[] = {"PIE_WORKER_GROUP_ID=lws",
                            "PIE_TP_SIZE=2",
                            "PIE_TP_RANK=0",
                            a.listen,
                            "PIE_TP_TIMEOUT=1s",
                            "PIE_TP_FORM_TIMEOUT=30s",
                            NULL};
    pie_proc *r0 = e2e_worker_spawn_env(ctl, r0_env);
    cr_assert(pie_proc_wait_log(r0, "event=wrk.tp.offer ", 1, WAIT_MS), "rank 0 offered nothing");
    pie_test_sleep_ms(2000);
    pie_proc *r1 = lws_rank(ctl, &a, 1, "PIE_TP_SIZE=2", NULL);
    pie_status st;
    cr_assert_eq(pie_proc_wait_ready(r0, START_MS, &st), PIE_OK, "rank 0: %s", st.msg);
    cr_assert_eq(pie_proc_wait_ready(r1, START_MS, &st), PIE_OK, "rank 1: %s", st.msg);
    cr_expect_eq(pie_proc_stop(r0, STOP_MS, &st), 0, "rank 0: %s", st.msg);
    cr_expect_eq(pie_proc_wait(r1, STOP_MS, &st), 0, "rank 1: %s", st.msg);
    pie_proc_destroy(r0);
    pie_proc_destroy(r1);

    const char *alone[] = {"PIE_WORKER_GROUP_ID=alone",
                           "PIE_TP_SIZE=2",
                           "PIE_TP_RANK=0",
                           a.listen,
                           "PIE_TP_TIMEOUT=1s",
                           "PIE_TP_FORM_TIMEOUT=2s",
                           NULL};
    r0 = e2e_worker_spawn_env(ctl, alone);
    expect_exit_saying(r0, 1, "1 of 2 ranks joined within 2000 ms", "rank 0");
    pie_proc_destroy(r0);
}

/* ---- a tp 4 group: 2 KV heads for 4 ranks, bf16, explicit masks --------------------------- */

#define DECODE_STEPS 64
#define DECODE_TOPK  8

typedef struct decode_dist {
    uint32_t ids[DECODE_TOPK];
    float probs[DECODE_TOPK];
} decode_dist;

/* tp_decode's messages "<i> <id>:<prob> ..." into d[0..DECODE_STEPS]; asserts their shape. */
static void parse_decode(const e2e_run *r, decode_dist *d, const char *who) {
    cr_assert_eq(r->n_msgs, DECODE_STEPS + 2, "%s: %zu messages, want %d (the last: %s)", who,
                 r->n_msgs, DECODE_STEPS + 2, r->n_msgs ? r->msgs[r->n_msgs - 1] : "-");
    cr_assert_str_eq(r->msgs[DECODE_STEPS + 1], "done", "%s", who);
    for (size_t i = 0; i <= DECODE_STEPS; i++) {
        char *at = r->msgs[i], *end;
        cr_assert_eq(strtoul(at, &end, 10), i, "%s: message %zu is \"%s\"", who, i, r->msgs[i]);
        for (int j = 0; j < DECODE_TOPK; j++) {
            d[i].ids[j] = (uint32_t)strtoul(end, &at, 10);
            cr_assert(at != end && *at == ':', "%s: message %zu is \"%s\"", who, i, r->msgs[i]);
            d[i].probs[j] = strtof(at + 1, &end);
            cr_assert(end != at + 1, "%s: message %zu is \"%s\"", who, i, r->msgs[i]);
        }
    }
}

/* got equals want: the same top token, every probability within tol_rel (relative), the same
 * ids except where two within tol of each other trade places. Returns the worst relative
 * difference. */
static double expect_same_dist(const decode_dist *got, const decode_dist *want, double tol_rel,
                               size_t step) {
    double worst = 0;
    cr_expect_eq(got->ids[0], want->ids[0], "step %zu: greedy token %u, tp 1 chose %u", step,
                 got->ids[0], want->ids[0]);
    for (int j = 0; j < DECODE_TOPK; j++) {
        double tol = tol_rel * fabs((double)want->probs[j]) + 1e-12;
        double diff = fabs((double)got->probs[j] - want->probs[j]);
        if (want->probs[j] > 0) worst = fmax(worst, diff / want->probs[j]);
        cr_expect_leq(diff, tol, "step %zu, position %d: probability %.9g, tp 1 %.9g", step, j,
                      got->probs[j], want->probs[j]);
        bool tie = got->ids[j] == want->ids[j];
        for (int i = 0; i < DECODE_TOPK && !tie; i++)
            tie = want->ids[i] == got->ids[j] &&
                  fabs((double)want->probs[i] - got->probs[j]) <= 2 * tol;
        cr_expect(tie, "step %zu, position %d: id %u, tp 1 has id %u", step, j, got->ids[j],
                  want->ids[j]);
    }
    return worst;
}

/* A tp 1 worker, then a tp 4 group (4 forked ranks over shared memory) of `model` run
 * tp_decode: a 20-token prompt under an explicit mask, 64 greedy decode steps, every other one
 * under an explicit mask, a KV page mask from step 41 on. Both print the same 65 greedy tokens
 * and distributions within tol_rel. kern: two PIE_KRN_* settings for both workers (NULL for
 * none; kern NULL: the kernels' defaults). */
static void tp4_decodes_like_tp1(const char *model, double tol_rel, const char *const *kern) {
    static const char *const none[2] = {NULL, NULL};
    if (!kern) kern = none;
    char model_env[600];
    snprintf(model_env, sizeof model_env, "PIE_MODEL_PATH=%s/%s", PIE_MODELS_DIR, model);
    const char *tp1_env[] = {"PIE_WORKER_GROUP_ID=tp1", model_env, kern[0], kern[1], NULL};
    e2e_cluster c;
    e2e_cluster_start_full(&c, tp1_env, NULL, NULL);
    pie_status st;
    rpc_channel *ctl = rpc_channel_create(pie_proc_addr(c.ctl), NULL, &st);
    cr_assert(ctl, "%s", st.msg);
    char *prog = e2e_upload_path(&c, PIE_WASM_FIXTURES_DIR "/tp_decode.wasm", "tp_decode");
    static const char *const args[] = {"--steps", "64", NULL};
    static const char *const causal_args[] = {"--steps", "64", "--no-masks", NULL};
    e2e_run r1, r4, causal;
    wait_workers(ctl, "tp1", 1);
    e2e_run_program(&c, prog, args, NULL, &r1);
    e2e_assert_success(&r1, "tp_decode at tp 1");
    e2e_run_program(&c, prog, causal_args, NULL, &causal);
    e2e_assert_success(&causal, "tp_decode --no-masks at tp 1");

    const char *tp4_env[] = {
        "PIE_WORKER_GROUP_ID=tp4", "PIE_TP_SIZE=4", model_env, kern[0], kern[1], NULL};
    e2e_worker_replace(&c, "the tp 1 worker", tp4_env);
    wait_group(&c, ctl, "tp4", 4);
    e2e_run_program(&c, prog, args, NULL, &r4);
    e2e_assert_success(&r4, "tp_decode at tp 4");

    static decode_dist d1[DECODE_STEPS + 1], d4[DECODE_STEPS + 1], dc[DECODE_STEPS + 1];
    parse_decode(&r1, d1, "tp 1");
    parse_decode(&r4, d4, "tp 4");
    parse_decode(&causal, dc, "tp 1 without masks");
    cr_expect_neq(memcmp(d1, dc, sizeof d1[0]), 0, "%s: the prompt's mask changes nothing", model);
    cr_expect_neq(memcmp(d1 + 2, dc + 2, sizeof d1[0]), 0,
                  "%s: the decode step's mask changes nothing", model);
    double worst = 0;
    uint32_t changes = 0;
    for (size_t i = 0; i <= DECODE_STEPS; i++) {
        worst = fmax(worst, expect_same_dist(&d4[i], &d1[i], tol_rel, i));
        changes += i > 0 && d1[i].ids[0] != d1[i - 1].ids[0];
    }
    cr_log_info("%s at tp 4 through the worker: worst relative probability difference %.3g, %u "
                "changes of greedy token in %d steps",
                model, worst, changes, DECODE_STEPS);
    cr_expect_gt(changes, 8, "%s: the greedy tokens barely change (%u times): a weak check", model,
                 changes);
    e2e_run_free(&r1);
    e2e_run_free(&r4);
    e2e_run_free(&causal);
    free(prog);
    rpc_channel_destroy(ctl);
    e2e_cluster_stop(&c);
}

/* Issue 14's bf16 check through the worker: the same 64 greedy tokens (and distributions
 * within 1e-4, the engine test's bf16 bound) at tp 4 as at tp 1, with explicit attention masks
 * and a KV page mask; small-bf16 has 8 heads and 2 KV heads, so two ranks share each KV head.
 * The exact kernels: the AVX512-BF16 path (on by default on AMD CPUs that have it) rounds x to
 * bf16, which turns the ranks' f32 summation-order differences into bf16 steps wherever an x
 * lies near a rounding midpoint — the next test. */
Test(tp,
     a_tp4_group_with_fewer_kv_heads_than_ranks_decodes_tp1s_64_greedy_bf16_tokens_under_masks) {
    static const char *const exact[] = {"PIE_KRN_BF16DOT=0", NULL};
    tp4_decodes_like_tp1("small-bf16", 1e-4, exact);
}

/* The same with the AVX512-BF16 dot-product path, where the CPU has it (krn_bf16dot.c; AMX
 * off, which would take those rows first on a CPU that has both): the same 65 greedy tokens,
 * distributions within 5e-2 relative. On a 2-core AMD EPYC (Zen 4) the worst was 9.7e-3 against
 * 3e-6 with the exact kernels: a rounded x differs by one bf16 step (2^-8 relative) where tp 1 and
 * tp 4 computed it an f32 ulp apart across a midpoint, the rounding the path's accuracy note
 * accepts (kernels/cpu/README.md: 2.7e-3 relative logits error end to end against the float64
 * reference). */
Test(tp, a_tp4_group_on_the_avx512_bf16_path_decodes_tp1s_64_greedy_bf16_tokens) {
    if (krn_cpu_set_bf16dot(1) != 0) /* the kernels' own check of the CPU */
        cr_skip_test("no AVX512-BF16 on this CPU: the path is not taken here");
    static const char *const dot[] = {"PIE_KRN_BF16DOT=1", "PIE_KRN_AMX=0"};
    tp4_decodes_like_tp1("small-bf16", 5e-2, dot);
}

/* The f32 bound of the issue (1e-5 relative) on the same calls. */
Test(tp, a_tp4_group_with_fewer_kv_heads_than_ranks_gives_tp1s_f32_distributions_under_masks) {
    tp4_decodes_like_tp1("small-f32", 1e-5, NULL);
}

/* ---- a rank that comes late --------------------------------------------------------------- */

/* The epoch rank 0's log offered ("event=wrk.tp.offer ... epoch=<hex>"), the n-th (from 1). */
static unsigned long long offered_epoch(const pie_proc *p) {
    char *log = pie_proc_log(p);
    cr_assert(log);
    const char *at = strstr(log, "event=wrk.tp.offer ");
    at = at ? strstr(at, " epoch=") : NULL;
    unsigned long long e = at ? strtoull(at + 7, NULL, 16) : 0;
    free(log);
    cr_assert_neq(e, 0, "rank 0 logged no offer");
    return e;
}

/* Issue 14's late rank. Rank 0 whose rank 1 does not come within tp.timeout exits 1 (its
 * formation ended); whoever restarts it (here the test, as Kubernetes restarts the pod) starts
 * a new formation under a new epoch. Rank 1, started after that timeout, retries TpJoin while
 * nobody answers and joins the new formation: the group registers with both ranks and its
 * completion is the engine's greedy decoding (the restarted rank 0 has a fixed tp.port, and
 * rank 1 reaches the collective there). A rank that asks once the group formed is refused
 * (exit 2: FAILED_PRECONDITION "formed already"), and the group serves on. */
Test(tp, a_rank_joining_after_rank_0s_timeout_joins_its_next_formation_under_a_new_epoch) {
    pie_status st;
    e2e_cluster c = {0};
    c.ctl = pie_proc_start("pie-controller", NULL, START_MS, &st);
    cr_assert(c.ctl, "%s", st.msg);
    char ctl_env[96];
    pie_proc_env_controller(c.ctl, ctl_env, sizeof ctl_env);
    lws_addr a = lws_addr_free_port();

    /* the first formation: rank 1 does not come within 1 s */
    pie_proc *r0 = lws_rank(ctl_env, &a, 0, "PIE_TP_SIZE=2", "PIE_TP_TIMEOUT=1s");
    expect_exit_saying(r0, 1, "1 of 2 ranks joined within 1000 ms", "rank 0");
    unsigned long long first = offered_epoch(r0);
    pie_proc_destroy(r0);

    /* rank 1 comes late, while no rank 0 answers; then rank 0 is restarted */
    pie_proc *r1 = lws_rank(ctl_env, &a, 1, "PIE_TP_SIZE=2", NULL);
    cr_assert(pie_proc_wait_log(r1, "event=svc.started ", 1, WAIT_MS), "rank 1 never served");
    pie_test_sleep_ms(300);
    cr_expect_eq(pie_proc_log_count(r1, "serving=true"), 0,
                 "rank 1 reported SERVING before its group formed");
    int coll_port = pie_proc_free_port(); /* tp.port: a fixed collective port this time */
    cr_assert_gt(coll_port, 0);
    char coll_env[32], coll_log[48];
    snprintf(coll_env, sizeof coll_env, "PIE_TP_PORT=%d", coll_port);
    snprintf(coll_log, sizeof coll_log, " collective_port=%d ", coll_port);
    c.wrk = lws_rank(ctl_env, &a, 0, "PIE_TP_SIZE=2", coll_env);
    cr_assert_eq(pie_proc_wait_ready(c.wrk, START_MS, &st), PIE_OK, "rank 0: %s", st.msg);
    rpc_channel *ctl = rpc_channel_create(pie_proc_addr(c.ctl), NULL, &st);
    cr_assert(ctl, "%s", st.msg);
    wait_workers(ctl, "lws", 2);
    unsigned long long second = offered_epoch(c.wrk);
    cr_expect_neq(second, first, "rank 0 formed the group again under its first epoch %016llx",
                  first);
    char joined[96];
    snprintf(joined, sizeof joined, "event=wrk.tp.joined rank=1 tp_size=2 epoch=%016llx ", second);
    cr_assert_eq(pie_proc_wait_ready(r1, START_MS, &st), PIE_OK, "rank 1: %s", st.msg);
    cr_expect_eq(pie_proc_log_count(r1, joined), 1, "rank 1 did not join epoch %016llx", second);
    cr_expect_eq(pie_proc_log_count(c.wrk, coll_log), 1, "rank 0 did not listen on tp.port %d",
                 coll_port);
    char coll_leader[64];
    snprintf(coll_leader, sizeof coll_leader, " collective=127.0.0.1:%d", coll_port);
    cr_expect_eq(pie_proc_log_count(r1, coll_leader), 1,
                 "rank 1 did not reach the collective at tp.port %d", coll_port);

    /* a rank 1 once the group formed: refused, saying so */
    join_refused(lws_rank(ctl_env, &a, 1, "PIE_TP_SIZE=2", NULL), "group lws formed already");

    /* the group computes what the engine computes */
    e2e_cluster_start_lifecycle(&c, NULL, NULL);
    char *prog = e2e_upload(&c, "text_completion");
    e2e_run r;
    e2e_run_program(&c, prog, e2e_tc_args, NULL, &r);
    e2e_assert_success(&r, "text_completion on the re-formed group");
    expect_greedy_completion(&r, "text_completion on the re-formed group");
    e2e_run_free(&r);
    free(prog);
    rpc_channel_destroy(ctl);
    e2e_cluster_stop(&c); /* rank 0 exits 0 and stops rank 1 */
    int rc = pie_proc_wait(r1, STOP_MS, &st);
    cr_expect_eq(rc, 0, "rank 1 exited with %d (%s)", rc, st.msg);
    pie_proc_destroy(r1);
}
