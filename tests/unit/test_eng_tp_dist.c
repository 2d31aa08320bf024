/* test_eng_tp_dist.c — the host side of a tensor-parallel group's next_dist (engine/eng_tp_dist.h)
 * as both backends use it, against one softmax over the whole vocabulary.
 *
 * Owns: a row of logits cut into N slices of ceil(V / N) (eng_shard.h's split), each rank's
 * part computed as krn_cuda_topk_shifted's contract says (kernels/cuda/krn_cuda.h; the cpu
 * engine computes the same with krn_cpu_exp_shifted): the slice maxima, eng_tp_max_holder,
 * exp((l - M) / T) over the slice with the limits, the slice's top k and sum; then
 * eng_tp_merge_lists. The result must be krn_cpu_softmax + krn_cpu_topk over the whole row:
 * the same ids in the same order, probabilities within 1e-5 relative (the sums are added in
 * another order), NaN where it is NaN — on random rows whose slices have very different
 * maxima, top_k larger than a slice, low temperatures where most probabilities underflow to
 * zero (their order is by id, as on one rank), infinite logits, temperature 0, NaN slices. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "eng_tp_dist.h"
#include "krn_cpu.h"

#define MAX_V 2048
#define MAX_N 8

/* Rank r's part of one row: what krn_cuda_topk_shifted writes for its slice. */
static void rank_part(const float *slice, uint32_t nv, uint32_t v0, float max, bool holds, float t,
                      uint32_t k, uint32_t *ids, float *vals, float *sum) {
    float x[MAX_V];
    memcpy(x, slice, nv * sizeof(float));
    bool one_hot = !isnan(max) && (!(t > 0.0f) || isinf(max) || isinf(1.0f / t));
    *sum = 0.0f;
    if (one_hot) {
        uint32_t arg = nv;
        for (uint32_t i = 0; holds && i < nv && arg == nv; i++)
            if (x[i] == max) arg = i;
        for (uint32_t i = 0; i < nv; i++)
            if (!isnan(x[i])) x[i] = i == arg ? 1.0f : 0.0f;
        *sum = arg < nv ? 1.0f : 0.0f;
    } else if (!isnan(max)) {
        *sum = krn_cpu_exp_shifted(x, (int)nv, max, t);
    }
    krn_cpu_topk(x, (int)nv, (int)k, ids, vals);
    for (uint32_t i = 0; i < k; i++) ids[i] += v0;
}

/* The group's top_k of row[V] at temperature t over n ranks into ids / probs. */
static void group_dist(const float *row, uint32_t V, uint32_t n, float t, uint32_t top_k,
                       uint32_t *out_ids, float *out_probs) {
    static uint32_t ids[MAX_N][MAX_V];
    static float vals[MAX_N][MAX_V];
    uint32_t stride = (V + n - 1) / n;
    float maxima[MAX_N], sums[MAX_N];
    for (uint32_t r = 0; r < n; r++) { /* step 1: each slice's largest number */
        maxima[r] = NAN;
        for (uint32_t i = r * stride; i < V && i < (r + 1) * stride; i++)
            if (!isnan(row[i]) && (isnan(maxima[r]) || row[i] > maxima[r])) maxima[r] = row[i];
    }
    float max;
    uint32_t holder = eng_tp_max_holder(maxima, 1, n, &max);
    const uint32_t *lid[MAX_N];
    const float *lval[MAX_N];
    int counts[MAX_N];
    double sum = 0.0;
    for (uint32_t r = 0; r < n; r++) { /* step 2: each rank's list */
        uint32_t v0 = r * stride, nv = V - v0 < stride ? V - v0 : stride;
        uint32_t k = top_k < nv ? top_k : nv;
        rank_part(row + v0, nv, v0, max, holder == r, t, k, ids[r], vals[r], &sums[r]);
        lid[r] = ids[r], lval[r] = vals[r], counts[r] = (int)k;
        sum += sums[r];
    }
    eng_tp_merge_lists(lid, lval, counts, n, sum, top_k, out_ids, out_probs); /* step 3 */
}

/* The row's distribution on one rank: krn_cpu_softmax, krn_cpu_topk. */
static void whole_dist(const float *row, uint32_t V, float t, uint32_t top_k, uint32_t *ids,
                       float *probs) {
    float x[MAX_V];
    memcpy(x, row, V * sizeof(float));
    krn_cpu_softmax(x, (int)V, t);
    krn_cpu_topk(x, (int)V, (int)top_k, ids, probs);
}

static void expect_same(const float *row, uint32_t V, uint32_t n, float t, uint32_t k,
                        const char *what) {
    uint32_t gi[MAX_V], wi[MAX_V];
    float gp[MAX_V], wp[MAX_V];
    group_dist(row, V, n, t, k, gi, gp);
    whole_dist(row, V, t, k, wi, wp);
    for (uint32_t i = 0; i < k; i++) {
        cr_assert_eq(gi[i], wi[i],
                     "%s: V %u, %u ranks, T %g, top_k %u: entry %u is id %u, one "
                     "rank says %u",
                     what, V, n, t, k, i, gi[i], wi[i]);
        if (isnan(wp[i])) {
            cr_assert(isnan(gp[i]), "%s: entry %u: %g where one rank has NaN", what, i, gp[i]);
            continue;
        }
        cr_assert(fabsf(gp[i] - wp[i]) <= 1e-5f * fabsf(wp[i]),
                  "%s: V %u, %u ranks, T %g, top_k %u: id %u has probability %.9g, one rank "
                  "%.9g",
                  what, V, n, t, k, gi[i], gp[i], wp[i]);
    }
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static float uniform(void) { /* [0, 1) */
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
    return (float)(rng_state >> 40) / (float)(1u << 24);
}

/* Logits whose slices (of n) sit at different heights: a rank's own maximum is far from the
 * row's, so its local probabilities are nothing like the merged ones. */
static void fill_row(float *row, uint32_t V, uint32_t n, float spread) {
    uint32_t stride = (V + n - 1) / n;
    for (uint32_t i = 0; i < V; i++)
        row[i] = spread * (uniform() - 0.5f) + 2.5f * (float)(i / stride);
}

Test(eng_tp_dist, random_rows_over_1_to_8_ranks_give_one_ranks_top_k) {
    static const uint32_t vs[] = {1000, 37, 2048};
    static const float ts[] = {1.0f, 0.6f, 2.0f};
    float row[MAX_V];
    for (size_t a = 0; a < 3; a++)
        for (uint32_t n = 1; n <= MAX_N; n++)
            for (size_t b = 0; b < 3; b++) {
                uint32_t V = vs[a];
                fill_row(row, V, n, 8.0f);
                uint32_t ks[] = {1, 7, V < 300 ? V : 300};
                for (size_t c = 0; c < 3; c++) expect_same(row, V, n, ts[b], ks[c], "random");
            }
}

Test(eng_tp_dist, top_k_of_the_whole_vocabulary_spans_slices_of_unequal_size) {
    float row[10];
    fill_row(row, 10, 4, 3.0f); /* slices of 3, 3, 3, 1 */
    expect_same(row, 10, 4, 1.0f, 10, "every id");
    expect_same(row, 10, 3, 0.7f, 9, "all but one");
}

Test(eng_tp_dist, underflowed_zeros_are_ordered_by_id_across_ranks) {
    /* at T 0.01 everything 1 below the maximum underflows: the tail is zeros in id order, and
     * the ranks whose own maximum is far below have only zeros */
    float row[MAX_V];
    fill_row(row, 1000, 4, 40.0f);
    for (uint32_t n = 2; n <= 4; n++) expect_same(row, 1000, n, 0.01f, 200, "zeros");
}

Test(eng_tp_dist, an_infinite_logit_puts_all_mass_on_its_first_occurrence) {
    float row[100];
    fill_row(row, 100, 4, 4.0f);
    row[60] = INFINITY; /* rank 2 of 4 (slices of 25) */
    row[90] = INFINITY; /* rank 3: later, so 0 */
    row[70] = INFINITY; /* rank 2 again: later in the slice */
    expect_same(row, 100, 4, 1.0f, 30, "+inf");
    uint32_t ids[5];
    float p[5];
    group_dist(row, 100, 4, 1.0f, 5, ids, p);
    cr_assert(ids[0] == 60 && p[0] == 1.0f && p[1] == 0.0f && ids[1] == 0,
              "the mass is on id %u (%g), then id %u (%g)", ids[0], p[0], ids[1], p[1]);
}

Test(eng_tp_dist, temperature_zero_is_the_first_largest_logit_across_ranks) {
    float row[64];
    fill_row(row, 64, 1, 1.0f);
    row[40] = 9.0f; /* rank 2 of 4 (slices of 16) */
    row[20] = 9.0f; /* rank 1: the first */
    expect_same(row, 64, 4, 0.0f, 8, "T 0");
    uint32_t id;
    float p;
    group_dist(row, 64, 4, 0.0f, 1, &id, &p);
    cr_assert(id == 20 && p == 1.0f, "T 0 picks id %u (%g), not 20", id, p);
    expect_same(row, 64, 4, 1e-39f, 8, "1 / T overflows"); /* a subnormal temperature */
}

Test(eng_tp_dist, nan_logits_stay_nan_and_rank_last) {
    float row[48];
    fill_row(row, 48, 3, 3.0f);
    for (uint32_t i = 16; i < 32; i++) row[i] = NAN; /* rank 1 of 3: nothing but NaN */
    row[3] = NAN;
    expect_same(row, 48, 3, 1.0f, 48, "a NaN slice");
    for (uint32_t i = 0; i < 48; i++) row[i] = NAN;
    expect_same(row, 48, 3, 1.0f, 10, "a NaN row");
    uint32_t ids[3];
    float p[3];
    group_dist(row, 48, 3, 1.0f, 3, ids, p);
    cr_assert(isnan(p[0]) && ids[0] == 0 && ids[2] == 2, "a NaN row: id %u (%g) first", ids[0],
              p[0]);
}

Test(eng_tp_dist, the_holder_is_the_lowest_rank_with_the_largest_number) {
    float m[] = {NAN, 3.0f, 7.0f, 7.0f, -INFINITY};
    float max;
    cr_assert_eq(eng_tp_max_holder(m, 1, 5, &max), 2);
    cr_assert_eq(max, 7.0f);
    float none[] = {NAN, 0, NAN, 0}; /* stride 2: ranks see m[0] and m[2] */
    cr_assert_eq(eng_tp_max_holder(none, 2, 2, &max), 2, "no rank has a number");
    cr_assert(isnan(max));
    float neg[] = {-INFINITY, NAN};
    cr_assert_eq(eng_tp_max_holder(neg, 1, 2, &max), 0);
    cr_assert(isinf(max) && max < 0);
}
