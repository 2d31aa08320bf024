/* krn_bf16dot.c — bf16 weights × bf16-rounded x with AVX512-BF16 dot products (VDPBF16PS), the
 * batched path of krn_cpu_linear for bf16 weights on CPUs with AVX512-BF16 but no AMX (the AMD
 * EPYC kind of issue 17), or with AMX switched off.
 *
 * Owns: detecting AVX512-BF16, the PIE_KRN_BF16DOT switch and krn_cpu_set_bf16dot, rounding x
 * to bf16 and packing it, and the tile loop over a block of output rows.
 * Does not own: when the path is used (krn_linear.c: bf16 weights, enough rows, AMX not active)
 * nor the threads (krn_linear.c splits the rows over the pool).
 *
 * Layout: no repacking of W. A row of W is already 16 consecutive bf16 pairs per 64 bytes,
 * which is what VDPBF16PS multiplies lane by lane against 16 pairs of x: x is rounded once per
 * call into xp[n][in32] (bf16, in32 = in rounded up to 32, zero padded), and a tile keeps
 * RX rows of x × RW rows of W accumulators, each lane summing the pairs k = 32i + 2j, 2j + 1;
 * the 16 lanes are added at the end.
 *
 * Accuracy (the precision choice is issue 17's owner's; kernels/cpu/README.md):
 *   x is rounded to bf16, nearest even (VCVTNE2PS2BF16; an f32 subnormal x becomes 0), so each
 *   x carries a relative error of at most 2^-9. This is the whole difference from the exact
 *   paths: a product of two bf16 values is exact in f32, VDPBF16PS adds the two products of a
 *   pair one after the other into its f32 lane (round to nearest even; subnormal inputs and
 *   outputs are flushed to zero), so the rest is f32 summation: each lane adds in32 / 16
 *   products in sequence and the 16 lanes are added in a tree of 4 levels, hence
 *   |y - Σ w·bf16(x)| <= (in32 / 16 + 4) · 2^-24 · Σ |w·bf16(x)| (first order), against the
 *   rounding's own |Σ w·(bf16(x) - x)| <= 2^-9 · Σ |w·x|. NaN and infinities in x stay NaN
 *   and infinities. Unlike the AMX path (krn_amx.c), which splits x into two bf16 parts and is
 *   as accurate as f32, this path rounds x to one bf16 as llama.cpp's AVX512-BF16 path does:
 *   one VDPBF16PS per 32 products instead of two FMAs and a conversion of W. */
#include "krn_cpu_impl.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#define KRN_TARGET_BF16DOT __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl,avx2,fma")))
#define KRN_INLINE         static inline __attribute__((always_inline))
#define KRN_UNROLL         _Pragma("GCC unroll 8")

/* Global on purpose, as krn_amx.c's: whether the CPU has the instructions is decided once; the
 * switch is changed only by krn_cpu_set_bf16dot, which tests call between kernel calls. */
static pthread_once_t g_dot_once = PTHREAD_ONCE_INIT;
static atomic_int g_dot_have; /* CPU has AVX512-BF16 (and the avx512 path's features) */
static atomic_int g_dot_on;   /* 0 off, 1 the tiles below, 2 the panel variant (krn_panel.c) */

/* Default: on for AMD CPUs, off for others; PIE_KRN_BF16DOT=1 / 0 overrides either way. On the
 * Intel Xeon of the development VMs (AMX off) the path costs ~24% more CPU per 32-sequence
 * decode step than the exact GEMV tiles (VDPBF16PS issues once every 2 cycles there: 60 GMAC/s
 * per core against 120 for f32 FMA); on AMD Zen 4 (the EPYC kind) it runs at twice the f32
 * FMA's products per cycle (117 against 58.7 GMAC/s per core) and a 32-sequence decode step of
 * the 1B shape costs 42% less CPU than on the exact panels (kernels/cpu/README.md). */
static void dot_init(void) {
    int have = 0, amd = 0;
#if KRN_X86
    __builtin_cpu_init();
    have = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw");
    amd = __builtin_cpu_is("amd");
#endif
    const char *env = getenv("PIE_KRN_BF16DOT");
    int want = !(env && *env) ? amd : strcmp(env, "panel") == 0 ? 2 : env[0] != '0';
    atomic_store(&g_dot_have, have);
    atomic_store(&g_dot_on, have ? want : 0);
}

int krn_cpu_bf16dot_active(void) {
    pthread_once(&g_dot_once, dot_init);
    return atomic_load_explicit(&g_dot_on, memory_order_relaxed) &&
           krn_simd_level() == KRN_SIMD_AVX512 && !krn_cpu_amx_active();
}

int krn_bf16dot_panel(void) {
    pthread_once(&g_dot_once, dot_init);
    return atomic_load_explicit(&g_dot_on, memory_order_relaxed) == 2;
}

int krn_cpu_set_bf16dot(int on) {
    pthread_once(&g_dot_once, dot_init);
    if (on && !atomic_load(&g_dot_have)) return -1;
    atomic_store(&g_dot_on, on == 2 ? 2 : on ? 1 : 0);
    return 0;
}

static size_t in32_of(int in) { return ((size_t)in + 31) / 32 * 32; }

size_t krn_bf16dot_pack_bytes(int n, int in) { return (size_t)n * in32_of(in) * 2; }

#if KRN_X86
typedef struct pack_job {
    const float *x;
    int n, in;
    uint16_t *xp;
} pack_job;

/* Row r of x → xp[r][0, in32): bf16, nearest even, zeros past in. */
KRN_TARGET_BF16DOT static void pack_row(void *arg, int r, int n_tasks) {
    (void)n_tasks;
    const pack_job *j = arg;
    const float *xr = j->x + (size_t)r * (size_t)j->in;
    uint16_t *dst = j->xp + (size_t)r * in32_of(j->in);
    for (int k = 0; k < j->in; k += 32) {
        _mm512_storeu_si512((void *)(dst + k), krn_bf16x32_of(xr + k, j->in - k));
    }
}

void krn_bf16dot_pack(krn_pool *p, const float *x, int n, int in, void *xp) {
    pack_job j = {.x = x, .n = n, .in = in, .xp = xp};
    krn_pool_run(p, pack_row, &j, n);
}

/* y[r, c] for RX rows of packed x (stride ldx bf16) and RW rows of W (stride ldw), compile-time
 * RX and RW after inlining; the last (in % 32) columns of W are loaded masked (zeros), so W is
 * never read past a row and x's zero padding never meets a NaN. */
KRN_TARGET_BF16DOT KRN_INLINE void tile(const uint16_t *x, size_t ldx, int RX, const uint16_t *w,
                                        size_t ldw, int RW, int in, float *y, size_t ldy) {
    __m512 acc[8][4];
    KRN_UNROLL for (int r = 0; r < RX; r++) {
        KRN_UNROLL for (int c = 0; c < RW; c++) { acc[r][c] = _mm512_setzero_ps(); }
    }
    int k = 0;
    for (; k + 32 <= in; k += 32) {
        __m512i wv[4];
        KRN_UNROLL for (int c = 0; c < RW; c++) {
            wv[c] = _mm512_loadu_si512((const void *)(w + (size_t)c * ldw + (size_t)k));
        }
        KRN_UNROLL for (int r = 0; r < RX; r++) {
            __m512i xv = _mm512_loadu_si512((const void *)(x + (size_t)r * ldx + (size_t)k));
            KRN_UNROLL for (int c = 0; c < RW; c++) {
                acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)xv, (__m512bh)wv[c]);
            }
        }
    }
    if (k < in) {
        __mmask32 m = (__mmask32)((1ull << (in - k)) - 1u);
        __m512i wv[4];
        KRN_UNROLL for (int c = 0; c < RW; c++) {
            wv[c] = _mm512_maskz_loadu_epi16(m, w + (size_t)c * ldw + (size_t)k);
        }
        KRN_UNROLL for (int r = 0; r < RX; r++) {
            __m512i xv = _mm512_loadu_si512((const void *)(x + (size_t)r * ldx + (size_t)k));
            KRN_UNROLL for (int c = 0; c < RW; c++) {
                acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)xv, (__m512bh)wv[c]);
            }
        }
    }
    KRN_UNROLL for (int r = 0; r < RX; r++) {
        KRN_UNROLL for (int c = 0; c < RW; c++) {
            y[(size_t)r * ldy + (size_t)c] = _mm512_reduce_add_ps(acc[r][c]);
        }
    }
}

/* Rows of x in groups of 8, the rest in one smaller tile, against RW rows of W at wo. */
#define KRN_DOT_ROWS(RW)                                                                       \
    do {                                                                                       \
        int r = 0;                                                                             \
        for (; r + 8 <= n; r += 8)                                                             \
            tile(xp + (size_t)r * ldx, ldx, 8, wo, ldw, RW, in, y + (size_t)r * ldy + o, ldy); \
        switch (n - r) {                                                                       \
        case 7:                                                                                \
            tile(xp + (size_t)r * ldx, ldx, 7, wo, ldw, RW, in, y + (size_t)r * ldy + o, ldy); \
            break;                                                                             \
        case 6:                                                                                \
            tile(xp + (size_t)r * ldx, ldx, 6, wo, ldw, RW, in, y + (size_t)r * ldy + o, ldy); \
            break;                                                                             \
        case 5:                                                                                \
            tile(xp + (size_t)r * ldx, ldx, 5, wo, ldw, RW, in, y + (size_t)r * ldy + o, ldy); \
            break;                                                                             \
        case 4:                                                                                \
            tile(xp + (size_t)r * ldx, ldx, 4, wo, ldw, RW, in, y + (size_t)r * ldy + o, ldy); \
            break;                                                                             \
        case 3:                                                                                \
            tile(xp + (size_t)r * ldx, ldx, 3, wo, ldw, RW, in, y + (size_t)r * ldy + o, ldy); \
            break;                                                                             \
        case 2:                                                                                \
            tile(xp + (size_t)r * ldx, ldx, 2, wo, ldw, RW, in, y + (size_t)r * ldy + o, ldy); \
            break;                                                                             \
        case 1:                                                                                \
            tile(xp + (size_t)r * ldx, ldx, 1, wo, ldw, RW, in, y + (size_t)r * ldy + o, ldy); \
            break;                                                                             \
        default: break;                                                                        \
        }                                                                                      \
    } while (0)

KRN_TARGET_BF16DOT void krn_bf16dot_rows(const void *xpv, int n, int in, const uint16_t *w, int o0,
                                         int o1, float *y, int out) {
    const uint16_t *xp = xpv;
    size_t ldx = in32_of(in), ldw = (size_t)in, ldy = (size_t)out;
    int o = o0;
    for (; o + 3 <= o1; o += 3) {
        const uint16_t *wo = w + (size_t)o * ldw;
        KRN_DOT_ROWS(3);
    }
    for (; o < o1; o++) {
        const uint16_t *wo = w + (size_t)o * ldw;
        KRN_DOT_ROWS(1);
    }
}
#else
void krn_bf16dot_pack(krn_pool *p, const float *x, int n, int in, void *xp) {
    (void)p, (void)x, (void)n, (void)in, (void)xp;
    abort(); /* unreachable: krn_cpu_bf16dot_active() is 0 off x86 */
}
void krn_bf16dot_rows(const void *xp, int n, int in, const uint16_t *w, int o0, int o1, float *y,
                      int out) {
    (void)xp, (void)n, (void)in, (void)w, (void)o0, (void)o1, (void)y, (void)out;
    abort();
}
#endif
