/* eng_cuda_fwd.c — the cuda backend's forward pass: validation, the per-batch tables, the
 * layer loop on the device, and CUDA-graph capture/replay of decode steps.
 *
 * Owns: eng_cuda_forward and ec_linear. A call (1) validates every item with the cpu backend's
 * checks (eng_check.c, plus two capacities: page-list and mask-run totals), (2) writes the batch's
 * tables into pinned host memory — input slot and RoPE position per row, the pool token each
 * appended row's K/V goes to, output rows and slots, attention tiles for all rows and for the
 * output rows, page lists, mask runs and each masked row's first run — and uploads them in one
 * copy, (3) runs the layers: every kernel reads its per-batch values from those tables, so the
 * same launches serve any batch of the same shape. A decode step (every item one input and one
 * output, at most EC_GRAPH_MAX_T items) is padded to a power-of-two bucket and replayed from a
 * graph captured the first time that (bucket, split) shape is seen; padding rows read slot 0,
 * store nothing, write no slot, and their tiles are empty.
 * Does not own: the pool and other handlers (eng_cuda.c), the kernels (kernels/cuda), the
 * run-length mask format (eng_mask.c), validation (eng_check.c). */
#include <string.h>

#include "eng_cuda_impl.h"
#include "eng_mask.h"

/* ---- linear ------------------------------------------------------------------------------ */

pie_code ec_linear(eng_cuda *e, const krn_bf16 *x, uint32_t rows, uint32_t in, const krn_bf16 *w,
                   uint32_t out, float *y, pie_status *st) {
    if (rows == 0 || out == 0) return PIE_OK;
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
        };
    }
    return n;
}

/* Split count for a tile list (same for every tile; chunks per tile). */
static uint32_t ec_splits(const eng_cuda *e, krn_cuda_attn_tile *t, uint32_t n_tiles,
                          uint32_t rows) {
    uint32_t max_keys = 0;
    for (uint32_t i = 0; i < n_tiles; i++) {
        uint32_t lim = (uint32_t)(t[i].n_ctx + t[i].n_tail);
        uint32_t causal = (uint32_t)(t[i].q_seq + t[i].n_q);
        if (causal < lim) lim = causal;
        if (t[i].n_q > 0 && lim > max_keys) max_keys = lim;
    }
    uint64_t units = (uint64_t)n_tiles * e->info.n_kv_heads, target = 2ull * (uint64_t)e->n_sms;
    uint32_t s = 1;
    if (rows <= e->split_rows && units < target && max_keys >= 512) {
        uint64_t want = (target + units - 1) / units;
        uint64_t most = max_keys / 256;
        if (want > most) want = most;
        if (want > KRN_CUDA_MAX_SPLITS) want = KRN_CUDA_MAX_SPLITS;
        while (s * 2 <= want) s *= 2; /* powers of two: fewer graph shapes */
    }
    for (uint32_t i = 0; i < n_tiles; i++) {
        uint32_t lim = (uint32_t)(t[i].n_ctx + t[i].n_tail),
                 causal = (uint32_t)(t[i].q_seq + t[i].n_q);
        if (causal < lim) lim = causal;
        uint32_t chunk = (lim + s - 1) / s;
        t[i].kv_chunk = (int32_t)((chunk + 31) / 32 * 32);
    }
    return s;
}

/* Fills the host tables for rows R >= T (R > T pads a graph bucket). */
static void ec_fill_tables(eng_cuda *e, const eng_forward_item *items, uint32_t n, uint32_t T,
                           uint32_t R, bool graph, ec_run *run) {
    const eng_info *in = &e->info;
    uint32_t ps = in->kv_page_size;
    ec_meta_layout L = ec_layout(e, R);
    int32_t *M = e->h_meta;
    krn_cuda_attn_tile *ta = (krn_cuda_attn_tile *)(M + L.tiles_all);
    krn_cuda_attn_tile *to = (krn_cuda_attn_tile *)(M + L.tiles_out);
    uint32_t n_out = 0, n_ta = 0, n_to = 0, runs_at = 0, most_in = 0, most_out = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (items[i].n_in > most_in) most_in = items[i].n_in;
        if (items[i].n_out > most_out) most_out = items[i].n_out;
    }
    /* prefill-shaped lists (an item with at least 16 rows) go to the tensor-core kernel */
    run->tc_all = !graph && e->tc_rows > 0 && most_in >= 16;
    run->tc_out = !graph && e->tc_rows > 0 && most_out >= 16;
    uint32_t rows_all = run->tc_all ? e->tc_rows : e->tile_rows;
    uint32_t rows_out = run->tc_out ? e->tc_rows : e->tile_rows;
    for (uint32_t i = 0; i < n; i++) {
        const eng_forward_item *it = &items[i];
        const eng_check_plan *p = &e->chk.plan[i];
        if (it->n_kv_pages > 0) /* kv_pages may be NULL then */
            memcpy(M + L.pages + p->pages, it->kv_pages, it->n_kv_pages * sizeof(uint32_t));
        uint32_t cursor = 0;
        for (uint32_t t = 0; t < it->n_in; t++) {
            uint32_t row = p->first + t, slot = it->in_slots[t];
            M[L.in_slot + row] = (int32_t)slot;
            M[L.pos + row] = (int32_t)e->emb_pos[slot];
            int32_t dst = -1;
            if (it->append_kv) {
                uint32_t s = p->ctx + t;
                dst = (int32_t)(it->kv_pages[s / ps] * ps + s % ps);
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
        n_ta += ec_item_tiles(it, p, 0, p->first, rows_all, ta + n_ta);
        if (it->n_out > 0)
            n_to += ec_item_tiles(it, p, it->n_in - it->n_out, n_out, rows_out, to + n_to);
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
    krn_cuda_attn_tile empty = {.n_q = 0, .mask_row = -1};
    uint32_t tiles_cap = graph ? R : n_ta;
    for (uint32_t k = n_ta; k < tiles_cap; k++) ta[k] = empty;
    uint32_t out_cap = graph ? R : n_to;
    for (uint32_t k = n_to; k < out_cap; k++) to[k] = empty;
    run->tiles_all = tiles_cap;
    run->tiles_out = out_cap;
    run->splits_all = run->tc_all ? 1 : ec_splits(e, ta, tiles_cap, R);
    run->splits_out = run->tc_out ? 1 : ec_splits(e, to, out_cap, graph ? R : n_out);
    run->n_out = n_out;
    run->lay = L;
}

/* Uploads the tables: everything up to the end of the page lists, and the runs used. */
static pie_code ec_upload_tables(eng_cuda *e, const ec_run *run, uint64_t n_pages, uint64_t n_runs,
                                 pie_status *st) {
    const ec_meta_layout *L = &run->lay;
    size_t head = (L->pages + n_pages) * sizeof(int32_t);
    EC_CUDA(st, cudaMemcpyAsync(e->d_meta, e->h_meta, head, cudaMemcpyHostToDevice, e->stream));
    if (n_runs > 0)
        EC_CUDA(st, cudaMemcpyAsync(e->d_meta + L->runs, e->h_meta + L->runs,
                                    n_runs * sizeof(int32_t), cudaMemcpyHostToDevice, e->stream));
    return PIE_OK;
}

/* ---- the layers on the device ------------------------------------------------------------ */

static krn_cuda_attn_args ec_attn_args(const eng_cuda *e, uint32_t layer, const ec_run *run,
                                       bool outputs) {
    const mdl_config *c = &e->m->cfg;
    const ec_meta_layout *L = &run->lay;
    return (krn_cuda_attn_args){
        .tiles = (const krn_cuda_attn_tile *)(e->d_meta + (outputs ? L->tiles_out : L->tiles_all)),
        .n_tiles = (int)(outputs ? run->tiles_out : run->tiles_all),
        .q = e->qkv,
        .q_stride = (int)e->qkvd,
        .kv = e->kv + (size_t)layer * e->kv_layer_elems,
        .page_list = (const uint32_t *)(e->d_meta + L->pages),
        .page_mask = e->d_page_mask,
        .page_size = (int)e->info.kv_page_size,
        .kb = e->kb,
        .vb = e->vb,
        .runs = (const uint32_t *)(e->d_meta + L->runs),
        .row_runs = e->d_meta + L->row_runs,
        .n_heads = (int)c->n_heads,
        .n_kv_heads = (int)c->n_kv_heads,
        .hd = (int)c->head_dim,
        .scale = e->attn_scale,
        .out = e->att,
        .n_splits = (int)(outputs ? run->splits_out : run->splits_all),
        .part_acc = e->part_acc,
        .part_ml = e->part_ml,
        .split_rows = (int)e->split_rows,
    };
}

/* o-proj, residual + norm, gate|up, SiLU-mul, down (into tmp) over `rows` rows of x. */
static pie_code ec_layer_tail(eng_cuda *e, const ec_layer *L, float *x, uint32_t rows,
                              pie_status *st) {
    uint32_t d = e->info.hidden_size;
    pie_code rc = ec_linear(e, e->att, rows, e->qd, L->wo, d, e->tmp, st);
    if (rc != PIE_OK) return rc;
    EC_CUDA(st, krn_cuda_add_rmsnorm(x, e->tmp, L->ffn_norm, (int)rows, (int)d, e->m->cfg.rms_eps,
                                     e->xn, NULL, e->stream));
    rc = ec_linear(e, e->xn, rows, d, L->w_gate_up, 2 * e->ffn, e->gu, st);
    if (rc != PIE_OK) return rc;
    EC_CUDA(st, krn_cuda_silu_mul(e->gu, (int)rows, (int)e->ffn, e->h, e->stream));
    return ec_linear(e, e->h, rows, e->ffn, L->w_down, d, e->tmp, st);
}

/* Enqueues the whole pass for the uploaded tables; nothing here waits or reads the host
 * tables, so it may run under stream capture. */
static pie_code ec_run_layers(eng_cuda *e, const ec_run *run, pie_status *st) {
    const mdl_config *c = &e->m->cfg;
    const ec_meta_layout *L = &run->lay;
    const int32_t *M = e->d_meta;
    int d = (int)c->hidden_size;
    uint32_t R = run->rows;
    float *x = e->x;
    EC_CUDA(st, krn_cuda_gather_rows(x, e->emb, M + L->in_slot, (int)R, d, e->stream));
    for (uint32_t l = 0; l < c->n_layers; l++) {
        const ec_layer *Ly = &e->layers[l];
        bool last = l + 1 == c->n_layers;
        EC_CUDA(st, krn_cuda_add_rmsnorm(x, l == 0 ? NULL : e->tmp, Ly->attn_norm, (int)R, d,
                                         c->rms_eps, e->xn, NULL, e->stream));
        pie_code rc = ec_linear(e, e->xn, R, (uint32_t)d, Ly->wqkv, e->qkvd, e->qkv, st);
        if (rc != PIE_OK) return rc;
        EC_CUDA(st,
                krn_cuda_rope_qkv(e->qkv, M + L->pos, (int)R, (int)c->n_heads, (int)c->n_kv_heads,
                                  (int)c->head_dim, e->inv_freq, e->kb, e->vb, e->stream));
        EC_CUDA(st,
                krn_cuda_kv_append(e->kv + (size_t)l * e->kv_layer_elems, (int)e->info.kv_page_size,
                                   (int)e->kvd, e->kb, e->vb, M + L->kv_dst, (int)R, e->stream));
        if (last && run->n_out == 0) return PIE_OK; /* K/V stored; nothing else is read */
        krn_cuda_attn_args a = ec_attn_args(e, l, run, last);
        EC_CUDA(st, (last ? run->tc_out : run->tc_all) ? krn_cuda_attention_tc(&a, e->stream)
                                                       : krn_cuda_attention(&a, e->stream));
        uint32_t rows = R;
        if (last) { /* only the output rows go on */
            EC_CUDA(st, krn_cuda_gather_rows(e->x2, x, M + L->out_row, (int)run->out_rows, d,
                                             e->stream));
            x = e->x2;
            rows = run->out_rows;
        }
        rc = ec_layer_tail(e, Ly, x, rows, st);
        if (rc != PIE_OK) return rc;
    }
    if (run->n_out == 0) return PIE_OK;
    float *y = x == e->x ? e->x2 : e->x; /* the buffer x is not */
    if (c->n_layers == 0) {              /* degenerate model: the outputs are the normed inputs */
        EC_CUDA(st, krn_cuda_gather_rows(e->x2, e->x, M + L->out_row, (int)run->out_rows, d,
                                         e->stream));
        x = e->x2;
        y = e->x;
    }
    EC_CUDA(st, krn_cuda_add_rmsnorm(x, c->n_layers ? e->tmp : NULL, e->norm, (int)run->out_rows, d,
                                     c->rms_eps, NULL, y, e->stream));
    EC_CUDA(st,
            krn_cuda_scatter_rows(e->emb, y, M + L->out_slot, (int)run->out_rows, d, e->stream));
    return PIE_OK;
}

/* ---- graphs ------------------------------------------------------------------------------ */

void ec_graphs_free(eng_cuda *e) {
    for (uint32_t i = 0; i < e->n_graphs; i++) (void)cudaGraphExecDestroy(e->graphs[i].exec);
    e->n_graphs = 0;
}

static uint32_t ec_bucket(uint32_t n) {
    uint32_t b = 1;
    while (b < n) b *= 2;
    return b;
}

/* A decode step: every item one input and one output, few enough items. */
static bool ec_graph_eligible(const eng_cuda *e, const eng_forward_item *items, uint32_t n) {
    if (!e->graphs_on || n > EC_GRAPH_MAX_T || ec_bucket(n) > e->info.max_batch_tokens ||
        e->info.n_layers == 0)
        return false;
    for (uint32_t i = 0; i < n; i++)
        if (items[i].n_in != 1 || items[i].n_out != 1) return false;
    return true;
}

/* Captures ec_run_layers for run's shape; returns NULL exec on failure (st set). */
static pie_code ec_capture(eng_cuda *e, const ec_run *run, cudaGraphExec_t *exec, pie_status *st) {
    cudaGraph_t g = NULL;
    *exec = NULL;
    EC_CUDA(st, cudaStreamBeginCapture(e->stream, cudaStreamCaptureModeThreadLocal));
    pie_code rc = ec_run_layers(e, run, st);
    cudaError_t err = cudaStreamEndCapture(e->stream, &g);
    if (rc != PIE_OK) {
        if (g) (void)cudaGraphDestroy(g);
        return rc;
    }
    if (err != cudaSuccess)
        return ec_cuda_fail(st, err, "cudaStreamEndCapture", __FILE__, __LINE__);
    err = cudaGraphInstantiate(exec, g, 0);
    (void)cudaGraphDestroy(g);
    if (err != cudaSuccess) {
        *exec = NULL;
        return ec_cuda_fail(st, err, "cudaGraphInstantiate", __FILE__, __LINE__);
    }
    return PIE_OK;
}

/* Runs the uploaded step from the graph of its shape (captured on first use). Falls back to
 * launching directly when the cache is full. */
static pie_code ec_run_graph(eng_cuda *e, const ec_run *run, pie_status *st) {
    for (uint32_t i = 0; i < e->n_graphs; i++) {
        ec_graph *g = &e->graphs[i];
        if (g->rows == run->rows && g->splits == (run->splits_all << 8 | run->splits_out)) {
            EC_CUDA(st, cudaGraphLaunch(g->exec, e->stream));
            e->graph_replays++;
            return PIE_OK;
        }
    }
    if (e->n_graphs == EC_GRAPHS) return ec_run_layers(e, run, st);
    cudaGraphExec_t exec;
    pie_code rc = ec_capture(e, run, &exec, st);
    if (rc != PIE_OK) return rc;
    e->graphs[e->n_graphs++] = (ec_graph){
        .rows = run->rows, .splits = run->splits_all << 8 | run->splits_out, .exec = exec};
    EC_CUDA(st, cudaGraphLaunch(exec, e->stream));
    e->graph_replays++;
    return PIE_OK;
}

/* ---- forward ----------------------------------------------------------------------------- */

pie_code eng_cuda_forward(eng_cuda *e, const eng_forward_item *items, uint32_t n, pie_status *st) {
    if (n == 0) return PIE_OK;
    uint32_t T = 0;
    pie_code rc = eng_check_forward(&e->chk, items, n, e->page_n_masked, &T, st);
    if (rc != PIE_OK) return rc;

    EC_CUDA(st, cudaSetDevice(e->dev)); /* handlers may run on any thread */
    bool graph = ec_graph_eligible(e, items, n);
    ec_run run = {0};
    run.rows = graph ? ec_bucket(T) : T;
    uint64_t n_pages = 0, n_runs = 0, n_out = 0;
    for (uint32_t i = 0; i < n; i++) {
        n_pages += items[i].n_kv_pages;
        n_runs += items[i].mask_runs ? items[i].n_mask_runs : 0;
        n_out += items[i].n_out;
    }
    run.out_rows = graph ? run.rows : (uint32_t)n_out;
    ec_fill_tables(e, items, n, T, run.rows, graph, &run);
    rc = ec_upload_tables(e, &run, n_pages, n_runs, st);
    if (rc == PIE_OK) rc = graph ? ec_run_graph(e, &run, st) : ec_run_layers(e, &run, st);
    if (rc != PIE_OK) {
        (void)cudaStreamSynchronize(e->stream);
        return rc;
    }
    EC_CUDA(st, cudaStreamSynchronize(e->stream));
    /* an output inherits its input's position (from the table: slots may be rewritten here) */
    const int32_t *M = e->h_meta;
    for (uint32_t r = 0; r < run.n_out; r++)
        e->emb_pos[M[run.lay.out_slot + r]] = (uint32_t)M[run.lay.pos + M[run.lay.out_row + r]];
    return PIE_OK;
}
