/* test_eng_cuda_swap.c — the swap policy on the cuda backend (issue 13; eng_cuda.h's
 * eng_cuda_swap_*, engine/eng_cuda_swap.c): the device holds the KV of `slots` of the model's
 * layers, the pinned host pool the others, and two copy streams move whole layers while the
 * forward computes.
 *
 * The promise tested: swapping changes where bytes are, never what is computed. The same
 * workloads run on a cuda engine without swapping (policy gpu; graphs off, as swap runs them)
 * and on engines with 2 and 3 of small-bf16's layers on the device; every output's logits must
 * be BIT-identical, and the engine must have swapped (layers seen on the host, bytes moved both
 * ways, every step). Why a broken swap fails: every layer holds different K/V, and with fewer
 * slots than layers each layer leaves the device and comes back every step — a move that read
 * before the kernels wrote (a missing wait on the layer's event) or a layer handed another's
 * buffer changes the logits; `a_move_that_copies_nothing_is_caught` shows that the comparison
 * sees it. Fault cases: a failing move fails the forward that needed the layer with the
 * move's message, and the next forward runs. Skips visibly where there is no CUDA device. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_test.h"
#include "eng.h"
#include "eng_cuda.h"
#include "cuda_kc.h"
#include "kcheck.h"

#include <cuda_runtime_api.h>

#define PAGE 16
enum { SEQS = 5, CTX = 40, STEPS = 3, PER = (CTX + STEPS + PAGE - 1) / PAGE };
enum { FORK_CTX = 2 * PAGE + 5 };
enum { OUTS = SEQS + 2 }; /* the sequences, the fork, a read of the last page id */

typedef struct swap_setup {
    uint32_t slots; /* 0: policy gpu */
    uint32_t min;   /* swap_min_slots (0: slots): fewer is adaptive expansion */
    uint32_t pages_x; /* the page space, times the workload's (0: 1) */
    pie_code (*copy)(void *user, void *dst, const void *src, size_t bytes, pie_status *st);
    void *copy_user;
} swap_setup;

static eng_cuda *open_swap(const swap_setup *s, pie_status *st) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/small-bf16", PIE_MODELS_DIR);
    eng_opts o = {.model_dir = dir,
                  .backend = ENG_BACKEND_CUDA,
                  .kv_page_size = PAGE,
                  .kv_pages = (SEQS * PER + 8) * (s->pages_x ? s->pages_x : 1),
                  .embed_slots = CTX + 2 * SEQS + 8,
                  .max_batch_tokens = CTX,
                  .swap_slots = s->slots,
                  .swap_min_slots = s->min ? s->min : s->slots,
                  .swap_host_bytes = 256u << 20,
                  .swap_copy = s->copy,
                  .swap_copy_user = s->copy_user};
    eng_cuda *g = NULL;
    pie_code rc = eng_cuda_open(&o, &g, st);
    if (rc == PIE_OK) eng_cuda_set_graphs(g, false); /* swap never replays graphs */
    return rc == PIE_OK ? g : NULL;
}

static eng_cuda *open_ok(const swap_setup *s) {
    pie_status st = {0};
    eng_cuda *g = open_swap(s, &st);
    cr_assert_not_null(g, "eng_cuda_open with %u slots: %s", s->slots, st.msg);
    return g;
}


/* kcheck's decode scenario (SEQS sequences, prefill then STEPS decode steps of all of them),
 * then a fork: sequence 0's first FORK_CTX tokens copied into fresh pages (a page copy of two
 * whole pages and a partial one, after clear_pages of the destination), one token decoded on
 * the fork. With `far`: first a clear of the last page id (the worker clears every page it is
 * given), last an item that reads it without appending (never written: zero K/V) — on a device
 * committed as it is used, far past the committed range unless the engine raised it first;
 * without, that output row is zero. logits ← [OUTS][vocab] (malloc'ed). Sequence 0 lives in
 * pages 0-2. */
static float *run_workload(eng_cuda *g, uint32_t *vocab, bool far) {
    kc_engine k = kc_engine_gpu(g);
    *vocab = k.vocab;
    float *l = calloc((size_t)OUTS * k.vocab, sizeof(float));
    cr_assert_not_null(l);
    char why[512];
    pie_status st = {0};
    uint32_t last = eng_cuda_get_info(g)->kv_pages - 1;
    if (far) cr_assert_eq(eng_cuda_clear_pages(g, &last, 1, &st), PIE_OK, "%s", st.msg);
    cr_assert(kc_eng_decode_scenario(&k, SEQS, CTX, STEPS, l, why, sizeof why), "%s", why);
    uint32_t fork[3] = {SEQS * PER, SEQS * PER + 1, SEQS * PER + 2};
    uint32_t in = CTX + 2 * SEQS, out = in + 1, tok = 7;
    cuda_kc_fork_decode(g, fork, PAGE, FORK_CTX, in, l + (size_t)SEQS * k.vocab);
    if (!far) return l;
    uint32_t pos_read = PAGE;
    cr_assert_eq(eng_cuda_embed_text(g, &in, &tok, &pos_read, 1, &st), PIE_OK, "%s", st.msg);
    eng_forward_item read = {.kv_pages = &last,
                             .n_kv_pages = 1,
                             .kv_last_page_len = PAGE,
                             .append_kv = false,
                             .in_slots = &in,
                             .n_in = 1,
                             .out_slots = &out,
                             .n_out = 1};
    cr_assert_eq(eng_cuda_forward(g, &read, 1, &st), PIE_OK, "reading page %u: %s", last, st.msg);
    cr_assert_eq(eng_cuda_logits(g, out, l + (size_t)(SEQS + 1) * k.vocab, &st), PIE_OK, "%s",
                 st.msg);
    return l;
}

static float *gpu_reference(uint32_t *vocab, bool far) {
    swap_setup none = {0};
    eng_cuda *g = open_ok(&none);
    float *l = run_workload(g, vocab, far);
    eng_cuda_close(g);
    return l;
}

Test(eng_cuda_swap, outputs_are_bitwise_those_of_policy_gpu_with_2_and_3_layers_on_the_device) {
    CUDA_TEST_REQUIRE_DEVICE();
    uint32_t vocab;
    float *want = gpu_reference(&vocab, true);
    for (uint32_t slots = 2; slots <= 3; slots++) {
        swap_setup s = {.slots = slots};
        eng_cuda *g = open_ok(&s);
        const eng_info *in = eng_cuda_get_info(g);
        cr_assert_lt(slots, in->n_layers, "small-bf16 must have more layers than slots");
        float *got = run_workload(g, &vocab, true);
        eng_cuda_swap_quiesce(g);
        eng_swap_stats ss;
        eng_cuda_swap_get_stats(g, &ss);
        cr_assert_eq(ss.slots, slots);
        cr_assert_leq(ss.on_device, slots);
        cr_assert_geq(ss.on_host, in->n_layers - slots);
        /* every forward brings every host layer in: prefill SEQS + STEPS + the fork's */
        cr_assert_geq(ss.swaps_in, (uint64_t)(in->n_layers - slots) * (SEQS + STEPS + 1),
                      "%u slots: %llu moves in", slots, (unsigned long long)ss.swaps_in);
        cr_assert_gt(ss.swap_out_bytes, 0);
        cr_assert_eq(ss.copy_failures, 0);
        char what[64], why[256];
        snprintf(what, sizeof what, "swap with %u slots vs gpu", slots);
        cr_assert(kc_eng_bitwise(got, want, OUTS * vocab, what, why, sizeof why), "%s",
                  why);
        uint32_t applied = 0;
        pie_status st = {0};
        cr_assert_eq(eng_cuda_swap_set_slots(g, in->n_layers, &applied, &st), PIE_OK, "%s",
                     st.msg);
        cr_assert_eq(applied, slots, "the device region holds %u layers, not more", slots);
        free(got);
        eng_cuda_close(g);
    }
    free(want);
}

/* Adaptive expansion: a device budget of 2 layer caches of a page space 200 times what the
 * workload uses (swap_min_slots 2, every layer on the device at start; 4600 pages of 4 KiB a
 * layer: 18 MiB, committed in 2 MiB pieces). While so few page ids are in use every layer
 * fits: nothing moves. Asked for 2 layers, the others leave
 * and come back every step. Both bit for bit policy gpu. */
Test(eng_cuda_swap, adaptive_expansion_commits_the_budget_as_pages_are_used) {
    CUDA_TEST_REQUIRE_DEVICE();
    uint32_t vocab;
    float *want = gpu_reference(&vocab, false);
    for (int shrink = 0; shrink <= 1; shrink++) {
        swap_setup s = {.slots = 4, .min = 2, .pages_x = 200};
        eng_cuda *g = open_ok(&s);
        const eng_info *in = eng_cuda_get_info(g);
        cr_assert_eq(in->n_layers, 4, "the test is sized for small-bf16's 4 layers");
        pie_status st = {0};
        uint32_t applied = 0;
        if (shrink) {
            cr_assert_eq(eng_cuda_swap_set_slots(g, 2, &applied, &st), PIE_OK, "%s", st.msg);
            cr_assert_eq(applied, 2);
        }
        float *got = run_workload(g, &vocab, false);
        eng_cuda_swap_quiesce(g);
        eng_swap_stats ss;
        eng_cuda_swap_get_stats(g, &ss);
        cr_assert_eq(ss.copy_failures, 0);
        if (shrink) {
            cr_assert_leq(ss.on_device, 2);
            cr_assert_geq(ss.swaps_in, 2u * (SEQS + STEPS + 1), "%llu moves in",
                          (unsigned long long)ss.swaps_in);
            cr_assert_eq(eng_cuda_swap_set_slots(g, 4, &applied, &st), PIE_OK, "%s", st.msg);
            cr_assert_eq(applied, 4, "few pages in use: every layer fits");
        } else {
            cr_assert_eq(ss.on_device, 4);
            cr_assert_eq(ss.swaps_in + ss.swaps_out, 0, "every layer fit the budget");
        }
        char what[64], why[256];
        snprintf(what, sizeof what, "adaptive swap (%s) vs gpu", shrink ? "2 layers" : "4");
        cr_assert(kc_eng_bitwise(got, want, OUTS * vocab, what, why, sizeof why), "%s",
                  why);
        free(got);
        eng_cuda_close(g);
    }
    free(want);
}

/* A clear and a read of the last page id on the adaptive engine of the test above: far past
 * the committed range, so the engine raises the prefix (device memory for it) first. No fault,
 * outputs bit for bit policy gpu's, and the budget now holds its 2 full layers only. */
Test(eng_cuda_swap, pages_far_past_the_committed_range_are_committed_before_use) {
    CUDA_TEST_REQUIRE_DEVICE();
    uint32_t vocab;
    float *want = gpu_reference(&vocab, true);
    swap_setup s = {.slots = 4, .min = 2, .pages_x = 200};
    eng_cuda *g = open_ok(&s);
    float *got = run_workload(g, &vocab, true);
    char why[256];
    cr_assert(kc_eng_bitwise(got, want, OUTS * vocab, "far pages vs gpu", why, sizeof why), "%s",
              why);
    pie_status st = {0};
    uint32_t applied = 0;
    cr_assert_eq(eng_cuda_swap_set_slots(g, 4, &applied, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(applied, 2, "the whole page space in use: the budget holds 2 layers");
    free(got);
    free(want);
    eng_cuda_close(g);
}

/* A move that reports success but copies nothing: the comparison above must see it. */
static pie_code copy_nothing(void *user, void *dst, const void *src, size_t bytes,
                             pie_status *st) {
    (void)user, (void)dst, (void)src, (void)bytes, (void)st;
    return PIE_OK;
}

Test(eng_cuda_swap, a_move_that_copies_nothing_is_caught) {
    CUDA_TEST_REQUIRE_DEVICE();
    uint32_t vocab;
    float *want = gpu_reference(&vocab, true);
    swap_setup s = {.slots = 2, .copy = copy_nothing};
    eng_cuda *g = open_ok(&s);
    float *got = run_workload(g, &vocab, true);
    char why[256];
    cr_assert_not(kc_eng_bitwise(got, want, OUTS * vocab, "a skipped move", why, sizeof why),
                  "outputs equal although no layer was moved: the test cannot see a broken swap");
    free(got);
    free(want);
    eng_cuda_close(g);
}

/* The real copy until `fail_at` (1-based), then failures while `failing`. */
typedef struct fail_plan {
    int calls, fail_at;
    bool failing;
} fail_plan;

static pie_code copy_failing(void *user, void *dst, const void *src, size_t bytes,
                             pie_status *st) {
    fail_plan *p = user;
    if (++p->calls >= p->fail_at && p->failing)
        return pie_status_set(st, PIE_INTERNAL, "injected copy failure %d", p->calls);
    cudaError_t err = cudaMemcpy(dst, src, bytes, cudaMemcpyDefault);
    if (err != cudaSuccess)
        return pie_status_set(st, PIE_INTERNAL, "cudaMemcpy: %s", cudaGetErrorString(err));
    return PIE_OK;
}

Test(eng_cuda_swap, a_failed_move_fails_its_forward_with_the_reason_and_the_next_one_runs) {
    CUDA_TEST_REQUIRE_DEVICE();
    fail_plan plan = {.fail_at = 1000000, .failing = true};
    swap_setup s = {.slots = 2, .copy = copy_failing, .copy_user = &plan};
    eng_cuda *g = open_ok(&s);
    eng_cuda_swap_quiesce(g);
    plan.fail_at = plan.calls + 1; /* the next move fails */
    kc_engine k = kc_engine_gpu(g);
    pie_status st = {0};
    uint32_t pages[PER], slots[CTX];
    for (uint32_t i = 0; i < PER; i++) pages[i] = i;
    for (uint32_t i = 0; i < CTX; i++) slots[i] = i;
    uint32_t tokens[CTX], pos[CTX];
    for (uint32_t i = 0; i < CTX; i++) tokens[i] = (i * 7 + 3) % k.vocab, pos[i] = i;
    cr_assert_eq(eng_cuda_embed_text(g, slots, tokens, pos, CTX, &st), PIE_OK, "%s", st.msg);
    eng_forward_item it = {.kv_pages = pages,
                           .n_kv_pages = (CTX + PAGE - 1) / PAGE,
                           .kv_last_page_len = CTX - (CTX - 1) / PAGE * PAGE,
                           .append_kv = true,
                           .in_slots = slots,
                           .n_in = CTX};
    pie_code rc = eng_cuda_forward(g, &it, 1, &st);
    cr_assert_eq(rc, PIE_INTERNAL, "a forward whose layer could not move: %s", st.msg);
    cr_assert(strstr(st.msg, "swap: moving layer") && strstr(st.msg, "injected copy failure"),
              "%s", st.msg);
    plan.failing = false;
    eng_cuda_swap_quiesce(g);
    cr_assert_eq(eng_cuda_forward(g, &it, 1, &st), PIE_OK, "the next forward: %s", st.msg);
    eng_swap_stats ss;
    eng_cuda_swap_get_stats(g, &ss);
    cr_assert_geq(ss.copy_failures, 1);
    eng_cuda_close(g);
}

Test(eng_cuda_swap, a_host_pool_too_small_fails_the_open_saying_what_it_needs) {
    CUDA_TEST_REQUIRE_DEVICE();
    char dir[512];
    snprintf(dir, sizeof dir, "%s/small-bf16", PIE_MODELS_DIR);
    eng_opts o = {.model_dir = dir,
                  .backend = ENG_BACKEND_CUDA,
                  .kv_page_size = PAGE,
                  .kv_pages = 16,
                  .embed_slots = 16,
                  .max_batch_tokens = 16,
                  .swap_slots = 2,
                  .swap_host_bytes = 1};
    eng_cuda *g = NULL;
    pie_status st = {0};
    cr_assert_eq(eng_cuda_open(&o, &g, &st), PIE_RESOURCE_EXHAUSTED, "%s", st.msg);
    cr_assert(strstr(st.msg, "swap: the host pool holds 0 layer caches"), "%s", st.msg);
    cr_assert_null(g);
}
