/* eng_mask.h — pie.v1.AttentionMask run lists: row decoding; the host copy of the per-token
 * page masks (engine-internal).
 *
 * Owns: decoding the run-length mask format of proto/pie/v1/common.proto (validated before by
 * pie_check_mask, services/common/pie_check.h, whose rules every layer shares). Row i of an
 * item with C context tokens covers the first C + i + 1 tokens of its sequence; a row's runs
 * alternate visible, masked, ... starting visible; a row ends exactly when its runs sum to its
 * length (so a zero-length run after that belongs to the next row). Invalid: a run crossing the
 * end of a row, a row whose last token (the input itself) is masked, runs missing before the
 * last row ends, runs left over after it.
 * Page masks (mask_page): [kv_pages * page_size] bytes, 1 = masked, and a masked-token count
 * per page so that pages without masked tokens cost nothing; both backends keep them on the
 * host with these functions (cuda mirrors them on the device).
 * Does not own: combining masks with causality (the backends' attention). */
#ifndef ENG_MASK_H
#define ENG_MASK_H

#include <stdbool.h>
#include <stdint.h>

#include "eng.h"
#include "pie_status.h"

/* Decodes the row of `len` tokens that starts at runs[*cursor] (a checked mask) into
 * out[0, len) as 1 = visible / 0 = masked, and zeroes out[len, cols); advances *cursor past
 * the row's runs. */
void eng_mask_row(const uint32_t *runs, uint32_t *cursor, uint32_t len, uint32_t cols,
                  uint8_t *out);

/* Advances *cursor past the row of `len` tokens that starts there, writing nothing. */
void eng_mask_skip_row(const uint32_t *runs, uint32_t *cursor, uint32_t len);

/* Sets the page mask m[ps] from masked[ps]; returns how many tokens it masks. */
uint32_t eng_mask_page_set(uint8_t *m, const bool *masked, uint32_t ps);

/* Copies the mask bytes of copy item c (checked) within page_mask, keeping n_masked[c->dst]. */
void eng_mask_page_copy(uint8_t *page_mask, uint32_t *n_masked, uint32_t ps,
                        const eng_copy_item *c);

/* Whether a page mask hides any of the first ctx tokens of kv_pages. */
bool eng_mask_ctx_masked(const uint32_t *n_masked, uint32_t ps, const uint32_t *kv_pages,
                         uint32_t ctx);

#endif
