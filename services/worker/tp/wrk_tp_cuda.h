/* wrk_tp_cuda.h — what a cuda tensor-parallel group needs beyond a cpu one, in plain C (no CUDA
 * or NCCL header: unit-tested on any machine).
 *
 * Owns: refusing a cuda group this build cannot run (no NCCL); the GPU of each forked rank
 * (its CUDA_VISIBLE_DEVICES: one GPU per rank process, so the engine always opens device 0
 * and NCCL sees distinct GPUs); the NCCL unique id in TpJoin's answer (rank 0 writes it,
 * a joining rank reads and checks it).
 * Does not own: the communicator (wrk_nccl.c), the group's formation (wrk_tp.c), TpJoin's other
 * checks (wrk_tp_offer_admit). */
#ifndef WRK_TP_CUDA_H
#define WRK_TP_CUDA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pie_status.h"

#define WRK_TP_NCCL_ID_BYTES 128 /* wrk_nccl.h's WRK_NCCL_ID_BYTES, NCCL_UNIQUE_ID_BYTES */

/* Whether this binary was built with NCCL (the caller passes PIE_WITH_NCCL). tp_size > 1
 * without it: UNIMPLEMENTED "tp.size N with backend cuda needs NCCL, and this pie-worker was
 * built without it (nccl.h and libnccl were not found at build time; docs/cuda.md)". */
pie_code wrk_tp_cuda_check(uint32_t tp_size, bool nccl_built, pie_status *st);

/* The CUDA_VISIBLE_DEVICES of rank `rank` of `size` ranks forked on one node: the rank-th
 * entry of the launcher's own list `parent` (NULL or "": every GPU, so "<rank>"). A list with
 * fewer than `size` entries is refused (FAILED_PRECONDITION, "tp.size 4 needs 4 GPUs, one per
 * rank, but CUDA_VISIBLE_DEVICES \"0,1\" lists 2"). */
pie_code wrk_tp_cuda_visible(const char *parent, uint32_t rank, uint32_t size, char *out,
                             size_t cap, pie_status *st);

struct Pie__V1__TpJoinResponse;

/* Rank 0 of a cuda group: the answer carries the NCCL unique id (COLLECTIVE_NCCL; the host
 * endpoint is still set by the caller: the steps' fan-out runs on the host collective). id is
 * borrowed by resp until it is sent. */
void wrk_tp_cuda_answer(struct Pie__V1__TpJoinResponse *resp, const uint8_t *id);

/* A joining rank: checks the answer's collective against what this rank runs (want_nccl: a
 * cuda rank) and copies the id. FAILED_PRECONDITION for a cuda rank answered without an id of
 * WRK_TP_NCCL_ID_BYTES bytes, a cpu rank answered anything but COLLECTIVE_HOST (rank 0 runs
 * another backend). */
pie_code wrk_tp_cuda_read_answer(const struct Pie__V1__TpJoinResponse *resp, bool want_nccl,
                                 uint8_t id[WRK_TP_NCCL_ID_BYTES], pie_status *st);

#endif
