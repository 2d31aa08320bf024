/* test_eng.c — services/worker/engine: the CPU engine's handlers (eng.h) on the generated test
 * models (PIE_MODELS_DIR, made by tools/tinymodel at build time).
 *
 * Four parts. (1) Every message of the list in eng_cpu.c's header comment, exactly, and that a
 * refused call changes nothing. (2) Equivalences that pin the forward semantics without a
 * reference: prefill-then-decode and chunked prefill equal one-shot prefill, items sharing
 * pages read the same, append_kv=false leaves pages untouched, page masks equal explicit masks,
 * copied pages equal their source, a mixed batch equals its items run alone, an item reading
 * what another item of its batch writes sees the new K/V (pie.v1.ForwardBatch), explicit masks
 * larger than the mask scratch. (3) next_dist against a softmax of eng_logits computed here;
 * bf16/f16 twins against f32. (4) pie-engine-probe (tools/engine-probe/PROTOCOL.md) against
 * the engine in this process. The numeric comparison with an independent reference lives in
 * tests/python/test_forward_reference.py. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "eng.h"
#include "pie_testeng.h"

#define PAGE    16
#define THREADS 2

/* ---- helpers --------------------------------------------------------------------------------- */

static void model_path(char *buf, size_t n, const char *name) {
    int k = snprintf(buf, n, "%s/%s", PIE_MODELS_DIR, name);
    cr_assert(k > 0 && (size_t)k < n);
}

static eng *open_model_kv(const char *name, uint32_t pages, uint32_t slots, uint32_t max_batch,
                          eng_kv_dtype kv) {
    char dir[512];
    model_path(dir, sizeof dir, name);
    eng_opts o = {.model_dir = dir,
                  .kv_page_size = PAGE,
                  .kv_pages = pages,
                  .embed_slots = slots,
                  .max_batch_tokens = max_batch,
                  .n_threads = THREADS,
                  .kv_dtype = kv};
    pie_status st = {0};
    eng *e = NULL;
    cr_assert_eq(eng_open(&o, &e, &st), PIE_OK, "eng_open %s: %s", dir, st.msg);
    return e;
}

static eng *open_model(const char *name, uint32_t pages, uint32_t slots, uint32_t max_batch) {
    return open_model_kv(name, pages, slots, max_batch, ENG_KV_F32);
}

/* A deterministic token of sequence `seq` at index i. */
static uint32_t tok(const eng *e, uint32_t seq, uint32_t i) {
    return (seq * 7919u + i * 104729u + 13u) % eng_get_info(e)->vocab_size;
}

/* slots slot0.. ← tokens of sequence seq at indices [from, from + n), positions the same. */
static void embed_seq(eng *e, uint32_t slot0, uint32_t seq, uint32_t from, uint32_t n) {
    uint32_t slots[4096], toks[4096], pos[4096];
    cr_assert(n <= 4096);
    for (uint32_t i = 0; i < n; i++) {
        slots[i] = slot0 + i;
        toks[i] = tok(e, seq, from + i);
        pos[i] = from + i;
    }
    pie_status st = {0};
    cr_assert_eq(eng_embed_text(e, slots, toks, pos, n, &st), PIE_OK, "embed: %s", st.msg);
}

static float *logits_of(eng *e, uint32_t slot) {
    float *lg = malloc(eng_get_info(e)->vocab_size * sizeof *lg);
    cr_assert_not_null(lg);
    pie_status st = {0};
    cr_assert_eq(eng_logits(e, slot, lg, &st), PIE_OK, "logits: %s", st.msg);
    return lg;
}

/* max |a - b| / max |b| */
static double rel_diff(const float *a, const float *b, uint32_t n) {
    double worst = 0, scale = 0;
    for (uint32_t i = 0; i < n; i++) {
        worst = fmax(worst, fabs((double)a[i] - b[i]));
        scale = fmax(scale, fabs((double)b[i]));
    }
    return worst / scale;
}

static void assert_close(eng *e, uint32_t slot_a, eng *e2, uint32_t slot_b, double tol,
                         const char *what) {
    float *a = logits_of(e, slot_a), *b = logits_of(e2, slot_b);
    double d = rel_diff(a, b, eng_get_info(e)->vocab_size);
    cr_assert(d <= tol, "%s: logits of slot %u and slot %u differ by %.3g (relative), more than %g",
              what, slot_a, slot_b, d, tol);
    free(a);
    free(b);
}

static void assert_same(eng *e, uint32_t slot_a, eng *e2, uint32_t slot_b, const char *what) {
    float *a = logits_of(e, slot_a), *b = logits_of(e2, slot_b);
    cr_assert(memcmp(a, b, eng_get_info(e)->vocab_size * sizeof *a) == 0,
              "%s: logits of slot %u and slot %u are not bitwise equal (relative diff %.3g)", what,
              slot_a, slot_b, rel_diff(a, b, eng_get_info(e)->vocab_size));
    free(a);
    free(b);
}

/* Prefills `len` tokens of sequence seq (slots from slot0) into pages, appending; output of
 * the last token to out_slot (or none when out_slot is UINT32_MAX). */
static void prefill(eng *e, const uint32_t *pages, uint32_t seq, uint32_t len, uint32_t slot0,
                    uint32_t out_slot) {
    uint32_t in[4096];
    embed_seq(e, slot0, seq, 0, len);
    eng_forward_item it = pie_test_item(PAGE, pages, len, true, pie_test_range(in, slot0, len), len,
                                        &out_slot, out_slot == UINT32_MAX ? 0 : 1);
    pie_test_forward_ok(e, &it, 1);
}

/* ---- (1) validation ----------------------------------------------------------------------------
 */

static void expect(pie_code got, pie_code want, const pie_status *st, const char *msg) {
    cr_assert_eq(got, want, "code %d (%s), expected %d; message: %s", got, pie_code_name(got), want,
                 st->msg);
    cr_assert_str_eq(st->msg, msg);
}

static void expect_fwd(eng *e, const eng_forward_item *items, uint32_t n, const char *msg) {
    pie_status st = {0};
    expect(eng_forward(e, items, n, &st), PIE_INVALID_ARGUMENT, &st, msg);
}

Test(eng, open_refuses_bad_options_with_the_promised_messages) {
    char dir[512];
    model_path(dir, sizeof dir, "tiny-f32");
    pie_status st = {0};
    eng *e = (eng *)1;
    expect(eng_open(NULL, &e, &st), PIE_INVALID_ARGUMENT, &st,
           "eng_open: opts, out and opts->model_dir must not be NULL");
    eng_opts o = {.model_dir = dir, .backend = ENG_BACKEND_CUDA};
    expect(eng_open(&o, &e, &st), PIE_UNIMPLEMENTED, &st,
           "eng_open: backend 2 is not available (this build has the cpu backend)");
    cr_assert_null(e);
    o = (eng_opts){.model_dir = dir, .kv_page_size = 70000};
    expect(eng_open(&o, &e, &st), PIE_INVALID_ARGUMENT, &st,
           "eng_open: kv_page_size 70000 is out of range [1, 65536]");
    o = (eng_opts){.model_dir = dir, .max_batch_tokens = 2000000};
    expect(eng_open(&o, &e, &st), PIE_INVALID_ARGUMENT, &st,
           "eng_open: max_batch_tokens 2000000 is out of range [1, 1048576]");
    o = (eng_opts){.model_dir = dir, .embed_slots = 20000000};
    expect(eng_open(&o, &e, &st), PIE_INVALID_ARGUMENT, &st,
           "eng_open: embed_slots 20000000 is out of range [1, 16777216]");
    o = (eng_opts){.model_dir = dir, .kv_pages = 100000000, .kv_page_size = 16};
    expect(eng_open(&o, &e, &st), PIE_INVALID_ARGUMENT, &st,
           "eng_open: kv_pages 100000000 x kv_page_size 16 exceeds 2^30 tokens");
    o = (eng_opts){.model_dir = dir, .kv_dtype = (eng_kv_dtype)7};
    expect(eng_open(&o, &e, &st), PIE_INVALID_ARGUMENT, &st,
           "eng_open: kv_dtype 7 is neither f32 (0) nor bf16 (1)");
    o = (eng_opts){.model_dir = "/nonexistent/pie-model"};
    cr_assert_eq(eng_open(&o, &e, &st), PIE_NOT_FOUND, "missing dir: %s", st.msg);
    cr_assert(strstr(st.msg, "/nonexistent/pie-model") != NULL, "message: %s", st.msg);
    cr_assert_null(e);
}

Test(eng, info_reports_model_pools_and_memory) {
    eng *e = open_model("tiny-f32", 8, 32, 64);
    const eng_info *in = eng_get_info(e);
    cr_assert_str_eq(in->architecture, "llama");
    cr_assert_str_eq(in->dtype, "f32");
    cr_assert_eq(in->vocab_size, 512);
    cr_assert_eq(in->hidden_size, 64);
    cr_assert_eq(in->n_layers, 2);
    cr_assert_eq(in->n_heads, 4);
    cr_assert_eq(in->n_kv_heads, 2);
    cr_assert_eq(in->head_dim, 16);
    cr_assert_eq(in->kv_page_size, PAGE);
    cr_assert_eq(in->kv_pages, 8);
    cr_assert_eq(in->embed_slots, 32);
    cr_assert_eq(in->max_batch_tokens, 64);
    /* K and V of every layer, f32, plus one mask byte and a count per page */
    size_t kv = (size_t)2 * 8 * PAGE * 2 * 2 * 16 * 4 + 8 * PAGE + 8 * 4;
    cr_assert_eq(in->kv_pool_bytes, kv, "kv_pool_bytes %zu, expected %zu", in->kv_pool_bytes, kv);
    cr_assert_geq(in->embed_pool_bytes, (size_t)32 * (64 * 4 + 4));
    cr_assert_gt(in->scratch_bytes, (size_t)64 * 64 * 4 * 2);
    cr_assert_gt(in->weight_bytes, (size_t)512 * 64 * 4);
    cr_assert_str_eq(in->kv_dtype, "f32");
    cr_assert_eq(in->kv_page_layer_bytes, (size_t)2 * PAGE * 2 * 16 * 4);
    eng_close(e);

    /* a bf16 pool: half the K/V bytes, the same masks */
    e = open_model_kv("tiny-f32", 8, 32, 64, ENG_KV_BF16);
    in = eng_get_info(e);
    cr_assert_str_eq(in->kv_dtype, "bf16");
    cr_assert_eq(in->kv_page_layer_bytes, (size_t)2 * PAGE * 2 * 16 * 2);
    kv = (size_t)2 * 8 * PAGE * 2 * 2 * 16 * 2 + 8 * PAGE + 8 * 4;
    cr_assert_eq(in->kv_pool_bytes, kv, "bf16: kv_pool_bytes %zu, expected %zu", in->kv_pool_bytes,
                 kv);
    eng_close(e);

    e = open_model("tiny-bf16", 8, 32, 64);
    cr_assert_str_eq(eng_get_info(e)->dtype, "bf16");
    eng_close(e);
}

Test(eng, embed_refuses_bad_items) {
    eng *e = open_model("tiny-f32", 8, 32, 64);
    pie_status st = {0};
    uint32_t ok[2] = {1, 2}, bad_slot[2] = {1, 32}, bad_tok[2] = {1, 512}, bad_pos[2] = {0, 2048};
    expect(eng_embed_text(e, NULL, ok, ok, 2, &st), PIE_INVALID_ARGUMENT, &st,
           "embed_text: slots, tokens and positions must not be NULL");
    expect(eng_embed_text(e, bad_slot, ok, ok, 2, &st), PIE_INVALID_ARGUMENT, &st,
           "embed_text: item 1: slot 32 is out of range [0, 32)");
    expect(eng_embed_text(e, ok, bad_tok, ok, 2, &st), PIE_INVALID_ARGUMENT, &st,
           "embed_text: item 1: token 512 is out of range [0, 512)");
    expect(eng_embed_text(e, ok, ok, bad_pos, 2, &st), PIE_INVALID_ARGUMENT, &st,
           "embed_text: item 1: position 2048 is out of range [0, 2048)");
    cr_assert_eq(eng_embed_text(e, NULL, NULL, NULL, 0, &st), PIE_OK);
    eng_close(e);
}

Test(eng, forward_refuses_bad_pages_and_counts) {
    eng *e = open_model("tiny-f32", 8, 32, 64);
    embed_seq(e, 0, 0, 0, 20);
    uint32_t p0[] = {0}, p01[] = {0, 1}, p18[] = {0, 8}, p303[] = {3, 0, 3}, s[64];
    eng_forward_item good = pie_test_item(PAGE, p0, 7, true, pie_test_range(s, 0, 7), 7, NULL, 0);
    eng_forward_item it;

    expect_fwd(e, NULL, 1, "forward: items is NULL");
    it = good, it.kv_pages = NULL;
    expect_fwd(e, &it, 1, "forward: item 0: kv_pages is NULL");
    eng_forward_item two[2] = {good, pie_test_item(PAGE, p18, 17, false, s, 1, NULL, 0)};
    expect_fwd(e, two, 2, "forward: item 1: kv_pages[1] = 8 is out of range [0, 8)");
    it = pie_test_item(PAGE, p303, 40, false, s, 1, NULL, 0);
    expect_fwd(e, &it, 1, "forward: item 0: kv page 3 appears twice (kv_pages[0] and kv_pages[2])");
    it = pie_test_item(PAGE, NULL, 0, false, s, 1, NULL, 0), it.kv_last_page_len = 3;
    expect_fwd(e, &it, 1, "forward: item 0: kv_last_page_len 3 must be 0 when kv_pages is empty");
    eng_forward_item three[3] = {good, pie_test_item(PAGE, p01, 20, false, s, 1, NULL, 0),
                                 pie_test_item(PAGE, p0, 7, false, s, 1, NULL, 0)};
    three[2].kv_last_page_len = 17;
    expect_fwd(e, three, 3, "forward: item 2: kv_last_page_len 17 is out of range [1, 16]");
    it = pie_test_item(PAGE, p0, 7, false, s, 1, NULL, 0), it.kv_last_page_len = 0;
    expect_fwd(e, &it, 1, "forward: item 0: kv_last_page_len 0 is out of range [1, 16]");
    it = pie_test_item(PAGE, p0, 7, false, s, 0, NULL, 0);
    expect_fwd(e, &it, 1, "forward: item 0: in_slots is empty");
    it = pie_test_item(PAGE, p0, 7, false, NULL, 1, NULL, 0);
    expect_fwd(e, &it, 1, "forward: item 0: in_slots is NULL");
    it = pie_test_item(PAGE, p0, 7, false, s, 1, s, 2);
    expect_fwd(e, &it, 1, "forward: item 0: out_slots has 2 entries, more than the 1 of in_slots");
    it = pie_test_item(PAGE, p0, 7, false, s, 1, NULL, 1);
    expect_fwd(e, &it, 1, "forward: item 0: out_slots is NULL");
    uint32_t zeros[64] = {0};
    eng_forward_item big[2] = {pie_test_item(PAGE, NULL, 0, false, zeros, 40, NULL, 0),
                               pie_test_item(PAGE, NULL, 0, false, zeros, 30, NULL, 0)};
    expect_fwd(e, big, 2,
               "forward: item 1: the batch reaches 70 input tokens, more than max_batch_tokens 64");
    uint32_t in_bad[] = {0, 32}, out_bad[] = {1, 40};
    it = pie_test_item(PAGE, p0, 7, false, in_bad, 2, NULL, 0);
    expect_fwd(e, &it, 1, "forward: item 0: in_slots[1] = 32 is out of range [0, 32)");
    it = pie_test_item(PAGE, p0, 7, false, s, 2, out_bad, 2);
    expect_fwd(e, &it, 1, "forward: item 0: out_slots[1] = 40 is out of range [0, 32)");
    uint32_t p1[] = {1};
    it = pie_test_item(PAGE, p1, 2, true, pie_test_range(s, 0, 3), 3, NULL, 0);
    expect_fwd(e, &it, 1, "forward: item 0: append_kv with n_in 3 but kv_pages hold only 2 tokens");
    it = pie_test_item(PAGE, NULL, 0, true, s, 1, NULL, 0);
    expect_fwd(e, &it, 1, "forward: item 0: append_kv with n_in 1 but kv_pages hold only 0 tokens");
    eng_close(e);
}

Test(eng, forward_refuses_conflicting_items) {
    eng *e = open_model("tiny-f32", 8, 32, 64);
    embed_seq(e, 0, 0, 0, 20);
    uint32_t p0[] = {0}, p20[] = {2, 0}, s[8];
    uint32_t o55[] = {5, 5}, o5[] = {5}, i5[] = {5}, i3[] = {3}, o6[] = {6};
    eng_forward_item two[2];

    eng_forward_item it = pie_test_item(PAGE, p0, 7, false, pie_test_range(s, 0, 2), 2, o55, 2);
    expect_fwd(e, &it, 1, "forward: item 0: out_slots[1] = 5 is also an output of item 0");
    two[0] = pie_test_item(PAGE, p0, 7, false, i3, 1, o5, 1);
    two[1] = pie_test_item(PAGE, p0, 7, false, pie_test_range(s, 0, 2), 2, o5, 1);
    expect_fwd(e, two, 2, "forward: item 1: out_slots[0] = 5 is also an output of item 0");
    /* both append token 4 of page 0 (item 1's page list is [2, 0]: sequence index 20) */
    two[0] = pie_test_item(PAGE, p0, 5, true, i3, 1, NULL, 0);
    two[1] = pie_test_item(PAGE, p20, 21, true, pie_test_range(s, 0, 1), 1, NULL, 0);
    expect_fwd(e, two, 2, "forward: item 1: input 0 writes kv page 0 offset 4, as does item 0");
    /* item 0 reads the output of item 1 (an item may read its own output slot) */
    two[0] = pie_test_item(PAGE, p0, 7, false, i5, 1, o6, 1);
    two[1] = pie_test_item(PAGE, p0, 7, false, i3, 1, o5, 1);
    expect_fwd(e, two, 2, "forward: item 0: in_slots[0] = 5 is an output of item 1");
    it = pie_test_item(PAGE, p0, 7, false, i5, 1, o5, 1);
    pie_test_forward_ok(e, &it, 1);
    eng_close(e);
}

Test(eng, forward_refuses_malformed_masks) {
    eng *e = open_model("tiny-f32", 8, 32, 64);
    embed_seq(e, 0, 0, 0, 20);
    uint32_t p0[] = {0}, s[4] = {10, 11, 12, 13};
    eng_forward_item it =
        pie_test_item(PAGE, p0, 7, false, s, 1, NULL, 0); /* C = 7, row 0 has 8 tokens */
    it.n_mask_runs = 2;
    expect_fwd(e, &it, 1, "forward: item 0: mask_runs is NULL with n_mask_runs 2");
    uint32_t cross[] = {3, 1, 5}, left[] = {8, 4}, hide[] = {7, 1}, zero_left[] = {8, 0};
    it.mask_runs = cross, it.n_mask_runs = 3;
    expect_fwd(e, &it, 1,
               "forward: item 0: mask run 2 (length 5) crosses the end of row 0 (8 tokens)");
    it.mask_runs = left, it.n_mask_runs = 2;
    expect_fwd(e, &it, 1, "forward: item 0: mask has 1 runs left over after row 0");
    it.mask_runs = zero_left, it.n_mask_runs = 2;
    expect_fwd(e, &it, 1, "forward: item 0: mask has 1 runs left over after row 0");
    it.mask_runs = hide, it.n_mask_runs = 2;
    expect_fwd(e, &it, 1, "forward: item 0: mask row 0 hides its own token (the last of its 8)");
    it.mask_runs = hide, it.n_mask_runs = 0;
    expect_fwd(e, &it, 1, "forward: item 0: mask runs end in row 0 (0 of its 8 tokens covered)");
    eng_forward_item two = pie_test_item(PAGE, p0, 7, false, s, 2, NULL, 0);
    uint32_t short_runs[] = {8};
    two.mask_runs = short_runs, two.n_mask_runs = 1;
    expect_fwd(e, &two, 1, "forward: item 0: mask runs end in row 1 (0 of its 9 tokens covered)");
    /* valid: a zero first run starts a row masked; rows end exactly at their length */
    uint32_t fine[] = {0, 2, 6, 9};
    two.mask_runs = fine, two.n_mask_runs = 4;
    pie_test_forward_ok(e, &two, 1);
    eng_close(e);
}

Test(eng, refused_forward_changes_no_page_and_no_slot) {
    uint32_t p0[] = {0}, s[8], o20 = 20, o21 = 21, in10 = 10, runs_bad[] = {3, 1, 5};
    eng *e = open_model("tiny-f32", 8, 32, 64), *twin = open_model("tiny-f32", 8, 32, 64);
    for (int k = 0; k < 2; k++) {
        eng *x = k ? twin : e;
        prefill(x, p0, 0, 7, 0, 20);
        embed_seq(x, 10, 0, 7, 1);
    }
    float *before = logits_of(e, 20);
    /* item 0 alone would write page 0 offset 7 and slot 20 */
    eng_forward_item bad[2] = {pie_test_item(PAGE, p0, 8, true, &in10, 1, &o20, 1),
                               pie_test_item(PAGE, p0, 7, false, &in10, 1, &o21, 1)};
    bad[1].mask_runs = runs_bad, bad[1].n_mask_runs = 3;
    expect_fwd(e, bad, 2,
               "forward: item 1: mask run 2 (length 5) crosses the end of row 0 (8 tokens)");
    float *after = logits_of(e, 20);
    cr_assert(memcmp(before, after, 512 * sizeof(float)) == 0, "slot 20 changed");
    /* reading page 0 with 8 tokens sees offset 7 as the twin does (never written) */
    for (int k = 0; k < 2; k++) {
        eng *x = k ? twin : e;
        eng_forward_item rd =
            pie_test_item(PAGE, p0, 8, false, pie_test_range(s, 10, 1), 1, &o21, 1);
        pie_test_forward_ok(x, &rd, 1);
    }
    assert_same(e, 21, twin, 21, "page 0 after a refused forward");
    free(before);
    free(after);
    eng_close(e);
    eng_close(twin);
}

Test(eng, page_copy_mask_dist_and_slot_handlers_refuse_bad_items) {
    eng *e = open_model("tiny-f32", 8, 32, 64);
    pie_status st = {0};
    bool m[PAGE] = {0};
    expect(eng_mask_page(e, 0, NULL, &st), PIE_INVALID_ARGUMENT, &st, "mask_page: masked is NULL");
    expect(eng_mask_page(e, 8, m, &st), PIE_INVALID_ARGUMENT, &st,
           "mask_page: page 8 is out of range [0, 8)");

    expect(eng_copy_pages(e, NULL, 1, &st), PIE_INVALID_ARGUMENT, &st, "copy_pages: items is NULL");
    eng_copy_item c[2] = {{0, 1, 0, 0, 4}};
    struct {
        eng_copy_item bad;
        const char *msg;
    } cases[] = {
        {{8, 1, 0, 0, 1}, "copy_pages: item 1: src 8 is out of range [0, 8)"},
        {{0, 9, 0, 0, 1}, "copy_pages: item 1: dst 9 is out of range [0, 8)"},
        {{0, 1, 0, 0, 0}, "copy_pages: item 1: token_count 0 is out of range [1, 16]"},
        {{0, 1, 10, 0, 7},
         "copy_pages: item 1: src_offset 10 + token_count 7 exceeds kv_page_size 16"},
        {{0, 1, 0, 12, 5},
         "copy_pages: item 1: dst_offset 12 + token_count 5 exceeds kv_page_size 16"},
        {{2, 2, 0, 2, 4},
         "copy_pages: item 1: source [0, 4) and destination [2, 6) overlap in kv page 2"},
        {{2, 2, 6, 3, 4},
         "copy_pages: item 1: source [6, 10) and destination [3, 7) overlap in kv page 2"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        c[1] = cases[i].bad;
        expect(eng_copy_pages(e, c, 2, &st), PIE_INVALID_ARGUMENT, &st, cases[i].msg);
    }
    c[1] = (eng_copy_item){2, 2, 0, 4, 4}; /* adjacent ranges of one page are fine */
    cr_assert_eq(eng_copy_pages(e, c, 2, &st), PIE_OK, "%s", st.msg);

    uint32_t ids[4];
    float probs[4];
    eng_dist_item d[2] = {{.slot = 0, .top_k = 4, .temperature = 1, .ids = ids, .probs = probs}};
    expect(eng_next_dist(e, NULL, 1, &st), PIE_INVALID_ARGUMENT, &st, "next_dist: items is NULL");
    struct {
        eng_dist_item bad;
        const char *msg;
    } dcases[] = {
        {{32, 4, 1.0f, ids, probs}, "next_dist: item 1: slot 32 is out of range [0, 32)"},
        {{0, 0, 1.0f, ids, probs}, "next_dist: item 1: top_k 0 is out of range [1, 512]"},
        {{0, 513, 1.0f, ids, probs}, "next_dist: item 1: top_k 513 is out of range [1, 512]"},
        {{0, 4, 0.0f, ids, probs}, "next_dist: item 1: temperature 0 is not a finite number > 0"},
        {{0, 4, -1.0f, ids, probs}, "next_dist: item 1: temperature -1 is not a finite number > 0"},
        {{0, 4, INFINITY, ids, probs},
         "next_dist: item 1: temperature inf is not a finite number > 0"},
        {{0, 4, NAN, ids, probs}, "next_dist: item 1: temperature nan is not a finite number > 0"},
        {{0, 4, 1.0f, NULL, probs}, "next_dist: item 1: ids and probs must not be NULL"},
    };
    for (size_t i = 0; i < sizeof dcases / sizeof dcases[0]; i++) {
        d[1] = dcases[i].bad;
        expect(eng_next_dist(e, d, 2, &st), PIE_INVALID_ARGUMENT, &st, dcases[i].msg);
    }

    float lg[512];
    uint32_t pos;
    expect(eng_logits(e, 32, lg, &st), PIE_INVALID_ARGUMENT, &st,
           "logits: slot 32 is out of range [0, 32)");
    expect(eng_logits(e, 0, NULL, &st), PIE_INVALID_ARGUMENT, &st, "logits: logits is NULL");
    expect(eng_slot_position(e, 32, &pos, &st), PIE_INVALID_ARGUMENT, &st,
           "slot_position: slot 32 is out of range [0, 32)");
    expect(eng_slot_position(e, 0, NULL, &st), PIE_INVALID_ARGUMENT, &st,
           "slot_position: pos is NULL");
    eng_close(e);
}

/* ---- (2) forward equivalences -------------------------------------------------------------------
 */

static void prefill_decode_chunked(const char *model) {
    eng *e = open_model(model, 16, 256, 256);
    uint32_t pa[] = {0, 1, 2}, pb[] = {3, 4, 5}, pc[] = {6, 7, 8}, s[64];
    const uint32_t N = 37;
    /* one shot */
    prefill(e, pa, 0, N, 0, 100);
    /* prefill N-1 without outputs, then decode the last token */
    prefill(e, pb, 0, N - 1, 0, UINT32_MAX);
    embed_seq(e, 60, 0, N - 1, 1);
    uint32_t o = 101;
    eng_forward_item dec = pie_test_item(PAGE, pb, N, true, pie_test_range(s, 60, 1), 1, &o, 1);
    pie_test_forward_ok(e, &dec, 1);
    assert_close(e, 101, e, 100, 1e-5, "prefill + decode vs one-shot prefill");
    /* chunks of 10, 16, 11 */
    uint32_t done = 0, chunks[] = {10, 16, 11};
    for (int c = 0; c < 3; c++) {
        embed_seq(e, 0, 0, done, chunks[c]);
        done += chunks[c];
        o = 102;
        eng_forward_item it = pie_test_item(PAGE, pc, done, true, pie_test_range(s, 0, chunks[c]),
                                            chunks[c], &o, c == 2 ? 1 : 0);
        pie_test_forward_ok(e, &it, 1);
    }
    assert_close(e, 102, e, 100, 1e-5, "chunked prefill vs one-shot prefill");
    uint32_t pos;
    pie_status st = {0};
    cr_assert_eq(eng_slot_position(e, 102, &pos, &st), PIE_OK);
    cr_assert_eq(pos, N - 1, "output slot carries position %u, expected %u", pos, N - 1);
    eng_close(e);
}

Test(eng, clear_handlers_refuse_bad_ids) {
    eng *e = open_model("tiny-f32", 8, 32, 64);
    pie_status st = {0};
    expect(eng_clear_pages(e, NULL, 1, &st), PIE_INVALID_ARGUMENT, &st,
           "clear_pages: pages is NULL");
    expect(eng_clear_pages(e, (uint32_t[]){0, 8}, 2, &st), PIE_INVALID_ARGUMENT, &st,
           "clear_pages: item 1: page 8 is out of range [0, 8)");
    expect(eng_clear_embeds(e, NULL, 1, &st), PIE_INVALID_ARGUMENT, &st,
           "clear_embeds: slots is NULL");
    expect(eng_clear_embeds(e, (uint32_t[]){32}, 1, &st), PIE_INVALID_ARGUMENT, &st,
           "clear_embeds: item 0: slot 32 is out of range [0, 32)");
    cr_assert_eq(eng_clear_pages(e, NULL, 0, &st), PIE_OK, "n 0 does nothing");
    cr_assert_eq(eng_clear_embeds(e, NULL, 0, &st), PIE_OK, "n 0 does nothing");
    eng_close(e);
}

/* What a page or slot held before it was cleared is gone: it reads exactly as one nobody ever
 * wrote (a fresh engine's, whose pools start zeroed). */
Test(eng, cleared_pages_and_slots_read_as_never_written) {
    /* 160 pages: clearing them all (1.25 MiB of K/V in tiny-f32) splits over the threads; two
     * pages are cleared by the caller alone. */
    eng *e = open_model("tiny-f32", 160, 64, 64), *fresh = open_model("tiny-f32", 160, 64, 64);
    uint32_t p[] = {0, 1}, p_rev[] = {1, 0}, all[160], slots[21], x = 30, o = 40, pos = 7;
    bool m[PAGE] = {0};
    m[3] = true;
    pie_status st = {0};
    for (int round = 0; round < 2; round++) {
        prefill(e, p, 2, 20, 0, 20); /* pages 0 and 1, slots 0..19, output slot 20 */
        cr_assert_eq(eng_mask_page(e, 0, m, &st), PIE_OK, "%s", st.msg);
        if (round == 0)
            cr_assert_eq(eng_clear_pages(e, p_rev, 2, &st), PIE_OK, "%s", st.msg);
        else
            cr_assert_eq(eng_clear_pages(e, pie_test_range(all, 0, 160), 160, &st), PIE_OK, "%s",
                         st.msg);
        cr_assert_eq(eng_clear_embeds(e, pie_test_range(slots, 0, 21), 21, &st), PIE_OK, "%s",
                     st.msg);
        for (int k = 0; k < 2; k++) { /* token 20 over the 20-token context the pages "hold" */
            eng *m2 = k ? fresh : e;
            embed_seq(m2, x, 2, 20, 1);
            eng_forward_item rd = pie_test_item(PAGE, p, 20, false, &x, 1, &o, 1);
            pie_test_forward_ok(m2, &rd, 1);
        }
        assert_same(e, o, fresh, o, round ? "pages cleared with the pool" : "pages cleared");
        assert_same(e, 20, fresh, 20, "a cleared embedding slot");
        cr_assert_eq(eng_slot_position(e, 20, &pos, &st), PIE_OK, "%s", st.msg);
        cr_assert_eq(pos, 0, "a cleared slot's position is %u, not 0", pos);
    }
    eng_close(e);
    eng_close(fresh);
}

Test(eng, prefill_then_decode_and_chunked_prefill_equal_one_shot_tiny) {
    prefill_decode_chunked("tiny-f32");
}
Test(eng, prefill_then_decode_and_chunked_prefill_equal_one_shot_small) {
    prefill_decode_chunked("small-f32");
}

Test(eng, outputs_are_the_last_inputs_with_their_positions) {
    eng *e = open_model("tiny-f32", 8, 64, 64);
    uint32_t p[] = {0, 1}, s[32], outs[3] = {40, 41, 42};
    embed_seq(e, 0, 3, 0, 20);
    eng_forward_item it = pie_test_item(PAGE, p, 20, true, pie_test_range(s, 0, 20), 20, outs, 3);
    pie_test_forward_ok(e, &it, 1);
    /* each output equals a one-shot prefill of the prefix that ends at its input */
    for (uint32_t j = 0; j < 3; j++) {
        uint32_t pos;
        pie_status st = {0};
        cr_assert_eq(eng_slot_position(e, outs[j], &pos, &st), PIE_OK);
        cr_assert_eq(pos, 17 + j);
        uint32_t q[] = {2 + j * 2, 3 + j * 2};
        prefill(e, q, 3, 18 + j, 0, 50 + j);
        assert_close(e, outs[j], e, 50 + j, 1e-5, "output of a middle input");
    }
    eng_close(e);
}

Test(eng, items_sharing_context_pages_read_the_same) {
    eng *e = open_model("tiny-f32", 8, 64, 64);
    uint32_t p[] = {0, 1}, i0 = 30, i1 = 31, o0 = 40, o1 = 41, o2 = 42;
    prefill(e, p, 1, 20, 0, UINT32_MAX);
    embed_seq(e, 30, 1, 20, 1);
    embed_seq(e, 31, 1, 20, 1);
    eng_forward_item two[2] = {pie_test_item(PAGE, p, 20, false, &i0, 1, &o0, 1),
                               pie_test_item(PAGE, p, 20, false, &i1, 1, &o1, 1)};
    pie_test_forward_ok(e, two, 2);
    assert_close(e, 40, e, 41, 1e-6, "two items over the same pages");
    /* and the same as the item alone */
    eng_forward_item one = pie_test_item(PAGE, p, 20, false, &i0, 1, &o2, 1);
    pie_test_forward_ok(e, &one, 1);
    assert_close(e, 42, e, 40, 1e-6, "item alone vs in a pair");
    eng_close(e);
}

Test(eng, append_false_leaves_pages_untouched_and_equals_append) {
    eng *e = open_model("tiny-f32", 8, 64, 64), *twin = open_model("tiny-f32", 8, 64, 64);
    uint32_t p[] = {0, 1}, x = 30, y = 31, o = 40, o_rd = 41, o_app = 42;
    for (int k = 0; k < 2; k++) {
        eng *m = k ? twin : e;
        prefill(m, p, 2, 20, 0, UINT32_MAX);
        embed_seq(m, 30, 2, 20, 1);
        embed_seq(m, 31, 2, 21, 1);
    }
    eng_forward_item no_app = pie_test_item(PAGE, p, 20, false, &x, 1, &o, 1);
    pie_test_forward_ok(e, &no_app, 1);
    /* both read token 20 (page 1 offset 4), which only an append could have written */
    for (int k = 0; k < 2; k++) {
        eng_forward_item rd = pie_test_item(PAGE, p, 21, false, &y, 1, &o_rd, 1);
        pie_test_forward_ok(k ? twin : e, &rd, 1);
    }
    assert_same(e, 41, twin, 41, "page read after an append_kv=false forward");
    eng_forward_item app = pie_test_item(PAGE, p, 21, true, &x, 1, &o_app, 1);
    pie_test_forward_ok(e, &app, 1);
    assert_close(e, 42, e, 40, 1e-6, "append_kv true vs false");
    eng_close(e);
    eng_close(twin);
}

Test(eng, page_masks_equal_explicit_masks_and_combine_with_them) {
    eng *e = open_model("tiny-f32", 8, 64, 64);
    uint32_t p[] = {0, 1}, x = 30, o;
    prefill(e, p, 4, 20, 0, UINT32_MAX);
    embed_seq(e, 30, 4, 20, 1);
    bool m[PAGE] = {0};
    pie_status st = {0};

    o = 40; /* no mask */
    eng_forward_item it = pie_test_item(PAGE, p, 20, false, &x, 1, &o, 1);
    pie_test_forward_ok(e, &it, 1);
    m[3] = m[4] = true;
    cr_assert_eq(eng_mask_page(e, 0, m, &st), PIE_OK);
    o = 41; /* page mask hides tokens 3, 4 */
    pie_test_forward_ok(e, &it, 1);
    memset(m, 0, sizeof m);
    cr_assert_eq(eng_mask_page(e, 0, m, &st), PIE_OK);
    uint32_t runs[] = {3, 2, 16};
    o = 42; /* explicit mask hides tokens 3, 4 */
    it.mask_runs = runs, it.n_mask_runs = 3;
    pie_test_forward_ok(e, &it, 1);
    assert_close(e, 41, e, 42, 1e-6, "page mask vs explicit mask");
    float *a = logits_of(e, 40), *b = logits_of(e, 41);
    cr_assert_gt(rel_diff(a, b, 512), 1e-4, "hiding two tokens changed nothing");
    free(a);
    free(b);

    /* AND: page mask hides 3, 4 of page 0 and 2 of page 1 (token 18); runs hide token 10 */
    m[3] = m[4] = true;
    cr_assert_eq(eng_mask_page(e, 0, m, &st), PIE_OK);
    memset(m, 0, sizeof m);
    m[2] = true;
    cr_assert_eq(eng_mask_page(e, 1, m, &st), PIE_OK);
    uint32_t runs10[] = {10, 1, 10};
    it.mask_runs = runs10, it.n_mask_runs = 3, o = 43;
    pie_test_forward_ok(e, &it, 1);
    memset(m, 0, sizeof m);
    cr_assert_eq(eng_mask_page(e, 0, m, &st), PIE_OK);
    cr_assert_eq(eng_mask_page(e, 1, m, &st), PIE_OK);
    uint32_t all[] = {3, 2, 5, 1, 7, 1, 2};
    it.mask_runs = all, it.n_mask_runs = 7, o = 44;
    pie_test_forward_ok(e, &it, 1);
    assert_close(e, 43, e, 44, 1e-6, "page masks AND explicit mask");
    eng_close(e);
}

Test(eng, copied_pages_read_as_their_source) {
    eng *e = open_model("tiny-f32", 8, 64, 64);
    uint32_t p[] = {0, 1}, q[] = {5, 6}, x = 30, o;
    pie_status st = {0};
    prefill(e, p, 5, 20, 0, UINT32_MAX);
    embed_seq(e, 30, 5, 20, 1);
    bool m[PAGE] = {0};
    m[7] = true;
    cr_assert_eq(eng_mask_page(e, 0, m, &st), PIE_OK);
    /* page 0 → 5 whole; page 1's 4 tokens → page 7 offset 9, then within page 7 to offset 0,
     * then page 7 → page 6 (so page 6 got them through two shifted copies) */
    eng_copy_item c[] = {{0, 5, 0, 0, 16}, {1, 7, 0, 9, 4}, {7, 7, 9, 0, 4}, {7, 6, 0, 0, 4}};
    cr_assert_eq(eng_copy_pages(e, c, 4, &st), PIE_OK, "%s", st.msg);
    o = 40;
    eng_forward_item it = pie_test_item(PAGE, p, 20, false, &x, 1, &o, 1);
    pie_test_forward_ok(e, &it, 1);
    o = 41;
    it.kv_pages = q;
    pie_test_forward_ok(e, &it, 1);
    assert_same(e, 41, e, 40, "forward over copied pages (mask copied too)");
    eng_close(e);
}

/* Items of the mixed batch, on an engine prepared by mixed_setup. */
static void mixed_setup(eng *e) {
    uint32_t pb[] = {0, 1}, pc[] = {2};
    prefill(e, pb, 10, 20, 0, UINT32_MAX);
    prefill(e, pc, 11, 9, 0, UINT32_MAX);
    embed_seq(e, 100, 12, 0, 12); /* A: a new 12-token prompt */
    embed_seq(e, 120, 10, 20, 1); /* B: decode after its 20 tokens */
    embed_seq(e, 130, 11, 9, 3);  /* C: three drafted tokens over 9 */
    embed_seq(e, 140, 13, 0, 4);  /* D: no pages */
    embed_seq(e, 150, 10, 20, 1); /* E: reads B's context without appending */
}

Test(eng, mixed_batch_equals_each_item_alone) {
    eng *e = open_model("small-f32", 16, 256, 256), *twin = open_model("small-f32", 16, 256, 256);
    mixed_setup(e);
    mixed_setup(twin);
    uint32_t pa[] = {3}, pb[] = {0, 1}, pc[] = {2}, s[4][16];
    uint32_t oa[] = {200, 201}, ob[] = {202}, oc[] = {203, 204, 205}, od[] = {206}, oe[] = {207};
    /* C: a tree — inputs 1 and 2 both follow input 0: rows [10], [11], [10, 1, 1] */
    uint32_t tree[] = {10, 11, 10, 1, 1};
    eng_forward_item items[5] = {
        pie_test_item(PAGE, pa, 12, true, pie_test_range(s[0], 100, 12), 12, oa, 2),
        pie_test_item(PAGE, pb, 21, true, pie_test_range(s[1], 120, 1), 1, ob, 1),
        pie_test_item(PAGE, pc, 9, false, pie_test_range(s[2], 130, 3), 3, oc, 3),
        pie_test_item(PAGE, NULL, 0, false, pie_test_range(s[3], 140, 4), 4, od, 1),
        pie_test_item(PAGE, pb, 20, false, (uint32_t[]){150}, 1, oe, 1),
    };
    items[2].mask_runs = tree, items[2].n_mask_runs = 5;
    pie_test_forward_ok(e, items, 5);
    for (int i = 0; i < 5; i++) pie_test_forward_ok(twin, &items[i], 1);
    uint32_t outs[] = {200, 201, 202, 203, 204, 205, 206, 207};
    for (int i = 0; i < 8; i++) assert_close(e, outs[i], twin, outs[i], 1e-5, "batched vs alone");
    /* the tree rows 1 and 2 see the same tokens but differ in their own input */
    float *a = logits_of(e, 204), *b = logits_of(e, 205);
    cr_assert_gt(rel_diff(a, b, eng_get_info(e)->vocab_size), 1e-4);
    free(a);
    free(b);
    eng_close(e);
    eng_close(twin);
}

Test(eng, an_item_reads_kv_that_another_item_of_the_batch_writes) {
    eng *e = open_model("tiny-f32", 8, 64, 64), *twin = open_model("tiny-f32", 8, 64, 64);
    uint32_t p[] = {0, 1}, q[] = {0, 1}, a_in = 30, b_in = 31, oa = 40, ob = 41;
    for (int k = 0; k < 2; k++) {
        eng *m = k ? twin : e;
        prefill(m, p, 6, 20, 0, UINT32_MAX);
        embed_seq(m, 30, 6, 20, 2); /* slots 30, 31: tokens 20, 21 */
    }
    /* item 1 (listed first) reads token 20, which item 0 appends in the same batch */
    eng_forward_item batch[2] = {pie_test_item(PAGE, q, 21, false, &b_in, 1, &ob, 1),
                                 pie_test_item(PAGE, p, 21, true, &a_in, 1, &oa, 1)};
    pie_test_forward_ok(e, batch, 2);
    pie_test_forward_ok(twin, &batch[1], 1);
    pie_test_forward_ok(twin, &batch[0], 1);
    assert_close(e, 41, twin, 41, 1e-5, "reader in the writer's batch vs after it");
    assert_close(e, 40, twin, 40, 1e-5, "writer");
    eng_close(e);
    eng_close(twin);
}

Test(eng, explicit_masks_larger_than_the_mask_scratch_are_cut_into_row_chunks) {
    /* 3 items x 1000 rows x 1000 columns of mask = 3 MB > the 2 MiB mask scratch */
    enum { N = 1000, PER = (N + PAGE - 1) / PAGE };
    eng *e = open_model("tiny-f32", 3 * PER, 8 * N, 3 * N);
    uint32_t *runs = malloc(N * sizeof *runs), *pages = malloc(3 * PER * sizeof *pages);
    uint32_t *in = malloc(3 * N * sizeof *in), outs[6] = {6000, 6001, 6002, 6003, 6004, 6005};
    cr_assert(runs && pages && in);
    for (uint32_t i = 0; i < N; i++) runs[i] = i + 1; /* causal, written out */
    for (uint32_t i = 0; i < 3 * PER; i++) pages[i] = i;
    eng_forward_item items[3];
    for (uint32_t k = 0; k < 3; k++) {
        embed_seq(e, k * N, 20 + k, 0, N);
        items[k] = pie_test_item(PAGE, pages + k * PER, N, true,
                                 pie_test_range(in + k * N, k * N, N), N, &outs[k], 1);
        items[k].mask_runs = runs, items[k].n_mask_runs = N;
    }
    pie_test_forward_ok(e, items, 3);
    /* each last output equals its last token run again, unmasked, over the other N - 1 */
    for (uint32_t k = 0; k < 3; k++) {
        eng_forward_item it = items[k];
        it.mask_runs = NULL, it.n_mask_runs = 0;
        it.append_kv = false; /* pages already hold the prompt: read N-1 of them, last as tail */
        it.kv_last_page_len = (N - 2) % PAGE + 1;
        it.n_kv_pages = (N - 1 + PAGE - 1) / PAGE;
        it.in_slots = &in[k * N + N - 1];
        embed_seq(e, k * N + N - 1, 20 + k, N - 1, 1);
        it.n_in = 1;
        it.out_slots = &outs[3 + k];
        pie_test_forward_ok(e, &it, 1);
        assert_close(e, outs[k], e, outs[3 + k], 1e-5, "masked prefill vs unmasked decode");
    }
    free(runs);
    free(pages);
    free(in);
    eng_close(e);
}

/* ---- (3) distributions and dtypes -------------------------------------------------------------
 */

/* order[] ← token ids by descending p, ties by lower id (insertion sort: V is small). */
static void rank_order(const double *p, uint32_t V, uint32_t *order) {
    for (uint32_t i = 0; i < V; i++) {
        uint32_t j = i;
        while (j > 0 && p[order[j - 1]] < p[i]) j--;
        memmove(order + j + 1, order + j, (i - j) * sizeof *order);
        order[j] = i;
    }
}

Test(eng, next_dist_is_the_sorted_top_k_of_the_softmax_of_the_logits) {
    eng *e = open_model("small-f32", 8, 256, 64);
    uint32_t p[] = {0, 1, 2, 3};
    prefill(e, p, 7, 33, 0, 100);
    prefill(e, p + 3, 8, 5, 0, 101);
    uint32_t V = eng_get_info(e)->vocab_size;
    float *lg = logits_of(e, 100);
    double *prob = malloc(V * sizeof *prob);
    uint32_t *order = malloc(V * sizeof *order), *ids = malloc(V * sizeof *ids);
    float *probs = malloc(V * sizeof *probs);
    cr_assert(prob && order && ids && probs);
    struct {
        uint32_t k;
        float t;
    } cases[] = {{1, 1.0f}, {10, 1.0f}, {V, 1.0f}, {20, 0.5f}, {5, 2.5f}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        double mx = -INFINITY, sum = 0;
        for (uint32_t i = 0; i < V; i++) mx = fmax(mx, lg[i] / (double)cases[c].t);
        for (uint32_t i = 0; i < V; i++) sum += prob[i] = exp(lg[i] / (double)cases[c].t - mx);
        for (uint32_t i = 0; i < V; i++) prob[i] /= sum;
        rank_order(prob, V, order);
        eng_dist_item d = {.slot = 100,
                           .top_k = cases[c].k,
                           .temperature = cases[c].t,
                           .ids = ids,
                           .probs = probs};
        pie_status st = {0};
        cr_assert_eq(eng_next_dist(e, &d, 1, &st), PIE_OK, "%s", st.msg);
        double total = 0;
        for (uint32_t j = 0; j < cases[c].k; j++) {
            cr_assert_eq(ids[j], order[j], "k %u T %g: rank %u is id %u, expected %u", cases[c].k,
                         (double)cases[c].t, j, ids[j], order[j]);
            cr_assert(fabs(probs[j] - prob[ids[j]]) <= 1e-6 + 1e-5 * prob[ids[j]],
                      "rank %u: p %.9g, expected %.9g", j, (double)probs[j], prob[ids[j]]);
            if (j > 0) cr_assert_geq(probs[j - 1], probs[j], "not descending at rank %u", j);
            total += probs[j];
        }
        if (cases[c].k == V)
            cr_assert(fabs(total - 1) < 1e-4, "full distribution sums to %.9g", total);
    }
    /* many items in one call (more than one lm_head batch) equal single calls */
    enum { M = 70, K = 6 };
    eng_dist_item many[M];
    uint32_t mids[M][K], one_ids[K];
    float mprobs[M][K], one_probs[K];
    for (int i = 0; i < M; i++)
        many[i] = (eng_dist_item){.slot = 100 + i % 2,
                                  .top_k = K,
                                  .temperature = 0.5f + i % 3,
                                  .ids = mids[i],
                                  .probs = mprobs[i]};
    pie_status st = {0};
    cr_assert_eq(eng_next_dist(e, many, M, &st), PIE_OK, "%s", st.msg);
    for (int i = 0; i < M; i++) {
        eng_dist_item one = many[i];
        one.ids = one_ids, one.probs = one_probs;
        cr_assert_eq(eng_next_dist(e, &one, 1, &st), PIE_OK);
        cr_assert(memcmp(one_ids, mids[i], sizeof one_ids) == 0, "item %d: ids differ", i);
        for (int j = 0; j < K; j++)
            cr_assert(fabsf(one_probs[j] - mprobs[i][j]) <= 1e-6f, "item %d rank %d", i, j);
    }
    free(lg);
    free(prob);
    free(order);
    free(ids);
    free(probs);
    eng_close(e);
}

static void twin_close(const char *twin, double tol) {
    eng *f = open_model("tiny-f32", 8, 64, 64), *h = open_model(twin, 8, 64, 64);
    uint32_t p[] = {0, 1, 2}, o = 50;
    for (int k = 0; k < 2; k++) {
        eng *m = k ? h : f;
        prefill(m, p, 9, 40, 0, 50);
        embed_seq(m, 45, 9, 40, 1);
        uint32_t in = 45;
        eng_forward_item it = pie_test_item(PAGE, p, 41, true, &in, 1, &o, 1);
        pie_test_forward_ok(m, &it, 1);
    }
    assert_close(h, 50, f, 50, tol, twin);
    eng_close(f);
    eng_close(h);
}

/* A bf16 KV pool rounds each K/V value once (relative 2^-9); on small-f32 that moves the logits
 * by ~1e-3 of their range (tests/python/test_forward_reference.py bounds it against the float64
 * reference). Tails are rounded as pages are, so append_kv false still equals true exactly,
 * and a page copy reads as its source. */
Test(eng, a_bf16_kv_pool_stays_close_to_f32_and_keeps_the_equivalences) {
    eng *f = open_model("small-f32", 8, 128, 64),
        *h = open_model_kv("small-f32", 8, 128, 64, ENG_KV_BF16);
    uint32_t p[] = {0, 1, 2, 3}, q[] = {4, 5, 6, 7}, x = 100, o = 110, o_app = 111, o_cp = 112;
    for (int k = 0; k < 2; k++) {
        eng *m = k ? h : f;
        prefill(m, p, 3, 50, 0, UINT32_MAX);
        embed_seq(m, x, 3, 50, 1);
        eng_forward_item no_app = pie_test_item(PAGE, p, 50, false, &x, 1, &o, 1);
        pie_test_forward_ok(m, &no_app, 1);
    }
    float *a = logits_of(h, o), *b = logits_of(f, o);
    uint32_t vocab = eng_get_info(f)->vocab_size;
    double d = rel_diff(a, b, vocab);
    cr_assert(memcmp(a, b, vocab * sizeof *a) != 0, "bf16 KV gave the f32 pool's bits");
    cr_assert(d <= 1e-2, "bf16 KV vs f32 KV: logits differ by %.3g (relative), more than 1e-2", d);
    free(a);
    free(b);
    /* the same input appended (read from its page) and copied to other pages */
    eng_forward_item app = pie_test_item(PAGE, p, 51, true, &x, 1, &o_app, 1);
    pie_test_forward_ok(h, &app, 1);
    assert_same(h, o_app, h, o, "bf16 KV: append_kv true vs false");
    eng_copy_item cp[4];
    for (uint32_t i = 0; i < 4; i++)
        cp[i] =
            (eng_copy_item){.src = p[i], .dst = q[i], .src_off = 0, .dst_off = 0, .count = PAGE};
    pie_status st = {0};
    cr_assert_eq(eng_copy_pages(h, cp, 4, &st), PIE_OK, "%s", st.msg);
    eng_forward_item rd = pie_test_item(PAGE, q, 51, false, &x, 1, &o_cp, 1);
    pie_test_forward_ok(h, &rd, 1);
    eng_forward_item rd_p = pie_test_item(PAGE, p, 51, false, &x, 1, &o, 1);
    pie_test_forward_ok(h, &rd_p, 1);
    assert_same(h, o_cp, h, o, "bf16 KV: copied pages vs their source");
    eng_close(f);
    eng_close(h);
}

Test(eng, bf16_and_f16_twins_stay_close_to_f32) {
    twin_close("tiny-bf16", 2e-2);
    twin_close("tiny-f16", 5e-3);
}

/* ---- (4) pie-engine-probe ----------------------------------------------------------------------
 */

/* Runs the probe on script (a JSON text); returns its parsed stdout and exit status. */
static json_t *run_probe(const char *args, const char *script, int *status) {
    char in_path[] = "/tmp/pie-test-eng-XXXXXX";
    int fd = mkstemp(in_path);
    cr_assert_geq(fd, 0);
    size_t n = strlen(script);
    cr_assert_eq(write(fd, script, n), (ssize_t)n);
    cr_assert_eq(close(fd), 0);
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "%s/pie-engine-probe %s < %s 2>/dev/null", PIE_BIN_DIR, args,
             in_path);
    FILE *f = popen(cmd, "r");
    cr_assert_not_null(f);
    json_error_t err;
    json_t *doc = json_loadf(f, JSON_DISABLE_EOF_CHECK, &err);
    int rc = pclose(f);
    *status = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
    unlink(in_path);
    return doc;
}

Test(eng, probe_follows_its_protocol_and_matches_the_engine) {
    char dir[512], args[700];
    model_path(dir, sizeof dir, "tiny-f32");
    snprintf(args, sizeof args, "--model %s --page-size 16 --pages 8 --slots 64 --threads %d", dir,
             THREADS);
    const char *script =
        "{\"ops\": ["
        "{\"op\": \"embed\", \"slots\": [0, 1, 2, 3, 4], \"tokens\": [5, 6, 7, 8, 9],"
        " \"positions\": [0, 1, 2, 3, 4]},"
        "{\"op\": \"forward\", \"items\": [{\"kv_pages\": [0], \"kv_last_page_len\": 5,"
        " \"append_kv\": true, \"in_slots\": [0, 1, 2, 3, 4], \"out_slots\": [20]}]},"
        "{\"op\": \"logits\", \"slot\": 20},"
        "{\"op\": \"next_dist\", \"slot\": 20, \"top_k\": 3, \"temperature\": 0.5},"
        "{\"op\": \"forward\", \"items\": [{\"kv_pages\": [0], \"kv_last_page_len\": 17,"
        " \"append_kv\": false, \"in_slots\": [1], \"out_slots\": []}]},"
        "{\"op\": \"mask_page\", \"page\": 0, \"masked\": [true]},"
        "{\"op\": \"nope\"},"
        "{\"op\": \"greedy\", \"tokens\": [11, 12, 13], \"steps\": 6, \"pages\": [3],"
        " \"slot_base\": 30}"
        "]}";
    int status;
    json_t *doc = run_probe(args, script, &status);
    cr_assert_eq(status, 0);
    cr_assert_not_null(doc, "probe printed no JSON");
    json_t *info = json_object_get(doc, "info"), *res = json_object_get(doc, "results");
    cr_assert_eq(json_integer_value(json_object_get(info, "vocab_size")), 512);
    cr_assert_eq(json_integer_value(json_object_get(info, "kv_pages")), 8);
    cr_assert_str_eq(json_string_value(json_object_get(info, "dtype")), "f32");
    cr_assert_eq(json_array_size(res), 8);

    /* the same operations in this process */
    eng *e = open_model("tiny-f32", 8, 64, 4096);
    uint32_t p0[] = {0}, p3[] = {3}, s[8], o = 20;
    uint32_t toks[] = {5, 6, 7, 8, 9}, pos[] = {0, 1, 2, 3, 4};
    pie_status st = {0};
    cr_assert_eq(eng_embed_text(e, pie_test_range(s, 0, 5), toks, pos, 5, &st), PIE_OK);
    eng_forward_item it = pie_test_item(PAGE, p0, 5, true, s, 5, &o, 1);
    pie_test_forward_ok(e, &it, 1);
    float *lg = logits_of(e, 20);
    json_t *jl = json_object_get(json_array_get(res, 2), "logits");
    cr_assert_eq(json_array_size(jl), 512);
    for (size_t i = 0; i < 512; i++)
        cr_assert_eq((float)json_real_value(json_array_get(jl, i)), lg[i],
                     "logit %zu: probe %.9g, engine %.9g", i,
                     json_real_value(json_array_get(jl, i)), (double)lg[i]);
    uint32_t ids[3];
    float probs[3];
    eng_dist_item d = {.slot = 20, .top_k = 3, .temperature = 0.5f, .ids = ids, .probs = probs};
    cr_assert_eq(eng_next_dist(e, &d, 1, &st), PIE_OK);
    json_t *jd = json_array_get(res, 3);
    for (size_t j = 0; j < 3; j++) {
        cr_assert_eq(json_integer_value(json_array_get(json_object_get(jd, "ids"), j)), ids[j]);
        cr_assert_eq((float)json_real_value(json_array_get(json_object_get(jd, "probs"), j)),
                     probs[j]);
    }
    struct {
        size_t op;
        const char *msg;
    } errs[] = {
        {4, "forward: item 0: kv_last_page_len 17 is out of range [1, 16]"},
        {5, "mask_page: masked has 1 entries, expected kv_page_size 16"},
        {6, "ops[6]: unknown op \"nope\""},
    };
    for (size_t i = 0; i < 3; i++) {
        json_t *r = json_array_get(res, errs[i].op);
        cr_assert_str_eq(json_string_value(json_object_get(r, "error")), errs[i].msg);
        cr_assert_eq(json_integer_value(json_object_get(r, "code")), PIE_INVALID_ARGUMENT);
    }
    cr_assert_eq(json_object_size(json_array_get(res, 0)), 0);
    cr_assert_eq(json_object_size(json_array_get(res, 1)), 0);

    /* greedy: prefill [11, 12, 13] into page 3 then argmax decodes */
    uint32_t gt[] = {11, 12, 13}, gs[] = {30, 31, 32}, gp[] = {0, 1, 2}, out = 32;
    cr_assert_eq(eng_embed_text(e, gs, gt, gp, 3, &st), PIE_OK);
    eng_forward_item g = pie_test_item(PAGE, p3, 3, true, gs, 3, &out, 1);
    json_t *jg = json_object_get(json_array_get(res, 7), "tokens");
    cr_assert_eq(json_array_size(jg), 6);
    for (uint32_t step = 0; step < 6; step++) {
        pie_test_forward_ok(e, &g, 1);
        float *l = logits_of(e, 32);
        uint32_t best = 0;
        for (uint32_t v = 1; v < 512; v++)
            if (l[v] > l[best]) best = v;
        free(l);
        cr_assert_eq(json_integer_value(json_array_get(jg, step)), best, "greedy step %u", step);
        uint32_t next_pos = 3 + step;
        cr_assert_eq(eng_embed_text(e, gs, &best, &next_pos, 1, &st), PIE_OK);
        g = pie_test_item(PAGE, p3, 4 + step, true, gs, 1, &out, 1);
    }
    free(lg);
    json_decref(doc);
    eng_close(e);

    /* exit status: 2 for usage errors, 1 when the engine cannot be opened */
    doc = run_probe("--pages 8", "{\"ops\": []}", &status);
    cr_assert_eq(status, 2);
    json_decref(doc);
    doc = run_probe("--model /nonexistent/pie-model", "{\"ops\": []}", &status);
    cr_assert_eq(status, 1);
    json_decref(doc);
    snprintf(args, sizeof args, "--model %s", dir);
    doc = run_probe(args, "not json", &status);
    cr_assert_eq(status, 2);
    json_decref(doc);
}
