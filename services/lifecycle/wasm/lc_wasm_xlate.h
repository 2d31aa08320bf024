/* lc_wasm_xlate.h — the in-process wasm → C translator of tier 0 (lc_wasm_xlate.c).
 *
 * lc_wasm_xlate validates a module completely (for the features it accepts) and writes one C
 * translation unit that tcc compiles into a library with the lc_wasm glue entry points
 * (<cname>_lc_instance_size, _lc_init_module, _lc_instantiate, _lc_start, _lc_free) and the
 * wasm-rt.h / host-function ABI that wasm2c 1.0.32's code uses. A module it does not accept is
 * "declined" (PIE_UNIMPLEMENTED: a feature it does not translate) or "invalid"
 * (PIE_INVALID_ARGUMENT: its validator's reason); either way the caller falls back to wasm2c,
 * which gives the authoritative message. */
#ifndef LC_WASM_XLATE_H
#define LC_WASM_XLATE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pie_status.h"

typedef struct lc_wasm_xlate_out {
    char *c; /* the C text (malloc'd; free it), NUL-terminated */
    size_t len;
    uint32_t n_funcs; /* functions defined by the module */
} lc_wasm_xlate_out;

/* Validates wasm (n bytes) and translates it into C whose entry points are named after cname.
 * PIE_OK: out filled. PIE_UNIMPLEMENTED: declined (st->msg says which feature).
 * PIE_INVALID_ARGUMENT: invalid (st->msg says why). PIE_RESOURCE_EXHAUSTED: out of memory. */
pie_code lc_wasm_xlate(const uint8_t *wasm, size_t n, const char *cname, lc_wasm_xlate_out *out,
                       pie_status *st);

/* Where lc_wasm_xlate_to sends the C text while it is made, so that a compiler reading it can
 * work at the same time: write takes the next n bytes (in order; every call has n > 0) and
 * returns false to stop the translation, which then fails with the status write left in st. */
typedef struct lc_wasm_xlate_sink {
    bool (*write)(void *user, const char *text, size_t n, pie_status *st);
    void *user;
} lc_wasm_xlate_sink;

/* lc_wasm_xlate, the text going to sink in pieces of about LC_WASM_XLATE_PIECE bytes (a
 * function's text is never split) instead of into one buffer; *n_funcs (unless NULL) as
 * out->n_funcs. On a
 * failure sink has already taken part of the text: its reader must discard what it got. */
#define LC_WASM_XLATE_PIECE (32u << 10)
pie_code lc_wasm_xlate_to(const uint8_t *wasm, size_t n, const char *cname,
                          const lc_wasm_xlate_sink *sink, uint32_t *n_funcs, pie_status *st);

#endif
