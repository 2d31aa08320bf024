/* bench_cuda.c — speed of the cuda backend (services/worker/engine/eng_cuda*.c) on one model.
 *
 * Measures, in one run on the model directory given on the command line:
 *   bandwidth   device-to-device cudaMemcpy of --bw-mib MiB (best of 10): 2 x bytes / time,
 *               since a copy reads and writes every byte; GB/s
 *   decode b=1  one token per step (forward + next_dist top-k 256) over a --context token
 *               context, median and best of --steps, ms/token; against the HBM floor
 *               weight bytes (as stored on the device: bf16) / bandwidth, and against the
 *               stricter floor of the bytes a step reads (the embedding table is not read
 *               when lm_head is separate)
 *   decode b=B  --batch sequences of --context tokens (prefilled once, copied with copy_pages),
 *               one token each per step: tokens/s
 *   prefill     one forward of --prefill tokens into fresh pages (output of the last), tokens/s
 * Graph replay is on unless --no-graphs (or PIE_CUDA_GRAPHS=0).
 *
 * Usage: bench_cuda MODEL_DIR [--context 1024] [--batch 64] [--prefill 2048] [--steps 32]
 *                   [--bw-mib 1024] [--no-graphs]
 * Prints one Markdown table row per measurement; bench/results/cuda.md keeps recorded runs and
 * the acceptance targets (decode b=1 <= 1.25x the floor for the 8B shape, <= 1.6x for 1B;
 * decode b=64 and prefill >= 3x transformers, bench/cuda/bench_transformers.py). */
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "eng_cuda.h"
#include "mdl.h"

typedef struct bench_opts {
    const char *model;
    uint32_t context, batch, prefill, steps, bw_mib;
    bool graphs;
} bench_opts;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void die(const char *what, const pie_status *st) {
    fprintf(stderr, "bench_cuda: %s: %s\n", what, st ? st->msg : "failed");
    exit(1);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Best device-to-device copy bandwidth (read + write bytes per second). */
static double copy_bandwidth(size_t bytes) {
    void *a = NULL, *b = NULL;
    if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess) {
        fprintf(stderr, "bench_cuda: cannot allocate 2 x %zu bytes for the bandwidth test\n",
                bytes);
        exit(1);
    }
    cudaEvent_t e0, e1;
    if (cudaEventCreate(&e0) != cudaSuccess || cudaEventCreate(&e1) != cudaSuccess ||
        cudaMemset(a, 1, bytes) != cudaSuccess) {
        fprintf(stderr, "bench_cuda: cuda events / memset failed\n");
        exit(1);
    }
    double best = 0;
    for (int i = 0; i < 11; i++) {
        float ms = 0;
        if (cudaEventRecord(e0, 0) != cudaSuccess ||
            cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice) != cudaSuccess ||
            cudaEventRecord(e1, 0) != cudaSuccess || cudaEventSynchronize(e1) != cudaSuccess ||
            cudaEventElapsedTime(&ms, e0, e1) != cudaSuccess) {
            fprintf(stderr, "bench_cuda: the bandwidth copy failed\n");
            exit(1);
        }
        double bw = 2.0 * (double)bytes / (ms * 1e-3);
        if (i > 0 && bw > best) best = bw; /* the first copy warms up */
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaFree(a);
    cudaFree(b);
    return best;
}

static uint32_t *seq_pages(uint32_t seq, uint32_t per) {
    uint32_t *p = malloc(sizeof *p * per);
    if (!p) exit(1);
    for (uint32_t j = 0; j < per; j++) p[j] = seq * per + j;
    return p;
}

/* Prefill n tokens of a sequence into pages (appending), output of the last to out_slot. */
static double prefill(eng_cuda *e, const uint32_t *pages, uint32_t n, uint32_t out_slot) {
    const eng_info *in = eng_cuda_get_info(e);
    uint32_t *slots = malloc(sizeof *slots * n), *toks = malloc(sizeof *toks * n),
             *pos = malloc(sizeof *pos * n);
    if (!slots || !toks || !pos) exit(1);
    for (uint32_t i = 0; i < n; i++) {
        slots[i] = i;
        toks[i] = (i * 7919u + 13u) % in->vocab_size;
        pos[i] = i;
    }
    pie_status st;
    if (eng_cuda_embed_text(e, slots, toks, pos, n, &st) != PIE_OK) die("embed", &st);
    uint32_t ps = in->kv_page_size;
    eng_forward_item it = {.kv_pages = pages,
                           .n_kv_pages = (n + ps - 1) / ps,
                           .kv_last_page_len = (n - 1) % ps + 1,
                           .append_kv = true,
                           .in_slots = slots,
                           .n_in = n,
                           .out_slots = &out_slot,
                           .n_out = 1};
    double t0 = now_s();
    if (eng_cuda_forward(e, &it, 1, &st) != PIE_OK) die("prefill forward", &st);
    double t = now_s() - t0;
    free(slots), free(toks), free(pos);
    return t;
}

/* One decode step of `batch` sequences at context ctx + step: forward + next_dist. */
static double decode_step(eng_cuda *e, uint32_t batch, uint32_t **pages, uint32_t ctx,
                          uint32_t slot0, uint32_t *ids, float *probs) {
    const eng_info *in = eng_cuda_get_info(e);
    uint32_t ps = in->kv_page_size, n = ctx + 1;
    enum { MAXB = 1024 };
    static uint32_t slots[MAXB], outs[MAXB], toks[MAXB], pos[MAXB];
    static eng_forward_item items[MAXB];
    static eng_dist_item dist[MAXB];
    pie_status st;
    for (uint32_t b = 0; b < batch; b++) {
        slots[b] = slot0 + b;
        outs[b] = slot0 + MAXB + b; /* embed_slots >= slot0 + 2 * MAXB */
        toks[b] = (b * 31u + ctx) % in->vocab_size;
        pos[b] = ctx;
        items[b] = (eng_forward_item){.kv_pages = pages[b],
                                      .n_kv_pages = (n + ps - 1) / ps,
                                      .kv_last_page_len = (n - 1) % ps + 1,
                                      .append_kv = true,
                                      .in_slots = &slots[b],
                                      .n_in = 1,
                                      .out_slots = &outs[b],
                                      .n_out = 1};
        dist[b] =
            (eng_dist_item){outs[b], 256, 1.0f, ids + (size_t)b * 256, probs + (size_t)b * 256};
    }
    if (eng_cuda_embed_text(e, slots, toks, pos, batch, &st) != PIE_OK) die("embed", &st);
    double t0 = now_s();
    if (eng_cuda_forward(e, items, batch, &st) != PIE_OK) die("decode forward", &st);
    if (eng_cuda_next_dist(e, dist, batch, &st) != PIE_OK) die("next_dist", &st);
    return now_s() - t0;
}

static void parse(int argc, char **argv, bench_opts *o) {
    *o = (bench_opts){
        .context = 1024, .batch = 64, .prefill = 2048, .steps = 32, .bw_mib = 1024, .graphs = true};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        uint32_t *u = !strcmp(a, "--context")   ? &o->context
                      : !strcmp(a, "--batch")   ? &o->batch
                      : !strcmp(a, "--prefill") ? &o->prefill
                      : !strcmp(a, "--steps")   ? &o->steps
                      : !strcmp(a, "--bw-mib")  ? &o->bw_mib
                                                : NULL;
        if (u && i + 1 < argc) {
            *u = (uint32_t)strtoul(argv[++i], NULL, 10);
        } else if (!strcmp(a, "--no-graphs")) {
            o->graphs = false;
        } else if (a[0] != '-' && !o->model) {
            o->model = a;
        } else {
            o->model = NULL;
            break;
        }
    }
    if (!o->model || o->batch == 0 || o->batch > 1024 || o->steps == 0 || o->context == 0 ||
        o->prefill == 0 || o->bw_mib == 0) {
        fprintf(stderr, "usage: bench_cuda MODEL_DIR [--context 1024] [--batch 64 (<= 1024)] "
                        "[--prefill 2048] [--steps 32] [--bw-mib 1024] [--no-graphs]\n");
        exit(2);
    }
}

static double median(double *v, uint32_t n) {
    qsort(v, n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

int main(int argc, char **argv) {
    bench_opts o;
    parse(argc, argv, &o);
    const uint32_t ps = 16;
    uint32_t per = (o.context + o.steps + 1 + ps - 1) / ps; /* pages per decode sequence */
    uint32_t pre_pages = (o.prefill + ps - 1) / ps;
    uint32_t pages = (o.batch + 1) * per + pre_pages;
    uint32_t max_t = o.prefill > o.context ? o.prefill : o.context;
    if (o.batch > max_t) max_t = o.batch;
    eng_opts eo = {.model_dir = o.model,
                   .backend = ENG_BACKEND_CUDA,
                   .kv_page_size = ps,
                   .kv_pages = pages,
                   .embed_slots = max_t + 2048,
                   .max_batch_tokens = max_t};
    pie_status st;
    mdl_config cfg;
    if (mdl_config_load(o.model, &cfg, &st) != PIE_OK) die("config", &st);
    eng_cuda *e = NULL;
    if (eng_cuda_open(&eo, &e, &st) != PIE_OK) die("open", &st);
    eng_cuda_set_graphs(e, o.graphs);
    const eng_info *in = eng_cuda_get_info(e);
    size_t dev_weights = in->weight_bytes / (strcmp(in->dtype, "f32") == 0 ? 2 : 1);
    size_t embed_bytes = (size_t)in->vocab_size * in->hidden_size * 2;
    /* untied: the embedding table is in weight_bytes but a decode step reads only its rows */
    size_t read_bytes = dev_weights - (cfg.tie_word_embeddings ? 0 : embed_bytes);
    printf("model %s: %s, %u layers, hidden %u, ffn %u, heads %u/%u, vocab %u; device %s; "
           "graphs %s\n",
           o.model, in->dtype, in->n_layers, in->hidden_size, in->intermediate_size, in->n_heads,
           in->n_kv_heads, in->vocab_size, eng_cuda_device_name(e), o.graphs ? "on" : "off");
    printf("weights on the device %.1f MiB (read per decode step %.1f MiB); KV pool %.1f MiB "
           "(%u pages of %u)\n\n",
           dev_weights / 1048576.0, read_bytes / 1048576.0, in->kv_pool_bytes / 1048576.0,
           in->kv_pages, in->kv_page_size);
    double bw = copy_bandwidth((size_t)o.bw_mib << 20);
    printf("| measurement | value | reference | ratio |\n| --- | --- | --- | --- |\n");
    printf("| device-to-device copy bandwidth (%u MiB, best of 10) | %.1f GB/s | | |\n", o.bw_mib,
           bw / 1e9);

    uint32_t **sp = malloc(sizeof *sp * (o.batch + 1));
    if (!sp) return 1;
    for (uint32_t b = 0; b <= o.batch; b++) sp[b] = seq_pages(b, per);
    uint32_t *pre = seq_pages(0, pre_pages);
    for (uint32_t j = 0; j < pre_pages; j++) pre[j] = (o.batch + 1) * per + j;
    uint32_t *ids = malloc(sizeof *ids * 256 * o.batch);
    float *probs = malloc(sizeof *probs * 256 * o.batch);
    double *t = malloc(sizeof *t * o.steps);
    if (!ids || !probs || !t) return 1;

    /* prefill (a warm-up run first: cuBLAS picks its kernels) */
    (void)prefill(e, pre, o.prefill, 0);
    double tp = prefill(e, pre, o.prefill, 0);
    printf("| prefill %u tokens | %.0f tok/s (%.1f ms) | transformers: bench_transformers.py | |\n",
           o.prefill, o.prefill / tp, tp * 1e3);

    /* context for every sequence: prefill one, copy it to the others */
    (void)prefill(e, sp[0], o.context, 0);
    for (uint32_t b = 1; b <= o.batch; b++)
        for (uint32_t j = 0; j * ps < o.context; j++) {
            uint32_t cnt = o.context - j * ps < ps ? o.context - j * ps : ps;
            eng_copy_item c = {sp[0][j], sp[b][j], 0, 0, cnt};
            if (eng_cuda_copy_pages(e, &c, 1, &st) != PIE_OK) die("copy_pages", &st);
        }

    /* decode b=1 on sequence 1 (its context is a copy); step 0 warms up / captures */
    for (uint32_t s = 0; s <= o.steps; s++) {
        double dt = decode_step(e, 1, &sp[1], o.context + s, max_t, ids, probs);
        if (s > 0) t[s - 1] = dt;
    }
    double med1 = median(t, o.steps), best1 = t[0];
    double floor_all = (double)dev_weights / bw, floor_read = (double)read_bytes / bw;
    printf("| decode b=1 @%u ctx (forward + next_dist), median (best) of %u | %.3f (%.3f) "
           "ms/token | floor %.3f ms (weights / bw); %.3f ms (bytes read / bw) | %.2fx; %.2fx |\n",
           o.context, o.steps, med1 * 1e3, best1 * 1e3, floor_all * 1e3, floor_read * 1e3,
           med1 / floor_all, med1 / floor_read);

    /* decode b=B: sequences 1..B; each step rewrites the same next position of each */
    for (uint32_t s = 0; s <= o.steps; s++) {
        double dt = decode_step(e, o.batch, &sp[1], o.context + s, max_t, ids, probs);
        if (s > 0) t[s - 1] = dt;
    }
    double medb = median(t, o.steps);
    printf("| decode b=%u @%u ctx, median (best) of %u | %.0f (%.0f) tok/s | transformers: "
           "bench_transformers.py | |\n",
           o.batch, o.context, o.steps, o.batch / medb, o.batch / t[0]);
    uint64_t replays;
    uint32_t graphs;
    eng_cuda_graph_stats(e, &replays, &graphs);
    printf("\ngraph replays %llu, graphs captured %u\n", (unsigned long long)replays, graphs);

    for (uint32_t b = 0; b <= o.batch; b++) free(sp[b]);
    free(sp), free(pre), free(ids), free(probs), free(t);
    eng_cuda_close(e);
    return 0;
}
