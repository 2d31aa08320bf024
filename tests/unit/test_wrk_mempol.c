/* test_wrk_mempol.c — the worker's memory policy (issue 13; services/worker/mem/wrk_mempol.h):
 * what memory.* means for the pools, the refusals and their messages, and the epoch loop that
 * feeds adaptive expansion.
 *
 * Numbers: 8 layers, one page of one layer B = 4096 bytes, pool.kv_pages 100. Every layer on
 * the device holds 100 pages in D = 100 * 8 * B bytes; with S layers on the device each layer's
 * cache holds D / (S * B) = 800 / S pages (the pooling paper's expansion n / S). */
#include <criterion/criterion.h>
#include <string.h>

#include "pie_testutil.h"
#include "wrk_mempol.h"

TestSuite(wrk_mempol, .fini = pie_test_leak_check);

#define B 4096u

static const wrk_mem_shape shape = {
    .n_layers = 8, .page_layer_bytes = B, .pool_pages = 100, .max_pages = 1u << 20};

static wrk_mem_plan plan_ok(const wrk_mem_config *c) {
    wrk_mem_plan p;
    pie_status st = {0};
    cr_assert_eq(wrk_mem_plan_make(c, &shape, &p, &st), PIE_OK, "%s", st.msg);
    return p;
}

static void plan_fails(const wrk_mem_config *c, pie_code code, const char *msg) {
    wrk_mem_plan p;
    pie_status st = {0};
    cr_assert_eq(wrk_mem_plan_make(c, &shape, &p, &st), code, "%s", st.msg);
    cr_assert_str_eq(st.msg, msg);
}

Test(wrk_mempol, gpu_offers_the_pool_as_it_is) {
    wrk_mem_plan p = plan_ok(&(wrk_mem_config){.policy = WRK_MEM_GPU});
    cr_assert_eq(p.kv_pages_max, 100);
    cr_assert_eq(p.kv_pages_gpu, 100);
    cr_assert_eq(wrk_mem_effective(&p, 3), 100, "gpu ignores slot counts");
    cr_assert_eq(p.host_bytes, 0);
}

Test(wrk_mempol, swap_grows_the_pages_by_the_expansion_up_to_what_the_host_pool_allows) {
    /* a large host pool: down to 2 layers on the device, 400 pages; the host holds 8 - 2 + 2
     * layer caches of 400 pages */
    wrk_mem_plan p = plan_ok(&(wrk_mem_config){.policy = WRK_MEM_SWAP, .host_pool = 1ull << 30});
    cr_assert_eq(p.kv_pages_gpu, 100);
    cr_assert_eq(p.min_slots, 2);
    cr_assert_eq(p.kv_pages_max, 400);
    cr_assert(p.adaptive);
    cr_assert_eq(p.start_slots, 8, "adaptive starts with every layer on the device");
    cr_assert_eq(p.host_bytes, 8ull * 400 * B);
    cr_assert_eq(wrk_mem_effective(&p, 8), 100);
    cr_assert_eq(wrk_mem_effective(&p, 4), 200);
    cr_assert_eq(wrk_mem_effective(&p, 3), 266);
    cr_assert_eq(wrk_mem_effective(&p, 2), 400);
    /* a host pool of 800 pages' caches: S = 4 needs 8 - 4 + 2 = 6 caches of 200 pages (1200),
     * S = 5 needs 5 caches of 160 (800): it fits from 5 layers on the device */
    wrk_mem_plan q =
        plan_ok(&(wrk_mem_config){.policy = WRK_MEM_SWAP, .host_pool = 5ull * 160 * B});
    cr_assert_eq(q.min_slots, 5, "the smallest slot count the host pool can back");
    cr_assert_eq(q.kv_pages_max, 160);
    /* device_kv set: half the default */
    wrk_mem_plan h = plan_ok(&(wrk_mem_config){
        .policy = WRK_MEM_SWAP, .device_kv = 400ull * B, .host_pool = 1ull << 30});
    cr_assert_eq(h.kv_pages_gpu, 50);
    cr_assert_eq(h.kv_pages_max, 200);
}

Test(wrk_mempol, offload_offers_the_device_pages_plus_the_host_pools) {
    /* 100 pages of every layer on the device (the default D), a host pool of 250.5 more */
    wrk_mem_plan p = plan_ok(&(wrk_mem_config){.policy = WRK_MEM_OFFLOAD,
                                               .host_pool = 250ull * 8 * B + 100});
    cr_assert_eq(p.kv_pages_gpu, 100);
    cr_assert_eq(p.kv_pages_max, 350);
    cr_assert_eq(wrk_mem_effective(&p, 8), 350, "no expansion: the effective capacity is fixed");
    cr_assert_eq(p.host_bytes, 250ull * 8 * B);
    cr_assert_eq(p.start_slots, 8);
    wrk_mem_plan h = plan_ok(&(wrk_mem_config){
        .policy = WRK_MEM_OFFLOAD, .device_kv = 400ull * B, .host_pool = 1ull << 30});
    cr_assert_eq(h.kv_pages_gpu, 50);
    cr_assert_eq(h.kv_pages_max, 50 + (1u << 30) / (8 * B));
}

Test(wrk_mempol, a_fixed_device_layer_count_is_the_effective_capacity) {
    wrk_mem_plan p = plan_ok(&(wrk_mem_config){
        .policy = WRK_MEM_SWAP, .device_layers = 4, .host_pool = 1ull << 30, .link_gbps = 8});
    cr_assert(!p.adaptive);
    cr_assert_eq(p.start_slots, 4);
    cr_assert_eq(p.kv_pages_max, 200);
    cr_assert_eq(wrk_mem_effective(&p, 4), 200);
    cr_assert_float_eq(p.link_bytes_per_s, 1e9, 1e-3, "8 Gb/s is 1 GB/s");
}

Test(wrk_mempol, refusals_name_the_key_and_the_numbers) {
    plan_fails(&(wrk_mem_config){.policy = WRK_MEM_OFFLOAD}, PIE_RESOURCE_EXHAUSTED,
               "memory.host_pool 0 bytes is too small: offload needs at least one KV page of "
               "every layer (32768 bytes)");
    plan_fails(&(wrk_mem_config){.policy = WRK_MEM_AUTO}, PIE_UNIMPLEMENTED,
               "memory.policy auto has no plan of its own: the worker chooses swap or offload "
               "(wrk_mem_auto_choose) and plans that");
    plan_fails(&(wrk_mem_config){.policy = WRK_MEM_SWAP, .host_pool = 1000}, PIE_RESOURCE_EXHAUSTED,
               "memory.host_pool 1000 bytes is too small: 8 layers with 8 on the device need "
               "819200 bytes of host memory");
    plan_fails(&(wrk_mem_config){.policy = WRK_MEM_SWAP, .device_layers = 3, .host_pool = 1000},
               PIE_RESOURCE_EXHAUSTED,
               "memory.host_pool 1000 bytes is too small: 8 layers with 3 on the device need "
               "7626752 bytes of host memory");
    plan_fails(&(wrk_mem_config){.policy = WRK_MEM_SWAP, .device_layers = 9, .host_pool = 1u << 30},
               PIE_INVALID_ARGUMENT,
               "memory.device_layers 9 is out of range [2, 8] for this model (0 = adaptive)");
    plan_fails(&(wrk_mem_config){.policy = WRK_MEM_SWAP, .device_kv = 100, .host_pool = 1u << 30},
               PIE_INVALID_ARGUMENT,
               "memory.device_kv 100 bytes holds no KV page of every layer (32768 bytes)");
}

/* The loop decides once per epoch, on what the epoch measured: saturated pages and no stalls
 * → one more layer to the host; a stall → one back. */
Test(wrk_mempol, the_epoch_loop_expands_while_pages_are_short_and_backs_off_on_a_stall) {
    wrk_mem_plan p = plan_ok(&(wrk_mem_config){.policy = WRK_MEM_SWAP, .host_pool = 1ull << 30});
    wrk_mem_adapt a;
    wrk_mem_adapt_init(&a, &p, 4);
    uint32_t slots = 8;
    for (int i = 0; i < 3; i++)
        cr_assert_eq(wrk_mem_adapt_step(&a, 100, 1000000, 0, 100), 8, "inside the epoch");
    slots = wrk_mem_adapt_step(&a, 100, 1000000, 0, 100); /* every page live: kv-limited */
    cr_assert_eq(slots, 7, "end of a kv-limited, stall-free epoch: one layer to the host");
    /* the steps right after a change are the pipeline's transient: not observed (a stall
     * there, or a dip, would otherwise undo the change) */
    for (int i = 0; i < WRK_MEM_SETTLE_STEPS; i++)
        cr_assert_eq(wrk_mem_adapt_step(&a, 1, 1000000, 900000, 0), 7, "settling");
    /* the next epoch pays (throughput up by more than the gain rule) */
    for (int i = 0; i < 3; i++) wrk_mem_adapt_step(&a, 200, 1000000, 0, 114);
    slots = wrk_mem_adapt_step(&a, 200, 1000000, 0, 114);
    cr_assert_eq(slots, 6, "it paid: one more");
    for (int i = 0; i < WRK_MEM_SETTLE_STEPS; i++) wrk_mem_adapt_step(&a, 1, 1000000, 900000, 0);
    /* an epoch where compute waited 10% of the time on swaps */
    for (int i = 0; i < 3; i++) wrk_mem_adapt_step(&a, 200, 1000000, 100000, 133);
    slots = wrk_mem_adapt_step(&a, 200, 1000000, 100000, 133);
    cr_assert_eq(slots, 7, "a stall: one layer back to the device");
    for (int i = 0; i < WRK_MEM_SETTLE_STEPS; i++) wrk_mem_adapt_step(&a, 1, 1000000, 0, 0);
    /* pages not short (few live): no further expansion */
    for (int e = 0; e < 3; e++)
        for (int i = 0; i < 4; i++) slots = wrk_mem_adapt_step(&a, 200, 1000000, 0, 10);
    cr_assert_eq(slots, 7);
}

/* A try whose extra pages stay unused (one layer's gain admits no further request: the most
 * pages live does not rise) is inconclusive: without a stall the loop goes one layer further
 * from the same base until the pages are used and throughput rises, instead of stopping at
 * the first step. */
Test(wrk_mempol, a_try_too_small_to_admit_a_request_goes_on_until_pages_are_used) {
    wrk_mem_plan p = plan_ok(&(wrk_mem_config){.policy = WRK_MEM_SWAP, .host_pool = 1ull << 30});
    wrk_mem_adapt a;
    wrk_mem_adapt_init(&a, &p, 2);
    uint32_t eff8 = wrk_mem_effective(&p, 8);
    /* requests of 32% of the gpu pool: 3 fit at 8 layers, a 4th needs 6 (4 x 0.32 x 8/6 < 1) */
    uint32_t req = eff8 * 32 / 100, slots = 8, seen_min = 8;
    for (int step = 0; step < 200; step++) {
        uint32_t eff = wrk_mem_effective(&p, slots);
        uint32_t running = eff / req;
        uint32_t got = wrk_mem_adapt_step(&a, running * 100, 1000000, 0, running * req);
        if (got < seen_min) seen_min = got;
        slots = got;
    }
    cr_expect_leq(seen_min, 6, "stopped at %u layers: the 4th request never fit", seen_min);
    cr_expect_geq(wrk_mem_effective(&p, slots) / req, 4, "ended at %u layers, %u requests",
                  slots, wrk_mem_effective(&p, slots) / req);
}
