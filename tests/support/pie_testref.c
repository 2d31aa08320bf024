/* pie_testref.c — reference next-token distributions from a fresh forward of the whole context
 * (pie_testref.h). */
#include "pie_testref.h"

#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "eng.h"

struct pie_testref {
    eng *e;
};

pie_testref *pie_testref_open(const char *model_dir) {
    pie_testref *r = calloc(1, sizeof *r);
    cr_assert(r);
    eng_opts o = {.model_dir = model_dir,
                  .kv_pages = 1, /* never used: the reference reads and writes no page */
                  .embed_slots = PIE_TESTREF_MAX_CTX,
                  .max_batch_tokens = PIE_TESTREF_MAX_CTX,
                  .n_threads = 1};
    pie_status st;
    cr_assert_eq(eng_open(&o, &r->e, &st), PIE_OK, "reference engine on %s: %s", model_dir, st.msg);
    return r;
}

void pie_testref_close(pie_testref *r) {
    if (!r) return;
    eng_close(r->e);
    free(r);
}

void pie_testref_next(pie_testref *r, const uint32_t *tokens, size_t n, uint32_t k,
                      pie_testref_dist *out) {
    cr_assert(n >= 1 && n <= PIE_TESTREF_MAX_CTX, "reference context of %zu tokens", n);
    cr_assert(k >= 1 && k <= PIE_TESTREF_MAX_K, "reference top_k %u", k);
    uint32_t slots[PIE_TESTREF_MAX_CTX], pos[PIE_TESTREF_MAX_CTX];
    for (uint32_t i = 0; i < n; i++) slots[i] = pos[i] = i;
    pie_status st;
    cr_assert_eq(eng_embed_text(r->e, slots, tokens, pos, (uint32_t)n, &st), PIE_OK, "%s", st.msg);
    uint32_t last = (uint32_t)n - 1;
    eng_forward_item it = {.n_kv_pages = 0, /* no context in pages: every token is an input */
                           .kv_last_page_len = 0,
                           .append_kv = false,
                           .in_slots = slots,
                           .n_in = (uint32_t)n,
                           .out_slots = &last,
                           .n_out = 1};
    cr_assert_eq(eng_forward(r->e, &it, 1, &st), PIE_OK, "%s", st.msg);
    eng_dist_item d = {
        .slot = last, .top_k = k, .temperature = 1.0f, .ids = out->ids, .probs = out->probs};
    cr_assert_eq(eng_next_dist(r->e, &d, 1, &st), PIE_OK, "%s", st.msg);
    out->k = k;
}

/* Whether every entry of a is matched in b (see pie_testref_same); why ← the first that is not. */
static bool covered(const pie_testref_dist *a, const char *a_name, const pie_testref_dist *b,
                    const char *b_name, float tol, char *why, size_t cap) {
    float b_min = b->probs[0];
    for (uint32_t j = 1; j < b->k; j++) b_min = fminf(b_min, b->probs[j]);
    for (uint32_t i = 0; i < a->k; i++) {
        uint32_t j = 0;
        while (j < b->k && b->ids[j] != a->ids[i]) j++;
        float other = j < b->k ? b->probs[j] : b_min;
        if (!(fabsf(a->probs[i] - other) <= tol)) {
            snprintf(why, cap, "token %u (rank %u): %s %.6f, %s %.6f%s", a->ids[i], i, a_name,
                     (double)a->probs[i], b_name, (double)other,
                     j < b->k ? "" : " (not in its top-k: its smallest)");
            return false;
        }
    }
    return true;
}

bool pie_testref_same(const pie_testref_dist *got, const pie_testref_dist *want, float tol,
                      char *why, size_t cap) {
    if (got->k != want->k || got->k == 0) {
        snprintf(why, cap, "%u candidates, the reference has %u", got->k, want->k);
        return false;
    }
    return covered(got, "got", want, "reference", tol, why, cap) &&
           covered(want, "reference", got, "got", tol, why, cap);
}

void pie_testref_expect_gen(pie_testref *r, const char *label, const uint32_t *prompt,
                            size_t n_prompt, const uint32_t *gen, const pie_testref_dist *got,
                            size_t n_gen) {
    uint32_t ctx[PIE_TESTREF_MAX_CTX];
    cr_assert_leq(n_prompt + n_gen, PIE_TESTREF_MAX_CTX, "%s: context too long", label);
    memcpy(ctx, prompt, n_prompt * sizeof *ctx);
    memcpy(ctx + n_prompt, gen, n_gen * sizeof *ctx);
    for (size_t s = 0; s < n_gen; s++) {
        pie_testref_dist want;
        pie_testref_next(r, ctx, n_prompt + s, got[s].k, &want);
        char why[256];
        cr_assert(pie_testref_same(&got[s], &want, PIE_TESTREF_TOL, why, sizeof why),
                  "%s, step %zu (after %zu prompt + %zu generated tokens): %s", label, s, n_prompt,
                  s, why);
    }
}
