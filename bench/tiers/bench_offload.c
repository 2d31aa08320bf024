/* bench_offload.c — issue 13, benchmark 3: CPU attention offload (Neo) against GPU-only
 * serving at T4-, A10G- and H100-like ratios (seed 004 Table 1), over output lengths, on the
 * analytic model of services/worker/mem/wrk_offsim.h (its assumptions and figures are there).
 *
 *   bench_offload [in_len]          e.g. build-rel/bench/bench_offload 1000
 *
 * Each point also runs with 4x its host's attention bandwidth (the whole machine's channels
 * rather than one node's), to show what the gain depends on. Prints a Markdown table
 * (bench/results/tiers.md). */
#include <stdio.h>
#include <stdlib.h>

#include "wrk_offsim.h"

int main(int argc, char **argv) {
    double in_len = argc > 1 ? atof(argv[1]) : 1000;
    if (!(in_len >= 1)) {
        fprintf(stderr, "usage: bench_offload [in_len >= 1]\n");
        return 2;
    }
    static const double outs[] = {25, 100, 400, 1600};
    const wrk_offsim_hw *hws[] = {&wrk_offsim_t4, &wrk_offsim_a10g, &wrk_offsim_h100};
    printf("input %.0f tokens\n\n| point | host bw | output | GPU-only reqs | tok/s | offload "
           "reqs (gpu+cpu) | tok/s | gain |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | "
           "---: |\n",
           in_len);
    for (size_t h = 0; h < sizeof hws / sizeof *hws; h++)
        for (int bw = 1; bw <= 4; bw *= 4)
            for (size_t i = 0; i < sizeof outs / sizeof *outs; i++) {
                wrk_offsim_hw hw = *hws[h];
                hw.hattn /= bw;
                wrk_offsim_result r = wrk_offsim_run(&hw, in_len, outs[i]);
                printf("| %s | %dx | %.0f | %u | %.0f | %u+%u | %.0f | %+.1f%% |\n", hw.name, bw,
                       outs[i], r.n_gpu, r.thr_gpu, r.n_gpu, r.n_cpu, r.thr_off, 100 * r.gain);
            }
    return 0;
}
