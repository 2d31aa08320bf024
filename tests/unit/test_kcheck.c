/* test_kcheck.c — the shared checks of tests/kcheck (kcheck.h) on the CPU backend, in CI.
 *
 * tests/cuda runs these checks against the CUDA kernels and engine on a GPU; here each one (1)
 * passes on the real CPU kernel or engine and (2) fails on deliberately broken variants written
 * in this file — a kernel that drops a key, ignores page-mask or explicit-mask bits, sees one
 * key past causality, loses a split-KV chunk, reads a wrong page or scales its scores wrongly;
 * a top-k that ranks NaN first, orders underflowed ties by logit or turns +inf into NaN; an
 * engine that ignores a mask, picks a top-1 beyond the near-tie margin or is not deterministic.
 * That is the evidence that the checks can fail, which the GPU run alone cannot give. The
 * broken attention variants are the real kernel fed what the bug would make it read (a dense
 * mask with the bug's visibility, a shuffled page list, a wrong scale), so they break exactly
 * one thing each. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "eng.h"
#include "kcheck.h"
#include "krn_cpu.h"

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    cr_assert_not_null(p, "out of memory (%zu bytes)", n);
    return p;
}

/* ---- attention --------------------------------------------------------------------------- */

typedef enum attn_bug {
    BUG_NONE,
    BUG_DROP_LAST_CONTEXT_KEY, /* "long": its last context token is never read */
    BUG_IGNORE_PAGE_MASK,      /* page-mask bytes are not applied */
    BUG_IGNORE_RUNS,           /* explicit masks are read as causal */
    BUG_ONE_PAST_CAUSAL,       /* every row also sees the key after its own */
    BUG_LOSE_SPLIT_CHUNK,      /* the merge of 4 splits skips the second partial */
    BUG_WRONG_PAGE,            /* "append" reads its 4th page where its 5th belongs */
    BUG_SCALE_TWICE,           /* scores scaled by 1 / head_dim instead of 1 / sqrt(head_dim) */
    BUG_COUNT
} attn_bug;

static const char *const attn_bug_names[BUG_COUNT] = {
    "none",
    "drops the last context key",
    "ignores page-mask bits",
    "ignores explicit-mask bits",
    "sees one key past causality",
    "loses one of 4 split-KV chunks",
    "reads a wrong page",
    "scales the scores twice",
};

/* Whether the buggy kernel sees key t for row r of sequence s. */
static bool bug_visible(const kc_attn_case *c, int s, int r, int t, attn_bug bug, int chunk) {
    const kc_attn_seq *q = &c->seq[s];
    int keys = q->n_ctx + q->n_tail, lim = q->q_seq + r + (bug == BUG_ONE_PAST_CAUSAL ? 1 : 0);
    if (t >= keys || t > lim) return false;
    if (bug == BUG_DROP_LAST_CONTEXT_KEY && strcmp(q->name, "long") == 0 && t == q->n_ctx - 1)
        return false;
    if (bug == BUG_LOSE_SPLIT_CHUNK && t >= chunk && t < 2 * chunk) return false;
    if (bug != BUG_IGNORE_RUNS && !kc_attn_run_visible(c, s, r, t)) return false;
    if (bug != BUG_IGNORE_PAGE_MASK && kc_attn_page_masked(c, s, t)) return false;
    return true;
}

/* Runs krn_cpu_attention on the case (with the bug's view of it) into out [rows][qd]. */
static void run_cpu_attention(kc_attn_case *c, attn_bug bug, int splits, krn_pool *pool,
                              float *out) {
    int hd = c->head_dim, kvd = c->n_kv_heads * hd, qd = c->n_heads * hd;
    int chunk = splits > 1 ? kc_attn_chunk(c, splits) : -1;
    krn_kv_layer kv = {
        .base = c->kv, .page_size = c->page_size, .n_kv_heads = c->n_kv_heads, .head_dim = hd};
    krn_attn_item items[KC_ATTN_SEQS];
    uint8_t *masks[KC_ATTN_SEQS] = {0};
    uint32_t *pages = xmalloc(sizeof(uint32_t) * (size_t)c->n_page_list);
    memcpy(pages, c->pages, sizeof(uint32_t) * (size_t)c->n_page_list);
    if (bug == BUG_WRONG_PAGE) pages[c->seq[0].page0 + 4] = pages[c->seq[0].page0 + 3];
    for (int s = 0; s < c->n_seqs; s++) {
        const kc_attn_seq *q = &c->seq[s];
        int keys = q->n_ctx + q->n_tail;
        /* a sequence with nothing but causality runs the kernel's causal path */
        bool dense = q->runs || q->pm_ctx > 0 ||
                     (bug != BUG_NONE && bug != BUG_WRONG_PAGE && bug != BUG_SCALE_TWICE);
        if (dense) {
            masks[s] = xmalloc((size_t)q->n_q * (size_t)keys);
            for (int r = 0; r < q->n_q; r++)
                for (int t = 0; t < keys; t++)
                    masks[s][(size_t)r * keys + t] = bug_visible(c, s, r, t, bug, chunk);
        }
        items[s] = (krn_attn_item){
            .q = c->q + (size_t)q->q_row * qd,
            .out = out + (size_t)q->q_row * qd,
            .n_q = q->n_q,
            .pages = pages + q->page0,
            .n_ctx = q->n_ctx,
            .k_tail = q->n_tail ? c->kt + (size_t)q->tail_row * kvd : NULL,
            .v_tail = q->n_tail ? c->vt + (size_t)q->tail_row * kvd : NULL,
            .n_tail = q->n_tail,
            .q_offset = q->q_seq,
            .mask = masks[s],
        };
    }
    float scale = bug == BUG_SCALE_TWICE ? c->scale * c->scale : c->scale;
    krn_cpu_attention_ex(pool, &kv, items, c->n_seqs, c->n_heads, scale, chunk);
    for (int s = 0; s < c->n_seqs; s++) free(masks[s]);
    free(pages);
}

static void build_case(kc_attn_case *c, int hd) {
    char why[256];
    cr_assert(kc_attn_build(c, hd, (uint64_t)hd, why, sizeof why), "%s", why);
}

Test(kcheck_attn, the_cpu_kernel_passes_at_head_dim_64_128_256_with_1_4_16_splits) {
    static const int hds[] = {64, 128, 256}, splits[] = {1, 4, 16};
    krn_pool *pool = krn_pool_create(2);
    cr_assert_not_null(pool);
    for (size_t h = 0; h < 3; h++) {
        kc_attn_case c;
        build_case(&c, hds[h]);
        float *out = xmalloc(sizeof(float) * (size_t)c.rows * c.n_heads * c.head_dim);
        for (size_t s = 0; s < 3; s++) {
            run_cpu_attention(&c, BUG_NONE, splits[s], pool, out);
            char why[512];
            cr_assert(kc_attn_check(&c, out, KC_ATTN_RTOL, why, sizeof why), "%d splits: %s",
                      splits[s], why);
        }
        free(out);
        kc_attn_free(&c);
    }
    krn_pool_destroy(pool);
}

Test(kcheck_attn, every_broken_kernel_variant_is_caught_at_every_head_dim) {
    static const int hds[] = {64, 128, 256};
    krn_pool *pool = krn_pool_create(2);
    cr_assert_not_null(pool);
    for (size_t h = 0; h < 3; h++) {
        kc_attn_case c;
        build_case(&c, hds[h]);
        float *out = xmalloc(sizeof(float) * (size_t)c.rows * c.n_heads * c.head_dim);
        for (int bug = BUG_NONE + 1; bug < BUG_COUNT; bug++) {
            run_cpu_attention(&c, (attn_bug)bug, bug == BUG_LOSE_SPLIT_CHUNK ? 4 : 1, pool, out);
            char why[512] = "";
            cr_assert_not(kc_attn_check(&c, out, KC_ATTN_RTOL, why, sizeof why),
                          "head_dim %d: a kernel that %s passes the sharpened check", hds[h],
                          attn_bug_names[bug]);
            cr_log_info("head_dim %d, kernel that %s: caught: %s", hds[h], attn_bug_names[bug],
                        why);
        }
        free(out);
        kc_attn_free(&c);
    }
    krn_pool_destroy(pool);
}

/* The test this replaces drew q and k uniformly in [-1, 1] and allowed 1e-2: softmax is then
 * nearly uniform, and a kernel that drops a key stays within that tolerance (the near-uniform
 * variant is still run, for the arithmetic of every key, next to the sharpened case). */
Test(kcheck_attn, a_near_uniform_softmax_would_not_see_a_dropped_key) {
    kc_attn_case c;
    build_case(&c, 64);
    kc_attn_randomize(&c, 1);
    size_t n = (size_t)c.rows * c.n_heads * c.head_dim;
    float *good = xmalloc(sizeof(float) * n), *bad = xmalloc(sizeof(float) * n);
    run_cpu_attention(&c, BUG_NONE, 1, NULL, good);
    run_cpu_attention(&c, BUG_DROP_LAST_CONTEXT_KEY, 1, NULL, bad);
    char why[512];
    cr_assert(kc_attn_check(&c, good, 1e-2, why, sizeof why), "%s", why);
    cr_assert(kc_attn_check(&c, bad, 1e-2, why, sizeof why),
              "expected the near-uniform check to miss the dropped key; it saw: %s", why);
    double worst = 0;
    for (size_t i = 0; i < n; i++) worst = fmax(worst, fabs(good[i] - bad[i]));
    cr_assert_gt(worst, 0, "the dropped key must change something");
    cr_log_info("near-uniform case: the dropped key moved an output by only %.2g", worst);
    free(good);
    free(bad);
    kc_attn_free(&c);
}

/* ---- distributions ----------------------------------------------------------------------- */

static float *edge_row(int which, uint32_t *n, float *t, uint32_t *k, const char **name) {
    float *x = xmalloc(sizeof(float) * KC_DIST_EDGE_MAX_N);
    *name = kc_dist_edge(which, x, n, t, k);
    cr_assert_not_null(*name);
    return x;
}

Test(kcheck_dist, the_reference_puts_underflowed_ties_in_id_order_and_nan_last) {
    uint32_t n, k;
    float t, p[64];
    const char *name;
    float *x = edge_row(2, &n, &t, &k, &name);
    kc_dist_reference(x, n, t, p);
    cr_assert_eq(p[0], 0.0f, "e^-205 is 0 in f32");
    cr_assert(p[3] > 0.98f && p[10] > 0 && p[10] == p[11]);
    uint32_t want[12] = {3, 10, 11, 0, 1, 2, 4, 5, 6, 7, 8, 9};
    float probs[12];
    for (int j = 0; j < 12; j++) probs[j] = p[want[j]];
    char why[256];
    cr_assert(kc_dist_check(x, n, t, k, want, probs, 1e-6, why, sizeof why), "%s", why);
    free(x);
    x = edge_row(0, &n, &t, &k, &name);
    kc_dist_reference(x, n, t, p);
    cr_assert_eq(p[3], 1.0f, "the first +inf takes all the mass");
    cr_assert_eq(p[7], 0.0f);
    cr_assert(isnan(p[5]));
    free(x);
}

static void cpu_dist(const float *x, uint32_t n, float t, uint32_t k, uint32_t *ids, float *pr) {
    float *row = xmalloc(sizeof(float) * n);
    memcpy(row, x, sizeof(float) * n);
    krn_cpu_softmax(row, (int)n, t);
    krn_cpu_topk(row, (int)n, (int)k, ids, pr);
    free(row);
}

Test(kcheck_dist, cpu_softmax_and_topk_pass_every_edge_on_every_simd_path) {
    static const char *const paths[] = {"scalar", "avx2", "avx512"};
    uint32_t *ids = xmalloc(sizeof(uint32_t) * 1024);
    float *pr = xmalloc(sizeof(float) * 1024);
    for (size_t s = 0; s < 3; s++) {
        if (krn_cpu_set_simd(paths[s]) != 0) {
            cr_log_info("SIMD path %s: not on this CPU", paths[s]);
            continue;
        }
        for (int e = 0; e < KC_DIST_EDGES; e++) {
            uint32_t n, k;
            float t;
            const char *name;
            float *x = edge_row(e, &n, &t, &k, &name);
            cpu_dist(x, n, t, k, ids, pr);
            char why[512];
            cr_assert(kc_dist_check(x, n, t, k, ids, pr, 1e-5, why, sizeof why), "%s, %s: %s",
                      paths[s], name, why);
            free(x);
        }
    }
    free(ids);
    free(pr);
}

/* Broken variants of softmax + top-k. */
typedef enum dist_bug {
    DBUG_NAN_FIRST,       /* top-k ranks NaN above every number (a raw float-key sort) */
    DBUG_ZEROS_BY_LOGIT,  /* equal probabilities ordered by logit (a sort on the logits) */
    DBUG_INF_GIVES_NAN,   /* softmax without the infinite-logit case: exp(inf - inf) */
    DBUG_NAN_POISONS_SUM, /* NaN summed into the normaliser */
    DBUG_NAN_EXP_CLAMPED, /* NaN through a clamping vector exp: e^88.7 */
    DBUG_COUNT
} dist_bug;

static const char *const dist_bug_names[DBUG_COUNT] = {
    "ranks NaN first", "orders underflowed ties by logit", "turns +inf into NaN",
    "lets NaN poison the sum", "clamps NaN to the largest exponent"};

/* The edge row each bug is shown on. */
static const int dist_bug_edge[DBUG_COUNT] = {1, 2, 0, 1, 1};

static void broken_softmax(float *p, const float *x, uint32_t n, float t, dist_bug bug) {
    float m = -INFINITY;
    for (uint32_t i = 0; i < n; i++)
        if (x[i] > m) m = x[i];
    double sum = 0;
    for (uint32_t i = 0; i < n; i++) {
        float v = (x[i] - m) / t;
        if (isnan(x[i]) && bug == DBUG_NAN_EXP_CLAMPED) v = 88.7f;
        if (isnan(x[i]) && bug != DBUG_NAN_POISONS_SUM && bug != DBUG_NAN_EXP_CLAMPED) {
            p[i] = NAN;
            continue;
        }
        p[i] = expf(v);
        sum += p[i];
    }
    for (uint32_t i = 0; i < n; i++) p[i] = isnan(p[i]) ? p[i] : (float)(p[i] / sum);
}

/* Selection of the k best by (key desc, id asc), where key is p or (bug) the logit, and NaN
 * counts as +inf (bug) or -inf. */
static void broken_topk(const float *p, const float *x, uint32_t n, uint32_t k, dist_bug bug,
                        uint32_t *ids, float *pr) {
    uint8_t *taken = calloc(n, 1);
    cr_assert_not_null(taken);
    for (uint32_t j = 0; j < k; j++) {
        int64_t best = -1;
        double bk = 0;
        for (uint32_t i = 0; i < n; i++) {
            if (taken[i]) continue;
            double key = bug == DBUG_ZEROS_BY_LOGIT ? x[i] : p[i];
            if (isnan(key)) key = bug == DBUG_NAN_FIRST ? INFINITY : -INFINITY;
            if (best < 0 || key > bk) best = i, bk = key;
        }
        taken[best] = 1;
        ids[j] = (uint32_t)best;
        pr[j] = p[best];
    }
    free(taken);
}

Test(kcheck_dist, every_broken_softmax_or_topk_variant_is_caught) {
    float *p = xmalloc(sizeof(float) * KC_DIST_EDGE_MAX_N);
    uint32_t ids[1024];
    float pr[1024];
    for (int bug = 0; bug < DBUG_COUNT; bug++) {
        uint32_t n, k;
        float t;
        const char *name;
        float *x = edge_row(dist_bug_edge[bug], &n, &t, &k, &name);
        broken_softmax(p, x, n, t, (dist_bug)bug);
        broken_topk(p, x, n, k, (dist_bug)bug, ids, pr);
        char why[512] = "";
        cr_assert_not(kc_dist_check(x, n, t, k, ids, pr, 1e-5, why, sizeof why),
                      "a softmax/top-k that %s passes on \"%s\"", dist_bug_names[bug], name);
        cr_log_info("top-k that %s: caught on \"%s\": %s", dist_bug_names[bug], name, why);
        free(x);
    }
    free(p);
}

/* ---- engines ----------------------------------------------------------------------------- */

static eng *open_model(const char *name, uint32_t pages, uint32_t slots, uint32_t max_batch) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/%s", PIE_MODELS_DIR, name);
    eng_opts o = {.model_dir = dir,
                  .kv_page_size = 16,
                  .kv_pages = pages,
                  .embed_slots = slots,
                  .max_batch_tokens = max_batch,
                  .n_threads = 2};
    pie_status st = {0};
    eng *e = NULL;
    cr_assert_eq(eng_open(&o, &e, &st), PIE_OK, "eng_open %s: %s", dir, st.msg);
    return e;
}

/* The models tests/cuda/test_eng_cuda.c compares on, with its tolerance for each. */
static const struct {
    const char *name;
    double tol;
} eng_models[] = {{"small-bf16", KC_ENG_TOL_BF16}, {"small-f32", KC_ENG_TOL_F32}};

Test(kcheck_eng, the_mask_scenario_moves_cpu_logits_by_5x_the_cuda_tolerance) {
    for (size_t m = 0; m < sizeof eng_models / sizeof eng_models[0]; m++) {
        eng *e = open_model(eng_models[m].name, 8, 64, 64);
        kc_engine ke = kc_engine_cpu(e);
        float *L = xmalloc(sizeof(float) * KC_MASK_CASES * ke.vocab);
        char why[512];
        cr_assert(kc_eng_mask_scenario(&ke, L, why, sizeof why), "%s", why);
        const float *span = L, *causal = L + ke.vocab, *pages = L + 2 * ke.vocab;
        double tol = eng_models[m].tol;
        cr_assert(kc_eng_mask_visible(span, causal, ke.vocab, tol, 5.0, eng_models[m].name, why,
                                      sizeof why),
                  "%s", why);
        cr_assert(kc_eng_agree(pages, span, ke.vocab, 1e-6, "page masks = explicit mask", why,
                               sizeof why),
                  "%s", why);
        /* an engine that ignored the mask: the same check the GPU's logits go through */
        cr_assert_not(kc_eng_agree(causal, span, ke.vocab, tol, "mask ignored", why, sizeof why),
                      "%s: an engine that ignores the mask passes", eng_models[m].name);
        cr_log_info("%s: mask ignored: caught: %s", eng_models[m].name, why);
        cr_log_info("%s: one hidden token moves the logits by %.3g (tolerance %.3g)",
                    eng_models[m].name, kc_rel_diff(L + 3 * ke.vocab, causal, ke.vocab), tol);
        free(L);
        eng_close(e);
    }
}

Test(kcheck_eng, top1_accepts_near_ties_and_catches_a_clear_miss) {
    float want[6] = {1.0f, 3.0f, 2.95f, -1.0f, 2.0f, 3.0f};
    char why[256];
    /* abs error 0.05: ids 1, 2 and 5 are within 2 x 0.05 of the top */
    cr_assert(kc_eng_top1(want, 6, 1, 0.05, "exact", why, sizeof why), "%s", why);
    cr_assert(kc_eng_top1(want, 6, 5, 0.05, "exact tie", why, sizeof why), "%s", why);
    cr_assert(kc_eng_top1(want, 6, 2, 0.05, "near tie", why, sizeof why), "%s", why);
    cr_assert_not(kc_eng_top1(want, 6, 4, 0.05, "clear miss", why, sizeof why));
    cr_assert_not(kc_eng_top1(want, 6, 2, 0.01, "beyond the margin", why, sizeof why));
    /* on real logits: the engine's own argmax passes, the runner-up only within the margin */
    eng *e = open_model("small-bf16", 8, 64, 64);
    kc_engine ke = kc_engine_cpu(e);
    float *L = xmalloc(sizeof(float) * KC_MASK_CASES * ke.vocab);
    cr_assert(kc_eng_mask_scenario(&ke, L, why, sizeof why), "%s", why);
    uint32_t best = 0, second = 1;
    double scale = 0;
    for (uint32_t i = 0; i < ke.vocab; i++) scale = fmax(scale, fabs(L[i]));
    for (uint32_t i = 0; i < ke.vocab; i++)
        if (L[i] > L[best]) best = i;
    second = best == 0 ? 1 : 0;
    for (uint32_t i = 0; i < ke.vocab; i++)
        if (i != best && L[i] > L[second]) second = i;
    double err = KC_ENG_TOL_BF16 * scale;
    cr_assert(kc_eng_top1(L, ke.vocab, best, err, "argmax", why, sizeof why), "%s", why);
    cr_assert_eq(kc_eng_top1(L, ke.vocab, second, err, "runner-up", why, sizeof why),
                 L[best] - L[second] <= 2 * err);
    free(L);
    eng_close(e);
}

Test(kcheck_eng, a_17_sequence_decode_is_bitwise_deterministic_and_one_ulp_is_caught) {
    enum { SEQS = 17, CTX = 40, STEPS = 2 };
    float *a = NULL, *b = NULL;
    uint32_t vocab = 0;
    for (int run = 0; run < 2; run++) {
        eng *e = open_model("small-bf16", SEQS * 3, CTX + 2 * SEQS, CTX);
        kc_engine ke = kc_engine_cpu(e);
        vocab = ke.vocab;
        float *L = xmalloc(sizeof(float) * SEQS * vocab);
        char why[512];
        cr_assert(kc_eng_decode_scenario(&ke, SEQS, CTX, STEPS, L, why, sizeof why), "%s", why);
        *(run ? &b : &a) = L;
        eng_close(e);
    }
    char why[256];
    cr_assert(kc_eng_bitwise(a, b, SEQS * vocab, "two runs", why, sizeof why), "%s", why);
    b[5 * vocab + 7] = nextafterf(b[5 * vocab + 7], INFINITY);
    cr_assert_not(kc_eng_bitwise(a, b, SEQS * vocab, "one ulp", why, sizeof why));
    free(a);
    free(b);
}
