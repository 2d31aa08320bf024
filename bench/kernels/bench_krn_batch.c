/* bench_krn_batch.c — one thread, bf16/f16 linear layers with a few to a few dozen rows of x
 * (batched decode, and prefill sizes past it): the kernels that can run them, A/B on the same
 * data.
 *
 * Owns: timing, per shape and row count, of
 *   tiles   krn_cpu_linear with the panel path off (AMX and AVX512-BF16 off): the 4 × 6 GEMV
 *           tiles up to 32 rows, the converted-tile sgemm above;
 *   panel   the packed-panel kernel (krn_panel.c), called directly so it runs at any n;
 *   dot     krn_cpu_linear on the AVX512-BF16 path (x rounded to bf16; bf16 weights, 8-32
 *           rows, when the CPU has it), its tiles;
 *   dotpanel the same path's packed-panel variant (PIE_KRN_BF16DOT=panel);
 *   wpack   krn_cpu_linear on W packed once (krn_wpack_bf16, KRN_BF16_PANEL; bf16 only);
 * in thread CPU time (CLOCK_THREAD_CPUTIME_ID: the machine is shared, time spent descheduled
 * does not count), best of --reps, the variants interleaved rep by rep so drifts in load hit
 * all alike. The panel result is checked against the tiles' (relative difference printed).
 * Weights: one copy (warm in the caches that hold it) or, with --rotate, copies totalling
 * >= 1 GiB used in turn, so every call streams W from DRAM as in a forward pass.
 * Usage: bench_krn_batch [--reps N] [--ns 2,4,8] [--dtype bf16|f16] [--rotate] [--shape IxO]...
 *                        [--variants tiles,panel,dot,dotpanel,wpack]
 * Results: bench/results/engine.md. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "krn_cpu.h"
#include "krn_cpu_impl.h" /* the panel kernel's entry points and switch */
#include "bench_krn_util.h"

static double cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Weights of magnitude ~0.05 as bf16 (top half of the f32) or f16 (F16C rounding; the bench
 * needs the avx512 path anyway). */
__attribute__((target("f16c"))) static void fill_w(uint16_t *w, size_t n, krn_dtype wt) {
    for (size_t i = 0; i < n; i++) {
        float f = bench_krn_frand() * 0.05f;
        if (wt == KRN_BF16) {
            uint32_t u;
            memcpy(&u, &f, 4);
            w[i] = (uint16_t)(u >> 16);
        } else {
            w[i] = _cvtss_sh(f, 0);
        }
    }
}

typedef struct shape {
    int in, out;
    int copies;
    uint16_t **w;
    void **wp; /* bf16: each copy packed once (krn_wpack_bf16), for the wpack variant */
} shape;

static shape shape_make(int in, int out, krn_dtype wt, int rotate) {
    shape s = {.in = in, .out = out, .copies = 1};
    size_t bytes = (size_t)in * (size_t)out * 2;
    if (rotate) s.copies = (int)((1ull << 30) / bytes) + 1;
    s.w = calloc((size_t)s.copies, sizeof *s.w);
    s.wp = calloc((size_t)s.copies, sizeof *s.wp);
    for (int c = 0; c < s.copies; c++) {
        s.w[c] = bench_krn_alloc(bytes);
        if (c == 0)
            fill_w(s.w[0], (size_t)in * (size_t)out, wt);
        else
            memcpy(s.w[c], s.w[0], bytes);
        if (wt == KRN_BF16) {
            s.wp[c] = bench_krn_alloc(krn_wpack_bytes(out, in));
            krn_wpack_bf16(NULL, s.w[c], out, in, s.wp[c]);
        }
    }
    return s;
}

static void shape_free(shape *s) {
    for (int c = 0; c < s->copies; c++) free(s->w[c]), free(s->wp[c]);
    free(s->w);
    free(s->wp);
}

enum { V_TILES, V_PANEL, V_DOT, V_DOTPANEL, V_WPACK, N_VARIANTS };
static const char *const VARIANT_NAMES[N_VARIANTS] = {"tiles", "panel", "dot", "dotpanel",
                                                      "wpack"};

/* The panel kernel on one thread, as krn_cpu_linear runs it with a 1-thread pool. */
static void run_panel(krn_pool *p, const float *x, int n, int in, const uint16_t *w, krn_dtype wt,
                      int out, float *y) {
    void *xp = krn_pool_scratch(p, 1, krn_panel_x_bytes(KRN_PANEL_F32, n, in));
    void *panel = krn_pool_scratch(p, 0, krn_panel_w_bytes());
    if (!xp || !panel) {
        fprintf(stderr, "bench_krn_batch: out of memory for the panel path\n");
        exit(1);
    }
    krn_panel_pack_x(p, KRN_PANEL_F32, x, n, in, xp);
    krn_panel_rows(KRN_PANEL_F32, xp, n, in, w, wt, 0, out, panel, y, out);
}

static int g_want[N_VARIANTS] = {1, 1, 1, 1, 1}; /* --variants */

static int variant_runs(int v, krn_dtype wt, int n, int have_dot) {
    if (!g_want[v]) return 0;
    if (v == V_DOT || v == V_DOTPANEL) return have_dot && wt == KRN_BF16 && n >= 8 && n <= 32;
    if (v == V_WPACK) return wt == KRN_BF16;
    return 1;
}

static void run_variant(int v, krn_pool *p, const float *x, int n, const shape *s, int copy,
                        krn_dtype wt, float *y) {
    const uint16_t *w = s->w[copy];
    krn_cpu_set_panel(0);
    if (v == V_PANEL) {
        krn_cpu_set_panel(1);
        run_panel(p, x, n, s->in, w, wt, s->out, y);
        return;
    }
    if (v == V_WPACK) { /* krn_cpu_linear on W packed at load (the exact path) */
        krn_cpu_linear(p, x, n, s->in, s->wp[copy], KRN_BF16_PANEL, s->out, y);
        return;
    }
    krn_cpu_set_bf16dot(v == V_DOT ? 1 : v == V_DOTPANEL ? 2 : 0);
    krn_cpu_linear(p, x, n, s->in, w, wt, s->out, y);
    krn_cpu_set_bf16dot(0);
}

/* max |a - b| / max |b| over n values */
static double rel_diff(const float *a, const float *b, size_t n) {
    double d = 0, m = 0;
    for (size_t i = 0; i < n; i++) {
        d = fmax(d, fabs((double)a[i] - (double)b[i]));
        m = fmax(m, fabs((double)b[i]));
    }
    return m > 0 ? d / m : d;
}

static void bench_shape(krn_pool *p, const shape *s, krn_dtype wt, const int *ns, int n_ns,
                        int reps, int have_dot) {
    for (int a = 0; a < n_ns; a++) {
        int n = ns[a];
        float *x = bench_krn_alloc((size_t)n * (size_t)s->in * 4);
        float *y[N_VARIANTS];
        for (size_t i = 0; i < (size_t)n * (size_t)s->in; i++) x[i] = bench_krn_frand();
        double best[N_VARIANTS];
        for (int v = 0; v < N_VARIANTS; v++) {
            best[v] = INFINITY;
            y[v] = bench_krn_alloc((size_t)n * (size_t)s->out * 4);
            if (variant_runs(v, wt, n, have_dot)) run_variant(v, p, x, n, s, 0, wt, y[v]);
        }
        double diff = g_want[V_PANEL] && g_want[V_TILES]
                          ? rel_diff(y[V_PANEL], y[V_TILES], (size_t)n * (size_t)s->out)
                          : 0;
        for (int r = 0; r < reps; r++)
            for (int v = 0; v < N_VARIANTS; v++) {
                if (!variant_runs(v, wt, n, have_dot)) continue;
                double t0 = cpu_s();
                run_variant(v, p, x, n, s, (r + 1) % s->copies, wt, y[v]);
                double t = cpu_s() - t0;
                if (t < best[v]) best[v] = t;
            }
        double macs = (double)n * s->in * s->out;
        printf("  %5d -> %6d n=%2d", s->in, s->out, n);
        for (int v = 0; v < N_VARIANTS; v++) {
            if (!variant_runs(v, wt, n, have_dot)) continue;
            printf("  %s %8.3f ms %5.1f GMAC/s", VARIANT_NAMES[v], best[v] * 1e3,
                   macs / best[v] / 1e9);
        }
        if (g_want[V_PANEL] && g_want[V_TILES])
            printf("  panel/tiles %.2fx  (rel diff %.1e)", best[V_TILES] / best[V_PANEL], diff);
        printf("\n");
        fflush(stdout);
        for (int v = 0; v < N_VARIANTS; v++) free(y[v]);
        free(x);
    }
}

static int parse_ns(const char *arg, int *ns, int max) {
    int k = 0;
    for (const char *c = arg; *c && k < max;) {
        ns[k++] = atoi(c);
        c = strchr(c, ',');
        if (!c) break;
        c++;
    }
    return k;
}

/* Whether `name` is one of the comma-separated words of `list`. */
static int in_list(const char *list, const char *name) {
    size_t len = strlen(name);
    for (const char *c = list; c; c = strchr(c, ',') ? strchr(c, ',') + 1 : NULL)
        if (strncmp(c, name, len) == 0 && (c[len] == ',' || c[len] == '\0')) return 1;
    return 0;
}

int main(int argc, char **argv) {
    int reps = 10, rotate = 0, ns[64] = {2, 4, 8, 16, 32}, n_ns = 5;
    krn_dtype wt = KRN_BF16;
    int shapes[8][2] = {{2048, 2048}, {2048, 8192}, {8192, 2048}, {2048, 128256}}, n_shapes = 4;
    int custom = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (strcmp(argv[i], "--ns") == 0 && i + 1 < argc)
            n_ns = parse_ns(argv[++i], ns, 64);
        else if (strcmp(argv[i], "--dtype") == 0 && i + 1 < argc)
            wt = strcmp(argv[++i], "f16") == 0 ? KRN_F16 : KRN_BF16;
        else if (strcmp(argv[i], "--variants") == 0 && i + 1 < argc) {
            const char *list = argv[++i];
            for (int v = 0; v < N_VARIANTS; v++) g_want[v] = in_list(list, VARIANT_NAMES[v]);
        } else if (strcmp(argv[i], "--rotate") == 0)
            rotate = 1;
        else if (strcmp(argv[i], "--shape") == 0 && i + 1 < argc && custom < 8) {
            if (sscanf(argv[++i], "%dx%d", &shapes[custom][0], &shapes[custom][1]) != 2) {
                fprintf(stderr, "bench_krn_batch: --shape wants INxOUT\n");
                return 2;
            }
            n_shapes = ++custom;
        } else {
            fprintf(stderr,
                    "usage: %s [--reps N] [--ns 2,4,8] [--dtype bf16|f16] [--rotate] "
                    "[--shape INxOUT]... [--variants tiles,panel,dot,dotpanel,wpack]\n",
                    argv[0]);
            return 2;
        }
    }
    krn_pool *p = krn_pool_create(1);
    if (!p || strcmp(krn_cpu_simd_name(), "avx512") != 0) {
        fprintf(stderr, "bench_krn_batch: needs the avx512 path and a pool\n");
        return 1;
    }
    krn_cpu_set_amx(0);
    int have_dot = krn_cpu_set_bf16dot(1) == 0;
    krn_cpu_set_bf16dot(0);
    printf("bench_krn_batch: 1 thread, %s weights, W %s, best of %d (thread CPU time), AMX off%s\n",
           wt == KRN_BF16 ? "bf16" : "f16", rotate ? "rotated through >= 1 GiB" : "one copy", reps,
           have_dot ? "" : ", no AVX512-BF16");
    for (int i = 0; i < n_shapes; i++) {
        shape s = shape_make(shapes[i][0], shapes[i][1], wt, rotate);
        int r = shapes[i][1] > 100000 ? (reps + 2) / 3 : reps;
        bench_shape(p, &s, wt, ns, n_ns, r, have_dot);
        shape_free(&s);
    }
    krn_pool_destroy(p);
    return 0;
}
