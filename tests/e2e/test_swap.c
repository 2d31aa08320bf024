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
#include "pie_testutil.h"

#define WAIT_MS 60000 /* hang guard of every poll: sanitizer builds on 2 shared cores */

TestSuite(swap, .timeout = 600);

Test(swap, layers_in_the_host_pool_change_no_output_of_fork_export_and_import) {
    e2e_vs_gpu v;
    /* 2 of small-f32's 4 layers on the device, the other 2 in the host pool, a 16 Gb/s link */
    const char *swap_env[] = {"PIE_WORKER_GROUP_ID=swap",        "PIE_MEMORY_POLICY=swap",
                              "PIE_MEMORY_DEVICE_LAYERS=2",      "PIE_MEMORY_HOST_POOL=64MiB",
                              "PIE_MEMORY_EMULATE_LINK_GBPS=16", NULL};
    e2e_vs_gpu_run(&v, "swap", swap_env, PIE__V1__MEMORY_POLICY__MEMORY_POLICY_SWAP);
    /* the layers did move: the worker's counters (its heartbeat, in ClusterStatus) */
    e2e_wait_swap_traffic(v.ctl);

    e2e_vs_gpu_end(&v);
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

/* The contention test on a worker of tp.size `tp` (the gpu worker and the swap worker alike). */
static void spill_where_gpu_refuses(const char *tp) {
    const char *gpu_env[] = {"PIE_WORKER_GROUP_ID=gpu", "PIE_POOL_KV_PAGES=8", tp, NULL};
    e2e_cluster c;
    e2e_cluster_start_full(&c, gpu_env, NULL, NULL);
    pie_status st;
    rpc_channel *ctl = rpc_channel_create(pie_proc_addr(c.ctl), NULL, &st);
    cr_assert(ctl, "%s", st.msg);
    char *id = e2e_upload(&c, "text_completion");
    e2e_wait_serving(&c, ctl, "gpu");
    e2e_run alone_a, alone_b, ga, gb, sa, sb;
    e2e_run_program(&c, id, long_a, NULL, &alone_a);
    e2e_assert_success(&alone_a, "a alone");
    e2e_run_program(&c, id, long_b, NULL, &alone_b);
    e2e_assert_success(&alone_b, "b alone");
    run_both(&c, id, &ga, &gb);
    cr_assert(ga.status_code != 0 || gb.status_code != 0 || ga.exit_code != 0 || gb.exit_code != 0,
              "policy gpu served both on 8 pages: the test has no contention");

    const char *swap_env[] = {"PIE_WORKER_GROUP_ID=swap", "PIE_POOL_KV_PAGES=8",
                              "PIE_MEMORY_POLICY=swap", "PIE_MEMORY_HOST_POOL=64MiB", tp, NULL};
    e2e_worker_replace(&c, "the worker", swap_env);
    e2e_wait_serving(&c, ctl, "swap");
    run_both(&c, id, &sa, &sb);
    e2e_assert_success(&sa, "a beside b on the swap worker");
    e2e_assert_success(&sb, "b beside a on the swap worker (spilled, not terminated)");
    e2e_expect_same_msgs(&sa, &alone_a, "a", "swap", "gpu");
    e2e_expect_same_msgs(&sb, &alone_b, "b", "swap", "gpu");
    cr_expect_geq(pie_proc_log_count(c.ctl, "event=ctl.kv.spill "), 1, "no spill logged");
    cr_expect_geq(pie_proc_log_count(c.wrk, "reason=spill"), 1, "the worker never spilled");

    e2e_run *all[] = {&alone_a, &alone_b, &ga, &gb, &sa, &sb};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) e2e_run_free(all[i]);
    free(id);
    rpc_channel_destroy(ctl);
    e2e_cluster_stop(&c);
}

Test(swap, contention_spills_to_the_host_pool_where_policy_gpu_must_refuse) {
    spill_where_gpu_refuses(NULL);
}

/* ---- inside a tensor-parallel group (each rank's host pool holds its KV heads' share) ---- */

/* tp 2 against policy gpu at tp 2: rank 0's layer moves are every rank's */
Test(swap, a_tp2_group_with_layers_in_its_host_pools_says_what_its_gpu_policy_says) {
    e2e_vs_gpu v;
    const char *gpu_env[] = {"PIE_WORKER_GROUP_ID=gpu", "PIE_TP_SIZE=2", NULL};
    const char *swap_env[] = {"PIE_WORKER_GROUP_ID=swap2",      "PIE_TP_SIZE=2",
                              "PIE_MEMORY_POLICY=swap",         "PIE_MEMORY_DEVICE_LAYERS=2",
                              "PIE_MEMORY_HOST_POOL=64MiB",     "PIE_MEMORY_EMULATE_LINK_GBPS=16",
                              NULL};
    e2e_vs_gpu_run_at(&v, gpu_env, "swap2", swap_env, PIE__V1__MEMORY_POLICY__MEMORY_POLICY_SWAP);
    e2e_wait_swap_traffic(v.ctl);
    e2e_vs_gpu_end(&v);
}

/* the spill at tp 2: rank 0 lowers the layers on the device, every rank follows */
Test(swap, a_tp2_group_spills_to_its_host_pools_where_its_gpu_policy_must_refuse) {
    spill_where_gpu_refuses("PIE_TP_SIZE=2");
}
