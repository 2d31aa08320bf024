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
 * host_attn_kv_us is the host's attention time per context token per layer, carried for the
 * offload policy's emulation (not used by the swap pipeline). Thread safety: every function
 * may be called from any thread (one mutex). Does not own: the slot-count decision
 * (wrk_mempol/wrk_expand), sleeping, real data (the null backend holds none). */
#ifndef WRK_NULLDEV_H
#define WRK_NULLDEV_H

#include <stdbool.h>
#include <stdint.h>

#include "pie_status.h"

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
} wrk_nulldev_config;

typedef struct wrk_nulldev_stats {
    uint32_t slots, on_host;
    uint64_t swap_in_bytes, swap_out_bytes, swaps_in, swaps_out;
    uint64_t stalls, stall_ns; /* layers waited for, time waited */
    uint64_t forwards;
    uint64_t device_ns; /* emulated device time of every forward batch so far */
} wrk_nulldev_stats;

/* One forward batch as the device would run it. */
typedef struct wrk_nulldev_batch {
    double time_s;    /* all of it: fixed part + layers + stalls */
    double compute_s; /* the layers' compute alone (n · t_c) */
    double stall_s;
    double t_layer_s, t_swap_s; /* t_c and t_s of this batch */
} wrk_nulldev_batch;

typedef struct wrk_nulldev wrk_nulldev;

/* Fails (INVALID_ARGUMENT) for 0 or more than WRK_SWAPSIM_MAX_LAYERS layers, a negative cost. */
pie_code wrk_nulldev_create(const wrk_nulldev_config *c, wrk_nulldev **out, pie_status *st);
void wrk_nulldev_destroy(wrk_nulldev *d);

/* Runs one forward batch of `tokens` input tokens attending `kv_tokens` context tokens. */
wrk_nulldev_batch wrk_nulldev_forward(wrk_nulldev *d, uint64_t tokens, uint64_t kv_tokens);
/* What a batch would cost with no swapping (every layer on the device): the `gpu` baseline. */
double wrk_nulldev_compute_s(const wrk_nulldev *d, uint64_t tokens, uint64_t kv_tokens);
/* From the next batch on at most `slots` layers on the device (clamped to min_slots..n). */
uint32_t wrk_nulldev_set_slots(wrk_nulldev *d, uint32_t slots);
/* The link's bandwidth from the next batch on (a benchmark halves it mid-run). */
void wrk_nulldev_set_link(wrk_nulldev *d, double bytes_per_s);
void wrk_nulldev_get_stats(wrk_nulldev *d, wrk_nulldev_stats *out);
const wrk_nulldev_config *wrk_nulldev_config_of(const wrk_nulldev *d);

#endif
