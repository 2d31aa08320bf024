/* bench_cuda.c — speed of the cuda backend (services/worker/engine/eng_cuda*.c) on one model.
 *
 * Measures, in one run on the model directory given on the command line:
 *   bandwidth   the device's read bandwidth: a kernel that reads --bw-mib MiB once with 16-byte
 *               loads, best of 10 (krn_cuda_read_bandwidth); GB/s. A copy's read+write rate is
 *               not what a decode step does.
 *   decode b=1  one token per step (forward + next_dist top-k 256) over a --context token
 *               context, median and best of --steps, ms/token; against the floor: the bytes a
 *               step actually reads / the read bandwidth. Those bytes are every layer's weights
 *               (norms, q|k|v, o, gate|up, down), the final norm and the LM head (V x d: tied
 *               or not, the LM head reads the whole matrix), one embedding row, and the
 *               context's K and V in every layer — not the embedding table (a step gathers
 *               one row of it).
 *   decode b=B  --batch sequences of --context tokens (prefilled once, copied with copy_pages),
 *               one token each per step: tokens/s
 *   prefill     one forward of --prefill tokens into fresh pages (output of the last), tokens/s
 *   clearing    eng_cuda_clear_pages of 1, 16 and 256 pages (what the worker does to every page
 *               a SlotBatch allocates: cudaMemsetAsync on the engine's stream per layer and run
 *               of consecutive pages), ascending ids and every other id (no runs), and
 *               eng_cuda_clear_embeds of 256 slots: median of --steps, against decode b=1
 * and for prefill and both decodes the kernels of the last forward (a graph's kernel nodes when
 * replayed, else the launches; next_dist adds 4 launches, not graphed) and the graph coverage
 * (decode steps replayed from a graph / decode steps).
 * Graph replay is on unless --no-graphs (or PIE_CUDA_GRAPHS=0).
 *   host link   pinned host ↔ device copies of 256 MiB (cudaMemcpyAsync, best of 5), each way:
 *               what the swap policy's layer moves can reach
 *   swap        with --swap-slots S (issue 13): the engine under the swap policy with S of the
 *               layers' KV on the device and the rest in a pinned host pool of --host-mib MiB
 *               (0: just enough); no graphs then. After the decodes: layers moved each way,
 *               bytes, compute stalls waiting for a layer (count, total ms). Run it beside the
 *               same command without --swap-slots: the step-time ratio is swap's transparency.
 *   offload     with --offload-host H (issue 13): the engine under CPU attention offload (every
 *               page fits the device: no eviction), the first H sequences of every decode step
 *               attending on --offload-threads host threads (the pick, not the scheduler), as
 *               Neo's second sub-batch; no graphs then. After the decodes: host items, host
 *               attention and the engine's wait for it. Beside the same command without it, the
 *               b=B step-time ratio is what offloading H sequences costs or gains on this host.
 *
 * Usage: bench_cuda MODEL_DIR [--context 1024] [--batch 64] [--prefill 2048] [--steps 32]
 *                   [--bw-mib 1024] [--no-graphs] [--swap-slots S [--host-mib M]]
 *                   [--offload-host H [--offload-threads N]]
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
#include "krn_cuda_device.h"
#include "mdl.h"

typedef struct bench_opts {
    const char *model;
    uint32_t context, batch, prefill, steps, bw_mib;
    uint32_t swap_slots, host_mib; /* the swap policy: layers on the device, host pool (0: fit) */
    uint32_t offload_host, offload_threads; /* offload: sequences on the host, its threads */
    bool graphs;
    bool decode_only; /* only the context prefill and the b=1 decode: a short run for ncu */
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

/* The device's read bandwidth (bytes per second). */
static double read_bandwidth(size_t bytes) {
    double bw = 0;
    char why[256];
    if (krn_cuda_read_bandwidth(bytes, 10, &bw, why, sizeof why) != 0) {
        fprintf(stderr, "bench_cuda: the read-bandwidth probe failed: %s\n", why);
        exit(1);
    }
    return bw;
}

/* Bytes one decode step of one sequence reads at a context of ctx tokens (bf16 on the device):
 * *weights the layers, final norm, LM head and one embedding row; *kv the context's K and V. */
static void step_bytes(const mdl_config *c, uint32_t ctx, double *weights, double *kv) {
    double d = c->hidden_size, qd = (double)c->n_heads * c->head_dim,
           kvd = (double)c->n_kv_heads * c->head_dim, ffn = c->intermediate_size;
    double layer = 2 * d + (qd + 2 * kvd) * d + d * qd + 2 * ffn * d + ffn * d;
    *weights = 2.0 * (layer * c->n_layers + d + (double)c->vocab_size * d + d);
    *kv = 2.0 * 2.0 * kvd * ctx * c->n_layers;
}

/* Kernels and graph coverage of a phase: stats before it (a) and after (b). */
static void print_graphs(const char *phase, const eng_cuda_stats *a, const eng_cuda_stats *b) {
    uint64_t dec = b->decode_steps - a->decode_steps, rep = b->graph_steps - a->graph_steps;
    printf("| %s: kernels of the last forward; graph coverage | %u kernels | %llu of %llu decode "
           "steps replayed | %.0f%% |\n",
           phase, b->last_step_kernels, (unsigned long long)rep, (unsigned long long)dec,
           dec ? 100.0 * (double)rep / (double)dec : 0.0);
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

/* One decode step of `batch` sequences at context ctx + step: forward + next_dist; the time of
 * next_dist alone goes to *dist_s (each handler ends with a stream sync, so host clocks split
 * the step exactly). */
static double decode_step(eng_cuda *e, uint32_t batch, uint32_t **pages, uint32_t ctx,
                          uint32_t slot0, uint32_t *ids, float *probs, double *dist_s) {
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
    double t1 = now_s();
    if (eng_cuda_next_dist(e, dist, batch, &st) != PIE_OK) die("next_dist", &st);
    double t2 = now_s();
    *dist_s = t2 - t1;
    return t2 - t0;
}

static void parse(int argc, char **argv, bench_opts *o) {
    *o = (bench_opts){
        .context = 1024, .batch = 64, .prefill = 2048, .steps = 32, .bw_mib = 1024, .graphs = true};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        uint32_t *u = !strcmp(a, "--context")           ? &o->context
                      : !strcmp(a, "--batch")           ? &o->batch
                      : !strcmp(a, "--prefill")         ? &o->prefill
                      : !strcmp(a, "--steps")           ? &o->steps
                      : !strcmp(a, "--bw-mib")          ? &o->bw_mib
                      : !strcmp(a, "--swap-slots")      ? &o->swap_slots
                      : !strcmp(a, "--host-mib")        ? &o->host_mib
                      : !strcmp(a, "--offload-host")    ? &o->offload_host
                      : !strcmp(a, "--offload-threads") ? &o->offload_threads
                                                        : NULL;
        if (u && i + 1 < argc) {
            *u = (uint32_t)strtoul(argv[++i], NULL, 10);
        } else if (!strcmp(a, "--no-graphs")) {
            o->graphs = false;
        } else if (!strcmp(a, "--decode-only")) {
            o->decode_only = true;
        } else if (a[0] != '-' && !o->model) {
            o->model = a;
        } else {
            o->model = NULL;
            break;
        }
    }
    if (o->swap_slots && o->offload_host) o->model = NULL; /* one policy at a time */
    if (!o->model || o->batch == 0 || o->batch > 1024 || o->steps == 0 || o->context == 0 ||
        o->prefill == 0 || o->bw_mib == 0) {
        fprintf(stderr, "usage: bench_cuda MODEL_DIR [--context 1024] [--batch 64 (<= 1024)] "
                        "[--prefill 2048] [--steps 32] [--bw-mib 1024] [--no-graphs] "
                        "[--decode-only] [--swap-slots S [--host-mib M]] "
                        "[--offload-host H [--offload-threads N]]\n");
        exit(2);
    }
}

static double median(double *v, uint32_t n) {
    qsort(v, n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* The clearing rows: n pages with ids step apart (1: one run; 2: no two consecutive), and
 * embedding slots; median of `reps` (t holds at least reps), against the decode step dec_s. */
static void bench_clearing(eng_cuda *e, uint32_t reps, double *t, double dec_s) {
    const eng_info *in = eng_cuda_get_info(e);
    size_t page_bytes = (size_t)in->n_layers * 2 * in->kv_page_size * in->n_kv_heads *
                        in->head_dim * 2; /* bf16 K/V */
    uint32_t *ids = malloc(sizeof *ids * 512);
    if (!ids) die("clear ids", NULL);
    pie_status st;
    static const uint32_t counts[] = {1, 16, 256};
    for (uint32_t stride = 1; stride <= 2; stride++)
        for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
            uint32_t n = counts[c];
            if ((uint64_t)n * stride > in->kv_pages) break;
            for (uint32_t i = 0; i < n; i++) ids[i] = i * stride;
            for (uint32_t r = 0; r < reps; r++) {
                double t0 = now_s();
                if (eng_cuda_clear_pages(e, ids, n, &st) != PIE_OK) die("clear_pages", &st);
                t[r] = now_s() - t0;
            }
            double m = median(t, reps);
            printf("| clear_pages n=%u %s (%.2f MiB), median of %u | %.1f us (%.2f us/page) | "
                   "decode b=1 %.3f ms | %.1f%% |\n",
                   n, stride == 1 ? "consecutive" : "every other id", n * page_bytes / 1048576.0,
                   reps, m * 1e6, m * 1e6 / n, dec_s * 1e3, 100 * m / dec_s);
        }
    uint32_t n = in->embed_slots < 256 ? in->embed_slots : 256;
    for (uint32_t i = 0; i < n; i++) ids[i] = i;
    for (uint32_t r = 0; r < reps; r++) {
        double t0 = now_s();
        if (eng_cuda_clear_embeds(e, ids, n, &st) != PIE_OK) die("clear_embeds", &st);
        t[r] = now_s() - t0;
    }
    double m = median(t, reps);
    printf("| clear_embeds n=%u consecutive, median of %u | %.1f us | decode b=1 %.3f ms | "
           "%.1f%% |\n",
           n, reps, m * 1e6, dec_s * 1e3, 100 * m / dec_s);
    free(ids);
}

/* Pinned host memory to the device and back, 256 MiB, best of 5 each way (GB/s). */
static void link_bandwidth(double *h2d, double *d2h) {
    const size_t bytes = 256u << 20;
    void *h = NULL, *d = NULL;
    cudaStream_t s = NULL;
    *h2d = *d2h = 0;
    if (cudaMallocHost(&h, bytes) != cudaSuccess || cudaMalloc(&d, bytes) != cudaSuccess ||
        cudaStreamCreate(&s) != cudaSuccess) {
        fprintf(stderr, "bench_cuda: link bandwidth: %s\n", cudaGetErrorString(cudaGetLastError()));
        goto out;
    }
    memset(h, 1, bytes);
    for (int dir = 0; dir < 2; dir++)
        for (int r = 0; r < 5; r++) {
            double t0 = now_s();
            if (cudaMemcpyAsync(dir ? h : d, dir ? d : h, bytes,
                                dir ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice,
                                s) != cudaSuccess ||
                cudaStreamSynchronize(s) != cudaSuccess)
                goto out;
            double gbs = bytes / (now_s() - t0) / 1e9, *best = dir ? d2h : h2d;
            if (gbs > *best) *best = gbs;
        }
out:
    if (s) (void)cudaStreamDestroy(s);
    if (d) (void)cudaFree(d);
    if (h) (void)cudaFreeHost(h);
}

/* offload's pick: the first `host` items of a batch attend on the host. */
static bool pick_first(void *user, uint32_t item, const eng_forward_item *it) {
    (void)it;
    return item < *(const uint32_t *)user;
}

static void print_offload(eng_cuda *e, const char *phase, const eng_offload_stats *before) {
    eng_offload_stats w;
    eng_cuda_offload_get_stats(e, &w);
    if (w.device_pages == 0) return;
    uint64_t steps = w.steps - before->steps;
    printf("| offload during %s: decodes on the host per step | %.1f | host attention %.2f ms, "
           "waited for %.2f ms per step | |\n",
           phase, steps ? (double)(w.host_items - before->host_items) / steps : 0.0,
           steps ? (w.host_attn_ns - before->host_attn_ns) / 1e6 / steps : 0.0,
           steps ? (w.host_wait_ns - before->host_wait_ns) / 1e6 / steps : 0.0);
}

static void print_swap(eng_cuda *e, const char *phase) {
    eng_swap_stats w;
    eng_cuda_swap_get_stats(e, &w);
    if (w.slots == 0) return;
    printf("| swap after %s: layers on the device / host | %u / %u | moves in / out %llu / %llu "
           "(%.1f / %.1f GiB) | stalls %llu, %.1f ms |\n",
           phase, w.on_device, w.on_host, (unsigned long long)w.swaps_in,
           (unsigned long long)w.swaps_out, w.swap_in_bytes / 1073741824.0,
           w.swap_out_bytes / 1073741824.0, (unsigned long long)w.stalls, w.stall_ns / 1e6);
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
    if (o.swap_slots) { /* the host pool: the other layers' caches plus one in flight each way */
        uint64_t layer = (uint64_t)pages * ps * 2 * cfg.n_kv_heads * cfg.head_dim * 2;
        uint64_t need = (uint64_t)(cfg.n_layers - o.swap_slots + 2) * layer;
        eo.swap_slots = eo.swap_min_slots = o.swap_slots;
        eo.swap_host_bytes = o.host_mib ? (uint64_t)o.host_mib << 20 : need;
        o.graphs = false;
    }
    if (o.offload_host) { /* every page has a slot: the rows show the host sub-batch alone */
        eo.offload_device_pages = pages;
        eo.offload_host_threads = o.offload_threads ? (int)o.offload_threads : 1;
        eo.offload_pick = pick_first;
        eo.offload_pick_user = &o.offload_host;
        o.graphs = false;
    }
    eng_cuda *e = NULL;
    if (eng_cuda_open(&eo, &e, &st) != PIE_OK) die("open", &st);
    eng_cuda_set_graphs(e, o.graphs);
    const eng_info *in = eng_cuda_get_info(e);
    double w_bytes, kv_bytes;
    step_bytes(&cfg, o.context, &w_bytes, &kv_bytes);
    printf("model %s: %s, %u layers, hidden %u, ffn %u, heads %u/%u, vocab %u%s; device %s; "
           "graphs %s\n",
           o.model, in->dtype, in->n_layers, in->hidden_size, in->intermediate_size, in->n_heads,
           in->n_kv_heads, in->vocab_size, cfg.tie_word_embeddings ? " (tied)" : "",
           eng_cuda_device_name(e), o.graphs ? "on" : "off");
    printf("read per decode step of one sequence at %u tokens: weights %.1f MiB (layers, final "
           "norm, LM head, one embedding row) + K/V %.1f MiB; KV pool %.1f MiB (%u pages of "
           "%u)\n\n",
           o.context, w_bytes / 1048576.0, kv_bytes / 1048576.0, in->kv_pool_bytes / 1048576.0,
           in->kv_pages, in->kv_page_size);
    double bw = read_bandwidth((size_t)o.bw_mib << 20);
    printf("| measurement | value | reference | ratio |\n| --- | --- | --- | --- |\n");
    printf("| device read bandwidth (%u MiB, best of 10) | %.1f GB/s | | |\n", o.bw_mib, bw / 1e9);
    double h2d, d2h;
    link_bandwidth(&h2d, &d2h);
    printf("| pinned host to device / device to host (256 MiB, best of 5) | %.1f / %.1f GB/s | | "
           "|\n",
           h2d, d2h);
    if (o.swap_slots)
        printf("| swap policy: %u of %u layers' KV on the device, host pool %.1f MiB | | | |\n",
               o.swap_slots, in->n_layers, eo.swap_host_bytes / 1048576.0);
    if (o.offload_host)
        printf("| offload policy: the first %u sequences of a step on %d host threads | | | |\n",
               o.offload_host, eo.offload_host_threads);
    eng_offload_stats off0;
    eng_cuda_stats s0, s1;

    uint32_t **sp = malloc(sizeof *sp * (o.batch + 1));
    if (!sp) return 1;
    for (uint32_t b = 0; b <= o.batch; b++) sp[b] = seq_pages(b, per);
    uint32_t *pre = seq_pages(0, pre_pages);
    for (uint32_t j = 0; j < pre_pages; j++) pre[j] = (o.batch + 1) * per + j;
    uint32_t *ids = malloc(sizeof *ids * 256 * o.batch);
    float *probs = malloc(sizeof *probs * 256 * o.batch);
    double *t = malloc(sizeof *t * o.steps), *td = malloc(sizeof *td * o.steps), dist_s = 0;
    if (!ids || !probs || !t || !td) return 1;

    /* prefill (a warm-up run first: cuBLAS picks its kernels) */
    if (!o.decode_only) {
        (void)prefill(e, pre, o.prefill, 0);
        eng_cuda_get_stats(e, &s0);
        double tp = prefill(e, pre, o.prefill, 0);
        eng_cuda_get_stats(e, &s1);
        printf("| prefill %u tokens | %.0f tok/s (%.1f ms) | transformers: bench_transformers.py "
               "| |\n",
               o.prefill, o.prefill / tp, tp * 1e3);
        print_graphs("prefill", &s0, &s1);
    }

    /* context for every sequence: prefill one, copy it to the others */
    (void)prefill(e, sp[0], o.context, 0);
    for (uint32_t b = 1; b <= o.batch; b++)
        for (uint32_t j = 0; j * ps < o.context; j++) {
            uint32_t cnt = o.context - j * ps < ps ? o.context - j * ps : ps;
            eng_copy_item c = {sp[0][j], sp[b][j], 0, 0, cnt};
            if (eng_cuda_copy_pages(e, &c, 1, &st) != PIE_OK) die("copy_pages", &st);
        }

    /* decode b=1 on sequence 1 (its context is a copy); step 0 warms up / captures */
    eng_cuda_get_stats(e, &s0);
    eng_cuda_offload_get_stats(e, &off0);
    for (uint32_t s = 0; s <= o.steps; s++) {
        double dt = decode_step(e, 1, &sp[1], o.context + s, max_t, ids, probs, &dist_s);
        if (s > 0) t[s - 1] = dt, td[s - 1] = dist_s;
    }
    eng_cuda_get_stats(e, &s1);
    double med1 = median(t, o.steps), best1 = t[0], medd = median(td, o.steps);
    double floor_s = (w_bytes + kv_bytes) / bw;
    printf("| decode b=1 @%u ctx (forward + next_dist), median (best) of %u | %.3f (%.3f) "
           "ms/token | floor %.3f ms (%.1f MiB read / %.0f GB/s) | %.2fx |\n",
           o.context, o.steps, med1 * 1e3, best1 * 1e3, floor_s * 1e3,
           (w_bytes + kv_bytes) / 1048576.0, bw / 1e9, med1 / floor_s);
    printf("| decode b=1: forward / next_dist (top-256 of %u), medians | %.3f / %.3f ms | | |\n",
           in->vocab_size, (med1 - medd) * 1e3, medd * 1e3);
    print_graphs("decode b=1", &s0, &s1);
    print_swap(e, "decode b=1");
    print_offload(e, "decode b=1", &off0);
    if (o.decode_only) {
        printf("\n(--decode-only: no prefill, b=%u decode or clearing rows)\n", o.batch);
        goto done;
    }

    /* decode b=B: sequences 1..B; each step rewrites the same next position of each */
    eng_cuda_get_stats(e, &s0);
    eng_cuda_offload_get_stats(e, &off0);
    for (uint32_t s = 0; s <= o.steps; s++) {
        double dt = decode_step(e, o.batch, &sp[1], o.context + s, max_t, ids, probs, &dist_s);
        if (s > 0) t[s - 1] = dt;
    }
    double medb = median(t, o.steps);
    printf("| decode b=%u @%u ctx, median (best) of %u | %.0f (%.0f) tok/s | transformers: "
           "bench_transformers.py | |\n",
           o.batch, o.context, o.steps, o.batch / medb, o.batch / t[0]);
    eng_cuda_get_stats(e, &s1);
    print_graphs("decode b=B", &s0, &s1);
    print_swap(e, "decode b=B");
    print_offload(e, "decode b=B", &off0);
    bench_clearing(e, o.steps, t, med1); /* after the decodes: it zeroes their pages */
    printf("\ngraphs captured %u, capture failures %u%s%s; next_dist: 4 launches per call of up "
           "to 64 slots, not graphed\n",
           s1.graphs, s1.capture_failures, s1.capture_error[0] ? ": " : "", s1.capture_error);
done:
    for (uint32_t b = 0; b <= o.batch; b++) free(sp[b]);
    free(sp), free(pre), free(ids), free(probs), free(t), free(td);
    eng_cuda_close(e);
    return 0;
}
