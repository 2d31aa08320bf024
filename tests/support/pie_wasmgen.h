/* pie_wasmgen.h — hostile wasm modules written byte by byte, for the tests of the lifecycle's
 * compile limits (issue 11, hole 5: compile bombs).
 *
 * Owns: one generator of valid WebAssembly 1.0 modules whose size and shape a test chooses:
 * how many functions, how deeply the first function nests blocks, how long its body is. Does
 * not own: what the runtime does with them (each test asserts that). */
#ifndef PIE_WASMGEN_H
#define PIE_WASMGEN_H

#include <stddef.h>
#include <stdint.h>

typedef struct pie_wasmgen_opts {
    uint32_t n_funcs; /* functions of type () -> (), function 0 exported as `_start`; 0 = 1 */
    uint32_t nest;    /* function 0 opens this many nested `block`s, then closes them */
    uint32_t pad;     /* nops in function 0 (its body is about pad + 2 * nest + 4 bytes) */
    uint32_t salt;    /* an i32.const in function 0: different salts, different modules */
} pie_wasmgen_opts;

/* The module's bytes (malloc'd; the caller frees them), *len its length; NULL when out of
 * memory. No imports: it loads into any runtime, and _start returns at once. */
uint8_t *pie_wasmgen(const pie_wasmgen_opts *o, size_t *len);

#endif
