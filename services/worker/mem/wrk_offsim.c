/* wrk_offsim.c — the analytic model of CPU attention offload (wrk_offsim.h). */
#include "wrk_offsim.h"

#include <math.h>

/* The testbeds. KV per token = 2 (K, V) × layers × KV heads × head_dim × 2 bytes (bf16);
 * weights bf16. GPU: HBM bandwidth and dense bf16 tensor throughput at ~60% of peak; device KV
 * = memory − weights − ~10% for activations. CPU: Table 1's instance; bandwidth an estimate of
 * what a decode attention kernel streams (about 70% of the channels' peak).
 *   T4: 16 GB, 320 GB/s, 65 TFLOP/s; LLaMa-2-7B: 13.5 GB, 512 KiB/token (32 KV heads).
 *       g4dn.4xlarge: 8 cores, 64 GB, ~30 GB/s.
 *   A10G: 24 GB, 600 GB/s, 125 TFLOP/s; LLaMa-3.1-8B: 16 GB, 128 KiB/token.
 *       g5.4xlarge: 8 cores, 64 GB, ~40 GB/s.
 *   2×H100 SXM: 2 × 80 GB, 2 × 3.35 TB/s, 2 × 989 TFLOP/s; LLaMa-3.1-70B: 141 GB,
 *       320 KiB/token. One NUMA node of 2 × Xeon 8462Y+: 16 cores, 512 GB, ~99 GB/s: four
 *       NUMA nodes on two sockets is two per socket, 4 of a socket's 8 DDR5 channels each;
 *       2 TB in a 32-slot HGX board is two DIMMs per channel, DDR5-4400: 4 × 35.2 = 140.8 GB/s
 *       peak, 70 % of it (75 GB/s until 2026-11-30: about half the peak). */
#define KIB 1024.0
const wrk_offsim_hw wrk_offsim_t4 = {.name = "T4-like (LLaMa-2-7B)",
                                     .w = 13.5e9 / 320e9,
                                     .lin_tok = 2 * 6.7e9 / (0.6 * 65e12),
                                     .dattn = 512 * KIB / 320e9,
                                     .hattn = 512 * KIB / 30e9,
                                     .gpu_kv = (16e9 * 0.9 - 13.5e9) / (512 * KIB),
                                     .cpu_kv = 48e9 / (512 * KIB),
                                     .max_batch = 256};
const wrk_offsim_hw wrk_offsim_a10g = {.name = "A10G-like (LLaMa-3.1-8B)",
                                       .w = 16e9 / 600e9,
                                       .lin_tok = 2 * 8e9 / (0.6 * 125e12),
                                       .dattn = 128 * KIB / 600e9,
                                       .hattn = 128 * KIB / 40e9,
                                       .gpu_kv = (24e9 * 0.9 - 16e9) / (128 * KIB),
                                       .cpu_kv = 48e9 / (128 * KIB),
                                       .max_batch = 256};
const wrk_offsim_hw wrk_offsim_h100 = {.name = "2xH100-like (LLaMa-3.1-70B)",
                                       .w = 141e9 / (2 * 3.35e12),
                                       .lin_tok = 2 * 70e9 / (2 * 0.6 * 989e12),
                                       .dattn = 320 * KIB / (2 * 3.35e12),
                                       .hattn = 320 * KIB / 99e9,
                                       .gpu_kv = (2 * 80e9 * 0.9 - 141e9) / (320 * KIB),
                                       .cpu_kv = 400e9 / (320 * KIB),
                                       .max_batch = 512};

static double linear(const wrk_offsim_hw *hw, double tokens) {
    double c = hw->lin_tok * tokens;
    return c > hw->w ? c : hw->w;
}

wrk_offsim_result wrk_offsim_run(const wrk_offsim_hw *hw, double in_len, double out_len) {
    wrk_offsim_result r = {0};
    double ctx = in_len + out_len / 2;
    double ng = floor(hw->gpu_kv / ctx);
    if (ng > hw->max_batch) ng = hw->max_batch;
    if (ng < 1) ng = 1;
    r.n_gpu = (uint32_t)ng;
    double pre_per_req = in_len / out_len; /* prefill tokens per decode token */
    double p = ng * pre_per_req;
    r.step_gpu = linear(hw, ng + p) + hw->dattn * (ng * ctx + p * in_len / 2);
    r.thr_gpu = ng / r.step_gpu;
    r.step_off = r.step_gpu;
    r.thr_off = r.thr_gpu;
    double nc_max = floor(hw->cpu_kv / ctx);
    if (nc_max > hw->max_batch - ng) nc_max = hw->max_batch - ng;
    for (double nc = 1; nc <= nc_max; nc++) {
        double pp = (ng + nc) * pre_per_req;
        double tl0 = linear(hw, ng + pp), tl1 = linear(hw, nc);
        double tca1 = hw->hattn * nc * ctx;
        double tga0 = hw->dattn * (ng * ctx + pp * in_len / 2);
        double t = (tl0 > tca1 ? tl0 : tca1) + tl1 + tga0;
        double thr = (ng + nc) / t;
        if (thr > r.thr_off) {
            r.thr_off = thr;
            r.step_off = t;
            r.n_cpu = (uint32_t)nc;
        }
    }
    r.gain = r.thr_off / r.thr_gpu - 1;
    return r;
}
