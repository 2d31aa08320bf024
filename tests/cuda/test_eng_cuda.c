/* test_eng_cuda.c — the cuda backend (eng_cuda.h) against the CPU backend (eng.h) on the same
 * batches as the CPU engine's own tests (tests/unit/test_eng.c): prefill, decode, chunked
 * prefill, explicit and page masks, items sharing pages, copied and masked pages, a mixed
 * batch, decode batches replayed from CUDA graphs, long contexts (split-KV), next_dist, greedy
 * generation, and the validation messages. Every operation runs on both engines ("a pair");
 * logits must agree within bf16 tolerance (the cuda backend keeps weights and KV in bf16).
 * Skips visibly where there is no CUDA device. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_test.h"
#include "eng.h"
#include "eng_cuda.h"

#define PAGE 16
/* max |gpu - cpu| / max |cpu| over the logits; bf16 weights and KV against the CPU's f32 KV */
#define TOL_BF16 3e-2
#define TOL_F32  6e-2 /* f32 checkpoints: the cuda backend also rounds the weights to bf16 */

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
    p.tol = strstr(name, "f32") ? TOL_F32 : TOL_BF16;
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

static eng_forward_item seq_item(const uint32_t *pages, uint32_t seq_len, bool append,
                                 const uint32_t *in, uint32_t n_in, const uint32_t *out,
                                 uint32_t n_out) {
    return (eng_forward_item){.kv_pages = pages,
                              .n_kv_pages = (seq_len + PAGE - 1) / PAGE,
                              .kv_last_page_len = seq_len ? (seq_len - 1) % PAGE + 1 : 0,
                              .append_kv = append,
                              .in_slots = in,
                              .n_in = n_in,
                              .out_slots = out,
                              .n_out = n_out};
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

static const uint32_t *range(uint32_t *buf, uint32_t first, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) buf[i] = first + i;
    return buf;
}

static double rel_diff(const float *a, const float *b, uint32_t n) {
    double worst = 0, scale = 0;
    for (uint32_t i = 0; i < n; i++) {
        worst = fmax(worst, fabs((double)a[i] - b[i]));
        scale = fmax(scale, fabs((double)b[i]));
    }
    return worst / scale;
}

/* The slot's logits agree between the backends, and so do their positions. */
static void assert_agree(pair *p, uint32_t slot, const char *what) {
    float *a = malloc(p->vocab * sizeof *a), *b = malloc(p->vocab * sizeof *b);
    cr_assert(a && b);
    pie_status st = {0};
    cr_assert_eq(eng_cuda_logits(p->g, slot, a, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(eng_logits(p->c, slot, b, &st), PIE_OK, "%s", st.msg);
    double d = rel_diff(a, b, p->vocab);
    cr_assert(d <= p->tol,
              "%s: slot %u: cuda logits differ from cpu by %.3g (relative), more than %g", what,
              slot, d, p->tol);
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
    eng_forward_item it = seq_item(pages, len, true, range(in, slot0, len), len, &out_slot,
                                   out_slot == UINT32_MAX ? 0 : 1);
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
    eng_forward_item dec = seq_item(pb, N, true, range(s, 60, 1), 1, &o, 1);
    forward(&p, &dec, 1);
    assert_agree(&p, 101, "prefill + decode");
    uint32_t done = 0, chunks[] = {10, 16, 11};
    for (int c = 0; c < 3; c++) {
        embed_seq(&p, 0, 0, done, chunks[c]);
        done += chunks[c];
        o = 102;
        eng_forward_item it =
            seq_item(pc, done, true, range(s, 0, chunks[c]), chunks[c], &o, c == 2 ? 1 : 0);
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
    eng_forward_item it = seq_item(pg, 20, true, range(s, 0, 20), 20, outs, 3);
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
    eng_forward_item two[2] = {seq_item(pg, 20, false, &i0, 1, &o0, 1),
                               seq_item(pg, 20, false, &i1, 1, &o1, 1)};
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
    eng_forward_item it = seq_item(pg, 20, false, &x, 1, &o, 1);
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
    eng_forward_item it = seq_item(q, 20, false, &x, 1, &o, 1);
    forward(&p, &it, 1);
    assert_agree(&p, 40, "forward over copied pages (mask copied too)");
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
        seq_item(pa, 12, true, range(s[0], 100, 12), 12, oa, 2),
        seq_item(pb, 21, true, range(s[1], 120, 1), 1, ob, 1),
        seq_item(pc, 9, false, range(s[2], 130, 3), 3, oc, 3),
        seq_item(NULL, 0, false, range(s[3], 140, 4), 4, od, 1),
        seq_item(pb, 20, false, &e_in, 1, oe, 1),
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
            items[b] = seq_item(pages[b], ctx + t + 1, true, &in[b], 1, &out[b], 1);
        }
        forward(p, items, batch);
        for (uint32_t b = 0; b < batch; b++) assert_agree(p, out[b], "decode step");
    }
}

Test(eng_cuda, decode_batches_replayed_from_graphs_agree_with_cpu) {
    CUDA_TEST_REQUIRE_DEVICE();
    pair p = open_pair("small-f32", 64 * 4, 4096, 4096);
    decode_batch(&p, 3, 40, 4, 4); /* bucket 4: one padding row */
    uint64_t replays;
    uint32_t graphs;
    eng_cuda_graph_stats(p.g, &replays, &graphs);
    cr_assert_geq(replays, 4, "decode steps should replay graphs (%llu replays)",
                  (unsigned long long)replays);
    cr_assert_geq(graphs, 1);
    close_pair(&p);
}

Test(eng_cuda, graphs_on_and_off_give_identical_logits) {
    CUDA_TEST_REQUIRE_DEVICE();
    pair p = open_pair("tiny-bf16", 16, 256, 256);
    uint32_t pg[] = {0, 1, 2}, in = 60, o1 = 101, o2 = 102;
    prefill(&p, pg, 0, 36, 0, UINT32_MAX);
    embed_seq(&p, in, 0, 36, 1);
    eng_forward_item it = seq_item(pg, 37, true, &in, 1, &o1, 1);
    forward(&p, &it, 1);
    eng_cuda_set_graphs(p.g, false);
    it.out_slots = &o2;
    forward(&p, &it, 1); /* rewrites the same K/V */
    float *a = malloc(p.vocab * sizeof *a), *b = malloc(p.vocab * sizeof *b);
    pie_status st = {0};
    cr_assert_eq(eng_cuda_logits(p.g, o1, a, &st), PIE_OK);
    cr_assert_eq(eng_cuda_logits(p.g, o2, b, &st), PIE_OK);
    cr_assert(memcmp(a, b, p.vocab * sizeof *a) == 0,
              "graph replay and direct launches differ (relative %.3g)", rel_diff(a, b, p.vocab));
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

Test(eng_cuda, greedy_generation_equals_cpu) {
    CUDA_TEST_REQUIRE_DEVICE();
    pair p = open_pair("small-f32", 16, 256, 256);
    uint32_t pg[] = {0, 1, 2, 3}, in = 60, out = 61;
    prefill(&p, pg, 9, 12, 0, out);
    pie_status st = {0};
    uint32_t n = 12;
    for (int step = 0; step < 24; step++) {
        uint32_t idc, idg;
        float pc[2], pgp[2];
        uint32_t ic[2], ig[2];
        eng_dist_item dc = {out, 2, 1.0f, ic, pc}, dg = {out, 2, 1.0f, ig, pgp};
        cr_assert_eq(eng_next_dist(p.c, &dc, 1, &st), PIE_OK, "%s", st.msg);
        cr_assert_eq(eng_cuda_next_dist(p.g, &dg, 1, &st), PIE_OK, "%s", st.msg);
        idc = ic[0], idg = ig[0];
        /* a near tie may fall either way within bf16 tolerance; elsewhere the choice is equal */
        if (pc[0] - pc[1] > 0.02f * pc[0])
            cr_assert_eq(idg, idc, "step %d: greedy token %u, cpu %u", step, idg, idc);
        uint32_t pos = n;
        cr_assert_eq(eng_embed_text(p.c, &in, &idc, &pos, 1, &st), PIE_OK);
        cr_assert_eq(eng_cuda_embed_text(p.g, &in, &idc, &pos, 1, &st), PIE_OK); /* teacher: cpu */
        n++;
        eng_forward_item it = seq_item(pg, n, true, &in, 1, &out, 1);
        forward(&p, &it, 1);
    }
    close_pair(&p);
}

/* ---- validation: the cpu backend's messages -------------------------------------------------- */

Test(eng_cuda, refused_calls_give_the_cpu_backends_messages) {
    CUDA_TEST_REQUIRE_DEVICE();
    pair p = open_pair("tiny-bf16", 8, 32, 64);
    pie_status sc = {0}, sg = {0};
    uint32_t pg[] = {0, 9}, in = 1, out = 2;
    eng_forward_item bad = seq_item(pg, 20, true, &in, 1, &out, 1);
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
