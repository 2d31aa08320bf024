/* pie_testeng.c — see pie_testeng.h. */
#include "pie_testeng.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PAGE PIE_TESTWORK_PAGE

eng_forward_item pie_test_item(uint32_t page_size, const uint32_t *pages, uint32_t seq_len,
                               bool append, const uint32_t *in, uint32_t n_in, const uint32_t *out,
                               uint32_t n_out) {
    return (eng_forward_item){.kv_pages = pages,
                              .n_kv_pages = (seq_len + page_size - 1) / page_size,
                              .kv_last_page_len = seq_len ? (seq_len - 1) % page_size + 1 : 0,
                              .append_kv = append,
                              .in_slots = in,
                              .n_in = n_in,
                              .out_slots = out,
                              .n_out = n_out};
}

const uint32_t *pie_test_range(uint32_t *buf, uint32_t first, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) buf[i] = first + i;
    return buf;
}

void pie_test_forward_ok(eng *e, const eng_forward_item *items, uint32_t n) {
    pie_status st = {0};
    cr_assert_eq(eng_forward(e, items, n, &st), PIE_OK, "forward: %s", st.msg);
}

/* ---- the mixed workload -------------------------------------------------------------------- */

eng_opts pie_testwork_opts(char *dir, size_t cap) {
    int k = snprintf(dir, cap, "%s/%s", PIE_MODELS_DIR, PIE_TESTWORK_MODEL);
    cr_assert(k > 0 && (size_t)k < cap);
    return (eng_opts){.model_dir = dir,
                      .kv_page_size = PIE_TESTWORK_PAGE,
                      .kv_pages = PIE_TESTWORK_PAGES,
                      .embed_slots = 256,
                      .max_batch_tokens = 128,
                      .n_threads = 2};
}

void pie_testwork_out_init(pie_testwork_out *r, eng *e) {
    memset(r, 0, sizeof *r);
    r->vocab = eng_get_info(e)->vocab_size;
    r->logits = calloc((size_t)PIE_TESTWORK_MAX_OUT * r->vocab, sizeof *r->logits);
    cr_assert_not_null(r->logits);
}

static uint32_t tok(uint32_t seq, uint32_t i) { return (seq * 7919u + i * 104729u + 13u) % 2048u; }

void pie_testwork_embed(eng *e, uint32_t slot0, uint32_t seq, uint32_t from, uint32_t n) {
    uint32_t slots[128], toks[128], pos[128];
    cr_assert(n <= 128);
    for (uint32_t i = 0; i < n; i++)
        slots[i] = slot0 + i, toks[i] = tok(seq, from + i), pos[i] = from + i;
    pie_status st = {0};
    cr_assert_eq(eng_embed_text(e, slots, toks, pos, n, &st), PIE_OK, "embed: %s", st.msg);
}

void pie_testwork_record(eng *e, pie_testwork_out *r, uint32_t slot) {
    cr_assert(r->n < PIE_TESTWORK_MAX_OUT);
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

static eng_forward_item item(const uint32_t *pages, uint32_t seq_len, bool append,
                             const uint32_t *in, uint32_t n_in, const uint32_t *out,
                             uint32_t n_out) {
    return pie_test_item(PAGE, pages, seq_len, append, in, n_in, out, n_out);
}

void pie_testwork_run(eng *e, pie_testwork_out *r, bool fork, pie_testwork_step_fn step_fn,
                      void *user) {
    uint32_t pa[] = {0, 1, 2}, pb[] = {3, 4}, pc[] = {5}, pd[] = {6, 7}, s[4][64];
    uint32_t step = 0;
    pie_status st = {0};
#define STEP()                               \
    do {                                     \
        if (step_fn) step_fn(e, step, user); \
        step++;                              \
    } while (0)
    /* prefill A (30 tokens) and B (20), one batch */
    pie_testwork_embed(e, 0, 1, 0, 30);
    pie_testwork_embed(e, 40, 2, 0, 20);
    uint32_t oa = 100, ob = 101;
    eng_forward_item pre[2] = {item(pa, 30, true, pie_test_range(s[0], 0, 30), 30, &oa, 1),
                               item(pb, 20, true, pie_test_range(s[1], 40, 20), 20, &ob, 1)};
    pie_test_forward_ok(e, pre, 2);
    pie_testwork_record(e, r, 100);
    pie_testwork_record(e, r, 101);
    STEP();
    /* three decode steps of A and B together */
    for (uint32_t t = 0; t < 3; t++) {
        pie_testwork_embed(e, 60, 1, 30 + t, 1);
        pie_testwork_embed(e, 61, 2, 20 + t, 1);
        uint32_t ia = 60, ib = 61, o1 = 102, o2 = 103;
        eng_forward_item dec[2] = {item(pa, 31 + t, true, &ia, 1, &o1, 1),
                                   item(pb, 21 + t, true, &ib, 1, &o2, 1)};
        pie_test_forward_ok(e, dec, 2);
        STEP();
    }
    pie_testwork_record(e, r, 102);
    pie_testwork_record(e, r, 103);
    /* C: prefill 9 tokens; then a mixed batch: A decodes, C runs 3 drafted tokens as a tree
     * without appending, a new prompt D prefills into pages 6-7 */
    pie_testwork_embed(e, 70, 3, 0, 9);
    uint32_t oc = 104;
    eng_forward_item pc9 = item(pc, 9, true, pie_test_range(s[2], 70, 9), 9, &oc, 1);
    pie_test_forward_ok(e, &pc9, 1);
    STEP();
    pie_testwork_embed(e, 80, 1, 33, 1);
    pie_testwork_embed(e, 81, 3, 9, 3);
    pie_testwork_embed(e, 150, 4, 0, 18);
    uint32_t ia = 80, oa2 = 105, ocs[] = {106, 107, 108}, od = 109, tree[] = {10, 11, 10, 1, 1};
    eng_forward_item mixed[3] = {item(pa, 34, true, &ia, 1, &oa2, 1),
                                 item(pc, 9, false, pie_test_range(s[3], 81, 3), 3, ocs, 3),
                                 item(pd, 18, true, pie_test_range(s[0], 150, 18), 18, &od, 1)};
    mixed[1].mask_runs = tree, mixed[1].n_mask_runs = 5;
    pie_test_forward_ok(e, mixed, 3);
    for (uint32_t i = 105; i <= 109; i++) pie_testwork_record(e, r, i);
    STEP();
    /* mask two tokens of A's first page, copy B's pages over pages 8-9, and read both */
    bool m[PAGE] = {0};
    m[3] = m[11] = true;
    cr_assert_eq(eng_mask_page(e, 0, m, &st), PIE_OK, "%s", st.msg);
    eng_copy_item cp[] = {{3, 8, 0, 0, 16}, {4, 9, 0, 0, 7}};
    cr_assert_eq(eng_copy_pages(e, cp, 2, &st), PIE_OK, "%s", st.msg);
    STEP();
    uint32_t pcopy[] = {8, 9};
    pie_testwork_embed(e, 62, 1, 34, 1);
    pie_testwork_embed(e, 63, 2, 23, 1);
    uint32_t i1 = 62, i2 = 63, o1 = 110, o2 = 111;
    eng_forward_item rd[2] = {item(pa, 35, true, &i1, 1, &o1, 1),
                              item(pcopy, 24, true, &i2, 1, &o2, 1)};
    pie_test_forward_ok(e, rd, 2);
    pie_testwork_record(e, r, 110);
    pie_testwork_record(e, r, 111);
    STEP();
    /* page 6 and 7 freed and reused by a new sequence (cleared as the worker does) */
    uint32_t reuse[] = {6, 7};
    cr_assert_eq(eng_clear_pages(e, reuse, 2, &st), PIE_OK, "%s", st.msg);
    pie_testwork_embed(e, 0, 5, 0, 12);
    uint32_t oe = 112;
    eng_forward_item pe = item(pd, 12, true, pie_test_range(s[0], 0, 12), 12, &oe, 1);
    pie_test_forward_ok(e, &pe, 1);
    pie_testwork_record(e, r, 112);
    STEP();
    for (uint32_t t = 0; t < 4; t++) { /* decode B's copy alone */
        pie_testwork_embed(e, 64, 2, 24 + t, 1);
        uint32_t in = 64, o = 113;
        eng_forward_item dec = item(pcopy, 25 + t, true, &in, 1, &o, 1);
        pie_test_forward_ok(e, &dec, 1);
        STEP();
    }
    pie_testwork_record(e, r, 113);
    if (fork) {
        /* a fork of A sharing A's first page (16 tokens) and its own page 10: its prefill of 4
         * tokens, then A and the fork decode in one batch (they read the same page) */
        uint32_t pf[] = {0, 10};
        pie_testwork_embed(e, 90, 6, 16, 4);
        uint32_t of = 114;
        eng_forward_item fpre = item(pf, 20, true, pie_test_range(s[0], 90, 4), 4, &of, 1);
        pie_test_forward_ok(e, &fpre, 1);
        STEP();
        pie_testwork_embed(e, 94, 6, 20, 1);
        pie_testwork_embed(e, 95, 1, 35, 1);
        uint32_t fi = 94, ai = 95, fo = 115, ao = 116;
        eng_forward_item both[2] = {item(pf, 21, true, &fi, 1, &fo, 1),
                                    item(pa, 36, true, &ai, 1, &ao, 1)};
        pie_test_forward_ok(e, both, 2);
        pie_testwork_record(e, r, 114);
        pie_testwork_record(e, r, 115);
        pie_testwork_record(e, r, 116);
        STEP();
    }
#undef STEP
}

uint32_t pie_testwork_n_differing(const pie_testwork_out *a, const pie_testwork_out *ref) {
    cr_assert_eq(a->n, ref->n);
    uint32_t bad = 0;
    for (uint32_t i = 0; i < a->n; i++) {
        bool same = memcmp(a->logits + (size_t)i * a->vocab, ref->logits + (size_t)i * a->vocab,
                           a->vocab * sizeof(float)) == 0 &&
                    memcmp(a->ids[i], ref->ids[i], sizeof a->ids[i]) == 0 &&
                    memcmp(a->probs[i], ref->probs[i], sizeof a->probs[i]) == 0;
        bad += !same;
    }
    return bad;
}
