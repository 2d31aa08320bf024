/* krn_cpu_impl.h — what the files of kernels/cpu share and nobody else sees.
 *
 * Owns: the SIMD level enum and the dispatcher's getter (krn_simd.c), the pool's internal run
 * variant that tells a task which worker runs it and the per-worker scratch memory
 * (krn_pool.c), exact scalar conversions of bf16/f16 to f32, and vector exp approximations
 * for AVX2 and AVX-512 (used by softmax, SiLU and attention).
 * Does not own: any public API (krn_cpu.h). */
#ifndef KRN_CPU_IMPL_H
#define KRN_CPU_IMPL_H

#include "krn_cpu.h"

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KRN_X86 1
#else
#define KRN_X86 0
#endif

/* ---- AVX-512 tail masks --------------------------------------------------------------------- */

#if KRN_X86
/* Lanes [0, min(left, 16)) of a 16-float vector; none when left <= 0. */
static inline __mmask16 krn_mask16(int left) {
    return left >= 16  ? (__mmask16)0xffff
           : left <= 0 ? (__mmask16)0
                       : (__mmask16)((1u << left) - 1u);
}
#endif

/* ---- x rounded to bf16 for the AVX512-BF16 kernels (krn_bf16dot.c, krn_panel.c) ---------- */

#if KRN_X86
/* x[0, min(left, 32)) as 32 bf16 (nearest even), zeros past left; bf16 lane j is x[j]. */
__attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl"))) static inline __m512i
krn_bf16x32_of(const float *x, int left) {
    __m512 a = _mm512_maskz_loadu_ps(krn_mask16(left), x),
           b = _mm512_maskz_loadu_ps(krn_mask16(left - 16), x + 16);
    return (__m512i)_mm512_cvtne2ps_pbh(b, a); /* the low half from the second operand */
}
#endif

/* ---- SIMD dispatch (krn_simd.c) ------------------------------------------------------------ */

typedef enum krn_simd { KRN_SIMD_SCALAR = 0, KRN_SIMD_AVX2 = 1, KRN_SIMD_AVX512 = 2 } krn_simd;

/* The path every kernel takes now: the best the CPU supports, or what PIE_KRN_SIMD /
 * krn_cpu_set_simd asked for. */
krn_simd krn_simd_level(void);

/* ---- AMX (krn_amx.c) ----------------------------------------------------------------------- */

/* Bytes of the packed form of x[n, in] (in a multiple of 32): bf16 "B" tiles of x's two
 * bf16 parts (hi, lo), rows padded to a multiple of 16. */
size_t krn_amx_pack_bytes(int n, int in);
/* Splits x[n, in] into bf16 parts and packs them into xp (krn_amx_pack_bytes bytes, 64-byte
 * aligned), across the pool. */
void krn_amx_pack(krn_pool *p, const float *x, int n, int in, void *xp);
/* y[r, o] = Σ_k w[o, k] · x[r, k] with x as packed, for o in [o0, o1), o1 - o0 a multiple of
 * 16, in a multiple of 32. Only when krn_cpu_amx_active(). */
void krn_amx_rows(const void *xp, int n, int in, const uint16_t *w, int o0, int o1, float *y,
                  int out);
/* W packed once (KRN_BF16_PANEL): bytes of x[n, in]'s two bf16 parts packed as AMX "A" tiles
 * (rows padded to 16, `in` to 32, zeros); packing them across the pool; and y[r, o] = Σ_k
 * w[o, k] · x[r, k] for o in [o0, o1), o0 a multiple of 32, any `in` and `out`, the bits of
 * krn_amx_rows on the same weights row-major. Only when krn_cpu_amx_active(). */
size_t krn_amx_wpack_x_bytes(int n, int in);
void krn_amx_wpack_x(krn_pool *p, const float *x, int n, int in, void *xa);
void krn_amx_wpack_rows(const void *xa, int n, int in, const uint32_t *wp, int o0, int o1, float *y,
                        int out);

/* ---- AVX512-BF16 dot products (krn_bf16dot.c) ---------------------------------------------- */

/* Bytes of x[n, in] rounded to bf16 and packed: n rows of `in` rounded up to 32, zero padded. */
size_t krn_bf16dot_pack_bytes(int n, int in);
/* Rounds x[n, in] to bf16 (nearest even) into xp (krn_bf16dot_pack_bytes bytes), across the
 * pool. */
void krn_bf16dot_pack(krn_pool *p, const float *x, int n, int in, void *xp);
/* y[r, o] = Σ_k w[o, k] · bf16(x[r, k]) with x as packed, for o in [o0, o1), f32 sums. Only when
 * krn_cpu_bf16dot_active(). */
void krn_bf16dot_rows(const void *xp, int n, int in, const uint16_t *w, int o0, int o1, float *y,
                      int out);
/* Whether the AVX512-BF16 path runs on the dot panels of krn_panel.c (KRN_PANEL_DOT) instead of
 * the tiles above: PIE_KRN_BF16DOT=panel or krn_cpu_set_bf16dot(2). */
int krn_bf16dot_panel(void);

/* ---- packed panels (krn_panel.c) ----------------------------------------------------------- */

/* Outputs (rows of W) per packed panel: two vectors of 16. */
#define KRN_PANEL_ROWS 32
/* Most rows of x in one register tile: 12 × 2 accumulators + 4 weight vectors of 32 zmm. */
#define KRN_PANEL_MAX_R 12
/* Columns of W per packed block of a panel: 32 rows × 128 in f32 (16 KiB) and the matching
 * slice of x (at most 32 rows, 16 KiB) fit the 48 KiB L1 together. A multiple of 32; 256 was
 * no faster and 512 10-25% slower (one thread, W from DRAM, n = 8-32). */
#define KRN_PANEL_KC 128

/* Whether the panel path may run: the SIMD path is avx512 and neither PIE_KRN_PANEL=0 (read
 * once) nor krn_cpu_set_panel(0) turned it off. krn_cpu_set_panel is for tests and benchmarks
 * (old against new on one machine); not to be called while kernels run. */
int krn_panel_on(void);
void krn_cpu_set_panel(int on);
/* What a panel multiplies: W converted exactly to f32 against f32 x (KRN_PANEL_F32, bf16 or
 * f16 W), or bf16 W pairs against x rounded to bf16 pairs by VDPBF16PS (KRN_PANEL_DOT, bf16 W,
 * only while krn_cpu_bf16dot_active(): the precision of krn_bf16dot.c). */
typedef enum krn_panel_kind { KRN_PANEL_F32 = 0, KRN_PANEL_DOT = 1 } krn_panel_kind;
/* Bytes of x[n, in] packed into row tiles; bytes of a worker's panel buffer (one block). */
size_t krn_panel_x_bytes(krn_panel_kind kind, int n, int in);
size_t krn_panel_w_bytes(void);
/* Row tiles x is cut into (the tasks of krn_panel_pack_x). */
int krn_panel_tiles(int n);
/* Packs x[n, in] into xp (krn_panel_x_bytes, 64-byte aligned), across the pool. */
void krn_panel_pack_x(krn_pool *p, krn_panel_kind kind, const float *x, int n, int in, void *xp);
/* y[r, o] = Σ_k w[o, k] · x[r, k] for o in [o0, o1), o0 a multiple of KRN_PANEL_ROWS, x as
 * packed for `kind`, f32 sums in k order; `panel` is this worker's buffer (krn_panel_w_bytes,
 * 64-byte aligned). Only when krn_panel_on() (and for KRN_PANEL_DOT krn_cpu_bf16dot_active()). */
void krn_panel_rows(krn_panel_kind kind, const void *xp, int n, int in, const uint16_t *w,
                    krn_dtype wt, int o0, int o1, void *panel, float *y, int out);

/* bf16 W packed once (krn_wpack_bf16): uint32 pairs of one panel of 32 rows. */
size_t krn_wpack_panel_u32(int in);
/* Up to this many rows of x (one tile), packed W is read by a GEMV over krn_wpack_gemv_panels(n)
 * panels at once (one stream each; above 6 rows in two passes), above it by the panel
 * micro-kernel. */
#define KRN_WPACK_GEMV_MAX_N 12
int krn_wpack_gemv_panels(int n);
/* y[r, o] = Σ_k w[o, k] · x[r, k] for o in [o0, o1), o0 a multiple of KRN_PANEL_ROWS, W packed at
 * wp (all of it), f32 FMAs in k order. xp: x packed by krn_panel_pack_x for `kind` (the avx512
 * path; KRN_PANEL_DOT only while krn_cpu_bf16dot_active()), or NULL: then x is read as it is
 * (the avx2 and scalar paths, exact; kind must be KRN_PANEL_F32). */
void krn_wpack_rows(krn_panel_kind kind, const void *xp, const float *x, int n, int in,
                    const uint32_t *wp, int o0, int o1, float *y, int out);
/* dst[in] = row `row` of packed W as f32 (the embedding gather from a packed table). */
void krn_wpack_row(const void *wp, int in, uint32_t row, float *dst);

/* ---- pool internals (krn_pool.c) ---------------------------------------------------------- */

/* Like krn_task_fn, plus the index in [0, krn_pool_size) of the worker running the task (0 is
 * the caller), so a task may use that worker's scratch. */
typedef void (*krn_task_ex_fn)(void *arg, int task, int n_tasks, int worker);
void krn_pool_run_ex(krn_pool *p, krn_task_ex_fn fn, void *arg, int n_tasks);

/* Scratch memory of worker `worker` ([0, krn_pool_size)) or, with worker == krn_pool_size, one
 * region shared by all; at least `bytes` bytes, 64-byte aligned, grown on demand and kept until
 * the pool is destroyed. Call it before krn_pool_run_ex, never from a task. NULL when memory
 * runs out (callers fall back to a path that needs none). */
void *krn_pool_scratch(krn_pool *p, int worker, size_t bytes);

/* ---- exact scalar conversions ---------------------------------------------------------------- */

static inline float krn_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* IEEE binary16 → binary32, exact for every input (subnormals, infinities, NaN payloads). */
static inline float krn_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else { /* subnormal: normalise */
        int e = -1;
        do {
            man <<= 1;
            e++;
        } while ((man & 0x400u) == 0);
        u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Element `i` of a weight vector of dtype wt, as f32. */
static inline float krn_load_elt(const void *w, krn_dtype wt, size_t i) {
    switch (wt) {
    case KRN_BF16: return krn_bf16_to_f32(((const uint16_t *)w)[i]);
    case KRN_F16: return krn_f16_to_f32(((const uint16_t *)w)[i]);
    default: return ((const float *)w)[i];
    }
}

static inline size_t krn_dtype_size(krn_dtype wt) { return wt == KRN_F32 ? 4 : 2; }

/* dst[n] = src[n] as f32, exact, with the current SIMD path (krn_linear.c). */
void krn_cvt_f32(const void *src, krn_dtype wt, size_t n, float *dst);

/* ---- vector exp ---------------------------------------------------------------------------- */
/* exp(x) = 2^k * e^r with k = round(x / ln 2), r = x - k ln 2 (ln 2 split in two parts), e^r by
 * a degree-6 polynomial; relative error below 2.3e-7 (2 ulp) on [-87, 88]. Inputs below -87.3 give
 * 0 (exp of -inf too), above 88.7 give +inf. */

#if KRN_X86
__attribute__((target("avx2,fma"))) static inline __m256 krn_exp256(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.7f), lo = _mm256_set1_ps(-87.3f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    __m256 over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
    __m256 xc = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
    __m256 k = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 pl = _mm256_set1_ps(1.0f / 720.0f);
    pl = _mm256_fmadd_ps(pl, r, _mm256_set1_ps(1.0f / 120.0f));
    pl = _mm256_fmadd_ps(pl, r, _mm256_set1_ps(1.0f / 24.0f));
    pl = _mm256_fmadd_ps(pl, r, _mm256_set1_ps(1.0f / 6.0f));
    pl = _mm256_fmadd_ps(pl, r, _mm256_set1_ps(0.5f));
    pl = _mm256_fmadd_ps(pl, r, _mm256_set1_ps(1.0f));
    pl = _mm256_fmadd_ps(pl, r, _mm256_set1_ps(1.0f));
    /* k in [-126, 128]: scale in two steps so 2^128 and 2^-126 stay representable */
    __m256i ki = _mm256_cvtps_epi32(k);
    __m256i k1 = _mm256_srai_epi32(ki, 1), k2 = _mm256_sub_epi32(ki, k1);
    __m256 s1 =
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, _mm256_set1_epi32(127)), 23));
    __m256 s2 =
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, _mm256_set1_epi32(127)), 23));
    __m256 y = _mm256_mul_ps(_mm256_mul_ps(pl, s1), s2);
    y = _mm256_andnot_ps(under, y);
    return _mm256_blendv_ps(y, _mm256_set1_ps(__builtin_inff()), over);
}

__attribute__((target("avx512f"))) static inline __m512 krn_exp512(__m512 x) {
    const __m512 hi = _mm512_set1_ps(88.7f), lo = _mm512_set1_ps(-87.3f);
    __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    __mmask16 over = _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ);
    __m512 xc = _mm512_max_ps(_mm512_min_ps(x, hi), lo);
    __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), xc);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 pl = _mm512_set1_ps(1.0f / 720.0f);
    pl = _mm512_fmadd_ps(pl, r, _mm512_set1_ps(1.0f / 120.0f));
    pl = _mm512_fmadd_ps(pl, r, _mm512_set1_ps(1.0f / 24.0f));
    pl = _mm512_fmadd_ps(pl, r, _mm512_set1_ps(1.0f / 6.0f));
    pl = _mm512_fmadd_ps(pl, r, _mm512_set1_ps(0.5f));
    pl = _mm512_fmadd_ps(pl, r, _mm512_set1_ps(1.0f));
    pl = _mm512_fmadd_ps(pl, r, _mm512_set1_ps(1.0f));
    __m512 y = _mm512_scalef_ps(pl, k); /* pl * 2^k, exact for the whole range */
    y = _mm512_maskz_mov_ps((__mmask16)~under, y);
    return _mm512_mask_mov_ps(y, over, _mm512_set1_ps(__builtin_inff()));
}
#endif

#endif
