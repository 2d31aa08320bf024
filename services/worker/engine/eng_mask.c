/* eng_mask.c — pie.v1.AttentionMask run lists: row decoding; page masks.
 *
 * Owns: the functions of eng_mask.h. The format is documented there and in
 * proto/pie/v1/common.proto; its validation is pie_check_mask (services/common), every
 * decoding of a checked mask in the engine goes through the first two functions, every host
 * update of a page mask through the last three. */
#include "eng_mask.h"

#include <string.h>

void eng_mask_row(const uint32_t *runs, uint32_t *cursor, uint32_t len, uint32_t cols,
                  uint8_t *out) {
    uint32_t j = 0, cur = *cursor;
    uint8_t visible = 1;
    while (j < len) {
        uint32_t r = runs[cur++];
        memset(out + j, visible, r);
        j += r;
        visible ^= 1;
    }
    memset(out + len, 0, cols - len);
    *cursor = cur;
}

void eng_mask_skip_row(const uint32_t *runs, uint32_t *cursor, uint32_t len) {
    uint32_t j = 0, cur = *cursor;
    while (j < len) j += runs[cur++];
    *cursor = cur;
}

uint32_t eng_mask_page_set(uint8_t *m, const bool *masked, uint32_t ps) {
    uint32_t count = 0;
    for (uint32_t o = 0; o < ps; o++) {
        m[o] = masked[o] ? 1 : 0;
        count += m[o];
    }
    return count;
}

void eng_mask_page_copy(uint8_t *page_mask, uint32_t *n_masked, uint32_t ps,
                        const eng_copy_item *c) {
    uint8_t *dm = page_mask + (size_t)c->dst * ps;
    const uint8_t *sm = page_mask + (size_t)c->src * ps;
    uint32_t count = n_masked[c->dst];
    for (uint32_t t = 0; t < c->count; t++) {
        count -= dm[c->dst_off + t];
        dm[c->dst_off + t] = sm[c->src_off + t];
        count += dm[c->dst_off + t];
    }
    n_masked[c->dst] = count;
}

bool eng_mask_ctx_masked(const uint32_t *n_masked, uint32_t ps, const uint32_t *kv_pages,
                         uint32_t ctx) {
    for (uint32_t j = 0; j * ps < ctx; j++)
        if (n_masked[kv_pages[j]] > 0) return true;
    return false;
}
