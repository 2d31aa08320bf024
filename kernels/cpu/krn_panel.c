/* krn_panel.c — bf16/f16 weights × f32 x for a few to a few hundred rows of x (batched decode,
 * short prefills) without AMX: the packed-panel form of a GEMM, exact f32 arithmetic; and the
 * same panels of bf16 pairs for the AVX512-BF16 path's VDPBF16PS (its precision: x rounded to
 * bf16; the variant PIE_KRN_BF16DOT=panel selects, krn_bf16dot.c).
 *
 * Owns: the PIE_KRN_PANEL switch and krn_cpu_set_panel, packing x into row tiles (f32, or
 * rounded to bf16 pairs), packing a panel of W (f32, or bf16 pairs), the register
 * micro-kernels, and the loop over a panel's column blocks; and bf16 W packed once for good
 * (krn_wpack_bf16, KRN_BF16_PANEL: the dot panels' pairs for the whole matrix, read by a
 * variant of the exact micro-kernel, the dot micro-kernel as it is, a GEMV over several panels
 * for up to 12 rows of x, avx2 and portable versions, and the row gather of the embedding).
 * Does not own: when the path is used nor the threads (krn_linear.c splits panels over the
 * pool and gives each worker its panel buffer), nor whether AVX512-BF16 is on (krn_bf16dot.c).
 *
 * Why: the GEMV tiles of krn_linear.c (4 rows of W × 6 rows of x, lanes over k, reduced at the
 * end) read 6 lines of x from L2 for every 24 FMAs and run at 48-63 GMAC/s per core on the
 * Xeon, 40-55% of its f32 FMA peak. Here a vector holds 16 *outputs* at one k, so no lanes are
 * reduced and a loaded weight vector feeds one FMA per row of x, with x[r][k] broadcast from
 * a small packed tile that stays in L1.
 *
 * Layouts:
 *   x  tiles of R <= KRN_PANEL_MAX_R rows (n split evenly), one after another; tile rows
 *      [r0, r0 + R) hold x[r0 + i][k] at xp[r0 · k2 + k · R + i], k2 = in rounded up to even,
 *      the odd padding column zero. Packed once per call, read by every panel.
 *   W  a panel is KRN_PANEL_ROWS (32) rows of W, rows past `out` zero, packed KRN_PANEL_KC
 *      columns at a time into a block of f32 (exact: bf16 by a shift, f16 by vcvtph2ps):
 *      per pair of columns (k, k + 1), 4 vectors: k for rows 0-15, rows 16-31, then k + 1.
 *      A bf16 row's 64-byte line is 16 (k, k + 1) pairs, so a 16 × 16 transpose of 32-bit
 *      elements puts 16 rows' pair in one vector; shifted left by 16 it is f32(w[k]), with
 *      its low half cleared f32(w[k + 1]).
 *   The micro-kernel keeps R × 2 vectors of y (R rows of x × 32 outputs) in registers over a
 *   block, starting from zero (first block) or from y, and stores them back (masked past
 *   `out`). While the first tile runs, the next block's rows of W are prefetched.
 *
 *   The dot panels: W pairs transposed the same way but not converted (128 bytes per pair),
 *   x rounded to bf16 pairs (x[k], x[k + 1]) per 32-bit element, broadcast as one: one
 *   VDPBF16PS per 16 outputs, row of x and pair.
 *
 * Accuracy: each y is Σ_k f32(w[o][k]) · x[r][k], every product exact inside an FMA and summed
 * in k order in f32 (one rounding per step): the order of the scalar reference path. The dot
 * panels sum Σ_k w[o][k] · bf16(x[r][k]) in the same order (VDPBF16PS adds the pair's two
 * exact products in turn). */
#include "krn_cpu_impl.h"

#include <pthread.h>
#include <stdatomic.h>
#include <math.h>
#include <stdlib.h>

#define KRN_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define KRN_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KRN_TARGET_BF16DOT \
    __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define KRN_INLINE static inline __attribute__((always_inline))
#define KRN_UNROLL _Pragma("GCC unroll 16")
/* How far ahead of its loads the exact kernel on packed W prefetches (two blocks of a panel). */
#define KRN_WPACK_PF_BYTES 16384
/* ... and the GEMV on packed W (n <= 3), per stream. */
#define KRN_WPACK_GEMV_PF_BYTES 2048

/* Global on purpose, as krn_amx.c's switch: set once from the environment, changed only by
 * krn_cpu_set_panel between kernel calls (tests, benchmarks). */
static pthread_once_t g_panel_once = PTHREAD_ONCE_INIT;
static atomic_int g_panel_on;

static void panel_init(void) {
    const char *env = getenv("PIE_KRN_PANEL");
    atomic_store(&g_panel_on, !(env && env[0] == '0'));
}

int krn_panel_on(void) {
    pthread_once(&g_panel_once, panel_init);
    return atomic_load_explicit(&g_panel_on, memory_order_relaxed) &&
           krn_simd_level() == KRN_SIMD_AVX512;
}

void krn_cpu_set_panel(int on) {
    pthread_once(&g_panel_once, panel_init);
    atomic_store(&g_panel_on, on ? 1 : 0);
}

static size_t in_even(int in) { return ((size_t)in + 1) / 2 * 2; }

/* f32 x, or bf16 x (two per 32-bit pair) for the dot panels */
static size_t x_elt(krn_panel_kind kind) { return kind == KRN_PANEL_DOT ? 2 : 4; }

size_t krn_panel_x_bytes(krn_panel_kind kind, int n, int in) {
    return (size_t)n * in_even(in) * x_elt(kind);
}

/* One block of a panel: KRN_PANEL_KC columns of 32 rows in f32 (the dot panels' bf16 pairs
 * take half), whatever the shape. */
size_t krn_panel_w_bytes(void) { return (size_t)KRN_PANEL_ROWS * KRN_PANEL_KC * sizeof(float); }

int krn_panel_tiles(int n) { return (n + KRN_PANEL_MAX_R - 1) / KRN_PANEL_MAX_R; }

/* Tile t of the krn_panel_tiles(n) near-equal tiles of n rows: its first row and row count. */
static void tile_rows(int n, int t, int *r0, int *rows) {
    int tiles = krn_panel_tiles(n);
    int base = n / tiles, extra = n % tiles;
    *rows = base + (t < extra);
    *r0 = t * base + (t < extra ? t : extra);
}

typedef struct pack_x_job {
    const float *x;
    int n, in;
    void *xp;
} pack_x_job;

/* Tile `task` of x into its [k2][R] block (portable C: about n · in floats per call, against
 * n · in · out multiply-adds). */
static void pack_x_tile(void *arg, int task, int n_tasks) {
    (void)n_tasks;
    const pack_x_job *j = arg;
    int r0, rows;
    tile_rows(j->n, task, &r0, &rows);
    size_t k2 = in_even(j->in);
    float *dst = (float *)j->xp + (size_t)r0 * k2;
    const float *src = j->x + (size_t)r0 * (size_t)j->in;
    for (int k = 0; k < j->in; k++) /* writes in order, reads `rows` streams */
        for (int i = 0; i < rows; i++) *dst++ = src[(size_t)i * (size_t)j->in + (size_t)k];
    if ((size_t)j->in < k2)
        for (int i = 0; i < rows; i++) *dst++ = 0.0f;
}

#if KRN_X86
/* Tile `task` of x rounded to bf16 (VCVTNE2PS2BF16: nearest even, subnormals to zero, as the
 * AVX512-BF16 tiles of krn_bf16dot.c round it) into its [k2 / 2][R] block of 32-bit pairs
 * (x[k], x[k + 1]), the odd padding column zero. */
KRN_TARGET_BF16DOT static void pack_x_tile_dot(void *arg, int task, int n_tasks) {
    (void)n_tasks;
    const pack_x_job *j = arg;
    int r0, rows;
    tile_rows(j->n, task, &r0, &rows);
    size_t pairs = in_even(j->in) / 2;
    uint32_t *dst = (uint32_t *)(void *)j->xp + (size_t)r0 * pairs;
    for (int i = 0; i < rows; i++) {
        const float *src = j->x + (size_t)(r0 + i) * (size_t)j->in;
        for (int k = 0; k < j->in; k += 32) {
            uint32_t pair[16]; /* low half x[k + 2j], high half x[k + 2j + 1] */
            _mm512_storeu_si512((void *)pair, krn_bf16x32_of(src + k, j->in - k));
            for (size_t q = (size_t)k / 2, e = 0; e < 16 && q < pairs; q++, e++)
                dst[q * (size_t)rows + (size_t)i] = pair[e];
        }
    }
}
#else
static void pack_x_tile_dot(void *arg, int task, int n_tasks) {
    (void)arg, (void)task, (void)n_tasks;
    abort(); /* unreachable: the dot panels need AVX512-BF16 */
}
#endif

void krn_panel_pack_x(krn_pool *p, krn_panel_kind kind, const float *x, int n, int in, void *xp) {
    pack_x_job j = {.x = x, .n = n, .in = in, .xp = xp};
    krn_pool_run(p, kind == KRN_PANEL_DOT ? pack_x_tile_dot : pack_x_tile, &j, krn_panel_tiles(n));
}

#if KRN_X86
/* v[i] = row i of a 16 × 16 matrix of 32-bit elements → v[j] = column j. Four rounds of 16
 * shuffles: pairs of rows by 32-bit, then 64-bit unpacks (giving 4 × 4 blocks in each 128-bit
 * lane), then two rounds of 128-bit lane exchanges. */
KRN_TARGET_AVX512 KRN_INLINE void transpose16(__m512i v[16]) {
    __m512i t[16];
    KRN_UNROLL for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
    }
    /* u[4g + c]: in each 128-bit lane L, column 4L + c of rows 4g..4g+3 */
    __m512i u[16];
    KRN_UNROLL for (int g = 0; g < 4; g++) {
        u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    KRN_UNROLL for (int c = 0; c < 4; c++) {
        __m512i lo01 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);      /* lanes 0,1 of g 0,1 */
        __m512i hi01 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xee);      /* lanes 2,3 of g 0,1 */
        __m512i lo23 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44); /* lanes 0,1 of g 2,3 */
        __m512i hi23 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xee);
        v[c] = _mm512_shuffle_i32x4(lo01, lo23, 0x88);      /* lane 0 of g 0..3 */
        v[4 + c] = _mm512_shuffle_i32x4(lo01, lo23, 0xdd);  /* lane 1 */
        v[8 + c] = _mm512_shuffle_i32x4(hi01, hi23, 0x88);  /* lane 2 */
        v[12 + c] = _mm512_shuffle_i32x4(hi01, hi23, 0xdd); /* lane 3 */
    }
}

/* Rows [16h, 16h + 16) of bf16 W (zero past `rows`), columns [k, k + 32) ∩ [0, in),
 * transposed: v[q] holds pair q (columns k + 2q, k + 2q + 1) of the 16 rows, one row per
 * 32-bit lane. A row's 64 bytes are already 16 (k, k + 1) pairs, so one 16 × 16 transpose of
 * 32-bit elements does it. */
KRN_TARGET_AVX512 KRN_INLINE void load_pairs(const uint16_t *w, size_t ldw, int rows, int h, int k,
                                             int in, __m512i v[16]) {
    __mmask32 m = in - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (in - k)) - 1u);
    KRN_UNROLL for (int i = 0; i < 16; i++) {
        int o = 16 * h + i;
        v[i] = o < rows ? _mm512_maskz_loadu_epi16(m, w + (size_t)o * ldw + (size_t)k)
                        : _mm512_setzero_si512();
    }
    transpose16(v);
}

/* Columns [k, k + 32) ∩ [0, in) of rows [0, rows) of bf16 W into pairs k/2 .. k/2 + 15 of the
 * panel block `dst` (f32, 64 floats per pair): a pair's lane shifted left by 16 is f32(w[k]),
 * with its low half cleared f32(w[k + 1]). */
KRN_TARGET_AVX512 KRN_INLINE void pack_bf16_32(const uint16_t *w, size_t ldw, int rows, int k,
                                               int in, float *dst) {
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    for (int h = 0; h < 2; h++) {
        __m512i v[16];
        load_pairs(w, ldw, rows, h, k, in, v);
        KRN_UNROLL for (int q = 0; q < 16; q++) {
            float *d = dst + (size_t)q * 64 + (size_t)h * 16;
            _mm512_store_si512((void *)d, _mm512_slli_epi32(v[q], 16));
            _mm512_store_si512((void *)(d + 32), _mm512_and_si512(v[q], hi));
        }
    }
}

/* The same for f16 W, 16 columns at a time (vcvtph2ps, exact): column k + i goes to pair i / 2,
 * vector i % 2 (rows 0-15 at +0, rows 16-31 at +16, k + 1 at +32). */
KRN_TARGET_AVX512 KRN_INLINE void pack_f16_16(const uint16_t *w, size_t ldw, int rows, int k,
                                              int in, float *dst) {
    __mmask16 m = krn_mask16(in - k);
    for (int h = 0; h < 2; h++) {
        __m512i v[16];
        KRN_UNROLL for (int i = 0; i < 16; i++) {
            int o = 16 * h + i;
            __m256i hv = o < rows ? _mm256_maskz_loadu_epi16(m, w + (size_t)o * ldw + (size_t)k)
                                  : _mm256_setzero_si256();
            v[i] = _mm512_castps_si512(_mm512_cvtph_ps(hv));
        }
        transpose16(v);
        KRN_UNROLL for (int i = 0; i < 16; i++) {
            float *d = dst + (size_t)(i / 2) * 64 + (size_t)(i % 2) * 32 + (size_t)h * 16;
            _mm512_store_si512((void *)d, v[i]);
        }
    }
}

/* For the dot panels: the pairs as they are (what VDPBF16PS multiplies), pair q's two vectors
 * (rows 0-15, 16-31) at dst + 32 q. */
KRN_TARGET_AVX512 KRN_INLINE void pack_pairs_32(const uint16_t *w, size_t ldw, int rows, int k,
                                                int in, uint32_t *dst) {
    for (int h = 0; h < 2; h++) {
        __m512i v[16];
        load_pairs(w, ldw, rows, h, k, in, v);
        KRN_UNROLL for (int q = 0; q < 16; q++) {
            _mm512_store_si512((void *)(dst + (size_t)q * 32 + (size_t)h * 16), v[q]);
        }
    }
}

/* Columns [k0, k0 + kc) of the panel's rows into the block buffer (pairs from 0). */
KRN_TARGET_AVX512 static void pack_block(krn_panel_kind kind, const uint16_t *w, krn_dtype wt,
                                         int in, int rows, int k0, int kc, void *dst) {
    size_t ldw = (size_t)in;
    int k1 = k0 + kc < in ? k0 + kc : in;
    if (kind == KRN_PANEL_DOT)
        for (int k = k0; k < k1; k += 32)
            pack_pairs_32(w, ldw, rows, k, k1, (uint32_t *)dst + (k - k0) * 16);
    else if (wt == KRN_BF16)
        for (int k = k0; k < k1; k += 32)
            pack_bf16_32(w, ldw, rows, k, k1, (float *)dst + (k - k0) * 32);
    else
        for (int k = k0; k < k1; k += 16)
            pack_f16_16(w, ldw, rows, k, k1, (float *)dst + (k - k0) * 32);
}

/* The rows of W the next block will read: row q of it is prefetched (`lines` cache lines from
 * its first column) in step q of a micro-kernel run. The block takes about as long to
 * multiply as its lines take to arrive from DRAM at n >= ~8; without this, packing waits for
 * memory while the FMA units idle (one thread, W from DRAM: 9-19% more time at n = 8-32;
 * prefetching into L2 instead of L1 was no different). */
typedef struct pf_rows {
    const char *first; /* row 0's first column of the block */
    size_t ld;         /* bytes from row to row */
    int rows, lines;
} pf_rows;

/* Step q of a micro-kernel run: row q of the next block (if it has one) towards L1. */
KRN_TARGET_AVX512 KRN_INLINE void prefetch_step(const pf_rows *pf, int q) {
    if (q < pf->rows)
        for (int l = 0; l < pf->lines; l++)
            _mm_prefetch(pf->first + (size_t)q * pf->ld + (size_t)l * 64, _MM_HINT_T0);
}

/* The micro-kernels' accumulators at the start of a block: rows [0, R) of y (outputs masked by
 * m0, m1), or zero for the first block. Inlined with R constant, acc stays in registers. */
KRN_TARGET_AVX512 KRN_INLINE void acc_start(__m512 acc[][2], int R, int first, const float *y,
                                            size_t ldy, __mmask16 m0, __mmask16 m1) {
    KRN_UNROLL for (int r = 0; r < R; r++) {
        acc[r][0] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m0, y + (size_t)r * ldy);
        acc[r][1] =
            first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m1, y + (size_t)r * ldy + 16);
    }
}

/* ... and at its end: back into rows [0, R) of y, masked as they were loaded. */
KRN_TARGET_AVX512 KRN_INLINE void acc_store(__m512 acc[][2], int R, float *y, size_t ldy,
                                            __mmask16 m0, __mmask16 m1) {
    KRN_UNROLL for (int r = 0; r < R; r++) {
        _mm512_mask_storeu_ps(y + (size_t)r * ldy, m0, acc[r][0]);
        _mm512_mask_storeu_ps(y + (size_t)r * ldy + 16, m1, acc[r][1]);
    }
}

/* y[r][0, 32) (+)= the R rows of tile xt against `pairs` pairs of the panel block, k in order;
 * `first` starts from zero, otherwise from y (the earlier column blocks). m0/m1 mask outputs
 * past `out`. R is a compile-time constant after inlining. */
KRN_TARGET_AVX512 KRN_INLINE void micro(const float *panel, const float *xt, int R, int pairs,
                                        int first, float *y, size_t ldy, __mmask16 m0, __mmask16 m1,
                                        const pf_rows *pf) {
    __m512 acc[KRN_PANEL_MAX_R][2];
    acc_start(acc, R, first, y, ldy, m0, m1);
    for (int q = 0; q < pairs; q++) {
        const float *wq = panel + (size_t)q * 64;
        const float *xk = xt + (size_t)q * 2 * (size_t)R;
        prefetch_step(pf, q);
        /* column k, then k + 1: two weight vectors live at a time (24 accumulators + 2 + the
         * broadcasts fit the 32 registers; with all four GCC spilled one) */
        KRN_UNROLL for (int h = 0; h < 2; h++) {
            __m512 w0 = _mm512_load_ps(wq + 32 * h), w1 = _mm512_load_ps(wq + 32 * h + 16);
            KRN_UNROLL for (int r = 0; r < R; r++) {
                __m512 b = _mm512_set1_ps(xk[h * R + r]);
                acc[r][0] = _mm512_fmadd_ps(w0, b, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(w1, b, acc[r][1]);
            }
        }
    }
    acc_store(acc, R, y, ldy, m0, m1);
}

#define KRN_PANEL_CASE(R) \
    case R: micro(panel, xt, R, pairs, first, y, ldy, m0, m1, pf); return

/* One instance of the micro-kernel per tile height (at most KRN_PANEL_MAX_R). */
KRN_TARGET_AVX512 static void micro_any(const float *panel, const float *xt, int R, int pairs,
                                        int first, float *y, size_t ldy, __mmask16 m0, __mmask16 m1,
                                        const pf_rows *pf) {
    switch (R) {
        KRN_PANEL_CASE(1);
        KRN_PANEL_CASE(2);
        KRN_PANEL_CASE(3);
        KRN_PANEL_CASE(4);
        KRN_PANEL_CASE(5);
        KRN_PANEL_CASE(6);
        KRN_PANEL_CASE(7);
        KRN_PANEL_CASE(8);
        KRN_PANEL_CASE(9);
        KRN_PANEL_CASE(10);
        KRN_PANEL_CASE(11);
        KRN_PANEL_CASE(12);
    default: return;
    }
}

/* The dot panels' micro-kernel: y[r][0, 32) (+)= Σ over `pairs` pairs of W (bf16 pairs) ·
 * x (bf16 pairs, tile xt), one VDPBF16PS per 16 outputs, row of x and pair: each lane adds
 * w[k] · x[k] and w[k + 1] · x[k + 1] (exact products) in turn, k in order. As micro(). */
KRN_TARGET_BF16DOT KRN_INLINE void micro_dot(const uint32_t *panel, const uint32_t *xt, int R,
                                             int pairs, int first, float *y, size_t ldy,
                                             __mmask16 m0, __mmask16 m1, const pf_rows *pf) {
    __m512 acc[KRN_PANEL_MAX_R][2];
    acc_start(acc, R, first, y, ldy, m0, m1);
    for (int q = 0; q < pairs; q++) {
        const uint32_t *wq = panel + (size_t)q * 32, *xq = xt + (size_t)q * (size_t)R;
        prefetch_step(pf, q);
        __m512bh w0 = (__m512bh)_mm512_load_si512((const void *)wq);
        __m512bh w1 = (__m512bh)_mm512_load_si512((const void *)(wq + 16));
        KRN_UNROLL for (int r = 0; r < R; r++) {
            __m512bh b = (__m512bh)_mm512_set1_epi32((int)xq[r]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], b, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], b, w1);
        }
    }
    acc_store(acc, R, y, ldy, m0, m1);
}

#define KRN_PANEL_DOT_CASE(R) \
    case R: micro_dot(panel, xt, R, pairs, first, y, ldy, m0, m1, pf); return

KRN_TARGET_BF16DOT static void micro_dot_any(const uint32_t *panel, const uint32_t *xt, int R,
                                             int pairs, int first, float *y, size_t ldy,
                                             __mmask16 m0, __mmask16 m1, const pf_rows *pf) {
    switch (R) {
        KRN_PANEL_DOT_CASE(1);
        KRN_PANEL_DOT_CASE(2);
        KRN_PANEL_DOT_CASE(3);
        KRN_PANEL_DOT_CASE(4);
        KRN_PANEL_DOT_CASE(5);
        KRN_PANEL_DOT_CASE(6);
        KRN_PANEL_DOT_CASE(7);
        KRN_PANEL_DOT_CASE(8);
        KRN_PANEL_DOT_CASE(9);
        KRN_PANEL_DOT_CASE(10);
        KRN_PANEL_DOT_CASE(11);
        KRN_PANEL_DOT_CASE(12);
    default: return;
    }
}

/* Columns [k0, k0 + KRN_PANEL_KC) ∩ [0, in) of `rows` rows of W at w. */
static pf_rows pf_block(const uint16_t *w, int in, int rows, int k0) {
    int k1 = k0 + KRN_PANEL_KC < in ? k0 + KRN_PANEL_KC : in;
    pf_rows pf = {.first = (const char *)(w + k0),
                  .ld = (size_t)in * 2,
                  .rows = rows,
                  .lines = (k1 - k0 + 31) / 32};
    return pf;
}

/* One panel (rows of W at w, rows <= 32) against every tile of x, KRN_PANEL_KC columns at a
 * time: the block of the panel and the matching k-slice of x stay in L1 while every tile runs
 * over them; y holds the sums between blocks. The first tile of each block prefetches the
 * next block: this panel's, or the first of the next panel (next_rows rows at next_w). */
KRN_TARGET_AVX512 static void panel_one(krn_panel_kind kind, const void *xp, int n, int in,
                                        const uint16_t *w, krn_dtype wt, int rows,
                                        const uint16_t *next_w, int next_rows, void *panel,
                                        float *y, size_t ldy) {
    __mmask16 m0 = krn_mask16(rows);
    __mmask16 m1 = krn_mask16(rows - 16);
    int tiles = krn_panel_tiles(n);
    size_t k2 = in_even(in);
    for (int k0 = 0; k0 < in; k0 += KRN_PANEL_KC) {
        int kc = in - k0 < KRN_PANEL_KC ? in - k0 : KRN_PANEL_KC;
        pack_block(kind, w, wt, in, rows, k0, kc, panel);
        pf_rows none = {.rows = 0};
        pf_rows pf = k0 + KRN_PANEL_KC < in ? pf_block(w, in, rows, k0 + KRN_PANEL_KC)
                                            : pf_block(next_w, in, next_rows, 0);
        for (int t = 0; t < tiles; t++) {
            int r0, rt;
            tile_rows(n, t, &r0, &rt);
            const void *xt =
                (const char *)xp + ((size_t)r0 * k2 + (size_t)k0 * (size_t)rt) * x_elt(kind);
            const pf_rows *tpf = t == 0 ? &pf : &none;
            if (kind == KRN_PANEL_DOT)
                micro_dot_any(panel, xt, rt, (kc + 1) / 2, k0 == 0, y + (size_t)r0 * ldy, ldy, m0,
                              m1, tpf);
            else
                micro_any(panel, xt, rt, (kc + 1) / 2, k0 == 0, y + (size_t)r0 * ldy, ldy, m0, m1,
                          tpf);
        }
    }
}

/* ---- W packed once (krn_wpack_bf16) -------------------------------------------------------- */

/* The exact micro-kernel on W packed once: as micro(), the pair's lanes converted on the fly
 * (rows 0-15 and 16-31 of pair q at blk + 32 q): shifted left by 16 they are f32(w[k]), with
 * the low halves masked off f32(w[k + 1]) — the same f32 weights, the same FMAs in the same
 * order, so the same bits as the panels packed per call. Both forms are read from the block
 * (in L1 after the first tile), so no pair vector stays live across the two columns. */
KRN_TARGET_AVX512 KRN_INLINE void micro_pk(const uint32_t *blk, const float *xt, int R, int pairs,
                                           int first, float *y, size_t ldy, __mmask16 m0,
                                           __mmask16 m1, const pf_rows *pf) {
    __m512 acc[KRN_PANEL_MAX_R][2];
    acc_start(acc, R, first, y, ldy, m0, m1);
    for (int q = 0; q < pairs; q++) {
        const uint32_t *wq = blk + (size_t)q * 32;
        const float *xk = xt + (size_t)q * 2 * (size_t)R;
        if (q < pf->rows) /* into L2: into L1 it was 7-20% slower at n = 1-4 (one stream) */
            for (int l = 0; l < pf->lines; l++)
                _mm_prefetch(pf->first + (size_t)q * pf->ld + (size_t)l * 64, _MM_HINT_T1);
        KRN_UNROLL for (int h = 0; h < 2; h++) {
            __m512 w0, w1;
            if (h == 0) {
                w0 = _mm512_castsi512_ps(
                    _mm512_slli_epi32(_mm512_load_si512((const void *)wq), 16));
                w1 = _mm512_castsi512_ps(
                    _mm512_slli_epi32(_mm512_load_si512((const void *)(wq + 16)), 16));
            } else { /* the odd 16-bit elements are the high halves */
                w0 = _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(0xaaaaaaaau, wq));
                w1 = _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(0xaaaaaaaau, wq + 16));
            }
            KRN_UNROLL for (int r = 0; r < R; r++) {
                __m512 b = _mm512_set1_ps(xk[h * R + r]);
                acc[r][0] = _mm512_fmadd_ps(w0, b, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(w1, b, acc[r][1]);
            }
        }
    }
    acc_store(acc, R, y, ldy, m0, m1);
}

#define KRN_PANEL_PK_CASE(R) \
    case R: micro_pk(blk, xt, R, pairs, first, y, ldy, m0, m1, pf); return

KRN_TARGET_AVX512 static void micro_pk_any(const uint32_t *blk, const float *xt, int R, int pairs,
                                           int first, float *y, size_t ldy, __mmask16 m0,
                                           __mmask16 m1, const pf_rows *pf) {
    switch (R) {
        KRN_PANEL_PK_CASE(1);
        KRN_PANEL_PK_CASE(2);
        KRN_PANEL_PK_CASE(3);
        KRN_PANEL_PK_CASE(4);
        KRN_PANEL_PK_CASE(5);
        KRN_PANEL_PK_CASE(6);
        KRN_PANEL_PK_CASE(7);
        KRN_PANEL_PK_CASE(8);
        KRN_PANEL_PK_CASE(9);
        KRN_PANEL_PK_CASE(10);
        KRN_PANEL_PK_CASE(11);
        KRN_PANEL_PK_CASE(12);
    default: return;
    }
}

/* One packed panel (`rows` valid rows, its pairs at pan) against every tile of x, as
 * panel_one() but with nothing to pack: block k0 is pairs [k0 / 2, k0 / 2 + 64) of the panel,
 * contiguous, and packed W is one stream (panel after panel): while the first tile runs, the
 * exact kernel prefetches KRN_WPACK_PF_BYTES ahead of its loads into L2, two lines per step
 * (one thread, W from DRAM, 2048 -> 8192: 8-20% less time at n = 1-4 and ~5% at 32 than one
 * block ahead into L1; the single stream without it reads W at ~10 GB/s, 32 rows at once
 * ~14); the dot kernel the next block into L1, as the per-call dot panels. */
KRN_TARGET_AVX512 static void panel_one_pk(krn_panel_kind kind, const void *xp, int n, int in,
                                           const uint32_t *pan, size_t stride, int rows, float *y,
                                           size_t ldy) {
    __mmask16 m0 = krn_mask16(rows);
    __mmask16 m1 = krn_mask16(rows - 16);
    int tiles = krn_panel_tiles(n);
    size_t k2 = in_even(in);
    for (int k0 = 0; k0 < in; k0 += KRN_PANEL_KC) {
        int kc = in - k0 < KRN_PANEL_KC ? in - k0 : KRN_PANEL_KC;
        const uint32_t *blk = pan + (size_t)k0 * 16;
        const uint32_t *next = k0 + KRN_PANEL_KC < in ? blk + KRN_PANEL_KC * 16 : pan + stride;
        const char *ahead = kind == KRN_PANEL_DOT ? (const char *)next
                                                  : (const char *)blk + KRN_WPACK_PF_BYTES;
        /* the block's 128 lines split over the tiles (a burst of 128 prefetches in the first
         * tile alone left the FMA units waiting for the loads at n = 32), one tile's share
         * spread over its steps */
        int share = (KRN_PANEL_KC / 2 * 2 + tiles - 1) / tiles;
        for (int t = 0; t < tiles; t++) {
            int r0, rt;
            tile_rows(n, t, &r0, &rt);
            const void *xt =
                (const char *)xp + ((size_t)r0 * k2 + (size_t)k0 * (size_t)rt) * x_elt(kind);
            pf_rows pf0 = {.first = ahead, .ld = 128, .rows = KRN_PANEL_KC / 2, .lines = 2};
            pf_rows pft = {.first = ahead + (size_t)t * (size_t)share * 64, .ld = 64,
                           .rows = share, .lines = 1};
            const pf_rows *tpf = share > KRN_PANEL_KC / 2 ? &pf0 : &pft;
            if (kind == KRN_PANEL_DOT)
                micro_dot_any(blk, xt, rt, (kc + 1) / 2, k0 == 0, y + (size_t)r0 * ldy, ldy, m0,
                              m1, tpf);
            else
                micro_pk_any(blk, xt, rt, (kc + 1) / 2, k0 == 0, y + (size_t)r0 * ldy, ldy, m0, m1,
                             tpf);
        }
    }
}

/* Rows [0, R) (R <= 6) of a tile of T rows of x (few rows: bound by reading W) against NP
 * panels at once, each from its own stream (one stream per core read W at ~10 GB/s, 4 streams
 * as fast as the 32 rows the per-call panels read), the whole of `in` in one pass: per panel
 * the FMAs of micro_pk in the same order (the same bits), x[r][k] broadcast from the packed
 * tile. NP (krn_wpack_gemv_panels): 4 up to 3 rows, 3 for 4, 2 for 5-6 (at most 24
 * accumulators); 7-12 rows take two passes over the same panels, the second from L2. Each
 * stream is prefetched KRN_WPACK_GEMV_PF_BYTES ahead into L2. One thread, W from DRAM: 8-20%
 * less time than the GEMV tiles at 1-4 rows, 2-18% less than the per-call panels at 5-12. */
KRN_TARGET_AVX512 KRN_INLINE void gemv_pk(const uint32_t *pan, size_t stride, int NP,
                                          const float *xt, int T, int R, int pairs, float *y,
                                          size_t ldy, const int *rows) {
    __m512 acc[6][8];
    KRN_UNROLL for (int r = 0; r < R; r++) {
        KRN_UNROLL for (int c = 0; c < 2 * NP; c++) { acc[r][c] = _mm512_setzero_ps(); }
    }
    for (int q = 0; q < pairs; q++) {
        const float *xk = xt + (size_t)q * 2 * (size_t)T;
        KRN_UNROLL for (int p = 0; p < NP; p++) {
            const char *ahead = (const char *)(pan + (size_t)p * stride + (size_t)q * 32);
            _mm_prefetch(ahead + KRN_WPACK_GEMV_PF_BYTES, _MM_HINT_T1);
            _mm_prefetch(ahead + KRN_WPACK_GEMV_PF_BYTES + 64, _MM_HINT_T1);
        }
        KRN_UNROLL for (int h = 0; h < 2; h++) {
            KRN_UNROLL for (int p = 0; p < NP; p++) {
                const uint32_t *wq = pan + (size_t)p * stride + (size_t)q * 32;
                __m512 w0, w1;
                if (h == 0) {
                    w0 = _mm512_castsi512_ps(
                        _mm512_slli_epi32(_mm512_load_si512((const void *)wq), 16));
                    w1 = _mm512_castsi512_ps(
                        _mm512_slli_epi32(_mm512_load_si512((const void *)(wq + 16)), 16));
                } else {
                    w0 = _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(0xaaaaaaaau, wq));
                    w1 = _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(0xaaaaaaaau, wq + 16));
                }
                KRN_UNROLL for (int r = 0; r < R; r++) {
                    __m512 b = _mm512_set1_ps(xk[h * T + r]);
                    acc[r][2 * p] = _mm512_fmadd_ps(w0, b, acc[r][2 * p]);
                    acc[r][2 * p + 1] = _mm512_fmadd_ps(w1, b, acc[r][2 * p + 1]);
                }
            }
        }
    }
    KRN_UNROLL for (int p = 0; p < NP; p++) {
        KRN_UNROLL for (int r = 0; r < R; r++) {
            float *yr = y + (size_t)r * ldy + (size_t)p * KRN_PANEL_ROWS;
            _mm512_mask_storeu_ps(yr, krn_mask16(rows[p]), acc[r][2 * p]);
            _mm512_mask_storeu_ps(yr + 16, krn_mask16(rows[p] - 16), acc[r][2 * p + 1]);
        }
    }
}

#define KRN_GEMV_PK_CASE(R)                                                        \
    case R:                                                                        \
        if (np == 4) gemv_pk(pan, stride, 4, xt, T, R, pairs, y, ldy, rows);       \
        else if (np == 3) gemv_pk(pan, stride, 3, xt, T, R, pairs, y, ldy, rows);  \
        else if (np == 2) gemv_pk(pan, stride, 2, xt, T, R, pairs, y, ldy, rows);  \
        else gemv_pk(pan, stride, 1, xt, T, R, pairs, y, ldy, rows);               \
        return

/* Rows [0, R) of a tile of T rows of x (xt: its row 0), R <= 6. */
KRN_TARGET_AVX512 static void gemv_pk_any(const uint32_t *pan, size_t stride, int np,
                                          const float *xt, int T, int R, int pairs, float *y,
                                          size_t ldy, const int *rows) {
    switch (R) {
        KRN_GEMV_PK_CASE(1);
        KRN_GEMV_PK_CASE(2);
        KRN_GEMV_PK_CASE(3);
        KRN_GEMV_PK_CASE(4);
        KRN_GEMV_PK_CASE(5);
        KRN_GEMV_PK_CASE(6);
    default: return;
    }
}

KRN_TARGET_AVX512 static void wpack_rows_avx512(krn_panel_kind kind, const void *xp, int n, int in,
                                                const uint32_t *wp, int o0, int o1, float *y,
                                                int out) {
    size_t stride = krn_wpack_panel_u32(in);
    if (n <= KRN_WPACK_GEMV_MAX_N && kind == KRN_PANEL_F32) {
        /* groups of krn_wpack_gemv_panels(n) panels, then one at a time */
        int pairs = (int)(in_even(in) / 2), g = krn_wpack_gemv_panels(n);
        for (int o = o0; o < o1;) {
            int np = o1 - o > (g - 1) * KRN_PANEL_ROWS ? g : 1, rows[4];
            for (int p = 0; p < np; p++) rows[p] = o1 - o - p * KRN_PANEL_ROWS;
            /* more than 6 rows: two passes over the panels, the second from L2 */
            for (int r0 = 0, half = n > 6 ? (n + 1) / 2 : n; r0 < n; r0 += half)
                gemv_pk_any(wp + (size_t)(o / KRN_PANEL_ROWS) * stride, stride, np,
                            (const float *)xp + r0, n, n - r0 < half ? n - r0 : half, pairs,
                            y + (size_t)r0 * (size_t)out + o, (size_t)out, rows);
            o += np * KRN_PANEL_ROWS;
        }
        return;
    }
    for (int o = o0; o < o1; o += KRN_PANEL_ROWS) {
        int rows = o1 - o < KRN_PANEL_ROWS ? o1 - o : KRN_PANEL_ROWS;
        panel_one_pk(kind, xp, n, in, wp + (size_t)(o / KRN_PANEL_ROWS) * stride, stride, rows,
                     y + o, (size_t)out);
    }
}

/* Panel `panel` of bf16 W into dst (krn_wpack_panel_u32(in) elements). */
KRN_TARGET_AVX512 static void wpack_panel_avx512(const uint16_t *w, int out, int in, int panel,
                                                 uint32_t *dst) {
    int o = panel * KRN_PANEL_ROWS;
    int rows = out - o < KRN_PANEL_ROWS ? out - o : KRN_PANEL_ROWS;
    for (int k = 0; k < in; k += 32)
        pack_pairs_32(w + (size_t)o * (size_t)in, (size_t)in, rows, k, in, dst + (size_t)k * 16);
}

/* The exact sums on packed W from x as it is (no packed x: the avx2 path, and the avx512 path
 * when there was no memory for packed x): 8 outputs per vector, up to 4 rows of x at a time,
 * the same FMAs in the same order as micro_pk. */
KRN_TARGET_AVX2 static void wpack_rows_avx2(const float *x, int n, int in, const uint32_t *wp,
                                            int o0, int o1, float *y, int out) {
    size_t stride = krn_wpack_panel_u32(in);
    int pairs = (int)(in_even(in) / 2);
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    for (int o = o0; o < o1; o += 8) { /* a group of 8 outputs: 8 lanes of one pair vector */
        const uint32_t *g = wp + (size_t)(o / KRN_PANEL_ROWS) * stride +
                            (size_t)(o % KRN_PANEL_ROWS / 16) * 16 + (size_t)(o % 16);
        int valid = o1 - o < 8 ? o1 - o : 8;
        for (int r0 = 0; r0 < n; r0 += 4) {
            int R = n - r0 < 4 ? n - r0 : 4;
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                             _mm256_setzero_ps()};
            for (int q = 0; q < pairs; q++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(g + (size_t)q * 32));
                __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
                for (int r = 0; r < R; r++) {
                    const float *xr = x + (size_t)(r0 + r) * (size_t)in;
                    float x1 = 2 * q + 1 < in ? xr[2 * q + 1] : 0.0f;
                    acc[r] = _mm256_fmadd_ps(w0, _mm256_set1_ps(xr[2 * q]), acc[r]);
                    acc[r] = _mm256_fmadd_ps(w1, _mm256_set1_ps(x1), acc[r]);
                }
            }
            for (int r = 0; r < R; r++) {
                float v[8];
                _mm256_storeu_ps(v, acc[r]);
                memcpy(y + (size_t)(r0 + r) * (size_t)out + (size_t)o, v, (size_t)valid * 4);
            }
        }
    }
}
KRN_TARGET_AVX512 void krn_panel_rows(krn_panel_kind kind, const void *xp, int n, int in,
                                      const uint16_t *w, krn_dtype wt, int o0, int o1, void *panel,
                                      float *y, int out) {
    for (int o = o0; o < o1; o += KRN_PANEL_ROWS) {
        int rows = o1 - o < KRN_PANEL_ROWS ? o1 - o : KRN_PANEL_ROWS;
        int next = o1 - o - rows < KRN_PANEL_ROWS ? o1 - o - rows : KRN_PANEL_ROWS;
        const uint16_t *wo = w + (size_t)o * (size_t)in;
        panel_one(kind, xp, n, in, wo, wt, rows, wo + (size_t)rows * (size_t)in, next, panel, y + o,
                  (size_t)out);
    }
}
#else
void krn_panel_rows(krn_panel_kind kind, const void *xp, int n, int in, const uint16_t *w,
                    krn_dtype wt, int o0, int o1, void *panel, float *y, int out) {
    (void)kind, (void)xp, (void)n, (void)in, (void)w, (void)wt, (void)o0, (void)o1, (void)panel;
    (void)y, (void)out;
    abort(); /* unreachable: krn_panel_on() is 0 off x86 */
}
#endif

/* ---- W packed once: the parts without AVX-512 ------------------------------------------- */

int krn_wpack_gemv_panels(int n) { return n >= 5 ? 2 : n == 4 ? 3 : 4; }

size_t krn_wpack_panel_u32(int in) {
    return (((size_t)in + 31) / 32 * 32 / 2) * KRN_PANEL_ROWS;
}

size_t krn_wpack_bytes(int out, int in) {
    if (out <= 0 || in <= 0) return 0;
    size_t panels = ((size_t)out + KRN_PANEL_ROWS - 1) / KRN_PANEL_ROWS;
    return panels * krn_wpack_panel_u32(in) * sizeof(uint32_t);
}

/* Element (o, k) of packed W, o < out rounded up to 32, k < in rounded up to 32 (zero past
 * in): the 16-bit half of pair k / 2 in row o's lane. */
static uint16_t wpack_at(const uint32_t *wp, int in, int o, int k) {
    const uint32_t *pan = wp + (size_t)(o / KRN_PANEL_ROWS) * krn_wpack_panel_u32(in);
    uint32_t u = pan[(size_t)(k / 2) * 32 + (size_t)(o % KRN_PANEL_ROWS)];
    return (uint16_t)(k % 2 ? u >> 16 : u & 0xffffu);
}

static void wpack_panel_scalar(const uint16_t *w, int out, int in, int panel, uint32_t *dst) {
    size_t pairs = krn_wpack_panel_u32(in) / KRN_PANEL_ROWS;
    for (size_t q = 0; q < pairs; q++)
        for (int i = 0; i < KRN_PANEL_ROWS; i++) {
            int o = panel * KRN_PANEL_ROWS + i, k = (int)q * 2;
            uint32_t lo = 0, hi = 0;
            if (o < out) {
                const uint16_t *row = w + (size_t)o * (size_t)in;
                lo = k < in ? row[k] : 0;
                hi = k + 1 < in ? row[k + 1] : 0;
            }
            dst[q * 32 + (size_t)i] = lo | hi << 16;
        }
}

typedef struct wpack_job {
    const uint16_t *w;
    int out, in;
    uint32_t *dst;
} wpack_job;

static void wpack_task(void *arg, int task, int n_tasks) {
    (void)n_tasks;
    const wpack_job *j = arg;
    uint32_t *dst = j->dst + (size_t)task * krn_wpack_panel_u32(j->in);
#if KRN_X86
    if (krn_simd_level() == KRN_SIMD_AVX512) {
        wpack_panel_avx512(j->w, j->out, j->in, task, dst);
        return;
    }
#endif
    wpack_panel_scalar(j->w, j->out, j->in, task, dst);
}

void krn_wpack_bf16(krn_pool *p, const uint16_t *w, int out, int in, void *dst) {
    if (out <= 0 || in <= 0) return;
    wpack_job j = {.w = w, .out = out, .in = in, .dst = dst};
    krn_pool_run(p, wpack_task, &j, (out + KRN_PANEL_ROWS - 1) / KRN_PANEL_ROWS);
}

void krn_wpack_row(const void *wp, int in, uint32_t row, float *dst) {
    for (int k = 0; k < in; k++) dst[k] = krn_bf16_to_f32(wpack_at(wp, in, (int)row, k));
}

/* The portable exact sums: per output and row of x, fmaf in k order, the padding column of
 * an odd `in` included (w = x = 0), as every packed path. */
static void wpack_rows_scalar(const float *x, int n, int in, const uint32_t *wp, int o0, int o1,
                              float *y, int out) {
    int k2 = (int)in_even(in);
    for (int o = o0; o < o1; o++)
        for (int r = 0; r < n; r++) {
            const float *xr = x + (size_t)r * (size_t)in;
            float acc = 0.0f;
            for (int k = 0; k < k2; k++)
                acc = fmaf(krn_bf16_to_f32(wpack_at(wp, in, o, k)), k < in ? xr[k] : 0.0f, acc);
            y[(size_t)r * (size_t)out + (size_t)o] = acc;
        }
}

void krn_wpack_rows(krn_panel_kind kind, const void *xp, const float *x, int n, int in,
                    const uint32_t *wp, int o0, int o1, float *y, int out) {
#if KRN_X86
    if (xp && krn_simd_level() == KRN_SIMD_AVX512) {
        wpack_rows_avx512(kind, xp, n, in, wp, o0, o1, y, out);
        return;
    }
    if (krn_simd_level() >= KRN_SIMD_AVX2) {
        wpack_rows_avx2(x, n, in, wp, o0, o1, y, out);
        return;
    }
#else
    (void)kind, (void)xp;
#endif
    wpack_rows_scalar(x, n, in, wp, o0, o1, y, out);
}
