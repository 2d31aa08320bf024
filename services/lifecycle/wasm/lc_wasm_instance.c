/* lc_wasm_instance.c — runtimes, modules and instances: the lifecycle of an inferlet's code.
 *
 * Owns: lc_wasm_rt (its module table, one entry per content hash, and the tier-1 queue), module
 * loading with "compile once" for concurrent loads, instance creation, the run (frame, alternate
 * signal stack, CPU and wall timers, instantiate + _start under one sigsetjmp, the outcome), the
 * interrupt of a running instance, and the helpers host functions use.
 * Does not own: the wasm-rt.h functions and signal handlers (lc_wasm_rt.c), compiling
 * (lc_wasm_compile.c), WASI (lc_wasm_wasi.c).
 *
 * The watchdog: a run with a CPU quota owns a POSIX timer on its thread's CPU-time clock, and
 * every run owns one on CLOCK_MONOTONIC (wall quota, lc_wasm_instance_interrupt). Each sends the
 * interrupt signal to the instance's thread (SIGEV_THREAD_ID) when it expires and again every
 * 5 ms after; the handler (lc_wasm_rt.c) unwinds once the thread is in generated code. The kernel
 * is the watchdog: no thread polls, and it scales with the number of instances. */
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "lc_wasm_int.h"
#include "pie_sha256.h"

#define LC_WASM_REPEAT_NS (5 * 1000 * 1000) /* interrupt signal repeat while not yet taken */
#define LC_WASM_ALTSTACK  (64u << 10)

uint64_t lc_wasm_now_ns(clockid_t clock) {
    struct timespec ts;
    if (clock_gettime(clock, &ts) != 0) return 0;
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ---- runtime -------------------------------------------------------------------------------- */

static char *dup_or(const char *s, const char *def) { return strdup(s ? s : def); }

/* mkdir -p with mode 0700 for the parts it creates. */
static pie_code make_dirs(const char *path, pie_status *st) {
    char p[PATH_MAX];
    size_t n = strlen(path);
    if (n == 0 || n >= sizeof p)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "cache_dir \"%s\" is empty or too long",
                              path);
    memcpy(p, path, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (p[i] != '/' && p[i] != '\0') continue;
        char c = p[i];
        p[i] = '\0';
        if (mkdir(p, 0700) != 0 && errno != EEXIST)
            return pie_status_set(st, PIE_INVALID_ARGUMENT, "cache_dir: mkdir %s: %s", p,
                                  strerror(errno));
        p[i] = c;
    }
    struct stat sb;
    if (stat(path, &sb) != 0 || !S_ISDIR(sb.st_mode) || access(path, W_OK | X_OK) != 0)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "cache_dir %s is not a writable directory",
                              path);
    return PIE_OK;
}

static bool exported(const char *sym, void (*expect)(void)) {
    void *p = dlsym(RTLD_DEFAULT, sym);
    if (p == NULL) return false;
    void (*f)(void);
    memcpy(&f, &p, sizeof p);
    return expect == NULL || f == expect;
}

/* The executable must export the wasm-rt interface, WASI and every declared host function, since
 * dlopen'ed modules resolve their imports against it. */
static pie_code check_host(const lc_wasm_rt_opts *o, pie_status *st) {
    if (!exported("wasm_rt_trap", NULL) || !exported("Z_wasi_snapshot_preview1Z_fd_write", NULL) ||
        !exported("lc_wasm_stack_floor", NULL))
        return pie_status_set(st, PIE_FAILED_PRECONDITION,
                              "the executable does not export the wasm runtime (wasm_rt_trap): "
                              "link it with ENABLE_EXPORTS (-rdynamic)");
    for (size_t i = 0; i < o->n_host_fns; i++) {
        const lc_wasm_host_fn *f = &o->host_fns[i];
        if (f->name == NULL || f->name[0] == '\0' || f->fn == NULL)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "host_fns[%zu]: name and fn are required", i);
        if (!lc_wasm_type_is_canonical(f->type))
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "host function pie.%s: type \"%s\" is not canonical WAT such as "
                                  "\"(param i32 i64) (result i32)\"",
                                  f->name, f->type ? f->type : "(null)");
        for (size_t j = 0; j < i; j++)
            if (strcmp(o->host_fns[j].name, f->name) == 0)
                return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                      "host function pie.%s is declared twice", f->name);
        char sym[256];
        lc_wasm_mangle_import("pie", f->name, sym, sizeof sym);
        if (!exported(sym, f->fn))
            return pie_status_set(st, PIE_FAILED_PRECONDITION,
                                  "host function pie.%s: the executable does not export %s as the "
                                  "given function (define it with that name and link with "
                                  "ENABLE_EXPORTS / -rdynamic)",
                                  f->name, sym);
    }
    return PIE_OK;
}

/* Frees rt and the strings it owns (not its mutex and condition); NULL is a no-op. */
static void rt_free_fields(lc_wasm_rt *rt) {
    if (rt == NULL) return;
    free(rt->cache_dir);
    free(rt->wasm2c);
    free(rt->tcc);
    free(rt->tcc_helper);
    free(rt->helpers);
    free(rt->cc);
    free(rt->host_fns);
    free(rt);
}

pie_code lc_wasm_rt_create(const lc_wasm_rt_opts *o, lc_wasm_rt **out, pie_status *st) {
    *out = NULL;
    if (o == NULL || o->cache_dir == NULL)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "lc_wasm_rt_create: cache_dir is required");
    if (strlen(o->cache_dir) > PATH_MAX - 128)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "cache_dir is longer than %d bytes",
                              PATH_MAX - 128);
    if (o->n_host_fns > 0 && o->host_fns == NULL)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "host_fns is NULL but n_host_fns is %zu",
                              o->n_host_fns);
    if (make_dirs(o->cache_dir, st) != PIE_OK || check_host(o, st) != PIE_OK) return st->code;
    if (lc_wasm_signals_acquire(o->interrupt_signal, st) != PIE_OK) return st->code;

    lc_wasm_rt *rt = calloc(1, sizeof *rt);
    if (rt == NULL) goto oom;
    rt->cache_dir = strdup(o->cache_dir);
    rt->wasm2c = dup_or(o->wasm2c, "wasm2c");
    rt->tcc = dup_or(o->tcc, "tcc");
    rt->cc = dup_or(o->cc, "cc");
    rt->host_fns = calloc(o->n_host_fns ? o->n_host_fns : 1, sizeof *rt->host_fns);
    if (!rt->cache_dir || !rt->wasm2c || !rt->tcc || !rt->cc || !rt->host_fns) goto oom;
    if (o->n_host_fns) memcpy(rt->host_fns, o->host_fns, o->n_host_fns * sizeof *rt->host_fns);
    rt->n_host_fns = o->n_host_fns;
    rt->tier1 = o->tier1;
    const char *t0 = getenv("PIE_WASM_TIER0");
    rt->tier0_wasm2c = o->tier0_wasm2c || (t0 != NULL && strcmp(t0, "wasm2c") == 0);
    rt->limits = o->module_limits;
    if (rt->limits.max_functions == 0) rt->limits.max_functions = LC_WASM_DEFAULT_MAX_FUNCTIONS;
    if (rt->limits.max_function_bytes == 0)
        rt->limits.max_function_bytes = LC_WASM_DEFAULT_MAX_FUNCTION_BYTES;
    if (rt->limits.max_nesting == 0) rt->limits.max_nesting = LC_WASM_DEFAULT_MAX_NESTING;
    rt->compile_timeout_ms = o->compile_timeout_ms ? o->compile_timeout_ms : 60000;
    rt->tier1_timeout_ms = o->tier1_timeout_ms ? o->tier1_timeout_ms : 600000;
    rt->max_compiles = o->max_compiles ? o->max_compiles : 2;
    if (o->tcc_helper != NULL && o->tcc_helper[0] != '\0') {
        rt->tcc_helper = strdup(o->tcc_helper);
        rt->helpers = calloc(rt->max_compiles, sizeof *rt->helpers);
        if (!rt->tcc_helper || !rt->helpers) goto oom;
        for (uint32_t i = 0; i < rt->max_compiles; i++) {
            rt->helpers[i].fd = -1;
            if (pthread_mutex_init(&rt->helpers[i].mu, NULL) != 0) goto oom;
        }
    }
    rt->cache_max = o->cache_max_bytes;
    lc_wasm_cache_init(rt);
    rt->compile_queue = o->compile_queue > 0    ? (uint32_t)o->compile_queue
                        : o->compile_queue == 0 ? 32u
                                                : 0u;
    atomic_init(&rt->compiles_stopped, false);
    if (pthread_mutex_init(&rt->mu, NULL) != 0) goto oom;
    pthread_condattr_t ca;
    if (pthread_condattr_init(&ca) != 0) {
        pthread_mutex_destroy(&rt->mu);
        goto oom;
    }
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    int ce = pthread_cond_init(&rt->slot_cv, &ca);
    pthread_condattr_destroy(&ca);
    if (ce != 0) {
        pthread_mutex_destroy(&rt->mu);
        goto oom;
    }
    if (pthread_cond_init(&rt->t1_cv, NULL) != 0) {
        pthread_cond_destroy(&rt->slot_cv);
        pthread_mutex_destroy(&rt->mu);
        goto oom;
    }
    if (rt->tier1) {
        int e = pthread_create(&rt->t1_thread, NULL, lc_wasm_tier1_main, rt);
        if (e != 0) {
            pthread_cond_destroy(&rt->t1_cv);
            pthread_cond_destroy(&rt->slot_cv);
            pthread_mutex_destroy(&rt->mu);
            pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "tier-1 thread: %s", strerror(e));
            goto fail;
        }
        rt->t1_started = true;
    }
    *out = rt;
    pie_status_ok(st);
    return PIE_OK;
oom:
    pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "lc_wasm_rt_create: out of memory");
fail:
    rt_free_fields(rt);
    lc_wasm_signals_release();
    return st->code;
}

static void module_free(lc_wasm_module *m) {
    lc_wasm_code_release(m->code);
    pthread_cond_destroy(&m->cv);
    pthread_mutex_destroy(&m->mu);
    free(m->dir);
    free(m);
}

static void table_unlink(lc_wasm_rt *rt, lc_wasm_module *m);
static void t1_unlink(lc_wasm_rt *rt, lc_wasm_module *m);

void lc_wasm_module_release(lc_wasm_module *m) {
    if (m == NULL) return;
    lc_wasm_rt *rt = m->rt;
    pthread_mutex_lock(&rt->mu);
    int left = --m->refs;
    if (left == 0) { /* under the lock: no load or tier-1 compile can find it any more */
        table_unlink(rt, m);
        t1_unlink(rt, m);
    }
    pthread_mutex_unlock(&rt->mu);
    if (left == 0) module_free(m);
}

void lc_wasm_rt_stop_compiles(lc_wasm_rt *rt) {
    atomic_store(&rt->compiles_stopped, true); /* compiling threads kill their tools */
    pthread_mutex_lock(&rt->mu);
    pthread_cond_broadcast(&rt->slot_cv);
    pthread_mutex_unlock(&rt->mu);
}

void lc_wasm_rt_destroy(lc_wasm_rt *rt) {
    if (rt == NULL) return;
    lc_wasm_rt_stop_compiles(rt); /* a tier-1 compile in progress ends within 50 ms */
    pthread_mutex_lock(&rt->mu);
    rt->stopping = true;
    pthread_cond_broadcast(&rt->t1_cv);
    pthread_mutex_unlock(&rt->mu);
    if (rt->t1_started) pthread_join(rt->t1_thread, NULL);

    if (rt->modules != NULL) {
        /* A module (or an instance holding one) outlives its runtime: a caller bug that would
         * otherwise surface later as a use after free. */
        fprintf(stderr, "lc_wasm: lc_wasm_rt_destroy: module %s still has %d references\n",
                rt->modules->id, rt->modules->refs);
        abort();
    }
    lc_wasm_helpers_stop(rt);
    pthread_cond_destroy(&rt->t1_cv);
    pthread_cond_destroy(&rt->slot_cv);
    pthread_mutex_destroy(&rt->mu);
    rt_free_fields(rt);
    lc_wasm_signals_release();
}

lc_wasm_rt_stats lc_wasm_rt_stats_get(lc_wasm_rt *rt) {
    lc_wasm_rt_stats s = {
        .translations = atomic_load(&rt->translations),
        .own_translations = atomic_load(&rt->own_translations),
        .own_declines = atomic_load(&rt->own_declines),
        .tier0_compiles = atomic_load(&rt->tier0_compiles),
        .helper_compiles = atomic_load(&rt->helper_compiles),
        .helper_starts = atomic_load(&rt->helper_starts),
        .tier1_compiles = atomic_load(&rt->tier1_compiles),
        .disk_hits = atomic_load(&rt->disk_hits),
        .memory_hits = atomic_load(&rt->memory_hits),
        .t0_files_ns = atomic_load(&rt->t0_files_ns),
        .t0_translate_ns = atomic_load(&rt->t0_translate_ns),
        .t0_compile_ns = atomic_load(&rt->t0_compile_ns),
        .t0_open_ns = atomic_load(&rt->t0_open_ns),
        .cache_bytes = atomic_load(&rt->cache_bytes),
        .cache_removals = atomic_load(&rt->cache_removals),
    };
    pthread_mutex_lock(&rt->mu);
    s.compiles_running = rt->n_compiling;
    s.compiles_queued = rt->n_queued;
    for (const lc_wasm_module *m = rt->modules; m != NULL; m = m->next) s.modules_loaded++;
    for (const lc_wasm_module *m = rt->t1_head; m != NULL; m = m->t1_next) s.tier1_queued++;
    pthread_mutex_unlock(&rt->mu);
    return s;
}

/* ---- modules -----------------------------------------------------------------------------------
 */

static lc_wasm_module *module_new(lc_wasm_rt *rt, const char *id, const lc_wasm_info *info) {
    lc_wasm_module *m = calloc(1, sizeof *m);
    if (m == NULL) return NULL;
    size_t dl = strlen(rt->cache_dir) + 1 + 64 + 1;
    m->dir = malloc(dl);
    pthread_condattr_t ca;
    bool ca_ok = m->dir && pthread_condattr_init(&ca) == 0;
    if (!ca_ok || pthread_mutex_init(&m->mu, NULL) != 0) {
        if (ca_ok) pthread_condattr_destroy(&ca);
        free(m->dir);
        free(m);
        return NULL;
    }
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    int e = pthread_cond_init(&m->cv, &ca);
    pthread_condattr_destroy(&ca);
    if (e != 0) {
        pthread_mutex_destroy(&m->mu);
        free(m->dir);
        free(m);
        return NULL;
    }
    snprintf(m->dir, dl, "%s/%s", rt->cache_dir, id);
    m->rt = rt;
    memcpy(m->id, id, 65);
    snprintf(m->cname, sizeof m->cname, "w%.24s", id);
    m->imports_pie = info->imports_pie;
    m->imports_wasi = info->imports_wasi;
    if (info->import_in_table) {
        const lc_wasm_import *im = &info->imports[info->table_import];
        snprintf(m->no_wasm2c, sizeof m->no_wasm2c,
                 "element segment %u puts the imported function %s.%s into a table",
                 info->table_segment, im->module, im->name);
    }
    m->state = LC_WASM_LOADING;
    return m;
}

/* Takes m out of the runtime's table (if it is there). The table holds no reference: a module
 * is listed while someone holds it (the program store, instances, a tier-1 compile), so its
 * callers decide what stays loaded. Caller holds rt->mu. */
static void table_unlink(lc_wasm_rt *rt, lc_wasm_module *m) {
    for (lc_wasm_module **p = &rt->modules; *p != NULL; p = &(*p)->next)
        if (*p == m) {
            *p = m->next;
            return;
        }
}

/* Takes m out of the tier-1 queue (if it is there). The queue holds no reference either: a
 * burst of distinct programs would otherwise stay loaded until cc -O2 had got through them all,
 * past what the program store lets stay loaded. A module dropped unbuilt is queued again when it
 * is next loaded (its tier 0 is on disk, its tier 1 is not). Caller holds rt->mu. */
static void t1_unlink(lc_wasm_rt *rt, lc_wasm_module *m) {
    lc_wasm_module *prev = NULL;
    for (lc_wasm_module *q = rt->t1_head; q != NULL; prev = q, q = q->t1_next)
        if (q == m) {
            if (prev)
                prev->t1_next = m->t1_next;
            else
                rt->t1_head = m->t1_next;
            if (rt->t1_tail == m) rt->t1_tail = prev;
            m->t1_next = NULL;
            return;
        }
}

/* Waits until m is no longer loading, or cancel fires (false). */
static bool wait_loaded(lc_wasm_module *m, lc_wasm_cancel *cancel) {
    bool given_up = false;
    pthread_mutex_lock(&m->mu);
    while (m->state == LC_WASM_LOADING) {
        if (cancel != NULL && atomic_load(&cancel->fired)) {
            given_up = true;
            break;
        }
        uint64_t t = lc_wasm_now_ns(CLOCK_MONOTONIC) + LC_WASM_CANCEL_POLL_MS * 1000000u;
        struct timespec ts = {(time_t)(t / 1000000000u), (long)(t % 1000000000u)};
        pthread_cond_timedwait(&m->cv, &m->mu, &ts);
    }
    pthread_mutex_unlock(&m->mu);
    return !given_up;
}

pie_code lc_wasm_module_load(lc_wasm_rt *rt, const void *wasm, size_t len, lc_wasm_module **out,
                             pie_status *st) {
    return lc_wasm_module_load_cancel(rt, wasm, len, NULL, out, st);
}

pie_code lc_wasm_module_load_cancel(lc_wasm_rt *rt, const void *wasm, size_t len,
                                    lc_wasm_cancel *cancel, lc_wasm_module **out, pie_status *st) {
    return lc_wasm_module_load_id(rt, wasm, len, NULL, cancel, out, st);
}

pie_code lc_wasm_module_load_id(lc_wasm_rt *rt, const void *wasm, size_t len, const char *sha256,
                                lc_wasm_cancel *cancel, lc_wasm_module **out, pie_status *st) {
    *out = NULL;
    if (wasm == NULL && len > 0)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "module bytes are NULL");
    lc_wasm_info info;
    if (lc_wasm_parse_limited(wasm, len, &rt->limits, &info, st) != PIE_OK) return st->code;
    if (lc_wasm_check_imports(&info, rt->host_fns, rt->n_host_fns, st) != PIE_OK) {
        lc_wasm_info_free(&info);
        return st->code;
    }
    char id[65];
    if (sha256) {
        snprintf(id, sizeof id, "%s", sha256);
    } else if (pie_sha256_hex(wasm, len, id, st) != PIE_OK) {
        lc_wasm_info_free(&info);
        return st->code;
    }

again:
    pthread_mutex_lock(&rt->mu);
    lc_wasm_module *m = rt->modules;
    while (m != NULL && strcmp(m->id, id) != 0) m = m->next;
    bool loader = m == NULL;
    if (loader) {
        m = module_new(rt, id, &info);
        if (m == NULL) {
            pthread_mutex_unlock(&rt->mu);
            lc_wasm_info_free(&info);
            return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory for module %s", id);
        }
        m->refs = 1; /* the caller's (the table's entry is not one) */
        m->next = rt->modules;
        rt->modules = m;
    } else {
        m->refs++;
    }
    pthread_mutex_unlock(&rt->mu);

    if (loader) {
        /* Compile without holding any lock; concurrent loads of these bytes wait on m->cv. */
        pie_status err;
        pie_code rc = lc_wasm_compile_load(m, wasm, len, cancel, &err);
        pthread_mutex_lock(&rt->mu);
        if (rc != PIE_OK) {
            table_unlink(rt, m); /* a later load tries again; before waiters see FAILED */
        } else if (m->tier1 == LC_WASM_T1_QUEUED && !rt->stopping) {
            if (rt->t1_tail)
                rt->t1_tail->t1_next = m;
            else
                rt->t1_head = m;
            rt->t1_tail = m;
            pthread_cond_signal(&rt->t1_cv);
        }
        pthread_mutex_unlock(&rt->mu);
        pthread_mutex_lock(&m->mu);
        m->state = rc == PIE_OK ? LC_WASM_READY : LC_WASM_FAILED;
        if (rc != PIE_OK) m->err = err;
        pthread_cond_broadcast(&m->cv);
        pthread_mutex_unlock(&m->mu);
    } else if (!wait_loaded(m, cancel)) {
        lc_wasm_module_release(m);
        lc_wasm_info_free(&info);
        return pie_status_set(st, PIE_CANCELLED,
                              "load cancelled while waiting for the compile of %s", id);
    }

    pthread_mutex_lock(&m->mu);
    bool ok = m->state == LC_WASM_READY;
    pie_status err = m->err;
    pthread_mutex_unlock(&m->mu);
    if (!ok) {
        lc_wasm_module_release(m);
        /* The compile we waited for was cancelled by its own caller: compile for ourselves. */
        if (!loader && err.code == PIE_CANCELLED) goto again;
        lc_wasm_info_free(&info);
        if (st) *st = err;
        return err.code;
    }
    lc_wasm_info_free(&info);
    if (!loader) atomic_fetch_add(&rt->memory_hits, 1u);
    *out = m;
    pie_status_ok(st);
    return PIE_OK;
}

const char *lc_wasm_module_id(const lc_wasm_module *m) { return m->id; }

int lc_wasm_module_tier(lc_wasm_module *m) {
    pthread_mutex_lock(&m->mu);
    int t = m->code->tier;
    pthread_mutex_unlock(&m->mu);
    return t;
}

pie_code lc_wasm_module_wait_tier1(lc_wasm_module *m, int64_t timeout_ms, pie_status *st) {
    uint64_t deadline =
        lc_wasm_now_ns(CLOCK_MONOTONIC) + (uint64_t)(timeout_ms > 0 ? timeout_ms : 0) * 1000000u;
    struct timespec ts = {(time_t)(deadline / 1000000000u), (long)(deadline % 1000000000u)};
    pthread_mutex_lock(&m->mu);
    while (m->tier1 == LC_WASM_T1_QUEUED)
        if (pthread_cond_timedwait(&m->cv, &m->mu, &ts) == ETIMEDOUT) break;
    int t1 = m->tier1;
    char err[sizeof m->tier1_err];
    memcpy(err, m->tier1_err, sizeof err);
    pthread_mutex_unlock(&m->mu);
    switch (t1) {
    case LC_WASM_T1_DONE: pie_status_ok(st); return PIE_OK;
    case LC_WASM_T1_FAILED: return pie_status_set(st, PIE_INTERNAL, "tier 1 of %s: %s", m->id, err);
    case LC_WASM_T1_OFF:
        return pie_status_set(st, PIE_FAILED_PRECONDITION, "tier 1 is disabled in this runtime");
    case LC_WASM_T1_SKIPPED:
        return pie_status_set(st, PIE_FAILED_PRECONDITION,
                              "tier 1 is not built for %s: %s, which wasm2c's code would call "
                              "with a wrong instance (it stays on tier 0, the own translator's)",
                              m->id, m->no_wasm2c);
    default:
        return pie_status_set(st, PIE_DEADLINE_EXCEEDED, "tier 1 of %s not ready after %lld ms",
                              m->id, (long long)timeout_ms);
    }
}

/* ---- instances
 * ----------------------------------------------------------------------------------- */

/* Packs n strings into one NUL-separated buffer. */
static char *pack(const char *const *v, size_t n, size_t *bytes) {
    size_t total = 0;
    for (size_t i = 0; i < n; i++) total += strlen(v[i]) + 1;
    char *buf = malloc(total ? total : 1);
    if (buf == NULL) return NULL;
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        size_t l = strlen(v[i]) + 1;
        memcpy(buf + at, v[i], l);
        at += l;
    }
    *bytes = total;
    return buf;
}

static bool strings_ok(const char *const *v, size_t n) {
    if (n > 0 && v == NULL) return false;
    for (size_t i = 0; i < n; i++)
        if (v[i] == NULL) return false;
    return true;
}

pie_code lc_wasm_instance_create(lc_wasm_module *m, const lc_wasm_instance_opts *o,
                                 lc_wasm_instance **out, pie_status *st) {
    *out = NULL;
    static const lc_wasm_instance_opts none = {0};
    if (o == NULL) o = &none;
    if (!strings_ok(o->argv, o->argc) || !strings_ok(o->env, o->n_env))
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "argv/env: NULL array or NULL string");
    if (o->argc > 65536 || o->n_env > 65536)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "more than 65536 arguments or variables");
    if (o->limits.max_memory_pages > LC_WASM_MAX_PAGES)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "limits.max_memory_pages %u exceeds %u",
                              o->limits.max_memory_pages, LC_WASM_MAX_PAGES);

    lc_wasm_instance *inst = calloc(1, sizeof *inst);
    if (inst == NULL) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
    pthread_mutex_lock(&m->mu);
    inst->code = m->code;
    atomic_fetch_add(&inst->code->refs, 1);
    pthread_mutex_unlock(&m->mu);
    pthread_mutex_lock(&m->rt->mu);
    m->refs++;
    pthread_mutex_unlock(&m->rt->mu);
    inst->mod = m;

    inst->args_buf = pack(o->argv, o->argc, &inst->args_bytes);
    inst->env_buf = pack(o->env, o->n_env, &inst->env_bytes);
    inst->z = calloc(1, inst->code->instance_size ? inst->code->instance_size : 1);
    pthread_condattr_t ca;
    bool sync_ok = false;
    if (pthread_condattr_init(&ca) == 0) {
        if (pthread_condattr_setclock(&ca, CLOCK_MONOTONIC) == 0 &&
            pthread_mutex_init(&inst->mu, NULL) == 0) {
            if (pthread_cond_init(&inst->cv, &ca) == 0)
                sync_ok = true;
            else
                pthread_mutex_destroy(&inst->mu);
        }
        pthread_condattr_destroy(&ca);
    }
    if (!inst->args_buf || !inst->env_buf || !inst->z || !sync_ok) {
        free(inst->args_buf);
        free(inst->env_buf);
        free(inst->z);
        lc_wasm_code_release(inst->code);
        lc_wasm_module_release(m);
        free(inst);
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory for an instance");
    }
    inst->argc = o->argc;
    inst->n_env = o->n_env;
    inst->limits = o->limits;
    inst->output = o->output;
    inst->output_ctx = o->output_ctx;
    inst->on_interrupt = o->on_interrupt;
    inst->budget = o->budget;
    inst->pie = (struct Z_pie_instance_t){inst, o->host};
    inst->wasi = (struct Z_wasi_snapshot_preview1_instance_t){inst, o->host};
    inst->wall_deadline_ns = UINT64_MAX;
    atomic_init(&inst->interrupt, 0);
    *out = inst;
    pie_status_ok(st);
    return PIE_OK;
}

/* A timer that sends the interrupt signal with `why` to the calling thread. */
static bool make_timer(clockid_t clock, int why, timer_t *t) {
    struct sigevent sev;
    memset(&sev, 0, sizeof sev);
    sev.sigev_notify = SIGEV_THREAD_ID;
    sev.sigev_signo = lc_wasm_interrupt_signal();
    sev.sigev_value.sival_int = why;
    sev._sigev_un._tid = gettid(); /* glibc 2.36 has no sigev_notify_thread_id macro */
    return timer_create(clock, &sev, t) == 0;
}

static void arm(timer_t t, uint64_t after_ns) {
    struct itimerspec its = {
        .it_interval = {0, LC_WASM_REPEAT_NS},
        .it_value = {(time_t)(after_ns / 1000000000u), (long)(after_ns % 1000000000u)},
    };
    if (its.it_value.tv_sec == 0 && its.it_value.tv_nsec == 0) its.it_value.tv_nsec = 1;
    timer_settime(t, 0, &its, NULL);
}

/* Timers for the run; a failure leaves that quota unenforced and is reported. */
static pie_code start_timers(lc_wasm_instance *inst, pie_status *st) {
    clockid_t cpu;
    if (inst->limits.cpu_ms) {
        if (pthread_getcpuclockid(pthread_self(), &cpu) != 0 ||
            !make_timer(cpu, LC_WASM_TRAP_CPU_TIME, &inst->cpu_timer))
            return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "CPU timer: %s", strerror(errno));
        inst->has_cpu_timer = true;
        arm(inst->cpu_timer, inst->limits.cpu_ms * 1000000u);
    }
    if (!make_timer(CLOCK_MONOTONIC, LC_WASM_TRAP_WALL_TIME, &inst->kill_timer))
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "wall timer: %s", strerror(errno));
    inst->has_kill_timer = true;
    if (inst->limits.wall_ms) {
        inst->wall_deadline_ns = lc_wasm_now_ns(CLOCK_MONOTONIC) + inst->limits.wall_ms * 1000000u;
        arm(inst->kill_timer, inst->limits.wall_ms * 1000000u);
    }
    return PIE_OK;
}

static void stop_timers(lc_wasm_instance *inst) {
    if (inst->has_cpu_timer) timer_delete(inst->cpu_timer);
    if (inst->has_kill_timer) timer_delete(inst->kill_timer);
    inst->has_cpu_timer = inst->has_kill_timer = false;
}

/* Gives the thread an alternate signal stack (a fault from stack exhaustion needs one) unless it
 * has one already; *buf is what altstack_pop frees (NULL if the existing one was kept). */
static pie_code altstack_push(stack_t *saved, void **buf, pie_status *st) {
    *buf = NULL;
    if (sigaltstack(NULL, saved) != 0)
        return pie_status_set(st, PIE_INTERNAL, "sigaltstack: %s", strerror(errno));
    if (!(saved->ss_flags & SS_DISABLE) && saved->ss_size >= LC_WASM_ALTSTACK) return PIE_OK;
    void *b = malloc(LC_WASM_ALTSTACK);
    if (b == NULL)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory (signal stack)");
    stack_t ss = {.ss_sp = b, .ss_flags = 0, .ss_size = LC_WASM_ALTSTACK};
    if (sigaltstack(&ss, NULL) != 0) {
        free(b);
        return pie_status_set(st, PIE_INTERNAL, "sigaltstack: %s", strerror(errno));
    }
    *buf = b;
    return PIE_OK;
}

static void altstack_pop(void *buf, const stack_t *saved) {
    if (buf == NULL) return;
    stack_t restore = *saved;
    if (restore.ss_flags & SS_DISABLE) restore = (stack_t){.ss_flags = SS_DISABLE};
    sigaltstack(&restore, NULL);
    free(buf);
}

static void describe(lc_wasm_instance *inst, int reason, bool instantiated, lc_wasm_outcome *out) {
    size_t n = sizeof out->message;
    int w = 0;
    if (reason == 0 || reason == LC_WASM_TRAP_EXIT) {
        out->end = LC_WASM_EXITED;
        out->exit_code = reason ? inst->exit_code : 0;
        w = snprintf(out->message, n, "exited with code %d", out->exit_code);
    } else if (reason == LC_WASM_TRAP_CPU_TIME || reason == LC_WASM_TRAP_WALL_TIME ||
               reason == LC_WASM_TRAP_TERMINATED) {
        out->end = LC_WASM_INTERRUPTED;
        out->trap = (lc_wasm_trap)reason;
        if (reason == LC_WASM_TRAP_CPU_TIME)
            w = snprintf(out->message, n, "interrupted: CPU time quota of %llu ms used up",
                         (unsigned long long)inst->limits.cpu_ms);
        else if (reason == LC_WASM_TRAP_WALL_TIME)
            w = snprintf(out->message, n, "interrupted: wall-time quota of %llu ms passed",
                         (unsigned long long)inst->limits.wall_ms);
        else
            w = snprintf(out->message, n, "interrupted: terminated on request");
    } else {
        out->end = LC_WASM_TRAPPED;
        out->trap = (lc_wasm_trap)reason;
        const char *what = reason == LC_WASM_TRAP_MEMORY_LIMIT || reason == LC_WASM_TRAP_HOST
                               ? inst->trap_msg
                               : lc_wasm_trap_text(reason);
        w = snprintf(out->message, n, "trapped%s: %s", instantiated ? "" : " during instantiation",
                     what);
    }
    if (inst->budget_refusals && w > 0 && (size_t)w < n)
        w += snprintf(out->message + w, n - (size_t)w,
                      "; memory.grow refused %u time%s: the replica's memory budget "
                      "(limits.replica_memory) was spent",
                      inst->budget_refusals, inst->budget_refusals == 1 ? "" : "s");
    if (inst->memory_refusals && w > 0 && (size_t)w < n) {
        uint32_t lim = inst->limits.max_memory_pages ? inst->limits.max_memory_pages : 16384;
        snprintf(out->message + w, n - (size_t)w,
                 "; memory.grow refused %u time%s at the instance limit of %u pages (%u MiB), "
                 "the last request wanted %u pages",
                 inst->memory_refusals, inst->memory_refusals == 1 ? "" : "s", lim, lim / 16,
                 inst->refused_pages);
    }
}

/* Instantiate and _start inside the frame; returns 0 or the reason the frame was unwound with.
 * Kept apart so that no local of the caller lives across sigsetjmp. */
static __attribute__((noinline)) int run_guarded(lc_wasm_instance *inst, lc_wasm_frame *f,
                                                 volatile bool *instantiated) {
    lc_wasm_frame_enter(f);
    int reason = sigsetjmp(f->jmp, 1);
    if (reason == 0) {
        inst->code->instantiate(inst->z, &inst->pie, &inst->wasi);
        *instantiated = true;
        inst->code->start(inst->z);
    }
    lc_wasm_frame_leave();
    return reason;
}

pie_code lc_wasm_instance_run(lc_wasm_instance *inst, lc_wasm_outcome *out, pie_status *st) {
    memset(out, 0, sizeof *out);
    if (lc_wasm_frame_current() != NULL)
        return pie_status_set(st, PIE_FAILED_PRECONDITION,
                              "lc_wasm_instance_run called from inside a running instance");
    uintptr_t stack_lo;
    size_t guard;
    lc_wasm_thread_stack(&stack_lo, &guard);
    if (guard < LC_WASM_MIN_GUARD)
        return pie_status_set(st, PIE_FAILED_PRECONDITION,
                              "the calling thread's stack guard is %zu bytes; run instances on "
                              "threads made with lc_wasm_thread_attr_init (guard >= %u bytes)",
                              guard, LC_WASM_MIN_GUARD);
    pthread_mutex_lock(&inst->mu);
    if (inst->state != 0) {
        pthread_mutex_unlock(&inst->mu);
        return pie_status_set(st, PIE_FAILED_PRECONDITION, "instance already ran");
    }
    inst->state = 1;
    pie_code rc = start_timers(inst, st);
    pthread_mutex_unlock(&inst->mu);

    lc_wasm_frame f;
    memset(&f, 0, sizeof f);
    f.inst = inst;
    f.text_lo = inst->code->text_lo;
    f.text_hi = inst->code->text_hi;
    f.stack_lo = stack_lo;
    f.guard_lo = stack_lo - guard;
    stack_t saved_alt;
    void *alt = NULL;
    if (rc == PIE_OK) rc = altstack_push(&saved_alt, &alt, st);
    uint64_t cpu0 = lc_wasm_now_ns(CLOCK_THREAD_CPUTIME_ID);
    uint64_t wall0 = lc_wasm_now_ns(CLOCK_MONOTONIC);

    volatile bool instantiated = false;
    int reason = atomic_load(&inst->interrupt); /* terminated before it started */
    if (rc == PIE_OK && reason == 0) reason = run_guarded(inst, &f, &instantiated);

    pthread_mutex_lock(&inst->mu);
    stop_timers(inst);
    inst->state = 2;
    pthread_mutex_unlock(&inst->mu);
    altstack_pop(alt, &saved_alt);
    if (rc != PIE_OK) return rc;
    out->cpu_ns = lc_wasm_now_ns(CLOCK_THREAD_CPUTIME_ID) - cpu0;
    out->wall_ns = lc_wasm_now_ns(CLOCK_MONOTONIC) - wall0;
    out->memory_pages = inst->mem0 ? inst->mem0->pages : 0;
    out->memory_refusals = inst->memory_refusals;
    out->tier = inst->code->tier;
    describe(inst, reason, instantiated, out);
    pie_status_ok(st);
    return PIE_OK;
}

void lc_wasm_instance_interrupt(lc_wasm_instance *inst) {
    pthread_mutex_lock(&inst->mu);
    int none = 0;
    atomic_compare_exchange_strong(&inst->interrupt, &none, LC_WASM_TRAP_TERMINATED);
    bool call = inst->state != 2;
    if (inst->state == 1 && inst->has_kill_timer) arm(inst->kill_timer, 0);
    pthread_cond_broadcast(&inst->cv);
    void (*cb)(void *) = inst->on_interrupt;
    void *host = inst->pie.host;
    pthread_mutex_unlock(&inst->mu);
    if (call && cb) cb(host);
}

void lc_wasm_instance_free(lc_wasm_instance *inst) {
    if (inst == NULL) return;
    pthread_mutex_lock(&inst->mu);
    int state = inst->state;
    pthread_mutex_unlock(&inst->mu);
    if (state == 1) {
        fprintf(stderr, "lc_wasm: lc_wasm_instance_free called while the instance runs\n");
        abort();
    }
    inst->code->free_instance(inst->z); /* memories and tables, through wasm_rt_free_* */
    pie_budget_give(inst->budget, atomic_load(&inst->memory_pages) * LC_WASM_PAGE_BYTES);
    free(inst->z);
    free(inst->exception);
    free(inst->args_buf);
    free(inst->env_buf);
    pthread_cond_destroy(&inst->cv);
    pthread_mutex_destroy(&inst->mu);
    lc_wasm_code_release(inst->code);
    lc_wasm_module_release(inst->mod);
    free(inst);
}

/* ---- host function helpers ------------------------------------------------------------------- */

lc_wasm_instance *lc_wasm_enter(lc_wasm_instance *inst) {
    lc_wasm_frame *f = lc_wasm_frame_current();
    if (f == NULL || f->inst != inst) {
        fprintf(stderr, "lc_wasm: host function called outside the run of its instance\n");
        abort();
    }
    uintptr_t sp = (uintptr_t)__builtin_frame_address(0);
    if (f->stack_lo != 0 && sp < f->stack_lo + LC_WASM_HOST_HEADROOM)
        lc_wasm_unwind(LC_WASM_TRAP_EXHAUSTION);
    return inst;
}

/* The instance that runs on this thread, checked against the context pointer that a host
 * function received (own: that instance's pie or wasi struct) before anything is read through
 * it. wasm2c 1.0.32's code passes a pointer into its own instance struct instead when an import
 * is called through a table (lc_wasm_info.import_in_table): such modules no longer run on
 * wasm2c's code, but if one still did (a library cached by an older version, say), its call
 * traps that instance rather than reading a wrong struct or aborting the process. */
static lc_wasm_instance *enter_checked(const void *ctx, bool pie) {
    lc_wasm_frame *f = lc_wasm_frame_current();
    if (f == NULL || f->inst == NULL) {
        fprintf(stderr, "lc_wasm: host function called outside the run of an instance\n");
        abort();
    }
    const void *own = pie ? (const void *)&f->inst->pie : (const void *)&f->inst->wasi;
    if (ctx != own)
        lc_wasm_host_trap(f->inst, "a host function was called with a wrong instance pointer "
                                   "(wasm2c's code calling an import through a table)");
    return lc_wasm_enter(f->inst);
}

lc_wasm_instance *lc_wasm_host_enter(struct Z_pie_instance_t *pie) {
    return enter_checked(pie, true);
}

lc_wasm_instance *lc_wasm_wasi_enter(struct Z_wasi_snapshot_preview1_instance_t *wasi) {
    return enter_checked(wasi, false);
}

void *lc_wasm_mem(lc_wasm_instance *inst, uint32_t addr, uint32_t len) {
    const wasm_rt_memory_t *m = inst->mem0;
    if (m == NULL || (uint64_t)addr + len > m->size) return NULL;
    return m->data + addr;
}

_Noreturn void lc_wasm_host_trap(lc_wasm_instance *inst, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(inst->trap_msg, sizeof inst->trap_msg, fmt, ap);
    va_end(ap);
    lc_wasm_unwind(LC_WASM_TRAP_HOST);
}

bool lc_wasm_interrupted(const lc_wasm_instance *inst) {
    return atomic_load(&inst->interrupt) != 0;
}

void lc_wasm_host_checkpoint(lc_wasm_instance *inst) {
    int r = atomic_load(&inst->interrupt);
    if (r != 0) lc_wasm_unwind(r);
}

uint64_t lc_wasm_wall_deadline_ns(const lc_wasm_instance *inst) { return inst->wall_deadline_ns; }

uint64_t lc_wasm_instance_memory_bytes(const lc_wasm_instance *inst) {
    return atomic_load_explicit(&inst->memory_pages, memory_order_relaxed) * LC_WASM_PAGE_BYTES;
}
