/* pie_ctx.c — the Context: one sequence's queue, KV pages, token history and hidden state.
 *
 * Owns: creating and freeing contexts, forwarding pending tokens in chunks into pages allocated
 * on demand, copy-on-write of shared pages, recomputing the last hidden state of a forked or
 * imported context, fork, export/import, token masks and dropping masked pages, truncation.
 * Does not own: decode loops and output text (pie_gen.c), beam search (pie_beam.c), the page
 * table (pie_res.c).
 *
 * Invariants (see pie.h): pages[0..used) hold kv_len tokens, used = ceil(kv_len / page_size),
 * all full but the last; pages[used..n_pages) are spare pages of this context (written earlier
 * and rolled back, or allocated ahead), always writable. */
#include <stdlib.h>
#include <string.h>

#include "pie_int.h"

uint32_t pie_ctx_page_size(const pie_ctx *c) { return c->model->info.kv_page_size; }

static size_t pages_for(const pie_ctx *c, size_t tokens) {
    size_t ps = pie_ctx_page_size(c);
    return (tokens + ps - 1) / ps;
}

pie_ctx *ctx_new(const pie_model *m) {
    if (!m) m = pie_model_get(NULL);
    if (m->info.kv_page_size == 0 || m->info.max_forward_tokens == 0)
        pie_fatal("model \"%s\" reports kv_page_size %u, max_forward_tokens %u", m->name,
                  (unsigned)m->info.kv_page_size, (unsigned)m->info.max_forward_tokens);
    pie_ctx *c = pie_xcalloc(1, sizeof *c);
    c->model = m;
    c->queue = pie_queue_create(m);
    c->add_bos = m->info.has_bos_token != 0;
    return c;
}

/* Releases one holder of each page; pages nobody holds any more are deallocated on c's queue. */
static void release_pages(pie_ctx *c, const uint32_t *ids, size_t n) {
    uint32_t *dead = pie_xmalloc((n ? n : 1) * sizeof *dead);
    size_t n_dead = 0;
    for (size_t i = 0; i < n; i++)
        if (pie_page_unref(ids[i]) == 0) dead[n_dead++] = ids[i];
    if (n_dead) pie_kv_pages_free(c->queue, dead, n_dead);
    free(dead);
}

void ctx_free(pie_ctx *c) {
    if (!c) return;
    /* Another holder may release a page later on its own queue: finish our reads first. */
    bool shared = false;
    for (size_t i = 0; i < c->n_pages && !shared; i++) shared = pie_page_holders(c->pages[i]) > 1;
    if (shared) pie_queue_sync(c->queue, "ctx_free");
    release_pages(c, c->pages, c->n_pages);
    if (c->n_in_embeds) pie_embeds_free(c->queue, c->in_embeds, c->n_in_embeds);
    if (c->n_out_embeds) pie_embeds_free(c->queue, c->out_embeds, c->n_out_embeds);
    pie_queue_sync(c->queue, "ctx_free");
    pie_queue_destroy(c->queue);
    free(c->pages);
    free(c->kv_masked);
    free(c->tokens);
    free(c->in_embeds);
    free(c->out_embeds);
    free(c);
}

/* ---- history ------------------------------------------------------------------------------- */

static void tokens_reserve(pie_ctx *c, size_t n) {
    if (n <= c->cap_tokens) return;
    size_t cap = c->cap_tokens ? c->cap_tokens : 64;
    while (cap < n) cap *= 2;
    c->tokens = pie_xrealloc(c->tokens, cap * sizeof *c->tokens);
    c->cap_tokens = cap;
}

void ctx_append_tokens(pie_ctx *c, const uint32_t *tokens, size_t n) {
    tokens_reserve(c, c->n_tokens + n);
    memcpy(c->tokens + c->n_tokens, tokens, n * sizeof *tokens);
    c->n_tokens += n;
    c->n_pending += (uint32_t)n;
    if (n) c->has_out = false;
}

void pie_ctx_push_token(pie_ctx *c, uint32_t t) { ctx_append_tokens(c, &t, 1); }

static void kv_masked_resize(pie_ctx *c, size_t n) {
    if (n > c->cap_kv_masked) {
        size_t cap = c->cap_kv_masked ? c->cap_kv_masked : 256;
        while (cap < n) cap *= 2;
        c->kv_masked = pie_xrealloc(c->kv_masked, cap);
        c->cap_kv_masked = cap;
    }
    if (n > c->kv_len) memset(c->kv_masked + c->kv_len, 0, n - c->kv_len);
}

/* ---- pages --------------------------------------------------------------------------------- */

static void pages_reserve(pie_ctx *c, size_t n) {
    if (n <= c->cap_pages) return;
    size_t cap = c->cap_pages ? c->cap_pages : 16;
    while (cap < n) cap *= 2;
    c->pages = pie_xrealloc(c->pages, cap * sizeof *c->pages);
    c->cap_pages = cap;
}

/* Replaces pages[i] (shared or pinned) by a private copy of its first `tokens` tokens. Waits
 * for the copy so that the other holders may free the original whenever they like. */
static void page_make_writable(pie_ctx *c, size_t i, uint32_t tokens) {
    uint32_t old = c->pages[i], fresh;
    pie_kv_pages_alloc(c->queue, &fresh, 1);
    if (tokens && pie_copy_kv_page(c->queue, old, fresh, 0, 0, tokens) < 0)
        pie_fatal("copy_kv_page %u -> %u (%u tokens): %s", (unsigned)old, (unsigned)fresh,
                  (unsigned)tokens, pie_error());
    pie_queue_sync(c->queue, "copy-on-write of a shared kv page");
    c->pages[i] = fresh;
    release_pages(c, &old, 1);
}

/* Makes sure pages[0..ceil((kv_len + n) / ps)) exist and the ones written by n more tokens are
 * writable. */
static void pages_prepare(pie_ctx *c, size_t n) {
    uint32_t ps = pie_ctx_page_size(c);
    size_t first = c->kv_len / ps, need = pages_for(c, c->kv_len + n);
    if (need > c->n_pages) {
        pages_reserve(c, need);
        pie_kv_pages_alloc(c->queue, c->pages + c->n_pages, need - c->n_pages);
        c->n_pages = need;
    }
    for (size_t i = first; i < need; i++) {
        if (pie_page_writable(c->pages[i])) continue;
        uint32_t keep = i == first ? c->kv_len % ps : 0;
        page_make_writable(c, i, keep);
    }
}

/* The ABI binds at most this many ids per call; a fill's chunk uses at most as many inputs. */
#define EMBEDS_PER_CALL 4096u

/* Grows *ids (held *have) towards want embeddings. The instance's embedding quota is not known
 * up front, so each growth is synchronized: when the quota refuses it, a smaller one is tried,
 * down to least. Returns false when even least could not be allocated (message in
 * pie_error()); any other failure is fatal. */
static bool embeds_grow(pie_ctx *c, uint32_t **ids, uint32_t *have, uint32_t want, uint32_t least) {
    if (*have >= want) return true;
    *ids = pie_xrealloc(*ids, want * sizeof **ids);
    uint32_t n = want;
    while (n > *have) {
        uint32_t k = n - *have, *fresh = *ids + *have;
        for (uint32_t i = 0; i < k; i++) fresh[i] = pie_id_get(PIE_ID_EMBED);
        if (pie_alloc_embeds(c->queue, fresh, k) < 0)
            pie_fatal("alloc_embeds (queue %u, %u ids): %s", (unsigned)c->queue, (unsigned)k,
                      pie_error());
        int32_t rc = pie_queue_sync_try(c->queue);
        if (rc >= 0) {
            *have = n;
            return true;
        }
        const char *msg = pie_error();
        if (rc != PIE_ABI_E_RESOURCE_EXHAUSTED || strncmp(msg, "alloc_embeds:", 13) != 0)
            pie_fatal("alloc_embeds (queue %u, %u ids) or a call before it failed: %s (code %d)",
                      (unsigned)c->queue, (unsigned)k, msg, (int)-rc);
        for (uint32_t i = 0; i < k; i++) pie_id_put(PIE_ID_EMBED, fresh[k - 1 - i]);
        if (n <= least) return false;
        n = *have + k / 2;
        if (n < least) n = least;
    }
    return true; /* held more than the quota allowed adding: keep those */
}

/* Gives back input embeddings [keep, n_in_embeds) (room for outputs). */
static void in_embeds_shrink(pie_ctx *c, uint32_t keep) {
    pie_embeds_free(c->queue, c->in_embeds + keep, c->n_in_embeds - keep);
    c->n_in_embeds = keep;
}

/* Makes sure the context holds n output embeddings, giving input ones back if the quota
 * leaves no room otherwise. */
static void out_embeds_reserve(pie_ctx *c, uint32_t n) {
    while (!embeds_grow(c, &c->out_embeds, &c->n_out_embeds, n, n)) {
        if (c->n_in_embeds == 0)
            pie_fatal("alloc_embeds: %u output embeddings: %s", (unsigned)n, pie_error());
        in_embeds_shrink(c, c->n_in_embeds / 2);
    }
}

/* Makes sure the context holds between 1 and want input embeddings (as many as the quota
 * allows) and returns how many of them a forward may use (<= want). */
static uint32_t in_embeds_reserve(pie_ctx *c, uint32_t want) {
    if (want > EMBEDS_PER_CALL) want = EMBEDS_PER_CALL;
    if (!embeds_grow(c, &c->in_embeds, &c->n_in_embeds, want, 1))
        pie_fatal("alloc_embeds: 1 input embedding: %s", pie_error());
    return c->n_in_embeds < want ? c->n_in_embeds : want;
}

/* ---- forward ------------------------------------------------------------------------------- */

/* Embeds toks[0..n) at positions pos0.. into the context's input embeddings (n of them held). */
static void embed(pie_ctx *c, const uint32_t *toks, uint32_t n, uint32_t pos0) {
    uint32_t *pos = pie_xmalloc(n * sizeof *pos);
    for (uint32_t i = 0; i < n; i++) pos[i] = pos0 + i;
    if (pie_embed_text(c->queue, c->in_embeds, toks, pos, n) < 0)
        pie_fatal("embed_text (%u tokens at position %u): %s", (unsigned)n, (unsigned)pos0,
                  pie_error());
    free(pos);
}

/* One forward of n inputs over a context of ctx_tokens tokens; stores the inputs' K/V after
 * them when store, and writes the last n_out outputs into out_embeds[0..n_out) (held). */
static void forward(pie_ctx *c, uint32_t ctx_tokens, uint32_t n, bool store, uint32_t n_out) {
    uint32_t ps = pie_ctx_page_size(c);
    uint32_t n_ctx_pages = (uint32_t)pages_for(c, ctx_tokens);
    uint32_t first_out = ctx_tokens / ps;
    uint32_t n_out_pages = store ? (uint32_t)pages_for(c, ctx_tokens + n) - first_out : 0;
    pie_abi_forward d = {
        .kv_page_ids = PIE_ADDR(c->pages),
        .n_kv_pages = n_ctx_pages,
        .kv_page_last_len = n_ctx_pages ? ctx_tokens - (n_ctx_pages - 1) * ps : 0,
        .input_embed_ids = PIE_ADDR(c->in_embeds),
        .n_inputs = n,
        .output_kv_page_ids = PIE_ADDR(c->pages + first_out),
        .n_output_kv_pages = n_out_pages,
        .output_embed_ids = PIE_ADDR(c->out_embeds),
        .n_outputs = n_out,
    };
    if (pie_forward(c->queue, &d) < 0)
        pie_fatal("forward (%u inputs over %u context tokens): %s", (unsigned)n,
                  (unsigned)ctx_tokens, pie_error());
}

void ctx_forward_pending(pie_ctx *c, uint32_t n_outputs, const uint32_t **outs) {
    uint32_t mft = c->model->info.max_forward_tokens, pending = c->n_pending;
    if (n_outputs > pending || n_outputs > mft)
        pie_fatal("ctx_forward_pending: %u outputs asked of %u pending tokens (at most %u)",
                  (unsigned)n_outputs, (unsigned)pending, (unsigned)mft);
    if (c->next_pos + pending > c->model->info.max_context_tokens)
        pie_fatal("ctx_forward_pending: %u tokens at position %u exceed the model's context of %u",
                  (unsigned)pending, (unsigned)c->next_pos,
                  (unsigned)c->model->info.max_context_tokens);
    if (pending == 0) {
        c->has_out = false;
        if (outs) *outs = c->out_embeds;
        return;
    }
    /* Chunks of at most mft tokens and at most the input embeddings the instance's quota
     * leaves (reused by every chunk); the first takes the remainder so the outputs all fall in
     * the last chunk. */
    out_embeds_reserve(c, n_outputs ? n_outputs : 1);
    uint32_t chunk = in_embeds_reserve(c, pending < mft ? pending : mft);
    if (n_outputs > chunk)
        pie_fatal("ctx_forward_pending: %u outputs need as many input embeddings, the instance's "
                  "quota leaves %u",
                  (unsigned)n_outputs, (unsigned)chunk);
    uint32_t n_chunks = (pending + chunk - 1) / chunk;
    const uint32_t *toks = c->tokens + (c->n_tokens - pending);
    for (uint32_t k = 0; k < n_chunks; k++) {
        uint32_t n = k == 0 ? pending - (n_chunks - 1) * chunk : chunk;
        pages_prepare(c, n);
        embed(c, toks, n, c->next_pos);
        bool last = k + 1 == n_chunks;
        forward(c, c->kv_len, n, true, last ? n_outputs : 0);
        kv_masked_resize(c, c->kv_len + n);
        c->kv_len += n;
        c->next_pos += n;
        toks += n;
    }
    c->n_pending = 0;
    c->has_out = n_outputs > 0;
    if (outs) *outs = c->out_embeds;
}

/* Recomputes the last token's hidden state without storing its K/V again (its page may be
 * shared): the token attends to the kv_len - 1 tokens before it. */
static void recompute_last(pie_ctx *c) {
    uint32_t t = c->tokens[c->n_tokens - 1];
    out_embeds_reserve(c, 1);
    in_embeds_reserve(c, 1);
    embed(c, &t, 1, c->next_pos - 1);
    forward(c, c->kv_len - 1, 1, false, 1);
    c->has_out = true;
}

void ctx_flush(pie_ctx *c) {
    if (c->n_pending) {
        ctx_forward_pending(c, 1, NULL);
        /* The hidden state of the last token is out_embeds[0]. */
    } else if (!c->has_out) {
        if (c->kv_len == 0) pie_fatal("ctx_flush: the context is empty: nothing to predict from");
        recompute_last(c);
    }
}

/* Appends tokens as pending, the model's BOS first on an empty context when add_bos (unless
 * tokens already start with it). */
static void append_prompt(pie_ctx *c, const uint32_t *tokens, size_t n) {
    if (c->n_tokens == 0 && c->add_bos) {
        uint32_t bos = c->model->info.bos_token_id;
        if (n == 0 || tokens[0] != bos) ctx_append_tokens(c, &bos, 1);
    }
    ctx_append_tokens(c, tokens, n);
}

void ctx_fill_tokens(pie_ctx *c, const uint32_t *tokens, size_t n) {
    append_prompt(c, tokens, n);
    ctx_flush(c);
}

void ctx_append_text(pie_ctx *c, const char *text, size_t len) {
    size_t n;
    uint32_t *ids = pie_encode(c->model, text, len, true, &n);
    append_prompt(c, ids, n);
    free(ids);
}

void ctx_fill(pie_ctx *c, const char *text) {
    ctx_append_text(c, text, strlen(text));
    ctx_flush(c);
}

void ctx_truncate(pie_ctx *c, size_t n) {
    if (n > c->n_tokens) pie_fatal("ctx_truncate: %zu tokens of %zu", n, c->n_tokens);
    size_t from_pending = n < c->n_pending ? n : c->n_pending;
    c->n_pending -= (uint32_t)from_pending;
    size_t from_kv = n - from_pending;
    if (from_kv > c->kv_len) pie_fatal("ctx_truncate: %zu stored tokens of %u", from_kv, c->kv_len);
    c->kv_len -= (uint32_t)from_kv;
    c->next_pos -= (uint32_t)from_kv;
    c->n_tokens -= n;
    c->has_out = false;
}

uint32_t ctx_next_dist_issue(pie_ctx *c, uint32_t top_k) {
    ctx_flush(c);
    return pie_next_dist_issue(c->queue, c->out_embeds, 1, top_k);
}

void ctx_next_dist(pie_ctx *c, uint32_t top_k, pie_dists *out) {
    pie_dists_take(ctx_next_dist_issue(c, top_k), out);
}

/* ---- fork, export, import ------------------------------------------------------------------ */

pie_ctx *ctx_fork(pie_ctx *c) {
    pie_queue_sync(c->queue, "ctx_fork"); /* the shared pages must be complete */
    pie_ctx *f = ctx_new(c->model);
    f->add_bos = c->add_bos;
    size_t used = pages_for(c, c->kv_len);
    pages_reserve(f, used);
    for (size_t i = 0; i < used; i++) {
        f->pages[i] = c->pages[i];
        pie_page_ref(c->pages[i]);
    }
    f->n_pages = used;
    kv_masked_resize(f, c->kv_len);
    if (c->kv_len) memcpy(f->kv_masked, c->kv_masked, c->kv_len);
    f->kv_len = c->kv_len;
    tokens_reserve(f, c->n_tokens);
    memcpy(f->tokens, c->tokens, c->n_tokens * sizeof *c->tokens);
    f->n_tokens = c->n_tokens;
    f->n_pending = c->n_pending;
    f->next_pos = c->next_pos;
    return f;
}

int32_t ctx_export_try(pie_ctx *c, const char *name, bool persistent) {
    if (c->n_pending) ctx_forward_pending(c, 0, NULL);
    size_t used = pages_for(c, c->kv_len);
    if (used == 0) pie_fatal("ctx_export \"%s\": the context holds no tokens", name);
    int32_t rc = pie_export_kv_pages(c->queue, c->pages, (uint32_t)used, name,
                                     (uint32_t)strlen(name), persistent);
    if (rc >= 0) rc = pie_queue_sync_try(c->queue); /* ALREADY_EXISTS arrives deferred */
    if (rc < 0) return rc;
    for (size_t i = 0; i < used; i++) pie_page_pin(c->pages[i]);
    return 0;
}

void ctx_export(pie_ctx *c, const char *name, bool persistent) {
    int32_t rc = ctx_export_try(c, name, persistent);
    if (rc < 0) pie_fatal("export_kv_pages \"%s\": %s (code %d)", name, pie_error(), (int)-rc);
}

void ctx_unexport(pie_ctx *c, const char *name) {
    if (pie_unexport_kv_pages(c->queue, name, (uint32_t)strlen(name)) < 0)
        pie_fatal("unexport_kv_pages \"%s\": %s", name, pie_error());
}

static uint32_t payload_u32(const pie_buf *b, size_t i) {
    uint32_t v;
    memcpy(&v, b->data + 4 * i, sizeof v);
    return v;
}

int32_t ctx_import_try(pie_ctx *c, const char *name, const uint32_t *tokens, size_t n) {
    if (c->n_tokens || c->n_pages)
        pie_fatal("ctx_import \"%s\": the context already holds %zu tokens", name, c->n_tokens);
    size_t want = pages_for(c, n);
    if (want == 0) pie_fatal("ctx_import \"%s\": no tokens given", name);
    pages_reserve(c, want);
    for (size_t i = 0; i < want; i++) c->pages[i] = pie_id_get(PIE_ID_KV_PAGE);
    uint32_t f = pie_future_new();
    int32_t rc = pie_import_kv_pages(c->queue, c->pages, (uint32_t)want, name,
                                     (uint32_t)strlen(name), f);
    pie_buf b = {0};
    if (rc < 0) pie_id_put(PIE_ID_FUTURE, f);
    else rc = pie_future_take_try(f, &b);
    uint32_t got = rc >= 0 && b.len >= 4 ? payload_u32(&b, 0) : 0;
    pie_buf_free(&b);
    if (rc >= 0 && got != want) {
        /* Bound fewer pages than the tokens need: give them back and report it. */
        if (got) pie_kv_pages_free(c->queue, c->pages, got); /* pages untracked: plain free */
        for (size_t i = got; i < want; i++) pie_id_put(PIE_ID_KV_PAGE, c->pages[i]);
        pie_fatal("ctx_import \"%s\": the export has %u pages, %zu tokens need %zu", name,
                  (unsigned)got, n, want);
    }
    if (rc < 0) {
        for (size_t i = 0; i < want; i++) pie_id_put(PIE_ID_KV_PAGE, c->pages[i]);
        return rc;
    }
    for (size_t i = 0; i < want; i++) {
        pie_page_track(c->pages[i]);
        pie_page_pin(c->pages[i]);
    }
    c->n_pages = want;
    kv_masked_resize(c, n);
    c->kv_len = (uint32_t)n;
    tokens_reserve(c, n);
    memcpy(c->tokens, tokens, n * sizeof *tokens);
    c->n_tokens = n;
    c->next_pos = (uint32_t)n;
    c->has_out = false;
    return 0;
}

void ctx_import(pie_ctx *c, const char *name, const uint32_t *tokens, size_t n) {
    int32_t rc = ctx_import_try(c, name, tokens, n);
    if (rc < 0) pie_fatal("import_kv_pages \"%s\": %s (code %d)", name, pie_error(), (int)-rc);
}

/* ---- masks --------------------------------------------------------------------------------- */

/* Sends page i's mask (tokens past kv_len are visible). */
static void page_send_mask(pie_ctx *c, size_t i) {
    uint32_t ps = pie_ctx_page_size(c);
    uint8_t *m = pie_xcalloc(ps, 1);
    size_t base = i * ps;
    for (uint32_t j = 0; j < ps && base + j < c->kv_len; j++) m[j] = c->kv_masked[base + j];
    if (pie_mask_kv_page(c->queue, c->pages[i], m, ps) < 0)
        pie_fatal("mask_kv_page %u: %s", (unsigned)c->pages[i], pie_error());
    free(m);
}

void ctx_mask_tokens(pie_ctx *c, uint32_t start, uint32_t count, bool masked) {
    if (count == 0) return;
    if (start > c->kv_len || count > c->kv_len - start)
        pie_fatal("ctx_mask_tokens: tokens [%u, %u) outside the %u stored ones", (unsigned)start,
                  (unsigned)(start + count), (unsigned)c->kv_len);
    uint32_t ps = pie_ctx_page_size(c);
    memset(c->kv_masked + start, masked ? 1 : 0, count);
    size_t last = pages_for(c, c->kv_len) - 1;
    for (size_t i = start / ps; i <= (start + count - 1) / ps; i++) {
        if (!pie_page_writable(c->pages[i]))
            page_make_writable(c, i, i == last ? c->kv_len - (uint32_t)(i * ps) : ps);
        page_send_mask(c, i);
    }
}

size_t ctx_drop_masked_pages(pie_ctx *c) {
    uint32_t ps = pie_ctx_page_size(c);
    size_t used = pages_for(c, c->kv_len), dropped = 0, keep = 0;
    for (size_t i = 0; i < used; i++) {
        bool all = i + 1 < used; /* the last page always stays */
        for (uint32_t j = 0; j < ps && all; j++) all = c->kv_masked[i * ps + j] != 0;
        if (all) {
            release_pages(c, &c->pages[i], 1);
            dropped++;
            continue;
        }
        /* compact the pages and their token masks */
        c->pages[keep] = c->pages[i];
        size_t tokens_here = i + 1 < used ? ps : c->kv_len - i * ps;
        memmove(c->kv_masked + keep * ps, c->kv_masked + i * ps, tokens_here);
        keep++;
    }
    memmove(c->pages + keep, c->pages + used, (c->n_pages - used) * sizeof *c->pages);
    c->n_pages -= dropped;
    c->kv_len -= (uint32_t)(dropped * ps);
    return dropped;
}

char *ctx_text(const pie_ctx *c) {
    pie_buf b = {0};
    pie_decode(c->model, c->tokens, c->n_tokens, &b);
    pie_buf_append(&b, "", 0);
    return b.data;
}
