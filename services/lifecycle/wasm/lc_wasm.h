/* lc_wasm.h — the WebAssembly inferlet runtime of the lifecycle service (public interface).
 *
 * Owns: turning wasm bytes into native code (validate → wasm2c → tcc tier 0 → dlopen, with a
 * background cc -O2 tier 1 and an on-disk cache keyed by SHA-256), running one instance of a
 * module on the calling thread with per-instance traps, guard-page memories, a memory limit,
 * CPU/wall-time quotas and a structured outcome, the WASI preview1 subset, and the mechanism by
 * which the host provides the functions of the `pie` import module.
 * Does not own: the `pie` host API itself (the host binary defines those functions), threads
 * (the caller runs each instance on a thread of its own, see lc_wasm_thread_attr_init), program
 * upload and storage. Start reading at lc_wasm_module_load and lc_wasm_instance_run; the design
 * is in services/lifecycle/wasm/README.md. */
#ifndef LC_WASM_H
#define LC_WASM_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pie_budget.h"
#include "pie_status.h"

typedef struct lc_wasm_rt lc_wasm_rt;             /* one runtime: cache, compiler thread */
typedef struct lc_wasm_module lc_wasm_module;     /* one program, shared by its instances */
typedef struct lc_wasm_instance lc_wasm_instance; /* one running inferlet */

/* ---- host import modules -------------------------------------------------------------------
 * wasm2c turns an import `pie.forward` into a call of the external C function
 * `Z_pieZ_forward(struct Z_pie_instance_t *, ...)` which the dlopen'ed module resolves against the
 * host executable (linked with ENABLE_EXPORTS / -rdynamic). Its first argument is the struct
 * below: the instance it runs for and the host's per-instance context. */
struct Z_pie_instance_t {
    lc_wasm_instance *inst;
    void *host; /* lc_wasm_instance_opts.host */
};
struct Z_wasi_snapshot_preview1_instance_t {
    lc_wasm_instance *inst;
    void *host;
};

/* One function of the `pie` import module that the host provides. `type` is the wasm type in
 * WAT syntax with i32/i64/f32/f64 (parameters then results, either part omitted when empty):
 * "(param i32 i32) (result i32)", "(param i64)", "(result f64)", "". A module is accepted only if
 * every `pie` import it declares has exactly this name and type. The C function must be
 * `Z_pieZ_<name>` with u32/u64/float/double per wasm type, `void` for no result, and be exported
 * by the executable; LC_WASM_HOST_FN builds the entry from the name. Names with characters other
 * than [A-Za-z0-9_] or with a 'Z' are mangled by wasm2c ('.' → "Z2E", 'Z' → "Z5A"): write such
 * entries by hand. */
typedef struct lc_wasm_host_fn {
    const char *name;
    const char *type;
    void (*fn)(void); /* &Z_pieZ_<mangled name>, cast; checked against the exported symbol */
} lc_wasm_host_fn;
#define LC_WASM_HOST_FN(name, type) \
    { #name, type, (void (*)(void))Z_pieZ_##name }

/* ---- runtime -------------------------------------------------------------------------------- */

/* Limits on a module's complexity, checked by the parser before anything is compiled: wasm2c's
 * time grows faster than linearly with the number of functions (10,000 empty ones: 1.3 s,
 * 20,000: 9 s) and its native stack with the nesting of blocks (it crashes near 15,000 levels
 * on an 8 MiB stack). A module beyond one is refused with INVALID_ARGUMENT naming the limit, its
 * value and the lifecycle's config key. 0 = the default. */
typedef struct lc_wasm_module_limits {
    uint32_t max_functions;      /* functions the module defines; 0 = 20000 */
    uint32_t max_function_bytes; /* bytes of one function body (locals and code); 0 = 1 MiB */
    uint32_t max_nesting;        /* blocks, loops and ifs open at once in a body; 0 = 4096 */
} lc_wasm_module_limits;
#define LC_WASM_DEFAULT_MAX_FUNCTIONS      20000u
#define LC_WASM_DEFAULT_MAX_FUNCTION_BYTES (1u << 20)
#define LC_WASM_DEFAULT_MAX_NESTING        4096u
#define LC_WASM_MAX_LOCALS                 50000u /* locals of one function (as V8), fixed */
/* Parameters and results of one function type together, fixed: tcc (tier 0) keeps every
 * argument of a call, and each value of the variadic wasm_rt_register_func_type call that
 * registers a type, on a value stack of 256 entries ("memory full (vstack)" beyond ~254). */
#define LC_WASM_MAX_TYPE_ARITY 224u

typedef struct lc_wasm_rt_opts {
    const char *cache_dir;           /* required; created (0700) if missing */
    const lc_wasm_host_fn *host_fns; /* the `pie` module; may be NULL when n_host_fns is 0 */
    size_t n_host_fns;
    bool tier1;                    /* recompile with `cc -O2` in the background */
    const char *wasm2c, *tcc, *cc; /* programs; NULL = "wasm2c", "tcc", "cc" from PATH */
    int interrupt_signal;          /* real-time signal of the CPU/wall watchdog; 0 = SIGRTMIN+4 */
    lc_wasm_module_limits module_limits;
    /* Compiles. A tier-0 compile (wasm2c | tcc, what a load waits for) that runs longer than
     * compile_timeout_ms is killed and the load fails RESOURCE_EXHAUSTED; a tier-1 compile
     * longer than tier1_timeout_ms is killed and the module stays at tier 0. At most
     * max_compiles tier-0 compiles run at once; up to compile_queue more loads wait for one
     * to end, and a load beyond those fails RESOURCE_EXHAUSTED at once. */
    uint64_t compile_timeout_ms; /* 0 = 60 s */
    uint64_t tier1_timeout_ms;   /* 0 = 10 min */
    uint32_t max_compiles;       /* 0 = 2 */
    int32_t compile_queue;       /* 0 = 32; negative: no waiting */
    /* Bytes the cache directory may hold (0: no bound). Past it, entries of modules not loaded
     * in this runtime are removed, least recently used first, down to 3/4 of it; a removed
     * entry's next load compiles again. */
    uint64_t cache_max_bytes;
    /* Tier 0 translates with lc_wasm's own translator (lc_wasm_xlate.c) and falls back to
     * wasm2c for modules it declines. true, or the environment variable PIE_WASM_TIER0=wasm2c
     * when the runtime is created, makes tier 0 use wasm2c for every module (A/B comparisons,
     * and an escape hatch). Tier 1 always uses wasm2c | cc -O2. */
    bool tier0_wasm2c;
    /* pie-tcc-helper (helper/lc_tcc_helper.c): tier 0's own-translator compiles go to such a
     * long-lived libtcc process, one per compile slot, started on first use and again after
     * it crashed or was killed (a timeout, a cancel); a compile that finds every helper busy,
     * or none startable, runs a tcc child as without one. NULL: tcc children only. */
    const char *tcc_helper;
} lc_wasm_rt_opts;

/* Counters since the runtime was created (tests and metrics). */
typedef struct lc_wasm_rt_stats {
    uint64_t translations;     /* wasm2c runs */
    uint64_t own_translations; /* modules lc_wasm_xlate translated for tier 0 */
    uint64_t own_declines;     /* modules it declined (tier 0 used wasm2c for them) */
    uint64_t tier0_compiles;   /* tcc runs (children and helpers) */
    uint64_t helper_compiles;  /* of them, compiled by a pie-tcc-helper */
    uint64_t helper_starts;    /* pie-tcc-helper processes started */
    uint64_t tier1_compiles;   /* cc -O2 runs that produced a library */
    uint64_t disk_hits;        /* loads served from the cache directory without compiling */
    uint64_t memory_hits;      /* loads served from modules already loaded in this runtime */
    uint32_t compiles_running; /* tier-0 compiles in progress now */
    uint32_t compiles_queued;  /* loads waiting now for one of them to end */
    uint32_t modules_loaded;   /* modules loaded now (someone holds each) */
    uint32_t tier1_queued;     /* loaded modules waiting now for their tier-1 compile */
    uint64_t cache_bytes;      /* the cache directory's size as this runtime estimates it */
    uint64_t cache_removals;   /* entries removed to keep it within cache_max_bytes */
    /* Where the wall time of the tier-0 compiles that succeeded went, summed over them (ns,
     * CLOCK_MONOTONIC; the benchmark takes differences): */
    uint64_t t0_files_ns;     /* cache entry: mkdir, lock, module.wasm, t0.h and wasm.h */
    uint64_t t0_translate_ns; /* wasm2c | compiler started → wasm2c ended; or tcc started → our
                                 translator (in process, feeding tcc as it goes) ended */
    uint64_t t0_compile_ns;   /* the same start → the compiler ended (tcc overlaps wasm2c) */
    uint64_t t0_open_ns;      /* dlopen of t0.so, its glue symbols, init_module */
} lc_wasm_rt_stats;

/* Creates a runtime: installs the fault and interrupt signal handlers (process-wide, shared by
 * all runtimes, removed with the last one), checks that the executable exports the wasm-rt
 * interface and every host function, starts the tier-1 compiler thread. */
pie_code lc_wasm_rt_create(const lc_wasm_rt_opts *opts, lc_wasm_rt **out, pie_status *st);
/* Stops the tier-1 thread (killing a compile in progress) and unloads every module. All
 * instances and module references must have been released. NULL is a no-op. */
void lc_wasm_rt_destroy(lc_wasm_rt *rt);
lc_wasm_rt_stats lc_wasm_rt_stats_get(lc_wasm_rt *rt);
/* Removes the cache entry (native code) of module id, e.g. when its program is deleted: PIE_OK
 * when removed or absent; FAILED_PRECONDITION when a module of it is loaded in this runtime or
 * its compile is running (the entry stays; the bound prunes it later). */
pie_code lc_wasm_rt_forget(lc_wasm_rt *rt, const char *id, pie_status *st);
/* Shutdown: kills every compile in progress (their loads fail UNAVAILABLE within ~50 ms) and
 * fails every later load that would have to compile; loads of compiled modules still work.
 * Thread-safe, idempotent; lc_wasm_rt_destroy is still needed. */
void lc_wasm_rt_stop_compiles(lc_wasm_rt *rt);

/* ---- modules -------------------------------------------------------------------------------- */

/* Returns a reference to the module for these bytes: from this runtime's memory, else from the
 * cache directory, else validated, translated and compiled at tier 0 now (one compile for
 * concurrent loads of the same bytes, also across processes sharing the directory). Rejects
 * (INVALID_ARGUMENT) non-wasm and corrupt bytes, modules beyond the runtime's module_limits,
 * modules without a `_start` of type () -> (), and modules whose imports the host does not
 * provide (all such imports are listed in the message). A compile that passes
 * compile_timeout_ms, or that finds max_compiles running and compile_queue waiting, fails
 * RESOURCE_EXHAUSTED; after lc_wasm_rt_stop_compiles a load that must compile fails
 * UNAVAILABLE. */
pie_code lc_wasm_module_load(lc_wasm_rt *rt, const void *wasm, size_t len, lc_wasm_module **out,
                             pie_status *st);

/* A caller's way to give up on a load: lc_wasm_cancel_fire (any thread, any time, once or more)
 * makes a load that was given this token stop within ~50 ms, killing its compile (the
 * compiler's whole process group) or leaving the queue, with PIE_CANCELLED. A load of the same
 * bytes by another caller that was waiting for that compile compiles again for itself. The
 * token must outlive the load and every fire. */
typedef struct lc_wasm_cancel {
    atomic_bool fired;
} lc_wasm_cancel;
static inline void lc_wasm_cancel_init(lc_wasm_cancel *c) { atomic_init(&c->fired, false); }
static inline void lc_wasm_cancel_fire(lc_wasm_cancel *c) { atomic_store(&c->fired, true); }
/* lc_wasm_module_load that stops when cancel (may be NULL) fires. */
pie_code lc_wasm_module_load_cancel(lc_wasm_rt *rt, const void *wasm, size_t len,
                                    lc_wasm_cancel *cancel, lc_wasm_module **out, pie_status *st);
/* lc_wasm_module_load_cancel of bytes whose SHA-256 the caller computed (sha256, 64 lowercase
 * hex digits; NULL: hashed here). It must be theirs: it names the module and its cache files. */
pie_code lc_wasm_module_load_id(lc_wasm_rt *rt, const void *wasm, size_t len, const char *sha256,
                                lc_wasm_cancel *cancel, lc_wasm_module **out, pie_status *st);
/* Drops a reference; the last one unloads the module (unmaps its native code; its disk cache
 * stays): the runtime keeps a module only while someone holds it. NULL is a no-op. */
void lc_wasm_module_release(lc_wasm_module *m);
/* Lower-case hex SHA-256 of the module's bytes (64 characters): its content id. */
const char *lc_wasm_module_id(const lc_wasm_module *m);
/* Tier that the next instance will use: 0 (tcc) or 1 (cc -O2). */
int lc_wasm_module_tier(lc_wasm_module *m);
/* Waits until tier 1 is in use (PIE_OK), failed (PIE_INTERNAL with the compiler's message), is
 * disabled or not built for this module (PIE_FAILED_PRECONDITION, saying why), or timeout_ms
 * passed (PIE_DEADLINE_EXCEEDED). */
pie_code lc_wasm_module_wait_tier1(lc_wasm_module *m, int64_t timeout_ms, pie_status *st);

/* Writes len bytes to path through a unique temporary name in the same directory and rename(2),
 * so readers (other threads, other replicas sharing the directory) see the whole file or none.
 * No fsync: the cache and the program store are rebuildable. PIE_INTERNAL naming the file. */
pie_code lc_wasm_write_file(const char *path, const void *data, size_t len, pie_status *st);

/* ---- instances ------------------------------------------------------------------------------ */

/* Receives what the instance writes to stdout (fd 1) and stderr (fd 2); called on the instance's
 * thread, in the order written. */
typedef void (*lc_wasm_output_fn)(void *ctx, int fd, const char *data, size_t len);

/* The largest linear memory an instance may have: 65,535 pages of 64 KiB, 64 KiB short of the
 * 4 GiB a wasm32 memory could address (wasm_rt_memory_t.size is a uint32_t). */
#define LC_WASM_MAX_MEMORY_PAGES 65535u

typedef struct lc_wasm_limits {
    /* linear memory cap in 64 KiB pages, at most LC_WASM_MAX_MEMORY_PAGES; 0 = 16384 (1 GiB) */
    uint32_t max_memory_pages;
    uint32_t max_table_elems; /* funcref/externref table cap; 0 = 65536 */
    uint64_t cpu_ms;          /* CPU time of the instance's thread; 0 = unlimited */
    uint64_t wall_ms;         /* wall time of run; 0 = unlimited (see lc_wasm_wall_deadline_ns) */
} lc_wasm_limits;

typedef struct lc_wasm_instance_opts {
    const char *const *argv; /* argv[0] is the program name; copied */
    size_t argc;
    const char *const *env; /* "KEY=VALUE" strings; copied */
    size_t n_env;
    lc_wasm_limits limits;
    lc_wasm_output_fn output; /* NULL: output is discarded */
    void *output_ctx;
    void *host;                       /* per-instance host context, see Z_pie_instance_t */
    void (*on_interrupt)(void *host); /* lc_wasm_instance_interrupt calls this, so that a host
                                         call blocked in a wait can wake up; may be NULL */
    /* Shared by the instances of a replica (limits.replica_memory): linear memory is charged
     * to it as allocated and grown and given back when the instance is freed; an initial memory
     * that does not fit fails the instantiation, a memory.grow that does not fit returns -1.
     * NULL: none. Must outlive the instance. */
    pie_budget *budget;
} lc_wasm_instance_opts;

typedef enum lc_wasm_end {
    LC_WASM_EXITED = 1,  /* _start returned (code 0) or proc_exit(code) */
    LC_WASM_TRAPPED,     /* the wasm code failed; trap says how */
    LC_WASM_INTERRUPTED, /* stopped from outside: CPU or wall quota, or terminated */
} lc_wasm_end;

/* Every way an instance can end other than exiting. The first eight equal wasm_rt_trap_t. */
typedef enum lc_wasm_trap {
    LC_WASM_TRAP_NONE = 0,
    LC_WASM_TRAP_OOB,                /* linear memory or table access out of bounds */
    LC_WASM_TRAP_INT_OVERFLOW,       /* INT_MIN / -1, or a float too large to truncate */
    LC_WASM_TRAP_DIV_BY_ZERO,        /* integer division or remainder by zero */
    LC_WASM_TRAP_INVALID_CONVERSION, /* NaN truncated to an integer */
    LC_WASM_TRAP_UNREACHABLE,        /* `unreachable` (abort(), __builtin_trap()) */
    LC_WASM_TRAP_CALL_INDIRECT,      /* call_indirect: null, out of table, wrong signature */
    LC_WASM_TRAP_UNCAUGHT_EXCEPTION, /* wasm exception not caught */
    LC_WASM_TRAP_EXHAUSTION,         /* native call stack exhausted (recursion too deep) */
    LC_WASM_TRAP_MEMORY_LIMIT, /* instantiation needs more memory than allowed / mmap failed */
    LC_WASM_TRAP_HOST,         /* a host function ended the instance (lc_wasm_host_trap) */
    LC_WASM_TRAP_EXIT,         /* internal: proc_exit, reported as LC_WASM_EXITED */
    LC_WASM_TRAP_CPU_TIME,     /* interrupted: CPU quota used up */
    LC_WASM_TRAP_WALL_TIME,    /* interrupted: wall-time quota passed */
    LC_WASM_TRAP_TERMINATED,   /* interrupted: lc_wasm_instance_interrupt */
} lc_wasm_trap;

typedef struct lc_wasm_outcome {
    lc_wasm_end end;
    int exit_code;     /* LC_WASM_EXITED */
    lc_wasm_trap trap; /* LC_WASM_TRAPPED / LC_WASM_INTERRUPTED */
    char message[320]; /* one line for the client: "exited with code 3", "trapped: integer
                          divide by zero", "interrupted: CPU time quota of 200 ms used up";
                          a refused memory.grow is appended ("; memory.grow refused ...") */
    uint64_t cpu_ns;   /* CPU time of the run (instantiate + _start) */
    uint64_t wall_ns;
    uint32_t memory_pages;    /* linear memory size at the end */
    uint32_t memory_refusals; /* memory.grow calls refused by the instance's limit */
    int tier;                 /* code tier that ran */
} lc_wasm_outcome;

/* Prepares an instance of m (takes its own reference to m): copies arguments and environment,
 * allocates the instance. Nothing of the wasm module runs yet. */
pie_code lc_wasm_instance_create(lc_wasm_module *m, const lc_wasm_instance_opts *opts,
                                 lc_wasm_instance **out, pie_status *st);
/* Instantiates the module (memories, tables, data, its start function) and runs `_start` on the
 * calling thread, catching every trap; fills out. Once per instance. Returns PIE_OK when out
 * describes the run, else an error without running: called twice, or the calling thread's stack
 * guard is below 64 KiB (make threads with lc_wasm_thread_attr_init; the main thread is fine). */
pie_code lc_wasm_instance_run(lc_wasm_instance *inst, lc_wasm_outcome *out, pie_status *st);
/* Asks a running (or not yet started) instance to stop: it ends INTERRUPTED/TERMINATED as soon as
 * it executes wasm code. Thread-safe; any thread; no-op once the run ended. */
void lc_wasm_instance_interrupt(lc_wasm_instance *inst);
/* Bytes of linear memory the instance holds now (all its memories). Thread-safe; any thread,
 * while the instance exists. */
uint64_t lc_wasm_instance_memory_bytes(const lc_wasm_instance *inst);
/* Frees the instance, its memories and tables, and its module reference. Not while running. */
void lc_wasm_instance_free(lc_wasm_instance *inst);

/* Thread attributes for a thread that runs instances: the given stack size (0 = 8 MiB) and a
 * 1 MiB guard (address space only), so that deep wasm recursion faults in the guard and becomes a
 * trap. Returns 0 or an errno value. */
int lc_wasm_thread_attr_init(pthread_attr_t *attr, size_t stack_bytes);

/* ---- for host functions (called on the instance's thread, from inside a host import) -------- */

/* The instance a host call runs for. Every host function calls this first, before it reads
 * anything through pie: it checks that pie is the running instance's (a wrong pointer traps that
 * instance) and that at least 128 KiB of native stack are left, trapping (EXHAUSTION) otherwise,
 * which is what lets a stack overflow be treated as a trap of the wasm code (README, "stack"). */
lc_wasm_instance *lc_wasm_host_enter(struct Z_pie_instance_t *pie);
/* Pointer to len bytes of linear memory at addr, or NULL if any of them is out of bounds. Valid
 * until the host call returns (memory.grow may not move it, but a later call may fail). */
void *lc_wasm_mem(lc_wasm_instance *inst, uint32_t addr, uint32_t len);
/* Ends the instance with LC_WASM_TRAPPED/LC_WASM_TRAP_HOST and this message. Never returns; call
 * only with no locks held and nothing left to free on the host side. */
_Noreturn void lc_wasm_host_trap(lc_wasm_instance *inst, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* True once the instance was asked to stop (quota or terminate). A host call that waits should
 * wait at most until lc_wasm_wall_deadline_ns, wake on opts.on_interrupt, and then call
 * lc_wasm_host_checkpoint. */
bool lc_wasm_interrupted(const lc_wasm_instance *inst);
/* Ends the instance (as lc_wasm_host_trap, with the interrupt's reason) if it was asked to stop. */
void lc_wasm_host_checkpoint(lc_wasm_instance *inst);
/* CLOCK_MONOTONIC time in ns at which the wall-time quota ends; UINT64_MAX if unlimited. */
uint64_t lc_wasm_wall_deadline_ns(const lc_wasm_instance *inst);

#endif
