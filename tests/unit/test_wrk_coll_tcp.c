/* test_wrk_coll_tcp.c — the host collective's TCP transport (services/worker/tp/wrk_coll_tcp.c,
 * wrk_coll_opts.tcp_leader) between forked rank processes on loopback: the transport of groups
 * whose ranks run on different nodes.
 *
 * Covers: every operation gives every rank the same bits, and all-reduce gives the bits the
 * shared-memory transport gives (both sum in rank order) over sizes from 1 float to several
 * receive chunks; all-gather, broadcast from a rank other than 0, barrier, idle broadcast;
 * joining: a rank of another epoch or group size is refused with FAILED_PRECONDITION and a
 * second rank 1 with ALREADY_EXISTS, and the group still forms; failure: a rank that exits
 * fails the others with UNAVAILABLE naming it (rank 0 tells the followers), a dead rank 0 ends
 * a follower's idle wait. No assertion is on a time; no test sets Criterion's .timeout (see
 * test_wrk_coll.c): ctest's TIMEOUT bounds a hang and every wait has its own deadline. */
#include <criterion/criterion.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "pie_testranks.h"
#include "wrk_coll.h"

#define CHUNK   (64u << 10) /* rank 0's receive chunk in these tests: large sums take several */
#define N_RANKS 3

static const size_t SIZES[] = {1, 3, 1000, CHUNK / 4, CHUNK / 4 + 1, 5 * CHUNK / 4 + 7};
#define N_SIZES (sizeof SIZES / sizeof SIZES[0])

/* Shared with the ranks (MAP_SHARED before the fork). */
typedef struct tcp_world {
    char leader[64]; /* "127.0.0.1:<port>"; "" = the shared-memory transport */
    int listen_fd;   /* rank 0's listener, made before the fork */
    uint64_t hash[PIE_TESTRANKS_MAX][N_SIZES]; /* each rank's all-reduce results */
    atomic_int flags[8];                       /* test-specific signals between ranks */
    int codes[PIE_TESTRANKS_MAX];
    char msgs[PIE_TESTRANKS_MAX][PIE_STATUS_MSG_MAX];
} tcp_world;

static tcp_world *world_new(bool tcp) {
    tcp_world *w = mmap(NULL, sizeof *w, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert_neq(w, MAP_FAILED);
    memset(w, 0, sizeof *w);
    w->listen_fd = -1;
    if (!tcp) return w;
    pie_status st = {0};
    uint16_t port = 0;
    cr_assert_eq(wrk_coll_tcp_listen("127.0.0.1:0", &w->listen_fd, &port, &st), PIE_OK, "%s",
                 st.msg);
    snprintf(w->leader, sizeof w->leader, "127.0.0.1:%u", port);
    return w;
}

static void world_free(tcp_world *w) {
    if (w->listen_fd >= 0) close(w->listen_fd);
    munmap(w, sizeof *w);
}

/* A process that is not rank 0 closes its inherited copy of rank 0's listener first. */
static void drop_listener(const tcp_world *w, bool is_rank0) {
    if (!is_rank0 && w->listen_fd >= 0) close(w->listen_fd);
}

/* Joins as `rank` of n with `epoch` (the world's transport); NULL with *st on failure. */
static wrk_coll *join(tcp_world *w, uint32_t rank, uint32_t n, const char *name, uint64_t epoch,
                      uint32_t timeout_ms, pie_status *st) {
    wrk_coll_opts o = {.name = name,
                       .epoch = epoch,
                       .rank = rank,
                       .n_ranks = n,
                       .chunk_bytes = CHUNK,
                       .timeout_ms = timeout_ms,
                       .tcp_leader = w->leader,
                       .tcp_listen_fd = rank == 0 ? w->listen_fd : -1};
    wrk_coll *c = NULL;
    return wrk_coll_open(&o, &c, st) == PIE_OK ? c : NULL;
}

static float rnd(uint32_t rank, size_t j) {
    uint64_t x = (uint64_t)(rank + 1) * 0x9E3779B97F4A7C15ull ^ (uint64_t)j * 0x94D049BB133111EBull;
    x ^= x >> 31;
    x *= 0xD6E9F8CC1ull;
    x ^= x >> 29;
    return (float)((double)(x & 0xFFFFFF) / (double)0x800000 - 1.0);
}

/* ---- every operation ---------------------------------------------------------------------- */

static int ops_rank(uint32_t rank, uint32_t n, const char *name, void *arg) {
    tcp_world *w = arg;
    pie_status st = {0};
    drop_listener(w, rank == 0);
    wrk_coll *c = join(w, rank, n, name, 11, 20000, &st);
    PIE_RANK_CHECK(rank, c, "join: %s", st.msg);
    float *buf = malloc(SIZES[N_SIZES - 1] * sizeof *buf);
    PIE_RANK_CHECK(rank, buf, "out of memory");
    for (size_t s = 0; s < N_SIZES; s++) {
        for (size_t j = 0; j < SIZES[s]; j++) buf[j] = rnd(rank, j);
        PIE_RANK_CHECK(rank, wrk_coll_allreduce_sum_f32(c, buf, SIZES[s], &st) == PIE_OK,
                       "all-reduce of %zu: %s", SIZES[s], st.msg);
        w->hash[rank][s] = pie_testranks_hash(buf, SIZES[s] * sizeof *buf);
    }
    if (w->leader[0]) { /* the other operations, on TCP */
        uint32_t mine[2] = {rank * 10 + 1, rank * 10 + 2}, all[2 * PIE_TESTRANKS_MAX];
        PIE_RANK_CHECK(rank, wrk_coll_allgather(c, mine, sizeof mine, all, &st) == PIE_OK,
                       "all-gather: %s", st.msg);
        for (uint32_t r = 0; r < n; r++)
            PIE_RANK_CHECK(rank, all[2 * r] == r * 10 + 1 && all[2 * r + 1] == r * 10 + 2,
                           "all-gather: rank %u's slot holds %u %u", r, all[2 * r], all[2 * r + 1]);
        char text[100] = "";
        if (rank == 2) snprintf(text, sizeof text, "from rank 2");
        PIE_RANK_CHECK(rank, wrk_coll_bcast(c, 2, text, sizeof text, &st) == PIE_OK,
                       "broadcast: %s", st.msg);
        PIE_RANK_CHECK(rank, strcmp(text, "from rank 2") == 0, "broadcast gave \"%s\"", text);
        PIE_RANK_CHECK(rank, wrk_coll_barrier(c, &st) == PIE_OK, "barrier: %s", st.msg);
        uint64_t word = rank == 0 ? 0xfeedull : 0;
        PIE_RANK_CHECK(rank, wrk_coll_bcast_idle(c, 0, &word, sizeof word, &st) == PIE_OK,
                       "idle broadcast: %s", st.msg);
        PIE_RANK_CHECK(rank, word == 0xfeedull, "idle broadcast gave %llx",
                       (unsigned long long)word);
    }
    free(buf);
    wrk_coll_close(c);
    return 0;
}

Test(wrk_coll_tcp, every_rank_gets_the_bits_the_shared_memory_transport_gives) {
    tcp_world *shm = world_new(false), *tcp = world_new(true);
    pie_testranks_expect_ok(N_RANKS, ops_rank, shm);
    pie_testranks_expect_ok(N_RANKS, ops_rank, tcp);
    for (size_t s = 0; s < N_SIZES; s++)
        for (uint32_t r = 0; r < N_RANKS; r++) {
            cr_expect_eq(tcp->hash[r][s], tcp->hash[0][s],
                         "all-reduce of %zu floats: rank %u's result differs from rank 0's",
                         SIZES[s], r);
            cr_expect_eq(tcp->hash[r][s], shm->hash[r][s],
                         "all-reduce of %zu floats: rank %u got other bits on TCP than on "
                         "shared memory",
                         SIZES[s], r);
        }
    world_free(shm);
    world_free(tcp);
}

/* ---- joining ------------------------------------------------------------------------------ */

/* Waits (bounded) until flags[i] is set; 0 when it was. */
static int wait_flag(tcp_world *w, int i) {
    for (int k = 0; k < 3000 && !w->flags[i]; k++) {
        struct timespec ts = {0, 10000000};
        nanosleep(&ts, NULL);
    }
    return w->flags[i] ? 0 : -1;
}

/* Process roles: 0 rank 0; 1 and 3 both claim rank 1; 2 tries another epoch and another group
 * size, then says so in flags[0]; 4 is rank 2 and joins once both others have a verdict. */
static int join_rank(uint32_t proc, uint32_t n_procs, const char *name, void *arg) {
    (void)n_procs;
    tcp_world *w = arg;
    pie_status st = {0};
    wrk_coll *c = NULL;
    drop_listener(w, proc == 0);
    if (proc == 2) {
        c = join(w, 1, N_RANKS, name, 99, 20000, &st);
        PIE_RANK_CHECK(
            proc, !c && st.code == PIE_FAILED_PRECONDITION && strstr(st.msg, "another formation"),
            "a rank of epoch 99 was not refused: %s", st.msg);
        c = join(w, 1, N_RANKS + 1, name, 5, 20000, &st);
        PIE_RANK_CHECK(
            proc, !c && st.code == PIE_FAILED_PRECONDITION && strstr(st.msg, "group of 4 ranks"),
            "a rank of a 4-rank group was not refused: %s", st.msg);
        w->flags[0] = 1;
        return 0;
    }
    if (proc == 4) {
        PIE_RANK_CHECK(proc, wait_flag(w, 0) == 0 && wait_flag(w, 1) == 0,
                       "the refusals never came");
        c = join(w, 2, N_RANKS, name, 5, 20000, &st);
    } else {
        c = join(w, proc == 0 ? 0 : 1, N_RANKS, name, 5, 20000, &st);
    }
    if (!c && (proc == 1 || proc == 3)) { /* the second rank 1 */
        w->codes[proc] = st.code;
        snprintf(w->msgs[proc], sizeof w->msgs[proc], "%s", st.msg);
        w->flags[1] = 1;
        return 0;
    }
    PIE_RANK_CHECK(proc, c, "join: %s", st.msg);
    float x = 1.0f;
    PIE_RANK_CHECK(proc, wrk_coll_allreduce_sum_f32(c, &x, 1, &st) == PIE_OK, "all-reduce: %s",
                   st.msg);
    PIE_RANK_CHECK(proc, x == 3.0f, "the group's sum is %g, not 3", x);
    wrk_coll_close(c);
    return 0;
}

Test(wrk_coll_tcp, ranks_of_another_epoch_size_or_a_taken_rank_are_refused_and_the_group_forms) {
    tcp_world *w = world_new(true);
    pie_testranks_expect_ok(5, join_rank, w);
    int refused = w->codes[1] ? 1 : 3, winner = refused == 1 ? 3 : 1;
    cr_expect_eq(w->codes[winner], 0, "both processes claiming rank 1 were refused");
    cr_expect_eq(w->codes[refused], PIE_ALREADY_EXISTS, "the second rank 1: code %d: %s",
                 w->codes[refused], w->msgs[refused]);
    cr_expect(strstr(w->msgs[refused], "rank 1 already joined this epoch"), "%s", w->msgs[refused]);
    world_free(w);
}

/* ---- failure ------------------------------------------------------------------------------ */

/* Rank 2 exits after the first all-reduce; the others' second one fails naming it. */
static int dying_rank(uint32_t rank, uint32_t n, const char *name, void *arg) {
    tcp_world *w = arg;
    pie_status st = {0};
    drop_listener(w, rank == 0);
    wrk_coll *c = join(w, rank, n, name, 3, 20000, &st);
    PIE_RANK_CHECK(rank, c, "join: %s", st.msg);
    float x[4] = {1, 2, 3, 4};
    PIE_RANK_CHECK(rank, wrk_coll_allreduce_sum_f32(c, x, 4, &st) == PIE_OK, "all-reduce: %s",
                   st.msg);
    if (rank == 2) _exit(0); /* gone without a word */
    pie_code rc = wrk_coll_allreduce_sum_f32(c, x, 4, &st);
    w->codes[rank] = rc;
    snprintf(w->msgs[rank], sizeof w->msgs[rank], "%s", st.msg);
    pie_code again = wrk_coll_barrier(c, &st);
    PIE_RANK_CHECK(rank, again == rc, "the failure is not sticky: %d then %d", rc, again);
    wrk_coll_close(c);
    return 0;
}

Test(wrk_coll_tcp, a_rank_that_exits_fails_the_others_with_unavailable_naming_it) {
    tcp_world *w = world_new(true);
    pie_testranks_expect_ok(N_RANKS, dying_rank, w);
    for (uint32_t r = 0; r < 2; r++) {
        cr_expect_eq(w->codes[r], PIE_UNAVAILABLE, "rank %u: code %d: %s", r, w->codes[r],
                     w->msgs[r]);
        cr_expect(strstr(w->msgs[r], "rank 2 of 3 is gone"), "rank %u: %s", r, w->msgs[r]);
    }
    world_free(w);
}

/* Rank 0 exits while rank 1 waits in an idle broadcast (no deadline): the wait ends. */
static int dead_root(uint32_t rank, uint32_t n, const char *name, void *arg) {
    tcp_world *w = arg;
    pie_status st = {0};
    drop_listener(w, rank == 0);
    wrk_coll *c = join(w, rank, n, name, 4, 20000, &st);
    PIE_RANK_CHECK(rank, c, "join: %s", st.msg);
    if (rank == 0) _exit(0);
    uint64_t word = 0;
    w->codes[rank] = wrk_coll_bcast_idle(c, 0, &word, sizeof word, &st);
    snprintf(w->msgs[rank], sizeof w->msgs[rank], "%s", st.msg);
    wrk_coll_close(c);
    return 0;
}

Test(wrk_coll_tcp, a_dead_rank_0_ends_an_idle_wait) {
    tcp_world *w = world_new(true);
    pie_testranks_expect_ok(2, dead_root, w);
    cr_expect_eq(w->codes[1], PIE_UNAVAILABLE, "code %d: %s", w->codes[1], w->msgs[1]);
    cr_expect(strstr(w->msgs[1], "rank 0 of 2 is gone"), "%s", w->msgs[1]);
    world_free(w);
}
