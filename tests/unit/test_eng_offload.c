/* test_eng_offload.c — CPU attention offload on the cpu engine (issue 13; Neo, seed 004;
 * services/worker/engine/eng_cpu_offload.c, services/worker/mem/wrk_offload.h): decode items
 * whose pages all live in the "host" region attend on a host attention pool while the engine's
 * pool runs the rest, both with the whole call's attention plan.
 *
 * The promise tested: offload changes where K/V live and which threads read them, never what
 * is computed. The mixed workload test_eng_swap runs too (tests/support/pie_testeng.h:
 * prefill, decode, a non-appending item with a tree mask, page masks, page copies, clear_pages
 * of a reused page) plus a fork sharing a page with its parent runs on policy gpu and under
 * offload — every decode on the host, decodes alternating between the regions, and the
 * load-aware scheduler with a device too small for the decodes' KV — and every output's logits
 * and distribution must be BIT-identical.
 *
 * Why these tests can fail: the host region starts as zeros and a page moves there only by
 * the engine's copy (every layer) when an item going to the host reads it; an engine that
 * skipped a move, read the wrong region or mixed two calls' plans would change the outputs.
 * Each test asserts items attended on the host and pages moved (both ways where it alternates),
 * so an engine that never offloaded would not pass for one that does. */
#include <criterion/criterion.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "eng.h"
#include "pie_testeng.h"
#include "pie_testutil.h"
#include "wrk_numa.h"

#define PAGE  PIE_TESTWORK_PAGE
#define PAGES PIE_TESTWORK_PAGES /* of small-f32 (4 layers): pie_testwork_opts */

TestSuite(eng_offload, .fini = pie_test_leak_check);

/* ---- engines ------------------------------------------------------------------------------ */

typedef struct off_setup {
    uint32_t device_pages; /* 0: policy gpu */
    bool (*pick)(void *user, uint32_t item, const struct eng_forward_item *it);
    void *pick_user;
    uint32_t swap_slots;
    int numa_node; /* the host region's NUMA node; 0 with numa_bind false: none */
    bool numa_bind;
    eng_kv_dtype kv_dtype;
} off_setup;

static pie_code open_off(const off_setup *s, eng **out, pie_status *st) {
    char dir[512];
    eng_opts o = pie_testwork_opts(dir, sizeof dir);
    o.swap_slots = s->swap_slots;
    o.swap_host_bytes = s->swap_slots ? 1u << 24 : 0;
    o.offload_device_pages = s->device_pages;
    o.offload_host_threads = 2;
    o.offload_pick = s->pick;
    o.offload_pick_user = s->pick_user;
    o.host_numa_bind = s->numa_bind;
    o.host_numa_node = s->numa_node;
    o.kv_dtype = s->kv_dtype;
    return eng_open(&o, out, st);
}

static eng *open_ok(const off_setup *s) {
    pie_status st = {0};
    eng *e = NULL;
    cr_assert_eq(open_off(s, &e, &st), PIE_OK, "eng_open: %s", st.msg);
    return e;
}

/* ---- the workload ------------------------------------------------------------------------- */

/* What one run produced: the workload's outputs and the offload stats after its last step. */
typedef struct run_out {
    pie_testwork_out o;
    uint64_t host_items, to_host, to_device; /* offload stats after the last step */
    uint32_t written;                        /* pages written and not cleared, on either region */
} run_out;

static void note_host(eng *e, uint32_t step, void *user) {
    (void)step;
    run_out *r = user;
    eng_offload_stats s;
    eng_offload_get_stats(e, &s);
    r->host_items = s.host_items;
    r->to_host = s.pages_to_host;
    r->to_device = s.pages_to_device;
    r->written = s.pages_on_host + s.pages_on_device;
}

/* The workload with the fork (16 outputs; tests/support/pie_testeng.h). */
static void workload(eng *e, run_out *r) { pie_testwork_run(e, &r->o, true, note_host, r); }

static run_out run(const off_setup *s) {
    eng *e = open_ok(s);
    run_out r = {0};
    pie_testwork_out_init(&r.o, e);
    workload(e, &r);
    eng_close(e);
    return r;
}

static void assert_identical(const run_out *a, const run_out *ref, const char *what) {
    uint32_t bad = pie_testwork_n_differing(&a->o, &ref->o);
    cr_assert_eq(bad, 0, "%s: %u of %u outputs differ from policy gpu", what, bad, ref->o.n);
}

static bool pick_all(void *user, uint32_t item, const struct eng_forward_item *it) {
    (void)user, (void)item, (void)it;
    return true;
}

/* every other call says yes: a decode goes to the host, comes back, goes again */
static bool pick_alternate(void *user, uint32_t item, const struct eng_forward_item *it) {
    (void)item, (void)it;
    uint32_t *calls = user;
    return (*calls)++ % 2 == 0;
}

/* ---- tests -------------------------------------------------------------------------------- */

Test(eng_offload, outputs_equal_policy_gpu_when_every_decode_attends_on_the_host) {
    off_setup gpu = {0};
    run_out ref = run(&gpu);
    cr_assert_eq(ref.o.n, 16);
    cr_assert_eq(ref.host_items, 0);
    off_setup all = {.device_pages = 8, .pick = pick_all};
    run_out r = run(&all);
    assert_identical(&r, &ref, "every decode on the host");
    /* A 0-2, B 3-4, C 5, D 6 (7 cleared, not rewritten), B's copy 8-9, the fork's 10 */
    cr_assert_eq(r.written, 10, "written pages counted on the two regions: %u", r.written);
    /* 3 + 3 + 1 + 1 + 4 decodes, A's and the fork's last decode share a page: both go */
    cr_assert_geq(r.host_items, 12, "decode items attended on the host: %llu",
                  (unsigned long long)r.host_items);
    cr_assert_gt(r.to_host, 0);
    free(r.o.logits);
    free(ref.o.logits);
}

Test(eng_offload, a_bf16_kv_pool_moves_and_copies_half_the_bytes_with_the_same_outputs) {
    off_setup gpu = {.kv_dtype = ENG_KV_BF16}, gpu32 = {0};
    run_out ref = run(&gpu), ref32 = run(&gpu32);
    /* the pool's dtype took effect: the outputs moved, but not far (test_eng bounds it) */
    cr_assert_gt(pie_testwork_n_differing(&ref.o, &ref32.o), 0);
    off_setup all = {.device_pages = 8, .pick = pick_all, .kv_dtype = ENG_KV_BF16};
    run_out r = run(&all);
    assert_identical(&r, &ref, "bf16 KV, every decode on the host");
    cr_assert_geq(r.host_items, 12);
    uint32_t calls = 0;
    off_setup alt = {
        .device_pages = 8, .pick = pick_alternate, .pick_user = &calls, .kv_dtype = ENG_KV_BF16};
    run_out r2 = run(&alt);
    assert_identical(&r2, &ref, "bf16 KV, decodes moving back and forth");
    cr_assert_gt(r2.to_device, 0);
    free(r.o.logits);
    free(r2.o.logits);
    free(ref.o.logits);
    free(ref32.o.logits);
}

Test(eng_offload, outputs_equal_policy_gpu_when_decodes_move_back_and_forth) {
    off_setup gpu = {0};
    run_out ref = run(&gpu);
    uint32_t calls = 0;
    off_setup alt = {.device_pages = 8, .pick = pick_alternate, .pick_user = &calls};
    run_out r = run(&alt);
    assert_identical(&r, &ref, "decodes alternating between the regions");
    cr_assert_eq(r.written, 10, "written pages counted on the two regions: %u", r.written);
    cr_assert_gt(r.host_items, 0);
    cr_assert_gt(r.to_host, 0);
    cr_assert_gt(r.to_device, 0, "pages came back to the device");
    free(r.o.logits);
    free(ref.o.logits);
}

Test(eng_offload, the_scheduler_offloads_what_a_small_device_cannot_hold_with_the_same_outputs) {
    off_setup gpu = {0};
    run_out ref = run(&gpu);
    off_setup small = {.device_pages = 2}; /* 32 tokens for the decodes: A alone is more */
    eng *e = open_ok(&small);
    run_out r = {0};
    pie_testwork_out_init(&r.o, e);
    workload(e, &r);
    eng_offload_stats s;
    eng_offload_get_stats(e, &s);
    eng_close(e);
    assert_identical(&r, &ref, "the load-aware scheduler, 2 device pages");
    cr_assert_gt(s.forced_steps, 0, "the device could not hold the decodes' KV");
    cr_assert_gt(s.host_items, 0);
    cr_assert_gt(s.lin_tok, 0.0, "the cost model was profiled at open");
    cr_assert_gt(s.hattn_kv, 0.0);
    cr_assert_eq(s.device_pages, 2);
    free(r.o.logits);
    free(ref.o.logits);
}

/* Sequence A: tokens 5.. at positions 0..19 in slots 0..19 (slot 20 holds the next one),
 * prefilled into pages[0] and pages[1] (20 tokens: the second page holds 4). */
static void prefill_a(eng *e, const uint32_t pages[2]) {
    uint32_t slots[21], toks[21], pos[21];
    for (uint32_t i = 0; i < 21; i++) slots[i] = i, toks[i] = 5 + i, pos[i] = i;
    pie_status st = {0};
    cr_assert_eq(eng_embed_text(e, slots, toks, pos, 21, &st), PIE_OK, "%s", st.msg);
    eng_forward_item pre = {.kv_pages = pages,
                            .n_kv_pages = 2,
                            .kv_last_page_len = 4,
                            .append_kv = true,
                            .in_slots = slots,
                            .n_in = 20};
    cr_assert_eq(eng_forward(e, &pre, 1, &st), PIE_OK, "%s", st.msg);
}

Test(eng_offload, a_page_shared_with_a_device_item_keeps_the_decode_on_the_device) {
    /* A's decode is asked to go to the host, the fork's (same first page) is not: both attend
     * on the device, nothing moves */
    uint32_t calls = 0;
    off_setup alt = {.device_pages = 8, .pick = pick_alternate, .pick_user = &calls};
    eng *e = open_ok(&alt);
    uint32_t pa[] = {0, 1}, pf[] = {0, 2};
    prefill_a(e, pa);
    pie_status st = {0};
    uint32_t fin = 20, ain = 20, fo = 30, ao = 31;
    uint32_t fpos[] = {17}, ftok[] = {5};
    cr_assert_eq(eng_embed_text(e, &fin, ftok, fpos, 1, &st), PIE_OK, "%s", st.msg);
    eng_forward_item two[2] = {{.kv_pages = pa,
                                .n_kv_pages = 2,
                                .kv_last_page_len = 5,
                                .append_kv = true,
                                .in_slots = &ain,
                                .n_in = 1,
                                .out_slots = &ao,
                                .n_out = 1},
                               {.kv_pages = pf,
                                .n_kv_pages = 2,
                                .kv_last_page_len = 2,
                                .append_kv = true,
                                .in_slots = &fin,
                                .n_in = 1,
                                .out_slots = &fo,
                                .n_out = 1}};
    cr_assert_eq(eng_forward(e, two, 2, &st), PIE_OK, "%s", st.msg);
    eng_offload_stats s;
    eng_offload_get_stats(e, &s);
    cr_assert_eq(calls, 2, "both decodes were offered");
    cr_assert_eq(s.last_host_items, 0, "the shared page kept A on the device");
    cr_assert_eq(s.pages_to_host, 0);
    eng_close(e);
}

/* The worker's frees (eng_pages_freed): a freed page stops counting as the device's, ids never
 * written or out of range change nothing. */
Test(eng_offload, freed_pages_stop_counting_against_the_device) {
    off_setup s8 = {.device_pages = 8};
    eng *e = open_ok(&s8);
    const uint32_t pa[] = {0, 1};
    prefill_a(e, pa);
    eng_offload_stats s;
    eng_offload_get_stats(e, &s);
    cr_assert_eq(s.pages_on_device, 2);
    const uint32_t freed[] = {1, 7, 1u << 30};
    eng_pages_freed(e, freed, 3);
    eng_offload_get_stats(e, &s);
    cr_assert_eq(s.pages_on_device, 1, "page 1 was freed: %u pages count", s.pages_on_device);
    eng_close(e);
}

Test(eng_offload, is_refused_with_swap_and_beyond_the_page_ids) {
    pie_status st = {0};
    eng *e = NULL;
    off_setup both = {.device_pages = 8, .swap_slots = 2};
    cr_assert_eq(open_off(&both, &e, &st), PIE_INVALID_ARGUMENT);
    cr_assert(strstr(st.msg, "exclude each other"), "%s", st.msg);
    cr_assert_null(e);
    off_setup big = {.device_pages = PAGES + 1};
    cr_assert_eq(open_off(&big, &e, &st), PIE_INVALID_ARGUMENT);
    cr_assert(strstr(st.msg, "exceeds kv_pages"), "%s", st.msg);
    /* the host region on a NUMA node the machine lacks (memory.host_numa_node): refused */
    off_setup far = {.device_pages = 8, .numa_bind = true, .numa_node = wrk_numa_nodes()};
    if (far.numa_node < WRK_NUMA_MAX_NODES) {
        cr_assert_eq(open_off(&far, &e, &st), PIE_UNAVAILABLE);
        cr_assert(strstr(st.msg, "cannot bind offload's host KV region"), "%s", st.msg);
        cr_assert_null(e);
    }
    off_setup near = {.device_pages = 8, .numa_bind = true, .numa_node = wrk_numa_nodes() - 1};
    e = open_ok(&near);
    eng_close(e);
}
