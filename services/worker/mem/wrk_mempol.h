/* wrk_mempol.h — the worker's memory policy (issue 13): what the `memory.*` keys of the worker
 * config mean for its pools, and the swap policy's adaptive expansion between steps.
 *
 * Owns: the sizing (how many page ids the worker offers, how many of them fit with every layer
 * on the device, how small the host pool may be) and the epoch loop that feeds wrk_expand with
 * what the steps measured. Sizing, with n layers, B = bytes of one page of one layer, D =
 * memory.device_kv: with S of the n layers' caches on the device each layer's cache holds
 * D / (S·B) pages (the pooling paper §3.1: expansion n/S), so
 *   kv_pages_gpu       = D / (n·B)            (every layer on the device: policy gpu's pool)
 *   kv_pages_effective = D / (S·B)            (what the controller may allocate now)
 *   kv_pages_max       = D / (min_slots·B)    (page ids: the most expanded point)
 * and the host region must hold n - min_slots + 2 layer caches of kv_pages_max pages (the FIFO
 * keeps one layer in flight each way): min_slots is the smallest count >= 2 for which
 * memory.host_pool suffices. Offload (Neo) moves whole pages, every layer at once:
 *   kv_pages_gpu       = D / (n·B)            (pages the device holds)
 *   kv_pages_max       = kv_pages_effective = kv_pages_gpu + host_pool / (n·B)
 * and host_bytes = (kv_pages_max - kv_pages_gpu)·n·B. Does not own: moving data (wrk_tier.h,
 * the engine's offload), the decision rules (wrk_expand.h, wrk_offload.h), measuring (the
 * executor). */
#ifndef WRK_MEMPOL_H
#define WRK_MEMPOL_H

#include <stdbool.h>
#include <stdint.h>

#include "pie_status.h"
#include "wrk_expand.h"

typedef enum wrk_mem_policy {
    WRK_MEM_GPU = 0,
    WRK_MEM_SWAP = 1,
    WRK_MEM_OFFLOAD = 2, /* CPU attention offload (Neo; wrk_offload.h) */
    WRK_MEM_AUTO = 3,    /* swap or offload, chosen at load (wrk_mem_auto_choose) */
} wrk_mem_policy;

/* "gpu", "swap", "offload", "auto", NULL: the config's choices, in enum order. */
extern const char *const wrk_mem_policy_names[];

typedef struct wrk_mem_config {
    wrk_mem_policy policy;
    uint64_t device_kv;     /* bytes of KV on the device; 0: pool.kv_pages with every layer */
    uint64_t host_pool;     /* bytes of the host pool */
    uint32_t device_layers; /* swap: this many layers on the device, fixed; 0: adaptive */
    double link_gbps;       /* emulated link (cpu backend), gigabits/s each way; 0: none */
} wrk_mem_config;

/* The model and pool as the engine will hold them. */
typedef struct wrk_mem_shape {
    uint32_t n_layers;
    uint64_t page_layer_bytes; /* B */
    uint32_t pool_pages;       /* pool.kv_pages: policy gpu's pages, device_kv's default */
    uint32_t max_pages;        /* most pages the engine accepts (its id limit) */
    uint32_t page_size;        /* tokens per page (pool.kv_page_size; 0: 16) */
} wrk_mem_shape;

typedef struct wrk_mem_plan {
    wrk_mem_policy policy;
    uint32_t n_layers;
    uint64_t page_layer_bytes;
    uint32_t page_size;    /* tokens per page */
    uint64_t device_kv;    /* D */
    uint32_t kv_pages_max; /* the engine's kv_pages */
    uint32_t kv_pages_gpu;
    uint32_t min_slots;   /* swap: fewest layers on the device */
    uint32_t start_slots; /* swap: layers on the device at start (n when adaptive) */
    bool adaptive;
    uint64_t host_bytes;     /* swap, offload: host region for the engine (0 otherwise) */
    double link_bytes_per_s; /* swap: emulated link (0: none) */
} wrk_mem_plan;

/* Sizes the pools for c over s. gpu: kv_pages_max = effective = gpu = pool_pages. Refuses
 * auto (UNIMPLEMENTED: the worker chooses swap or offload first), a device_kv that holds no
 * page, a host pool too small for even two layers on the host (swap) or one page of every
 * layer (offload), each with a message naming the key and the numbers. */
pie_code wrk_mem_plan_make(const wrk_mem_config *c, const wrk_mem_shape *s, wrk_mem_plan *p,
                           pie_status *st);

/* Pages the controller may allocate with `slots` layers on the device (gpu: kv_pages_max). */
uint32_t wrk_mem_effective(const wrk_mem_plan *p, uint32_t slots);
/* The most layers on the device (min_slots..n) whose effective capacity holds `pages`; 0 if
 * not even min_slots does (more pages than kv_pages_max). */
uint32_t wrk_mem_slots_for(const wrk_mem_plan *p, uint32_t pages);

/* Adaptive expansion between steps: observations gathered over epoch_steps forward steps. */
typedef struct wrk_mem_adapt {
    wrk_expand ex;
    const wrk_mem_plan *plan;
    uint32_t epoch_steps;
    uint32_t steps;
    uint64_t tokens, busy_ns, stall_ns;
    bool kv_limited; /* some step of the epoch ran with nearly every effective page live */
    uint32_t kv_live_max;
    uint32_t settle; /* steps still to skip after a change of the slot count */
} wrk_mem_adapt;

/* Forward steps not observed after the slot count changes: the pipeline's transient (layers
 * leaving or coming back) is the change's cost, not the new count's steady state (the pooling
 * paper tolerates brief interference without adjusting, §3.4.2). */
#define WRK_MEM_SETTLE_STEPS 2

void wrk_mem_adapt_init(wrk_mem_adapt *a, const wrk_mem_plan *p, uint32_t epoch_steps);

/* One forward step: tokens it ran, its time, the time compute waited for swaps during it, the
 * KV pages live after it. Returns the slot count for the next steps (unchanged inside an
 * epoch; at an epoch's end wrk_expand's decision). An epoch is epoch_steps observed steps;
 * the WRK_MEM_SETTLE_STEPS after a change are not observed. */
uint32_t wrk_mem_adapt_step(wrk_mem_adapt *a, uint64_t tokens, uint64_t busy_ns, uint64_t stall_ns,
                            uint32_t kv_live);
/* The slot count was set from outside the epoch loop (a spill grew the capacity to hold the
 * live pages, wrk_memrt.h): the loop goes on from `slots`, holding there (a plateau) with a
 * fresh epoch after the settling steps. */
void wrk_mem_adapt_force(wrk_mem_adapt *a, uint32_t slots);

#endif
