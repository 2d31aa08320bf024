/* wrk_tier.h — the swap policy's data path (issue 13; the pooling paper, seed 000, §3.2–3.3 and
 * Fig. 4): where each layer's KV cache lives, and the copy engine that moves it.
 *
 * Owns: two regions of layer-sized buffers — the "device" region (n buffers, of which at most
 * `slots` hold a layer at once: the device KV budget) and the "host" region (host_buffers) —,
 * the mapping table (logical layer → the buffer holding it, updated in two phases: prepare sets
 * the destination and marks the layer moving; publish, after the copy ended, makes the
 * destination the layer's home and frees the source), and the copy engine: one thread per link
 * direction, each moving one layer at a time — the prefix of its buffer ever written
 * (wrk_tier_touch: the pages in use so far; the rest is zero everywhere) — with an optional
 * emulated bandwidth.
 *
 * Policy (the paper's, FIFO): the engine says which layer it computes next (acquire) and when it
 * is done with it (release). Distance of layer l from the cursor c is (l - c) mod n: the hottest
 * layer is the one needed soonest (the next step's first layers included, so the link prefetches
 * across steps), the coldest the one just computed. Whenever a transfer ends or the cursor
 * moves: the idle in-direction fetches the hottest host layer into a free slot; the idle
 * out-direction evicts the coldest device layer when more layers are on the device than `slots`
 * allow, or when the slots are full and a host layer is hotter than it (the paper's exception:
 * no swap-out when every host layer is colder than every device layer). The layer being
 * computed is never moved. Every layer's buffer is sized for the whole page-id space, so a page
 * id is the same offset wherever its layer lives and no id changes when data moves.
 *
 * Threads: the decisions and the table are under one mutex; the engine thread and the two copy
 * threads take it. Data of a layer is touched only by its owner of the moment: the engine while
 * the layer is resident and not moving, a copy thread while it moves.
 * Does not own: choosing `slots` (wrk_expand.h), what the pages mean (the engine). */
#ifndef WRK_TIER_H
#define WRK_TIER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pie_status.h"

/* Copies bytes from src to dst (a test can make it fail); returns PIE_OK or sets st. */
typedef pie_code (*wrk_tier_copy_fn)(void *user, void *dst, const void *src, size_t bytes,
                                     pie_status *st);

/* A real device behind the "device" region (the cuda backend; NULL: both regions are host
 * memory and layers move with `copy` or memcpy). */
typedef struct wrk_tier_mem {
    void *user;
    /* The device region, zeroed; released by dev_free at close. */
    pie_code (*dev_alloc)(void *user, size_t bytes, void **out, pie_status *st);
    void (*dev_free)(void *user, void *p);
    /* Pins the host region (mapped and NUMA-bound by the tier) for the device's copy engines;
     * undone by host_unpin at close. */
    pie_code (*host_pin)(void *user, void *p, size_t bytes, pie_status *st);
    void (*host_unpin)(void *user, void *p);
    /* Moves the first `bytes` of layer l (instead of `copy`), on the calling copy thread, and
     * returns when they have arrived; to_host: out of the device region (the device must be
     * done with the layer first: it was released, its work may still be queued). */
    pie_code (*move)(void *user, uint32_t l, bool to_host, void *dst, const void *src,
                     size_t bytes, pie_status *st);
    /* Optional (both or neither): a device region committed as it is used, for a device
     * budget that holds more layers while fewer pages are in use (adaptive expansion).
     * dev_alloc then only reserves the addresses (each buffer starts dev_step-aligned:
     * buffers are spaced layer_bytes rounded up to dev_step); dev_commit makes [have, want) of
     * a buffer usable and zero (both multiples of dev_step); dev_decommit gives [0, have)
     * back. The tier commits a layer's buffer to the used prefix rounded up to dev_step when
     * the layer takes it and whenever the prefix grows, decommits free buffers when another
     * needs their memory, and runs at most device_bytes / that many layers on the device. */
    pie_code (*dev_commit)(void *user, void *buf, size_t have, size_t want, pie_status *st);
    void (*dev_decommit)(void *user, void *buf, size_t have);
    size_t dev_step;       /* > 0 with dev_commit */
    uint64_t device_bytes; /* the committed memory's budget */
} wrk_tier_mem;

typedef struct wrk_tier_config {
    uint32_t n_layers;       /* n >= 1 */
    size_t layer_bytes;      /* one layer's cache for the whole page-id space */
    uint32_t slots;          /* layers the device holds at start, min_slots..n (n: no swapping) */
    uint32_t min_slots;      /* fewest slots set_slots accepts: 2..n (1 when n is 1) */
    uint32_t host_buffers;   /* >= n - min_slots + 2 (wrk_tier_host_buffers_needed) */
    /* Layer buffers of the device region: 0 means n (the cpu backend: budget enforced by the
     * page count); a real device allocates only its budget, so slots can never exceed it
     * (min_slots..device_buffers), and layers device_buffers..n-1 start on the host. */
    uint32_t device_buffers;
    const wrk_tier_mem *mem; /* NULL: host memory both sides */
    double link_bytes_per_s; /* emulated link, each direction; 0: as fast as the copy goes */
    wrk_tier_copy_fn copy;   /* NULL: memcpy */
    void *copy_user;
    bool host_numa_bind;     /* the host region on NUMA node host_numa_node (wrk_numa.h) */
    int host_numa_node;
} wrk_tier_config;

typedef struct wrk_tier_stats {
    uint32_t slots;     /* the device budget in layers now */
    uint32_t on_device; /* layers holding a device buffer (moving ones included) */
    uint32_t on_host;   /* layers whose only copy is on the host (moving in included) */
    uint64_t swap_in_bytes, swap_out_bytes, swaps_in, swaps_out;
    uint64_t stalls;   /* acquires that had to wait for a layer */
    uint64_t stall_ns; /* time the engine waited in them */
    uint64_t copy_failures;
    uint64_t committed; /* device bytes committed now (a committing device; 0 otherwise) */
} wrk_tier_stats;

typedef struct wrk_tier wrk_tier;

/* Host buffers the FIFO needs at the most expanded point: every layer but min_slots, plus one
 * in flight each way. */
uint32_t wrk_tier_host_buffers_needed(uint32_t n_layers, uint32_t min_slots);

/* Allocates both regions (zeroed; layer l starts on device buffer l — on the host past
 * device_buffers —, then the pipeline moves what `slots` does not allow) and starts the copy
 * threads. */
pie_code wrk_tier_open(const wrk_tier_config *cfg, wrk_tier **out, pie_status *st);
void wrk_tier_close(wrk_tier *t);

/* The engine is about to read or write layer l: moves the cursor to l, waits until l is on the
 * device and pins it there; *base is its buffer. Fails (the layer not acquired) when a copy
 * failed since the last call: the copy's message, once; the data stays where it was. */
pie_code wrk_tier_acquire(wrk_tier *t, uint32_t l, void **base, pie_status *st);
/* Before writing into any layer below byte offset `bytes` of its buffer: moves copy only the
 * prefix of every layer buffer written so far (the used page range), so the engine raises it
 * first. Never lowered. */
void wrk_tier_touch(wrk_tier *t, size_t bytes);
/* Unpins l; the cursor moves to l + 1 (mod n). */
void wrk_tier_release(wrk_tier *t, uint32_t l);

/* For handlers that touch every layer (page copy, clear): waits until nothing moves and starts
 * nothing until wrk_tier_resume; wrk_tier_where(l) is then l's buffer, on either region. */
void wrk_tier_hold(wrk_tier *t);
void *wrk_tier_where(wrk_tier *t, uint32_t l);
/* wrk_tier_hold, and on a committing device every resident layer's buffer gets memory to the
 * prefix; fails (held all the same: resume) when it cannot, with the device's reason, or with
 * a copy failure not yet reported. */
pie_code wrk_tier_hold_ready(wrk_tier *t, pie_status *st);
void wrk_tier_resume(wrk_tier *t);

/* New device budget in layers (between steps; clamped to min_slots..device_buffers, and for a
 * committing device to device_bytes / the used prefix: the return value). Fewer slots: the
 * pipeline evicts down to it; more: it fetches back. */
uint32_t wrk_tier_set_slots(wrk_tier *t, uint32_t slots);

/* Waits until no transfer is in flight and none would start (tests and benchmarks). */
void wrk_tier_quiesce(wrk_tier *t);

void wrk_tier_get_stats(wrk_tier *t, wrk_tier_stats *out);

#endif
