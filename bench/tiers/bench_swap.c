/* bench_swap.c — issue 13, benchmark 5: the real cpu engine with the swap memory policy on,
 * against policy gpu on the same workload: are the outputs identical, and what does swapping
 * cost per decode step?
 *
 * Workload: `seqs` sequences of `ctx` prompt tokens each (prefilled in chunks), then `steps`
 * decode steps of all sequences in one forward batch (the saturated decode the pooling paper
 * measures). Configurations: gpu; swap with S of the model's n layers on the device for every
 * S in 2..n-1, over memory speed and over each emulated link. For each: the median and mean
 * wall time of a decode step (after `warmup` steps), the share of it compute waited for swaps,
 * the bytes moved per step, and whether every decode output's logits equal gpu's bit for bit.
 *
 *   bench_swap MODEL_DIR [seqs ctx steps warmup threads gbps...]
 *   e.g. build-rel/bench/bench_swap build-rel/models/small-f32 16 1024 24 4 2 0 32 8
 *
 * Prints a Markdown table (bench/results/tiers.md). Exit 1 if any output differs. */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "eng.h"

#define PAGE 16u

typedef struct bench_cfg {
    const char *model;
    uint32_t seqs, ctx, steps, warmup, threads;
    uint32_t n_layers;
    size_t page_bytes; /* one page of one layer */
} bench_cfg;

typedef struct bench_run {
    double median_ms, mean_ms, stall_share, bytes_per_step;
    float *logits; /* [seqs][vocab] of the last decode step */
    bool ok;
} bench_run;

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static uint32_t pages_per_seq(const bench_cfg *c) {
    return (c->ctx + c->warmup + c->steps + PAGE - 1) / PAGE;
}

static bool check(pie_code rc, const pie_status *st, const char *what) {
    if (rc == PIE_OK) return true;
    fprintf(stderr, "bench_swap: %s: %s\n", what, st->msg);
    return false;
}

/* Prefills every sequence (chunks of at most 256 tokens; slots 0..255 as inputs). */
static bool prefill(eng *e, const bench_cfg *c, uint32_t **pages, pie_status *st) {
    uint32_t vocab = eng_get_info(e)->vocab_size;
    uint32_t slots[256], toks[256], pos[256];
    for (uint32_t s = 0; s < c->seqs; s++)
        for (uint32_t from = 0; from < c->ctx; from += 256) {
            uint32_t n = c->ctx - from < 256 ? c->ctx - from : 256;
            for (uint32_t i = 0; i < n; i++) {
                slots[i] = i;
                toks[i] = (s * 7919u + (from + i) * 104729u + 13u) % vocab;
                pos[i] = from + i;
            }
            if (!check(eng_embed_text(e, slots, toks, pos, n, st), st, "embed")) return false;
            uint32_t len = from + n;
            eng_forward_item it = {.kv_pages = pages[s],
                                   .n_kv_pages = (len + PAGE - 1) / PAGE,
                                   .kv_last_page_len = (len - 1) % PAGE + 1,
                                   .append_kv = true,
                                   .in_slots = slots,
                                   .n_in = n};
            if (!check(eng_forward(e, &it, 1, st), st, "prefill")) return false;
        }
    return true;
}

/* One decode step of every sequence at token index t (>= ctx); outputs to slots 256 + s. */
static bool decode(eng *e, const bench_cfg *c, uint32_t **pages, uint32_t t,
                   eng_forward_item *items, uint32_t *in, uint32_t *out, pie_status *st) {
    uint32_t vocab = eng_get_info(e)->vocab_size;
    uint32_t *toks = malloc(c->seqs * sizeof *toks), *pos = malloc(c->seqs * sizeof *pos);
    bool ok = toks && pos;
    for (uint32_t s = 0; ok && s < c->seqs; s++) {
        in[s] = 512 + s;
        out[s] = 256 + s;
        toks[s] = (s * 31u + t * 17u + 5u) % vocab;
        pos[s] = t;
        items[s] = (eng_forward_item){.kv_pages = pages[s],
                                      .n_kv_pages = t / PAGE + 1,
                                      .kv_last_page_len = t % PAGE + 1,
                                      .append_kv = true,
                                      .in_slots = &in[s],
                                      .n_in = 1,
                                      .out_slots = &out[s],
                                      .n_out = 1};
    }
    ok = ok && check(eng_embed_text(e, in, toks, pos, c->seqs, st), st, "embed");
    ok = ok && check(eng_forward(e, items, c->seqs, st), st, "decode");
    free(toks);
    free(pos);
    return ok;
}

/* One configuration: slots 0 = policy gpu. */
static bench_run run(const bench_cfg *c, uint32_t slots, double gbps) {
    bench_run r = {0};
    uint32_t pps = pages_per_seq(c);
    eng_opts o = {.model_dir = c->model,
                  .kv_page_size = PAGE,
                  .kv_pages = c->seqs * pps,
                  .embed_slots = 1024,
                  .max_batch_tokens = 256 > c->seqs ? 256 : c->seqs,
                  .n_threads = (int)c->threads,
                  .swap_slots = slots,
                  /* the host pool for 2 layers on the device: n - 2 + 2 layer caches */
                  .swap_host_bytes = (uint64_t)c->n_layers * c->seqs * pps * c->page_bytes,
                  .swap_link_bytes_per_s = gbps * 1e9 / 8};
    pie_status st = {0};
    eng *e = NULL;
    uint32_t **pages = calloc(c->seqs, sizeof *pages);
    eng_forward_item *items = calloc(c->seqs, sizeof *items);
    uint32_t *in = calloc(c->seqs, sizeof *in), *out = calloc(c->seqs, sizeof *out);
    double *ms = calloc(c->steps, sizeof *ms);
    if (!pages || !items || !in || !out || !ms) goto done;
    if (!check(eng_open(&o, &e, &st), &st, "eng_open")) goto done;
    uint32_t vocab = eng_get_info(e)->vocab_size;
    for (uint32_t s = 0; s < c->seqs; s++) {
        pages[s] = malloc(pps * sizeof **pages);
        if (!pages[s]) goto done;
        for (uint32_t j = 0; j < pps; j++) pages[s][j] = s * pps + j;
    }
    if (!prefill(e, c, pages, &st)) goto done;
    eng_swap_stats s0 = {0}, s1;
    for (uint32_t k = 0; k < c->warmup + c->steps; k++) {
        if (k == c->warmup) eng_swap_get_stats(e, &s0);
        double t0 = now_ms();
        if (!decode(e, c, pages, c->ctx + k, items, in, out, &st)) goto done;
        if (k >= c->warmup) ms[k - c->warmup] = now_ms() - t0;
    }
    eng_swap_get_stats(e, &s1);
    double total = 0;
    for (uint32_t k = 0; k < c->steps; k++) total += ms[k];
    r.mean_ms = total / c->steps;
    qsort(ms, c->steps, sizeof *ms, cmp_double);
    r.median_ms = ms[c->steps / 2];
    r.stall_share = (double)(s1.stall_ns - s0.stall_ns) * 1e-6 / total;
    r.bytes_per_step =
        (double)(s1.swap_in_bytes - s0.swap_in_bytes + s1.swap_out_bytes - s0.swap_out_bytes) /
        c->steps;
    r.logits = malloc((size_t)c->seqs * vocab * sizeof *r.logits);
    if (!r.logits) goto done;
    for (uint32_t s = 0; s < c->seqs; s++)
        if (!check(eng_logits(e, out[s], r.logits + (size_t)s * vocab, &st), &st, "logits"))
            goto done;
    r.ok = true;
done:
    if (pages)
        for (uint32_t s = 0; s < c->seqs; s++) free(pages[s]);
    free(pages);
    free(items);
    free(in);
    free(out);
    free(ms);
    eng_close(e);
    return r;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: bench_swap MODEL_DIR [seqs ctx steps warmup threads gbps...]\n");
        return 2;
    }
    bench_cfg c = {
        .model = argv[1], .seqs = 16, .ctx = 1024, .steps = 24, .warmup = 4, .threads = 2};
    uint32_t *f[] = {&c.seqs, &c.ctx, &c.steps, &c.warmup, &c.threads};
    for (int i = 0; i < 5 && i + 2 < argc; i++) *f[i] = (uint32_t)strtoul(argv[i + 2], NULL, 10);
    double gbps[8] = {0};
    int n_gbps = 0;
    for (int i = 7; i < argc && n_gbps < 8; i++) gbps[n_gbps++] = strtod(argv[i], NULL);
    if (n_gbps == 0) n_gbps = 1; /* memory speed only */
    if (c.seqs == 0 || c.seqs > 256 || c.ctx == 0 || c.steps == 0 || c.ctx + c.steps > 65536) {
        fprintf(stderr, "bench_swap: seqs 1..256, ctx and steps >= 1\n");
        return 2;
    }
    eng_opts probe = {.model_dir = c.model,
                      .kv_pages = 1,
                      .embed_slots = 1,
                      .max_batch_tokens = 1,
                      .n_threads = 1};
    pie_status st = {0};
    eng *e = NULL;
    if (!check(eng_open(&probe, &e, &st), &st, "eng_open")) return 1;
    uint32_t n = eng_get_info(e)->n_layers, vocab = eng_get_info(e)->vocab_size;
    size_t page_bytes = eng_get_info(e)->kv_page_layer_bytes;
    eng_close(e);
    c.n_layers = n;
    c.page_bytes = page_bytes;
    bench_run gpu = run(&c, 0, 0);
    if (!gpu.ok) return 1;
    printf("model %s: %u layers; %u sequences x %u tokens, %u decode steps (+%u warm-up), %u "
           "threads; KV in use per layer %.1f MiB\n\n",
           c.model, n, c.seqs, c.ctx, c.steps, c.warmup, c.threads,
           (double)c.seqs * pages_per_seq(&c) * page_bytes / (1 << 20));
    printf("| policy | layers on device | link | step median ms | step mean ms | vs gpu "
           "(median) | compute waiting | swapped MiB/step | outputs = gpu |\n");
    printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    printf("| gpu | %u | - | %.2f | %.2f | - | - | 0 | - |\n", n, gpu.median_ms, gpu.mean_ms);
    int status = 0;
    for (int g = 0; g < n_gbps; g++)
        for (uint32_t s = n - 1; s >= 2; s--) {
            bench_run r = run(&c, s, gbps[g]);
            if (!r.ok) return 1;
            bool same = memcmp(r.logits, gpu.logits, (size_t)c.seqs * vocab * sizeof(float)) == 0;
            if (!same) status = 1;
            char link[32];
            if (gbps[g] > 0)
                snprintf(link, sizeof link, "%g Gb/s", gbps[g]);
            else
                snprintf(link, sizeof link, "memcpy");
            printf("| swap | %u | %s | %.2f | %.2f | %+.1f%% | %.0f%% | %.1f | %s |\n", s, link,
                   r.median_ms, r.mean_ms, (r.median_ms / gpu.median_ms - 1) * 100,
                   r.stall_share * 100, r.bytes_per_step / (1 << 20), same ? "yes" : "NO");
            fflush(stdout);
            free(r.logits);
        }
    free(gpu.logits);
    return status;
}
