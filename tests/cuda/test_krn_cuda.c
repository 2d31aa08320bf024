/* test_krn_cuda.c — kernels/cuda against simple CPU computations written here (and, for RoPE
 * and top-k, against kernels/cpu, which the CPU backend uses). Each test skips visibly where
 * there is no CUDA device. Inputs are deterministic pseudo-random values. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_test.h"
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

enum { A_NH = 8, A_NKV = 2, A_HD = 64, A_PS = 16, A_PAGES = 80 };
#define A_KVD (A_NKV * A_HD)
#define A_QD  (A_NH * A_HD)

/* One sequence for the reference: its tokens in pages, an optional tail, query rows. */
typedef struct ref_seq {
    const uint32_t *pages;
    int n_ctx, n_tail, tail_row, q_row, n_q, q_seq, pm_ctx;
    const uint32_t *runs; /* explicit mask of its rows (NULL: causal) */
} ref_seq;

/* Row r's visibility of key t, decoded from the runs without the engine's helpers. */
static int ref_visible(const ref_seq *s, const uint8_t *pm, int r, int t) {
    int len = s->q_seq + r + 1;
    if (t >= len) return 0;
    if (s->runs) {
        int row = 0, at = 0, cur = 0;
        while (row < r) { /* skip rows before r */
            int rl = s->q_seq + row + 1, c = 0;
            while (c < rl) c += (int)s->runs[cur++];
            row++;
        }
        int vis = 1;
        at = 0;
        for (;;) {
            int run = (int)s->runs[cur++];
            if (t < at + run) break;
            at += run;
            vis ^= 1;
        }
        if (!vis) return 0;
    }
    if (t < s->pm_ctx && pm[s->pages[t / A_PS] * A_PS + t % A_PS]) return 0;
    return 1;
}

static void ref_attention(const ref_seq *s, const uint16_t *kv, const uint8_t *pm, const float *q,
                          const uint16_t *kb, const uint16_t *vb, double *out /* [n_q][QD] */) {
    int g = A_NH / A_NKV, keys = s->n_ctx + s->n_tail;
    for (int r = 0; r < s->n_q; r++)
        for (int h = 0; h < A_NH; h++) {
            int kvh = h / g;
            double m = -INFINITY, sum = 0, acc[A_HD] = {0};
            double *sc = malloc(sizeof(double) * (size_t)(keys ? keys : 1));
            for (int t = 0; t < keys; t++) {
                sc[t] = -INFINITY;
                if (!ref_visible(s, pm, r, t)) continue;
                const uint16_t *kr =
                    t < s->n_ctx
                        ? kv + ((size_t)(s->pages[t / A_PS] * 2) * A_PS + t % A_PS) * A_KVD +
                              kvh * A_HD
                        : kb + (size_t)(s->tail_row + t - s->n_ctx) * A_KVD + kvh * A_HD;
                double dot = 0;
                for (int d = 0; d < A_HD; d++)
                    dot += (double)q[(size_t)(s->q_row + r) * A_QD + h * A_HD + d] * bf2f(kr[d]);
                sc[t] = dot / sqrt((double)A_HD);
                if (sc[t] > m) m = sc[t];
            }
            for (int t = 0; t < keys; t++) {
                if (sc[t] == -INFINITY) continue;
                double p = exp(sc[t] - m);
                sum += p;
                const uint16_t *vr =
                    t < s->n_ctx
                        ? kv + ((size_t)(s->pages[t / A_PS] * 2 + 1) * A_PS + t % A_PS) * A_KVD +
                              kvh * A_HD
                        : vb + (size_t)(s->tail_row + t - s->n_ctx) * A_KVD + kvh * A_HD;
                for (int d = 0; d < A_HD; d++) acc[d] += p * bf2f(vr[d]);
            }
            for (int d = 0; d < A_HD; d++)
                out[((size_t)r * A_NH + h) * A_HD + d] = sum > 0 ? acc[d] / sum : 0;
            free(sc);
        }
}

/* Tiles of a sequence as the engine cuts them, `rows` rows each. */
static int seq_tiles(const ref_seq *s, int mask_row0, krn_cuda_attn_tile *t, int page_off,
                     int rows) {
    int n = 0;
    for (int r = 0; r < s->n_q; r += rows) {
        int nq = s->n_q - r < rows ? s->n_q - r : rows;
        t[n++] = (krn_cuda_attn_tile){.q_row = s->q_row + r,
                                      .o_row = s->q_row + r,
                                      .n_q = nq,
                                      .q_seq = s->q_seq + r,
                                      .n_ctx = s->n_ctx,
                                      .pages = page_off,
                                      .tail_row = s->tail_row,
                                      .n_tail = s->n_tail,
                                      .pm_ctx = s->pm_ctx,
                                      .mask_row = s->runs ? mask_row0 + r : -1,
                                      .kv_chunk = 0};
    }
    return n;
}

/* splits: split-KV partitions of krn_cuda_attention; 0: the tensor-core kernel instead. */
static void attention_case(int splits) {
    bool tc = splits == 0;
    if (tc) splits = 1;
    int rows = tc ? krn_cuda_attn_tc_rows(A_NH, A_NKV) : krn_cuda_attn_tile_rows(A_NH, A_NKV);
    /* three sequences: A appends 20 rows after 700 context tokens (causal, page masks);
     * B decodes one row over 1000 tokens plus a 2-row tail; C: 3 rows over 30 tokens with an
     * explicit tree mask */
    size_t layer = (size_t)A_PAGES * 2 * A_PS * A_KVD;
    uint16_t *kv = bf_rand(layer, 1.0f);
    uint8_t pm[A_PAGES * A_PS] = {0};
    static uint32_t pa[48], pb[64], pc[2];
    for (int i = 0; i < 45; i++) pa[i] = (uint32_t)(79 - i); /* shuffled order */
    for (int i = 0; i < 63; i++) pb[i] = (uint32_t)((i * 7) % 80);
    pc[0] = 3, pc[1] = 11;
    pm[pa[2] * A_PS + 5] = 1, pm[pa[40] * A_PS + 1] = 1;
    enum { ROWS = 20 + 2 + 3 };
    float *q = f_rand((size_t)ROWS * A_QD, 1.0f);
    uint16_t *kb = bf_rand((size_t)ROWS * A_KVD, 1.0f), *vb = bf_rand((size_t)ROWS * A_KVD, 1.0f);
    /* C's rows cover 31, 32, 33 tokens: row 0 sees all; row 1 hides row 0's token (30); row 2
     * hides row 1's token (31): a tree where inputs 1 and 2 both follow input 0 */
    static const uint32_t runs_c[] = {31, 30, 1, 1, 31, 1, 1};
    ref_seq seqs[3] = {
        {.pages = pa,
         .n_ctx = 720,
         .n_tail = 0,
         .tail_row = 0,
         .q_row = 0,
         .n_q = 20,
         .q_seq = 700,
         .pm_ctx = 700},
        {.pages = pb,
         .n_ctx = 1000,
         .n_tail = 2,
         .tail_row = 20,
         .q_row = 20,
         .n_q = 2,
         .q_seq = 1000,
         .pm_ctx = 0},
        {.pages = pc,
         .n_ctx = 30,
         .n_tail = 3,
         .tail_row = 22,
         .q_row = 22,
         .n_q = 3,
         .q_seq = 30,
         .pm_ctx = 0,
         .runs = runs_c},
    };
    uint32_t pages[48 + 64 + 2];
    memcpy(pages, pa, sizeof pa), memcpy(pages + 48, pb, sizeof pb),
        memcpy(pages + 112, pc, sizeof pc);
    int page_off[3] = {0, 48, 112};
    int32_t row_runs[ROWS] = {0};
    row_runs[22] = 0, row_runs[23] = 1, row_runs[24] = 4; /* where C's rows start in runs_c */
    krn_cuda_attn_tile tiles[64];
    int n_tiles = 0;
    for (int i = 0; i < 3; i++)
        n_tiles += seq_tiles(&seqs[i], 22, tiles + n_tiles, page_off[i], rows);
    for (int i = 0; i < n_tiles; i++) {
        int lim = tiles[i].n_ctx + tiles[i].n_tail, causal = tiles[i].q_seq + tiles[i].n_q;
        if (causal < lim) lim = causal;
        tiles[i].kv_chunk = ((lim + splits - 1) / splits + 31) / 32 * 32;
    }
    krn_cuda_attn_args a = {
        .tiles = cuda_test_up(tiles, sizeof tiles),
        .n_tiles = n_tiles,
        .q = cuda_test_up(q, sizeof(float) * ROWS * A_QD),
        .q_stride = A_QD,
        .kv = cuda_test_up(kv, 2 * layer),
        .page_list = cuda_test_up(pages, sizeof pages),
        .page_mask = cuda_test_up(pm, sizeof pm),
        .page_size = A_PS,
        .kb = cuda_test_up(kb, 2 * ROWS * A_KVD),
        .vb = cuda_test_up(vb, 2 * ROWS * A_KVD),
        .runs = cuda_test_up(runs_c, sizeof runs_c),
        .row_runs = cuda_test_up(row_runs, sizeof row_runs),
        .n_heads = A_NH,
        .n_kv_heads = A_NKV,
        .hd = A_HD,
        .scale = 1.0f / sqrtf((float)A_HD),
        .out = cuda_test_up(NULL, 2 * ROWS * A_QD),
        .n_splits = splits,
        .part_acc = cuda_test_up(NULL, sizeof(float) * splits * ROWS * A_QD),
        .part_ml = cuda_test_up(NULL, sizeof(float) * splits * ROWS * A_NH * 2),
        .split_rows = ROWS,
    };
    CUDA_OK(krn_cuda_init(A_HD));
    CUDA_OK(tc ? krn_cuda_attention_tc(&a, 0) : krn_cuda_attention(&a, 0));
    uint16_t *out = malloc(2 * ROWS * A_QD);
    cuda_test_down(out, a.out, 2 * ROWS * A_QD);
    double *ref = malloc(sizeof(double) * 20 * A_QD);
    for (int i = 0; i < 3; i++) {
        ref_attention(&seqs[i], kv, pm, q, kb, vb, ref);
        for (int r = 0; r < seqs[i].n_q; r++)
            for (int j = 0; j < A_QD; j++) {
                double want = ref[(size_t)r * A_QD + j];
                float got = bf2f(out[(size_t)(seqs[i].q_row + r) * A_QD + j]);
                cr_assert(fabs(got - want) <= 1e-2 * (1 + fabs(want)),
                          "%s, splits %d: sequence %d row %d element %d: %g, expected %g",
                          tc ? "tensor cores" : "cuda cores", splits, i, r, j, got, want);
            }
    }
    void *ptrs[] = {(void *)a.tiles,     (void *)a.q,  (void *)a.kv, (void *)a.page_list,
                    (void *)a.page_mask, (void *)a.kb, (void *)a.vb, (void *)a.runs,
                    (void *)a.row_runs,  a.out,        a.part_acc,   a.part_ml};
    for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) cudaFree(ptrs[i]);
    free(kv), free(q), free(kb), free(vb), free(out), free(ref);
}

Test(krn_cuda, attention_matches_a_naive_reference_causal_tail_and_masks) {
    CUDA_TEST_REQUIRE_DEVICE();
    attention_case(1);
}

Test(krn_cuda, split_kv_attention_equals_the_unsplit_reference) {
    CUDA_TEST_REQUIRE_DEVICE();
    attention_case(4);
    attention_case(16);
}

Test(krn_cuda, tensor_core_attention_matches_the_same_reference) {
    CUDA_TEST_REQUIRE_DEVICE();
    CUDA_OK(krn_cuda_init(A_HD));
    if (!krn_cuda_attn_tc_fits(A_HD, A_NH, A_NKV))
        cr_skip_test("this device has no bf16 tensor cores (sm_80+)");
    attention_case(0);
}

/* ---- distributions --------------------------------------------------------------------------- */

Test(krn_cuda, topk_over_a_128k_vocabulary_equals_the_cpu_softmax_and_topk) {
    CUDA_TEST_REQUIRE_DEVICE();
    enum { V = 128256, ROWS = 3 };
    float *lg = malloc(sizeof(float) * ROWS * V);
    for (size_t i = 0; i < (size_t)ROWS * V; i++)
        lg[i] = roundf(frand() * 640.0f) / 64.0f; /* multiples of 1/64: many exact ties */
    float temp[ROWS] = {1.0f, 0.7f, 2.5f};
    int32_t k[ROWS] = {1, 50, 1024};
    float *dlg = cuda_test_up(lg, sizeof(float) * ROWS * V), *dt = cuda_test_up(temp, sizeof temp);
    int32_t *dk = cuda_test_up(k, sizeof k);
    uint32_t *dids = cuda_test_up(NULL, sizeof(uint32_t) * ROWS * KRN_CUDA_TOPK_MAX);
    float *dp = cuda_test_up(NULL, sizeof(float) * ROWS * KRN_CUDA_TOPK_MAX);
    CUDA_OK(krn_cuda_topk(dlg, ROWS, V, dt, dk, dids, dp, 0));
    uint32_t *ids = malloc(sizeof(uint32_t) * ROWS * KRN_CUDA_TOPK_MAX), ref_ids[1024];
    float *probs = malloc(sizeof(float) * ROWS * KRN_CUDA_TOPK_MAX), ref_p[1024];
    cuda_test_down(ids, dids, sizeof(uint32_t) * ROWS * KRN_CUDA_TOPK_MAX);
    cuda_test_down(probs, dp, sizeof(float) * ROWS * KRN_CUDA_TOPK_MAX);
    float *row = malloc(sizeof(float) * V);
    for (int r = 0; r < ROWS; r++) {
        memcpy(row, lg + (size_t)r * V, sizeof(float) * V);
        krn_cpu_softmax(row, V, temp[r]);
        krn_cpu_topk(row, V, k[r], ref_ids, ref_p);
        for (int j = 0; j < k[r]; j++) {
            cr_assert_eq(ids[r * KRN_CUDA_TOPK_MAX + j], ref_ids[j],
                         "row %d rank %d: id %u, expected %u", r, j, ids[r * KRN_CUDA_TOPK_MAX + j],
                         ref_ids[j]);
            cr_assert(fabsf(probs[r * KRN_CUDA_TOPK_MAX + j] - ref_p[j]) <=
                          1e-5f * ref_p[j] + 1e-9f,
                      "row %d rank %d: p %g, expected %g", r, j, probs[r * KRN_CUDA_TOPK_MAX + j],
                      ref_p[j]);
        }
    }
    cudaFree(dlg), cudaFree(dt), cudaFree(dk), cudaFree(dids), cudaFree(dp);
    free(lg), free(ids), free(probs), free(row);
}
