/* test_eng_cuda_offload.c — CPU attention offload on the cuda backend (issue 13; eng_cuda.h's
 * eng_cuda_offload_*, engine/eng_cuda_off.c): every page has its home in the pinned host pool,
 * the device holds offload_device_pages of them, and decodes sent to the host attend there
 * with the cpu kernels.
 *
 * The promise tested: where a page is and where its attention runs change the rounding of
 * attention only. The workload of test_eng_cuda_swap.c (5 sequences prefilled and decoded
 * 3 steps, a fork by page copies, one decode on it) runs on policy gpu and under offload with
 * a pick callback deciding each decode's side; the logits must agree within OFF_TOL (the two
 * attention kernels sum in different orders; the bf16 output rounding turns that into a few
 * bf16 ulps at most) while the sequences' own logits differ by far more than OFF_TOL (so a
 * decode that attended over the wrong pages, or missed a token, fails). The engine must have
 * done what the case is about: decodes on the host, pages moved, pages evicted to make room.
 * The mask scenario checks the device's page masks, which offload indexes by slot. Skips
 * visibly where there is no CUDA device. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_kc.h"
#include "cuda_test.h"
#include "eng.h"
#include "eng_cuda.h"
#include "kcheck.h"

#define PAGE 16
enum { SEQS = 5, CTX = 40, STEPS = 3, PER = (CTX + STEPS + PAGE - 1) / PAGE };
enum { FORK_CTX = 2 * PAGE + 5, OUTS = SEQS + 1, PAGES = SEQS * PER + 8 };
#define OFF_TOL 1e-2

typedef enum { PICK_NONE, PICK_ALL, PICK_ALTERNATE } pick_mode;

typedef struct picker {
    pick_mode mode;
    uint32_t asked, sent;
} picker;

static bool pick(void *user, uint32_t item, const eng_forward_item *it) {
    (void)it;
    picker *p = user;
    p->asked++;
    bool host = p->mode == PICK_ALL || (p->mode == PICK_ALTERNATE && (p->asked + item) % 2);
    p->sent += host;
    return host;
}

/* device_pages 0: policy gpu. */
static eng_cuda *open_off(uint32_t device_pages, picker *p, pie_status *st) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/small-bf16", PIE_MODELS_DIR);
    eng_opts o = {.model_dir = dir,
                  .backend = ENG_BACKEND_CUDA,
                  .kv_page_size = PAGE,
                  .kv_pages = PAGES,
                  .embed_slots = CTX + 2 * SEQS + 16,
                  .max_batch_tokens = 48, /* the mask scenario needs 48 */
                  .offload_device_pages = device_pages,
                  .offload_host_threads = 2,
                  .offload_pick = device_pages ? pick : NULL,
                  .offload_pick_user = p};
    eng_cuda *g = NULL;
    pie_code rc = eng_cuda_open(&o, &g, st);
    return rc == PIE_OK ? g : NULL;
}

static eng_cuda *open_ok(uint32_t device_pages, picker *p) {
    pie_status st = {0};
    eng_cuda *g = open_off(device_pages, p, &st);
    cr_assert_not_null(g, "eng_cuda_open with %u device pages: %s", device_pages, st.msg);
    return g;
}

/* kcheck's decode scenario, then sequence 0's first FORK_CTX tokens copied into fresh pages
 * and one token decoded on the fork. logits ← [OUTS][vocab] (malloc'ed). */
static float *run_workload(eng_cuda *g, uint32_t *vocab) {
    kc_engine k = kc_engine_gpu(g);
    *vocab = k.vocab;
    float *l = calloc((size_t)OUTS * k.vocab, sizeof(float));
    cr_assert_not_null(l);
    char why[512];
    cr_assert(kc_eng_decode_scenario(&k, SEQS, CTX, STEPS, l, why, sizeof why), "%s", why);
    uint32_t fork[3] = {SEQS * PER, SEQS * PER + 1, SEQS * PER + 2};
    cuda_kc_fork_decode(g, fork, PAGE, FORK_CTX, CTX + 2 * SEQS, l + (size_t)SEQS * k.vocab);
    return l;
}

/* After run_workload: one forward of two items — a 4-token prefill of a new sequence (page
 * SEQS * PER + 3) and one more decode of sequence 0 — whose outputs' logits go to l[2][vocab].
 * Under offload with every eligible item picked, the decode is sub-batch 1 and the prefill
 * sub-batch 0 of the same step. */
static void run_mixed(eng_cuda *g, uint32_t vocab, float *l) {
    pie_status st = {0};
    uint32_t page = SEQS * PER + 3, seq0[PER], base = CTX + 2 * SEQS + 2;
    for (uint32_t i = 0; i < PER; i++) seq0[i] = i;
    cr_assert_eq(eng_cuda_clear_pages(g, &page, 1, &st), PIE_OK, "%s", st.msg);
    uint32_t slots[5] = {base, base + 1, base + 2, base + 3, base + 4};
    uint32_t toks[5] = {11, 12, 13, 14, 9}, pos[5] = {0, 1, 2, 3, CTX + STEPS};
    cr_assert_eq(eng_cuda_embed_text(g, slots, toks, pos, 5, &st), PIE_OK, "%s", st.msg);
    uint32_t outs[2] = {base + 5, base + 6};
    eng_forward_item it[2] = {{.kv_pages = &page,
                               .n_kv_pages = 1,
                               .kv_last_page_len = 4,
                               .append_kv = true,
                               .in_slots = slots,
                               .n_in = 4,
                               .out_slots = &outs[0],
                               .n_out = 1},
                              {.kv_pages = seq0,
                               .n_kv_pages = PER,
                               .kv_last_page_len = CTX + STEPS + 1 - (PER - 1) * PAGE,
                               .append_kv = true,
                               .in_slots = &slots[4],
                               .n_in = 1,
                               .out_slots = &outs[1],
                               .n_out = 1}};
    cr_assert_eq(eng_cuda_forward(g, it, 2, &st), PIE_OK, "%s", st.msg);
    for (int o = 0; o < 2; o++)
        cr_assert_eq(eng_cuda_logits(g, outs[o], l + (size_t)o * vocab, &st), PIE_OK, "%s", st.msg);
}

static float *gpu_reference(uint32_t *vocab) {
    eng_cuda *g = open_ok(0, NULL);
    float *l = run_workload(g, vocab);
    eng_cuda_close(g);
    /* the tolerance can see a wrong context: two sequences' logits differ by far more */
    char why[256];
    cr_assert_not(
        kc_eng_agree(l, l + *vocab, *vocab, 5 * OFF_TOL, "sequence 0 vs 1", why, sizeof why),
        "the workload's sequences are too alike for the tolerance to mean anything");
    return l;
}

static void expect_agree(const float *got, const float *want, uint32_t vocab, const char *what) {
    char why[256];
    for (uint32_t o = 0; o < OUTS; o++) {
        char w[96];
        snprintf(w, sizeof w, "%s, output %u", what, o);
        cr_assert(kc_eng_agree(got + (size_t)o * vocab, want + (size_t)o * vocab, vocab, OFF_TOL, w,
                               why, sizeof why),
                  "%s", why);
    }
}

Test(eng_cuda_offload, decodes_on_the_host_agree_with_policy_gpu) {
    CUDA_TEST_REQUIRE_DEVICE();
    uint32_t vocab;
    float *want = gpu_reference(&vocab);
    picker p = {.mode = PICK_ALL};
    eng_cuda *g = open_ok(PAGES, &p);
    float *got = run_workload(g, &vocab);
    eng_offload_stats os;
    eng_cuda_offload_get_stats(g, &os);
    cr_assert_geq(os.host_items, SEQS * STEPS + 1, "%llu decodes on the host",
                  (unsigned long long)os.host_items);
    cr_assert_gt(os.pages_to_host, 0);
    cr_assert_gt(os.host_attn_ns, 0);
    cr_assert_gt(os.lin_tok, 0, "the profile ran");
    cr_assert_gt(os.hattn_kv, 0);
    expect_agree(got, want, vocab, "every decode on the host");
    free(got);
    eng_cuda_close(g);
    free(want);
}

/* Decodes alternate sides step by step: pages go home and come back (fetched) between steps. */
Test(eng_cuda_offload, pages_moving_both_ways_every_step_agree_with_policy_gpu) {
    CUDA_TEST_REQUIRE_DEVICE();
    uint32_t vocab;
    float *want = gpu_reference(&vocab);
    picker p = {.mode = PICK_ALTERNATE};
    eng_cuda *g = open_ok(PAGES, &p);
    float *got = run_workload(g, &vocab);
    eng_offload_stats os;
    eng_cuda_offload_get_stats(g, &os);
    cr_assert_gt(os.pages_to_host, 0);
    cr_assert_gt(os.pages_to_device, 0, "no page came back to the device");
    cr_assert_gt(os.host_items, 0);
    cr_assert_lt(os.host_items, p.asked, "some decodes stayed on the device");
    expect_agree(got, want, vocab, "decodes alternating sides");
    free(got);
    eng_cuda_close(g);
    free(want);
}

/* A device of one sequence's pages: each prefill evicts the one before (spilled home), every
 * decode attends on the host, the fork's pages are written on the device from the homes. */
Test(eng_cuda_offload, a_device_of_one_sequence_evicts_to_make_room_and_agrees) {
    CUDA_TEST_REQUIRE_DEVICE();
    uint32_t vocab;
    float *want = gpu_reference(&vocab);
    picker p = {.mode = PICK_ALL};
    eng_cuda *g = open_ok(PER, &p);
    float *got = run_workload(g, &vocab);
    eng_offload_stats os;
    eng_cuda_offload_get_stats(g, &os);
    cr_assert_geq(os.pages_to_host, (SEQS - 1) * PER, "%llu pages left the device",
                  (unsigned long long)os.pages_to_host);
    cr_assert_leq(os.pages_on_device, PER);
    expect_agree(got, want, vocab, "a device of 3 pages");
    free(got);
    eng_cuda_close(g);
    free(want);
}

Test(eng_cuda_offload, a_step_needing_more_device_pages_than_there_are_fails_and_the_next_runs) {
    CUDA_TEST_REQUIRE_DEVICE();
    picker p = {.mode = PICK_NONE};
    eng_cuda *g = open_ok(2, &p);
    kc_engine k = kc_engine_gpu(g);
    pie_status st = {0};
    uint32_t pages[PER], slots[CTX], tokens[CTX], pos[CTX];
    for (uint32_t i = 0; i < PER; i++) pages[i] = i;
    for (uint32_t i = 0; i < CTX; i++) slots[i] = i, tokens[i] = (i * 7 + 3) % k.vocab, pos[i] = i;
    cr_assert_eq(eng_cuda_embed_text(g, slots, tokens, pos, CTX, &st), PIE_OK, "%s", st.msg);
    eng_forward_item it = {.kv_pages = pages,
                           .n_kv_pages = PER,
                           .kv_last_page_len = CTX - (PER - 1) * PAGE,
                           .append_kv = true,
                           .in_slots = slots,
                           .n_in = CTX};
    cr_assert_eq(eng_cuda_forward(g, &it, 1, &st), PIE_RESOURCE_EXHAUSTED, "%s", st.msg);
    cr_assert(strstr(st.msg, "more than the device's 2 KV pages"), "%s", st.msg);
    it.n_kv_pages = 2, it.n_in = 2 * PAGE, it.kv_last_page_len = PAGE;
    cr_assert_eq(eng_cuda_forward(g, &it, 1, &st), PIE_OK, "the next forward: %s", st.msg);
    eng_cuda_close(g);
}

/* Page masks live on the device by slot under offload: the mask scenario (explicit masks, page
 * masks, masks cleared again; no item there may attend on the host) gives policy gpu's bits. */
Test(eng_cuda_offload, masks_agree_with_policy_gpu) {
    CUDA_TEST_REQUIRE_DEVICE();
    char why[512];
    eng_cuda *ref = open_ok(0, NULL);
    kc_engine kr = kc_engine_gpu(ref);
    float *want = calloc((size_t)KC_MASK_CASES * kr.vocab, sizeof(float));
    float *got = calloc((size_t)KC_MASK_CASES * kr.vocab, sizeof(float));
    cr_assert(want && got);
    cr_assert(kc_eng_mask_scenario(&kr, want, why, sizeof why), "%s", why);
    eng_cuda_close(ref);
    picker p = {.mode = PICK_ALL};
    eng_cuda *g = open_ok(PAGES, &p); /* pages 0-2 take the last slots (wrk_kvslots) */
    kc_engine k = kc_engine_gpu(g);
    cr_assert(kc_eng_mask_scenario(&k, got, why, sizeof why), "%s", why);
    /* the same kernels over the same K/V and masks at other addresses: the same bits */
    cr_assert(
        kc_eng_bitwise(got, want, KC_MASK_CASES * k.vocab, "masks under offload", why, sizeof why),
        "%s", why);
    free(want);
    free(got);
    eng_cuda_close(g);
}

Test(eng_cuda_offload, the_open_refuses_what_offload_cannot_run) {
    CUDA_TEST_REQUIRE_DEVICE();
    char dir[512];
    snprintf(dir, sizeof dir, "%s/small-bf16", PIE_MODELS_DIR);
    eng_opts o = {.model_dir = dir,
                  .backend = ENG_BACKEND_CUDA,
                  .kv_page_size = PAGE,
                  .kv_pages = 16,
                  .embed_slots = 16,
                  .max_batch_tokens = 16,
                  .offload_device_pages = 17};
    eng_cuda *g = NULL;
    pie_status st = {0};
    cr_assert_eq(eng_cuda_open(&o, &g, &st), PIE_INVALID_ARGUMENT, "%s", st.msg);
    cr_assert(strstr(st.msg, "offload_device_pages 17 exceeds kv_pages 16"), "%s", st.msg);
    o.offload_device_pages = 8;
    o.swap_slots = 2;
    cr_assert_eq(eng_cuda_open(&o, &g, &st), PIE_INVALID_ARGUMENT, "%s", st.msg);
    cr_assert(strstr(st.msg, "exclude each other"), "%s", st.msg);
    cr_assert_null(g);
}

/* A prefill on the device and a decode on the host in one step: the two sub-batches. */
Test(eng_cuda_offload, a_step_with_both_sub_batches_agrees_with_policy_gpu) {
    CUDA_TEST_REQUIRE_DEVICE();
    uint32_t vocab;
    eng_cuda *ref = open_ok(0, NULL);
    float *w = run_workload(ref, &vocab);
    float *want = calloc(2 * (size_t)vocab, sizeof(float));
    cr_assert_not_null(want);
    run_mixed(ref, vocab, want);
    eng_cuda_close(ref);
    picker p = {.mode = PICK_ALL};
    eng_cuda *g = open_ok(PAGES, &p);
    float *l = run_workload(g, &vocab);
    float *got = calloc(2 * (size_t)vocab, sizeof(float));
    cr_assert_not_null(got);
    run_mixed(g, vocab, got);
    eng_offload_stats os;
    eng_cuda_offload_get_stats(g, &os);
    cr_assert_eq(os.last_host_items, 1, "the decode on the host, the prefill on the device");
    char why[256];
    const char *what[2] = {"the prefill (sub-batch 0)", "the decode (sub-batch 1)"};
    for (int o = 0; o < 2; o++)
        cr_assert(kc_eng_agree(got + (size_t)o * vocab, want + (size_t)o * vocab, vocab, OFF_TOL,
                               what[o], why, sizeof why),
                  "%s", why);
    free(w);
    free(l);
    free(want);
    free(got);
    eng_cuda_close(g);
}
