/* pie_testutil.h — small helpers shared by the C tests: leak checking and time.
 *
 * Owns: pie_test_leak_check (a Criterion suite's .fini under AddressSanitizer: LeakSanitizer
 * alone only prints from Criterion's worker process and the test would still pass, so a leak
 * here aborts), and millisecond clock/sleep helpers for polling loops. */
#ifndef PIE_TESTUTIL_H
#define PIE_TESTUTIL_H

#include <stdint.h>

/* Aborts (failing the test) when LeakSanitizer finds a leak; a no-op without ASan. */
void pie_test_leak_check(void);

int64_t pie_test_now_ms(void); /* CLOCK_MONOTONIC, milliseconds */
void pie_test_sleep_ms(int ms);

#endif
