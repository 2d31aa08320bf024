/* test_offload.c — the offload memory policy (issue 13; Neo's CPU attention offload) under the
 * whole stack: controller, a cpu worker with memory.policy offload, lifecycle, real inferlets.
 *
 * Covered: with a device share of 4 pages (small-f32: 4 layers x 8 KiB a page) and a 64 MiB host
 * pool, the load-aware scheduler must send decodes' KV and attention to the host (the device
 * cannot hold them); text completion, parallel generation (a fork: pages shared between
 * sequences) and prefix caching's export, import and unexport say byte for byte what a worker
 * with policy gpu says, and the worker's metrics show decodes attended on the host and pages
 * moved there.
 *
 * Deferral (memory.offload_defer; Neo's rule in the worker, the controller offering deferred
 * calls again): concurrent text completions and a parallel generation, with the scheduler's
 * host attention cost pinned so that no host decode hides behind device work, say what a
 * worker with policy gpu says, while host decodes were deferred and offered again (both
 * services' counters). Without the switch nothing is deferred. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>

#include "e2e_support.h"

TestSuite(offload, .timeout = 600);

Test(offload, host_attention_changes_no_output_of_fork_export_and_import) {
    e2e_vs_gpu v;
    /* 4 device pages of every layer (128 KiB), the rest of the pages in the host pool */
    const char *off_env[] = {"PIE_WORKER_GROUP_ID=offload", "PIE_MEMORY_POLICY=offload",
                             "PIE_MEMORY_DEVICE_KV=128KiB", "PIE_MEMORY_HOST_POOL=64MiB", NULL};
    e2e_vs_gpu_run(&v, "offload", off_env, PIE__V1__MEMORY_POLICY__MEMORY_POLICY_OFFLOAD);
    /* decodes did attend on the host, and pages did move there */
    double hosted = e2e_metric(v.c.wrk, "pie_worker_offload_host_instances_total");
    double moved = e2e_metric(v.c.wrk, "pie_worker_offload_pages_moved_total{direction=\"to_host\"}");
    double forced = e2e_metric(v.c.wrk, "pie_worker_offload_steps_total{decision=\"forced\"}");
    cr_expect_gt(hosted, 0, "no decode attended on the host");
    cr_expect_gt(moved, 0, "no page moved to the host");
    cr_expect_gt(forced, 0, "4 device pages never forced a decode to the host");
    /* deferral is off unless switched on: every item ran where it was sent */
    cr_expect_eq(e2e_metric(v.c.wrk, "pie_worker_deferred_items_total{kind=\"forward\"}"), 0);
    cr_expect_eq(e2e_metric(v.c.ctl, "pie_controller_deferred_calls_total"), 0);
    cr_expect_eq(pie_proc_log_count(v.c.wrk, "deferral=on"), 0);

    e2e_vs_gpu_end(&v);
}

/* ---- deferral ---------------------------------------------------------------------------- */

#define N_MIXED 4

/* Three text completions and a parallel generation (a fork into 3) at once: their decodes
 * share steps, some with KV on the device (device work), some on the host. */
static void run_mixed(e2e_cluster *c, char *const ids[3], e2e_run out[N_MIXED]) {
    static const char *const tc_b[] = {"--prompt",     "Once upon a time in a land far away there",
                                       "--max-tokens", "40",
                                       "--ignore-eos", NULL};
    static const char *const tc_c[] = {
        "--prompt", "The capital of France is", "--max-tokens", "24", "--ignore-eos", NULL};
    static const char *const pg[] = {"--prompt",     "In a small village by the sea there lived",
                                     "--n",          "3",
                                     "--suffixes",   " one day| never|",
                                     "--max-tokens", "16",
                                     "--ignore-eos", NULL};
    rpc_stream *s[N_MIXED] = {
        e2e_run_open(c, ids[0], e2e_tc_args, NULL), e2e_run_open(c, ids[0], tc_b, NULL),
        e2e_run_open(c, ids[0], tc_c, NULL), e2e_run_open(c, ids[1], pg, NULL)};
    for (int i = 0; i < N_MIXED; i++) {
        e2e_run_collect(s[i], &out[i]);
        char what[32];
        snprintf(what, sizeof what, "concurrent run %d", i);
        e2e_assert_success(&out[i], what);
    }
}

/* Policy offload with deferral against policy gpu: the concurrent programs, then the
 * sequential ones (fork, export/import), byte for byte the same; host decodes were deferred by
 * the worker and taken back by the controller. 4 device pages; a host attention cost of a
 * second per KV token (memory.offload_host_attn_us) hides nothing, so a host decode waits
 * whenever its step has device work — up to 8 steps in a row, then it runs. */
Test(offload, deferred_host_decodes_change_no_output_of_concurrent_and_sequential_programs) {
    e2e_cluster c;
    const char *gpu_env[] = {"PIE_WORKER_GROUP_ID=gpu", NULL};
    e2e_cluster_start_full(&c, gpu_env, NULL, NULL);
    pie_status st;
    rpc_channel *ctl = rpc_channel_create(pie_proc_addr(c.ctl), NULL, &st);
    cr_assert(ctl, "%s", st.msg);
    char *ids[3];
    e2e_upload_programs(&c, ids);
    cr_assert_eq(e2e_wait_worker(ctl, "gpu"), PIE__V1__MEMORY_POLICY__MEMORY_POLICY_GPU);
    e2e_run gpu_mixed[N_MIXED], got_mixed[N_MIXED], gpu_seq[E2E_N_RUNS], got_seq[E2E_N_RUNS];
    run_mixed(&c, ids, gpu_mixed);
    e2e_run_programs(&c, ids, "defer-prefix", gpu_seq);

    const char *defer_env[] = {"PIE_WORKER_GROUP_ID=offload-defer",
                               "PIE_MEMORY_POLICY=offload",
                               "PIE_MEMORY_DEVICE_KV=128KiB",
                               "PIE_MEMORY_HOST_POOL=64MiB",
                               "PIE_MEMORY_OFFLOAD_DEFER=true",
                               "PIE_MEMORY_OFFLOAD_HOST_ATTN_US=1000000",
                               NULL};
    e2e_worker_replace(&c, "the worker", defer_env);
    cr_assert_eq(e2e_wait_serving(&c, ctl, "offload-defer"),
                 PIE__V1__MEMORY_POLICY__MEMORY_POLICY_OFFLOAD);
    cr_assert_eq(pie_proc_log_count(c.wrk, "deferral=on"), 1, "the link runs with deferral");
    run_mixed(&c, ids, got_mixed);
    e2e_run_programs(&c, ids, "defer-prefix", got_seq);
    for (int i = 0; i < N_MIXED; i++) {
        char what[32];
        snprintf(what, sizeof what, "concurrent run %d", i);
        e2e_expect_same_msgs(&got_mixed[i], &gpu_mixed[i], what, "offload with deferral", "gpu");
    }
    const char *what[E2E_N_RUNS] = {"text_completion", "parallel_generation",
                                    "prefix_caching (export)", "prefix_caching (import)",
                                    "prefix_caching (unexport)"};
    for (int i = 0; i < E2E_N_RUNS; i++)
        e2e_expect_same_msgs(&got_seq[i], &gpu_seq[i], what[i], "offload with deferral", "gpu");
    double wrk_fwd = e2e_metric(c.wrk, "pie_worker_deferred_items_total{kind=\"forward\"}");
    double ctl_calls = e2e_metric(c.ctl, "pie_controller_deferred_calls_total");
    double failed = e2e_metric(c.ctl, "pie_controller_deferral_failures_total");
    cr_expect_gt(wrk_fwd, 0, "no forward was deferred");
    cr_expect_geq(ctl_calls, wrk_fwd, "the controller took back %g calls for %g deferred forwards",
                  ctl_calls, wrk_fwd);
    cr_expect_eq(failed, 0, "no call reached the controller's bound");
    double wrk_dist = e2e_metric(c.wrk, "pie_worker_deferred_items_total{kind=\"next_dist\"}");
    cr_expect_eq(ctl_calls, wrk_fwd + wrk_dist,
                 "calls taken back: %g; deferred forwards %g and next_dists %g (one item each)",
                 ctl_calls, wrk_fwd, wrk_dist);
    cr_log_info("deferred: %g forward items, %g next_dist items, %g calls taken back", wrk_fwd,
                wrk_dist, ctl_calls);
    for (int i = 0; i < N_MIXED; i++) {
        e2e_run_free(&gpu_mixed[i]);
        e2e_run_free(&got_mixed[i]);
    }
    for (int i = 0; i < E2E_N_RUNS; i++) {
        e2e_run_free(&gpu_seq[i]);
        e2e_run_free(&got_seq[i]);
    }
    for (int i = 0; i < 3; i++) free(ids[i]);
    rpc_channel_destroy(ctl);
    e2e_cluster_stop(&c);
}

/* ---- inside a tensor-parallel group (each rank's host pool holds its KV heads' share) ---- */

/* tp 2 against policy gpu at tp 2: a rank of small-f32 at tp 2 stores 1 of its 2 KV heads, 4 KiB
 * a page of a layer, so 64 KiB of device KV is again 4 pages; rank 0's scheduler decides which
 * decodes go to the host, and every rank attends those on its host pool. */
Test(offload, a_tp2_group_attending_on_its_host_pools_says_what_its_gpu_policy_says) {
    e2e_vs_gpu v;
    const char *gpu_env[] = {"PIE_WORKER_GROUP_ID=gpu", "PIE_TP_SIZE=2", NULL};
    const char *off_env[] = {"PIE_WORKER_GROUP_ID=offload2",  "PIE_TP_SIZE=2",
                             "PIE_MEMORY_POLICY=offload",     "PIE_MEMORY_DEVICE_KV=64KiB",
                             "PIE_MEMORY_HOST_POOL=64MiB",    NULL};
    e2e_vs_gpu_run_at(&v, gpu_env, "offload2", off_env,
                      PIE__V1__MEMORY_POLICY__MEMORY_POLICY_OFFLOAD);
    cr_expect_gt(e2e_metric(v.c.wrk, "pie_worker_offload_host_instances_total"), 0,
                 "no decode attended on the host");
    cr_expect_gt(e2e_metric(v.c.wrk, "pie_worker_offload_steps_total{decision=\"forced\"}"), 0,
                 "4 device pages per rank never forced a decode to the host");
    e2e_vs_gpu_end(&v);
}

/* auto at tp 2 over a 10 kb/s emulated link: rank 0 chooses offload for the group, which
 * registers OFFLOAD once, says why once, and says what policy gpu at tp 2 says. The margin: a
 * rank's layer of 4 device pages (16 KiB) takes 13 s to swap, a layer's compute over a batch of
 * 4096 tokens a fraction of a second even under sanitizers on a loaded machine (at 1 Mb/s the
 * two were close enough that auto chose swap about one run in three). */
Test(offload, a_tp2_group_under_auto_chooses_once_for_every_rank) {
    e2e_vs_gpu v;
    const char *gpu_env[] = {"PIE_WORKER_GROUP_ID=gpu", "PIE_TP_SIZE=2", NULL};
    const char *auto_env[] = {"PIE_WORKER_GROUP_ID=auto2",      "PIE_TP_SIZE=2",
                              "PIE_MEMORY_POLICY=auto",         "PIE_MEMORY_DEVICE_KV=64KiB",
                              "PIE_MEMORY_HOST_POOL=64MiB",     "PIE_MEMORY_EMULATE_LINK_GBPS=0.00001",
                              NULL};
    e2e_vs_gpu_run_at(&v, gpu_env, "auto2", auto_env,
                      PIE__V1__MEMORY_POLICY__MEMORY_POLICY_OFFLOAD);
    cr_expect_eq(pie_proc_log_count(v.c.wrk, "event=wrk.mem.auto "), 1,
                 "the group's choice is logged once (rank 0)");
    cr_expect_eq(pie_proc_log_count(v.c.wrk, "reason=\"offload: swapping a layer takes"), 1);
    e2e_vs_gpu_end(&v);
}
