/* pie_testutil.c — see pie_testutil.h. */
#include "pie_testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif

void pie_test_leak_check(void) {
#if defined(__SANITIZE_ADDRESS__)
    if (__lsan_do_recoverable_leak_check() != 0) {
        fprintf(stderr, "memory leaked: see the LeakSanitizer report above\n");
        abort();
    }
#endif
}

int64_t pie_test_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void pie_test_sleep_ms(int ms) {
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}
