/* wrk_backend.h — the compute behind the worker's executor: the engine (cpu backend), its cuda
 * backend, or the benchmark-only null backend, behind one table of functions with eng.h's
 * signatures.
 *
 * Owns: the null backend (every handler succeeds at once, or after the emulated device's time
 * for forward batches; next_dist returns token ids 0..k-1 with a fixed descending distribution; it
 * holds no storage, so clearing is nothing), the
 * adapters that call the engines, and opening the cuda engine (wrk_backend_open_cuda: present in
 * every build; without nvcc at build time it says so). Does not own: validation against capacities
 * and slot liveness (wrk_exec.c checks that before any backend call), the engines themselves
 * (engine/eng.h, engine/eng_cuda.h). */
#ifndef WRK_BACKEND_H
#define WRK_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "eng.h"
#include "pie_status.h"

typedef struct wrk_backend {
    const char *name; /* "cpu", "cuda", "null" */
    void *ctx; /* the eng for "cpu", the eng_cuda for "cuda"; the wrk_nulldev (or NULL) for "null" */
    pie_code (*embed_text)(void *ctx, const uint32_t *slots, const uint32_t *tokens,
                           const uint32_t *positions, uint32_t n, pie_status *st);
    pie_code (*forward)(void *ctx, const eng_forward_item *items, uint32_t n, pie_status *st);
    /* Deferral (eng_forward_plan, eng_forward_skip); NULL: this backend never defers (null,
     * cuda). */
    pie_code (*forward_plan)(void *ctx, const eng_forward_item *items, uint32_t n, uint8_t *defer,
                             pie_status *st);
    pie_code (*forward_skip)(void *ctx, const eng_forward_item *items, uint32_t n,
                             const uint8_t *skip, pie_status *st);
    pie_code (*mask_page)(void *ctx, uint32_t page, const bool *masked, pie_status *st);
    pie_code (*copy_pages)(void *ctx, const eng_copy_item *items, uint32_t n, pie_status *st);
    pie_code (*next_dist)(void *ctx, eng_dist_item *items, uint32_t n, pie_status *st);
    /* What a fresh allocation holds: zeroed K/V and an all-visible mask / a zeroed embedding
     * (eng_clear_pages, eng_clear_embeds). */
    pie_code (*clear_pages)(void *ctx, const uint32_t *pages, uint32_t n, pie_status *st);
    pie_code (*clear_embeds)(void *ctx, const uint32_t *slots, uint32_t n, pie_status *st);
    /* Pages a slot batch freed (eng_pages_freed); NULL: nothing to tell. */
    void (*pages_freed)(void *ctx, const uint32_t *pages, uint32_t n);
    void (*close)(void *ctx); /* releases ctx when the backend owns it (cuda); NULL otherwise */
    /* The swap policy's engine side (eng_swap_get_stats, eng_swap_set_slots and their cuda
     * twins); NULL where the backend has none (null: its emulated device, wrk_memrt). */
    void (*swap_get_stats)(void *ctx, eng_swap_stats *out);
    pie_code (*swap_set_slots)(void *ctx, uint32_t slots, uint32_t *applied, pie_status *st);
    /* The offload policy's engine side (eng_offload_get_stats, eng_cuda_offload_get_stats);
     * NULL on the null backend (its emulated device: wrk_offrt_nulldev_stats). */
    void (*offload_get_stats)(void *ctx, eng_offload_stats *out);
} wrk_backend;

/* Handlers that call e (borrowed; it must outlive every use of *b). */
void wrk_backend_engine(wrk_backend *b, eng *e);

/* The null backend's emulated device (config keys null.*): a forward batch of T input tokens
 * costs batch_us + T * token_us (a GPU's launch-bound fixed cost and its small per-token
 * cost) plus, per layer, layer_us + T * layer_token_us + K * layer_kv_us (K: context tokens
 * attended), with the swap policy's layer pipeline over memory.emulate_link_gbps in between
 * (mem/wrk_nulldev.h); host_attn_kv_us: the host's attention per layer and context token
 * (offload). The batch sleeps that long, without using a host core, so that scheduling
 * strategies and memory policies can be compared as they would be on a GPU. All zero =
 * instant results (the control plane alone). */
typedef struct wrk_null_cost {
    uint32_t batch_us, token_us;
    double layer_us, layer_token_us, layer_kv_us, host_attn_kv_us;
} wrk_null_cost;

/* The null backend; dev (borrowed; NULL = instant results) must outlive every use of *b. */
struct wrk_nulldev;
void wrk_backend_null(wrk_backend *b, struct wrk_nulldev *dev);

/* Opens the cuda engine with opts (backend field ignored) and makes *b call it; b->close
 * releases it. *info is set to its eng_info, *device to e.g. "cuda: NVIDIA H100 ... (sm_90)".
 * Fails with "backend cuda: no CUDA device (<reason>)" (PIE_UNAVAILABLE) where the machine
 * has none, and with "backend cuda: not built into this worker (nvcc was not found at build
 * time)" (PIE_UNIMPLEMENTED) in a build without CUDA. On failure *b is untouched. */
pie_code wrk_backend_open_cuda(wrk_backend *b, const eng_opts *opts, const eng_info **info,
                               char *device, size_t device_len, pie_status *st);

/* Releases what the backend owns (b->close), then clears *b. */
void wrk_backend_release(wrk_backend *b);

/* Whether the cuda backend met a device fault (eng_cuda_fault): the CUDA context of the process
 * is lost and every later call would fail. When it happens the worker logs wrk.device_fault
 * with the reason (the batch that met it fails with the same message) and stops as if by
 * SIGTERM, leaving the cluster; main then exits 1 saying why. why ← the fault. Always false in
 * a build without CUDA. */
bool wrk_backend_fault(char *why, size_t cap);

#endif
