/* pie_gen.c — decode loops: plain generation and draft-and-verify (speculative) generation, and
 * the output they fill (tokens, text, stop strings, streaming).
 *
 * Owns: pie_output bookkeeping, stop-string detection with hold-back of text that may still
 * become a stop string, ctx_generate, ctx_generate_drafted.
 * Does not own: forwarding and pages (pie_ctx.c), sampling (pie_sample.c). */
#include <stdlib.h>
#include <string.h>

#include "pie_int.h"

/* ==== output ================================================================================== */

void pie_output_start(pie_output *o, const pie_model *m) {
    if (o->started) return;
    pie_detok_init(&o->detok, m);
    o->started = true;
}

void pie_output_free(pie_output *o) {
    pie_buf_free(&o->text);
    free(o->tokens);
    if (o->started) pie_detok_free(&o->detok);
    *o = (pie_output){0};
}

size_t pie_output_held(const pie_output *o) {
    return o->text.len - o->emitted + (o->started ? o->detok.pending.len : 0);
}

/* First occurrence of any stop string in text[from..len); SIZE_MAX when none. */
static size_t find_stop_string(const pie_stop *stop, const pie_buf *text, size_t from) {
    size_t best = SIZE_MAX;
    for (size_t i = 0; i < stop->n_stop_strings; i++) {
        const char *s = stop->stop_strings[i];
        size_t sl = strlen(s);
        if (sl == 0 || text->len < sl) continue;
        for (size_t at = from; at + sl <= text->len && at < best; at++)
            if (memcmp(text->data + at, s, sl) == 0) {
                best = at;
                break;
            }
    }
    return best;
}

/* Bytes at the end of text that are a proper prefix of some stop string (may still become one). */
static size_t stop_prefix_tail(const pie_stop *stop, const pie_buf *text) {
    size_t hold = 0;
    for (size_t i = 0; i < stop->n_stop_strings; i++) {
        const char *s = stop->stop_strings[i];
        size_t sl = strlen(s);
        for (size_t k = sl > 0 ? sl - 1 : 0; k > hold; k--)
            if (k <= text->len && memcmp(text->data + text->len - k, s, k) == 0) {
                hold = k;
                break;
            }
    }
    return hold;
}

static size_t max_stop_len(const pie_stop *stop) {
    size_t m = 0;
    for (size_t i = 0; i < stop->n_stop_strings; i++) {
        size_t l = strlen(stop->stop_strings[i]);
        if (l > m) m = l;
    }
    return m;
}

static void emit_upto(pie_output *o, size_t end) {
    if (end <= o->emitted) return;
    if (o->on_text) o->on_text(o->on_text_arg, o->text.data + o->emitted, end - o->emitted);
    o->emitted = end;
}

/* Checks the text appended since `before` for stop strings; cuts the text at a match. */
static bool settle_text(pie_output *o, const pie_stop *stop, size_t before, bool final) {
    size_t ml = max_stop_len(stop);
    size_t from = before > ml ? before - ml + 1 : 0;
    if (from < o->emitted) from = o->emitted; /* emitted text holds no stop string */
    size_t at = find_stop_string(stop, &o->text, from);
    if (at != SIZE_MAX) {
        o->text.len = at;
        o->text.data[at] = 0;
        emit_upto(o, at);
        return true;
    }
    emit_upto(o, final ? o->text.len : o->text.len - stop_prefix_tail(stop, &o->text));
    return false;
}

bool pie_output_push(pie_output *o, const pie_stop *stop, uint32_t t) {
    if (o->n_tokens == o->cap_tokens) {
        o->cap_tokens = o->cap_tokens ? o->cap_tokens * 2 : 64;
        o->tokens = pie_xrealloc(o->tokens, o->cap_tokens * sizeof *o->tokens);
    }
    o->tokens[o->n_tokens++] = t;
    size_t before = o->text.len;
    pie_detok_push(&o->detok, t, &o->text);
    return settle_text(o, stop, before, false);
}

void pie_output_finish(pie_output *o, const pie_stop *stop) {
    if (o->reason == PIE_STOP_STRING) { /* the text ends where the stop string began */
        pie_buf_clear(&o->detok.pending);
        return;
    }
    size_t before = o->text.len;
    pie_detok_flush(&o->detok, &o->text);
    if (settle_text(o, stop, before, true)) o->reason = PIE_STOP_STRING;
}

/* ==== plain generation ======================================================================== */

/* Why generation cannot take one more token now, or PIE_STOP_NONE. */
static pie_stop_reason budget_left(const pie_ctx *c, const pie_stop *stop, size_t generated,
                                   uint32_t extra) {
    if (stop->max_tokens && generated >= stop->max_tokens) return PIE_STOP_MAX_TOKENS;
    if ((uint64_t)c->next_pos + c->n_pending + extra >= c->model->info.max_context_tokens)
        return PIE_STOP_CONTEXT;
    return PIE_STOP_NONE;
}

/* Samples one token from d, records it; returns the stop reason it caused (or NONE). The token
 * is appended to c's history as pending unless it is a stop token. */
static pie_stop_reason take_token(pie_ctx *c, pie_sampler *s, const pie_stop *stop,
                                  pie_output *out, pie_dist *d, uint32_t *picked) {
    uint32_t t = pie_sample(s, c->tokens, c->n_tokens, d);
    *picked = t;
    if (pie_stop_is_token(stop, c->model, t)) return PIE_STOP_TOKEN;
    pie_ctx_push_token(c, t);
    return pie_output_push(out, stop, t) ? PIE_STOP_STRING : PIE_STOP_NONE;
}

void pie_gen_start(pie_gen *g, pie_ctx *c, pie_sampler *s, const pie_stop *stop,
                   pie_output *out) {
    *g = (pie_gen){.ctx = c, .sampler = s, .stop = stop, .out = out};
    pie_output_start(out, c->model);
}

static void gen_finish(pie_gen *g, pie_stop_reason r) {
    g->done = true;
    pie_dists_free(&g->dists);
    g->out->reason = r;
    pie_output_finish(g->out, g->stop);
}

bool pie_gen_issue(pie_gen *g) {
    if (g->done) return false;
    pie_stop_reason r = budget_left(g->ctx, g->stop, g->generated, 0);
    if (r != PIE_STOP_NONE) {
        gen_finish(g, r);
        return false;
    }
    g->future = ctx_next_dist_issue(g->ctx, g->sampler->dist_k);
    return true;
}

bool pie_gen_take(pie_gen *g) {
    if (g->done) return false;
    if (!g->future) pie_fatal("pie_gen_take: no next_dist issued (call pie_gen_issue first)");
    pie_dists_take(g->future, &g->dists);
    g->future = 0;
    uint32_t t;
    pie_stop_reason r = take_token(g->ctx, g->sampler, g->stop, g->out, &g->dists.d[0], &t);
    if (r != PIE_STOP_NONE) {
        gen_finish(g, r);
        return false;
    }
    g->generated++;
    return true;
}

void pie_gen_run_all(pie_gen *gens, size_t n) {
    for (;;) {
        size_t live = 0;
        for (size_t i = 0; i < n; i++) live += pie_gen_issue(&gens[i]);
        if (!live) return;
        for (size_t i = 0; i < n; i++)
            if (gens[i].future) pie_gen_take(&gens[i]);
    }
}

void ctx_generate(pie_ctx *c, pie_sampler *s, const pie_stop *stop, pie_output *out) {
    pie_gen g;
    pie_gen_start(&g, c, s, stop, out);
    pie_gen_run_all(&g, 1);
}

char *ctx_generate_text(pie_ctx *c, pie_sampler *s, const pie_stop *stop) {
    pie_output o = {0};
    ctx_generate(c, s, stop, &o);
    char *text = pie_xstrdup(o.text.data ? o.text.data : "");
    pie_output_free(&o);
    return text;
}

/* ==== draft and verify ======================================================================== */

/* One verification step: forwards the pending tokens plus the drafts, samples at each position
 * and keeps the drafts the samples agree with. Returns the stop reason (or NONE); adds to
 * *generated. */
static pie_stop_reason verify_step(pie_ctx *c, pie_sampler *s, const pie_stop *stop,
                                   pie_drafter *dr, pie_output *out, pie_spec_stats *st,
                                   size_t *generated, pie_dists *ds, uint32_t *drafts) {
    uint32_t mft = c->model->info.max_forward_tokens;
    size_t room = mft > c->n_pending ? mft - c->n_pending : 0;
    if (dr->max_draft < room) room = dr->max_draft;
    if (stop->max_tokens && stop->max_tokens - *generated - 1 < room)
        room = stop->max_tokens - *generated - 1;
    size_t ctx_room = c->model->info.max_context_tokens - c->next_pos - c->n_pending - 1;
    if (ctx_room < room) room = ctx_room;
    size_t nd = room ? dr->propose(dr->state, c->tokens, c->n_tokens, drafts, room) : 0;
    if (nd > room) pie_fatal("drafter proposed %zu tokens, at most %zu were asked", nd, room);
    ctx_append_tokens(c, drafts, nd);
    const uint32_t *outs;
    ctx_forward_pending(c, (uint32_t)nd + 1, &outs);
    pie_dists_take(pie_next_dist_issue(c->queue, outs, nd + 1, s->dist_k), ds);
    st->steps++;
    st->drafted += nd;
    /* The history now ends with the nd drafts; verify them one by one. */
    ctx_truncate(c, nd);
    for (size_t i = 0; i <= nd; i++) {
        uint32_t t;
        pie_stop_reason r = take_token(c, s, stop, out, &ds->d[i], &t);
        bool agrees = i < nd && t == drafts[i];
        if (r == PIE_STOP_NONE) (*generated)++;
        if (agrees) {
            /* The accepted draft's K/V is stored already: re-admit it instead of pending. */
            st->accepted++;
            c->n_pending--;
            c->kv_len++;
            c->next_pos++;
        }
        if (r != PIE_STOP_NONE) return r;
        if (!agrees) return PIE_STOP_NONE; /* t is pending; the rest of the drafts are gone */
        if (stop->max_tokens && *generated >= stop->max_tokens) return PIE_STOP_MAX_TOKENS;
    }
    return PIE_STOP_NONE;
}

void ctx_generate_drafted(pie_ctx *c, pie_sampler *s, const pie_stop *stop, pie_drafter *d,
                          pie_output *out, pie_spec_stats *stats) {
    pie_output_start(out, c->model);
    pie_spec_stats local = {0};
    if (!stats) stats = &local;
    pie_dists ds = {0};
    uint32_t mft = c->model->info.max_forward_tokens;
    uint32_t *drafts = pie_xmalloc((size_t)mft * sizeof *drafts);
    size_t generated = 0;
    pie_stop_reason r;
    while ((r = budget_left(c, stop, generated, 0)) == PIE_STOP_NONE) {
        if (c->n_pending == 0 || c->n_pending >= mft) { /* nothing to verify drafts after */
            ctx_next_dist(c, s->dist_k, &ds);
            uint32_t t;
            r = take_token(c, s, stop, out, &ds.d[0], &t);
            if (r != PIE_STOP_NONE) break;
            generated++;
            continue;
        }
        r = verify_step(c, s, stop, d, out, stats, &generated, &ds, drafts);
        if (r != PIE_STOP_NONE) break;
    }
    out->reason = r;
    pie_output_finish(out, stop);
    free(drafts);
    pie_dists_free(&ds);
}
