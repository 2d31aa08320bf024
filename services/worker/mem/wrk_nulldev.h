/* wrk_nulldev.h — the null backend's emulated device (issue 13): how long a forward batch would
 * take on a GPU-like device whose KV memory is stretched by the swap policy, so that a worker
 * with `backend: null` runs the real memory-policy code (wrk_memrt, wrk_mempol, wrk_expand,
 * effective capacity, CapacityChange) at GPU ratios, and benchmarks can drive the same code in
 * virtual time.
 *
 * Owns: the cost model and its state. A forward batch of T input tokens attending K context
 * tokens (summed over its items) costs batch_us + T·token_us (launch-bound fixed part, as the
 * null backend always had) plus one pass over the n layers, each computing for
 *   t_c = layer_us + T·layer_token_us + K·layer_kv_us
 * while the layer-wise FIFO pipeline of the pooling paper (mem/wrk_swapsim.h, kept between
 * batches) moves layer caches over the link: with S of the n layers on the device, a layer's
 * device buffer is D/S bytes (D = memory.device_kv: each layer's cache grows as layers leave,
 * seed 000 §3.1) and one transfer takes t_s = (D/S) / link bytes per second (0: instant).
 * Compute waiting for a layer still in transfer is a stall; it counts in the batch's time.
 * Everything is virtual time: this file never sleeps (the null backend sleeps the result).
 *
 * Offload (offload_device_pages > 0; Neo, seed 004): the device runs the real load-aware
 * scheduler (mem/wrk_offplace.h over wrk_offload.h) on the batch's items with the costs a
 * profile of this device would measure (the linear layers at 1 and 16 rows — lin_fixed the
 * 1-row pass, lin_tok the slope between the two, (t(16) − t(1)) / 15, not the cpu engine's
 * t(16) / 16, which at GPU ratios counts the weights' pass in every token and overstates a large
 * batch's linear time several times —, attention per KV token on each side, the link per
 * token), keeps where each page lives, and times the step it chose. With offload_defer the
 * scheduler may defer a host decode (item_state): it is not run, and the caller offers it again
 * (wrk_offplace.h). With lin(t) = layer_us + t·layer_token_us (0 for t = 0),
 * sub-batch 0 = the prefills and the decodes kept on the device (T0 tokens, K0 KV tokens),
 * sub-batch 1 = the decodes attended on the host (T1, K1), per layer
 *   device-only:    lin(T) + K·layer_kv_us
 *   two sub-batches: max(lin(T0), K1·host_attn_kv_us) + lin(T1) + K0·layer_kv_us
 * (Neo's asymmetric pipeline: the host attends sub-batch 1 while the device runs sub-batch 0's
 * linear layers), n layers of it plus the fixed part, and never less than the step's page moves
 * over the link (overlapped layer by layer). The device waited for the host for
 * n·max(0, K1·host_attn_kv_us − lin(T0)). The scheduler estimates with a roofline of the two
 * probes (wrk_offload.h), the device times with the sum above: the scheduler's model error is
 * part of what a benchmark measures.
 *
 * Thread safety: every function may be called from any thread (one mutex). Does not own: the
 * slot-count decision (wrk_mempol/wrk_expand), sleeping, real data (the null backend holds
 * none). */
#ifndef WRK_NULLDEV_H
#define WRK_NULLDEV_H

#include <stdbool.h>
#include <stdint.h>

#include "pie_status.h"
#include "wrk_offload.h"
#include "wrk_offplace.h"

typedef struct wrk_nulldev_config {
    uint32_t n_layers;       /* 1..WRK_SWAPSIM_MAX_LAYERS */
    uint32_t page_size;      /* tokens per KV page (the null backend counts context tokens) */
    double batch_us;         /* per forward batch, fixed */
    double token_us;         /* per input token, outside the layers */
    double layer_us;         /* per layer of a forward batch, fixed */
    double layer_token_us;   /* per layer per input token */
    double layer_kv_us;      /* per layer per context token attended */
    double host_attn_kv_us;  /* offload: host attention per layer per context token */
    double link_bytes_per_s; /* device <-> host, each way; 0: transfers take no time */
    uint64_t device_kv;      /* D: the device's KV memory, bytes */
    uint32_t slots;          /* layers on the device at start (n: no swapping) */
    uint32_t min_slots;      /* fewest set_slots accepts (0: 2, or n if n < 2) */
    /* offload: 0 off; else the device's share of the page ids [0, kv_pages) */
    uint32_t offload_device_pages;
    uint32_t kv_pages;          /* page ids (offload) */
    uint64_t page_layer_bytes;  /* one page of one layer: what moves per page per layer */
    uint32_t max_items;         /* most items of one forward batch (offload; 0: 4096) */
    /* offload: the caller runs only what the scheduler does not defer (Neo's rules,
     * wrk_offload.h; wrk_nulldev_batch.item_state says which). The worker runs the
     * controller's batches whole and leaves it off; a benchmark standing in for a controller
     * that re-queues a deferred item turns it on. */
    bool offload_defer;
} wrk_nulldev_config;

typedef struct wrk_nulldev_stats {
    uint32_t slots, on_host;
    uint64_t swap_in_bytes, swap_out_bytes, swaps_in, swaps_out;
    uint64_t stalls, stall_ns; /* layers waited for, time waited */
    uint64_t forwards;
    uint64_t device_ns; /* emulated device time of every forward batch so far */
    /* offload */
    uint64_t offload_steps;   /* forward batches that ran two sub-batches */
    uint64_t host_items;      /* decodes attended on the host, summed */
    uint32_t last_host_items; /* in the last forward batch */
    uint64_t host_attn_ns, last_host_attn_ns; /* host attention time: summed, last batch */
    uint64_t host_wait_ns;    /* the device waited for host attention, summed */
    wrk_offplace_stats place; /* pages on each side, moves, forced steps */
} wrk_nulldev_stats;

/* One forward batch as the device would run it. */
typedef struct wrk_nulldev_batch {
    double time_s;    /* all of it: fixed part + layers + stalls */
    double compute_s; /* the layers' compute alone (n · t_c) */
    double stall_s;
    double t_layer_s, t_swap_s; /* t_c and t_s of this batch */
    uint32_t host_items;        /* offload: decodes attended on the host */
    double host_s, wait_s;      /* offload: host attention, the device's wait for it */
    uint32_t deferred;          /* offload with offload_defer: items skipped this step */
    /* offload: per item WRK_OFF_DEVICE, _HOST or _DEFER (not run: its token is not made);
     * the device's scratch, valid until its next forward; NULL without offload */
    const uint8_t *item_state;
} wrk_nulldev_batch;

typedef struct wrk_nulldev wrk_nulldev;

/* Fails (INVALID_ARGUMENT) for 0 or more than WRK_SWAPSIM_MAX_LAYERS layers, a negative cost. */
pie_code wrk_nulldev_create(const wrk_nulldev_config *c, wrk_nulldev **out, pie_status *st);
void wrk_nulldev_destroy(wrk_nulldev *d);

/* Runs one forward batch of `tokens` input tokens attending `kv_tokens` context tokens. */
wrk_nulldev_batch wrk_nulldev_forward(wrk_nulldev *d, uint64_t tokens, uint64_t kv_tokens);
/* One forward batch of the null backend's items: under offload the scheduler's split, the page
 * moves and the step it chose (above); otherwise wrk_nulldev_forward of the batch's input tokens
 * and the tokens of its pages. INVALID_ARGUMENT for more than max_items items under offload. */
pie_code wrk_nulldev_forward_items(wrk_nulldev *d, const wrk_offplace_item *items, uint32_t n,
                                   wrk_nulldev_batch *out, pie_status *st);
/* Scratch for n items of a forward batch (NULL above max_items): the null backend fills it. */
wrk_offplace_item *wrk_nulldev_items(wrk_nulldev *d, uint32_t n);
/* Offload's page bookkeeping: pages cleared (empty, on the device), a page written by a copy. */
void wrk_nulldev_cleared(wrk_nulldev *d, const uint32_t *pages, uint32_t n);
void wrk_nulldev_copied(wrk_nulldev *d, uint32_t dst);
/* Pages freed by the worker (wrk_offplace_freed). */
void wrk_nulldev_freed(wrk_nulldev *d, const uint32_t *pages, uint32_t n);
/* The costs the scheduler uses: this device's profile (zero without offload). */
wrk_off_costs wrk_nulldev_offload_costs(const wrk_nulldev *d);
/* What a batch would cost with no swapping (every layer on the device): the `gpu` baseline. */
double wrk_nulldev_compute_s(const wrk_nulldev *d, uint64_t tokens, uint64_t kv_tokens);
/* From the next batch on at most `slots` layers on the device (clamped to min_slots..n). */
uint32_t wrk_nulldev_set_slots(wrk_nulldev *d, uint32_t slots);
/* The link's bandwidth from the next batch on (a benchmark halves it mid-run). */
void wrk_nulldev_set_link(wrk_nulldev *d, double bytes_per_s);
void wrk_nulldev_get_stats(wrk_nulldev *d, wrk_nulldev_stats *out);
const wrk_nulldev_config *wrk_nulldev_config_of(const wrk_nulldev *d);

#endif
