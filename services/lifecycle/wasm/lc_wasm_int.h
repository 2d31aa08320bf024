/* lc_wasm_int.h — shared internals of services/lifecycle/wasm (not for other folders).
 *
 * Owns: the structs behind the opaque handles of lc_wasm.h (runtime, module, loaded code,
 * instance), the per-thread run frame that traps and signals unwind to, and the prototypes the
 * files of this folder call across. Which file owns what: lc_wasm_parse.c (binary checks, import
 * check), lc_wasm_compile.c (cache directory, wasm2c/tcc/cc, dlopen, tier 1), lc_wasm_rt.c (the
 * wasm-rt.h interface, signals, frames), lc_wasm_instance.c (runtime, modules, instances),
 * lc_wasm_wasi.c (WASI preview1). Content ids are SHA-256 from services/common/pie_sha256.h. */
#ifndef LC_WASM_INT_H
#define LC_WASM_INT_H

#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <time.h>

#include "pie_budget.h"
#include "lc_wasm.h"
#include "wasm-rt.h"

#define LC_WASM_PAGE_BYTES    65536u
#define LC_WASM_RESERVE_BYTES (8ull << 30) /* a 32-bit index + a 32-bit offset never leaves it */
#define LC_WASM_MAX_PAGES     LC_WASM_MAX_MEMORY_PAGES /* lc_wasm.h */
#define LC_WASM_MAX_MEMORIES  4
#define LC_WASM_MIN_GUARD     (64u << 10)  /* run refuses threads with a smaller stack guard */
#define LC_WASM_HOST_HEADROOM (128u << 10) /* native stack a host call needs to be entered */

/* ---- parse (lc_wasm_parse.c) ---------------------------------------------------------------- */

typedef struct lc_wasm_import {
    char *module, *name;
    char *type; /* WAT text, as lc_wasm_host_fn.type */
} lc_wasm_import;

typedef struct lc_wasm_info {
    lc_wasm_import *imports; /* function imports, in order */
    size_t n_imports;
    bool imports_pie, imports_wasi;
    /* An active or passive element segment names an imported function (the first such: import
     * table_import in segment table_segment). wasm2c 1.0.32's code gives such a table entry the
     * address of its instance's import field as the instance, so a call_indirect of it passes the
     * host function a wrong pointer: these modules must not run on wasm2c's code. */
    bool import_in_table;
    uint32_t table_import, table_segment;
} lc_wasm_info;

/* Checks the module's structure as far as the runtime relies on it (magic, version, section
 * bounds, import and export kinds, `_start` of type () -> (), the instruction structure of every
 * function body) and its complexity against lim (NULL or 0 fields: the defaults); fills info. */
pie_code lc_wasm_parse_limited(const uint8_t *b, size_t n, const lc_wasm_module_limits *lim,
                               lc_wasm_info *info, pie_status *st);
/* lc_wasm_parse_limited with the default limits. */
pie_code lc_wasm_parse(const uint8_t *b, size_t n, lc_wasm_info *info, pie_status *st);
void lc_wasm_info_free(lc_wasm_info *info);
/* Every function import must be one of the host's: pie.* from pie_fns, wasi_snapshot_preview1.*
 * from lc_wasm_wasi_fns, with the same type. Lists every one that is not. */
pie_code lc_wasm_check_imports(const lc_wasm_info *info, const lc_wasm_host_fn *pie_fns,
                               size_t n_pie, pie_status *st);
/* wasm2c's C name of an import: "Z_" mangle(module) "Z_" mangle(name). */
void lc_wasm_mangle_import(const char *module, const char *name, char *out, size_t n);
/* True if type is well-formed canonical WAT type text ("(param i32) (result i64)"). */
bool lc_wasm_type_is_canonical(const char *type);

/* ---- WASI (lc_wasm_wasi.c) ------------------------------------------------------------------ */

extern const lc_wasm_host_fn lc_wasm_wasi_fns[];
extern const size_t lc_wasm_wasi_n_fns;

/* ---- loaded code and compile (lc_wasm_compile.c) -------------------------------------------- */

/* One dlopen'ed library of one tier of a module. Instances hold a reference, so a tier-0 library
 * stays loaded while instances started on it run, after tier 1 replaced it for new ones. */
typedef struct lc_wasm_code {
    int tier;
    void *dl;
    uintptr_t text_lo, text_hi; /* executable segment: the interrupt handler unwinds only here */
    size_t instance_size;
    void (*instantiate)(void *z, struct Z_pie_instance_t *,
                        struct Z_wasi_snapshot_preview1_instance_t *);
    void (*start)(void *z);
    void (*free_instance)(void *z);
    atomic_int refs;
} lc_wasm_code;

void lc_wasm_code_release(lc_wasm_code *c);

enum { LC_WASM_LOADING, LC_WASM_READY, LC_WASM_FAILED };
/* SKIPPED: not built for this module (lc_wasm_module.no_wasm2c says why) */
enum { LC_WASM_T1_OFF, LC_WASM_T1_QUEUED, LC_WASM_T1_DONE, LC_WASM_T1_FAILED, LC_WASM_T1_SKIPPED };

struct lc_wasm_module {
    lc_wasm_rt *rt;
    char id[65];    /* hex SHA-256 */
    char cname[32]; /* wasm2c -n name: "w" + 24 hex digits */
    char *dir;      /* <cache_dir>/<id> */
    bool imports_pie, imports_wasi;
    /* Why wasm2c's code (tier 1, and tier 0 of what the own translator declines) must not run
     * this module ("" if it may): see lc_wasm_info.import_in_table. Set before compiling. */
    char no_wasm2c[160];
    pthread_mutex_t mu; /* guards state..tier1_err and code */
    pthread_cond_t cv;
    int state;
    pie_status err;     /* when FAILED */
    lc_wasm_code *code; /* best tier loaded; the module holds one reference */
    int tier1;          /* LC_WASM_T1_* */
    char tier1_err[512];
    int refs;                /* guarded by rt->mu; listed in the runtime's table while > 0 */
    lc_wasm_module *next;    /* runtime's table */
    lc_wasm_module *t1_next; /* tier-1 queue (guarded by rt->mu; holds no reference) */
};

/* One pie-tcc-helper process (lc_wasm_compile.c): held by one compile at a time. */
typedef struct lc_tcch {
    pthread_mutex_t mu; /* held for a compile */
    pid_t pid;          /* 0: not running; else also its process group */
    int fd;             /* its control socket; -1 when not running */
} lc_tcch;

struct lc_wasm_rt {
    char *cache_dir;
    lc_wasm_host_fn *host_fns; /* copy of the array (the strings are the caller's) */
    size_t n_host_fns;
    bool tier1;
    bool tier0_wasm2c; /* opts.tier0_wasm2c or PIE_WASM_TIER0=wasm2c: no own translator */
    char *wasm2c, *tcc, *cc;
    char *tcc_helper; /* opts.tcc_helper; NULL: tcc children only */
    lc_tcch *helpers; /* [max_compiles] when tcc_helper */
    _Atomic uint64_t helper_compiles, helper_starts;
    lc_wasm_module_limits limits; /* defaults filled in */
    uint64_t compile_timeout_ms, tier1_timeout_ms;
    uint32_t max_compiles;
    uint32_t compile_queue;
    pthread_mutex_t mu; /* guards modules, t1 queue, stopping, n_compiling, n_queued */
    pthread_cond_t t1_cv;
    pthread_cond_t slot_cv; /* CLOCK_MONOTONIC; a tier-0 compile slot came free */
    lc_wasm_module *modules;
    lc_wasm_module *t1_head, *t1_tail;
    uint32_t n_compiling, n_queued; /* tier-0 compiles running, loads waiting for a slot */
    bool stopping;
    atomic_bool compiles_stopped; /* lc_wasm_rt_stop_compiles or destroy: compiles end */
    bool t1_started;
    pthread_t t1_thread;
    _Atomic uint64_t own_translations, own_declines;
    _Atomic uint64_t translations, tier0_compiles, tier1_compiles, disk_hits, memory_hits;
    _Atomic uint64_t t0_files_ns, t0_translate_ns, t0_compile_ns, t0_open_ns; /* see stats */
    uint64_t cache_max;              /* opts.cache_max_bytes; 0: no bound */
    _Atomic uint64_t cache_bytes;    /* estimate of the directory's size (lc_wasm_cache.c) */
    _Atomic uint64_t cache_removals; /* entries pruned */
    atomic_bool cache_pruning;       /* a prune is running */
};

/* Makes m->code (tier 0 or 1) from the cache directory or by compiling; sets m->tier1 to QUEUED
 * when tier 1 should be built. Called once per module, without locks. Stops when cancel (may be
 * NULL) fires (PIE_CANCELLED) or compiles are stopped (PIE_UNAVAILABLE). */
pie_code lc_wasm_compile_load(lc_wasm_module *m, const uint8_t *wasm, size_t len,
                              lc_wasm_cancel *cancel, pie_status *st);
/* Stops every pie-tcc-helper (kills and reaps it); the runtime's destroy. */
void lc_wasm_helpers_stop(lc_wasm_rt *rt);
/* How often waits for a compile, a compile slot or the cache lock look at cancel and stop. */
#define LC_WASM_CANCEL_POLL_MS 50
/* The tier-1 thread: compiles queued modules with cc -O2 and swaps their code. */
void *lc_wasm_tier1_main(void *rt);

/* lc_wasm_cache.c: the directory's size bound. init estimates it (at create); entry_bytes
 * measures one entry directory; used marks the entry whose lock is open as used now; grew
 * records that an entry went from before to after bytes and prunes when the estimate is past
 * the bound. */
void lc_wasm_cache_init(lc_wasm_rt *rt);
uint64_t lc_wasm_cache_entry_bytes(const char *dir);
void lc_wasm_cache_used(int lock_fd);
void lc_wasm_cache_grew(lc_wasm_rt *rt, uint64_t before, uint64_t after);

/* ---- instances and run frames ---------------------------------------------------------------- */

typedef struct lc_wasm_region {
    uintptr_t lo, hi; /* a linear memory's reservation: a fault here is an OOB access */
} lc_wasm_region;

struct lc_wasm_instance {
    lc_wasm_module *mod;
    lc_wasm_code *code;
    void *z; /* the generated Z_<name>_instance_t, code->instance_size bytes */
    struct Z_pie_instance_t pie;
    struct Z_wasi_snapshot_preview1_instance_t wasi;
    char *args_buf, *env_buf; /* NUL-separated strings */
    size_t argc, args_bytes, n_env, env_bytes;
    lc_wasm_limits limits;
    lc_wasm_output_fn output;
    void *output_ctx;
    void (*on_interrupt)(void *host);

    /* Written on the instance's thread only (allocate/grow/trap), read by its signal handler. */
    lc_wasm_region regions[LC_WASM_MAX_MEMORIES];
    volatile sig_atomic_t n_regions;
    wasm_rt_memory_t *mem0; /* memory 0, for host calls */
    uint32_t memory_refusals, refused_pages;
    uint32_t budget_refusals;     /* memory.grow refused by the shared budget */
    pie_budget *budget;           /* lc_wasm_instance_opts.budget: charged memory_pages' bytes */
    int exit_code;
    char trap_msg[256]; /* for MEMORY_LIMIT and HOST traps */
    void *exception;    /* wasm exception payload (EH proposal), up to 64 KiB */
    uint32_t exception_tag, exception_size;

    /* Cross-thread state. */
    pthread_mutex_t mu;   /* guards state, timers, and the poll_oneoff sleep */
    pthread_cond_t cv;    /* CLOCK_MONOTONIC; signalled by interrupt */
    int state;            /* 0 created, 1 running, 2 done */
    atomic_int interrupt; /* lc_wasm_trap reason to stop with, 0 if none */
    /* Pages of all its linear memories: written by the instance's thread (allocate, grow), read
     * by any (lc_wasm_instance_memory_bytes, for ListInstances of a running instance). */
    _Atomic uint64_t memory_pages;
    timer_t cpu_timer, kill_timer;
    bool has_cpu_timer, has_kill_timer;
    uint64_t wall_deadline_ns;
};

/* The run frame: one per thread while an instance runs on it. Everything the signal handlers
 * read is here or in the instance, written before `active` is set. */
typedef struct lc_wasm_frame {
    sigjmp_buf jmp;                /* wasm_rt_trap and the handlers jump here */
    WASM_RT_UNWIND_TARGET *unwind; /* wasm exceptions (wasm_rt_throw) */
    lc_wasm_instance *inst;
    uintptr_t text_lo, text_hi;
    uintptr_t stack_lo, guard_lo; /* usable stack starts at stack_lo; guard below it */
    volatile sig_atomic_t active;
} lc_wasm_frame;

/* The calling thread's frame or NULL. */
lc_wasm_frame *lc_wasm_frame_current(void);
void lc_wasm_frame_enter(lc_wasm_frame *f);
void lc_wasm_frame_leave(void);
/* Usable stack bottom and guard size of the calling thread (cached per thread). */
void lc_wasm_thread_stack(uintptr_t *stack_lo, size_t *guard);
/* Lowest usable stack address of the instance running on this thread (0: none). Called by the
 * code of lc_wasm_xlate before entering a function with a large native frame, which could
 * otherwise step over the stack guard: part of the ABI generated code links against. */
uintptr_t lc_wasm_stack_floor(void);
/* Unwinds the current frame with reason. Aborts if the thread has no frame. */
_Noreturn void lc_wasm_unwind(int reason);

/* Process-wide signal handlers; reference-counted by runtimes. */
pie_code lc_wasm_signals_acquire(int interrupt_signal, pie_status *st);
void lc_wasm_signals_release(void);
int lc_wasm_interrupt_signal(void);

/* What lc_wasm_host_enter does, for any import module: checks that inst runs on this thread and
 * that LC_WASM_HOST_HEADROOM bytes of stack are left (else traps with EXHAUSTION). */
lc_wasm_instance *lc_wasm_enter(lc_wasm_instance *inst);
/* lc_wasm_host_enter for WASI functions (checks that wasi is the running instance's). */
lc_wasm_instance *lc_wasm_wasi_enter(struct Z_wasi_snapshot_preview1_instance_t *wasi);

/* Text for a trap reason ("integer divide by zero"). */
const char *lc_wasm_trap_text(int reason);

/* WASI helpers that lc_wasm_instance.c also uses. */
uint64_t lc_wasm_now_ns(clockid_t clock);

#endif
