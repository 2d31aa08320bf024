/* wrk_coll.h — the host collective of a tensor-parallel worker group: all-reduce (sum, f32),
 * all-gather and broadcast between the N rank processes of one node, through shared memory,
 * or between ranks on different nodes over TCP (opts.tcp_leader; wrk_coll_tcp.h: the same
 * contract and the same bits, through rank 0).
 *
 * Owns: the group's shared segment (POSIX shm named by the group, created by rank 0, opened by
 * the others, unlinked once all have joined), the per-rank sequence counters the ranks wait on
 * (a brief spin, then FUTEX_WAIT), the liveness of every rank (an OFD lock each rank holds on
 * its byte of the segment: the kernel drops it when the process dies, whatever its pid
 * namespace), and the timeouts that turn a missing rank into an error instead of a hang.
 * Does not own: who the ranks are and how they find the segment's name and epoch (the group's
 * join, TpJoin on rank 0), NCCL (the cuda backend), what the ranks compute (engine/).
 *
 * Contract. Every rank calls the same operations in the same order with the same sizes (and
 * the same root); that is what makes the protocol need no per-op handshake. All-reduce sums in
 * rank order (rank 0's value + rank 1's + ...) for every element, and every rank receives the
 * same bits. Any failure (a rank that does not arrive within timeout_ms, a rank whose process
 * died, wrk_coll_abort anywhere) marks the whole group failed: that call and every later one
 * on every rank returns an error (UNAVAILABLE: a rank died or the group was aborted;
 * DEADLINE_EXCEEDED: a rank did not arrive in time). A failed group is not repaired: its ranks
 * close it and form a new one (a new epoch).
 *
 * Protocol. Each operation is one or more steps of at most chunk_bytes per rank. A step
 * writes into one of two buffer sets (alternating), then passes a barrier (every rank
 * publishes its step count and waits for all others to reach it); an all-reduce of more than
 * WRK_COLL_DIRECT_BYTES per step reduces a 1/N slice per rank into a shared result and passes a
 * second barrier — except in an all-reduce of several steps, which is pipelined: step s's
 * result is copied out after step s+1's barrier, one barrier per step and one at the end.
 * Alternating buffers make a barrier at the end of a step unnecessary: a rank writing step s's
 * buffers has seen every rank reach step s-1, so all are done with step s-2's.
 *
 * Threads: a handle is used by one thread at a time. The process must keep the handle's file
 * descriptor open (it holds the liveness lock); closing the handle releases it. Open the
 * handle in the rank's own process, after any fork: a child that inherits the descriptor
 * keeps the lock held for a parent that died. */
#ifndef WRK_COLL_H
#define WRK_COLL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pie_status.h"

#define WRK_COLL_MAX_RANKS 64
/* All-reduce steps up to this size: every rank sums all N inputs itself (one barrier instead
 * of two). */
#define WRK_COLL_DIRECT_BYTES (64u << 10)

typedef struct wrk_coll_opts {
    /* shm_open name of the group's segment: "/" then up to 200 characters of [A-Za-z0-9._-],
     * e.g. "/pie-tp-<group id>-<epoch>". Unused when n_ranks is 1. */
    const char *name;
    uint64_t epoch;      /* the group's formation: a segment of another epoch is stale */
    uint32_t rank;       /* 0 .. n_ranks - 1; rank 0 creates the segment */
    uint32_t n_ranks;    /* 1 .. WRK_COLL_MAX_RANKS; 1: every operation is local */
    size_t chunk_bytes;  /* bytes per rank per step; 0 → 1 MiB; rounded up to 64 */
    uint32_t timeout_ms; /* the longest wait for another rank (joining, each step); 0 → 30000 */
    /* joining only (every rank there, or rank 0 reached); 0 → timeout_ms */
    uint32_t join_timeout_ms;
    /* The TCP transport instead of shared memory, for ranks on different nodes
     * (wrk_coll_tcp.h): "host:port" of rank 0's listener; NULL or "": shared memory (name).
     * Rank 0 listens there itself, unless tcp_listen_fd > 0: a listening socket (from
     * wrk_coll_tcp_listen) that the handle takes over and closes once the group has formed. */
    const char *tcp_leader;
    int tcp_listen_fd;
    /* Shared memory, all-reduces of several steps: false (the default) pipelines them, one
     * barrier per step (step s's result is copied out after step s+1's barrier); true keeps
     * two barriers per step (reduce, wait, copy out), the earlier path, for benchmarks and
     * tests that compare both. The bits are the same either way. */
    bool allreduce_stepwise;
} wrk_coll_opts;

typedef struct wrk_coll wrk_coll;

/* A listening TCP socket on hostport ("host:port"; port 0 = any free one) for rank 0 of a TCP
 * group: *fd (pass it as tcp_listen_fd) and *port (the port bound), for whoever must know the
 * port before the group forms (TpJoin's answer, tests). */
pie_code wrk_coll_tcp_listen(const char *hostport, int *fd, uint16_t *port, pie_status *st);

/* Joins the group: rank 0 creates the segment (replacing a stale one of the same name), the
 * others wait up to timeout_ms for a segment of this epoch to appear; returns when all
 * n_ranks have joined. Errors: INVALID_ARGUMENT (options), FAILED_PRECONDITION (a segment of
 * this epoch with another n_ranks or chunk_bytes), DEADLINE_EXCEEDED (not all ranks joined in
 * time), INTERNAL (the OS refused shm, mmap or a lock). */
pie_code wrk_coll_open(const wrk_coll_opts *o, wrk_coll **out, pie_status *st);
void wrk_coll_close(wrk_coll *c); /* NULL is fine */

uint32_t wrk_coll_rank(const wrk_coll *c);
uint32_t wrk_coll_size(const wrk_coll *c);

/* buf[n] ← the element-wise sum over ranks of every rank's buf[n], in place. */
pie_code wrk_coll_allreduce_sum_f32(wrk_coll *c, float *buf, size_t n, pie_status *st);

/* out[n_ranks][bytes] ← every rank's in[bytes], in rank order (out[rank] too). in and out
 * must not overlap. */
pie_code wrk_coll_allgather(wrk_coll *c, const void *in, size_t bytes, void *out, pie_status *st);

/* buf[bytes] on every rank ← root's buf[bytes]. */
pie_code wrk_coll_bcast(wrk_coll *c, uint32_t root, void *buf, size_t bytes, pie_status *st);

/* wrk_coll_bcast whose waits have no deadline: for ranks that wait for the next thing root
 * will send, however long the group stays idle (a follower rank waiting for its next step).
 * A rank that dies or a group that fails still ends the wait (UNAVAILABLE). Every rank of one
 * broadcast must use the same variant's data shape (root may call either). */
pie_code wrk_coll_bcast_idle(wrk_coll *c, uint32_t root, void *buf, size_t bytes, pie_status *st);

/* PIE_OK while the group works; else its sticky failure (also one another rank marked). */
pie_code wrk_coll_check(wrk_coll *c, pie_status *st);

/* Returns when every rank has called it (or with an error). */
pie_code wrk_coll_barrier(wrk_coll *c, pie_status *st);

/* Marks the group failed: every rank's current and later operations return UNAVAILABLE. */
void wrk_coll_abort(wrk_coll *c);

#endif
