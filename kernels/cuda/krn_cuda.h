/* krn_cuda.h — the CUDA kernels of the engine's cuda backend, callable from C.
 *
 * Owns: the device math of one decoder pass over a ragged batch — embedding gather, RMSNorm
 * fused with the residual add, RoPE (Llama-3 frequencies come from krn_cpu_rope_freqs, one
 * definition for both backends), KV append into layer-major pages, paged attention (prefill /
 * append with causal or explicit run-length masks, split-KV for long contexts, GQA-aware),
 * SiLU-multiply, a GEMV for small batches (larger ones go through cuBLAS in the engine), the
 * softmax + top-k of next-token distributions, page copy and row gathers.
 * Does not own: what a batch is, validation, memory (services/worker/engine/eng_cuda*.c
 * allocates every buffer once at open; these functions allocate nothing), cuBLAS calls.
 *
 * Conventions. Weights, KV pages and the inputs of matrix products are bf16 (stored as their
 * uint16_t bits); the residual stream, projections, scores and every accumulation are f32.
 * Shapes are [rows, cols] row-major. Every function only enqueues work on `stream` and returns
 * the launch's cudaError_t (0 = cudaSuccess); errors of the work itself surface at the next
 * synchronising call. Everything whose values change per batch (tables of rows, tiles, pages,
 * masks) is read from device memory, so a launch sequence can be captured as a CUDA graph and
 * replayed with new tables. */
#ifndef KRN_CUDA_H
#define KRN_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef uint16_t krn_bf16; /* bf16 bits: the high half of an f32 */

/* ---- limits ---------------------------------------------------------------------------- */

#define KRN_CUDA_MAX_HEAD_DIM  256 /* attention keeps a query in 8 f32 per lane */
#define KRN_CUDA_MAX_GROUP     32  /* n_heads / n_kv_heads */
#define KRN_CUDA_ATTN_QVECS    32  /* query vectors (rows x heads of one kv head) per block */
#define KRN_CUDA_MAX_SPLITS    64  /* split-KV partitions of one tile */
#define KRN_CUDA_GEMV_MAX_ROWS 8   /* krn_cuda_gemv handles 1..8 rows */
#define KRN_CUDA_TOPK_MAX      1024
#define KRN_CUDA_TC_QVECS      64 /* query vectors per block of the tensor-core attention */

/* Sets per-kernel attributes (the attention kernels' dynamic shared memory, up to what the
 * current device allows). Call once per process and device before the first launch; fails
 * with cudaErrorInvalidValue when head_dim is beyond the limits or the CUDA-core attention's
 * shared memory at head_dim does not fit the device (krn_cuda_attn_smem says by how much). */
cudaError_t krn_cuda_init(int head_dim);

/* Shared memory per block the CUDA-core attention needs at head_dim (dynamic + static bytes)
 * and the most the current device grants a block (its opt-in limit: 64 KiB on T4, 96 KiB on
 * V100, 99 KiB on L4 and other sm_86/89 parts, 163 KiB on A100, 227 KiB on H100/H200). */
cudaError_t krn_cuda_attn_smem(int head_dim, size_t *need, size_t *limit);

/* ---- rows ------------------------------------------------------------------------------ */

/* out[i, :] = table[tokens[i], :] widened to f32, written to row slots[i] of out ([*, d]). */
cudaError_t krn_cuda_embed(const krn_bf16 *table, int d, const uint32_t *tokens,
                           const uint32_t *slots, int n, float *out, cudaStream_t stream);

/* dst[i, :] = src[idx[i], :] for i < n; rows of d floats. idx[i] < 0 leaves dst row i alone. */
cudaError_t krn_cuda_gather_rows(float *dst, const float *src, const int32_t *idx, int n, int d,
                                 cudaStream_t stream);

/* dst[idx[i], :] = src[i, :] for i < n with idx[i] >= 0 (scatter; padding rows have -1). */
cudaError_t krn_cuda_scatter_rows(float *dst, const float *src, const int32_t *idx, int n, int d,
                                  cudaStream_t stream);

/* y[i] = bf16(x[i]) for n elements. */
cudaError_t krn_cuda_to_bf16(const float *x, size_t n, krn_bf16 *y, cudaStream_t stream);

/* ---- per-row math ---------------------------------------------------------------------- */

/* Per row of [n, d]: when r is not NULL x += r first (the residual add); then
 * y = x / sqrt(mean(x^2) + eps) * w, written as bf16 to yb (when not NULL) and as f32 to yf
 * (when not NULL). w is bf16 [d]. */
cudaError_t krn_cuda_add_rmsnorm(float *x, const float *r, const krn_bf16 *w, int n, int d,
                                 float eps, krn_bf16 *yb, float *yf, cudaStream_t stream);

/* After the fused q|k|v projection qkv [n, (nh + 2 nkv) hd] f32: rotates q in place and k into
 * kb ([n, nkv hd] bf16) at row positions pos[n] (HF rotate_half, angle = pos * inv_freq[j] in
 * f32), and converts v into vb. inv_freq is [hd / 2] on the device. */
cudaError_t krn_cuda_rope_qkv(float *qkv, const int32_t *pos, int n, int nh, int nkv, int hd,
                              const float *inv_freq, krn_bf16 *kb, krn_bf16 *vb,
                              cudaStream_t stream);

/* krn_cuda_rope_qkv and krn_cuda_kv_append of kb / vb into one layer's pool region in one
 * launch (the decode step's form): the same kb, vb and pool contents as the two calls. */
cudaError_t krn_cuda_rope_qkv_append(float *qkv, const int32_t *pos, int n, int nh, int nkv, int hd,
                                     const float *inv_freq, krn_bf16 *kb, krn_bf16 *vb,
                                     krn_bf16 *layer, int page_size, const int32_t *dst,
                                     cudaStream_t stream);

/* Writes row i of kb / vb ([n, kvd] bf16) into the pool token dst[i] (page * page_size +
 * offset) of one layer's region ([pages][2][page_size][kvd], K then V); dst[i] < 0 skips. */
cudaError_t krn_cuda_kv_append(krn_bf16 *layer, int page_size, int kvd, const krn_bf16 *kb,
                               const krn_bf16 *vb, const int32_t *dst, int n, cudaStream_t stream);

/* h[i, j] = bf16(silu(gu[i, j]) * gu[i, ffn + j]) for gu [n, 2 ffn] f32 (gate | up). */
cudaError_t krn_cuda_silu_mul(const float *gu, int n, int ffn, krn_bf16 *h, cudaStream_t stream);

/* ---- linear ---------------------------------------------------------------------------- */

/* y[n, out] (row stride ldy) = x[n, in] · W^T for W [out, in], all bf16 in, f32 out, for
 * 1 <= n <= KRN_CUDA_GEMV_MAX_ROWS. Requires in % 8 == 0 and 16-byte aligned x and W
 * (krn_cuda_gemv_fits); the engine uses cuBLAS otherwise. */
int krn_cuda_gemv_fits(const void *x, const void *w, int n, int in);
cudaError_t krn_cuda_gemv(const krn_bf16 *x, int n, int in, const krn_bf16 *w, int out, float *y,
                          int ldy, cudaStream_t stream);

/* ---- attention ------------------------------------------------------------------------- */

/* A run of query rows of one sequence (at most KRN_CUDA_ATTN_QVECS / group rows). Keys are the
 * sequence's first n_ctx tokens, read from its pages, then n_tail tokens read from the batch
 * rows kb/vb[tail_row ...] (inputs attended to without being stored). Row r of the tile is
 * query row q_row + r, sits at sequence index q_seq + r and sees keys t <= q_seq + r; with an
 * explicit mask (mask_row >= 0) row r's visibility is the run list starting at
 * runs[row_runs[mask_row + r]] instead. Keys t < pm_ctx are also hidden where their page's
 * mask byte is set. n_q == 0 marks a padding tile.
 * Split-KV (krn_cuda_attention only): a launch has args.n_splits blocks per (tile, KV head);
 * the tile uses the first n_split of them (0 or 1: not split, block 0 writes the output), each
 * over kv_chunk keys (a multiple of 32), writing an unnormalised partial at partial rows
 * part_row .. part_row + n_q - 1 (< args.split_rows), which the merge combines. The split count
 * is data, not launch shape, so a captured graph serves every split count. */
typedef struct krn_cuda_attn_tile {
    int32_t q_row, o_row, n_q, q_seq;
    int32_t n_ctx, pages, tail_row, n_tail;
    int32_t pm_ctx, mask_row, kv_chunk, n_split;
    int32_t part_row, pad;
} krn_cuda_attn_tile;

typedef struct krn_cuda_attn_args {
    const krn_cuda_attn_tile *tiles; /* [n_tiles] */
    int n_tiles;
    const float *q; /* [rows, q_stride]: head h of row i at q + i*q_stride + h*hd */
    int q_stride;
    const krn_bf16 *kv; /* one layer's region [pages][2][page_size][n_kv_heads][hd] */
    const uint32_t *page_list;
    const uint8_t *page_mask; /* [pages * page_size], 1 = masked */
    int page_size;
    const krn_bf16 *kb, *vb; /* [rows, n_kv_heads * hd]: the batch's own K/V (tails) */
    const uint32_t *runs;    /* explicit masks: run lists */
    const int32_t *row_runs; /* index in runs where each masked row starts */
    int n_heads, n_kv_heads, hd;
    float scale;
    krn_bf16 *out;   /* [o_rows, n_heads * hd] */
    int n_splits;    /* blocks per (tile, KV head), 1..KRN_CUDA_MAX_SPLITS; > 1: a merge runs */
    float *part_acc; /* [n_splits][split_rows][n_heads][hd] */
    float *part_ml;  /* [n_splits][split_rows][n_heads][2] (max, sum) */
    int split_rows;  /* partial rows: part_row + n_q <= split_rows for every split tile */
} krn_cuda_attn_args;

/* Rows of one tile for this model: KRN_CUDA_ATTN_QVECS / group (at least 1). */
int krn_cuda_attn_tile_rows(int n_heads, int n_kv_heads);

cudaError_t krn_cuda_attention(const krn_cuda_attn_args *a, cudaStream_t stream);

/* The tensor-core variant for prefill-shaped tiles (krn_cuda_attn_tc.cu): same tiles and
 * arguments, tiles of up to krn_cuda_attn_tc_rows rows, no split (n_splits must be 1).
 * krn_cuda_attn_tc_fits: the current device (sm_80+, enough shared memory for the head_dim's
 * kernel: 72 KiB at 64, 112 KiB at 128) and the shape (head_dim 16, 32, 64 or 128,
 * group <= KRN_CUDA_TC_QVECS) allow it. */
int krn_cuda_attn_tc_rows(int n_heads, int n_kv_heads);
int krn_cuda_attn_tc_fits(int head_dim, int n_heads, int n_kv_heads);
cudaError_t krn_cuda_attn_tc_init(void);
cudaError_t krn_cuda_attention_tc(const krn_cuda_attn_args *a, cudaStream_t stream);

/* ---- pages ----------------------------------------------------------------------------- */

/* For every layer l < n_layers (regions layer_elems apart): count tokens of K and V from pool
 * token src (page * page_size + offset) to dst, and the page-mask bytes. */
cudaError_t krn_cuda_page_copy(krn_bf16 *kv, size_t layer_elems, int n_layers, int page_size,
                               int kvd, uint8_t *page_mask, int src, int dst, int count,
                               cudaStream_t stream);

/* Zeroes pages ids[0..n) (device array) in every layer (K and V) and their page-mask bytes: one
 * launch however scattered the ids are (a memset per layer per run of consecutive ids cost
 * 52-110 us per scattered page on an H100). */
cudaError_t krn_cuda_clear_pages(krn_bf16 *kv, size_t layer_elems, int n_layers, int page_size,
                                 int kvd, uint8_t *page_mask, const int32_t *ids, int n,
                                 cudaStream_t stream);

/* ---- distributions --------------------------------------------------------------------- */

/* For each row r < n of logits [n, vocab]: softmax(logits / temp[r]) over the whole row,
 * written over the row (the logits are consumed), and its top k[r] (<= KRN_CUDA_TOPK_MAX) ids
 * and probabilities in descending probability (equal probabilities, underflowed zeros
 * included: lower id first; NaN after every number) into ids / probs [n, KRN_CUDA_TOPK_MAX].
 * Edges as krn_cpu_softmax: NaN logits are left out of the max and the sum and stay NaN; an
 * infinite largest logit, temp not > 0 or 1 / temp overflowing put all mass on the first
 * largest number. No full sort: a radix select over the probabilities finds the k-th, then
 * only the candidates are sorted. */
cudaError_t krn_cuda_topk(float *logits, int n, int vocab, const float *temp, const int32_t *k,
                          uint32_t *ids, float *probs, cudaStream_t stream);

/* A tensor-parallel rank's part of krn_cuda_topk (engine/eng_cuda_tp.c): logits [n, vocab] is
 * its slice of each row and the whole row's largest number is given, shift[2 r] (NaN: the row
 * has no number anywhere), with shift[2 r + 1] = 1 in the one slice that holds the row's first
 * largest number. Writes exp((l - max) / temp[r]) over the slice (NOT normalised; the limits
 * of krn_cuda_topk: 1 on that first largest number if it is here, 0 on every other number),
 * the top k[r] of those into ids / vals [n, KRN_CUDA_TOPK_MAX] (ids within the slice; the
 * same order and ties as krn_cuda_topk) and sums[r], their sum over the slice's numbers. The
 * ranks' lists merged with the sums added give krn_cuda_topk's result over the whole row
 * (engine/eng_tp_dist.h). */
cudaError_t krn_cuda_topk_shifted(float *logits, int n, int vocab, const float *temp,
                                  const int32_t *k, const float *shift, uint32_t *ids, float *vals,
                                  float *sums, cudaStream_t stream);

/* out[r] = the largest number of row r of x [n, vocab] (NaN left out; NaN when it has none). */
cudaError_t krn_cuda_row_max(const float *x, int n, int vocab, float *out, cudaStream_t stream);

/* ---- test hook --------------------------------------------------------------------------- */

/* Launches a kernel that traps: the device fault a test needs (the CUDA context is lost for
 * the process). The engine launches it only when PIE_CUDA_FAULT_AFTER asks (docs/cuda.md). */
cudaError_t krn_cuda_trap(cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
