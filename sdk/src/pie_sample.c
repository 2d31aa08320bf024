/* pie_sample.c — the seeded PRNG, samplers over top-k distributions, and stop conditions.
 *
 * Owns: the PRNG (pie_rng), greedy / temperature / top-k / top-p sampling (pie_sample_keep says
 * which candidates a sampler may draw and with what probability; pie_sample_default draws), the
 * filter hook, the most likely candidates of a distribution (pie_dist_top), presence and
 * frequency penalties (pie_dist_penalize), stop-token checks.
 * Does not own: where distributions come from (pie_res.c, pie_ctx.c), stop strings in text
 * (pie_gen.c).
 * Nothing here calls the host: tests/unit/test_pie_sample.c compiles this file natively. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h> /* getentropy (WASI random_get) */

#include "pie_int.h"

/* ==== random numbers ========================================================================== */

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void pie_rng_seed(pie_rng *r, uint64_t seed) {
    if (seed == 0 && getentropy(&seed, sizeof seed) != 0) pie_fatal("getentropy failed");
    r->s[0] = splitmix64(&seed);
    r->s[1] = splitmix64(&seed);
    if (!r->s[0] && !r->s[1]) r->s[1] = 1;
}

/* xorshift128+ */
uint64_t pie_rng_next(pie_rng *r) {
    uint64_t a = r->s[0], b = r->s[1];
    r->s[0] = b;
    a ^= a << 23;
    a ^= a >> 17;
    a ^= b ^ (b >> 26);
    r->s[1] = a;
    return a + b;
}

double pie_rng_uniform(pie_rng *r) { return (double)(pie_rng_next(r) >> 11) * 0x1.0p-53; }

/* ==== samplers ================================================================================ */

pie_sampler pie_sampler_greedy(void) {
    return (pie_sampler){.sample = pie_sample_default, .temperature = 0, .dist_k = 1};
}

pie_sampler pie_sampler_temperature(float temperature, uint64_t seed) {
    pie_sampler s = {.sample = pie_sample_default, .temperature = temperature};
    pie_rng_seed(&s.rng, seed);
    return s;
}

pie_sampler pie_sampler_top_k(uint32_t k, float temperature, uint64_t seed) {
    pie_sampler s = pie_sampler_temperature(temperature, seed);
    s.top_k = k;
    s.dist_k = k;
    return s;
}

pie_sampler pie_sampler_top_p(float p, float temperature, uint64_t seed) {
    pie_sampler s = pie_sampler_temperature(temperature, seed);
    s.top_p = p;
    return s;
}

static _Noreturn void no_candidate(const pie_dist *d) {
    pie_fatal("sample: every one of the %u candidates has probability 0", d->k);
}

uint32_t pie_dist_argmax(const pie_dist *d) {
    if (d->k == 0) no_candidate(d);
    uint32_t best = 0;
    for (uint32_t i = 1; i < d->k; i++)
        if (d->probs[i] > d->probs[best]) best = i;
    return d->ids[best];
}

/* Whether candidate a comes before b: more likely, or equally likely and earlier in the payload. */
static bool dist_precedes(const pie_dist *d, uint32_t a, uint32_t b) {
    return d->probs[a] > d->probs[b] || (d->probs[a] == d->probs[b] && a < b);
}

uint32_t pie_dist_top(const pie_dist *d, uint32_t n, uint32_t *idx) {
    if (n > d->k) n = d->k;
    /* Selection: pass j takes the first candidate after pick j - 1 in that order (no storage). */
    for (uint32_t j = 0; j < n; j++) {
        uint32_t best = UINT32_MAX;
        for (uint32_t i = 0; i < d->k; i++)
            if ((j == 0 || dist_precedes(d, idx[j - 1], i)) &&
                (best == UINT32_MAX || dist_precedes(d, i, best)))
                best = i;
        idx[j] = best;
    }
    return n;
}

/* The penalised logit of candidate i (its probability must be > 0). */
static double penalised_logit(const pie_dist *d, uint32_t i, const uint32_t *counts,
                              float presence, float frequency) {
    uint32_t n = counts[d->ids[i]];
    return log((double)d->probs[i]) - (double)n * frequency - (n > 0 ? presence : 0.0f);
}

void pie_dist_penalize(pie_dist *d, const uint32_t *counts, float presence, float frequency) {
    double top = -INFINITY, sum = 0;
    for (uint32_t i = 0; i < d->k; i++)
        if (d->probs[i] > 0) top = fmax(top, penalised_logit(d, i, counts, presence, frequency));
    /* softmax relative to the largest penalised logit: its weight is 1, none can overflow */
    for (uint32_t i = 0; i < d->k; i++) {
        if (!(d->probs[i] > 0)) continue;
        double w = exp(penalised_logit(d, i, counts, presence, frequency) - top);
        d->probs[i] = (float)w;
        sum += w;
    }
    if (!(sum > 0)) return; /* no candidate: nothing to renormalise */
    for (uint32_t i = 0; i < d->k; i++) d->probs[i] = (float)(d->probs[i] / sum);
}

/* Most likely first; equal probabilities keep the payload order. */
static int cand_cmp(const void *a, const void *b) {
    const pie_cand *x = a, *y = b;
    if (x->p != y->p) return x->p > y->p ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}

/* Scales c[0..n)'s weights to sum 1. */
static void normalise(pie_cand *c, uint32_t n) {
    double total = 0;
    for (uint32_t i = 0; i < n; i++) total += c[i].p;
    for (uint32_t i = 0; i < n; i++) c[i].p /= total;
}

uint32_t pie_sample_keep(const pie_sampler *s, const pie_dist *d, pie_cand *c) {
    uint32_t n = 0;
    for (uint32_t i = 0; i < d->k; i++)
        if (d->probs[i] > 0) c[n++] = (pie_cand){.i = i, .p = d->probs[i]};
    if (n == 0) return 0;
    qsort(c, n, sizeof *c, cand_cmp);
    if (s->top_k && s->top_k < n) n = s->top_k;
    /* Re-temper: the host's probabilities are softmax(logits) at temperature 1 over the whole
     * vocabulary, so p^(1/T), renormalised over the kept candidates, is softmax(logits / T)
     * restricted to them. Taken relative to the most likely candidate, (p / p_max)^(1/T), in
     * double: the first weight is 1, so no temperature can underflow them all to 0. */
    double top = c[0].p;
    for (uint32_t i = 0; i < n; i++) {
        double r = c[i].p / top;
        c[i].p = s->temperature == 1.0f ? r : exp(log(r) / s->temperature);
    }
    normalise(c, n);
    if (s->top_p > 0 && s->top_p < 1) {
        double acc = 0;
        for (uint32_t i = 0; i + 1 < n; i++) {
            acc += c[i].p;
            if (acc >= (double)s->top_p - PIE_TOP_P_SLACK) {
                n = i + 1;
                break;
            }
        }
        normalise(c, n);
    }
    return n;
}

uint32_t pie_sample_default(pie_sampler *s, const pie_dist *d) {
    if (!(s->temperature > 0)) return pie_dist_argmax(d); /* NaN too */
    pie_cand *c = pie_xmalloc((size_t)d->k * sizeof *c);
    uint32_t n = pie_sample_keep(s, d, c);
    if (n == 0) {
        free(c);
        no_candidate(d);
    }
    double u = pie_rng_uniform(&s->rng), acc = 0;
    uint32_t pick = c[n - 1].i; /* u at or above the rounded sum of the weights */
    for (uint32_t i = 0; i < n; i++) {
        acc += c[i].p;
        if (u < acc) {
            pick = c[i].i;
            break;
        }
    }
    free(c);
    return d->ids[pick];
}

uint32_t pie_sample(pie_sampler *s, const uint32_t *history, size_t n_history, pie_dist *d) {
    if (s->filter) s->filter(s->filter_state, history, n_history, d);
    bool any = false;
    for (uint32_t i = 0; i < d->k && !any; i++) any = d->probs[i] > 0;
    if (!any) no_candidate(d);
    return (s->sample ? s->sample : pie_sample_default)(s, d);
}

/* ==== stop conditions ========================================================================= */

bool pie_stop_is_token(const pie_stop *stop, const pie_model *m, uint32_t t) {
    if (!stop->ignore_model_stop_tokens && pie_model_is_stop_token(m, t)) return true;
    for (size_t i = 0; i < stop->n_stop_tokens; i++)
        if (stop->stop_tokens[i] == t) return true;
    return false;
}

const char *pie_stop_reason_name(pie_stop_reason r) {
    switch (r) {
    case PIE_STOP_NONE: return "none";
    case PIE_STOP_MAX_TOKENS: return "max_tokens";
    case PIE_STOP_TOKEN: return "stop_token";
    case PIE_STOP_STRING: return "stop_string";
    case PIE_STOP_CONTEXT: return "context_full";
    }
    return "?";
}
