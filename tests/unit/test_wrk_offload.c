/* test_wrk_offload.c — the load-aware scheduler of CPU attention offload (issue 13; Neo,
 * seed 004 §3.2-3.3) on constructed costs: it offloads when the host's attention hides behind
 * the device's linear layers, never when the estimate says the two sub-batches are slower (the
 * paper's fall-back to device-only), always when the device cannot hold every decode's KV. */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "pie_testutil.h"
#include "wrk_nulldev.h"
#include "wrk_offload.h"
#include "wrk_offsim.h"

TestSuite(wrk_offload, .fini = pie_test_leak_check);

/* H100-like per-token costs (8B model, all layers): linear 20 us/token at small batches is the
 * weights' read amortised; device attention reads 128 KiB/token at ~3 TB/s, the host at
 * ~0.2 TB/s; the link moves 128 KiB/token at ~50 GB/s. Only the ratios matter here. */
static const wrk_off_costs H100 = {
    .lin_tok = 20e-6, .dattn_kv = 0.04e-6, .hattn_kv = 0.6e-6, .xfer_tok = 2.5e-6};

Test(wrk_offload, offloads_decodes_whose_attention_hides_behind_the_prefill_linear_layers) {
    wrk_off_req r[4] = {{.kv = 2000, .on_host = true}, {.kv = 3000}, {.kv = 500}, {.kv = 8000}};
    wrk_off_batch b = {.dev_tokens = 2048, .dev_kv = 2048 * 1024, .reqs = r, .n_reqs = 4,
                       .device_kv_budget = UINT64_MAX};
    uint8_t host[4];
    wrk_off_choice ch;
    wrk_off_decide(&H100, &b, host, &ch);
    cr_assert(ch.offload, "t_off %.6f vs t_dev %.6f", ch.t_off, ch.t_dev);
    cr_assert_not(ch.forced);
    cr_assert_eq(host[0], 1, "already on the host and hidden: it stays");
    cr_assert_lt(ch.t_off, ch.t_dev);
    cr_assert_float_eq(ch.t_off, wrk_off_estimate(&H100, &b, host), 1e-12);
    /* hiding CPU: sub-batch 1's host attention fits in sub-batch 0's linear time */
    uint64_t n0 = 0;
    for (int i = 0; i < 4; i++) n0 += !host[i];
    cr_assert_leq(H100.hattn_kv * (double)ch.host_kv, H100.lin_tok * (double)(b.dev_tokens + n0));
}

Test(wrk_offload, falls_back_to_device_only_when_the_host_is_too_slow) {
    wrk_off_costs slow = H100;
    slow.hattn_kv = 1.0; /* a second per KV token: nothing can hide */
    wrk_off_req r[3] = {{.kv = 100}, {.kv = 200}, {.kv = 300, .on_host = true}};
    wrk_off_batch b = {.dev_tokens = 16, .dev_kv = 256, .reqs = r, .n_reqs = 3,
                       .device_kv_budget = UINT64_MAX};
    uint8_t host[3] = {9, 9, 9};
    wrk_off_choice ch;
    wrk_off_decide(&slow, &b, host, &ch);
    cr_assert_not(ch.offload);
    cr_assert(host[0] == 0 && host[1] == 0 && host[2] == 0, "device-only: nothing on the host");
    cr_assert_float_eq(ch.t_dev, wrk_off_estimate_dev(&slow, &b), 1e-12);
}

Test(wrk_offload, sub_batch_1s_own_pass_over_the_weights_is_counted) {
    /* a device whose linear pass costs 20 ms at any small batch (weights read once): 8 decodes
     * of 1000 tokens, host attention 1 us per KV token — one decode's 1 ms hides behind the
     * 20 ms pass, but sub-batch 1's own pass costs another 20 ms, more than the device
     * attention it saves (8 x 1000 x 0.1 us = 0.8 ms): device-only */
    wrk_off_costs c = {.lin_tok = 1e-5, .lin_fixed = 20e-3, .dattn_kv = 0.1e-6, .hattn_kv = 1e-6};
    wrk_off_req r[8];
    for (int i = 0; i < 8; i++) r[i] = (wrk_off_req){.kv = 1000};
    wrk_off_batch b = {.reqs = r, .n_reqs = 8, .device_kv_budget = UINT64_MAX};
    uint8_t host[8];
    wrk_off_choice ch;
    wrk_off_decide(&c, &b, host, &ch);
    cr_assert_not(ch.offload, "t_off %.6f vs t_dev %.6f", ch.t_off, ch.t_dev);
    cr_assert_float_eq(ch.t_dev, 20e-3 + 0.8e-3, 1e-12);
    cr_assert_gt(ch.t_off, ch.t_dev);
    /* without the fixed pass (a compute-bound device) the same step offloads */
    c.lin_fixed = 0;
    c.lin_tok = 3e-3; /* 8 tokens: 24 ms of linear work to hide behind */
    wrk_off_decide(&c, &b, host, &ch);
    cr_assert(ch.offload, "t_off %.6f vs t_dev %.6f", ch.t_off, ch.t_dev);
}

Test(wrk_offload, a_decode_only_step_without_linear_time_to_hide_behind_stays_on_the_device) {
    /* decode-only, host attention 15x slower than the device's: Tca1 > Tl0 for any request */
    wrk_off_req r[2] = {{.kv = 100000}, {.kv = 90000}};
    wrk_off_batch b = {.reqs = r, .n_reqs = 2, .device_kv_budget = UINT64_MAX};
    uint8_t host[2];
    wrk_off_choice ch;
    wrk_off_decide(&H100, &b, host, &ch);
    cr_assert_not(ch.offload);
    cr_assert_eq(ch.n_host, 0);
}

Test(wrk_offload, what_the_device_cannot_hold_goes_to_the_host_whatever_it_costs) {
    wrk_off_costs slow = H100;
    slow.hattn_kv = 1.0;
    wrk_off_req r[3] = {{.kv = 1000}, {.kv = 1000}, {.kv = 1000}};
    wrk_off_batch b = {.dev_tokens = 0, .reqs = r, .n_reqs = 3, .device_kv_budget = 1500};
    uint8_t host[3];
    wrk_off_choice ch;
    wrk_off_decide(&slow, &b, host, &ch);
    cr_assert(ch.offload && ch.forced);
    cr_assert(isinf(ch.t_dev), "device-only is infeasible");
    uint64_t kept = 0;
    for (int i = 0; i < 3; i++) kept += host[i] ? 0 : r[i].kv;
    cr_assert_leq(kept, 1500);
    cr_assert_eq(ch.n_host, 2);
}

Test(wrk_offload, never_chooses_two_sub_batches_estimated_slower_over_random_steps) {
    uint64_t x = 0x9e3779b97f4a7c15ull;
#define RND() (x ^= x << 13, x ^= x >> 7, x ^= x << 17, x)
    uint8_t host[64];
    wrk_off_req r[64];
    int offloaded = 0, fell_back = 0;
    for (int it = 0; it < 5000; it++) {
        wrk_off_costs c = {.lin_tok = (double)(RND() % 1000 + 1) * 1e-7,
                           .lin_fixed = RND() % 2 ? (double)(RND() % 1000) * 1e-5 : 0,
                           .dattn_kv = (double)(RND() % 1000) * 1e-10,
                           .hattn_kv = (double)(RND() % 1000 + 1) * 1e-9,
                           .xfer_tok = (double)(RND() % 1000) * 1e-9};
        uint32_t n = (uint32_t)(RND() % 64);
        for (uint32_t i = 0; i < n; i++)
            r[i] = (wrk_off_req){.kv = (uint32_t)(RND() % 20000 + 1), .on_host = RND() % 3 == 0};
        wrk_off_batch b = {.dev_tokens = (uint32_t)(RND() % 4096),
                           .dev_kv = RND() % 1000000,
                           .reqs = r,
                           .n_reqs = n,
                           .device_kv_budget = UINT64_MAX};
        wrk_off_choice ch;
        wrk_off_decide(&c, &b, host, &ch);
        double dev = wrk_off_estimate_dev(&c, &b);
        if (ch.offload) {
            offloaded++;
            double off = wrk_off_estimate(&c, &b, host);
            cr_assert_lt(off, dev, "step %d: offload estimated %.9f, device-only %.9f", it, off,
                         dev);
        } else {
            fell_back++;
            for (uint32_t i = 0; i < n; i++) cr_assert_eq(host[i], 0);
        }
    }
    cr_assert(offloaded > 100 && fell_back > 100, "both outcomes: %d offloaded, %d fell back",
              offloaded, fell_back);
#undef RND
}

/* ---- the analytic model of benchmark 3 (wrk_offsim.h) ------------------------------------- */

Test(wrk_offload, the_model_falls_back_and_follows_neos_step_formula) {
    /* a hand-computed point: w = 10, lin_tok = 1 (knee at 10 tokens), dattn = 0, hattn = 0.01;
     * ctx = 100 + 100/2 = 150; gpu_kv 300 → 2 requests; prefill 1 token per decode token */
    wrk_offsim_hw hw = {.name = "toy", .w = 10, .lin_tok = 1, .dattn = 0, .hattn = 0.01,
                        .gpu_kv = 300, .cpu_kv = 1500, .max_batch = 64};
    wrk_offsim_result r = wrk_offsim_run(&hw, 100, 100);
    cr_assert_eq(r.n_gpu, 2);
    cr_assert_float_eq(r.step_gpu, 10.0, 1e-9, "max(w, 2 + 2) = w");
    cr_assert_float_eq(r.thr_gpu, 0.2, 1e-9);
    /* n_c = 10: Tl0 = max(10, 2 + 12) = 14, Tca1 = 0.01 · 1500 = 15, Tl1 = max(10, 10) = 10:
     * T = 25 for 12 tokens = 0.48/s; the best n_c is at most cpu_kv / ctx = 10 */
    cr_assert_leq(r.n_cpu, 10);
    cr_assert_float_eq(r.thr_off, (r.n_gpu + r.n_cpu) / r.step_off, 1e-9);
    cr_assert_geq(r.thr_off, 12.0 / 25.0 - 1e-9);
    cr_assert_gt(r.gain, 1.0);
    /* a host too slow to hide anything: the fall-back keeps GPU-only's throughput */
    hw.hattn = 100;
    r = wrk_offsim_run(&hw, 100, 100);
    cr_assert_eq(r.n_cpu, 0);
    cr_assert_float_eq(r.gain, 0.0, 1e-12);
    /* the testbeds never report a loss, over output lengths */
    const wrk_offsim_hw *hws[] = {&wrk_offsim_t4, &wrk_offsim_a10g, &wrk_offsim_h100};
    for (int h = 0; h < 3; h++)
        for (double out = 16; out <= 4096; out *= 2) {
            wrk_offsim_result t = wrk_offsim_run(hws[h], 1000, out);
            cr_assert_geq(t.gain, 0.0, "%s at output %.0f: %.4f", hws[h]->name, out, t.gain);
        }
}

/* ---- memory.policy auto ------------------------------------------------------------------- */

Test(wrk_offload, auto_takes_swap_when_the_link_keeps_up_else_offload_when_the_host_hides) {
    wrk_mem_auto_in in = {.costs = {.lin_tok = 1e-3, .dattn_kv = 0, .hattn_kv = 1e-6},
                          .n_layers = 10,
                          .batch_tokens = 100,
                          .decode_ctx = 1000};
    wrk_mem_auto_out out;
    in.layer_swap_s = 5e-3; /* a layer computes in 100 · 1e-3 / 10 = 10 ms */
    wrk_mem_auto_choose(&in, &out);
    cr_assert_eq(out.policy, WRK_MEM_SWAP, "%s", out.why);
    cr_assert_float_eq(out.swap_ratio, 0.5, 1e-9);
    cr_assert(strstr(out.why, "transparent"), "%s", out.why);
    in.layer_swap_s = 30e-3; /* swapping would stall; a decode's host attention is 1 ms */
    wrk_mem_auto_choose(&in, &out);
    cr_assert_eq(out.policy, WRK_MEM_OFFLOAD, "%s", out.why);
    cr_assert_float_eq(out.host_share, 1.0, 1e-9);
    in.costs.hattn_kv = 1e-4; /* 100 ms per host decode: 0.01 per device token */
    wrk_mem_auto_choose(&in, &out);
    cr_assert_eq(out.policy, WRK_MEM_SWAP, "%s", out.why);
    cr_assert(strstr(out.why, "neither hides"), "%s", out.why);
}

/* ---- offload's effective capacity ---------------------------------------------------------- */

Test(wrk_offload, the_capacity_shrinks_while_host_attention_is_exposed_and_grows_back) {
    wrk_off_adapt a;
    wrk_off_adapt_init(&a, 100, 900, 4, 16); /* 800 host pages: steps of 100 */
    cr_assert_eq(a.pages, 900, "every page at start");
    /* an epoch with the device waiting 10% of the time: one eighth of the host goes */
    uint32_t p = 0;
    for (int i = 0; i < 4; i++) p = wrk_off_adapt_step(&a, 1000, 100, 10);
    cr_assert_eq(p, 800);
    for (int e = 0; e < 20; e++)
        for (int i = 0; i < 4; i++) p = wrk_off_adapt_step(&a, 1000, 100, 10);
    cr_assert_eq(p, 100, "never below the device's pages");
    /* hidden (1% is not below the grow threshold) and kv-limited: stays */
    for (int i = 0; i < 4; i++) p = wrk_off_adapt_step(&a, 1000, 10, 99);
    cr_assert_eq(p, 100);
    /* hidden and kv-limited: grows an eighth per epoch */
    for (int i = 0; i < 4; i++) p = wrk_off_adapt_step(&a, 1000, 0, 99);
    cr_assert_eq(p, 200);
    /* hidden but not kv-limited: stays */
    for (int i = 0; i < 4; i++) p = wrk_off_adapt_step(&a, 1000, 0, 10);
    cr_assert_eq(p, 200);
    /* inside an epoch nothing moves */
    cr_assert_eq(wrk_off_adapt_step(&a, 1000, 1000, 10), 200);
    /* a spill raises it to the live pages, at most every page */
    cr_assert_eq(wrk_off_adapt_spill(&a, 450), 450);
    cr_assert_eq(wrk_off_adapt_spill(&a, 5000), 900);
    cr_assert_eq(wrk_off_adapt_spill(&a, 10), 900, "a spill never lowers it");
}

/* The null backend's emulated device under offload (wrk_nulldev.h): 2 layers of 10 us + 1 us a
 * token, device attention 0.1 us and host attention 0.5 us a KV token, 1 device page of 16
 * tokens. A prefill of 10 tokens beside two decodes reading 21 KV tokens each (2 pages): the
 * device holds neither decode, so the scheduler forces both to the host (sub-batch 1: 2 tokens,
 * 42 KV tokens). Per layer max(lin(10) = 20, host 42 x 0.5 = 21) + lin(2) = 12 + device attention
 * 10 x 0.1 = 1: 34 us, 68 us for the step, of which the device waited 2 x (21 - 20) = 2 us for the
 * host. The prefill alone runs device-only: 2 x (20 + 1) = 42 us. */
Test(wrk_offload, the_emulated_device_times_an_offloaded_step_as_neos_pipeline_runs_it) {
    wrk_nulldev_config c = {.n_layers = 2,
                            .page_size = 16,
                            .layer_us = 10,
                            .layer_token_us = 1,
                            .layer_kv_us = 0.1,
                            .host_attn_kv_us = 0.5,
                            .device_kv = 2 * 1024,
                            .offload_device_pages = 1,
                            .kv_pages = 8,
                            .page_layer_bytes = 1024};
    wrk_nulldev *d = NULL;
    pie_status st;
    cr_assert_eq(wrk_nulldev_create(&c, &d, &st), PIE_OK, "%s", st.msg);
    static const uint32_t pa[] = {0}, pb[] = {1, 2}, pc[] = {3, 4}, pd[] = {5};
    wrk_offplace_item items[3] = {
        {.pages = pa, .n_pages = 1, .ctx = 0, .n_in = 10, .append = true},
        {.pages = pb, .n_pages = 2, .ctx = 20, .n_in = 1, .append = true},
        {.pages = pc, .n_pages = 2, .ctx = 20, .n_in = 1, .append = true},
    };
    wrk_nulldev_batch b;
    cr_assert_eq(wrk_nulldev_forward_items(d, items, 3, &b, &st), PIE_OK, "%s", st.msg);
    cr_expect_eq(b.host_items, 2u);
    cr_expect_float_eq(b.time_s, 68e-6, 1e-12, "step %.9g s, want 68 us", b.time_s);
    cr_expect_float_eq(b.wait_s, 2e-6, 1e-12, "wait %.9g s, want 2 us", b.wait_s);
    cr_expect_float_eq(b.host_s, 42e-6, 1e-12, "host %.9g s, want 42 us", b.host_s);
    wrk_offplace_item prefill = {.pages = pd, .n_pages = 1, .ctx = 0, .n_in = 10, .append = true};
    cr_assert_eq(wrk_nulldev_forward_items(d, &prefill, 1, &b, &st), PIE_OK, "%s", st.msg);
    cr_expect_eq(b.host_items, 0u);
    cr_expect_float_eq(b.time_s, 42e-6, 1e-12, "device-only step %.9g s, want 42 us", b.time_s);
    wrk_nulldev_stats s;
    wrk_nulldev_get_stats(d, &s);
    cr_expect_eq(s.place.forced_steps, 1u);
    cr_expect_eq(s.host_items, 2u);
    cr_expect_eq(s.offload_steps, 1u);
    cr_expect_eq(s.place.pages_on_host, 4u, "the two decodes' pages, written on the host");
    cr_expect_eq(s.host_wait_ns, 2000u);
    /* a page id past the device's table is refused, not indexed */
    static const uint32_t bad[] = {8};
    wrk_offplace_item oob = {.pages = bad, .n_pages = 1, .ctx = 0, .n_in = 1, .append = true};
    cr_expect_eq(wrk_nulldev_forward_items(d, &oob, 1, &b, &st), PIE_INVALID_ARGUMENT);
    cr_expect_str_eq(st.msg, "forward: item 0: kv page 8 is out of range [0, 8)");
    wrk_nulldev_destroy(d);
}

/* Pages the worker freed stop counting against the device's room (wrk_offplace_freed): with one
 * device page, a decode written there keeps the next decode's pages off the device (forced to
 * the host) until the worker frees it; then the next decode fits on the device again. */
Test(wrk_offload, freed_pages_give_the_device_its_room_back) {
    wrk_nulldev_config c = {.n_layers = 1,
                            .page_size = 16,
                            .layer_us = 10,
                            .layer_token_us = 1,
                            .layer_kv_us = 0.1,
                            .host_attn_kv_us = 0.5,
                            .device_kv = 1024,
                            .offload_device_pages = 1,
                            .kv_pages = 4,
                            .page_layer_bytes = 1024};
    wrk_nulldev *d = NULL;
    pie_status st;
    cr_assert_eq(wrk_nulldev_create(&c, &d, &st), PIE_OK, "%s", st.msg);
    static const uint32_t p0[] = {0}, p1[] = {1}, p2[] = {2}, both[] = {0, 1};
    wrk_offplace_item a = {.pages = p0, .n_pages = 1, .ctx = 10, .n_in = 1, .append = true};
    wrk_offplace_item b = {.pages = p1, .n_pages = 1, .ctx = 10, .n_in = 1, .append = true};
    wrk_offplace_item e = {.pages = p2, .n_pages = 1, .ctx = 10, .n_in = 1, .append = true};
    wrk_nulldev_batch r;
    cr_assert_eq(wrk_nulldev_forward_items(d, &a, 1, &r, &st), PIE_OK, "%s", st.msg);
    cr_expect_eq(r.host_items, 0u, "the first decode fits the device");
    cr_assert_eq(wrk_nulldev_forward_items(d, &b, 1, &r, &st), PIE_OK, "%s", st.msg);
    cr_expect_eq(r.host_items, 1u, "page 0 holds the device's only page: forced to the host");
    wrk_nulldev_freed(d, both, 2);
    cr_assert_eq(wrk_nulldev_forward_items(d, &e, 1, &r, &st), PIE_OK, "%s", st.msg);
    cr_expect_eq(r.host_items, 0u, "pages 0 and 1 were freed: the device has its page back");
    wrk_nulldev_stats s;
    wrk_nulldev_get_stats(d, &s);
    cr_expect_eq(s.place.pages_on_device, 1u);
    cr_expect_eq(s.place.pages_on_host, 0u);
    cr_expect_eq(s.place.forced_steps, 1u);
    wrk_nulldev_destroy(d);
}

/* The rule's knobs (wrk_off_adapt_tune, compared by bench_nulloff's sweep): start at the
 * device's pages, halve the host share on an exposed epoch, grow by a fixed step, and make no
 * decision while the live pages still exceed the capacity (an earlier shrink still drains). */
Test(wrk_offload, the_tuned_capacity_rule_halves_grows_by_its_step_and_holds_while_pages_drain) {
    wrk_off_adapt a;
    wrk_off_adapt_init(&a, 100, 900, 4, 16);
    wrk_off_adapt_opts o = {.grow_pages = 50, .shrink_share = 0.5, .start_at_gpu = true,
                            .hold_while_over = true};
    wrk_off_adapt_tune(&a, &o);
    cr_assert_eq(a.pages, 100, "starts at the device's pages");
    uint32_t p = 0;
    for (int e = 0; e < 4; e++) /* hidden and kv-limited: +50 an epoch */
        for (int i = 0; i < 4; i++) p = wrk_off_adapt_step(&a, 1000, 0, a.pages);
    cr_assert_eq(p, 300);
    for (int i = 0; i < 4; i++) p = wrk_off_adapt_step(&a, 1000, 100, 300); /* exposed */
    cr_assert_eq(p, 200, "half of the 200 host pages offered go");
    /* still exposed, but 300 pages live above the 200 offered: the shrink has not taken effect */
    for (int i = 0; i < 4; i++) p = wrk_off_adapt_step(&a, 1000, 100, 300);
    cr_assert_eq(p, 200, "held while the live pages drain");
    for (int i = 0; i < 4; i++) p = wrk_off_adapt_step(&a, 1000, 100, 190);
    cr_assert_eq(p, 150, "drained: exposed again, half of 100 go");
}

/* The climb knob: from the device's pages, an epoch that filled them probes one step further;
 * once the grown capacity has filled for two epochs it stays when tokens per busy second rose
 * by more than 1 %, else it steps back and holds (hold_epochs) before probing again. */
Test(wrk_offload, the_climbing_capacity_keeps_a_step_that_paid_and_undoes_one_that_did_not) {
    wrk_off_adapt a;
    wrk_off_adapt_init(&a, 100, 900, 2, 16);
    wrk_off_adapt_opts o = {.climb = true, .start_at_gpu = true, .grow_pages = 50,
                            .hold_epochs = 2};
    wrk_off_adapt_tune(&a, &o);
    uint32_t p = 0;
    /* an epoch at 100 pages, filled, 100 tokens per 1000 ns: probe 150 */
    for (int i = 0; i < 2; i++) p = wrk_off_adapt_step_tokens(&a, 100, 1000, 5000, 100);
    cr_assert_eq(p, 150);
    /* two filled epochs at 150 with 120 tokens: it paid (a large wait does not matter) */
    for (int e = 0; e < 2; e++)
        for (int i = 0; i < 2; i++) p = wrk_off_adapt_step_tokens(&a, 120, 1000, 5000, 150);
    cr_assert_eq(p, 150, "kept");
    for (int i = 0; i < 2; i++) p = wrk_off_adapt_step_tokens(&a, 120, 1000, 0, 150);
    cr_assert_eq(p, 200, "filled again: the next probe");
    /* at 200 the throughput falls: back to 150, held for two epochs even when filled */
    for (int e = 0; e < 2; e++)
        for (int i = 0; i < 2; i++) p = wrk_off_adapt_step_tokens(&a, 110, 1000, 0, 200);
    cr_assert_eq(p, 150, "undone");
    for (int e = 0; e < 2; e++)
        for (int i = 0; i < 2; i++) p = wrk_off_adapt_step_tokens(&a, 120, 1000, 0, 150);
    cr_assert_eq(p, 150, "held");
    for (int i = 0; i < 2; i++) p = wrk_off_adapt_step_tokens(&a, 120, 1000, 0, 150);
    cr_assert_eq(p, 200, "probes again after the hold");
    /* a probe whose pages never fill is kept without judging it (demand does not need more) */
    wrk_off_adapt_init(&a, 100, 900, 1, 16);
    o.climb_wait = 3;
    wrk_off_adapt_tune(&a, &o);
    p = wrk_off_adapt_step_tokens(&a, 100, 1000, 0, 100);
    cr_assert_eq(p, 150);
    for (int i = 0; i < 4; i++) p = wrk_off_adapt_step_tokens(&a, 100, 1000, 0, 100);
    cr_assert_eq(p, 150);
    p = wrk_off_adapt_step_tokens(&a, 100, 1000, 0, 148); /* filled: base again, probe */
    cr_assert_eq(p, 200);
}

/* ---- Neo's rules with deferral (defer_ok; wrk_offload.h) ----------------------------------- */

/* A device whose linear pass costs 20 ms at any small batch (weights read once), 10 us per
 * token past it; device attention 0.1 us, host attention 1 us per KV token. */
static const wrk_off_costs WEIGHT_BOUND = {
    .lin_tok = 1e-5, .lin_fixed = 20e-3, .dattn_kv = 0.1e-6, .hattn_kv = 1e-6};

Test(wrk_offload, neo_chooses_device_only_when_host_decodes_would_lower_the_steps_throughput) {
    /* 8 decodes on the device, 2 on the host that hide (2 ms behind 20 ms) — but sub-batch 1's
     * own pass costs 20 ms more: two sub-batches make 10 tokens in 40.8 ms (245/s), device-only
     * 8 in 20.8 ms (385/s). The host ones are deferred, not brought back. */
    wrk_off_req r[10];
    for (int i = 0; i < 10; i++) r[i] = (wrk_off_req){.kv = 1000, .on_host = i >= 8};
    wrk_off_batch b = {.reqs = r, .n_reqs = 10, .device_kv_budget = UINT64_MAX, .defer_ok = true};
    uint8_t host[10];
    wrk_off_choice ch;
    wrk_off_decide(&WEIGHT_BOUND, &b, host, &ch);
    cr_assert_not(ch.offload, "t_off %.6f vs t_dev %.6f", ch.t_off, ch.t_dev);
    cr_assert_float_eq(ch.t_dev, 20e-3 + 0.8e-3, 1e-12, "device-only: the 8 device decodes");
    cr_assert_float_eq(ch.t_off, 40.8e-3, 1e-12);
    for (int i = 0; i < 8; i++) cr_assert_eq(host[i], WRK_OFF_DEVICE);
    cr_assert(host[8] == WRK_OFF_DEFER && host[9] == WRK_OFF_DEFER, "the host ones wait");
    cr_assert_eq(ch.n_defer, 2);
    /* but the step's 20 ms hide 20000 KV tokens: 20 such decodes for one more pass would
     * pay (20 x 20.8 ms > 8 x 20 ms), so the capacity may offer the host that much */
    cr_assert_float_eq(ch.gain_kv, 20e-3 / 1e-6, 1e-6);
}

Test(wrk_offload, neo_includes_host_decodes_hidden_behind_a_prefills_linear_layers) {
    /* a 2048-token prefill: Tl0 = lin(2048 + 8) = 20.56 ms hides 10 host decodes of 1 ms;
     * two sub-batches: 19 requests in 20.56 + 20 + 0.8 ms (459/s) against 9 in 21.36 ms */
    wrk_off_req r[18];
    for (int i = 0; i < 18; i++) r[i] = (wrk_off_req){.kv = 1000, .on_host = i >= 8};
    wrk_off_batch b = {.dev_tokens = 2048,
                       .dev_items = 1,
                       .reqs = r,
                       .n_reqs = 18,
                       .device_kv_budget = UINT64_MAX,
                       .defer_ok = true};
    uint8_t host[18];
    wrk_off_choice ch;
    wrk_off_decide(&WEIGHT_BOUND, &b, host, &ch);
    cr_assert(ch.offload, "t_off %.6f vs t_dev %.6f", ch.t_off, ch.t_dev);
    cr_assert_eq(ch.n_host, 10);
    cr_assert_eq(ch.n_defer, 0);
    for (int i = 0; i < 18; i++) cr_assert_eq(host[i], i >= 8 ? WRK_OFF_HOST : WRK_OFF_DEVICE);
    cr_assert_float_eq(ch.t_off, 20.56e-3 + 20e-3 + 0.8e-3, 1e-12);
    cr_assert_leq(WEIGHT_BOUND.hattn_kv * (double)ch.host_kv, 20.56e-3, "hidden");
    /* what the step hides: Tl0 / hattn = 20560 KV tokens, 20 decodes of 1000 for one more
     * pass of 20 ms against 9 requests of 21.36 ms: it pays */
    cr_assert_float_eq(ch.gain_kv, 20.56e-3 / 1e-6, 1e-6);
}

Test(wrk_offload, neo_defers_the_host_decodes_that_would_not_hide_longest_waiting_first) {
    /* a 4096-token prefill: Tl0 = lin(4104) = 41.04 ms. Host decodes: 10 of 2 ms, 2 of 15 ms;
     * request 19 waited 3 steps: it is taken first (15 ms), then the small ones (35 ms): the
     * other large one would not hide (50 ms > 41.04 ms): deferred. Two sub-batches: 20
     * requests in 61.84 ms against 9 in 41.84. */
    wrk_off_req r[20];
    for (int i = 0; i < 8; i++) r[i] = (wrk_off_req){.kv = 1000};
    for (int i = 8; i < 18; i++) r[i] = (wrk_off_req){.kv = 2000, .on_host = true};
    r[18] = (wrk_off_req){.kv = 15000, .on_host = true};
    r[19] = (wrk_off_req){.kv = 15000, .on_host = true, .waited = 3};
    wrk_off_batch b = {.dev_tokens = 4096,
                       .dev_items = 1,
                       .reqs = r,
                       .n_reqs = 20,
                       .device_kv_budget = UINT64_MAX,
                       .defer_ok = true};
    uint8_t host[20];
    wrk_off_choice ch;
    wrk_off_decide(&WEIGHT_BOUND, &b, host, &ch);
    cr_assert(ch.offload, "t_off %.6f vs t_dev %.6f", ch.t_off, ch.t_dev);
    cr_assert_eq(ch.n_host, 11);
    cr_assert_eq(ch.n_defer, 1);
    cr_assert_eq(host[19], WRK_OFF_HOST, "the longest-waiting first");
    cr_assert_eq(host[18], WRK_OFF_DEFER);
    for (int i = 8; i < 18; i++) cr_assert_eq(host[i], WRK_OFF_HOST);
    cr_assert_float_eq(ch.t_off, 41.04e-3 + 20e-3 + 0.8e-3, 1e-12);
    /* without deferral every request runs: none is skipped */
    b.defer_ok = false;
    wrk_off_decide(&WEIGHT_BOUND, &b, host, &ch);
    cr_assert_eq(ch.n_defer, 0);
    for (int i = 0; i < 20; i++) cr_assert_neq(host[i], WRK_OFF_DEFER);
}

Test(wrk_offload, a_request_deferred_defer_max_steps_runs_at_its_next_step) {
    wrk_off_req r[10];
    for (int i = 0; i < 10; i++) r[i] = (wrk_off_req){.kv = 1000, .on_host = i >= 8};
    r[9].waited = WRK_OFF_DEFER_MAX;
    wrk_off_batch b = {.reqs = r, .n_reqs = 10, .device_kv_budget = UINT64_MAX, .defer_ok = true};
    uint8_t host[10];
    wrk_off_choice ch;
    wrk_off_decide(&WEIGHT_BOUND, &b, host, &ch);
    /* the device has room: back on the device is cheaper than a second pass */
    cr_assert_not(ch.offload);
    cr_assert_eq(host[9], WRK_OFF_DEVICE, "starving: it runs");
    cr_assert_eq(host[8], WRK_OFF_DEFER);
    /* a full device: it runs on the host, whatever it costs */
    b.device_kv_budget = 8000;
    wrk_off_decide(&WEIGHT_BOUND, &b, host, &ch);
    cr_assert(ch.offload);
    cr_assert(isinf(ch.t_dev), "device-only would leave it waiting");
    cr_assert_eq(host[9], WRK_OFF_HOST);
}

/* The placement keeps the count by a request's first page: over many steps on a device that
 * never hides a host decode, each host request still makes a token every DEFER_MAX + 1 steps. */
Test(wrk_offload, deferral_never_starves_a_host_request) {
    wrk_offplace p;
    pie_status st;
    cr_assert_eq(wrk_offplace_init(&p, 64, 32, 16, 16, &st), PIE_OK, "%s", st.msg);
    uint32_t pages[7] = {0, 1, 2, 3, 40, 41, 42};
    wrk_offplace_item it[7];
    for (int i = 0; i < 7; i++)
        it[i] = (wrk_offplace_item){
            .pages = &pages[i], .n_pages = 1, .ctx = 10, .n_in = 1, .append = true};
    uint8_t h[7] = {0, 0, 0, 0, 1, 1, 1};
    wrk_offplace_apply(&p, it, 7, h, NULL, NULL); /* three requests' KV on the host */
    wrk_offplace_set_defer(&p, true);
    wrk_off_costs slow = WEIGHT_BOUND;
    slow.hattn_kv = 1.0; /* nothing hides */
    int last_run[3] = {0, 0, 0};
    int runs[3] = {0, 0, 0};
    for (int step = 1; step <= 60; step++) {
        wrk_off_choice ch;
        wrk_offplace_decide(&p, &slow, it, 7, NULL, NULL, h, &ch);
        for (int i = 0; i < 4; i++) cr_assert_neq(h[i], WRK_OFF_DEFER, "device decodes run");
        for (int k = 0; k < 3; k++) {
            if (h[4 + k] != WRK_OFF_DEFER) {
                last_run[k] = step;
                runs[k]++;
            }
            cr_assert_leq(step - last_run[k], WRK_OFF_DEFER_MAX,
                          "request %d waited %d steps at step %d", k, step - last_run[k], step);
        }
        wrk_offplace_apply(&p, it, 7, h, NULL, NULL);
        /* a request that ran came back to the device: send it out again, as the memory would */
        for (int k = 0; k < 3; k++)
            if (!wrk_offplace_on_host(&p, pages[4 + k])) {
                uint8_t one[1] = {1};
                wrk_offplace_apply(&p, &it[4 + k], 1, one, NULL, NULL);
            }
    }
    for (int k = 0; k < 3; k++) cr_assert_geq(runs[k], 60 / (WRK_OFF_DEFER_MAX + 1));
    cr_assert_gt(p.stats.deferred, 0);
    wrk_offplace_free(&p);
}

Test(wrk_offload, the_estimate_capacity_offers_the_host_only_what_every_step_hid_at_a_gain) {
    wrk_off_adapt a;
    wrk_off_adapt_init(&a, 100, 900, 4, 16);
    wrk_off_adapt_tune(&a, &(wrk_off_adapt_opts){.estimate = true});
    cr_assert_eq(a.pages, 100, "nothing offered before an estimate");
    uint32_t p = 0;
    /* 1000 tokens a step over 50 live pages: a KV token lives 0.8 steps, the window is one
     * epoch */
    for (int i = 0; i < 4; i++) p = wrk_off_adapt_step_est(&a, 1000, 1000, 0, 200, 1, 50);
    cr_assert_eq(p, 300, "every step hid 200 pages at a gain");
    /* one step of the epoch hid nothing: nothing is offered */
    for (int i = 0; i < 4; i++) p = wrk_off_adapt_step_est(&a, 1000, 1000, 0, i ? 400 : 0, 1, 50);
    cr_assert_eq(p, 100);
    /* an epoch without decodes estimates nothing: unchanged */
    for (int i = 0; i < 4; i++) p = wrk_off_adapt_step_est(&a, 1000, 1000, 0, 0, 0, 50);
    cr_assert_eq(p, 100);
    for (int i = 0; i < 4; i++) p = wrk_off_adapt_step_est(&a, 1000, 1000, 0, 200, 1, 50);
    cr_assert_eq(p, 300);
    /* noise (less than an eighth of the host share) moves nothing */
    for (int i = 0; i < 4; i++) p = wrk_off_adapt_step_est(&a, 1000, 1000, 0, 210, 1, 50);
    cr_assert_eq(p, 300, "est 210: 10 pages of 200 is noise");
    /* never above every page */
    for (int i = 0; i < 4; i++) p = wrk_off_adapt_step_est(&a, 1000, 1000, 0, 5000, 1, 50);
    cr_assert_eq(p, 900);
}

/* What is admitted while the estimate is high stays for its life: the estimate is the least
 * over the epochs a KV token lives (Little's law), so a burst of prefill-heavy epochs does not
 * raise it while the decode-only epochs before it are younger than that life. */
Test(wrk_offload, the_estimate_takes_the_least_over_the_life_of_what_it_admits) {
    wrk_off_adapt a;
    wrk_off_adapt_init(&a, 100, 900, 4, 16);
    wrk_off_adapt_tune(&a, &(wrk_off_adapt_opts){.estimate = true});
    /* 10 tokens a step over 50 live pages: 80 steps a KV token, 20 epochs of 4 steps */
    uint32_t p = 0;
    for (int i = 0; i < 4; i++) p = wrk_off_adapt_step_est(&a, 10, 1000, 0, 200, 1, 50);
    cr_assert_eq(p, 300);
    for (int i = 0; i < 4; i++) p = wrk_off_adapt_step_est(&a, 10, 1000, 0, 8, 1, 50);
    cr_assert_eq(p, 108, "a decode-only epoch hid 8 pages");
    for (int e = 0; e < 19; e++) { /* prefill bursts: the low epoch and 19 after it */
        for (int i = 0; i < 4; i++) p = wrk_off_adapt_step_est(&a, 10, 1000, 0, 600, 1, 50);
        cr_assert_eq(p, 108, "epoch %d: the low epoch is still within the window", e);
    }
    for (int i = 0; i < 4; i++) p = wrk_off_adapt_step_est(&a, 10, 1000, 0, 600, 1, 50);
    cr_assert_eq(p, 700, "the newest 20 epochs hid 600 pages at every step");
    cr_assert_eq(a.window, 20, "80 steps a KV token: 20 epochs of 4");
    /* the same burst with a short life (1000 tokens a step): the next epoch follows it */
    wrk_off_adapt_init(&a, 100, 900, 4, 16);
    wrk_off_adapt_tune(&a, &(wrk_off_adapt_opts){.estimate = true});
    for (int i = 0; i < 4; i++) p = wrk_off_adapt_step_est(&a, 1000, 1000, 0, 8, 1, 50);
    for (int i = 0; i < 4; i++) p = wrk_off_adapt_step_est(&a, 1000, 1000, 0, 600, 1, 50);
    cr_assert_eq(p, 700);
    cr_assert_eq(a.window, 1);
}

/* With deferral, over random steps: two sub-batches only when their estimated throughput beats
 * the device-only schedule's (or device-only is impossible), every request deferred only below
 * the bound, every starving request run, a deferred request never on the device's side of a
 * two-sub-batch step's estimate. */
Test(wrk_offload, with_deferral_never_picks_the_lower_estimated_throughput_nor_starves) {
    uint64_t x = 0x2545f4914f6cdd1dull;
#define RND() (x ^= x << 13, x ^= x >> 7, x ^= x << 17, x)
    uint8_t host[64];
    wrk_off_req r[64];
    int two = 0, dev = 0, deferred = 0;
    for (int it = 0; it < 5000; it++) {
        wrk_off_costs c = {.lin_tok = (double)(RND() % 1000 + 1) * 1e-7,
                           .lin_fixed = RND() % 2 ? (double)(RND() % 1000) * 1e-5 : 0,
                           .dattn_kv = (double)(RND() % 1000) * 1e-10,
                           .hattn_kv = (double)(RND() % 1000 + 1) * 1e-9,
                           .xfer_tok = (double)(RND() % 1000) * 1e-9};
        uint32_t n = (uint32_t)(RND() % 64);
        for (uint32_t i = 0; i < n; i++)
            r[i] = (wrk_off_req){.kv = (uint32_t)(RND() % 20000 + 1),
                                 .on_host = RND() % 2 == 0,
                                 .waited = (uint16_t)(RND() % (WRK_OFF_DEFER_MAX + 2))};
        uint32_t dev_tokens = (uint32_t)(RND() % 4096);
        wrk_off_batch b = {.dev_tokens = dev_tokens,
                           .dev_items = dev_tokens ? 1 + dev_tokens / 1024 : 0,
                           .dev_kv = RND() % 1000000,
                           .reqs = r,
                           .n_reqs = n,
                           .device_kv_budget = UINT64_MAX,
                           .defer_ok = true};
        wrk_off_choice ch;
        wrk_off_decide(&c, &b, host, &ch);
        uint32_t n_defer = 0;
        for (uint32_t i = 0; i < n; i++) {
            if (host[i] != WRK_OFF_DEFER) continue;
            n_defer++;
            cr_assert(r[i].on_host, "step %d: only host requests wait", it);
            cr_assert_lt(r[i].waited, WRK_OFF_DEFER_MAX, "step %d: request %u starves", it, i);
        }
        cr_assert_eq(ch.n_defer, n_defer);
        deferred += n_defer > 0;
        if (ch.offload) {
            two++;
            cr_assert_geq(ch.t_off, 0);
            if (isfinite(ch.t_dev)) {
                double x_dev = 0, x_off = 0;
                for (uint32_t i = 0; i < n; i++) {
                    x_off += host[i] != WRK_OFF_DEFER;
                    x_dev += host[i] == WRK_OFF_DEVICE;
                }
                x_off += b.dev_items, x_dev += b.dev_items;
                /* device-only runs sub-batch 0 alone: the joined host requests wait */
                cr_assert(x_dev == 0 || x_off * ch.t_dev > x_dev * ch.t_off,
                          "step %d: %g in %.9f s against %g in %.9f s", it, x_off, ch.t_off, x_dev,
                          ch.t_dev);
            }
        } else {
            dev++;
            for (uint32_t i = 0; i < n; i++) cr_assert_neq(host[i], WRK_OFF_HOST);
        }
    }
    cr_assert(two > 100 && dev > 100 && deferred > 100, "%d two, %d device-only, %d deferring", two,
              dev, deferred);
#undef RND
}

/* A host whose attention costs (next to) nothing: the estimate is unbounded, what the capacity
 * rule reads stays bounded by the page ids (no overflowing conversion). */
Test(wrk_offload, a_free_hosts_estimate_is_bounded_by_the_page_ids) {
    wrk_off_costs c = WEIGHT_BOUND;
    c.hattn_kv = 1e-300;
    wrk_off_req r[2] = {{.kv = 1000}, {.kv = 1000, .on_host = true}};
    wrk_off_batch b = {.reqs = r, .n_reqs = 2, .device_kv_budget = UINT64_MAX};
    uint8_t host[2];
    wrk_off_choice ch;
    wrk_off_decide(&c, &b, host, &ch);
    cr_assert_gt(ch.gain_kv, 1e200);
    wrk_offplace p;
    pie_status st;
    cr_assert_eq(wrk_offplace_init(&p, 64, 32, 16, 4, &st), PIE_OK, "%s", st.msg);
    uint32_t pages[2] = {0, 1};
    wrk_offplace_item it[2] = {
        {.pages = &pages[0], .n_pages = 1, .ctx = 10, .n_in = 1, .append = true},
        {.pages = &pages[1], .n_pages = 1, .ctx = 10, .n_in = 1, .append = true}};
    c.hattn_kv = 0;
    wrk_offplace_decide(&p, &c, it, 2, NULL, NULL, host, &ch);
    cr_assert(isinf(ch.gain_kv));
    cr_assert_eq(p.stats.gain_pages, 64);
    cr_assert_eq(p.stats.gain_steps, 1);
    wrk_offplace_free(&p);
}

/* The cuda engine's hooks: an item the host side cannot run stays on the device even when
 * every other decode goes to the host, and a page evicted to make room counts on the host. */
static bool pick_every_one(void *user, uint32_t item) {
    (void)user, (void)item;
    return true;
}

Test(wrk_offload, device_only_items_stay_and_evicted_pages_count_on_the_host) {
    wrk_offplace p;
    pie_status st;
    cr_assert_eq(wrk_offplace_init(&p, 16, 4, 16, 4, &st), PIE_OK, "%s", st.msg);
    uint32_t pages[2] = {0, 1};
    wrk_offplace_item it[2] = {
        {.pages = &pages[0], .n_pages = 1, .ctx = 10, .n_in = 1, .append = true},
        {.pages = &pages[1],
         .n_pages = 1,
         .ctx = 10,
         .n_in = 1,
         .append = true,
         .device_only = true},
    };
    cr_assert(wrk_offplace_eligible(&it[0]));
    cr_assert_not(wrk_offplace_eligible(&it[1]));
    uint8_t h[2] = {9, 9};
    wrk_offplace_decide(&p, NULL, it, 2, pick_every_one, NULL, h, NULL);
    cr_assert_eq(h[0], WRK_OFF_HOST, "the pick sends the eligible decode to the host");
    cr_assert_eq(h[1], WRK_OFF_DEVICE);
    wrk_offplace_apply(&p, it, 2, h, NULL, NULL);
    cr_assert_eq(p.stats.pages_on_host, 1);
    cr_assert_eq(p.stats.pages_on_device, 1);
    wrk_offplace_evicted(&p, 1);
    cr_assert(wrk_offplace_on_host(&p, 1));
    cr_assert_eq(p.stats.pages_on_host, 2);
    cr_assert_eq(p.stats.pages_on_device, 0);
    cr_assert_eq(p.stats.pages_to_host, 1);
    wrk_offplace_evicted(&p, 1);  /* already there: nothing */
    wrk_offplace_evicted(&p, 99); /* past the table: ignored */
    cr_assert_eq(p.stats.pages_on_host, 2);
    wrk_offplace_free(&p);
}
