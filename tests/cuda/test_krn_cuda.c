/* test_krn_cuda.c — kernels/cuda against simple CPU computations written here (RoPE against
 * kernels/cpu, which the CPU backend uses), and attention and top-k against the shared checks
 * of tests/kcheck — the same checks tests/unit/test_kcheck.c runs in CI against the CPU kernels
 * and shows failing on broken variants: the sharpened attention case at head_dim 32/64/128/256
 * with 1, 4, 16 and 64 splits, per-tile split counts in one launch, and the tensor-core kernel;
 * the top-k edges (+inf, NaN, underflowed ties). Each test skips visibly where there is no
 * CUDA device. Inputs are deterministic pseudo-random values. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_test.h"
#include "kcheck.h"
#include "krn_cpu.h"
#include "krn_cuda.h"

/* ---- helpers --------------------------------------------------------------------------------- */

static uint32_t rng_state = 12345u;
static float frand(void) { /* [-1, 1) */
    rng_state = rng_state * 1664525u + 1013904223u;
    return (float)(rng_state >> 8) / (float)(1u << 23) - 1.0f;
}

static uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static float bf2f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint16_t *bf_rand(size_t n, float scale) {
    uint16_t *p = malloc(n * sizeof *p);
    cr_assert_not_null(p);
    for (size_t i = 0; i < n; i++) p[i] = f2bf(frand() * scale);
    return p;
}

static float *f_rand(size_t n, float scale) {
    float *p = malloc(n * sizeof *p);
    cr_assert_not_null(p);
    for (size_t i = 0; i < n; i++) p[i] = frand() * scale;
    return p;
}

/* ---- linear ---------------------------------------------------------------------------------- */

Test(krn_cuda, gemv_matches_a_double_dot_product_for_1_to_8_rows) {
    CUDA_TEST_REQUIRE_DEVICE();
    enum { IN = 520, OUT = 300 };
    uint16_t *w = bf_rand((size_t)OUT * IN, 0.5f), *x = bf_rand(8 * IN, 1.0f);
    void *dw = cuda_test_up(w, sizeof(uint16_t) * OUT * IN), *dx = cuda_test_up(x, 16 * IN);
    float *dy = cuda_test_up(NULL, sizeof(float) * 8 * OUT), *y = malloc(sizeof(float) * 8 * OUT);
    for (int n = 1; n <= 8; n++) {
        cr_assert(krn_cuda_gemv_fits(dx, dw, n, IN));
        CUDA_OK(krn_cuda_gemv(dx, n, IN, dw, OUT, dy, OUT, 0));
        cuda_test_down(y, dy, sizeof(float) * (size_t)n * OUT);
        for (int m = 0; m < n; m++)
            for (int o = 0; o < OUT; o++) {
                double ref = 0;
                for (int i = 0; i < IN; i++)
                    ref += (double)bf2f(w[(size_t)o * IN + i]) * bf2f(x[(size_t)m * IN + i]);
                cr_assert(fabs(y[m * OUT + o] - ref) <= 1e-4 * (1 + fabs(ref)),
                          "n=%d row %d out %d: %g, expected %g", n, m, o, y[m * OUT + o], ref);
            }
    }
    cr_assert_not(krn_cuda_gemv_fits(dx, dw, 9, IN), "9 rows are cuBLAS's");
    cr_assert_not(krn_cuda_gemv_fits(dx, dw, 1, IN - 4), "in %% 8 != 0 is cuBLAS's");
    cudaFree(dw), cudaFree(dx), cudaFree(dy);
    free(w), free(x), free(y);
}

/* ---- per-row math ---------------------------------------------------------------------------- */

Test(krn_cuda, add_rmsnorm_adds_the_residual_then_normalises) {
    CUDA_TEST_REQUIRE_DEVICE();
    enum { N = 3, D = 1000 };
    float *x = f_rand(N * D, 2.0f), *r = f_rand(N * D, 1.0f);
    uint16_t *w = bf_rand(D, 1.0f);
    float *dx = cuda_test_up(x, sizeof(float) * N * D),
          *dr = cuda_test_up(r, sizeof(float) * N * D);
    void *dw = cuda_test_up(w, 2 * D);
    float *dyf = cuda_test_up(NULL, sizeof(float) * N * D);
    uint16_t *dyb = cuda_test_up(NULL, 2 * N * D);
    CUDA_OK(krn_cuda_add_rmsnorm(dx, dr, dw, N, D, 1e-5f, dyb, dyf, 0));
    float *x2 = malloc(sizeof(float) * N * D), *yf = malloc(sizeof(float) * N * D);
    uint16_t *yb = malloc(2 * N * D);
    cuda_test_down(x2, dx, sizeof(float) * N * D);
    cuda_test_down(yf, dyf, sizeof(float) * N * D);
    cuda_test_down(yb, dyb, 2 * N * D);
    for (int i = 0; i < N; i++) {
        double ss = 0;
        for (int j = 0; j < D; j++) {
            double v = (double)x[i * D + j] + r[i * D + j];
            cr_assert(fabs(x2[i * D + j] - v) <= 1e-6 * (1 + fabs(v)), "residual row %d col %d", i,
                      j);
            ss += v * v;
        }
        double inv = 1.0 / sqrt(ss / D + 1e-5);
        for (int j = 0; j < D; j++) {
            double ref = ((double)x[i * D + j] + r[i * D + j]) * inv * bf2f(w[j]);
            cr_assert(fabs(yf[i * D + j] - ref) <= 1e-4 * (1 + fabs(ref)),
                      "row %d col %d: %g vs %g", i, j, yf[i * D + j], ref);
            cr_assert(fabs(bf2f(yb[i * D + j]) - ref) <= 1e-2 * (1 + fabs(ref)),
                      "bf16 row %d col %d", i, j);
        }
    }
    cudaFree(dx), cudaFree(dr), cudaFree(dw), cudaFree(dyf), cudaFree(dyb);
    free(x), free(r), free(w), free(x2), free(yf), free(yb);
}

Test(krn_cuda, rope_qkv_matches_the_cpu_rope_with_llama3_frequencies) {
    CUDA_TEST_REQUIRE_DEVICE();
    enum { N = 5, NH = 4, NKV = 2, HD = 16, W = (NH + 2 * NKV) * HD, KVD = NKV * HD };
    float inv_freq[HD / 2];
    krn_cpu_rope_freqs(inv_freq, HD, 10000.0f, 8.0f, 1.0f, 4.0f, 256);
    float *qkv = f_rand(N * W, 1.0f);
    int32_t pos[N] = {0, 1, 17, 300, 2047};
    uint32_t upos[N] = {0, 1, 17, 300, 2047};
    float *dqkv = cuda_test_up(qkv, sizeof(float) * N * W),
          *df = cuda_test_up(inv_freq, sizeof inv_freq);
    int32_t *dpos = cuda_test_up(pos, sizeof pos);
    uint16_t *dkb = cuda_test_up(NULL, 2 * N * KVD), *dvb = cuda_test_up(NULL, 2 * N * KVD);
    CUDA_OK(krn_cuda_rope_qkv(dqkv, dpos, N, NH, NKV, HD, df, dkb, dvb, 0));
    float *got = malloc(sizeof(float) * N * W);
    uint16_t kb[N * KVD], vb[N * KVD];
    cuda_test_down(got, dqkv, sizeof(float) * N * W);
    cuda_test_down(kb, dkb, sizeof kb);
    cuda_test_down(vb, dvb, sizeof vb);
    float q[N * NH * HD], k[N * KVD];
    for (int i = 0; i < N; i++) {
        memcpy(q + i * NH * HD, qkv + i * W, sizeof(float) * NH * HD);
        memcpy(k + i * KVD, qkv + i * W + NH * HD, sizeof(float) * KVD);
    }
    krn_cpu_rope(q, upos, N, NH, HD, inv_freq);
    krn_cpu_rope(k, upos, N, NKV, HD, inv_freq);
    for (int i = 0; i < N; i++) {
        for (int j = 0; j < NH * HD; j++)
            cr_assert(fabs(got[i * W + j] - q[i * NH * HD + j]) <= 1e-4, "q row %d dim %d", i, j);
        for (int j = 0; j < KVD; j++) {
            cr_assert(fabs(bf2f(kb[i * KVD + j]) - k[i * KVD + j]) <=
                          1e-2 * (1 + fabs(k[i * KVD + j])),
                      "k row %d dim %d", i, j);
            cr_assert_eq(vb[i * KVD + j], f2bf(qkv[i * W + NH * HD + KVD + j]), "v row %d dim %d",
                         i, j);
        }
    }
    cudaFree(dqkv), cudaFree(df), cudaFree(dpos), cudaFree(dkb), cudaFree(dvb);
    free(qkv), free(got);
}

/* add + RMSNorm of n rows of d against a double computation; the vectorised kernel (d % 4 == 0,
 * d <= 16384: one row in registers, up to 1024 threads) and the general one (d % 4 != 0 or
 * d > 16384). with_r = 0 leaves x alone. Then row 0 alone, in a 1-row launch: bitwise the same
 * outputs as in the n-row launch (a graph bucket pads the batch; a row must not depend on it). */
static void check_rmsnorm(int n, int d, int with_r) {
    size_t nd = (size_t)n * (size_t)d;
    float *x = f_rand(nd, 2.0f), *r = f_rand(nd, 1.0f);
    uint16_t *w = bf_rand((size_t)d, 1.0f);
    float *dx = cuda_test_up(x, sizeof(float) * nd), *dr = cuda_test_up(r, sizeof(float) * nd);
    void *dw = cuda_test_up(w, 2 * (size_t)d);
    float *dyf = cuda_test_up(NULL, sizeof(float) * nd);
    uint16_t *dyb = cuda_test_up(NULL, 2 * nd);
    CUDA_OK(krn_cuda_add_rmsnorm(dx, with_r ? dr : NULL, dw, n, d, 1e-5f, dyb, dyf, 0));
    float *x2 = malloc(sizeof(float) * nd), *yf = malloc(sizeof(float) * nd);
    uint16_t *yb = malloc(2 * nd);
    cr_assert(x2 && yf && yb);
    cuda_test_down(x2, dx, sizeof(float) * nd);
    cuda_test_down(yf, dyf, sizeof(float) * nd);
    cuda_test_down(yb, dyb, 2 * nd);
    for (int i = 0; i < n; i++) {
        const float *xi = x + (size_t)i * d, *ri = r + (size_t)i * d;
        double ss = 0;
        for (int j = 0; j < d; j++) {
            double v = (double)xi[j] + (with_r ? ri[j] : 0.0);
            cr_assert(fabs(x2[(size_t)i * d + j] - v) <= 1e-6 * (1 + fabs(v)),
                      "n=%d d=%d: residual row %d col %d", n, d, i, j);
            ss += v * v;
        }
        double inv = 1.0 / sqrt(ss / d + 1e-5);
        for (int j = 0; j < d; j++) {
            double ref = ((double)xi[j] + (with_r ? ri[j] : 0.0)) * inv * bf2f(w[j]);
            size_t o = (size_t)i * d + j;
            cr_assert(fabs(yf[o] - ref) <= 1e-4 * (1 + fabs(ref)),
                      "n=%d d=%d row %d col %d: %g vs %g", n, d, i, j, yf[o], ref);
            cr_assert(fabs(bf2f(yb[o]) - ref) <= 1e-2 * (1 + fabs(ref)),
                      "n=%d d=%d: bf16 row %d col %d", n, d, i, j);
        }
    }
    /* row 0 again, alone */
    float *one_f = malloc(sizeof(float) * (size_t)d), *one_x = malloc(sizeof(float) * (size_t)d);
    uint16_t *one_b = malloc(2 * (size_t)d);
    cr_assert(one_f && one_b && one_x);
    CUDA_OK(cudaMemcpy(dx, x, sizeof(float) * (size_t)d, cudaMemcpyHostToDevice));
    CUDA_OK(krn_cuda_add_rmsnorm(dx, with_r ? dr : NULL, dw, 1, d, 1e-5f, dyb, dyf, 0));
    cuda_test_down(one_f, dyf, sizeof(float) * (size_t)d);
    cuda_test_down(one_b, dyb, 2 * (size_t)d);
    cuda_test_down(one_x, dx, sizeof(float) * (size_t)d);
    cr_assert(memcmp(one_f, yf, sizeof(float) * (size_t)d) == 0,
              "d=%d: row 0 of %d rows differs alone", d, n);
    cr_assert(memcmp(one_b, yb, 2 * (size_t)d) == 0, "d=%d: bf16 row 0 of %d rows differs alone", d,
              n);
    cr_assert(memcmp(one_x, x2, sizeof(float) * (size_t)d) == 0, "d=%d: residual row 0", d);
    cudaFree(dx), cudaFree(dr), cudaFree(dw), cudaFree(dyf), cudaFree(dyb);
    free(x), free(r), free(w), free(x2), free(yf), free(yb), free(one_f), free(one_b), free(one_x);
}

Test(krn_cuda, add_rmsnorm_at_decode_and_prefill_shapes_and_a_row_independent_of_the_batch) {
    CUDA_TEST_REQUIRE_DEVICE();
    check_rmsnorm(1, 4096, 1);  /* 8B decode: 1024 threads, one float4 each */
    check_rmsnorm(64, 4096, 1); /* batch 64 */
    check_rmsnorm(8, 2048, 1);  /* 1B: 512 threads */
    check_rmsnorm(3, 8192, 0);  /* two float4 per thread, no residual (layer 0) */
    check_rmsnorm(2, 16384, 1); /* four float4 per thread */
    check_rmsnorm(2, 16388, 1); /* beyond: the general kernel */
    check_rmsnorm(5, 1002, 1);  /* d % 4 != 0: the general kernel */
    check_rmsnorm(17, 40, 1);   /* a tiny model: one warp, 10 of its lanes working */
}

/* RoPE with and without the fused KV append, n rows of an (nh, nkv, hd) model: q and kb against
 * kernels/cpu's RoPE, vb exact; the fused call gives bitwise the same q, kb and vb as the plain
 * one, and the pool holds bitwise kb / vb rows at dst (the -1 rows nowhere, the rest of the pool
 * untouched). hd % 8 == 0 takes the 16-byte path, other hd the general one. */
static void check_rope(int n, int nh, int nkv, int hd) {
    enum { PS = 16 };
    int w = (nh + 2 * nkv) * hd, kvd = nkv * hd, pages = (n + 3 + PS - 1) / PS + 1;
    size_t nw = (size_t)n * w, nk = (size_t)n * kvd, pool = (size_t)pages * 2 * PS * kvd;
    float *inv_freq = malloc(sizeof(float) * (size_t)(hd / 2));
    cr_assert(inv_freq);
    krn_cpu_rope_freqs(inv_freq, hd, 500000.0f, 8.0f, 1.0f, 4.0f, 8192);
    float *qkv = f_rand(nw, 1.0f);
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)n), *dst = malloc(sizeof(int32_t) * (size_t)n);
    uint32_t *upos = malloc(sizeof(uint32_t) * (size_t)n);
    cr_assert(pos && dst && upos);
    for (int i = 0; i < n; i++) {
        pos[i] = i == 0 ? 1023 : (i * 7919) % 32768; /* a 1k decode position, then spread */
        upos[i] = (uint32_t)pos[i];
        dst[i] = i % 5 == 3 ? -1 : (n - 1 - i) + 3; /* reversed, from token 3, some not stored */
    }
    float *dqkv = cuda_test_up(qkv, sizeof(float) * nw),
          *dqkv2 = cuda_test_up(qkv, sizeof(float) * nw),
          *df = cuda_test_up(inv_freq, sizeof(float) * (size_t)(hd / 2));
    int32_t *dpos = cuda_test_up(pos, sizeof(int32_t) * (size_t)n),
            *ddst = cuda_test_up(dst, sizeof(int32_t) * (size_t)n);
    uint16_t *dkb = cuda_test_up(NULL, 2 * nk), *dvb = cuda_test_up(NULL, 2 * nk),
             *dkb2 = cuda_test_up(NULL, 2 * nk), *dvb2 = cuda_test_up(NULL, 2 * nk),
             *dpool = cuda_test_up(NULL, 2 * pool);
    CUDA_OK(krn_cuda_rope_qkv(dqkv, dpos, n, nh, nkv, hd, df, dkb, dvb, 0));
    CUDA_OK(
        krn_cuda_rope_qkv_append(dqkv2, dpos, n, nh, nkv, hd, df, dkb2, dvb2, dpool, PS, ddst, 0));
    float *got = malloc(sizeof(float) * nw), *got2 = malloc(sizeof(float) * nw);
    uint16_t *kb = malloc(2 * nk), *vb = malloc(2 * nk), *kb2 = malloc(2 * nk),
             *vb2 = malloc(2 * nk), *pl = malloc(2 * pool);
    float *q = malloc(sizeof(float) * (size_t)n * nh * hd), *k = malloc(sizeof(float) * nk);
    cr_assert(got && got2 && kb && vb && kb2 && vb2 && pl && q && k);
    cuda_test_down(got, dqkv, sizeof(float) * nw);
    cuda_test_down(got2, dqkv2, sizeof(float) * nw);
    cuda_test_down(kb, dkb, 2 * nk);
    cuda_test_down(vb, dvb, 2 * nk);
    cuda_test_down(kb2, dkb2, 2 * nk);
    cuda_test_down(vb2, dvb2, 2 * nk);
    cuda_test_down(pl, dpool, 2 * pool);
    for (int i = 0; i < n; i++) {
        memcpy(q + (size_t)i * nh * hd, qkv + (size_t)i * w, sizeof(float) * (size_t)nh * hd);
        memcpy(k + (size_t)i * kvd, qkv + (size_t)i * w + (size_t)nh * hd,
               sizeof(float) * (size_t)kvd);
    }
    krn_cpu_rope(q, upos, n, nh, hd, inv_freq);
    krn_cpu_rope(k, upos, n, nkv, hd, inv_freq);
    cr_assert(memcmp(got, got2, sizeof(float) * nw) == 0, "(%d, %d, %d) n=%d: fused q differs", nh,
              nkv, hd, n);
    cr_assert(memcmp(kb, kb2, 2 * nk) == 0 && memcmp(vb, vb2, 2 * nk) == 0,
              "(%d, %d, %d) n=%d: fused kb/vb differ", nh, nkv, hd, n);
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < nh * hd; j++)
            cr_assert(fabs(got[(size_t)i * w + j] - q[(size_t)i * nh * hd + j]) <= 1e-4,
                      "(%d, %d, %d) n=%d: q row %d dim %d", nh, nkv, hd, n, i, j);
        for (int j = 0; j < kvd; j++) {
            size_t o = (size_t)i * kvd + j;
            cr_assert(fabs(bf2f(kb[o]) - k[o]) <= 1e-2 * (1 + fabs(k[o])),
                      "(%d, %d, %d) n=%d: k row %d dim %d", nh, nkv, hd, n, i, j);
            cr_assert_eq(vb[o], f2bf(qkv[(size_t)i * w + (size_t)(nh + nkv) * hd + j]),
                         "(%d, %d, %d) n=%d: v row %d dim %d", nh, nkv, hd, n, i, j);
        }
    }
    /* the pool: every token either a stored row's K/V or zero */
    for (int t = 0; t < pages * PS; t++) {
        int row = -1;
        for (int i = 0; i < n; i++)
            if (dst[i] == t) row = i;
        const uint16_t *pk = pl + ((size_t)(t / PS) * 2 * PS + (size_t)(t % PS)) * kvd,
                       *pv = pk + (size_t)PS * kvd;
        for (int j = 0; j < kvd; j++) {
            uint16_t ek = row < 0 ? 0 : kb[(size_t)row * kvd + j],
                     ev = row < 0 ? 0 : vb[(size_t)row * kvd + j];
            cr_assert(pk[j] == ek && pv[j] == ev,
                      "(%d, %d, %d) n=%d: pool token %d (row %d) dim %d", nh, nkv, hd, n, t, row,
                      j);
        }
    }
    cudaFree(dqkv), cudaFree(dqkv2), cudaFree(df), cudaFree(dpos), cudaFree(ddst);
    cudaFree(dkb), cudaFree(dvb), cudaFree(dkb2), cudaFree(dvb2), cudaFree(dpool);
    free(inv_freq), free(qkv), free(pos), free(dst), free(upos), free(got), free(got2);
    free(kb), free(vb), free(kb2), free(vb2), free(pl), free(q), free(k);
}

Test(krn_cuda, rope_qkv_append_at_the_1b_and_8b_shapes_equals_rope_then_kv_append) {
    CUDA_TEST_REQUIRE_DEVICE();
    for (int n = 1; n <= 17; n += 16) {
        check_rope(n, 32, 8, 64);  /* llama-3.2-1b */
        check_rope(n, 32, 8, 128); /* llama-3.1-8b */
        check_rope(n, 3, 1, 12);   /* hd % 8 != 0: the general kernel */
    }
}

Test(krn_cuda, kv_append_of_17_rows_at_the_8b_kv_width) {
    CUDA_TEST_REQUIRE_DEVICE();
    enum { PS = 16, KVD = 1024, N = 17, P = 3 };
    size_t layer = (size_t)P * 2 * PS * KVD;
    uint16_t *k = bf_rand(N * KVD, 1.0f), *v = bf_rand(N * KVD, 1.0f);
    int32_t dst[N];
    for (int i = 0; i < N; i++) dst[i] = i == 5 ? -1 : 2 * i + 1;
    uint16_t *dkv = cuda_test_up(NULL, 2 * layer);
    void *dk = cuda_test_up(k, 2 * N * KVD), *dv = cuda_test_up(v, 2 * N * KVD),
         *ddst = cuda_test_up(dst, sizeof dst);
    CUDA_OK(krn_cuda_kv_append(dkv, PS, KVD, dk, dv, ddst, N, 0));
    uint16_t *kv = malloc(2 * layer);
    cr_assert(kv);
    cuda_test_down(kv, dkv, 2 * layer);
    for (int t = 0; t < P * PS; t++) {
        int row = -1;
        for (int i = 0; i < N; i++)
            if (dst[i] == t) row = i;
        const uint16_t *pk = kv + ((size_t)(t / PS) * 2 * PS + (size_t)(t % PS)) * KVD,
                       *pv = pk + (size_t)PS * KVD;
        for (int j = 0; j < KVD; j++) {
            cr_assert_eq(pk[j], row < 0 ? 0 : k[row * KVD + j], "token %d K dim %d", t, j);
            cr_assert_eq(pv[j], row < 0 ? 0 : v[row * KVD + j], "token %d V dim %d", t, j);
        }
    }
    cudaFree(dkv), cudaFree(dk), cudaFree(dv), cudaFree(ddst);
    free(k), free(v), free(kv);
}

Test(krn_cuda, silu_mul_and_embed_and_row_moves) {
    CUDA_TEST_REQUIRE_DEVICE();
    enum { N = 3, F = 700, V = 50, D = 40 };
    float *gu = f_rand(N * 2 * F, 4.0f);
    float *dgu = cuda_test_up(gu, sizeof(float) * N * 2 * F);
    uint16_t *dh = cuda_test_up(NULL, 2 * N * F), h[N * F];
    CUDA_OK(krn_cuda_silu_mul(dgu, N, F, dh, 0));
    cuda_test_down(h, dh, sizeof h);
    for (int i = 0; i < N; i++)
        for (int j = 0; j < F; j++) {
            double g = gu[i * 2 * F + j], ref = g / (1 + exp(-g)) * gu[i * 2 * F + F + j];
            cr_assert(fabs(bf2f(h[i * F + j]) - ref) <= 1e-2 * (1 + fabs(ref)), "row %d col %d", i,
                      j);
        }
    uint16_t *table = bf_rand(V * D, 1.0f);
    uint32_t toks[N] = {7, 0, 49}, slots[N] = {5, 2, 0};
    void *dt = cuda_test_up(table, 2 * V * D), *dtok = cuda_test_up(toks, sizeof toks),
         *dslot = cuda_test_up(slots, sizeof slots);
    float *demb = cuda_test_up(NULL, sizeof(float) * 6 * D), emb[6 * D];
    CUDA_OK(krn_cuda_embed(dt, D, dtok, dslot, N, demb, 0));
    cuda_test_down(emb, demb, sizeof emb);
    for (int i = 0; i < N; i++)
        for (int j = 0; j < D; j++)
            cr_assert_eq(emb[slots[i] * D + j], bf2f(table[toks[i] * D + j]), "slot %u dim %d",
                         slots[i], j);
    /* gather rows 5, 0 into a 2-row buffer, scatter them back to 1 and (padding) nowhere */
    int32_t gidx[2] = {5, 0}, sidx[2] = {1, -1};
    void *dg = cuda_test_up(gidx, sizeof gidx), *ds = cuda_test_up(sidx, sizeof sidx);
    float *dtmp = cuda_test_up(NULL, sizeof(float) * 2 * D), moved[6 * D];
    CUDA_OK(krn_cuda_gather_rows(dtmp, demb, dg, 2, D, 0));
    CUDA_OK(krn_cuda_scatter_rows(demb, dtmp, ds, 2, D, 0));
    cuda_test_down(moved, demb, sizeof moved);
    for (int j = 0; j < D; j++) {
        cr_assert_eq(moved[1 * D + j], emb[5 * D + j]);
        cr_assert_eq(moved[0 * D + j], emb[0 * D + j]);
    }
    cudaFree(dgu), cudaFree(dh), cudaFree(dt), cudaFree(dtok), cudaFree(dslot), cudaFree(demb);
    cudaFree(dg), cudaFree(ds), cudaFree(dtmp);
    free(gu), free(table);
}

/* ---- pages ----------------------------------------------------------------------------------- */

Test(krn_cuda, kv_append_and_page_copy_move_k_v_and_masks_in_every_layer) {
    CUDA_TEST_REQUIRE_DEVICE();
    enum { L = 3, P = 4, PS = 8, KVD = 12, N = 3 };
    size_t layer = (size_t)P * 2 * PS * KVD;
    uint16_t *dkv = cuda_test_up(NULL, 2 * L * layer);
    uint8_t pm[P * PS] = {0};
    pm[1 * PS + 2] = 1;
    uint8_t *dpm = cuda_test_up(pm, sizeof pm);
    uint16_t *k = bf_rand(N * KVD, 1.0f), *v = bf_rand(N * KVD, 1.0f);
    void *dk = cuda_test_up(k, 2 * N * KVD), *dv = cuda_test_up(v, 2 * N * KVD);
    int32_t dst[N] = {1 * PS + 2, -1, 3 * PS + 7};
    void *ddst = cuda_test_up(dst, sizeof dst);
    for (int l = 0; l < L; l++)
        CUDA_OK(krn_cuda_kv_append(dkv + l * layer, PS, KVD, dk, dv, ddst, N, 0));
    /* page 1 offsets [2, 3) → page 2 offset 5 */
    CUDA_OK(krn_cuda_page_copy(dkv, layer, L, PS, KVD, dpm, 1 * PS + 2, 2 * PS + 5, 1, 0));
    uint16_t *kv = malloc(2 * L * layer);
    cuda_test_down(kv, dkv, 2 * L * layer);
    cuda_test_down(pm, dpm, sizeof pm);
    for (int l = 0; l < L; l++) {
        const uint16_t *base = kv + l * layer;
        for (int j = 0; j < KVD; j++) {
            cr_assert_eq(base[((1 * 2 + 0) * PS + 2) * KVD + j], k[0 * KVD + j], "layer %d K", l);
            cr_assert_eq(base[((1 * 2 + 1) * PS + 2) * KVD + j], v[0 * KVD + j], "layer %d V", l);
            cr_assert_eq(base[((3 * 2 + 0) * PS + 7) * KVD + j], k[2 * KVD + j], "layer %d K", l);
            cr_assert_eq(base[((2 * 2 + 0) * PS + 5) * KVD + j], k[0 * KVD + j], "copied K");
            cr_assert_eq(base[((2 * 2 + 1) * PS + 5) * KVD + j], v[0 * KVD + j], "copied V");
        }
    }
    cr_assert_eq(pm[2 * PS + 5], 1, "the mask byte travels with the copy");
    cudaFree(dkv), cudaFree(dpm), cudaFree(dk), cudaFree(dv), cudaFree(ddst);
    free(k), free(v), free(kv);
}

/* ---- attention ------------------------------------------------------------------------------- */

/* How a case's tiles split their keys: every tile into `splits` chunks (1: none), or as the
 * engine does (SPLIT_PER_TILE: tiles over 128 keys or more into chunks of 64 keys or more, up to
 * KRN_CUDA_MAX_SPLITS, short ones not at all, in one launch of KRN_CUDA_MAX_SPLITS split blocks
 * per tile — the shape of a captured graph). */
#define SPLIT_PER_TILE (-1)

/* Runs the CUDA-core (tc false) or tensor-core kernel on the case; out [rows][qd] f32. */
static void run_cuda_attention(const kc_attn_case *c, int splits, bool tc, float *out) {
    int hd = c->head_dim, kvd = c->n_kv_heads * hd, qd = c->n_heads * hd;
    int rows = tc ? krn_cuda_attn_tc_rows(c->n_heads, c->n_kv_heads)
                  : krn_cuda_attn_tile_rows(c->n_heads, c->n_kv_heads);
    size_t kv_elems = (size_t)c->pool_pages * c->page_size * 2 * kvd;
    uint16_t *kv = malloc(2 * kv_elems), *kt = malloc(2 * (size_t)c->rows * kvd),
             *vt = malloc(2 * (size_t)c->rows * kvd);
    krn_cuda_attn_tile *tiles = calloc((size_t)c->rows, sizeof *tiles);
    cr_assert(kv && kt && vt && tiles);
    for (size_t i = 0; i < kv_elems; i++) kv[i] = f2bf(c->kv[i]); /* exact: bf16 values */
    for (size_t i = 0; i < (size_t)c->rows * kvd; i++)
        kt[i] = f2bf(c->kt[i]), vt[i] = f2bf(c->vt[i]);
    int n_tiles = 0, launch_splits = splits == SPLIT_PER_TILE ? KRN_CUDA_MAX_SPLITS : splits;
    for (int s = 0; s < c->n_seqs; s++) {
        const kc_attn_seq *q = &c->seq[s];
        for (int r = 0; r < q->n_q; r += rows) {
            krn_cuda_attn_tile t = {.q_row = q->q_row + r,
                                    .o_row = q->q_row + r,
                                    .n_q = q->n_q - r < rows ? q->n_q - r : rows,
                                    .q_seq = q->q_seq + r,
                                    .n_ctx = q->n_ctx,
                                    .pages = q->page0,
                                    .tail_row = q->tail_row,
                                    .n_tail = q->n_tail,
                                    .pm_ctx = q->pm_ctx,
                                    .mask_row = q->runs ? q->q_row + r : -1,
                                    .n_split = 1,
                                    .part_row = q->q_row + r};
            int lim = t.n_ctx + t.n_tail < t.q_seq + t.n_q ? t.n_ctx + t.n_tail : t.q_seq + t.n_q;
            int want = splits == SPLIT_PER_TILE ? (lim >= 128 ? lim / 64 : 1) : splits;
            if (want > KRN_CUDA_MAX_SPLITS) want = KRN_CUDA_MAX_SPLITS;
            if (!tc && want > 1) {
                t.kv_chunk = ((lim + want - 1) / want + 31) / 32 * 32;
                t.n_split = (lim + t.kv_chunk - 1) / t.kv_chunk;
            }
            tiles[n_tiles++] = t;
        }
    }
    size_t parts = (size_t)KRN_CUDA_MAX_SPLITS * c->rows * c->n_heads;
    krn_cuda_attn_args a = {
        .tiles = cuda_test_up(tiles, sizeof *tiles * (size_t)n_tiles),
        .n_tiles = n_tiles,
        .q = cuda_test_up(c->q, sizeof(float) * (size_t)c->rows * qd),
        .q_stride = qd,
        .kv = cuda_test_up(kv, 2 * kv_elems),
        .page_list = cuda_test_up(c->pages, sizeof(uint32_t) * (size_t)c->n_page_list),
        .page_mask = cuda_test_up(c->page_mask, (size_t)c->pool_pages * c->page_size),
        .page_size = c->page_size,
        .kb = cuda_test_up(kt, 2 * (size_t)c->rows * kvd),
        .vb = cuda_test_up(vt, 2 * (size_t)c->rows * kvd),
        .runs = cuda_test_up(c->runs, sizeof(uint32_t) * (size_t)c->n_runs),
        .row_runs = cuda_test_up(c->row_runs, sizeof(int32_t) * (size_t)c->rows),
        .n_heads = c->n_heads,
        .n_kv_heads = c->n_kv_heads,
        .hd = hd,
        .scale = c->scale,
        .out = cuda_test_up(NULL, 2 * (size_t)c->rows * qd),
        .n_splits = tc ? 1 : launch_splits,
        .part_acc = cuda_test_up(NULL, sizeof(float) * parts * hd),
        .part_ml = cuda_test_up(NULL, sizeof(float) * parts * 2),
        .split_rows = c->rows,
    };
    CUDA_OK(krn_cuda_init(hd));
    CUDA_OK(tc ? krn_cuda_attention_tc(&a, 0) : krn_cuda_attention(&a, 0));
    uint16_t *ob = malloc(2 * (size_t)c->rows * qd);
    cr_assert_not_null(ob);
    cuda_test_down(ob, a.out, 2 * (size_t)c->rows * qd);
    for (size_t i = 0; i < (size_t)c->rows * qd; i++) out[i] = bf2f(ob[i]);
    void *ptrs[] = {(void *)a.tiles,     (void *)a.q,  (void *)a.kv, (void *)a.page_list,
                    (void *)a.page_mask, (void *)a.kb, (void *)a.vb, (void *)a.runs,
                    (void *)a.row_runs,  a.out,        a.part_acc,   a.part_ml};
    for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) CUDA_OK(cudaFree(ptrs[i]));
    free(kv), free(kt), free(vt), free(tiles), free(ob);
}

static void check_case(int hd, bool uniform, int splits, bool tc) {
    kc_attn_case c;
    char why[512];
    cr_assert(kc_attn_build(&c, hd, (uint64_t)hd, why, sizeof why), "%s", why);
    if (uniform) kc_attn_randomize(&c, (uint64_t)hd);
    float *out = malloc(sizeof(float) * (size_t)c.rows * c.n_heads * hd);
    cr_assert_not_null(out);
    run_cuda_attention(&c, splits, tc, out);
    cr_assert(kc_attn_check(&c, out, uniform ? 1e-2 : KC_ATTN_RTOL, why, sizeof why),
              "%s kernel, %s case, %d splits: %s", tc ? "tensor-core" : "CUDA-core",
              uniform ? "near-uniform" : "sharpened", splits, why);
    free(out);
    kc_attn_free(&c);
}

Test(krn_cuda, sharpened_attention_at_head_dim_32_64_128_256_with_1_4_16_64_splits) {
    CUDA_TEST_REQUIRE_DEVICE();
    /* 32 to 256: every accumulator width of the CUDA-core kernel (1, 2, 4, 8 dims a lane) */
    static const int hds[] = {32, 64, 128, 256}, splits[] = {1, 4, 16, 64, SPLIT_PER_TILE};
    for (size_t h = 0; h < 4; h++) {
        size_t need = 0, limit = 0;
        CUDA_OK(krn_cuda_attn_smem(hds[h], &need, &limit));
        if (need > limit) { /* eng_open refuses this head_dim on this device, and says so */
            fprintf(stderr, "head_dim %d: %zu bytes of shared memory, the device has %zu\n", hds[h],
                    need, limit);
            continue;
        }
        for (size_t s = 0; s < 5; s++) check_case(hds[h], false, splits[s], false);
    }
}

Test(krn_cuda, near_uniform_attention_at_head_dim_32_64_128_256_with_1_4_16_64_splits) {
    CUDA_TEST_REQUIRE_DEVICE();
    /* 32 to 256: every accumulator width of the CUDA-core kernel (1, 2, 4, 8 dims a lane) */
    static const int hds[] = {32, 64, 128, 256}, splits[] = {1, 4, 16, 64, SPLIT_PER_TILE};
    for (size_t h = 0; h < 4; h++) {
        size_t need = 0, limit = 0;
        CUDA_OK(krn_cuda_attn_smem(hds[h], &need, &limit));
        if (need > limit) continue;
        for (size_t s = 0; s < 5; s++) check_case(hds[h], true, splits[s], false);
    }
}

Test(krn_cuda, tensor_core_attention_passes_the_sharpened_and_near_uniform_cases) {
    CUDA_TEST_REQUIRE_DEVICE();
    static const int hds[] = {64, 128};
    int ran = 0;
    for (size_t h = 0; h < 2; h++) {
        CUDA_OK(krn_cuda_init(hds[h]));
        if (!krn_cuda_attn_tc_fits(hds[h], 8, 2)) continue; /* sm_80+ and its shared memory */
        check_case(hds[h], false, 1, true);
        check_case(hds[h], true, 1, true);
        ran++;
    }
    if (ran == 0) cr_skip_test("this device runs no tensor-core attention (sm_80+ needed)");
}

/* ---- distributions --------------------------------------------------------------------------- */

/* One row through krn_cuda_topk; ids / probs [k]. */
static void cuda_topk_row(const float *x, uint32_t n, float t, uint32_t k, uint32_t *ids,
                          float *probs) {
    int32_t kk = (int32_t)k;
    float *dlg = cuda_test_up(x, sizeof(float) * n), *dt = cuda_test_up(&t, sizeof t);
    int32_t *dk = cuda_test_up(&kk, sizeof kk);
    uint32_t *dids = cuda_test_up(NULL, sizeof(uint32_t) * KRN_CUDA_TOPK_MAX);
    float *dp = cuda_test_up(NULL, sizeof(float) * KRN_CUDA_TOPK_MAX);
    CUDA_OK(krn_cuda_topk(dlg, 1, (int)n, dt, dk, dids, dp, 0));
    cuda_test_down(ids, dids, sizeof(uint32_t) * k);
    cuda_test_down(probs, dp, sizeof(float) * k);
    void *ptrs[] = {dlg, dt, dk, dids, dp};
    for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) CUDA_OK(cudaFree(ptrs[i]));
}

Test(krn_cuda, topk_edges_match_the_cpu_semantics_inf_nan_and_underflowed_ties) {
    CUDA_TEST_REQUIRE_DEVICE();
    float *x = malloc(sizeof(float) * KC_DIST_EDGE_MAX_N);
    uint32_t ids[KRN_CUDA_TOPK_MAX];
    float probs[KRN_CUDA_TOPK_MAX];
    cr_assert_not_null(x);
    for (int e = 0; e < KC_DIST_EDGES; e++) {
        uint32_t n, k;
        float t;
        const char *name = kc_dist_edge(e, x, &n, &t, &k);
        cuda_topk_row(x, n, t, k, ids, probs);
        char why[512];
        cr_assert(kc_dist_check(x, n, t, k, ids, probs, 1e-5, why, sizeof why), "%s: %s", name,
                  why);
    }
    free(x);
}

Test(krn_cuda, topk_over_a_128k_vocabulary_with_many_ties_matches_the_reference) {
    CUDA_TEST_REQUIRE_DEVICE();
    enum { V = 128256, ROWS = 3 };
    float *lg = malloc(sizeof(float) * ROWS * V);
    cr_assert_not_null(lg);
    for (size_t i = 0; i < (size_t)ROWS * V; i++)
        lg[i] = roundf(frand() * 640.0f) / 64.0f; /* multiples of 1/64: many exact ties */
    float temp[ROWS] = {1.0f, 0.7f, 2.5f};
    int32_t k[ROWS] = {1, 50, 1024};
    float *dlg = cuda_test_up(lg, sizeof(float) * ROWS * V), *dt = cuda_test_up(temp, sizeof temp);
    int32_t *dk = cuda_test_up(k, sizeof k);
    uint32_t *dids = cuda_test_up(NULL, sizeof(uint32_t) * ROWS * KRN_CUDA_TOPK_MAX);
    float *dp = cuda_test_up(NULL, sizeof(float) * ROWS * KRN_CUDA_TOPK_MAX);
    CUDA_OK(krn_cuda_topk(dlg, ROWS, V, dt, dk, dids, dp, 0));
    uint32_t *ids = malloc(sizeof(uint32_t) * ROWS * KRN_CUDA_TOPK_MAX);
    float *probs = malloc(sizeof(float) * ROWS * KRN_CUDA_TOPK_MAX);
    cr_assert(ids && probs);
    cuda_test_down(ids, dids, sizeof(uint32_t) * ROWS * KRN_CUDA_TOPK_MAX);
    cuda_test_down(probs, dp, sizeof(float) * ROWS * KRN_CUDA_TOPK_MAX);
    for (int r = 0; r < ROWS; r++) {
        char why[512];
        cr_assert(kc_dist_check(lg + (size_t)r * V, V, temp[r], (uint32_t)k[r],
                                ids + (size_t)r * KRN_CUDA_TOPK_MAX,
                                probs + (size_t)r * KRN_CUDA_TOPK_MAX, 1e-5, why, sizeof why),
                  "row %d (T=%g, k=%d): %s", r, temp[r], k[r], why);
    }
    void *ptrs[] = {dlg, dt, dk, dids, dp};
    for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) CUDA_OK(cudaFree(ptrs[i]));
    free(lg), free(ids), free(probs);
}
