/* wrk_offload.h — the load-aware scheduler of CPU attention offload (Neo, seed 004 §3.2–3.3;
 * issue 13): per step, device-only or two asymmetric sub-batches, and which decode requests
 * have their KV and attention on the host.
 *
 * Owns: the cost model (four per-token costs profiled at start) and the decision of one step.
 * Sub-batch 0 holds every prefill and the decodes kept on the device, sub-batch 1 the decodes
 * whose KV lives in the host pool (their attention runs on host cores). With L folded into the
 * costs, the paper's estimate with no host attention in sub-batch 0 (Tca0 = 0) is
 *   T_off = max(Tl0, Tca1, Tx) + Tl1 + Tga0
 *   T_dev = max(Tl(all) + Tga(all), Tx(back))
 * Tl(b) = max(lin_fixed, lin_tok · b) for b > 0 tokens (a roofline: a linear pass reads the
 * weights once whatever the batch, so sub-batch 1's own pass costs at least lin_fixed — the
 * price of two sub-batches on a device whose small batches are bound by weight reads), 0 for
 * none; Tga = device attention per KV token × KV tokens, Tca = host
 * attention per KV token × KV tokens, Tx = transfer per token × tokens moved (layer by layer,
 * overlapped with the compute as Neo does; it bounds the step when it is the longest). Rules:
 *  - memory: decodes kept on the device may hold at most `device_kv_budget` KV tokens; the
 *    first in batch order move to the host until they fit (then device-only is infeasible:
 *    forced);
 *  - hiding CPU (§3.3 step 4): decodes already on the host first, then the others, in batch
 *    order, join sub-batch 1 while Tca1 <= Tl0; a decode already on the host that does not fit
 *    stays there or comes back, whichever the estimate says costs less;
 *  - greedy fall-back: the two sub-batches are chosen only when forced or when T_off < T_dev.
 * With defer_ok (the caller can skip a request for a step and run it later; Neo §3.3 step 4 and
 * 6) the rules are Neo's instead:
 *  - sub-batch 0 holds the prefills and the decodes whose KV is on the device (memory-forced
 *    moves as above); the decodes on the host are the CPU run queue, taken longest-waiting first
 *    (then batch order): one joins sub-batch 1 while Tca1 <= Tl0 (hidden behind sub-batch 0's
 *    linear layers); one that would not hide is deferred (WRK_OFF_DEFER: skipped this step);
 *  - no starvation: a request deferred WRK_OFF_DEFER_MAX steps in a row runs at its next step
 *    whatever it costs (on the host, exposed, or back on the device when the device has room
 *    and the estimate says it costs less), so every host request makes a token at least every
 *    WRK_OFF_DEFER_MAX + 1 steps it is offered;
 *  - greedy (step 6): the device-only schedule is sub-batch 0 without the host requests that
 *    joined sub-batch 1 (deferred instead); the schedule with the higher estimated throughput
 *    x/T wins (x = requests run: dev_items + decodes), device-only on a tie. Device-only is
 *    not possible when memory forced a move or a starving request stays on the host.
 * Either way the decision reports gain_kv (wrk_off_choice): the host KV tokens this step's
 * device work could hide at a gain — the capacity rule's input (wrk_off_adapt, estimate mode).
 * Does not own: moving KV (the engine), measuring (the engine's profile at open). */
#ifndef WRK_OFFLOAD_H
#define WRK_OFFLOAD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "wrk_mempol.h"

/* Seconds, for every layer of the model together. */
typedef struct wrk_off_costs {
    double lin_tok;   /* device linear layers per batch token (compute-bound slope) */
    double lin_fixed; /* one pass of the device linear layers over the weights, any batch */
    double dattn_kv;  /* device attention per KV token read */
    double hattn_kv;  /* host attention per KV token read */
    double xfer_tok;  /* moving one token's KV between the device and the host */
} wrk_off_costs;

/* One decode request of the step (one new token). */
typedef struct wrk_off_req {
    uint32_t kv;     /* KV tokens its attention reads (context + the new token) */
    bool on_host;    /* its KV is in the host pool now */
    uint16_t waited; /* steps it was deferred in a row (defer_ok) */
} wrk_off_req;

/* host[i] of a decision: where request i attends this step. */
#define WRK_OFF_DEVICE 0
#define WRK_OFF_HOST   1
#define WRK_OFF_DEFER  2 /* skipped this step (only with defer_ok) */
/* Steps a request may be deferred in a row; at the next it runs whatever it costs. */
#define WRK_OFF_DEFER_MAX 8

typedef struct wrk_off_batch {
    uint32_t dev_tokens;       /* tokens of the items that stay on the device (prefill) */
    uint64_t dev_kv;           /* KV tokens their attention reads */
    const wrk_off_req *reqs;   /* the decode requests that may go to the host */
    uint32_t n_reqs;
    uint64_t device_kv_budget; /* KV tokens decodes kept on the device may hold; UINT64_MAX */
    uint32_t dev_items;        /* items behind dev_tokens (throughput's x; defer_ok only) */
    bool defer_ok;             /* the caller can skip a request for a step (Neo's rules) */
} wrk_off_batch;

typedef struct wrk_off_choice {
    bool offload;      /* two sub-batches (host[] says which requests are in sub-batch 1) */
    bool forced;       /* the device could not hold every decode's KV */
    uint32_t n_host;   /* requests in sub-batch 1 */
    uint64_t host_kv;  /* their KV tokens */
    double t_dev;      /* estimated device-only step (INFINITY when forced) */
    double t_off;      /* estimated two-sub-batch step (INFINITY when nothing can go) */
    uint32_t n_defer;  /* requests deferred (WRK_OFF_DEFER) */
    /* Host KV tokens whose attention this step's device work (prefills and decodes on the
     * device) hides at a gain: H = Tl0 / hattn_kv, n1 = H / (the step's mean decode KV); H
     * when n1 >= 1 and n1 more requests for one more linear pass pay (n1 · T0 > x0 · Tl(n1),
     * T0 = Tl0 + Tga0 the device-resident step, x0 its requests), else 0. 0 without decodes. */
    double gain_kv;
} wrk_off_choice;

/* Decides one step: host[i] = WRK_OFF_HOST for the requests whose attention runs on the host
 * (all WRK_OFF_DEVICE when device-only is chosen), WRK_OFF_DEFER for those skipped (defer_ok
 * only). host has n_reqs entries. */
void wrk_off_decide(const wrk_off_costs *c, const wrk_off_batch *b, uint8_t *host,
                    wrk_off_choice *out);

/* The estimate of a given split (host[i] = 1: sub-batch 1), as above. */
double wrk_off_estimate(const wrk_off_costs *c, const wrk_off_batch *b, const uint8_t *host);

/* The device-only estimate (every request on the device, those on the host brought back). */
double wrk_off_estimate_dev(const wrk_off_costs *c, const wrk_off_batch *b);

/* Offload's effective capacity between steps (the worker cannot defer a host request as Neo
 * does: the controller's batches run whole, so what it may place on the host is the lever).
 * It starts at every page (device + host); over an epoch of forward batches, when the device
 * waited for host attention more than WRK_OFF_EXPOSED_MAX of the busy time, the host's share
 * shrinks by an eighth of the host pages (never below the device's pages; pages already live
 * stay valid); when it waited less than WRK_OFF_EXPOSED_GROW and the pages were nearly all
 * live (within 1/16), it grows back by as much (never above every page). */
#define WRK_OFF_EXPOSED_MAX  0.05
#define WRK_OFF_EXPOSED_GROW 0.01

/* The rule's knobs (wrk_off_adapt_tune; benchmarks compare them, bench/results/tiers.md). The
 * defaults are the rule above. */
typedef struct wrk_off_adapt_opts {
    double exposed_max, exposed_grow; /* thresholds; 0: WRK_OFF_EXPOSED_MAX, _GROW */
    uint32_t grow_pages;  /* pages added on a hidden, kv-limited epoch; 0: an eighth of the host */
    double shrink_share;  /* exposed: this share of the host pages offered goes (0 < s <= 1);
                             0: grow_pages go instead */
    bool start_at_gpu;    /* start at the device's pages instead of every page */
    bool hold_while_over; /* no decision in an epoch that ended with more live pages than the
                             capacity (an earlier shrink has not taken effect yet) */
    /* climb: the thresholds are not used; the capacity climbs by throughput instead (swap's
     * adaptive expansion's way): from an epoch that filled it, grow by grow_pages; once the
     * grown capacity has filled (at most climb_wait epochs), keep it if tokens per busy second
     * rose by more than 1 %, else step back and hold hold_epochs epochs before probing again. */
    bool climb;
    uint32_t climb_wait;  /* 0: 8 */
    uint32_t hold_epochs; /* 0: 32 */
    /* estimate (the worker's default, wrk_memrt.c): the thresholds are not used; the host's
     * share follows the scheduler's own estimate of what it can serve at a gain (gain_kv of
     * wrk_off_choice, in pages, per step with decodes). At an epoch's end with such steps,
     * est = the least of the last W epochs' lows, low = the least any step of the epoch hid
     * at a gain (a host decode runs at every step of its life: it must hide at every step,
     * not on average — prefill steps hide far more than decode-only ones, and a burst of them
     * can fill whole epochs while the requests admitted then decode for many more). W covers
     * the life of what is admitted: a KV token stays live pages × page size / tokens written
     * per step steps on average (Little's law over the epoch), W = that in epochs, 1 to
     * WRK_OFF_EST_EPOCHS. The capacity becomes device pages + ceil(est), when that moves the
     * host share by at least 4 pages and an eighth of it (no CapacityChange for noise). It
     * starts at the device's pages: nothing is offered to the host before an estimate says
     * it pays. */
    bool estimate;
} wrk_off_adapt_opts;

/* The most epochs the estimate's least is taken over (64 × 16 forward batches). */
#define WRK_OFF_EST_EPOCHS 64

typedef struct wrk_off_adapt {
    uint32_t gpu_pages, max_pages; /* the device's pages; device + host */
    uint32_t page_size;            /* tokens per page */
    uint32_t pages;                /* effective now */
    uint32_t epoch_steps, steps;
    uint64_t busy_ns, wait_ns;
    bool kv_limited;
    uint32_t last_live;
    wrk_off_adapt_opts opts;
    uint64_t tokens;       /* of the epoch (climb) */
    int climb_mode;        /* 0 base, 1 probing, 2 holding */
    uint32_t climb_epochs; /* epochs in the mode */
    double thr_base;       /* tokens per busy second before the probe */
    uint64_t gain_pages, gain_steps; /* of the epoch (estimate) */
    double gain_min;                 /* the least pages one batch's estimate gave in the epoch */
    double est;                      /* host pages the estimate says pay (estimate) */
    double lows[WRK_OFF_EST_EPOCHS]; /* the last epochs' gain_min, a ring */
    uint32_t n_lows, next_low;
    uint32_t window;   /* epochs the last estimate took its least over (its log line) */
    uint64_t live_sum; /* kv_live summed over the epoch's steps (estimate's window) */
} wrk_off_adapt;

void wrk_off_adapt_init(wrk_off_adapt *a, uint32_t gpu_pages, uint32_t max_pages,
                        uint32_t epoch_steps, uint32_t page_size);
/* Other knobs than the defaults (after init; benchmarks). */
void wrk_off_adapt_tune(wrk_off_adapt *a, const wrk_off_adapt_opts *o);
/* One forward batch: its time, the time the device waited for host attention in it, the pages
 * live after it. Returns the effective capacity for the next steps. */
uint32_t wrk_off_adapt_step(wrk_off_adapt *a, uint64_t busy_ns, uint64_t wait_ns,
                            uint32_t kv_live);
/* The same with the batch's input tokens (the climb knob's throughput; the default rule
 * ignores them). */
uint32_t wrk_off_adapt_step_tokens(wrk_off_adapt *a, uint64_t tokens, uint64_t busy_ns,
                                   uint64_t wait_ns, uint32_t kv_live);
/* The same with the scheduler's estimate over the batch (estimate mode): gain_pages = the sum of
 * wrk_off_choice.gain_kv / page size over its gain_steps steps with decodes (the emulated
 * device or the engine may run one per batch). */
uint32_t wrk_off_adapt_step_est(wrk_off_adapt *a, uint64_t tokens, uint64_t busy_ns,
                                uint64_t wait_ns, uint64_t gain_pages, uint64_t gain_steps,
                                uint32_t kv_live);
/* The controller spilled past the capacity: it becomes min(kv_live, max_pages). */
uint32_t wrk_off_adapt_spill(wrk_off_adapt *a, uint32_t kv_live);

/* memory.policy auto: swap or offload, from the costs profiled at open and the workload the
 * pool is sized for. Swap is transparent when the link moves one layer's KV within one layer's
 * compute (ratio = swap time / compute time <= 1; the pooling paper's condition, seed 000 §3.3);
 * offload pays when the host's attention hides behind the device's linear layers for a useful
 * share of decodes (host_share = host decodes one device token's linear time covers,
 * (linear pass of a typical batch / its tokens) / (hattn_kv · decode_ctx), Neo's
 * Tca1 <= Tl0, at least WRK_AUTO_MIN_HOST_SHARE).
 * Swap first (transparent: no per-step cost), then offload, else swap (its adaptive expansion
 * backs off to every layer on the device: policy gpu's speed). */
#define WRK_AUTO_MIN_HOST_SHARE 0.1

typedef struct wrk_mem_auto_in {
    wrk_off_costs costs;        /* profiled */
    uint32_t n_layers;
    double layer_swap_s;        /* moving one layer's KV cache (the device's pages) one way */
    uint32_t batch_tokens;      /* tokens of a typical step */
    uint32_t decode_ctx;        /* KV tokens a typical decode reads */
} wrk_mem_auto_in;

typedef struct wrk_mem_auto_out {
    wrk_mem_policy policy;      /* WRK_MEM_SWAP or WRK_MEM_OFFLOAD */
    double swap_ratio;          /* layer swap time / layer compute time */
    double host_share;          /* host decodes per device token */
    char why[192];
} wrk_mem_auto_out;

void wrk_mem_auto_choose(const wrk_mem_auto_in *in, wrk_mem_auto_out *out);

#endif
