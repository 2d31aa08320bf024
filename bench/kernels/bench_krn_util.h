/* bench_krn_util.h — what the kernel benches (bench_krn.c, bench_krn_batch.c) share: aligned
 * buffers that end the run when memory runs out, and the generator their data comes from.
 *
 * Header-only (static inline) because every bench is one .c file that bench/CMakeLists.txt
 * builds on its own; each bench gets its own generator state, seeded alike, so a bench's data
 * do not depend on which other bench exists. */
#ifndef BENCH_KRN_UTIL_H
#define BENCH_KRN_UTIL_H

#include <errno.h> /* program_invocation_short_name (_GNU_SOURCE, set for every target) */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* n bytes aligned to a cache line (64: the kernels' vector loads want it); exits with a message
 * naming the bench when there is no memory, since a bench cannot go on without its buffers. */
static inline void *bench_krn_alloc(size_t n) {
    void *p = NULL;
    if (posix_memalign(&p, 64, n ? n : 64) != 0) {
        fprintf(stderr, "%s: out of memory (%zu bytes)\n", program_invocation_short_name, n);
        exit(1);
    }
    return p;
}

static uint64_t bench_krn_rng_state = 88172645463325252ull; /* one per bench (single thread) */

/* The next of a fixed xorshift64 sequence as a float in [-1, 1): the same data every run. */
static inline float bench_krn_frand(void) {
    bench_krn_rng_state ^= bench_krn_rng_state << 13;
    bench_krn_rng_state ^= bench_krn_rng_state >> 7;
    bench_krn_rng_state ^= bench_krn_rng_state << 17;
    return (float)((double)(bench_krn_rng_state >> 11) / 4503599627370496.0 - 1.0);
}

#endif
