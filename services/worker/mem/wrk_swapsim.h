/* wrk_swapsim.h — the layer-wise FIFO swap pipeline as a discrete-event model (issue 13; the
 * pooling paper, seed 000, §3.3 and Fig. 4), for the null backend's device emulation and the
 * adaptive-expansion benchmarks: how long a decode step takes when only S of a model's n
 * layers keep their KV cache on the device.
 *
 * Owns: the timing of one model's steps. Each step computes layers 0..n-1 in order, t_compute
 * each. The device holds S layer caches ("slots"); the others are on the host. A duplex link
 * moves one layer cache in and one out at a time, t_swap each way. Protocol, as the paper's:
 * whenever a transfer ends or a layer starts, the idle out-direction evicts the coldest
 * resident layer (the one computed most recently: its next use is farthest) if a host layer
 * waits for a slot, and the idle in-direction fetches the hottest host layer (the one needed
 * soonest, the next step's first layers included) into a free slot. A slot is free again once
 * its eviction ends. Computing a layer that is not resident waits (a stall).
 * The pipeline can also run one step at a time with its state kept between steps
 * (wrk_swapsim_pipe: the null backend's emulated device, mem/wrk_nulldev.h), the compute and
 * swap times and the slot count changing between steps; a slot count lowered below the layers
 * resident evicts the coldest ones first.
 * Does not own: real data (wrk_tier moves pages), the policy choosing S (wrk_expand.h). */
#ifndef WRK_SWAPSIM_H
#define WRK_SWAPSIM_H

#include <stdbool.h>
#include <stdint.h>

#define WRK_SWAPSIM_MAX_LAYERS 256

typedef struct wrk_swapsim_result {
    double step_s;      /* mean time of a step */
    double stall_s;     /* mean time per step compute waited for a layer */
    double link_busy;   /* share of the time the in-direction moved data */
    double slack_s;     /* least time a fetched layer waited on the device before its compute
                           (negative: the shortest stall) */
} wrk_swapsim_result;

/* The pipeline's state between steps. */
typedef struct wrk_swapsim_pipe {
    uint32_t n, slots;
    uint8_t state[WRK_SWAPSIM_MAX_LAYERS];
    double fetched_at[WRK_SWAPSIM_MAX_LAYERS];
    uint32_t cur; /* layer computing or about to */
    double t;     /* now */
    double ts;    /* the swap time of transfers started from now on */
    double in_until, out_until;
    int32_t in_layer, out_layer; /* -1: idle */
    double in_busy, slack;       /* while measuring */
    bool measuring;
    uint64_t swaps_in, swaps_out, stalls; /* transfers started / layers waited for, ever */
} wrk_swapsim_pipe;

/* One step of the pipeline. */
typedef struct wrk_swapsim_step {
    double step_s;  /* its time: compute plus stall */
    double stall_s; /* compute waited for a layer */
    uint32_t stalls; /* layers waited for */
} wrk_swapsim_step;

/* n layers (1..WRK_SWAPSIM_MAX_LAYERS), the first `slots` resident (clamped as below). */
void wrk_swapsim_pipe_init(wrk_swapsim_pipe *p, uint32_t n, uint32_t slots);
/* From now on at most `slots` layer caches on the device (2..n, or n). */
void wrk_swapsim_pipe_set_slots(wrk_swapsim_pipe *p, uint32_t slots);
/* Runs one step of n layers, t_compute each, transfers started during it taking t_swap. */
wrk_swapsim_step wrk_swapsim_pipe_step(wrk_swapsim_pipe *p, double t_compute, double t_swap);
/* Layers whose cache is only on the host now. */
uint32_t wrk_swapsim_pipe_on_host(const wrk_swapsim_pipe *p);

/* Simulates warmup + steps steps of n layers (1..WRK_SWAPSIM_MAX_LAYERS) with slots layer
 * caches on the device (2..n; n: no swapping), measuring the last `steps`. */
wrk_swapsim_result wrk_swapsim_run(uint32_t n, uint32_t slots, double t_compute, double t_swap,
                                   uint32_t warmup, uint32_t steps);

/* A saturating decode workload on one worker, for measuring policies at GPU ratios: how the
 * batch, the compute time and the swap time follow from the slot count. */
typedef struct wrk_swapsim_model {
    uint32_t n_layers;
    double device_pages;    /* KV pages the device memory holds with every layer on it */
    double pages_per_seq;   /* KV pages one running sequence holds */
    double demand_seqs;     /* sequences that would run if pages allowed */
    double t_layer_fixed;   /* compute of one layer: fixed part (weights), seconds */
    double t_layer_per_seq; /* ... plus this per sequence in the batch */
    double t_move_all;      /* moving the whole device KV memory one way over the link */
} wrk_swapsim_model;

typedef struct wrk_swapsim_point {
    double batch;        /* sequences per step */
    double tokens_per_s; /* batch / step time */
    wrk_swapsim_result sim;
    bool kv_limited;     /* demand exceeds what the pages hold */
} wrk_swapsim_point;

/* The model with `slots` layers' caches on the device: the pool offers device_pages * n / slots
 * pages (each layer's cache is 1/slots of the device's KV memory), so a layer's cache moves in
 * t_move_all / slots. */
wrk_swapsim_point wrk_swapsim_eval(const wrk_swapsim_model *m, uint32_t slots, uint32_t steps);

#endif
