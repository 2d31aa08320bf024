/* cuda_kc.h — the cuda engine behind tests/kcheck's scenarios (kc_engine), for the tests of
 * tests/cuda that run them. */
#ifndef CUDA_KC_H
#define CUDA_KC_H

#include <criterion/criterion.h>

#include "eng_cuda.h"
#include "kcheck.h"

static inline pie_code cuda_kc_embed(void *ctx, const uint32_t *slots, const uint32_t *tokens,
                                     const uint32_t *positions, uint32_t n, pie_status *st) {
    return eng_cuda_embed_text(ctx, slots, tokens, positions, n, st);
}
static inline pie_code cuda_kc_forward(void *ctx, const eng_forward_item *items, uint32_t n,
                                       pie_status *st) {
    return eng_cuda_forward(ctx, items, n, st);
}
static inline pie_code cuda_kc_mask_page(void *ctx, uint32_t page, const bool *masked,
                                         pie_status *st) {
    return eng_cuda_mask_page(ctx, page, masked, st);
}
static inline pie_code cuda_kc_logits(void *ctx, uint32_t slot, float *logits, pie_status *st) {
    return eng_cuda_logits(ctx, slot, logits, st);
}

static inline kc_engine kc_engine_gpu(eng_cuda *e) {
    const eng_info *in = eng_cuda_get_info(e);
    return (kc_engine){.ctx = e,
                       .embed_text = cuda_kc_embed,
                       .forward = cuda_kc_forward,
                       .mask_page = cuda_kc_mask_page,
                       .logits = cuda_kc_logits,
                       .vocab = in->vocab_size,
                       .page_size = in->kv_page_size};
}

/* A fork after the decode scenario: the first fork_ctx tokens of the sequence in pages 0-2
 * (page_size tokens a page, fork_ctx in (2, 3] pages) copied into the cleared pages fork[3] —
 * two whole pages and a partial one —, then one token (7, slot `in`) decoded on the fork into
 * slot in + 1, whose logits go to logits[vocab]. Asserts every call succeeds. */
static inline void cuda_kc_fork_decode(eng_cuda *g, const uint32_t fork[3], uint32_t page_size,
                                       uint32_t fork_ctx, uint32_t in, float *logits) {
    pie_status st = {0};
    cr_assert_eq(eng_cuda_clear_pages(g, fork, 3, &st), PIE_OK, "%s", st.msg);
    eng_copy_item cp[2] = {{.src = 0, .dst = fork[0], .count = page_size},
                           {.src = 1, .dst = fork[1], .count = page_size}};
    eng_copy_item tail = {.src = 2, .dst = fork[2], .count = fork_ctx - 2 * page_size};
    cr_assert_eq(eng_cuda_copy_pages(g, cp, 2, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(eng_cuda_copy_pages(g, &tail, 1, &st), PIE_OK, "%s", st.msg);
    uint32_t out = in + 1, tok = 7, pos = fork_ctx;
    cr_assert_eq(eng_cuda_embed_text(g, &in, &tok, &pos, 1, &st), PIE_OK, "%s", st.msg);
    eng_forward_item it = {.kv_pages = fork,
                           .n_kv_pages = 3,
                           .kv_last_page_len = fork_ctx + 1 - 2 * page_size,
                           .append_kv = true,
                           .in_slots = &in,
                           .n_in = 1,
                           .out_slots = &out,
                           .n_out = 1};
    cr_assert_eq(eng_cuda_forward(g, &it, 1, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(eng_cuda_logits(g, out, logits, &st), PIE_OK, "%s", st.msg);
}

#endif
