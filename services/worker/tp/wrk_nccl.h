/* wrk_nccl.h — NCCL for a cuda tensor-parallel group: one communicator per rank process, the
 * collectives the sharded cuda engine needs, on its compute stream.
 *
 * Owns: the unique id (rank 0 makes it; the ranks receive it in TpJoin's answer or over the
 * host collective, wrk_tp.c), the communicator (rank, size, the rank's CUDA device), all-reduce
 * sum in place (f32, bf16), all-gather, broadcast, and turning ncclResult_t and the
 * communicator's asynchronous errors into pie_status messages.
 * Does not own: which data moves when (engine/eng_cuda*.c), the group's formation and the step
 * fan-out (wrk_tp.c, over the host collective wrk_coll.h), choosing the device (wrk_tp_cuda.h).
 *
 * Every collective is enqueued on the caller's stream and returns without waiting, so it may be
 * called while that stream is being captured into a CUDA graph (the decode steps are graphs;
 * NCCL >= 2.9 supports capture). Every rank must call the same collectives in the same order
 * with the same sizes. Errors: a call NCCL refuses fails with PIE_INTERNAL "nccl: <op> failed:
 * <ncclGetErrorString>: <ncclGetLastError>"; a failure discovered later (a peer died, a network
 * error) is found by wrk_nccl_check (ncclCommGetAsyncError), after which the communicator is
 * aborted and every call fails UNAVAILABLE: the group is re-formed, never repaired.
 * Built only where NCCL was found (PIE_HAVE_NCCL, top-level CMakeLists.txt). One thread at a
 * time per communicator. */
#ifndef WRK_NCCL_H
#define WRK_NCCL_H

#include <stddef.h>
#include <stdint.h>

#include "pie_status.h"

#define WRK_NCCL_ID_BYTES 128 /* NCCL_UNIQUE_ID_BYTES */

typedef struct wrk_nccl wrk_nccl;
struct CUstream_st; /* cudaStream_t is struct CUstream_st * (no CUDA header needed here) */

typedef enum wrk_nccl_dtype { WRK_NCCL_F32 = 1, WRK_NCCL_BF16 = 2 } wrk_nccl_dtype;

/* A fresh unique id (ncclGetUniqueId: it opens rank 0's bootstrap listener in this process,
 * which must live until the group formed). One per formation (epoch). */
pie_code wrk_nccl_unique_id(uint8_t id[WRK_NCCL_ID_BYTES], pie_status *st);

/* Rank `rank` of `size` on CUDA device `device` joins the communicator of `id`: blocks until
 * every rank called it (ncclCommInitRank). INVALID_ARGUMENT for rank >= size. */
pie_code wrk_nccl_open(const uint8_t id[WRK_NCCL_ID_BYTES], uint32_t rank, uint32_t size,
                       int device, wrk_nccl **out, pie_status *st);
/* Releases this rank's communicator without waiting for the others (ncclCommAbort). NULL is
 * fine. */
void wrk_nccl_close(wrk_nccl *c);

uint32_t wrk_nccl_rank(const wrk_nccl *c);
uint32_t wrk_nccl_size(const wrk_nccl *c);

/* buf[count] of dtype on the device ← the elementwise sum over the ranks (in place). */
pie_code wrk_nccl_allreduce_sum(wrk_nccl *c, void *buf, size_t count, wrk_nccl_dtype dtype,
                                struct CUstream_st *stream, pie_status *st);
/* recv[size][bytes] ← every rank's send[bytes], in rank order (device pointers; send may be
 * recv + rank * bytes, in place). */
pie_code wrk_nccl_allgather(wrk_nccl *c, const void *send, void *recv, size_t bytes,
                            struct CUstream_st *stream, pie_status *st);
/* buf[bytes] ← root's buf[bytes] on every rank. */
pie_code wrk_nccl_bcast(wrk_nccl *c, void *buf, size_t bytes, uint32_t root,
                        struct CUstream_st *stream, pie_status *st);

/* The communicator's asynchronous state: OK, or the first error (then the communicator is
 * aborted and UNAVAILABLE from here on). Call after the stream's work was waited for. */
pie_code wrk_nccl_check(wrk_nccl *c, pie_status *st);

/* The longest wait for the group's collectives within one wrk_nccl_sync (tp.timeout); 0: no
 * bound. wrk_nccl_open sets WRK_NCCL_DEFAULT_TIMEOUT_MS. */
#define WRK_NCCL_DEFAULT_TIMEOUT_MS 30000u
void wrk_nccl_set_timeout(wrk_nccl *c, uint32_t timeout_ms);

/* Waits for `stream`'s work without trusting the peers: a cudaStreamSynchronize would wait
 * forever for a collective whose peer hangs (stopped, or stuck in a kernel), since NCCL's
 * kernels spin until every rank arrives. Polls the stream and the communicator's asynchronous
 * error; past the timeout, or at an asynchronous error, the communicator is aborted (its
 * kernels return) and the call fails UNAVAILABLE naming the reason — the group is re-formed,
 * never repaired. A CUDA error of the stream itself is left in *cuda_err (a cudaError_t; 0
 * when none) with PIE_OK, for the caller's own CUDA error path (device faults). */
pie_code wrk_nccl_sync(wrk_nccl *c, struct CUstream_st *stream, int *cuda_err, pie_status *st);

/* OK when CUDA device `device` exists for this process; UNAVAILABLE naming the driver's
 * reason or "this process sees N CUDA devices" otherwise. */
pie_code wrk_nccl_device_ok(int device, pie_status *st);

/* "2.28.3": the NCCL library loaded at run time (ncclGetVersion). */
void wrk_nccl_version(char *out, size_t cap);

#endif
