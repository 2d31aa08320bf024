/* bench_nulloff.c — the offload policy of a worker on the null backend's emulated device, in
 * virtual time (issue 13, benchmark 3 on the running code rather than the analytic model).
 *
 * What runs is the worker's own offload code: the memory plan (wrk_mempol: device pages + host
 * pool pages), the runtime (wrk_memrt.c, compiled in: offload's effective capacity, which
 * follows the scheduler's estimate of the host decodes that pay) and the emulated device
 * (mem/wrk_nulldev.h: the load-aware scheduler of wrk_offload.h through wrk_offplace.h picks
 * each step's split over the real page placement, and the step is timed as Neo's two
 * sub-batches). The controller is stood in for by continuous batching: requests of `in`
 * prompt and `out` output tokens, each holding its pages from admission to its end; a request
 * is admitted while the pages it will need fit in the effective capacity (gpu: the device's
 * pages), at most max_batch run at once and at most 2048 prompt tokens are prefilled a step.
 * Throughput = output tokens per virtual second over the steps after a warm-up.
 *
 * Testbeds: wrk_offsim's T4-, A10G- and H100-like ratios (seed 004 Table 1; figures and sources
 * in mem/wrk_offsim.c), spread over their models' layers (32, 32, 80) with their KV bytes per
 * token, and a PCIe link each (16, 32, 64 GB/s: gen 3, 4, 5 x16 — assumed, not measured).
 * The emulated device adds a layer's fixed and per-token linear costs (layer_us + T·token),
 * where wrk_offsim takes a roofline max: its numbers are lower for large batches.
 *
 * Usage: bench_nulloff [steps, default 3000] [sweep] [in=N]
 *   in=N: every request's prompt is N tokens (default 500; seed 004's H100 runs, Fig. 8b, use
 *   2000);
 *   without "sweep": the default capacity rule (the scheduler's estimate) against gpu, in
 *   detail, as the worker runs (every item of a batch runs) and with deferral (the stand-in
 *   controller re-queues the items the scheduler defers: Neo's rules, wrk_offload.h);
 *   with it: offload's gain over gpu at every point under variants of the capacity rule
 *   (wrk_off_adapt_opts: the estimate, thresholds, step sizes, where it starts, holding while
 *   pages drain). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pie_status.h"
#include "wrk_memrt.h"
#include "wrk_mempol.h"
#include "wrk_nulldev.h"
#include "wrk_offsim.h"

#define PAGE        16u
#define PREFILL_CAP 2048u /* prompt tokens prefilled per step at most */

typedef struct testbed {
    const wrk_offsim_hw *hw;
    uint32_t n_layers;
    double kv_token_bytes; /* every layer */
    double link_bytes_per_s;
} testbed;

typedef struct req {
    uint32_t *pages; /* [need] */
    uint32_t need;   /* pages for in + out tokens */
    uint32_t pos;    /* tokens in its KV */
    uint32_t made;   /* output tokens so far */
    int state;       /* 0 free, 1 waiting for its prefill in this step, 2 decoding */
} req;

typedef struct sim {
    wrk_mem_plan plan;
    wrk_nulldev *dev;
    wrk_memrt *rt; /* offload only */
    uint32_t *free_pages, n_free;
    req *reqs;
    uint32_t n_reqs;
    wrk_offplace_item *items;
    uint32_t *item_req; /* [max_items] the request of each item of the step */
    uint32_t live; /* pages held */
    double t;
    uint64_t out_tokens, decode_items;
} sim;

static void die(const char *what, const pie_status *st) {
    fprintf(stderr, "bench_nulloff: %s: %s\n", what, st->msg);
    exit(1);
}

static void *xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size);
    if (!p) {
        fprintf(stderr, "bench_nulloff: out of memory\n");
        exit(1);
    }
    return p;
}

/* Offload's capacity rule: the default, or one of the variants the sweep compares. */
typedef struct variant {
    const char *name;
    wrk_off_adapt_opts opts;
    bool tuned; /* false: the default rule, untouched */
    bool defer; /* the stand-in controller re-queues what the scheduler defers */
    bool host_steps; /* grow_pages 0 keeps the rule's own step (an eighth of the host) */
} variant;

static void sim_open(sim *s, const testbed *tb, bool offload, const variant *v) {
    pie_status st;
    memset(s, 0, sizeof *s);
    const wrk_offsim_hw *hw = tb->hw;
    double L = tb->n_layers;
    uint64_t page_layer = (uint64_t)llround(tb->kv_token_bytes / L * PAGE);
    uint64_t page_all = page_layer * tb->n_layers;
    uint64_t device_kv = (uint64_t)floor(hw->gpu_kv / PAGE) * page_all;
    wrk_mem_config mc = {.policy = offload ? WRK_MEM_OFFLOAD : WRK_MEM_GPU,
                         .device_kv = device_kv,
                         .host_pool = (uint64_t)floor(hw->cpu_kv / PAGE) * page_all};
    uint32_t gpu_pages = (uint32_t)floor(hw->gpu_kv / PAGE);
    wrk_mem_shape sh = {.n_layers = tb->n_layers,
                        .page_layer_bytes = page_layer,
                        .pool_pages = gpu_pages,
                        .max_pages = 1u << 24,
                        .page_size = PAGE};
    if (wrk_mem_plan_make(&mc, &sh, &s->plan, &st) != PIE_OK) die("plan", &st);
    uint32_t max_items = hw->max_batch + PREFILL_CAP;
    wrk_nulldev_config dc = {.n_layers = tb->n_layers,
                             .page_size = PAGE,
                             .layer_us = hw->w / L * 1e6,
                             .layer_token_us = hw->lin_tok / L * 1e6,
                             .layer_kv_us = hw->dattn / L * 1e6,
                             .host_attn_kv_us = hw->hattn / L * 1e6,
                             .link_bytes_per_s = offload ? tb->link_bytes_per_s : 0,
                             .device_kv = device_kv,
                             .offload_device_pages = offload ? s->plan.kv_pages_gpu : 0,
                             .kv_pages = s->plan.kv_pages_max,
                             .page_layer_bytes = page_layer,
                             .max_items = max_items,
                             .offload_defer = offload && v && v->defer};
    if (wrk_nulldev_create(&dc, &s->dev, &st) != PIE_OK) die("device", &st);
    if (offload) {
        s->rt = wrk_memrt_create(&s->plan, NULL, &st);
        if (!s->rt) die("runtime", &st);
        wrk_memrt_use_nulldev(s->rt, s->dev);
        if (v && v->tuned) wrk_memrt_offload_tune(s->rt, &v->opts);
    }
    s->free_pages = xcalloc(s->plan.kv_pages_max, sizeof *s->free_pages);
    for (uint32_t i = 0; i < s->plan.kv_pages_max; i++)
        s->free_pages[i] = s->plan.kv_pages_max - 1 - i; /* lowest ids first */
    s->n_free = s->plan.kv_pages_max;
    s->n_reqs = hw->max_batch;
    s->reqs = xcalloc(s->n_reqs, sizeof *s->reqs);
    s->items = xcalloc(max_items, sizeof *s->items);
    s->item_req = xcalloc(max_items, sizeof *s->item_req);
}

static void sim_close(sim *s) {
    for (uint32_t i = 0; i < s->n_reqs; i++) free(s->reqs[i].pages);
    free(s->reqs);
    free(s->free_pages);
    free(s->items);
    free(s->item_req);
    wrk_memrt_destroy(s->rt);
    wrk_nulldev_destroy(s->dev);
}

static uint32_t capacity(const sim *s) {
    if (!s->rt) return s->plan.kv_pages_gpu;
    Pie__V1__WorkerCapacity c = PIE__V1__WORKER_CAPACITY__INIT;
    wrk_memrt_capacity(s->rt, &c);
    return c.kv_pages_effective;
}

/* Admits requests while they fit; returns the prompt tokens admitted. */
static uint32_t admit(sim *s, uint32_t in, uint32_t out) {
    uint32_t need = (in + out + PAGE - 1) / PAGE, prefill = 0;
    for (uint32_t r = 0; r < s->n_reqs; r++) {
        req *q = &s->reqs[r];
        if (q->state != 0) continue;
        if (prefill + in > PREFILL_CAP || s->live + need > capacity(s) || s->n_free < need) break;
        if (!q->pages) q->pages = xcalloc(need, sizeof *q->pages);
        for (uint32_t j = 0; j < need; j++) q->pages[j] = s->free_pages[--s->n_free];
        wrk_nulldev_cleared(s->dev, q->pages, need); /* the worker clears what it allocates */
        *q = (req){.pages = q->pages, .need = need, .state = 1};
        s->live += need;
        prefill += in;
    }
    return prefill;
}

static void step(sim *s, uint32_t in, uint32_t out) {
    admit(s, in, out);
    uint32_t n = 0, tokens = 0;
    for (uint32_t r = 0; r < s->n_reqs; r++) {
        req *q = &s->reqs[r];
        if (q->state == 1) {
            s->item_req[n] = r;
            s->items[n++] = (wrk_offplace_item){
                .pages = q->pages, .n_pages = (in + PAGE - 1) / PAGE, .n_in = in, .append = true};
        } else if (q->state == 2) {
            s->item_req[n] = r;
            s->items[n++] = (wrk_offplace_item){.pages = q->pages,
                                                .n_pages = q->pos / PAGE + 1,
                                                .ctx = q->pos,
                                                .n_in = 1,
                                                .append = true};
        }
    }
    if (n == 0) return;
    wrk_nulldev_batch b;
    pie_status st;
    if (wrk_nulldev_forward_items(s->dev, s->items, n, &b, &st) != PIE_OK) die("forward", &st);
    s->t += b.time_s;
    for (uint32_t i = 0; i < n; i++) {
        if (b.item_state && b.item_state[i] == WRK_OFF_DEFER) continue; /* re-queued */
        req *q = &s->reqs[s->item_req[i]];
        tokens += s->items[i].n_in;
        if (q->state == 2) s->decode_items++;
        if (q->state == 1) {
            q->pos = in;
            q->state = 2;
        } else if (q->state == 2) {
            q->pos++;
            s->out_tokens++;
            if (++q->made == out) { /* done: its pages go back */
                for (uint32_t j = 0; j < q->need; j++) s->free_pages[s->n_free++] = q->pages[j];
                wrk_nulldev_freed(s->dev, q->pages, q->need); /* the worker's SlotBatch free */
                s->live -= q->need;
                q->state = 0;
            }
        }
    }
    if (s->rt) wrk_memrt_after_forward(s->rt, tokens, (uint64_t)llround(b.time_s * 1e9), s->live);
}

typedef struct result {
    double tps;                /* output tokens per virtual second, measured steps */
    double decodes, host;      /* decodes per step, of them attended on the host (measured) */
    uint64_t forced, two;      /* forced and two-sub-batch steps (measured) */
    double deferred;           /* decodes deferred per step (measured) */
    uint32_t eff, max;         /* effective capacity at the end, kv_pages_max */
} result;

/* steps / 4 of warm-up, then `steps` measured. */
static result run(const testbed *tb, bool offload, const variant *v, uint32_t in, uint32_t out,
                  uint32_t steps) {
    sim s;
    sim_open(&s, tb, offload, v);
    for (uint32_t i = 0; i < steps / 4; i++) step(&s, in, out);
    double t0 = s.t;
    uint64_t k0 = s.out_tokens, d0 = s.decode_items;
    wrk_nulldev_stats a, b;
    wrk_nulldev_get_stats(s.dev, &a);
    for (uint32_t i = 0; i < steps; i++) step(&s, in, out);
    wrk_nulldev_get_stats(s.dev, &b);
    result r = {.tps = (double)(s.out_tokens - k0) / (s.t - t0),
                .decodes = (double)(s.decode_items - d0) / steps,
                .host = (double)(b.host_items - a.host_items) / steps,
                .forced = b.place.forced_steps - a.place.forced_steps,
                .two = b.offload_steps - a.offload_steps,
                .deferred = (double)(b.place.deferred - a.place.deferred) / steps,
                .eff = capacity(&s),
                .max = s.plan.kv_pages_max};
    sim_close(&s);
    return r;
}

static const testbed tbs[] = {
    {&wrk_offsim_t4, 32, 512 * 1024.0, 16e9},
    {&wrk_offsim_a10g, 32, 128 * 1024.0, 32e9},
    {&wrk_offsim_h100, 80, 320 * 1024.0, 64e9},
};
static const uint32_t outs[] = {50, 200, 1000};
#define N_TB   (sizeof tbs / sizeof tbs[0])
#define N_LENS (sizeof outs / sizeof outs[0])

/* The default rule against policy gpu, in detail: the worker as it runs (every item of a batch
 * runs), and with deferral (the stand-in controller re-queues what the scheduler defers). */
static void table(uint32_t steps, uint32_t in_len) {
    static const variant defer = {"defer", {.estimate = true}, true, true};
    printf("| testbed | in | out | gpu tok/s (decodes/step) | offload tok/s (decodes/step, on "
           "host) | gain | forced / two-sub-batch steps of %u | effective pages of max | "
           "with deferral: tok/s (decodes, on host, deferred per step) | gain |\n",
           steps);
    printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for (size_t t = 0; t < N_TB; t++)
        for (size_t l = 0; l < N_LENS; l++) {
            result g = run(&tbs[t], false, NULL, in_len, outs[l], steps);
            result o = run(&tbs[t], true, NULL, in_len, outs[l], steps);
            result d = run(&tbs[t], true, &defer, in_len, outs[l], steps);
            printf("| %s | %u | %u | %.0f (%.1f) | %.0f (%.1f, %.1f) | %+.1f %% | %llu / %llu | "
                   "%u of %u | %.0f (%.1f, %.1f, %.1f) | %+.1f %% |\n",
                   tbs[t].hw->name, in_len, outs[l], g.tps, g.decodes, o.tps, o.decodes, o.host,
                   (o.tps / g.tps - 1) * 100, (unsigned long long)o.forced,
                   (unsigned long long)o.two, o.eff, o.max, d.tps, d.decodes, d.host, d.deferred,
                   (d.tps / g.tps - 1) * 100);
        }
}

/* grow_pages markers of the sweep: half of, or all of, the testbed's device pages */
#define GROW_HALF 0xfffffffeu
#define GROW_FULL 0xffffffffu

/* The capacity rule's variants: gain over gpu at every point, and the worst and mean. */
static void sweep(uint32_t steps, uint32_t in_len) {
    const variant vs[] = {
        {"default: the scheduler's estimate (least over the life of what it admits)", {0}, false},
        {"the estimate, with deferral (a controller that re-queues)",
         {.estimate = true},
         true,
         true},
        {"exposed wait (the default before): start at every page, -/+ an eighth of the host, "
         "5 % / 1 %",
         {0},
         true,
         false,
         true},
        {"start at every page, halve the host share, +1/8 device, hold while over",
         {.shrink_share = 0.5, .hold_while_over = true},
         true},
        {"start at the device, halve, +1/8 device, hold",
         {.shrink_share = 0.5, .start_at_gpu = true, .hold_while_over = true},
         true},
        {"start at the device, halve, +1/8 device, hold, 10 % / 2 %",
         {.exposed_max = 0.10,
          .exposed_grow = 0.02,
          .shrink_share = 0.5,
          .start_at_gpu = true,
          .hold_while_over = true},
         true},
        {"start at the device, halve, +1/8 device, hold, 2 % / 0.5 %",
         {.exposed_max = 0.02,
          .exposed_grow = 0.005,
          .shrink_share = 0.5,
          .start_at_gpu = true,
          .hold_while_over = true},
         true},
        {"climb by throughput from the device, +1/8 device",
         {.climb = true, .start_at_gpu = true},
         true},
        {"climb by throughput from the device, +1/2 device",
         {.climb = true, .start_at_gpu = true, .grow_pages = GROW_HALF},
         true},
        {"climb by throughput from the device, +1 device",
         {.climb = true, .start_at_gpu = true, .grow_pages = GROW_FULL},
         true},
    };
    printf("| capacity rule |");
    for (size_t t = 0; t < N_TB; t++)
        for (size_t l = 0; l < N_LENS; l++)
            printf(" %.4s %u/%u |", tbs[t].hw->name, in_len, outs[l]);
    printf(" worst | mean |\n|---|");
    for (size_t i = 0; i < N_TB * N_LENS + 2; i++) printf("---|");
    printf("\n");
    double gpu[N_TB][N_LENS];
    for (size_t t = 0; t < N_TB; t++)
        for (size_t l = 0; l < N_LENS; l++)
            gpu[t][l] = run(&tbs[t], false, NULL, in_len, outs[l], steps).tps;
    for (size_t v = 0; v < sizeof vs / sizeof vs[0]; v++) {
        variant vv = vs[v];
        printf("| %s |", vv.name);
        double worst = INFINITY, sum = 0;
        for (size_t t = 0; t < N_TB; t++)
            for (size_t l = 0; l < N_LENS; l++) {
                uint32_t gpu_pages = (uint32_t)floor(tbs[t].hw->gpu_kv / PAGE);
                if (vv.tuned && !vv.host_steps && !vv.opts.estimate &&
                    vv.opts.grow_pages == 0) /* an eighth of the device's pages */
                    vv.opts.grow_pages = gpu_pages / 8 + 1;
                else if (vv.opts.grow_pages == GROW_HALF)
                    vv.opts.grow_pages = gpu_pages / 2 + 1;
                else if (vv.opts.grow_pages == GROW_FULL)
                    vv.opts.grow_pages = gpu_pages;
                double g = run(&tbs[t], true, &vv, in_len, outs[l], steps).tps / gpu[t][l] - 1;
                vv.opts.grow_pages = vs[v].opts.grow_pages;
                printf(" %+.1f %% |", g * 100);
                worst = fmin(worst, g);
                sum += g;
            }
        printf(" %+.1f %% | %+.1f %% |\n", worst * 100, sum / (N_TB * N_LENS) * 100);
    }
}

int main(int argc, char **argv) {
    uint32_t steps = argc > 1 ? (uint32_t)strtoul(argv[1], NULL, 10) : 3000;
    if (steps < 8) steps = 8;
    bool do_sweep = false;
    uint32_t in_len = 500; /* every request's prompt */
    for (int i = 2; i < argc; i++) {
        if (strcmp(argv[i], "sweep") == 0)
            do_sweep = true;
        else if (strncmp(argv[i], "in=", 3) == 0 && atoi(argv[i] + 3) > 0)
            in_len = (uint32_t)atoi(argv[i] + 3);
        else {
            fprintf(stderr, "usage: bench_nulloff [steps] [sweep] [in=N]\n");
            return 2;
        }
    }
    if (do_sweep)
        sweep(steps, in_len);
    else
        table(steps, in_len);
    return 0;
}
