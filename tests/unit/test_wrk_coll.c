/* test_wrk_coll.c — services/worker/tp/wrk_coll: the host collective between forked rank
 * processes (2, 3 and 4 of them; 1 in-process).
 *
 * Results are checked exactly where the arithmetic is exact (sums of small integers as
 * floats, gathered and broadcast bytes), against a serial sum with a tolerance for random data
 * (plus: every rank gets the same bits), over many iterations, sizes around the one-barrier
 * threshold and the step size, odd lengths, and mixed operations that exercise the alternating
 * buffers. Failures: a rank that exits, a rank that never arrives, mismatched group shapes, bad
 * options. No assertion is on a time.
 * No test sets Criterion's .timeout: its watchdog now and then leaks an allocation in the runner
 * under LeakSanitizer; ctest's TIMEOUT bounds a hang, and every wait of the collective has its
 * own deadline. */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <stdbool.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "pie_testranks.h"
#include "wrk_coll.h"

#define CHUNK (256u << 10) /* bytes per step in these tests: large messages take several */

static wrk_coll *open_rank(uint32_t rank, uint32_t n, const char *name, uint32_t timeout_ms) {
    wrk_coll_opts o = {.name = name,
                       .epoch = 7,
                       .rank = rank,
                       .n_ranks = n,
                       .chunk_bytes = CHUNK,
                       .timeout_ms = timeout_ms};
    pie_status st = {0};
    wrk_coll *c = NULL;
    if (wrk_coll_open(&o, &c, &st) != PIE_OK) {
        fprintf(stderr, "rank %u: wrk_coll_open: %s\n", rank, st.msg);
        return NULL;
    }
    return c;
}

/* A deterministic pseudo-random float in [-1, 1) of (rank, iteration, index). */
static float rnd(uint32_t rank, uint32_t iter, size_t j) {
    uint64_t x = (uint64_t)rank * 0x9E3779B97F4A7C15ull ^ (uint64_t)iter * 0xBF58476D1CE4E5B9ull ^
                 (uint64_t)j * 0x94D049BB133111EBull;
    x ^= x >> 31;
    x *= 0xD6E9F8CC1ull;
    x ^= x >> 29;
    return (float)((double)(x & 0xFFFFFF) / (double)0x800000 - 1.0);
}

/* Sizes (floats): tiny, odd, just below/above the one-barrier threshold, above one step. */
static const size_t SIZES[] = {1,
                               3,
                               17,
                               1000,
                               WRK_COLL_DIRECT_BYTES / 4,
                               WRK_COLL_DIRECT_BYTES / 4 + 1,
                               CHUNK / 4 + 5,
                               3 * CHUNK / 4 + 7};
#define N_SIZES (sizeof SIZES / sizeof SIZES[0])

/* ---- all-reduce ---------------------------------------------------------------------------- */

static int rank_sum_integers(uint32_t rank, uint32_t n, const char *name, void *arg) {
    (void)arg;
    wrk_coll *c = open_rank(rank, n, name, 20000);
    PIE_RANK_CHECK(rank, c, "open failed");
    float *buf = malloc(SIZES[N_SIZES - 1] * sizeof(float));
    PIE_RANK_CHECK(rank, buf, "out of memory");
    pie_status st = {0};
    for (size_t s = 0; s < N_SIZES; s++) {
        size_t len = SIZES[s];
        uint32_t iters = len <= 1000 ? 200 : 6;
        for (uint32_t it = 0; it < iters; it++) {
            for (size_t j = 0; j < len; j++) buf[j] = (float)((rank + 1) * (j % 1000) + it);
            PIE_RANK_CHECK(rank, wrk_coll_allreduce_sum_f32(c, buf, len, &st) == PIE_OK,
                           "all-reduce of %zu floats, iteration %u: %s", len, it, st.msg);
            float tri = (float)(n * (n + 1) / 2);
            for (size_t j = 0; j < len; j++) {
                float want = tri * (float)(j % 1000) + (float)(n * it);
                PIE_RANK_CHECK(rank, buf[j] == want,
                               "all-reduce of %zu floats, iteration %u: [%zu] = %.1f, want %.1f",
                               len, it, j, buf[j], want);
            }
        }
    }
    free(buf);
    wrk_coll_close(c);
    return 0;
}

Test(wrk_coll, allreduce_of_integers_is_exact_with_2_and_4_ranks) {
    pie_testranks_expect_ok(2, rank_sum_integers, NULL);
    pie_testranks_expect_ok(4, rank_sum_integers, NULL);
}

Test(wrk_coll, allreduce_with_3_ranks_splits_uneven_slices) {
    pie_testranks_expect_ok(3, rank_sum_integers, NULL);
}

static int rank_sum_random(uint32_t rank, uint32_t n, const char *name, void *arg) {
    (void)arg;
    wrk_coll *c = open_rank(rank, n, name, 20000);
    PIE_RANK_CHECK(rank, c, "open failed");
    size_t cap = SIZES[N_SIZES - 1];
    float *buf = malloc(cap * sizeof(float));
    uint64_t *hashes = malloc(n * sizeof *hashes);
    PIE_RANK_CHECK(rank, buf && hashes, "out of memory");
    pie_status st = {0};
    for (size_t s = 0; s < N_SIZES; s++) {
        size_t len = SIZES[s];
        for (uint32_t it = 0; it < 4; it++) {
            for (size_t j = 0; j < len; j++) buf[j] = rnd(rank, it, j);
            PIE_RANK_CHECK(rank, wrk_coll_allreduce_sum_f32(c, buf, len, &st) == PIE_OK,
                           "all-reduce of %zu floats: %s", len, st.msg);
            for (size_t j = 0; j < len; j++) {
                double want = 0;
                for (uint32_t r = 0; r < n; r++) want += rnd(r, it, j);
                PIE_RANK_CHECK(rank, fabs(buf[j] - want) <= 1e-6 * n,
                               "all-reduce of %zu floats: [%zu] = %.9g, serial sum %.9g", len, j,
                               buf[j], want);
            }
            uint64_t h = pie_testranks_hash(buf, len * sizeof(float));
            PIE_RANK_CHECK(rank, wrk_coll_allgather(c, &h, sizeof h, hashes, &st) == PIE_OK,
                           "all-gather: %s", st.msg);
            for (uint32_t r = 0; r < n; r++)
                PIE_RANK_CHECK(rank, hashes[r] == h,
                               "all-reduce of %zu floats: rank %u received other bits", len, r);
        }
    }
    free(hashes);
    free(buf);
    wrk_coll_close(c);
    return 0;
}

Test(wrk_coll, allreduce_of_random_data_matches_the_serial_sum_on_every_rank) {
    pie_testranks_expect_ok(2, rank_sum_random, NULL);
    pie_testranks_expect_ok(4, rank_sum_random, NULL);
}

/* The bits of every all-reduce, on both paths for messages of several steps (pipelined, one
 * barrier per step; stepwise, two): exactly the float sum in rank order ((x0 + x1) + x2), on
 * every rank. With 3 ranks the order shows: another one rounds differently somewhere. Messages
 * of several steps alternate with single-step ones and all-gathers, so the pipelined path's
 * last result is read while the next operation writes the other buffer set. */
static int rank_sum_bits(uint32_t rank, uint32_t n, const char *name, void *arg) {
    bool stepwise = *(const bool *)arg;
    wrk_coll_opts o = {.name = name,
                       .epoch = 9,
                       .rank = rank,
                       .n_ranks = n,
                       .chunk_bytes = CHUNK,
                       .timeout_ms = 20000,
                       .allreduce_stepwise = stepwise};
    pie_status st = {0};
    wrk_coll *c = NULL;
    PIE_RANK_CHECK(rank, wrk_coll_open(&o, &c, &st) == PIE_OK, "wrk_coll_open: %s", st.msg);
    static const size_t lens[] = {5 * CHUNK / 4 + 3, 1000, 2 * CHUNK / 4,
                                  CHUNK / 4 + 1,     17,   4 * CHUNK / 4 + 64};
    size_t cap = 5 * CHUNK / 4 + 3; /* the largest of lens */
    float *buf = malloc(cap * sizeof(float));
    uint64_t *hashes = malloc(n * sizeof *hashes);
    PIE_RANK_CHECK(rank, buf && hashes, "out of memory");
    uint32_t rounded = 0;
    for (uint32_t it = 0; it < 3; it++) {
        for (size_t s = 0; s < sizeof lens / sizeof lens[0]; s++) {
            size_t len = lens[s];
            for (size_t j = 0; j < len; j++) buf[j] = rnd(rank, it * 8 + (uint32_t)s, j) * 1e3f;
            PIE_RANK_CHECK(rank, wrk_coll_allreduce_sum_f32(c, buf, len, &st) == PIE_OK,
                           "all-reduce of %zu floats: %s", len, st.msg);
            for (size_t j = 0; j < len; j++) {
                float want = rnd(0, it * 8 + (uint32_t)s, j) * 1e3f;
                for (uint32_t r = 1; r < n; r++) want += rnd(r, it * 8 + (uint32_t)s, j) * 1e3f;
                float other = rnd(n - 1, it * 8 + (uint32_t)s, j) * 1e3f;
                for (uint32_t r = n - 1; r-- > 0;) other += rnd(r, it * 8 + (uint32_t)s, j) * 1e3f;
                rounded += want != other;
                PIE_RANK_CHECK(rank, memcmp(&buf[j], &want, sizeof want) == 0,
                               "%s all-reduce of %zu floats: [%zu] = %a, the rank-order sum %a",
                               stepwise ? "stepwise" : "pipelined", len, j, buf[j], want);
            }
            uint64_t h = pie_testranks_hash(buf, len * sizeof(float));
            PIE_RANK_CHECK(rank, wrk_coll_allgather(c, &h, sizeof h, hashes, &st) == PIE_OK,
                           "all-gather: %s", st.msg);
            for (uint32_t r = 0; r < n; r++)
                PIE_RANK_CHECK(rank, hashes[r] == h, "rank %u received other bits", r);
        }
    }
    PIE_RANK_CHECK(rank, rounded > 0, "no element where the summation order matters: a weak test");
    free(hashes);
    free(buf);
    wrk_coll_close(c);
    return 0;
}

Test(wrk_coll, allreduce_bits_are_the_rank_order_sum_on_the_pipelined_and_stepwise_paths) {
    bool pipelined = false, stepwise = true;
    pie_testranks_expect_ok(3, rank_sum_bits, &pipelined);
    pie_testranks_expect_ok(3, rank_sum_bits, &stepwise);
}

/* ---- all-gather, broadcast, mixed --------------------------------------------------------------
 */

static const size_t BYTES[] = {1, 7, 64, 1001, CHUNK, CHUNK + 3, 2 * CHUNK + 129};
#define N_BYTES (sizeof BYTES / sizeof BYTES[0])

static unsigned char byte_of(uint32_t rank, uint32_t iter, size_t j) {
    return (unsigned char)(rank * 131u + iter * 31u + j * 7u + (j >> 8));
}

static int rank_gather_bcast(uint32_t rank, uint32_t n, const char *name, void *arg) {
    (void)arg;
    wrk_coll *c = open_rank(rank, n, name, 20000);
    PIE_RANK_CHECK(rank, c, "open failed");
    size_t cap = BYTES[N_BYTES - 1];
    unsigned char *in = malloc(cap), *out = malloc(cap * n);
    PIE_RANK_CHECK(rank, in && out, "out of memory");
    pie_status st = {0};
    for (size_t s = 0; s < N_BYTES; s++) {
        size_t len = BYTES[s];
        for (uint32_t it = 0; it < 3; it++) {
            for (size_t j = 0; j < len; j++) in[j] = byte_of(rank, it, j);
            PIE_RANK_CHECK(rank, wrk_coll_allgather(c, in, len, out, &st) == PIE_OK,
                           "all-gather of %zu bytes: %s", len, st.msg);
            for (uint32_t r = 0; r < n; r++)
                for (size_t j = 0; j < len; j++)
                    PIE_RANK_CHECK(rank, out[r * len + j] == byte_of(r, it, j),
                                   "all-gather of %zu bytes: rank %u's byte %zu differs", len, r,
                                   j);
            for (uint32_t root = 0; root < n; root++) {
                for (size_t j = 0; j < len; j++) in[j] = rank == root ? byte_of(root, it, j) : 0xEE;
                PIE_RANK_CHECK(rank, wrk_coll_bcast(c, root, in, len, &st) == PIE_OK,
                               "broadcast of %zu bytes from %u: %s", len, root, st.msg);
                for (size_t j = 0; j < len; j++)
                    PIE_RANK_CHECK(rank, in[j] == byte_of(root, it, j),
                                   "broadcast of %zu bytes from %u: byte %zu differs", len, root,
                                   j);
            }
        }
    }
    free(in);
    free(out);
    wrk_coll_close(c);
    return 0;
}

Test(wrk_coll, allgather_and_broadcast_deliver_exact_bytes) {
    pie_testranks_expect_ok(2, rank_gather_bcast, NULL);
    pie_testranks_expect_ok(4, rank_gather_bcast, NULL);
}

/* Thousands of small operations of every kind back to back: a rank that ran ahead into a
 * buffer another rank still reads would show up as a wrong value here. */
static int rank_mixed(uint32_t rank, uint32_t n, const char *name, void *arg) {
    (void)arg;
    wrk_coll *c = open_rank(rank, n, name, 20000);
    PIE_RANK_CHECK(rank, c, "open failed");
    pie_status st = {0};
    float v[5];
    uint32_t ids[WRK_COLL_MAX_RANKS];
    for (uint32_t it = 0; it < 3000; it++) {
        for (int j = 0; j < 5; j++) v[j] = (float)(rank * 10 + (uint32_t)j + it % 97);
        PIE_RANK_CHECK(rank, wrk_coll_allreduce_sum_f32(c, v, 5, &st) == PIE_OK, "%s", st.msg);
        for (int j = 0; j < 5; j++) {
            float want = (float)(10 * n * (n - 1) / 2 + n * ((uint32_t)j + it % 97));
            PIE_RANK_CHECK(rank, v[j] == want, "iteration %u: sum[%d] = %.1f, want %.1f", it, j,
                           v[j], want);
        }
        uint32_t mine = rank * 1000 + it;
        PIE_RANK_CHECK(rank, wrk_coll_allgather(c, &mine, sizeof mine, ids, &st) == PIE_OK, "%s",
                       st.msg);
        for (uint32_t r = 0; r < n; r++)
            PIE_RANK_CHECK(rank, ids[r] == r * 1000 + it, "iteration %u: gathered[%u] = %u", it, r,
                           ids[r]);
        uint32_t root = it % n, word = rank == root ? it * 3 + 1 : 0;
        PIE_RANK_CHECK(rank, wrk_coll_bcast(c, root, &word, sizeof word, &st) == PIE_OK, "%s",
                       st.msg);
        PIE_RANK_CHECK(rank, word == it * 3 + 1, "iteration %u: broadcast gave %u", it, word);
        if (it % 500 == 0)
            PIE_RANK_CHECK(rank, wrk_coll_barrier(c, &st) == PIE_OK, "barrier: %s", st.msg);
    }
    wrk_coll_close(c);
    return 0;
}

Test(wrk_coll, thousands_of_mixed_operations_stay_in_step) {
    pie_testranks_expect_ok(2, rank_mixed, NULL);
    pie_testranks_expect_ok(4, rank_mixed, NULL);
}

Test(wrk_coll, one_rank_needs_no_segment) {
    wrk_coll_opts o = {.n_ranks = 1}; /* no name: nothing is shared */
    pie_status st = {0};
    wrk_coll *c = NULL;
    cr_assert_eq(wrk_coll_open(&o, &c, &st), PIE_OK, "%s", st.msg);
    float v[3] = {1.5f, -2.0f, 3.0f};
    cr_assert_eq(wrk_coll_allreduce_sum_f32(c, v, 3, &st), PIE_OK, "%s", st.msg);
    cr_expect(v[0] == 1.5f && v[1] == -2.0f && v[2] == 3.0f);
    char in[5] = "abcd", out[5] = {0};
    cr_assert_eq(wrk_coll_allgather(c, in, 5, out, &st), PIE_OK, "%s", st.msg);
    cr_expect_str_eq(out, "abcd");
    cr_assert_eq(wrk_coll_bcast(c, 0, in, 5, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(wrk_coll_barrier(c, &st), PIE_OK, "%s", st.msg);
    cr_expect_eq(wrk_coll_bcast(c, 1, in, 5, &st), PIE_INVALID_ARGUMENT);
    cr_expect_str_eq(st.msg, "wrk_coll broadcast: root 1 is out of range [0, 1)");
    wrk_coll_close(c);
}

/* ---- failures ------------------------------------------------------------------------------ */

/* Rank `dead` exits right after joining; the others' next all-reduce fails naming it. */
static int rank_one_dies(uint32_t rank, uint32_t n, const char *name, void *arg) {
    uint32_t dead = *(const uint32_t *)arg;
    wrk_coll *c = open_rank(rank, n, name, 60000);
    PIE_RANK_CHECK(rank, c, "open failed");
    if (rank == dead) _exit(0); /* no close: as a crash, the kernel drops the lock */
    pie_status st = {0};
    float v[4] = {1, 2, 3, 4};
    pie_code rc = wrk_coll_allreduce_sum_f32(c, v, 4, &st);
    PIE_RANK_CHECK(rank, rc == PIE_UNAVAILABLE, "all-reduce with a dead rank returned %s: %s",
                   pie_code_name(rc), st.msg);
    char want[128];
    snprintf(want, sizeof want, "rank %u of %u is gone", dead, n);
    PIE_RANK_CHECK(rank, strstr(st.msg, want) || strstr(st.msg, "another rank of the group failed"),
                   "unexpected message: %s", st.msg);
    /* the failure is sticky */
    rc = wrk_coll_barrier(c, &st);
    PIE_RANK_CHECK(rank, rc == PIE_UNAVAILABLE && strstr(st.msg, "the group failed earlier"),
                   "barrier after the failure returned %s: %s", pie_code_name(rc), st.msg);
    wrk_coll_close(c);
    return 0;
}

Test(wrk_coll, a_rank_that_dies_fails_the_others_instead_of_hanging) {
    uint32_t dead = 1;
    pie_testranks_expect_ok(2, rank_one_dies, &dead);
    dead = 2;
    pie_testranks_expect_ok(4, rank_one_dies, &dead);
}

/* Rank 1 stays alive but does not arrive; rank 0 times out, and rank 1 finds the group failed. */
static int rank_one_stalls(uint32_t rank, uint32_t n, const char *name, void *arg) {
    (void)arg;
    wrk_coll *c = open_rank(rank, n, name, 300);
    PIE_RANK_CHECK(rank, c, "open failed");
    pie_status st = {0};
    float v[2] = {1, 2};
    if (rank == 1) {
        struct timespec ts = {.tv_sec = 1, .tv_nsec = 200000000};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
        pie_code rc = wrk_coll_allreduce_sum_f32(c, v, 2, &st);
        PIE_RANK_CHECK(rank, rc == PIE_UNAVAILABLE, "late all-reduce returned %s: %s",
                       pie_code_name(rc), st.msg);
    } else {
        pie_code rc = wrk_coll_allreduce_sum_f32(c, v, 2, &st);
        PIE_RANK_CHECK(rank, rc == PIE_DEADLINE_EXCEEDED, "all-reduce returned %s: %s",
                       pie_code_name(rc), st.msg);
        PIE_RANK_CHECK(rank,
                       strcmp(st.msg, "wrk_coll all-reduce: rank 1 of 2 did not arrive within "
                                      "300 ms") == 0,
                       "unexpected message: %s", st.msg);
    }
    wrk_coll_close(c);
    return 0;
}

Test(wrk_coll, a_rank_that_does_not_arrive_times_out) {
    pie_testranks_expect_ok(2, rank_one_stalls, NULL);
}

/* An idle wait: rank 0 broadcasts only after 4 times the ranks' timeout (the followers of a
 * worker group between steps); the others, in wrk_coll_bcast_idle, get the bytes instead of
 * DEADLINE_EXCEEDED, and the group is still fine afterwards (wrk_coll_check, an all-reduce). */
static int rank_idle_bcast(uint32_t rank, uint32_t n, const char *name, void *arg) {
    (void)arg;
    wrk_coll *c = open_rank(rank, n, name, 300);
    PIE_RANK_CHECK(rank, c, "open failed");
    pie_status st = {0};
    char msg[32] = "";
    pie_code rc;
    if (rank == 0) {
        struct timespec ts = {.tv_sec = 1, .tv_nsec = 200000000};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
        snprintf(msg, sizeof msg, "the next step");
        rc = wrk_coll_bcast(c, 0, msg, sizeof msg, &st);
    } else {
        rc = wrk_coll_bcast_idle(c, 0, msg, sizeof msg, &st);
    }
    PIE_RANK_CHECK(rank, rc == PIE_OK, "broadcast returned %s: %s", pie_code_name(rc), st.msg);
    PIE_RANK_CHECK(rank, strcmp(msg, "the next step") == 0, "received \"%s\"", msg);
    PIE_RANK_CHECK(rank, wrk_coll_check(c, &st) == PIE_OK, "check: %s", st.msg);
    float v[1] = {1};
    PIE_RANK_CHECK(rank, wrk_coll_allreduce_sum_f32(c, v, 1, &st) == PIE_OK && v[0] == (float)n,
                   "all-reduce after the idle wait: %s (%g)", st.msg, (double)v[0]);
    wrk_coll_close(c);
    return 0;
}

Test(wrk_coll, an_idle_broadcast_waits_past_the_timeout) {
    pie_testranks_expect_ok(2, rank_idle_bcast, NULL);
    pie_testranks_expect_ok(3, rank_idle_bcast, NULL);
}

/* Rank 0 dies while the others wait for it without a deadline: the wait ends UNAVAILABLE
 * naming it, and wrk_coll_check reports the failure from then on. */
static int rank_root_dies_idle(uint32_t rank, uint32_t n, const char *name, void *arg) {
    (void)arg;
    wrk_coll *c = open_rank(rank, n, name, 300);
    PIE_RANK_CHECK(rank, c, "open failed");
    if (rank == 0) {
        struct timespec ts = {.tv_sec = 0, .tv_nsec = 500000000};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
        _exit(0); /* no close: as a crash */
    }
    pie_status st = {0};
    uint64_t word = 0;
    pie_code rc = wrk_coll_bcast_idle(c, 0, &word, sizeof word, &st);
    PIE_RANK_CHECK(rank, rc == PIE_UNAVAILABLE, "idle broadcast returned %s: %s", pie_code_name(rc),
                   st.msg);
    PIE_RANK_CHECK(
        rank, strstr(st.msg, "rank 0 of") || strstr(st.msg, "another rank of the group failed"),
        "unexpected message: %s", st.msg);
    rc = wrk_coll_check(c, &st);
    PIE_RANK_CHECK(rank, rc == PIE_UNAVAILABLE, "check after the failure returned %s",
                   pie_code_name(rc));
    wrk_coll_close(c);
    return 0;
}

Test(wrk_coll, an_idle_broadcast_ends_when_the_root_dies) {
    pie_testranks_expect_ok(2, rank_root_dies_idle, NULL);
    pie_testranks_expect_ok(3, rank_root_dies_idle, NULL);
}

/* Rank 1 expects 4 ranks where rank 0 made a segment for 2. */
static int rank_mismatched(uint32_t rank, uint32_t n, const char *name, void *arg) {
    (void)arg;
    (void)n;
    wrk_coll_opts o = {.name = name,
                       .epoch = 7,
                       .rank = rank,
                       .n_ranks = rank == 0 ? 2 : 4,
                       .chunk_bytes = CHUNK,
                       .timeout_ms = rank == 0 ? 1500 : 20000};
    pie_status st = {0};
    wrk_coll *c = NULL;
    pie_code rc = wrk_coll_open(&o, &c, &st);
    if (rank == 0) {
        PIE_RANK_CHECK(rank, rc == PIE_DEADLINE_EXCEEDED, "rank 0 open returned %s: %s",
                       pie_code_name(rc), st.msg);
        PIE_RANK_CHECK(rank, strstr(st.msg, "wrk_coll join: rank 1 of 2 did not arrive"),
                       "unexpected message: %s", st.msg);
    } else {
        PIE_RANK_CHECK(rank, rc == PIE_FAILED_PRECONDITION, "rank 1 open returned %s: %s",
                       pie_code_name(rc), st.msg);
        PIE_RANK_CHECK(rank,
                       strstr(st.msg, "has 2 ranks and chunk_bytes 262144, this rank "
                                      "expects 4 and 262144"),
                       "unexpected message: %s", st.msg);
    }
    PIE_RANK_CHECK(rank, c == NULL, "a failed open returned a handle");
    return 0;
}

Test(wrk_coll, a_rank_expecting_another_group_shape_is_refused) {
    pie_testranks_expect_ok(2, rank_mismatched, NULL);
}

/* A segment left under the group's name by an earlier formation (a rank 0 that crashed before
 * unlinking it): rank 0 replaces it; a rank of the new epoch never attaches to it. */
static int rank_after_stale(uint32_t rank, uint32_t n, const char *name, void *arg) {
    (void)arg;
    if (rank != 0) { /* give rank 0's replacement a chance to race with the stale object */
        struct timespec ts = {.tv_sec = 0, .tv_nsec = 20000000};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
    }
    wrk_coll *c = open_rank(rank, n, name, 20000);
    PIE_RANK_CHECK(rank, c, "open failed");
    pie_status st = {0};
    float v[3] = {1, 2, 3};
    PIE_RANK_CHECK(rank, wrk_coll_allreduce_sum_f32(c, v, 3, &st) == PIE_OK, "%s", st.msg);
    PIE_RANK_CHECK(rank, v[0] == (float)n && v[2] == 3.0f * (float)n, "wrong sum %g", v[0]);
    wrk_coll_close(c);
    return 0;
}

Test(wrk_coll, a_stale_segment_under_the_same_name_is_replaced) {
    static const char *garbage = "a segment of another formation";
    char name[PIE_TESTRANKS_NAME_MAX];
    pie_testranks_next_name(name, sizeof name);
    int fd = shm_open(name, O_RDWR | O_CREAT | O_TRUNC, 0600);
    cr_assert_geq(fd, 0, "shm_open %s: %s", name, strerror(errno));
    cr_assert_eq(ftruncate(fd, 1 << 16), 0);
    cr_assert_eq(pwrite(fd, garbage, strlen(garbage), 0), (ssize_t)strlen(garbage));
    close(fd);
    pie_testranks_expect_ok(3, rank_after_stale, NULL);
    cr_expect(shm_unlink(name) != 0 && errno == ENOENT, "%s is left behind", name);
}

/* Rank 1 of epoch 8 does not attach to rank 0's segment of epoch 7 (it would be a stale one for
 * it): it waits for its own, then times out; rank 0 times out waiting for it. */
static int rank_other_epoch(uint32_t rank, uint32_t n, const char *name, void *arg) {
    (void)arg;
    wrk_coll_opts o = {.name = name,
                       .epoch = rank == 0 ? 7 : 8,
                       .rank = rank,
                       .n_ranks = n,
                       .chunk_bytes = CHUNK,
                       .timeout_ms = 800};
    pie_status st = {0};
    wrk_coll *c = NULL;
    pie_code rc = wrk_coll_open(&o, &c, &st);
    PIE_RANK_CHECK(rank, rc == PIE_DEADLINE_EXCEEDED && c == NULL, "open returned %s: %s",
                   pie_code_name(rc), st.msg);
    char want[160];
    if (rank == 0)
        snprintf(want, sizeof want, "wrk_coll join: rank 1 of 2 did not arrive within 800 ms");
    else
        snprintf(want, sizeof want,
                 "wrk_coll_open: rank 1: no segment %s of epoch 8 appeared within 800 ms (is "
                 "rank 0 running?)",
                 name);
    PIE_RANK_CHECK(rank, strcmp(st.msg, want) == 0, "message: %s, want: %s", st.msg, want);
    return 0;
}

Test(wrk_coll, a_rank_of_another_epoch_does_not_join) {
    pie_testranks_expect_ok(2, rank_other_epoch, NULL);
}

/* Once every rank has joined, the segment's name is gone (nothing is left in /dev/shm). */
static int rank_check_unlinked(uint32_t rank, uint32_t n, const char *name, void *arg) {
    (void)arg;
    wrk_coll *c = open_rank(rank, n, name, 20000);
    PIE_RANK_CHECK(rank, c, "open failed");
    pie_status st = {0}; /* rank 0 unlinks before it reaches this barrier */
    PIE_RANK_CHECK(rank, wrk_coll_barrier(c, &st) == PIE_OK, "barrier: %s", st.msg);
    int fd = shm_open(name, O_RDONLY, 0);
    PIE_RANK_CHECK(rank, fd < 0 && errno == ENOENT, "%s still exists after the join", name);
    wrk_coll_close(c);
    return 0;
}

Test(wrk_coll, the_segment_name_is_removed_once_all_ranks_joined) {
    pie_testranks_expect_ok(3, rank_check_unlinked, NULL);
}

Test(wrk_coll, bad_options_are_refused_with_the_field_named) {
    pie_status st = {0};
    wrk_coll *c = NULL;
    wrk_coll_opts o = {.name = "/x", .n_ranks = 0};
    cr_expect_eq(wrk_coll_open(&o, &c, &st), PIE_INVALID_ARGUMENT);
    cr_expect_str_eq(st.msg, "wrk_coll_open: n_ranks 0 is out of range [1, 64]");
    o = (wrk_coll_opts){.name = "/x", .rank = 2, .n_ranks = 2};
    cr_expect_eq(wrk_coll_open(&o, &c, &st), PIE_INVALID_ARGUMENT);
    cr_expect_str_eq(st.msg, "wrk_coll_open: rank 2 is out of range [0, 2)");
    o = (wrk_coll_opts){.name = "no-slash", .rank = 0, .n_ranks = 2};
    cr_expect_eq(wrk_coll_open(&o, &c, &st), PIE_INVALID_ARGUMENT);
    cr_expect_str_eq(st.msg, "wrk_coll_open: name 'no-slash' must be '/' followed by 1 to 200 "
                             "characters of [A-Za-z0-9._-]");
    o = (wrk_coll_opts){.name = "/a/b", .rank = 0, .n_ranks = 2};
    cr_expect_eq(wrk_coll_open(&o, &c, &st), PIE_INVALID_ARGUMENT);
    cr_expect_null(c);
}
