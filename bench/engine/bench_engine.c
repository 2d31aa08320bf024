/* bench_engine.c — speed and memory of the CPU engine (services/worker/engine) on one model.
 *
 * Measures, in one run on the model directory given on the command line:
 *   bandwidth   the machine's read bandwidth: the threads sum a buffer of --bw-mib MiB (best
 *               pass; one pass before every decode step, so the bound and the decode see the
 *               same load on the shared machine), GB/s
 *   prefill     one forward of P tokens (append into fresh pages, output of the last), tokens/s;
 *               against OpenBLAS sgemm run on the same [P, in] x [in, out] shapes as the
 *               model's linear layers (GFLOP/s of the prefill's linear layers vs sgemm's)
 *   decode b=1  forward of 1 token over a C-token context + next_dist (top-k 256) per step,
 *               tokens/s, against the bandwidth bound (weight bytes / bandwidth)
 *   decode b=B  the same for B sequences of C context tokens in one batch (the context is
 *               prefilled once and copied to the other sequences' pages with copy_pages)
 *   threads     where the pool's thread time goes during the decode steps (per-thread
 *               /proc schedstat): running, runnable but waiting for a CPU (other load on the
 *               machine), idle (nothing to do: serial work, waits between kernels); and the
 *               running thread time per step, which other load moves less than wall time
 *   memory      VmRSS / VmHWM from /proc/self/status against the engine's own accounting
 *               (weights mapped + KV pool + embedding slots + scratch)
 *   clearing    eng_clear_pages of 1, 16 and 256 pages (what the worker does to every page a
 *               SlotBatch allocates, so no instance reads another's data) and eng_clear_embeds
 *               of 1 and 256 slots, on pages and slots already in use: median time, per page,
 *               zeroed bytes per second, and against the median b=1 decode step
 *
 * Usage: bench_engine MODEL_DIR [--threads N] [--context 512] [--batch 32] [--prefill 512]
 *                    [--steps 8] [--bw-mib 2048] [--skip-prefill] [--kv f32|bf16]
 * --kv: what the engine's KV pool stores (eng_opts.kv_dtype; default f32).
 * Results are printed as one Markdown table row per measurement; bench/results/engine.md keeps
 * the recorded ones. */
#include <cblas.h>
#include <dirent.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <time.h>

#include "eng.h"
#include "krn_cpu.h"

typedef struct bench_opts {
    const char *model;
    int threads;
    uint32_t context, batch, prefill, steps, bw_mib;
    int skip_prefill;
    eng_kv_dtype kv_dtype;
} bench_opts;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void die(const char *what, const pie_status *st) {
    fprintf(stderr, "bench_engine: %s: %s\n", what, st ? st->msg : "failed");
    exit(1);
}

/* CPU seconds (user + system) this process has used. */
static double cpu_s(void) {
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0) return 0;
    return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 + (double)ru.ru_stime.tv_sec +
           ru.ru_stime.tv_usec * 1e-6;
}

/* Summed over this process's threads (/proc/self/task/<tid>/schedstat): seconds on a CPU and
 * seconds runnable but waiting for one (other load on the machine). Both 0 when unreadable. */
typedef struct sched_sum {
    double run_s, wait_s;
} sched_sum;

static sched_sum sched_now(void) {
    sched_sum t = {0, 0};
    DIR *d = opendir("/proc/self/task");
    if (!d) return t;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.') continue;
        char path[300];
        snprintf(path, sizeof path, "/proc/self/task/%s/schedstat", de->d_name);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        unsigned long long run = 0, wait = 0;
        if (fscanf(f, "%llu %llu", &run, &wait) == 2) {
            t.run_s += (double)run * 1e-9;
            t.wait_s += (double)wait * 1e-9;
        }
        fclose(f);
    }
    closedir(d);
    return t;
}

/* "VmRSS:" or "VmHWM:" of this process in bytes (0 when unreadable). */
static size_t proc_status_bytes(const char *key) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return 0;
    char line[256];
    size_t kb = 0, n = strlen(key);
    while (fgets(line, sizeof line, f))
        if (strncmp(line, key, n) == 0 && sscanf(line + n, "%zu", &kb) == 1) break;
    fclose(f);
    return kb * 1024;
}

/* ---- memory bandwidth ---------------------------------------------------------------------- */

typedef struct bw_job {
    const uint64_t *buf;
    size_t bytes;
    uint64_t sums[1024]; /* per task, so the reads cannot be optimised away */
    uint64_t check;
} bw_job;

/* Each task reads its share as 4 interleaved sequential streams (one stream per core leaves
 * memory-level parallelism unused and so understates the bandwidth the kernels can get). */
static void bw_task(void *arg, int task, int n_tasks) {
    bw_job *j = arg;
    size_t words = j->bytes / 8;
    size_t lo = words * (size_t)task / (size_t)n_tasks;
    size_t quarter = (words * (size_t)(task + 1) / (size_t)n_tasks - lo) / 4;
    const uint64_t *p0 = j->buf + lo, *p1 = p0 + quarter, *p2 = p1 + quarter, *p3 = p2 + quarter;
    uint64_t a = 0, b = 0, c = 0, d = 0;
    for (size_t i = 0; i + 2 <= quarter; i += 2) {
        a += p0[i] + p0[i + 1];
        b += p1[i] + p1[i + 1];
        c += p2[i] + p2[i + 1];
        d += p3[i] + p3[i + 1];
    }
    j->sums[task] = a + b + c + d;
}

/* A buffer of `mib` MiB, written once so that every page is resident. */
static bw_job *bw_open(uint32_t mib) {
    bw_job *job = calloc(1, sizeof *job);
    if (!job) die("bandwidth job", NULL);
    job->bytes = (size_t)mib << 20;
    void *p = mmap(NULL, job->bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) die("bandwidth buffer", NULL);
    memset(p, 1, job->bytes);
    job->buf = p;
    return job;
}

/* One read of the whole buffer by the pool's threads: bytes/s. */
static double bw_pass(bw_job *job, krn_pool *pool) {
    int tasks = krn_pool_size(pool);
    double t0 = now_s();
    krn_pool_run(pool, bw_task, job, tasks);
    double dt = now_s() - t0;
    size_t words = job->bytes / 8, read = 0;
    for (int t = 0; t < tasks; t++) {
        job->check += job->sums[t];
        size_t lo = words * (size_t)t / (size_t)tasks, hi = words * (size_t)(t + 1) / (size_t)tasks;
        read += (hi - lo) / 4 / 2 * 2 * 4 * 8; /* what bw_task read: 4 streams, pairs of words */
    }
    return (double)read / dt;
}

static void bw_close(bw_job *job) {
    if (job->check == 42) fprintf(stderr, "\n"); /* keeps the sums live */
    munmap((void *)job->buf, job->bytes);
    free(job);
}

/* ---- OpenBLAS reference GEMM --------------------------------------------------------------- */

/* The linear layers of one decoder layer as the engine calls them: y[rows, out] = x[rows, in] W^T.
 */
typedef struct lin_shape {
    int in, out;
} lin_shape;

static void layer_shapes(const eng_info *m, lin_shape s[7]) {
    int d = (int)m->hidden_size, q = (int)(m->n_heads * m->head_dim);
    int kv = (int)(m->n_kv_heads * m->head_dim), f = (int)m->intermediate_size;
    lin_shape all[7] = {{d, q}, {d, kv}, {d, kv}, {q, d}, {d, f}, {d, f}, {f, d}};
    memcpy(s, all, sizeof all);
}

/* FLOPs of the prefill's linear layers: every layer for all rows, except that the last layer's
 * o-proj and MLP run for the output rows only (the engine skips the others). */
static double prefill_linear_flops(const eng_info *m, uint32_t rows, uint32_t outputs) {
    lin_shape s[7];
    layer_shapes(m, s);
    double qkv = 0, rest = 0;
    for (int i = 0; i < 7; i++) *(i < 3 ? &qkv : &rest) += 2.0 * s[i].in * s[i].out;
    return m->n_layers * qkv * rows + (m->n_layers - 1) * rest * rows + rest * outputs;
}

/* OpenBLAS sgemm GFLOP/s over one layer's linear shapes with M = rows (second of two passes),
 * OpenBLAS's own threading with `threads` threads (kernels/cpu sets it to 1 for its own use and
 * gets it back). */
static double sgemm_gflops(const eng_info *m, uint32_t rows, int threads) {
    int saved = openblas_get_num_threads();
    openblas_set_num_threads(threads);
    lin_shape s[7];
    layer_shapes(m, s);
    size_t max_dim = 0;
    for (int i = 0; i < 7; i++) {
        if ((size_t)s[i].in > max_dim) max_dim = (size_t)s[i].in;
        if ((size_t)s[i].out > max_dim) max_dim = (size_t)s[i].out;
    }
    float *x = malloc((size_t)rows * max_dim * sizeof *x);
    float *w = malloc(max_dim * max_dim * sizeof *w);
    float *y = malloc((size_t)rows * max_dim * sizeof *y);
    if (!x || !w || !y) die("sgemm buffers", NULL);
    for (size_t i = 0; i < (size_t)rows * max_dim; i++) x[i] = (float)(i % 7) * 0.1f;
    for (size_t i = 0; i < max_dim * max_dim; i++) w[i] = (float)(i % 5) * 0.01f;
    double flops = 0, secs = 0;
    for (int pass = 0; pass < 2; pass++) /* the first pass warms up */
        for (int i = 0; i < 7; i++) {
            double t0 = now_s();
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)rows, s[i].out, s[i].in, 1.0f,
                        x, s[i].in, w, s[i].in, 0.0f, y, s[i].out);
            if (pass == 1) {
                secs += now_s() - t0;
                flops += 2.0 * rows * (double)s[i].in * s[i].out;
            }
        }
    free(x);
    free(w);
    free(y);
    openblas_set_num_threads(saved);
    return flops / secs * 1e-9;
}

/* ---- engine workloads ---------------------------------------------------------------------- */

/* Embeds n tokens of a fixed pseudo-random sequence into slots slot0.. at positions pos0.. */
static void embed_run(eng *e, uint32_t slot0, uint32_t pos0, uint32_t n, uint32_t seed) {
    uint32_t *s = malloc(n * 3 * sizeof *s), vocab = eng_get_info(e)->vocab_size;
    if (vocab > 4096) /* ids the tokenizer of the llama-3.2-1b preset knows */
        vocab = 4096;
    if (!s) die("embed buffers", NULL);
    for (uint32_t i = 0; i < n; i++) {
        s[i] = slot0 + i;
        s[n + i] = (seed * 2654435761u + (pos0 + i) * 40503u) % vocab;
        s[2 * n + i] = pos0 + i;
    }
    pie_status st = {0};
    if (eng_embed_text(e, s, s + n, s + 2 * n, n, &st) != PIE_OK) die("embed_text", &st);
    free(s);
}

static eng_forward_item item_over(const uint32_t *pages, uint32_t seq_len, uint32_t ps,
                                  const uint32_t *in, uint32_t n_in, const uint32_t *out,
                                  uint32_t n_out) {
    return (eng_forward_item){.kv_pages = pages,
                              .n_kv_pages = (seq_len + ps - 1) / ps,
                              .kv_last_page_len = (seq_len - 1) % ps + 1,
                              .append_kv = true,
                              .in_slots = in,
                              .n_in = n_in,
                              .out_slots = out,
                              .n_out = n_out};
}

/* Prefills `len` tokens into pages (outputs the last into slot out); returns seconds. */
static double prefill_once(eng *e, const uint32_t *pages, uint32_t len, uint32_t out) {
    uint32_t ps = eng_get_info(e)->kv_page_size;
    uint32_t *in = malloc(len * sizeof *in);
    if (!in) die("prefill slots", NULL);
    for (uint32_t i = 0; i < len; i++) in[i] = i;
    embed_run(e, 0, 0, len, 1);
    eng_forward_item it = item_over(pages, len, ps, in, len, &out, 1);
    pie_status st = {0};
    double t0 = now_s();
    if (eng_forward(e, &it, 1, &st) != PIE_OK) die("prefill forward", &st);
    double dt = now_s() - t0;
    free(in);
    return dt;
}

/* Buffers of a decode step over B sequences. */
typedef struct decode_bufs {
    eng_forward_item *items;
    eng_dist_item *dist;
    uint32_t *slots, *ids;
    float *probs;
} decode_bufs;

static decode_bufs decode_bufs_make(uint32_t B) {
    decode_bufs d = {.items = calloc(B, sizeof *d.items),
                     .dist = calloc(B, sizeof *d.dist),
                     .slots = malloc(B * sizeof *d.slots),
                     .ids = malloc((size_t)B * 256 * sizeof *d.ids),
                     .probs = malloc((size_t)B * 256 * sizeof *d.probs)};
    if (!d.items || !d.dist || !d.slots || !d.ids || !d.probs) die("decode buffers", NULL);
    return d;
}

static void decode_bufs_free(decode_bufs *d) {
    free(d->items);
    free(d->dist);
    free(d->slots);
    free(d->ids);
    free(d->probs);
}

/* One decode step of B sequences (sequence b in pages[b * per ..], `len` tokens after the step):
 * forward of one token each + next_dist (top 256). Returns seconds. */
static double decode_step(eng *e, const uint32_t *pages, uint32_t per, uint32_t B, uint32_t len,
                          uint32_t slot0, decode_bufs *d) {
    uint32_t ps = eng_get_info(e)->kv_page_size;
    for (uint32_t b = 0; b < B; b++) {
        d->slots[b] = slot0 + b;
        embed_run(e, d->slots[b], len - 1, 1, 7 + b);
        d->items[b] = item_over(pages + (size_t)b * per, len, ps, &d->slots[b], 1, &d->slots[b], 1);
        d->dist[b] = (eng_dist_item){.slot = d->slots[b],
                                     .top_k = 256,
                                     .temperature = 1.0f,
                                     .ids = d->ids + (size_t)b * 256,
                                     .probs = d->probs + (size_t)b * 256};
    }
    pie_status st = {0};
    double t0 = now_s();
    if (eng_forward(e, d->items, B, &st) != PIE_OK) die("decode forward", &st);
    if (eng_next_dist(e, d->dist, B, &st) != PIE_OK) die("next_dist", &st);
    return now_s() - t0;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, uint32_t n) {
    qsort(v, n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* Copies sequence 0's first `context` tokens (pages[0 ..]) to sequences 1..B-1. */
static void replicate_context(eng *e, const uint32_t *pages, uint32_t per, uint32_t B,
                              uint32_t context) {
    uint32_t ps = eng_get_info(e)->kv_page_size, full = (context + ps - 1) / ps;
    eng_copy_item *c = calloc((size_t)full * B, sizeof *c);
    if (!c) die("copy items", NULL);
    uint32_t n = 0;
    for (uint32_t b = 1; b < B; b++)
        for (uint32_t j = 0; j < full; j++) {
            uint32_t count = j + 1 < full ? ps : context - j * ps;
            c[n++] = (eng_copy_item){pages[j], pages[(size_t)b * per + j], 0, 0, count};
        }
    pie_status st = {0};
    if (eng_copy_pages(e, c, n, &st) != PIE_OK) die("copy_pages", &st);
    free(c);
}

/* Median seconds of `reps` calls clearing ids[0..n) (pages, or embedding slots). */
static double clear_time(eng *e, bool pages, const uint32_t *ids, uint32_t n, uint32_t reps) {
    double t[64];
    if (reps > 64) reps = 64;
    pie_status st = {0};
    for (uint32_t r = 0; r < reps; r++) {
        double t0 = now_s();
        pie_code rc = pages ? eng_clear_pages(e, ids, n, &st) : eng_clear_embeds(e, ids, n, &st);
        if (rc != PIE_OK) die(pages ? "clear_pages" : "clear_embeds", &st);
        t[r] = now_s() - t0;
    }
    return median(t, reps);
}

/* The clearing rows: pages (and slots) 0.. of the pools, all written by the runs before. */
static void bench_clearing(eng *e, const uint32_t *pages, uint32_t n_pages, uint32_t n_slots,
                           double decode_s, uint32_t reps) {
    const eng_info *in = eng_get_info(e);
    size_t page_bytes =
        (size_t)in->n_layers * 2 * in->kv_page_size * in->n_kv_heads * in->head_dim * sizeof(float);
    static const uint32_t counts[] = {1, 16, 256};
    for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++) {
        uint32_t n = counts[i] < n_pages ? counts[i] : n_pages;
        double t = clear_time(e, true, pages, n, reps);
        printf("| clear_pages n=%u (%.2f MiB of K/V), median of %u | %.1f us (%.1f us/page, "
               "%.1f GB/s) | decode b=1 step %.2f ms | %.2f%% |\n",
               n, n * page_bytes / 1048576.0, reps, t * 1e6, t * 1e6 / n, n * page_bytes / t * 1e-9,
               decode_s * 1e3, 100 * t / decode_s);
        if (n == n_pages) break;
    }
    uint32_t *slots = malloc(n_slots * sizeof *slots);
    if (!slots) die("slots", NULL);
    for (uint32_t i = 0; i < n_slots; i++) slots[i] = i;
    static const uint32_t scounts[] = {1, 256};
    for (size_t i = 0; i < sizeof scounts / sizeof scounts[0]; i++) {
        uint32_t n = scounts[i] < n_slots ? scounts[i] : n_slots;
        double t = clear_time(e, false, slots, n, reps);
        printf("| clear_embeds n=%u, median of %u | %.2f us (%.2f us/slot) | decode b=1 step "
               "%.2f ms | %.2f%% |\n",
               n, reps, t * 1e6, t * 1e6 / n, decode_s * 1e3, 100 * t / decode_s);
    }
    free(slots);
}

static int parse_args(int argc, char **argv, bench_opts *o) {
    *o = (bench_opts){.context = 512, .batch = 32, .prefill = 512, .steps = 8, .bw_mib = 2048};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--skip-prefill") == 0) {
            o->skip_prefill = 1;
            continue;
        }
        if (a[0] != '-') {
            o->model = a;
            continue;
        }
        if (i + 1 >= argc) return -1;
        if (strcmp(a, "--kv") == 0) {
            const char *k = argv[++i];
            if (strcmp(k, "f32") != 0 && strcmp(k, "bf16") != 0) return -1;
            o->kv_dtype = strcmp(k, "bf16") == 0 ? ENG_KV_BF16 : ENG_KV_F32;
            continue;
        }
        long v = strtol(argv[++i], NULL, 10);
        if (v < 0 || v > 1000000) return -1;
        if (strcmp(a, "--threads") == 0)
            o->threads = (int)v;
        else if (strcmp(a, "--context") == 0)
            o->context = (uint32_t)v;
        else if (strcmp(a, "--batch") == 0)
            o->batch = (uint32_t)v;
        else if (strcmp(a, "--prefill") == 0)
            o->prefill = (uint32_t)v;
        else if (strcmp(a, "--steps") == 0)
            o->steps = (uint32_t)v;
        else if (strcmp(a, "--bw-mib") == 0)
            o->bw_mib = (uint32_t)v;
        else
            return -1;
    }
    return o->model && o->context > 0 && o->batch > 0 && o->prefill > 0 && o->steps > 0 &&
                   o->bw_mib > 0
               ? 0
               : -1;
}

int main(int argc, char **argv) {
    bench_opts o;
    if (parse_args(argc, argv, &o) != 0) {
        fprintf(stderr, "usage: bench_engine MODEL_DIR [--threads N] [--context 512] [--batch 32]"
                        " [--prefill 512] [--steps 8] [--bw-mib 2048] [--skip-prefill]"
                        " [--kv f32|bf16]\n");
        return 2;
    }
    const uint32_t ps = 16;
    /* pages: B sequences of context + steps + 1 tokens, plus the prefill's */
    uint32_t per = (o.context + o.steps + 1 + ps - 1) / ps;
    uint32_t pre_pages = (o.prefill + ps - 1) / ps;
    uint32_t n_pages = per * o.batch + pre_pages;
    uint32_t max_batch = o.prefill > o.context ? o.prefill : o.context;
    if (max_batch < o.batch) max_batch = o.batch;
    eng_opts eo = {.model_dir = o.model,
                   .kv_page_size = ps,
                   .kv_pages = n_pages,
                   .embed_slots = max_batch + 2 * o.batch + 8,
                   .max_batch_tokens = max_batch,
                   .n_threads = o.threads,
                   .kv_dtype = o.kv_dtype};
    pie_status st = {0};
    eng *e = NULL;
    double t_open = now_s(), wall0 = t_open, cpu0 = cpu_s();
    if (eng_open(&eo, &e, &st) != PIE_OK) die("eng_open", &st);
    t_open = now_s() - t_open;
    const eng_info *in = eng_get_info(e);
    int threads = o.threads > 0 ? o.threads : 0;
    krn_pool *pool = krn_pool_create(threads);
    if (!pool) die("krn_pool_create", NULL);
    printf("model %s: %s, %u layers, hidden %u, ffn %u, heads %u/%u, vocab %u; threads %d; "
           "simd %s%s; open %.2f s\n",
           o.model, in->dtype, in->n_layers, in->hidden_size, in->intermediate_size, in->n_heads,
           in->n_kv_heads, in->vocab_size, krn_pool_size(pool), krn_cpu_simd_name(),
           krn_cpu_amx_active() ? " + AMX (bf16 linear, n >= 8)"
           : krn_cpu_bf16dot_active()
               ? " + AVX512-BF16 (bf16 linear, 8 <= n <= 32, x rounded to bf16)"
               : "",
           t_open);
    printf("pools: weights %.1f MiB, KV %.1f MiB (%s, %u pages of %u), embeddings %.1f MiB, "
           "scratch %.1f MiB (max_batch_tokens %u)\n\n",
           in->weight_bytes / 1048576.0, in->kv_pool_bytes / 1048576.0, in->kv_dtype, n_pages, ps,
           in->embed_pool_bytes / 1048576.0, in->scratch_bytes / 1048576.0, max_batch);
    if (in->packed_weight_bytes) /* PIE_KRN_PREPACK (services/worker/engine/eng_cpu_wpack.c) */
        printf("weights packed at open: %.1f MiB in %.0f ms\n\n",
               in->packed_weight_bytes / 1048576.0, in->pack_ms);

    uint32_t *pages = malloc(n_pages * sizeof *pages);
    if (!pages) die("pages", NULL);
    for (uint32_t i = 0; i < n_pages; i++) pages[i] = i;

    printf("| measurement | value | reference | ratio |\n| --- | --- | --- | --- |\n");
    /* the context of sequence 0, copied to the other B - 1 sequences */
    (void)prefill_once(e, pages, o.context, max_batch);
    replicate_context(e, pages, per, o.batch, o.context);

    double prefill_s = 0, pre_gflops = 0;
    if (!o.skip_prefill) {
        prefill_s = prefill_once(e, pages + per * o.batch, o.prefill, max_batch + 1);
        pre_gflops = prefill_linear_flops(in, o.prefill, 1) / prefill_s * 1e-9;
    }
    size_t hwm = proc_status_bytes("VmHWM:");

    /* Decode: each step is a bandwidth pass, a batch-1 step and a batch-B step back to back, so
     * that the three see the same load on the machine (it is shared); the first is a warm-up. */
    bw_job *bw = bw_open(o.bw_mib);
    decode_bufs d1 = decode_bufs_make(1), dB = decode_bufs_make(o.batch);
    double *t1 = malloc(o.steps * sizeof *t1), *tB = malloc(o.steps * sizeof *tB);
    if (!t1 || !tB) die("step times", NULL);
    double bw_best = 0, best1 = 1e30, bestB = 1e30;
    double run1 = 0, wait1 = 0, wall1 = 0, runB = 0, waitB = 0, wallB = 0;
    uint32_t slot0 = max_batch + 4; /* apart from the prefill's slots 0..max_batch-1 */
    for (uint32_t step = 0; step <= o.steps; step++) {
        double b = bw_pass(bw, pool);
        bw_best = b > bw_best ? b : bw_best;
        uint32_t len = o.context + step + 1;
        sched_sum s0 = sched_now();
        double a1 = decode_step(e, pages, per, 1, len, slot0, &d1);
        sched_sum s1 = sched_now();
        double aB = decode_step(e, pages, per, o.batch, len, slot0 + 1, &dB);
        sched_sum s2 = sched_now();
        if (step == 0) continue;
        /* thread time of the steps: on a CPU, waiting for one (other load), and the rest, in
         * which a thread of the pool had nothing to do (serial work, waits between kernels) */
        run1 += s1.run_s - s0.run_s, wait1 += s1.wait_s - s0.wait_s, wall1 += a1;
        runB += s2.run_s - s1.run_s, waitB += s2.wait_s - s1.wait_s, wallB += aB;
        t1[step - 1] = a1, tB[step - 1] = aB;
        best1 = a1 < best1 ? a1 : best1;
        bestB = aB < bestB ? aB : bestB;
    }
    for (int extra = 0; extra < 3; extra++) {
        double b = bw_pass(bw, pool);
        bw_best = b > bw_best ? b : bw_best;
    }
    bw_close(bw);
    double med1 = median(t1, o.steps);
    double tps1 = 1.0 / med1, tpsB = o.batch / median(tB, o.steps);
    double btps1 = 1.0 / best1, btpsB = o.batch / bestB;
    double bound_tps = bw_best / (double)in->weight_bytes;
    size_t rss = proc_status_bytes("VmRSS:");
    size_t accounted =
        in->weight_bytes + in->kv_pool_bytes + in->embed_pool_bytes + in->scratch_bytes;

    printf("| read bandwidth (%u MiB, %d threads, best of %u passes) | %.1f GB/s | | |\n", o.bw_mib,
           krn_pool_size(pool), o.steps + 4, bw_best * 1e-9);
    printf("| decode b=1 @%u ctx (forward + next_dist), median (best) of %u steps | %.2f (%.2f) "
           "tok/s | bandwidth bound %.2f tok/s | %.0f%% (%.0f%%) |\n",
           o.context, o.steps, tps1, btps1, bound_tps, 100 * tps1 / bound_tps,
           100 * btps1 / bound_tps);
    printf("| decode b=%u @%u ctx, median (best) | %.2f (%.2f) tok/s | 8x b=1 = %.2f tok/s | "
           "%.1fx (%.1fx) b=1 |\n",
           o.batch, o.context, tpsB, btpsB, 8 * tps1, tpsB / tps1, btpsB / btps1);
    int nt = krn_pool_size(pool);
    /* thread-seconds on a CPU per step move much less with other load than wall time does */
    printf("| thread time of the decode steps (%d threads): running / waiting for a CPU / idle "
           "| b=1 %.0f%% / %.0f%% / %.0f%%, b=%u %.0f%% / %.0f%% / %.0f%% | CPU time per step: "
           "b=1 %.1f ms, b=%u %.1f ms | |\n",
           nt, 100 * run1 / (wall1 * nt), 100 * wait1 / (wall1 * nt),
           100 * (1 - (run1 + wait1) / (wall1 * nt)), o.batch, 100 * runB / (wallB * nt),
           100 * waitB / (wallB * nt), 100 * (1 - (runB + waitB) / (wallB * nt)),
           1e3 * run1 / o.steps, o.batch, 1e3 * runB / o.steps);
    if (!o.skip_prefill) {
        double blas = sgemm_gflops(in, o.prefill, krn_pool_size(pool));
        printf("| prefill %u tokens | %.1f tok/s (%.2f s), linear layers %.1f GFLOP/s | "
               "OpenBLAS sgemm (%d threads) same shapes %.1f GFLOP/s | %.0f%% |\n",
               o.prefill, o.prefill / prefill_s, prefill_s, pre_gflops, krn_pool_size(pool), blas,
               100 * pre_gflops / blas);
    }
    printf("| VmRSS at the end (VmHWM before the bandwidth buffer) | %.1f MiB (%.1f MiB) | "
           "weights+KV+embeddings+scratch %.1f MiB | %.0f%% (%.0f%%) |\n",
           rss / 1048576.0, hwm / 1048576.0, accounted / 1048576.0, 100.0 * rss / accounted,
           100.0 * hwm / accounted);
    bench_clearing(e, pages, per * o.batch, max_batch, med1, o.steps < 3 ? 3 : o.steps);
    free(t1);
    free(tB);
    decode_bufs_free(&d1);
    decode_bufs_free(&dB);
    double wall = now_s() - wall0, cpu = cpu_s() - cpu0;
    printf(
        "\nCPU share of this run: %.0f s of CPU in %.0f s, %.0f%% of %d threads (well below 100%% "
        "means other load on the machine slowed it)\n",
        cpu, wall, 100 * cpu / (wall * krn_pool_size(pool)), krn_pool_size(pool));
    krn_pool_destroy(pool);
    free(pages);
    eng_close(e);
    return 0;
}
