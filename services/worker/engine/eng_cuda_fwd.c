/* eng_cuda_fwd.c — the cuda backend's forward pass: validation, the per-batch tables, the
 * layer loop on the device, and CUDA-graph capture/replay of decode steps.
 *
 * Owns: eng_cuda_forward and ec_linear. A call (1) validates every item with the cpu backend's
 * checks (eng_check.c, plus two capacities: page-list and mask-run totals), (2) writes the batch's
 * tables into pinned host memory — input slot and RoPE position per row, the pool token each
 * appended row's K/V goes to, output rows and slots, attention tiles for all rows and for the
 * output rows, page lists, mask runs and each masked row's first run — and uploads them in one
 * copy, (3) runs the layers: every kernel reads its per-batch values from those tables, so the
 * same launches serve any batch of the same shape. Attention tiles are cut per item: items with
 * at least 16 rows run on the tensor-core kernel, the others on the CUDA-core kernel, whose
 * tiles each carry their own split-KV count (so a long decode item in a batch with a prefill
 * still splits). A decode step (every item one input and one output, at most EC_GRAPH_MAX_T
 * items) is padded to a power-of-two bucket and replayed from the bucket's graph, captured on
 * first use; the launch grid of a bucket is fixed (split blocks included) and split counts are
 * read from the tiles, so 8 graphs cover every decode step. Padding rows read slot 0, store
 * nothing, write no slot, and their tiles are empty. A bucket whose capture fails launches
 * directly from then on (a device fault is reported instead).
 * Does not own: the pool and other handlers (eng_cuda.c), the kernels (kernels/cuda), the
 * run-length mask format (eng_mask.c), validation (eng_check.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "eng_cuda_impl.h"
#include "eng_mask.h"

/* ---- linear ------------------------------------------------------------------------------ */

pie_code ec_linear(eng_cuda *e, const krn_bf16 *x, uint32_t rows, uint32_t in, const krn_bf16 *w,
                   uint32_t out, float *y, pie_status *st) {
    if (rows == 0 || out == 0) return PIE_OK;
    e->step_launches++;
    if (krn_cuda_gemv_fits(x, w, (int)rows, (int)in)) {
        EC_CUDA(st, krn_cuda_gemv(x, (int)rows, (int)in, w, (int)out, y, (int)out, e->stream));
        return PIE_OK;
    }
    /* row-major y[rows, out] = x[rows, in] · W[out, in]^T is column-major
     * y^T[out, rows] = W^T' · x^T with W read transposed */
    const float one = 1.0f, zero = 0.0f;
    EC_CUBLAS(st, cublasGemmEx(e->cublas, CUBLAS_OP_T, CUBLAS_OP_N, (int)out, (int)rows, (int)in,
                               &one, w, CUDA_R_16BF, (int)in, x, CUDA_R_16BF, (int)in, &zero, y,
                               CUDA_R_32F, (int)out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return PIE_OK;
}

/* ---- tables ------------------------------------------------------------------------------ */

static ec_meta_layout ec_layout(const eng_cuda *e, uint32_t R) {
    size_t tw = sizeof(krn_cuda_attn_tile) / sizeof(int32_t);
    ec_meta_layout L;
    L.in_slot = 0;
    L.pos = L.in_slot + R;
    L.kv_dst = L.pos + R;
    L.out_row = L.kv_dst + R;
    L.out_slot = L.out_row + R;
    L.row_runs = L.out_slot + R;
    L.tiles_all = L.row_runs + R;
    L.tiles_out = L.tiles_all + tw * R;
    L.pages = L.tiles_out + tw * R;
    L.runs = L.pages + e->page_cap;
    L.end = L.runs + e->runs_cap;
    return L;
}

/* Tiles of `rows` rows over rows [from, n_in) of item i; o_base is the output row of row
 * `from`. Returns the count written at *tiles. */
static uint32_t ec_item_tiles(const eng_forward_item *it, const eng_check_plan *p, uint32_t from,
                              uint32_t o_base, uint32_t rows, krn_cuda_attn_tile *tiles) {
    uint32_t n = 0;
    for (uint32_t r = from; r < it->n_in; r += rows) {
        uint32_t nq = it->n_in - r < rows ? it->n_in - r : rows;
        tiles[n++] = (krn_cuda_attn_tile){
            .q_row = (int32_t)(p->first + r),
            .o_row = (int32_t)(o_base + (r - from)),
            .n_q = (int32_t)nq,
            .q_seq = (int32_t)(p->ctx + r),
            .n_ctx = (int32_t)(it->append_kv ? p->ctx + it->n_in : p->ctx),
            .pages = (int32_t)p->pages,
            .tail_row = (int32_t)p->first,
            .n_tail = it->append_kv ? 0 : (int32_t)it->n_in,
            .pm_ctx = p->ctx_masked ? (int32_t)p->ctx : 0,
            /* an explicit mask's rows start at row_runs[first] */
            .mask_row = it->mask_runs ? (int32_t)(p->first + r) : -1,
            .kv_chunk = 0,
            .n_split = 1,
            .part_row = 0,
        };
    }
    return n;
}

/* Whether an item's `rows` rows of a tile list go to the tensor-core kernel. */
static bool ec_use_tc(const eng_cuda *e, bool graph, uint32_t rows) {
    return !graph && e->tc_rows > 0 && rows >= 16;
}

static uint32_t ec_ceil_div(uint32_t a, uint32_t b) { return (a + b - 1) / b; }

/* Split blocks per tile for a CUDA-core launch of n_tiles tiles: enough (tile, KV head, split)
 * blocks for four per SM, at most KRN_CUDA_MAX_SPLITS and at most the partial buffers' pairs.
 * (Two per SM and splits of at least 256 keys left a batch-1 decode of the 8B shape at 32 of
 * 132 SMs: its attention took 3.1 of 10 ms per token at 1k context and 19 of 29 ms at 32k on
 * an H100 — bench/results/cuda.md.) */
static uint32_t ec_split_cap(const eng_cuda *e, uint32_t n_tiles) {
    uint64_t units = (uint64_t)n_tiles * e->nkv, target = 4ull * (uint64_t)e->n_sms;
    if (units == 0 || units >= target) return 1;
    uint64_t want = (target + units - 1) / units, pairs = (uint64_t)EC_PART_SPLITS * e->split_rows;
    if (want > KRN_CUDA_MAX_SPLITS) want = KRN_CUDA_MAX_SPLITS;
    return want > pairs ? (uint32_t)pairs : (uint32_t)want;
}

/* Each tile's split-KV: a tile over at least 128 keys takes up to cap splits of at least 64
 * keys (chunks a multiple of 32) while the launch's partial rows last (EC_PART_SPLITS *
 * split_rows / cap: a launch of cap splits); the others are not split. Returns the most splits
 * a tile took. */
static uint32_t ec_split_tiles(const eng_cuda *e, krn_cuda_attn_tile *t, uint32_t n, uint32_t cap) {
    uint32_t part_rows = 0, most = 1, row_lim = cap > 1 ? EC_PART_SPLITS * e->split_rows / cap : 0;
    for (uint32_t i = 0; i < n; i++) {
        t[i].n_split = 1, t[i].kv_chunk = 0, t[i].part_row = 0;
        if (t[i].n_q <= 0 || cap <= 1) continue;
        uint32_t lim = (uint32_t)(t[i].n_ctx + t[i].n_tail),
                 causal = (uint32_t)(t[i].q_seq + t[i].n_q);
        if (causal < lim) lim = causal;
        if (lim < 128 || part_rows + (uint32_t)t[i].n_q > row_lim) continue;
        uint32_t s = lim / 64 < cap ? lim / 64 : cap;
        uint32_t chunk = ec_ceil_div(ec_ceil_div(lim, s), 32) * 32;
        s = ec_ceil_div(lim, chunk);
        if (s <= 1) continue;
        t[i].n_split = (int32_t)s;
        t[i].kv_chunk = (int32_t)chunk;
        t[i].part_row = (int32_t)part_rows;
        part_rows += (uint32_t)t[i].n_q;
        if (s > most) most = s;
    }
    return most;
}

/* One tile region of the tables (R tiles at int32 offset `at`): CUDA-core tiles from the front,
 * tensor-core tiles at the back. */
typedef struct ec_region {
    krn_cuda_attn_tile *tiles;
    size_t at;
    uint32_t n_cc, n_tc, tc_cap;
} ec_region;

static void ec_region_add(const eng_cuda *e, ec_region *g, bool graph, const eng_forward_item *it,
                          const eng_check_plan *p, uint32_t from, uint32_t o_base, uint32_t R) {
    uint32_t rows = it->n_in - from;
    if (ec_use_tc(e, graph, rows))
        g->n_tc +=
            ec_item_tiles(it, p, from, o_base, e->tc_rows, g->tiles + R - g->tc_cap + g->n_tc);
    else
        g->n_cc += ec_item_tiles(it, p, from, o_base, e->tile_rows, g->tiles + g->n_cc);
}

/* The launches of a region: graph mode pads the CUDA-core list to R empty tiles and fixes the
 * split blocks by R, so the launch shape depends on the bucket alone. */
static void ec_region_close(const eng_cuda *e, ec_region *g, bool graph, uint32_t R, ec_tiles *cc,
                            ec_tiles *tc) {
    size_t tw = sizeof(krn_cuda_attn_tile) / sizeof(int32_t);
    krn_cuda_attn_tile empty = {.n_q = 0, .mask_row = -1};
    uint32_t n_cc = graph ? R : g->n_cc;
    for (uint32_t k = g->n_cc; k < n_cc; k++) g->tiles[k] = empty;
    uint32_t cap = ec_split_cap(e, n_cc);
    uint32_t most = ec_split_tiles(e, g->tiles, n_cc, cap);
    uint32_t splits = graph ? cap : most; /* the graph's launch shape is fixed by the bucket */
    *cc = (ec_tiles){.at = g->at, .n = n_cc, .splits = splits,
                     .part_rows = EC_PART_SPLITS * e->split_rows / splits};
    *tc = (ec_tiles){.at = g->at + (size_t)(R - g->tc_cap) * tw, .n = g->n_tc, .splits = 1,
                     .part_rows = EC_PART_SPLITS * e->split_rows};
}

/* Fills the host tables for rows R >= T (R > T pads a graph bucket). */
static void ec_fill_tables(eng_cuda *e, const eng_forward_item *items, uint32_t n, uint32_t T,
                           uint32_t R, bool graph, ec_run *run) {
    const eng_info *in = &e->info;
    uint32_t ps = in->kv_page_size;
    ec_meta_layout L = ec_layout(e, R);
    int32_t *M = e->h_meta;
    ec_region all = {.tiles = (krn_cuda_attn_tile *)(M + L.tiles_all), .at = L.tiles_all};
    ec_region out = {.tiles = (krn_cuda_attn_tile *)(M + L.tiles_out), .at = L.tiles_out};
    for (uint32_t i = 0; i < n; i++) { /* tensor-core tiles go at the back: count them first */
        if (ec_use_tc(e, graph, items[i].n_in))
            all.tc_cap += ec_ceil_div(items[i].n_in, e->tc_rows);
        if (items[i].n_out > 0 && ec_use_tc(e, graph, items[i].n_out))
            out.tc_cap += ec_ceil_div(items[i].n_out, e->tc_rows);
    }
    uint32_t n_out = 0, runs_at = 0;
    for (uint32_t i = 0; i < n; i++) {
        const eng_forward_item *it = &items[i];
        const eng_check_plan *p = &e->chk.plan[i];
        if (it->n_kv_pages > 0 && !e->off) /* kv_pages may be NULL then */
            memcpy(M + L.pages + p->pages, it->kv_pages, it->n_kv_pages * sizeof(uint32_t));
        for (uint32_t j = 0; e->off && j < it->n_kv_pages; j++) /* device slots, not page ids */
            M[L.pages + p->pages + j] = (int32_t)ec_off_page(e, it->kv_pages[j]);
        uint32_t cursor = 0;
        for (uint32_t t = 0; t < it->n_in; t++) {
            uint32_t row = p->first + t, slot = it->in_slots[t];
            M[L.in_slot + row] = (int32_t)slot;
            M[L.pos + row] = (int32_t)e->emb_pos[slot];
            int32_t dst = -1;
            if (it->append_kv) {
                uint32_t s = p->ctx + t;
                dst = (int32_t)(ec_off_page(e, it->kv_pages[s / ps]) * ps + s % ps);
            }
            M[L.kv_dst + row] = dst;
            if (it->mask_runs) {
                M[L.row_runs + row] = (int32_t)(runs_at + cursor);
                eng_mask_skip_row(it->mask_runs, &cursor, p->ctx + t + 1);
            }
        }
        if (it->mask_runs) {
            memcpy(M + L.runs + runs_at, it->mask_runs, it->n_mask_runs * sizeof(uint32_t));
            runs_at += it->n_mask_runs;
        }
        ec_region_add(e, &all, graph, it, p, 0, p->first, R);
        if (it->n_out > 0) ec_region_add(e, &out, graph, it, p, it->n_in - it->n_out, n_out, R);
        for (uint32_t j = 0; j < it->n_out; j++) {
            M[L.out_row + n_out] = (int32_t)(p->first + it->n_in - it->n_out + j);
            M[L.out_slot + n_out] = (int32_t)it->out_slots[j];
            n_out++;
        }
    }
    /* padding of a graph bucket: harmless rows, empty tiles, no stores, no slot writes */
    for (uint32_t row = T; row < R; row++) {
        M[L.in_slot + row] = 0;
        M[L.pos + row] = 0;
        M[L.kv_dst + row] = -1;
    }
    for (uint32_t r = n_out; r < R; r++) {
        M[L.out_row + r] = (int32_t)r;
        M[L.out_slot + r] = -1;
    }
    ec_region_close(e, &all, graph, R, &run->all_cc, &run->all_tc);
    ec_region_close(e, &out, graph, R, &run->out_cc, &run->out_tc);
    run->n_out = n_out;
    run->lay = L;
}

/* Uploads the tables: everything up to the end of the page lists, and the runs used. */
static pie_code ec_upload_tables(eng_cuda *e, const ec_run *run, uint64_t n_pages, uint64_t n_runs,
                                 pie_status *st) {
    const ec_meta_layout *L = &run->lay;
    size_t head = (L->pages + n_pages) * sizeof(int32_t); /* 0: an offload step's empty
                                                              sub-batch 0 */
    if (head > 0)
        EC_CUDA(st, cudaMemcpyAsync(e->d_meta, e->h_meta, head, cudaMemcpyHostToDevice, e->stream));
    if (n_runs > 0)
        EC_CUDA(st, cudaMemcpyAsync(e->d_meta + L->runs, e->h_meta + L->runs,
                                    n_runs * sizeof(int32_t), cudaMemcpyHostToDevice, e->stream));
    return PIE_OK;
}

/* ---- the layers on the device ------------------------------------------------------------ */

static krn_cuda_attn_args ec_attn_args(const eng_cuda *e, uint32_t layer, const ec_run *run,
                                       const ec_tiles *tl) {
    const mdl_config *c = &e->m->cfg;
    const ec_meta_layout *L = &run->lay;
    return (krn_cuda_attn_args){
        .tiles = (const krn_cuda_attn_tile *)(e->d_meta + tl->at),
        .n_tiles = (int)tl->n,
        .q = e->qkv,
        .q_stride = (int)e->qkvd,
        .kv = ec_kv(e, layer),
        .page_list = (const uint32_t *)(e->d_meta + L->pages),
        .page_mask = e->d_page_mask,
        .page_size = (int)e->info.kv_page_size,
        .kb = e->kb,
        .vb = e->vb,
        .runs = (const uint32_t *)(e->d_meta + L->runs),
        .row_runs = e->d_meta + L->row_runs,
        .n_heads = (int)e->nh, /* this rank's heads (all of them without nccl) */
        .n_kv_heads = (int)e->nkv,
        .hd = (int)c->head_dim,
        .scale = e->attn_scale,
        .out = e->att,
        .n_splits = (int)tl->splits,
        .part_acc = e->part_acc,
        .part_ml = e->part_ml,
        .split_rows = (int)tl->part_rows,
    };
}

/* Attention of one layer: the CUDA-core list (with its merge when it splits), then the
 * tensor-core list; they write disjoint rows of att. */
static pie_code ec_attention(eng_cuda *e, uint32_t layer, const ec_run *run, bool outputs,
                             pie_status *st) {
    const ec_tiles *cc = outputs ? &run->out_cc : &run->all_cc;
    const ec_tiles *tc = outputs ? &run->out_tc : &run->all_tc;
    if (cc->n > 0) {
        krn_cuda_attn_args a = ec_attn_args(e, layer, run, cc);
        EC_CUDA(st, krn_cuda_attention(&a, e->stream));
        e->step_launches += cc->splits > 1 ? 2 : 1;
    }
    if (tc->n > 0) {
        krn_cuda_attn_args a = ec_attn_args(e, layer, run, tc);
        EC_CUDA(st, krn_cuda_attention_tc(&a, e->stream));
        e->step_launches++;
    }
    return PIE_OK;
}

/* o-proj of att, residual + norm, gate|up, SiLU-mul, down (into tmp) over `rows` rows of x. In
 * a tensor-parallel group o-proj and down are row-parallel: each rank's partial sums are
 * all-reduced on the stream (inside a decode graph's capture too). */
pie_code ec_layer_tail(eng_cuda *e, const ec_layer *L, float *x, uint32_t rows, const krn_bf16 *att,
                       float *tmp, pie_status *st) {
    uint32_t d = e->info.hidden_size;
    pie_code rc = ec_linear(e, att, rows, e->qd, L->wo, d, tmp, st);
    if (rc == PIE_OK && e->nccl) rc = ec_tp_allreduce(e, tmp, (size_t)rows * d, st);
    if (rc != PIE_OK) return rc;
    EC_CUDA(st, krn_cuda_add_rmsnorm(x, tmp, L->ffn_norm, (int)rows, (int)d, e->m->cfg.rms_eps,
                                     e->xn, NULL, e->stream));
    rc = ec_linear(e, e->xn, rows, d, L->w_gate_up, 2 * e->ffn, e->gu, st);
    if (rc != PIE_OK) return rc;
    EC_CUDA(st, krn_cuda_silu_mul(e->gu, (int)rows, (int)e->ffn, e->h, e->stream));
    e->step_launches += 2;
    rc = ec_linear(e, e->h, rows, e->ffn, L->w_down, d, tmp, st);
    if (rc == PIE_OK && e->nccl) rc = ec_tp_allreduce(e, tmp, (size_t)rows * d, st);
    return rc;
}

/* Layer l of the pass over *x (the output rows only in the last layer, *x then e->x2); *stored:
 * the pass ends after it (K/V stored, nothing else read). */
static pie_code ec_run_layer(eng_cuda *e, const ec_run *run, uint32_t l, float **x, bool *stored,
                             pie_status *st) {
    const mdl_config *c = &e->m->cfg;
    const ec_meta_layout *L = &run->lay;
    const int32_t *M = e->d_meta;
    const ec_layer *Ly = &e->layers[l];
    int d = (int)c->hidden_size;
    uint32_t R = run->rows;
    bool last = l + 1 == c->n_layers;
    EC_CUDA(st, krn_cuda_add_rmsnorm(*x, l == 0 ? NULL : e->tmp, Ly->attn_norm, (int)R, d,
                                     c->rms_eps, e->xn, NULL, e->stream));
    pie_code rc = ec_linear(e, e->xn, R, (uint32_t)d, Ly->wqkv, e->qkvd, e->qkv, st);
    if (rc != PIE_OK) return rc;
    EC_CUDA(st, krn_cuda_rope_qkv_append(e->qkv, M + L->pos, (int)R, (int)e->nh, (int)e->nkv,
                                         (int)c->head_dim, e->inv_freq, e->kb, e->vb, ec_kv(e, l),
                                         (int)e->info.kv_page_size, M + L->kv_dst, e->stream));
    e->step_launches += 2;
    *stored = last && run->n_out == 0;
    if (*stored) return PIE_OK;
    rc = ec_attention(e, l, run, last, st);
    if (rc != PIE_OK) return rc;
    uint32_t rows = R;
    if (last) { /* only the output rows go on */
        EC_CUDA(st, krn_cuda_gather_rows(e->x2, *x, M + L->out_row, (int)run->out_rows, d,
                                         e->stream));
        e->step_launches++;
        *x = e->x2;
        rows = run->out_rows;
    }
    return ec_layer_tail(e, Ly, *x, rows, e->att, e->tmp, st);
}

/* Enqueues the whole pass for the uploaded tables; nothing here waits or reads the host
 * tables, so it may run under stream capture (without the swap policy: under it each layer
 * first waits for its cache to be on the device). Under offload with host items this is
 * sub-batch 0 (the device items; run->rows 0 when there are none), and the host items'
 * sub-batch runs around each of its layers (eng_cuda_off.c): their q/k/v before it, their
 * host attention while the device runs it, their layer tail after it. */
static pie_code ec_run_layers(eng_cuda *e, const ec_run *run, pie_status *st) {
    const mdl_config *c = &e->m->cfg;
    const ec_meta_layout *L = &run->lay;
    const int32_t *M = e->d_meta;
    int d = (int)c->hidden_size;
    uint32_t R = run->rows;
    bool hosts = ec_off_step_hosts(e);
    float *x = e->x;
    if (R > 0) {
        EC_CUDA(st, krn_cuda_gather_rows(x, e->emb, M + L->in_slot, (int)R, d, e->stream));
        e->step_launches++;
    }
    bool stored = false;
    for (uint32_t l = 0; l < c->n_layers; l++) {
        pie_code rc = ec_swap_acquire(e, l, st); /* swap policy: layer l's cache is here */
        if (rc != PIE_OK) return rc;
        if (hosts) rc = ec_off_layer_begin(e, l, st);
        if (rc == PIE_OK && R > 0) rc = ec_run_layer(e, run, l, &x, &stored, st);
        ec_swap_release(e, l); /* after its kernels were enqueued, even the failed ones */
        if (rc == PIE_OK && hosts) rc = ec_off_layer_end(e, l, st);
        if (rc != PIE_OK) return rc;
    }
    if (hosts) {
        pie_code rc = ec_off_finish(e, st);
        if (rc != PIE_OK) return rc;
    }
    if (R == 0 || run->n_out == 0 || stored) return PIE_OK;
    float *y = x == e->x ? e->x2 : e->x; /* the buffer x is not */
    if (c->n_layers == 0) {              /* degenerate model: the outputs are the normed inputs */
        EC_CUDA(st, krn_cuda_gather_rows(e->x2, e->x, M + L->out_row, (int)run->out_rows, d,
                                         e->stream));
        e->step_launches++;
        x = e->x2;
        y = e->x;
    }
    EC_CUDA(st, krn_cuda_add_rmsnorm(x, c->n_layers ? e->tmp : NULL, e->norm, (int)run->out_rows, d,
                                     c->rms_eps, NULL, y, e->stream));
    EC_CUDA(st,
            krn_cuda_scatter_rows(e->emb, y, M + L->out_slot, (int)run->out_rows, d, e->stream));
    e->step_launches += 2;
    return PIE_OK;
}

/* ---- graphs ------------------------------------------------------------------------------ */

void ec_graphs_free(eng_cuda *e) {
    for (uint32_t i = 0; i < EC_GRAPHS; i++) {
        if (e->graphs[i].exec) (void)cudaGraphExecDestroy(e->graphs[i].exec);
        e->graphs[i] = (ec_graph){0};
    }
    e->stats.graphs = 0;
}

static uint32_t ec_bucket(uint32_t n) {
    uint32_t b = 1;
    while (b < n) b *= 2;
    return b;
}

static uint32_t ec_log2(uint32_t b) {
    uint32_t l = 0;
    while ((1u << l) < b) l++;
    return l;
}

/* A decode step: every item one input and one output, few enough items for a bucket. */
static bool ec_decode_shaped(const eng_cuda *e, const eng_forward_item *items, uint32_t n) {
    if (n > EC_GRAPH_MAX_T || ec_bucket(n) > e->info.max_batch_tokens || e->info.n_layers == 0)
        return false;
    for (uint32_t i = 0; i < n; i++)
        if (items[i].n_in != 1 || items[i].n_out != 1) return false;
    return true;
}

/* Kernel nodes of a captured graph (cuBLAS may add several per call). Capture path only: the
 * node list is allocated here. */
static uint32_t ec_graph_kernels(cudaGraph_t g) {
    size_t n = 0;
    uint32_t kernels = 0;
    if (cudaGraphGetNodes(g, NULL, &n) != cudaSuccess || n == 0) return 0;
    cudaGraphNode_t *nodes = malloc(n * sizeof *nodes);
    if (nodes && cudaGraphGetNodes(g, nodes, &n) == cudaSuccess)
        for (size_t i = 0; i < n; i++) {
            enum cudaGraphNodeType t;
            if (cudaGraphNodeGetType(nodes[i], &t) == cudaSuccess && t == cudaGraphNodeTypeKernel)
                kernels++;
        }
    free(nodes);
    return kernels;
}

/* Captures ec_run_layers for run's bucket into *out; on failure out->exec stays NULL, st says
 * why and the stream is no longer capturing. */
static pie_code ec_capture(eng_cuda *e, const ec_run *run, ec_graph *out, pie_status *st) {
    cudaGraph_t g = NULL;
    EC_CUDA(st, cudaStreamBeginCapture(e->stream, cudaStreamCaptureModeThreadLocal));
    pie_code rc = ec_run_layers(e, run, st);
    cudaError_t err = cudaStreamEndCapture(e->stream, &g); /* ends it whatever happened */
    if (rc == PIE_OK && err != cudaSuccess)
        rc = ec_cuda_fail(st, err, "cudaStreamEndCapture", __FILE__, __LINE__);
    if (rc == PIE_OK) {
        err = cudaGraphInstantiate(&out->exec, g, 0);
        if (err != cudaSuccess) {
            out->exec = NULL;
            rc = ec_cuda_fail(st, err, "cudaGraphInstantiate", __FILE__, __LINE__);
        }
    }
    if (rc == PIE_OK) out->kernels = ec_graph_kernels(g);
    if (g) (void)cudaGraphDestroy(g);
    return rc;
}

/* Runs the uploaded step from its bucket's graph, capturing it on first use. When the capture
 * fails (a cuBLAS or driver limit, not a device fault), the bucket launches directly from then
 * on and the step still runs; the first reason is kept in the stats. */
static pie_code ec_run_graph(eng_cuda *e, const ec_run *run, pie_status *st) {
    ec_graph *g = &e->graphs[ec_log2(run->rows)];
    if (!g->exec && !g->failed) {
        pie_code rc = ec_capture(e, run, g, st);
        if (rc != PIE_OK) {
            if (eng_cuda_fault(NULL, 0)) return rc; /* the context is gone: report it */
            (void)cudaGetLastError();               /* a capture error is not sticky */
            g->failed = true;
            e->stats.capture_failures++;
            if (!e->stats.capture_error[0])
                snprintf(e->stats.capture_error, sizeof e->stats.capture_error, "bucket %u: %.230s",
                         run->rows, st->msg);
            e->step_launches = 0;
        } else {
            e->stats.graphs++;
        }
    }
    if (!g->exec) return ec_run_layers(e, run, st);
    EC_CUDA(st, cudaGraphLaunch(g->exec, e->stream));
    e->stats.graph_steps++;
    e->step_launches = g->kernels;
    return PIE_OK;
}

/* ---- forward ----------------------------------------------------------------------------- */

pie_code eng_cuda_forward(eng_cuda *e, const eng_forward_item *items, uint32_t n, pie_status *st) {
    if (n == 0) return PIE_OK;
    uint32_t T = 0;
    pie_code rc = eng_check_forward(&e->chk, items, n, e->page_n_masked, &T, st);
    if (rc != PIE_OK) return rc;

    EC_CUDA(st, cudaSetDevice(e->dev)); /* handlers may run on any thread */
    rc = ec_off_prepare(e, items, n, st);       /* offload: the split, pages where they attend */
    if (rc == PIE_OK && ec_off_step_hosts(e)) { /* the device items run as sub-batch 0 */
        ec_off_device_items(e, &items, &n);
        T = 0;
        if (n > 0) rc = eng_check_forward(&e->chk, items, n, e->page_n_masked, &T, st);
    }
    if (rc != PIE_OK) {
        (void)cudaStreamSynchronize(e->stream); /* moves enqueued before the failure */
        return rc;
    }
    /* under the swap policy a layer's cache moves between steps: no graph holds its address;
     * a step with host items needs the engine's thread inside every layer */
    bool decode = ec_decode_shaped(e, items, n);
    bool graph = decode && e->graphs_on && !e->tier && !ec_off_step_hosts(e);
    ec_run run = {0};
    e->step_launches = 0;
    run.rows = graph ? ec_bucket(T) : T;
    uint64_t n_pages = 0, n_runs = 0, n_out = 0;
    for (uint32_t i = 0; i < n; i++) {
        n_pages += items[i].n_kv_pages;
        n_runs += items[i].mask_runs ? items[i].n_mask_runs : 0;
        n_out += items[i].n_out;
    }
    run.out_rows = graph ? run.rows : (uint32_t)n_out;
    ec_fill_tables(e, items, n, T, run.rows, graph, &run);
    ec_swap_touch(e, eng_check_kv_top_forward(items, n));
    rc = ec_upload_tables(e, &run, n_pages, n_runs, st);
    if (rc == PIE_OK) rc = graph ? ec_run_graph(e, &run, st) : ec_run_layers(e, &run, st);
    if (rc == PIE_OK && e->fault_after && ++e->forward_calls == e->fault_after)
        EC_CUDA(st, krn_cuda_trap(e->stream)); /* PIE_CUDA_FAULT_AFTER: the fault comes next */
    if (rc != PIE_OK) {
        pie_status ignored; /* rc's reason is the one to report */
        if (e->nccl) /* a collective may be waiting for a hung peer */
            (void)ec_tp_sync(e, &ignored);
        else
            (void)cudaStreamSynchronize(e->stream);
        return rc;
    }
    if (e->nccl) { /* a peer's failure or hang surfaces here (the group is not repaired) */
        rc = ec_tp_sync(e, st);
        if (rc != PIE_OK) return rc;
    } else {
        EC_CUDA(st, cudaStreamSynchronize(e->stream));
    }
    e->stats.forward_steps++;
    e->stats.decode_steps += decode;
    e->stats.last_step_kernels = e->step_launches;
    /* an output inherits its input's position (from the table: slots may be rewritten here) */
    const int32_t *M = e->h_meta;
    for (uint32_t r = 0; r < run.n_out; r++)
        e->emb_pos[M[run.lay.out_slot + r]] = (uint32_t)M[run.lay.pos + M[run.lay.out_row + r]];
    return PIE_OK;
}
