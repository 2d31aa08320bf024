/* tok_encode.c — text to token ids.
 *
 * Owns: the encode pipeline of one call: added tokens are matched first (a byte trie, leftmost
 * longest); the text between them runs through the pre-tokenizer steps (PCRE2 Split with its
 * five behaviors, ByteLevel with add_prefix_space and the GPT-2 regex) depth-first, piece by
 * piece, so memory stays proportional to the output; every piece goes through BPE.
 *
 * BPE of one piece: the bytes become one-byte tokens in a linked list; a binary min-heap holds
 * candidate merges keyed by (rank, position of the left symbol), so the best-ranked, leftmost
 * merge is applied first, as in HF tokenizers; stale heap entries are skipped by re-checking
 * the pair in the merge table. With ignore_merges (Llama 3), a piece that is itself in the
 * vocab is one token. A per-call cache maps pieces already seen in this text to the range of
 * output ids they produced, so repeated words cost one hash lookup.
 *
 * Everything mutable lives in a tok_ws made per call: tok_encode is safe to run on many
 * threads over one tok. */
#include <inttypes.h>
#include <stdlib.h>

#include "pie_utf8.h"
#include "tok_int.h"

/* Pieces longer than this are not cached (they rarely repeat). */
#define TOK_CACHE_MAX_PIECE 64

typedef struct tok_cache_slot {
    const uint8_t *p; /* NULL = empty */
    uint32_t n, n_ids;
    size_t out_off;
} tok_cache_slot;

/* Arena for pieces that get a prefix space (their bytes are not in the caller's text). */
typedef struct tok_chunk {
    struct tok_chunk *next;
    size_t used, cap;
    uint8_t data[];
} tok_chunk;

typedef struct tok_ws {
    const tok *t;
    pie_status *st;
    const uint8_t *text; /* the caller's text, for error offsets */
    size_t text_len;

    uint32_t *out;
    size_t n_out, cap_out;

    pcre2_match_data *md;
    tok_chunk *chunks;

    /* BPE scratch for one piece, [cap_sym] each */
    uint32_t *sym_id, *sym_prev, *sym_next;
    uint64_t *heap; /* rank << 32 | left position */
    size_t cap_sym;

    tok_cache_slot *cache;
    size_t cache_mask, cache_used;
} tok_ws;

static pie_code ws_oom(tok_ws *w) {
    return pie_status_set(w->st, PIE_RESOURCE_EXHAUSTED,
                          "tok: encode: out of memory (text of %zu bytes, %zu ids so far)",
                          w->text_len, w->n_out);
}

static pie_code out_reserve(tok_ws *w, size_t more) {
    if (w->cap_out - w->n_out >= more) return PIE_OK;
    size_t cap = w->cap_out ? w->cap_out : 64;
    while (cap - w->n_out < more) {
        if (cap > SIZE_MAX / 2 / sizeof *w->out) return ws_oom(w);
        cap *= 2;
    }
    uint32_t *o = realloc(w->out, cap * sizeof *o);
    if (o == NULL) return ws_oom(w);
    w->out = o;
    w->cap_out = cap;
    return PIE_OK;
}

static pie_code emit(tok_ws *w, uint32_t id) {
    pie_code rc = out_reserve(w, 1);
    if (rc != PIE_OK) return rc;
    w->out[w->n_out++] = id;
    return PIE_OK;
}

/* ---- the merge loop ---- */

static void heap_push(uint64_t *h, size_t *n, uint64_t v) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (h[parent] <= v) break;
        h[i] = h[parent];
        i = parent;
    }
    h[i] = v;
}

static uint64_t heap_pop(uint64_t *h, size_t *n) {
    uint64_t top = h[0];
    uint64_t v = h[--(*n)];
    size_t i = 0, len = *n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= len) break;
        if (c + 1 < len && h[c + 1] < h[c]) c++;
        if (h[c] >= v) break;
        h[i] = h[c];
        i = c;
    }
    if (len > 0) h[i] = v;
    return top;
}

static pie_code scratch_reserve(tok_ws *w, size_t n) {
    if (n <= w->cap_sym) return PIE_OK;
    size_t cap = w->cap_sym ? w->cap_sym : 64;
    while (cap < n) cap *= 2;
    uint32_t *a = realloc(w->sym_id, cap * sizeof *a);
    if (a == NULL) return ws_oom(w);
    w->sym_id = a;
    a = realloc(w->sym_prev, cap * sizeof *a);
    if (a == NULL) return ws_oom(w);
    w->sym_prev = a;
    a = realloc(w->sym_next, cap * sizeof *a);
    if (a == NULL) return ws_oom(w);
    w->sym_next = a;
    /* Each merge pushes at most two entries and the start pushes n - 1: 3n bounds the heap. */
    uint64_t *h = realloc(w->heap, 3 * cap * sizeof *h);
    if (h == NULL) return ws_oom(w);
    w->heap = h;
    w->cap_sym = cap;
    return PIE_OK;
}

static pie_code missing_byte(tok_ws *w, const uint8_t *p) {
    if (p >= w->text && p < w->text + w->text_len)
        return pie_status_set(w->st, PIE_INVALID_ARGUMENT,
                              "tok: encode: byte 0x%02X at offset %zu has no token in model.vocab "
                              "and model.unk_token is not set",
                              *p, (size_t)(p - w->text));
    return pie_status_set(w->st, PIE_INVALID_ARGUMENT,
                          "tok: encode: byte 0x%02X (of an added prefix space) has no token in "
                          "model.vocab and model.unk_token is not set",
                          *p);
}

/* Runs BPE over the n bytes at p (n >= 1) and appends the ids. */
static pie_code bpe(tok_ws *w, const uint8_t *p, size_t n) {
    const tok *t = w->t;
    if (n >= UINT32_MAX)
        return pie_status_set(w->st, PIE_RESOURCE_EXHAUSTED,
                              "tok: encode: a pre-token of %zu bytes is longer than 4 GiB", n);
    pie_code rc = scratch_reserve(w, n);
    if (rc != PIE_OK) return rc;
    uint32_t *id = w->sym_id, *prev = w->sym_prev, *next = w->sym_next;
    for (size_t i = 0; i < n; i++) {
        id[i] = t->byte_id[p[i]];
        if (id[i] == TOK_NO_ID) {
            if (t->unk_id == TOK_NO_ID) return missing_byte(w, p + i);
            id[i] = t->unk_id;
        }
        prev[i] = (uint32_t)i - 1; /* UINT32_MAX for the first: no symbol */
        next[i] = (uint32_t)i + 1; /* n for the last */
    }
    size_t nh = 0;
    for (size_t i = 0; i + 1 < n; i++) {
        const tok_merge_slot *m = tok_merge_find(t, id[i], id[i + 1]);
        if (m != NULL) heap_push(w->heap, &nh, (uint64_t)m->rank << 32 | i);
    }
    while (nh > 0) {
        uint64_t top = heap_pop(w->heap, &nh);
        uint32_t l = (uint32_t)top, rank = (uint32_t)(top >> 32);
        if (id[l] == TOK_NO_ID || next[l] >= n) continue; /* merged away, or now the last */
        uint32_t r = next[l];
        const tok_merge_slot *m = tok_merge_find(t, id[l], id[r]);
        if (m == NULL || m->rank != rank) continue; /* the pair changed since it was pushed */
        id[l] = m->id;
        id[r] = TOK_NO_ID;
        next[l] = next[r];
        if (next[r] < n) prev[next[r]] = l;
        if (prev[l] != UINT32_MAX) {
            const tok_merge_slot *pm = tok_merge_find(t, id[prev[l]], id[l]);
            if (pm != NULL) heap_push(w->heap, &nh, (uint64_t)pm->rank << 32 | prev[l]);
        }
        if (next[l] < n) {
            const tok_merge_slot *nm = tok_merge_find(t, id[l], id[next[l]]);
            if (nm != NULL) heap_push(w->heap, &nh, (uint64_t)nm->rank << 32 | l);
        }
    }
    size_t count = 0;
    for (uint32_t i = 0; i < n; i = next[i]) count++;
    rc = out_reserve(w, count);
    if (rc != PIE_OK) return rc;
    for (uint32_t i = 0; i < n; i = next[i]) w->out[w->n_out++] = id[i];
    return PIE_OK;
}

/* ---- one pre-token ---- */

static tok_cache_slot *cache_slot(tok_ws *w, const uint8_t *p, size_t n) {
    uint64_t h = tok_hash(p, n);
    for (size_t i = h & w->cache_mask;; i = (i + 1) & w->cache_mask) {
        tok_cache_slot *s = &w->cache[i];
        if (s->p == NULL || (s->n == n && memcmp(s->p, p, n) == 0)) return s;
    }
}

static pie_code encode_piece(tok_ws *w, const uint8_t *p, size_t n) {
    const tok *t = w->t;
    if (n == 0) return PIE_OK;
    if (n == 1) {
        uint32_t id = t->byte_id[p[0]];
        if (id == TOK_NO_ID) {
            if (t->unk_id == TOK_NO_ID) return missing_byte(w, p);
            id = t->unk_id;
        }
        return emit(w, id);
    }
    if (t->ignore_merges) {
        uint32_t id = tok_vocab_find(t, p, n);
        if (id != TOK_NO_ID) return emit(w, id);
    }
    tok_cache_slot *slot = NULL;
    if (n <= TOK_CACHE_MAX_PIECE && w->cache != NULL) {
        slot = cache_slot(w, p, n);
        if (slot->p != NULL) {
            pie_code rc = out_reserve(w, slot->n_ids);
            if (rc != PIE_OK) return rc;
            memcpy(w->out + w->n_out, w->out + slot->out_off, slot->n_ids * sizeof *w->out);
            w->n_out += slot->n_ids;
            return PIE_OK;
        }
        if (w->cache_used * 2 >= w->cache_mask) slot = NULL; /* full enough: stop inserting */
    }
    size_t start = w->n_out;
    pie_code rc = bpe(w, p, n);
    if (rc != PIE_OK) return rc;
    if (slot != NULL) {
        *slot = (tok_cache_slot){.p = p, .n = (uint32_t)n, .n_ids = (uint32_t)(w->n_out - start),
                                 .out_off = start};
        w->cache_used++;
    }
    return PIE_OK;
}

/* ---- pre-tokenizer steps ---- */

static pie_code run_steps(tok_ws *w, size_t step, const uint8_t *p, size_t n);

/* Splitting one piece: spans come in text order and are grouped into output pieces according to
 * the behavior, with at most one pending piece held back. */
typedef struct tok_splitter {
    tok_ws *w;
    size_t step; /* the Split step; output pieces go to step + 1 */
    tok_split_behavior behavior;
    bool invert;
    const uint8_t *base;
    bool has_pending, pending_match;
    size_t pending_start, pending_end;
} tok_splitter;

static pie_code split_flush(tok_splitter *s) {
    if (!s->has_pending) return PIE_OK;
    s->has_pending = false;
    return run_steps(s->w, s->step + 1, s->base + s->pending_start,
                     s->pending_end - s->pending_start);
}

static pie_code split_hold(tok_splitter *s, size_t start, size_t end, bool match) {
    pie_code rc = split_flush(s);
    s->has_pending = true;
    s->pending_start = start;
    s->pending_end = end;
    s->pending_match = match;
    return rc;
}

/* One span [start, end) that did (match) or did not match the pattern. */
static pie_code split_span(tok_splitter *s, size_t start, size_t end, bool match) {
    if (s->invert) match = !match;
    switch (s->behavior) {
    case TOK_SPLIT_ISOLATED:
        return run_steps(s->w, s->step + 1, s->base + start, end - start);
    case TOK_SPLIT_REMOVED:
        return match ? PIE_OK : run_steps(s->w, s->step + 1, s->base + start, end - start);
    case TOK_SPLIT_MERGED_WITH_PREVIOUS: /* a match joins the non-match before it */
        if (match && s->has_pending && !s->pending_match) {
            s->pending_end = end;
            s->pending_match = true;
            return PIE_OK;
        }
        return split_hold(s, start, end, match);
    case TOK_SPLIT_MERGED_WITH_NEXT: /* a match joins the non-match after it */
        if (!match && s->has_pending && s->pending_match) {
            s->pending_end = end;
            s->pending_match = false;
            return split_flush(s);
        }
        return split_hold(s, start, end, match);
    case TOK_SPLIT_CONTIGUOUS: /* runs of matches become one piece */
        if (match && s->has_pending && s->pending_match) {
            s->pending_end = end;
            return PIE_OK;
        }
        return split_hold(s, start, end, match);
    }
    return PIE_OK;
}

static pie_code regex_failed(tok_ws *w, int rc, const uint8_t *p, size_t pos) {
    PCRE2_UCHAR msg[160];
    if (pcre2_get_error_message(rc, msg, sizeof msg) < 0) strcpy((char *)msg, "?");
    size_t off = p >= w->text && p < w->text + w->text_len ? (size_t)(p - w->text) + pos : pos;
    return pie_status_set(w->st, PIE_RESOURCE_EXHAUSTED,
                          "tok: encode: the pre-tokenizer regex failed near byte %zu: %s", off,
                          (const char *)msg);
}

static pie_code split_piece(tok_ws *w, size_t step, const pcre2_code *re, tok_split_behavior b,
                            bool invert, const uint8_t *p, size_t n) {
    tok_splitter s = {.w = w, .step = step, .behavior = b, .invert = invert, .base = p};
    size_t pos = 0, last = 0;
    pie_code rc = PIE_OK;
    while (pos < n) {
        int m = pcre2_match(re, p, n, pos, 0, w->md, NULL);
        if (m == PCRE2_ERROR_NOMATCH) break;
        if (m < 0) return regex_failed(w, m, p, pos);
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(w->md);
        size_t ms = ov[0], me = ov[1];
        if (ms < last || me < ms || me > n) /* \K or lookbehind tricks; cannot happen for HF patterns */
            return pie_status_set(w->st, PIE_INTERNAL,
                                  "tok: encode: the pre-tokenizer regex reported match [%zu, %zu) "
                                  "outside [%zu, %zu)", ms, me, last, n);
        if (ms > last) rc = split_span(&s, last, ms, false);
        if (rc == PIE_OK && me > ms) rc = split_span(&s, ms, me, true);
        if (rc != PIE_OK) return rc;
        if (me > ms) {
            last = pos = me;
        } else { /* empty match: skipped; step over one character (or one invalid byte) */
            last = ms;
            size_t k = pie_utf8_next(p + ms, n - ms, NULL);
            pos = ms + (k ? k : 1);
        }
    }
    if (last < n) rc = split_span(&s, last, n, false);
    if (rc == PIE_OK) rc = split_flush(&s);
    return rc;
}

/* Bytes that live as long as the call: a prefix space plus a piece. */
static uint8_t *arena_alloc(tok_ws *w, size_t n) {
    tok_chunk *c = w->chunks;
    if (c == NULL || c->cap - c->used < n) {
        size_t cap = n > 65536 ? n : 65536;
        c = malloc(sizeof *c + cap);
        if (c == NULL) return NULL;
        c->next = w->chunks;
        c->used = 0;
        c->cap = cap;
        w->chunks = c;
    }
    uint8_t *r = c->data + c->used;
    c->used += n;
    return r;
}

/* Applies steps[step..] to the piece p[0..n), then BPE. */
static pie_code run_steps(tok_ws *w, size_t step, const uint8_t *p, size_t n) {
    if (n == 0) return PIE_OK; /* empty pieces are dropped, as HF does */
    const tok *t = w->t;
    if (step == t->n_steps) return encode_piece(w, p, n);
    const tok_step *s = &t->steps[step];
    if (s->kind == TOK_STEP_SPLIT)
        return split_piece(w, step, s->re, s->behavior, s->invert, p, n);
    /* ByteLevel: a prefix space when asked and absent, then the GPT-2 regex when asked. */
    if (s->add_prefix_space && p[0] != ' ') {
        if (n == SIZE_MAX) return ws_oom(w);
        uint8_t *q = arena_alloc(w, n + 1);
        if (q == NULL) return ws_oom(w);
        q[0] = ' ';
        memcpy(q + 1, p, n);
        p = q;
        n++;
    }
    if (s->re != NULL) return split_piece(w, step, s->re, TOK_SPLIT_ISOLATED, false, p, n);
    return run_steps(w, step + 1, p, n);
}

/* ---- added tokens ---- */

static bool is_space(uint8_t c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

static bool is_word(uint8_t c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}

/* The longest added token allowed at text[i], as an index into t->added; -1 if none. */
static int32_t added_at(const tok *t, const uint8_t *text, size_t len, size_t i,
                        bool allow_special, size_t *end) {
    int32_t best = -1, node = 0;
    for (size_t j = i; j < len; j++) {
        int32_t c = t->trie[node].first_child;
        while (c >= 0 && t->trie[c].byte != text[j]) c = t->trie[c].next_sibling;
        if (c < 0) break;
        node = c;
        int32_t a = t->trie[node].added;
        if (a < 0) continue;
        const tok_added *ad = &t->added[a];
        if (ad->special && !allow_special) continue;
        if (ad->single_word && ((i > 0 && is_word(text[i - 1])) || (j + 1 < len && is_word(text[j + 1]))))
            continue;
        best = a;
        *end = j + 1;
    }
    return best;
}

static pie_code encode_all(tok_ws *w, bool allow_special) {
    const tok *t = w->t;
    const uint8_t *text = w->text;
    size_t len = w->text_len, seg = 0;
    if (t->n_added > 0) {
        for (size_t i = 0; i < len; i++) {
            if (!t->added_first[text[i]]) continue;
            size_t end;
            int32_t a = added_at(t, text, len, i, allow_special, &end);
            if (a < 0) continue;
            const tok_added *ad = &t->added[a];
            size_t s = i, e = end;
            if (ad->lstrip)
                while (s > seg && is_space(text[s - 1])) s--;
            if (ad->rstrip)
                while (e < len && is_space(text[e])) e++;
            pie_code rc = run_steps(w, 0, text + seg, s - seg);
            if (rc == PIE_OK) rc = emit(w, ad->id);
            if (rc != PIE_OK) return rc;
            seg = e;
            i = e - 1; /* the loop's i++ lands on e */
        }
    }
    return run_steps(w, 0, text + seg, len - seg);
}

static void ws_free(tok_ws *w) {
    free(w->out);
    if (w->md) pcre2_match_data_free(w->md);
    while (w->chunks) {
        tok_chunk *c = w->chunks;
        w->chunks = c->next;
        free(c);
    }
    free(w->sym_id);
    free(w->sym_prev);
    free(w->sym_next);
    free(w->heap);
    free(w->cache);
}

pie_code tok_encode(const tok *t, const char *text, size_t len, bool allow_special,
                    uint32_t **ids, size_t *n, pie_status *st) {
    *ids = NULL;
    *n = 0;
    if (len == 0) {
        pie_status_ok(st);
        return PIE_OK;
    }
    if (text == NULL)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "tok: encode: text is NULL with length %zu",
                              len);
    tok_ws w = {.t = t, .st = st, .text = (const uint8_t *)text, .text_len = len};
    pie_code rc = PIE_OK;
    w.md = pcre2_match_data_create(1, NULL);
    if (w.md == NULL) goto oom;
    /* Cache size: about one slot per 8 bytes of text (pieces average ~4-6 bytes and repeat),
     * between 64 and 64K slots. */
    size_t slots = 64;
    while (slots < len / 8 && slots < 65536) slots *= 2;
    w.cache = calloc(slots, sizeof *w.cache);
    if (w.cache == NULL) goto oom;
    w.cache_mask = slots - 1;
    rc = out_reserve(&w, len / 4 + 16);
    if (rc != PIE_OK) goto fail;
    rc = encode_all(&w, allow_special);
    if (rc != PIE_OK) goto fail;
    if (w.n_out > 0 && w.n_out < w.cap_out) { /* give back the slack */
        uint32_t *shrunk = realloc(w.out, w.n_out * sizeof *shrunk);
        if (shrunk != NULL) w.out = shrunk;
    }
    *ids = w.out;
    *n = w.n_out;
    w.out = NULL;
    ws_free(&w);
    pie_status_ok(st);
    return PIE_OK;
oom:
    rc = ws_oom(&w);
fail:
    ws_free(&w);
    return rc;
}
