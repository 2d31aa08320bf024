/* test_offload.c — the offload memory policy (issue 13; Neo's CPU attention offload) under the
 * whole stack: controller, a cpu worker with memory.policy offload, lifecycle, real inferlets.
 *
 * Covered: with a device share of 4 pages (small-f32: 4 layers x 8 KiB a page) and a 64 MiB host
 * pool, the load-aware scheduler must send decodes' KV and attention to the host (the device
 * cannot hold them); text completion, parallel generation (a fork: pages shared between
 * sequences) and prefix caching's export, import and unexport say byte for byte what a worker
 * with policy gpu says, and the worker's metrics show decodes attended on the host and pages
 * moved there. */
#include <criterion/criterion.h>

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

    e2e_vs_gpu_end(&v);
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
