/* pie_testranks.h — running one function as N forked "rank" processes (the tensor-parallel
 * tests: tests/unit/test_wrk_coll.c, tests/unit/test_eng_tp.c).
 *
 * Owns: forking the ranks, a name for their shared segment that no other test shares,
 * collecting their exit statuses, and a hash the ranks report results by. A rank reports failure by
 * returning non-zero after writing what differed to stderr (Criterion's asserts belong to the test
 * process, not to its children); the parent asserts on the statuses. */
#ifndef PIE_TESTRANKS_H
#define PIE_TESTRANKS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <unistd.h>

#define PIE_TESTRANKS_MAX 16

/* What a rank runs: rank of n_ranks, the group's segment name, the caller's argument. 0 =
 * passed. */
typedef int (*pie_testranks_fn)(uint32_t rank, uint32_t n_ranks, const char *name, void *arg);

#define PIE_TESTRANKS_NAME_MAX 64

/* The segment name the next pie_testranks_run of this process gives its group (a test that
 * plants something under it first). */
void pie_testranks_next_name(char *buf, size_t cap);

/* Forks n_ranks children that each run fn and exit with its result (a signal counts as a
 * failure); waits for all. status[r] (n_ranks of them) gets each child's exit code, or 128 +
 * the signal that ended it. Returns the number of ranks whose status is not 0; -1 when fork
 * fails. */
int pie_testranks_run(uint32_t n_ranks, pie_testranks_fn fn, void *arg, int *status);

/* pie_testranks_run in a Criterion test: asserts that the fork worked and expects every rank
 * to exit 0 (a failure names the rank; its stderr says why). */
void pie_testranks_expect_ok(uint32_t n_ranks, pie_testranks_fn fn, void *arg);

/* FNV-1a of bytes[0, n): how ranks leave a result for the test process to compare. */
uint64_t pie_testranks_hash(const void *bytes, size_t n);

/* Inside a rank: when cond is false, prints the rank and the message and returns 1. */
#define PIE_RANK_CHECK(rank, cond, ...)                     \
    do {                                                    \
        if (!(cond)) {                                      \
            fprintf(stderr, "rank %u: ", (unsigned)(rank)); \
            fprintf(stderr, __VA_ARGS__);                   \
            fprintf(stderr, "\n");                          \
            return 1;                                       \
        }                                                   \
    } while (0)

#endif
