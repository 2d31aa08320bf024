/* wrk_coll_tcp.h — the TCP transport of the host collective (wrk_coll.h): the same operations
 * between ranks on different nodes (a LeaderWorkerSet group of pods), used by wrk_coll.c when
 * wrk_coll_opts.tcp_leader is set. Internal to services/worker/tp.
 *
 * Owns: rank 0's listener and the star of connections (each rank 1..N-1 holds one to rank 0),
 * the join handshake (magic, epoch, rank, n_ranks: rank 0 refuses a rank of another formation,
 * shape or a rank already joined, and tells it why), the framing ({op, root, bytes} before each
 * payload, so ranks that call different operations fail instead of misreading each other), the
 * operations, and failure (a closed connection → UNAVAILABLE naming the rank; no data within
 * timeout_ms → DEADLINE_EXCEEDED; rank 0 tells every rank why before it closes, so all of them
 * name the rank that failed).
 *
 * Why a star through rank 0 and not a ring: rank 0 sums every element in rank order (rank 0's
 * value + rank 1's + ...) exactly as the shared-memory transport does, so every rank receives
 * the same bits whichever transport the group uses; a ring all-reduce sums each slice starting
 * at another rank. The cost is 2 (N - 1) transfers through rank 0's link per operation — fine
 * for the cpu backend's decode steps (33 all-reduces of 8 KiB per step on a 1B model) and 2-4
 * ranks; a deterministic ring (reduce-scatter in rank order per slice) is the step after. */
#ifndef WRK_COLL_TCP_H
#define WRK_COLL_TCP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pie_status.h"
#include "wrk_coll.h"

typedef struct wrk_coll_tcp wrk_coll_tcp;

/* Joins the group over TCP (o->tcp_leader, o->tcp_listen_fd, o->epoch, o->rank, o->n_ranks;
 * chunk_bytes and timeout_ms already defaulted by the caller). Errors as wrk_coll_open, plus
 * the refusals rank 0 sends: FAILED_PRECONDITION (another epoch or n_ranks), INVALID_ARGUMENT
 * (rank out of range), ALREADY_EXISTS (that rank already joined). */
pie_code wrk_coll_tcp_open(const wrk_coll_opts *o, size_t chunk_bytes, uint32_t timeout_ms,
                           wrk_coll_tcp **out, pie_status *st);
void wrk_coll_tcp_close(wrk_coll_tcp *t); /* NULL is fine */

pie_code wrk_coll_tcp_allreduce_sum_f32(wrk_coll_tcp *t, float *buf, size_t n, pie_status *st);
pie_code wrk_coll_tcp_allgather(wrk_coll_tcp *t, const void *in, size_t bytes, void *out,
                                pie_status *st);
/* no_deadline: receives wait without a deadline (wrk_coll_bcast_idle). */
pie_code wrk_coll_tcp_bcast(wrk_coll_tcp *t, uint32_t root, void *buf, size_t bytes,
                            bool no_deadline, pie_status *st);
pie_code wrk_coll_tcp_barrier(wrk_coll_tcp *t, pie_status *st);
pie_code wrk_coll_tcp_check(wrk_coll_tcp *t, const char *op, pie_status *st);
void wrk_coll_tcp_abort(wrk_coll_tcp *t);

#endif
