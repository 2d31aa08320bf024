/* test_lc_wasm.c — the WebAssembly inferlet runtime (services/lifecycle/wasm): what lc_wasm.h
 * promises, with real modules (tests/wasm/<name>.c compiled by clang for wasm32-wasi) translated by
 * wasm2c, compiled by tcc / cc and run.
 *
 * Each test runs in its own process (Criterion's default) with its own cache directory. This
 * executable exports the test host functions of tests/wasm/wasm_test_host.c (ENABLE_EXPORTS,
 * tests/wasm/CMakeLists.txt). Under ASan the fault handler of lc_wasm chains to
 * ASan's for faults that are not the instance's, and LeakSanitizer checks at the exit of every
 * test that instances, modules and runtimes free everything. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "lc_wasm.h"
#include "pie_sha256.h"
#include "pie_wasmgen.h"
#include "test_wasm_util.h"
#include "wasm_test_host.h"

/* ---- fixtures -------------------------------------------------------------------------------- */

TestSuite(lc_wasm, .init = wt_setup, .fini = wt_teardown, .timeout = 240);

static lc_wasm_rt *make_rt(bool tier1) {
    lc_wasm_rt_opts o = {.cache_dir = wt_dir,
                         .host_fns = wasm_test_host_fns,
                         .n_host_fns = wasm_test_host_n_fns,
                         .tier1 = tier1};
    lc_wasm_rt *rt = NULL;
    pie_status st;
    cr_assert_eq(lc_wasm_rt_create(&o, &rt, &st), PIE_OK, "rt_create: %s", st.msg);
    return rt;
}

static lc_wasm_module *load(lc_wasm_rt *rt, const char *name) {
    wt_bytes b = wt_fixture(name);
    lc_wasm_module *m = NULL;
    pie_status st;
    cr_assert_eq(lc_wasm_module_load(rt, b.data, b.len, &m, &st), PIE_OK, "load %s: %s", name,
                 st.msg);
    free(b.data);
    return m;
}

/* What an instance wrote. */
typedef struct capture {
    pthread_mutex_t mu;
    char out[8192], err[8192];
    size_t n_out, n_err;
} capture;

static void on_output(void *ctx, int fd, const char *data, size_t len) {
    capture *c = ctx;
    pthread_mutex_lock(&c->mu);
    char *buf = fd == 1 ? c->out : c->err;
    size_t *n = fd == 1 ? &c->n_out : &c->n_err;
    size_t take = len < sizeof c->out - 1 - *n ? len : sizeof c->out - 1 - *n;
    memcpy(buf + *n, data, take);
    *n += take;
    buf[*n] = '\0';
    pthread_mutex_unlock(&c->mu);
}

typedef struct run_spec {
    lc_wasm_module *mod;
    const char *argv[8]; /* NULL-terminated */
    const char *env[4];
    lc_wasm_limits limits;
    park_ctx *park;
    capture cap;
    lc_wasm_outcome out;
    lc_wasm_instance *inst; /* set while it exists (for interrupt from the test) */
    pthread_mutex_t inst_mu;
} run_spec;

static size_t count(const char *const *v) {
    size_t n = 0;
    while (v[n] != NULL) n++;
    return n;
}

/* A spec running m with the NULL-terminated arguments that follow (argv[0] first). */
static void spec_init(run_spec *s, lc_wasm_module *m, ...) {
    memset(s, 0, sizeof *s);
    s->mod = m;
    va_list ap;
    va_start(ap, m);
    for (size_t i = 0; i < sizeof s->argv / sizeof s->argv[0] - 1; i++)
        if ((s->argv[i] = va_arg(ap, const char *)) == NULL) break;
    va_end(ap);
    pthread_mutex_init(&s->cap.mu, NULL);
    pthread_mutex_init(&s->inst_mu, NULL);
}

static void spec_destroy(run_spec *s) {
    pthread_mutex_destroy(&s->cap.mu);
    pthread_mutex_destroy(&s->inst_mu);
}

/* Creates, runs and frees one instance on the calling thread. */
static void run_spec_now(run_spec *s) {
    lc_wasm_instance_opts o = {.argv = s->argv,
                               .argc = count(s->argv),
                               .env = s->env,
                               .n_env = count(s->env),
                               .limits = s->limits,
                               .output = on_output,
                               .output_ctx = &s->cap,
                               .host = s->park,
                               .on_interrupt = s->park ? park_wake : NULL};
    lc_wasm_instance *inst = NULL;
    pie_status st;
    cr_assert_eq(lc_wasm_instance_create(s->mod, &o, &inst, &st), PIE_OK, "create: %s", st.msg);
    pthread_mutex_lock(&s->inst_mu);
    s->inst = inst;
    pthread_mutex_unlock(&s->inst_mu);
    pie_code rc = lc_wasm_instance_run(inst, &s->out, &st);
    pthread_mutex_lock(&s->inst_mu);
    s->inst = NULL;
    pthread_mutex_unlock(&s->inst_mu);
    lc_wasm_instance_free(inst);
    cr_assert_eq(rc, PIE_OK, "run: %s", st.msg);
}

static void *run_thread(void *arg) {
    run_spec_now(arg);
    return NULL;
}

static pthread_t start_thread(run_spec *s, size_t stack) {
    pthread_attr_t a;
    cr_assert_eq(lc_wasm_thread_attr_init(&a, stack), 0);
    pthread_t t;
    cr_assert_eq(pthread_create(&t, &a, run_thread, s), 0);
    pthread_attr_destroy(&a);
    return t;
}

static void expect_trap(lc_wasm_rt *rt, const char *mode, lc_wasm_trap trap, const char *text) {
    lc_wasm_module *m = load(rt, "hostile");
    run_spec s;
    spec_init(&s, m, "hostile", mode, NULL);
    run_spec_now(&s);
    cr_expect_eq(s.out.end, LC_WASM_TRAPPED, "%s: ended %d: %s", mode, s.out.end, s.out.message);
    cr_expect_eq(s.out.trap, trap, "%s: trap %d, expected %d (%s)", mode, s.out.trap, trap,
                 s.out.message);
    cr_expect(strstr(s.out.message, text) != NULL, "%s: message \"%s\" lacks \"%s\"", mode,
              s.out.message, text);
    spec_destroy(&s);
    lc_wasm_module_release(m);
}

static uint64_t lcg(uint64_t n) {
    uint64_t x = 1;
    for (uint64_t i = 0; i < n; i++) x = x * 6364136223846793005ull + 1442695040888963407ull;
    return x;
}

/* Number of 8 GiB mappings (linear memory reservations) in this process. */
static int reservations(void) {
    FILE *f = fopen("/proc/self/maps", "r");
    cr_assert_not_null(f);
    char line[512];
    int n = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx", &lo, &hi) == 2 && hi - lo == (8ul << 30)) n++;
    }
    fclose(f);
    return n;
}

/* ---- tests ---------------------------------------------------------------------------------- */

/* Program ids and cache keys are pie_sha256_hex of the bytes (services/common). */
Test(lc_wasm, content_id_is_sha256_of_fips_180_vectors) {
    static const struct {
        const char *msg, *hex;
    } v[] = {
        {"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
        {"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"},
        {"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
         "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"},
    };
    char hex[65];
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        cr_assert_eq(pie_sha256_hex(v[i].msg, strlen(v[i].msg), hex, NULL), PIE_OK);
        cr_expect_str_eq(hex, v[i].hex, "sha256(\"%s\")", v[i].msg);
    }
}

Test(lc_wasm, hello_world_prints_args_env_and_calls_the_host) {
    lc_wasm_rt *rt = make_rt(false);
    lc_wasm_module *m = load(rt, "hello");
    cr_expect_eq(strlen(lc_wasm_module_id(m)), 64u);
    run_spec s;
    spec_init(&s, m, "hello", "pie", "0", NULL);
    s.env[0] = "PIE_GREETING=hi";
    run_spec_now(&s);
    cr_expect_eq(s.out.end, LC_WASM_EXITED, "%s", s.out.message);
    cr_expect_eq(s.out.exit_code, 0);
    cr_expect_str_eq(s.out.message, "exited with code 0");
    cr_expect_str_eq(s.cap.out, "hello, pie!\nargc=3 [hello] [pie] [0]\n40+2=42\nenv=hi\n");
    cr_expect_str_eq(s.cap.err, "to stderr\n");
    cr_expect_eq(s.out.tier, 0);
    cr_expect_gt(s.out.memory_pages, 0u);
    spec_destroy(&s);
    lc_wasm_module_release(m);
    lc_wasm_rt_destroy(rt);
}

Test(lc_wasm, exit_code_from_main_and_from_proc_exit) {
    lc_wasm_rt *rt = make_rt(false);
    lc_wasm_module *m = load(rt, "hello");
    run_spec s;
    spec_init(&s, m, "hello", "x", "3", NULL);
    run_spec_now(&s);
    cr_expect_eq(s.out.end, LC_WASM_EXITED);
    cr_expect_eq(s.out.exit_code, 3, "%s", s.out.message);
    cr_expect_str_eq(s.out.message, "exited with code 3");
    spec_destroy(&s);
    lc_wasm_module_release(m);

    m = load(rt, "hostile");
    spec_init(&s, m, "hostile", "exit", "9", NULL);
    run_spec_now(&s);
    cr_expect_eq(s.out.end, LC_WASM_EXITED, "%s", s.out.message);
    cr_expect_eq(s.out.exit_code, 9);
    spec_destroy(&s);
    lc_wasm_module_release(m);
    lc_wasm_rt_destroy(rt);
}

Test(lc_wasm, out_of_bounds_access_traps_only_that_instance) {
    lc_wasm_rt *rt = make_rt(false);
    lc_wasm_module *m = load(rt, "hostile");
    run_spec worker;
    spec_init(&worker, m, "hostile", "work", "30000000", NULL);
    pthread_t t = start_thread(&worker, 0);

    const char *modes[] = {"oob-read", "oob-write"};
    for (int i = 0; i < 2; i++) {
        run_spec s;
        spec_init(&s, m, "hostile", modes[i], NULL);
        pthread_t u = start_thread(&s, 0);
        pthread_join(u, NULL);
        cr_expect_eq(s.out.end, LC_WASM_TRAPPED, "%s: %s", modes[i], s.out.message);
        cr_expect_eq(s.out.trap, LC_WASM_TRAP_OOB, "%s: %s", modes[i], s.out.message);
        cr_expect_str_eq(s.out.message, "trapped: out-of-bounds memory or table access");
        spec_destroy(&s);
    }
    pthread_join(t, NULL);
    char want[64];
    snprintf(want, sizeof want, "work=%llu\n", (unsigned long long)lcg(30000000));
    cr_expect_eq(worker.out.end, LC_WASM_EXITED, "%s", worker.out.message);
    cr_expect_str_eq(worker.cap.out, want);
    spec_destroy(&worker);
    lc_wasm_module_release(m);
    lc_wasm_rt_destroy(rt);
}

Test(lc_wasm, infinite_loop_is_interrupted_within_cpu_quota) {
    lc_wasm_rt *rt = make_rt(false);
    lc_wasm_module *m = load(rt, "hostile");
    run_spec s;
    spec_init(&s, m, "hostile", "loop", NULL);
    s.limits.cpu_ms = 200;
    pthread_t t = start_thread(&s, 0);
    pthread_join(t, NULL);
    cr_expect_eq(s.out.end, LC_WASM_INTERRUPTED, "%s", s.out.message);
    cr_expect_eq(s.out.trap, LC_WASM_TRAP_CPU_TIME);
    cr_expect_str_eq(s.out.message, "interrupted: CPU time quota of 200 ms used up");
    /* The usage reported covers the quota. No upper bound: how soon the watchdog stops the
     * loop is a matter for bench/; a watchdog that never fires hangs the test into its timeout. */
    cr_expect_geq(s.out.cpu_ns, 200000000u, "stopped after %llu ns of CPU",
                  (unsigned long long)s.out.cpu_ns);
    spec_destroy(&s);
    lc_wasm_module_release(m);
    lc_wasm_rt_destroy(rt);
}

Test(lc_wasm, wall_time_quota_interrupts_a_loop_and_a_sleep) {
    lc_wasm_rt *rt = make_rt(false);
    lc_wasm_module *m = load(rt, "hostile");
    const char *modes[] = {"loop", "sleep"};
    for (int i = 0; i < 2; i++) {
        run_spec s;
        spec_init(&s, m, "hostile", modes[i], NULL);
        s.limits.wall_ms = 20;
        run_spec_now(&s);
        cr_expect_eq(s.out.end, LC_WASM_INTERRUPTED, "%s: %s", modes[i], s.out.message);
        cr_expect_eq(s.out.trap, LC_WASM_TRAP_WALL_TIME, "%s: %s", modes[i], s.out.message);
        cr_expect_str_eq(s.cap.out, "", "%s printed \"%s\"", modes[i], s.cap.out);
        spec_destroy(&s);
    }
    /* Without a quota the sleep (poll_oneoff) completes. */
    run_spec s;
    spec_init(&s, m, "hostile", "sleep", NULL);
    run_spec_now(&s);
    cr_expect_eq(s.out.end, LC_WASM_EXITED, "%s", s.out.message);
    cr_expect_str_eq(s.cap.out, "slept\n");
    cr_expect_geq(s.out.wall_ns, 50000000u);
    spec_destroy(&s);
    lc_wasm_module_release(m);
    lc_wasm_rt_destroy(rt);
}

Test(lc_wasm, terminate_stops_running_and_parked_instances) {
    lc_wasm_rt *rt = make_rt(false);
    lc_wasm_module *loop = load(rt, "hostile"), *park = load(rt, "host_calls");
    park_ctx p = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    run_spec a, b;
    spec_init(&a, loop, "hostile", "loop", NULL);
    spec_init(&b, park, "host_calls", "park", NULL);
    b.park = &p;
    pthread_t ta = start_thread(&a, 0), tb = start_thread(&b, 0);
    pthread_mutex_lock(&p.mu);
    while (p.parked == 0) pthread_cond_wait(&p.cv, &p.mu);
    pthread_mutex_unlock(&p.mu);
    run_spec *specs[] = {&a, &b};
    for (int i = 0; i < 2; i++) {
        /* The loop instance may not have been created yet: retry until it exists. */
        for (;;) {
            pthread_mutex_lock(&specs[i]->inst_mu);
            lc_wasm_instance *inst = specs[i]->inst;
            if (inst) lc_wasm_instance_interrupt(inst);
            pthread_mutex_unlock(&specs[i]->inst_mu);
            if (inst) break;
            usleep(1000);
        }
    }
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    for (int i = 0; i < 2; i++) {
        cr_expect_eq(specs[i]->out.end, LC_WASM_INTERRUPTED, "%s", specs[i]->out.message);
        cr_expect_eq(specs[i]->out.trap, LC_WASM_TRAP_TERMINATED);
        cr_expect_str_eq(specs[i]->out.message, "interrupted: terminated on request");
    }
    cr_expect_str_eq(b.cap.out, "");
    spec_destroy(&a);
    spec_destroy(&b);
    lc_wasm_module_release(loop);
    lc_wasm_module_release(park);
    lc_wasm_rt_destroy(rt);
}

Test(lc_wasm, deep_recursion_traps_with_stack_exhaustion) {
    lc_wasm_rt *rt = make_rt(false);
    lc_wasm_module *m = load(rt, "hostile");
    size_t stacks[] = {1u << 20, 8u << 20};
    for (int i = 0; i < 2; i++) {
        run_spec s;
        spec_init(&s, m, "hostile", "recurse", NULL);
        pthread_t t = start_thread(&s, stacks[i]);
        pthread_join(t, NULL);
        cr_expect_eq(s.out.end, LC_WASM_TRAPPED, "%s", s.out.message);
        cr_expect_eq(s.out.trap, LC_WASM_TRAP_EXHAUSTION, "%s", s.out.message);
        cr_expect_str_eq(s.out.message, "trapped: call stack exhausted (recursion too deep)");
        spec_destroy(&s);
    }
    /* And on the main thread, whose guard is the kernel's stack gap. */
    expect_trap(rt, "recurse", LC_WASM_TRAP_EXHAUSTION, "call stack exhausted");
    lc_wasm_module_release(m);
    lc_wasm_rt_destroy(rt);
}

Test(lc_wasm, arithmetic_and_control_traps_name_their_reason) {
    lc_wasm_rt *rt = make_rt(false);
    expect_trap(rt, "div0", LC_WASM_TRAP_DIV_BY_ZERO, "trapped: integer divide by zero");
    expect_trap(rt, "overflow", LC_WASM_TRAP_INT_OVERFLOW, "trapped: integer overflow");
    expect_trap(rt, "convert", LC_WASM_TRAP_INVALID_CONVERSION, "trapped: invalid conversion");
    expect_trap(rt, "unreachable", LC_WASM_TRAP_UNREACHABLE, "trapped: unreachable instruction");
    expect_trap(rt, "indirect", LC_WASM_TRAP_CALL_INDIRECT, "trapped: indirect call");
    lc_wasm_rt_destroy(rt);
}

Test(lc_wasm, memory_grow_beyond_the_instance_limit_returns_minus_one) {
    lc_wasm_rt *rt = make_rt(false);
    lc_wasm_module *m = load(rt, "hostile");
    run_spec s;
    spec_init(&s, m, "hostile", "grow", "1000", NULL);
    s.limits.max_memory_pages = 64;
    run_spec_now(&s);
    cr_expect_eq(s.out.end, LC_WASM_EXITED, "%s", s.out.message);
    cr_expect_str_eq(s.cap.out, "grow=-1\n");
    cr_expect_eq(s.out.memory_refusals, 1u);
    cr_expect(strstr(s.out.message, "memory.grow refused 1 time at the instance limit of 64 pages "
                                    "(4 MiB)") != NULL,
              "%s", s.out.message);
    spec_destroy(&s);

    spec_init(&s, m, "hostile", "grow", "10", NULL);
    s.limits.max_memory_pages = 64;
    run_spec_now(&s);
    cr_expect_eq(s.out.memory_refusals, 0u);
    cr_expect_str_neq(s.cap.out, "grow=-1\n");
    cr_expect_str_eq(s.out.message, "exited with code 0");
    spec_destroy(&s);
    lc_wasm_module_release(m);
    lc_wasm_rt_destroy(rt);
}

Test(lc_wasm, allocation_storm_ends_with_a_clear_error) {
    lc_wasm_rt *rt = make_rt(false);
    lc_wasm_module *m = load(rt, "hostile");
    run_spec s;
    spec_init(&s, m, "hostile", "storm", NULL);
    s.limits.max_memory_pages = 256;
    run_spec_now(&s);
    cr_expect_eq(s.out.end, LC_WASM_TRAPPED, "%s", s.out.message);
    cr_expect_eq(s.out.trap, LC_WASM_TRAP_UNREACHABLE);
    cr_expect(strstr(s.cap.err, "malloc failed after") != NULL, "stderr: %s", s.cap.err);
    cr_expect(strstr(s.out.message, "at the instance limit of 256 pages (16 MiB)") != NULL, "%s",
              s.out.message);
    cr_expect_leq(s.out.memory_pages, 256u);
    spec_destroy(&s);
    lc_wasm_module_release(m);
    lc_wasm_rt_destroy(rt);
}

Test(lc_wasm, host_function_can_end_the_instance_with_a_message) {
    lc_wasm_rt *rt = make_rt(false);
    lc_wasm_module *m = load(rt, "host_calls");
    run_spec s;
    spec_init(&s, m, "host_calls", "fail", NULL);
    run_spec_now(&s);
    cr_expect_eq(s.out.end, LC_WASM_TRAPPED);
    cr_expect_eq(s.out.trap, LC_WASM_TRAP_HOST);
    cr_expect_str_eq(s.out.message, "trapped: test_fail(17) ended the instance");
    cr_expect_str_eq(s.cap.out, "");
    spec_destroy(&s);
    lc_wasm_module_release(m);
    lc_wasm_rt_destroy(rt);
}

static void expect_rejected(lc_wasm_rt *rt, const uint8_t *b, size_t n, const char *text) {
    lc_wasm_module *m = NULL;
    pie_status st;
    pie_code rc = lc_wasm_module_load(rt, b, n, &m, &st);
    cr_expect_eq(rc, PIE_INVALID_ARGUMENT, "expected a rejection containing \"%s\", got %s: %s",
                 text, pie_code_name(rc), st.msg);
    cr_expect_null(m);
    cr_expect(strstr(st.msg, text) != NULL, "message \"%s\" lacks \"%s\"", st.msg, text);
    if (m) lc_wasm_module_release(m);
}

Test(lc_wasm, corrupt_and_non_wasm_bytes_are_rejected_with_a_reason) {
    lc_wasm_rt *rt = make_rt(false);
    const char *script = "#!/bin/sh\necho hi\n";
    expect_rejected(rt, (const uint8_t *)script, strlen(script),
                    "not a WebAssembly module: it starts with bytes 23 21 2f 62");
    expect_rejected(rt, (const uint8_t *)"", 0, "too short for the 8-byte header");
    const uint8_t v2[] = {0, 'a', 's', 'm', 2, 0, 0, 0};
    expect_rejected(rt, v2, sizeof v2, "unsupported WebAssembly binary version 2");
    const uint8_t no_code[] = {0, 'a', 's', 'm', 1, 0, 0, 0};
    expect_rejected(rt, no_code, sizeof no_code, "exports no function \"_start\"");

    wt_bytes b = wt_fixture("hello");
    expect_rejected(rt, b.data, 200, "declares");
    /* Garbage in the middle of the code section: only wasm2c's validation can tell. */
    size_t at = b.len / 2;
    memset(b.data + at, 0xff, 64);
    expect_rejected(rt, b.data, b.len, "invalid wasm module");
    free(b.data);
    /* Valid wasm that wasm2c 1.0.32 cannot translate (it aborts). */
    b = wt_fixture("simd");
    expect_rejected(rt, b.data, b.len,
                    "unsupported wasm module: wasm2c (translate to C) aborted, SIGABRT (signal 6");
    expect_rejected(rt, b.data, b.len, "; SIMD (-msimd128)");
    free(b.data);
    lc_wasm_rt_stats s = lc_wasm_rt_stats_get(rt);
    cr_expect_eq(s.tier0_compiles, 0u);
    lc_wasm_rt_destroy(rt);
}

/* (module (type (func (param i64) (result i32))) (type (func))
 *   (import "pie" "test_add" (func (type 0))) (func (type 1)) (export "_start" (func 1))) */
static const uint8_t wrong_type_import[] = {
    0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00,                         /* header */
    0x01, 0x09, 0x02, 0x60, 0x01, 0x7e, 0x01, 0x7f, 0x60, 0x00, 0x00,       /* types */
    0x02, 0x10, 0x01, 0x03, 'p',  'i',  'e',  0x08, 't',  'e',  's',  't',  /* imports */
    '_',  'a',  'd',  'd',  0x00, 0x00,                                     /*   ... */
    0x03, 0x02, 0x01, 0x01,                                                 /* functions */
    0x07, 0x0a, 0x01, 0x06, '_',  's',  't',  'a',  'r',  't',  0x00, 0x01, /* exports */
    0x0a, 0x04, 0x01, 0x02, 0x00, 0x0b,                                     /* code */
};

Test(lc_wasm, imports_the_host_does_not_provide_are_rejected_by_name) {
    lc_wasm_rt *rt = make_rt(false);
    wt_bytes b = wt_fixture("unknown_import");
    expect_rejected(rt, b.data, b.len, "module imports 2 functions the host does not provide");
    expect_rejected(rt, b.data, b.len, "pie.no_such_function (param i32) (result i32)");
    expect_rejected(rt, b.data, b.len, "env.mystery (no parameters or results)");
    free(b.data);
    expect_rejected(rt, wrong_type_import, sizeof wrong_type_import,
                    "pie.test_add with type (param i64) (result i32) (the host's has type "
                    "(param i32 i32) (result i32))");
    lc_wasm_rt_destroy(rt);
}

static void local_add(void) {}

Test(lc_wasm, runtime_checks_the_host_functions_it_is_given) {
    lc_wasm_rt *rt = NULL;
    pie_status st;
    lc_wasm_host_fn bad_type[] = {{"test_add", "(param i32,i32)", (void (*)(void))Z_pieZ_test_add}};
    lc_wasm_rt_opts o = {.cache_dir = wt_dir, .host_fns = bad_type, .n_host_fns = 1};
    cr_expect_eq(lc_wasm_rt_create(&o, &rt, &st), PIE_INVALID_ARGUMENT);
    cr_expect(strstr(st.msg, "is not canonical WAT") != NULL, "%s", st.msg);
    lc_wasm_host_fn not_exported[] = {{"test_add", "(param i32 i32) (result i32)", local_add}};
    o.host_fns = not_exported;
    cr_expect_eq(lc_wasm_rt_create(&o, &rt, &st), PIE_FAILED_PRECONDITION);
    cr_expect(strstr(st.msg, "does not export Z_pieZ_test_add as the given function") != NULL, "%s",
              st.msg);
    cr_expect_null(rt);
}

typedef struct guard_run {
    lc_wasm_instance *inst;
    pie_code rc;
    pie_status st;
    lc_wasm_outcome out;
} guard_run;

static void *guard_thread(void *arg) {
    guard_run *g = arg;
    g->rc = lc_wasm_instance_run(g->inst, &g->out, &g->st);
    return NULL;
}

Test(lc_wasm, thread_with_a_small_stack_guard_is_refused) {
    lc_wasm_rt *rt = make_rt(false);
    lc_wasm_module *m = load(rt, "trivial");
    guard_run g = {0};
    cr_assert_eq(lc_wasm_instance_create(m, NULL, &g.inst, &g.st), PIE_OK);
    pthread_attr_t a;
    cr_assert_eq(pthread_attr_init(&a), 0);
    cr_assert_eq(pthread_attr_setguardsize(&a, 4096), 0);
    pthread_t t;
    cr_assert_eq(pthread_create(&t, &a, guard_thread, &g), 0);
    pthread_join(t, NULL);
    pthread_attr_destroy(&a);
    cr_expect_eq(g.rc, PIE_FAILED_PRECONDITION, "%s", g.st.msg);
    cr_expect(strstr(g.st.msg, "stack guard is 4096 bytes") != NULL, "%s", g.st.msg);
    /* The instance did not run and can still run on a suitable thread (this main thread). */
    cr_expect_eq(lc_wasm_instance_run(g.inst, &g.out, &g.st), PIE_OK, "%s", g.st.msg);
    cr_expect_eq(g.out.end, LC_WASM_EXITED);
    cr_expect_eq(lc_wasm_instance_run(g.inst, &g.out, &g.st), PIE_FAILED_PRECONDITION);
    lc_wasm_instance_free(g.inst);
    lc_wasm_module_release(m);
    lc_wasm_rt_destroy(rt);
}

Test(lc_wasm, tier0_first_then_tier1_for_later_instances) {
    lc_wasm_rt *rt = make_rt(true);
    lc_wasm_module *m = load(rt, "hello");
    cr_expect_eq(lc_wasm_module_tier(m), 0);
    lc_wasm_instance *early = NULL;
    pie_status st;
    capture cap_early = {.mu = PTHREAD_MUTEX_INITIALIZER};
    const char *argv[] = {"hello", "early"};
    lc_wasm_instance_opts o = {
        .argv = argv, .argc = 2, .output = on_output, .output_ctx = &cap_early};
    cr_assert_eq(lc_wasm_instance_create(m, &o, &early, &st), PIE_OK);

    cr_assert_eq(lc_wasm_module_wait_tier1(m, 200000, &st), PIE_OK, "%s", st.msg);
    cr_expect_eq(lc_wasm_module_tier(m), 1);
    char t0[1024];
    snprintf(t0, sizeof t0, "%s/%s/t0.so", wt_dir, lc_wasm_module_id(m));
    cr_expect(access(t0, F_OK) != 0, "tier 0's library stayed on disk beside tier 1's");
    run_spec s;
    spec_init(&s, m, "hello", "late", NULL);
    run_spec_now(&s);
    cr_expect_eq(s.out.tier, 1);
    cr_expect(strstr(s.cap.out, "hello, late!\n") == s.cap.out, "%s", s.cap.out);
    spec_destroy(&s);

    /* The instance created before the swap still runs on its tier-0 library. */
    lc_wasm_outcome out;
    cr_assert_eq(lc_wasm_instance_run(early, &out, &st), PIE_OK, "%s", st.msg);
    cr_expect_eq(out.tier, 0);
    cr_expect_eq(out.end, LC_WASM_EXITED);
    cr_expect(strstr(cap_early.out, "hello, early!\n") == cap_early.out, "%s", cap_early.out);
    lc_wasm_instance_free(early);
    lc_wasm_rt_stats stats = lc_wasm_rt_stats_get(rt);
    cr_expect_eq(stats.tier0_compiles, 1u);
    cr_expect_eq(stats.tier1_compiles, 1u);
    lc_wasm_module_release(m);
    lc_wasm_rt_destroy(rt);

    /* A restart finds tier 1 on disk and uses it at once. */
    rt = make_rt(true);
    m = load(rt, "hello");
    cr_expect_eq(lc_wasm_module_tier(m), 1);
    stats = lc_wasm_rt_stats_get(rt);
    cr_expect_eq(stats.disk_hits, 1u);
    cr_expect_eq(stats.translations + stats.tier0_compiles + stats.tier1_compiles, 0u);
    lc_wasm_module_release(m);
    lc_wasm_rt_destroy(rt);
}

Test(lc_wasm, second_load_is_a_cache_hit_in_memory_and_after_restart_on_disk) {
    lc_wasm_rt *rt = make_rt(false);
    lc_wasm_module *a = load(rt, "hello"), *b = load(rt, "hello");
    cr_expect_eq(a, b);
    lc_wasm_rt_stats s = lc_wasm_rt_stats_get(rt);
    cr_expect_eq(s.translations + s.own_translations, 1u);
    cr_expect_eq(s.tier0_compiles, 1u);
    cr_expect_eq(s.memory_hits, 1u);
    /* the compile's phases were timed (the benchmark's breakdown) */
    cr_expect_gt(s.t0_files_ns, 0u);
    cr_expect_gt(s.t0_translate_ns, 0u);
    cr_expect_gt(s.t0_compile_ns, 0u);
    cr_expect_gt(s.t0_open_ns, 0u);
    lc_wasm_module_release(a);
    lc_wasm_module_release(b);
    lc_wasm_rt_destroy(rt);

    rt = make_rt(false);
    a = load(rt, "hello");
    s = lc_wasm_rt_stats_get(rt);
    cr_expect_eq(s.translations + s.own_translations, 0u);
    cr_expect_eq(s.tier0_compiles, 0u);
    cr_expect_eq(s.disk_hits, 1u);
    cr_expect_eq(s.t0_files_ns + s.t0_translate_ns + s.t0_compile_ns + s.t0_open_ns, 0u,
                 "a disk hit counted as a compile");
    run_spec r;
    spec_init(&r, a, "hello", NULL);
    run_spec_now(&r);
    cr_expect_eq(r.out.end, LC_WASM_EXITED, "%s", r.out.message);
    cr_expect(strstr(r.cap.out, "hello, world!\n") == r.cap.out, "%s", r.cap.out);
    spec_destroy(&r);
    lc_wasm_module_release(a);
    lc_wasm_rt_destroy(rt);
}

/* The runtime keeps a module only while someone holds it (the program store decides what stays
 * loaded: programs.max_loaded): before, its table held every module ever loaded, native code
 * mapped, until the runtime ended. */
Test(lc_wasm, a_module_is_unloaded_with_its_last_reference_and_reloads_from_disk) {
    lc_wasm_rt *rt = make_rt(false);
    lc_wasm_module *a = load(rt, "hello");
    lc_wasm_module_release(a);
    lc_wasm_module *b = load(rt, "hello");
    lc_wasm_rt_stats s = lc_wasm_rt_stats_get(rt);
    cr_expect_eq(s.memory_hits, 0u, "a module nobody held stayed loaded");
    cr_expect_eq(s.disk_hits, 1u);
    cr_expect_eq(s.tier0_compiles, 1u, "the native code on disk was compiled again");
    run_spec r;
    spec_init(&r, b, "hello", NULL);
    run_spec_now(&r);
    cr_expect_eq(r.out.end, LC_WASM_EXITED, "%s", r.out.message);
    cr_expect(strstr(r.cap.out, "hello, world!\n") == r.cap.out, "%s", r.cap.out);
    spec_destroy(&r);
    lc_wasm_module_release(b);
    lc_wasm_rt_destroy(rt);
}

typedef struct load_race {
    lc_wasm_rt *rt;
    wt_bytes b;
    lc_wasm_module *m;
    pie_code rc;
} load_race;

static void *load_thread(void *arg) {
    load_race *l = arg;
    pie_status st;
    l->rc = lc_wasm_module_load(l->rt, l->b.data, l->b.len, &l->m, &st);
    return NULL;
}

Test(lc_wasm, concurrent_loads_of_a_new_module_compile_it_once) {
    lc_wasm_rt *rt = make_rt(false);
    wt_bytes b = wt_fixture("hostile");
    load_race l[4];
    pthread_t t[4];
    for (int i = 0; i < 4; i++) {
        l[i] = (load_race){rt, b, NULL, PIE_UNKNOWN};
        cr_assert_eq(pthread_create(&t[i], NULL, load_thread, &l[i]), 0);
    }
    for (int i = 0; i < 4; i++) pthread_join(t[i], NULL);
    for (int i = 0; i < 4; i++) {
        cr_expect_eq(l[i].rc, PIE_OK);
        cr_expect_eq(l[i].m, l[0].m);
    }
    lc_wasm_rt_stats s = lc_wasm_rt_stats_get(rt);
    cr_expect_eq(s.translations + s.own_translations, 1u);
    cr_expect_eq(s.tier0_compiles, 1u);
    cr_expect_eq(s.memory_hits, 3u);
    for (int i = 0; i < 4; i++) lc_wasm_module_release(l[i].m);
    free(b.data);
    lc_wasm_rt_destroy(rt);
}

Test(lc_wasm, eight_instances_on_eight_threads_and_all_memory_returned) {
    lc_wasm_rt *rt = make_rt(false);
    lc_wasm_module *m = load(rt, "hello");
    int before = reservations();
    run_spec s[8];
    pthread_t t[8];
    char names[8][16];
    for (int i = 0; i < 8; i++) {
        snprintf(names[i], sizeof names[i], "thread%d", i);
        spec_init(&s[i], m, "hello", names[i], i % 2 ? "1" : "0", NULL);
        t[i] = start_thread(&s[i], 0);
    }
    for (int i = 0; i < 8; i++) pthread_join(t[i], NULL);
    for (int i = 0; i < 8; i++) {
        char want[64];
        snprintf(want, sizeof want, "hello, %s!\n", names[i]);
        cr_expect(strstr(s[i].cap.out, want) == s[i].cap.out, "%d: %s", i, s[i].cap.out);
        cr_expect_eq(s[i].out.end, LC_WASM_EXITED);
        cr_expect_eq(s[i].out.exit_code, i % 2);
        spec_destroy(&s[i]);
    }
    cr_expect_eq(reservations(), before, "linear memory reservations left mapped");
    lc_wasm_module_release(m);
    lc_wasm_rt_destroy(rt);
}

Test(lc_wasm, initial_memory_above_the_limit_fails_instantiation) {
    lc_wasm_rt *rt = make_rt(false);
    lc_wasm_module *m = load(rt, "hello");
    run_spec s;
    spec_init(&s, m, "hello", NULL);
    s.limits.max_memory_pages = 1;
    run_spec_now(&s);
    cr_expect_eq(s.out.end, LC_WASM_TRAPPED);
    cr_expect_eq(s.out.trap, LC_WASM_TRAP_MEMORY_LIMIT);
    cr_expect_str_eq(s.out.message, "trapped during instantiation: the module's initial memory of "
                                    "2 pages (128 KiB) exceeds the instance limit of 1 pages "
                                    "(64 KiB)");
    cr_expect_str_eq(s.cap.out, "");
    spec_destroy(&s);
    lc_wasm_module_release(m);
    lc_wasm_rt_destroy(rt);
}

Test(lc_wasm, instance_terminated_before_it_runs_does_not_run) {
    lc_wasm_rt *rt = make_rt(false);
    lc_wasm_module *m = load(rt, "hello");
    capture cap = {.mu = PTHREAD_MUTEX_INITIALIZER};
    lc_wasm_instance_opts o = {.output = on_output, .output_ctx = &cap};
    lc_wasm_instance *inst = NULL;
    pie_status st;
    cr_assert_eq(lc_wasm_instance_create(m, &o, &inst, &st), PIE_OK);
    lc_wasm_instance_interrupt(inst);
    lc_wasm_outcome out;
    cr_assert_eq(lc_wasm_instance_run(inst, &out, &st), PIE_OK);
    cr_expect_eq(out.end, LC_WASM_INTERRUPTED);
    cr_expect_eq(out.trap, LC_WASM_TRAP_TERMINATED);
    cr_expect_str_eq(cap.out, "");
    lc_wasm_instance_interrupt(inst); /* after the end: no effect */
    lc_wasm_instance_free(inst);
    lc_wasm_module_release(m);
    lc_wasm_rt_destroy(rt);
}

Test(lc_wasm, destroy_stops_a_tier1_compile_in_progress) {
    lc_wasm_rt *rt = make_rt(true);
    lc_wasm_module *m = load(rt, "big");
    cr_expect_eq(lc_wasm_module_tier(m), 0);
    lc_wasm_module_release(m);
    lc_wasm_rt_destroy(rt); /* kills cc, joins the tier-1 thread, frees everything */
}

static sigjmp_buf chain_jmp;
static volatile sig_atomic_t chained;

static void test_segv(int sig, siginfo_t *si, void *uc) {
    (void)sig, (void)si, (void)uc;
    chained = 1;
    siglongjmp(chain_jmp, 1);
}

Test(lc_wasm, faults_outside_wasm_reach_the_previous_handler) {
    struct sigaction sa, old;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = test_segv;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    cr_assert_eq(sigaction(SIGSEGV, &sa, &old), 0);
    lc_wasm_rt *rt = make_rt(false);
    void *page = mmap(NULL, 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    cr_assert_neq(page, MAP_FAILED);
    if (sigsetjmp(chain_jmp, 1) == 0) *(volatile char *)page = 1;
    munmap(page, 4096);
    cr_expect_eq(chained, 1, "the fault did not reach the handler installed before lc_wasm");
    lc_wasm_rt_destroy(rt);
    struct sigaction now;
    cr_assert_eq(sigaction(SIGSEGV, &old, &now), 0);
    cr_expect(now.sa_sigaction == test_segv, "the last runtime did not restore the handler");
}

/* What numeric.c prints, computed natively. */
static void numeric_expected(char *buf, size_t n) {
    static const uint64_t vals[] = {1,
                                    2,
                                    3,
                                    0x80000000u,
                                    0xffffffffu,
                                    0x100000000ull,
                                    0x8000000000000000ull,
                                    0x0123456789abcdefull,
                                    0xfedcba9876543210ull,
                                    0};
    size_t at = 0;
    for (unsigned i = 0; i < sizeof vals / sizeof vals[0]; i++) {
        uint64_t v = vals[i];
        uint32_t w = (uint32_t)v, r = (uint32_t)(i * 5 + 1);
        at += (size_t)snprintf(
            buf + at, n - at, "%016llx %d %d %d %d %d %d %08x %016llx %lld %lld\n",
            (unsigned long long)v, w ? __builtin_clz(w) : 32, w ? __builtin_ctz(w) : 32,
            __builtin_popcount(w), v ? __builtin_clzll(v) : 64, v ? __builtin_ctzll(v) : 64,
            __builtin_popcountll(v), (w << (r & 31)) | (w >> ((32 - r) & 31)),
            (unsigned long long)((v >> (r & 63)) | (v << ((64 - r) & 63))),
            (long long)((int64_t)v / (int64_t)(r | 3)), (long long)((int64_t)v % 7));
    }
}

Test(lc_wasm, both_tiers_compute_integer_bit_operations_like_native_code) {
    char want[4096];
    numeric_expected(want, sizeof want);
    lc_wasm_rt *rt = make_rt(true);
    lc_wasm_module *m = load(rt, "numeric");
    for (int tier = 0; tier < 2; tier++) {
        pie_status st;
        if (tier == 1)
            cr_assert_eq(lc_wasm_module_wait_tier1(m, 200000, &st), PIE_OK, "%s", st.msg);
        run_spec s;
        spec_init(&s, m, "numeric", NULL);
        run_spec_now(&s);
        cr_expect_eq(s.out.tier, tier);
        cr_expect_str_eq(s.cap.out, want, "tier %d printed:\n%s\nnative:\n%s", tier, s.cap.out,
                         want);
        spec_destroy(&s);
    }
    lc_wasm_module_release(m);
    lc_wasm_rt_destroy(rt);
}

/* ---- compile bombs (issue 11, hole 5) --------------------------------------------------------
 * Modules beyond the complexity limits never reach wasm2c; a compile that runs too long, whose
 * caller goes away or that is running at shutdown is killed; compiles beyond the cap queue and
 * then fail; a crash of the translator says so. Slow or crashing tools are stand-ins: shell
 * scripts given as lc_wasm_rt_opts.wasm2c that record their pid in <wt_dir>/pids. */

static wt_bytes gen(uint32_t n_funcs, uint32_t nest, uint32_t pad, uint32_t salt) {
    pie_wasmgen_opts o = {.n_funcs = n_funcs, .nest = nest, .pad = pad, .salt = salt};
    wt_bytes b = {0};
    b.data = pie_wasmgen(&o, &b.len);
    cr_assert_not_null(b.data, "pie_wasmgen: out of memory");
    return b;
}

/* The tier-1 queue held a reference to every module it was to compile, so a burst of distinct
 * programs stayed loaded — native code mapped — until cc -O2 had got through all of them,
 * whatever programs.max_loaded said (a soak: 60 uploads held 700 mappings with a bound of 16).
 * The queue holds none: a module nobody holds leaves it unbuilt, and is queued again when it is
 * loaded again (tier 0 is on disk, tier 1 is not). */
Test(lc_wasm, the_tier1_queue_keeps_no_module_loaded_that_nobody_holds) {
    lc_wasm_rt *rt = make_rt(true);
    enum { N = 6 };
    wt_bytes b[N];
    for (uint32_t i = 0; i < N; i++) {
        b[i] = gen(4, 2, 0, 0x51e0 + i);
        lc_wasm_module *m = NULL;
        pie_status st;
        cr_assert_eq(lc_wasm_module_load(rt, b[i].data, b[i].len, &m, &st), PIE_OK, "%s", st.msg);
        lc_wasm_module_release(m);
    }
    lc_wasm_rt_stats s = lc_wasm_rt_stats_get(rt);
    /* at most the one whose tier-1 compile is running (the compiler holds it meanwhile) */
    cr_expect_leq(s.modules_loaded, 1u, "%u of %d released modules still loaded (%u queued)",
                  s.modules_loaded, N, s.tier1_queued);
    cr_expect_eq(s.tier1_queued, 0u, "released modules wait for tier 1");

    lc_wasm_module *m = NULL;
    pie_status st;
    cr_assert_eq(lc_wasm_module_load(rt, b[N - 1].data, b[N - 1].len, &m, &st), PIE_OK, "%s",
                 st.msg);
    cr_expect_eq(lc_wasm_module_wait_tier1(m, 200000, &st), PIE_OK, "loaded again: %s", st.msg);
    cr_expect_eq(lc_wasm_module_tier(m), 1);
    lc_wasm_module_release(m);
    for (int i = 0; i < N; i++) free(b[i].data);
    lc_wasm_rt_destroy(rt);
}

static lc_wasm_rt *make_rt_opts(lc_wasm_rt_opts o) {
    o.cache_dir = wt_dir;
    o.host_fns = wasm_test_host_fns;
    o.n_host_fns = wasm_test_host_n_fns;
    lc_wasm_rt *rt = NULL;
    pie_status st;
    cr_assert_eq(lc_wasm_rt_create(&o, &rt, &st), PIE_OK, "rt_create: %s", st.msg);
    return rt;
}

static lc_wasm_module *load_bytes(lc_wasm_rt *rt, wt_bytes b) {
    lc_wasm_module *m = NULL;
    pie_status st;
    cr_assert_eq(lc_wasm_module_load(rt, b.data, b.len, &m, &st), PIE_OK, "%s", st.msg);
    return m;
}

static bool entry_exists(const char *id, const char *file) {
    char p[1024];
    snprintf(p, sizeof p, "%s/%s%s%s", wt_dir, id, file ? "/" : "", file ? file : "");
    return access(p, F_OK) == 0;
}

static void expect_runs(lc_wasm_module *m) {
    run_spec r;
    spec_init(&r, m, "gen", NULL);
    run_spec_now(&r);
    cr_expect_eq(r.out.end, LC_WASM_EXITED, "%s", r.out.message);
    spec_destroy(&r);
}

/* The cache directory grew by every program ever compiled (~130-400 KiB each), deleted ones
 * included, until the disk was full. Past cache_max_bytes the entries of modules nobody holds go,
 * least recently used first, down to 3/4 of the bound; a held one stays however old. */
Test(lc_wasm, the_cache_directory_stays_within_its_bound_least_recently_used_first) {
    enum { N = 8 };
    wt_bytes b[N];
    char id[N][65];
    for (uint32_t i = 0; i < N; i++) b[i] = gen(4, 2, 0, 0xcac0 + i);
    lc_wasm_rt *rt = make_rt(false); /* no bound: one entry's size */
    lc_wasm_module *held = load_bytes(rt, b[0]);
    uint64_t one = lc_wasm_rt_stats_get(rt).cache_bytes;
    cr_assert_gt(one, 0u, "a compile added nothing to the estimate");
    lc_wasm_module_release(held);
    lc_wasm_rt_destroy(rt);

    uint64_t bound = one * 4 + one / 2;
    rt = make_rt_opts((lc_wasm_rt_opts){.cache_max_bytes = bound});
    cr_expect_eq(lc_wasm_rt_stats_get(rt).cache_bytes, one, "the scan at creation");
    held = load_bytes(rt, b[0]); /* the oldest, but held throughout */
    snprintf(id[0], 65, "%s", lc_wasm_module_id(held));
    for (int i = 1; i < N; i++) {
        lc_wasm_module *m = load_bytes(rt, b[i]);
        snprintf(id[i], 65, "%s", lc_wasm_module_id(m));
        lc_wasm_module_release(m);
    }
    lc_wasm_rt_stats s = lc_wasm_rt_stats_get(rt);
    cr_expect_leq(s.cache_bytes, bound, "%llu bytes cached, bound %llu",
                  (unsigned long long)s.cache_bytes, (unsigned long long)bound);
    cr_expect_gt(s.cache_removals, 0u);
    size_t left = 0;
    for (int i = 0; i < N; i++) left += entry_exists(id[i], NULL);
    cr_expect_leq(left, 4u, "%zu entries of %d left, bound 4.5 entries", left, N);
    cr_expect(entry_exists(id[0], "t0.so"), "the held module's entry was removed");
    cr_expect(entry_exists(id[N - 1], "t0.so"), "the latest entry was removed");
    cr_expect(!entry_exists(id[1], NULL), "the least recently used entry stayed");

    lc_wasm_module *again = load_bytes(rt, b[1]); /* removed: compiled again, and runs */
    cr_expect_eq(lc_wasm_rt_stats_get(rt).tier0_compiles, (uint64_t)N);
    expect_runs(again);
    lc_wasm_module_release(again);
    lc_wasm_module_release(held);
    for (int i = 0; i < N; i++) free(b[i].data);
    lc_wasm_rt_destroy(rt);
}

typedef struct bg_load {
    lc_wasm_rt *rt;
    wt_bytes b;
    lc_wasm_cancel cancel;
    lc_wasm_module *m;
    pie_code rc;
    pie_status st;
} bg_load;

static void *bg_load_thread(void *arg) {
    bg_load *l = arg;
    l->rc = lc_wasm_module_load_cancel(l->rt, l->b.data, l->b.len, &l->cancel, &l->m, &l->st);
    return NULL;
}

static pthread_t bg_start(bg_load *l, lc_wasm_rt *rt, wt_bytes b) {
    *l = (bg_load){.rt = rt, .b = b, .rc = PIE_UNKNOWN};
    lc_wasm_cancel_init(&l->cancel);
    pthread_t t;
    cr_assert_eq(pthread_create(&t, NULL, bg_load_thread, l), 0);
    return t;
}

/* A loader that opened an entry's lock and waited for it while the entry was removed (a prune
 * here, or another replica's) got the lock of a file no longer in the directory, then wrote
 * into a directory that was gone. It starts again on a new entry. */
Test(lc_wasm, a_load_waiting_on_an_entry_that_is_removed_makes_it_again) {
    lc_wasm_rt *rt = make_rt(false);
    wt_bytes b = gen(3, 1, 0, 0xdead);
    lc_wasm_module *m = load_bytes(rt, b);
    char dir[1024], lock_path[1100];
    snprintf(dir, sizeof dir, "%s/%s", wt_dir, lc_wasm_module_id(m));
    lc_wasm_module_release(m);
    snprintf(lock_path, sizeof lock_path, "%s/lock", dir);
    int lock = open(lock_path, O_RDWR);
    cr_assert_geq(lock, 0, "open %s: %s", lock_path, strerror(errno));
    cr_assert_eq(flock(lock, LOCK_EX), 0);

    bg_load l;
    pthread_t t = bg_start(&l, rt, b);
    usleep(300 * 1000);    /* it has opened the lock and waits for it */
    DIR *d = opendir(dir); /* what a prune does: the files, the lock last, the directory */
    cr_assert_not_null(d);
    for (struct dirent *e; (e = readdir(d)) != NULL;)
        if (e->d_name[0] != '.' && strcmp(e->d_name, "lock") != 0)
            cr_assert_eq(unlinkat(dirfd(d), e->d_name, 0), 0, "%s", e->d_name);
    closedir(d);
    cr_assert_eq(unlink(lock_path), 0);
    /* fails only if the loader was so slow that it made a new lock here in between (it then
     * compiles into this directory, which is fine too) */
    cr_assert(rmdir(dir) == 0 || errno == ENOTEMPTY, "rmdir %s: %s", dir, strerror(errno));
    flock(lock, LOCK_UN);
    close(lock);
    pthread_join(t, NULL);
    cr_assert_eq(l.rc, PIE_OK, "the load failed: %s", l.st.msg);
    cr_expect_eq(lc_wasm_rt_stats_get(rt).tier0_compiles, 2u);
    cr_expect(access(dir, F_OK) == 0, "no entry was made again");
    expect_runs(l.m);
    lc_wasm_module_release(l.m);
    free(b.data);
    lc_wasm_rt_destroy(rt);
}

/* A deleted program's native code stayed in the cache for good. lc_wasm_rt_forget removes an
 * entry, but not one a module here holds. */
Test(lc_wasm, forget_removes_an_entry_nobody_holds) {
    lc_wasm_rt *rt = make_rt(false);
    wt_bytes b = gen(3, 1, 0, 0xf0f0);
    lc_wasm_module *m = load_bytes(rt, b);
    char id[65];
    snprintf(id, sizeof id, "%s", lc_wasm_module_id(m));
    pie_status st;
    cr_expect_eq(lc_wasm_rt_forget(rt, id, &st), PIE_FAILED_PRECONDITION);
    cr_expect(strstr(st.msg, "loaded"), "%s", st.msg);
    cr_expect(entry_exists(id, "t0.so"));
    lc_wasm_module_release(m);
    uint64_t before = lc_wasm_rt_stats_get(rt).cache_bytes;
    cr_expect_eq(lc_wasm_rt_forget(rt, id, &st), PIE_OK, "%s", st.msg);
    cr_expect(!entry_exists(id, NULL), "the entry is still there");
    cr_expect_lt(lc_wasm_rt_stats_get(rt).cache_bytes, before);
    cr_expect_eq(lc_wasm_rt_forget(rt, id, &st), PIE_OK, "absent: %s", st.msg);
    cr_expect_eq(lc_wasm_rt_forget(rt, "../../etc", &st), PIE_INVALID_ARGUMENT);
    free(b.data);
    lc_wasm_rt_destroy(rt);
}

/* <wt_dir>/<name>: a shell script that appends its pid to <wt_dir>/pids, then runs body.
 * Returns its path (the caller frees it). */
static char *fake_tool(const char *name, const char *body) {
    char path[256];
    snprintf(path, sizeof path, "%s/%s", wt_dir, name);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f, "%s: %s", path, strerror(errno));
    fprintf(f, "#!/bin/sh\necho $$ >> '%s/pids'\n%s\n", wt_dir, body);
    cr_assert_eq(fclose(f), 0);
    cr_assert_eq(chmod(path, 0700), 0);
    return strdup(path);
}

/* The pids the fake tools recorded so far. */
static size_t tool_pids(pid_t *out, size_t cap) {
    char path[256];
    snprintf(path, sizeof path, "%s/pids", wt_dir);
    FILE *f = fopen(path, "r");
    if (f == NULL) return 0;
    size_t n = 0;
    long v;
    while (n < cap && fscanf(f, "%ld", &v) == 1) out[n++] = (pid_t)v;
    fclose(f);
    return n;
}

static void wait_tool_pids(size_t n) {
    pid_t p[16];
    for (int i = 0; i < 2000 && tool_pids(p, 16) < n; i++) usleep(10000);
    cr_assert_geq(tool_pids(p, 16), n, "fewer than %zu fake tools started in 20 s", n);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* No fake tool is still running (they were killed and reaped, not left behind). */
static void expect_tools_gone(void) {
    pid_t p[16];
    size_t n = tool_pids(p, 16);
    for (size_t i = 0; i < n; i++)
        cr_expect(kill(p[i], 0) != 0 && errno == ESRCH, "tool process %ld is still running",
                  (long)p[i]);
}

Test(lc_wasm, modules_beyond_the_complexity_limits_are_refused_before_compiling) {
    lc_wasm_rt *rt = make_rt_opts((lc_wasm_rt_opts){
        .module_limits = {.max_functions = 100, .max_function_bytes = 4096, .max_nesting = 64}});
    wt_bytes b = gen(101, 0, 0, 1);
    expect_rejected(rt, b.data, b.len,
                    "module too complex to compile here: it defines 101 functions, more than "
                    "the limit of 100 (programs.max_functions)");
    free(b.data);
    b = gen(1, 0, 5000, 2);
    expect_rejected(rt, b.data, b.len,
                    "function 0 has a body of 5005 bytes, more than the limit of 4096 "
                    "(programs.max_function_size)");
    free(b.data);
    b = gen(1, 65, 0, 3);
    expect_rejected(rt, b.data, b.len,
                    "function 0 nests blocks more than 64 deep (the limit, programs.max_nesting)");
    free(b.data);
    lc_wasm_rt_stats rs = lc_wasm_rt_stats_get(rt);
    cr_expect_eq(rs.translations + rs.own_translations, 0u, "a refused module was translated");

    /* at every limit at once: compiles and runs */
    b = gen(100, 64, 3800, 4);
    lc_wasm_module *m = NULL;
    pie_status st;
    cr_assert_eq(lc_wasm_module_load(rt, b.data, b.len, &m, &st), PIE_OK, "%s", st.msg);
    lc_wasm_instance *inst = NULL;
    cr_assert_eq(lc_wasm_instance_create(m, NULL, &inst, &st), PIE_OK, "%s", st.msg);
    lc_wasm_outcome out;
    cr_assert_eq(lc_wasm_instance_run(inst, &out, &st), PIE_OK, "%s", st.msg);
    cr_expect_eq(out.end, LC_WASM_EXITED, "%s", out.message);
    lc_wasm_instance_free(inst);
    lc_wasm_module_release(m);
    free(b.data);
    lc_wasm_rt_destroy(rt);

    /* the defaults keep out the modules of the report: 50,000 functions (wasm2c busy for
     * minutes) and 20,000 nested blocks (wasm2c crashed) */
    rt = make_rt(false);
    b = gen(50000, 0, 0, 5);
    expect_rejected(rt, b.data, b.len, "it defines 50000 functions, more than the limit of 20000");
    free(b.data);
    b = gen(1, 20000, 0, 6);
    expect_rejected(rt, b.data, b.len, "nests blocks more than 4096 deep");
    free(b.data);
    rs = lc_wasm_rt_stats_get(rt);
    cr_expect_eq(rs.translations + rs.own_translations, 0u);
    lc_wasm_rt_destroy(rt);
}

Test(lc_wasm, a_translator_crash_is_reported_as_a_crash_not_as_simd) {
    char *w2c = fake_tool("wasm2c", "kill -s SEGV $$");
    lc_wasm_rt *rt = make_rt_opts((lc_wasm_rt_opts){.wasm2c = w2c, .tier0_wasm2c = true});
    wt_bytes b = gen(1, 0, 0, 1);
    expect_rejected(rt, b.data, b.len,
                    "wasm2c (translate to C) crashed on this module, killed by SIGSEGV (signal "
                    "11, Segmentation fault)");
    lc_wasm_module *m = NULL;
    pie_status st;
    lc_wasm_module_load(rt, b.data, b.len, &m, &st);
    cr_expect_null(strstr(st.msg, "SIMD"), "a crash blamed on SIMD: %s", st.msg);
    free(b.data);
    lc_wasm_rt_destroy(rt);
    free(w2c);

    /* The real wasm2c on a nesting beyond what its stack holds (limit raised), when the stack
     * limit is one it can exhaust. */
    struct rlimit rl;
    if (getrlimit(RLIMIT_STACK, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY ||
        rl.rlim_cur > (64u << 20))
        return;
    rt = make_rt_opts(
        (lc_wasm_rt_opts){.module_limits = {.max_nesting = 1000000}, .tier0_wasm2c = true});
    b = gen(1, 200000, 0, 2);
    expect_rejected(rt, b.data, b.len, "wasm2c (translate to C) crashed on this module");
    free(b.data);
    lc_wasm_rt_destroy(rt);
}

Test(lc_wasm, a_compile_past_its_time_limit_is_killed_and_says_so) {
    char *w2c = fake_tool("wasm2c", "exec sleep 60");
    lc_wasm_rt *rt = make_rt_opts(
        (lc_wasm_rt_opts){.wasm2c = w2c, .compile_timeout_ms = 300, .tier0_wasm2c = true});
    wt_bytes b = gen(1, 0, 0, 1);
    lc_wasm_module *m = NULL;
    pie_status st;
    double t0 = now_s();
    pie_code rc = lc_wasm_module_load(rt, b.data, b.len, &m, &st);
    double took = now_s() - t0;
    cr_expect_eq(rc, PIE_RESOURCE_EXHAUSTED, "%s: %s", pie_code_name(rc), st.msg);
    cr_expect(strstr(st.msg, "tier-0 compile (tcc): gave up after 300 ms "
                             "(runtime.compile_timeout) with wasm2c (translating to C) still "
                             "running") != NULL,
              "message: %s", st.msg);
    cr_expect_lt(took, 20.0, "the load took %.1f s: the 60 s translation was not cut", took);
    expect_tools_gone();
    free(b.data);
    lc_wasm_rt_destroy(rt);
    free(w2c);
}

Test(lc_wasm, a_cancelled_load_kills_its_compile_and_a_waiter_compiles_for_itself) {
    char *w2c = fake_tool("wasm2c", "exec sleep 60");
    lc_wasm_rt *rt = make_rt_opts((lc_wasm_rt_opts){.wasm2c = w2c, .tier0_wasm2c = true});
    wt_bytes b = gen(1, 0, 0, 1);
    bg_load a, w;
    pthread_t ta = bg_start(&a, rt, b);
    wait_tool_pids(1);
    pthread_t tw = bg_start(&w, rt, b); /* the same bytes: waits for a's compile */
    usleep(100000);
    double t0 = now_s();
    lc_wasm_cancel_fire(&a.cancel);
    pthread_join(ta, NULL);
    cr_expect_eq(a.rc, PIE_CANCELLED, "%s: %s", pie_code_name(a.rc), a.st.msg);
    cr_expect_lt(now_s() - t0, 10.0, "cancel took %.1f s", now_s() - t0);
    wait_tool_pids(2); /* w's own compile */
    lc_wasm_cancel_fire(&w.cancel);
    pthread_join(tw, NULL);
    cr_expect_eq(w.rc, PIE_CANCELLED, "%s: %s", pie_code_name(w.rc), w.st.msg);
    expect_tools_gone();
    lc_wasm_rt_stats s = lc_wasm_rt_stats_get(rt);
    cr_expect_eq(s.compiles_running + s.compiles_queued, 0u);
    free(b.data);
    lc_wasm_rt_destroy(rt);
    free(w2c);
}

Test(lc_wasm, stopping_compiles_ends_those_running_and_refuses_new_ones) {
    char *w2c = fake_tool("wasm2c", "exec sleep 60");
    lc_wasm_rt *rt = make_rt_opts((lc_wasm_rt_opts){.wasm2c = w2c, .tier0_wasm2c = true});
    wt_bytes b = gen(1, 0, 0, 1), b2 = gen(1, 0, 0, 2);
    bg_load a;
    pthread_t ta = bg_start(&a, rt, b);
    wait_tool_pids(1);
    double t0 = now_s();
    lc_wasm_rt_stop_compiles(rt);
    pthread_join(ta, NULL);
    cr_expect_lt(now_s() - t0, 10.0, "stopping took %.1f s", now_s() - t0);
    cr_expect_eq(a.rc, PIE_UNAVAILABLE, "%s: %s", pie_code_name(a.rc), a.st.msg);
    cr_expect(strstr(a.st.msg, "shutting down") != NULL, "message: %s", a.st.msg);
    lc_wasm_module *m = NULL;
    pie_status st;
    cr_expect_eq(lc_wasm_module_load(rt, b2.data, b2.len, &m, &st), PIE_UNAVAILABLE, "%s", st.msg);
    expect_tools_gone();
    free(b.data);
    free(b2.data);
    lc_wasm_rt_destroy(rt);
    free(w2c);
}

Test(lc_wasm, compiles_beyond_the_cap_wait_in_the_queue_then_are_refused) {
    char *w2c = fake_tool("wasm2c", "exec sleep 60");
    lc_wasm_rt *rt =
        make_rt_opts((lc_wasm_rt_opts){
            .wasm2c = w2c, .max_compiles = 1, .compile_queue = 1, .tier0_wasm2c = true});
    wt_bytes b1 = gen(1, 0, 0, 1), b2 = gen(1, 0, 0, 2), b3 = gen(1, 0, 0, 3);
    bg_load a, q;
    pthread_t ta = bg_start(&a, rt, b1);
    wait_tool_pids(1);
    pthread_t tq = bg_start(&q, rt, b2);
    for (int i = 0; i < 2000 && lc_wasm_rt_stats_get(rt).compiles_queued < 1; i++) usleep(10000);
    cr_assert_eq(lc_wasm_rt_stats_get(rt).compiles_queued, 1u, "the second load never queued");

    lc_wasm_module *m = NULL;
    pie_status st;
    pie_code rc = lc_wasm_module_load(rt, b3.data, b3.len, &m, &st);
    cr_expect_eq(rc, PIE_RESOURCE_EXHAUSTED, "%s: %s", pie_code_name(rc), st.msg);
    cr_expect(strstr(st.msg, "1 compiles running (the limit, runtime.max_compiles) and 1 "
                             "waiting (the limit, runtime.compile_queue)") != NULL,
              "message: %s", st.msg);
    pid_t p[16];
    cr_expect_eq(tool_pids(p, 16), 1u, "a compile beyond the cap started");

    lc_wasm_cancel_fire(&a.cancel); /* the slot frees: the queued load compiles */
    pthread_join(ta, NULL);
    cr_expect_eq(a.rc, PIE_CANCELLED, "%s", a.st.msg);
    wait_tool_pids(2);
    lc_wasm_cancel_fire(&q.cancel);
    pthread_join(tq, NULL);
    cr_expect_eq(q.rc, PIE_CANCELLED, "%s", q.st.msg);
    expect_tools_gone();
    free(b1.data);
    free(b2.data);
    free(b3.data);
    lc_wasm_rt_destroy(rt);
    free(w2c);
}

/* ---- pie-tcc-helper: tier 0's compiler kept between modules ------------------------------ */

#define HELPER PIE_BIN_DIR "/pie-tcc-helper"

Test(lc_wasm, tier0_compiles_module_after_module_in_one_kept_helper) {
    lc_wasm_rt *rt = make_rt_opts((lc_wasm_rt_opts){.tcc_helper = HELPER});
    enum { N = 3 };
    for (uint32_t i = 0; i < N; i++) {
        wt_bytes b = gen(3, 2, 0, 0x7e10 + i);
        lc_wasm_module *m = load_bytes(rt, b);
        expect_runs(m);
        lc_wasm_module_release(m);
        free(b.data);
    }
    lc_wasm_rt_stats s = lc_wasm_rt_stats_get(rt);
    cr_expect_eq(s.helper_compiles, (uint64_t)N, "compiled by the helper: %llu of %d",
                 (unsigned long long)s.helper_compiles, N);
    cr_expect_eq(s.helper_starts, 1u, "one helper for one compile at a time: %llu started",
                 (unsigned long long)s.helper_starts);
    cr_expect_eq(s.own_translations, (uint64_t)N);
    lc_wasm_rt_destroy(rt);
}

/* A helper past runtime.compile_timeout is killed with its process group, the load fails as a
 * tcc child's would, and the next compile starts another helper. The stand-in hangs the first
 * time it is started and is the real helper after. */
Test(lc_wasm, a_helper_past_the_time_limit_is_killed_and_the_next_compile_starts_another) {
    char body[512];
    snprintf(body, sizeof body,
             "if [ ! -e '%s/hung' ]; then touch '%s/hung'; exec sleep 60; fi\n"
             "exec '%s'",
             wt_dir, wt_dir, HELPER);
    char *helper = fake_tool("helper", body);
    /* 2 s: the compile after the kill (a helper's start and a small module) must fit too, on
     * a loaded machine under ASan */
    lc_wasm_rt *rt =
        make_rt_opts((lc_wasm_rt_opts){.tcc_helper = helper, .compile_timeout_ms = 2000});
    wt_bytes b = gen(1, 0, 0, 0x7e20);
    lc_wasm_module *m = NULL;
    pie_status st;
    double t0 = now_s();
    cr_assert_eq(lc_wasm_module_load(rt, b.data, b.len, &m, &st), PIE_RESOURCE_EXHAUSTED, "%s",
                 st.msg);
    cr_expect_lt(now_s() - t0, 8.0, "the load waited %.1f s for a hung helper", now_s() - t0);
    cr_expect_not_null(strstr(st.msg, "pie-tcc-helper"), "%s", st.msg);
    cr_expect_not_null(strstr(st.msg, "runtime.compile_timeout"), "%s", st.msg);
    expect_tools_gone();
    m = load_bytes(rt, b);
    expect_runs(m);
    lc_wasm_module_release(m);
    lc_wasm_rt_stats s = lc_wasm_rt_stats_get(rt);
    cr_expect_eq(s.helper_starts, 2u);
    cr_expect_eq(s.helper_compiles, 1u);
    free(b.data);
    lc_wasm_rt_destroy(rt);
    free(helper);
}

/* A helper that dies (a crash, a missing library) costs nothing but time: a tcc child compiles
 * the module, as without a helper. */
Test(lc_wasm, a_helper_that_dies_leaves_the_compile_to_a_tcc_child) {
    char *helper = fake_tool("helper", "kill -s SEGV $$");
    lc_wasm_rt *rt = make_rt_opts((lc_wasm_rt_opts){.tcc_helper = helper});
    for (uint32_t i = 0; i < 2; i++) {
        wt_bytes b = gen(2, 1, 0, 0x7e30 + i);
        lc_wasm_module *m = load_bytes(rt, b);
        expect_runs(m);
        lc_wasm_module_release(m);
        free(b.data);
    }
    lc_wasm_rt_stats s = lc_wasm_rt_stats_get(rt);
    cr_expect_eq(s.helper_compiles, 0u);
    cr_expect_eq(s.tier0_compiles, 2u);
    cr_expect_eq(s.own_translations, 2u, "a dead helper sent the module to wasm2c");
    cr_expect_eq(s.helper_starts, 2u, "started again for the second module");
    expect_tools_gone();
    lc_wasm_rt_destroy(rt);
    free(helper);
}
