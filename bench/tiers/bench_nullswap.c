/* bench_nullswap.c — the swap policy of a worker on the null backend's emulated device, in
 * virtual time (issue 13, benchmarks 1 and 2).
 *
 * What runs is the worker's own policy code: the memory plan (wrk_mempol: effective capacity
 * from device_kv and the slot count), the runtime (wrk_memrt.c, compiled in: epochs of 16
 * forward batches, adaptive expansion, the slot count it sets on the device) and the emulated
 * device (mem/wrk_nulldev.h: each batch timed by the layer-wise FIFO pipeline). The controller
 * is stood in for by a saturating decode workload: `demand` sequences of `pages_per_seq` KV
 * pages each want to run; a step runs as many as the effective capacity holds (one input token
 * each, their contexts attended), and the batch's device time is the step's time. Nothing
 * sleeps: time is the model's.
 *
 * Benchmark 1 (per scenario): a sweep of every fixed slot count S (memory.device_layers) finds
 * the best throughput; adaptive expansion (memory.device_layers 0) runs from every layer on
 * the device; the window of 16 steps from which it stays within 2% of the best (probes
 * excepted: see phase()) and its mean over the phase's last half are reported; then the
 * link's bandwidth is halved and the same is measured again.
 * Benchmark 2: policy gpu against swap (adaptive, converged) at the same device KV memory with
 * demand above what either holds: throughput ratio; and the step time of swap at gpu's batch
 * against gpu's step time (transparency: the swaps must hide behind compute).
 *
 * Usage: bench_nullswap [epochs per phase, default 120] */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "pie_status.h"
#include "wrk_memrt.h"
#include "wrk_mempol.h"
#include "wrk_nulldev.h"

typedef struct scenario {
    const char *name;
    uint32_t n_layers;
    uint64_t page_layer_bytes; /* B */
    uint32_t device_pages;     /* pages with every layer on the device: device_kv / (n B) */
    uint32_t pages_per_seq;
    uint32_t demand;         /* sequences that would run */
    double layer_us;         /* per layer, fixed (weights) */
    double layer_token_us;   /* per layer per sequence (one decode token each) */
    double layer_kv_us;      /* per layer per context token */
    double link_bytes_per_s; /* each way */
} scenario;

typedef struct run {
    wrk_mem_plan plan;
    wrk_nulldev *dev;
    wrk_memrt *rt;
    double t; /* virtual seconds */
    uint64_t tokens;
    double stall_s;
} run;

static void die(const char *what, const pie_status *st) {
    fprintf(stderr, "bench_nullswap: %s: %s\n", what, st->msg);
    exit(1);
}

/* policy: WRK_MEM_GPU or WRK_MEM_SWAP; device_layers: 0 adaptive, else fixed. */
static void run_open(run *r, const scenario *s, wrk_mem_policy policy, uint32_t device_layers) {
    pie_status st;
    *r = (run){0};
    uint64_t device_kv = (uint64_t)s->device_pages * s->n_layers * s->page_layer_bytes;
    wrk_mem_config mc = {.policy = policy,
                         .device_kv = device_kv,
                         .host_pool = device_kv * 64, /* never the bound here */
                         .device_layers = device_layers};
    wrk_mem_shape sh = {.n_layers = s->n_layers,
                        .page_layer_bytes = s->page_layer_bytes,
                        .pool_pages = s->device_pages,
                        .max_pages = 1u << 24};
    if (wrk_mem_plan_make(&mc, &sh, &r->plan, &st) != PIE_OK) die("plan", &st);
    wrk_nulldev_config dc = {.n_layers = s->n_layers,
                             .page_size = 16,
                             .layer_us = s->layer_us,
                             .layer_token_us = s->layer_token_us,
                             .layer_kv_us = s->layer_kv_us,
                             .link_bytes_per_s = s->link_bytes_per_s,
                             .device_kv = device_kv,
                             .slots = r->plan.start_slots,
                             .min_slots = r->plan.min_slots};
    if (wrk_nulldev_create(&dc, &r->dev, &st) != PIE_OK) die("device", &st);
    r->rt = wrk_memrt_create(&r->plan, NULL, &st);
    if (r->rt == NULL) die("runtime", &st);
    wrk_memrt_use_nulldev(r->rt, r->dev);
}

static void run_close(run *r) {
    wrk_memrt_destroy(r->rt);
    wrk_nulldev_destroy(r->dev);
}

static uint32_t effective(const run *r) {
    Pie__V1__WorkerCapacity c = PIE__V1__WORKER_CAPACITY__INIT;
    wrk_memrt_capacity(r->rt, &c);
    return c.kv_pages_effective;
}

/* One decode step of the saturating workload (batch_cap: at most this many sequences, 0 =
 * as many as the pages hold). Returns the batch's device time. */
static double step(run *r, const scenario *s, uint32_t batch_cap) {
    uint32_t fit = effective(r) / s->pages_per_seq;
    uint32_t batch = fit < s->demand ? fit : s->demand;
    if (batch_cap && batch > batch_cap) batch = batch_cap;
    uint64_t ctx = (uint64_t)s->pages_per_seq * 16 - 8; /* mid-page on average */
    wrk_nulldev_batch b = wrk_nulldev_forward(r->dev, batch, batch * ctx);
    r->t += b.time_s;
    r->tokens += batch;
    r->stall_s += b.stall_s;
    wrk_memrt_after_forward(r->rt, batch, (uint64_t)llround(b.time_s * 1e9),
                            batch * s->pages_per_seq);
    return b.time_s;
}

/* Throughput of n steps (after `warm` unmeasured ones). */
static double measure(run *r, const scenario *s, uint32_t warm, uint32_t n, uint32_t batch_cap) {
    for (uint32_t i = 0; i < warm; i++) step(r, s, batch_cap);
    double t0 = r->t;
    uint64_t k0 = r->tokens;
    for (uint32_t i = 0; i < n; i++) step(r, s, batch_cap);
    return (double)(r->tokens - k0) / (r->t - t0);
}

static double sweep(const scenario *s, uint32_t *best_s) {
    double best = 0;
    for (uint32_t S = s->n_layers; S >= 2; S--) {
        run r;
        run_open(&r, s, WRK_MEM_SWAP, S);
        double tps = measure(&r, s, 32, 64, 0);
        run_close(&r);
        if (tps > best) best = tps, *best_s = S;
    }
    return best;
}

#define EPOCH 16 /* wrk_memrt's epoch: 16 forward batches */

/* Runs `epochs` windows of EPOCH steps of the adaptive run; *settled: the first window from
 * which no more than 3 consecutive windows fell below 98% of target (-1: never) — a probe one
 * layer further that stalls, its back-off and the settling steps after each change span up
 * to 3 windows, which are not aligned with the policy's own epochs; returns the mean over the
 * last half. *slots: the device layers at the end. */
static double phase(run *r, const scenario *s, int epochs, double target, int *settled,
                    uint32_t *slots) {
    int below_run = 0;
    double sum_t = 0;
    uint64_t sum_k = 0;
    *settled = -1;
    for (int ep = 0; ep < epochs; ep++) {
        double t0 = r->t;
        uint64_t k0 = r->tokens;
        for (int i = 0; i < EPOCH; i++) step(r, s, 0);
        double tps = (double)(r->tokens - k0) / (r->t - t0);
        if (tps >= 0.98 * target) {
            below_run = 0;
            if (*settled < 0) *settled = ep;
        } else if (++below_run > 3 || *settled < 0) {
            *settled = -1;
        }
        if (ep >= epochs / 2) sum_t += r->t - t0, sum_k += r->tokens - k0;
    }
    wrk_nulldev_stats ds;
    wrk_nulldev_get_stats(r->dev, &ds);
    *slots = ds.slots;
    return sum_t > 0 ? (double)sum_k / sum_t : 0;
}

static void bench1(const scenario *s, int epochs) {
    uint32_t best_s = s->n_layers;
    double best = sweep(s, &best_s);
    run r;
    run_open(&r, s, WRK_MEM_SWAP, 0);
    int settled;
    uint32_t got_s;
    double got = phase(&r, s, epochs, best, &settled, &got_s);
    printf("| %s | start | %u | %.0f | %u | %.0f | %.3f | %d (%d steps) |\n", s->name, best_s, best,
           got_s, got, got / best, settled, settled >= 0 ? settled * EPOCH : -1);
    scenario half = *s;
    half.link_bytes_per_s /= 2;
    uint32_t best2_s = s->n_layers;
    double best2 = sweep(&half, &best2_s);
    wrk_nulldev_set_link(r.dev, half.link_bytes_per_s);
    got = phase(&r, &half, epochs, best2, &settled, &got_s);
    printf("| | link bandwidth halved | %u | %.0f | %u | %.0f | %.3f | %d (%d steps) |\n", best2_s,
           best2, got_s, got, got / best2, settled, settled >= 0 ? settled * EPOCH : -1);
    run_close(&r);
}

static void bench2(const scenario *s, int epochs) {
    run g;
    run_open(&g, s, WRK_MEM_GPU, 0);
    double gpu_tps = measure(&g, s, 8, 64, 0);
    uint32_t gpu_batch = effective(&g) / s->pages_per_seq;
    double gpu_step = g.t / (double)(8 + 64);
    run_close(&g);
    run w;
    run_open(&w, s, WRK_MEM_SWAP, 0);
    int settled;
    uint32_t slots;
    double swap_tps = phase(&w, s, epochs, 0, &settled, &slots);
    uint32_t swap_batch = effective(&w) / s->pages_per_seq;
    if (swap_batch > s->demand) swap_batch = s->demand;
    /* transparency: the converged swap pipeline, at gpu's batch */
    double t0 = w.t, st0 = w.stall_s;
    uint32_t n = 64;
    for (uint32_t i = 0; i < n; i++) step(&w, s, gpu_batch);
    double swap_step = (w.t - t0) / n, swap_stall = (w.stall_s - st0) / n;
    printf("| %s | %u | %.0f | %u of %u | %u | %.0f | %.2fx | %.1f | %.1f | %+.2f%% | %.2f%% |\n",
           s->name, gpu_batch, gpu_tps, slots, s->n_layers, swap_batch, swap_tps,
           swap_tps / gpu_tps, gpu_step * 1e6, swap_step * 1e6, 100 * (swap_step / gpu_step - 1),
           100 * swap_stall / swap_step);
    run_close(&w);
}

int main(int argc, char **argv) {
    int epochs = argc > 1 ? atoi(argv[1]) : 120;
    if (epochs < 4) epochs = 4;
    /* Benchmark 1: bench_tiers's model scenarios, now through the worker's code: an 8B-shape
     * decode step (32 layers of 120 us + 1.5 us per sequence; 4000 pages of 40 per sequence
     * with every layer on the device: batch 100), the link set so that at the start a layer's
     * swap takes twice its compute (the paper's Fig. 4 ratio), once, or four times. */
    const uint64_t B8 = 131072; /* 16 tokens x 8 KV heads x 128 x K,V x 4 bytes */
    const double tc8 = (120 + 1.5 * 100) * 1e-6;
    const double d8 = 4000.0 * 32 * B8;
    scenario b1[] = {
        {"swap = 2x layer compute, 32 layers", 32, B8, 4000, 40, 1000, 120, 1.5, 0,
         d8 / 32 / (2 * tc8)},
        {"swap = 1x layer compute, 32 layers", 32, B8, 4000, 40, 1000, 120, 1.5, 0,
         d8 / 32 / (1 * tc8)},
        {"swap = 4x layer compute, 32 layers", 32, B8, 4000, 40, 1000, 120, 1.5, 0,
         d8 / 32 / (4 * tc8)},
        {"swap = 2x layer compute, 80 layers", 80, B8, 4000, 40, 1000, 60, 0.8, 0,
         4000.0 * 80 * B8 / 80 / (2 * (60 + 0.8 * 100) * 1e-6)},
    };
    printf("Benchmark 1: adaptive expansion against the best fixed expansion (virtual time, "
           "%d epochs of %d forward batches per phase)\n\n",
           epochs, EPOCH);
    printf("| scenario | phase | best fixed S (sweep) | best tok/s | adaptive S at the end | "
           "adaptive tok/s (last half, probes included) | ratio | settled within 2%% at epoch "
           "|\n| --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for (size_t i = 0; i < sizeof b1 / sizeof b1[0]; i++) bench1(&b1[i], epochs);

    /* Benchmark 2: GH200-like ratios for a 13B-shape model (40 layers, 5120 hidden, f16 KV:
     * 20 KiB per token per layer): a layer's weights (650 MB) read at 4 TB/s = 160 us, each
     * context token's K/V of a layer at 4 TB/s = 0.005 us, one decode token per sequence 0.5
     * us, NVLink-C2C 450 GB/s each way; 640-token sequences (40 pages); device KV of 3, 6 and
     * 12 GiB (the pooling paper's Fig. 6 range), demand far above all of them. */
    const uint64_t B13 = 16ull * 20480;
    const double gib = 1024.0 * 1024 * 1024;
    scenario b2[] = {
        {"13B-shape, 3 GiB device KV", 40, B13, (uint32_t)(3 * gib / (40.0 * B13)), 40, 100000, 160,
         0.5, 0.005, 450e9},
        {"13B-shape, 6 GiB device KV", 40, B13, (uint32_t)(6 * gib / (40.0 * B13)), 40, 100000, 160,
         0.5, 0.005, 450e9},
        {"13B-shape, 12 GiB device KV", 40, B13, (uint32_t)(12 * gib / (40.0 * B13)), 40, 100000,
         160, 0.5, 0.005, 450e9},
        {"8B-shape, Fig. 4 ratio (bench 1's first row)", 32, B8, 4000, 40, 1000, 120, 1.5, 0,
         d8 / 32 / (2 * tc8)},
    };
    printf("\nBenchmark 2: swap (adaptive, after %d epochs) against gpu at the same device KV "
           "memory, demand saturating both\n\n",
           epochs);
    printf("| scenario | gpu batch | gpu tok/s | swap device layers | swap batch | swap tok/s | "
           "swap / gpu | gpu step us | swap step us at gpu's batch | step vs gpu | stall share "
           "|\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for (size_t i = 0; i < sizeof b2 / sizeof b2[0]; i++) bench2(&b2[i], epochs);
    return 0;
}
