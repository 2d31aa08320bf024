/* wrk_backend.c — see wrk_backend.h. */
#include "wrk_backend.h"

/* ---- the engine ------------------------------------------------------------------------------ */

static pie_code engine_embed_text(void *ctx, const uint32_t *slots, const uint32_t *tokens,
                                  const uint32_t *positions, uint32_t n, pie_status *st) {
    return eng_embed_text(ctx, slots, tokens, positions, n, st);
}

static pie_code engine_forward(void *ctx, const eng_forward_item *items, uint32_t n,
                               pie_status *st) {
    return eng_forward(ctx, items, n, st);
}

static pie_code engine_mask_page(void *ctx, uint32_t page, const bool *masked, pie_status *st) {
    return eng_mask_page(ctx, page, masked, st);
}

static pie_code engine_copy_pages(void *ctx, const eng_copy_item *items, uint32_t n,
                                  pie_status *st) {
    return eng_copy_pages(ctx, items, n, st);
}

static pie_code engine_next_dist(void *ctx, eng_dist_item *items, uint32_t n, pie_status *st) {
    return eng_next_dist(ctx, items, n, st);
}

void wrk_backend_engine(wrk_backend *b, eng *e) {
    *b = (wrk_backend){
        .name = "cpu",
        .ctx = e,
        .embed_text = engine_embed_text,
        .forward = engine_forward,
        .mask_page = engine_mask_page,
        .copy_pages = engine_copy_pages,
        .next_dist = engine_next_dist,
    };
}

/* ---- null: well-formed results, no work ------------------------------------------------------ */

static pie_code null_embed_text(void *ctx, const uint32_t *slots, const uint32_t *tokens,
                                const uint32_t *positions, uint32_t n, pie_status *st) {
    (void)ctx, (void)slots, (void)tokens, (void)positions, (void)n, (void)st;
    return PIE_OK;
}

static pie_code null_forward(void *ctx, const eng_forward_item *items, uint32_t n, pie_status *st) {
    (void)ctx, (void)items, (void)n, (void)st;
    return PIE_OK;
}

static pie_code null_mask_page(void *ctx, uint32_t page, const bool *masked, pie_status *st) {
    (void)ctx, (void)page, (void)masked, (void)st;
    return PIE_OK;
}

static pie_code null_copy_pages(void *ctx, const eng_copy_item *items, uint32_t n, pie_status *st) {
    (void)ctx, (void)items, (void)n, (void)st;
    return PIE_OK;
}

/* Token i gets (k - i) / (k (k + 1)): strictly descending, summing to 1/2 (the probabilities of
 * a full softmax are not renormalised over the k kept, so a sum below 1 is well-formed). */
static pie_code null_next_dist(void *ctx, eng_dist_item *items, uint32_t n, pie_status *st) {
    (void)ctx, (void)st;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t k = items[i].top_k;
        float norm = (float)k * (float)(k + 1);
        for (uint32_t j = 0; j < k; j++) {
            items[i].ids[j] = j;
            items[i].probs[j] = (float)(k - j) / norm;
        }
    }
    return PIE_OK;
}

void wrk_backend_null(wrk_backend *b) {
    *b = (wrk_backend){
        .name = "null",
        .ctx = NULL,
        .embed_text = null_embed_text,
        .forward = null_forward,
        .mask_page = null_mask_page,
        .copy_pages = null_copy_pages,
        .next_dist = null_next_dist,
    };
}
