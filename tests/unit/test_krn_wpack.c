/* test_krn_wpack.c — bf16 weights packed once (krn_wpack_bf16, KRN_BF16_PANEL) and the cpu
 * engine that packs its weights at open (PIE_KRN_PREPACK).
 *
 * (1) Kernels: the packed layout element by element; krn_cpu_linear on packed W equals, bit for
 * bit, Σ_k f32(w) · x as fmaf in k order (what every exact packed path computes) on the
 * scalar, avx2 and avx512 paths, for n = 1..40, 255-257 and 300, odd in and out, no pool and
 * pools of 1 and 2 threads, AMX and AVX512-BF16 off; on avx512 it also equals the panels packed per
 * call (krn_cpu_linear on row-major W) for 4 <= n <= 256; the AVX512-BF16 case equals the per-call
 * dot panels bit for bit and is within that path's stated bound; krn_cpu_linear_multi equals
 * separate calls; the embedding gather from a packed table equals the row-major gather.
 * (2) The engine: tiny-bf16 with PIE_KRN_PREPACK=1 packs its weights and writes the same
 * next_dist bits as with PIE_KRN_PREPACK=0 (batches of 4-256 rows: the panel path both ways),
 * and single-row logits within f32 rounding; with AMX on, the same top-32 ids and
 * probabilities within 1e-4 relative.
 * (3) AMX on packed W: the bits of AMX on the same W row-major (zero-padded to multiples of 32),
 * n = 8-40, 255-257, 300, 512, odd out, in not a multiple of 32, no pool and pools of 1 and 2;
 * fewer than 8 rows still take the exact kernels; multi = separate calls with AMX on. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "eng.h"
#include "krn_cpu.h"
#include "pie_testeng.h"

/* ---- helpers --------------------------------------------------------------------------------- */

static uint32_t g_seed = 12345u;
static float rnd(void) { /* uniform in [-1, 1) */
    g_seed = g_seed * 1664525u + 1013904223u;
    return (float)((g_seed >> 8) & 0xffffffu) / 8388608.0f - 1.0f;
}

static uint16_t bf16_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)(u >> 16); /* truncation: any bf16 value will do */
}

static float f32_of(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static uint16_t *rand_w(int out, int in) {
    uint16_t *w = malloc((size_t)out * (size_t)in * sizeof *w);
    cr_assert_not_null(w);
    for (size_t i = 0; i < (size_t)out * (size_t)in; i++) w[i] = bf16_of(rnd());
    return w;
}

static float *rand_x(int n, int in) {
    float *x = malloc((size_t)n * (size_t)in * sizeof *x);
    cr_assert_not_null(x);
    for (size_t i = 0; i < (size_t)n * (size_t)in; i++) x[i] = rnd();
    return x;
}

static void *pack(krn_pool *p, const uint16_t *w, int out, int in) {
    size_t bytes = krn_wpack_bytes(out, in);
    void *wp = aligned_alloc(64, (bytes + 63) / 64 * 64);
    cr_assert_not_null(wp);
    memset(wp, 0xa5, bytes); /* packing must write every byte */
    krn_wpack_bf16(p, w, out, in, wp);
    return wp;
}

/* y[r][o] = Σ_k f32(w[o][k]) · x[r][k]: fmaf in k order, starting from +0, the padding column
 * of an odd `in` included (0 · 0), as the packed kernels sum. */
static void ref_fma(const float *x, int n, int in, const uint16_t *w, int out, float *y) {
    for (int r = 0; r < n; r++)
        for (int o = 0; o < out; o++) {
            float acc = 0.0f;
            for (int k = 0; k < in; k++)
                acc = fmaf(f32_of(w[(size_t)o * (size_t)in + (size_t)k]),
                           x[(size_t)r * (size_t)in + (size_t)k], acc);
            if (in % 2) acc = fmaf(0.0f, 0.0f, acc);
            y[(size_t)r * (size_t)out + (size_t)o] = acc;
        }
}

/* The first element where a and b differ in bits, or -1. */
static long first_diff(const float *a, const float *b, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof a[i]) != 0) return (long)i;
    return -1;
}

/* The exact paths only: no AMX, no AVX512-BF16 (either may be absent: then nothing to turn off). */
static void exact_kernels(void) {
    (void)krn_cpu_set_amx(0);
    (void)krn_cpu_set_bf16dot(0);
}

/* ---- (1) kernels ----------------------------------------------------------------------------- */

Test(krn_wpack, layout_is_pairs_of_32_rows_per_panel_zero_padded) {
    int out = 45, in = 67; /* two panels, the second with 13 rows; in padded to 96 */
    cr_assert_eq(krn_wpack_bytes(out, in), (size_t)2 * 48 * 32 * 4);
    cr_assert_eq(krn_wpack_bytes(64, 2048), (size_t)64 * 2048 * 2, "no padding when aligned");
    uint16_t *w = rand_w(out, in);
    const char *paths[] = {"scalar", "avx2", "avx512"};
    for (int s = 0; s < 3; s++) {
        if (krn_cpu_set_simd(paths[s]) != 0) continue;
        uint32_t *wp = pack(NULL, w, out, in);
        for (int panel = 0; panel < 2; panel++)
            for (int p = 0; p < 48; p++)
                for (int i = 0; i < 32; i++) {
                    int o = panel * 32 + i, k = 2 * p;
                    uint32_t lo = o < out && k < in ? w[(size_t)o * in + k] : 0;
                    uint32_t hi = o < out && k + 1 < in ? w[(size_t)o * in + k + 1] : 0;
                    uint32_t got = wp[(size_t)panel * 48 * 32 + (size_t)p * 32 + (size_t)i];
                    cr_assert_eq(got, lo | hi << 16,
                                 "%s: panel %d pair %d row %d: 0x%08x, expected 0x%08x", paths[s],
                                 panel, p, i, got, lo | hi << 16);
                }
        free(wp);
    }
    free(w);
}

/* Every n of the list on shape (out, in), no pool and pools of 1 and 2: packed == ref_fma bit for
 * bit, and on avx512 with 4 <= n <= 256 == the per-call panels (row-major KRN_BF16). */
static void check_exact(const char *path, int out, int in, const int *ns, int n_ns) {
    uint16_t *w = rand_w(out, in);
    int max_n = 0;
    for (int i = 0; i < n_ns; i++) max_n = ns[i] > max_n ? ns[i] : max_n;
    float *x = rand_x(max_n, in);
    float *y = malloc((size_t)max_n * out * sizeof *y),
          *ref = malloc((size_t)max_n * out * sizeof *ref);
    float *row = malloc((size_t)max_n * out * sizeof *row);
    cr_assert(y && ref && row);
    for (int threads = 0; threads <= 2; threads++) { /* 0: no pool (all in the caller) */
        krn_pool *p = threads ? krn_pool_create(threads) : NULL;
        cr_assert(p || !threads);
        void *wp = pack(p, w, out, in);
        for (int i = 0; i < n_ns; i++) {
            int n = ns[i];
            size_t cnt = (size_t)n * out;
            ref_fma(x, n, in, w, out, ref);
            memset(y, 0xff, cnt * sizeof *y);
            krn_cpu_linear(p, x, n, in, wp, KRN_BF16_PANEL, out, y);
            long d = first_diff(y, ref, cnt);
            cr_assert(d < 0,
                      "%s, %d threads, %d -> %d, n = %d: y[%ld] = %.9g, k-order fma sum %.9g", path,
                      threads, in, out, n, d, d < 0 ? 0.0 : y[d], d < 0 ? 0.0 : ref[d]);
            if (strcmp(path, "avx512") == 0 && n >= 4 && n <= 256) {
                krn_cpu_linear(p, x, n, in, w, KRN_BF16, out, row);
                d = first_diff(y, row, cnt);
                cr_assert(d < 0,
                          "avx512, %d threads, %d -> %d, n = %d: packed y[%ld] = %.9g, "
                          "per-call panels %.9g",
                          threads, in, out, n, d, d < 0 ? 0.0 : y[d], d < 0 ? 0.0 : row[d]);
            }
        }
        free(wp);
        krn_pool_destroy(p);
    }
    free(w), free(x), free(y), free(ref), free(row);
}

static void exact_on(const char *path) {
    if (krn_cpu_set_simd(path) != 0) cr_skip_test("this CPU has no %s path", path);
    exact_kernels();
    int ns[48], k = 0;
    for (int n = 1; n <= 40; n++) ns[k++] = n;
    ns[k++] = 255, ns[k++] = 256, ns[k++] = 257, ns[k++] = 300;
    check_exact(path, 45, 67, ns, k);  /* odd in and out, 2 panels */
    check_exact(path, 97, 130, ns, k); /* one full block and a partial one of 128 columns */
    int few[] = {1, 3, 4, 12, 13, 33};
    check_exact(path, 64, 256, few, 6); /* aligned, two blocks */
    check_exact(path, 33, 1, few, 6);   /* in = 1 */
}

Test(krn_wpack, exact_sums_in_k_order_on_avx512) { exact_on("avx512"); }
Test(krn_wpack, exact_sums_in_k_order_on_avx2) { exact_on("avx2"); }
Test(krn_wpack, exact_sums_in_k_order_on_scalar) { exact_on("scalar"); }

/* The AVX512-BF16 rows (8..32): the bits of the per-call dot panels, and within the bound
 * krn_cpu.h states for that path against a float64 sum of w · bf16(x). */
Test(krn_wpack, dot_path_matches_the_dot_panels_and_its_bound) {
    if (krn_cpu_set_simd("avx512") != 0 || krn_cpu_set_bf16dot(2) != 0)
        cr_skip_test("this CPU has no AVX512-BF16");
    (void)krn_cpu_set_amx(0);
    int out = 45, in = 67;
    uint16_t *w = rand_w(out, in);
    float *x = rand_x(32, in);
    float *y = malloc(32 * out * sizeof *y), *row = malloc(32 * out * sizeof *row);
    uint16_t *xb = malloc((size_t)32 * in * sizeof *xb);
    cr_assert(y && row && xb);
    krn_cvt_bf16(x, (size_t)32 * in, xb);
    krn_pool *p = krn_pool_create(2);
    void *wp = pack(p, w, out, in);
    double worst = 0;
    for (int n = 8; n <= 32; n++) {
        krn_cpu_linear(p, x, n, in, wp, KRN_BF16_PANEL, out, y);
        krn_cpu_linear(p, x, n, in, w, KRN_BF16, out, row); /* the dot panels (set_bf16dot(2)) */
        long d = first_diff(y, row, (size_t)n * out);
        cr_assert(d < 0, "n = %d: packed y[%ld] = %.9g, dot panels %.9g", n, d, d < 0 ? 0.0 : y[d],
                  d < 0 ? 0.0 : row[d]);
        for (int r = 0; r < n; r++)
            for (int o = 0; o < out; o++) {
                double s = 0, a = 0;
                for (int k = 0; k < in; k++) {
                    double t =
                        (double)f32_of(w[(size_t)o * in + k]) * f32_of(xb[(size_t)r * in + k]);
                    s += t, a += fabs(t);
                }
                double bound = ((in + 31) / 32 * 32 / 16.0 + 5) * ldexp(1.0, -24) * a;
                double err = fabs((double)y[(size_t)r * out + o] - s);
                cr_assert(err <= bound,
                          "n = %d, y[%d][%d] = %.9g, reference %.9g: error %.3g > %.3g", n, r, o,
                          y[(size_t)r * out + o], s, err, bound);
                if (a > 0) worst = fmax(worst, err / bound);
            }
    }
    cr_log_info("dot path: largest error %.2f of the bound", worst);
    krn_cpu_set_bf16dot(0);
    free(wp), krn_pool_destroy(p);
    free(w), free(x), free(y), free(row), free(xb);
}

/* ---- AMX on packed W ---------------------------------------------------------------------- */

/* AMX on (and the avx512 path it needs), or skip the test with the reason. */
static void amx_or_skip(void) {
    if (krn_cpu_set_simd("avx512") != 0 || krn_cpu_set_amx(1) != 0 || !krn_cpu_amx_active())
        cr_skip_test("this CPU (or kernel) gives no AMX: nothing to compare");
    (void)krn_cpu_set_bf16dot(0);
}

/* AMX reading packed W (x as A tiles, the panels as B tiles) against AMX reading row-major W
 * (W as A tiles, x as B tiles) of the same weights zero-padded to out and in multiples of 32
 * (so every row takes the tiles, none the GEMV tail): the same products in the same order, so
 * the same bits for every valid output; no pool and pools of 1 and 2. */
static void check_amx(int out, int in, const int *ns, int n_ns) {
    int out32 = (out + 31) / 32 * 32, in32 = (in + 31) / 32 * 32, max_n = 0;
    for (int i = 0; i < n_ns; i++) max_n = ns[i] > max_n ? ns[i] : max_n;
    uint16_t *w = rand_w(out, in), *wpad = calloc((size_t)out32 * in32, sizeof *wpad);
    float *x = rand_x(max_n, in), *xpad = calloc((size_t)max_n * in32, sizeof *xpad);
    float *y = malloc((size_t)max_n * out * sizeof *y),
          *ref = malloc((size_t)max_n * out32 * sizeof *ref);
    cr_assert(wpad && xpad && y && ref);
    for (int o = 0; o < out; o++) memcpy(wpad + (size_t)o * in32, w + (size_t)o * in, in * 2);
    for (int r = 0; r < max_n; r++)
        memcpy(xpad + (size_t)r * in32, x + (size_t)r * in, (size_t)in * sizeof *x);
    for (int threads = 0; threads <= 2; threads++) {
        krn_pool *p = threads ? krn_pool_create(threads) : NULL;
        cr_assert(p || !threads);
        void *wp = pack(p, w, out, in);
        for (int i = 0; i < n_ns; i++) {
            int n = ns[i];
            memset(y, 0xff, (size_t)n * out * sizeof *y);
            krn_cpu_linear(p, x, n, in, wp, KRN_BF16_PANEL, out, y);
            krn_cpu_linear(p, xpad, n, in32, wpad, KRN_BF16, out32, ref);
            for (int r = 0; r < n; r++)
                for (int o = 0; o < out; o++) {
                    float a = y[(size_t)r * out + o], b = ref[(size_t)r * out32 + o];
                    cr_assert(memcmp(&a, &b, sizeof a) == 0,
                              "%d threads, %d -> %d, n = %d: y[%d][%d] = %.9g on packed W, %.9g "
                              "on row-major W",
                              threads, in, out, n, r, o, a, b);
                }
        }
        free(wp);
        krn_pool_destroy(p);
    }
    free(w), free(wpad), free(x), free(xpad), free(y), free(ref);
}

Test(krn_wpack, amx_on_packed_w_equals_amx_on_row_major_w) {
    amx_or_skip();
    int ns[48], k = 0;
    for (int n = 8; n <= 40; n++) ns[k++] = n;
    ns[k++] = 255, ns[k++] = 256, ns[k++] = 257, ns[k++] = 300, ns[k++] = 512;
    check_amx(67, 96, ns, k);  /* odd out: a panel with 3 rows, its second half empty */
    check_amx(45, 67, ns, k);  /* in not a multiple of 32 (nor of 2) */
    check_amx(64, 256, ns, k); /* aligned */
    int few[] = {8, 16, 17, 32, 33};
    check_amx(96, 130, few, 5);
    check_amx(20, 1, few, 5); /* in = 1, out < 32 */
}

/* Below KRN_LINEAR_AMX_MIN_N (8) rows the packed GEMV / panels run even with AMX on: the bits of
 * the exact k-order sums. */
Test(krn_wpack, amx_on_leaves_fewer_than_8_rows_to_the_exact_kernels) {
    amx_or_skip();
    int out = 45, in = 67;
    uint16_t *w = rand_w(out, in);
    float *x = rand_x(7, in), y[7 * 45], ref[7 * 45];
    krn_pool *p = krn_pool_create(2);
    void *wp = pack(p, w, out, in);
    for (int n = 1; n <= 7; n++) {
        krn_cpu_linear(p, x, n, in, wp, KRN_BF16_PANEL, out, y);
        ref_fma(x, n, in, w, out, ref);
        long d = first_diff(y, ref, (size_t)n * out);
        cr_assert(d < 0, "n = %d: y[%ld] = %.9g, k-order fma sum %.9g", n, d, d < 0 ? 0.0 : y[d],
                  d < 0 ? 0.0 : ref[d]);
    }
    free(wp), krn_pool_destroy(p), free(w), free(x);
}

/* q/k/v-like weights (and more than one pool run's worth: 5) through krn_cpu_linear_multi:
 * the same bits as separate calls, on every path and for GEMV, panel and chunked sizes. */
Test(krn_wpack, multi_equals_separate_calls) {
    const char *paths[] = {"avx512", "avx2", "scalar"};
    int outs_n[5] = {96, 32, 45, 7, 70}, in = 130, ns[] = {1, 3, 4, 9, 32, 300};
    for (int s = 0; s < 4; s++) { /* the last: avx512 with AMX (where there is AMX) */
        if (krn_cpu_set_simd(paths[s % 3]) != 0) continue;
        exact_kernels();
        if (s == 3 && krn_cpu_set_amx(1) != 0) continue;
        krn_pool *p = krn_pool_create(2);
        float *x = rand_x(300, in);
        uint16_t *w[5];
        void *wp[5];
        float *ym[5], *ys[5];
        krn_linear_out outs[5];
        for (int i = 0; i < 5; i++) {
            w[i] = rand_w(outs_n[i], in);
            wp[i] = pack(p, w[i], outs_n[i], in);
            ym[i] = malloc((size_t)300 * outs_n[i] * sizeof(float));
            ys[i] = malloc((size_t)300 * outs_n[i] * sizeof(float));
            outs[i] = (krn_linear_out){.w = wp[i], .out = outs_n[i], .y = ym[i]};
        }
        for (size_t t = 0; t < sizeof ns / sizeof ns[0]; t++) {
            int n = ns[t];
            krn_cpu_linear_multi(p, x, n, in, KRN_BF16_PANEL, outs, 5);
            for (int i = 0; i < 5; i++) {
                krn_cpu_linear(p, x, n, in, wp[i], KRN_BF16_PANEL, outs_n[i], ys[i]);
                long d = first_diff(ym[i], ys[i], (size_t)n * outs_n[i]);
                cr_assert(d < 0, "%s%s, n = %d, weight %d: multi y[%ld] = %.9g, alone %.9g",
                          paths[s % 3], s == 3 ? " + AMX" : "", n, i, d, d < 0 ? 0.0 : ym[i][d],
                          d < 0 ? 0.0 : ys[i][d]);
            }
        }
        for (int i = 0; i < 5; i++) free(w[i]), free(wp[i]), free(ym[i]), free(ys[i]);
        free(x);
        krn_pool_destroy(p);
    }
}

Test(krn_wpack, embed_gathers_the_rows_of_a_packed_table) {
    int vocab = 77, d = 67;
    uint16_t *t = rand_w(vocab, d);
    void *tp = pack(NULL, t, vocab, d);
    uint32_t toks[] = {0, 31, 32, 76, 5, 63, 64};
    int n = (int)(sizeof toks / sizeof toks[0]);
    float *a = malloc((size_t)n * d * sizeof *a), *b = malloc((size_t)n * d * sizeof *b);
    cr_assert(a && b);
    krn_cpu_embed(t, KRN_BF16, d, toks, n, a);
    krn_cpu_embed(tp, KRN_BF16_PANEL, d, toks, n, b);
    long i = first_diff(a, b, (size_t)n * d);
    cr_assert(i < 0, "row %u column %ld: packed %.9g, row-major %.9g", i < 0 ? 0 : toks[i / d],
              i % d, i < 0 ? 0.0 : b[i], i < 0 ? 0.0 : a[i]);
    free(t), free(tp), free(a), free(b);
}

/* ---- (2) the engine -------------------------------------------------------------------------- */

#define PAGE 16

/* The tiny model `name` (tiny-bf16, tiny-f32) opened with PIE_KRN_PREPACK=prepack. */
static eng *open_tiny(const char *name, const char *prepack) {
    setenv("PIE_KRN_PREPACK", prepack, 1);
    char dir[512];
    snprintf(dir, sizeof dir, "%s/%s", PIE_MODELS_DIR, name);
    eng_opts o = {.model_dir = dir,
                  .kv_page_size = PAGE,
                  .kv_pages = 16,
                  .embed_slots = 128,
                  .max_batch_tokens = 128,
                  .n_threads = 2};
    pie_status st = {0};
    eng *e = NULL;
    cr_assert_eq(eng_open(&o, &e, &st), PIE_OK, "eng_open %s: %s", dir, st.msg);
    return e;
}

static eng *open_tiny_bf16(const char *prepack) { return open_tiny("tiny-bf16", prepack); }

/* One row's logits (slot 113, the GEMV both ways) of a and b within 1e-5 of the largest. */
static void check_one_row_logits(eng *a, eng *b) {
    uint32_t vocab = eng_get_info(a)->vocab_size;
    float *la = malloc(vocab * sizeof *la), *lb = malloc(vocab * sizeof *lb);
    cr_assert(la && lb);
    pie_status st = {0};
    cr_assert_eq(eng_logits(a, 113, la, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(eng_logits(b, 113, lb, &st), PIE_OK, "%s", st.msg);
    double worst = 0, scale = 0;
    for (uint32_t i = 0; i < vocab; i++) {
        worst = fmax(worst, fabs((double)la[i] - lb[i]));
        scale = fmax(scale, fabs((double)la[i]));
    }
    cr_assert(worst <= 1e-5 * scale, "logits of one row differ by %.3g (relative)", worst / scale);
    free(la), free(lb);
}

/* Two sequences of 19 and 9 tokens in one forward, outputs of the last 5 of each (10 rows for
 * the last layer's tail), then 4 more tokens of each in one forward: every linear call has
 * 4-256 rows, the panel path with or without packing. Returns the top-32 ids and probs of the
 * 10 output slots after the prefill and 8 after the decode ([18][32] each). */
static void run(eng *e, uint32_t *ids, float *probs) {
    pie_status st = {0};
    const eng_info *in = eng_get_info(e);
    uint32_t lens[2] = {19, 9}, first[2] = {0, 32};
    for (uint32_t s = 0; s < 2; s++) {
        uint32_t sl[32], tk[32], ps[32];
        for (uint32_t i = 0; i < lens[s]; i++) {
            sl[i] = first[s] + i;
            tk[i] = (s * 7919u + i * 104729u + 13u) % in->vocab_size;
            ps[i] = i;
        }
        cr_assert_eq(eng_embed_text(e, sl, tk, ps, lens[s], &st), PIE_OK, "%s", st.msg);
    }
    uint32_t pages0[] = {0, 1}, pages1[] = {2}, in0[32], in1[32], out0[5], out1[5];
    for (uint32_t i = 0; i < 5; i++) out0[i] = 64 + i, out1[i] = 80 + i;
    eng_forward_item items[2] = {
        pie_test_item(PAGE, pages0, 19, true, pie_test_range(in0, 0, 19), 19, out0, 5),
        pie_test_item(PAGE, pages1, 9, true, pie_test_range(in1, 32, 9), 9, out1, 5)};
    pie_test_forward_ok(e, items, 2);
    eng_dist_item d[18];
    for (uint32_t i = 0; i < 10; i++)
        d[i] = (eng_dist_item){.slot = i < 5 ? out0[i] : out1[i - 5],
                               .top_k = 32,
                               .temperature = 1.0f,
                               .ids = ids + i * 32,
                               .probs = probs + i * 32};
    cr_assert_eq(eng_next_dist(e, d, 10, &st), PIE_OK, "%s", st.msg);
    /* decode: 4 new tokens of each sequence (a continuation of 4 rows each) */
    uint32_t sl[8], tk[8], ps[8];
    for (uint32_t i = 0; i < 8; i++) {
        sl[i] = 100 + i;
        tk[i] = ids[(i < 4 ? 4 : 9) * 32 + i % 4];
        ps[i] = (i < 4 ? 19 : 9) + i % 4;
    }
    cr_assert_eq(eng_embed_text(e, sl, tk, ps, 8, &st), PIE_OK, "%s", st.msg);
    uint32_t dec_in0[4] = {100, 101, 102, 103}, dec_in1[4] = {104, 105, 106, 107};
    uint32_t dec_out0[4] = {110, 111, 112, 113}, dec_out1[4] = {114, 115, 116, 117};
    eng_forward_item dec[2] = {pie_test_item(PAGE, pages0, 23, true, dec_in0, 4, dec_out0, 4),
                               pie_test_item(PAGE, pages1, 13, true, dec_in1, 4, dec_out1, 4)};
    pie_test_forward_ok(e, dec, 2);
    for (uint32_t i = 0; i < 8; i++)
        d[10 + i] = (eng_dist_item){.slot = 110 + i,
                                    .top_k = 32,
                                    .temperature = 1.0f,
                                    .ids = ids + (10 + i) * 32,
                                    .probs = probs + (10 + i) * 32};
    cr_assert_eq(eng_next_dist(e, d + 10, 8, &st), PIE_OK, "%s", st.msg);
}

/* tiny-bf16 opened unpacked (*a) and packed (*b), each given run(); their top-32 ids must be
 * the same. */
static void run_unpacked_and_packed(eng **a, eng **b, uint32_t *ia, float *pa, uint32_t *ib,
                                    float *pb) {
    *a = open_tiny_bf16("0");
    *b = open_tiny_bf16("1");
    cr_assert_eq(eng_get_info(*a)->packed_weight_bytes, 0, "PIE_KRN_PREPACK=0 packed weights");
    cr_assert_gt(eng_get_info(*b)->packed_weight_bytes, 0, "PIE_KRN_PREPACK=1 packed nothing");
    run(*a, ia, pa);
    run(*b, ib, pb);
    cr_assert(memcmp(ia, ib, 18 * 32 * sizeof *ia) == 0, "top-32 ids differ with packed weights");
}

Test(krn_wpack, engine_writes_the_same_bits_with_weights_packed_at_open) {
    if (krn_cpu_set_simd("avx512") != 0) cr_skip_test("this CPU has no avx512 path");
    exact_kernels();
    eng *a, *b;
    static uint32_t ia[18 * 32], ib[18 * 32];
    static float pa[18 * 32], pb[18 * 32];
    run_unpacked_and_packed(&a, &b, ia, pa, ib, pb);
    long d = first_diff(pa, pb, 18 * 32);
    cr_assert(d < 0, "probability %ld (output %ld, rank %ld): %.9g unpacked, %.9g packed", d,
              d / 32, d % 32, d < 0 ? 0.0 : pa[d], d < 0 ? 0.0 : pb[d]);
    /* one row: the packed GEMV sums in k order, the row-major one by lanes: close, not equal */
    check_one_row_logits(a, b);
    eng_close(a);
    eng_close(b);
}

/* AMX on: with weights packed, every call of >= 8 rows reads the panels on the tiles; unpacked,
 * the tiles read row-major W where `in` is a multiple of 32 and out - out % 16 rows, and the
 * exact GEMV takes the rest (tiny-bf16: intermediate 172, so all of w_down and 12 rows of
 * gate/up), packed they take the tiles (x = hi + lo to 2^-17: ~1e-5 · Σ|w·x|, krn_amx.c). So not
 * the same bits: the same top-32 ids, probabilities within 1e-4 relative (measured 4.3e-5 after
 * two layers and the softmax), logits of one row (the GEMV both ways) within 1e-5. */
Test(krn_wpack, engine_with_amx_gives_the_same_distributions_packed_or_not) {
    amx_or_skip();
    eng *a, *b;
    static uint32_t ia[18 * 32], ib[18 * 32];
    static float pa[18 * 32], pb[18 * 32];
    run_unpacked_and_packed(&a, &b, ia, pa, ib, pb);
    double worst = 0;
    int at = 0;
    for (int i = 0; i < 18 * 32; i++) {
        double rel = fabs((double)pa[i] - pb[i]) / fmax(fabs((double)pa[i]), 1e-30);
        if (rel > worst) worst = rel, at = i;
    }
    cr_assert(worst <= 1e-4, "probability %d (output %d, rank %d): %.9g unpacked, %.9g packed", at,
              at / 32, at % 32, pa[at], pb[at]);
    cr_log_info("AMX, packed vs not: largest relative difference of a probability %.3g", worst);
    check_one_row_logits(a, b);
    eng_close(a);
    eng_close(b);
}

Test(krn_wpack, engine_packs_nothing_for_f32_weights) {
    eng *e = open_tiny("tiny-f32", "1");
    cr_assert_eq(eng_get_info(e)->packed_weight_bytes, 0);
    eng_close(e);
}
