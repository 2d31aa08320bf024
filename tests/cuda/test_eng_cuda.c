/* test_eng_cuda.c — the cuda backend (eng_cuda.h) against the CPU backend (eng.h) on the same
 * batches as the CPU engine's own tests (tests/unit/test_eng.c): prefill, decode, chunked
 * prefill, explicit and page masks, items sharing pages, copied and masked pages, a mixed
 * batch, decode batches replayed from CUDA graphs, long contexts (split-KV), next_dist, greedy
 * generation, and the validation messages. Every operation runs on both engines ("a pair");
 * logits must agree within bf16 tolerance (the cuda backend keeps weights and KV in bf16).
 *
 * The checks that make the tolerance mean something are tests/kcheck's, which
 * tests/unit/test_kcheck.c runs in CI against the CPU engine and broken variants: the mask
 * scenario (the CPU's logits with and without the mask differ by more than 5x the tolerance,
 * so a GPU that ignored it fails), small-bf16 (identical weights on both sides), greedy top-1
 * with a near-tie margin, a 17-item decode batch (bucket 32: cuBLAS inside stream capture),
 * determinism (two runs bitwise equal), graphs = direct launches bitwise, the graph cache
 * bounded by the buckets whatever the split counts, a prefill and a long decode in one batch.
 * Skips visibly where there is no CUDA device. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_test.h"
#include "eng.h"
#include "eng_cuda.h"
#include "cuda_kc.h"
#include "kcheck.h"
#include "pie_testeng.h"

#define PAGE 16

typedef struct pair {
    eng *c;
    eng_cuda *g;
    uint32_t vocab;
    double tol;
} pair;

static pair open_pair(const char *name, uint32_t pages, uint32_t slots, uint32_t max_batch) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/%s", PIE_MODELS_DIR, name);
    eng_opts o = {.model_dir = dir,
                  .kv_page_size = PAGE,
                  .kv_pages = pages,
                  .embed_slots = slots,
                  .max_batch_tokens = max_batch,
                  .n_threads = 2};
    pie_status st = {0};
    pair p = {0};
    cr_assert_eq(eng_open(&o, &p.c, &st), PIE_OK, "eng_open %s: %s", dir, st.msg);
    o.backend = ENG_BACKEND_CUDA;
    cr_assert_eq(eng_cuda_open(&o, &p.g, &st), PIE_OK, "eng_cuda_open %s: %s", dir, st.msg);
    p.vocab = eng_get_info(p.c)->vocab_size;
    p.tol = strstr(name, "f32") ? KC_ENG_TOL_F32 : KC_ENG_TOL_BF16;
    return p;
}

static void close_pair(pair *p) {
    eng_close(p->c);
    eng_cuda_close(p->g);
}

static uint32_t tok(uint32_t vocab, uint32_t seq, uint32_t i) {
    return (seq * 7919u + i * 104729u + 13u) % vocab;
}

static void embed_seq(pair *p, uint32_t slot0, uint32_t seq, uint32_t from, uint32_t n) {
    static uint32_t slots[4096], toks[4096], pos[4096];
    cr_assert(n <= 4096);
    for (uint32_t i = 0; i < n; i++) {
        slots[i] = slot0 + i;
        toks[i] = tok(p->vocab, seq, from + i);
        pos[i] = from + i;
    }
    pie_status st = {0};
    cr_assert_eq(eng_embed_text(p->c, slots, toks, pos, n, &st), PIE_OK, "cpu embed: %s", st.msg);
    cr_assert_eq(eng_cuda_embed_text(p->g, slots, toks, pos, n, &st), PIE_OK, "cuda embed: %s",
                 st.msg);
}

static void forward(pair *p, const eng_forward_item *items, uint32_t n) {
    pie_status st = {0};
    cr_assert_eq(eng_forward(p->c, items, n, &st), PIE_OK, "cpu forward: %s", st.msg);
    cr_assert_eq(eng_cuda_forward(p->g, items, n, &st), PIE_OK, "cuda forward: %s", st.msg);
}

static void mask_page(pair *p, uint32_t page, const bool *m) {
    pie_status st = {0};
    cr_assert_eq(eng_mask_page(p->c, page, m, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(eng_cuda_mask_page(p->g, page, m, &st), PIE_OK, "%s", st.msg);
}

/* The slot's logits agree between the backends, and so do their positions. */
static void assert_agree(pair *p, uint32_t slot, const char *what) {
    float *a = malloc(p->vocab * sizeof *a), *b = malloc(p->vocab * sizeof *b);
    cr_assert(a && b);
    pie_status st = {0};
    cr_assert_eq(eng_cuda_logits(p->g, slot, a, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(eng_logits(p->c, slot, b, &st), PIE_OK, "%s", st.msg);
    char why[512];
    cr_assert(kc_eng_agree(a, b, p->vocab, p->tol, what, why, sizeof why), "slot %u: %s", slot,
              why);
    uint32_t pa, pb;
    cr_assert_eq(eng_cuda_slot_position(p->g, slot, &pa, &st), PIE_OK);
    cr_assert_eq(eng_slot_position(p->c, slot, &pb, &st), PIE_OK);
    cr_assert_eq(pa, pb, "%s: slot %u position %u, cpu says %u", what, slot, pa, pb);
    free(a);
    free(b);
}

static void prefill(pair *p, const uint32_t *pages, uint32_t seq, uint32_t len, uint32_t slot0,
                    uint32_t out_slot) {
    static uint32_t in[4096];
    embed_seq(p, slot0, seq, 0, len);
    eng_forward_item it = pie_test_item(PAGE, pages, len, true, pie_test_range(in, slot0, len), len,
                                        &out_slot, out_slot == UINT32_MAX ? 0 : 1);
    forward(p, &it, 1);
}

/* ---- forward equivalence with the CPU backend ------------------------------------------------ */

static void prefill_decode_chunked(const char *model) {
    pair p = open_pair(model, 16, 256, 256);
    uint32_t pa[] = {0, 1, 2}, pb[] = {3, 4, 5}, pc[] = {6, 7, 8}, s[64];
    const uint32_t N = 37;
    prefill(&p, pa, 0, N, 0, 100);
    assert_agree(&p, 100, "one-shot prefill");
    prefill(&p, pb, 0, N - 1, 0, UINT32_MAX);
    embed_seq(&p, 60, 0, N - 1, 1);
    uint32_t o = 101;
    eng_forward_item dec = pie_test_item(PAGE, pb, N, true, pie_test_range(s, 60, 1), 1, &o, 1);
    forward(&p, &dec, 1);
    assert_agree(&p, 101, "prefill + decode");
    uint32_t done = 0, chunks[] = {10, 16, 11};
    for (int c = 0; c < 3; c++) {
        embed_seq(&p, 0, 0, done, chunks[c]);
        done += chunks[c];
        o = 102;
        eng_forward_item it = pie_test_item(PAGE, pc, done, true, pie_test_range(s, 0, chunks[c]),
                                            chunks[c], &o, c == 2 ? 1 : 0);
        forward(&p, &it, 1);
    }
    assert_agree(&p, 102, "chunked prefill");
    close_pair(&p);
}

Test(eng_cuda, prefill_decode_and_chunked_prefill_agree_with_cpu_tiny_bf16) {
    CUDA_TEST_REQUIRE_DEVICE();
    prefill_decode_chunked("tiny-bf16");
}

Test(eng_cuda, prefill_decode_and_chunked_prefill_agree_with_cpu_small_f32) {
    CUDA_TEST_REQUIRE_DEVICE();
    prefill_decode_chunked("small-f32");
}

Test(eng_cuda, several_outputs_of_one_item_agree_with_cpu) {
    CUDA_TEST_REQUIRE_DEVICE();
    pair p = open_pair("tiny-bf16", 8, 64, 64);
    uint32_t pg[] = {0, 1}, s[32], outs[3] = {40, 41, 42};
    embed_seq(&p, 0, 3, 0, 20);
    eng_forward_item it = pie_test_item(PAGE, pg, 20, true, pie_test_range(s, 0, 20), 20, outs, 3);
    forward(&p, &it, 1);
    for (int j = 0; j < 3; j++) assert_agree(&p, outs[j], "output of a middle input");
    close_pair(&p);
}

Test(eng_cuda, items_sharing_pages_and_append_false_agree_with_cpu) {
    CUDA_TEST_REQUIRE_DEVICE();
    pair p = open_pair("tiny-bf16", 8, 64, 64);
    uint32_t pg[] = {0, 1}, i0 = 30, i1 = 31, o0 = 40, o1 = 41;
    prefill(&p, pg, 1, 20, 0, UINT32_MAX);
    embed_seq(&p, 30, 1, 20, 1);
    embed_seq(&p, 31, 1, 20, 1);
    eng_forward_item two[2] = {pie_test_item(PAGE, pg, 20, false, &i0, 1, &o0, 1),
                               pie_test_item(PAGE, pg, 20, false, &i1, 1, &o1, 1)};
    forward(&p, two, 2);
    assert_agree(&p, 40, "first of two items over the same pages");
    assert_agree(&p, 41, "second of two items over the same pages");
    close_pair(&p);
}

Test(eng_cuda, page_masks_and_explicit_masks_agree_with_cpu) {
    CUDA_TEST_REQUIRE_DEVICE();
    pair p = open_pair("tiny-bf16", 8, 64, 64);
    uint32_t pg[] = {0, 1}, x = 30, o;
    prefill(&p, pg, 4, 20, 0, UINT32_MAX);
    embed_seq(&p, 30, 4, 20, 1);
    bool m[PAGE] = {0};
    m[3] = m[4] = true;
    mask_page(&p, 0, m);
    o = 41;
    eng_forward_item it = pie_test_item(PAGE, pg, 20, false, &x, 1, &o, 1);
    forward(&p, &it, 1);
    assert_agree(&p, 41, "page mask");
    memset(m, 0, sizeof m);
    m[2] = true;
    mask_page(&p, 1, m);
    uint32_t runs10[] = {10, 1, 10};
    it.mask_runs = runs10, it.n_mask_runs = 3, o = 43;
    forward(&p, &it, 1);
    assert_agree(&p, 43, "page masks AND an explicit mask");
    close_pair(&p);
}

Test(eng_cuda, copied_and_masked_pages_agree_with_cpu) {
    CUDA_TEST_REQUIRE_DEVICE();
    pair p = open_pair("tiny-bf16", 8, 64, 64);
    uint32_t pg[] = {0, 1}, q[] = {5, 6}, x = 30, o;
    pie_status st = {0};
    prefill(&p, pg, 5, 20, 0, UINT32_MAX);
    embed_seq(&p, 30, 5, 20, 1);
    bool m[PAGE] = {0};
    m[7] = true;
    mask_page(&p, 0, m);
    eng_copy_item c[] = {{0, 5, 0, 0, 16}, {1, 7, 0, 9, 4}, {7, 7, 9, 0, 4}, {7, 6, 0, 0, 4}};
    cr_assert_eq(eng_copy_pages(p.c, c, 4, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(eng_cuda_copy_pages(p.g, c, 4, &st), PIE_OK, "%s", st.msg);
    o = 40;
    eng_forward_item it = pie_test_item(PAGE, q, 20, false, &x, 1, &o, 1);
    forward(&p, &it, 1);
    assert_agree(&p, 40, "forward over copied pages (mask copied too)");
    close_pair(&p);
}

/* Cleared pages and slots (what the worker does on allocation) read, on both backends, as ones
 * nobody wrote: runs of consecutive pages ascending and descending, a lone page, a mask. */
Test(eng_cuda, cleared_pages_and_slots_agree_with_cpu_and_hold_nothing_old) {
    CUDA_TEST_REQUIRE_DEVICE();
    pair p = open_pair("tiny-bf16", 8, 64, 64);
    uint32_t pg[] = {2, 1, 0, 5}, ctx[] = {0, 1}, x = 30, o = 40, slots[21];
    pie_status st = {0};
    prefill(&p, ctx, 6, 20, 0, 20);
    bool m[PAGE] = {0};
    m[3] = true;
    mask_page(&p, 0, m);
    cr_assert_eq(eng_clear_pages(p.c, pg, 4, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(eng_cuda_clear_pages(p.g, pg, 4, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(eng_clear_embeds(p.c, pie_test_range(slots, 0, 21), 21, &st), PIE_OK, "%s",
                 st.msg);
    cr_assert_eq(eng_cuda_clear_embeds(p.g, slots, 21, &st), PIE_OK, "%s", st.msg);
    float *z = malloc(p.vocab * sizeof *z);
    cr_assert(z);
    cr_assert_eq(eng_cuda_logits(p.g, 20, z, &st), PIE_OK, "%s", st.msg);
    for (uint32_t i = 0; i < p.vocab; i++)
        cr_assert(z[i] == 0.0f, "a cleared slot's logit %u is %g, not 0", i, (double)z[i]);
    free(z);
    embed_seq(&p, x, 6, 20, 1);
    eng_forward_item it = pie_test_item(PAGE, ctx, 20, false, &x, 1, &o, 1);
    forward(&p, &it, 1);
    assert_agree(&p, 40, "forward over cleared pages");
    cr_assert_eq(eng_cuda_clear_pages(p.g, (uint32_t[]){8}, 1, &st), PIE_INVALID_ARGUMENT);
    cr_assert_str_eq(st.msg, "clear_pages: item 0: page 8 is out of range [0, 8)");
    close_pair(&p);
}

static void mixed_setup(pair *p) {
    uint32_t pb[] = {0, 1}, pc[] = {2};
    prefill(p, pb, 10, 20, 0, UINT32_MAX);
    prefill(p, pc, 11, 9, 0, UINT32_MAX);
    embed_seq(p, 100, 12, 0, 12);
    embed_seq(p, 120, 10, 20, 1);
    embed_seq(p, 130, 11, 9, 3);
    embed_seq(p, 140, 13, 0, 4);
    embed_seq(p, 150, 10, 20, 1);
}

Test(eng_cuda, a_mixed_batch_with_a_tree_mask_agrees_with_cpu) {
    CUDA_TEST_REQUIRE_DEVICE();
    pair p = open_pair("small-f32", 16, 256, 256);
    mixed_setup(&p);
    uint32_t pa[] = {3}, pb[] = {0, 1}, pc[] = {2}, s[4][16], e_in = 150;
    uint32_t oa[] = {200, 201}, ob[] = {202}, oc[] = {203, 204, 205}, od[] = {206}, oe[] = {207};
    uint32_t tree[] = {10, 11, 10, 1, 1};
    eng_forward_item items[5] = {
        pie_test_item(PAGE, pa, 12, true, pie_test_range(s[0], 100, 12), 12, oa, 2),
        pie_test_item(PAGE, pb, 21, true, pie_test_range(s[1], 120, 1), 1, ob, 1),
        pie_test_item(PAGE, pc, 9, false, pie_test_range(s[2], 130, 3), 3, oc, 3),
        pie_test_item(PAGE, NULL, 0, false, pie_test_range(s[3], 140, 4), 4, od, 1),
        pie_test_item(PAGE, pb, 20, false, &e_in, 1, oe, 1),
    };
    items[2].mask_runs = tree, items[2].n_mask_runs = 5;
    forward(&p, items, 5);
    for (uint32_t o = 200; o <= 207; o++) assert_agree(&p, o, "mixed batch");
    close_pair(&p);
}

/* Decode steps of `batch` sequences over contexts of ctx tokens each (graphs on or off). */
static void decode_batch(pair *p, uint32_t batch, uint32_t ctx, uint32_t steps,
                         uint32_t pages_per_seq) {
    static uint32_t pages[64][128];
    cr_assert(batch <= 64 && pages_per_seq <= 128);
    for (uint32_t b = 0; b < batch; b++) {
        for (uint32_t j = 0; j < pages_per_seq; j++) pages[b][j] = b * pages_per_seq + j;
        prefill(p, pages[b], b, ctx, 0, UINT32_MAX);
    }
    uint32_t in[64], out[64];
    eng_forward_item items[64];
    for (uint32_t t = 0; t < steps; t++) {
        for (uint32_t b = 0; b < batch; b++) {
            in[b] = 3000 + b;
            out[b] = 3100 + b;
            embed_seq(p, in[b], b, ctx + t, 1);
            items[b] = pie_test_item(PAGE, pages[b], ctx + t + 1, true, &in[b], 1, &out[b], 1);
        }
        forward(p, items, batch);
        for (uint32_t b = 0; b < batch; b++) assert_agree(p, out[b], "decode step");
    }
}

Test(eng_cuda, decode_batches_replayed_from_graphs_agree_with_cpu) {
    CUDA_TEST_REQUIRE_DEVICE();
    pair p = open_pair("small-f32", 64 * 4, 4096, 4096);
    decode_batch(&p, 3, 40, 4, 4); /* bucket 4: one padding row */
    eng_cuda_stats gs;
    eng_cuda_get_stats(p.g, &gs);
    cr_assert_geq(gs.graph_steps, 4, "decode steps should replay graphs (%llu replays)",
                  (unsigned long long)gs.graph_steps);
    cr_assert_geq(gs.graphs, 1);
    cr_assert_eq(gs.capture_failures, 0, "capture failed: %s", gs.capture_error);
    close_pair(&p);
}

Test(eng_cuda, graphs_on_and_off_give_identical_logits) {
    CUDA_TEST_REQUIRE_DEVICE();
    pair p = open_pair("tiny-bf16", 16, 256, 256);
    uint32_t pg[] = {0, 1, 2}, in = 60, o1 = 101, o2 = 102;
    prefill(&p, pg, 0, 36, 0, UINT32_MAX);
    embed_seq(&p, in, 0, 36, 1);
    eng_forward_item it = pie_test_item(PAGE, pg, 37, true, &in, 1, &o1, 1);
    forward(&p, &it, 1);
    eng_cuda_set_graphs(p.g, false);
    it.out_slots = &o2;
    forward(&p, &it, 1); /* rewrites the same K/V */
    float *a = malloc(p.vocab * sizeof *a), *b = malloc(p.vocab * sizeof *b);
    pie_status st = {0};
    cr_assert_eq(eng_cuda_logits(p.g, o1, a, &st), PIE_OK);
    cr_assert_eq(eng_cuda_logits(p.g, o2, b, &st), PIE_OK);
    char why[256];
    cr_assert(kc_eng_bitwise(a, b, p.vocab, "graph replay vs direct launches", why, sizeof why),
              "%s", why);
    free(a);
    free(b);
    close_pair(&p);
}

Test(eng_cuda, long_context_decode_with_split_kv_agrees_with_cpu) {
    CUDA_TEST_REQUIRE_DEVICE();
    /* 2 sequences x 1500 tokens: few attention tiles, long contexts → split-KV */
    pair p = open_pair("tiny-bf16", 2 * 100, 4096, 2048);
    decode_batch(&p, 2, 1500, 2, 100);
    close_pair(&p);
}

/* ---- distributions and generation ------------------------------------------------------------ */

Test(eng_cuda, next_dist_agrees_with_cpu) {
    CUDA_TEST_REQUIRE_DEVICE();
    pair p = open_pair("tiny-bf16", 8, 64, 64);
    uint32_t pg[] = {0, 1};
    prefill(&p, pg, 7, 25, 0, 50);
    enum { K = 64 };
    uint32_t ids_c[K], ids_g[K];
    float pr_c[K], pr_g[K];
    float temps[] = {1.0f, 0.5f, 3.0f};
    for (int t = 0; t < 3; t++) {
        eng_dist_item dc = {50, K, temps[t], ids_c, pr_c}, dg = {50, K, temps[t], ids_g, pr_g};
        pie_status st = {0};
        cr_assert_eq(eng_next_dist(p.c, &dc, 1, &st), PIE_OK, "%s", st.msg);
        cr_assert_eq(eng_cuda_next_dist(p.g, &dg, 1, &st), PIE_OK, "%s", st.msg);
        for (int j = 0; j < K; j++) {
            cr_assert(fabsf(pr_g[j] - pr_c[j]) <= 0.02f * pr_c[0] + 1e-6f,
                      "T=%g rank %d: p %g, cpu %g", temps[t], j, pr_g[j], pr_c[j]);
            if (j + 1 < K) cr_assert_geq(pr_g[j], pr_g[j + 1], "descending at rank %d", j);
        }
        cr_assert_eq(ids_g[0], ids_c[0], "T=%g: top token %u, cpu %u", temps[t], ids_g[0],
                     ids_c[0]);
    }
    close_pair(&p);
}

/* Greedy generation, the CPU's token fed to both (teacher forcing): at every step the GPU's
 * top-1 is one the CPU's logits allow within the near-tie margin (2 x the logit error bound
 * tol x max|logit|); elsewhere it is the CPU's top-1 exactly. */
static void greedy_within_margin(const char *model) {
    pair p = open_pair(model, 16, 256, 256);
    uint32_t pg[] = {0, 1, 2, 3}, in = 60, out = 61;
    prefill(&p, pg, 9, 12, 0, out);
    pie_status st = {0};
    uint32_t n = 12, ties = 0;
    float *lc = malloc(p.vocab * sizeof *lc);
    cr_assert_not_null(lc);
    for (int step = 0; step < 24; step++) {
        float pc, pg1;
        uint32_t idc, idg;
        eng_dist_item dc = {out, 1, 1.0f, &idc, &pc}, dg = {out, 1, 1.0f, &idg, &pg1};
        cr_assert_eq(eng_next_dist(p.c, &dc, 1, &st), PIE_OK, "%s", st.msg);
        cr_assert_eq(eng_cuda_next_dist(p.g, &dg, 1, &st), PIE_OK, "%s", st.msg);
        cr_assert_eq(eng_logits(p.c, out, lc, &st), PIE_OK, "%s", st.msg);
        double scale = 0;
        for (uint32_t v = 0; v < p.vocab; v++) scale = fmax(scale, fabs(lc[v]));
        char what[64], why[512];
        snprintf(what, sizeof what, "%s greedy step %d", model, step);
        cr_assert(kc_eng_top1(lc, p.vocab, idg, p.tol * scale, what, why, sizeof why), "%s", why);
        ties += idg != idc;
        uint32_t pos = n;
        cr_assert_eq(eng_embed_text(p.c, &in, &idc, &pos, 1, &st), PIE_OK);
        cr_assert_eq(eng_cuda_embed_text(p.g, &in, &idc, &pos, 1, &st), PIE_OK);
        n++;
        eng_forward_item it = pie_test_item(PAGE, pg, n, true, &in, 1, &out, 1);
        forward(&p, &it, 1);
    }
    fprintf(stderr, "%s: greedy top-1 differed from the cpu's at %u of 24 steps (near ties)\n",
            model, ties);
    free(lc);
    close_pair(&p);
}

Test(eng_cuda, greedy_top1_is_the_cpus_up_to_near_ties_small_bf16_and_f32) {
    CUDA_TEST_REQUIRE_DEVICE();
    greedy_within_margin("small-bf16"); /* identical weights on both sides */
    greedy_within_margin("small-f32");
}

/* ---- checks calibrated on the CPU (tests/kcheck) -------------------------------------------- */

/* The mask scenario on both engines: every case agrees within tolerance, and the tolerance is
 * shown to see the mask (the CPU's masked and unmasked logits differ by more than 5x it). */
static void mask_scenario(const char *model) {
    pair p = open_pair(model, 8, 64, 64);
    kc_engine kc = kc_engine_cpu(p.c), kg = kc_engine_gpu(p.g);
    float *lc = malloc(sizeof(float) * KC_MASK_CASES * p.vocab);
    float *lg = malloc(sizeof(float) * KC_MASK_CASES * p.vocab);
    cr_assert(lc && lg);
    char why[512];
    cr_assert(kc_eng_mask_scenario(&kc, lc, why, sizeof why), "cpu: %s", why);
    cr_assert(kc_eng_mask_scenario(&kg, lg, why, sizeof why), "cuda: %s", why);
    cr_assert(kc_eng_mask_visible(lc, lc + p.vocab, p.vocab, p.tol, 5.0, model, why, sizeof why),
              "%s", why);
    static const char *const cases[KC_MASK_CASES] = {"explicit mask hiding 32 tokens", "causal",
                                                     "page masks hiding 32 tokens",
                                                     "explicit mask hiding 1 token"};
    for (int c = 0; c < KC_MASK_CASES; c++)
        cr_assert(kc_eng_agree(lg + (size_t)c * p.vocab, lc + (size_t)c * p.vocab, p.vocab, p.tol,
                               cases[c], why, sizeof why),
                  "%s: %s", model, why);
    cr_assert(kc_eng_agree(lg + 2 * (size_t)p.vocab, lg, p.vocab, 1e-6,
                           "cuda: page masks vs the same explicit mask", why, sizeof why),
              "%s", why);
    free(lc);
    free(lg);
    close_pair(&p);
}

Test(eng_cuda, masks_agree_with_cpu_within_a_tolerance_5x_tighter_than_their_effect) {
    CUDA_TEST_REQUIRE_DEVICE();
    mask_scenario("small-bf16");
    mask_scenario("small-f32");
}

static eng_cuda *open_gpu(const char *name, uint32_t pages, uint32_t slots, uint32_t max_batch) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/%s", PIE_MODELS_DIR, name);
    eng_opts o = {.model_dir = dir,
                  .backend = ENG_BACKEND_CUDA,
                  .kv_page_size = PAGE,
                  .kv_pages = pages,
                  .embed_slots = slots,
                  .max_batch_tokens = max_batch};
    pie_status st = {0};
    eng_cuda *g = NULL;
    cr_assert_eq(eng_cuda_open(&o, &g, &st), PIE_OK, "eng_cuda_open %s: %s", dir, st.msg);
    return g;
}

enum { SEQS17 = 17, CTX17 = 40, STEPS17 = 3 };

/* The 17-sequence decode scenario on a fresh cuda engine; logits [17][vocab] (malloc'ed). */
static float *gpu_decode17(bool graphs, eng_cuda_stats *stats, uint32_t *vocab) {
    eng_cuda *g = open_gpu("small-bf16", SEQS17 * 3, CTX17 + 2 * SEQS17, CTX17);
    eng_cuda_set_graphs(g, graphs);
    kc_engine kg = kc_engine_gpu(g);
    *vocab = kg.vocab;
    float *l = malloc(sizeof(float) * SEQS17 * kg.vocab);
    cr_assert_not_null(l);
    char why[512];
    cr_assert(kc_eng_decode_scenario(&kg, SEQS17, CTX17, STEPS17, l, why, sizeof why), "%s", why);
    eng_cuda_get_stats(g, stats);
    eng_cuda_close(g);
    return l;
}

Test(eng_cuda, a_17_item_decode_batch_replays_bucket_32_with_cublas_and_agrees_with_cpu) {
    CUDA_TEST_REQUIRE_DEVICE();
    eng_cuda_stats gs;
    uint32_t vocab;
    float *lg = gpu_decode17(true, &gs, &vocab);
    cr_assert_eq(gs.capture_failures, 0, "capture of bucket 32 failed: %s", gs.capture_error);
    cr_assert_eq(gs.graph_steps, STEPS17, "%llu of %d decode steps replayed",
                 (unsigned long long)gs.graph_steps, STEPS17);
    char dir[512];
    snprintf(dir, sizeof dir, "%s/small-bf16", PIE_MODELS_DIR);
    eng_opts o = {.model_dir = dir,
                  .kv_page_size = PAGE,
                  .kv_pages = SEQS17 * 3,
                  .embed_slots = CTX17 + 2 * SEQS17,
                  .max_batch_tokens = CTX17,
                  .n_threads = 2};
    pie_status st = {0};
    eng *c = NULL;
    cr_assert_eq(eng_open(&o, &c, &st), PIE_OK, "%s", st.msg);
    kc_engine kc = kc_engine_cpu(c);
    float *lc = malloc(sizeof(float) * SEQS17 * kc.vocab);
    cr_assert_not_null(lc);
    char why[512];
    cr_assert(kc_eng_decode_scenario(&kc, SEQS17, CTX17, STEPS17, lc, why, sizeof why), "%s", why);
    for (uint32_t b = 0; b < SEQS17; b++) {
        char what[64];
        snprintf(what, sizeof what, "decode batch of 17, item %u", b);
        cr_assert(kc_eng_agree(lg + (size_t)b * kc.vocab, lc + (size_t)b * kc.vocab, kc.vocab,
                               KC_ENG_TOL_BF16, what, why, sizeof why),
                  "%s", why);
    }
    free(lc);
    free(lg);
    eng_close(c);
}

Test(eng_cuda, two_identical_runs_are_bitwise_equal_and_graphs_equal_direct_launches) {
    CUDA_TEST_REQUIRE_DEVICE();
    eng_cuda_stats s1, s2, s3;
    uint32_t vocab;
    float *a = gpu_decode17(true, &s1, &vocab), *b = gpu_decode17(true, &s2, &vocab);
    float *c = gpu_decode17(false, &s3, &vocab);
    char why[256];
    uint32_t n = SEQS17 * vocab;
    cr_assert(kc_eng_bitwise(a, b, n, "two runs, graphs on", why, sizeof why), "%s", why);
    cr_assert(kc_eng_bitwise(a, c, n, "graphs on vs off", why, sizeof why), "%s", why);
    cr_assert_eq(s3.graph_steps, 0);
    free(a), free(b), free(c);
}

/* `batch` sequences of ctx tokens in pages from first_page on, then one decode step of all of
 * them in one batch; every output agrees with the CPU. Returns the next free page. */
static uint32_t decode_step_batch(pair *p, uint32_t first_page, uint32_t batch, uint32_t ctx) {
    uint32_t per = (ctx + 1 + PAGE - 1) / PAGE;
    static uint32_t pages[64][64], in[64], out[64];
    eng_forward_item items[64];
    cr_assert(batch <= 64 && per <= 64);
    for (uint32_t b = 0; b < batch; b++) {
        for (uint32_t j = 0; j < per; j++) pages[b][j] = first_page + b * per + j;
        prefill(p, pages[b], 100 + b, ctx, 0, UINT32_MAX);
    }
    for (uint32_t b = 0; b < batch; b++) {
        in[b] = 3000 + b, out[b] = 3100 + b;
        embed_seq(p, in[b], 100 + b, ctx, 1);
        items[b] = pie_test_item(PAGE, pages[b], ctx + 1, true, &in[b], 1, &out[b], 1);
    }
    forward(p, items, batch);
    for (uint32_t b = 0; b < batch; b++) assert_agree(p, out[b], "decode step of a batch");
    return first_page + batch * per;
}

Test(eng_cuda, decode_graphs_stay_one_per_bucket_across_split_counts_and_cover_every_step) {
    CUDA_TEST_REQUIRE_DEVICE();
    pair p = open_pair("tiny-bf16", 400, 4096, 2048);
    /* one sequence decoded at 100, 600, 1100 and 2040 tokens (tiny's positions end at 2048):
     * 1, 2, 4 and 7 splits, one graph */
    static uint32_t pages[140], s[2048];
    for (uint32_t i = 0; i < 140; i++) pages[i] = i;
    static const uint32_t lens[] = {100, 600, 1100, 2040};
    uint32_t at = 0, out = 3500, in = 3501;
    for (size_t k = 0; k < sizeof lens / sizeof lens[0]; k++) {
        uint32_t n = lens[k] - 1 - at; /* prefill up to the token before the decode */
        embed_seq(&p, 0, 7, at, n);
        eng_forward_item chunk =
            pie_test_item(PAGE, pages, at + n, true, pie_test_range(s, 0, n), n, NULL, 0);
        forward(&p, &chunk, 1);
        embed_seq(&p, in, 7, lens[k] - 1, 1);
        eng_forward_item dec = pie_test_item(PAGE, pages, lens[k], true, &in, 1, &out, 1);
        forward(&p, &dec, 1);
        assert_agree(&p, out, "decode step over a growing context");
        at = lens[k];
    }
    /* batches of 2, 3, 5, 9 and 17 items: buckets 2, 4, 8, 16, 32 */
    uint32_t page = 140;
    static const uint32_t batches[] = {2, 3, 5, 9, 17};
    for (size_t k = 0; k < sizeof batches / sizeof batches[0]; k++)
        page = decode_step_batch(&p, page, batches[k], 30);
    eng_cuda_stats gs;
    eng_cuda_get_stats(p.g, &gs);
    cr_assert_eq(gs.capture_failures, 0, "capture failed: %s", gs.capture_error);
    cr_assert_eq(gs.graphs, 6, "buckets 1, 2, 4, 8, 16, 32 used: %u graphs", gs.graphs);
    cr_assert_eq(gs.graph_steps, gs.decode_steps, "%llu of %llu decode steps replayed",
                 (unsigned long long)gs.graph_steps, (unsigned long long)gs.decode_steps);
    cr_assert_eq(gs.decode_steps, 4 + 5);
    fprintf(stderr, "kernels in the last step (bucket 32, tiny model): %u\n", gs.last_step_kernels);
    close_pair(&p);
}

Test(eng_cuda, a_prefill_and_a_long_decode_in_one_batch_each_get_their_kernel_and_agree) {
    CUDA_TEST_REQUIRE_DEVICE();
    pair p = open_pair("tiny-bf16", 120, 4096, 2048);
    static uint32_t pa[8], pb[100], s[64];
    for (uint32_t i = 0; i < 8; i++) pa[i] = i;
    for (uint32_t i = 0; i < 100; i++) pb[i] = 8 + i;
    prefill(&p, pb, 3, 1500, 0, UINT32_MAX); /* the long decode's context */
    embed_seq(&p, 2000, 4, 0, 40);           /* the prefill: 40 rows, tensor cores */
    embed_seq(&p, 2100, 3, 1500, 1);         /* the decode: 1 row over 1500 keys, split */
    uint32_t oa = 2200, ob = 2201, ib = 2100;
    eng_forward_item items[2] = {
        pie_test_item(PAGE, pa, 40, true, pie_test_range(s, 2000, 40), 40, &oa, 1),
        pie_test_item(PAGE, pb, 1501, true, &ib, 1, &ob, 1)};
    forward(&p, items, 2);
    assert_agree(&p, oa, "prefill beside a long decode");
    assert_agree(&p, ob, "long decode beside a prefill");
    close_pair(&p);
}

/* ---- device faults --------------------------------------------------------------------------- */

static void count_fault(const char *why, void *arg) {
    (void)why;
    (*(int *)arg)++;
}

Test(eng_cuda, a_device_fault_fails_the_call_and_every_later_one_with_its_reason) {
    CUDA_TEST_REQUIRE_DEVICE();
    setenv("PIE_CUDA_FAULT_AFTER", "2", 1); /* the second forward launches a trapping kernel */
    int hooks = 0;
    eng_cuda_on_fault(count_fault, &hooks);
    eng_cuda *g = open_gpu("tiny-bf16", 8, 64, 64);
    uint32_t pg[] = {0, 1}, slots[20], toks[20], pos[20], out = 40;
    for (uint32_t i = 0; i < 20; i++) slots[i] = i, toks[i] = i + 1, pos[i] = i;
    pie_status st = {0};
    cr_assert_eq(eng_cuda_embed_text(g, slots, toks, pos, 20, &st), PIE_OK, "%s", st.msg);
    eng_forward_item it = pie_test_item(PAGE, pg, 20, true, slots, 20, &out, 1);
    cr_assert_eq(eng_cuda_forward(g, &it, 1, &st), PIE_OK, "first forward: %s", st.msg);
    cr_assert_eq(eng_cuda_forward(g, &it, 1, &st), PIE_INTERNAL);
    cr_assert(strstr(st.msg, "cuda: device fault: ") == st.msg, "message: %s", st.msg);
    char why[PIE_STATUS_MSG_MAX];
    cr_assert(eng_cuda_fault(why, sizeof why));
    cr_assert_str_eq(why, st.msg);
    cr_assert_eq(hooks, 1);
    cr_assert_eq(eng_cuda_embed_text(g, slots, toks, pos, 20, &st), PIE_INTERNAL);
    cr_assert(strstr(st.msg, "device fault") != NULL, "a later call: %s", st.msg);
    cr_assert_eq(hooks, 1, "the hook runs once");
    eng_cuda_close(g);
}

/* ---- validation: the cpu backend's messages -------------------------------------------------- */

Test(eng_cuda, refused_calls_give_the_cpu_backends_messages) {
    CUDA_TEST_REQUIRE_DEVICE();
    pair p = open_pair("tiny-bf16", 8, 32, 64);
    pie_status sc = {0}, sg = {0};
    uint32_t pg[] = {0, 9}, in = 1, out = 2;
    eng_forward_item bad = pie_test_item(PAGE, pg, 20, true, &in, 1, &out, 1);
    cr_assert_eq(eng_forward(p.c, &bad, 1, &sc), PIE_INVALID_ARGUMENT);
    cr_assert_eq(eng_cuda_forward(p.g, &bad, 1, &sg), PIE_INVALID_ARGUMENT);
    cr_assert_str_eq(sg.msg, sc.msg);
    uint32_t slot = 40, token = 0, pos = 0;
    cr_assert_eq(eng_embed_text(p.c, &slot, &token, &pos, 1, &sc), PIE_INVALID_ARGUMENT);
    cr_assert_eq(eng_cuda_embed_text(p.g, &slot, &token, &pos, 1, &sg), PIE_INVALID_ARGUMENT);
    cr_assert_str_eq(sg.msg, sc.msg);
    eng_copy_item c = {0, 0, 0, 4, 8};
    cr_assert_eq(eng_copy_pages(p.c, &c, 1, &sc), PIE_INVALID_ARGUMENT);
    cr_assert_eq(eng_cuda_copy_pages(p.g, &c, 1, &sg), PIE_INVALID_ARGUMENT);
    cr_assert_str_eq(sg.msg, sc.msg);
    close_pair(&p);
}

/* Tensor parallelism is the cpu backend's so far (tests/unit/test_eng_tp.c); the cuda backend
 * says so before it touches a device, so this runs everywhere. */
Test(eng_cuda, tp_size_above_1_is_refused_with_a_clear_error) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/tiny-bf16", PIE_MODELS_DIR);
    eng_opts o = {.model_dir = dir, .backend = ENG_BACKEND_CUDA, .tp_rank = 1, .tp_size = 2};
    pie_status st = {0};
    eng_cuda *g = NULL;
    cr_assert_eq(eng_cuda_open(&o, &g, &st), PIE_UNIMPLEMENTED);
    cr_assert_str_eq(st.msg, "eng_open: tp_size 2: the cuda backend runs only tp_size 1 so far "
                             "(tensor parallelism is built for the cpu backend)");
    cr_assert_null(g);
}
