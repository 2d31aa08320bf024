/* bench_hattn.c — issue 13, benchmark 4: the host attention kernel of CPU attention offload
 * (Neo, seed 004 §3.4). Decode attention is bound by memory bandwidth: how many KV bytes per
 * second does it read, at 1 and 2 threads, against the machine's read bandwidth measured the
 * same way (a streaming sum over a buffer as large as the KV, on the same pool)?
 *
 * Workload: `seqs` decode sequences of `ctx` context tokens each, one query row each, a
 * Llama-3-8B layer's attention shape (32 query heads, 8 KV heads, head_dim 128, f32 KV as the
 * cpu engine stores it: 8 KiB of K and V per token), pages of 16 tokens scattered over the
 * region. The kernel is krn_cpu_attention (the flash-decoding split over KV chunks when there
 * are fewer (sequence, head) groups than the threads want). Rounds interleave the read-bandwidth
 * probe and the kernel so both see the same machine load; the medians are reported.
 *
 *   bench_hattn [seqs ctx rounds]      e.g. build-rel/bench/bench_hattn 64 1024 7
 *
 * Prints a Markdown table (bench/results/tiers.md). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "krn_cpu.h"

#define PAGE     16
#define N_KV     8
#define HEAD_DIM 128
#define N_HEADS  32
#define MAX_ROUNDS 31

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The read probe: each task sums its share of the buffer with 8 independent accumulators
 * (vectorised by the compiler at -O2/-O3), so loads, not adds, bound it. */
typedef struct read_job {
    const float *buf;
    size_t n;
    float sums[64];
} read_job;

static void read_task(void *arg, int task, int n_tasks) {
    read_job *j = arg;
    size_t per = j->n / (size_t)n_tasks, lo = per * (size_t)task;
    size_t hi = task + 1 == n_tasks ? j->n : lo + per;
    float acc[16] = {0};
    size_t i = lo;
    for (; i + 16 <= hi; i += 16)
        for (int k = 0; k < 16; k++) acc[k] += j->buf[i + k];
    for (; i < hi; i++) acc[0] += j->buf[i];
    float s = 0;
    for (int k = 0; k < 16; k++) s += acc[k];
    j->sums[task % 64] = s;
}

int main(int argc, char **argv) {
    int seqs = argc > 1 ? atoi(argv[1]) : 64;
    int ctx = argc > 2 ? atoi(argv[2]) : 1024;
    int rounds = argc > 3 ? atoi(argv[3]) : 7;
    if (seqs < 1 || ctx < 1 || rounds < 1 || rounds > MAX_ROUNDS) {
        fprintf(stderr, "usage: bench_hattn [seqs ctx rounds<=%d]\n", MAX_ROUNDS);
        return 2;
    }
    int pages_per = (ctx + PAGE - 1) / PAGE, n_pages = seqs * pages_per;
    size_t tok = (size_t)N_KV * HEAD_DIM;
    size_t kv_floats = (size_t)n_pages * 2 * PAGE * tok;
    float *kvbuf = malloc(kv_floats * sizeof(float));
    float *q = malloc((size_t)seqs * N_HEADS * HEAD_DIM * sizeof(float));
    float *out = malloc((size_t)seqs * N_HEADS * HEAD_DIM * sizeof(float));
    uint32_t *pages = malloc((size_t)n_pages * sizeof(uint32_t));
    krn_attn_item *items = malloc((size_t)seqs * sizeof *items);
    if (!kvbuf || !q || !out || !pages || !items) {
        fprintf(stderr, "bench_hattn: out of memory (%zu MiB of KV)\n",
                kv_floats * sizeof(float) >> 20);
        return 1;
    }
    uint64_t x = 88172645463325252ull;
    for (size_t i = 0; i < kv_floats; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        kvbuf[i] = (float)(x >> 40) / (float)(1u << 24) - 0.5f;
    }
    for (size_t i = 0; i < (size_t)seqs * N_HEADS * HEAD_DIM; i++) q[i] = kvbuf[i * 7 % kv_floats];
    /* pages interleaved across sequences, as an allocator serving many at once hands them out */
    for (int s = 0; s < seqs; s++)
        for (int p = 0; p < pages_per; p++) pages[s * pages_per + p] = (uint32_t)(p * seqs + s);
    krn_kv_layer kv = {.base = kvbuf, .page_size = PAGE, .n_kv_heads = N_KV, .head_dim = HEAD_DIM};
    for (int s = 0; s < seqs; s++)
        items[s] = (krn_attn_item){.q = q + (size_t)s * N_HEADS * HEAD_DIM,
                                   .out = out + (size_t)s * N_HEADS * HEAD_DIM,
                                   .n_q = 1,
                                   .pages = pages + (size_t)s * pages_per,
                                   .n_ctx = ctx,
                                   .q_offset = ctx - 1};
    double kv_bytes = (double)seqs * ctx * 2.0 * (double)tok * sizeof(float);

    printf("| threads | KV read | attention (median) | KV bytes/s | read probe bytes/s | "
           "share |\n| ---: | ---: | ---: | ---: | ---: | ---: |\n");
    for (int threads = 1; threads <= 2; threads++) {
        krn_pool *p = krn_pool_create(threads);
        if (!p) {
            fprintf(stderr, "bench_hattn: cannot start %d threads\n", threads);
            return 1;
        }
        read_job rj = {.buf = kvbuf, .n = kv_floats};
        double t_att[MAX_ROUNDS], t_read[MAX_ROUNDS];
        krn_cpu_attention(p, &kv, items, seqs, N_HEADS, 0.088f); /* warm */
        for (int r = 0; r < rounds; r++) {
            double t0 = now_s();
            krn_pool_run(p, read_task, &rj, threads);
            double t1 = now_s();
            krn_cpu_attention(p, &kv, items, seqs, N_HEADS, 0.088f);
            double t2 = now_s();
            t_read[r] = t1 - t0;
            t_att[r] = t2 - t1;
        }
        qsort(t_att, (size_t)rounds, sizeof(double), cmp_double);
        qsort(t_read, (size_t)rounds, sizeof(double), cmp_double);
        double att = t_att[rounds / 2], rd = t_read[rounds / 2];
        double bw_att = kv_bytes / att, bw_read = (double)kv_floats * sizeof(float) / rd;
        printf("| %d | %.0f MiB | %.2f ms | %.2f GB/s | %.2f GB/s | %.0f%% |\n", threads,
               kv_bytes / (1 << 20), att * 1e3, bw_att / 1e9, bw_read / 1e9,
               100.0 * bw_att / bw_read);
        if (rj.sums[0] == 12345.678f) printf("(sum %g)\n", rj.sums[0]); /* keep the probe */
        krn_pool_destroy(p);
    }
    free(kvbuf);
    free(q);
    free(out);
    free(pages);
    free(items);
    return 0;
}
