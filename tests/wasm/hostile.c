/* hostile.c — fixture: an inferlet that misbehaves in the way argv[1] names. Each mode must end
 * only this instance, with the trap or error the test expects. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Not tail-recursive and not a reduction clang can turn into a loop: one native frame per call. */
__attribute__((noinline)) static unsigned recurse(unsigned n) {
    if (n == 0xffffffffu) return 1;
    return recurse(n + 1) * 3u + n;
}

static char *volatile sink;

/* Deterministic busy work: N steps of a 64-bit LCG. */
__attribute__((noinline)) static uint64_t work(uint64_t n) {
    uint64_t x = 1;
    for (uint64_t i = 0; i < n; i++) x = x * 6364136223846793005ull + 1442695040888963407ull;
    return x;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "";
    if (strcmp(mode, "oob-read") == 0) {
        volatile uint32_t *p = (volatile uint32_t *)(uintptr_t)0xfffffff0u;
        printf("read %u\n", (unsigned)*p);
    } else if (strcmp(mode, "oob-write") == 0) {
        uintptr_t end = __builtin_wasm_memory_size(0) * 65536u;
        *(volatile uint32_t *)(end + 16) = 1;
        printf("wrote past the end\n");
    } else if (strcmp(mode, "div0") == 0) {
        volatile int zero = 0, hundred = 100; /* 1 / x would become a select, not a division */
        printf("%d\n", hundred / zero);
    } else if (strcmp(mode, "overflow") == 0) {
        volatile int min = INT32_MIN, minus1 = -1;
        printf("%d\n", min / minus1);
    } else if (strcmp(mode, "convert") == 0) {
        volatile float nan = NAN; /* C's (int) cast is lowered to a guarded, non-trapping form */
        printf("%d\n", __builtin_wasm_trunc_s_i32_f32(nan));
    } else if (strcmp(mode, "unreachable") == 0) {
        __builtin_trap();
    } else if (strcmp(mode, "indirect") == 0) {
        void (*volatile fn)(void) = 0;
        fn();
    } else if (strcmp(mode, "loop") == 0) {
        volatile unsigned long n = 0;
        for (;;) n++;
    } else if (strcmp(mode, "recurse") == 0) {
        printf("%u\n", recurse((unsigned)argc));
    } else if (strcmp(mode, "grow") == 0) {
        long r = __builtin_wasm_memory_grow(0, argc > 2 ? atol(argv[2]) : 1000);
        printf("grow=%ld\n", r);
    } else if (strcmp(mode, "storm") == 0) {
        size_t mib = 0;
        for (;;) {
            char *p = malloc(1u << 20);
            if (p == NULL) {
                fprintf(stderr, "malloc failed after %zu MiB\n", mib);
                abort();
            }
            memset(p, 1, 1u << 20);
            sink = p; /* escapes, so the allocation cannot be optimised away */
            mib++;
        }
    } else if (strcmp(mode, "exit") == 0) {
        exit(argc > 2 ? atoi(argv[2]) : 7);
    } else if (strcmp(mode, "hold") == 0) {
        /* hold N MS: grow by N pages, touch them, say how it went, then keep them MS ms */
        long r = __builtin_wasm_memory_grow(0, argc > 2 ? atol(argv[2]) : 1);
        if (r >= 0)
            for (long i = 0; i < (argc > 2 ? atol(argv[2]) : 1); i++)
                ((volatile char *)(uintptr_t)((r + i) * 65536))[0] = 1;
        printf("grow=%ld\n", r);
        fflush(stdout);
        long ms = argc > 3 ? atol(argv[3]) : 60000;
        struct timespec ts = {ms / 1000, (ms % 1000) * 1000000};
        nanosleep(&ts, NULL);
    } else if (strcmp(mode, "sleep") == 0) {
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
        printf("slept\n");
    } else if (strcmp(mode, "work") == 0) {
        printf("work=%llu\n", (unsigned long long)work(argc > 2 ? strtoull(argv[2], 0, 10) : 1000));
    } else {
        fprintf(stderr, "unknown mode %s\n", mode);
        return 2;
    }
    return 0;
}
