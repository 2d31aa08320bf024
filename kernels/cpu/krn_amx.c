/* krn_amx.c — bf16 × bf16 → f32 matrix products on Intel AMX (TDPBF16PS), the batched-decode
 * path of krn_cpu_linear for bf16 weights.
 *
 * Owns: detecting AMX (CPUID AMX-TILE + AMX-BF16, the OS enabling tile state in XCR0, and
 * Linux's per-process permission via arch_prctl(ARCH_REQ_XCOMP_PERM)), the PIE_KRN_AMX switch
 * and krn_cpu_set_amx, rounding x to bf16 and packing it into AMX "B" tiles, and the tile loop
 * over a block of output rows; for bf16 W packed once (KRN_BF16_PANEL), x packed as "A" tiles
 * and the tile loop over a block of packed panels (see the section below).
 * Does not own: when AMX is used (krn_linear.c decides: bf16 weights, enough rows, shapes it
 * can tile) nor the threads (krn_linear.c splits the rows over the pool), nor the packed
 * layout (krn_panel.c).
 *
 * The product is computed transposed: y^T[out, n] = W[out, in] · x^T. W's rows are already
 * what an AMX "A" tile wants (16 rows × 32 consecutive bf16 of k), so the mapped weights are
 * read in place — no conversion, no copy. x (few rows) is split into two bf16 parts,
 * x = hi + lo + e with hi = bf16(x), lo = bf16(x - hi) (round to nearest even; |e| <= 2^-17
 * |x|), and packed once per call into "B" tiles: for every 32 k and 16 rows of x, a 16 × 16
 * matrix of bf16 pairs B[kp][r] = (x[r][k0 + 2kp], x[r][k0 + 2kp + 1]) for hi, then one for
 * lo. Both go through the same W tile into two C tiles (16 out × 16 rows of x, f32) that are
 * added when written, transposed, into y.
 * Accuracy: products of bf16 values are exact in f32 and accumulated in f32, so the result is
 * as good as the f32 paths (|error| <= ~1e-5 · Σ|w·x|) rather than bf16(x)'s 2^-8. The second
 * part doubles the tile products, which costs little where it matters: at decode batch sizes
 * the loop waits on W from memory, not on the tile unit. */
#include "krn_cpu_impl.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#if KRN_X86 && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define KRN_HAVE_AMX 1
#else
#define KRN_HAVE_AMX 0
#endif

#define KRN_TARGET_AMX \
    __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx2,fma")))

/* Global on purpose: whether AMX is usable is a property of the CPU, the kernel and the
 * process (the arch_prctl permission is process-wide), decided once; the switch is changed
 * only by krn_cpu_set_amx, which tests call between kernel calls. */
static pthread_once_t g_amx_once = PTHREAD_ONCE_INIT;
static atomic_int g_amx_have; /* CPU + OS + permission */
static atomic_int g_amx_on;   /* what krn_cpu_linear uses */

#if KRN_HAVE_AMX
#define KRN_ARCH_REQ_XCOMP_PERM 0x1023
#define KRN_XFEATURE_XTILEDATA  18

static int probe_amx(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (!(d & (1u << 24)) || !(d & (1u << 22))) return 0;               /* AMX-TILE, AMX-BF16 */
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0; /* OSXSAVE */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    (void)hi;
    if ((lo & (3u << 17)) != (3u << 17)) return 0; /* XTILECFG and XTILEDATA enabled */
    /* Linux (5.16+) hands out the 8 KiB tile state only to processes that ask. */
    return syscall(SYS_arch_prctl, KRN_ARCH_REQ_XCOMP_PERM, KRN_XFEATURE_XTILEDATA) == 0;
}
#endif

static void amx_init(void) {
    int have = 0;
#if KRN_HAVE_AMX
    have = probe_amx();
#endif
    const char *env = getenv("PIE_KRN_AMX");
    int on = have && !(env && env[0] == '0');
    atomic_store(&g_amx_have, have);
    atomic_store(&g_amx_on, on);
}

int krn_cpu_amx_active(void) {
    pthread_once(&g_amx_once, amx_init);
    return atomic_load_explicit(&g_amx_on, memory_order_relaxed) &&
           krn_simd_level() == KRN_SIMD_AVX512;
}

int krn_cpu_set_amx(int on) {
    pthread_once(&g_amx_once, amx_init);
    if (on && !atomic_load(&g_amx_have)) return -1;
    atomic_store(&g_amx_on, on ? 1 : 0);
    return 0;
}

size_t krn_amx_pack_bytes(int n, int in) {
    size_t nb = (size_t)(n + 15) / 16;
    return (size_t)(in / 32) * nb * 2 * 1024; /* hi and lo */
}

size_t krn_amx_wpack_x_bytes(int n, int in) {
    size_t nb = (size_t)(n + 15) / 16, kb = ((size_t)in + 31) / 32;
    return kb * nb * 2 * 1024; /* hi and lo, `in` rounded up to 32 */
}

#if KRN_HAVE_AMX
/* 16 floats → 16 bf16 (round to nearest even; NaN stays NaN), in the low halves of 32-bit
 * lanes. */
KRN_TARGET_AMX static inline __m512i round_bf16(__m512i u) {
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7f800000));
    __m512i qnan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_mask_mov_epi32(r, nan, qnan);
}

/* x[16] → hi, lo as 16 bf16 each (low halves of 32-bit lanes). lo is 0 where hi is not
 * finite, so an infinity in x stays an infinity in y (x - hi would be NaN). */
KRN_TARGET_AMX static inline void split_bf16(const float *x, __mmask16 m, __m512i *hi,
                                             __m512i *lo) {
    __m512 v = _mm512_maskz_loadu_ps(m, x); /* lanes off the mask are 0 */
    *hi = round_bf16(_mm512_castps_si512(v));
    __m512 h = _mm512_castsi512_ps(_mm512_slli_epi32(*hi, 16));
    __m512i l = round_bf16(_mm512_castps_si512(_mm512_sub_ps(v, h)));
    __m512i exp = _mm512_and_si512(*hi, _mm512_set1_epi32(0x7f80));
    __mmask16 inf = _mm512_cmpeq_epi32_mask(exp, _mm512_set1_epi32(0x7f80));
    *lo = _mm512_maskz_mov_epi32((__mmask16)~inf, l);
}

/* 32 bf16 in two vectors' low halves → one vector of 16 consecutive pairs. */
KRN_TARGET_AMX static inline __m512i pairs_of(__m512i a, __m512i b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(a)),
                              _mm512_cvtepi32_epi16(b), 1);
}

/* Columns [32 kb, 32 kb + 32) of row xr (those at or past `in` read as zero) split into hi and
 * lo bf16, each as one vector of 16 consecutive pairs; zeros for a row past x's (xr NULL). */
KRN_TARGET_AMX static inline void block_pairs(const float *xr, int in, int kb, __m512i *hp,
                                              __m512i *lp) {
    *hp = *lp = _mm512_setzero_si512();
    if (!xr) return;
    int left = in - kb * 32;
    __m512i h0, l0, h1, l1;
    split_bf16(xr + kb * 32, krn_mask16(left), &h0, &l0);
    split_bf16(xr + kb * 32 + 16, krn_mask16(left - 16), &h1, &l1);
    *hp = pairs_of(h0, h1);
    *lp = pairs_of(l0, l1);
}

typedef struct pack_job {
    const float *x;
    int n, in;
    uint32_t *xp;
} pack_job;

/* Group q of 16 rows of x: its hi tiles are block 2q, its lo tiles block 2q + 1, of
 * xp[kb][block][kp][r] (uint32 bf16 pairs); rows past n are zeros. */
KRN_TARGET_AMX static void pack_group(void *arg, int q, int n_groups) {
    const pack_job *j = arg;
    int KB = j->in / 32, NBT = 2 * n_groups;
    const __m512i idx =
        _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                           _mm512_set1_epi32(16));
    for (int rl = 0; rl < 16; rl++) {
        int r = q * 16 + rl;
        const float *xr = r < j->n ? j->x + (size_t)r * (size_t)j->in : NULL;
        for (int kb = 0; kb < KB; kb++) {
            uint32_t *dst = j->xp + ((size_t)kb * (size_t)NBT + 2 * (size_t)q) * 256 + (size_t)rl;
            __m512i hp, lp;
            block_pairs(xr, j->in, kb, &hp, &lp);
            /* pair kp goes to row kp of the tile, column rl */
            _mm512_i32scatter_epi32(dst, idx, hp, 4);
            _mm512_i32scatter_epi32(dst + 256, idx, lp, 4);
        }
    }
}

void krn_amx_pack(krn_pool *p, const float *x, int n, int in, void *xp) {
    pack_job j = {.x = x, .n = n, .in = in, .xp = xp};
    krn_pool_run(p, pack_group, &j, (n + 15) / 16);
}

typedef struct amx_cfg {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg;

/* Tiles 0-3: C (a, b) = 2a + b; 4-5: A (W rows); 6-7: B (packed x). All 16 rows × 64 bytes. */
KRN_TARGET_AMX static void load_config(void) {
    amx_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

/* y[r, o] for o in [o, o + 16 * (1 + two_a)) and the 16 rows r of group q: tiles 4/5 hold
 * W, 6/7 x's hi/lo parts, C tile 2a + part sums W-tile a against that part. */
KRN_TARGET_AMX static void block(const uint16_t *w, int in, const uint32_t *xp, int n_groups, int q,
                                 int two_a, int n, int o, float *y, int out) {
    const uint16_t *w0 = w + (size_t)o * (size_t)in;
    const uint16_t *w1 = w0 + (size_t)16 * (size_t)in;
    const uint32_t *b0 = xp + (size_t)q * 512;
    size_t ldw = (size_t)in * 2, kstride = (size_t)n_groups * 512;
    int KB = in / 32;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    if (two_a) {
        for (int kb = 0; kb < KB; kb++) {
            const uint32_t *b = b0 + (size_t)kb * kstride;
            _tile_loadd(4, w0 + (size_t)kb * 32, ldw);
            _tile_loadd(6, b, 64);
            _tile_loadd(7, b + 256, 64);
            _tile_loadd(5, w1 + (size_t)kb * 32, ldw);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    } else {
        for (int kb = 0; kb < KB; kb++) {
            const uint32_t *b = b0 + (size_t)kb * kstride;
            _tile_loadd(4, w0 + (size_t)kb * 32, ldw);
            _tile_loadd(6, b, 64);
            _tile_loadd(7, b + 256, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
    }
    float c[4][256] __attribute__((aligned(64)));
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
    int r0 = q * 16, rn = n - r0 < 16 ? n - r0 : 16;
    for (int a = 0; a <= two_a; a++) {
        const float *hi = c[2 * a], *lo = c[2 * a + 1];
        float *yo = y + o + 16 * a;
        for (int j = 0; j < rn; j++)
            for (int i = 0; i < 16; i++)
                yo[(size_t)(r0 + j) * (size_t)out + (size_t)i] = hi[i * 16 + j] + lo[i * 16 + j];
    }
}

/* y[r, o] for o in [o, o + 16) and the rows of both groups (n in 17..32), W read once: one W
 * tile (4) against four x tiles per 32 k, C tile 2q + part for group q. Only three B tiles are
 * left (5-7), so group 1's lo part reuses tile 5 after group 0's hi product has read it. Reading
 * W once matters: in the two-group form of block() the second group's pass over the same W
 * rows took 20-70% more time than the first (2 cores, bench/results/engine.md), whether or not
 * the lo products ran. Same products, same order per C tile: the result is bit-identical to
 * block()'s. */
KRN_TARGET_AMX static void block_pair(const uint16_t *w, int in, const uint32_t *xp, int n, int o,
                                      float *y, int out) {
    const uint16_t *w0 = w + (size_t)o * (size_t)in;
    size_t ldw = (size_t)in * 2, kstride = 2 * 512;
    int KB = in / 32;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int kb = 0; kb < KB; kb++) {
        const uint32_t *b = xp + (size_t)kb * kstride; /* group 0 hi, lo; group 1 hi, lo */
        _tile_loadd(4, w0 + (size_t)kb * 32, ldw);
        _tile_loadd(5, b, 64);
        _tile_loadd(6, b + 256, 64);
        _tile_loadd(7, b + 512, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, b + 768, 64);
        _tile_dpbf16ps(3, 4, 5);
    }
    float c[4][256] __attribute__((aligned(64)));
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
    for (int q = 0; q < 2; q++) {
        const float *hi = c[2 * q], *lo = c[2 * q + 1];
        int r0 = q * 16, rn = n - r0 < 16 ? n - r0 : 16;
        for (int j = 0; j < rn; j++)
            for (int i = 0; i < 16; i++)
                y[(size_t)(r0 + j) * (size_t)out + (size_t)(o + i)] =
                    hi[i * 16 + j] + lo[i * 16 + j];
    }
}

KRN_TARGET_AMX void krn_amx_rows(const void *xp, int n, int in, const uint16_t *w, int o0, int o1,
                                 float *y, int out) {
    load_config();
    int n_groups = (n + 15) / 16;
    if (n_groups == 2) {
        for (int o = o0; o + 16 <= o1; o += 16) block_pair(w, in, xp, n, o, y, out);
        _tile_release();
        return;
    }
    for (int o = o0; o + 16 <= o1; o += 32) {
        int two_a = o + 32 <= o1;
        for (int q = 0; q < n_groups; q++) block(w, in, xp, n_groups, q, two_a, n, o, y, out);
    }
    _tile_release();
}
/* ---- W packed once (KRN_BF16_PANEL) -----------------------------------------------------------
 *
 * The operands swap roles: y[n, out] = x · W^T is computed as it stands, not transposed.
 *   A  x's parts (hi, lo as above), row-major: a tile is 16 rows of x × 32 consecutive bf16 of
 *      k (64 bytes a row), what TDPBF16PS wants of A. Packed once per call, tile after tile:
 *      xa[kb][q][part][16][32] (k block kb, group q of 16 rows, part hi/lo), rows past n and
 *      columns past `in` zero.
 *   B  the packed panel itself (krn_panel.c): for pair p, 32 uint32 (w[o][2p], w[o][2p + 1]),
 *      outputs 0-15 then 16-31. So the 64 bytes of outputs 0-15 at pair p are row p of a B
 *      tile (16 pair rows × 16 columns) and the next pair's are 128 bytes on: B tile (kb, h) is
 *      read in place at panel + kb · 512 + 16 h with a stride of 128 bytes. Nothing converted,
 *      nothing copied; columns past `in` are zero in the panel, outputs past `out` zero rows.
 *   C  16 rows of x × 16 outputs, f32: hi and lo each, added when stored straight into y's rows
 *      (16 consecutive floats; masked past `out`).
 * Each C element is Σ over the same k pairs of the same two products in the same order as the
 * transposed form above (TDPBF16PS multiplies a pair of A by the pair of B: the products
 * commute), then hi + lo: the same bits as krn_amx_rows on row-major W (tests check it). */

/* k blocks of a panel per chunk in wblock_pair (2 KiB each). */
#define KRN_AMX_WPACK_KC 16
/* How far ahead (uint32) the first pass over a panel prefetches it into L2: packed W is one
 * stream per core, which the hardware prefetchers alone bring in at ~10 GB/s against ~14 for
 * row-major W's 16 (bench/results/engine.md, issue 17 item 2). */
#define KRN_AMX_WPACK_PF_U32 (8 * 512)

/* The 2 KiB of the k block KRN_AMX_WPACK_PF_U32 after b (32 lines) into L2. The address is
 * formed as an integer: near the end of W it lies past it (a prefetch does not fault). */
KRN_TARGET_AMX static inline void prefetch_block(const uint32_t *b) {
    uintptr_t a = (uintptr_t)b + KRN_AMX_WPACK_PF_U32 * sizeof *b;
    for (int l = 0; l < 32; l++) _mm_prefetch((const char *)(a + 64 * (uintptr_t)l), _MM_HINT_T1);
}

typedef struct pack_a_job {
    const float *x;
    int n, in;
    uint16_t *xa;
} pack_a_job;

KRN_TARGET_AMX static void pack_a_group(void *arg, int q, int n_groups) {
    const pack_a_job *j = arg;
    int KB = (j->in + 31) / 32;
    for (int rl = 0; rl < 16; rl++) {
        int r = q * 16 + rl;
        const float *xr = r < j->n ? j->x + (size_t)r * (size_t)j->in : NULL;
        for (int kb = 0; kb < KB; kb++) {
            uint16_t *dst =
                j->xa + (((size_t)kb * (size_t)n_groups + (size_t)q) * 2) * 512 + (size_t)rl * 32;
            __m512i hp, lp;
            block_pairs(xr, j->in, kb, &hp, &lp);
            _mm512_storeu_si512((void *)dst, hp);
            _mm512_storeu_si512((void *)(dst + 512), lp);
        }
    }
}

void krn_amx_wpack_x(krn_pool *p, const float *x, int n, int in, void *xa) {
    pack_a_job j = {.x = x, .n = n, .in = in, .xa = xa};
    krn_pool_run(p, pack_a_group, &j, (n + 15) / 16);
}

/* C tiles (hi, lo) of group q into y: rows [16 q, min(n, 16 q + 16)), outputs [o, o + valid). */
KRN_TARGET_AMX static inline void store_c(const float *hi, const float *lo, int n, int q, int o,
                                          int valid, float *y, int out) {
    if (valid <= 0) return;
    __mmask16 m = krn_mask16(valid);
    int r0 = q * 16, rn = n - r0 < 16 ? n - r0 : 16;
    for (int j = 0; j < rn; j++)
        _mm512_mask_storeu_ps(
            y + (size_t)(r0 + j) * (size_t)out + (size_t)o, m,
            _mm512_add_ps(_mm512_load_ps(hi + j * 16), _mm512_load_ps(lo + j * 16)));
}

/* One panel (outputs [o, o + 32)) against group q of x: tiles 4/5 x's hi/lo, 6/7 the panel's
 * two halves, C tile 2h + part. */
KRN_TARGET_AMX static void wblock(const uint16_t *xa, int KB, int NG, int q, const uint32_t *pan,
                                  int n, int o, float *y, int out) {
    const uint16_t *a0 = xa + (size_t)q * 1024;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int kb = 0; kb < KB; kb++) {
        const uint16_t *a = a0 + (size_t)kb * (size_t)NG * 1024;
        const uint32_t *b = pan + (size_t)kb * 512;
        if (q == 0) prefetch_block(b);
        _tile_loadd(4, a, 64);
        _tile_loadd(5, a + 512, 64);
        _tile_loadd(6, b, 128);
        _tile_loadd(7, b + 16, 128);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
    }
    float c[4][256] __attribute__((aligned(64)));
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
    store_c(c[0], c[1], n, q, o, out - o, y, out);
    store_c(c[2], c[3], n, q, o + 16, out - o - 16, y, out);
}

/* Both halves of a panel against both groups (n in 17..32), W read once, in k order per C
 * tile as block_pair() above: 8 C tiles would be needed at once, so the panel is taken
 * KRN_AMX_WPACK_KC k blocks at a time (2 KiB each: the chunk stays in L1 for the second half),
 * half 0 then half 1, each half's 4 C tiles (group q, part: 2q + part) saved to c[h] between
 * chunks and loaded back (exact: f32 in, f32 out). Per 32 k: one B tile (4) against four A
 * tiles, tile 5 reused for group 1's lo part. */
KRN_TARGET_AMX static void wblock_pair(const uint16_t *xa, int KB, const uint32_t *pan, int n,
                                       int o, float *y, int out) {
    float c[2][4][256] __attribute__((aligned(64)));
    for (int k0 = 0; k0 < KB; k0 += KRN_AMX_WPACK_KC) {
        int k1 = k0 + KRN_AMX_WPACK_KC < KB ? k0 + KRN_AMX_WPACK_KC : KB;
        for (int h = 0; h < 2; h++) {
            if (k0 == 0) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
            } else {
                _tile_loadd(0, c[h][0], 64);
                _tile_loadd(1, c[h][1], 64);
                _tile_loadd(2, c[h][2], 64);
                _tile_loadd(3, c[h][3], 64);
            }
            for (int kb = k0; kb < k1; kb++) {
                const uint16_t *a = xa + (size_t)kb * 2048, *a1 = a + 1024;
                const uint32_t *b = pan + (size_t)kb * 512;
                if (h == 0) prefetch_block(b);
                _tile_loadd(4, b + 16 * h, 128);
                _tile_loadd(5, a, 64);
                _tile_loadd(6, a + 512, 64);
                _tile_loadd(7, a1, 64);
                _tile_dpbf16ps(0, 5, 4);
                _tile_dpbf16ps(1, 6, 4);
                _tile_dpbf16ps(2, 7, 4);
                _tile_loadd(5, a1 + 512, 64);
                _tile_dpbf16ps(3, 5, 4);
            }
            _tile_stored(0, c[h][0], 64);
            _tile_stored(1, c[h][1], 64);
            _tile_stored(2, c[h][2], 64);
            _tile_stored(3, c[h][3], 64);
        }
    }
    for (int h = 0; h < 2; h++) {
        store_c(c[h][0], c[h][1], n, 0, o + 16 * h, out - o - 16 * h, y, out);
        store_c(c[h][2], c[h][3], n, 1, o + 16 * h, out - o - 16 * h, y, out);
    }
}

KRN_TARGET_AMX void krn_amx_wpack_rows(const void *xa, int n, int in, const uint32_t *wp, int o0,
                                       int o1, float *y, int out) {
    load_config();
    int KB = (in + 31) / 32, n_groups = (n + 15) / 16;
    size_t stride = (size_t)KB * 512; /* uint32 per panel: krn_wpack_panel_u32(in) */
    for (int o = o0; o < o1; o += 32) {
        const uint32_t *pan = wp + (size_t)(o / 32) * stride;
        if (n_groups == 2)
            wblock_pair(xa, KB, pan, n, o, y, out);
        else
            for (int q = 0; q < n_groups; q++) wblock(xa, KB, n_groups, q, pan, n, o, y, out);
    }
    _tile_release();
}
#else
void krn_amx_pack(krn_pool *p, const float *x, int n, int in, void *xp) {
    (void)p, (void)x, (void)n, (void)in, (void)xp;
    abort(); /* unreachable: krn_cpu_amx_active() is 0 without AMX support */
}
void krn_amx_rows(const void *xp, int n, int in, const uint16_t *w, int o0, int o1, float *y,
                  int out) {
    (void)xp, (void)n, (void)in, (void)w, (void)o0, (void)o1, (void)y, (void)out;
    abort();
}
void krn_amx_wpack_x(krn_pool *p, const float *x, int n, int in, void *xa) {
    (void)p, (void)x, (void)n, (void)in, (void)xa;
    abort();
}
void krn_amx_wpack_rows(const void *xa, int n, int in, const uint32_t *wp, int o0, int o1, float *y,
                        int out) {
    (void)xa, (void)n, (void)in, (void)wp, (void)o0, (void)o1, (void)y, (void)out;
    abort();
}
#endif
