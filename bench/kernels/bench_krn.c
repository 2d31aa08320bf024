/* bench_krn.c — timings of the CPU kernels (kernels/cpu) on Llama-3.2-1B shapes.
 *
 * Owns: (a) memory bandwidth of a multi-threaded streaming read measured in the same run;
 * (b) decode-shape linear (n = 1) in bf16 and f32 against that bandwidth; (c) batch-32 decode
 * linear throughput against batch 1; (d) 512-token prefill linear GFLOP/s against plain
 * cblas_sgemm (OpenBLAS with its own threads); (e) decode attention at 512 and 4096 tokens of
 * context (f32 KV) and (f) with bf16 KV; (g) one core's arithmetic peak, f32 FMA and AVX512-BF16
 * dot products (the ceiling of the batched linear layers); plus the pool's cost per run. Weights
 * rotate through copies totalling at least 2 GiB, so every call streams from DRAM as in a real
 * forward pass. Times are the best of N (the machine is shared; interference only adds time).
 * Usage: bench_krn [--threads N] [--quick] [--only SECTIONS] (e.g. --only ae; the pool and (a)
 * always run, (b) runs when (c) does). Results: bench/results/kernels.md. */
#include <cblas.h>
#include <immintrin.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "krn_cpu.h"
#include "bench_krn_util.h"

#define GIB (1024.0 * 1024.0 * 1024.0)

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void fill_f32(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = bench_krn_frand();
}

static void fill_bf16(uint16_t *x, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float f = bench_krn_frand() * 0.05f;
        uint32_t u;
        memcpy(&u, &f, 4);
        x[i] = (uint16_t)(u >> 16);
    }
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The best (smallest) time: the machine is shared, and interference only ever adds time. */
static double best_of(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return v[0];
}

/* ---- (a) bandwidth ------------------------------------------------------------------------- */

typedef struct bw_arg {
    const uint64_t *buf;
    size_t words;
    uint64_t sums[64];
} bw_arg;

/* Each task reads its share as 4 interleaved sequential streams: one stream per core leaves
 * memory-level parallelism unused (about 12 GB/s per core here against 14 with 4 streams),
 * and the kernels read several rows of W at once. */
__attribute__((target("avx2"))) static void bw_task(void *varg, int task, int n_tasks) {
    bw_arg *a = varg;
    size_t per = a->words / (size_t)n_tasks / 64 * 64, quarter = per / 4;
    const uint64_t *p = a->buf + per * (size_t)task;
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
    for (size_t i = 0; i < quarter; i += 8) {
        for (size_t k = 0; k < 8; k += 4) {
            s0 =
                _mm256_add_epi64(s0, _mm256_load_si256((const __m256i *)(const void *)(p + i + k)));
            s1 = _mm256_add_epi64(
                s1, _mm256_load_si256((const __m256i *)(const void *)(p + quarter + i + k)));
            s2 = _mm256_add_epi64(
                s2, _mm256_load_si256((const __m256i *)(const void *)(p + 2 * quarter + i + k)));
            s3 = _mm256_add_epi64(
                s3, _mm256_load_si256((const __m256i *)(const void *)(p + 3 * quarter + i + k)));
        }
    }
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)(void *)lanes,
                        _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3)));
    a->sums[task % 64] = lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

static double bench_bandwidth(krn_pool *p, int threads) {
    size_t bytes = (size_t)(2.0 * GIB);
    bw_arg a = {.buf = bench_krn_alloc(bytes), .words = bytes / 8};
    memset((void *)a.buf, 1, bytes);
    double best = 0;
    for (int rep = 0; rep < 8; rep++) {
        double t0 = now_s();
        krn_pool_run(p, bw_task, &a, threads);
        double gbs = (double)(a.words / (size_t)threads / 64 * 64 * (size_t)threads * 8) /
                     (now_s() - t0) / 1e9;
        if (gbs > best) best = gbs;
    }
    free((void *)a.buf);
    return best;
}

/* ---- linear -------------------------------------------------------------------------------- */

typedef struct mat {
    int in, out;
    krn_dtype wt;
    int copies;
    void **w;
} mat;

static mat mat_make(int in, int out, krn_dtype wt) {
    mat m = {.in = in, .out = out, .wt = wt};
    size_t bytes = (size_t)in * (size_t)out * (wt == KRN_F32 ? 4 : 2);
    m.copies = (int)ceil(2.0 * GIB / (double)bytes);
    if (m.copies < 1) m.copies = 1;
    m.w = calloc((size_t)m.copies, sizeof *m.w);
    for (int c = 0; c < m.copies; c++) {
        m.w[c] = bench_krn_alloc(bytes);
        if (c == 0) {
            if (wt == KRN_F32)
                fill_f32(m.w[c], (size_t)in * (size_t)out);
            else
                fill_bf16(m.w[c], (size_t)in * (size_t)out);
        } else {
            memcpy(m.w[c], m.w[0], bytes);
        }
    }
    return m;
}

static void mat_free(mat *m) {
    for (int c = 0; c < m->copies; c++) free(m->w[c]);
    free(m->w);
}

static size_t mat_bytes(const mat *m) {
    return (size_t)m->in * (size_t)m->out * (m->wt == KRN_F32 ? 4 : 2);
}

/* Median seconds per krn_cpu_linear call with n rows, rotating through the copies. */
static double time_linear(krn_pool *p, const mat *m, int n, int reps) {
    float *x = bench_krn_alloc((size_t)n * (size_t)m->in * 4),
          *y = bench_krn_alloc((size_t)n * (size_t)m->out * 4);
    fill_f32(x, (size_t)n * (size_t)m->in);
    double *t = malloc((size_t)reps * sizeof *t);
    krn_cpu_linear(p, x, n, m->in, m->w[0], m->wt, m->out, y); /* warm-up */
    for (int r = 0; r < reps; r++) {
        double t0 = now_s();
        krn_cpu_linear(p, x, n, m->in, m->w[(r + 1) % m->copies], m->wt, m->out, y);
        t[r] = now_s() - t0;
    }
    double best = best_of(t, reps);
    free(t);
    free(x);
    free(y);
    return best;
}

/* Median seconds of plain cblas_sgemm (OpenBLAS's own threads) for the same product. */
static double time_sgemm(const mat *m, int n, int reps, int threads) {
    float *x = bench_krn_alloc((size_t)n * (size_t)m->in * 4),
          *y = bench_krn_alloc((size_t)n * (size_t)m->out * 4);
    fill_f32(x, (size_t)n * (size_t)m->in);
    double *t = malloc((size_t)reps * sizeof *t);
    openblas_set_num_threads(threads);
    for (int r = -1; r < reps; r++) {
        double t0 = now_s();
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, m->out, m->in, 1.0f, x, m->in,
                    m->w[(r + 1) % m->copies], m->in, 0.0f, y, m->out);
        if (r >= 0) t[r] = now_s() - t0;
    }
    openblas_set_num_threads(1); /* what krn_cpu_linear expects (see krn_linear.c) */
    double best = best_of(t, reps);
    free(t);
    free(x);
    free(y);
    return best;
}

static const int SHAPES[4][2] = {{2048, 2048}, {2048, 8192}, {8192, 2048}, {2048, 128256}};

/* ---- attention ----------------------------------------------------------------------------- */

/* dt: the KV region's dtype (KRN_F32 or KRN_BF16, the engine's kv_dtype). */
static void bench_attention(krn_pool *p, int ctx, int batch, int reps, krn_dtype dt) {
    int n_heads = 32, n_kv = 8, hd = 64, page = 16;
    int pages_per = (ctx + page - 1) / page;
    krn_kv_layer kv = {.page_size = page, .n_kv_heads = n_kv, .head_dim = hd, .dtype = dt};
    size_t floats =
        (size_t)pages_per * (size_t)batch * 2 * (size_t)page * (size_t)n_kv * (size_t)hd;
    float *f = bench_krn_alloc(floats * 4);
    fill_f32(f, floats);
    if (dt == KRN_BF16) {
        kv.base = bench_krn_alloc(floats * 2);
        krn_cvt_bf16(f, floats, kv.base);
        free(f);
    } else {
        kv.base = f;
    }
    uint32_t *pages = bench_krn_alloc((size_t)pages_per * (size_t)batch * 4);
    for (int i = 0; i < pages_per * batch; i++) pages[i] = (uint32_t)i;
    float *q = bench_krn_alloc((size_t)batch * (size_t)n_heads * (size_t)hd * 4);
    float *o = bench_krn_alloc((size_t)batch * (size_t)n_heads * (size_t)hd * 4);
    fill_f32(q, (size_t)batch * (size_t)n_heads * (size_t)hd);
    krn_attn_item *items = calloc((size_t)batch, sizeof *items);
    for (int b = 0; b < batch; b++) {
        items[b].q = q + (size_t)b * (size_t)n_heads * (size_t)hd;
        items[b].out = o + (size_t)b * (size_t)n_heads * (size_t)hd;
        items[b].n_q = 1;
        items[b].pages = pages + (size_t)b * (size_t)pages_per;
        items[b].n_ctx = ctx;
        items[b].q_offset = ctx - 1;
    }
    double *t = malloc((size_t)reps * sizeof *t);
    for (int mode = 0; mode < 2; mode++) {
        int chunk = mode == 0 ? -1 : 0;
        krn_cpu_attention_ex(p, &kv, items, batch, n_heads, 0.125f, chunk);
        for (int r = 0; r < reps; r++) {
            double t0 = now_s();
            krn_cpu_attention_ex(p, &kv, items, batch, n_heads, 0.125f, chunk);
            t[r] = now_s() - t0;
        }
        double best = best_of(t, reps);
        double bytes = (double)ctx * batch * 2.0 * n_kv * hd * (double)krn_kv_elt_bytes(&kv);
        printf("    ctx %5d batch %2d %-10s %8.3f ms  %6.1f GB/s of KV\n", ctx, batch,
               mode == 0 ? "unchunked" : "auto", best * 1e3, bytes / best / 1e9);
    }
    free(t);
    free(items);
    free(q);
    free(o);
    free(pages);
    free(kv.base);
}

/* ---- (g) arithmetic peak ------------------------------------------------------------------ */

/* (g): one thread, 12 independent accumulator chains (enough to cover the latency on current
 * x86 cores), `iters` rounds of 12 instructions; multiply-adds per second. */
#if defined(__x86_64__)
#define PEAK_CHAINS 12
__attribute__((target("avx512f,fma"))) static double peak_fma(long iters) {
    __m512 acc[PEAK_CHAINS];
    for (int i = 0; i < PEAK_CHAINS; i++) acc[i] = _mm512_setzero_ps();
    const __m512 a = _mm512_set1_ps(1.0001f), b = _mm512_set1_ps(0.9999f);
    double t0 = now_s();
    for (long it = 0; it < iters; it++) {
#pragma GCC unroll 12 /* the chains in registers, not in memory */
        for (int i = 0; i < PEAK_CHAINS; i++) acc[i] = _mm512_fmadd_ps(a, b, acc[i]);
    }
    double t = now_s() - t0;
    float sum = 0;
    for (int i = 0; i < PEAK_CHAINS; i++) sum += _mm512_reduce_add_ps(acc[i]);
    if (sum == 0) printf("    (fma sums to 0)\n"); /* keeps the chains live */
    return (double)iters * PEAK_CHAINS * 16 / t;
}

__attribute__((target("avx512bf16,avx512f,avx512bw"))) static double peak_dot(long iters) {
    __m512 acc[PEAK_CHAINS];
    for (int i = 0; i < PEAK_CHAINS; i++) acc[i] = _mm512_setzero_ps();
    const __m512bh one = (__m512bh)_mm512_set1_epi16(0x3f80); /* bf16 1.0 */
    double t0 = now_s();
    for (long it = 0; it < iters; it++) {
#pragma GCC unroll 12
        for (int i = 0; i < PEAK_CHAINS; i++) acc[i] = _mm512_dpbf16_ps(acc[i], one, one);
    }
    double t = now_s() - t0;
    float sum = 0;
    for (int i = 0; i < PEAK_CHAINS; i++) sum += _mm512_reduce_add_ps(acc[i]);
    if (sum == 0) printf("    (dot sums to 0)\n");
    return (double)iters * PEAK_CHAINS * 32 / t;
}

static void bench_peak(int quick) {
    long iters = quick ? 20000000 : 100000000;
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f")) {
        printf("    no AVX-512 on this CPU\n");
        return;
    }
    double fma = 0, dot = 0;
    int have_dot = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
    for (int r = 0; r < 3; r++) { /* best of 3 */
        double f = peak_fma(iters);
        fma = f > fma ? f : fma;
        double d = have_dot ? peak_dot(iters) : 0;
        dot = d > dot ? d : dot;
    }
    printf("    f32 FMA (zmm): %.1f GMAC/s per core\n", fma / 1e9);
    if (have_dot)
        printf("    VDPBF16PS (zmm): %.1f GMAC/s per core (%.2fx FMA)\n", dot / 1e9, dot / fma);
    else
        printf("    no AVX512-BF16 on this CPU\n");
}
#else
static void bench_peak(int quick) {
    (void)quick;
    printf("    x86-64 only\n");
}
#endif

/* ---- pool ---------------------------------------------------------------------------------- */

static void empty_task(void *arg, int task, int n_tasks) {
    (void)arg;
    (void)task;
    (void)n_tasks;
}

int main(int argc, char **argv) {
    int threads = 2, quick = 0;
    const char *only = "abcdefg";
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc)
            threads = atoi(argv[++i]);
        else if (strcmp(argv[i], "--quick") == 0)
            quick = 1;
        else if (strcmp(argv[i], "--only") == 0 && i + 1 < argc)
            only = argv[++i];
        else {
            fprintf(stderr, "usage: %s [--threads N] [--quick] [--only SECTIONS]\n", argv[0]);
            return 2;
        }
    }
    int run_b = strchr(only, 'b') || strchr(only, 'c'), run_c = strchr(only, 'c') != NULL;
    int run_d = strchr(only, 'd') != NULL, run_e = strchr(only, 'e') != NULL;
    int run_f = strchr(only, 'f') != NULL, run_g = strchr(only, 'g') != NULL;
    krn_pool *p = krn_pool_create(threads);
    if (!p) {
        fprintf(stderr, "bench_krn: cannot create a pool of %d threads\n", threads);
        return 1;
    }
    printf("bench_krn: %d threads, SIMD %s%s\n", krn_pool_size(p), krn_cpu_simd_name(),
           krn_cpu_amx_active() ? " + AMX (bf16 linear, n >= 8)"
           : krn_cpu_bf16dot_active()
               ? " + AVX512-BF16 (bf16 linear, 8 <= n <= 32, x rounded to bf16)"
               : "");

    {
        int reps = 20000;
        double t0 = now_s();
        for (int r = 0; r < reps; r++) krn_pool_run(p, empty_task, NULL, threads);
        printf("pool: %.2f us per run of %d empty tasks (back to back)\n",
               (now_s() - t0) / reps * 1e6, threads);
    }

    double bw1 = bench_bandwidth(NULL, 1);
    double bw = bench_bandwidth(p, threads);
    printf("(a) bandwidth, streaming read of 2 GiB (4 streams per thread): %.1f GB/s with 1 "
           "thread, %.1f GB/s with %d\n",
           bw1, bw, threads);

    int reps = quick ? 5 : 15;
    double t1[4][2];
    if (run_b) printf("(b) decode linear, n = 1 (weights streamed from DRAM)\n");
    for (int s = 0; s < 4 && run_b; s++)
        for (int d = 0; d < 2; d++) {
            krn_dtype wt = d == 0 ? KRN_BF16 : KRN_F32;
            mat m = mat_make(SHAPES[s][0], SHAPES[s][1], wt);
            double t = time_linear(p, &m, 1, reps);
            t1[s][d] = t;
            double gbs = (double)mat_bytes(&m) / t / 1e9;
            printf("    %5d -> %6d %-4s %9.3f ms  %6.1f GB/s  %3.0f%% of bandwidth\n", m.in, m.out,
                   d == 0 ? "bf16" : "f32", t * 1e3, gbs, 100.0 * gbs / bw);
            mat_free(&m);
        }

    if (run_c)
        printf("(c) batched decode linear, bf16: time per call and throughput against n = 1\n");
    static const int batches[] = {2, 4, 8, 9, 16, 32};
    for (int s = 0; s < 4 && run_c; s++) {
        mat m = mat_make(SHAPES[s][0], SHAPES[s][1], KRN_BF16);
        for (size_t b = 0; b < sizeof batches / sizeof *batches; b++) {
            if (quick && batches[b] != 8 && batches[b] != 32) continue;
            double t = time_linear(p, &m, batches[b], reps);
            printf("    %5d -> %6d n=%2d %9.3f ms  %5.1fx the rows/s of n=1\n", m.in, m.out,
                   batches[b], t * 1e3, batches[b] * t1[s][0] / t);
        }
        mat_free(&m);
    }

    if (run_d)
        printf("(d) prefill linear, n = 512: GFLOP/s (plain sgemm = cblas_sgemm with %d OpenBLAS "
               "threads)\n",
               threads);
    for (int s = 0; s < 4 && run_d; s++) {
        if (quick && s == 3) continue;
        int n = 512, pr = s == 3 ? 3 : reps / 3 + 2;
        mat mb = mat_make(SHAPES[s][0], SHAPES[s][1], KRN_BF16);
        double tb = time_linear(p, &mb, n, pr);
        mat_free(&mb);
        mat mf = mat_make(SHAPES[s][0], SHAPES[s][1], KRN_F32);
        double tf = time_linear(p, &mf, n, pr);
        double ts = time_sgemm(&mf, n, pr, threads);
        mat_free(&mf);
        double flop = 2.0 * n * SHAPES[s][0] * SHAPES[s][1];
        printf("    %5d -> %6d  bf16 %6.1f  f32 %6.1f  plain sgemm %6.1f GFLOP/s  (bf16 at %3.0f%% "
               "of sgemm)\n",
               SHAPES[s][0], SHAPES[s][1], flop / tb / 1e9, flop / tf / 1e9, flop / ts / 1e9,
               100.0 * ts / tb);
    }

    if (run_e) {
        printf("(e) decode attention, Llama-3.2-1B layer (32 heads, 8 KV heads, head_dim 64), f32 "
               "KV\n");
        bench_attention(p, 512, 1, quick ? 20 : 100, KRN_F32);
        bench_attention(p, 4096, 1, quick ? 10 : 50, KRN_F32);
        bench_attention(p, 4096, 8, quick ? 5 : 20, KRN_F32);
        bench_attention(p, 4096, 32, quick ? 3 : 8, KRN_F32);
    }
    if (run_f) {
        printf("(f) decode attention as (e), bf16 KV (the engine's kv_dtype bf16)\n");
        bench_attention(p, 512, 32, quick ? 10 : 40, KRN_BF16);
        bench_attention(p, 4096, 8, quick ? 5 : 20, KRN_BF16);
    }

    if (run_g) {
        printf("(g) arithmetic peak of one core (one thread, 12 independent chains)\n");
        bench_peak(quick);
    }

    krn_pool_destroy(p);
    return 0;
}
