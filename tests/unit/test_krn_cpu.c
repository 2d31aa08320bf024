/* test_krn_cpu.c — the CPU kernels (kernels/cpu) against straightforward references.
 *
 * Owns: references written here in double precision (linear, RMSNorm, SiLU, RoPE and its
 * Llama-3 frequencies, softmax, top-k by full sort, paged attention by one softmax per row)
 * and the checks that every SIMD path, every weight dtype and pools of 1..4 threads agree with
 * them on odd sizes.
 *
 * SIMD paths: "scalar", "avx2", "avx512" (AMX and AVX512-BF16 off: the exact kernels),
 * "avx512bf16" (avx512 with bf16 weights × bf16-rounded x by VDPBF16PS, AMX off) and "amx"
 * (avx512 with bf16 weights on AMX tiles). CTest runs this binary once per path with
 * PIE_TEST_SIMD=<path>
 * (tests/CMakeLists.txt): the path-dependent checks then run on that path only, and a path the
 * CPU lacks exits 77, which CTest reports as Skipped — so the summary says which paths this
 * machine could not test. Without PIE_TEST_SIMD (run by hand) every path the CPU has runs. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "krn_cpu.h"
#include "krn_cpu_impl.h" /* pool internals: worker index, scratch */

static const char *const SIMD_PATHS[] = {"scalar", "avx2", "avx512", "avx512bf16", "amx"};
#define N_SIMD 5

/* Exit status CTest reads as "skipped" (SKIP_RETURN_CODE in tests/CMakeLists.txt). */
#define TEST_SKIP_RC 77

/* ---- helpers ------------------------------------------------------------------------------- */

typedef struct rng {
    uint64_t s;
} rng;

static uint64_t rng_next(rng *r) {
    r->s ^= r->s << 13;
    r->s ^= r->s >> 7;
    r->s ^= r->s << 17;
    return r->s;
}

/* uniform in [-1, 1) */
static float rng_f(rng *r) {
    return (float)((double)(rng_next(r) >> 11) / 4503599627370496.0 - 1.0);
}

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    cr_assert_not_null(p, "out of memory (%zu bytes)", n);
    return p;
}

static void fill(rng *r, float *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = rng_f(r);
}

/* Decoding written independently of the library: bf16 is the top half of an f32, f16 is
 * (1024 + mantissa) * 2^(exp - 25), or mantissa * 2^-24 for subnormals. */
static double ref_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static double ref_f16(uint16_t h) {
    int sign = h >> 15, exp = (h >> 10) & 31, man = h & 1023;
    double v = exp == 0 ? ldexp(man, -24) : ldexp(1024 + man, exp - 25);
    return sign ? -v : v;
}

/* Random weights of dtype wt with values of magnitude about 2^-6..2^4 (f16: some subnormals). */
static void *make_weights(rng *r, krn_dtype wt, size_t n, double *ref) {
    if (wt == KRN_F32) {
        float *w = xmalloc(n * 4);
        for (size_t i = 0; i < n; i++) {
            w[i] = rng_f(r);
            ref[i] = w[i];
        }
        return w;
    }
    uint16_t *w = xmalloc(n * 2);
    for (size_t i = 0; i < n; i++) {
        uint64_t b = rng_next(r);
        if (wt == KRN_BF16) {
            float f = rng_f(r) * 4.0f;
            uint32_t u;
            memcpy(&u, &f, 4);
            w[i] = (uint16_t)(u >> 16);
            ref[i] = ref_bf16(w[i]);
        } else {
            int exp = (b & 15) == 0 ? 0 : 9 + (int)((b >> 4) % 10); /* 1 in 16 subnormal */
            w[i] = (uint16_t)(((b >> 8) & 1) << 15 | (uint64_t)exp << 10 | ((b >> 16) & 1023));
            ref[i] = ref_f16(w[i]);
        }
    }
    return w;
}

static const char *dtype_name(krn_dtype wt) {
    return wt == KRN_F32 ? "f32" : wt == KRN_BF16 ? "bf16" : "f16";
}

/* Forces SIMD path `name` (one of SIMD_PATHS); -1 when the CPU lacks it. */
static int force_simd(const char *name) {
    if (strcmp(name, "amx") == 0)
        return krn_cpu_set_simd("avx512") == 0 && krn_cpu_set_amx(1) == 0 ? 0 : -1;
    if (strcmp(name, "avx512bf16") == 0)
        return krn_cpu_set_simd("avx512") == 0 && krn_cpu_set_amx(0) == 0 &&
                       krn_cpu_set_bf16dot(1) == 0
                   ? 0
                   : -1;
    if (krn_cpu_set_simd(name) != 0) return -1;
    /* AMX and AVX512-BF16 may still be on the CPU: "avx512" means the exact AVX-512 kernels. */
    return krn_cpu_set_amx(0) == 0 && krn_cpu_set_bf16dot(0) == 0 ? 0 : -1;
}

/* Whether a bf16 linear of n rows runs on the AVX512-BF16 path now (x rounded to bf16). */
static int linear_rounds_x(krn_dtype wt, int n) {
    return wt == KRN_BF16 && n >= 8 && n <= 32 && krn_cpu_bf16dot_active();
}

/* bf16(f), nearest even, computed in double here rather than by the library's bit trick: the
 * significand scaled to 8 bits and rounded by nearbyint (ties to even in the default mode). */
static float ref_round_bf16(float f) {
    if (!isfinite(f) || f == 0.0f) return f;
    int e = ilogb(f); /* f = m * 2^e, 1 <= |m| < 2 */
    double q = ldexp(nearbyint(ldexp((double)f, 7 - e)), e - 7);
    return (float)q; /* exact (8 significant bits), or +-inf past the largest bf16 */
}

/* The path PIE_TEST_SIMD selects, or NULL for "every path the CPU has". */
static const char *selected_path(void) {
    const char *p = getenv("PIE_TEST_SIMD");
    return p && *p ? p : NULL;
}

/* Whether the path-dependent checks run on SIMD_PATHS[s] in this process; if so, forces it. */
static int use_simd(int s) {
    const char *only = selected_path();
    if (only && strcmp(only, SIMD_PATHS[s]) != 0) return 0;
    if (force_simd(SIMD_PATHS[s]) != 0) {
        cr_assert_null(only, "PIE_TEST_SIMD=%s but the CPU lacks it (main checks first)", only);
        cr_log_info("SIMD path %s is not supported by this CPU; skipped", SIMD_PATHS[s]);
        return 0;
    }
    cr_assert_str_eq(krn_cpu_simd_name(),
                     strncmp(SIMD_PATHS[s], "avx512", 6) && strcmp(SIMD_PATHS[s], "amx")
                         ? SIMD_PATHS[s]
                         : "avx512");
    return 1;
}

/* ---- pool ---------------------------------------------------------------------------------- */

typedef struct count_arg {
    atomic_int *hits;
    int n_tasks;
    atomic_int bad;
} count_arg;

static void count_task(void *varg, int task, int n_tasks) {
    count_arg *a = varg;
    if (task < 0 || task >= a->n_tasks || n_tasks != a->n_tasks)
        atomic_fetch_add(&a->bad, 1);
    else
        atomic_fetch_add(&a->hits[task], 1);
}

Test(krn_pool, every_task_runs_exactly_once_for_1_to_4_threads) {
    static const int sizes[] = {0, 1, 2, 3, 7, 64, 1000};
    atomic_int *hits = xmalloc(1000 * sizeof *hits);
    for (int threads = 1; threads <= 4; threads++) {
        krn_pool *p = krn_pool_create(threads);
        cr_assert_not_null(p);
        cr_assert_eq(krn_pool_size(p), threads);
        for (int rep = 0; rep < 300; rep++)
            for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
                int n = sizes[s];
                for (int i = 0; i < n; i++) atomic_init(&hits[i], 0);
                count_arg a = {.hits = hits, .n_tasks = n};
                atomic_init(&a.bad, 0);
                krn_pool_run(p, count_task, &a, n);
                cr_assert_eq(atomic_load(&a.bad), 0, "task index out of range");
                for (int i = 0; i < n; i++)
                    cr_assert_eq(atomic_load(&hits[i]), 1,
                                 "%d threads, %d tasks: task %d ran %d times", threads, n, i,
                                 atomic_load(&hits[i]));
            }
        krn_pool_destroy(p);
    }
    free(hits);
}

Test(krn_pool, null_pool_runs_in_the_caller_and_default_size_is_the_core_count) {
    atomic_int hits[5];
    for (int i = 0; i < 5; i++) atomic_init(&hits[i], 0);
    count_arg a = {.hits = hits, .n_tasks = 5};
    atomic_init(&a.bad, 0);
    krn_pool_run(NULL, count_task, &a, 5);
    for (int i = 0; i < 5; i++) cr_assert_eq(atomic_load(&hits[i]), 1);
    cr_assert_eq(krn_pool_size(NULL), 1);
    krn_pool *p = krn_pool_create(0);
    cr_assert_not_null(p);
    cr_assert_geq(krn_pool_size(p), 1);
    krn_pool_destroy(p);
    krn_pool_destroy(NULL);
}

static void sleepy_task(void *varg, int task, int n_tasks) {
    (void)n_tasks;
    count_arg *a = varg;
    struct timespec ts = {0, 200000}; /* 0.2 ms: workers fall asleep between runs */
    nanosleep(&ts, NULL);
    atomic_fetch_add(&a->hits[task], 1);
}

Test(krn_pool, runs_after_workers_went_to_sleep_still_complete) {
    krn_pool *p = krn_pool_create(3);
    cr_assert_not_null(p);
    atomic_int hits[6];
    for (int rep = 0; rep < 20; rep++) {
        for (int i = 0; i < 6; i++) atomic_init(&hits[i], 0);
        count_arg a = {.hits = hits, .n_tasks = 6};
        krn_pool_run(p, sleepy_task, &a, 6);
        for (int i = 0; i < 6; i++) cr_assert_eq(atomic_load(&hits[i]), 1);
        struct timespec ts = {0, 300000}; /* longer than the spin: workers sleep */
        nanosleep(&ts, NULL);
    }
    krn_pool_destroy(p);
}

typedef struct worker_arg {
    int threads;
    atomic_int bad;
    atomic_int hits[64];
} worker_arg;

static void worker_task(void *varg, int task, int n_tasks, int worker) {
    (void)n_tasks;
    worker_arg *a = varg;
    if (worker < 0 || worker >= a->threads) atomic_fetch_add(&a->bad, 1);
    atomic_fetch_add(&a->hits[task], 1);
}

Test(krn_pool, run_ex_names_a_worker_in_range_and_scratch_is_per_worker) {
    for (int threads = 1; threads <= 4; threads++) {
        krn_pool *p = krn_pool_create(threads);
        cr_assert_not_null(p);
        worker_arg a = {.threads = threads};
        for (int i = 0; i < 64; i++) atomic_init(&a.hits[i], 0);
        krn_pool_run_ex(p, worker_task, &a, 64);
        cr_assert_eq(atomic_load(&a.bad), 0);
        for (int i = 0; i < 64; i++) cr_assert_eq(atomic_load(&a.hits[i]), 1);
        void *first = krn_pool_scratch(p, 0, 100);
        cr_assert_not_null(first);
        cr_assert_eq((uintptr_t)first % 64, 0);
        cr_assert_eq(krn_pool_scratch(p, 0, 50), first, "a smaller request reuses the block");
        for (int w = 1; w <= threads; w++) {
            void *other = krn_pool_scratch(p, w, 100);
            cr_assert(other && other != first);
        }
        cr_assert_null(krn_pool_scratch(p, threads + 1, 8));
        krn_pool_destroy(p);
    }
}

Test(krn_simd, paths_can_be_forced_and_unknown_names_are_refused) {
    cr_assert_eq(krn_cpu_set_simd("scalar"), 0);
    cr_assert_str_eq(krn_cpu_simd_name(), "scalar");
    cr_assert_eq(krn_cpu_set_simd("avx1024"), -1);
    cr_assert_str_eq(krn_cpu_simd_name(), "scalar");
    cr_assert_eq(krn_cpu_set_simd(NULL), -1);
}

/* ---- linear -------------------------------------------------------------------------------- */

/* max over y of |y - ref| / (2^-24 · Σ|w·x|) for one krn_cpu_linear call, asserting it stays
 * within `bound` (the reference in double; x exact, or bf16(x) where the kernel rounds it). */
static double linear_error_units(krn_pool *p, rng *r, krn_dtype wt, int n, int in, int out,
                                 double bound, const char *what) {
    float *x = xmalloc((size_t)n * (size_t)in * 4);
    double *wref = xmalloc((size_t)out * (size_t)in * sizeof(double));
    float *y = xmalloc((size_t)n * (size_t)out * 4);
    fill(r, x, (size_t)n * (size_t)in);
    void *w = make_weights(r, wt, (size_t)out * (size_t)in, wref);
    for (size_t i = 0; i < (size_t)n * (size_t)out; i++) y[i] = NAN;
    krn_cpu_linear(p, x, n, in, w, wt, out, y);
    int rounds = linear_rounds_x(wt, n); /* then the reference takes bf16(x), as the kernel */
    double worst = 0;
    for (int i = 0; i < n; i++)
        for (int o = 0; o < out; o++) {
            double sum = 0, mag = 0;
            for (int k = 0; k < in; k++) {
                float xv = x[(size_t)i * (size_t)in + (size_t)k];
                double t = (double)(rounds ? ref_round_bf16(xv) : xv) *
                           wref[(size_t)o * (size_t)in + (size_t)k];
                sum += t;
                mag += fabs(t);
            }
            double got = y[(size_t)i * (size_t)out + (size_t)o];
            double units = mag > 0 ? fabs(got - sum) / (0x1p-24 * mag) : fabs(got - sum);
            cr_assert(units <= bound,
                      "linear %s %s n=%d in=%d out=%d threads=%d: y[%d,%d] = %.9g, want %.9g "
                      "(off by %.3g · 2^-24 · Σ|w·x|, bound %g)",
                      what, dtype_name(wt), n, in, out, krn_pool_size(p), i, o, got, sum, units,
                      bound);
            if (units > worst) worst = units;
        }
    free(x);
    free(wref);
    free(w);
    free(y);
    return worst;
}

/* Any path's result within 1e-5 · Σ|w·x| (~168 units of 2^-24 · Σ|w·x|): room for the longest
 * sums of the tests below in any order; dropping a product costs ~Σ|w·x| / in. */
static void check_linear(krn_pool *p, rng *r, krn_dtype wt, int n, int in, int out,
                         const char *simd) {
    (void)linear_error_units(p, r, wt, n, in, out, 1e-5 / 0x1p-24, simd);
}

Test(krn_linear, matches_reference_for_every_dtype_path_and_odd_shape) {
    static const int ns[] = {1, 2, 3, 5, 7, 8, 9, 33};
    static const int ins[] = {1, 16, 17, 65, 130};
    static const int outs[] = {1, 5, 67};
    rng r = {0x1234567u};
    krn_pool *pools[3] = {NULL, krn_pool_create(2), krn_pool_create(3)};
    cr_assert(pools[1] && pools[2]);
    for (int s = 0; s < N_SIMD; s++) {
        if (!use_simd(s)) continue;
        for (int wt = 0; wt < 3; wt++)
            for (size_t a = 0; a < sizeof ns / sizeof *ns; a++)
                for (size_t b = 0; b < sizeof ins / sizeof *ins; b++)
                    for (size_t c = 0; c < sizeof outs / sizeof *outs; c++)
                        check_linear(pools[(a + b + c) % 3], &r, (krn_dtype)wt, ns[a], ins[b],
                                     outs[c], SIMD_PATHS[s]);
    }
    krn_pool_destroy(pools[1]);
    krn_pool_destroy(pools[2]);
}

Test(krn_linear, large_shapes_use_many_tiles_and_tasks) {
    rng r = {42};
    for (int s = 0; s < N_SIMD; s++) {
        if (!use_simd(s)) continue;
        for (int threads = 1; threads <= 4; threads++) {
            krn_pool *p = krn_pool_create(threads);
            cr_assert_not_null(p);
            check_linear(p, &r, KRN_BF16, 1, 300, 700, SIMD_PATHS[s]);
            /* rows long enough for the n = 1 kernel's prefetch to run ahead, odd tail */
            check_linear(p, &r, KRN_BF16, 1, 2088, 37, SIMD_PATHS[s]);
            check_linear(p, &r, KRN_BF16, 40, 4100, 100, SIMD_PATHS[s]);
            check_linear(p, &r, KRN_F16, 12, 520, 300, SIMD_PATHS[s]);
            check_linear(p, &r, KRN_F32, 3, 257, 301, SIMD_PATHS[s]);
            /* f32 on the GEMV kernels (n <= 32 on avx512): the prefetching n = 1 rows, then
             * 6 + 6 + 4 + 3 rows of x per tile, odd K */
            check_linear(p, &r, KRN_F32, 1, 2088, 37, SIMD_PATHS[s]);
            check_linear(p, &r, KRN_F32, 19, 1030, 70, SIMD_PATHS[s]);
            check_linear(p, &r, KRN_F32, 32, 512, 40, SIMD_PATHS[s]);
            krn_pool_destroy(p);
        }
    }
}

/* bf16 weights on AMX (when the CPU and kernel have it): the same accuracy as every other
 * path (check_linear's 1e-5 · Σ|w·x|) on batch sizes from 8, odd row counts of W (the last
 * out % 16 rows take the exact path) and K up to 2048; then a probe that tells the paths
 * apart: x = 1 + 2^-10 + 2^-18 needs 19 significant bits, so the AMX path (x as two bf16
 * parts, 1 and 2^-10; 2^-18 is a tie that rounds to even) gives exactly 32 + 2^-5 for 32 such
 * products with w = 1, where the exact paths give 32 + 2^-5 + 2^-13. Every partial sum is a
 * multiple of 2^-18 below 64, so exact in f32 whatever order a path adds in. */
Test(krn_linear, bf16_on_amx_is_as_accurate_and_covers_odd_rows_and_batches) {
    const char *only = selected_path();
    if (only && strcmp(only, "amx") != 0) cr_skip_test("runs in the amx registration only");
    if (force_simd("amx") != 0) cr_skip_test("no AMX on this CPU/kernel");
    cr_assert(krn_cpu_amx_active());
    static const int ns[] = {8, 9, 16, 17, 31, 32, 33, 48, 70};
    static const int ins[] = {32, 64, 96, 2048};
    static const int outs[] = {16, 32, 48, 67, 200};
    rng r = {0xa3a3u};
    krn_pool *pools[3] = {NULL, krn_pool_create(2), krn_pool_create(3)};
    cr_assert(pools[1] && pools[2]);
    for (size_t a = 0; a < sizeof ns / sizeof *ns; a++)
        for (size_t b = 0; b < sizeof ins / sizeof *ins; b++)
            for (size_t c = 0; c < sizeof outs / sizeof *outs; c++)
                check_linear(pools[(a + b + c) % 3], &r, KRN_BF16, ns[a], ins[b], outs[c],
                             "avx512+amx");

    enum { N = 9, K = 32, OUT = 35 };
    float xs[N * K], ys[N * OUT];
    uint16_t ws[OUT * K];
    for (int i = 0; i < N * K; i++) xs[i] = 1.0f + 0x1p-10f + 0x1p-18f;
    for (int i = 0; i < OUT * K; i++) ws[i] = 0x3f80; /* 1.0 */
    xs[3 * K + 5] = INFINITY;                         /* special values survive the split */
    const float amx = 32.0f + 0x1p-5f, exact = 32.0f + 0x1p-5f + 0x1p-13f;
    krn_cpu_linear(pools[1], xs, N, K, ws, KRN_BF16, OUT, ys);
    for (int i = 0; i < N; i++)
        for (int o = 0; o < OUT; o++) {
            float want = i == 3 ? INFINITY : o < OUT / 16 * 16 ? amx : exact;
            cr_assert_eq(ys[i * OUT + o], want, "AMX on: y[%d,%d] = %.9g, want %.9g", i, o,
                         ys[i * OUT + o], want);
        }
    /* switched off (AVX512-BF16 off too), or on another SIMD path, the same call is exact */
    cr_assert_eq(krn_cpu_set_bf16dot(0), 0);
    cr_assert_eq(krn_cpu_set_amx(0), 0);
    cr_assert(!krn_cpu_amx_active());
    krn_cpu_linear(pools[1], xs, N, K, ws, KRN_BF16, OUT, ys);
    cr_assert_eq(ys[0], exact, "AMX off: y[0,0] = %.9g", ys[0]);
    cr_assert_eq(krn_cpu_set_amx(1), 0);
    cr_assert_eq(krn_cpu_set_simd("avx2"), 0);
    cr_assert(!krn_cpu_amx_active());
    krn_cpu_linear(pools[2], xs, N, K, ws, KRN_BF16, OUT, ys);
    cr_assert_eq(ys[0], exact, "avx2: y[0,0] = %.9g", ys[0]);
    cr_assert_eq(krn_cpu_set_simd("avx512"), 0);
    krn_pool_destroy(pools[1]);
    krn_pool_destroy(pools[2]);
}

/* bf16 weights × bf16-rounded x on AVX512-BF16 (VDPBF16PS; when the CPU has it, AMX off), in
 * the path's variant `variant` (krn_cpu_set_bf16dot: 1 the tiles, 2 the packed panels): the
 * reference rounds x itself (ref_round_bf16) and sums in double; what is left is f32
 * summation. The tiles' 16 lanes each add in32/16 exact products in turn and the lanes are
 * added in a tree of 4 levels, so |y - ref| <= (in32/16 + 5) · 2^-24 · Σ|w·bf16(x)| (in32 =
 * in rounded up to 32; one level spare). The panels add all `in` products in k order: the
 * worst case is (in + 2) · 2^-24 · Σ|w·bf16(x)|, too loose to notice a lost product, so they
 * get the exact paths' statistical 32 units (decode_batches_1_to_40_...; the log says the
 * largest seen). Shapes cover K tails (masked loads of W), 1-8 rows of x past a multiple of 8
 * and 1-2 rows of W past a multiple of 3 (the tiles' sizes), tiles of x and panels of W with
 * tails. Then probes whose exact sums tell nearest-even rounding of x apart from truncation or
 * ties away from zero. Returns the largest error in units of 2^-24 · Σ|w·bf16(x)|. */
static double bf16dot_check(int variant) {
    const char *only = selected_path();
    if (only && strcmp(only, "avx512bf16") != 0)
        cr_skip_test("runs in the avx512bf16 registration only");
    if (force_simd("avx512bf16") != 0) cr_skip_test("no AVX512-BF16 on this CPU");
    cr_assert_eq(krn_cpu_set_bf16dot(variant), 0);
    cr_assert(krn_cpu_bf16dot_active() && !krn_cpu_amx_active());
    double worst = 0;
    static const int ns[] = {8, 9, 15, 16, 17, 23, 31, 32};
    static const int ins[] = {1, 31, 32, 33, 96, 2048, 2050};
    static const int outs[] = {1, 2, 4, 7, 49, 67};
    rng r = {0xbf16u};
    krn_pool *pools[3] = {NULL, krn_pool_create(2), krn_pool_create(3)};
    cr_assert(pools[1] && pools[2]);
    for (size_t a = 0; a < sizeof ns / sizeof *ns; a++)
        for (size_t b = 0; b < sizeof ins / sizeof *ins; b++)
            for (size_t c = 0; c < sizeof outs / sizeof *outs; c++) {
                int n = ns[a], in = ins[b], out = outs[c], in32 = (in + 31) / 32 * 32;
                krn_pool *p = pools[(a + b + c) % 3];
                float *x = xmalloc((size_t)n * (size_t)in * 4);
                double *wref = xmalloc((size_t)out * (size_t)in * sizeof(double));
                float *y = xmalloc((size_t)n * (size_t)out * 4);
                fill(&r, x, (size_t)n * (size_t)in);
                void *w = make_weights(&r, KRN_BF16, (size_t)out * (size_t)in, wref);
                for (size_t i = 0; i < (size_t)n * (size_t)out; i++) y[i] = NAN;
                krn_cpu_linear(p, x, n, in, w, KRN_BF16, out, y);
                for (int i = 0; i < n; i++)
                    for (int o = 0; o < out; o++) {
                        double sum = 0, mag = 0;
                        for (int k = 0; k < in; k++) {
                            float xv = x[(size_t)i * (size_t)in + (size_t)k];
                            double t = (double)ref_round_bf16(xv) *
                                       wref[(size_t)o * (size_t)in + (size_t)k];
                            sum += t;
                            mag += fabs(t);
                        }
                        double got = y[(size_t)i * (size_t)out + (size_t)o];
                        double units = variant == 1 ? in32 / 16 + 5 : 32;
                        double bound = units * 0x1p-24 * mag + 1e-30;
                        cr_assert(fabs(got - sum) <= bound,
                                  "bf16 dot (variant %d) n=%d in=%d out=%d threads=%d: y[%d,%d] = "
                                  "%.9g, want %.9g (|diff| %.3g > bound %.3g)",
                                  variant, n, in, out, krn_pool_size(p), i, o, got, sum,
                                  fabs(got - sum), bound);
                        if (mag > 0 && fabs(got - sum) / (0x1p-24 * mag) > worst)
                            worst = fabs(got - sum) / (0x1p-24 * mag);
                    }
                free(x);
                free(wref);
                free(w);
                free(y);
            }

    /* w = 1; row i of x holds one value v_i in all K = 40 columns, so y = 40 · bf16(v_i)
     * exactly. 1 + 2^-8 + 2^-10 rounds up (truncation would give 40), 1 + 3·2^-8 is a tie that
     * goes to the even 1 + 2^-6 (truncation: 1 + 2^-7), 1 + 2^-8 a tie that goes to the even
     * 1 (ties away from zero: 1 + 2^-7); infinities and NaN stay. */
    enum { N = 9, K = 40, OUT = 5 };
    static const float v[N] = {1.0f + 0x1p-8f + 0x1p-10f, 1.0f + 0x3p-8f, 1.0f + 0x1p-8f,
                               -(1.0f + 0x1p-8f + 0x1p-10f), INFINITY, NAN, 0.5f, -3.0f, 0x1p-30f};
    static const float want[N] = {40.0f * (1.0f + 0x1p-7f), 40.0f * (1.0f + 0x1p-6f), 40.0f,
                                  -40.0f * (1.0f + 0x1p-7f), INFINITY, NAN, 20.0f, -120.0f,
                                  40.0f * 0x1p-30f};
    float xs[N * K], ys[N * OUT];
    uint16_t ws[OUT * K];
    for (int i = 0; i < N * K; i++) xs[i] = v[i / K];
    for (int i = 0; i < OUT * K; i++) ws[i] = 0x3f80; /* 1.0 */
    krn_cpu_linear(pools[1], xs, N, K, ws, KRN_BF16, OUT, ys);
    for (int i = 0; i < N; i++)
        for (int o = 0; o < OUT; o++) {
            float got = ys[i * OUT + o];
            cr_assert(isnan(want[i]) ? isnan(got) : got == want[i],
                      "bf16 dot probe: y[%d,%d] = %.9g, want %.9g (x = %.9g)", i, o, got, want[i],
                      v[i]);
        }
    /* 33 rows (prefill sizes) stay on the exact paths */
    enum { N33 = 33 };
    float *x33 = xmalloc((size_t)N33 * K * 4), *y33 = xmalloc((size_t)N33 * OUT * 4);
    for (int i = 0; i < N33 * K; i++) x33[i] = v[0];
    krn_cpu_linear(pools[2], x33, N33, K, ws, KRN_BF16, OUT, y33);
    for (int i = 0; i < N33 * OUT; i++)
        cr_assert_eq(y33[i], 40.0f * v[0], "bf16 dot, 33 rows: y[%d] = %.9g, want the exact %.9g",
                     i, y33[i], 40.0f * v[0]);
    free(x33);
    free(y33);
    /* switched off, the same call is exact: 40 · (1 + 2^-8 + 2^-10) */
    cr_assert_eq(krn_cpu_set_bf16dot(0), 0);
    cr_assert(!krn_cpu_bf16dot_active());
    krn_cpu_linear(pools[1], xs, N, K, ws, KRN_BF16, OUT, ys);
    cr_assert_eq(ys[0], 40.0f * v[0], "bf16 dot off: y[0,0] = %.9g", ys[0]);
    cr_assert_eq(krn_cpu_set_bf16dot(variant), 0);
    krn_pool_destroy(pools[1]);
    krn_pool_destroy(pools[2]);
    return worst;
}

Test(krn_linear, bf16_dot_rounds_x_to_nearest_even_and_sums_in_f32) {
    double worst = bf16dot_check(1);
    cr_log_info("bf16 dot tiles: largest error %.2f · 2^-24 · Σ|w·bf16(x)|", worst);
}

Test(krn_linear, bf16_dot_panels_round_x_the_same_and_sum_in_k_order) {
    double worst = bf16dot_check(2);
    cr_log_info("bf16 dot panels: largest error %.2f · 2^-24 · Σ|w·bf16(x)|", worst);
    /* several weights in one run (x packed once) write the bits of one call each */
    enum { N = 17, IN = 96, COUNT = 3 };
    static const int outs[COUNT] = {64, 48, 7};
    rng r = {0xd07u};
    krn_pool *p = krn_pool_create(2);
    cr_assert_not_null(p);
    float x[N * IN], *y1[COUNT], *y2[COUNT];
    void *w[COUNT];
    krn_linear_out lo[COUNT];
    fill(&r, x, N * IN);
    for (int k = 0; k < COUNT; k++) {
        double *wref = xmalloc((size_t)outs[k] * IN * sizeof(double));
        w[k] = make_weights(&r, KRN_BF16, (size_t)outs[k] * IN, wref);
        free(wref);
        y1[k] = xmalloc((size_t)N * (size_t)outs[k] * 4);
        y2[k] = xmalloc((size_t)N * (size_t)outs[k] * 4);
        krn_cpu_linear(p, x, N, IN, w[k], KRN_BF16, outs[k], y1[k]);
        lo[k] = (krn_linear_out){.w = w[k], .out = outs[k], .y = y2[k]};
    }
    krn_cpu_linear_multi(p, x, N, IN, KRN_BF16, lo, COUNT);
    for (int k = 0; k < COUNT; k++) {
        cr_assert(memcmp(y1[k], y2[k], (size_t)N * (size_t)outs[k] * 4) == 0,
                  "bf16 dot panels out=%d: multi differs from the single call", outs[k]);
        free(w[k]);
        free(y1[k]);
        free(y2[k]);
    }
    krn_pool_destroy(p);
    cr_assert_eq(krn_cpu_set_bf16dot(1), 0); /* the default variant for the other tests */
}

/* Decode batches on the exact paths, every n from 1 to 40 (on avx512: the GEMV kernels below 4
 * rows (f16: 24), the packed panels of krn_panel.c from there — tiles of up to 12 rows, 32
 * outputs, 128 columns per block — up to 256, then the sgemm tiles), bf16 and f16, pools of 1
 * and 2 threads, `in` not a multiple of 16 (a block tail, an odd last pair) and `out` not a
 * multiple of a panel. The bound is tight: 32 · 2^-24 · Σ|w·x| (check_linear allows 1e-5, ~168
 * units). Every path sums in f32 with one rounding per step, and with these zero-mean inputs
 * the roundings do not add up the worst-case way (in · 2^-24): the largest error seen was 7.3
 * units (f16, whose weights span 10 binades, at in = 45; the log says each run's largest).
 * Losing one product (say the last column) costs about Σ|w·x| / in, over 2^14 units here. On
 * avx512 the panel path is also switched off to keep the 4 × 6 GEMV tiles it replaced checked
 * (PIE_KRN_PANEL=0, and the fallback when scratch memory runs out). */
Test(krn_linear, decode_batches_1_to_40_on_exact_paths_are_within_32_units) {
    static const int shapes[][2] = {{45, 67}, {300, 33}, {531, 67}}; /* {in, out} */
    const double bound = 32;
    rng r = {0x40404u};
    krn_pool *pools[2] = {krn_pool_create(1), krn_pool_create(2)};
    cr_assert(pools[0] && pools[1]);
    for (int s = 0; s < 3; s++) { /* scalar, avx2, avx512: the exact paths */
        if (!use_simd(s)) continue;
        double worst = 0;
        for (int panel = 1; panel >= (s == 2 ? 0 : 1); panel--) {
            krn_cpu_set_panel(panel);
            for (size_t sh = 0; sh < sizeof shapes / sizeof *shapes; sh++) {
                if (!panel && sh > 0) continue;
                for (int wt = KRN_F16; wt <= KRN_BF16; wt++)
                    for (int n = 1; n <= 40; n++)
                        for (int t = 0; t < 2; t++) {
                            double e = linear_error_units(pools[t], &r, (krn_dtype)wt, n,
                                                          shapes[sh][0], shapes[sh][1], bound,
                                                          panel ? SIMD_PATHS[s] : "avx512 tiles");
                            if (e > worst) worst = e;
                        }
            }
        }
        krn_cpu_set_panel(1);
        /* no pool: the panel path allocates its own buffers */
        for (int n = 4; n <= 33; n += 29)
            linear_error_units(NULL, &r, KRN_BF16, n, 531, 67, bound, SIMD_PATHS[s]);
        /* prefill sizes: the last on panels (256 rows, 22 tiles) and the first past them */
        for (int n = 255; n <= 257; n++)
            for (int wt = KRN_F16; wt <= KRN_BF16; wt++)
                linear_error_units(pools[1], &r, (krn_dtype)wt, n, 45, 67, bound, SIMD_PATHS[s]);
        cr_log_info("%s: largest linear error %.2f · 2^-24 · Σ|w·x| (bound %g)", SIMD_PATHS[s],
                    worst, bound);
    }
    krn_pool_destroy(pools[0]);
    krn_pool_destroy(pools[1]);
}

/* Several weights reading one x in one call write the bits of one call per weight, on every
 * path (the AMX one packs x once and runs every weight's rows in one pool run; an `out` below
 * 16 or f32 weights take the separate calls). */
Test(krn_linear, multi_equals_one_call_per_weight_bit_for_bit) {
    static const int ns[] = {1, 8, 17, 32, 40};
    static const int outs_a[] = {64, 200, 16}, outs_b[] = {16, 48, 7}, outs_c[] = {32, 67, 64};
    static const krn_dtype dts[] = {KRN_BF16, KRN_F16, KRN_F32};
    enum { IN = 96 };
    rng r = {0x5eedu};
    for (int si = 0; si < N_SIMD; si++) {
        if (!use_simd(si)) continue;
        krn_pool *p = krn_pool_create(2 + si % 2);
        cr_assert_not_null(p);
        for (size_t a = 0; a < sizeof ns / sizeof *ns; a++)
            for (size_t d = 0; d < sizeof dts / sizeof *dts; d++)
                for (size_t c = 0; c < 3; c++) {
                    int n = ns[a], o[3] = {outs_a[c], outs_b[c], outs_c[c]};
                    float *x = xmalloc((size_t)n * IN * 4);
                    fill(&r, x, (size_t)n * IN);
                    void *w[3];
                    float *y1[3], *y2[3];
                    krn_linear_out lo[3];
                    for (int k = 0; k < 3; k++) {
                        double *wref = xmalloc((size_t)o[k] * IN * sizeof(double));
                        w[k] = make_weights(&r, dts[d], (size_t)o[k] * IN, wref);
                        free(wref);
                        y1[k] = xmalloc((size_t)n * (size_t)o[k] * 4);
                        y2[k] = xmalloc((size_t)n * (size_t)o[k] * 4);
                        for (size_t i = 0; i < (size_t)n * (size_t)o[k]; i++) y2[k][i] = NAN;
                        krn_cpu_linear(p, x, n, IN, w[k], dts[d], o[k], y1[k]);
                        lo[k] = (krn_linear_out){.w = w[k], .out = o[k], .y = y2[k]};
                    }
                    krn_cpu_linear_multi(p, x, n, IN, dts[d], lo, 3);
                    for (int k = 0; k < 3; k++) {
                        cr_assert(memcmp(y1[k], y2[k], (size_t)n * (size_t)o[k] * 4) == 0,
                                  "%s %s n=%d out=%d: multi differs from the single call",
                                  SIMD_PATHS[si], dtype_name(dts[d]), n, o[k]);
                        free(w[k]);
                        free(y1[k]);
                        free(y2[k]);
                    }
                    free(x);
                }
        krn_pool_destroy(p);
    }
}

/* ---- element-wise -------------------------------------------------------------------------- */

Test(krn_vec, rmsnorm_matches_reference_in_place_and_not) {
    static const int ds[] = {1, 7, 16, 64, 65, 1030, 2500};
    rng r = {7};
    for (int s = 0; s < N_SIMD; s++) {
        if (!use_simd(s)) continue;
        for (int wt = 0; wt < 3; wt++)
            for (size_t di = 0; di < sizeof ds / sizeof *ds; di++) {
                int d = ds[di], n = 3;
                float *x = xmalloc((size_t)n * (size_t)d * 4),
                      *y = xmalloc((size_t)n * (size_t)d * 4);
                double *wref = xmalloc((size_t)d * sizeof(double));
                fill(&r, x, (size_t)n * (size_t)d);
                void *w = make_weights(&r, (krn_dtype)wt, (size_t)d, wref);
                krn_cpu_rmsnorm(x, w, (krn_dtype)wt, n, d, 1e-5f, y);
                for (int i = 0; i < n; i++) {
                    double ss = 0;
                    for (int k = 0; k < d; k++) ss += (double)x[i * d + k] * x[i * d + k];
                    double inv = 1.0 / sqrt(ss / d + 1e-5);
                    for (int k = 0; k < d; k++) {
                        double want = x[i * d + k] * inv * wref[k];
                        cr_assert(fabs(y[i * d + k] - want) <= 1e-5 * (fabs(want) + 1e-3),
                                  "rmsnorm %s %s d=%d: y[%d,%d] = %.9g, want %.9g", SIMD_PATHS[s],
                                  dtype_name((krn_dtype)wt), d, i, k, y[i * d + k], want);
                    }
                }
                krn_cpu_rmsnorm(x, w, (krn_dtype)wt, n, d, 1e-5f, x); /* y == x */
                cr_assert_arr_eq(x, y, (size_t)n * (size_t)d * 4, "rmsnorm in place differs");
                free(x);
                free(y);
                free(wref);
                free(w);
            }
    }
}

Test(krn_vec, add_and_silu_mul_match_reference) {
    static const size_t ns[] = {0, 1, 7, 15, 16, 17, 100, 1001};
    rng r = {9};
    for (int s = 0; s < N_SIMD; s++) {
        if (!use_simd(s)) continue;
        for (size_t a = 0; a < sizeof ns / sizeof *ns; a++) {
            size_t n = ns[a];
            float *x = xmalloc(n * 4), *y = xmalloc(n * 4), *x0 = xmalloc(n * 4);
            fill(&r, x, n);
            fill(&r, y, n);
            for (size_t i = 0; i < n; i++)
                x[i] *= 30.0f; /* gates from -30 to 30: both tails of the sigmoid */
            memcpy(x0, x, n * 4);
            krn_cpu_add(x, y, n);
            for (size_t i = 0; i < n; i++)
                cr_assert_eq(x[i], x0[i] + y[i], "add %s n=%zu at %zu", SIMD_PATHS[s], n, i);
            memcpy(x, x0, n * 4);
            krn_cpu_silu_mul(x, y, n);
            for (size_t i = 0; i < n; i++) {
                double g = x0[i], want = g / (1.0 + exp(-g)) * y[i];
                cr_assert(fabs(x[i] - want) <= 1e-6 * fabs(want) + 1e-30,
                          "silu_mul %s n=%zu: [%zu] = %.9g, want %.9g (gate %g)", SIMD_PATHS[s], n,
                          i, x[i], want, g);
            }
            free(x);
            free(y);
            free(x0);
        }
    }
}

Test(krn_vec, silu_mul_of_extreme_gates_is_finite) {
    float g[4] = {-200.0f, -88.0f, 88.0f, 200.0f}, u[4] = {1, 1, 1, 1};
    for (int s = 0; s < N_SIMD; s++) {
        if (!use_simd(s)) continue;
        float x[4];
        memcpy(x, g, sizeof x);
        krn_cpu_silu_mul(x, u, 4);
        cr_assert(fabs(x[0]) < 1e-30 && fabs(x[1]) < 1e-30, "%s: silu(-200) = %g", SIMD_PATHS[s],
                  x[0]);
        cr_assert_eq(x[2], 88.0f);
        cr_assert_eq(x[3], 200.0f);
    }
}

Test(krn_vec, embed_gathers_rows_of_every_dtype_exactly) {
    rng r = {11};
    int vocab = 37, d = 67;
    uint32_t tokens[6] = {0, 36, 5, 5, 17, 1};
    for (int s = 0; s < N_SIMD; s++) {
        if (!use_simd(s)) continue;
        for (int wt = 0; wt < 3; wt++) {
            double *ref = xmalloc((size_t)vocab * (size_t)d * sizeof(double));
            void *table = make_weights(&r, (krn_dtype)wt, (size_t)vocab * (size_t)d, ref);
            float out[6 * 67];
            krn_cpu_embed(table, (krn_dtype)wt, d, tokens, 6, out);
            for (int i = 0; i < 6; i++)
                for (int k = 0; k < d; k++)
                    cr_assert_eq((double)out[i * d + k],
                                 ref[(size_t)tokens[i] * (size_t)d + (size_t)k],
                                 "embed %s %s row %d col %d", SIMD_PATHS[s],
                                 dtype_name((krn_dtype)wt), i, k);
            free(ref);
            free(table);
        }
    }
}

Test(krn_vec, f16_conversion_is_exact_for_every_bit_pattern) {
    /* every f16 value through embed: a table of all 65536 patterns */
    uint16_t *table = xmalloc(65536 * 2);
    for (uint32_t i = 0; i < 65536; i++) table[i] = (uint16_t)i;
    uint32_t tok = 0;
    float *out = xmalloc(65536 * 4);
    for (int s = 0; s < N_SIMD; s++) {
        if (!use_simd(s)) continue;
        krn_cpu_embed(table, KRN_F16, 65536, &tok, 1, out);
        for (uint32_t i = 0; i < 65536; i++) {
            int exp = (i >> 10) & 31;
            if (exp == 31) {
                if (i & 1023)
                    cr_assert(isnan(out[i]), "%s: f16 %#x should be NaN", SIMD_PATHS[s], i);
                else
                    cr_assert(isinf(out[i]) && (out[i] < 0) == (i >> 15), "%s: f16 %#x",
                              SIMD_PATHS[s], i);
            } else {
                cr_assert_eq((double)out[i], ref_f16((uint16_t)i), "%s: f16 %#x -> %.9g",
                             SIMD_PATHS[s], i, out[i]);
            }
        }
    }
    free(table);
    free(out);
}

/* ---- RoPE ---------------------------------------------------------------------------------- */

Test(krn_rope, frequencies_without_scaling_follow_theta) {
    float f[64];
    krn_cpu_rope_freqs(f, 128, 10000.0f, 0.0f, 0.0f, 0.0f, 0);
    for (int j = 0; j < 64; j++) {
        double want = pow(10000.0, -2.0 * j / 128.0);
        cr_assert(fabs(f[j] - want) <= 1e-7 * want, "inv_freq[%d] = %.9g, want %.9g", j, f[j],
                  want);
    }
}

Test(krn_rope, llama3_scaling_matches_the_three_bands) {
    /* Llama 3.2 1B: theta 500000, head_dim 64, factor 32, low 1, high 4, original 8192 */
    float f[32];
    krn_cpu_rope_freqs(f, 64, 500000.0f, 32.0f, 1.0f, 4.0f, 8192);
    int bands[3] = {0, 0, 0};
    for (int j = 0; j < 32; j++) {
        double base = pow(500000.0, -2.0 * j / 64.0);
        double wavelen = 2.0 * M_PI / base, want;
        if (wavelen < 8192.0 / 4.0) {
            want = base;
            bands[0]++;
        } else if (wavelen > 8192.0 / 1.0) {
            want = base / 32.0;
            bands[2]++;
        } else {
            double smooth = (8192.0 / wavelen - 1.0) / (4.0 - 1.0);
            want = (1.0 - smooth) * base / 32.0 + smooth * base;
            bands[1]++;
        }
        cr_assert(fabs(f[j] - want) <= 2e-7 * want, "inv_freq[%d] = %.9g, want %.9g", j, f[j],
                  want);
    }
    cr_assert(bands[0] > 0 && bands[1] > 0 && bands[2] > 0,
              "bands %d/%d/%d: every branch must be hit", bands[0], bands[1], bands[2]);
    /* the first frequency is untouched (1.0), the last is divided by the factor */
    cr_assert_eq(f[0], 1.0f);
}

Test(krn_rope, rotation_follows_rotate_half) {
    rng r = {13};
    int n = 3, heads = 5, hd = 34, half = 17;
    float inv[17];
    krn_cpu_rope_freqs(inv, hd, 10000.0f, 8.0f, 1.0f, 4.0f, 64);
    uint32_t pos[3] = {0, 7, 300};
    float x[3 * 5 * 34], x0[3 * 5 * 34];
    fill(&r, x, sizeof x / 4);
    memcpy(x0, x, sizeof x);
    krn_cpu_rope(x, pos, n, heads, hd, inv);
    for (int i = 0; i < n; i++)
        for (int h = 0; h < heads; h++)
            for (int j = 0; j < half; j++) {
                /* the angle rounded to f32 like HF; then exact trigonometry */
                double a = (double)((float)pos[i] * inv[j]);
                const float *v = x0 + (i * heads + h) * hd;
                double lo = v[j] * cos(a) - v[j + half] * sin(a);
                double hi = v[j + half] * cos(a) + v[j] * sin(a);
                const float *g = x + (i * heads + h) * hd;
                cr_assert(fabs(g[j] - lo) < 1e-6 && fabs(g[j + half] - hi) < 1e-6,
                          "rope pos %u head %d pair %d: (%g, %g), want (%g, %g)", pos[i], h, j,
                          g[j], g[j + half], lo, hi);
            }
}

/* ---- softmax / top-k ----------------------------------------------------------------------- */

Test(krn_dist, softmax_matches_reference_with_temperature_and_large_logits) {
    static const int ns[] = {1, 2, 15, 17, 1000, 128256};
    static const float temps[] = {1.0f, 0.7f, 2.5f};
    rng r = {17};
    for (int s = 0; s < N_SIMD; s++) {
        if (!use_simd(s)) continue;
        for (size_t a = 0; a < sizeof ns / sizeof *ns; a++)
            for (size_t t = 0; t < 3; t++) {
                int n = ns[a];
                float *x = xmalloc((size_t)n * 4), *x0 = xmalloc((size_t)n * 4);
                for (int i = 0; i < n; i++)
                    x[i] = 1000.0f + 20.0f * rng_f(&r); /* exp would overflow without the max */
                memcpy(x0, x, (size_t)n * 4);
                krn_cpu_softmax(x, n, temps[t]);
                double mx = -INFINITY, sum = 0;
                for (int i = 0; i < n; i++) mx = x0[i] > mx ? x0[i] : mx;
                for (int i = 0; i < n; i++) sum += exp((x0[i] - mx) / temps[t]);
                for (int i = 0; i < n; i++) {
                    double want = exp((x0[i] - mx) / temps[t]) / sum;
                    cr_assert(fabs(x[i] - want) <= 1e-5 * want + 1e-37,
                              "softmax %s n=%d T=%g: p[%d] = %.9g, want %.9g", SIMD_PATHS[s], n,
                              temps[t], i, x[i], want);
                }
                free(x);
                free(x0);
            }
    }
}

Test(krn_dist, softmax_with_zero_temperature_is_one_hot_on_the_first_max) {
    float x[5] = {1, 3, 2, 3, -1};
    krn_cpu_softmax(x, 5, 0.0f);
    float want[5] = {0, 1, 0, 0, 0};
    cr_assert_arr_eq(x, want, sizeof x);
}

/* The edges (the cuda backend's top-k is held to the same, tests/kcheck): NaN is left out of
 * the max and the sum and stays NaN; +inf, or 1/T overflowing, is the T → 0 limit. 33 values
 * reach the vector loops and their tails. */
Test(krn_dist, softmax_leaves_nan_out_and_puts_all_mass_on_the_first_infinity) {
    for (int s = 0; s < N_SIMD; s++) {
        if (!use_simd(s)) continue;
        float x[33];
        for (int i = 0; i < 33; i++) x[i] = (float)(i % 5);
        x[0] = x[17] = x[32] = NAN;
        krn_cpu_softmax(x, 33, 1.0f);
        double sum = 0, z = 0;
        for (int i = 1; i < 32; i++) z += i == 17 ? 0 : exp((i % 5) - 4.0);
        for (int i = 0; i < 33; i++) {
            if (i == 0 || i == 17 || i == 32) {
                cr_assert(isnan(x[i]), "%s: p[%d] = %g, want NaN", SIMD_PATHS[s], i, x[i]);
                continue;
            }
            double want = exp((i % 5) - 4.0) / z;
            cr_assert(fabs(x[i] - want) <= 1e-6 * want, "%s: p[%d] = %.9g, want %.9g",
                      SIMD_PATHS[s], i, x[i], want);
            sum += x[i];
        }
        cr_assert(fabs(sum - 1) < 1e-5, "%s: the numbers sum to %g", SIMD_PATHS[s], sum);

        float y[33];
        for (int i = 0; i < 33; i++) y[i] = (float)i;
        y[9] = y[20] = INFINITY, y[3] = NAN;
        krn_cpu_softmax(y, 33, 1.0f);
        for (int i = 0; i < 33; i++)
            if (i == 3)
                cr_assert(isnan(y[i]), "%s: NaN stays NaN", SIMD_PATHS[s]);
            else
                cr_assert_eq(y[i], i == 9 ? 1.0f : 0.0f, "%s: +inf: p[%d] = %g", SIMD_PATHS[s], i,
                             y[i]);
        for (int i = 0; i < 33; i++) y[i] = i == 30 || i == 31 ? 2.0f : 1.0f;
        krn_cpu_softmax(y, 33, 1e-40f); /* 1 / T overflows */
        for (int i = 0; i < 33; i++)
            cr_assert_eq(y[i], i == 30 ? 1.0f : 0.0f, "%s: tiny T: p[%d] = %g", SIMD_PATHS[s], i,
                         y[i]);
        for (int i = 0; i < 33; i++) y[i] = NAN;
        krn_cpu_softmax(y, 33, 1.0f);
        for (int i = 0; i < 33; i++) cr_assert(isnan(y[i]), "%s: all NaN stays NaN", SIMD_PATHS[s]);
    }
}

/* The first largest number (found by a SIMD pass) takes all mass in the limit T -> 0: the
 * first of equal maxima past a vector's width, -0 equal to +0, and -inf when every number is
 * -inf (NaN left out). */
Test(krn_dist, softmax_limit_puts_the_mass_on_the_first_largest_number_on_every_path) {
    enum { N = 100 };
    float x[3][N];
    int want[3] = {33, 3, 1};
    for (int i = 0; i < N; i++) {
        x[0][i] = i == 33 || i == 70 ? 7.0f : 1.0f;
        x[1][i] = i < 3 ? -1.0f : i == 3 ? -0.0f : 0.0f;
        x[2][i] = i == 0 || i == 50 ? NAN : -INFINITY;
    }
    for (int s = 0; s < N_SIMD; s++) {
        if (!use_simd(s)) continue;
        for (int c = 0; c < 3; c++) {
            float y[N];
            memcpy(y, x[c], sizeof y);
            krn_cpu_softmax(y, N, 1e-40f);
            for (int i = 0; i < N; i++)
                if (isnan(x[c][i]))
                    cr_assert(isnan(y[i]), "%s case %d: NaN stays NaN", SIMD_PATHS[s], c);
                else
                    cr_assert_eq(y[i], i == want[c] ? 1.0f : 0.0f, "%s case %d: p[%d] = %g",
                                 SIMD_PATHS[s], c, i, y[i]);
        }
    }
}

Test(krn_dist, underflowed_probabilities_rank_by_id_not_by_logit) {
    float x[40];
    for (int i = 0; i < 40; i++) x[i] = i % 2 ? -300.0f : -200.0f;
    x[3] = 5.0f;
    for (int s = 0; s < N_SIMD; s++) {
        if (!use_simd(s)) continue;
        float p[40];
        memcpy(p, x, sizeof p);
        krn_cpu_softmax(p, 40, 1.0f);
        uint32_t ids[6];
        float vals[6];
        krn_cpu_topk(p, 40, 6, ids, vals);
        uint32_t want[6] = {3, 0, 1, 2, 4, 5};
        cr_assert_arr_eq(ids, want, sizeof ids, "%s: zeros must follow in id order", SIMD_PATHS[s]);
        cr_assert_eq(vals[1], 0.0f, "%s: e^-205 underflows to 0", SIMD_PATHS[s]);
    }
}

static int cmp_desc(const void *a, const void *b, void *varg) {
    const float *x = varg;
    uint32_t ia = *(const uint32_t *)a, ib = *(const uint32_t *)b;
    if (x[ia] != x[ib]) return x[ia] > x[ib] ? -1 : 1;
    return ia < ib ? -1 : 1;
}

Test(krn_dist, topk_matches_a_full_sort_with_ties_to_the_lower_index) {
    static const int ns[] = {1, 5, 100, 5000};
    static const int ks[] = {1, 2, 5, 64, 5000};
    rng r = {19};
    for (size_t a = 0; a < sizeof ns / sizeof *ns; a++)
        for (size_t b = 0; b < sizeof ks / sizeof *ks; b++) {
            int n = ns[a], k = ks[b] < n ? ks[b] : n;
            float *x = xmalloc((size_t)n * 4);
            for (int i = 0; i < n; i++) x[i] = (float)(rng_next(&r) % 23); /* many ties */
            uint32_t *order = xmalloc((size_t)n * 4), *ids = xmalloc((size_t)k * 4);
            float *vals = xmalloc((size_t)k * 4);
            for (int i = 0; i < n; i++) order[i] = (uint32_t)i;
            qsort_r(order, (size_t)n, 4, cmp_desc, x);
            krn_cpu_topk(x, n, k, ids, vals);
            for (int i = 0; i < k; i++) {
                cr_assert_eq(ids[i], order[i], "topk n=%d k=%d: ids[%d] = %u, want %u", n, k, i,
                             ids[i], order[i]);
                cr_assert_eq(vals[i], x[order[i]]);
            }
            free(x);
            free(order);
            free(ids);
            free(vals);
        }
}

Test(krn_dist, topk_ranks_nan_last) {
    float x[5] = {NAN, 1.0f, -INFINITY, NAN, 2.0f};
    uint32_t ids[5];
    float vals[5];
    krn_cpu_topk(x, 5, 5, ids, vals);
    uint32_t want[5] = {4, 1, 2, 0, 3};
    cr_assert_arr_eq(ids, want, sizeof ids);
}

/* Ranks x[a] and x[b] as the top-k does: larger first, NaN last, ties to the lower index. */
static int cmp_rank(const void *a, const void *b, void *varg) {
    const float *x = varg;
    uint32_t ia = *(const uint32_t *)a, ib = *(const uint32_t *)b;
    int na = isnan(x[ia]), nb = isnan(x[ib]);
    if (na != nb) return na ? 1 : -1;
    if (!na && x[ia] != x[ib]) return x[ia] > x[ib] ? -1 : 1;
    return ia < ib ? -1 : 1;
}

/* A vocabulary-sized row (not a multiple of 16) of few distinct values, NaNs and infinities,
 * on every SIMD path (the scan skips numbers 8 or 16 at a time, from a floor taken from block
 * maxima when k <= n / 128: k = 1, 50, 1000 here): the same ids and values as a
 * full sort, for k = 1, a sampling k, and k = n; a row that starts with NaNs makes the heap's
 * root NaN until numbers push them out, and a row of mostly NaN keeps NaNs in the result. */
Test(krn_dist, topk_of_a_vocabulary_with_ties_nan_and_inf_matches_a_full_sort) {
    enum { N = 128256 + 5 };
    static const int ks[] = {1, 50, 1000, N};
    float *x = xmalloc((size_t)N * 4);
    uint32_t *order = xmalloc((size_t)N * 4), *ids = xmalloc((size_t)N * 4);
    float *vals = xmalloc((size_t)N * 4);
    rng r = {41};
    for (int row = 0; row < 3; row++) {
        for (int i = 0; i < N; i++) {
            uint64_t v = rng_next(&r) % 1000;
            x[i] = v < 5 ? NAN : v < 7 ? -INFINITY : v == 7 ? INFINITY : (float)(v % 97) * 0.25f;
        }
        if (row == 1)
            for (int i = 0; i < 2000; i++) x[i] = NAN;
        if (row == 2) /* ~100 numbers: k = 1000 ends with NaNs, the lowest ids first */
            for (int i = 0; i < N; i++)
                if (i % 1283 != 7) x[i] = NAN;
        for (int i = 0; i < N; i++) order[i] = (uint32_t)i;
        qsort_r(order, N, 4, cmp_rank, x);
        for (int s = 0; s < N_SIMD; s++) {
            if (!use_simd(s)) continue;
            for (size_t b = 0; b < sizeof ks / sizeof *ks; b++) {
                int k = ks[b];
                krn_cpu_topk(x, N, k, ids, vals);
                for (int i = 0; i < k; i++) {
                    cr_assert_eq(ids[i], order[i], "%s row %d k=%d: ids[%d] = %u, want %u",
                                 SIMD_PATHS[s], row, k, i, ids[i], order[i]);
                    cr_assert(memcmp(&vals[i], &x[order[i]], 4) == 0, "%s row %d k=%d: vals[%d]",
                              SIMD_PATHS[s], row, k, i);
                }
            }
        }
    }
    free(x);
    free(order);
    free(ids);
    free(vals);
}

/* Tensor parallelism (engine/eng_cpu_tp.c): a rank's exponentials with the group's maximum are
 * the softmax's before its scaling, bit for bit over the whole, and to rounding over slices. */
Test(krn_dist, exp_shifted_over_slices_reproduces_the_softmax) {
    static const int cuts[] = {0, 333, 334, 701, 1000}; /* 4 uneven slices */
    rng r = {23};
    for (int s = 0; s < N_SIMD; s++) {
        if (!use_simd(s)) continue;
        float x[1000], p[1000], e[1000];
        for (int i = 0; i < 1000; i++) x[i] = 8.0f * rng_f(&r);
        x[5] = x[400] = NAN;
        float mx = -INFINITY;
        for (int i = 0; i < 1000; i++) mx = !isnan(x[i]) && x[i] > mx ? x[i] : mx;
        memcpy(p, x, sizeof p);
        krn_cpu_softmax(p, 1000, 0.7f);
        memcpy(e, x, sizeof e);
        float whole = krn_cpu_exp_shifted(e, 1000, mx, 0.7f);
        for (int i = 0; i < 1000; i++) {
            float q = e[i] * (1.0f / whole);
            cr_assert(isnan(p[i]) ? isnan(q) : q == p[i], "%s: whole: p[%d] = %.9g, want %.9g",
                      SIMD_PATHS[s], i, q, p[i]);
        }
        memcpy(e, x, sizeof e);
        double sum = 0;
        for (int c = 0; c < 4; c++)
            sum += krn_cpu_exp_shifted(e + cuts[c], cuts[c + 1] - cuts[c], mx, 0.7f);
        for (int i = 0; i < 1000; i++) {
            float q = e[i] * (1.0f / (float)sum);
            cr_assert(isnan(p[i]) ? isnan(q) : fabsf(q - p[i]) <= 1e-6f * p[i],
                      "%s: slices: p[%d] = %.9g, want %.9g", SIMD_PATHS[s], i, q, p[i]);
        }
    }
}

/* The merge of slices' top-k lists is the top-k of the whole, ties and NaN included. */
Test(krn_dist, topk_merge_of_slices_equals_the_topk_of_the_whole) {
    static const int cuts[] = {0, 1, 130, 131, 400}; /* slices of 1, 129, 1 and 269 */
    static const int ks[] = {1, 3, 64, 200, 400};
    rng r = {29};
    float x[400];
    for (int i = 0; i < 400; i++) x[i] = (float)(rng_next(&r) % 17); /* many ties */
    x[0] = x[77] = x[399] = NAN;
    for (size_t a = 0; a < sizeof ks / sizeof *ks; a++) {
        int k = ks[a];
        uint32_t want_ids[400], ids[4][400], got_ids[400];
        float want_vals[400], vals[4][400], got_vals[400];
        krn_cpu_topk(x, 400, k, want_ids, want_vals);
        const uint32_t *lid[4];
        const float *lval[4];
        int counts[4];
        for (int c = 0; c < 4; c++) {
            int len = cuts[c + 1] - cuts[c];
            counts[c] = k < len ? k : len;
            krn_cpu_topk(x + cuts[c], len, counts[c], ids[c], vals[c]);
            for (int i = 0; i < counts[c]; i++) ids[c][i] += (uint32_t)cuts[c];
            lid[c] = ids[c];
            lval[c] = vals[c];
        }
        krn_cpu_topk_merge(lid, lval, counts, 4, 0.5f, k, got_ids, got_vals);
        for (int i = 0; i < k; i++) {
            cr_assert_eq(got_ids[i], want_ids[i], "k=%d: ids[%d] = %u, want %u", k, i, got_ids[i],
                         want_ids[i]);
            cr_assert(isnan(want_vals[i]) ? isnan(got_vals[i]) : got_vals[i] == 0.5f * want_vals[i],
                      "k=%d: vals[%d] = %g, want %g", k, i, got_vals[i], 0.5f * want_vals[i]);
        }
    }
}

/* ---- attention ----------------------------------------------------------------------------- */

typedef struct attn_case {
    int n_q, n_ctx, n_tail, q_offset;
    int use_mask; /* 0: causal; 1: random mask with row 0 fully masked */
} attn_case;

typedef struct attn_setup {
    krn_kv_layer kv;
    int n_pages;
    krn_attn_item *items;
    int n_items;
    uint32_t **pages;
    float **q, **out, **kt, **vt;
    uint8_t **mask;
} attn_setup;

/* Builds a KV region whose pages are handed out in a shuffled order. */
static void attn_build(attn_setup *s, rng *r, const attn_case *cases, int n_items, int page_size,
                       int n_kv, int hd, int n_heads) {
    memset(s, 0, sizeof *s);
    s->n_items = n_items;
    int total_pages = 0;
    for (int i = 0; i < n_items; i++) total_pages += (cases[i].n_ctx + page_size - 1) / page_size;
    s->n_pages = total_pages + 3; /* some unused pages */
    size_t tok = (size_t)n_kv * (size_t)hd;
    size_t floats = (size_t)s->n_pages * 2 * (size_t)page_size * tok;
    float *base = xmalloc(floats * 4);
    for (size_t i = 0; i < floats; i++) base[i] = NAN; /* unused slots must never be read */
    s->kv.base = base;
    s->kv.page_size = page_size;
    s->kv.n_kv_heads = n_kv;
    s->kv.head_dim = hd;
    uint32_t *perm = xmalloc((size_t)s->n_pages * 4);
    for (int i = 0; i < s->n_pages; i++) perm[i] = (uint32_t)i;
    for (int i = s->n_pages - 1; i > 0; i--) {
        int j = (int)(rng_next(r) % (uint64_t)(i + 1));
        uint32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    s->items = calloc((size_t)n_items, sizeof *s->items);
    s->pages = calloc((size_t)n_items, sizeof *s->pages);
    s->q = calloc((size_t)n_items, sizeof *s->q);
    s->out = calloc((size_t)n_items, sizeof *s->out);
    s->kt = calloc((size_t)n_items, sizeof *s->kt);
    s->vt = calloc((size_t)n_items, sizeof *s->vt);
    s->mask = calloc((size_t)n_items, sizeof *s->mask);
    cr_assert(s->items && s->pages && s->q && s->out && s->kt && s->vt && s->mask);
    int next_page = 0;
    for (int i = 0; i < n_items; i++) {
        const attn_case *c = &cases[i];
        krn_attn_item *it = &s->items[i];
        int np = (c->n_ctx + page_size - 1) / page_size;
        s->pages[i] = xmalloc((size_t)(np ? np : 1) * 4);
        for (int pg = 0; pg < np; pg++) s->pages[i][pg] = perm[next_page++];
        for (int t = 0; t < c->n_ctx; t++) {
            fill(r, krn_kv_k(&s->kv, s->pages[i][t / page_size], t % page_size), tok);
            fill(r, krn_kv_v(&s->kv, s->pages[i][t / page_size], t % page_size), tok);
        }
        size_t qn = (size_t)c->n_q * (size_t)n_heads * (size_t)hd;
        s->q[i] = xmalloc(qn * 4);
        for (size_t k = 0; k < qn; k++)
            s->q[i][k] = 3.0f * rng_f(r); /* peaky enough that the max matters */
        s->out[i] = xmalloc(qn * 4);
        s->kt[i] = xmalloc((size_t)(c->n_tail ? c->n_tail : 1) * tok * 4);
        s->vt[i] = xmalloc((size_t)(c->n_tail ? c->n_tail : 1) * tok * 4);
        fill(r, s->kt[i], (size_t)c->n_tail * tok);
        fill(r, s->vt[i], (size_t)c->n_tail * tok);
        int keys = c->n_ctx + c->n_tail;
        if (c->use_mask) {
            s->mask[i] = xmalloc((size_t)c->n_q * (size_t)keys + 1);
            for (int qi = 0; qi < c->n_q; qi++)
                for (int t = 0; t < keys; t++)
                    s->mask[i][qi * keys + t] = qi == 0 ? 0 : (rng_next(r) % 3 != 0);
        }
        it->q = s->q[i];
        it->out = s->out[i];
        it->n_q = c->n_q;
        it->pages = s->pages[i];
        it->n_ctx = c->n_ctx;
        it->k_tail = c->n_tail ? s->kt[i] : NULL;
        it->v_tail = c->n_tail ? s->vt[i] : NULL;
        it->n_tail = c->n_tail;
        it->q_offset = c->q_offset;
        it->mask = s->mask[i];
    }
    free(perm);
}

static void attn_free(attn_setup *s) {
    for (int i = 0; i < s->n_items; i++) {
        free(s->pages[i]);
        free(s->q[i]);
        free(s->out[i]);
        free(s->kt[i]);
        free(s->vt[i]);
        free(s->mask[i]);
    }
    free(s->pages);
    free(s->q);
    free(s->out);
    free(s->kt);
    free(s->vt);
    free(s->mask);
    free(s->items);
    free(s->kv.base);
}

/* One softmax per (item, query, head) in double, keys gathered token by token. */
static void attn_check(const attn_setup *s, int n_heads, float scale, const char *what) {
    int hd = s->kv.head_dim, n_kv = s->kv.n_kv_heads, g = n_heads / n_kv;
    size_t tok = (size_t)n_kv * (size_t)hd;
    for (int i = 0; i < s->n_items; i++) {
        const krn_attn_item *it = &s->items[i];
        int keys = it->n_ctx + it->n_tail;
        double *w = xmalloc((size_t)(keys ? keys : 1) * sizeof(double));
        for (int qi = 0; qi < it->n_q; qi++)
            for (int h = 0; h < n_heads; h++) {
                int kvh = h / g;
                const float *q = it->q + ((size_t)qi * (size_t)n_heads + (size_t)h) * (size_t)hd;
                double mx = -INFINITY;
                for (int t = 0; t < keys; t++) {
                    int vis = it->mask ? it->mask[qi * keys + t] : t <= it->q_offset + qi;
                    if (!vis) {
                        w[t] = -INFINITY;
                        continue;
                    }
                    const float *k =
                        t < it->n_ctx
                            ? krn_kv_k(&s->kv, it->pages[t / s->kv.page_size], t % s->kv.page_size)
                            : it->k_tail + (size_t)(t - it->n_ctx) * tok;
                    double dot = 0;
                    for (int d = 0; d < hd; d++)
                        dot += (double)q[d] * k[(size_t)kvh * (size_t)hd + (size_t)d];
                    w[t] = dot * scale;
                    mx = w[t] > mx ? w[t] : mx;
                }
                const float *o = it->out + ((size_t)qi * (size_t)n_heads + (size_t)h) * (size_t)hd;
                for (int d = 0; d < hd; d++) {
                    double num = 0, den = 0;
                    for (int t = 0; t < keys; t++) {
                        if (w[t] == -INFINITY) continue;
                        const float *v = t < it->n_ctx
                                             ? krn_kv_v(&s->kv, it->pages[t / s->kv.page_size],
                                                        t % s->kv.page_size)
                                             : it->v_tail + (size_t)(t - it->n_ctx) * tok;
                        double e = exp(w[t] - mx);
                        num += e * v[(size_t)kvh * (size_t)hd + (size_t)d];
                        den += e;
                    }
                    double want = den > 0 ? num / den : 0.0;
                    cr_assert(fabs(o[d] - want) <= 2e-5,
                              "%s: item %d query %d head %d dim %d = %.9g, want %.9g", what, i, qi,
                              h, d, o[d], want);
                }
            }
        free(w);
    }
}

static void attn_run_and_check(const attn_case *cases, int n_items, int page_size, int n_kv, int hd,
                               int n_heads, int kv_chunk, uint64_t seed) {
    rng r = {seed};
    attn_setup s;
    attn_build(&s, &r, cases, n_items, page_size, n_kv, hd, n_heads);
    float scale = 1.0f / sqrtf((float)hd);
    char what[160];
    for (int si = 0; si < N_SIMD; si++) {
        if (!use_simd(si)) continue;
        for (int threads = 0; threads <= 4; threads++) {
            krn_pool *p = threads ? krn_pool_create(threads) : NULL;
            cr_assert(threads == 0 || p);
            for (int i = 0; i < n_items; i++)
                for (size_t k = 0; k < (size_t)cases[i].n_q * (size_t)n_heads * (size_t)hd; k++)
                    s.out[i][k] = NAN;
            krn_cpu_attention_ex(p, &s.kv, s.items, n_items, n_heads, scale, kv_chunk);
            snprintf(what, sizeof what, "%s, %d threads, kv %d x %d, %d heads, chunk %d",
                     SIMD_PATHS[si], threads, n_kv, hd, n_heads, kv_chunk);
            attn_check(&s, n_heads, scale, what);
            krn_pool_destroy(p);
        }
    }
    attn_free(&s);
}

Test(krn_attention, causal_prefill_with_gqa_ratios_1_2_4) {
    attn_case c[2] = {{.n_q = 37, .n_ctx = 37, .q_offset = 0},
                      {.n_q = 5, .n_ctx = 50, .q_offset = 45}};
    attn_run_and_check(c, 2, 8, 2, 64, 2, 0, 1);  /* ratio 1 */
    attn_run_and_check(c, 2, 8, 2, 64, 4, 0, 2);  /* ratio 2 */
    attn_run_and_check(c, 2, 16, 2, 65, 8, 0, 3); /* ratio 4, odd head_dim */
    attn_run_and_check(c, 2, 5, 1, 16, 4, 0, 4);
    attn_run_and_check(c, 2, 8, 2, 100, 6, 0, 12); /* ratio 3 (tiles of 2 + 1), 100 = 64 + 36 */
    attn_run_and_check(c, 2, 8, 1, 80, 8, 0, 13);  /* ratio 8 (tiles of 4 + 4) */
}

Test(krn_attention, decode_batch_of_many_sequences_uses_all_heads_per_unit) {
    attn_case c[5] = {{.n_q = 1, .n_ctx = 130, .q_offset = 129},
                      {.n_q = 1, .n_ctx = 1, .q_offset = 0},
                      {.n_q = 1, .n_ctx = 64, .q_offset = 63},
                      {.n_q = 1, .n_ctx = 65, .q_offset = 64},
                      {.n_q = 1, .n_ctx = 17, .n_tail = 1, .q_offset = 17}};
    attn_run_and_check(c, 5, 16, 4, 64, 16, 0, 14);
    attn_run_and_check(c, 5, 16, 4, 128, 32, 0, 15);
}

Test(krn_attention, long_prefill_spans_many_query_blocks) {
    attn_case c[1] = {{.n_q = 150, .n_ctx = 170, .q_offset = 20}};
    attn_run_and_check(c, 1, 16, 2, 128, 8, 0, 5);
}

Test(krn_attention, decode_with_long_context_chunked_equals_unchunked) {
    attn_case c[3] = {{.n_q = 1, .n_ctx = 1000, .q_offset = 999},
                      {.n_q = 1, .n_ctx = 77, .q_offset = 76},
                      {.n_q = 2, .n_ctx = 300, .q_offset = 298}};
    static const int chunks[] = {-1, 0, 64, 100, 333, 2000};
    for (size_t i = 0; i < sizeof chunks / sizeof *chunks; i++)
        attn_run_and_check(c, 3, 16, 2, 64, 8, chunks[i], 6);

    /* chunked and unchunked agree with each other to rounding, not just to the reference */
    rng r = {7};
    attn_setup s;
    attn_build(&s, &r, c, 3, 16, 2, 64, 8);
    krn_pool *p = krn_pool_create(2);
    cr_assert_not_null(p);
    krn_cpu_attention_ex(p, &s.kv, s.items, 3, 8, 0.125f, -1);
    float *whole = xmalloc(8 * 64 * 4);
    memcpy(whole, s.out[0], 8 * 64 * 4);
    krn_cpu_attention_ex(p, &s.kv, s.items, 3, 8, 0.125f, 128);
    for (int k = 0; k < 8 * 64; k++)
        cr_assert(fabs(whole[k] - s.out[0][k]) <= 1e-6, "chunked %g vs unchunked %g at %d",
                  s.out[0][k], whole[k], k);
    free(whole);
    krn_pool_destroy(p);
    attn_free(&s);
}

Test(krn_attention, a_call_split_in_parts_with_its_plan_writes_the_same_bits) {
    /* a prefill among decodes changes the unit shape, 3 threads make chunks: each part, run
     * on another pool with the whole call's plan, must write exactly what the whole call
     * wrote (the CPU attention offload relies on it) */
    attn_case c[4] = {{.n_q = 1, .n_ctx = 1000, .q_offset = 999},
                      {.n_q = 9, .n_ctx = 300, .q_offset = 291},
                      {.n_q = 1, .n_ctx = 700, .q_offset = 699},
                      {.n_q = 1, .n_ctx = 77, .q_offset = 76}};
    rng r = {21};
    attn_setup s;
    attn_build(&s, &r, c, 4, 16, 2, 64, 8);
    krn_pool *p = krn_pool_create(3), *h = krn_pool_create(2);
    cr_assert(p && h);
    krn_attn_plan plan = krn_cpu_attention_plan(p, &s.kv, s.items, 4, 8, 0);
    cr_assert_eq(plan.max_nq, 9);
    cr_assert_gt(plan.chunk, 0, "3 threads and 8 groups: the keys are chunked");
    krn_cpu_attention_ex(p, &s.kv, s.items, 4, 8, 0.125f, 0);
    float *whole[4];
    for (int i = 0; i < 4; i++) {
        size_t n = (size_t)c[i].n_q * 8 * 64;
        whole[i] = xmalloc(n * sizeof(float));
        memcpy(whole[i], s.out[i], n * sizeof(float));
        for (size_t k = 0; k < n; k++) s.out[i][k] = NAN;
    }
    krn_attn_item dev[2] = {s.items[1], s.items[3]}, host[2] = {s.items[0], s.items[2]};
    krn_cpu_attention_run(p, &s.kv, dev, 2, 8, 0.125f, &plan);
    krn_cpu_attention_run(h, &s.kv, host, 2, 8, 0.125f, &plan);
    for (int i = 0; i < 4; i++) {
        size_t n = (size_t)c[i].n_q * 8 * 64;
        cr_assert(memcmp(whole[i], s.out[i], n * sizeof(float)) == 0, "item %d differs", i);
        free(whole[i]);
    }
    /* the parts' own plans differ (no prefill among the decodes: another shape) */
    krn_attn_plan own = krn_cpu_attention_plan(h, &s.kv, host, 2, 8, 0);
    cr_assert_eq(own.max_nq, 1);
    krn_pool_destroy(p);
    krn_pool_destroy(h);
    attn_free(&s);
}

Test(krn_attention, explicit_masks_and_fully_masked_rows_give_zeros) {
    attn_case c[2] = {{.n_q = 6, .n_ctx = 40, .n_tail = 3, .use_mask = 1},
                      {.n_q = 3, .n_ctx = 9, .use_mask = 1}};
    attn_run_and_check(c, 2, 8, 2, 32, 4, 0, 8);
    attn_run_and_check(c, 2, 8, 2, 32, 4, 16, 9);
}

Test(krn_attention, tail_tokens_follow_the_pages) {
    attn_case c[3] = {{.n_q = 6, .n_ctx = 20, .n_tail = 6, .q_offset = 20},
                      {.n_q = 4, .n_ctx = 0, .n_tail = 4, .q_offset = 0},
                      {.n_q = 1, .n_ctx = 300, .n_tail = 1, .q_offset = 300}};
    attn_run_and_check(c, 3, 8, 2, 48, 8, 0, 10);
    attn_run_and_check(c, 3, 8, 2, 48, 8, 128, 11);
}

/* ---- bf16 KV ------------------------------------------------------------------------------- */

Test(krn_attention, bf16_storage_rounds_to_nearest_even_and_keeps_nan_and_infinity) {
    static const uint32_t in[] = {0x3f800000u, 0x3f808000u, 0x3f818000u, 0x3f808001u, 0x3f80ffffu,
                                  0xbf818000u, 0x7f7fffffu, 0x7f800000u, 0xff800000u, 0x00008000u,
                                  0x00018000u, 0x7fc00001u, 0xff800001u, 0x00000000u, 0x80000000u};
    static const uint16_t want[] = {0x3f80, 0x3f80, 0x3f82, 0x3f81, 0x3f81, 0xbf82, 0x7f80, 0x7f80,
                                    0xff80, 0x0000, 0x0002, 0x7fc0, 0xffc0, 0x0000, 0x8000};
    size_t n = sizeof in / sizeof *in;
    float x[16], r[16];
    uint16_t got[16];
    memcpy(x, in, sizeof in);
    memcpy(r, in, sizeof in);
    krn_cvt_bf16(x, n, got);
    krn_round_bf16(r, n);
    for (size_t i = 0; i < n; i++) {
        cr_assert_eq(got[i], want[i], "bf16(0x%08x) = 0x%04x, want 0x%04x", in[i], got[i], want[i]);
        uint32_t back;
        memcpy(&back, &r[i], 4);
        cr_assert_eq(back, (uint32_t)want[i] << 16, "round(0x%08x) = 0x%08x, want 0x%04x0000",
                     in[i], back, want[i]);
    }
    /* krn_kv_store: the rows of (page, off) in a bf16 region, and nothing else */
    uint16_t region[2 * 2 * 2 * 3]; /* 2 pages x K/V x 2 tokens x (1 head x 3) */
    memset(region, 0xee, sizeof region);
    krn_kv_layer kv = {
        .base = region, .page_size = 2, .n_kv_heads = 1, .head_dim = 3, .dtype = KRN_BF16};
    cr_assert_eq(krn_kv_elt_bytes(&kv), 2);
    krn_kv_store(&kv, 1, 1, x, x + 3);
    for (size_t i = 0; i < sizeof region / sizeof *region; i++) {
        size_t k_at = (1 * 2 + 0) * 2 * 3 + 1 * 3, v_at = (1 * 2 + 1) * 2 * 3 + 1 * 3;
        uint16_t w = i >= k_at && i < k_at + 3   ? want[i - k_at]
                     : i >= v_at && i < v_at + 3 ? want[3 + i - v_at]
                                                 : 0xeeee;
        cr_assert_eq(region[i], w, "region[%zu] = 0x%04x, want 0x%04x", i, region[i], w);
    }
}

/* The cases run on a bf16 region and on an f32 region holding the same rounded values: the
 * results must be the same bits on every SIMD path with a pool (attention converts a bf16 block
 * to f32 exactly and runs the f32 kernels on it), and within the reference's bound without one
 * (a stack buffer: blocks of fewer keys). Tails stay f32 in both. */
static void attn_bf16_run_and_compare(const attn_case *cases, int n_items, int page_size, int n_kv,
                                      int hd, int n_heads, int kv_chunk, uint64_t seed) {
    rng r = {seed};
    attn_setup s;
    attn_build(&s, &r, cases, n_items, page_size, n_kv, hd, n_heads);
    size_t n = (size_t)s.n_pages * 2 * (size_t)page_size * (size_t)n_kv * (size_t)hd;
    krn_round_bf16(s.kv.base, n); /* the unused slots stay NaN */
    krn_kv_layer kb = s.kv;
    kb.dtype = KRN_BF16;
    kb.base = xmalloc(n * 2);
    krn_cvt_bf16(s.kv.base, n, kb.base);
    float scale = 1.0f / sqrtf((float)hd);
    char what[200];
    for (int si = 0; si < N_SIMD; si++) {
        if (!use_simd(si)) continue;
        for (int threads = 0; threads <= 4; threads++) {
            krn_pool *p = threads ? krn_pool_create(threads) : NULL;
            cr_assert(threads == 0 || p);
            float *f32_out[8];
            cr_assert(n_items <= 8);
            krn_cpu_attention_ex(p, &s.kv, s.items, n_items, n_heads, scale, kv_chunk);
            for (int i = 0; i < n_items; i++) {
                size_t qn = (size_t)cases[i].n_q * (size_t)n_heads * (size_t)hd;
                f32_out[i] = xmalloc(qn * 4);
                memcpy(f32_out[i], s.out[i], qn * 4);
                for (size_t k = 0; k < qn; k++) s.out[i][k] = NAN;
            }
            krn_cpu_attention_ex(p, &kb, s.items, n_items, n_heads, scale, kv_chunk);
            snprintf(what, sizeof what, "bf16 KV, %s, %d threads, kv %d x %d, %d heads, chunk %d",
                     SIMD_PATHS[si], threads, n_kv, hd, n_heads, kv_chunk);
            attn_check(&s, n_heads, scale, what); /* s.kv: the same values in f32 */
            for (int i = 0; i < n_items; i++) {
                size_t qn = (size_t)cases[i].n_q * (size_t)n_heads * (size_t)hd;
                if (p)
                    cr_assert(memcmp(f32_out[i], s.out[i], qn * 4) == 0,
                              "%s: item %d is not the f32 region's bits", what, i);
                free(f32_out[i]);
            }
            krn_pool_destroy(p);
        }
    }
    free(kb.base);
    attn_free(&s);
}

Test(krn_attention, bf16_kv_gives_the_bits_of_f32_kv_holding_the_rounded_values) {
    attn_case dec[5] = {{.n_q = 1, .n_ctx = 130, .q_offset = 129},
                        {.n_q = 1, .n_ctx = 1, .q_offset = 0},
                        {.n_q = 1, .n_ctx = 64, .q_offset = 63},
                        {.n_q = 1, .n_ctx = 65, .q_offset = 64},
                        {.n_q = 1, .n_ctx = 17, .n_tail = 1, .q_offset = 17}};
    attn_bf16_run_and_compare(dec, 5, 16, 4, 64, 16, 0, 31);  /* decode: all heads per unit */
    attn_bf16_run_and_compare(dec, 5, 16, 8, 128, 32, 0, 32); /* 8 x 128: 32 keys a block */
    /* decode with masks, tails, an odd head_dim and chunks */
    attn_case decm[3] = {{.n_q = 1, .n_ctx = 70, .use_mask = 1},
                         {.n_q = 1, .n_ctx = 33, .n_tail = 2, .use_mask = 1},
                         {.n_q = 1, .n_ctx = 200, .q_offset = 199}};
    attn_bf16_run_and_compare(decm, 3, 16, 2, 65, 8, 64, 36);
    attn_bf16_run_and_compare(decm, 3, 8, 4, 64, 16, 0, 37);
    attn_case pre[3] = {{.n_q = 37, .n_ctx = 37, .q_offset = 0},
                        {.n_q = 6, .n_ctx = 40, .n_tail = 3, .use_mask = 1},
                        {.n_q = 5, .n_ctx = 300, .n_tail = 2, .q_offset = 297}};
    attn_bf16_run_and_compare(pre, 3, 8, 2, 64, 8, 0, 33);
    attn_bf16_run_and_compare(pre, 3, 8, 2, 65, 8, 100, 34); /* odd head_dim, chunks */
    attn_bf16_run_and_compare(pre, 3, 8, 1, 256, 2, 0, 35);  /* > 128: fewer keys a block */
}

/* ---- main: one SIMD path per CTest registration ------------------------------------------- */

static int cpu_has_path(const char *name) {
    for (int s = 0; s < N_SIMD; s++)
        if (strcmp(name, SIMD_PATHS[s]) == 0) return force_simd(name) == 0;
    return -1; /* not a path name */
}

/* Lists the paths this CPU has, so the log of every registration says what was testable. */
static void print_cpu_paths(void) {
    printf("krn_cpu: SIMD paths on this CPU:");
    for (int s = 0; s < N_SIMD; s++)
        printf(" %s=%s", SIMD_PATHS[s], force_simd(SIMD_PATHS[s]) == 0 ? "yes" : "no");
#if KRN_X86
    __builtin_cpu_init();
    printf(" (cpu flags: avx512bf16=%s)", __builtin_cpu_supports("avx512bf16") ? "yes" : "no");
#endif
    printf("\n");
    fflush(stdout);
}

int main(int argc, char *argv[]) {
    print_cpu_paths();
    const char *only = selected_path();
    if (only) {
        int has = cpu_has_path(only);
        if (has < 0) {
            fprintf(stderr,
                    "PIE_TEST_SIMD=%s is not one of scalar, avx2, avx512, avx512bf16, amx\n",
                    only);
            return 2;
        }
        if (!has) {
            printf("skipped: this CPU (or kernel) has no %s path\n", only);
            return TEST_SKIP_RC;
        }
    }
    struct criterion_test_set *tests = criterion_initialize();
    /* criterion_handle_args: 1 run, 0 exit gracefully (--help), -1 bad arguments */
    int args = criterion_handle_args(argc, argv, true);
    int ok = args == 1 ? criterion_run_all_tests(tests) : args == 0;
    criterion_finalize(tests);
    return ok ? 0 : 1;
}
