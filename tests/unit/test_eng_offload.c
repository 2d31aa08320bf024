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
    double host_attn_s; /* the scheduler's host attention cost, pinned (0: profiled) */
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
    o.offload_host_attn_s = s->host_attn_s;
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

/* ---- deferral (eng_forward_plan / eng_forward_skip) --------------------------------------- */

/* The same batch on two engines: under test (e) and policy gpu (ref), which must agree. */
static void embed_both(eng *e, eng *ref, uint32_t slot, uint32_t tok, uint32_t pos) {
    pie_status st = {0};
    cr_assert_eq(eng_embed_text(e, &slot, &tok, &pos, 1, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(eng_embed_text(ref, &slot, &tok, &pos, 1, &st), PIE_OK, "%s", st.msg);
}

static void forward_both(eng *e, eng *ref, const eng_forward_item *items, uint32_t n) {
    pie_test_forward_ok(e, items, n);
    pie_test_forward_ok(ref, items, n);
}

/* The logits of slot are bit for bit the same on both engines. */
static void same_logits(eng *e, eng *ref, uint32_t slot, const char *what) {
    uint32_t V = eng_get_info(e)->vocab_size;
    float *a = calloc(V, sizeof *a), *b = calloc(V, sizeof *b);
    cr_assert(a && b);
    pie_status st = {0};
    cr_assert_eq(eng_logits(e, slot, a, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(eng_logits(ref, slot, b, &st), PIE_OK, "%s", st.msg);
    cr_assert(memcmp(a, b, V * sizeof *a) == 0,
              "%s: the logits of slot %u differ from policy gpu's", what, slot);
    free(a);
    free(b);
}

/* The prompts of two sequences, 20 tokens each at positions 0-19, embedded on both engines:
 * A's (tokens 5-24) into slots 0-19, B's (tokens 300-319) into slots 40-59; sa, sb <- those
 * slots, A's and B's prefill inputs. */
static void embed_two_prompts(eng *e, eng *ref, uint32_t sa[20], uint32_t sb[20]) {
    for (uint32_t i = 0; i < 20; i++) {
        embed_both(e, ref, i, 5 + i, i);
        embed_both(e, ref, 40 + i, 300 + i, i);
        sa[i] = i, sb[i] = 40 + i;
    }
}

/* A decode of a sequence of `len` tokens (the new one included) over pages p[0..1]. */
static eng_forward_item dec(const uint32_t *p, uint32_t len, const uint32_t *in,
                            const uint32_t *out) {
    return pie_test_item(PAGE, p, len, true, in, 1, out, 1);
}

/* Reading pages p[0..1] up to `len` tokens without appending: device work that writes nothing
 * (and shows what the pages hold up to there). */
static eng_forward_item probe(const uint32_t *p, uint32_t len, const uint32_t *in,
                              const uint32_t *out) {
    return pie_test_item(PAGE, p, len, false, in, 1, out, 1);
}

/* With 2 device pages and host attention pinned at a second per KV token, nothing on the host
 * hides: a decode whose KV is on the host is deferred whenever the step has device work, and
 * runs on its own, or after WRK_OFF_DEFER_MAX (8) deferrals in a row. A deferred decode writes
 * neither its K/V nor its output (probes read both against policy gpu, which never ran it);
 * what runs beside it computes what a batch of it alone computes on policy gpu. */
Test(eng_offload, a_deferred_decode_leaves_no_trace_and_runs_after_at_most_8_deferrals) {
    eng *e = open_ok(&(off_setup){.device_pages = 2, .host_attn_s = 1.0});
    eng *ref = open_ok(&(off_setup){0});
    const uint32_t pa[] = {0, 1}, pb[] = {2, 3};
    uint32_t sa[20], sb[20];
    embed_two_prompts(e, ref, sa, sb);
    eng_forward_item pre[2] = {pie_test_item(PAGE, pa, 20, true, sa, 20, NULL, 0),
                               pie_test_item(PAGE, pb, 20, true, sb, 20, NULL, 0)};
    forward_both(e, ref, pre, 2);
    /* decode 1: the device holds 32 tokens of decodes, A and B need 42: A goes to the host */
    const uint32_t a1 = 20, a1o = 21, b1 = 60, b1o = 61;
    embed_both(e, ref, a1, 25, 20);
    embed_both(e, ref, b1, 320, 20);
    eng_forward_item d1[2] = {dec(pa, 21, &a1, &a1o), dec(pb, 21, &b1, &b1o)};
    forward_both(e, ref, d1, 2);
    eng_offload_stats s;
    eng_offload_get_stats(e, &s);
    cr_assert_eq(s.forced_steps, 1, "A was forced to the host");
    /* decode 2: A (host) does not hide behind B's linear layers: deferred */
    const uint32_t a2 = 22, a2o = 23, b2 = 62, b2o = 63;
    embed_both(e, ref, a2, 26, 21);
    embed_both(e, ref, b2, 321, 21);
    eng_forward_item d2[2] = {dec(pa, 22, &a2, &a2o), dec(pb, 22, &b2, &b2o)};
    uint8_t defer[2] = {9, 9};
    pie_status st = {0};
    cr_assert_eq(eng_forward_plan(e, d2, 2, defer, &st), PIE_OK, "%s", st.msg);
    cr_assert(defer[0] == 1 && defer[1] == 0, "A deferred, B runs: %u %u", defer[0], defer[1]);
    cr_assert_eq(eng_forward_skip(e, d2, 2, defer, &st), PIE_OK, "%s", st.msg);
    pie_test_forward_ok(ref, &d2[1], 1); /* what ran: B alone */
    same_logits(e, ref, b2o, "B beside a deferred A");
    same_logits(e, ref, a2o, "A's output slot (never written)");
    /* A's pages up to position 21, which the deferred decode would have written */
    const uint32_t pr = 24, pro = 25;
    embed_both(e, ref, pr, 27, 22);
    eng_forward_item look = probe(pa, 23, &pr, &pro);
    forward_both(e, ref, &look, 1);
    same_logits(e, ref, pro, "a probe of A's pages");
    /* offered again alone (nothing to hide behind): it runs */
    cr_assert_eq(eng_forward_plan(e, d2, 1, defer, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(defer[0], 0, "alone, A runs");
    cr_assert_eq(eng_forward_skip(e, d2, 1, defer, &st), PIE_OK, "%s", st.msg);
    pie_test_forward_ok(ref, d2, 1);
    same_logits(e, ref, a2o, "A, run a step late");
    /* the bound: beside B's probe (device work) A is deferred 8 times, then runs */
    const uint32_t a3 = 26, a3o = 27, bp = 64, bpo = 65;
    embed_both(e, ref, a3, 28, 22);
    embed_both(e, ref, bp, 322, 22);
    eng_forward_item d3[2] = {dec(pa, 23, &a3, &a3o), probe(pb, 22, &bp, &bpo)};
    for (int k = 0; k <= 8; k++) {
        cr_assert_eq(eng_forward_plan(e, d3, 2, defer, &st), PIE_OK, "%s", st.msg);
        cr_assert_eq(defer[0], k < 8, "offer %d: A %s", k, defer[0] ? "deferred" : "runs");
        cr_assert_eq(defer[1], 0);
        cr_assert_eq(eng_forward_skip(e, d3, 2, defer, &st), PIE_OK, "%s", st.msg);
    }
    pie_test_forward_ok(ref, d3, 2); /* the 9th offer ran both, as one batch */
    same_logits(e, ref, a3o, "A after 8 deferrals");
    same_logits(e, ref, bpo, "B's probe beside it");
    eng_offload_get_stats(e, &s);
    cr_assert_eq(s.deferred, 9, "the scheduler deferred 1 + 8 times: %llu",
                 (unsigned long long)s.deferred);
    eng_close(e);
    eng_close(ref);
}

/* An item the caller skips beyond the scheduler's deferrals (a dependent) is not run either,
 * and skipping needs offload. */
Test(eng_offload, skipped_dependents_are_not_run_and_skipping_needs_offload) {
    eng *e = open_ok(&(off_setup){.device_pages = 8});
    eng *ref = open_ok(&(off_setup){0});
    const uint32_t pa[] = {0, 1}, pb[] = {2, 3};
    uint32_t sa[20], sb[20];
    embed_two_prompts(e, ref, sa, sb);
    const uint32_t ao = 30, bo = 31;
    eng_forward_item two[2] = {pie_test_item(PAGE, pa, 20, true, sa, 20, &ao, 1),
                               pie_test_item(PAGE, pb, 20, true, sb, 20, &bo, 1)};
    uint8_t defer[2], skip[2] = {0, 1};
    pie_status st = {0};
    cr_assert_eq(eng_forward_plan(e, two, 2, defer, &st), PIE_OK, "%s", st.msg);
    cr_assert(defer[0] == 0 && defer[1] == 0, "prefills are never deferred");
    cr_assert_eq(eng_forward_skip(e, two, 2, skip, &st), PIE_OK, "%s", st.msg);
    pie_test_forward_ok(ref, two, 1);
    same_logits(e, ref, ao, "A beside a skipped B");
    same_logits(e, ref, bo, "B's output slot (never written)");
    eng_offload_stats s;
    eng_offload_get_stats(e, &s);
    cr_assert_eq(s.pages_on_device + s.pages_on_host, 2, "only A's pages were written");
    /* policy gpu plans nothing and cannot skip */
    cr_assert_eq(eng_forward_plan(ref, two, 2, defer, &st), PIE_OK, "%s", st.msg);
    cr_assert(defer[0] == 0 && defer[1] == 0);
    cr_assert_eq(eng_forward_skip(ref, two, 2, skip, &st), PIE_FAILED_PRECONDITION);
    cr_assert_str_eq(st.msg, "forward: skipping items needs the offload memory policy");
    eng_close(e);
    eng_close(ref);
}
