/* test_eng_offload.c — CPU attention offload on the cpu engine (issue 13; Neo, seed 004;
 * services/worker/engine/eng_cpu_offload.c, services/worker/mem/wrk_offload.h): decode items
 * whose pages all live in the "host" region attend on a host attention pool while the engine's
 * pool runs the rest, both with the whole call's attention plan.
 *
 * The promise tested: offload changes where K/V live and which threads read them, never what
 * is computed. test_eng_swap's mixed workload (prefill, decode, a non-appending item with a
 * tree mask, page masks, page copies, clear_pages of a reused page) plus a fork sharing a page
 * with its parent runs on policy gpu and under offload — every decode on the host, decodes
 * alternating between the regions, and the load-aware scheduler with a device too small for
 * the decodes' KV — and every output's logits and distribution must be BIT-identical.
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
#include "pie_testutil.h"

#define PAGE    16
#define PAGES   24
#define SLOTS   256
#define THREADS 2
#define MODEL   "small-f32" /* 4 layers */
#define N_OUT   20          /* outputs the workload records */

TestSuite(eng_offload, .fini = pie_test_leak_check);

/* ---- engines ------------------------------------------------------------------------------ */

typedef struct off_setup {
    uint32_t device_pages; /* 0: policy gpu */
    bool (*pick)(void *user, uint32_t item, const struct eng_forward_item *it);
    void *pick_user;
    uint32_t swap_slots;
} off_setup;

static pie_code open_off(const off_setup *s, eng **out, pie_status *st) {
    char dir[512];
    int k = snprintf(dir, sizeof dir, "%s/%s", PIE_MODELS_DIR, MODEL);
    cr_assert(k > 0 && (size_t)k < sizeof dir);
    eng_opts o = {.model_dir = dir,
                  .kv_page_size = PAGE,
                  .kv_pages = PAGES,
                  .embed_slots = SLOTS,
                  .max_batch_tokens = 128,
                  .n_threads = THREADS,
                  .swap_slots = s->swap_slots,
                  .swap_host_bytes = s->swap_slots ? 1u << 24 : 0,
                  .offload_device_pages = s->device_pages,
                  .offload_host_threads = 2,
                  .offload_pick = s->pick,
                  .offload_pick_user = s->pick_user};
    return eng_open(&o, out, st);
}

static eng *open_ok(const off_setup *s) {
    pie_status st = {0};
    eng *e = NULL;
    cr_assert_eq(open_off(s, &e, &st), PIE_OK, "eng_open: %s", st.msg);
    return e;
}

/* ---- the workload ------------------------------------------------------------------------- */

/* What one run produced: the logits and top-8 distribution of every recorded output. */
typedef struct run_out {
    uint32_t vocab;
    float *logits; /* [N_OUT][vocab] */
    uint32_t ids[N_OUT][8];
    float probs[N_OUT][8];
    uint32_t n;
    uint64_t host_items, to_host, to_device; /* offload stats after the last step */
    uint32_t written; /* pages written and not cleared, on either region */
} run_out;

/* Called between steps with the step's number (changes the slot count in one test). */
typedef void (*step_hook)(eng *e, uint32_t step);

static uint32_t tok(uint32_t seq, uint32_t i) { return (seq * 7919u + i * 104729u + 13u) % 2048u; }

static void embed(eng *e, uint32_t slot0, uint32_t seq, uint32_t from, uint32_t n) {
    uint32_t slots[128], toks[128], pos[128];
    cr_assert(n <= 128);
    for (uint32_t i = 0; i < n; i++)
        slots[i] = slot0 + i, toks[i] = tok(seq, from + i), pos[i] = from + i;
    pie_status st = {0};
    cr_assert_eq(eng_embed_text(e, slots, toks, pos, n, &st), PIE_OK, "embed: %s", st.msg);
}

static const uint32_t *range(uint32_t *buf, uint32_t first, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) buf[i] = first + i;
    return buf;
}

static eng_forward_item item(const uint32_t *pages, uint32_t seq_len, bool append,
                             const uint32_t *in, uint32_t n_in, const uint32_t *out,
                             uint32_t n_out) {
    return (eng_forward_item){.kv_pages = pages,
                              .n_kv_pages = (seq_len + PAGE - 1) / PAGE,
                              .kv_last_page_len = seq_len ? (seq_len - 1) % PAGE + 1 : 0,
                              .append_kv = append,
                              .in_slots = in,
                              .n_in = n_in,
                              .out_slots = out,
                              .n_out = n_out};
}

static pie_code forward(eng *e, const eng_forward_item *items, uint32_t n, pie_status *st) {
    return eng_forward(e, items, n, st);
}

static void forward_ok(eng *e, const eng_forward_item *items, uint32_t n) {
    pie_status st = {0};
    cr_assert_eq(forward(e, items, n, &st), PIE_OK, "forward: %s", st.msg);
}

/* Records slot's logits and top-8 distribution as output r->n. */
static void record(eng *e, run_out *r, uint32_t slot) {
    cr_assert(r->n < N_OUT);
    pie_status st = {0};
    cr_assert_eq(eng_logits(e, slot, r->logits + (size_t)r->n * r->vocab, &st), PIE_OK, "%s",
                 st.msg);
    eng_dist_item d = {.slot = slot,
                       .top_k = 8,
                       .temperature = 1.0f,
                       .ids = r->ids[r->n],
                       .probs = r->probs[r->n]};
    cr_assert_eq(eng_next_dist(e, &d, 1, &st), PIE_OK, "%s", st.msg);
    r->n++;
}

static void note_host(eng *e, run_out *r) {
    eng_offload_stats s;
    eng_offload_get_stats(e, &s);
    r->host_items = s.host_items;
    r->to_host = s.pages_to_host;
    r->to_device = s.pages_to_device;
    r->written = s.pages_on_host + s.pages_on_device;
}

/* Sequence A in pages 0-2, B in 3-4, C in 5; decode steps; a batch of all; masks and copies;
 * page 6 reused after clear_pages. */
static void workload(eng *e, run_out *r, step_hook hook) {
    uint32_t pa[] = {0, 1, 2}, pb[] = {3, 4}, pc[] = {5}, pd[] = {6, 7}, s[4][64];
    uint32_t step = 0;
    pie_status st = {0};
#define STEP()                   \
    do {                         \
        note_host(e, r);         \
        if (hook) hook(e, step); \
        step++;                  \
    } while (0)
    /* prefill A (30 tokens) and B (20), one batch */
    embed(e, 0, 1, 0, 30);
    embed(e, 40, 2, 0, 20);
    uint32_t oa = 100, ob = 101;
    eng_forward_item pre[2] = {item(pa, 30, true, range(s[0], 0, 30), 30, &oa, 1),
                               item(pb, 20, true, range(s[1], 40, 20), 20, &ob, 1)};
    forward_ok(e, pre, 2);
    record(e, r, 100);
    record(e, r, 101);
    STEP();
    /* three decode steps of A and B together */
    for (uint32_t t = 0; t < 3; t++) {
        embed(e, 60, 1, 30 + t, 1);
        embed(e, 61, 2, 20 + t, 1);
        uint32_t ia = 60, ib = 61, o1 = 102, o2 = 103;
        eng_forward_item dec[2] = {item(pa, 31 + t, true, &ia, 1, &o1, 1),
                                   item(pb, 21 + t, true, &ib, 1, &o2, 1)};
        forward_ok(e, dec, 2);
        STEP();
    }
    record(e, r, 102);
    record(e, r, 103);
    /* C: prefill 9 tokens; then a mixed batch: A decodes, C runs 3 drafted tokens as a tree
     * without appending, a new prompt D prefills into pages 6-7 */
    embed(e, 70, 3, 0, 9);
    uint32_t oc = 104;
    eng_forward_item pc9 = item(pc, 9, true, range(s[2], 70, 9), 9, &oc, 1);
    forward_ok(e, &pc9, 1);
    STEP();
    embed(e, 80, 1, 33, 1);
    embed(e, 81, 3, 9, 3);
    embed(e, 150, 4, 0, 18);
    uint32_t ia = 80, oa2 = 105, ocs[] = {106, 107, 108}, od = 109, tree[] = {10, 11, 10, 1, 1};
    eng_forward_item mixed[3] = {item(pa, 34, true, &ia, 1, &oa2, 1),
                                 item(pc, 9, false, range(s[3], 81, 3), 3, ocs, 3),
                                 item(pd, 18, true, range(s[0], 150, 18), 18, &od, 1)};
    mixed[1].mask_runs = tree, mixed[1].n_mask_runs = 5;
    forward_ok(e, mixed, 3);
    for (uint32_t i = 105; i <= 109; i++) record(e, r, i);
    STEP();
    /* mask two tokens of A's first page, copy B's pages over pages 8-9, and read both */
    bool m[PAGE] = {0};
    m[3] = m[11] = true;
    cr_assert_eq(eng_mask_page(e, 0, m, &st), PIE_OK, "%s", st.msg);
    eng_copy_item cp[] = {{3, 8, 0, 0, 16}, {4, 9, 0, 0, 7}};
    cr_assert_eq(eng_copy_pages(e, cp, 2, &st), PIE_OK, "%s", st.msg);
    STEP();
    uint32_t pcopy[] = {8, 9};
    embed(e, 62, 1, 34, 1);
    embed(e, 63, 2, 23, 1);
    uint32_t i1 = 62, i2 = 63, o1 = 110, o2 = 111;
    eng_forward_item rd[2] = {item(pa, 35, true, &i1, 1, &o1, 1),
                              item(pcopy, 24, true, &i2, 1, &o2, 1)};
    forward_ok(e, rd, 2);
    record(e, r, 110);
    record(e, r, 111);
    STEP();
    /* page 6 and 7 freed and reused by a new sequence (cleared as the worker does) */
    uint32_t reuse[] = {6, 7};
    cr_assert_eq(eng_clear_pages(e, reuse, 2, &st), PIE_OK, "%s", st.msg);
    embed(e, 0, 5, 0, 12);
    uint32_t oe = 112;
    eng_forward_item pe = item(pd, 12, true, range(s[0], 0, 12), 12, &oe, 1);
    forward_ok(e, &pe, 1);
    record(e, r, 112);
    STEP();
    for (uint32_t t = 0; t < 4; t++) { /* decode B's copy alone */
        embed(e, 64, 2, 24 + t, 1);
        uint32_t in = 64, o = 113;
        eng_forward_item dec = item(pcopy, 25 + t, true, &in, 1, &o, 1);
        forward_ok(e, &dec, 1);
        STEP();
    }
    record(e, r, 113);
    /* a fork of A sharing A's first page (16 tokens) and its own page 10: its prefill of 4
     * tokens, then A and the fork decode in one batch (they read the same page) */
    uint32_t pf[] = {0, 10};
    embed(e, 90, 6, 16, 4);
    uint32_t of = 114;
    eng_forward_item fpre = item(pf, 20, true, range(s[0], 90, 4), 4, &of, 1);
    forward_ok(e, &fpre, 1);
    STEP();
    embed(e, 94, 6, 20, 1);
    embed(e, 95, 1, 35, 1);
    uint32_t fi = 94, ai = 95, fo = 115, ao = 116;
    eng_forward_item both[2] = {item(pf, 21, true, &fi, 1, &fo, 1),
                                item(pa, 36, true, &ai, 1, &ao, 1)};
    forward_ok(e, both, 2);
    record(e, r, 114);
    record(e, r, 115);
    record(e, r, 116);
    STEP();
#undef STEP
}

static run_out run(const off_setup *s) {
    eng *e = open_ok(s);
    run_out r = {.vocab = eng_get_info(e)->vocab_size};
    r.logits = calloc((size_t)N_OUT * r.vocab, sizeof *r.logits);
    cr_assert_not_null(r.logits);
    workload(e, &r, NULL);
    eng_close(e);
    return r;
}

static void assert_identical(const run_out *a, const run_out *ref, const char *what) {
    cr_assert_eq(a->n, ref->n);
    uint32_t bad = 0;
    for (uint32_t i = 0; i < a->n; i++) {
        bool same = memcmp(a->logits + (size_t)i * a->vocab, ref->logits + (size_t)i * a->vocab,
                           a->vocab * sizeof(float)) == 0 &&
                    memcmp(a->ids[i], ref->ids[i], sizeof a->ids[i]) == 0 &&
                    memcmp(a->probs[i], ref->probs[i], sizeof a->probs[i]) == 0;
        bad += !same;
    }
    cr_assert_eq(bad, 0, "%s: %u of %u outputs differ from policy gpu", what, bad, ref->n);
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
    cr_assert_eq(ref.n, 16);
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
    free(r.logits);
    free(ref.logits);
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
    free(r.logits);
    free(ref.logits);
}

Test(eng_offload, the_scheduler_offloads_what_a_small_device_cannot_hold_with_the_same_outputs) {
    off_setup gpu = {0};
    run_out ref = run(&gpu);
    off_setup small = {.device_pages = 2}; /* 32 tokens for the decodes: A alone is more */
    eng *e = open_ok(&small);
    run_out r = {.vocab = eng_get_info(e)->vocab_size};
    r.logits = calloc((size_t)N_OUT * r.vocab, sizeof *r.logits);
    cr_assert_not_null(r.logits);
    workload(e, &r, NULL);
    eng_offload_stats s;
    eng_offload_get_stats(e, &s);
    eng_close(e);
    assert_identical(&r, &ref, "the load-aware scheduler, 2 device pages");
    cr_assert_gt(s.forced_steps, 0, "the device could not hold the decodes' KV");
    cr_assert_gt(s.host_items, 0);
    cr_assert_gt(s.lin_tok, 0.0, "the cost model was profiled at open");
    cr_assert_gt(s.hattn_kv, 0.0);
    cr_assert_eq(s.device_pages, 2);
    free(r.logits);
    free(ref.logits);
}

Test(eng_offload, a_page_shared_with_a_device_item_keeps_the_decode_on_the_device) {
    /* A's decode is asked to go to the host, the fork's (same first page) is not: both attend
     * on the device, nothing moves */
    uint32_t calls = 0;
    off_setup alt = {.device_pages = 8, .pick = pick_alternate, .pick_user = &calls};
    eng *e = open_ok(&alt);
    uint32_t slots[21], toks[21], pos[21], pa[] = {0, 1}, pf[] = {0, 2};
    for (uint32_t i = 0; i < 21; i++) slots[i] = i, toks[i] = 5 + i, pos[i] = i;
    pie_status st = {0};
    cr_assert_eq(eng_embed_text(e, slots, toks, pos, 21, &st), PIE_OK, "%s", st.msg);
    eng_forward_item pre = {.kv_pages = pa, .n_kv_pages = 2, .kv_last_page_len = 4,
                            .append_kv = true, .in_slots = slots, .n_in = 20};
    cr_assert_eq(eng_forward(e, &pre, 1, &st), PIE_OK, "%s", st.msg);
    uint32_t fin = 20, ain = 20, fo = 30, ao = 31;
    uint32_t fpos[] = {17};
    cr_assert_eq(eng_embed_text(e, &fin, toks, fpos, 1, &st), PIE_OK, "%s", st.msg);
    eng_forward_item two[2] = {
        {.kv_pages = pa, .n_kv_pages = 2, .kv_last_page_len = 5, .append_kv = true,
         .in_slots = &ain, .n_in = 1, .out_slots = &ao, .n_out = 1},
        {.kv_pages = pf, .n_kv_pages = 2, .kv_last_page_len = 2, .append_kv = true,
         .in_slots = &fin, .n_in = 1, .out_slots = &fo, .n_out = 1}};
    cr_assert_eq(eng_forward(e, two, 2, &st), PIE_OK, "%s", st.msg);
    eng_offload_stats s;
    eng_offload_get_stats(e, &s);
    cr_assert_eq(calls, 2, "both decodes were offered");
    cr_assert_eq(s.last_host_items, 0, "the shared page kept A on the device");
    cr_assert_eq(s.pages_to_host, 0);
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
}
