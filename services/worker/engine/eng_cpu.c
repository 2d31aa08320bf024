/* eng_cpu.c — the CPU backend of the engine: eng.h's pools and handlers over kernels/cpu.
 *
 * Owns: the engine object (model mapping, KV pool, page masks, embedding slots, scratch sized
 * at open for max_batch_tokens, the thread pool, RoPE frequencies) and the handlers. A forward
 * call gathers the inputs of all items into one [T, hidden] matrix so every linear layer runs
 * once per layer for the whole batch; only attention is per item. No handler allocates.
 * Does not own: the math (kernels/cpu), the model files (services/worker/model), the mask
 * format (eng_mask.c).
 *
 * Errors the caller can cause (all PIE_INVALID_ARGUMENT unless noted; <i> = item index):
 *   eng_open: "eng_open: opts, out and opts->model_dir must not be NULL",
 *     "eng_open: backend N is not available (this build has the cpu backend)" (UNIMPLEMENTED),
 *     "eng_open: kv_page_size N is out of range [1, 65536]",
 *     "eng_open: max_batch_tokens N is out of range [1, 1048576]",
 *     "eng_open: embed_slots N is out of range [1, 16777216]",
 *     "eng_open: kv_pages N x kv_page_size M exceeds 2^30 tokens",
 *     "eng_open: <dir>: head_dim N must be even and n_kv_heads M must divide n_heads H",
 *     "eng_open: cannot allocate N bytes for <what>", "eng_open: cannot allocate the page masks
 *     and marks of N pages", "eng_open: cannot start N threads" (RESOURCE_EXHAUSTED), and
 *     mdl_open's errors (services/worker/model/mdl.h).
 *   embed_text: "embed_text: slots, tokens and positions must not be NULL",
 *     "embed_text: item <i>: slot N is out of range [0, S)",
 *     "embed_text: item <i>: token N is out of range [0, V)",
 *     "embed_text: item <i>: position N is out of range [0, P)".
 *   forward: "forward: items is NULL", "forward: item <i>: kv_pages is NULL",
 *     "forward: item <i>: kv_pages[j] = N is out of range [0, K)",
 *     "forward: item <i>: kv page N appears twice (kv_pages[a] and kv_pages[b])",
 *     "forward: item <i>: kv_last_page_len N must be 0 when kv_pages is empty",
 *     "forward: item <i>: kv_last_page_len N is out of range [1, P]",
 *     "forward: item <i>: n_in is 0 (an item needs at least one input)",
 *     "forward: item <i>: in_slots is NULL", "forward: item <i>: out_slots is NULL",
 *     "forward: item <i>: n_out N exceeds n_in M",
 *     "forward: item <i>: the batch reaches N input tokens, more than max_batch_tokens M",
 *     "forward: item <i>: in_slots[j] = N is out of range [0, S)" (and out_slots),
 *     "forward: item <i>: out_slots[j] = N is also an output of item <k>",
 *     "forward: item <i>: append_kv with n_in N but kv_pages hold only M tokens",
 *     "forward: item <i>: input j writes kv page N offset M, as does item <k>",
 *     "forward: item <i>: in_slots[j] = N is an output of item <k>",
 *     "forward: item <i>: mask_runs is NULL with n_mask_runs N", and eng_mask_check's messages
 *     prefixed "forward: item <i>".
 *   mask_page: "mask_page: masked is NULL", "mask_page: page N is out of range [0, K)".
 *   copy_pages: "copy_pages: items is NULL", "copy_pages: item <i>: src N is out of range
 *     [0, K)" (and dst), "copy_pages: item <i>: count is 0",
 *     "copy_pages: item <i>: src_off N + count M exceeds kv_page_size P" (and dst_off),
 *     "copy_pages: item <i>: ranges [a, b) and [c, d) of page N overlap".
 *   next_dist: "next_dist: items is NULL", "next_dist: item <i>: slot N is out of range [0, S)",
 *     "next_dist: item <i>: top_k N is out of range [1, V]",
 *     "next_dist: item <i>: temperature X must be finite and > 0",
 *     "next_dist: item <i>: ids and probs must not be NULL".
 *   logits / slot_position: "logits: slot N is out of range [0, S)", "logits: logits is NULL",
 *     "slot_position: slot N is out of range [0, S)", "slot_position: pos is NULL".
 *
 * Batch semantics (as pie.v1.ForwardBatch): in every layer the K/V of all appended inputs of all
 * items are written before any item attends, so an item may read (as context) positions that
 * another item of the same batch writes and sees the new values; two items writing the same
 * position, and an item reading a slot another item outputs, are errors. A page mask belongs to
 * the page position: it hides the token there from every query that has it as CONTEXT, and
 * writing K/V there does not change it (the worker resets the mask when it allocates a page). */
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "eng.h"
#include "eng_mask.h"
#include "krn_cpu.h"
#include "mdl.h"

#define ENG_MAX_PAGE_SIZE  65536u
#define ENG_MAX_BATCH      (1u << 20)
#define ENG_MAX_SLOTS      (1u << 24)
#define ENG_MAX_KV_TOKENS  (1ull << 30)
#define ENG_DIST_ROWS      64u        /* slots per lm_head call in next_dist */
#define ENG_MASK_MIN_BYTES (2u << 20) /* dense attention-mask scratch, at least */
#define ENG_ALIGN          64u

/* One forward item after validation. */
typedef struct eng_plan {
    uint32_t first; /* its first row in the batch matrix */
    uint32_t ctx;   /* C: tokens before the inputs */
    bool dense;     /* attention needs a byte mask (explicit mask or masked context tokens) */
} eng_plan;

/* Validation stamp: which check generation last touched an id, and who (item index). */
typedef struct eng_mark {
    uint32_t gen, who;
} eng_mark;

/* A region from mmap: zeroed, page aligned, committed on first touch. */
typedef struct eng_region {
    void *p;
    size_t bytes;
} eng_region;

struct eng {
    mdl_model *m;
    eng_info info;
    krn_pool *pool;
    float attn_scale; /* 1 / sqrt(head_dim) */
    float *inv_freq;  /* [head_dim / 2] */
    uint32_t qd, kvd; /* n_heads * head_dim, n_kv_heads * head_dim */

    /* KV pool: one region per layer, [kv_pages][2][page_size][n_kv_heads][head_dim] f32 */
    eng_region *kv_regions;  /* [n_layers] */
    krn_kv_layer *kv;        /* [n_layers] */
    uint8_t *page_mask;      /* [kv_pages * page_size], 1 = masked */
    uint32_t *page_n_masked; /* [kv_pages] masked tokens per page */

    /* embedding slots */
    eng_region emb_region;
    float *emb;        /* [embed_slots, hidden] */
    uint32_t *emb_pos; /* [embed_slots] */

    /* scratch, one region carved at open; T = max_batch_tokens */
    eng_region scratch;
    float *x, *xn;          /* [T, hidden]: residual stream, normed / projected rows */
    float *q, *k, *v, *att; /* [T, qd], [T, kvd], [T, kvd], [T, qd]; share memory with: */
    float *gate, *up;       /* [T, intermediate] (the MLP runs after attention is consumed) */
    float *logits;          /* [dist_rows, vocab] */
    uint32_t dist_rows;
    uint32_t *pos;       /* [T] RoPE position of each row */
    uint32_t *out_rows;  /* [T] rows whose states go to output slots, ascending */
    uint32_t *out_slot;  /* [T] their slots */
    eng_plan *plan;      /* [T] (items <= tokens) */
    krn_attn_item *attn; /* [T] attention work of one kernel call */
    uint8_t *mask;       /* [mask_cap] dense masks of the attention items of one call */
    size_t mask_cap;

    /* validation stamps */
    eng_mark *slot_mark; /* [embed_slots] */
    eng_mark *page_mark; /* [kv_pages], who = index in the item's kv_pages */
    eng_mark *tok_mark;  /* [kv_pages * page_size] */
    uint32_t gen;
};

/* ---- memory ------------------------------------------------------------------------------ */

static size_t eng_align(size_t n) { return (n + ENG_ALIGN - 1) / ENG_ALIGN * ENG_ALIGN; }

/* a * b, or SIZE_MAX when it overflows (then any allocation of it fails). */
static size_t eng_mul(size_t a, size_t b) {
    if (a != 0 && b > SIZE_MAX / a) return SIZE_MAX;
    return a * b;
}

static size_t eng_add(size_t a, size_t b) { return a > SIZE_MAX - b ? SIZE_MAX : a + b; }

static pie_code eng_map(eng_region *r, size_t bytes, const char *what, pie_status *st) {
    r->p = NULL;
    r->bytes = 0;
    if (bytes == 0) bytes = ENG_ALIGN;
    void *p = bytes == SIZE_MAX
                  ? MAP_FAILED
                  : mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "eng_open: cannot allocate %zu bytes for %s", bytes, what);
    /* Transparent huge pages where the kernel offers them (THP "madvise" mode): attention and
     * the linear layers stream these regions, and 4 KiB pages cost TLB misses. Advice only:
     * a refusal changes nothing but speed. */
    if (bytes >= ((size_t)2 << 20)) (void)madvise(p, bytes, MADV_HUGEPAGE);
    r->p = p;
    r->bytes = bytes;
    return PIE_OK;
}

static void eng_unmap(eng_region *r) {
    if (r->p) (void)munmap(r->p, r->bytes);
    r->p = NULL;
    r->bytes = 0;
}

/* Carves consecutive 64-byte-aligned pieces out of one region (two passes: measure, assign). */
typedef struct eng_carver {
    char *base; /* NULL while measuring */
    size_t used;
} eng_carver;

static void *eng_carve(eng_carver *c, size_t bytes) {
    size_t at = c->used;
    c->used = eng_add(c->used, eng_align(bytes));
    return c->base ? c->base + at : NULL;
}

/* Validation generations: a fresh value per check. eng_reserve_gens makes room for `count`
 * more before a call starts (marks reset when the counter would wrap). */
static void eng_reserve_gens(eng *e, uint64_t count) {
    if ((uint64_t)e->gen + count < UINT32_MAX) return;
    memset(e->slot_mark, 0, sizeof *e->slot_mark * e->info.embed_slots);
    memset(e->page_mark, 0, sizeof *e->page_mark * e->info.kv_pages);
    memset(e->tok_mark, 0, sizeof *e->tok_mark * (size_t)e->info.kv_pages * e->info.kv_page_size);
    e->gen = 0;
}

static uint32_t eng_next_gen(eng *e) { return ++e->gen; }

/* y[rows, w.rows] = x[rows, w.cols] · w^T */
static void eng_linear(eng *e, const float *x, uint32_t rows, const mdl_tensor *w, float *y) {
    krn_cpu_linear(e->pool, x, (int)rows, (int)w->cols, w->data, (krn_dtype)w->dtype, (int)w->rows,
                   y);
}

/* ---- open / close ------------------------------------------------------------------------ */

static void eng_fill_info(eng *e, uint32_t ps, uint32_t pages, uint32_t slots, uint32_t T) {
    const mdl_config *c = &e->m->cfg;
    eng_info *in = &e->info;
    snprintf(in->architecture, sizeof in->architecture, "%s", c->architecture);
    snprintf(in->dtype, sizeof in->dtype, "%s", mdl_dtype_name(e->m->embed.dtype));
    in->vocab_size = c->vocab_size;
    in->hidden_size = c->hidden_size;
    in->intermediate_size = c->intermediate_size;
    in->n_layers = c->n_layers;
    in->n_heads = c->n_heads;
    in->n_kv_heads = c->n_kv_heads;
    in->head_dim = c->head_dim;
    in->max_position = c->max_position;
    in->bos_token_id = c->bos_token_id;
    in->eos_token_id = c->eos_token_id;
    in->kv_page_size = ps;
    in->kv_pages = pages;
    in->embed_slots = slots;
    in->max_batch_tokens = T;
    in->weight_bytes = e->m->weight_bytes;
}

/* Lays out the scratch region (c->base NULL: only measures). */
static void eng_carve_scratch(eng *e, eng_carver *c) {
    const eng_info *in = &e->info;
    size_t T = in->max_batch_tokens, d = in->hidden_size, ffn = in->intermediate_size;
    size_t attn_floats = eng_mul(T, 2 * (size_t)e->qd + 2 * (size_t)e->kvd);
    size_t mlp_floats = eng_mul(T, 2 * ffn);
    size_t shared = attn_floats > mlp_floats ? attn_floats : mlp_floats;

    e->x = eng_carve(c, eng_mul(eng_mul(T, d), sizeof(float)));
    e->xn = eng_carve(c, eng_mul(eng_mul(T, d), sizeof(float)));
    float *u = eng_carve(c, eng_mul(shared, sizeof(float)));
    if (u) {
        e->q = u;
        e->k = e->q + T * e->qd;
        e->v = e->k + T * e->kvd;
        e->att = e->v + T * e->kvd;
        e->gate = u;
        e->up = u + T * ffn;
    }
    e->logits = eng_carve(c, eng_mul(eng_mul(e->dist_rows, in->vocab_size), sizeof(float)));
    e->pos = eng_carve(c, T * sizeof(uint32_t));
    e->out_rows = eng_carve(c, T * sizeof(uint32_t));
    e->out_slot = eng_carve(c, T * sizeof(uint32_t));
    e->plan = eng_carve(c, T * sizeof(eng_plan));
    e->attn = eng_carve(c, T * sizeof(krn_attn_item));
    e->mask = eng_carve(c, e->mask_cap);
}

pie_code eng_open(const eng_opts *opts, eng **out, pie_status *st) {
    if (!opts || !out || !opts->model_dir)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "eng_open: opts, out and opts->model_dir must not be NULL");
    *out = NULL;
    if (opts->backend != 0 && opts->backend != ENG_BACKEND_CPU)
        return pie_status_set(st, PIE_UNIMPLEMENTED,
                              "eng_open: backend %d is not available (this build has the cpu "
                              "backend)",
                              (int)opts->backend);
    uint32_t ps = opts->kv_page_size ? opts->kv_page_size : 16;
    uint32_t pages = opts->kv_pages ? opts->kv_pages : 256;
    uint32_t slots = opts->embed_slots ? opts->embed_slots : 1024;
    uint32_t T = opts->max_batch_tokens ? opts->max_batch_tokens : 4096;
    if (ps > ENG_MAX_PAGE_SIZE)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "eng_open: kv_page_size %u is out of range [1, %u]", ps,
                              ENG_MAX_PAGE_SIZE);
    if (T > ENG_MAX_BATCH)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "eng_open: max_batch_tokens %u is out of range [1, %u]", T,
                              ENG_MAX_BATCH);
    if (slots > ENG_MAX_SLOTS)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "eng_open: embed_slots %u is out of range [1, %u]", slots,
                              ENG_MAX_SLOTS);
    if ((uint64_t)pages * ps > ENG_MAX_KV_TOKENS)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "eng_open: kv_pages %u x kv_page_size %u exceeds 2^30 tokens", pages,
                              ps);

    eng *e = calloc(1, sizeof *e);
    if (!e) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "eng_open: out of memory");
    pie_code rc = mdl_open(opts->model_dir, &e->m, st);
    if (rc != PIE_OK) goto fail;
    const mdl_config *c = &e->m->cfg;
    if (c->head_dim == 0 || c->head_dim % 2 != 0 || c->n_kv_heads == 0 ||
        c->n_heads % c->n_kv_heads != 0) {
        rc = pie_status_set(st, PIE_INVALID_ARGUMENT,
                            "eng_open: %s: head_dim %u must be even and n_kv_heads %u must "
                            "divide n_heads %u",
                            opts->model_dir, c->head_dim, c->n_kv_heads, c->n_heads);
        goto fail;
    }
    eng_fill_info(e, ps, pages, slots, T);
    e->qd = c->n_heads * c->head_dim;
    e->kvd = c->n_kv_heads * c->head_dim;
    e->attn_scale = 1.0f / sqrtf((float)c->head_dim);

    e->pool = krn_pool_create(opts->n_threads);
    if (!e->pool) {
        rc = pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "eng_open: cannot start %d threads",
                            opts->n_threads);
        goto fail;
    }
    e->inv_freq = malloc(sizeof(float) * (c->head_dim / 2));
    e->kv_regions = calloc(c->n_layers ? c->n_layers : 1, sizeof *e->kv_regions);
    e->kv = calloc(c->n_layers ? c->n_layers : 1, sizeof *e->kv);
    size_t kv_tokens = (size_t)pages * ps;
    e->page_mask = calloc(kv_tokens, 1);
    e->page_n_masked = calloc(pages, sizeof *e->page_n_masked);
    e->slot_mark = calloc(slots, sizeof *e->slot_mark);
    e->page_mark = calloc(pages, sizeof *e->page_mark);
    e->tok_mark = calloc(kv_tokens, sizeof *e->tok_mark);
    if (!e->inv_freq || !e->kv_regions || !e->kv || !e->page_mask || !e->page_n_masked ||
        !e->slot_mark || !e->page_mark || !e->tok_mark) {
        rc =
            pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                           "eng_open: cannot allocate the page masks and marks of %u pages", pages);
        goto fail;
    }
    krn_cpu_rope_freqs(e->inv_freq, (int)c->head_dim, c->rope_theta, c->rope_factor,
                       c->rope_low_freq_factor, c->rope_high_freq_factor,
                       (int)c->rope_orig_max_position);

    size_t layer_bytes = eng_mul(eng_mul(eng_mul(kv_tokens, 2), e->kvd), sizeof(float));
    for (uint32_t l = 0; l < c->n_layers; l++) {
        rc = eng_map(&e->kv_regions[l], layer_bytes, "a layer of the KV pool", st);
        if (rc != PIE_OK) goto fail;
        e->kv[l] = (krn_kv_layer){.base = e->kv_regions[l].p,
                                  .page_size = (int)ps,
                                  .n_kv_heads = (int)c->n_kv_heads,
                                  .head_dim = (int)c->head_dim};
    }
    size_t emb_bytes = eng_mul(eng_mul(slots, c->hidden_size), sizeof(float));
    rc = eng_map(&e->emb_region, eng_add(emb_bytes, eng_mul(slots, sizeof(uint32_t))),
                 "the embedding slots", st);
    if (rc != PIE_OK) goto fail;
    e->emb = e->emb_region.p;
    e->emb_pos = (uint32_t *)((char *)e->emb_region.p + emb_bytes);

    /* A dense mask row is at most kv_tokens + T bytes; keep room for several rows at once. */
    e->dist_rows = T < ENG_DIST_ROWS ? T : ENG_DIST_ROWS;
    e->mask_cap = eng_mul(eng_add(kv_tokens, T), 8);
    if (e->mask_cap < ENG_MASK_MIN_BYTES) e->mask_cap = ENG_MASK_MIN_BYTES;
    eng_carver measure = {0};
    eng_carve_scratch(e, &measure);
    rc = eng_map(&e->scratch, measure.used, "the activation scratch", st);
    if (rc != PIE_OK) goto fail;
    eng_carver carve = {.base = e->scratch.p};
    eng_carve_scratch(e, &carve);

    e->info.kv_pool_bytes =
        eng_add(eng_mul(layer_bytes, c->n_layers), kv_tokens + (size_t)pages * sizeof(uint32_t));
    e->info.embed_pool_bytes = e->emb_region.bytes;
    e->info.scratch_bytes = e->scratch.bytes + (size_t)slots * sizeof(eng_mark) +
                            (size_t)pages * sizeof(eng_mark) + kv_tokens * sizeof(eng_mark);
    *out = e;
    return PIE_OK;

fail:
    eng_close(e);
    return rc;
}

void eng_close(eng *e) {
    if (!e) return;
    if (e->kv_regions && e->m)
        for (uint32_t l = 0; l < e->m->cfg.n_layers; l++) eng_unmap(&e->kv_regions[l]);
    eng_unmap(&e->emb_region);
    eng_unmap(&e->scratch);
    krn_pool_destroy(e->pool);
    mdl_close(e->m);
    free(e->inv_freq);
    free(e->kv_regions);
    free(e->kv);
    free(e->page_mask);
    free(e->page_n_masked);
    free(e->slot_mark);
    free(e->page_mark);
    free(e->tok_mark);
    free(e);
}

const eng_info *eng_get_info(const eng *e) { return &e->info; }

/* ---- embed ------------------------------------------------------------------------------- */

pie_code eng_embed_text(eng *e, const uint32_t *slots, const uint32_t *tokens,
                        const uint32_t *positions, uint32_t n, pie_status *st) {
    if (n == 0) return PIE_OK;
    if (!slots || !tokens || !positions)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "embed_text: slots, tokens and positions must not be NULL");
    const eng_info *in = &e->info;
    for (uint32_t i = 0; i < n; i++) {
        if (slots[i] >= in->embed_slots)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "embed_text: item %u: slot %u is out of range [0, %u)", i,
                                  slots[i], in->embed_slots);
        if (tokens[i] >= in->vocab_size)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "embed_text: item %u: token %u is out of range [0, %u)", i,
                                  tokens[i], in->vocab_size);
        if (positions[i] >= in->max_position)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "embed_text: item %u: position %u is out of range [0, %u)", i,
                                  positions[i], in->max_position);
    }
    for (uint32_t i = 0; i < n; i++) {
        krn_cpu_embed(e->m->embed.data, (krn_dtype)e->m->embed.dtype, (int)in->hidden_size,
                      &tokens[i], 1, e->emb + (size_t)slots[i] * in->hidden_size);
        e->emb_pos[slots[i]] = positions[i];
    }
    return PIE_OK;
}

/* ---- forward: validation ------------------------------------------------------------------ */

static pie_code eng_check_slots(eng *e, const uint32_t *slots, uint32_t n, const char *field,
                                uint32_t item, pie_status *st) {
    for (uint32_t j = 0; j < n; j++)
        if (slots[j] >= e->info.embed_slots)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "forward: item %u: %s[%u] = %u is out of range [0, %u)", item,
                                  field, j, slots[j], e->info.embed_slots);
    return PIE_OK;
}

/* Pages: in range, none twice. Sets *tokens to the tokens the page list holds. */
static pie_code eng_check_pages(eng *e, const eng_forward_item *it, uint32_t i, uint64_t *tokens,
                                pie_status *st) {
    const eng_info *in = &e->info;
    if (it->n_kv_pages > 0 && !it->kv_pages)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "forward: item %u: kv_pages is NULL", i);
    uint32_t gen = eng_next_gen(e);
    for (uint32_t j = 0; j < it->n_kv_pages; j++) {
        uint32_t p = it->kv_pages[j];
        if (p >= in->kv_pages)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "forward: item %u: kv_pages[%u] = %u is out of range [0, %u)", i,
                                  j, p, in->kv_pages);
        if (e->page_mark[p].gen == gen)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "forward: item %u: kv page %u appears twice (kv_pages[%u] and "
                                  "kv_pages[%u])",
                                  i, p, e->page_mark[p].who, j);
        e->page_mark[p] = (eng_mark){gen, j};
    }
    if (it->n_kv_pages == 0) {
        if (it->kv_last_page_len != 0)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "forward: item %u: kv_last_page_len %u must be 0 when kv_pages "
                                  "is empty",
                                  i, it->kv_last_page_len);
        *tokens = 0;
        return PIE_OK;
    }
    if (it->kv_last_page_len < 1 || it->kv_last_page_len > in->kv_page_size)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "forward: item %u: kv_last_page_len %u is out of range [1, %u]", i,
                              it->kv_last_page_len, in->kv_page_size);
    *tokens = (uint64_t)(it->n_kv_pages - 1) * in->kv_page_size + it->kv_last_page_len;
    return PIE_OK;
}

/* Inputs and outputs: counts, slots, the batch total; out slots unique across the batch
 * (marks of generation `gen`). */
static pie_code eng_check_io(eng *e, const eng_forward_item *it, uint32_t i, uint32_t gen,
                             uint64_t *total, pie_status *st) {
    if (it->n_in == 0)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "forward: item %u: n_in is 0 (an item needs at least one input)", i);
    if (!it->in_slots)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "forward: item %u: in_slots is NULL", i);
    if (it->n_out > it->n_in)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "forward: item %u: n_out %u exceeds n_in %u", i, it->n_out, it->n_in);
    if (it->n_out > 0 && !it->out_slots)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "forward: item %u: out_slots is NULL", i);
    *total += it->n_in;
    if (*total > e->info.max_batch_tokens)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "forward: item %u: the batch reaches %llu input tokens, more than "
                              "max_batch_tokens %u",
                              i, (unsigned long long)*total, e->info.max_batch_tokens);
    pie_code rc = eng_check_slots(e, it->in_slots, it->n_in, "in_slots", i, st);
    if (rc == PIE_OK) rc = eng_check_slots(e, it->out_slots, it->n_out, "out_slots", i, st);
    if (rc != PIE_OK) return rc;
    for (uint32_t j = 0; j < it->n_out; j++) {
        eng_mark *mk = &e->slot_mark[it->out_slots[j]];
        if (mk->gen == gen)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "forward: item %u: out_slots[%u] = %u is also an output of item "
                                  "%u",
                                  i, j, it->out_slots[j], mk->who);
        *mk = (eng_mark){gen, i};
    }
    return PIE_OK;
}

/* Appended inputs: fit in the pages, and no position written twice in the batch. */
static pie_code eng_check_writes(eng *e, const eng_forward_item *it, uint32_t i, uint32_t gen,
                                 uint64_t seq_tokens, pie_status *st) {
    if (it->n_in > seq_tokens)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "forward: item %u: append_kv with n_in %u but kv_pages hold only "
                              "%llu tokens",
                              i, it->n_in, (unsigned long long)seq_tokens);
    uint32_t ps = e->info.kv_page_size;
    uint64_t ctx = seq_tokens - it->n_in;
    for (uint32_t t = 0; t < it->n_in; t++) {
        uint64_t s = ctx + t;
        uint32_t page = it->kv_pages[s / ps], off = (uint32_t)(s % ps);
        eng_mark *mk = &e->tok_mark[(size_t)page * ps + off];
        if (mk->gen == gen)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "forward: item %u: input %u writes kv page %u offset %u, as "
                                  "does item %u",
                                  i, t, page, off, mk->who);
        *mk = (eng_mark){gen, i};
    }
    return PIE_OK;
}

/* Checks every item and fills e->plan; returns the batch's token count in *total. */
static pie_code eng_check_forward(eng *e, const eng_forward_item *items, uint32_t n,
                                  uint32_t *total, pie_status *st) {
    /* one generation for the batch, one per item; items past max_batch_tokens never get one */
    eng_reserve_gens(e,
                     (uint64_t)(n < e->info.max_batch_tokens ? n : e->info.max_batch_tokens) + 2);
    uint32_t gen = eng_next_gen(e);
    uint64_t rows = 0;
    for (uint32_t i = 0; i < n; i++) {
        const eng_forward_item *it = &items[i];
        uint64_t seq = 0;
        uint32_t first = (uint32_t)rows;
        pie_code rc = eng_check_pages(e, it, i, &seq, st);
        if (rc == PIE_OK) rc = eng_check_io(e, it, i, gen, &rows, st);
        if (rc == PIE_OK && it->append_kv) rc = eng_check_writes(e, it, i, gen, seq, st);
        if (rc != PIE_OK) return rc;
        uint32_t ctx = (uint32_t)(it->append_kv ? seq - it->n_in : seq);
        if (it->mask_runs || it->n_mask_runs) {
            char prefix[48];
            snprintf(prefix, sizeof prefix, "forward: item %u", i);
            if (!it->mask_runs)
                return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                      "forward: item %u: mask_runs is NULL with n_mask_runs %u", i,
                                      it->n_mask_runs);
            rc = eng_mask_check(it->mask_runs, it->n_mask_runs, ctx, it->n_in, prefix, st);
            if (rc != PIE_OK) return rc;
        }
        /* i < rows <= max_batch_tokens: the plan array has room. */
        e->plan[i] = (eng_plan){.first = first, .ctx = ctx, .dense = it->mask_runs != NULL};
    }
    /* every output is marked now: no input may be another item's output */
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t j = 0; j < items[i].n_in; j++) {
            const eng_mark *mk = &e->slot_mark[items[i].in_slots[j]];
            if (mk->gen == gen && mk->who != i)
                return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                      "forward: item %u: in_slots[%u] = %u is an output of item "
                                      "%u",
                                      i, j, items[i].in_slots[j], mk->who);
        }
    *total = (uint32_t)rows;
    return PIE_OK;
}

/* ---- forward: execution ------------------------------------------------------------------- */

/* Sequence index s of an item → its (page, offset). */
static void eng_seq_at(const eng *e, const eng_forward_item *it, uint32_t s, uint32_t *page,
                       uint32_t *off) {
    *page = it->kv_pages[s / e->info.kv_page_size];
    *off = s % e->info.kv_page_size;
}

/* Rows of the batch matrix from the input slots; the output row list. Returns outputs. */
static uint32_t eng_gather(eng *e, const eng_forward_item *items, uint32_t n) {
    size_t d = e->info.hidden_size;
    uint32_t n_out = 0;
    for (uint32_t i = 0; i < n; i++) {
        const eng_forward_item *it = &items[i];
        uint32_t first = e->plan[i].first;
        for (uint32_t t = 0; t < it->n_in; t++) {
            uint32_t slot = it->in_slots[t];
            memcpy(e->x + (first + t) * d, e->emb + slot * d, d * sizeof(float));
            e->pos[first + t] = e->emb_pos[slot];
        }
        for (uint32_t j = 0; j < it->n_out; j++) {
            e->out_rows[n_out] = first + it->n_in - it->n_out + j;
            e->out_slot[n_out] = it->out_slots[j];
            n_out++;
        }
    }
    return n_out;
}

/* Which items need a dense attention mask: an explicit one, or a masked token among their
 * context pages. */
static void eng_plan_masks(eng *e, const eng_forward_item *items, uint32_t n) {
    uint32_t ps = e->info.kv_page_size;
    for (uint32_t i = 0; i < n; i++) {
        eng_plan *p = &e->plan[i];
        uint32_t ctx_pages = (p->ctx + ps - 1) / ps;
        for (uint32_t j = 0; j < ctx_pages && !p->dense; j++)
            if (e->page_n_masked[items[i].kv_pages[j]] > 0) p->dense = true;
    }
}

/* Dense mask rows [row, row + rows) of item it into out ([rows, ctx + n_in]); *cursor is the
 * run index where row `row` starts. */
static void eng_fill_mask(const eng *e, const eng_forward_item *it, const eng_plan *p, uint32_t row,
                          uint32_t rows, uint32_t *cursor, uint8_t *out) {
    uint32_t ps = e->info.kv_page_size, cols = p->ctx + it->n_in;
    for (uint32_t r = 0; r < rows; r++) {
        uint8_t *m = out + (size_t)r * cols;
        uint32_t len = p->ctx + row + r + 1;
        if (it->mask_runs) {
            eng_mask_row(it->mask_runs, cursor, len, cols, m);
        } else {
            memset(m, 1, len);
            memset(m + len, 0, cols - len);
        }
        for (uint32_t j = 0; j * ps < p->ctx; j++) {
            uint32_t page = it->kv_pages[j];
            if (e->page_n_masked[page] == 0) continue;
            const uint8_t *pm = e->page_mask + (size_t)page * ps;
            uint32_t lim = p->ctx - j * ps < ps ? p->ctx - j * ps : ps;
            for (uint32_t o = 0; o < lim; o++)
                if (pm[o]) m[j * ps + o] = 0;
        }
    }
}

/* Attention of one layer for every item: query rows from `outputs_only` ? the item's last
 * n_out : all. Items needing dense masks are cut into row chunks that fit the mask scratch;
 * the kernel runs whenever the scratch is full and once at the end. */
static void eng_attend(eng *e, const eng_forward_item *items, uint32_t n, uint32_t layer,
                       bool outputs_only) {
    const krn_kv_layer *kv = &e->kv[layer];
    int nh = (int)e->info.n_heads;
    size_t qd = e->qd, kvd = e->kvd;
    int n_att = 0;
    size_t used = 0;
    for (uint32_t i = 0; i < n; i++) {
        const eng_forward_item *it = &items[i];
        const eng_plan *p = &e->plan[i];
        uint32_t row = outputs_only ? it->n_in - it->n_out : 0;
        if (row == it->n_in) continue;
        krn_attn_item base = {
            .pages = it->kv_pages,
            .n_ctx = (int)(it->append_kv ? p->ctx + it->n_in : p->ctx),
            .k_tail = it->append_kv ? NULL : e->k + p->first * kvd,
            .v_tail = it->append_kv ? NULL : e->v + p->first * kvd,
            .n_tail = it->append_kv ? 0 : (int)it->n_in,
        };
        if (!p->dense) {
            krn_attn_item a = base;
            a.q = e->q + (p->first + row) * qd;
            a.out = e->att + (p->first + row) * qd;
            a.n_q = (int)(it->n_in - row);
            a.q_offset = (int)(p->ctx + row);
            e->attn[n_att++] = a;
            continue;
        }
        size_t cols = (size_t)p->ctx + it->n_in;
        uint32_t cursor = 0;
        if (it->mask_runs)
            for (uint32_t r = 0; r < row; r++)
                eng_mask_skip_row(it->mask_runs, &cursor, p->ctx + r + 1);
        while (row < it->n_in) {
            size_t fit = (e->mask_cap - used) / cols;
            if (fit == 0) {
                krn_cpu_attention(e->pool, kv, e->attn, n_att, nh, e->attn_scale);
                n_att = 0;
                used = 0;
                fit = e->mask_cap / cols; /* >= 8: mask_cap >= 8 * (kv tokens + T) */
            }
            uint32_t rows = fit < it->n_in - row ? (uint32_t)fit : it->n_in - row;
            uint8_t *m = e->mask + used;
            eng_fill_mask(e, it, p, row, rows, &cursor, m);
            krn_attn_item a = base;
            a.q = e->q + (p->first + row) * qd;
            a.out = e->att + (p->first + row) * qd;
            a.n_q = (int)rows;
            a.q_offset = (int)(p->ctx + row);
            a.mask = m;
            e->attn[n_att++] = a;
            used += rows * cols;
            row += rows;
        }
    }
    if (n_att > 0) krn_cpu_attention(e->pool, kv, e->attn, n_att, nh, e->attn_scale);
}

/* K/V rows of the appended inputs into their pages. */
static void eng_store_kv(eng *e, const eng_forward_item *items, uint32_t n, uint32_t layer) {
    const krn_kv_layer *kv = &e->kv[layer];
    size_t kvd = e->kvd;
    for (uint32_t i = 0; i < n; i++) {
        const eng_forward_item *it = &items[i];
        if (!it->append_kv) continue;
        const eng_plan *p = &e->plan[i];
        for (uint32_t t = 0; t < it->n_in; t++) {
            uint32_t page, off;
            eng_seq_at(e, it, p->ctx + t, &page, &off);
            memcpy(krn_kv_k(kv, page, off), e->k + (p->first + t) * kvd, kvd * sizeof(float));
            memcpy(krn_kv_v(kv, page, off), e->v + (p->first + t) * kvd, kvd * sizeof(float));
        }
    }
}

/* Moves rows out_rows[r] of m ([*, width]) to row r (out_rows ascending, so no row is
 * overwritten before it is moved). */
static void eng_compact(float *m, size_t width, const uint32_t *out_rows, uint32_t n_out) {
    for (uint32_t r = 0; r < n_out; r++)
        if (out_rows[r] != r) memcpy(m + r * width, m + out_rows[r] * width, width * sizeof(float));
}

/* o-proj + residual, then the SwiGLU MLP + residual, over the first `rows` rows. */
static void eng_layer_tail(eng *e, const mdl_layer *L, uint32_t rows) {
    const eng_info *in = &e->info;
    int d = (int)in->hidden_size;
    size_t nd = (size_t)rows * in->hidden_size;
    eng_linear(e, e->att, rows, &L->wo, e->xn);
    krn_cpu_add(e->x, e->xn, nd);
    krn_cpu_rmsnorm(e->x, L->ffn_norm.data, (krn_dtype)L->ffn_norm.dtype, (int)rows, d,
                    e->m->cfg.rms_eps, e->xn);
    eng_linear(e, e->xn, rows, &L->w_gate, e->gate);
    eng_linear(e, e->xn, rows, &L->w_up, e->up);
    krn_cpu_silu_mul(e->gate, e->up, (size_t)rows * in->intermediate_size);
    eng_linear(e, e->gate, rows, &L->w_down, e->xn);
    krn_cpu_add(e->x, e->xn, nd);
}

pie_code eng_forward(eng *e, const eng_forward_item *items, uint32_t n, pie_status *st) {
    if (n == 0) return PIE_OK;
    if (!items) return pie_status_set(st, PIE_INVALID_ARGUMENT, "forward: items is NULL");
    uint32_t T = 0;
    pie_code rc = eng_check_forward(e, items, n, &T, st);
    if (rc != PIE_OK) return rc;

    const eng_info *in = &e->info;
    int d = (int)in->hidden_size;
    uint32_t n_out = eng_gather(e, items, n);
    eng_plan_masks(e, items, n);
    for (uint32_t l = 0; l < in->n_layers; l++) {
        const mdl_layer *L = &e->m->layers[l];
        bool last = l + 1 == in->n_layers;
        krn_cpu_rmsnorm(e->x, L->attn_norm.data, (krn_dtype)L->attn_norm.dtype, (int)T, d,
                        e->m->cfg.rms_eps, e->xn);
        eng_linear(e, e->xn, T, &L->wq, e->q);
        eng_linear(e, e->xn, T, &L->wk, e->k);
        eng_linear(e, e->xn, T, &L->wv, e->v);
        krn_cpu_rope(e->q, e->pos, (int)T, (int)in->n_heads, (int)in->head_dim, e->inv_freq);
        krn_cpu_rope(e->k, e->pos, (int)T, (int)in->n_kv_heads, (int)in->head_dim, e->inv_freq);
        eng_store_kv(e, items, n, l);
        if (last && n_out == 0) break; /* K/V stored; no state of this layer is read */
        eng_attend(e, items, n, l, last);
        uint32_t rows = T;
        if (last) { /* only the output rows go on: the rest would be discarded */
            eng_compact(e->att, e->qd, e->out_rows, n_out);
            eng_compact(e->x, in->hidden_size, e->out_rows, n_out);
            rows = n_out;
        }
        eng_layer_tail(e, L, rows);
    }
    if (n_out == 0) return PIE_OK;
    if (in->n_layers == 0) /* degenerate model: outputs are the inputs */
        eng_compact(e->x, in->hidden_size, e->out_rows, n_out);
    krn_cpu_rmsnorm(e->x, e->m->norm.data, (krn_dtype)e->m->norm.dtype, (int)n_out, d,
                    e->m->cfg.rms_eps, e->xn);
    for (uint32_t r = 0; r < n_out; r++) {
        uint32_t slot = e->out_slot[r];
        memcpy(e->emb + (size_t)slot * in->hidden_size, e->xn + (size_t)r * in->hidden_size,
               in->hidden_size * sizeof(float));
        e->emb_pos[slot] = e->pos[e->out_rows[r]];
    }
    return PIE_OK;
}

/* ---- pages ------------------------------------------------------------------------------- */

pie_code eng_mask_page(eng *e, uint32_t page, const bool *masked, pie_status *st) {
    if (!masked) return pie_status_set(st, PIE_INVALID_ARGUMENT, "mask_page: masked is NULL");
    if (page >= e->info.kv_pages)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "mask_page: page %u is out of range [0, %u)", page, e->info.kv_pages);
    uint32_t ps = e->info.kv_page_size, count = 0;
    uint8_t *m = e->page_mask + (size_t)page * ps;
    for (uint32_t o = 0; o < ps; o++) {
        m[o] = masked[o] ? 1 : 0;
        count += m[o];
    }
    e->page_n_masked[page] = count;
    return PIE_OK;
}

static pie_code eng_check_copy(const eng *e, const eng_copy_item *c, uint32_t i, pie_status *st) {
    uint32_t pages = e->info.kv_pages, ps = e->info.kv_page_size;
    if (c->src >= pages)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "copy_pages: item %u: src %u is out of range [0, %u)", i, c->src,
                              pages);
    if (c->dst >= pages)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "copy_pages: item %u: dst %u is out of range [0, %u)", i, c->dst,
                              pages);
    if (c->count == 0)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "copy_pages: item %u: count is 0", i);
    if ((uint64_t)c->src_off + c->count > ps)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "copy_pages: item %u: src_off %u + count %u exceeds kv_page_size %u",
                              i, c->src_off, c->count, ps);
    if ((uint64_t)c->dst_off + c->count > ps)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "copy_pages: item %u: dst_off %u + count %u exceeds kv_page_size %u",
                              i, c->dst_off, c->count, ps);
    if (c->src == c->dst && c->src_off < c->dst_off + c->count &&
        c->dst_off < c->src_off + c->count)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "copy_pages: item %u: ranges [%u, %u) and [%u, %u) of page %u "
                              "overlap",
                              i, c->src_off, c->src_off + c->count, c->dst_off,
                              c->dst_off + c->count, c->src);
    return PIE_OK;
}

pie_code eng_copy_pages(eng *e, const eng_copy_item *items, uint32_t n, pie_status *st) {
    if (n == 0) return PIE_OK;
    if (!items) return pie_status_set(st, PIE_INVALID_ARGUMENT, "copy_pages: items is NULL");
    for (uint32_t i = 0; i < n; i++) {
        pie_code rc = eng_check_copy(e, &items[i], i, st);
        if (rc != PIE_OK) return rc;
    }
    uint32_t ps = e->info.kv_page_size;
    size_t kvd = e->kvd;
    for (uint32_t i = 0; i < n; i++) {
        const eng_copy_item *c = &items[i];
        size_t bytes = (size_t)c->count * kvd * sizeof(float);
        for (uint32_t l = 0; l < e->info.n_layers; l++) {
            const krn_kv_layer *kv = &e->kv[l];
            memcpy(krn_kv_k(kv, c->dst, (int)c->dst_off), krn_kv_k(kv, c->src, (int)c->src_off),
                   bytes);
            memcpy(krn_kv_v(kv, c->dst, (int)c->dst_off), krn_kv_v(kv, c->src, (int)c->src_off),
                   bytes);
        }
        uint8_t *dm = e->page_mask + (size_t)c->dst * ps;
        const uint8_t *sm = e->page_mask + (size_t)c->src * ps;
        uint32_t count = e->page_n_masked[c->dst];
        for (uint32_t t = 0; t < c->count; t++) {
            count -= dm[c->dst_off + t];
            dm[c->dst_off + t] = sm[c->src_off + t];
            count += dm[c->dst_off + t];
        }
        e->page_n_masked[c->dst] = count;
    }
    return PIE_OK;
}

/* ---- distributions ----------------------------------------------------------------------- */

typedef struct eng_dist_job {
    eng *e;
    eng_dist_item *items; /* the rows of this lm_head call */
} eng_dist_job;

static void eng_dist_task(void *arg, int task, int n_tasks) {
    (void)n_tasks;
    eng_dist_job *job = arg;
    eng_dist_item *it = &job->items[task];
    int vocab = (int)job->e->info.vocab_size;
    float *row = job->e->logits + (size_t)task * job->e->info.vocab_size;
    krn_cpu_softmax(row, vocab, it->temperature);
    krn_cpu_topk(row, vocab, (int)it->top_k, it->ids, it->probs);
}

/* lm_head over the states of items[0, rows)'s slots into e->logits. */
static void eng_lm_head(eng *e, const eng_dist_item *items, uint32_t rows) {
    size_t d = e->info.hidden_size;
    for (uint32_t r = 0; r < rows; r++)
        memcpy(e->x + r * d, e->emb + items[r].slot * d, d * sizeof(float));
    eng_linear(e, e->x, rows, &e->m->lm_head, e->logits);
}

pie_code eng_next_dist(eng *e, eng_dist_item *items, uint32_t n, pie_status *st) {
    if (n == 0) return PIE_OK;
    if (!items) return pie_status_set(st, PIE_INVALID_ARGUMENT, "next_dist: items is NULL");
    const eng_info *in = &e->info;
    for (uint32_t i = 0; i < n; i++) {
        const eng_dist_item *it = &items[i];
        if (it->slot >= in->embed_slots)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "next_dist: item %u: slot %u is out of range [0, %u)", i,
                                  it->slot, in->embed_slots);
        if (it->top_k < 1 || it->top_k > in->vocab_size)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "next_dist: item %u: top_k %u is out of range [1, %u]", i,
                                  it->top_k, in->vocab_size);
        if (!(it->temperature > 0.0f) || !isfinite(it->temperature))
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "next_dist: item %u: temperature %g must be finite and > 0", i,
                                  (double)it->temperature);
        if (!it->ids || !it->probs)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "next_dist: item %u: ids and probs must not be NULL", i);
    }
    for (uint32_t start = 0; start < n; start += e->dist_rows) {
        uint32_t rows = n - start < e->dist_rows ? n - start : e->dist_rows;
        eng_lm_head(e, &items[start], rows);
        eng_dist_job job = {e, &items[start]};
        krn_pool_run(e->pool, eng_dist_task, &job, (int)rows);
    }
    return PIE_OK;
}

pie_code eng_logits(eng *e, uint32_t slot, float *logits, pie_status *st) {
    if (slot >= e->info.embed_slots)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "logits: slot %u is out of range [0, %u)",
                              slot, e->info.embed_slots);
    if (!logits) return pie_status_set(st, PIE_INVALID_ARGUMENT, "logits: logits is NULL");
    eng_linear(e, e->emb + (size_t)slot * e->info.hidden_size, 1, &e->m->lm_head, logits);
    return PIE_OK;
}

pie_code eng_slot_position(eng *e, uint32_t slot, uint32_t *pos, pie_status *st) {
    if (slot >= e->info.embed_slots)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "slot_position: slot %u is out of range [0, %u)", slot,
                              e->info.embed_slots);
    if (!pos) return pie_status_set(st, PIE_INVALID_ARGUMENT, "slot_position: pos is NULL");
    *pos = e->emb_pos[slot];
    return PIE_OK;
}
