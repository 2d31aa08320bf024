/* test_swap.c — the swap memory policy (issue 13) under the whole stack: controller, a cpu
 * worker with memory.policy swap, lifecycle, real inferlets.
 *
 * Covered: with half of small-f32's layers in the host pool, text completion, parallel
 * generation (page copies: a fork), prefix caching's export and import and unexport say byte
 * for byte what a worker with policy gpu says; and under contention a swap worker spills where
 * a gpu worker of the same device KV memory cannot serve both instances: two concurrent
 * completions that together need more pages than the device holds both finish (the newer one
 * is neither terminated nor refused) with the text each gives alone. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "e2e_support.h"
#include "pie/v1/controller.pb-c.h"
#include "pie_testutil.h"

#define STOP_MS 60000
#define WAIT_MS 60000 /* hang guard of every poll: sanitizer builds on 2 shared cores */

TestSuite(swap, .timeout = 600);

static Pie__V1__ClusterStatusResponse *cluster_status(rpc_channel *ch) {
    Pie__V1__ClusterStatusRequest req = PIE__V1__CLUSTER_STATUS_REQUEST__INIT;
    ProtobufCMessage *m = NULL;
    pie_status st;
    rpc_call_opts o = {.timeout_ms = WAIT_MS};
    if (rpc_unary(ch, "/pie.v1.Controller/ClusterStatus", &req.base,
                  &pie__v1__cluster_status_response__descriptor, &m, &o, &st) != PIE_OK)
        return NULL;
    return (Pie__V1__ClusterStatusResponse *)m;
}

/* Polls until worker `group` is the only one linked; returns its memory policy. */
static Pie__V1__MemoryPolicy wait_worker(rpc_channel *ctl, const char *group) {
    int64_t until = pie_test_now_ms() + WAIT_MS;
    for (;;) {
        Pie__V1__ClusterStatusResponse *cs = cluster_status(ctl);
        bool ok = cs && cs->n_workers == 1 && strcmp(cs->workers[0]->group_id, group) == 0;
        Pie__V1__MemoryPolicy p = ok ? cs->workers[0]->memory_policy : 0;
        rpc_msg_free(cs ? &cs->base : NULL);
        if (ok) return p;
        cr_assert(pie_test_now_ms() < until, "worker %s never linked alone", group);
        pie_test_sleep_ms(10);
    }
}

/* Replaces the cluster's worker with one started with env. */
static void replace_worker(e2e_cluster *c, const char *const *env) {
    pie_status st;
    int rc = pie_proc_stop(c->wrk, STOP_MS, &st);
    cr_assert_eq(rc, 0, "the worker exited with %d: %s", rc, st.msg);
    pie_proc_destroy(c->wrk);
    char ctl_env[96];
    pie_proc_env_controller(c->ctl, ctl_env, sizeof ctl_env);
    c->wrk = e2e_worker_start_env(ctl_env, env);
}

static void expect_same(const e2e_run *got, const e2e_run *want, const char *what) {
    cr_expect_eq(got->n_msgs, want->n_msgs, "%s: %zu messages, %zu with policy gpu", what,
                 got->n_msgs, want->n_msgs);
    for (size_t j = 0; j < got->n_msgs && j < want->n_msgs; j++)
        cr_expect(got->msg_lens[j] == want->msg_lens[j] &&
                      memcmp(got->msgs[j], want->msgs[j], want->msg_lens[j]) == 0,
                  "%s, message %zu: swap sent\n  \"%s\"\ngpu sent\n  \"%s\"", what, j, got->msgs[j],
                  want->msgs[j]);
}

#define N_RUNS 5
static const char *const tc_args[] = {
    "--prompt",     "The quick brown fox jumps over the lazy dog.",
    "--max-tokens", "32",
    "--ignore-eos", NULL};
static const char *const pg_args[] = {
    "--prompt",     "In a small village by the sea there lived an old fisherman who",
    "--n",          "3",
    "--suffixes",   " one day| never|",
    "--max-tokens", "20",
    "--ignore-eos", NULL};
static const char *const pc_args[] = {
    "--prefix",     "You are a helpful assistant who answers briefly and precisely.",
    "--prompt",     " Question: what is the color of the sky? Answer:",
    "--max-tokens", "16",
    "--ignore-eos", "--name",
    "swap-prefix",  NULL};
static const char *const pc_unexport[] = {"--unexport", "--name", "swap-prefix", NULL};

static void run_programs(e2e_cluster *c, char *const ids[3], e2e_run out[N_RUNS]) {
    const char *const *args[N_RUNS] = {tc_args, pg_args, pc_args, pc_args, pc_unexport};
    const int prog[N_RUNS] = {0, 1, 2, 2, 2};
    for (int i = 0; i < N_RUNS; i++) {
        e2e_run_program(c, ids[prog[i]], args[i], NULL, &out[i]);
        char what[32];
        snprintf(what, sizeof what, "run %d", i);
        e2e_assert_success(&out[i], what);
    }
}

Test(swap, layers_in_the_host_pool_change_no_output_of_fork_export_and_import) {
    const char *gpu_env[] = {"PIE_WORKER_GROUP_ID=gpu", NULL};
    e2e_cluster c;
    e2e_cluster_start_full(&c, gpu_env, NULL, NULL);
    pie_status st;
    rpc_channel *ctl = rpc_channel_create(pie_proc_addr(c.ctl), NULL, &st);
    cr_assert(ctl, "%s", st.msg);
    char *ids[3] = {e2e_upload(&c, "text_completion"), e2e_upload(&c, "parallel_generation"),
                    e2e_upload(&c, "prefix_caching")};
    cr_assert_eq(wait_worker(ctl, "gpu"), PIE__V1__MEMORY_POLICY__MEMORY_POLICY_GPU);
    e2e_run gpu[N_RUNS], swp[N_RUNS];
    run_programs(&c, ids, gpu);

    /* 2 of small-f32's 4 layers on the device, the other 2 in the host pool, a 16 Gb/s link */
    const char *swap_env[] = {"PIE_WORKER_GROUP_ID=swap",        "PIE_MEMORY_POLICY=swap",
                              "PIE_MEMORY_DEVICE_LAYERS=2",      "PIE_MEMORY_HOST_POOL=64MiB",
                              "PIE_MEMORY_EMULATE_LINK_GBPS=16", NULL};
    replace_worker(&c, swap_env);
    cr_assert_eq(wait_worker(ctl, "swap"), PIE__V1__MEMORY_POLICY__MEMORY_POLICY_SWAP);
    run_programs(&c, ids, swp);
    const char *what[N_RUNS] = {"text_completion", "parallel_generation", "prefix_caching (export)",
                                "prefix_caching (import)", "prefix_caching (unexport)"};
    for (int i = 0; i < N_RUNS; i++) expect_same(&swp[i], &gpu[i], what[i]);
    cr_expect_str_eq(swp[2].msgs[0], "miss", "the first prefix_caching instance");
    cr_expect_str_eq(swp[3].msgs[0], "hit", "the second prefix_caching instance");
    /* the layers did move: the worker's counters (its heartbeat, in ClusterStatus) */
    uint64_t in = 0, out = 0;
    for (int64_t until = pie_test_now_ms() + WAIT_MS; (in == 0 || out == 0);) {
        Pie__V1__ClusterStatusResponse *cs = cluster_status(ctl);
        if (cs && cs->n_workers == 1 && cs->workers[0]->stats)
            in = cs->workers[0]->stats->swap_in_bytes, out = cs->workers[0]->stats->swap_out_bytes;
        rpc_msg_free(cs ? &cs->base : NULL);
        if (in == 0 || out == 0) {
            cr_assert(pie_test_now_ms() < until, "no swap traffic reported (in %llu, out %llu)",
                      (unsigned long long)in, (unsigned long long)out);
            pie_test_sleep_ms(50);
        }
    }

    for (int i = 0; i < N_RUNS; i++) {
        e2e_run_free(&gpu[i]);
        e2e_run_free(&swp[i]);
    }
    for (int i = 0; i < 3; i++) free(ids[i]);
    rpc_channel_destroy(ctl);
    e2e_cluster_stop(&c);
}

/* Two completions of ~110 tokens (7 pages of 16 each) at once on 8 device pages: a gpu worker
 * cannot hold both (the newer instance is terminated, or its allocation refused); a swap worker
 * with the same device KV memory (pool.kv_pages 8 with every layer on the device, up to 16 with
 * 2 of 4 layers in the host pool) spills and both finish with the text each gives alone. */
static const char *const long_a[] = {"--prompt", "Once upon a time,", "--max-tokens",
                                     "96",       "--ignore-eos",      NULL};
static const char *const long_b[] = {"--prompt", "The weather today is", "--max-tokens",
                                     "96",       "--ignore-eos",         NULL};

static void run_both(e2e_cluster *c, const char *id, e2e_run *a, e2e_run *b) {
    rpc_stream *sa = e2e_run_open(c, id, long_a, NULL);
    rpc_stream *sb = e2e_run_open(c, id, long_b, NULL);
    e2e_run_collect(sa, a);
    e2e_run_collect(sb, b);
}

Test(swap, contention_spills_to_the_host_pool_where_policy_gpu_must_refuse) {
    const char *gpu_env[] = {"PIE_WORKER_GROUP_ID=gpu", "PIE_POOL_KV_PAGES=8", NULL};
    e2e_cluster c;
    e2e_cluster_start_full(&c, gpu_env, NULL, NULL);
    pie_status st;
    rpc_channel *ctl = rpc_channel_create(pie_proc_addr(c.ctl), NULL, &st);
    cr_assert(ctl, "%s", st.msg);
    char *id = e2e_upload(&c, "text_completion");
    wait_worker(ctl, "gpu");
    e2e_run alone_a, alone_b, ga, gb, sa, sb;
    e2e_run_program(&c, id, long_a, NULL, &alone_a);
    e2e_assert_success(&alone_a, "a alone");
    e2e_run_program(&c, id, long_b, NULL, &alone_b);
    e2e_assert_success(&alone_b, "b alone");
    run_both(&c, id, &ga, &gb);
    cr_assert(ga.status_code != 0 || gb.status_code != 0 || ga.exit_code != 0 || gb.exit_code != 0,
              "policy gpu served both on 8 pages: the test has no contention");

    const char *swap_env[] = {"PIE_WORKER_GROUP_ID=swap", "PIE_POOL_KV_PAGES=8",
                              "PIE_MEMORY_POLICY=swap", "PIE_MEMORY_HOST_POOL=64MiB", NULL};
    replace_worker(&c, swap_env);
    wait_worker(ctl, "swap");
    run_both(&c, id, &sa, &sb);
    e2e_assert_success(&sa, "a beside b on the swap worker");
    e2e_assert_success(&sb, "b beside a on the swap worker (spilled, not terminated)");
    expect_same(&sa, &alone_a, "a");
    expect_same(&sb, &alone_b, "b");
    cr_expect_geq(pie_proc_log_count(c.ctl, "event=ctl.kv.spill "), 1, "no spill logged");
    cr_expect_geq(pie_proc_log_count(c.wrk, "reason=spill"), 1, "the worker never spilled");

    e2e_run *all[] = {&alone_a, &alone_b, &ga, &gb, &sa, &sb};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) e2e_run_free(all[i]);
    free(id);
    rpc_channel_destroy(ctl);
    e2e_cluster_stop(&c);
}
