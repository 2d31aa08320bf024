/* lc_wasm_rt.c — our implementation of the wasm-rt.h interface (wabt 1.0.32), thread-safe.
 *
 * Owns: every function wasm-rt.h declares (init/free, traps and the unwind target, function type
 * registry, exception state, guard-page memories, funcref/externref tables), the per-thread run
 * frame those unwind to, and the process-wide SIGSEGV/SIGBUS handler (faults in a linear memory
 * of the thread's instance → OOB trap; in the thread's stack guard → EXHAUSTION trap; anything
 * else → the previous handler) and the interrupt-signal handler of the CPU/wall watchdog.
 * Does not own: when frames are entered (lc_wasm_instance.c) or the timers that send the
 * interrupt signal (also there).
 *
 * Global mutable state, and why: signal dispositions are per process, so the installed
 * handlers, the previous ones they chain to and their reference count are process-wide (under
 * g_sig_mu); function type ids must agree between every module loaded in the process, so the
 * type registry is too (under g_types_mu); the frame a trap unwinds to is per thread
 * (t_frame, thread-local — this is what Debian's libwasm-rt-impl gets wrong with its global
 * jmp_buf). Generated code runs with WASM_RT_MEMCHECK_SIGNAL_HANDLER=1 and no stack-depth
 * counting (the header's defaults on 64-bit Linux), so memory bounds and stack exhaustion are
 * both detected here, from faults. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include "lc_wasm_int.h"

_Static_assert(WASM_RT_MEMCHECK_SIGNAL_HANDLER == 1 && WASM_RT_USE_STACK_DEPTH_COUNT == 0,
               "generated code must use guard pages and signal-based stack checks");
_Static_assert((int)LC_WASM_TRAP_OOB == (int)WASM_RT_TRAP_OOB &&
                   (int)LC_WASM_TRAP_CALL_INDIRECT == (int)WASM_RT_TRAP_CALL_INDIRECT &&
                   (int)LC_WASM_TRAP_UNCAUGHT_EXCEPTION == (int)WASM_RT_TRAP_UNCAUGHT_EXCEPTION &&
                   (int)LC_WASM_TRAP_EXHAUSTION == (int)WASM_RT_TRAP_EXHAUSTION,
               "lc_wasm_trap must extend wasm_rt_trap_t");
_Static_assert(ATOMIC_INT_LOCK_FREE == 2, "signal handlers read atomic_int");

/* ---- frames ---------------------------------------------------------------------------------- */

/* The run frame of this thread: the signal handlers and wasm_rt_trap unwind to it. Initial-exec
 * TLS (lc_wasm is linked into the executable), so reading it in a handler allocates nothing. */
static _Thread_local lc_wasm_frame *t_frame __attribute__((tls_model("initial-exec")));

lc_wasm_frame *lc_wasm_frame_current(void) { return t_frame; }

void lc_wasm_frame_enter(lc_wasm_frame *f) {
    f->unwind = &f->jmp;
    t_frame = f;
    atomic_signal_fence(memory_order_seq_cst);
    f->active = 1;
}

void lc_wasm_frame_leave(void) {
    lc_wasm_frame *f = t_frame;
    if (f == NULL) return;
    f->active = 0;
    atomic_signal_fence(memory_order_seq_cst);
    t_frame = NULL;
}

/* Cache of this thread's stack bounds (pthread_getattr_np reads /proc for the main thread). */
static _Thread_local struct {
    bool known;
    uintptr_t lo;
    size_t guard;
} t_stack;

void lc_wasm_thread_stack(uintptr_t *stack_lo, size_t *guard) {
    if (!t_stack.known) {
        pthread_attr_t a;
        void *addr = NULL;
        size_t size = 0, g = 0;
        if (pthread_getattr_np(pthread_self(), &a) == 0) {
            if (pthread_attr_getstack(&a, &addr, &size) != 0) addr = NULL;
            if (pthread_attr_getguardsize(&a, &g) != 0) g = 0;
            pthread_attr_destroy(&a);
        }
        /* The main thread's stack grows on demand; the kernel keeps a gap of 256 pages
         * (stack_guard_gap) below its limit, which is the guard here. */
        if ((pid_t)gettid() == getpid() && g < (1u << 20)) g = 1u << 20;
        t_stack.lo = (uintptr_t)addr;
        t_stack.guard = g;
        t_stack.known = true;
    }
    *stack_lo = t_stack.lo;
    *guard = t_stack.guard;
}

uintptr_t lc_wasm_stack_floor(void) {
    lc_wasm_frame *f = t_frame;
    return f != NULL && f->active ? f->stack_lo : 0;
}

_Noreturn void lc_wasm_unwind(int reason) {
    lc_wasm_frame *f = t_frame;
    if (f == NULL || !f->active) {
        /* Generated code trapped outside lc_wasm_instance_run: nothing to return to. */
        fprintf(stderr, "lc_wasm: wasm trap (%s) on a thread that runs no instance\n",
                lc_wasm_trap_text(reason));
        abort();
    }
    siglongjmp(f->jmp, reason);
}

int lc_wasm_thread_attr_init(pthread_attr_t *attr, size_t stack_bytes) {
    int rc = pthread_attr_init(attr);
    if (rc) return rc;
    rc = pthread_attr_setstacksize(attr, stack_bytes ? stack_bytes : (8u << 20));
    if (rc == 0) rc = pthread_attr_setguardsize(attr, 1u << 20);
    if (rc) pthread_attr_destroy(attr);
    return rc;
}

/* ---- trap texts --------------------------------------------------------------------------------
 */

const char *lc_wasm_trap_text(int reason) {
    switch (reason) {
    case LC_WASM_TRAP_NONE: return "no error";
    case LC_WASM_TRAP_OOB: return "out-of-bounds memory or table access";
    case LC_WASM_TRAP_INT_OVERFLOW: return "integer overflow (division or float-to-int truncation)";
    case LC_WASM_TRAP_DIV_BY_ZERO: return "integer divide by zero";
    case LC_WASM_TRAP_INVALID_CONVERSION: return "invalid conversion of NaN to an integer";
    case LC_WASM_TRAP_UNREACHABLE: return "unreachable instruction executed (abort or trap)";
    case LC_WASM_TRAP_CALL_INDIRECT:
        return "indirect call through a null, out-of-range or wrongly typed table entry";
    case LC_WASM_TRAP_UNCAUGHT_EXCEPTION: return "uncaught wasm exception";
    case LC_WASM_TRAP_EXHAUSTION: return "call stack exhausted (recursion too deep)";
    case LC_WASM_TRAP_MEMORY_LIMIT: return "memory limit";
    case LC_WASM_TRAP_HOST: return "ended by a host function";
    case LC_WASM_TRAP_EXIT: return "exited";
    case LC_WASM_TRAP_CPU_TIME: return "CPU time quota used up";
    case LC_WASM_TRAP_WALL_TIME: return "wall-time quota passed";
    case LC_WASM_TRAP_TERMINATED: return "terminated on request";
    default: return "unknown trap";
    }
}

/* ---- runtime init, traps, unwind target --------------------------------------------------------
 */

static pthread_mutex_t g_sig_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_sig_refs;         /* runtimes alive */
static int g_interrupt_signal; /* chosen by the first runtime */
static struct sigaction g_prev_segv, g_prev_bus, g_prev_interrupt;

void wasm_rt_init(void) {
    pie_status st;
    if (lc_wasm_signals_acquire(0, &st) != PIE_OK) {
        fprintf(stderr, "lc_wasm: wasm_rt_init: %s\n", st.msg);
        abort();
    }
}

bool wasm_rt_is_initialized(void) {
    pthread_mutex_lock(&g_sig_mu);
    bool ok = g_sig_refs > 0;
    pthread_mutex_unlock(&g_sig_mu);
    return ok;
}

void wasm_rt_free(void) { lc_wasm_signals_release(); }

WASM_RT_NO_RETURN void wasm_rt_trap(wasm_rt_trap_t code) {
    lc_wasm_unwind(code == WASM_RT_TRAP_NONE ? LC_WASM_TRAP_UNREACHABLE : (int)code);
}

const char *wasm_rt_strerror(wasm_rt_trap_t trap) { return lc_wasm_trap_text((int)trap); }

WASM_RT_UNWIND_TARGET *wasm_rt_get_unwind_target(void) {
    lc_wasm_frame *f = t_frame;
    return f ? f->unwind : NULL;
}

void wasm_rt_set_unwind_target(WASM_RT_UNWIND_TARGET *target) {
    lc_wasm_frame *f = t_frame;
    if (f) f->unwind = target ? target : &f->jmp;
}

/* ---- exceptions (EH proposal; not emitted unless wasm2c runs with --enable-exceptions) ------- */

#define LC_WASM_MAX_EXCEPTION 65536u
static atomic_uint g_tags; /* tag ids must be unique in the process, like function type ids */

uint32_t wasm_rt_register_tag(uint32_t size) {
    if (size > LC_WASM_MAX_EXCEPTION) wasm_rt_trap(WASM_RT_TRAP_EXHAUSTION);
    return atomic_fetch_add(&g_tags, 1u);
}

void wasm_rt_load_exception(uint32_t tag, uint32_t size, const void *values) {
    lc_wasm_frame *f = t_frame;
    if (f == NULL || size > LC_WASM_MAX_EXCEPTION) wasm_rt_trap(WASM_RT_TRAP_EXHAUSTION);
    lc_wasm_instance *inst = f->inst;
    if (inst->exception == NULL) {
        inst->exception = malloc(LC_WASM_MAX_EXCEPTION);
        if (inst->exception == NULL) wasm_rt_trap(WASM_RT_TRAP_EXHAUSTION);
    }
    inst->exception_tag = tag;
    inst->exception_size = size;
    if (size) memcpy(inst->exception, values, size);
}

WASM_RT_NO_RETURN void wasm_rt_throw(void) {
    lc_wasm_frame *f = t_frame;
    if (f == NULL) lc_wasm_unwind(LC_WASM_TRAP_UNCAUGHT_EXCEPTION);
    siglongjmp(*f->unwind, WASM_RT_TRAP_UNCAUGHT_EXCEPTION);
}

uint32_t wasm_rt_exception_tag(void) { return t_frame ? t_frame->inst->exception_tag : 0; }
uint32_t wasm_rt_exception_size(void) { return t_frame ? t_frame->inst->exception_size : 0; }
void *wasm_rt_exception(void) { return t_frame ? t_frame->inst->exception : NULL; }

/* ---- function types ----------------------------------------------------------------------------
 */

/* Registered signatures: ids are indices + 1 and identical signatures share an id, in every
 * module of the process (call_indirect compares ids). Freed with the last runtime. */
typedef struct functype_entry {
    uint32_t n_params, n_results;
    wasm_rt_type_t *types; /* params then results */
} functype_entry;

static pthread_mutex_t g_types_mu = PTHREAD_MUTEX_INITIALIZER;
static functype_entry *g_types;
static uint32_t g_n_types, g_cap_types;

uint32_t wasm_rt_register_func_type(uint32_t params, uint32_t results, ...) {
    uint32_t n = params + results;
    if (n < params || n > 100000) wasm_rt_trap(WASM_RT_TRAP_EXHAUSTION);
    wasm_rt_type_t *types = malloc((n ? n : 1) * sizeof *types);
    if (types == NULL) {
        fprintf(stderr, "lc_wasm: out of memory registering a function type\n");
        abort();
    }
    va_list ap;
    va_start(ap, results);
    for (uint32_t i = 0; i < n; i++) types[i] = (wasm_rt_type_t)va_arg(ap, int);
    va_end(ap);

    pthread_mutex_lock(&g_types_mu);
    uint32_t id = 0;
    for (uint32_t i = 0; i < g_n_types && id == 0; i++)
        if (g_types[i].n_params == params && g_types[i].n_results == results &&
            (n == 0 || memcmp(g_types[i].types, types, n * sizeof *types) == 0))
            id = i + 1;
    if (id == 0) {
        if (g_n_types == g_cap_types) {
            uint32_t cap = g_cap_types ? 2 * g_cap_types : 64;
            functype_entry *t = realloc(g_types, cap * sizeof *t);
            if (t == NULL) {
                pthread_mutex_unlock(&g_types_mu);
                fprintf(stderr, "lc_wasm: out of memory registering a function type\n");
                abort();
            }
            g_types = t;
            g_cap_types = cap;
        }
        g_types[g_n_types] = (functype_entry){params, results, types};
        types = NULL;
        id = ++g_n_types;
    }
    pthread_mutex_unlock(&g_types_mu);
    free(types);
    return id;
}

static void types_free(void) {
    pthread_mutex_lock(&g_types_mu);
    for (uint32_t i = 0; i < g_n_types; i++) free(g_types[i].types);
    free(g_types);
    g_types = NULL;
    g_n_types = g_cap_types = 0;
    pthread_mutex_unlock(&g_types_mu);
}

/* ---- memories ----------------------------------------------------------------------------------
 */

/* Ends instantiation with MEMORY_LIMIT and a message (on the instance's thread, in a frame). */
static _Noreturn void memory_trap(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static _Noreturn void memory_trap(const char *fmt, ...) {
    lc_wasm_frame *f = t_frame;
    if (f != NULL) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(f->inst->trap_msg, sizeof f->inst->trap_msg, fmt, ap);
        va_end(ap);
    }
    lc_wasm_unwind(LC_WASM_TRAP_MEMORY_LIMIT);
}

static uint32_t page_limit(const lc_wasm_instance *inst) {
    uint32_t lim = inst && inst->limits.max_memory_pages ? inst->limits.max_memory_pages : 16384;
    return lim > LC_WASM_MAX_PAGES ? LC_WASM_MAX_PAGES : lim;
}

void wasm_rt_allocate_memory(wasm_rt_memory_t *mem, uint32_t initial_pages, uint32_t max_pages) {
    memset(mem, 0, sizeof *mem);
    lc_wasm_frame *f = t_frame;
    lc_wasm_instance *inst = f ? f->inst : NULL;
    uint32_t lim = page_limit(inst);
    if (initial_pages > lim)
        memory_trap("the module's initial memory of %u pages (%u KiB) exceeds the instance limit "
                    "of %u pages (%u KiB)",
                    initial_pages, initial_pages * 64u, lim, lim * 64u);
    if (inst && inst->n_regions >= LC_WASM_MAX_MEMORIES)
        memory_trap("the module declares more than %d memories", LC_WASM_MAX_MEMORIES);
    void *base = mmap(NULL, LC_WASM_RESERVE_BYTES, PROT_NONE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED)
        memory_trap("could not reserve 8 GiB of address space for a linear memory: %s",
                    strerror(errno));
    size_t bytes = (size_t)initial_pages * LC_WASM_PAGE_BYTES;
    if (inst && !pie_budget_take(inst->budget, bytes)) {
        munmap(base, LC_WASM_RESERVE_BYTES);
        memory_trap("the replica's memory budget (limits.replica_memory) has %llu KiB free, the "
                    "module's initial memory needs %u pages (%u KiB)",
                    (unsigned long long)(pie_budget_free(inst->budget) / 1024), initial_pages,
                    initial_pages * 64u);
    }
    if (bytes && mprotect(base, bytes, PROT_READ | PROT_WRITE) != 0) {
        int e = errno;
        munmap(base, LC_WASM_RESERVE_BYTES);
        if (inst) pie_budget_give(inst->budget, bytes);
        memory_trap("could not commit %u pages of linear memory: %s", initial_pages, strerror(e));
    }
    mem->data = base;
    mem->pages = initial_pages;
    mem->max_pages = max_pages;
    mem->size = (uint32_t)bytes;
    if (inst) {
        /* Visible to this thread's signal handler once n_regions counts it. */
        int i = inst->n_regions;
        inst->regions[i].lo = (uintptr_t)base;
        inst->regions[i].hi = (uintptr_t)base + LC_WASM_RESERVE_BYTES;
        atomic_signal_fence(memory_order_seq_cst);
        inst->n_regions = i + 1;
        if (inst->mem0 == NULL) inst->mem0 = mem;
        atomic_fetch_add_explicit(&inst->memory_pages, initial_pages, memory_order_relaxed);
    }
}

uint32_t wasm_rt_grow_memory(wasm_rt_memory_t *mem, uint32_t delta) {
    uint32_t old = mem->pages;
    if (delta == 0) return old;
    lc_wasm_frame *f = t_frame;
    lc_wasm_instance *inst = f ? f->inst : NULL;
    uint64_t want = (uint64_t)old + delta;
    if (want > mem->max_pages || want > LC_WASM_MAX_PAGES) return UINT32_MAX;
    if (want > page_limit(inst)) {
        if (inst) {
            inst->memory_refusals++;
            inst->refused_pages = (uint32_t)want;
        }
        return UINT32_MAX;
    }
    size_t grow_bytes = (size_t)delta * LC_WASM_PAGE_BYTES;
    if (inst && !pie_budget_take(inst->budget, grow_bytes)) {
        inst->budget_refusals++;
        return UINT32_MAX;
    }
    if (mprotect(mem->data + (size_t)old * LC_WASM_PAGE_BYTES, grow_bytes,
                 PROT_READ | PROT_WRITE) != 0) {
        if (inst) pie_budget_give(inst->budget, grow_bytes);
        return UINT32_MAX;
    }
    mem->pages = (uint32_t)want;
    mem->size = (uint32_t)(want * LC_WASM_PAGE_BYTES);
    if (inst) atomic_fetch_add_explicit(&inst->memory_pages, delta, memory_order_relaxed);
    return old;
}

void wasm_rt_free_memory(wasm_rt_memory_t *mem) {
    if (mem->data != NULL && munmap(mem->data, LC_WASM_RESERVE_BYTES) != 0)
        fprintf(stderr, "lc_wasm: munmap of a linear memory failed: %s\n", strerror(errno));
    memset(mem, 0, sizeof *mem);
}

/* ---- tables ------------------------------------------------------------------------------------
 */

static uint32_t table_limit(void) {
    lc_wasm_frame *f = t_frame;
    uint32_t lim = f && f->inst->limits.max_table_elems ? f->inst->limits.max_table_elems : 65536;
    return lim;
}

/* The two table kinds differ only in element type; one macro keeps them identical. */
#define LC_WASM_TABLE_OPS(kind, elem_t)                                                         \
    void wasm_rt_allocate_##kind##_table(wasm_rt_##kind##_table_t *t, uint32_t elements,        \
                                         uint32_t max_elements) {                               \
        memset(t, 0, sizeof *t);                                                                \
        if (elements > table_limit())                                                           \
            memory_trap("the module's table of %u elements exceeds the instance limit of %u",   \
                        elements, table_limit());                                               \
        t->data = calloc(elements ? elements : 1, sizeof(elem_t));                              \
        if (t->data == NULL) memory_trap("out of memory for a table of %u elements", elements); \
        t->size = elements;                                                                     \
        t->max_size = max_elements;                                                             \
    }                                                                                           \
    void wasm_rt_free_##kind##_table(wasm_rt_##kind##_table_t *t) {                             \
        free(t->data);                                                                          \
        memset(t, 0, sizeof *t);                                                                \
    }                                                                                           \
    uint32_t wasm_rt_grow_##kind##_table(wasm_rt_##kind##_table_t *t, uint32_t delta,           \
                                         elem_t init) {                                         \
        uint32_t old = t->size;                                                                 \
        if (delta == 0) return old;                                                             \
        uint64_t want = (uint64_t)old + delta;                                                  \
        if (want > t->max_size || want > table_limit()) return UINT32_MAX;                      \
        elem_t *d = realloc(t->data, (size_t)want * sizeof(elem_t));                            \
        if (d == NULL) return UINT32_MAX;                                                       \
        for (uint64_t i = old; i < want; i++) d[i] = init;                                      \
        t->data = d;                                                                            \
        t->size = (uint32_t)want;                                                               \
        return old;                                                                             \
    }

LC_WASM_TABLE_OPS(funcref, wasm_rt_funcref_t)
LC_WASM_TABLE_OPS(externref, wasm_rt_externref_t)

/* ---- signal handlers ---------------------------------------------------------------------------
 */

static uintptr_t fault_pc(void *ucv) {
    ucontext_t *uc = ucv;
#if defined(__x86_64__)
    return (uintptr_t)uc->uc_mcontext.gregs[REG_RIP];
#elif defined(__aarch64__)
    return (uintptr_t)uc->uc_mcontext.pc;
#else
    (void)uc;
    return 0; /* unknown architecture: interrupts only take effect at host checkpoints */
#endif
}

static void chain(const struct sigaction *prev, int sig, siginfo_t *si, void *uc) {
    if (prev->sa_flags & SA_SIGINFO) {
        if (prev->sa_sigaction != NULL) {
            prev->sa_sigaction(sig, si, uc);
            return;
        }
    } else if (prev->sa_handler != SIG_DFL && prev->sa_handler != SIG_IGN) {
        prev->sa_handler(sig);
        return;
    }
    /* Default action: restore it and return; the faulting instruction runs again and the
     * kernel applies it (core dump with the right address). Ignoring a fault would loop. */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, NULL);
}

/* SIGSEGV/SIGBUS. Async-signal-safety: reads only the thread's frame and its instance's region
 * list (written before `active` / n_regions are published, by this same thread), and leaves by
 * siglongjmp. Unwinding is safe because the fault is synchronous and was raised by generated
 * code, by libc/libm routines it calls (memcpy in tier-0 loads), or by our runtime functions that
 * hold no locks; host functions check their stack headroom on entry (lc_wasm_host_enter) and
 * bounds-check memory (lc_wasm_mem), so they do not fault here. */
static void on_fault(int sig, siginfo_t *si, void *uc) {
    lc_wasm_frame *f = t_frame;
    if (f != NULL && f->active) {
        uintptr_t a = (uintptr_t)si->si_addr;
        lc_wasm_instance *inst = f->inst;
        int n = inst->n_regions;
        for (int i = 0; i < n; i++)
            if (a >= inst->regions[i].lo && a < inst->regions[i].hi)
                siglongjmp(f->jmp, LC_WASM_TRAP_OOB);
        /* Above stack_lo only the main thread's stack can fail to grow (at its rlimit). */
        if (f->stack_lo != 0 && a >= f->guard_lo && a < f->stack_lo + (64u << 10))
            siglongjmp(f->jmp, LC_WASM_TRAP_EXHAUSTION);
    }
    chain(sig == SIGBUS ? &g_prev_bus : &g_prev_segv, sig, si, uc);
}

/* The watchdog's signal (a CPU or wall timer of the instance, or lc_wasm_instance_interrupt).
 * Records the reason carried in si_value, then unwinds only if the interrupted instruction is in
 * the executable segment of the running module: generated code holds no locks and is never in the
 * middle of a heap update (it only calls out, to our runtime, libc or host functions, and none of
 * those addresses is in that segment). Anywhere else it returns, and the timer, which repeats
 * every few ms, tries again; host calls that block check lc_wasm_interrupted. */
static void on_interrupt(int sig, siginfo_t *si, void *uc) {
    (void)sig;
    int saved = errno;
    lc_wasm_frame *f = t_frame;
    if (f != NULL && f->active) {
        lc_wasm_instance *inst = f->inst;
        int why = si->si_code == SI_TIMER ? si->si_value.sival_int : 0;
        int none = 0;
        if (why > 0) atomic_compare_exchange_strong(&inst->interrupt, &none, why);
        int reason = atomic_load(&inst->interrupt);
        uintptr_t pc = fault_pc(uc);
        if (reason != 0 && pc >= f->text_lo && pc < f->text_hi) siglongjmp(f->jmp, reason);
    }
    errno = saved;
}

static int install(int sig, void (*fn)(int, siginfo_t *, void *), int extra,
                   struct sigaction *prev) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = fn;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | extra;
    sigemptyset(&sa.sa_mask);
    return sigaction(sig, &sa, prev);
}

pie_code lc_wasm_signals_acquire(int interrupt_signal, pie_status *st) {
    pthread_mutex_lock(&g_sig_mu);
    pie_code rc = PIE_OK;
    int sig = interrupt_signal ? interrupt_signal : SIGRTMIN + 4;
    if (g_sig_refs > 0) {
        if (interrupt_signal && interrupt_signal != g_interrupt_signal)
            rc = pie_status_set(st, PIE_FAILED_PRECONDITION,
                                "interrupt_signal %d differs from signal %d used by the runtimes "
                                "already created in this process",
                                interrupt_signal, g_interrupt_signal);
        else
            g_sig_refs++;
        pthread_mutex_unlock(&g_sig_mu);
        return rc;
    }
    if (sig < SIGRTMIN || sig > SIGRTMAX) {
        pthread_mutex_unlock(&g_sig_mu);
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "interrupt_signal %d is not a real-time signal (%d..%d)", sig,
                              SIGRTMIN, SIGRTMAX);
    }
    if (install(SIGSEGV, on_fault, 0, &g_prev_segv) != 0 ||
        install(SIGBUS, on_fault, 0, &g_prev_bus) != 0 ||
        install(sig, on_interrupt, SA_RESTART, &g_prev_interrupt) != 0) {
        int e = errno;
        sigaction(SIGSEGV, &g_prev_segv, NULL);
        sigaction(SIGBUS, &g_prev_bus, NULL);
        pthread_mutex_unlock(&g_sig_mu);
        return pie_status_set(st, PIE_INTERNAL, "sigaction: %s", strerror(e));
    }
    /* A sanitizer may keep its own handler (ASan with allow_user_segv_handler=0): then faults in
     * linear memory would crash the process instead of trapping. */
    struct sigaction cur;
    if (sigaction(SIGSEGV, NULL, &cur) != 0 || !(cur.sa_flags & SA_SIGINFO) ||
        cur.sa_sigaction != on_fault) {
        sigaction(SIGSEGV, &g_prev_segv, NULL);
        sigaction(SIGBUS, &g_prev_bus, NULL);
        sigaction(sig, &g_prev_interrupt, NULL);
        pthread_mutex_unlock(&g_sig_mu);
        return pie_status_set(st, PIE_FAILED_PRECONDITION,
                              "the SIGSEGV handler of the wasm runtime did not take effect (under "
                              "AddressSanitizer, do not set allow_user_segv_handler=0)");
    }
    g_interrupt_signal = sig;
    g_sig_refs = 1;
    pthread_mutex_unlock(&g_sig_mu);
    pie_status_ok(st);
    return PIE_OK;
}

void lc_wasm_signals_release(void) {
    pthread_mutex_lock(&g_sig_mu);
    if (g_sig_refs > 0 && --g_sig_refs == 0) {
        sigaction(SIGSEGV, &g_prev_segv, NULL);
        sigaction(SIGBUS, &g_prev_bus, NULL);
        sigaction(g_interrupt_signal, &g_prev_interrupt, NULL);
        types_free();
    }
    pthread_mutex_unlock(&g_sig_mu);
}

int lc_wasm_interrupt_signal(void) {
    pthread_mutex_lock(&g_sig_mu);
    int s = g_interrupt_signal;
    pthread_mutex_unlock(&g_sig_mu);
    return s;
}
