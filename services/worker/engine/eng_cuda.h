/* eng_cuda.h — the cuda backend of the engine: eng.h's handlers on one CUDA device.
 *
 * Owns: the same contract as eng.h (ragged forward batches over physical KV pages and
 * embedding slots, page mask and copy, next-token distributions, the same validation and error
 * messages), implemented with kernels/cuda and cuBLAS. The functions mirror eng.h one to one;
 * a worker with `backend: cuda` calls these instead (services/worker/wrk_backend.c).
 * Does not own: the contract's definition (eng.h, README.md), the kernels (kernels/cuda).
 *
 * Differences a caller can observe (all documented in docs/cuda.md):
 *  - numerics: weights are stored in bf16 on the device whatever the file's dtype, KV pages are
 *    bf16, activations and accumulations f32 (the CPU backend keeps f32 KV);
 *  - capacities fixed at open besides max_batch_tokens: the page lists of one forward batch may
 *    name at most 4 * kv_pages + max_batch_tokens pages in all, and its explicit masks at most
 *    max(2^20, 4 * (kv_pages * kv_page_size + max_batch_tokens)) runs in all (refused with
 *    RESOURCE_EXHAUSTED beyond), next_dist's top_k is at most 1024;
 *  - eng_open fails with "eng_open: backend cuda: no CUDA device (<driver's reason>)"
 *    (UNAVAILABLE) where there is none.
 * n_threads in eng_opts is ignored. Not thread-safe: one handler at a time, from any thread
 * (each handler makes the engine's device current first).
 *
 * Tensor parallelism (eng_opts.nccl, eng_cuda_tp.c): the engine is rank tp_rank of tp_size and
 * holds eng_shard.h's shard on its device (the process's device 0: one GPU per rank process);
 * the forward all-reduces after o_proj and down_proj on the compute stream (captured in the
 * decode graphs), embed_text is vocabulary-parallel, next_dist merges the ranks' local top-k
 * exactly, logits gathers the slices. Without NCCL built, tp_size > 1 is refused
 * (UNIMPLEMENTED). Without eng_opts.nccl the engine is the single-GPU one, unchanged. */
#ifndef ENG_CUDA_H
#define ENG_CUDA_H

#include <stddef.h>

#include "eng.h"

typedef struct eng_cuda eng_cuda;

/* Most top_k next_dist accepts (the CPU backend accepts up to the vocabulary). */
#define ENG_CUDA_TOPK_MAX 1024u

pie_code eng_cuda_open(const eng_opts *opts, eng_cuda **out, pie_status *st);
void eng_cuda_close(eng_cuda *e);
const eng_info *eng_cuda_get_info(const eng_cuda *e);

/* The device's name and compute capability, e.g. "NVIDIA H100 80GB HBM3 (sm_90)". */
const char *eng_cuda_device_name(const eng_cuda *e);

pie_code eng_cuda_embed_text(eng_cuda *e, const uint32_t *slots, const uint32_t *tokens,
                             const uint32_t *positions, uint32_t n, pie_status *st);
pie_code eng_cuda_forward(eng_cuda *e, const eng_forward_item *items, uint32_t n, pie_status *st);
pie_code eng_cuda_mask_page(eng_cuda *e, uint32_t page, const bool *masked, pie_status *st);
pie_code eng_cuda_copy_pages(eng_cuda *e, const eng_copy_item *items, uint32_t n, pie_status *st);
pie_code eng_cuda_clear_pages(eng_cuda *e, const uint32_t *pages, uint32_t n, pie_status *st);
pie_code eng_cuda_clear_embeds(eng_cuda *e, const uint32_t *slots, uint32_t n, pie_status *st);
pie_code eng_cuda_next_dist(eng_cuda *e, eng_dist_item *items, uint32_t n, pie_status *st);
pie_code eng_cuda_logits(eng_cuda *e, uint32_t slot, float *logits, pie_status *st);
pie_code eng_cuda_slot_position(eng_cuda *e, uint32_t slot, uint32_t *pos, pie_status *st);

/* What the forward pass has run since open (tests, bench_cuda). A decode step (every item one
 * input and one output, at most 128 items) is padded to a power-of-two bucket and replayed
 * from that bucket's graph, captured on first use; a bucket whose capture failed runs direct
 * launches from then on (the step still succeeds). */
typedef struct eng_cuda_stats {
    uint64_t forward_steps;     /* forward calls that ran on the device */
    uint64_t decode_steps;      /* of which decode-shaped, with graphs on */
    uint64_t graph_steps;       /* of which replayed from a graph (coverage: / decode_steps) */
    uint32_t graphs;            /* graphs captured: at most one per bucket, 8 buckets */
    uint32_t capture_failures;  /* buckets whose capture failed */
    uint32_t last_step_kernels; /* kernels of the last forward: its graph's kernel nodes when
                                   replayed, else the launches made (a cuBLAS call as 1) */
    char capture_error[256];    /* why the first capture failed; "" if none did */
} eng_cuda_stats;
void eng_cuda_get_stats(const eng_cuda *e, eng_cuda_stats *out);

/* A device fault (an illegal address, a kernel trap, an uncorrectable ECC error, ...) leaves the
 * process's CUDA context unusable: every later call fails. The first one is recorded for the
 * whole process, since the context is per process: eng_cuda_fault copies its description (the
 * failing call, where, the driver's reason) into why and returns true once one happened, and
 * the hook set by eng_cuda_on_fault (the worker's: log, leave the cluster, exit 1) is called
 * once, from the handler that met it. Errors that leave the context usable (a refused launch
 * configuration, a failed stream capture, out of memory) are not faults. */
bool eng_cuda_fault(char *why, size_t cap);
void eng_cuda_on_fault(void (*hook)(const char *why, void *arg), void *arg);

/* Whether a CUDA runtime error code (cudaError_t) is such a fault. */
bool eng_cuda_error_is_fault(int cuda_error);

/* Enables or disables graph capture/replay (default on; PIE_CUDA_GRAPHS=0 in the environment
 * at open turns it off). Benchmarks compare both; replayed and direct steps give bitwise equal
 * results. */
void eng_cuda_set_graphs(eng_cuda *e, bool on);

/* The swap policy (eng_opts.swap_slots > 0; issue 13, eng_cuda_swap.c): the device holds the
 * KV of swap_slots layers at start, the host pool (swap_host_bytes, pinned) the others, and
 * two copy streams move whole layers while the forward computes (FIFO, seed 000 Fig. 4). The
 * device's KV budget is swap_min_slots layer caches. With swap_min_slots == swap_slots it is
 * one allocation of that many buffers, for good. With fewer (adaptive expansion) every layer
 * has an address range and the budget is committed as the used prefix grows (the driver's
 * virtual memory calls), so more layers fit while fewer pages are in use: set_slots applies
 * at most the budget over the used prefix (the return value says what). Decode steps do not
 * replay graphs (a layer's cache moves between steps). Not with tensor parallelism
 * (refused). Results are bit for bit those of policy gpu. Without the policy: stats all zero,
 * set_slots refused. */
pie_code eng_cuda_swap_set_slots(eng_cuda *e, uint32_t slots, uint32_t *applied, pie_status *st);
void eng_cuda_swap_get_stats(eng_cuda *e, eng_swap_stats *out);
void eng_cuda_swap_quiesce(eng_cuda *e);

/* CPU attention offload (eng_opts.offload_device_pages > 0; issue 13, eng_cuda_off.c): every
 * page id has its home in a pinned host pool of kv_pages pages per layer, and the device holds
 * offload_device_pages of them per layer, moved in and out as steps need them; decode items
 * (one input, appended, no mask) that the scheduler (or offload_pick) sends to the host have
 * their attention run by offload_host_threads host threads with the cpu kernels over the
 * homes: such a step runs as two sub-batches, the host attention of the second overlapping
 * the device's layer of the first. Results are policy gpu's within the two
 * attention kernels' rounding. Not with tensor parallelism or swap (refused). A step whose
 * device items need more pages than the device holds fails (RESOURCE_EXHAUSTED). Without the
 * policy: stats all zero, pages_freed does nothing. */
void eng_cuda_offload_get_stats(eng_cuda *e, eng_offload_stats *out);
/* Pages the worker freed: their KV is never read again (eng_pages_freed's contract). */
void eng_cuda_pages_freed(eng_cuda *e, const uint32_t *pages, uint32_t n);

#endif
