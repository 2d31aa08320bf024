/* pie_beam.c — beam search over forked contexts.
 *
 * Owns: the beam search loop: per step, every live beam's distribution (issued together so
 * they batch), the width best continuations by summed log-probability, forks for beams that
 * continue in more than one way, finished beams at stop tokens, early exit once no live beam
 * can beat the best finished one.
 * Does not own: contexts (pie_ctx.c), sampling (beam search is deterministic). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pie_int.h"

typedef struct live_beam {
    pie_ctx *ctx;
    uint32_t *tokens;
    size_t n_tokens;
    double score;
} live_beam;

typedef struct candidate {
    double score;
    uint32_t beam, rank, token;
} candidate;

static int candidate_cmp(const void *a, const void *b) {
    const candidate *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    if (x->beam != y->beam) return x->beam < y->beam ? -1 : 1;
    return x->rank < y->rank ? -1 : x->rank > y->rank;
}

static int beam_cmp(const void *a, const void *b) {
    const pie_beam *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    return 0;
}

/* A result beam from a token list (copied) and a score. */
static pie_beam make_result(const pie_model *m, const uint32_t *toks, size_t n, double score,
                            bool finished) {
    pie_beam r = {.n_tokens = n, .score = score, .finished = finished};
    r.tokens = pie_xmalloc((n ? n : 1) * sizeof *r.tokens);
    if (n) memcpy(r.tokens, toks, n * sizeof *toks);
    pie_buf b = {0};
    pie_decode(m, toks, n, &b);
    pie_buf_append(&b, "", 0);
    r.text = b.data;
    return r;
}

/* Appends one candidate's continuation to a live beam copy. */
static live_beam extend(const live_beam *parent, pie_ctx *ctx, uint32_t token, double score) {
    live_beam nb = {.ctx = ctx, .n_tokens = parent->n_tokens + 1, .score = score};
    nb.tokens = pie_xmalloc(nb.n_tokens * sizeof *nb.tokens);
    if (parent->n_tokens) memcpy(nb.tokens, parent->tokens, parent->n_tokens * sizeof *nb.tokens);
    nb.tokens[parent->n_tokens] = token;
    pie_ctx_push_token(ctx, token);
    return nb;
}

/* Scores every live beam's top-width continuations into cands; returns their count. */
static size_t expand(live_beam *live, size_t n_live, uint32_t width, candidate *cands,
                     pie_dists *ds) {
    uint32_t k = width;
    uint32_t max_k = live[0].ctx->model->info.max_top_k;
    if (max_k && k > max_k) k = max_k;
    uint32_t *futs = pie_xmalloc(n_live * sizeof *futs);
    for (size_t b = 0; b < n_live; b++) futs[b] = ctx_next_dist_issue(live[b].ctx, k);
    size_t n = 0;
    for (size_t b = 0; b < n_live; b++) {
        pie_dists_take(futs[b], ds);
        const pie_dist *d = &ds->d[0];
        for (uint32_t j = 0; j < d->k && j < width; j++) {
            if (d->probs[j] <= 0) continue;
            cands[n++] = (candidate){.score = live[b].score + log((double)d->probs[j]),
                                     .beam = (uint32_t)b,
                                     .rank = j,
                                     .token = d->ids[j]};
        }
    }
    free(futs);
    qsort(cands, n, sizeof *cands, candidate_cmp);
    return n;
}

/* Keeps the width best finished beams (sorted, best first). */
static void trim_done(pie_beam *done, size_t *n_done, uint32_t width) {
    qsort(done, *n_done, sizeof *done, beam_cmp);
    if (*n_done > width) {
        pie_beams_free(done + width, *n_done - width);
        *n_done = width;
    }
}

/* One step: the width best candidates become the next live beams (or finished ones). */
static size_t advance(const pie_model *m, const pie_stop *stop, uint32_t width, live_beam *live,
                      size_t n_live, const candidate *cands, size_t n_c, live_beam *next,
                      pie_beam *done, size_t *n_done) {
    pie_ctx **ctxs = pie_xcalloc(width, sizeof *ctxs);
    const candidate **picked = pie_xcalloc(width, sizeof *picked);
    bool *used = pie_xcalloc(n_live, sizeof *used);
    size_t n_next = 0;
    for (size_t i = 0; i < n_c && i < width; i++) {
        const candidate *k = &cands[i];
        const live_beam *p = &live[k->beam];
        if (pie_stop_is_token(stop, m, k->token)) {
            done[(*n_done)++] = make_result(m, p->tokens, p->n_tokens, k->score, true);
            continue;
        }
        /* A beam's first continuation keeps its context; later ones fork it. Nothing is
         * appended until every fork is made, so forks see the parent as it was. */
        ctxs[n_next] = used[k->beam] ? ctx_fork(p->ctx) : p->ctx;
        used[k->beam] = true;
        picked[n_next++] = k;
    }
    for (size_t i = 0; i < n_next; i++)
        next[i] = extend(&live[picked[i]->beam], ctxs[i], picked[i]->token, picked[i]->score);
    for (size_t b = 0; b < n_live; b++) {
        if (!used[b]) ctx_free(live[b].ctx);
        free(live[b].tokens);
    }
    free(used);
    free(picked);
    free(ctxs);
    return n_next;
}

size_t pie_beam_search(pie_ctx *c, uint32_t width, const pie_stop *stop, pie_beam *beams) {
    if (width == 0) pie_fatal("pie_beam_search: width 0");
    uint32_t max_tokens = stop->max_tokens ? stop->max_tokens : 64;
    const pie_model *m = c->model;
    live_beam *live = pie_xcalloc(width, sizeof *live), *next = pie_xcalloc(width, sizeof *next);
    candidate *cands = pie_xmalloc((size_t)width * width * sizeof *cands);
    pie_beam *done = pie_xcalloc((size_t)width * 2, sizeof *done);
    size_t n_live = 1, n_done = 0;
    live[0].ctx = ctx_fork(c);
    pie_dists ds = {0};
    for (uint32_t step = 0; step < max_tokens && n_live; step++) {
        /* Scores only fall: stop once the kept finished beams beat every live one. */
        if (n_done == width && done[width - 1].score >= live[0].score) break;
        size_t n_c = expand(live, n_live, width, cands, &ds);
        n_live = advance(m, stop, width, live, n_live, cands, n_c, next, done, &n_done);
        live_beam *t = live;
        live = next;
        next = t;
        trim_done(done, &n_done, width);
    }
    /* Unfinished beams compete with the finished ones. */
    size_t n = 0;
    pie_beam *all = pie_xcalloc(n_done + n_live + 1, sizeof *all);
    for (size_t i = 0; i < n_done; i++) all[n++] = done[i];
    for (size_t i = 0; i < n_live; i++) {
        all[n++] = make_result(m, live[i].tokens, live[i].n_tokens, live[i].score, false);
        ctx_free(live[i].ctx);
        free(live[i].tokens);
    }
    qsort(all, n, sizeof *all, beam_cmp);
    size_t keep = n < width ? n : width;
    memcpy(beams, all, keep * sizeof *beams);
    pie_beams_free(all + keep, n - keep);
    free(all);
    free(done);
    free(cands);
    free(live);
    free(next);
    pie_dists_free(&ds);
    return keep;
}

void pie_beams_free(pie_beam *beams, size_t n) {
    for (size_t i = 0; i < n; i++) {
        free(beams[i].tokens);
        free(beams[i].text);
        beams[i] = (pie_beam){0};
    }
}
