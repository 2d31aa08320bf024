/* eng_cpu.c — the CPU backend of the engine: eng.h's pools and handlers over kernels/cpu.
 *
 * Owns: the engine object (model mapping, KV pool, page masks, embedding slots, scratch sized
 * at open for max_batch_tokens, the thread pool, RoPE frequencies) and the handlers. A forward
 * call gathers the inputs of all items into one [T, hidden] matrix so every linear layer runs
 * once per layer for the whole batch; only attention is per item. No handler allocates.
 * Does not own: the math (kernels/cpu), the model files (services/worker/model), the mask
 * format and page-mask updates (eng_mask.c), argument validation and its messages (eng_check.c),
 * what a rank of a tensor-parallel group does differently (eng_cpu_tp.c: its weight shard, the
 * embedding and distribution exchanges; the two all-reduces of every layer are here).
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
#include "eng_check.h"
#include "eng_cpu_impl.h"
#include "eng_mask.h"
#include "krn_cpu.h"
#include "mdl.h"
#include "wrk_coll.h"

#define ENG_DIST_ROWS        64u        /* slots per lm_head call in next_dist */
#define ENG_MASK_MIN_BYTES   (2u << 20) /* dense attention-mask scratch, at least */
#define ENG_ALIGN            64u
#define ENG_CLEAR_POOL_BYTES (1u << 20) /* clear_pages splits over the threads from this size */

/* ---- memory ------------------------------------------------------------------------------ */

static size_t eng_align(size_t n) { return (n + ENG_ALIGN - 1) / ENG_ALIGN * ENG_ALIGN; }

/* a * b, or SIZE_MAX when it overflows (then any allocation of it fails). */
static size_t eng_mul(size_t a, size_t b) {
    if (a != 0 && b > SIZE_MAX / a) return SIZE_MAX;
    return a * b;
}

static size_t eng_add(size_t a, size_t b) { return a > SIZE_MAX - b ? SIZE_MAX : a + b; }

pie_code eng_cpu_map(eng_region *r, size_t bytes, const char *what, pie_status *st) {
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

void eng_cpu_unmap(eng_region *r) {
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

void eng_cpu_linear(eng *e, const float *x, uint32_t rows, const mdl_tensor *w, float *y) {
    krn_cpu_linear(e->pool, x, (int)rows, (int)w->cols, w->data, eng_cpu_wt(e, w), (int)w->rows,
                   y);
}

/* y[i] = x · w[i]ᵀ for n weights that read the same x (q/k/v, gate/up): one call when they share
 * dtype and width (x packed once on AMX; the same bits as separate calls), else one each. */
static void eng_cpu_linear_same_x(eng *e, const float *x, uint32_t rows, const mdl_tensor *const *w,
                                  float *const *y, int n) {
    krn_linear_out outs[3];
    int same = n <= 3;
    for (int i = 0; same && i < n; i++) {
        same = eng_cpu_wt(e, w[i]) == eng_cpu_wt(e, w[0]) && w[i]->cols == w[0]->cols;
        outs[i] = (krn_linear_out){.w = w[i]->data, .out = (int)w[i]->rows, .y = y[i]};
    }
    if (!same) {
        for (int i = 0; i < n; i++) eng_cpu_linear(e, x, rows, w[i], y[i]);
        return;
    }
    krn_cpu_linear_multi(e->pool, x, (int)rows, (int)w[0]->cols, eng_cpu_wt(e, w[0]), outs, n);
}

/* ---- open / close ------------------------------------------------------------------------ */

/* Lays out the scratch region (c->base NULL: only measures). */
static void eng_carve_scratch(eng *e, eng_carver *c) {
    const eng_info *in = &e->info;
    size_t T = in->max_batch_tokens, d = in->hidden_size, ffn = e->ffn;
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
    e->logits = eng_carve(c, eng_mul(eng_mul(e->dist_rows, e->shard.vocab_stride), sizeof(float)));
    e->pos = eng_carve(c, T * sizeof(uint32_t));
    e->out_rows = eng_carve(c, T * sizeof(uint32_t));
    e->out_slot = eng_carve(c, T * sizeof(uint32_t));
    e->attn = eng_carve(c, T * sizeof(krn_attn_item));
    e->mask = eng_carve(c, e->mask_cap);
    size_t ranks = e->shard.size > 1 ? e->shard.size : 0;
    e->tp_max = eng_carve(c, eng_mul(ranks ? e->dist_rows : 0, sizeof(eng_tp_max)));
    e->tp_max_all = eng_carve(c, eng_mul(eng_mul(ranks, e->dist_rows), sizeof(eng_tp_max)));
    e->tp_rec = eng_carve(c, e->tp_rec_cap);
    e->tp_rec_all = eng_carve(c, eng_mul(ranks, e->tp_rec_cap));
}

/* A group of tp_size > 1 needs its collective, of that size, with this rank. */
static pie_code eng_coll_matches(const eng_opts *o, uint32_t tp_size, pie_status *st) {
    if (tp_size == 1) return PIE_OK;
    if (!o->coll)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "eng_open: tp_size %u needs a collective (coll is NULL)", tp_size);
    if (wrk_coll_size(o->coll) != tp_size || wrk_coll_rank(o->coll) != o->tp_rank)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "eng_open: tp_rank %u of tp_size %u, but the collective is rank %u "
                              "of %u",
                              o->tp_rank, tp_size, wrk_coll_rank(o->coll), wrk_coll_size(o->coll));
    return PIE_OK;
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
    eng_check_dims dims;
    pie_code rc = eng_check_opts(opts, &dims, st);
    if (rc != PIE_OK) return rc;
    uint32_t ps = dims.page_size, pages = dims.pages, slots = dims.slots, T = dims.batch_tokens;

    eng *e = calloc(1, sizeof *e);
    if (!e) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "eng_open: out of memory");
    rc = mdl_open(opts->model_dir, &e->m, st);
    if (rc == PIE_OK) rc = eng_check_model(&e->m->cfg, opts->model_dir, st);
    if (rc == PIE_OK) rc = eng_shard_plan(&e->m->cfg, opts->tp_rank, opts->tp_size, &e->shard, st);
    if (rc == PIE_OK) rc = eng_coll_matches(opts, e->shard.size, st);
    if (rc != PIE_OK) goto fail;
    const mdl_config *c = &e->m->cfg;
    eng_check_fill_info(&e->info, e->m, &dims);
    e->coll = e->shard.size > 1 ? opts->coll : NULL;
    e->info.tp_rank = e->shard.rank;
    e->info.tp_size = e->shard.size;
    e->info.local_kv_heads = e->shard.n_kv_heads;
    e->qd = e->shard.n_heads * c->head_dim;
    e->kvd = e->shard.n_kv_heads * c->head_dim;
    e->ffn = e->shard.n_ffn;
    e->attn_scale = 1.0f / sqrtf((float)c->head_dim);
    rc = eng_tp_bind_weights(e, st);
    if (rc != PIE_OK) goto fail;

    e->pool = krn_pool_create(opts->n_threads);
    if (!e->pool) {
        rc = pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "eng_open: cannot start %d threads",
                            opts->n_threads);
        goto fail;
    }
    rc = eng_wpack_open(e, st); /* bf16 weights without AMX: packed once for the kernels */
    if (rc != PIE_OK) goto fail;
    e->inv_freq = malloc(sizeof(float) * (c->head_dim / 2));
    e->kv_regions = calloc(c->n_layers ? c->n_layers : 1, sizeof *e->kv_regions);
    e->kv = calloc(c->n_layers ? c->n_layers : 1, sizeof *e->kv);
    size_t kv_tokens = (size_t)pages * ps;
    e->page_mask = calloc(kv_tokens, 1);
    e->page_n_masked = calloc(pages, sizeof *e->page_n_masked);
    if (!e->inv_freq || !e->kv_regions || !e->kv || !e->page_mask || !e->page_n_masked) {
        rc =
            pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                           "eng_open: cannot allocate the page masks and marks of %u pages", pages);
        goto fail;
    }
    rc = eng_check_init(&e->chk, &e->info, st);
    if (rc != PIE_OK) goto fail;
    krn_cpu_rope_freqs(e->inv_freq, (int)c->head_dim, c->rope_theta, c->rope_factor,
                       c->rope_low_freq_factor, c->rope_high_freq_factor,
                       (int)c->rope_orig_max_position);

    krn_dtype kv_dt = opts->kv_dtype == ENG_KV_BF16 ? KRN_BF16 : KRN_F32;
    size_t kv_elt = kv_dt == KRN_BF16 ? 2 : 4;
    size_t layer_bytes = eng_mul(eng_mul(eng_mul(kv_tokens, 2), e->kvd), kv_elt);
    if (opts->swap_slots) { /* layers live in the tier's buffers (eng_cpu_swap.c) */
        rc = eng_swap_open(e, opts, layer_bytes, st);
        if (rc != PIE_OK) goto fail;
    }
    for (uint32_t l = 0; l < c->n_layers; l++) {
        if (!e->tier) {
            rc = eng_cpu_map(&e->kv_regions[l], layer_bytes, "a layer of the KV pool", st);
            if (rc != PIE_OK) goto fail;
        }
        e->kv[l] = (krn_kv_layer){.base = e->kv_regions[l].p,
                                  .page_size = (int)ps,
                                  .n_kv_heads = (int)e->shard.n_kv_heads,
                                  .head_dim = (int)c->head_dim,
                                  .dtype = kv_dt};
    }
    e->info.kv_page_layer_bytes = (size_t)2 * ps * e->kvd * kv_elt;
    snprintf(e->info.kv_dtype, sizeof e->info.kv_dtype, "%s", kv_dt == KRN_BF16 ? "bf16" : "f32");
    size_t emb_bytes = eng_mul(eng_mul(slots, c->hidden_size), sizeof(float));
    rc = eng_cpu_map(&e->emb_region, eng_add(emb_bytes, eng_mul(slots, sizeof(uint32_t))),
                     "the embedding slots", st);
    if (rc != PIE_OK) goto fail;
    e->emb = e->emb_region.p;
    e->emb_pos = (uint32_t *)((char *)e->emb_region.p + emb_bytes);

    /* A dense mask row is at most kv_tokens + T bytes; keep room for several rows at once. */
    e->dist_rows = T < ENG_DIST_ROWS ? T : ENG_DIST_ROWS;
    e->mask_cap = eng_mul(eng_add(kv_tokens, T), 8);
    if (e->mask_cap < ENG_MASK_MIN_BYTES) e->mask_cap = ENG_MASK_MIN_BYTES;
    e->tp_rec_cap = eng_tp_rec_cap(e);
    eng_carver measure = {0};
    eng_carve_scratch(e, &measure);
    rc = eng_cpu_map(&e->scratch, measure.used, "the activation scratch", st);
    if (rc != PIE_OK) goto fail;
    eng_carver carve = {.base = e->scratch.p};
    eng_carve_scratch(e, &carve);
    if (opts->offload_device_pages) { /* CPU attention offload (eng_cpu_offload.c) */
        rc = eng_offload_open(e, opts, layer_bytes, st);
        if (rc != PIE_OK) goto fail;
    }

    /* under the swap policy: the device region's budget (swap_slots layers) */
    e->info.kv_pool_bytes =
        eng_add(eng_mul(layer_bytes, e->tier ? opts->swap_slots : c->n_layers),
                kv_tokens + (size_t)pages * sizeof(uint32_t));
    e->info.embed_pool_bytes = e->emb_region.bytes;
    e->info.scratch_bytes = e->scratch.bytes + eng_check_bytes(&e->chk);
    *out = e;
    return PIE_OK;

fail:
    eng_close(e);
    return rc;
}

void eng_close(eng *e) {
    if (!e) return;
    eng_swap_close(e); /* first: its copy threads stop */
    eng_offload_close(e);
    if (e->kv_regions && e->m)
        for (uint32_t l = 0; l < e->m->cfg.n_layers; l++) eng_cpu_unmap(&e->kv_regions[l]);
    eng_cpu_unmap(&e->emb_region);
    eng_cpu_unmap(&e->scratch);
    eng_cpu_unmap(&e->slices);
    eng_cpu_unmap(&e->wpack);
    free(e->own_layers);
    krn_pool_destroy(e->pool);
    mdl_close(e->m);
    free(e->inv_freq);
    free(e->kv_regions);
    free(e->kv);
    free(e->page_mask);
    free(e->page_n_masked);
    eng_check_free(&e->chk);
    free(e);
}

const eng_info *eng_get_info(const eng *e) { return &e->info; }

/* ---- embed ------------------------------------------------------------------------------- */

pie_code eng_embed_text(eng *e, const uint32_t *slots, const uint32_t *tokens,
                        const uint32_t *positions, uint32_t n, pie_status *st) {
    const eng_info *in = &e->info;
    pie_code rc = eng_check_embed(in, slots, tokens, positions, n, st);
    if (rc != PIE_OK) return rc;
    if (e->coll) return eng_tp_embed_text(e, slots, tokens, positions, n, st);
    for (uint32_t i = 0; i < n; i++) {
        krn_cpu_embed(e->embed.data, eng_cpu_wt(e, &e->embed), (int)in->hidden_size,
                      &tokens[i], 1, e->emb + (size_t)slots[i] * in->hidden_size);
        e->emb_pos[slots[i]] = positions[i];
    }
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
        uint32_t first = e->chk.plan[i].first;
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

/* Dense mask rows [row, row + rows) of item it into out ([rows, ctx + n_in]); *cursor is the
 * run index where row `row` starts. */
static void eng_fill_mask(const eng *e, const eng_forward_item *it, const eng_check_plan *p,
                          uint32_t row, uint32_t rows, uint32_t *cursor, uint8_t *out) {
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
    size_t qd = e->qd, kvd = e->kvd;
    int n_att = 0;
    size_t used = 0;
    for (uint32_t i = 0; i < n; i++) {
        const eng_forward_item *it = &items[i];
        const eng_check_plan *p = &e->chk.plan[i];
        uint32_t row = outputs_only ? it->n_in - it->n_out : 0;
        if (row == it->n_in) continue;
        krn_attn_item base = {
            .pages = it->kv_pages,
            .n_ctx = (int)(it->append_kv ? p->ctx + it->n_in : p->ctx),
            .k_tail = it->append_kv ? NULL : e->k + p->first * kvd,
            .v_tail = it->append_kv ? NULL : e->v + p->first * kvd,
            .n_tail = it->append_kv ? 0 : (int)it->n_in,
        };
        /* a dense byte mask for an explicit mask or masked context tokens */
        if (!it->mask_runs && !p->ctx_masked) {
            krn_attn_item a = base;
            a.q = e->q + (p->first + row) * qd;
            a.out = e->att + (p->first + row) * qd;
            a.n_q = (int)(it->n_in - row);
            a.q_offset = (int)(p->ctx + row);
            eng_attn_note(e, (uint32_t)n_att, i);
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
                eng_attn_run(e, layer, n_att);
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
            eng_attn_note(e, (uint32_t)n_att, i);
            e->attn[n_att++] = a;
            used += rows * cols;
            row += rows;
        }
    }
    if (n_att > 0) eng_attn_run(e, layer, n_att);
}

/* K/V rows of the appended inputs into their pages. */
static void eng_store_kv(eng *e, const eng_forward_item *items, uint32_t n, uint32_t layer) {
    size_t kvd = e->kvd;
    for (uint32_t i = 0; i < n; i++) {
        const eng_forward_item *it = &items[i];
        if (!it->append_kv) continue;
        const krn_kv_layer *kv = eng_item_kv(e, i, layer); /* offload: the host region */
        const eng_check_plan *p = &e->chk.plan[i];
        for (uint32_t t = 0; t < it->n_in; t++) {
            uint32_t page, off;
            eng_seq_at(e, it, p->ctx + t, &page, &off);
            krn_kv_store(kv, page, (int)off, e->k + (p->first + t) * kvd,
                         e->v + (p->first + t) * kvd);
        }
    }
}

/* Moves rows out_rows[r] of m ([*, width]) to row r (out_rows ascending, so no row is
 * overwritten before it is moved). */
static void eng_compact(float *m, size_t width, const uint32_t *out_rows, uint32_t n_out) {
    for (uint32_t r = 0; r < n_out; r++)
        if (out_rows[r] != r) memcpy(m + r * width, m + out_rows[r] * width, width * sizeof(float));
}

/* x[rows, hidden] += the row-parallel output in xn: this rank's partial sum, all-reduced over
 * the group first (no exchange at tp_size 1). */
static pie_code eng_residual(eng *e, size_t nd, pie_status *st) {
    if (e->coll) {
        pie_code rc = wrk_coll_allreduce_sum_f32(e->coll, e->xn, nd, st);
        if (rc != PIE_OK) return rc;
    }
    krn_cpu_add(e->x, e->xn, nd);
    return PIE_OK;
}

/* o-proj + residual, then the SwiGLU MLP + residual, over the first `rows` rows. Sharded:
 * wo and w_down take this rank's heads and columns, and each output is all-reduced. */
static pie_code eng_layer_tail(eng *e, const mdl_layer *L, uint32_t rows, pie_status *st) {
    const eng_info *in = &e->info;
    int d = (int)in->hidden_size;
    size_t nd = (size_t)rows * in->hidden_size;
    eng_cpu_linear(e, e->att, rows, &L->wo, e->xn);
    pie_code rc = eng_residual(e, nd, st);
    if (rc != PIE_OK) return rc;
    krn_cpu_rmsnorm(e->x, L->ffn_norm.data, (krn_dtype)L->ffn_norm.dtype, (int)rows, d,
                    e->m->cfg.rms_eps, e->xn);
    const mdl_tensor *gu[2] = {&L->w_gate, &L->w_up};
    float *gu_y[2] = {e->gate, e->up};
    eng_cpu_linear_same_x(e, e->xn, rows, gu, gu_y, 2);
    krn_cpu_silu_mul(e->gate, e->up, (size_t)rows * e->ffn);
    eng_cpu_linear(e, e->gate, rows, &L->w_down, e->xn);
    return eng_residual(e, nd, st);
}

pie_code eng_forward(eng *e, const eng_forward_item *items, uint32_t n, pie_status *st) {
    if (n == 0) return PIE_OK;
    uint32_t T = 0;
    pie_code rc = eng_check_forward(&e->chk, items, n, e->page_n_masked, &T, st);
    if (rc != PIE_OK) return rc;

    const eng_info *in = &e->info;
    int d = (int)in->hidden_size;
    eng_kv_touch_forward(e, items, n); /* swap policy: the pages the tier moves */
    rc = eng_swap_share_slots(e, st); /* swap policy in a group: rank 0's slot count */
    if (rc != PIE_OK) return rc;
    rc = eng_offload_prepare(e, items, n, st); /* offload: which items attend on the host */
    if (rc != PIE_OK) return rc;
    uint32_t n_out = eng_gather(e, items, n);
    for (uint32_t l = 0; l < in->n_layers; l++) {
        const mdl_layer *L = &e->layers[l];
        bool last = l + 1 == in->n_layers;
        krn_cpu_rmsnorm(e->x, L->attn_norm.data, (krn_dtype)L->attn_norm.dtype, (int)T, d,
                        e->m->cfg.rms_eps, e->xn);
        const mdl_tensor *qkv[3] = {&L->wq, &L->wk, &L->wv};
        float *qkv_y[3] = {e->q, e->k, e->v};
        eng_cpu_linear_same_x(e, e->xn, T, qkv, qkv_y, 3);
        krn_cpu_rope(e->q, e->pos, (int)T, (int)e->shard.n_heads, (int)in->head_dim, e->inv_freq);
        krn_cpu_rope(e->k, e->pos, (int)T, (int)e->shard.n_kv_heads, (int)in->head_dim,
                     e->inv_freq);
        if (e->kv[l].dtype == KRN_BF16) { /* what the pages will hold, tails included */
            krn_round_bf16(e->k, (size_t)T * e->kvd);
            krn_round_bf16(e->v, (size_t)T * e->kvd);
        }
        rc = eng_kv_acquire(e, l, st); /* swap policy: wait for layer l's KV on the device */
        if (rc != PIE_OK) return rc;
        eng_store_kv(e, items, n, l);
        if (!(last && n_out == 0)) eng_attend(e, items, n, l, last);
        eng_kv_release(e, l);
        if (last && n_out == 0) break; /* K/V stored; no state of this layer is read */
        uint32_t rows = T;
        if (last) { /* only the output rows go on: the rest would be discarded */
            eng_compact(e->att, e->qd, e->out_rows, n_out);
            eng_compact(e->x, in->hidden_size, e->out_rows, n_out);
            rows = n_out;
        }
        rc = eng_layer_tail(e, L, rows, st);
        if (rc != PIE_OK) return rc;
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
    pie_code rc = eng_check_mask_page(&e->info, page, masked, st);
    if (rc != PIE_OK) return rc;
    uint32_t ps = e->info.kv_page_size;
    e->page_n_masked[page] = eng_mask_page_set(e->page_mask + (size_t)page * ps, masked, ps);
    return PIE_OK;
}

pie_code eng_copy_pages(eng *e, const eng_copy_item *items, uint32_t n, pie_status *st) {
    if (n == 0) return PIE_OK;
    pie_code rc = eng_check_copy(&e->info, items, n, st);
    if (rc != PIE_OK) return rc;
    uint32_t ps = e->info.kv_page_size;
    eng_kv_touch_copies(e, items, n);
    eng_kv_hold(e); /* swap policy: every layer stays where it is, kv[l] says where */
    for (uint32_t i = 0; i < n; i++) {
        const eng_copy_item *c = &items[i];
        eng_offload_copy(e, c); /* every layer; offload: each page where it lives */
        eng_mask_page_copy(e->page_mask, e->page_n_masked, ps, c);
    }
    eng_kv_resume(e);
    return PIE_OK;
}

/* Zeroing the K/V of the pages of one clear_pages call: one task per layer. */
typedef struct eng_clear_job {
    eng *e;
    const uint32_t *pages;
    uint32_t n;
} eng_clear_job;

static void eng_clear_task(void *arg, int task, int n_tasks) {
    (void)n_tasks;
    const eng_clear_job *job = arg;
    const krn_kv_layer *kv = &job->e->kv[task];
    size_t bytes = job->e->info.kv_page_layer_bytes;
    for (uint32_t i = 0; i < job->n; i++) memset(krn_kv_k(kv, job->pages[i], 0), 0, bytes);
}

pie_code eng_clear_pages(eng *e, const uint32_t *pages, uint32_t n, pie_status *st) {
    pie_code rc = eng_check_clear(&e->info, true, pages, n, st);
    if (rc != PIE_OK || n == 0) return rc;
    uint32_t ps = e->info.kv_page_size;
    eng_clear_job job = {e, pages, n};
    /* A page of one layer is one block [2][page_size][kvd] (K then V). Below ENG_CLEAR_POOL_BYTES
     * in all, waking the pool costs more than the stores. */
    size_t total = (size_t)n * e->info.n_layers * e->info.kv_page_layer_bytes;
    eng_kv_hold(e); /* swap policy: every layer stays where it is, kv[l] says where */
    krn_pool_run(total >= ENG_CLEAR_POOL_BYTES ? e->pool : NULL, eng_clear_task, &job,
                 (int)e->info.n_layers);
    eng_kv_resume(e);
    eng_offload_cleared(e, pages, n); /* offload: the zeroed device copy is the page now */
    for (uint32_t i = 0; i < n; i++) {
        memset(e->page_mask + (size_t)pages[i] * ps, 0, ps);
        e->page_n_masked[pages[i]] = 0;
    }
    return PIE_OK;
}

pie_code eng_clear_embeds(eng *e, const uint32_t *slots, uint32_t n, pie_status *st) {
    pie_code rc = eng_check_clear(&e->info, false, slots, n, st);
    if (rc != PIE_OK) return rc;
    size_t d = e->info.hidden_size;
    for (uint32_t i = 0; i < n; i++) {
        memset(e->emb + (size_t)slots[i] * d, 0, d * sizeof(float));
        e->emb_pos[slots[i]] = 0;
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

void eng_cpu_lm_head(eng *e, const eng_dist_item *items, uint32_t rows) {
    size_t d = e->info.hidden_size;
    for (uint32_t r = 0; r < rows; r++)
        memcpy(e->x + r * d, e->emb + items[r].slot * d, d * sizeof(float));
    eng_cpu_linear(e, e->x, rows, &e->lm_head, e->logits);
}

pie_code eng_next_dist(eng *e, eng_dist_item *items, uint32_t n, pie_status *st) {
    if (n == 0) return PIE_OK;
    pie_code rc = eng_check_dist(&e->info, items, n, e->info.vocab_size, st);
    if (rc != PIE_OK) return rc;
    if (e->coll) return eng_tp_next_dist(e, items, n, st);
    for (uint32_t start = 0; start < n; start += e->dist_rows) {
        uint32_t rows = n - start < e->dist_rows ? n - start : e->dist_rows;
        eng_cpu_lm_head(e, &items[start], rows);
        eng_dist_job job = {e, &items[start]};
        krn_pool_run(e->pool, eng_dist_task, &job, (int)rows);
    }
    return PIE_OK;
}

pie_code eng_logits(eng *e, uint32_t slot, float *logits, pie_status *st) {
    pie_code rc = eng_check_slot_out(&e->info, "logits", slot, logits, "logits", st);
    if (rc != PIE_OK) return rc;
    if (e->coll) return eng_tp_logits(e, slot, logits, st);
    eng_cpu_linear(e, e->emb + (size_t)slot * e->info.hidden_size, 1, &e->lm_head, logits);
    return PIE_OK;
}

pie_code eng_slot_position(eng *e, uint32_t slot, uint32_t *pos, pie_status *st) {
    pie_code rc = eng_check_slot_out(&e->info, "slot_position", slot, pos, "pos", st);
    if (rc != PIE_OK) return rc;
    *pos = e->emb_pos[slot];
    return PIE_OK;
}
