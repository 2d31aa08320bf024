/* krn_attn.c — grouped-query attention over paged, layer-major KV.
 *
 * Owns: where a token's K and V live in a layer's region (krn_kv_k / krn_kv_v), the split of
 * attention into units (item, KV heads, block of queries, heads of each group, KV chunk),
 * the online-softmax inner kernel (portable C, AVX2, AVX-512) and the flash-decoding merge of
 * chunk partials.
 * Does not own: the page table (the engine passes each item's page list), RoPE (applied to q
 * and K before they get here).
 *
 * A bf16 region (krn_kv_layer.dtype) is read a block at a time: the unit's slice of each token
 * row of the block is converted to f32 (exactly) into the worker's copy buffer, and the same
 * kernels run on the copy, so bf16 KV gives the bits of an f32 region holding the same
 * (rounded) values; only the bytes read from memory halve.
 *
 * A unit keeps, for each of its rows (query i, head h), the running max m, the running sum l
 * and the unnormalised output acc[head_dim], and walks its key range in blocks of
 * KRN_ATTN_BLOCK keys: scores of the block, new max, rescale (m, l, acc), add the block's
 * exp-weighted V rows. One KV head's slice of a block stays in L1 while every row of the unit
 * that uses it runs. A unit that covers only a chunk of the keys
 * writes (m, l, acc) to scratch instead of `out`; the merge rescales the chunks to their common
 * max and divides by the combined sum. */
#include "krn_cpu_impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#define KRN_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define KRN_TARGET_AVX2   __attribute__((target("avx2,fma,f16c")))

/* Keys per inner block (a multiple of 16): 64 keys of head_dim 128 are 32 KiB of K, and as
 * much of V. */
#define KRN_ATTN_BLOCK 64
/* Units that read every KV head go head by head through a block, striding by a whole token row;
 * smaller blocks keep those strides within fewer DRAM rows and TLB entries (measured: 32 keys
 * ~15% faster than 64 on 128 MB of KV, 16 no better). A multiple of 16, at most KRN_ATTN_BLOCK. */
#define KRN_ATTN_BLOCK_ALL_HEADS 32
/* Floats of row state a unit keeps on its stack (rows * head_dim); bounds head_dim. */
#define KRN_ATTN_STATE_FLOATS 4096
#define KRN_ATTN_MAX_ROWS     64
/* Blocks of heads up to this size are copied to a contiguous buffer (2 x 32 KiB of each
 * worker's scratch). */
#define KRN_ATTN_COPY_MAX_DIM 128
/* Floats of K (and as many of V) a worker's buffer holds: the copy above, or a bf16 block's
 * rows converted (keys x the unit's KV heads x head_dim; 32 keys x 8 heads x 128 fit). */
#define KRN_ATTN_BUF_FLOATS 32768
/* Without a pool's scratch a bf16 block is converted into a stack buffer of this many floats
 * (each of K and V) instead, in blocks of fewer keys. */
#define KRN_ATTN_STACK_BUF_FLOATS 4096
/* Pools larger than this run attention in the caller only (nobody has such machines here). */
#define KRN_ATTN_MAX_THREADS 256
/* Automatic KV chunks are at least this many tokens (merging costs a pass over head_dim per
 * chunk and row). */
#define KRN_ATTN_MIN_CHUNK 256

size_t krn_kv_elt_bytes(const krn_kv_layer *kv) { return kv->dtype == KRN_BF16 ? 2 : 4; }

void *krn_kv_k(const krn_kv_layer *kv, uint32_t page, int off) {
    size_t tok = (size_t)kv->n_kv_heads * (size_t)kv->head_dim * krn_kv_elt_bytes(kv);
    return (char *)kv->base + ((size_t)page * 2u * (size_t)kv->page_size + (size_t)off) * tok;
}

void *krn_kv_v(const krn_kv_layer *kv, uint32_t page, int off) {
    size_t tok = (size_t)kv->n_kv_heads * (size_t)kv->head_dim * krn_kv_elt_bytes(kv);
    return (char *)kv->base +
           (((size_t)page * 2u + 1u) * (size_t)kv->page_size + (size_t)off) * tok;
}

/* f32 bits → bf16 bits, round to nearest even; NaN keeps its sign and is quietened; an
 * overflow rounds to infinity. Portable on purpose: a stored value must not depend on the SIMD
 * path (the rows are few). */
static inline uint16_t bf16_of(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

void krn_cvt_bf16(const float *src, size_t n, uint16_t *dst) {
    for (size_t i = 0; i < n; i++) dst[i] = bf16_of(src[i]);
}

void krn_round_bf16(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = krn_bf16_to_f32(bf16_of(x[i]));
}

void krn_kv_store(const krn_kv_layer *kv, uint32_t page, int off, const float *k, const float *v) {
    size_t n = (size_t)kv->n_kv_heads * (size_t)kv->head_dim;
    if (kv->dtype == KRN_BF16) {
        krn_cvt_bf16(k, n, krn_kv_k(kv, page, off));
        krn_cvt_bf16(v, n, krn_kv_v(kv, page, off));
    } else {
        memcpy(krn_kv_k(kv, page, off), k, n * sizeof *k);
        memcpy(krn_kv_v(kv, page, off), v, n * sizeof *v);
    }
}

/* ---- inner kernel: one row against one block of keys --------------------------------------- */

/* Folds keys kp[0..nb) / vp[0..nb) into the row state st = [m, l, acc[d]] for query q.
 * vis: NULL (all visible) or nb flags. The SIMD versions score keys 8 or 16 at a time, so kp,
 * vp and s must hold nb rounded up to 16 entries, the extra pointers valid (their scores are
 * discarded). */
static void row_block_scalar(const float *q, const float *const *kp, const float *const *vp, int nb,
                             const uint8_t *vis, float scale, int d, float *st, float *s) {
    float bm = -INFINITY;
    for (int j = 0; j < nb; j++) {
        if (vis && !vis[j]) {
            s[j] = -INFINITY;
            continue;
        }
        float a = 0.0f;
        for (int i = 0; i < d; i++) a += q[i] * kp[j][i];
        s[j] = a * scale;
        if (s[j] > bm) bm = s[j];
    }
    if (bm == -INFINITY) return;
    float m_new = st[0] > bm ? st[0] : bm;
    float corr = expf(st[0] - m_new);
    float l = st[1] * corr;
    float *acc = st + 2;
    for (int i = 0; i < d; i++) acc[i] *= corr;
    for (int j = 0; j < nb; j++) {
        float pj = expf(s[j] - m_new);
        if (pj == 0.0f) continue;
        l += pj;
        for (int i = 0; i < d; i++) acc[i] += pj * vp[j][i];
    }
    st[0] = m_new;
    st[1] = l;
}

#if KRN_X86
#define KRN_INLINE static inline __attribute__((always_inline))
#define KRN_UNROLL _Pragma("GCC unroll 16")

/* ---- AVX2: scores 8 keys at a time -------------------------------------------------------- */

/* r[j] = the sum of the lanes of a[j], j < 8: a transpose-and-add tree, 7 adds in all. */
KRN_TARGET_AVX2 KRN_INLINE __m256 hsum8x8_avx2(const __m256 *a) {
    __m256 t[4], u[2];
    KRN_UNROLL for (int k = 0; k < 4; k++) {
        t[k] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * k], a[2 * k + 1]),
                             _mm256_unpackhi_ps(a[2 * k], a[2 * k + 1]));
    }
    KRN_UNROLL for (int k = 0; k < 2; k++) {
        __m256d lo = _mm256_unpacklo_pd(_mm256_castps_pd(t[2 * k]), _mm256_castps_pd(t[2 * k + 1]));
        __m256d hi = _mm256_unpackhi_pd(_mm256_castps_pd(t[2 * k]), _mm256_castps_pd(t[2 * k + 1]));
        u[k] = _mm256_add_ps(_mm256_castpd_ps(lo), _mm256_castpd_ps(hi));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20),
                         _mm256_permute2f128_ps(u[0], u[1], 0x31));
}

KRN_TARGET_AVX2 static void row_block_avx2(const float *q, const float *const *kp,
                                           const float *const *vp, int nb, const uint8_t *vis,
                                           float scale, int d, float *st, float *s) {
    int d8 = d & ~7;
    const __m256 ninf = _mm256_set1_ps(-INFINITY), vscale = _mm256_set1_ps(scale);
    __m256 vmax = ninf;
    for (int j0 = 0; j0 < nb; j0 += 8) {
        __m256 acc[8];
        KRN_UNROLL for (int jj = 0; jj < 8; jj++) { acc[jj] = _mm256_setzero_ps(); }
        for (int i = 0; i < d8; i += 8) {
            __m256 qv = _mm256_loadu_ps(q + i);
            KRN_UNROLL for (int jj = 0; jj < 8; jj++) {
                acc[jj] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp[j0 + jj] + i), acc[jj]);
            }
        }
        __m256 sc = hsum8x8_avx2(acc);
        if (d8 < d) {
            float tail[8];
            for (int jj = 0; jj < 8; jj++) {
                float t = 0.0f;
                for (int i = d8; i < d; i++) t += q[i] * kp[j0 + jj][i];
                tail[jj] = t;
            }
            sc = _mm256_add_ps(sc, _mm256_loadu_ps(tail));
        }
        sc = _mm256_mul_ps(sc, vscale);
        /* lanes past nb or not visible become -inf */
        int valid[8];
        for (int jj = 0; jj < 8; jj++) valid[jj] = j0 + jj < nb && (!vis || vis[j0 + jj]) ? -1 : 0;
        __m256 keep = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(const void *)valid));
        sc = _mm256_blendv_ps(ninf, sc, keep);
        _mm256_storeu_ps(s + j0, sc);
        vmax = _mm256_max_ps(vmax, sc);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    float bm = lanes[0];
    for (int i = 1; i < 8; i++) bm = lanes[i] > bm ? lanes[i] : bm;
    if (bm == -INFINITY) return;
    float m_new = st[0] > bm ? st[0] : bm;
    float corr = expf(st[0] - m_new);
    __m256 vm = _mm256_set1_ps(m_new), sum = _mm256_setzero_ps();
    for (int j = 0; j < nb; j += 8) {
        __m256 e = krn_exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    _mm256_storeu_ps(lanes, sum);
    float l = st[1] * corr;
    for (int i = 0; i < 8; i++) l += lanes[i];
    float *acc = st + 2;
    __m256 vc = _mm256_set1_ps(corr);
    for (int i = 0; i < d8; i += 8) {
        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(acc + i), vc);
        for (int jj = 0; jj < nb; jj++)
            if (s[jj] != 0.0f)
                a = _mm256_fmadd_ps(_mm256_set1_ps(s[jj]), _mm256_loadu_ps(vp[jj] + i), a);
        _mm256_storeu_ps(acc + i, a);
    }
    for (int i = d8; i < d; i++) {
        float a = acc[i] * corr;
        for (int jj = 0; jj < nb; jj++)
            if (s[jj] != 0.0f) a += s[jj] * vp[jj][i];
        acc[i] = a;
    }
    st[0] = m_new;
    st[1] = l;
}

/* ---- AVX-512: scores 16 keys at a time ---------------------------------------------------- */

/* r[j] = the sum of the lanes of a[j], j < 16: a transpose-and-add tree, 15 adds in all. */
KRN_TARGET_AVX512 KRN_INLINE __m512 hsum16x16_avx512(const __m512 *a) {
    __m512 t[8], u[4];
    KRN_UNROLL for (int k = 0; k < 8; k++) {
        t[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]),
                             _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
    }
    KRN_UNROLL for (int k = 0; k < 4; k++) {
        __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(t[2 * k]), _mm512_castps_pd(t[2 * k + 1]));
        __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(t[2 * k]), _mm512_castps_pd(t[2 * k + 1]));
        u[k] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    }
    __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44),
                               _mm512_shuffle_f32x4(u[0], u[1], 0xee));
    __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44),
                               _mm512_shuffle_f32x4(u[2], u[3], 0xee));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88),
                         _mm512_shuffle_f32x4(s01, s23, 0xdd));
}

/* RB rows (queries' heads sharing one visibility) against one block: every K and V row of the
 * block is loaded once for all RB rows. */
KRN_TARGET_AVX512 KRN_INLINE void pv_tile_avx512(float *const *st, const float (*s)[KRN_ATTN_BLOCK],
                                                 const float *corr, int RB, int NS, int i0,
                                                 const __mmask16 *mk, const float *const *vp,
                                                 int nb, const uint8_t *vis) {
    __m512 a[4][4];
    KRN_UNROLL for (int r = 0; r < RB; r++) {
        KRN_UNROLL for (int g = 0; g < NS; g++) {
            a[r][g] = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk[g], st[r] + 2 + i0 + 16 * g),
                                    _mm512_set1_ps(corr[r]));
        }
    }
    for (int j = 0; j < nb; j++) {
        if (vis && !vis[j]) continue; /* V rows of hidden keys may hold anything */
        __m512 v[4];
        KRN_UNROLL for (int g = 0; g < NS; g++) {
            v[g] = _mm512_maskz_loadu_ps(mk[g], vp[j] + i0 + 16 * g);
        }
        KRN_UNROLL for (int r = 0; r < RB; r++) {
            __m512 pr = _mm512_set1_ps(s[r][j]);
            KRN_UNROLL for (int g = 0; g < NS; g++) {
                a[r][g] = _mm512_fmadd_ps(pr, v[g], a[r][g]);
            }
        }
    }
    KRN_UNROLL for (int r = 0; r < RB; r++) {
        KRN_UNROLL for (int g = 0; g < NS; g++) {
            _mm512_mask_storeu_ps(st[r] + 2 + i0 + 16 * g, mk[g], a[r][g]);
        }
    }
}

KRN_TARGET_AVX512 KRN_INLINE void heads_tile_avx512(const float *const *q, float *const *st, int RB,
                                                    const float *const *kp, const float *const *vp,
                                                    int nb, const uint8_t *vis, float scale,
                                                    int d) {
    float s[4][KRN_ATTN_BLOCK];
    int nb16 = (nb + 15) & ~15;
    /* scores, 4 keys x RB rows at a time: 16 accumulators reduced by one tree */
    for (int j0 = 0; j0 < nb16; j0 += 4) {
        __m512 acc[16];
        KRN_UNROLL for (int a = 0; a < 16; a++) { acc[a] = _mm512_setzero_ps(); }
        for (int i = 0; i < d; i += 16) {
            __mmask16 m = krn_mask16(d - i);
            __m512 kv[4];
            KRN_UNROLL for (int jj = 0; jj < 4; jj++) {
                kv[jj] = _mm512_maskz_loadu_ps(m, kp[j0 + jj] + i);
            }
            KRN_UNROLL for (int r = 0; r < RB; r++) {
                __m512 qv = _mm512_maskz_loadu_ps(m, q[r] + i);
                KRN_UNROLL for (int jj = 0; jj < 4; jj++) {
                    acc[4 * r + jj] = _mm512_fmadd_ps(qv, kv[jj], acc[4 * r + jj]);
                }
            }
        }
        float sums[16];
        _mm512_storeu_ps(sums, hsum16x16_avx512(acc)); /* lane 4r + jj: row r, key j0 + jj */
        KRN_UNROLL for (int r = 0; r < RB; r++) {
            memcpy(&s[r][j0], sums + 4 * r, 4 * sizeof(float));
        }
    }
    /* per row: mask, new max, weights, sum */
    const __m512 ninf = _mm512_set1_ps(-INFINITY), vscale = _mm512_set1_ps(scale);
    float corr[4];
    KRN_UNROLL for (int r = 0; r < RB; r++) {
        __m512 vmax = ninf;
        for (int j0 = 0; j0 < nb16; j0 += 16) {
            __mmask16 valid = krn_mask16(nb - j0);
            if (vis) {
                __m128i bytes = _mm_maskz_loadu_epi8(valid, vis + j0);
                valid &= _mm_test_epi8_mask(bytes, bytes);
            }
            __m512 sc = _mm512_mask_blend_ps(valid, ninf,
                                             _mm512_mul_ps(_mm512_loadu_ps(&s[r][j0]), vscale));
            _mm512_storeu_ps(&s[r][j0], sc);
            vmax = _mm512_max_ps(vmax, sc);
        }
        float bm = _mm512_reduce_max_ps(vmax);
        if (bm == -INFINITY) { /* nothing visible: weights 0, state unchanged */
            corr[r] = 1.0f;
            memset(s[r], 0, (size_t)nb16 * sizeof(float));
            continue;
        }
        float m_new = st[r][0] > bm ? st[r][0] : bm;
        corr[r] = expf(st[r][0] - m_new);
        __m512 vm = _mm512_set1_ps(m_new), sum = _mm512_setzero_ps();
        for (int j0 = 0; j0 < nb16; j0 += 16) {
            __m512 e = krn_exp512(_mm512_sub_ps(_mm512_loadu_ps(&s[r][j0]), vm));
            _mm512_storeu_ps(&s[r][j0], e);
            sum = _mm512_add_ps(sum, e);
        }
        st[r][0] = m_new;
        st[r][1] = st[r][1] * corr[r] + _mm512_reduce_add_ps(sum);
    }
    /* acc = acc * corr + P V, 64 columns of head_dim per pass */
    for (int i0 = 0; i0 < d; i0 += 64) {
        __mmask16 mk[4];
        int ns = 0;
        for (int g = 0; g < 4 && i0 + 16 * g < d; g++, ns++) {
            int left = d - i0 - 16 * g;
            mk[g] = krn_mask16(left);
        }
        switch (ns) {
        case 4:
            pv_tile_avx512(st, (const float(*)[KRN_ATTN_BLOCK])s, corr, RB, 4, i0, mk, vp, nb, vis);
            break;
        case 3:
            pv_tile_avx512(st, (const float(*)[KRN_ATTN_BLOCK])s, corr, RB, 3, i0, mk, vp, nb, vis);
            break;
        case 2:
            pv_tile_avx512(st, (const float(*)[KRN_ATTN_BLOCK])s, corr, RB, 2, i0, mk, vp, nb, vis);
            break;
        default:
            pv_tile_avx512(st, (const float(*)[KRN_ATTN_BLOCK])s, corr, RB, 1, i0, mk, vp, nb, vis);
            break;
        }
    }
}

KRN_TARGET_AVX512 static void heads_block_avx512(const float *const *q, float *const *st, int R,
                                                 const float *const *kp, const float *const *vp,
                                                 int nb, const uint8_t *vis, float scale, int d,
                                                 float *s) {
    (void)s;
    int r = 0;
    for (; r + 4 <= R; r += 4) heads_tile_avx512(q + r, st + r, 4, kp, vp, nb, vis, scale, d);
    if (R - r >= 2) {
        heads_tile_avx512(q + r, st + r, 2, kp, vp, nb, vis, scale, d);
        r += 2;
    }
    if (r < R) heads_tile_avx512(q + r, st + r, 1, kp, vp, nb, vis, scale, d);
}
#endif

/* R rows that share one visibility (the heads of one query that read one KV head) against one
 * block; s: KRN_ATTN_BLOCK floats of scratch. */
typedef void (*heads_block_fn)(const float *const *q, float *const *st, int R,
                               const float *const *kp, const float *const *vp, int nb,
                               const uint8_t *vis, float scale, int d, float *s);

static void heads_block_scalar(const float *const *q, float *const *st, int R,
                               const float *const *kp, const float *const *vp, int nb,
                               const uint8_t *vis, float scale, int d, float *s) {
    for (int r = 0; r < R; r++) row_block_scalar(q[r], kp, vp, nb, vis, scale, d, st[r], s);
}

#if KRN_X86
KRN_TARGET_AVX2 static void heads_block_avx2(const float *const *q, float *const *st, int R,
                                             const float *const *kp, const float *const *vp, int nb,
                                             const uint8_t *vis, float scale, int d, float *s) {
    for (int r = 0; r < R; r++) row_block_avx2(q[r], kp, vp, nb, vis, scale, d, st[r], s);
}
#endif

/* ---- units --------------------------------------------------------------------------------- */

typedef struct attn_unit {
    int item;
    int k0, k1; /* KV heads */
    int q0, q1; /* queries */
    int h0, h1; /* heads within each KV head's group */
    int t0, t1; /* keys */
    int part;   /* -1: write out; else the first row-state slot of its partials */
} attn_unit;

typedef struct attn_group {
    int first, n_chunks; /* units [first, first + n_chunks) cover the same rows */
} attn_group;

typedef struct attn_ctx {
    const krn_kv_layer *kv;
    const krn_attn_item *items;
    int n_heads, group, d;
    float scale;
    heads_block_fn heads_block;
    int shares_kv; /* heads_block loads each K/V row once for all its rows */
    const attn_unit *units;
    const attn_group *groups;
    float *parts;                           /* row states [*, d + 2] of chunked units */
    float *copy_bufs[KRN_ATTN_MAX_THREADS]; /* per worker, or NULL */
} attn_ctx;

/* Row of (query qi, KV head kvh, head hh of its group) within unit u. */
static int unit_row(const attn_unit *u, int qi, int kvh, int hh) {
    return ((qi - u->q0) * (u->k1 - u->k0) + (kvh - u->k0)) * (u->h1 - u->h0) + (hh - u->h0);
}

static int unit_rows(const attn_unit *u) {
    return (u->q1 - u->q0) * (u->k1 - u->k0) * (u->h1 - u->h0);
}

/* Asks for the K and V rows (this unit's KV heads) of context keys [t0, t1) ahead of use. A
 * decode unit reads one 256-byte slice of each 2 KiB token row per KV head, so consecutive
 * loads are a row apart and the hardware prefetcher, which follows sequential lines, does not
 * see them coming: the next block is fetched while this one is computed (8% less time for
 * 32 sequences x 512 keys x 16 layers, 2 cores; bench/results/engine.md). */
static void prefetch_keys(const krn_kv_layer *kv, const krn_attn_item *it, const attn_unit *u,
                          int t0, int t1, int d) {
    size_t off = (size_t)u->k0 * (size_t)d * krn_kv_elt_bytes(kv);
    size_t bytes = (size_t)(u->k1 - u->k0) * (size_t)d * krn_kv_elt_bytes(kv);
    for (int t = t0; t < t1 && t < it->n_ctx; t++) {
        uint32_t page = it->pages[t / kv->page_size];
        const char *pk = (const char *)krn_kv_k(kv, page, t % kv->page_size) + off;
        const char *pv = (const char *)krn_kv_v(kv, page, t % kv->page_size) + off;
        for (size_t b = 0; b < bytes; b += 64) {
            __builtin_prefetch(pk + b, 0, 3);
            __builtin_prefetch(pv + b, 0, 3);
        }
    }
}

/* The unit's slice (KV heads [k0, k0 + nh)) of token rows kr/vr (bf16 where bf[j], else f32)
 * for keys [0, nb) of a block, as f32 rows of nh * d in kbuf/vbuf. */
static void convert_block(const void *const *kr, const void *const *vr, const uint8_t *bf, int nb,
                          size_t off, size_t n, float *kbuf, float *vbuf) {
    for (int j = 0; j < nb; j++) {
        krn_dtype t = bf[j] ? KRN_BF16 : KRN_F32;
        size_t elt = bf[j] ? 2 : 4;
        krn_cvt_f32((const char *)kr[j] + off * elt, t, n, kbuf + (size_t)j * n);
        krn_cvt_f32((const char *)vr[j] + off * elt, t, n, vbuf + (size_t)j * n);
    }
}

/* buf: NULL, or 2 * KRN_ATTN_BUF_FLOATS floats of the worker's scratch (K's half, then V's);
 * buf_floats: the floats of each half. A bf16 region needs a buffer (unit_run_stack). */
static void unit_run(const attn_ctx *c, const attn_unit *u, float *buf, int buf_floats) {
    const krn_attn_item *it = &c->items[u->item];
    const krn_kv_layer *kv = c->kv;
    int d = c->d, n_keys = it->n_ctx + it->n_tail;
    size_t kv_tok = (size_t)kv->n_kv_heads * (size_t)d;
    size_t q_tok = (size_t)c->n_heads * (size_t)d;
    float st_mem[KRN_ATTN_STATE_FLOATS + 2 * KRN_ATTN_MAX_ROWS];
    float s[KRN_ATTN_BLOCK];
    /* token rows of the block (all KV heads), then one head's slice; a block is a multiple of
     * 16 keys and the slots past the block's end point at its first token */
    const void *tk[KRN_ATTN_BLOCK], *tv[KRN_ATTN_BLOCK];
    uint8_t tbf[KRN_ATTN_BLOCK]; /* the row is bf16 (a page of a bf16 region) */
    const float *kp[KRN_ATTN_BLOCK], *vp[KRN_ATTN_BLOCK];
    size_t st_len = (size_t)d + 2;
    int nh_kv = u->k1 - u->k0;
    size_t slice = (size_t)nh_kv * (size_t)d; /* floats of one token row this unit reads */
    /* one KV head's slice of the block, copied when more than one pass reads it */
    float *kbuf = buf, *vbuf = buf ? buf + buf_floats : NULL;
    int readers = c->shares_kv ? u->q1 - u->q0 : (u->q1 - u->q0) * (u->h1 - u->h0);
    int convert = kv->dtype == KRN_BF16;
    int copy = !convert && buf && d <= KRN_ATTN_COPY_MAX_DIM && readers > 1;

    for (int r = 0; r < unit_rows(u); r++) {
        float *st = st_mem + (size_t)r * st_len;
        st[0] = -INFINITY;
        st[1] = 0.0f;
        memset(st + 2, 0, (size_t)d * sizeof(float));
    }
    int t_end = u->t1;
    if (!it->mask && it->q_offset + u->q1 < t_end)
        t_end = it->q_offset + u->q1; /* the last query sees up to q_offset + q1 - 1 */
    int blk = nh_kv > 1 ? KRN_ATTN_BLOCK_ALL_HEADS : KRN_ATTN_BLOCK;
    if (convert && (size_t)blk * slice > (size_t)buf_floats)
        blk = (int)((size_t)buf_floats / slice); /* >= 1: slice <= KRN_ATTN_STATE_FLOATS */
    for (int b0 = u->t0; b0 < t_end; b0 += blk) {
        int nb = t_end - b0 < blk ? t_end - b0 : blk;
        for (int j = 0; j < nb; j++) {
            int t = b0 + j;
            if (t < it->n_ctx) {
                uint32_t page = it->pages[t / kv->page_size];
                int off = t % kv->page_size;
                tk[j] = krn_kv_k(kv, page, off);
                tv[j] = krn_kv_v(kv, page, off);
                tbf[j] = (uint8_t)convert;
            } else {
                tk[j] = it->k_tail + (size_t)(t - it->n_ctx) * kv_tok;
                tv[j] = it->v_tail + (size_t)(t - it->n_ctx) * kv_tok;
                tbf[j] = 0;
            }
        }
        prefetch_keys(kv, it, u, b0 + blk, t_end < b0 + 2 * blk ? t_end : b0 + 2 * blk, d);
        if (convert) /* the block's rows as f32, [nb][nh_kv * d] */
            convert_block(tk, tv, tbf, nb, (size_t)u->k0 * (size_t)d, slice, kbuf, vbuf);
        for (int kvh = u->k0; kvh < u->k1; kvh++) {
            if (convert) {
                size_t h_off = (size_t)(kvh - u->k0) * (size_t)d;
                for (int j = 0; j < KRN_ATTN_BLOCK; j++) {
                    size_t row = (size_t)(j < nb ? j : 0) * slice + h_off;
                    kp[j] = kbuf + row;
                    vp[j] = vbuf + row;
                }
            } else {
                for (int j = 0; j < KRN_ATTN_BLOCK; j++) {
                    int jj = j < nb ? j : 0;
                    kp[j] = (const float *)tk[jj] + (size_t)kvh * (size_t)d;
                    vp[j] = (const float *)tv[jj] + (size_t)kvh * (size_t)d;
                }
            }
            if (copy) {
                /* the rows of a page are a power of two apart and fall into a few L1 sets:
                 * several rows reading them would each miss; a contiguous copy stays */
                for (int j = 0; j < nb; j++) {
                    memcpy(kbuf + (size_t)j * (size_t)d, kp[j], (size_t)d * sizeof(float));
                    memcpy(vbuf + (size_t)j * (size_t)d, vp[j], (size_t)d * sizeof(float));
                    kp[j] = kbuf + (size_t)j * (size_t)d;
                    vp[j] = vbuf + (size_t)j * (size_t)d;
                }
                for (int j = nb; j < KRN_ATTN_BLOCK; j++) {
                    kp[j] = kbuf;
                    vp[j] = vbuf;
                }
            }
            for (int qi = u->q0; qi < u->q1; qi++) {
                int nbq = nb;
                const uint8_t *vis = NULL;
                if (it->mask) {
                    vis = it->mask + (size_t)qi * (size_t)n_keys + (size_t)b0;
                } else {
                    int lim = it->q_offset + qi + 1 - b0; /* keys of the block this query sees */
                    if (lim <= 0) continue;
                    if (lim < nbq) nbq = lim;
                }
                const float *qs[KRN_ATTN_MAX_ROWS];
                float *sts[KRN_ATTN_MAX_ROWS];
                int nh = u->h1 - u->h0;
                for (int hh = u->h0; hh < u->h1; hh++) {
                    int h = kvh * c->group + hh;
                    qs[hh - u->h0] = it->q + (size_t)qi * q_tok + (size_t)h * (size_t)d;
                    sts[hh - u->h0] = st_mem + (size_t)unit_row(u, qi, kvh, hh) * st_len;
                }
                c->heads_block(qs, sts, nh, kp, vp, nbq, vis, c->scale, d, s);
            }
        }
    }

    for (int qi = u->q0; qi < u->q1; qi++)
        for (int kvh = u->k0; kvh < u->k1; kvh++)
            for (int hh = u->h0; hh < u->h1; hh++) {
                int r = unit_row(u, qi, kvh, hh);
                const float *st = st_mem + (size_t)r * st_len;
                if (u->part >= 0) {
                    memcpy(c->parts + (size_t)(u->part + r) * st_len, st, st_len * sizeof(float));
                    continue;
                }
                int h = kvh * c->group + hh;
                float *o = it->out + (size_t)qi * q_tok + (size_t)h * (size_t)d;
                float inv = st[1] > 0.0f ? 1.0f / st[1] : 0.0f;
                for (int i = 0; i < d; i++) o[i] = st[2 + i] * inv;
            }
}

/* unit_run without a pool's scratch: a bf16 region is converted into a stack buffer (blocks of
 * fewer keys: other rounding points of the online softmax than with a pool). */
static void unit_run_stack(const attn_ctx *c, const attn_unit *u) {
    if (c->kv->dtype != KRN_BF16) {
        unit_run(c, u, NULL, 0);
        return;
    }
    float buf[2 * KRN_ATTN_STACK_BUF_FLOATS];
    unit_run(c, u, buf, KRN_ATTN_STACK_BUF_FLOATS);
}

/* Combines the partial row states of a group's chunks into `out`. */
static void group_merge(const attn_ctx *c, const attn_group *g) {
    const attn_unit *u0 = &c->units[g->first];
    const krn_attn_item *it = &c->items[u0->item];
    int d = c->d;
    size_t st_len = (size_t)d + 2, q_tok = (size_t)c->n_heads * (size_t)d;
    for (int qi = u0->q0; qi < u0->q1; qi++)
        for (int kvh = u0->k0; kvh < u0->k1; kvh++)
            for (int hh = u0->h0; hh < u0->h1; hh++) {
                int r = unit_row(u0, qi, kvh, hh);
                float m = -INFINITY;
                for (int ch = 0; ch < g->n_chunks; ch++) {
                    const float *st =
                        c->parts + (size_t)(c->units[g->first + ch].part + r) * st_len;
                    if (st[1] > 0.0f && st[0] > m) m = st[0];
                }
                int h = kvh * c->group + hh;
                float *o = it->out + (size_t)qi * q_tok + (size_t)h * (size_t)d;
                memset(o, 0, (size_t)d * sizeof *o);
                if (m == -INFINITY) continue; /* nothing visible */
                float l = 0.0f;
                for (int ch = 0; ch < g->n_chunks; ch++) {
                    const float *st =
                        c->parts + (size_t)(c->units[g->first + ch].part + r) * st_len;
                    if (!(st[1] > 0.0f)) continue;
                    float w = expf(st[0] - m);
                    l += st[1] * w;
                    for (int i = 0; i < d; i++) o[i] += st[2 + i] * w;
                }
                float inv = 1.0f / l;
                for (int i = 0; i < d; i++) o[i] *= inv;
            }
}

static void task_unit(void *arg, int task, int n_tasks, int worker) {
    (void)n_tasks;
    const attn_ctx *c = arg;
    if (c->copy_bufs[worker])
        unit_run(c, &c->units[task], c->copy_bufs[worker], KRN_ATTN_BUF_FLOATS);
    else
        unit_run_stack(c, &c->units[task]);
}

static void task_merge(void *arg, int task, int n_tasks) {
    (void)n_tasks;
    const attn_ctx *c = arg;
    const attn_group *g = &c->groups[task];
    if (g->n_chunks > 1) group_merge(c, g);
}

/* ---- planning ------------------------------------------------------------------------------ */

/* Rows of a unit: qb queries x kb KV heads x hb heads of each group, at most
 * min(KRN_ATTN_MAX_ROWS, KRN_ATTN_STATE_FLOATS / head_dim) in all. Few queries (decode): all
 * KV heads in one unit, so each token's K and V rows are read whole and in order. Many
 * queries (prefill): one KV head per unit and as many queries as fit, so a block of K/V is
 * reused by the most rows while it sits in L1. */
typedef struct attn_shape {
    int qb, kb, hb;
} attn_shape;

static attn_shape unit_shape(int n_kv, int group, int d, int max_nq) {
    int rows = KRN_ATTN_STATE_FLOATS / d;
    if (rows > KRN_ATTN_MAX_ROWS) rows = KRN_ATTN_MAX_ROWS;
    if (rows < 1) rows = 1;
    attn_shape s;
    s.hb = group < rows ? group : rows;
    s.kb = rows / (s.hb * max_nq);
    if (s.kb > n_kv) s.kb = n_kv;
    if (s.kb < 1) s.kb = 1;
    s.qb = rows / (s.hb * s.kb);
    if (s.qb < 1) s.qb = 1;
    return s;
}

static int div_up(int a, int b) { return (a + b - 1) / b; }
static int min_int(int a, int b) { return a < b ? a : b; }

/* Runs the statements that follow the arguments for every group of rows, with item,
 * [k0, k1), [q0, q1) and [h0, h1) in scope. */
#define FOR_EACH_GROUP(items, n_items, n_kv, group, shape, ...)           \
    for (int item = 0; item < (n_items); item++)                          \
        for (int k0 = 0; k0 < (n_kv); k0 += (shape).kb)                   \
            for (int q0 = 0; q0 < (items)[item].n_q; q0 += (shape).qb)    \
                for (int h0 = 0; h0 < (group); h0 += (shape).hb) {        \
                    int k1 = min_int(k0 + (shape).kb, (n_kv));            \
                    int q1 = min_int(q0 + (shape).qb, (items)[item].n_q); \
                    int h1 = min_int(h0 + (shape).hb, (group));           \
                    __VA_ARGS__                                           \
                }

/* Work units of a call: (item, KV-head block, query block, head block) groups. */
static int count_groups(const krn_attn_item *items, int n_items, int n_kv, int group,
                        attn_shape shape) {
    int n = 0;
    FOR_EACH_GROUP(items, n_items, n_kv, group, shape, {
        (void)k1;
        (void)q1;
        (void)h1;
        n++;
    })
    return n;
}

static heads_block_fn pick_heads_block(int *shares_kv) {
    *shares_kv = 0;
    switch (krn_simd_level()) {
#if KRN_X86
    case KRN_SIMD_AVX512: *shares_kv = 1; return heads_block_avx512;
    case KRN_SIMD_AVX2: return heads_block_avx2;
#endif
    default: return heads_block_scalar;
    }
}

/* Aborts on a shape the kernel cannot run (see krn_cpu_attention_ex). */
static void check_shape(int n_heads, int n_kv, int d, krn_dtype dt) {
    if (dt != KRN_F32 && dt != KRN_BF16) {
        fprintf(stderr, "krn_cpu_attention: KV dtype %d is neither f32 nor bf16\n", (int)dt);
        abort();
    }
    if (n_kv <= 0 || n_heads % n_kv != 0 || d > KRN_ATTN_STATE_FLOATS) {
        fprintf(stderr,
                "krn_cpu_attention: n_heads %d is not a multiple of n_kv_heads %d, or "
                "head_dim %d exceeds %d\n",
                n_heads, n_kv, d, KRN_ATTN_STATE_FLOATS);
        abort();
    }
}

krn_attn_plan krn_cpu_attention_plan(const krn_pool *p, const krn_kv_layer *kv,
                                     const krn_attn_item *items, int n_items, int n_heads,
                                     int kv_chunk) {
    krn_attn_plan plan = {.max_nq = 1, .chunk = 0};
    int n_kv = kv->n_kv_heads, d = kv->head_dim;
    if (n_items <= 0 || n_heads <= 0 || d <= 0) return plan;
    check_shape(n_heads, n_kv, d, kv->dtype);
    int group = n_heads / n_kv;
    for (int i = 0; i < n_items; i++)
        if (items[i].n_q > plan.max_nq) plan.max_nq = items[i].n_q;
    attn_shape shape = unit_shape(n_kv, group, d, plan.max_nq);
    int n_groups = count_groups(items, n_items, n_kv, group, shape);
    /* chunk size in keys: forced, or enough chunks for every thread when groups are few */
    int threads = krn_pool_size(p);
    if (kv_chunk > 0) {
        plan.chunk = kv_chunk;
    } else if (kv_chunk == 0 && threads > 1 && n_groups < 4 * threads) {
        int max_keys = 0;
        for (int i = 0; i < n_items; i++)
            if (items[i].n_ctx + items[i].n_tail > max_keys)
                max_keys = items[i].n_ctx + items[i].n_tail;
        int want = div_up(4 * threads, n_groups);
        plan.chunk = div_up(div_up(max_keys, want), KRN_ATTN_BLOCK) * KRN_ATTN_BLOCK;
        if (plan.chunk < KRN_ATTN_MIN_CHUNK) plan.chunk = KRN_ATTN_MIN_CHUNK;
    }
    return plan;
}

void krn_cpu_attention_ex(krn_pool *p, const krn_kv_layer *kv, const krn_attn_item *items,
                          int n_items, int n_heads, float scale, int kv_chunk) {
    krn_attn_plan plan = krn_cpu_attention_plan(p, kv, items, n_items, n_heads, kv_chunk);
    krn_cpu_attention_run(p, kv, items, n_items, n_heads, scale, &plan);
}

void krn_cpu_attention_run(krn_pool *p, const krn_kv_layer *kv, const krn_attn_item *items,
                           int n_items, int n_heads, float scale, const krn_attn_plan *plan) {
    int n_kv = kv->n_kv_heads, d = kv->head_dim;
    if (n_items <= 0 || n_heads <= 0 || d <= 0) return;
    check_shape(n_heads, n_kv, d, kv->dtype);
    int group = n_heads / n_kv;
    attn_shape shape = unit_shape(n_kv, group, d, plan->max_nq);
    attn_ctx c = {
        .kv = kv, .items = items, .n_heads = n_heads, .group = group, .d = d, .scale = scale};
    c.heads_block = pick_heads_block(&c.shares_kv);
    int threads = krn_pool_size(p);
    int chunk = plan->chunk;
    int n_groups = count_groups(items, n_items, n_kv, group, shape);

    /* count units and partial row states */
    size_t n_units = 0, n_part_rows = 0;
    FOR_EACH_GROUP(items, n_items, n_kv, group, shape, {
        int keys = items[item].n_ctx + items[item].n_tail;
        int chunks = chunk > 0 && keys > chunk ? div_up(keys, chunk) : 1;
        n_units += (size_t)chunks;
        if (chunks > 1) n_part_rows += (size_t)chunks * (size_t)((q1 - q0) * (k1 - k0) * (h1 - h0));
    })

    size_t st_len = (size_t)d + 2;
    size_t units_bytes = (n_units * sizeof(attn_unit) + 63) & ~(size_t)63;
    size_t groups_bytes = ((size_t)n_groups * sizeof(attn_group) + 63) & ~(size_t)63;
    size_t bytes = units_bytes + groups_bytes + n_part_rows * st_len * sizeof(float);
    char *mem = p && threads <= KRN_ATTN_MAX_THREADS && n_part_rows <= (size_t)INT32_MAX
                    ? krn_pool_scratch(p, threads, bytes)
                    : NULL;
    if (!mem) {
        /* no pool or no memory: every group in the caller, unchunked, nothing allocated */
        FOR_EACH_GROUP(items, n_items, n_kv, group, shape, {
            attn_unit u = {item, k0, k1, q0, q1, h0, h1, 0, items[item].n_ctx + items[item].n_tail,
                           -1};
            unit_run_stack(&c, &u);
        })
        return;
    }
    attn_unit *units = (attn_unit *)(void *)mem;
    attn_group *groups = (attn_group *)(void *)(mem + units_bytes);
    c.units = units;
    c.groups = groups;
    c.parts = (float *)(void *)(mem + units_bytes + groups_bytes);

    int ui = 0, gi = 0, part = 0, any_chunked = 0;
    FOR_EACH_GROUP(items, n_items, n_kv, group, shape, {
        int keys = items[item].n_ctx + items[item].n_tail;
        int chunks = chunk > 0 && keys > chunk ? div_up(keys, chunk) : 1;
        int rows = (q1 - q0) * (k1 - k0) * (h1 - h0);
        groups[gi].first = ui;
        groups[gi].n_chunks = chunks;
        gi++;
        for (int ch = 0; ch < chunks; ch++) {
            attn_unit u = {item, k0, k1, q0, q1, h0, h1, 0, keys, -1};
            if (chunks > 1) {
                u.t0 = ch * chunk;
                u.t1 = min_int(u.t0 + chunk, keys);
                u.part = part;
                part += rows;
                any_chunked = 1;
            }
            units[ui++] = u;
        }
    })
    for (int w = 0; w < threads; w++)
        c.copy_bufs[w] = krn_pool_scratch(p, w, 2 * KRN_ATTN_BUF_FLOATS * sizeof(float));
    krn_pool_run_ex(p, task_unit, &c, ui);
    if (any_chunked) krn_pool_run(p, task_merge, &c, gi);
}

void krn_cpu_attention(krn_pool *p, const krn_kv_layer *kv, const krn_attn_item *items, int n_items,
                       int n_heads, float scale) {
    krn_cpu_attention_ex(p, kv, items, n_items, n_heads, scale, 0);
}
