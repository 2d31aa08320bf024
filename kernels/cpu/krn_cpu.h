/* krn_cpu.h — the CPU kernels of the engine (the CPU backend and Neo's CPU attention).
 *
 * Owns: a fork-join thread pool, linear layers (f32 through OpenBLAS sgemm; bf16/f16 weights
 * through our own SIMD kernels that never expand a whole matrix), RMSNorm, RoPE with Llama-3
 * frequency scaling, SiLU-multiply, embedding gather, paged attention over layer-major KV
 * pages (prefill with masks; decode split across threads flash-decoding style), softmax and
 * top-k. SIMD paths are chosen at run time (AVX-512 / AVX2+FMA / portable C).
 * Does not own: what a batch is (services/worker/engine), where weights come from
 * (services/worker/model). All activations are f32. Shapes are written [rows, cols],
 * row-major. */
#ifndef KRN_CPU_H
#define KRN_CPU_H

#include <stddef.h>
#include <stdint.h>

/* Element type of weights; values equal mdl_dtype's, except KRN_BF16_PANEL (no mdl_dtype):
 * bf16 weights packed once by krn_wpack_bf16, which krn_cpu_linear, krn_cpu_linear_multi and
 * krn_cpu_embed read in that form. */
typedef enum krn_dtype { KRN_F32 = 0, KRN_F16 = 1, KRN_BF16 = 2, KRN_BF16_PANEL = 3 } krn_dtype;

/* ---- thread pool ------------------------------------------------------------------------- */

typedef struct krn_pool krn_pool;

/* n_threads workers in total, the caller of krn_pool_run included (so n_threads - 1 threads are
 * created); n_threads <= 0 → the number of online cores. NULL on failure. */
krn_pool *krn_pool_create(int n_threads);
void krn_pool_destroy(krn_pool *p);
int krn_pool_size(const krn_pool *p);

/* Runs fn(arg, i, n_tasks) for every i in [0, n_tasks) across the pool (the caller takes part;
 * tasks are claimed dynamically, in increasing order) and returns when all are done. Not
 * reentrant: one run at a time per pool. p may be NULL: then everything runs in the caller. */
typedef void (*krn_task_fn)(void *arg, int task, int n_tasks);
void krn_pool_run(krn_pool *p, krn_task_fn fn, void *arg, int n_tasks);

/* Which SIMD path the dispatcher chose: "avx512", "avx2", "scalar". The best the CPU has,
 * unless the environment variable PIE_KRN_SIMD (read once) names a lower one. */
const char *krn_cpu_simd_name(void);

/* Forces the SIMD path ("scalar", "avx2", "avx512") for every later kernel call, so tests can
 * check each path on one machine. -1 (nothing changed) when the name is unknown or the CPU
 * lacks that path. Not to be called while kernels run. */
int krn_cpu_set_simd(const char *name);

/* Whether krn_cpu_linear multiplies bf16 weights on Intel AMX (see there): the CPU has
 * AMX-BF16, the kernel granted the tile state, the SIMD path is avx512, and neither
 * PIE_KRN_AMX=0 (read once) nor krn_cpu_set_amx(0) turned it off. */
int krn_cpu_amx_active(void);

/* Turns the AMX path on or off for later calls (tests check both on one machine). -1 (nothing
 * changed) when asked to turn it on and the CPU or kernel lacks AMX. Not to be called while
 * kernels run. */
int krn_cpu_set_amx(int on);

/* Whether krn_cpu_linear multiplies bf16 weights with n >= 8 rows of x by AVX512-BF16 dot
 * products, x rounded to bf16 (see there): the CPU has AVX512-BF16, the SIMD path is avx512,
 * AMX is not active (krn_cpu_amx_active()), and the switch is on: by default on AMD CPUs only,
 * PIE_KRN_BF16DOT=1 or 0 (read once) and krn_cpu_set_bf16dot override it. */
int krn_cpu_bf16dot_active(void);

/* Turns the AVX512-BF16 path on or off for later calls (tests check both on one machine); 2
 * turns it on with its packed-panel variant (PIE_KRN_BF16DOT=panel; same precision, sums in
 * k order). -1 (nothing changed) when asked to turn it on and the CPU lacks AVX512-BF16. Not
 * to be called while kernels run. */
int krn_cpu_set_bf16dot(int on);

/* ---- dense ------------------------------------------------------------------------------- */

/* y[n, out] = x[n, in] · W^T where W is [out, in] of dtype wt (the HF Linear layout). bf16/f16
 * weights are converted exactly and accumulated in f32. bf16 weights with n >= 8 rows and `in`
 * a multiple of 32 run on AMX while krn_cpu_amx_active() (the first out - out % 16 rows of W):
 * x is split into two bf16 parts (x = hi + lo to 2^-17 relative), products are exact and
 * accumulated in f32, so the result is as accurate as the f32 paths. Otherwise, while
 * krn_cpu_bf16dot_active(), bf16 weights with 8 <= n <= 32 rows use AVX512-BF16 dot products with x
 * rounded to one bf16 (nearest even): |y - Σ w·bf16(x)| <= (in/16 + 5) · 2^-24 · Σ|w·bf16(x)|,
 * i.e. x itself is off by up to 2^-9 relative (krn_bf16dot.c). The pool owns all
 * threads: the first call sets OpenBLAS to one thread (process-wide) and splits sgemm over the
 * pool. y must not overlap x or W. */
void krn_cpu_linear(krn_pool *p, const float *x, int n, int in, const void *w, krn_dtype wt,
                    int out, float *y);

/* bf16 weights packed once (at model load) in the order the packed-panel kernels read, so no
 * call transposes W again (krn_panel.c): panels of 32 rows of W (rows past `out` zero); in a
 * panel, for each column pair (2p, 2p + 1), 32 uint32 — the pair of rows 0-15, then of rows
 * 16-31 — low half w[o][2p], high half w[o][2p + 1]; columns past `in` (up to a multiple of 32)
 * zero. krn_wpack_bytes(out, in) bytes: W's own size when out is a multiple of 32 and in of 32.
 * krn_cpu_linear with wt = KRN_BF16_PANEL multiplies it: every y is Σ_k f32(w[o][k]) · x[r][k],
 * one FMA per product in k order, f32 — the bits of the exact panels of KRN_BF16 at 4-256 rows,
 * on every SIMD path and every n (no GEMV reduction tree, no sgemm) — except while
 * krn_cpu_bf16dot_active() with 8 <= n <= 32, which has the AVX512-BF16 path's precision (x
 * rounded to bf16, as for KRN_BF16). While krn_cpu_amx_active(), n >= 8 rows run on AMX tiles
 * reading the packed panels in place (krn_amx.c): the bits of the AMX path on row-major W, for
 * any `in` and `out`; fewer rows take the exact kernels above. */
size_t krn_wpack_bytes(int out, int in);
/* Packs bf16 W [out, in] into dst (krn_wpack_bytes bytes, 64-byte aligned), across the pool. */
void krn_wpack_bf16(krn_pool *p, const uint16_t *w, int out, int in, void *dst);

/* One of several products of the same x (krn_cpu_linear_multi): W [out, in], y [n, out]. */
typedef struct krn_linear_out {
    const void *w;
    int out;
    float *y;
} krn_linear_out;

/* krn_cpu_linear for count weights of one dtype that read the same x (q/k/v, gate/up), with the
 * same bits as count separate calls: on the paths that pack x (AMX, AVX512-BF16, the packed
 * panels) x is packed once and the rows of every W are the tasks of one pool run (one wait
 * instead of count). No y may overlap x or a W. */
void krn_cpu_linear_multi(krn_pool *p, const float *x, int n, int in, krn_dtype wt,
                          const krn_linear_out *outs, int count);

/* y[n, d] = x / sqrt(mean(x^2) + eps) * w, per row; w [d] of dtype wt. y may equal x. */
void krn_cpu_rmsnorm(const float *x, const void *w, krn_dtype wt, int n, int d, float eps,
                     float *y);

/* x[i] += y[i] */
void krn_cpu_add(float *x, const float *y, size_t n);

/* gate[i] = silu(gate[i]) * up[i] */
void krn_cpu_silu_mul(float *gate, const float *up, size_t n);

/* out[i, :] = table[tokens[i], :] as f32; table [vocab, d] of dtype wt (KRN_BF16_PANEL: packed
 * by krn_wpack_bf16 with in = d). */
void krn_cpu_embed(const void *table, krn_dtype wt, int d, const uint32_t *tokens, int n,
                   float *out);

/* Rotary frequencies inv_freq[head_dim / 2] with Llama-3 scaling when factor > 0 (factor,
 * low_freq_factor, high_freq_factor, original_max_position_embeddings as in config.json). */
void krn_cpu_rope_freqs(float *inv_freq, int head_dim, float theta, float factor,
                        float low_freq_factor, float high_freq_factor, int orig_max_position);

/* Rotates x[n, n_heads, head_dim] in place, row i at position pos[i], in the HF "rotate_half"
 * convention (pairs (j, j + head_dim/2)). */
void krn_cpu_rope(float *x, const uint32_t *pos, int n, int n_heads, int head_dim,
                  const float *inv_freq);

/* ---- attention over paged KV --------------------------------------------------------------- */

/* One layer's KV region: [n_pages][2][page_size][n_kv_heads][head_dim] of `dtype`, K before
 * V. dtype is KRN_F32 (the zero value) or KRN_BF16 (half the bytes; attention converts the
 * stored values to f32 exactly, so the only loss is the rounding of krn_kv_store). */
typedef struct krn_kv_layer {
    void *base;
    int page_size, n_kv_heads, head_dim;
    krn_dtype dtype;
} krn_kv_layer;

/* Token t (0-based) of a page list lives in page pages[t / page_size] at offset
 * t % page_size. K at krn_kv_k(kv, page, off), V at krn_kv_v(kv, page, off): one token row,
 * n_kv_heads * head_dim elements of kv->dtype. */
void *krn_kv_k(const krn_kv_layer *kv, uint32_t page, int off);
void *krn_kv_v(const krn_kv_layer *kv, uint32_t page, int off);
/* Bytes of one element of the region (4 or 2). */
size_t krn_kv_elt_bytes(const krn_kv_layer *kv);
/* Writes one token's K and V rows (f32, n_kv_heads * head_dim each) at (page, off), rounded to
 * nearest even when the region is bf16 (NaN stays NaN, infinities stay infinite). */
void krn_kv_store(const krn_kv_layer *kv, uint32_t page, int off, const float *k, const float *v);
/* dst[i] = bf16(src[i]), round to nearest even, NaN kept (quietened), as krn_kv_store. */
void krn_cvt_bf16(const float *src, size_t n, uint16_t *dst);
/* x[i] = the f32 value of bf16(x[i]) (as krn_cvt_bf16): what a bf16 region stores of x. */
void krn_round_bf16(float *x, size_t n);

/* One sequence's attention. Keys/values are the n_ctx tokens of `pages` followed by n_tail
 * tokens in k_tail/v_tail ([n_tail, n_kv_heads, head_dim]; used when a forward attends to its
 * inputs without storing them). Query row i sits at sequence index q_offset + i. */
typedef struct krn_attn_item {
    const float *q;         /* [n_q, n_heads, head_dim], RoPE applied */
    float *out;             /* [n_q, n_heads, head_dim] */
    int n_q;
    const uint32_t *pages;  /* KV pages in order */
    int n_ctx;              /* tokens read from the pages */
    const float *k_tail, *v_tail;
    int n_tail;
    int q_offset;           /* causal: row i sees sequence indices [0, q_offset + i] */
    const uint8_t *mask;    /* NULL: causal. Else [n_q, n_ctx + n_tail], 1 = visible; it
                               replaces causality (the caller folds causality in). A row with
                               nothing visible yields zeros. */
} krn_attn_item;

/* Grouped-query attention with softmax scale `scale` for every item; n_heads is a multiple of
 * kv->n_kv_heads. Work is split over items, heads and (for long contexts) KV chunks. */
void krn_cpu_attention(krn_pool *p, const krn_kv_layer *kv, const krn_attn_item *items,
                       int n_items, int n_heads, float scale);

/* krn_cpu_attention with the KV chunking chosen by the caller: kv_chunk > 0 splits every
 * item's keys into chunks of kv_chunk tokens (merged flash-decoding style), 0 chooses
 * automatically (chunks only when there are too few (item, head) units for the threads),
 * < 0 never splits. With p == NULL nothing is split and nothing is allocated. Requirements
 * of both: n_heads % n_kv_heads == 0 and head_dim <= 4096 (checked; abort otherwise). */
void krn_cpu_attention_ex(krn_pool *p, const krn_kv_layer *kv, const krn_attn_item *items,
                          int n_items, int n_heads, float scale, int kv_chunk);

/* What krn_cpu_attention_ex decides for one call before it runs: the unit shape (from the
 * most queries of any item) and the KV chunk size (from the threads of p and the number of
 * (item, head) groups). Every item's result depends only on its own inputs and this plan, so
 * a call split into parts, each run with the whole call's plan, writes the same bits as the
 * whole call (the CPU attention offload runs some items on another pool this way) — provided
 * each part runs on a pool (p != NULL: with p == NULL nothing is chunked) whose scratch could
 * be allocated. */
typedef struct krn_attn_plan {
    int max_nq; /* the unit shape is chosen for this many query rows */
    int chunk;  /* keys per chunk; 0: no item is split */
} krn_attn_plan;

krn_attn_plan krn_cpu_attention_plan(const krn_pool *p, const krn_kv_layer *kv,
                                     const krn_attn_item *items, int n_items, int n_heads,
                                     int kv_chunk);
/* Runs items with a plan made for them or for a call they are part of (n_q <= plan->max_nq). */
void krn_cpu_attention_run(krn_pool *p, const krn_kv_layer *kv, const krn_attn_item *items,
                           int n_items, int n_heads, float scale, const krn_attn_plan *plan);

/* ---- distributions ----------------------------------------------------------------------- */

/* x[n] = softmax(x / temperature), numerically stable. NaN logits are left out of the max and
 * the sum and stay NaN; when the largest number is infinite, temperature is not > 0 or its
 * inverse overflows, the first largest number gets 1 and the other numbers 0. The same on every
 * SIMD path and on the cuda backend (krn_cuda_topk; tests/kcheck/kcheck.h). */
void krn_cpu_softmax(float *x, int n, float temperature);

/* The exponentials of krn_cpu_softmax with a maximum found elsewhere (a tensor-parallel rank
 * holds a slice of the logits; the maximum is the whole vocabulary's): x[i] = exp((x[i] - max)
 * / temperature) for every number (NaN stays NaN, out of the sum); returns their sum. The same
 * arithmetic as krn_cpu_softmax before its final scaling. The caller has handled the limits
 * krn_cpu_softmax handles: max is finite, temperature > 0 with a finite inverse. */
float krn_cpu_exp_shifted(float *x, int n, float max, float temperature);

/* The k largest of x[n] in descending order (ties: lower index first): ids[k], vals[k].
 * O(n log k), no full sort. k <= n. */
void krn_cpu_topk(const float *x, int n, int k, uint32_t *ids, float *vals);

/* The k best of n_lists lists, each in krn_cpu_topk's order (descending, ties to the lower
 * id, NaN last), after multiplying their values by scale: out_ids[k], out_vals[k] in that
 * order. List i is ids[i][0, counts[i]), vals[i][0, counts[i]); ids are distinct across
 * lists; n_lists <= 64; k <= the sum of counts. The merge of a tensor-parallel group's local
 * top-k. */
void krn_cpu_topk_merge(const uint32_t *const *ids, const float *const *vals, const int *counts,
                        int n_lists, float scale, int k, uint32_t *out_ids, float *out_vals);

#endif
