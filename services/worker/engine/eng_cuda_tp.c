/* eng_cuda_tp.c — the cuda engine as one rank of a tensor-parallel group, over NCCL
 * (Megatron-style, the split of eng_shard.h, the same as the cpu engine's eng_cpu_tp.c).
 *
 * Owns: uploading the rank's shard (rows of wq/wk/wv fused into wqkv, rows of w_gate/w_up
 * fused into w_gate_up, the columns of wo and w_down this rank's heads and MLP columns read,
 * its rows of embed_tokens and lm_head), the all-reduce the forward runs after o_proj and
 * after down_proj (on the compute stream, so the decode graphs capture it), the
 * vocabulary-parallel embedding, next_dist without gathering logits, and the gathered logits.
 * Does not own: the forward (eng_cuda_fwd.c calls ec_tp_allreduce), the communicator
 * (services/worker/tp/wrk_nccl.c), the merge (eng_tp_dist.c, shared with the cpu engine).
 *
 * next_dist, per group of up to dist_rows rows, the cpu engine's algorithm (eng_cpu_tp.c's
 * header) with the work on the device: lm_head over this rank's slice, each row's slice
 * maximum (krn_cuda_row_max) all-gathered, the row's maximum M and the rank holding its first
 * occurrence found on the host (eng_tp_max_holder) and uploaded, then krn_cuda_topk_shifted:
 * exp((l - M) / T) over the slice, its top min(top_k, slice) and its sum; three all-gathers
 * (ids, values: [rows, TOPK_MAX] per rank, not [rows, vocab]; sums) and one copy to the host,
 * where every rank merges every row exactly with the cpu engine's eng_tp_merge_lists. Every
 * rank returns the same result; the worker uses rank 0's.
 *
 * Without NCCL (PIE_WITH_NCCL unset) eng_cuda_open refuses an engine with nccl, so nothing here
 * is reached: the functions fail with INTERNAL. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "eng_cuda_impl.h"

#ifdef PIE_WITH_NCCL

#include "wrk_nccl.h"

#define EC_TP_MAX_RANKS 64 /* krn_cpu_topk_merge's lists; wrk_tp's groups are no larger */

/* ---- weights ------------------------------------------------------------------------------- */

/* Columns [c0, c0 + n) of t as bf16 to dst ([t.rows, n]) through the pinned stage. */
static pie_code ec_tp_upload_cols(eng_cuda *e, const mdl_tensor *t, uint32_t c0, uint32_t n,
                                  krn_bf16 *dst, pie_status *st) {
    if (n == 0 || t->rows == 0) return PIE_OK;
    size_t rows_per = EC_STAGE_BYTES / sizeof(uint16_t) / n;
    if (rows_per == 0)
        return pie_status_set(st, PIE_INTERNAL, "eng_open: a row of %u columns exceeds the stage",
                              n);
    uint16_t *s = (uint16_t *)e->h_stage;
    for (size_t r0 = 0; r0 < t->rows; r0 += rows_per) {
        size_t rows = t->rows - r0 < rows_per ? t->rows - r0 : rows_per;
        eng_shard_cols_bf16(t, c0, n, r0, rows, s);
        EC_CUDA(st,
                cudaMemcpy(dst + r0 * n, s, rows * n * sizeof(uint16_t), cudaMemcpyHostToDevice));
    }
    return PIE_OK;
}

pie_code ec_tp_upload_weights(eng_cuda *e, pie_status *st) {
    const mdl_model *m = e->m;
    const eng_shard *s = &e->shard;
    size_t d = m->cfg.hidden_size, hd = m->cfg.head_dim;
    if (s->size > EC_TP_MAX_RANKS)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "eng_open: tp_size %u exceeds %d ranks",
                              s->size, EC_TP_MAX_RANKS);
    if (wrk_nccl_rank(e->nccl) != s->rank || wrk_nccl_size(e->nccl) != s->size)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "eng_open: tp_rank %u of tp_size %u, but the NCCL communicator is "
                              "rank %u of %u",
                              s->rank, s->size, wrk_nccl_rank(e->nccl), wrk_nccl_size(e->nccl));
    mdl_tensor embed = eng_shard_rows(&m->embed, s->vocab0, s->n_vocab);
    pie_code rc = ec_upload(e, &embed, e->embed, st);
    if (rc == PIE_OK && !m->cfg.tie_word_embeddings) {
        mdl_tensor head = eng_shard_rows(&m->lm_head, s->vocab0, s->n_vocab);
        rc = ec_upload(e, &head, e->lm_head, st);
    }
    if (rc == PIE_OK) rc = ec_upload(e, &m->norm, e->norm, st);
    for (uint32_t l = 0; rc == PIE_OK && l < m->cfg.n_layers; l++) {
        const mdl_layer *L = &m->layers[l];
        ec_layer *D = &e->layers[l];
        krn_bf16 *qkv = (krn_bf16 *)D->wqkv, *gu = (krn_bf16 *)D->w_gate_up;
        mdl_tensor wq = eng_shard_rows(&L->wq, s->head0 * (uint32_t)hd, e->qd);
        mdl_tensor wk = eng_shard_rows(&L->wk, s->kv_head0 * (uint32_t)hd, e->kvd);
        mdl_tensor wv = eng_shard_rows(&L->wv, s->kv_head0 * (uint32_t)hd, e->kvd);
        mdl_tensor wg = eng_shard_rows(&L->w_gate, s->ffn0, s->n_ffn);
        mdl_tensor wu = eng_shard_rows(&L->w_up, s->ffn0, s->n_ffn);
        rc = ec_upload(e, &L->attn_norm, (krn_bf16 *)D->attn_norm, st);
        if (rc == PIE_OK) rc = ec_upload(e, &wq, qkv, st);
        if (rc == PIE_OK) rc = ec_upload(e, &wk, qkv + (size_t)e->qd * d, st);
        if (rc == PIE_OK) rc = ec_upload(e, &wv, qkv + (size_t)(e->qd + e->kvd) * d, st);
        if (rc == PIE_OK)
            rc =
                ec_tp_upload_cols(e, &L->wo, s->head0 * (uint32_t)hd, e->qd, (krn_bf16 *)D->wo, st);
        if (rc == PIE_OK) rc = ec_upload(e, &L->ffn_norm, (krn_bf16 *)D->ffn_norm, st);
        if (rc == PIE_OK) rc = ec_upload(e, &wg, gu, st);
        if (rc == PIE_OK) rc = ec_upload(e, &wu, gu + (size_t)e->ffn * d, st);
        if (rc == PIE_OK)
            rc = ec_tp_upload_cols(e, &L->w_down, s->ffn0, e->ffn, (krn_bf16 *)D->w_down, st);
    }
    /* what this rank holds on the device, bf16 */
    size_t per_layer = 2 * d + (size_t)e->qkvd * d + d * e->qd + 3 * (size_t)e->ffn * d;
    size_t vocab = (m->cfg.tie_word_embeddings ? 1u : 2u) * (size_t)e->nv * d;
    e->info.weight_bytes = (per_layer * m->cfg.n_layers + vocab + d) * sizeof(krn_bf16);
    return rc;
}

/* ---- collectives --------------------------------------------------------------------------- */

pie_code ec_tp_allreduce(eng_cuda *e, float *x, size_t n, pie_status *st) {
    e->step_launches++;
    return wrk_nccl_allreduce_sum(e->nccl, x, n, WRK_NCCL_F32, e->stream, st);
}

/* The stream's work, waited for with the group's timeout (wrk_nccl_sync: a hung peer fails
 * the group instead of stopping this rank for good); a CUDA error takes the usual path. */
pie_code ec_tp_sync(eng_cuda *e, pie_status *st) {
    int err = 0;
    pie_code rc = wrk_nccl_sync(e->nccl, e->stream, &err, st);
    if (rc != PIE_OK) return rc;
    if (err != 0) return ec_cuda_fail(st, (cudaError_t)err, "cudaStreamQuery", __FILE__, __LINE__);
    return PIE_OK;
}

/* ---- embed --------------------------------------------------------------------------------- */

/* Rows of T at a time: zeros in tmp, this rank's tokens' rows embedded there (krn_cuda_embed
 * with the row as its "slot"), the all-reduce (exactly one rank holds each row: the sum is
 * that row, bit for bit), then the rows scattered to their slots. */
pie_code ec_tp_embed_text(eng_cuda *e, const uint32_t *slots, const uint32_t *tokens, uint32_t n,
                          pie_status *st) {
    uint32_t d = e->info.hidden_size, v0 = e->shard.vocab0, nv = e->nv;
    uint32_t cap = e->info.max_batch_tokens;
    if ((size_t)cap * 3 > e->meta_words) cap = (uint32_t)(e->meta_words / 3);
    uint32_t *h = (uint32_t *)e->h_meta, *dv = (uint32_t *)e->d_meta; /* [cap] x3: tok, row, slot */
    for (uint32_t at = 0; at < n; at += cap) {
        uint32_t rows = n - at < cap ? n - at : cap, mine = 0;
        for (uint32_t i = 0; i < rows; i++) {
            uint32_t t = tokens[at + i];
            if (t >= v0 && t - v0 < nv) {
                h[mine] = t - v0;
                h[cap + mine] = i;
                mine++;
            }
            h[2 * cap + i] = slots[at + i];
        }
        EC_CUDA(st, cudaMemcpyAsync(dv, h, 3 * (size_t)cap * sizeof(uint32_t),
                                    cudaMemcpyHostToDevice, e->stream));
        EC_CUDA(st, cudaMemsetAsync(e->tmp, 0, (size_t)rows * d * sizeof(float), e->stream));
        if (mine > 0)
            EC_CUDA(st,
                    krn_cuda_embed(e->embed, (int)d, dv, dv + cap, (int)mine, e->tmp, e->stream));
        pie_code rc = ec_tp_allreduce(e, e->tmp, (size_t)rows * d, st);
        if (rc != PIE_OK) return rc;
        EC_CUDA(st, krn_cuda_scatter_rows(e->emb, e->tmp, (const int32_t *)(dv + 2 * cap),
                                          (int)rows, (int)d, e->stream));
        rc = ec_tp_sync(e, st); /* the tables are reused next round */
        if (rc != PIE_OK) return rc;
    }
    return PIE_OK;
}

/* ---- next_dist ----------------------------------------------------------------------------- */

/* Rows of rank r's slice of the vocabulary. */
static uint32_t ec_tp_rank_vocab(const eng_cuda *e, uint32_t r) {
    uint32_t v0 = r * e->shard.vocab_stride, V = e->info.vocab_size;
    return V - v0 < e->shard.vocab_stride ? V - v0 : e->shard.vocab_stride;
}

/* Step 1 of a group of rows: each row's slice maximum, gathered; then, on the host, the row's
 * maximum and whether this rank holds its first occurrence, uploaded as the shift. */
static pie_code ec_tp_shift(eng_cuda *e, uint32_t rows, pie_status *st) {
    uint32_t N = e->shard.size;
    EC_CUDA(st, krn_cuda_row_max(e->logits, (int)rows, (int)e->nv, e->d_max, e->stream));
    pie_code rc =
        wrk_nccl_allgather(e->nccl, e->d_max, e->d_g_max, rows * sizeof(float), e->stream, st);
    if (rc != PIE_OK) return rc;
    EC_CUDA(st, cudaMemcpyAsync(e->h_g_max, e->d_g_max, (size_t)N * rows * sizeof(float),
                                cudaMemcpyDeviceToHost, e->stream));
    rc = ec_tp_sync(e, st);
    if (rc != PIE_OK) return rc;
    for (uint32_t row = 0; row < rows; row++) { /* h_g_max: [N][rows] */
        float max;
        uint32_t holder = eng_tp_max_holder(e->h_g_max + row, rows, N, &max);
        e->h_shift[2 * row] = max;
        e->h_shift[2 * row + 1] = holder == e->shard.rank ? 1.0f : 0.0f;
    }
    EC_CUDA(st, cudaMemcpyAsync(e->d_shift, e->h_shift, 2 * (size_t)rows * sizeof(float),
                                cudaMemcpyHostToDevice, e->stream));
    return PIE_OK;
}

/* Step 3 of one row: the ranks' lists (their ids made global) merged with the sums added in
 * rank order — the cpu engine's merge. */
static void ec_tp_merge_row(eng_cuda *e, uint32_t rows, uint32_t row, eng_dist_item *it) {
    const uint32_t *ids[EC_TP_MAX_RANKS];
    const float *vals[EC_TP_MAX_RANKS];
    int counts[EC_TP_MAX_RANKS];
    uint32_t N = e->shard.size;
    double sum = 0.0;
    for (uint32_t r = 0; r < N; r++) {
        size_t at = ((size_t)r * rows + row) * KRN_CUDA_TOPK_MAX;
        uint32_t nv = ec_tp_rank_vocab(e, r), k = it->top_k < nv ? it->top_k : nv;
        uint32_t *g = e->h_g_ids + at;
        for (uint32_t i = 0; i < k; i++) g[i] += r * e->shard.vocab_stride;
        ids[r] = g;
        vals[r] = e->h_g_vals + at;
        counts[r] = (int)k;
        sum += e->h_g_sums[(size_t)r * rows + row];
    }
    eng_tp_merge_lists(ids, vals, counts, N, sum, it->top_k, it->ids, it->probs);
}

pie_code ec_tp_next_dist(eng_cuda *e, eng_dist_item *items, uint32_t n, pie_status *st) {
    uint32_t R = e->dist_rows, N = e->shard.size;
    for (uint32_t start = 0; start < n; start += R) {
        uint32_t rows = n - start < R ? n - start : R;
        /* a slice's top k holds at most its rows */
        pie_code rc = ec_dist_upload(e, &items[start], rows, e->nv, st);
        if (rc == PIE_OK) rc = ec_lm_head(e, rows, st);
        if (rc == PIE_OK) rc = ec_tp_shift(e, rows, st);
        if (rc != PIE_OK) return rc;
        /* step 2: this slice's exponentials against the row's maximum, their top k and sum */
        EC_CUDA(st, krn_cuda_topk_shifted(e->logits, (int)rows, (int)e->nv, e->d_temp, e->d_topk,
                                          e->d_shift, e->d_top_ids, e->d_top_probs, e->d_sums,
                                          e->stream));
        size_t top = (size_t)rows * KRN_CUDA_TOPK_MAX;
        rc = wrk_nccl_allgather(e->nccl, e->d_top_ids, e->d_g_ids, top * sizeof(uint32_t),
                                e->stream, st);
        if (rc == PIE_OK)
            rc = wrk_nccl_allgather(e->nccl, e->d_top_probs, e->d_g_vals, top * sizeof(float),
                                    e->stream, st);
        if (rc == PIE_OK)
            rc = wrk_nccl_allgather(e->nccl, e->d_sums, e->d_g_sums, rows * sizeof(float),
                                    e->stream, st);
        if (rc != PIE_OK) return rc;
        EC_CUDA(st, cudaMemcpyAsync(e->h_g_ids, e->d_g_ids, N * top * sizeof(uint32_t),
                                    cudaMemcpyDeviceToHost, e->stream));
        EC_CUDA(st, cudaMemcpyAsync(e->h_g_vals, e->d_g_vals, N * top * sizeof(float),
                                    cudaMemcpyDeviceToHost, e->stream));
        EC_CUDA(st, cudaMemcpyAsync(e->h_g_sums, e->d_g_sums, (size_t)N * rows * sizeof(float),
                                    cudaMemcpyDeviceToHost, e->stream));
        rc = ec_tp_sync(e, st);
        if (rc != PIE_OK) return rc;
        for (uint32_t row = 0; row < rows; row++)
            ec_tp_merge_row(e, rows, row, &items[start + row]);
    }
    return PIE_OK;
}

/* ---- logits -------------------------------------------------------------------------------- */

pie_code ec_tp_logits(eng_cuda *e, uint32_t slot, float *logits, pie_status *st) {
    uint32_t stride = e->shard.vocab_stride;
    e->h_dist_i[0] = (int32_t)slot;
    EC_CUDA(st, cudaMemcpyAsync(e->d_slot_idx, e->h_dist_i, sizeof(int32_t), cudaMemcpyHostToDevice,
                                e->stream));
    pie_code rc = ec_lm_head(e, 1, st);
    if (rc != PIE_OK) return rc;
    float *mine = e->d_g_logits + (size_t)e->shard.rank * stride; /* in place */
    EC_CUDA(st, cudaMemcpyAsync(mine, e->logits, e->nv * sizeof(float), cudaMemcpyDeviceToDevice,
                                e->stream));
    if (stride > e->nv)
        EC_CUDA(st, cudaMemsetAsync(mine + e->nv, 0, (stride - e->nv) * sizeof(float), e->stream));
    rc = wrk_nccl_allgather(e->nccl, mine, e->d_g_logits, (size_t)stride * sizeof(float), e->stream,
                            st);
    if (rc != PIE_OK) return rc;
    /* the slices in vocabulary order */
    EC_CUDA(st, cudaMemcpyAsync(logits, e->d_g_logits, e->info.vocab_size * sizeof(float),
                                cudaMemcpyDeviceToHost, e->stream));
    return ec_tp_sync(e, st);
}

#else /* built without NCCL: eng_cuda_open refuses an engine that would call these */

static pie_code ec_tp_none(pie_status *st) {
    return pie_status_set(st, PIE_INTERNAL, "eng_cuda: built without NCCL");
}
pie_code ec_tp_upload_weights(eng_cuda *e, pie_status *st) { return (void)e, ec_tp_none(st); }
pie_code ec_tp_allreduce(eng_cuda *e, float *x, size_t n, pie_status *st) {
    return (void)e, (void)x, (void)n, ec_tp_none(st);
}
pie_code ec_tp_sync(eng_cuda *e, pie_status *st) { return (void)e, ec_tp_none(st); }
pie_code ec_tp_embed_text(eng_cuda *e, const uint32_t *slots, const uint32_t *tokens, uint32_t n,
                          pie_status *st) {
    return (void)e, (void)slots, (void)tokens, (void)n, ec_tp_none(st);
}
pie_code ec_tp_next_dist(eng_cuda *e, eng_dist_item *items, uint32_t n, pie_status *st) {
    return (void)e, (void)items, (void)n, ec_tp_none(st);
}
pie_code ec_tp_logits(eng_cuda *e, uint32_t slot, float *logits, pie_status *st) {
    return (void)e, (void)slot, (void)logits, ec_tp_none(st);
}

#endif
