/* bench_tiers.c — the host memory pool's policies at GPU ratios, on the swap pipeline model
 * (services/worker/mem/wrk_swapsim.h; issue 13, benchmark 1).
 *
 * For a saturating decode workload on a model of L layers whose layer compute is t_c and whose
 * whole device KV memory moves over the link in T: a sweep of every fixed expansion (slots =
 * layers on the device) finds the best throughput; adaptive expansion (wrk_expand.h) runs from
 * no expansion, and the epochs it takes to come within 2% of that best are counted; then the
 * link's bandwidth halves and the same is measured again. Prints one line per scenario:
 *   scenario  best_slots best_tok_s  adaptive_slots adaptive_tok_s ratio epochs_to_2%
 * Usage: bench_tiers [epochs per phase, default 80] */
#include <stdio.h>
#include <stdlib.h>

#include "wrk_expand.h"
#include "wrk_swapsim.h"

typedef struct scenario {
    const char *name;
    wrk_swapsim_model m;
} scenario;

static double sweep(const wrk_swapsim_model *m, uint32_t *best_slots) {
    double best = 0;
    for (uint32_t s = m->n_layers; s >= 2; s--) {
        wrk_swapsim_point p = wrk_swapsim_eval(m, s, 8);
        if (p.tokens_per_s > best) {
            best = p.tokens_per_s;
            *best_slots = s;
        }
    }
    return best;
}

/* Epochs of the controller; *settled = first epoch from which it stayed within 2% of target
 * (probes aside). Returns the mean throughput of the last quarter. */
static double phase(wrk_expand *e, const wrk_swapsim_model *m, int epochs, double target,
                    int *settled) {
    double sum = 0;
    int n = 0;
    *settled = -1;
    for (int ep = 0; ep < epochs; ep++) {
        wrk_swapsim_point p = wrk_swapsim_eval(m, e->slots, 8);
        if (p.tokens_per_s >= 0.98 * target) {
            if (*settled < 0) *settled = ep;
        } else if (e->state != WRK_EXPAND_TRYING) {
            *settled = -1;
        }
        if (ep >= epochs * 3 / 4) {
            sum += p.tokens_per_s;
            n++;
        }
        wrk_expand_obs o = {.tokens_per_s = p.tokens_per_s,
                            .stall_s = p.sim.stall_s,
                            .busy_s = p.sim.step_s,
                            .link_idle = p.sim.slack_s > 0,
                            .kv_limited = p.kv_limited};
        wrk_expand_observe(e, &o);
    }
    return n ? sum / n : 0;
}

int main(int argc, char **argv) {
    int epochs = argc > 1 ? atoi(argv[1]) : 80;
    /* Per-layer times of an 8B-shape model's decode step on an H100-class GPU and a PCIe-Gen5
     * / NVLink-C2C-class link, scaled so that at the start a layer's swap takes about twice its
     * compute (the paper's Fig. 4 ratio) or 1x / 4x around it. */
    scenario sc[] = {
        {"swap=2x compute, 32 layers",
         {32, 4000, 40, 1000, 120e-6, 1.5e-6, 32 * 2 * (120e-6 + 1.5e-6 * 100)}},
        {"swap=1x compute, 32 layers",
         {32, 4000, 40, 1000, 120e-6, 1.5e-6, 32 * 1 * (120e-6 + 1.5e-6 * 100)}},
        {"swap=4x compute, 32 layers",
         {32, 4000, 40, 1000, 120e-6, 1.5e-6, 32 * 4 * (120e-6 + 1.5e-6 * 100)}},
        {"swap=2x compute, 80 layers",
         {80, 4000, 40, 1000, 60e-6, 0.8e-6, 80 * 2 * (60e-6 + 0.8e-6 * 100)}},
    };
    printf("%-30s %-6s %6s %10s %6s %10s %7s %6s\n", "scenario", "phase", "best_S", "best_tok/s",
           "got_S", "got_tok/s", "ratio", "epochs");
    for (size_t i = 0; i < sizeof sc / sizeof sc[0]; i++) {
        wrk_swapsim_model m = sc[i].m;
        wrk_expand e;
        wrk_expand_config cfg = {.n_layers = m.n_layers};
        wrk_expand_init(&e, &cfg);
        for (int half = 0; half < 2; half++) {
            if (half) m.t_move_all *= 2;
            uint32_t best_slots = m.n_layers;
            double best = sweep(&m, &best_slots);
            int settled;
            double got = phase(&e, &m, epochs, best, &settled);
            printf("%-30s %-6s %6u %10.0f %6u %10.0f %7.3f %6d\n", sc[i].name,
                   half ? "bw/2" : "start", best_slots, best, e.slots, got, got / best, settled);
        }
    }
    return 0;
}
