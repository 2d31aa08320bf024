/* cuda_kc.h — the cuda engine behind tests/kcheck's scenarios (kc_engine), for the tests of
 * tests/cuda that run them. */
#ifndef CUDA_KC_H
#define CUDA_KC_H

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

#endif
