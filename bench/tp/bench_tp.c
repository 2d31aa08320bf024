/* bench_tp.c — tensor parallelism on the host: the shared-memory collective
 * (services/worker/tp/wrk_coll.h) and the sharded cpu engine at tp N against tp 1.
 *
 * Owns: two measurements, each run in ranks forked by this program (one process per rank, as
 * pie-worker's launcher does):
 *   coll     all-reduce (sum, f32) latency for small messages (4 B .. 64 KiB) and throughput
 *            for large ones (256 KiB .. 64 MiB) between --ranks processes, against a memcpy
 *            of the same size in one process (the bound: a shared-memory all-reduce copies each
 *            rank's input in and the result out at least once); and a barrier (the floor of any
 *            step). Median per operation over 5 repetitions. --tcp: the same over the
 *            collective's TCP transport on loopback (ranks on different nodes).
 *   engine   for each tp in --tp (e.g. 1,2): a prefill of --prefill tokens and decode steps
 *            (embed + forward + next_dist top 256) at batch 1 and --batch over a --context token
 *            context, every rank with --threads / tp engine threads; median step times, the
 *            speed-up against the first tp of the list, and how many collectives a step makes.
 *            --rounds runs the list that many times in turn (tp 1, tp 2, tp 1, ...): on a
 *            shared machine a comparison within a round sees about the same load.
 * Does not own: what the collective or engine do (their own files); the recorded results and
 * their discussion (bench/results/tp.md).
 *
 * Usage: bench_tp coll [--ranks 2] [--tcp] [--quick]
 *        bench_tp engine MODEL_DIR [--tp 1,2] [--threads N] [--prefill 128] [--context 256]
 *                 [--batch 8] [--steps 8] [--swap-slots LAYERS | --offload 1]
 *          (--swap-slots, --offload: the engine under issue 13's swap policy with that many
 *          layers on the device, or offload with every page the device's — at tp > 1 rank 0's
 *          plan is broadcast with every forward, which is what a comparison with the default
 *          policy gpu measures when nothing moves)
 * Output: Markdown tables. Ranks exchange results through an anonymous shared mapping made
 * before the fork; the parent makes no threads, so forking is safe. */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "eng.h"
#include "wrk_coll.h"

#define BTP_REPS       5
#define BTP_MAX_STEPS  64
#define BTP_MAX_TP     8
#define BTP_MAX_ROUNDS 9
#define BTP_TOPK       256

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, uint32_t n) {
    qsort(v, n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* ---- ranks --------------------------------------------------------------------------------- */

typedef int (*btp_rank_fn)(uint32_t rank, uint32_t n, const char *name, void *arg);

/* Forks n ranks running fn (segment name unique to this call); 0 when all exit 0. */
static int btp_run_ranks(uint32_t n, btp_rank_fn fn, void *arg) {
    static unsigned group; /* distinct segment names for the groups of this process */
    char name[64];
    (void)snprintf(name, sizeof name, "/pie-bench-tp-%ld-%u", (long)getpid(), group++);
    pid_t pids[WRK_COLL_MAX_RANKS];
    uint32_t started = 0;
    for (; started < n; started++) {
        fflush(NULL);
        pid_t p = fork();
        if (p < 0) break;
        if (p == 0) {
            int rc = fn(started, n, name, arg);
            fflush(NULL);
            _exit(rc == 0 ? 0 : 1);
        }
        pids[started] = p;
    }
    int failed = started < n;
    for (uint32_t r = 0; r < started; r++) {
        int ws = 0;
        while (waitpid(pids[r], &ws, 0) < 0 && errno == EINTR) {}
        if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0) {
            fprintf(stderr, "bench_tp: rank %u of %u failed\n", r, n);
            failed = 1;
        }
    }
    return failed ? -1 : 0;
}

static void *shared_alloc(size_t bytes) {
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static pie_code coll_join(uint32_t rank, uint32_t n, const char *name, wrk_coll **c,
                          pie_status *st) {
    wrk_coll_opts o = {.name = name, .epoch = 1, .rank = rank, .n_ranks = n};
    return wrk_coll_open(&o, c, st);
}

/* ---- coll: all-reduce latency and throughput ----------------------------------------------- */

static const size_t coll_sizes[] = {4,         64,       1024,     16384,     65536,
                                    256 << 10, 1u << 20, 4u << 20, 16u << 20, 64u << 20};
#define N_COLL_SIZES (sizeof coll_sizes / sizeof coll_sizes[0])

typedef struct coll_job {
    int quick;
    int stepwise;              /* shared memory: the earlier two-barrier steps (wrk_coll_opts) */
    char tcp_leader[64];       /* "127.0.0.1:<port>": the TCP transport; "": shared memory */
    int listen_fd;             /* rank 0's listener (TCP) */
    double ar_s[N_COLL_SIZES]; /* median seconds per all-reduce (rank 0's view) */
    double barrier_s;
} coll_job;

static uint32_t coll_iters(size_t bytes, int quick) {
    uint32_t it = bytes <= 1024 ? 20000 : bytes <= 65536 ? 4000 : (uint32_t)((256u << 20) / bytes);
    if (it < 4) it = 4;
    return quick ? (it + 9) / 10 : it;
}

/* Median seconds per call of BTP_REPS timed loops of `iters` all-reduces (or barriers). */
static int coll_time(wrk_coll *c, float *buf, size_t n, uint32_t iters, double *out) {
    pie_status st = {0};
    double t[BTP_REPS];
    for (uint32_t w = 0; w < 2; w++)
        if ((n ? wrk_coll_allreduce_sum_f32(c, buf, n, &st) : wrk_coll_barrier(c, &st)) != PIE_OK)
            goto fail;
    for (int r = 0; r < BTP_REPS; r++) {
        if (wrk_coll_barrier(c, &st) != PIE_OK) goto fail;
        double t0 = now_s();
        for (uint32_t i = 0; i < iters; i++)
            if ((n ? wrk_coll_allreduce_sum_f32(c, buf, n, &st) : wrk_coll_barrier(c, &st)) !=
                PIE_OK)
                goto fail;
        t[r] = (now_s() - t0) / iters;
        /* keep the values finite: every call doubles them (n ranks of the same input) */
        for (size_t i = 0; i < n; i++) buf[i] = 1.0f;
    }
    *out = median(t, BTP_REPS);
    return 0;
fail:
    fprintf(stderr, "bench_tp: collective: %s\n", st.msg);
    return -1;
}

static int coll_rank(uint32_t rank, uint32_t n, const char *name, void *arg) {
    coll_job *job = arg;
    pie_status st = {0};
    wrk_coll *c = NULL;
    wrk_coll_opts o = {.name = name,
                       .epoch = 1,
                       .rank = rank,
                       .n_ranks = n,
                       .allreduce_stepwise = job->stepwise != 0};
    if (job->tcp_leader[0]) {
        o.tcp_leader = job->tcp_leader;
        o.tcp_listen_fd = rank == 0 ? job->listen_fd : -1;
        if (rank != 0) close(job->listen_fd); /* rank 0's, inherited */
    }
    if (wrk_coll_open(&o, &c, &st) != PIE_OK) {
        fprintf(stderr, "bench_tp: rank %u: %s\n", rank, st.msg);
        return 1;
    }
    float *buf = malloc(coll_sizes[N_COLL_SIZES - 1]);
    int rc = buf ? 0 : -1;
    for (size_t s = 0; rc == 0 && s < N_COLL_SIZES; s++) {
        size_t cnt = coll_sizes[s] / sizeof(float);
        for (size_t i = 0; i < cnt; i++) buf[i] = 1.0f;
        double t = 0;
        rc = coll_time(c, buf, cnt, coll_iters(coll_sizes[s], job->quick), &t);
        if (rank == 0) job->ar_s[s] = t;
    }
    double tb = 0;
    if (rc == 0) rc = coll_time(c, NULL, 0, coll_iters(4, job->quick), &tb);
    if (rank == 0) job->barrier_s = tb;
    free(buf);
    wrk_coll_close(c);
    return rc == 0 ? 0 : 1;
}

/* Median seconds of a memcpy of `bytes` (source and destination resident, warm). */
static double memcpy_time(void *dst, const void *src, size_t bytes, uint32_t iters) {
    double t[BTP_REPS];
    for (int r = 0; r < BTP_REPS; r++) {
        double t0 = now_s();
        for (uint32_t i = 0; i < iters; i++) {
            memcpy(dst, src, bytes);
            __asm__ volatile("" : : "r"(dst) : "memory"); /* the copy must happen every time */
        }
        t[r] = (now_s() - t0) / iters;
    }
    return median(t, BTP_REPS);
}

static void print_size(size_t b) {
    if (b >= (1u << 20))
        printf("%zu MiB", b >> 20);
    else if (b >= 1024)
        printf("%zu KiB", b >> 10);
    else
        printf("%zu B", b);
}

static int bench_coll(uint32_t ranks, int quick, int tcp, int stepwise) {
    coll_job *job = shared_alloc(sizeof *job);
    size_t top = coll_sizes[N_COLL_SIZES - 1];
    char *src = malloc(top), *dst = malloc(top);
    if (!job || !src || !dst) {
        fprintf(stderr, "bench_tp: out of memory\n");
        return 1;
    }
    job->quick = quick;
    job->stepwise = stepwise;
    job->listen_fd = -1;
    if (tcp) {
        pie_status st = {0};
        uint16_t port = 0;
        if (wrk_coll_tcp_listen("127.0.0.1:0", &job->listen_fd, &port, &st) != PIE_OK) {
            fprintf(stderr, "bench_tp: %s\n", st.msg);
            return 1;
        }
        snprintf(job->tcp_leader, sizeof job->tcp_leader, "127.0.0.1:%u", port);
    }
    memset(src, 1, top);
    memset(dst, 2, top);
    double mc[N_COLL_SIZES];
    for (size_t s = 0; s < N_COLL_SIZES; s++)
        mc[s] = memcpy_time(dst, src, coll_sizes[s], coll_iters(coll_sizes[s], quick));
    free(src);
    free(dst);
    int rc = btp_run_ranks(ranks, coll_rank, job);
    if (job->listen_fd >= 0) close(job->listen_fd);
    if (rc != 0) return 1;
    if (tcp)
        printf("host all-reduce (sum, f32) between %u processes over TCP on loopback (wrk_coll's "
               "TCP transport: a star through rank 0); median of %d loops\n\n",
               ranks, BTP_REPS);
    else
        printf("host all-reduce (sum, f32) between %u processes (wrk_coll, shared memory; chunk 1 "
               "MiB, direct path up to %u KiB per step; messages of several steps %s); median "
               "of %d loops\n\n",
               ranks, WRK_COLL_DIRECT_BYTES >> 10,
               stepwise ? "step by step, two barriers each (--stepwise)"
                        : "pipelined, one barrier per step",
               BTP_REPS);
    printf("| message | all-reduce | memcpy of the same bytes (1 process) | all-reduce / memcpy | "
           "all-reduce throughput | memcpy throughput |\n| --- | --- | --- | --- | --- | --- |\n");
    for (size_t s = 0; s < N_COLL_SIZES; s++) {
        printf("| ");
        print_size(coll_sizes[s]);
        printf(" | %.2f us | %.3f us | %.1fx | %.2f GB/s | %.2f GB/s |\n", job->ar_s[s] * 1e6,
               mc[s] * 1e6, job->ar_s[s] / mc[s], coll_sizes[s] / job->ar_s[s] * 1e-9,
               coll_sizes[s] / mc[s] * 1e-9);
    }
    printf("| barrier (no data) | %.2f us | | | | |\n", job->barrier_s * 1e6);
    (void)munmap(job, sizeof *job);
    return 0;
}

/* ---- coll-ab: the pipelined all-reduce against the stepwise one, paired ------------------- */

/* Messages of one step (the control: both handles run the same code) and of several. */
static const size_t ab_sizes[] = {1u << 20, 2u << 20, 4u << 20, 16u << 20, 64u << 20};
#define N_AB_SIZES    (sizeof ab_sizes / sizeof ab_sizes[0])
#define AB_MAX_ROUNDS 15

typedef struct ab_job {
    uint32_t rounds;
    double t[2][N_AB_SIZES][AB_MAX_ROUNDS]; /* rank 0's seconds per call: [pipelined, stepwise] */
} ab_job;

/* One timed loop of `iters` all-reduces on c, after a barrier. */
static int ab_loop(wrk_coll *c, float *buf, size_t n, uint32_t iters, double *out) {
    pie_status st = {0};
    if (wrk_coll_barrier(c, &st) != PIE_OK) goto fail;
    double t0 = now_s();
    for (uint32_t i = 0; i < iters; i++)
        if (wrk_coll_allreduce_sum_f32(c, buf, n, &st) != PIE_OK) goto fail;
    *out = (now_s() - t0) / iters;
    for (size_t i = 0; i < n; i++) buf[i] = 1.0f;
    return 0;
fail:
    fprintf(stderr, "bench_tp: collective: %s\n", st.msg);
    return -1;
}

/* Each rank joins two groups, pipelined and stepwise, and alternates them loop by loop, so
 * both see the same moments of the machine's load. */
static int ab_rank(uint32_t rank, uint32_t n, const char *name, void *arg) {
    ab_job *job = arg;
    pie_status st = {0};
    wrk_coll *c[2] = {NULL, NULL};
    for (int k = 0; k < 2; k++) {
        char nm[96];
        snprintf(nm, sizeof nm, "%s-%c", name, k ? 's' : 'p');
        wrk_coll_opts o = {
            .name = nm, .epoch = 1, .rank = rank, .n_ranks = n, .allreduce_stepwise = k == 1};
        if (wrk_coll_open(&o, &c[k], &st) != PIE_OK) {
            fprintf(stderr, "bench_tp: rank %u: %s\n", rank, st.msg);
            wrk_coll_close(c[0]);
            return 1;
        }
    }
    float *buf = malloc(ab_sizes[N_AB_SIZES - 1]);
    int rc = buf ? 0 : -1;
    for (size_t s = 0; rc == 0 && s < N_AB_SIZES; s++) {
        size_t cnt = ab_sizes[s] / sizeof(float);
        uint32_t iters = (uint32_t)((128u << 20) / ab_sizes[s]);
        for (size_t i = 0; i < cnt; i++) buf[i] = 1.0f;
        double warm;
        for (int k = 0; rc == 0 && k < 2; k++) rc = ab_loop(c[k], buf, cnt, 2, &warm);
        for (uint32_t r = 0; rc == 0 && r < job->rounds; r++)
            for (int k = 0; rc == 0 && k < 2; k++) {
                int kk = (int)(r & 1u) ^ k; /* alternate which one goes first */
                double t = 0;
                rc = ab_loop(c[kk], buf, cnt, iters < 2 ? 2 : iters, &t);
                if (rank == 0) job->t[kk][s][r] = t;
            }
    }
    free(buf);
    wrk_coll_close(c[0]);
    wrk_coll_close(c[1]);
    return rc == 0 ? 0 : 1;
}

static int bench_coll_ab(uint32_t ranks, uint32_t rounds) {
    ab_job *job = shared_alloc(sizeof *job);
    if (!job) return 1;
    job->rounds = rounds;
    if (btp_run_ranks(ranks, ab_rank, job) != 0) return 1;
    printf("host all-reduce (sum, f32, shared memory, chunk 1 MiB) between %u processes: the "
           "pipelined path (one barrier per step) against the stepwise one (two), %u paired "
           "rounds, alternating which runs first; 128 MiB moved per timed loop\n\n",
           ranks, rounds);
    printf("| message | steps | pipelined (median) | stepwise (median) | stepwise / pipelined: "
           "median of the rounds | min | max |\n| --- | --- | --- | --- | --- | --- | --- |\n");
    for (size_t s = 0; s < N_AB_SIZES; s++) {
        double p[AB_MAX_ROUNDS], q[AB_MAX_ROUNDS], ratio[AB_MAX_ROUNDS], lo = 1e9, hi = 0;
        for (uint32_t r = 0; r < rounds; r++) {
            p[r] = job->t[0][s][r];
            q[r] = job->t[1][s][r];
            ratio[r] = q[r] / p[r];
            lo = ratio[r] < lo ? ratio[r] : lo;
            hi = ratio[r] > hi ? ratio[r] : hi;
        }
        printf("| ");
        print_size(ab_sizes[s]);
        printf(" | %zu | %.0f us | %.0f us | %.3f | %.2f | %.2f |\n", ab_sizes[s] >> 20,
               median(p, rounds) * 1e6, median(q, rounds) * 1e6, median(ratio, rounds), lo, hi);
    }
    (void)munmap(job, sizeof *job);
    return 0;
}

/* ---- engine: tp N against tp 1 ------------------------------------------------------------- */

typedef struct eng_job {
    const char *model;
    uint32_t tp, threads_per_rank, prefill, context, batch, steps;
    uint32_t swap_slots;  /* > 0: the swap policy with this many layers on the device */
    bool offload;         /* the offload policy, every page the device's */
    /* rank 0's results */
    double prefill_s[BTP_REPS], dec1_s[BTP_MAX_STEPS], decB_s[BTP_MAX_STEPS], open_s;
    eng_info info;
} eng_job;

typedef struct eng_bench {
    eng *e;
    uint32_t rank, ps, per, *pages;
    pie_status st;
} eng_bench;

#define EB_TRY(b, call, what)                                                             \
    do {                                                                                  \
        if ((call) != PIE_OK) {                                                           \
            fprintf(stderr, "bench_tp: rank %u: %s: %s\n", (b)->rank, what, (b)->st.msg); \
            return -1;                                                                    \
        }                                                                                 \
    } while (0)

/* Embeds n tokens of a fixed sequence into slots slot0.. at positions pos0.. */
static int eb_embed(eng_bench *b, uint32_t slot0, uint32_t pos0, uint32_t n, uint32_t seed) {
    uint32_t *s = malloc((size_t)n * 3 * sizeof *s), vocab = eng_get_info(b->e)->vocab_size;
    if (!s) return -1;
    if (vocab > 4096) vocab = 4096; /* ids the preset's tokenizer knows */
    for (uint32_t i = 0; i < n; i++) {
        s[i] = slot0 + i;
        s[n + i] = (seed * 2654435761u + (pos0 + i) * 40503u) % vocab;
        s[2 * n + i] = pos0 + i;
    }
    pie_code rc = eng_embed_text(b->e, s, s + n, s + 2 * n, n, &b->st);
    free(s);
    EB_TRY(b, rc, "embed_text");
    return 0;
}

static eng_forward_item eb_item(const eng_bench *b, const uint32_t *pages, uint32_t len,
                                const uint32_t *in, uint32_t n_in, const uint32_t *out) {
    return (eng_forward_item){.kv_pages = pages,
                              .n_kv_pages = (len + b->ps - 1) / b->ps,
                              .kv_last_page_len = (len - 1) % b->ps + 1,
                              .append_kv = true,
                              .in_slots = in,
                              .n_in = n_in,
                              .out_slots = out,
                              .n_out = 1};
}

/* Embed + forward of len tokens into pages from position 0 (the last one out); *secs. */
static int eb_prefill(eng_bench *b, const uint32_t *pages, uint32_t len, double *secs) {
    uint32_t *in = malloc(len * sizeof *in), out = len;
    if (!in) return -1;
    for (uint32_t i = 0; i < len; i++) in[i] = i;
    double t0 = now_s();
    int rc = eb_embed(b, 0, 0, len, 1);
    eng_forward_item it = eb_item(b, pages, len, in, len, &out);
    if (rc == 0 && eng_forward(b->e, &it, 1, &b->st) != PIE_OK) {
        fprintf(stderr, "bench_tp: rank %u: forward: %s\n", b->rank, b->st.msg);
        rc = -1;
    }
    *secs = now_s() - t0;
    free(in);
    return rc;
}

/* One decode step of B sequences (sequence i in pages[i * per ..], len tokens after it):
 * embed, forward, next_dist (top 256) of each; *secs. */
static int eb_decode(eng_bench *b, uint32_t B, uint32_t len, uint32_t slot0, double *secs) {
    eng_forward_item items[64];
    eng_dist_item dist[64];
    uint32_t slots[64];
    static uint32_t ids[64 * BTP_TOPK]; /* rank-private: each rank is its own process */
    static float probs[64 * BTP_TOPK];
    double t0 = now_s();
    for (uint32_t i = 0; i < B; i++) {
        slots[i] = slot0 + i;
        if (eb_embed(b, slots[i], len - 1, 1, 7 + i) != 0) return -1;
        items[i] = eb_item(b, b->pages + (size_t)i * b->per, len, &slots[i], 1, &slots[i]);
        dist[i] = (eng_dist_item){.slot = slots[i],
                                  .top_k = BTP_TOPK,
                                  .temperature = 1.0f,
                                  .ids = ids + (size_t)i * BTP_TOPK,
                                  .probs = probs + (size_t)i * BTP_TOPK};
    }
    EB_TRY(b, eng_forward(b->e, items, B, &b->st), "decode forward");
    EB_TRY(b, eng_next_dist(b->e, dist, B, &b->st), "next_dist");
    *secs = now_s() - t0;
    return 0;
}

/* Copies sequence 0's context to sequences 1..B-1 (whole pages, the last one partly). */
static int eb_replicate(eng_bench *b, uint32_t B, uint32_t context) {
    uint32_t full = (context + b->ps - 1) / b->ps, n = 0;
    eng_copy_item *c = calloc((size_t)full * B + 1, sizeof *c);
    if (!c) return -1;
    for (uint32_t s = 1; s < B; s++)
        for (uint32_t j = 0; j < full; j++)
            c[n++] = (eng_copy_item){b->pages[j], b->pages[(size_t)s * b->per + j], 0, 0,
                                     j + 1 < full ? b->ps : context - j * b->ps};
    pie_code rc = n ? eng_copy_pages(b->e, c, n, &b->st) : PIE_OK;
    free(c);
    EB_TRY(b, rc, "copy_pages");
    return 0;
}

/* The workload, the same calls on every rank. */
static int eb_workload(eng_bench *b, eng_job *job) {
    double t = 0;
    uint32_t *pre_pages = b->pages + (size_t)job->batch * b->per;
    for (int r = 0; r <= BTP_REPS; r++) { /* the first is a warm-up */
        if (eb_prefill(b, pre_pages, job->prefill, &t) != 0) return -1;
        if (r > 0 && b->rank == 0) job->prefill_s[r - 1] = t;
    }
    if (eb_prefill(b, b->pages, job->context, &t) != 0) return -1;
    if (eb_replicate(b, job->batch, job->context) != 0) return -1;
    uint32_t slot0 = job->prefill + 8;
    for (uint32_t s = 0; s <= job->steps; s++) {
        uint32_t len = job->context + s + 1;
        double t1 = 0, tB = 0;
        if (eb_decode(b, 1, len, slot0, &t1) != 0) return -1;
        if (eb_decode(b, job->batch, len, slot0 + 1, &tB) != 0) return -1;
        if (s > 0 && b->rank == 0) job->dec1_s[s - 1] = t1, job->decB_s[s - 1] = tB;
    }
    return 0;
}

static int eng_rank(uint32_t rank, uint32_t n, const char *name, void *arg) {
    eng_job *job = arg;
    eng_bench b = {.rank = rank, .ps = 16};
    wrk_coll *c = NULL;
    int rc = 1;
    b.per = (job->context + job->steps + 1 + b.ps - 1) / b.ps;
    uint32_t n_pages = b.per * job->batch + (job->prefill + b.ps - 1) / b.ps;
    uint32_t max_tokens = job->prefill > job->context ? job->prefill : job->context;
    b.pages = malloc(n_pages * sizeof *b.pages);
    if (!b.pages) goto out;
    for (uint32_t i = 0; i < n_pages; i++) b.pages[i] = i;
    if (n > 1 && coll_join(rank, n, name, &c, &b.st) != PIE_OK) {
        fprintf(stderr, "bench_tp: rank %u: %s\n", rank, b.st.msg);
        goto out;
    }
    eng_opts eo = {.model_dir = job->model,
                   .kv_page_size = b.ps,
                   .kv_pages = n_pages,
                   .embed_slots = max_tokens + job->batch + 16,
                   .max_batch_tokens = max_tokens,
                   .n_threads = (int)job->threads_per_rank,
                   .tp_rank = rank,
                   .tp_size = n,
                   .coll = c};
    if (job->swap_slots) { /* issue 13 inside a group: the slot count travels with each forward */
        eo.swap_slots = job->swap_slots;
        eo.swap_min_slots = job->swap_slots < 2 ? job->swap_slots : 2;
        eo.swap_host_bytes = (size_t)1 << 30; /* reserved, committed only where touched */
    }
    if (job->offload) { /* the offload split travels with each forward that has a decode */
        eo.offload_device_pages = n_pages;
        eo.offload_host_threads = (int)job->threads_per_rank;
    }
    double t0 = now_s();
    if (eng_open(&eo, &b.e, &b.st) != PIE_OK) {
        fprintf(stderr, "bench_tp: rank %u: eng_open: %s\n", rank, b.st.msg);
        goto out;
    }
    if (c && wrk_coll_barrier(c, &b.st) != PIE_OK) goto out;
    if (rank == 0) job->open_s = now_s() - t0, job->info = *eng_get_info(b.e);
    rc = eb_workload(&b, job) == 0 ? 0 : 1;
out:
    eng_close(b.e);
    wrk_coll_close(c);
    free(b.pages);
    return rc;
}

typedef struct eng_opts_cli {
    const char *model;
    uint32_t tps[BTP_MAX_TP], n_tp, threads, prefill, context, batch, steps, rounds;
    uint32_t swap_slots, offload; /* the memory policy (default gpu) */
} eng_opts_cli;

/* Medians of one run of a group: prefill, decode b=1, decode b=B step seconds. */
static void eng_medians(const eng_job *j, uint32_t steps, double m[3]) {
    double p[BTP_REPS], d1[BTP_MAX_STEPS], dB[BTP_MAX_STEPS];
    memcpy(p, j->prefill_s, sizeof p);
    memcpy(d1, j->dec1_s, steps * sizeof *d1);
    memcpy(dB, j->decB_s, steps * sizeof *dB);
    m[0] = median(p, BTP_REPS), m[1] = median(d1, steps), m[2] = median(dB, steps);
}

static void eng_row(const char *label, uint32_t tp, uint32_t tpr, const double m[3],
                    const double ref[3], uint32_t prefill, uint32_t batch) {
    printf("| %s | %u | %u | %.1f ms (%.1f tok/s) | %.2f ms | %.2f ms (%.1f tok/s) | "
           "%.2fx / %.2fx / %.2fx |\n",
           label, tp, tpr, m[0] * 1e3, prefill / m[0], m[1] * 1e3, m[2] * 1e3, batch / m[2],
           ref[0] / m[0], ref[1] / m[1], ref[2] / m[2]);
}

/* jobs[round * n_tp + i]: one row per run (speed-ups against the same round's first tp, run
 * just before it), then the medians over rounds of each tp. */
static void eng_print(const eng_opts_cli *o, eng_job *const *jobs) {
    const eng_info *m = &jobs[0]->info;
    printf("model %s: %s, %u layers, hidden %u, ffn %u, heads %u/%u, vocab %u; %u threads in "
           "all; prefill %u tokens, decode over %u context tokens, %u steps; %u rounds, each "
           "running every tp in turn\n\n",
           o->model, m->dtype, m->n_layers, m->hidden_size, m->intermediate_size, m->n_heads,
           m->n_kv_heads, m->vocab_size, o->threads, o->prefill, o->context, o->steps, o->rounds);
    printf("| run | tp | threads per rank | prefill %u tok (median of %d) | decode b=1 step "
           "(median of %u) | decode b=%u step | speed-up vs tp %u: prefill / b=1 / b=%u |\n"
           "| --- | --- | --- | --- | --- | --- | --- |\n",
           o->prefill, BTP_REPS, o->steps, o->batch, o->tps[0], o->batch);
    double all[BTP_MAX_ROUNDS][BTP_MAX_TP][3];
    for (uint32_t r = 0; r < o->rounds; r++)
        for (uint32_t i = 0; i < o->n_tp; i++) {
            const eng_job *j = jobs[r * o->n_tp + i];
            eng_medians(j, o->steps, all[r][i]);
            char label[48];
            (void)snprintf(label, sizeof label, "round %u (open %.2f s)", r + 1, j->open_s);
            eng_row(label, j->tp, j->threads_per_rank, all[r][i], all[r][0], o->prefill, o->batch);
        }
    double med[BTP_MAX_TP][3];
    for (uint32_t i = 0; i < o->n_tp; i++)
        for (int k = 0; k < 3; k++) {
            double v[BTP_MAX_ROUNDS];
            for (uint32_t r = 0; r < o->rounds; r++) v[r] = all[r][i][k];
            med[i][k] = median(v, o->rounds);
        }
    for (uint32_t i = 0; i < o->n_tp; i++)
        eng_row("median of the rounds", o->tps[i], jobs[i]->threads_per_rank, med[i], med[0],
                o->prefill, o->batch);
    printf("\nCollectives per step at tp > 1: embed 1 all-reduce of [tokens, %u] f32, forward "
           "%u all-reduces (2 per layer), next_dist 2 all-gathers; a decode step of batch 1 "
           "thus makes %u all-reduces of %u KiB.\n",
           m->hidden_size, 2 * m->n_layers, 2 * m->n_layers + 1, m->hidden_size * 4 / 1024);
}

static int parse_tps(const char *s, eng_opts_cli *o) {
    o->n_tp = 0;
    while (*s) {
        char *end = NULL;
        long v = strtol(s, &end, 10);
        if (end == s || v < 1 || v > WRK_COLL_MAX_RANKS || o->n_tp == BTP_MAX_TP) return -1;
        o->tps[o->n_tp++] = (uint32_t)v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') return -1;
    }
    return o->n_tp ? 0 : -1;
}

static int parse_engine(int argc, char **argv, eng_opts_cli *o) {
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    *o = (eng_opts_cli){.tps = {1, 2},
                        .n_tp = 2,
                        .threads = cores > 0 ? (uint32_t)cores : 1,
                        .prefill = 128,
                        .context = 256,
                        .batch = 8,
                        .steps = 8,
                        .rounds = 3};
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        if (a[0] != '-') {
            o->model = a;
            continue;
        }
        if (i + 1 >= argc) return -1;
        const char *v = argv[++i];
        if (strcmp(a, "--tp") == 0) {
            if (parse_tps(v, o) != 0) return -1;
            continue;
        }
        long x = strtol(v, NULL, 10);
        if (x < 1 || x > 100000) return -1;
        if (strcmp(a, "--threads") == 0)
            o->threads = (uint32_t)x;
        else if (strcmp(a, "--prefill") == 0)
            o->prefill = (uint32_t)x;
        else if (strcmp(a, "--context") == 0)
            o->context = (uint32_t)x;
        else if (strcmp(a, "--batch") == 0 && x <= 64)
            o->batch = (uint32_t)x;
        else if (strcmp(a, "--steps") == 0 && x <= BTP_MAX_STEPS)
            o->steps = (uint32_t)x;
        else if (strcmp(a, "--rounds") == 0 && x <= BTP_MAX_ROUNDS)
            o->rounds = (uint32_t)x;
        else if (strcmp(a, "--swap-slots") == 0)
            o->swap_slots = (uint32_t)x;
        else if (strcmp(a, "--offload") == 0 && x == 1)
            o->offload = 1;
        else
            return -1;
    }
    return o->model ? 0 : -1;
}

static int bench_engine_tp(const eng_opts_cli *o) {
    eng_job *jobs[BTP_MAX_ROUNDS * BTP_MAX_TP] = {0};
    uint32_t n_jobs = o->rounds * o->n_tp;
    int rc = 0;
    for (uint32_t k = 0; k < n_jobs && rc == 0; k++) {
        uint32_t tp = o->tps[k % o->n_tp], tpr = o->threads / tp;
        jobs[k] = shared_alloc(sizeof *jobs[k]);
        if (!jobs[k]) {
            fprintf(stderr, "bench_tp: out of memory\n");
            rc = 1;
            break;
        }
        *jobs[k] = (eng_job){.model = o->model,
                             .tp = tp,
                             .threads_per_rank = tpr ? tpr : 1,
                             .prefill = o->prefill,
                             .context = o->context,
                             .batch = o->batch,
                             .steps = o->steps,
                             .swap_slots = o->swap_slots,
                             .offload = o->offload != 0};
        if (btp_run_ranks(tp, eng_rank, jobs[k]) != 0) rc = 1;
    }
    if (rc == 0) eng_print(o, jobs);
    for (uint32_t k = 0; k < n_jobs; k++)
        if (jobs[k]) (void)munmap(jobs[k], sizeof *jobs[k]);
    return rc;
}

static int usage(void) {
    fprintf(stderr, "usage: bench_tp coll [--ranks 2] [--tcp] [--stepwise] [--quick]\n"
                    "       bench_tp coll-ab [--ranks 2] [--rounds 9]\n"
                    "       bench_tp engine MODEL_DIR [--tp 1,2] [--threads N] [--prefill 128] "
                    "[--context 256] [--batch 8] [--steps 8] [--rounds 3]\n"
                    "                 [--swap-slots LAYERS | --offload 1]\n");
    return 2;
}

int main(int argc, char **argv) {
    if (argc >= 2 && strcmp(argv[1], "coll") == 0) {
        uint32_t ranks = 2;
        int quick = 0, tcp = 0, stepwise = 0;
        for (int i = 2; i < argc; i++) {
            if (strcmp(argv[i], "--quick") == 0)
                quick = 1;
            else if (strcmp(argv[i], "--stepwise") == 0)
                stepwise = 1;
            else if (strcmp(argv[i], "--tcp") == 0)
                tcp = 1;
            else if (strcmp(argv[i], "--ranks") == 0 && i + 1 < argc) {
                long v = strtol(argv[++i], NULL, 10);
                if (v < 2 || v > WRK_COLL_MAX_RANKS) return usage();
                ranks = (uint32_t)v;
            } else
                return usage();
        }
        return bench_coll(ranks, quick, tcp, stepwise);
    }
    if (argc >= 2 && strcmp(argv[1], "coll-ab") == 0) {
        uint32_t ranks = 2, rounds = 9;
        for (int i = 2; i + 1 < argc; i += 2) {
            long v = strtol(argv[i + 1], NULL, 10);
            if (strcmp(argv[i], "--ranks") == 0 && v >= 2 && v <= WRK_COLL_MAX_RANKS)
                ranks = (uint32_t)v;
            else if (strcmp(argv[i], "--rounds") == 0 && v >= 1 && v <= AB_MAX_ROUNDS)
                rounds = (uint32_t)v;
            else
                return usage();
        }
        if (argc % 2) return usage(); /* an option without its value */
        return bench_coll_ab(ranks, rounds);
    }
    if (argc >= 2 && strcmp(argv[1], "engine") == 0) {
        eng_opts_cli o;
        if (parse_engine(argc, argv, &o) != 0) return usage();
        return bench_engine_tp(&o);
    }
    return usage();
}
