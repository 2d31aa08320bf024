/* pie_testutil.h — small helpers shared by the C tests: leak checking, time, waiting for a
 * lifecycle replica to know a model.
 *
 * Owns: pie_test_leak_check (a Criterion suite's .fini under AddressSanitizer: LeakSanitizer
 * alone only prints from Criterion's worker process and the test would still pass, so a leak
 * here aborts), millisecond clock/sleep helpers for polling loops, pie_test_wait_models, and
 * distinct variants of one wasm module (pie_test_wasm_variant). */
#ifndef PIE_TESTUTIL_H
#define PIE_TESTUTIL_H

#include <stddef.h>
#include <stdint.h>

#include "rpc.h"

/* Aborts (failing the test) when LeakSanitizer finds a leak; a no-op without ASan. */
void pie_test_leak_check(void);

int64_t pie_test_now_ms(void); /* CLOCK_MONOTONIC, milliseconds */
void pie_test_sleep_ms(int ms);

/* Polls pie.v1.Lifecycle/ListModels on ch until the replica lists a model (its Session has
 * delivered the model list: launches before that fail with UNAVAILABLE) or timeout_ms passed.
 * Returns the number of models, 0 if none in time. */
size_t pie_test_wait_models(rpc_channel *ch, int64_t timeout_ms);

/* Bytes pie_test_wasm_variant adds to a module. */
#define PIE_TEST_WASM_VARIANT_EXTRA 11
/* wasm[0, len) with a custom section numbering it appended: a distinct program (another
 * SHA-256) that runs as the original, len + PIE_TEST_WASM_VARIANT_EXTRA bytes, malloc'd (the
 * caller frees it); NULL when out of memory. */
uint8_t *pie_test_wasm_variant(const uint8_t *wasm, size_t len, int number);

#endif
