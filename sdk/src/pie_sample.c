/* pie_sample.c — samplers over top-k distributions and stop conditions.
 *
 * Owns: greedy / temperature / top-k / top-p sampling, the filter hook, stop-token checks.
 * Does not own: where distributions come from (pie_res.c, pie_ctx.c), stop strings in text
 * (pie_gen.c). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pie_int.h"

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

uint32_t pie_dist_argmax(const pie_dist *d) {
    uint32_t best = 0;
    for (uint32_t i = 1; i < d->k; i++)
        if (d->probs[i] > d->probs[best]) best = i;
    return d->ids[best];
}

/* Candidate indices ordered by probability, descending; ties keep the payload order. */
typedef struct cand {
    float p;
    uint32_t i;
} cand;

static int cand_cmp(const void *a, const void *b) {
    const cand *x = a, *y = b;
    if (x->p != y->p) return x->p > y->p ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}

uint32_t pie_sample_default(pie_sampler *s, const pie_dist *d) {
    if (s->temperature <= 0) return pie_dist_argmax(d);
    cand *c = pie_xmalloc((size_t)d->k * sizeof *c);
    uint32_t n = 0;
    for (uint32_t i = 0; i < d->k; i++)
        if (d->probs[i] > 0) c[n++] = (cand){d->probs[i], i};
    qsort(c, n, sizeof *c, cand_cmp);
    if (s->top_k && s->top_k < n) n = s->top_k;
    /* Re-temper: the host's probabilities are softmax(logits) at temperature 1 over the whole
     * vocabulary, so p^(1/T), renormalised over the kept candidates, is softmax(logits / T)
     * restricted to them. */
    double total = 0;
    for (uint32_t i = 0; i < n; i++) {
        double w = s->temperature == 1.0f ? c[i].p : pow(c[i].p, 1.0 / s->temperature);
        c[i].p = (float)w;
        total += w;
    }
    if (s->top_p > 0 && s->top_p < 1) { /* smallest prefix with mass >= top_p */
        double acc = 0;
        for (uint32_t i = 0; i < n; i++) {
            acc += c[i].p / total;
            if (acc >= s->top_p) {
                n = i + 1;
                break;
            }
        }
        total = 0;
        for (uint32_t i = 0; i < n; i++) total += c[i].p;
    }
    double u = pie_rng_uniform(&s->rng) * total, acc = 0;
    uint32_t pick = c[n - 1].i;
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
    if (!any) pie_fatal("sample: every one of the %u candidates has probability 0", d->k);
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
