/* eng_mask.c — pie.v1.AttentionMask run lists: validation and row decoding; page masks.
 *
 * Owns: the functions of eng_mask.h. The format is documented there and in
 * proto/pie/v1/common.proto; every reading of it in the engine goes through the first three
 * functions, every host update of a page mask through the last three. */
#include "eng_mask.h"

#include <string.h>

pie_code eng_mask_check(const uint32_t *runs, uint32_t n_runs, uint32_t ctx, uint32_t n_rows,
                        const char *prefix, pie_status *st) {
    uint32_t cur = 0;
    for (uint32_t i = 0; i < n_rows; i++) {
        uint64_t len = (uint64_t)ctx + i + 1, covered = 0;
        int visible = 1, last_visible = 1;
        while (covered < len) {
            if (cur == n_runs)
                return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                      "%s: mask runs end in row %u (%llu of its %llu tokens "
                                      "covered)",
                                      prefix, i, (unsigned long long)covered,
                                      (unsigned long long)len);
            uint32_t r = runs[cur];
            if (covered + r > len)
                return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                      "%s: mask run %u (length %u) crosses the end of row %u "
                                      "(%llu tokens)",
                                      prefix, cur, r, i, (unsigned long long)len);
            covered += r;
            last_visible = visible;
            visible = !visible;
            cur++;
        }
        if (!last_visible)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "%s: mask row %u hides its own token (the last of its %llu)",
                                  prefix, i, (unsigned long long)len);
    }
    if (cur != n_runs)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "%s: mask has %u runs left over after row %u", prefix, n_runs - cur,
                              n_rows ? n_rows - 1 : 0);
    return PIE_OK;
}

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
