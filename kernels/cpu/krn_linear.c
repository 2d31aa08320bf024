/* krn_linear.c — y[n, out] = x[n, in] · W^T for f32, bf16 and f16 weights W[out, in].
 *
 * Owns: the split of a linear layer over the pool, the OpenBLAS threading policy, the
 * GEMV-style kernels for few rows (decode) and the tile conversion feeding sgemm for many rows
 * (prefill).
 * Does not own: the pool (krn_pool.c), the SIMD choice (krn_simd.c).
 *
 * Threading: the pool owns every thread. OpenBLAS is set to one thread once
 * (openblas_set_num_threads(1), the first time a linear runs) and each pool task calls sgemm
 * on its own block of output columns, so OpenBLAS's threads never compete with the pool's
 * (2 cores: two sets of busy threads would halve both). A process that uses OpenBLAS elsewhere
 * gets one thread per call too; that is the price of one threading model.
 *
 * Paths, per weight dtype:
 *   f32, n <= KRN_LINEAR_F32_GEMV_MAX_N (32), avx512
 *                  the GEMV-style kernels below, W loaded as it is: 1.2-1.5x OpenBLAS's sgemv
 *                  at n = 1 and about 2x its sgemm at n = 8-32 in a 1B-shape decode step (2
 *                  cores, bench/results/peers.md, 2026-11-30).
 *   f32, otherwise sgemm (sgemv when n == 1) per block of output columns.
 *   bf16, n >= KRN_LINEAR_AMX_MIN_N (8), in % 32 == 0, AMX active (krn_amx.c)
 *                  x is packed once per call (split into two bf16 parts: as accurate as the
 *                  exact paths); W is read in place as AMX tiles, blocks of 64 output rows
 *                  are the tasks; the last out % 16 rows take the GEMV path below. 1.9-2.8×
 *                  the GEMV path's throughput at n = 32 (now close to n = 1's time: W is read
 *                  once) and 2-4.6× the tile path's at n = 512 (2 cores;
 *                  bench/results/kernels.md).
 *   bf16 packed once (KRN_BF16_PANEL), n >= KRN_LINEAR_AMX_MIN_N, AMX active (krn_amx.c)
 *                  x packed once per call as AMX "A" tiles (hi and lo parts), the packed panels
 *                  read in place as "B" tiles, any `in` and `out`, all n rows in one pass;
 *                  blocks of KRN_LINEAR_AMX_ROWS outputs are the tasks. Fewer rows, or AMX off:
 *                  the packed panels' own kernels (krn_panel.c), in chunks of
 *                  KRN_LINEAR_WPACK_CHUNK_N rows.
 *   bf16/f16, n <= KRN_LINEAR_GEMV_MAX_N (32), otherwise
 *                  GEMV-style: W is streamed once for all n rows (a block of 4 rows of W is
 *                  reused from L1/L2 for every group of 4 rows of x); each weight is converted
 *                  exactly to f32 in registers and multiplied with x in f32 (f32 accumulation,
 *                  nothing lost to rounding x). Blocks of output rows are the tasks.
 *   bf16/f16, more rows, otherwise
 *                  each task owns KRN_LINEAR_TILE_ROWS rows of W; it converts them
 *                  KRN_LINEAR_TILE_K columns at a time into its worker's scratch (1 MiB of f32)
 *                  and calls sgemm on each tile, accumulating into y (beta = 1 after the
 *                  first); the whole matrix is never expanded.
 *                  If scratch cannot be allocated the GEMV path is used instead. */
#include "krn_cpu_impl.h"

#include <cblas.h>
#include <pthread.h>
#include <stdlib.h>

/* Up to this many rows the GEMV path is faster than converting tiles for sgemm: at n = 16 it
 * takes half the time, at n = 32 about the same, at n = 64 twice as long (2 cores, bf16,
 * 2048 x 2048 and 2048 x 8192; bench/results/kernels.md). */
#define KRN_LINEAR_GEMV_MAX_N 32
/* A converted tile is KRN_LINEAR_TILE_ROWS rows of W by KRN_LINEAR_TILE_K columns in f32
 * (1 MiB, half of a 2 MiB L2, so it is still in cache when sgemm packs it). Many rows per
 * tile because each sgemm call packs its slice of x again: 2 * rows flops per packed float. */
#define KRN_LINEAR_TILE_ROWS 512
#define KRN_LINEAR_TILE_K    512
/* How far ahead of its loads the n = 1 AVX-512 kernel prefetches each row of W: 512 bytes (8
 * cache lines), about as good as 384-1024 and better than 256 (2 cores;
 * bench/results/engine.md). */
#define KRN_LINEAR_PF_BYTES 512
/* f32 weights up to this many rows of x on the AVX-512 GEMV kernels (W streamed once, 16
 * weights per load, no conversion) instead of OpenBLAS sgemm/sgemv per block of columns: a
 * 1B-shape decode step at b=1 ran at 26-36% of the bandwidth bound through sgemv, at b=8-32 at
 * 13.8-27 tok/s through sgemm, against 60 tok/s at b=32 here (~65% of the f32 FMA peak). */
#define KRN_LINEAR_F32_GEMV_MAX_N 32
/* Output rows per GEMV task: small enough for load balance, large enough to amortise a task. */
#define KRN_LINEAR_GEMV_ROWS 64
/* bf16 weights on AMX (krn_amx.c) from this many rows of x: below it the exact GEMV path
 * reads the weights just as fast (it is bound by memory, not arithmetic, at n <= 4). */
#define KRN_LINEAR_AMX_MIN_N 8
/* Output rows per AMX task (a multiple of 32: two 16-row A tiles at a time). Each task loads
 * the tile configuration and releases the tiles once; 256 rows instead of 64 made a b=32
 * decode step ~2% faster (5 interleaved pairs, bench/results/engine.md). */
#define KRN_LINEAR_AMX_ROWS 256
/* bf16 weights by AVX512-BF16 dot products (krn_bf16dot.c), when AMX is not active, for
 * KRN_LINEAR_DOT_MIN_N..KRN_LINEAR_GEMV_MAX_N rows of x: the rows the exact GEMV tiles would
 * take. Below 8 rows the exact GEMV path is bound by memory, not arithmetic (as for AMX); above
 * 32 the sgemm tiles of the prefill path run at 71-73 GMAC/s per core against VDPBF16PS's 42
 * on the Intel kind (bench/results/peers.md, 2026-11-28 section on AVX512-BF16). */
#define KRN_LINEAR_DOT_MIN_N 8
/* Output rows per AVX512-BF16 task (a multiple of the tile's 3 rows of W). */
#define KRN_LINEAR_DOT_ROWS 48
/* bf16/f16 weights on packed panels (krn_panel.c) for KRN_LINEAR_PANEL_MIN_N..
 * KRN_LINEAR_PANEL_MAX_N rows of x on the avx512 path, where neither AMX nor AVX512-BF16 takes
 * them. Below 4 rows both kernels wait for W from DRAM (one thread, W streamed: equal within
 * ±8%) and with W in cache the GEMV tiles are faster (they pack nothing); at b=4 decode the
 * panels took 2% less CPU per step, at b=8-32 11-16% less. Past 256 rows the sgemm tiles
 * catch up (one thread: panels 1.1-1.2x at n = 192-256, 0.92-1.03x at 384-512;
 * bench/results/engine.md). */
#define KRN_LINEAR_PANEL_MIN_N 4
#define KRN_LINEAR_PANEL_MAX_N 256
/* f16 weights from this many rows: packing them costs twice bf16's (a 4-byte transpose per
 * weight after vcvtph2ps, where bf16 moves (k, k + 1) pairs), so with W from DRAM the panels
 * ran at 0.86-0.98x the GEMV tiles at 8-16 rows, 0.97-1.07x at 4, 1.00-1.03x at 20-24,
 * 1.08-1.13x at 28-32 (one thread; bench/results/engine.md). */
#define KRN_LINEAR_PANEL_MIN_N_F16 24
/* Output rows per panel task (a multiple of KRN_PANEL_ROWS), fewer when that leaves fewer
 * than 4 tasks per worker. */
#define KRN_LINEAR_PANEL_TASK_ROWS 64
/* Rows of x per pass over packed W (KRN_BF16_PANEL): one thread, n = 512, W from DRAM,
 * 2048 -> 8192 and 8192 -> 2048: 114-118 ms in chunks of 128 rows, 121-123 in chunks of 64,
 * ~128 in chunks of 256, 154-159 in one pass (x's slice of a block no longer stays in L1/L2
 * beside it), the sgemm tiles of row-major W 122-125 (bench_krn_batch, --variants wpack). */
#define KRN_LINEAR_WPACK_CHUNK_N 128

#define KRN_INLINE static inline __attribute__((always_inline))
/* Loops over register tiles with compile-time trip counts must unroll fully, or the
 * accumulator arrays live on the stack instead of in registers. */
#define KRN_UNROLL        _Pragma("GCC unroll 8")
#define KRN_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define KRN_TARGET_AVX2   __attribute__((target("avx2,fma,f16c")))

/* ---- OpenBLAS threading ------------------------------------------------------------------ */

/* Process-wide on purpose: OpenBLAS's thread count is itself process-wide; set it once. */
static pthread_once_t g_blas_once = PTHREAD_ONCE_INIT;
static void blas_single_thread(void) { openblas_set_num_threads(1); }

/* ---- portable C ------------------------------------------------------------------------- */

static void gemv_scalar(const float *x, int n, int in, const void *w, krn_dtype wt, int o0, int o1,
                        float *y, int out) {
    const uint16_t *w16 = w;
    for (int o = o0; o < o1; o++) {
        const uint16_t *row = w16 + (size_t)o * (size_t)in;
        for (int r = 0; r < n; r++) {
            const float *xr = x + (size_t)r * (size_t)in;
            float acc = 0.0f;
            if (wt == KRN_BF16)
                for (int k = 0; k < in; k++) acc += krn_bf16_to_f32(row[k]) * xr[k];
            else
                for (int k = 0; k < in; k++) acc += krn_f16_to_f32(row[k]) * xr[k];
            y[(size_t)r * (size_t)out + (size_t)o] = acc;
        }
    }
}

static void convert_scalar(const uint16_t *src, krn_dtype wt, size_t n, float *dst) {
    if (wt == KRN_BF16)
        for (size_t i = 0; i < n; i++) dst[i] = krn_bf16_to_f32(src[i]);
    else
        for (size_t i = 0; i < n; i++) dst[i] = krn_f16_to_f32(src[i]);
}

#if KRN_X86
/* ---- AVX2 + FMA + F16C ------------------------------------------------------------------- */

KRN_TARGET_AVX2 KRN_INLINE __m256 load8_avx2(const uint16_t *p, krn_dtype wt) {
    __m128i h = _mm_loadu_si128((const __m128i *)(const void *)p);
    if (wt == KRN_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

KRN_TARGET_AVX2 KRN_INLINE float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[r, c] for RX rows of x and RW rows of W (compile-time constants after inlining). */
KRN_TARGET_AVX2 KRN_INLINE void tile_avx2(const float *x, size_t ldx, int RX, const uint16_t *w,
                                          size_t ldw, int RW, int in, krn_dtype wt, float *y,
                                          size_t ldy) {
    __m256 acc[2][4];
    KRN_UNROLL for (int r = 0; r < RX; r++) {
        KRN_UNROLL for (int c = 0; c < RW; c++) { acc[r][c] = _mm256_setzero_ps(); }
    }
    int k = 0;
    for (; k + 8 <= in; k += 8) {
        __m256 wv[4];
        KRN_UNROLL for (int c = 0; c < RW; c++) {
            wv[c] = load8_avx2(w + (size_t)c * ldw + (size_t)k, wt);
        }
        KRN_UNROLL for (int r = 0; r < RX; r++) {
            __m256 xv = _mm256_loadu_ps(x + (size_t)r * ldx + (size_t)k);
            KRN_UNROLL for (int c = 0; c < RW; c++) {
                acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
            }
        }
    }
    KRN_UNROLL for (int r = 0; r < RX; r++) {
        KRN_UNROLL for (int c = 0; c < RW; c++) {
            float s = hsum256(acc[r][c]);
            const uint16_t *wr = w + (size_t)c * ldw;
            const float *xr = x + (size_t)r * ldx;
            for (int kk = k; kk < in; kk++)
                s += (wt == KRN_BF16 ? krn_bf16_to_f32(wr[kk]) : krn_f16_to_f32(wr[kk])) * xr[kk];
            y[(size_t)r * ldy + (size_t)c] = s;
        }
    }
}

KRN_TARGET_AVX2 KRN_INLINE void gemv_avx2_body(const float *x, int n, int in, const uint16_t *w16,
                                               krn_dtype wt, int o0, int o1, float *y, int out) {
    size_t ldw = (size_t)in, ldx = (size_t)in, ldy = (size_t)out;
    int o = o0;
    for (; o + 4 <= o1; o += 4) {
        const uint16_t *wo = w16 + (size_t)o * ldw;
        int r = 0;
        for (; r + 2 <= n; r += 2)
            tile_avx2(x + (size_t)r * ldx, ldx, 2, wo, ldw, 4, in, wt,
                      y + (size_t)r * ldy + (size_t)o, ldy);
        if (r < n)
            tile_avx2(x + (size_t)r * ldx, ldx, 1, wo, ldw, 4, in, wt,
                      y + (size_t)r * ldy + (size_t)o, ldy);
    }
    for (; o < o1; o++) {
        const uint16_t *wo = w16 + (size_t)o * ldw;
        int r = 0;
        for (; r + 2 <= n; r += 2)
            tile_avx2(x + (size_t)r * ldx, ldx, 2, wo, ldw, 1, in, wt,
                      y + (size_t)r * ldy + (size_t)o, ldy);
        if (r < n)
            tile_avx2(x + (size_t)r * ldx, ldx, 1, wo, ldw, 1, in, wt,
                      y + (size_t)r * ldy + (size_t)o, ldy);
    }
}

KRN_TARGET_AVX2 static void gemv_avx2(const float *x, int n, int in, const void *w, krn_dtype wt,
                                      int o0, int o1, float *y, int out) {
    if (wt == KRN_BF16)
        gemv_avx2_body(x, n, in, w, KRN_BF16, o0, o1, y, out);
    else
        gemv_avx2_body(x, n, in, w, KRN_F16, o0, o1, y, out);
}

KRN_TARGET_AVX2 static void convert_avx2(const uint16_t *src, krn_dtype wt, size_t n, float *dst) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8_avx2(src + i, wt));
    convert_scalar(src + i, wt, n - i, dst + i);
}

/* ---- AVX-512 ----------------------------------------------------------------------------- */

/* 16 weights from element i of w as f32 (wt is a compile-time constant after inlining). */
KRN_TARGET_AVX512 KRN_INLINE __m512 load16_avx512(const void *w, size_t i, krn_dtype wt,
                                                  __mmask16 m) {
    if (wt == KRN_F32) return _mm512_maskz_loadu_ps(m, (const float *)w + i);
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)w + i);
    if (wt == KRN_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* Element i of w as an address. */
KRN_INLINE const void *welem(const void *w, size_t i, krn_dtype wt) {
    return (const char *)w + i * krn_dtype_size(wt);
}

KRN_TARGET_AVX512 KRN_INLINE void tile_avx512(const float *x, size_t ldx, int RX, const void *w,
                                              size_t ldw, int RW, int in, krn_dtype wt, float *y,
                                              size_t ldy) {
    __m512 acc[6][8];
    KRN_UNROLL for (int r = 0; r < RX; r++) {
        KRN_UNROLL for (int c = 0; c < RW; c++) { acc[r][c] = _mm512_setzero_ps(); }
    }
    int k = 0;
    for (; k + 16 <= in; k += 16) {
        __m512 wv[8];
        KRN_UNROLL for (int c = 0; c < RW; c++) {
            wv[c] = load16_avx512(w, (size_t)c * ldw + (size_t)k, wt, 0xffff);
        }
        KRN_UNROLL for (int r = 0; r < RX; r++) {
            __m512 xv = _mm512_loadu_ps(x + (size_t)r * ldx + (size_t)k);
            KRN_UNROLL for (int c = 0; c < RW; c++) {
                acc[r][c] = _mm512_fmadd_ps(wv[c], xv, acc[r][c]);
            }
        }
    }
    if (k < in) {
        __mmask16 m = (__mmask16)((1u << (in - k)) - 1u);
        __m512 wv[8];
        KRN_UNROLL for (int c = 0; c < RW; c++) {
            wv[c] = load16_avx512(w, (size_t)c * ldw + (size_t)k, wt, m);
        }
        KRN_UNROLL for (int r = 0; r < RX; r++) {
            __m512 xv = _mm512_maskz_loadu_ps(m, x + (size_t)r * ldx + (size_t)k);
            KRN_UNROLL for (int c = 0; c < RW; c++) {
                acc[r][c] = _mm512_fmadd_ps(wv[c], xv, acc[r][c]);
            }
        }
    }
    KRN_UNROLL for (int r = 0; r < RX; r++) {
        KRN_UNROLL for (int c = 0; c < RW; c++) {
            y[(size_t)r * ldy + (size_t)c] = _mm512_reduce_add_ps(acc[r][c]);
        }
    }
}

#define KRN_GEMV512_ROWS(RW)                                              \
    do {                                                                  \
        int r = 0;                                                        \
        for (; r + 6 <= n; r += 6)                                        \
            tile_avx512(x + (size_t)r * ldx, ldx, 6, wo, ldw, RW, in, wt, \
                        y + (size_t)r * ldy + (size_t)o, ldy);            \
        for (; r + 4 <= n; r += 4)                                        \
            tile_avx512(x + (size_t)r * ldx, ldx, 4, wo, ldw, RW, in, wt, \
                        y + (size_t)r * ldy + (size_t)o, ldy);            \
        switch (n - r) {                                                  \
        case 3:                                                           \
            tile_avx512(x + (size_t)r * ldx, ldx, 3, wo, ldw, RW, in, wt, \
                        y + (size_t)r * ldy + (size_t)o, ldy);            \
            break;                                                        \
        case 2:                                                           \
            tile_avx512(x + (size_t)r * ldx, ldx, 2, wo, ldw, RW, in, wt, \
                        y + (size_t)r * ldy + (size_t)o, ldy);            \
            break;                                                        \
        case 1:                                                           \
            tile_avx512(x + (size_t)r * ldx, ldx, 1, wo, ldw, RW, in, wt, \
                        y + (size_t)r * ldy + (size_t)o, ldy);            \
            break;                                                        \
        default: break;                                                   \
        }                                                                 \
    } while (0)

/* n = 1: rows [o, o + 8) of W against x. Each step takes 32 weights of each of the 8 rows (one
 * cache line of 16-bit weights, two of f32) and prefetches them KRN_LINEAR_PF_BYTES / 2
 * weights further on (measured 5-14% less time on the MLP shapes; likely because a decode row
 * of W is only 4-16 KiB and the hardware prefetcher, which stops at 4 KiB pages, ramps up again
 * for every row). Two accumulators per row keep 16 FMA chains in flight. */
KRN_TARGET_AVX512 KRN_INLINE void gemv1_rows8_avx512(const float *x, int in, const void *w,
                                                     krn_dtype wt, float *y) {
    const size_t ldw = (size_t)in;
    __m512 a[8], b[8];
    KRN_UNROLL for (int c = 0; c < 8; c++) {
        a[c] = _mm512_setzero_ps();
        b[c] = _mm512_setzero_ps();
    }
    /* as many weights ahead for f32 as for 16-bit weights: the same time ahead of the loads
     * (1 KiB instead of 512 bytes: 11.1-11.6 against 10.5-11.6 tok/s in a b=1 decode of the
     * 1B shape, 3 interleaved pairs) */
    const int pf = KRN_LINEAR_PF_BYTES / 2;
    int k = 0;
    for (; k + 32 <= in; k += 32) {
        __m512 x0 = _mm512_loadu_ps(x + k), x1 = _mm512_loadu_ps(x + k + 16);
        /* never past the row: the addresses stay inside W */
        int ahead = k + pf + (wt == KRN_F32 ? 16 : 0) < in;
        KRN_UNROLL for (int c = 0; c < 8; c++) {
            size_t i = (size_t)c * ldw + (size_t)k;
            if (ahead) {
                _mm_prefetch((const char *)welem(w, i + (size_t)pf, wt), _MM_HINT_T0);
                if (wt == KRN_F32) /* 32 f32 weights: the second line too */
                    _mm_prefetch((const char *)welem(w, i + (size_t)pf + 16, wt), _MM_HINT_T0);
            }
            a[c] = _mm512_fmadd_ps(load16_avx512(w, i, wt, 0xffff), x0, a[c]);
            b[c] = _mm512_fmadd_ps(load16_avx512(w, i + 16, wt, 0xffff), x1, b[c]);
        }
    }
    for (; k < in; k += 16) {
        __mmask16 m = krn_mask16(in - k);
        __m512 x0 = _mm512_maskz_loadu_ps(m, x + k);
        KRN_UNROLL for (int c = 0; c < 8; c++) {
            a[c] = _mm512_fmadd_ps(load16_avx512(w, (size_t)c * ldw + (size_t)k, wt, m), x0, a[c]);
        }
    }
    KRN_UNROLL for (int c = 0; c < 8; c++) { y[c] = _mm512_reduce_add_ps(_mm512_add_ps(a[c], b[c])); }
}

/* Rows of W in blocks of 8 for one row of x (gemv1_rows8_avx512), else in
 * blocks of 4 against up to 6 rows of x at a time (24 accumulators: each converted weight
 * vector feeds 6 FMAs). */
KRN_TARGET_AVX512 KRN_INLINE void gemv_avx512_body(const float *x, int n, int in, const void *w,
                                                   krn_dtype wt, int o0, int o1, float *y,
                                                   int out) {
    size_t ldw = (size_t)in, ldx = (size_t)in, ldy = (size_t)out;
    int o = o0;
    if (n == 1)
        for (; o + 8 <= o1; o += 8)
            gemv1_rows8_avx512(x, in, welem(w, (size_t)o * ldw, wt), wt, y + o);
    for (; o + 4 <= o1; o += 4) {
        const void *wo = welem(w, (size_t)o * ldw, wt);
        KRN_GEMV512_ROWS(4);
    }
    for (; o < o1; o++) {
        const void *wo = welem(w, (size_t)o * ldw, wt);
        KRN_GEMV512_ROWS(1);
    }
}

KRN_TARGET_AVX512 static void gemv_avx512(const float *x, int n, int in, const void *w,
                                          krn_dtype wt, int o0, int o1, float *y, int out) {
    if (wt == KRN_BF16)
        gemv_avx512_body(x, n, in, w, KRN_BF16, o0, o1, y, out);
    else if (wt == KRN_F32)
        gemv_avx512_body(x, n, in, w, KRN_F32, o0, o1, y, out);
    else
        gemv_avx512_body(x, n, in, w, KRN_F16, o0, o1, y, out);
}

KRN_TARGET_AVX512 static void convert_avx512(const uint16_t *src, krn_dtype wt, size_t n,
                                             float *dst) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load16_avx512(src, i, wt, 0xffff));
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(dst + i, m, load16_avx512(src, i, wt, m));
    }
}
#endif /* KRN_X86 */

/* ---- dispatch ---------------------------------------------------------------------------- */

static void gemv_range(const float *x, int n, int in, const void *w, krn_dtype wt, int o0, int o1,
                       float *y, int out) {
    switch (krn_simd_level()) {
#if KRN_X86
    case KRN_SIMD_AVX512: gemv_avx512(x, n, in, w, wt, o0, o1, y, out); return;
    case KRN_SIMD_AVX2: gemv_avx2(x, n, in, w, wt, o0, o1, y, out); return;
#endif
    default: gemv_scalar(x, n, in, w, wt, o0, o1, y, out); return;
    }
}

static void convert_range(const uint16_t *src, krn_dtype wt, size_t n, float *dst) {
    switch (krn_simd_level()) {
#if KRN_X86
    case KRN_SIMD_AVX512: convert_avx512(src, wt, n, dst); return;
    case KRN_SIMD_AVX2: convert_avx2(src, wt, n, dst); return;
#endif
    default: convert_scalar(src, wt, n, dst); return;
    }
}

/* ---- tasks ------------------------------------------------------------------------------- */

typedef struct linear_job {
    const float *x;
    int n, in, out;
    const void *w;
    krn_dtype wt;
    float *y;
    int rows_per_task;  /* output rows (W rows) per task */
    int tile_k;           /* tile path: input columns per converted tile */
    void *scratch[1024];  /* per worker: the tile path's f32 tile, the panel path's panel */
    const void *xp;       /* AMX path: x packed as bf16 tiles; bf16-dot path: x rounded to bf16;
                             panel path: x packed into row tiles */
    int out16;          /* AMX path: rows of W it covers */
    krn_panel_kind kind; /* panel paths: exact f32 or bf16 dot products */
} linear_job;

/* The rows of W that task `task` of a job covers: [*o0, *o1). */
static inline void task_rows(const linear_job *j, int task, int *o0, int *o1) {
    *o0 = task * j->rows_per_task;
    *o1 = *o0 + j->rows_per_task < j->out ? *o0 + j->rows_per_task : j->out;
}

static void task_f32(void *arg, int task, int n_tasks) {
    (void)n_tasks;
    const linear_job *j = arg;
    int o0, o1;
    task_rows(j, task, &o0, &o1);
    const float *w = (const float *)j->w + (size_t)o0 * (size_t)j->in;
    if (j->n == 1)
        cblas_sgemv(CblasRowMajor, CblasNoTrans, o1 - o0, j->in, 1.0f, w, j->in, j->x, 1, 0.0f,
                    j->y + o0, 1);
    else
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, j->n, o1 - o0, j->in, 1.0f, j->x,
                    j->in, w, j->in, 0.0f, j->y + o0, j->out);
}

static void task_gemv(void *arg, int task, int n_tasks) {
    (void)n_tasks;
    const linear_job *j = arg;
    int o0, o1;
    task_rows(j, task, &o0, &o1);
    gemv_range(j->x, j->n, j->in, j->w, j->wt, o0, o1, j->y, j->out);
}

/* AMX for the first out16 rows (a multiple of 16), the exact GEMV for the rest. */
static void task_amx(void *arg, int task, int n_tasks, int worker) {
    (void)n_tasks, (void)worker;
    const linear_job *j = arg;
    int o0, o1;
    task_rows(j, task, &o0, &o1);
    int a1 = o1 < j->out16 ? o1 : j->out16;
    if (a1 > o0) krn_amx_rows(j->xp, j->n, j->in, j->w, o0, a1, j->y, j->out);
    int g0 = a1 > o0 ? a1 : o0;
    if (o1 > g0) gemv_range(j->x, j->n, j->in, j->w, j->wt, g0, o1, j->y, j->out);
}

static void task_dot(void *arg, int task, int n_tasks, int worker) {
    (void)n_tasks, (void)worker;
    const linear_job *j = arg;
    int o0, o1;
    task_rows(j, task, &o0, &o1);
    krn_bf16dot_rows(j->xp, j->n, j->in, j->w, o0, o1, j->y, j->out);
}

static void task_tile(void *arg, int task, int n_tasks, int worker) {
    (void)n_tasks;
    const linear_job *j = arg;
    int o0, o1;
    task_rows(j, task, &o0, &o1);
    float *tile = j->scratch[worker];
    const uint16_t *w = j->w;
    for (int k0 = 0; k0 < j->in; k0 += j->tile_k) {
        int kk = j->in - k0 < j->tile_k ? j->in - k0 : j->tile_k;
        for (int o = o0; o < o1; o++)
            convert_range(w + (size_t)o * (size_t)j->in + (size_t)k0, j->wt, (size_t)kk,
                          tile + (size_t)(o - o0) * (size_t)kk);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, j->n, o1 - o0, kk, 1.0f, j->x + k0,
                    j->in, tile, kk, k0 == 0 ? 0.0f : 1.0f, j->y + o0, j->out);
    }
}

static void task_panel(void *arg, int task, int n_tasks, int worker) {
    (void)n_tasks;
    const linear_job *j = arg;
    int o0, o1;
    task_rows(j, task, &o0, &o1);
    krn_panel_rows(j->kind, j->xp, j->n, j->in, j->w, j->wt, o0, o1, j->scratch[worker], j->y,
                   j->out);
}

static int div_up(int a, int b) { return (a + b - 1) / b; }

/* The GEMV path: blocks of KRN_LINEAR_GEMV_ROWS output rows, smaller when that leaves fewer
 * than 4 tasks per worker. */
static void linear_gemv(krn_pool *p, linear_job *j, int threads) {
    j->rows_per_task = KRN_LINEAR_GEMV_ROWS;
    int n_tasks = div_up(j->out, j->rows_per_task);
    if (n_tasks < 4 * threads && j->out >= 4 * threads * 4) {
        j->rows_per_task = (div_up(j->out, 4 * threads) + 3) / 4 * 4;
        n_tasks = div_up(j->out, j->rows_per_task);
    }
    krn_pool_run(p, task_gemv, j, n_tasks);
}

static size_t round64(size_t b) { return (b + 63) / 64 * 64; }

/* The panel path: x packed once (the pool's shared scratch), a panel buffer per worker, blocks
 * of panels as the tasks; without a pool one malloc for both. -1 when memory runs out (the
 * caller takes another path). */
/* Rows of W per panel task for `out` rows: KRN_LINEAR_PANEL_TASK_ROWS, or one panel when that
 * leaves fewer than 4 tasks per worker. */
static int panel_task_rows(int out, int threads) {
    if (div_up(out, KRN_LINEAR_PANEL_TASK_ROWS) < 4 * threads) return KRN_PANEL_ROWS;
    return KRN_LINEAR_PANEL_TASK_ROWS;
}

/* The pool's shared scratch for x packed for the panels and each worker's panel buffer (into
 * scratch[]); NULL when memory runs out. */
static void *panel_scratch(krn_pool *p, krn_panel_kind kind, int n, int in, void **scratch) {
    int threads = krn_pool_size(p);
    void *xp =
        threads <= 1024 ? krn_pool_scratch(p, threads, krn_panel_x_bytes(kind, n, in)) : NULL;
    for (int t = 0; xp && t < threads; t++)
        if (!(scratch[t] = krn_pool_scratch(p, t, krn_panel_w_bytes()))) xp = NULL;
    return xp;
}

static int linear_panel(krn_pool *p, linear_job *j) {
    size_t xb = krn_panel_x_bytes(j->kind, j->n, j->in), wb = krn_panel_w_bytes();
    void *own = NULL, *xp = NULL;
    if (p) {
        xp = panel_scratch(p, j->kind, j->n, j->in, j->scratch);
    } else if ((own = aligned_alloc(64, round64(xb) + round64(wb)))) {
        xp = own;
        j->scratch[0] = (char *)own + round64(xb);
    }
    if (!xp) return -1;
    krn_panel_pack_x(p, j->kind, j->x, j->n, j->in, xp);
    j->xp = xp;
    j->rows_per_task = panel_task_rows(j->out, krn_pool_size(p));
    krn_pool_run_ex(p, task_panel, j, div_up(j->out, j->rows_per_task));
    free(own);
    return 0;
}

/* The paths that pack x once (AMX: bf16 hi/lo tiles; AVX512-BF16: x rounded to bf16), in the
 * pool's shared scratch or a malloc without a pool, then split the rows of W over the pool. -1
 * when memory for the packed x runs out (the caller takes another path). */
static int linear_packed(krn_pool *p, linear_job *j, int amx) {
    size_t bytes = amx ? krn_amx_pack_bytes(j->n, j->in) : krn_bf16dot_pack_bytes(j->n, j->in);
    void *own = NULL;
    void *xp = p ? krn_pool_scratch(p, krn_pool_size(p), bytes)
                 : (own = aligned_alloc(64, (bytes + 63) / 64 * 64));
    if (!xp) return -1;
    if (amx)
        krn_amx_pack(p, j->x, j->n, j->in, xp);
    else
        krn_bf16dot_pack(p, j->x, j->n, j->in, xp);
    j->xp = xp;
    j->out16 = j->out / 16 * 16;
    j->rows_per_task = amx ? KRN_LINEAR_AMX_ROWS : KRN_LINEAR_DOT_ROWS;
    krn_pool_run_ex(p, amx ? task_amx : task_dot, j, div_up(j->out, j->rows_per_task));
    free(own);
    return 0;
}

/* The paths that pack x once per call, in the order krn_cpu_linear tries them; PATH_NONE: the
 * f32, GEMV and tile paths. */
typedef enum linear_path { PATH_NONE, PATH_AMX, PATH_DOT, PATH_PANEL } linear_path;

static linear_path packed_path(krn_dtype wt, int n, int in, int out) {
    if (wt == KRN_BF16 && n >= KRN_LINEAR_AMX_MIN_N && in % 32 == 0 && out >= 16 &&
        krn_cpu_amx_active())
        return PATH_AMX;
    if (wt == KRN_BF16 && n >= KRN_LINEAR_DOT_MIN_N && n <= KRN_LINEAR_GEMV_MAX_N &&
        krn_cpu_bf16dot_active())
        return PATH_DOT;
    int min_n = wt == KRN_F16 ? KRN_LINEAR_PANEL_MIN_N_F16 : KRN_LINEAR_PANEL_MIN_N;
    if (wt != KRN_F32 && n >= min_n && n <= KRN_LINEAR_PANEL_MAX_N && krn_panel_on())
        return PATH_PANEL;
    return PATH_NONE;
}

static void linear_wpack(krn_pool *p, const float *x, int n, int in, const krn_linear_out *outs,
                         int count);

void krn_cpu_linear(krn_pool *p, const float *x, int n, int in, const void *w, krn_dtype wt,
                    int out, float *y) {
    if (n <= 0 || out <= 0) return;
    if (in <= 0) {
        memset(y, 0, (size_t)n * (size_t)out * sizeof *y);
        return;
    }
    if (wt == KRN_BF16_PANEL) {
        krn_linear_out one = {.w = w, .out = out, .y = y};
        linear_wpack(p, x, n, in, &one, 1);
        return;
    }
    pthread_once(&g_blas_once, blas_single_thread);
    int threads = krn_pool_size(p);
    linear_job j = {.x = x, .n = n, .in = in, .out = out, .w = w, .wt = wt, .y = y};

    if (wt == KRN_F32 && n <= KRN_LINEAR_F32_GEMV_MAX_N && krn_simd_level() == KRN_SIMD_AVX512) {
        linear_gemv(p, &j, threads);
        return;
    }
    if (wt == KRN_F32) {
        /* one block of columns per worker, a multiple of 16 rows of W */
        j.rows_per_task = (div_up(out, threads) + 15) / 16 * 16;
        krn_pool_run(p, task_f32, &j, div_up(out, j.rows_per_task));
        return;
    }

    /* out of memory for packing: the paths below need none (or fall back themselves) */
    switch (packed_path(wt, n, in, out)) {
    case PATH_AMX:
        if (linear_packed(p, &j, 1) == 0) return;
        break;
    case PATH_DOT:
        if (krn_bf16dot_panel()) {
            j.kind = KRN_PANEL_DOT;
            if (linear_panel(p, &j) == 0) return;
        } else if (linear_packed(p, &j, 0) == 0) {
            return;
        }
        break;
    case PATH_PANEL:
        if (linear_panel(p, &j) == 0) return;
        break;
    case PATH_NONE: break;
    }

    if (n > KRN_LINEAR_GEMV_MAX_N && threads <= 1024) {
        int rows = KRN_LINEAR_TILE_ROWS, tk = KRN_LINEAR_TILE_K;
        if (tk > in) tk = in;
        /* no more rows per tile than an even split gives each worker */
        int even = (div_up(out, threads) + 15) / 16 * 16;
        if (rows > even) rows = even;
        j.tile_k = tk;
        size_t bytes = (size_t)rows * (size_t)tk * sizeof(float);
        krn_pool *own = NULL;
        krn_pool *use = p;
        if (!use) use = own = krn_pool_create(1);
        int ok = use != NULL;
        for (int t = 0; ok && t < threads; t++)
            ok = (j.scratch[t] = krn_pool_scratch(use, t, bytes)) != NULL;
        if (ok) {
            j.rows_per_task = rows;
            krn_pool_run_ex(use, task_tile, &j, div_up(out, rows));
        }
        krn_pool_destroy(own);
        if (ok) return;
        /* out of memory for tiles: the GEMV path needs none */
    }

    linear_gemv(p, &j, threads);
}

/* Up to this many weights share one packed x (the engine's most: q, k, v). */
#define KRN_LINEAR_MULTI_MAX 4

typedef struct multi_job {
    krn_task_ex_fn fn; /* task_amx, task_dot or task_panel */
    linear_job j[KRN_LINEAR_MULTI_MAX];
    int first[KRN_LINEAR_MULTI_MAX + 1]; /* tasks of weight i: [first[i], first[i + 1]) */
    int count;
} multi_job;

static void task_multi(void *arg, int task, int n_tasks, int worker) {
    const multi_job *m = arg;
    int i = 0;
    while (task >= m->first[i + 1]) i++;
    m->fn((void *)&m->j[i], task - m->first[i], n_tasks, worker);
}

/* ---- W packed once (KRN_BF16_PANEL) --------------------------------------------------------- */

static void task_wpack(void *arg, int task, int n_tasks, int worker) {
    (void)n_tasks, (void)worker;
    const linear_job *j = arg;
    int o0, o1;
    task_rows(j, task, &o0, &o1);
    krn_wpack_rows(j->kind, j->xp, j->x, j->n, j->in, j->w, o0, o1, j->y, j->out);
}

/* Rows [0, n) of x (n <= KRN_LINEAR_WPACK_CHUNK_N) against up to KRN_LINEAR_MULTI_MAX packed
 * weights: on the avx512 path x is packed once into row tiles (bf16 pairs while AVX512-BF16
 * takes these rows, else f32), then the panels of every W are the tasks of one pool run (rows
 * of W per task: up to KRN_WPACK_GEMV_MAX_N rows of x the 2-4 panels the GEMV reads at once,
 * else as the per-call panels). Without memory for packed x (or off avx512) the kernels read x
 * as it is, exactly. */
static void wpack_chunk(krn_pool *p, const float *x, int n, int in, const krn_linear_out *outs,
                        int count) {
    krn_panel_kind kind = n >= KRN_LINEAR_DOT_MIN_N && n <= KRN_LINEAR_GEMV_MAX_N &&
                                  krn_cpu_bf16dot_active()
                              ? KRN_PANEL_DOT
                              : KRN_PANEL_F32;
    void *own = NULL, *xp = NULL;
    if (krn_simd_level() == KRN_SIMD_AVX512) {
        size_t bytes = krn_panel_x_bytes(kind, n, in);
        xp = p ? krn_pool_scratch(p, krn_pool_size(p), bytes)
               : (own = aligned_alloc(64, round64(bytes)));
        if (xp) krn_panel_pack_x(p, kind, x, n, in, xp);
    }
    if (!xp) kind = KRN_PANEL_F32;
    multi_job m = {.count = count, .fn = task_wpack};
    m.first[0] = 0;
    for (int i = 0; i < count; i++) {
        linear_job *j = &m.j[i];
        j->x = x, j->n = n, j->in = in, j->out = outs[i].out, j->w = outs[i].w;
        j->wt = KRN_BF16_PANEL, j->y = outs[i].y, j->xp = xp, j->kind = kind;
        j->rows_per_task = n <= KRN_WPACK_GEMV_MAX_N ? KRN_PANEL_ROWS * krn_wpack_gemv_panels(n)
                                                     : panel_task_rows(j->out, krn_pool_size(p));
        m.first[i + 1] = m.first[i] + div_up(j->out, j->rows_per_task);
    }
    krn_pool_run_ex(p, task_multi, &m, m.first[count]);
    free(own);
}

static void task_amx_wpack(void *arg, int task, int n_tasks, int worker) {
    (void)n_tasks, (void)worker;
    const linear_job *j = arg;
    int o0, o1;
    task_rows(j, task, &o0, &o1);
    krn_amx_wpack_rows(j->xp, j->n, j->in, j->w, o0, o1, j->y, j->out);
}

/* Packed weights on AMX (krn_amx.c), all n rows at once (no chunks: W's panels are read once
 * per 16 rows of x either way): x packed once as "A" tiles, then blocks of
 * KRN_LINEAR_AMX_ROWS outputs of up to KRN_LINEAR_MULTI_MAX weights per pool run. -1 when
 * memory for packed x runs out (the caller takes the panel kernels). */
static int amx_wpack(krn_pool *p, const float *x, int n, int in, const krn_linear_out *outs,
                     int count) {
    size_t bytes = krn_amx_wpack_x_bytes(n, in);
    void *own = NULL;
    void *xa = p ? krn_pool_scratch(p, krn_pool_size(p), bytes)
                 : (own = aligned_alloc(64, round64(bytes)));
    if (!xa) return -1;
    krn_amx_wpack_x(p, x, n, in, xa);
    for (int i = 0; i < count;) {
        multi_job m = {.fn = task_amx_wpack};
        m.first[0] = 0;
        for (; i < count && m.count < KRN_LINEAR_MULTI_MAX; i++) {
            if (outs[i].out <= 0) continue;
            linear_job *j = &m.j[m.count];
            j->x = x, j->n = n, j->in = in, j->out = outs[i].out, j->w = outs[i].w;
            j->wt = KRN_BF16_PANEL, j->y = outs[i].y, j->xp = xa;
            j->rows_per_task = KRN_LINEAR_AMX_ROWS;
            m.first[m.count + 1] = m.first[m.count] + div_up(j->out, j->rows_per_task);
            m.count++;
        }
        if (m.count > 0) krn_pool_run_ex(p, task_multi, &m, m.first[m.count]);
    }
    free(own);
    return 0;
}

/* Packed weights, any n: chunks of KRN_LINEAR_WPACK_CHUNK_N rows of x (a row's result does not
 * depend on the chunking), at most KRN_LINEAR_MULTI_MAX weights per pool run. */
static void linear_wpack(krn_pool *p, const float *x, int n, int in, const krn_linear_out *outs,
                         int count) {
    if (n >= KRN_LINEAR_AMX_MIN_N && krn_cpu_amx_active() &&
        amx_wpack(p, x, n, in, outs, count) == 0)
        return;
    krn_linear_out part[KRN_LINEAR_MULTI_MAX];
    for (int r0 = 0; r0 < n; r0 += KRN_LINEAR_WPACK_CHUNK_N) {
        int rows = n - r0 < KRN_LINEAR_WPACK_CHUNK_N ? n - r0 : KRN_LINEAR_WPACK_CHUNK_N;
        for (int i = 0; i < count;) {
            int c = 0;
            for (; i < count && c < KRN_LINEAR_MULTI_MAX; i++) {
                if (outs[i].out <= 0) continue;
                part[c] = outs[i];
                part[c++].y = outs[i].y + (size_t)r0 * (size_t)outs[i].out;
            }
            if (c > 0) wpack_chunk(p, x + (size_t)r0 * (size_t)in, rows, in, part, c);
        }
    }
}

void krn_cpu_linear_multi(krn_pool *p, const float *x, int n, int in, krn_dtype wt,
                          const krn_linear_out *outs, int count) {
    if (wt == KRN_BF16_PANEL) {
        if (n > 0 && in > 0) linear_wpack(p, x, n, in, outs, count);
        for (int i = 0; in <= 0 && n > 0 && i < count; i++)
            if (outs[i].out > 0)
                memset(outs[i].y, 0, (size_t)n * (size_t)outs[i].out * sizeof(float));
        return;
    }
    /* one shared run only where every weight would take the same packing path alone */
    linear_path path = n > 0 && in > 0 && count > 0 && count <= KRN_LINEAR_MULTI_MAX
                           ? packed_path(wt, n, in, outs[0].out)
                           : PATH_NONE;
    for (int i = 0; i < count && path != PATH_NONE; i++)
        if (outs[i].out <= 0 || packed_path(wt, n, in, outs[i].out) != path) path = PATH_NONE;
    int amx = path == PATH_AMX, dot = path == PATH_DOT, panel = path == PATH_PANEL;
    void *xp = NULL;
    krn_panel_kind kind = KRN_PANEL_F32;
    if (dot && krn_bf16dot_panel()) /* the AVX512-BF16 path's panel variant */
        kind = KRN_PANEL_DOT, panel = 1, dot = 0;
    multi_job m = {.count = count, .fn = amx ? task_amx : dot ? task_dot : task_panel};
    if ((amx || dot) && p) {
        size_t bytes = amx ? krn_amx_pack_bytes(n, in) : krn_bf16dot_pack_bytes(n, in);
        xp = krn_pool_scratch(p, krn_pool_size(p), bytes);
    } else if (panel && p) {
        xp = panel_scratch(p, kind, n, in, m.j[0].scratch);
    }
    if (!xp) { /* not on AMX, bf16 dot or panels (or no pool, or no scratch): separate calls */
        for (int i = 0; i < count; i++)
            krn_cpu_linear(p, x, n, in, outs[i].w, wt, outs[i].out, outs[i].y);
        return;
    }
    pthread_once(&g_blas_once, blas_single_thread);
    if (amx)
        krn_amx_pack(p, x, n, in, xp);
    else if (dot)
        krn_bf16dot_pack(p, x, n, in, xp);
    else
        krn_panel_pack_x(p, kind, x, n, in, xp);
    m.first[0] = 0;
    for (int i = 0; i < count; i++) {
        linear_job *j = &m.j[i];
        j->x = x, j->n = n, j->in = in, j->out = outs[i].out, j->w = outs[i].w, j->wt = wt;
        j->y = outs[i].y, j->xp = xp, j->out16 = j->out / 16 * 16, j->kind = kind;
        j->rows_per_task = amx   ? KRN_LINEAR_AMX_ROWS
                           : dot ? KRN_LINEAR_DOT_ROWS
                                 : panel_task_rows(j->out, krn_pool_size(p));
        if (panel && i > 0)
            memcpy(j->scratch, m.j[0].scratch, (size_t)krn_pool_size(p) * sizeof *j->scratch);
        m.first[i + 1] = m.first[i] + div_up(j->out, j->rows_per_task);
    }
    krn_pool_run_ex(p, task_multi, &m, m.first[count]);
}

void krn_cvt_f32(const void *src, krn_dtype wt, size_t n, float *dst) {
    if (wt == KRN_F32)
        memmove(dst, src, n * sizeof *dst);
    else
        convert_range(src, wt, n, dst);
}
