/* bench_wasm.c — the inferlet runtime's speed and footprint (services/lifecycle/wasm).
 *
 * Measures, with the fixtures of tests/wasm (built by the normal build):
 *   cold    load of a new ~200 KB module made unique per iteration by a custom section: hash +
 *           checks + wasm2c | tcc (a pipeline) + dlopen, with the phases of each load (the
 *           runtime's t0_* stats: files, wasm2c ended, tcc ended, dlopen; the check timed on a
 *           second load of the same bytes); also wasm2c (and when its first byte of C comes)
 *           and tcc alone, and the tier-1 compile. Instruction counts of the same steps:
 *           bench/wasm/cold_profile.sh; reuse between two builds: bench/wasm/fn_reuse.py.
 *           big.wasm is ~200 KB of code, big_dwarf.wasm ~200 KB as clang emits it (mostly DWARF);
 *   warm    create + run + free of trivial.wasm (module already loaded), tier 0 and tier 1,
 *           and the same plus lc_wasm_module_load of the bytes (hash + memory hit);
 *   call    wasm → host → wasm round trip (pie.test_add in a loop), ns per call, both tiers;
 *   many    N instances (default 512) each on its own thread, all parked in a host call:
 *           time until all run, resident memory per idle instance, time until all finished.
 * Results are recorded in bench/results/wasm.md. Usage:
 *   bench_wasm [--cold N] [--warm N] [--calls N] [--instances N] [--stack-kib N] [--tier1 0|1]
 *              [--helper PATH]   (tier 0 in a pie-tcc-helper, e.g. build/bin/pie-tcc-helper)
 *              [--tier0 own|wasm2c]   (tier 0's translator: lc_wasm_xlate, the default, or wasm2c)
 * (--tier1 0 skips the tier-1 compile of the cold section, which takes seconds to minutes.) */
#include <errno.h>
#include <ftw.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "lc_wasm.h"
#include "wasm_test_host.h"

/* ---- helpers -----------------------------------------------------------------------------------
 */

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* CPU time of this process and of its waited-for children (wasm2c, tcc), in ms. */
static double cpu_ms(void) {
    struct rusage self, kids;
    getrusage(RUSAGE_SELF, &self);
    getrusage(RUSAGE_CHILDREN, &kids);
    double s = 0;
    const struct rusage *r[] = {&self, &kids};
    for (int i = 0; i < 2; i++)
        s += (double)(r[i]->ru_utime.tv_sec + r[i]->ru_stime.tv_sec) * 1e3 +
             (double)(r[i]->ru_utime.tv_usec + r[i]->ru_stime.tv_usec) / 1e3;
    return s;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double pct(double *v, size_t n, double p) {
    qsort(v, n, sizeof *v, cmp_double);
    size_t i = (size_t)(p * (double)(n - 1) + 0.5);
    return v[i];
}

static void die(const char *what, const pie_status *st) {
    fprintf(stderr, "bench_wasm: %s: %s\n", what, st ? st->msg : strerror(errno));
    exit(1);
}

static uint8_t *read_fixture(const char *name, size_t *len) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s.wasm", PIE_WASM_FIXTURES, name);
    FILE *f = fopen(path, "rb");
    if (f == NULL) die(path, NULL);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    rewind(f);
    uint8_t *b = malloc((size_t)n + 64); /* room for a custom section */
    if (b == NULL || n <= 0 || fread(b, 1, (size_t)n, f) != (size_t)n) die(path, NULL);
    fclose(f);
    *len = (size_t)n;
    return b;
}

/* Appends a custom section "bench" holding a nonce: new content hash, same code. */
static size_t make_unique(uint8_t *b, size_t len, uint64_t nonce) {
    const uint8_t head[] = {0x00, 1 + 5 + 8, 5, 'b', 'e', 'n', 'c', 'h'};
    memcpy(b + len, head, sizeof head);
    memcpy(b + len + sizeof head, &nonce, 8);
    return len + sizeof head + 8;
}

static long rss_kib(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long kib = -1;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "VmRSS: %ld kB", &kib) == 1) break;
    if (f) fclose(f);
    return kib;
}

static char cache_dir[64];
/* --tier0 wasm2c: tier 0 as before lc_wasm_xlate (wasm2c | tcc); default: our translator */
static bool g_tier0_wasm2c;
/* --helper PATH: tier 0 compiles in a pie-tcc-helper (lc_wasm_rt_opts.tcc_helper) */
static const char *g_tcc_helper;

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

static lc_wasm_rt *make_rt(bool tier1) {
    lc_wasm_rt_opts o = {.cache_dir = cache_dir,
                         .host_fns = wasm_test_host_fns,
                         .n_host_fns = wasm_test_host_n_fns,
                         .tier1 = tier1,
                         .tier0_wasm2c = g_tier0_wasm2c,
                         .tcc_helper = g_tcc_helper};
    lc_wasm_rt *rt = NULL;
    pie_status st;
    if (lc_wasm_rt_create(&o, &rt, &st) != PIE_OK) die("rt_create", &st);
    return rt;
}

static lc_wasm_outcome run_once(lc_wasm_module *m, const char *const *argv, size_t argc,
                                void *host) {
    lc_wasm_instance_opts o = {.argv = argv, .argc = argc, .host = host};
    lc_wasm_instance *inst;
    lc_wasm_outcome out;
    pie_status st;
    if (lc_wasm_instance_create(m, &o, &inst, &st) != PIE_OK) die("instance_create", &st);
    if (lc_wasm_instance_run(inst, &out, &st) != PIE_OK) die("instance_run", &st);
    lc_wasm_instance_free(inst);
    if (out.end != LC_WASM_EXITED || out.exit_code != 0) {
        fprintf(stderr, "bench_wasm: instance ended: %s\n", out.message);
        exit(1);
    }
    return out;
}

/* ---- cold
 * ---------------------------------------------------------------------------------------- */

static void bench_cold(const char *fixture, int n, bool tier1) {
    size_t len;
    uint8_t *b = read_fixture(fixture, &len);
    lc_wasm_rt *rt = make_rt(false);
    double *t = calloc((size_t)n, sizeof *t), *cpu = calloc((size_t)n, sizeof *cpu);
    /* per run: check (parse + hash, timed again on the loaded bytes: a memory hit), files,
     * wasm2c ended, compiler ended (both from the pipeline's start), dlopen */
    enum { PH_CHECK, PH_FILES, PH_W2C, PH_CC, PH_OPEN, PH_N };
    double *ph[PH_N];
    for (int k = 0; k < PH_N; k++) ph[k] = calloc((size_t)n, sizeof **ph);
    for (int i = 0; i < n; i++) {
        size_t l = make_unique(b, len, (uint64_t)i + 1);
        lc_wasm_module *m, *again;
        pie_status st;
        lc_wasm_rt_stats s0 = lc_wasm_rt_stats_get(rt);
        double c0 = cpu_ms(), t0 = now_ms();
        if (lc_wasm_module_load(rt, b, l, &m, &st) != PIE_OK) die("load big", &st);
        t[i] = now_ms() - t0;
        cpu[i] = cpu_ms() - c0;
        lc_wasm_rt_stats s1 = lc_wasm_rt_stats_get(rt);
        t0 = now_ms();
        if (lc_wasm_module_load(rt, b, l, &again, &st) != PIE_OK) die("load big again", &st);
        ph[PH_CHECK][i] = now_ms() - t0;
        lc_wasm_module_release(again);
        ph[PH_FILES][i] = (double)(s1.t0_files_ns - s0.t0_files_ns) / 1e6;
        ph[PH_W2C][i] = (double)(s1.t0_translate_ns - s0.t0_translate_ns) / 1e6;
        ph[PH_CC][i] = (double)(s1.t0_compile_ns - s0.t0_compile_ns) / 1e6;
        ph[PH_OPEN][i] = (double)(s1.t0_open_ns - s0.t0_open_ns) / 1e6;
        lc_wasm_module_release(m);
    }
    double p50 = pct(t, (size_t)n, 0.5), p90 = pct(t, (size_t)n, 0.9), min = t[0];
    lc_wasm_rt_stats sx = lc_wasm_rt_stats_get(rt);
    if (!g_tier0_wasm2c && sx.own_declines > 0) {
        fprintf(stderr, "bench_wasm: lc_wasm_xlate declined %s (fell back to wasm2c)\n", fixture);
        exit(1);
    }
    printf("cold load of a new %zu-byte module (%s: hash+check+%s+dlopen), %d runs: "
           "p50 %.1f ms, p90 %.1f ms, min %.1f ms; CPU (ours + children) p50 %.1f ms\n",
           len, fixture, g_tier0_wasm2c ? "wasm2c|tcc" : "lc_wasm_xlate+tcc", n, p50, p90, min,
           pct(cpu, (size_t)n, 0.5));
    printf(g_tier0_wasm2c
               ? "  phases, p50 of each: check (parse + SHA-256) %.2f ms, cache files %.2f ms, "
                 "pipeline start -> wasm2c ended %.1f ms, -> tcc ended %.1f ms, dlopen + init "
                 "%.2f ms\n"
               : "  phases, p50 of each: check (parse + SHA-256) %.2f ms, cache files %.2f ms, "
                 "tcc started -> translation (in process, feeding tcc) ended %.1f ms, "
                 "-> tcc ended %.1f ms, dlopen + init %.2f ms\n",
           pct(ph[PH_CHECK], (size_t)n, 0.5), pct(ph[PH_FILES], (size_t)n, 0.5),
           pct(ph[PH_W2C], (size_t)n, 0.5), pct(ph[PH_CC], (size_t)n, 0.5),
           pct(ph[PH_OPEN], (size_t)n, 0.5));
    for (int k = 0; k < PH_N; k++) free(ph[k]);
    free(cpu);
    lc_wasm_module *m;
    pie_status st;
    if (!g_tier0_wasm2c) goto tier1; /* the tools below are wasm2c's pipeline */

    /* The two tools alone, one after the other, on the last module's files (the runtime runs
     * them as a pipeline, wasm2c | tcc; the C name is the runtime's, "w" + 24 hex digits of the
     * id, so that the glue in wasm.h matches). */
    if (lc_wasm_module_load(rt, b, make_unique(b, len, (uint64_t)n), &m, &st) != PIE_OK)
        die("load big", &st);
    char cmd[1024];
    double w[5], c[5], first[5];
    for (int i = 0; i < 5; i++) {
        /* wasm2c reads and validates the whole module before it writes its first byte: until
         * then the compiler behind it in the pipeline has nothing to do */
        snprintf(cmd, sizeof cmd, "cd %s/%s && exec wasm2c module.wasm -n w%.24s", cache_dir,
                 lc_wasm_module_id(m), lc_wasm_module_id(m));
        double t0 = now_ms();
        FILE *p = popen(cmd, "r");
        if (p == NULL || fgetc(p) == EOF) die("wasm2c (popen)", NULL);
        first[i] = now_ms() - t0;
        while (fgetc(p) != EOF) {}
        if (pclose(p) != 0) die("wasm2c (popen)", NULL);
        t0 = now_ms();
        snprintf(cmd, sizeof cmd, "cd %s/%s && wasm2c module.wasm -n w%.24s > /tmp/bench_wasm_x.c",
                 cache_dir, lc_wasm_module_id(m), lc_wasm_module_id(m));
        if (system(cmd) != 0) die("wasm2c", NULL);
        w[i] = now_ms() - t0;
        t0 = now_ms();
        snprintf(cmd, sizeof cmd,
                 "cd %s/%s && tcc -shared -fPIC -I. -o /tmp/bench_wasm_x.so -include t0.h "
                 "/tmp/bench_wasm_x.c -lm",
                 cache_dir, lc_wasm_module_id(m));
        if (system(cmd) != 0) die("tcc", NULL);
        c[i] = now_ms() - t0;
    }
    unlink("/tmp/bench_wasm_x.c");
    unlink("/tmp/bench_wasm_x.so");
    printf("  the tools alone, one after the other (via system(), incl. a shell each): wasm2c "
           "p50 %.1f ms (its first byte of C after %.1f ms), tcc p50 %.1f ms\n",
           pct(w, 5, 0.5), pct(first, 5, 0.5), pct(c, 5, 0.5));
    lc_wasm_module_release(m);
tier1:
    lc_wasm_rt_destroy(rt);

    if (!tier1) {
        free(t);
        free(b);
        return;
    }
    /* Tier 1 of the same module, for reference. */
    rt = make_rt(true);
    double t0 = now_ms();
    if (lc_wasm_module_load(rt, b, make_unique(b, len, 1u << 30), &m, &st) != PIE_OK)
        die("load big", &st);
    if (lc_wasm_module_wait_tier1(m, 600000, &st) != PIE_OK) die("tier 1", &st);
    printf("  tier 1 (cc -O2) of the same module ready %.0f ms after the load began\n",
           now_ms() - t0);
    lc_wasm_module_release(m);
    lc_wasm_rt_destroy(rt);
    free(t);
    free(b);
}

/* ---- warm
 * ---------------------------------------------------------------------------------------- */

static void bench_warm(int n) {
    size_t len;
    uint8_t *b = read_fixture("trivial", &len);
    lc_wasm_rt *rt = make_rt(true);
    lc_wasm_module *m;
    pie_status st;
    if (lc_wasm_module_load(rt, b, len, &m, &st) != PIE_OK) die("load trivial", &st);
    double *t = calloc((size_t)n, sizeof *t), *u = calloc((size_t)n, sizeof *u);
    const char *argv[] = {"trivial"};
    for (int tier = 0; tier < 2; tier++) {
        if (tier == 1 && lc_wasm_module_wait_tier1(m, 600000, &st) != PIE_OK) die("tier 1", &st);
        for (int i = 0; i < 20; i++) run_once(m, argv, 1, NULL);
        for (int i = 0; i < n; i++) {
            double t0 = now_ms();
            run_once(m, argv, 1, NULL);
            t[i] = (now_ms() - t0) * 1e3;
            t0 = now_ms();
            lc_wasm_module *again;
            if (lc_wasm_module_load(rt, b, len, &again, &st) != PIE_OK) die("load", &st);
            run_once(again, argv, 1, NULL);
            lc_wasm_module_release(again);
            u[i] = (now_ms() - t0) * 1e3;
        }
        printf(
            "warm create+run+free of a trivial module, tier %d, %d runs: p50 %.1f us, p99 %.1f us;"
            " with module_load (hash+memory hit): p50 %.1f us\n",
            tier, n, pct(t, (size_t)n, 0.5), pct(t, (size_t)n, 0.99), pct(u, (size_t)n, 0.5));
    }
    lc_wasm_module_release(m);
    lc_wasm_rt_destroy(rt);
    free(t);
    free(u);
    free(b);
}

/* ---- host calls
 * ---------------------------------------------------------------------------------- */

static void bench_calls(long n) {
    size_t len;
    uint8_t *b = read_fixture("host_calls", &len);
    lc_wasm_rt *rt = make_rt(true);
    lc_wasm_module *m;
    pie_status st;
    if (lc_wasm_module_load(rt, b, len, &m, &st) != PIE_OK) die("load host_calls", &st);
    char count[32];
    snprintf(count, sizeof count, "%ld", n);
    const char *none[] = {"host_calls", "calls", "0"}, *many[] = {"host_calls", "calls", count};
    for (int tier = 0; tier < 2; tier++) {
        if (tier == 1 && lc_wasm_module_wait_tier1(m, 600000, &st) != PIE_OK) die("tier 1", &st);
        double base[5], full[5];
        for (int i = 0; i < 5; i++) {
            double t0 = now_ms();
            run_once(m, none, 3, NULL);
            base[i] = now_ms() - t0;
            t0 = now_ms();
            run_once(m, many, 3, NULL);
            full[i] = now_ms() - t0;
        }
        double ns = (pct(full, 5, 0.5) - pct(base, 5, 0.5)) * 1e6 / (double)n;
        printf(
            "host call round trip (wasm -> pie.test_add -> wasm), tier %d, %ld calls: %.1f ns per "
            "call (incl. the wasm loop around it)\n",
            tier, n, ns);
    }
    lc_wasm_module_release(m);
    lc_wasm_rt_destroy(rt);
    free(b);
}

/* ---- many concurrent instances
 * -------------------------------------------------------------------- */

typedef struct many_arg {
    lc_wasm_module *m;
    park_ctx *park;
} many_arg;

static void *many_thread(void *arg) {
    many_arg *a = arg;
    const char *argv[] = {"host_calls", "park"};
    run_once(a->m, argv, 2, a->park);
    return NULL;
}

static void bench_many(int n, size_t stack_kib) {
    size_t len;
    uint8_t *b = read_fixture("host_calls", &len);
    lc_wasm_rt *rt = make_rt(false);
    lc_wasm_module *m;
    pie_status st;
    if (lc_wasm_module_load(rt, b, len, &m, &st) != PIE_OK) die("load host_calls", &st);
    park_ctx park = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    many_arg a = {m, &park};
    pthread_t *t = calloc((size_t)n, sizeof *t);
    pthread_attr_t attr;
    if (lc_wasm_thread_attr_init(&attr, stack_kib * 1024) != 0) die("thread attr", NULL);
    long rss0 = rss_kib();
    double t0 = now_ms();
    for (int i = 0; i < n; i++)
        if (pthread_create(&t[i], &attr, many_thread, &a) != 0) die("pthread_create", NULL);
    double spawned = now_ms() - t0;
    pthread_mutex_lock(&park.mu);
    while (park.parked < n) pthread_cond_wait(&park.cv, &park.mu);
    pthread_mutex_unlock(&park.mu);
    double running = now_ms() - t0;
    usleep(200000);
    long rss1 = rss_kib();
    double t1 = now_ms();
    pthread_mutex_lock(&park.mu);
    park.released = true;
    pthread_cond_broadcast(&park.cv);
    pthread_mutex_unlock(&park.mu);
    for (int i = 0; i < n; i++) pthread_join(t[i], NULL);
    double finished = now_ms() - t1;
    long rss2 = rss_kib();
    printf("%d concurrent instances, one thread each (%zu KiB stacks): all created in %.0f ms, all "
           "running (parked in a host call) after %.0f ms; finished %.0f ms after release\n",
           n, stack_kib, spawned, running, finished);
    printf("  resident memory: %ld MiB before, %ld MiB with all idle (%.0f KiB per idle instance), "
           "%ld MiB after they ended\n",
           rss0 / 1024, rss1 / 1024, (double)(rss1 - rss0) / n, rss2 / 1024);
    pthread_attr_destroy(&attr);
    free(t);
    lc_wasm_module_release(m);
    lc_wasm_rt_destroy(rt);
    free(b);
}

int main(int argc, char **argv) {
    int cold = 20, warm = 2000, instances = 512, tier1 = 1;
    long calls = 10000000;
    size_t stack_kib = 8192;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--tier0") == 0) {
            g_tier0_wasm2c = strcmp(argv[i + 1], "wasm2c") == 0;
            continue;
        }
        if (strcmp(argv[i], "--helper") == 0)
            g_tcc_helper = argv[i + 1];
        else if (strcmp(argv[i], "--cold") == 0)
            cold = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--warm") == 0)
            warm = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--calls") == 0)
            calls = atol(argv[i + 1]);
        else if (strcmp(argv[i], "--instances") == 0)
            instances = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--stack-kib") == 0)
            stack_kib = (size_t)atol(argv[i + 1]);
        else if (strcmp(argv[i], "--tier1") == 0)
            tier1 = atoi(argv[i + 1]);
        else {
            fprintf(stderr, "usage: bench_wasm [--tier0 own|wasm2c] [--helper PATH] [--cold N] "
                            "[--warm N] [--calls N] [--instances N] [--stack-kib N] "
                            "[--tier1 0|1]\n");
            return 2;
        }
    }
    snprintf(cache_dir, sizeof cache_dir, "/tmp/bench_wasm.XXXXXX");
    if (mkdtemp(cache_dir) == NULL) die("mkdtemp", NULL);
    if (cold > 0) bench_cold("big", cold, tier1 != 0);
    if (cold > 0) bench_cold("big_dwarf", cold, tier1 != 0);
    if (warm > 0) bench_warm(warm);
    if (calls > 0) bench_calls(calls);
    if (instances > 0) bench_many(instances, stack_kib);
    nftw(cache_dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    return 0;
}
