/* test_pie_sample.c — the inferlet SDK's samplers (sdk/src/pie_sample.c, compiled natively into
 * this test) against the distributions they are specified to draw from.
 *
 * Covers: the PRNG (fixed stream for a seed, same seed → same draws); greedy (argmax, lowest
 * index among equals); temperature (exactly softmax(logits / T) over the candidates, also at a
 * temperature so low that p^(1/T) underflows); top-k (exactly the k most likely, equal
 * probabilities by index); top-p (the smallest prefix of the tempered distribution whose mass
 * reaches p: exact boundaries, p = 1, tiny p, ties, combined with top-k); the pie_sampler_*
 * constructors; the filter hook; and draws: a chi-square goodness-of-fit test of N seeded draws
 * against the exact renormalised distribution, at significance 0.001 (deterministic: the seed
 * is fixed), with a check that the same test rejects the untempered distribution; the n most
 * likely candidates (pie_dist_top: ties by index, zeros last) and OpenAI's presence and frequency
 * penalties (pie_dist_penalize) against their definition.
 *
 * The expected distributions are computed here from the specification (reference()), not with
 * the SDK's code. pie_sample.c calls three SDK functions that live in files which talk to the
 * host; they are defined below (exit with status 1 like the SDK's, plain malloc, no model stop
 * tokens). */
#include <criterion/criterion.h>

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pie_int.h"

/* ---- the SDK functions pie_sample.c calls (pie_core.c, pie_model.c) -------------------------- */

_Noreturn void pie_fatal(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("pie: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

void *pie_xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) pie_fatal("out of memory allocating %zu bytes", n);
    return p;
}

bool pie_model_is_stop_token(const pie_model *m, uint32_t token) {
    (void)m;
    return token == 2; /* this test's "model" stops at 2 */
}

/* ---- the specification ---------------------------------------------------------------------- */

#define MAXK 64

/* q[0..k) ← the probability with which a sampler (top_k, temperature T > 0, top_p) draws each
 * index of probs[0..k): order the indices with probability > 0 by probability, descending,
 * equal ones by index (selection, not qsort); keep the first top_k (0: all); weights
 * softmax(log(p) / T) over them; keep the smallest prefix whose mass reaches top_p (within
 * PIE_TOP_P_SLACK; off unless 0 < top_p < 1); renormalise. Returns how many are kept. */
static uint32_t reference(const float *probs, uint32_t k, uint32_t top_k, double T, float top_p,
                          double *q) {
    uint32_t order[MAXK], n = 0;
    bool taken[MAXK] = {false};
    for (;;) {
        int best = -1;
        for (uint32_t i = 0; i < k; i++)
            if (!taken[i] && probs[i] > 0 && (best < 0 || probs[i] > probs[best])) best = (int)i;
        if (best < 0) break;
        taken[best] = true;
        order[n++] = (uint32_t)best;
    }
    if (top_k && top_k < n) n = top_k;
    double l[MAXK], lmax = -INFINITY, sum = 0;
    for (uint32_t j = 0; j < n; j++) {
        l[j] = log((double)probs[order[j]]) / T;
        lmax = fmax(lmax, l[j]);
    }
    for (uint32_t j = 0; j < n; j++) sum += (l[j] = exp(l[j] - lmax));
    if (top_p > 0 && top_p < 1) {
        double acc = 0;
        for (uint32_t j = 0; j < n; j++) {
            acc += l[j] / sum;
            if (acc >= (double)top_p - PIE_TOP_P_SLACK) {
                n = j + 1;
                break;
            }
        }
        sum = 0;
        for (uint32_t j = 0; j < n; j++) sum += l[j];
    }
    for (uint32_t i = 0; i < k; i++) q[i] = 0;
    for (uint32_t j = 0; j < n; j++) q[order[j]] = l[j] / sum;
    return n;
}

/* Upper 0.001 quantiles of the chi-square distribution, df 1..9 (standard tables; their tail
 * mass is 0.001 to 4 digits). */
static const double chi2_999[10] = {0,      10.828, 13.816, 16.266, 18.467,
                                    20.515, 22.458, 24.322, 26.124, 27.877};

/* ---- helpers -------------------------------------------------------------------------------- */

/* A distribution over ids 100 + i (so an id is never mistaken for an index). */
typedef struct dist {
    uint32_t ids[MAXK];
    float probs[MAXK];
    pie_dist d;
} dist;

static void dist_make(dist *x, const float *probs, uint32_t k) {
    cr_assert_leq(k, MAXK);
    for (uint32_t i = 0; i < k; i++) x->ids[i] = 100 + i, x->probs[i] = probs[i];
    x->d = (pie_dist){.k = k, .ids = x->ids, .probs = x->probs};
}

/* probs ← softmax(logits) as floats (what the host sends at temperature 1). */
static void softmax_f(const double *logits, uint32_t k, float *probs) {
    double m = -INFINITY, s = 0;
    for (uint32_t i = 0; i < k; i++) m = fmax(m, logits[i]);
    for (uint32_t i = 0; i < k; i++) s += exp(logits[i] - m);
    for (uint32_t i = 0; i < k; i++) probs[i] = (float)(exp(logits[i] - m) / s);
}

/* Runs pie_sample_keep and checks that it keeps exactly the indices want[0..n_want) in that
 * order, with the reference's probabilities (to 1e-12). */
static void expect_keep(const char *what, const pie_sampler *s, const float *probs, uint32_t k,
                        const uint32_t *want, uint32_t n_want) {
    dist x;
    dist_make(&x, probs, k);
    pie_cand c[MAXK];
    double q[MAXK];
    uint32_t n = pie_sample_keep(s, &x.d, c);
    uint32_t nr = reference(probs, k, s->top_k, s->temperature, s->top_p, q);
    cr_assert_eq(nr, n_want, "%s: the specification keeps %u, the test expects %u", what, nr,
                 n_want);
    cr_assert_eq(n, n_want, "%s: %u candidates kept, %u expected", what, n, n_want);
    double sum = 0;
    for (uint32_t j = 0; j < n; j++) {
        cr_assert_eq(c[j].i, want[j], "%s: candidate %u is index %u, expected %u", what, j, c[j].i,
                     want[j]);
        cr_assert(fabs(c[j].p - q[c[j].i]) <= 1e-12,
                  "%s: index %u has probability %.17g, exactly %.17g", what, c[j].i, c[j].p,
                  q[c[j].i]);
        sum += c[j].p;
    }
    cr_assert(fabs(sum - 1) <= 1e-12, "%s: kept probabilities sum to %.17g", what, sum);
}

/* Pearson's statistic of counts[0..k) from n draws against q (cells with q = 0 must be empty:
 * asserted); *df ← cells with q > 0, minus one. */
static double chi2(const char *what, const uint32_t *counts, const double *q, uint32_t k,
                   uint32_t n, int *df) {
    double x2 = 0;
    *df = -1;
    for (uint32_t i = 0; i < k; i++) {
        if (q[i] == 0) {
            cr_assert_eq(counts[i], 0,
                         "%s: index %u is outside the kept set but was drawn %u times", what, i,
                         counts[i]);
            continue;
        }
        double e = q[i] * n;
        cr_assert_geq(e, 5, "%s: expected count %.1f of index %u is too small for chi-square", what,
                      e, i);
        x2 += (counts[i] - e) * (counts[i] - e) / e;
        ++*df;
    }
    return x2;
}

/* Draws n tokens with s from probs[0..k) through pie_sample, counting them by index. */
static void draw(pie_sampler *s, const float *probs, uint32_t k, uint32_t n, uint32_t *counts) {
    memset(counts, 0, k * sizeof *counts);
    for (uint32_t t = 0; t < n; t++) {
        dist x; /* afresh each time: a filter may change it */
        dist_make(&x, probs, k);
        uint32_t id = pie_sample(s, NULL, 0, &x.d);
        cr_assert(id >= 100 && id < 100 + k, "draw %u: id %u is not one of the distribution's", t,
                  id);
        counts[id - 100]++;
    }
}

/* n seeded draws of s fit the reference distribution at significance 0.001. */
static void expect_fit(const char *what, pie_sampler s, const float *probs, uint32_t k,
                       uint32_t n) {
    uint32_t counts[MAXK];
    double q[MAXK];
    reference(probs, k, s.top_k, s.temperature, s.top_p, q);
    draw(&s, probs, k, n, counts);
    int df;
    double x2 = chi2(what, counts, q, k, n, &df);
    cr_assert(df >= 1 && df <= 9, "%s: %d degrees of freedom", what, df);
    cr_assert_lt(x2, chi2_999[df],
                 "%s: chi-square %.2f with %d degrees of freedom exceeds %.3f (p < 0.001)", what,
                 x2, df, chi2_999[df]);
}

/* Eight candidates, all different, not in probability order. */
static const double LOGITS8[8] = {0.3, 1.9, -0.4, 1.1, 2.4, 0.0, -1.2, 0.8};

/* ---- the PRNG ----------------------------------------------------------------------------------
 */

Test(pie_sample, rng_stream_of_a_seed_is_fixed) {
    /* xorshift128+ seeded through splitmix64 (pie.h): the first outputs for seed 1. A change
     * here changes every seeded inferlet's output. */
    pie_rng r;
    pie_rng_seed(&r, 1);
    cr_assert_eq(pie_rng_next(&r), 0x9890a08cc61d98a5ull);
    cr_assert_eq(pie_rng_next(&r), 0x91a182125b3dfdc4ull);
    cr_assert_eq(pie_rng_next(&r), 0xd3e5dbe3cb93dd47ull);
    for (int i = 0; i < 10000; i++) {
        double u = pie_rng_uniform(&r);
        cr_assert(u >= 0 && u < 1, "uniform draw %d is %.17g", i, u);
    }
}

Test(pie_sample, same_seed_same_draws_other_seed_other_draws) {
    float probs[8];
    softmax_f(LOGITS8, 8, probs);
    uint32_t a[1000], b[1000], c[1000];
    pie_sampler sa = pie_sampler_top_p(0.9f, 0.8f, 42), sb = pie_sampler_top_p(0.9f, 0.8f, 42),
                sc = pie_sampler_top_p(0.9f, 0.8f, 43);
    size_t differ = 0;
    for (int t = 0; t < 1000; t++) {
        dist x;
        dist_make(&x, probs, 8);
        a[t] = pie_sample(&sa, NULL, 0, &x.d);
        b[t] = pie_sample(&sb, NULL, 0, &x.d);
        c[t] = pie_sample(&sc, NULL, 0, &x.d);
        cr_assert_eq(a[t], b[t], "draw %d: %u and %u from the same seed", t, a[t], b[t]);
        differ += a[t] != c[t];
    }
    cr_assert_gt(differ, 100, "seeds 42 and 43 differ in only %zu of 1000 draws", differ);
}

/* ---- constructors and greedy
 * --------------------------------------------------------------------- */

Test(pie_sample, constructors_set_what_they_name) {
    pie_sampler g = pie_sampler_greedy();
    cr_assert_eq(g.temperature, 0);
    cr_assert_eq(g.dist_k, 1, "greedy needs only the most likely candidate");
    cr_assert_eq(g.sample, pie_sample_default);
    pie_sampler k = pie_sampler_top_k(5, 0.7f, 9);
    cr_assert_eq(k.top_k, 5);
    cr_assert_eq(k.dist_k, 5, "top-k asks the host for exactly k candidates");
    cr_assert_eq(k.temperature, 0.7f);
    cr_assert_eq(k.top_p, 0);
    cr_assert_eq(k.sample, pie_sample_default);
    pie_sampler p = pie_sampler_top_p(0.9f, 1.2f, 9);
    cr_assert_eq(p.top_p, 0.9f);
    cr_assert_eq(p.top_k, 0);
    cr_assert_eq(p.dist_k, 0, "top-p takes the model's default k");
    cr_assert_eq(p.temperature, 1.2f);
    pie_sampler t = pie_sampler_temperature(0.5f, 9);
    cr_assert_eq(t.top_k, 0);
    cr_assert_eq(t.top_p, 0);
    /* the PRNG state is the seed's */
    pie_rng r;
    pie_rng_seed(&r, 9);
    cr_assert_eq(memcmp(&k.rng, &r, sizeof r), 0);
    cr_assert_eq(memcmp(&p.rng, &r, sizeof r), 0);
}

Test(pie_sample, greedy_takes_the_argmax_lowest_index_among_equals) {
    const float probs[] = {0.1f, 0.35f, 0.2f, 0.35f};
    dist x;
    dist_make(&x, probs, 4);
    pie_sampler g = pie_sampler_greedy();
    for (int t = 0; t < 10; t++) cr_assert_eq(pie_sample(&g, NULL, 0, &x.d), 101);
    pie_sampler nan_t = pie_sampler_temperature(NAN, 1); /* not > 0: greedy as well */
    cr_assert_eq(pie_sample(&nan_t, NULL, 0, &x.d), 101);
}

/* ---- temperature
 * ----------------------------------------------------------------------------------- */

Test(pie_sample, temperature_gives_softmax_of_logits_over_t) {
    float probs[8];
    softmax_f(LOGITS8, 8, probs);
    const float temps[] = {1.0f, 0.5f, 0.25f, 2.0f, 3.7f};
    for (size_t ti = 0; ti < sizeof temps / sizeof temps[0]; ti++) {
        pie_sampler s = pie_sampler_temperature(temps[ti], 1);
        dist x;
        dist_make(&x, probs, 8);
        pie_cand c[8];
        cr_assert_eq(pie_sample_keep(&s, &x.d, c), 8);
        /* exactly softmax(logits / T), computed from the logits (the host's float probabilities
         * carry 6e-8 relative error, 1/T times that after tempering) */
        double m = -INFINITY, sum = 0, want[8];
        for (int i = 0; i < 8; i++) m = fmax(m, LOGITS8[i] / temps[ti]);
        for (int i = 0; i < 8; i++) sum += (want[i] = exp(LOGITS8[i] / temps[ti] - m));
        for (int j = 0; j < 8; j++) {
            double w = want[c[j].i] / sum;
            cr_assert(fabs(c[j].p - w) <= 1e-6 * w, "T %.2f index %u: %.9f, softmax(l/T) %.9f",
                      temps[ti], c[j].i, c[j].p, w);
        }
        const uint32_t order[8] = {4, 1, 3, 7, 0, 5, 2, 6}; /* by logit */
        expect_keep("temperature", &s, probs, 8, order, 8);
    }
}

Test(pie_sample, a_low_temperature_draws_the_most_likely_candidate) {
    /* p^(1/T) of every candidate underflows a float (0.3^1000); the draw must still be the
     * argmax, not the last candidate. */
    const float probs[] = {0.2f, 0.3f, 0.25f, 0.25f};
    pie_sampler s = pie_sampler_temperature(0.001f, 5);
    dist x;
    dist_make(&x, probs, 4);
    pie_cand c[4];
    cr_assert_eq(pie_sample_keep(&s, &x.d, c), 4);
    cr_assert_eq(c[0].i, 1);
    cr_assert(c[0].p == 1.0, "the argmax has probability %.17g", c[0].p);
    for (int t = 0; t < 200; t++) cr_assert_eq(pie_sample(&s, NULL, 0, &x.d), 101, "draw %d", t);
}

/* ---- top-k
 * ------------------------------------------------------------------------------------------ */

Test(pie_sample, top_k_keeps_exactly_the_k_most_likely) {
    float probs[8];
    softmax_f(LOGITS8, 8, probs);
    const uint32_t order[8] = {4, 1, 3, 7, 0, 5, 2, 6};
    for (uint32_t k = 1; k <= 8; k++) {
        char what[32];
        snprintf(what, sizeof what, "top_k %u", k);
        pie_sampler s = pie_sampler_top_k(k, 1.0f, 1);
        expect_keep(what, &s, probs, 8, order, k);
        s = pie_sampler_top_k(k, 0.6f, 1); /* temperature does not change the set */
        expect_keep(what, &s, probs, 8, order, k);
    }
    pie_sampler all = pie_sampler_top_k(0, 1.0f, 1), more = pie_sampler_top_k(20, 1.0f, 1);
    expect_keep("top_k 0", &all, probs, 8, order, 8);
    expect_keep("top_k 20 of 8", &more, probs, 8, order, 8);
}

Test(pie_sample, top_k_breaks_ties_by_index_and_skips_zero_probabilities) {
    const float probs[] = {0.2f, 0.3f, 0.0f, 0.2f, 0.2f, 0.1f};
    pie_sampler s = pie_sampler_top_k(2, 1.0f, 1);
    const uint32_t two[] = {1, 0}; /* 0, 3, 4 tie for second: the lowest index */
    expect_keep("top_k 2 with ties", &s, probs, 6, two, 2);
    s.top_k = 3;
    const uint32_t three[] = {1, 0, 3};
    expect_keep("top_k 3 with ties", &s, probs, 6, three, 3);
    s.top_k = 6; /* more than the 5 with probability > 0: index 2 is never a candidate */
    const uint32_t five[] = {1, 0, 3, 4, 5};
    expect_keep("top_k 6 with a zero", &s, probs, 6, five, 5);
}

/* ---- top-p
 * ------------------------------------------------------------------------------------------ */

Test(pie_sample, top_p_keeps_the_smallest_prefix_reaching_p) {
    const float probs[] = {0.0625f, 0.25f, 0.5f, 0.125f, 0.0625f}; /* exact in binary */
    const uint32_t order[] = {2, 1, 3, 0, 4};
    const struct {
        float p;
        uint32_t n;
        const char *why;
    } cases[] = {
        {1e-9f, 1, "tiny p: the most likely alone"},
        {0.5f, 1, "reached exactly by the first"},
        {0.6f, 2, "between"},
        {0.75f, 2, "reached exactly by two"},
        {0.76f, 3, "just above two"},
        {0.9375f, 4, "reached exactly by four"},
        {0.99f, 5, "all"},
        {1.0f, 5, "off"},
        {0.0f, 5, "off"},
        {1.5f, 5, "off"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char what[80];
        snprintf(what, sizeof what, "top_p %g (%s)", (double)cases[i].p, cases[i].why);
        pie_sampler s = pie_sampler_top_p(cases[i].p, 1.0f, 1);
        expect_keep(what, &s, probs, 5, order, cases[i].n);
    }
}

Test(pie_sample, top_p_boundaries_in_float_and_ties) {
    /* 0.5f + 0.3f is 0.8f, but renormalising over a float sum of 1.0000000149 leaves the pair
     * 1.5e-8 short: it still reaches p = 0.8 (PIE_TOP_P_SLACK). */
    const float rounded[] = {0.5f, 0.3f, 0.2f};
    const uint32_t r_order[] = {0, 1, 2};
    pie_sampler s = pie_sampler_top_p(0.8f, 1.0f, 1);
    expect_keep("top_p 0.8 of 0.5, 0.3, 0.2", &s, rounded, 3, r_order, 2);
    /* equal candidates are taken in index order, and only as many as needed */
    const float tied[] = {0.2f, 0.4f, 0.2f, 0.2f};
    const uint32_t t_order[] = {1, 0, 2, 3};
    s.top_p = 0.6f;
    expect_keep("top_p 0.6 with ties", &s, tied, 4, t_order, 2);
    s.top_p = 0.7f;
    expect_keep("top_p 0.7 with ties", &s, tied, 4, t_order, 3);
}

Test(pie_sample, top_p_measures_the_tempered_distribution_after_top_k) {
    /* tempered at T 0.5: 0.5, 0.25, 0.25 → 2/3, 1/6, 1/6; p 0.6 keeps the first alone (the
     * untempered mass 0.5 would need two) */
    const float probs[] = {0.25f, 0.5f, 0.25f};
    const uint32_t order[] = {1, 0, 2};
    pie_sampler s = pie_sampler_top_p(0.6f, 0.5f, 1);
    expect_keep("top_p 0.6 at T 0.5", &s, probs, 3, order, 1);
    s.temperature = 1.0f;
    expect_keep("top_p 0.6 at T 1", &s, probs, 3, order, 2);
    /* top-k first: of 0.4, 0.3, 0.2, 0.1, k 2 leaves 4/7, 3/7; p 0.5 is reached by the first
     * (over all four it would take two) */
    const float four[] = {0.1f, 0.4f, 0.2f, 0.3f};
    const uint32_t f_order[] = {1, 3, 2, 0};
    s = pie_sampler_top_k(2, 1.0f, 1);
    s.top_p = 0.5f;
    expect_keep("top_k 2, top_p 0.5", &s, four, 4, f_order, 1);
    s.top_p = 0.6f;
    expect_keep("top_k 2, top_p 0.6", &s, four, 4, f_order, 2);
    s.top_k = 0;
    s.top_p = 0.5f;
    expect_keep("top_p 0.5 alone", &s, four, 4, f_order, 2);
}

/* ---- draws
 * ------------------------------------------------------------------------------------------- */

#define DRAWS 100000

Test(pie_sample, draws_fit_the_exact_distribution) {
    float probs[8];
    softmax_f(LOGITS8, 8, probs);
    expect_fit("temperature 1", pie_sampler_temperature(1.0f, 11), probs, 8, DRAWS);
    expect_fit("temperature 0.7", pie_sampler_temperature(0.7f, 12), probs, 8, DRAWS);
    expect_fit("temperature 1.8", pie_sampler_temperature(1.8f, 13), probs, 8, DRAWS);
    expect_fit("top_k 4, temperature 1.3", pie_sampler_top_k(4, 1.3f, 14), probs, 8, DRAWS);
    expect_fit("top_p 0.8, temperature 0.9", pie_sampler_top_p(0.8f, 0.9f, 16), probs, 8, DRAWS);
    expect_fit("top_p 0.95, temperature 1.5", pie_sampler_top_p(0.95f, 1.5f, 17), probs, 8, DRAWS);
    pie_sampler both = pie_sampler_top_k(5, 1.2f, 18);
    both.top_p = 0.9f;
    expect_fit("top_k 5, top_p 0.9, temperature 1.2", both, probs, 8, DRAWS);
}

Test(pie_sample, the_fit_test_rejects_the_wrong_temperature) {
    /* The same draws as "temperature 0.7" above fail against the untempered distribution: the
     * chi-square test has the power to see a sampler that ignores its temperature. */
    float probs[8];
    softmax_f(LOGITS8, 8, probs);
    pie_sampler s = pie_sampler_temperature(0.7f, 12);
    uint32_t counts[8];
    double q[8];
    reference(probs, 8, 0, 1.0, 0, q);
    draw(&s, probs, 8, DRAWS, counts);
    int df;
    double x2 = chi2("untempered", counts, q, 8, DRAWS, &df);
    cr_assert_gt(x2, 100 * chi2_999[df], "chi-square %.1f against the untempered distribution", x2);
}

/* ---- the filter hook and stop tokens
 * -------------------------------------------------------------- */

/* Forbids the most likely index (4 of LOGITS8) and doubles index 6's weight. */
static void filter(void *state, const uint32_t *history, size_t n_history, pie_dist *d) {
    (void)history;
    (void)n_history;
    (*(int *)state)++;
    d->probs[4] = 0;
    d->probs[6] *= 2;
}

Test(pie_sample, the_filter_runs_first_and_what_it_forbids_is_never_drawn) {
    float probs[8], filtered[8];
    softmax_f(LOGITS8, 8, probs);
    memcpy(filtered, probs, sizeof probs);
    filtered[4] = 0;
    filtered[6] *= 2;
    int calls = 0;
    pie_sampler s = pie_sampler_temperature(1.0f, 21);
    s.filter = filter;
    s.filter_state = &calls;
    uint32_t counts[8];
    double q[8];
    reference(filtered, 8, 0, 1.0, 0, q);
    draw(&s, probs, 8, DRAWS, counts);
    cr_assert_eq(calls, DRAWS);
    int df;
    double x2 = chi2("filtered", counts, q, 8, DRAWS, &df); /* asserts index 4 was never drawn */
    cr_assert_lt(x2, chi2_999[df], "chi-square %.2f with %d degrees of freedom", x2, df);
}

Test(pie_sample, a_distribution_without_a_candidate_is_fatal, .exit_code = 1) {
    const float probs[] = {0, 0, 0};
    dist x;
    dist_make(&x, probs, 3);
    pie_sampler s = pie_sampler_temperature(1.0f, 1);
    pie_sample(&s, NULL, 0, &x.d);
}

Test(pie_sample, stop_tokens_are_the_models_unless_ignored_and_the_extra_ones) {
    const uint32_t extra[] = {7};
    pie_stop stop = {.stop_tokens = extra, .n_stop_tokens = 1};
    cr_assert(pie_stop_is_token(&stop, NULL, 2), "the model's stop token");
    cr_assert(pie_stop_is_token(&stop, NULL, 7), "an extra stop token");
    cr_assert_not(pie_stop_is_token(&stop, NULL, 3));
    stop.ignore_model_stop_tokens = true;
    cr_assert_not(pie_stop_is_token(&stop, NULL, 2));
    cr_assert(pie_stop_is_token(&stop, NULL, 7));
    cr_assert_str_eq(pie_stop_reason_name(PIE_STOP_STRING), "stop_string");
}

/* ---- logprobs and penalties (what the openai_chat inferlet builds on) ------------------------ */

Test(pie_sample, top_lists_the_n_most_likely_equal_ones_by_index_zeros_last) {
    const float probs[] = {0.1f, 0.3f, 0, 0.3f, 0.05f, 0.25f};
    dist x;
    dist_make(&x, probs, 6);
    uint32_t idx[8];
    const uint32_t want[] = {1, 3, 5, 0, 4, 2};
    cr_assert_eq(pie_dist_top(&x.d, 8, idx), 6, "n above k gives all k");
    for (uint32_t j = 0; j < 6; j++)
        cr_assert_eq(idx[j], want[j], "rank %u is index %u, expected %u", j, idx[j], want[j]);
    cr_assert_eq(pie_dist_top(&x.d, 2, idx), 2);
    cr_assert(idx[0] == 1 && idx[1] == 3, "top 2: %u %u", idx[0], idx[1]);
    cr_assert_eq(pie_dist_top(&x.d, 0, idx), 0);
}

/* The penalised distribution from the definition: softmax over the candidates of
 * logit_i - count_i * frequency - (count_i > 0) * presence, logit_i = ln p_i. */
static void penalised_reference(const float *probs, const uint32_t *counts, uint32_t k,
                                double presence, double frequency, double *q) {
    double l[MAXK], top = -INFINITY, sum = 0;
    for (uint32_t i = 0; i < k; i++) {
        uint32_t n = counts[100 + i];
        l[i] = log((double)probs[i]) - n * frequency - (n > 0 ? presence : 0);
        top = fmax(top, l[i]);
    }
    for (uint32_t i = 0; i < k; i++) sum += exp(l[i] - top);
    for (uint32_t i = 0; i < k; i++) q[i] = exp(l[i] - top) / sum;
}

Test(pie_sample, penalties_follow_openais_definition_over_the_candidates) {
    float probs[8];
    softmax_f(LOGITS8, 8, probs);
    uint32_t counts[100 + MAXK] = {0};
    counts[100] = 3, counts[101] = 1, counts[105] = 2; /* ids 100 + i */
    const double cases[][2] = {{0.5, 0.25}, {2, 0}, {0, 2}, {-1.5, -0.75}, {0, 0}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        dist x;
        dist_make(&x, probs, 8);
        double q[8];
        penalised_reference(probs, counts, 8, cases[c][0], cases[c][1], q);
        pie_dist_penalize(&x.d, counts, (float)cases[c][0], (float)cases[c][1]);
        for (uint32_t i = 0; i < 8; i++)
            cr_assert(fabs(x.probs[i] - q[i]) <= 1e-6 * fmax(q[i], 1e-3),
                      "presence %g frequency %g: candidate %u has %.9g, expected %.9g",
                      cases[c][0], cases[c][1], i, x.probs[i], q[i]);
    }
}

Test(pie_sample, penalties_keep_zeros_and_survive_extreme_counts) {
    const float probs[] = {0.5f, 0, 0.3f, 0.2f};
    uint32_t counts[100 + MAXK] = {0};
    /* penalties of 200,000 in the logit: far past what exp can represent either way */
    counts[100] = 100000, counts[102] = 100000;
    dist x;
    dist_make(&x, probs, 4);
    pie_dist_penalize(&x.d, counts, 0, -2); /* rewarded: 0 and 2 share the mass 5:3 */
    cr_assert_eq(x.probs[1], 0, "a zero probability stays 0");
    cr_assert(fabsf(x.probs[0] - 0.625f) < 1e-6f && fabsf(x.probs[2] - 0.375f) < 1e-6f &&
                  x.probs[3] == 0,
              "rewarded: %g %g %g %g", x.probs[0], x.probs[1], x.probs[2], x.probs[3]);
    dist_make(&x, probs, 4);
    pie_dist_penalize(&x.d, counts, 0, 2);
    cr_assert(fabsf(x.probs[3] - 1) < 1e-6f && x.probs[0] == 0 && x.probs[2] == 0,
              "punished: %g %g %g %g", x.probs[0], x.probs[1], x.probs[2], x.probs[3]);
}
