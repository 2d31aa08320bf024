/* krn_pool.c — the fork-join thread pool the CPU kernels split their work over.
 *
 * Owns: the worker threads, one run at a time (tasks handed out dynamically through an atomic
 * counter, the caller taking part), the spin-then-sleep waiting on both sides, and each
 * worker's scratch memory (krn_pool_scratch).
 * Does not own: how a kernel divides its work into tasks.
 *
 * A run: the caller publishes (fn, arg, n_tasks), marks generation g open and bumps `gen` to g.
 * A worker that sees a new generation joins (`joined` + 1), checks that g is still open, claims
 * tasks until none are left, and leaves (`joined` - 1). The caller claims tasks too; when none
 * are left it closes the run (`open` = 0) and waits until `joined` is 0. A worker that comes
 * late finds the run closed and touches nothing, so the caller never waits for a worker that
 * the OS has not scheduled yet (on a busy machine it simply does the work itself), and no
 * worker touches the run's arguments after krn_pool_run returns. Joining and closing are
 * sequentially consistent on both sides, so one of the two always sees the other.
 * Waiting spins for a short while (runs come back to back inside a forward) and then sleeps on
 * a condition variable; a sleeper announces itself in `sleepers` / `caller_sleeping` before
 * re-checking, and the waker checks that count after publishing (both sequentially consistent),
 * so a wake-up is never lost. */
#include "krn_cpu_impl.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

/* How long a waiting thread spins before it sleeps. Runs of one forward pass follow each other
 * within microseconds; between forwards the workers go to sleep and cost nothing. */
#define KRN_POOL_SPIN_NS 50000

typedef struct krn_scratch {
    void *ptr;
    size_t bytes;
} krn_scratch;

struct krn_pool {
    int n_threads;
    pthread_t *threads; /* [n_threads - 1] */
    int n_started;
    krn_scratch *scratch; /* [n_threads + 1]; the last one is shared */

    pthread_mutex_t mu;
    pthread_cond_t cv_work; /* workers sleep here waiting for a new generation */
    pthread_cond_t cv_done; /* the caller sleeps here waiting for joined == 0 */

    /* the current run */
    krn_task_fn fn;
    krn_task_ex_fn fn_ex;
    void *arg;
    int n_tasks;
    atomic_int next;   /* next unclaimed task */
    atomic_int joined; /* workers inside the current run */
    atomic_uint gen;   /* bumped once per run (never 0); workers wake when it changes */
    atomic_uint open;  /* the generation accepting workers; 0 when closed */
    atomic_int stop;

    atomic_int sleepers;        /* workers asleep (or about to be) on cv_work */
    atomic_int caller_sleeping; /* the caller asleep (or about to be) on cv_done */
};

typedef struct krn_worker_arg {
    krn_pool *p;
    int index;
} krn_worker_arg;

static inline void cpu_relax(void) {
#if KRN_X86
    _mm_pause();
#endif
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Claims and runs tasks of the current run until none are left. */
static void run_tasks(krn_pool *p, int worker) {
    for (;;) {
        int t = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed);
        if (t >= p->n_tasks) break;
        if (p->fn_ex)
            p->fn_ex(p->arg, t, p->n_tasks, worker);
        else
            p->fn(p->arg, t, p->n_tasks);
    }
}

/* Spin budget of the two waits below: every 64th spin reads the clock; true once the waiter has
 * spun for KRN_POOL_SPIN_NS since its first reading (then it sleeps instead). */
static bool spin_expired(int i, uint64_t *t0) {
    if ((i & 63) != 63) return false;
    uint64_t t = now_ns();
    if (*t0 == 0) {
        *t0 = t;
        return false;
    }
    return t - *t0 > KRN_POOL_SPIN_NS;
}

/* Waits until p->gen differs from `seen` (or stop is set); returns the new generation. */
static unsigned wait_generation(krn_pool *p, unsigned seen) {
    uint64_t t0 = 0;
    for (int i = 0;; i++) {
        unsigned g = atomic_load_explicit(&p->gen, memory_order_acquire);
        if (g != seen || atomic_load_explicit(&p->stop, memory_order_acquire)) return g;
        cpu_relax();
        if (spin_expired(i, &t0)) break;
    }
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add(&p->sleepers, 1);
    unsigned g;
    while ((g = atomic_load(&p->gen)) == seen && !atomic_load(&p->stop))
        pthread_cond_wait(&p->cv_work, &p->mu);
    atomic_fetch_sub(&p->sleepers, 1);
    pthread_mutex_unlock(&p->mu);
    return g;
}

static void *worker_main(void *varg) {
    krn_worker_arg *wa = varg;
    krn_pool *p = wa->p;
    int index = wa->index;
    free(wa);
    /* generation 0 is the pool's state at creation; a run may already have started before
     * this thread got here, so the worker must not sample gen itself */
    unsigned seen = 0;
    for (;;) {
        seen = wait_generation(p, seen);
        if (atomic_load_explicit(&p->stop, memory_order_acquire)) break;
        atomic_fetch_add(&p->joined, 1);
        if (atomic_load(&p->open) == seen) run_tasks(p, index);
        if (atomic_fetch_sub(&p->joined, 1) == 1 && atomic_load(&p->caller_sleeping)) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->cv_done);
            pthread_mutex_unlock(&p->mu);
        }
    }
    return NULL;
}

/* Waits until no worker is inside the (closed) run. */
static void wait_joined(krn_pool *p) {
    uint64_t t0 = 0;
    for (int i = 0;; i++) {
        if (atomic_load(&p->joined) == 0) return;
        cpu_relax();
        if (spin_expired(i, &t0)) break;
    }
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->caller_sleeping, 1);
    while (atomic_load(&p->joined) != 0) pthread_cond_wait(&p->cv_done, &p->mu);
    atomic_store(&p->caller_sleeping, 0);
    pthread_mutex_unlock(&p->mu);
}

krn_pool *krn_pool_create(int n_threads) {
    if (n_threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (int)n : 1;
    }
    if (n_threads > 1024) return NULL;
    krn_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n_threads = n_threads;
    int have_mu = 0, have_cv_work = 0, have_cv_done = 0;
    p->scratch = calloc((size_t)n_threads + 1, sizeof *p->scratch);
    if (!p->scratch) goto fail;
    if (pthread_mutex_init(&p->mu, NULL) != 0) goto fail;
    have_mu = 1;
    if (pthread_cond_init(&p->cv_work, NULL) != 0) goto fail;
    have_cv_work = 1;
    if (pthread_cond_init(&p->cv_done, NULL) != 0) goto fail;
    have_cv_done = 1;
    if (n_threads > 1) {
        p->threads = calloc((size_t)n_threads - 1, sizeof *p->threads);
        if (!p->threads) goto fail;
        for (int i = 1; i < n_threads; i++) {
            krn_worker_arg *wa = malloc(sizeof *wa);
            if (!wa) goto fail;
            wa->p = p;
            wa->index = i;
            if (pthread_create(&p->threads[i - 1], NULL, worker_main, wa) != 0) {
                free(wa);
                goto fail;
            }
            p->n_started++;
        }
    }
    return p;
fail:
    if (p->n_started > 0) {
        krn_pool_destroy(p);
        return NULL;
    }
    if (have_cv_done) pthread_cond_destroy(&p->cv_done);
    if (have_cv_work) pthread_cond_destroy(&p->cv_work);
    if (have_mu) pthread_mutex_destroy(&p->mu);
    free(p->threads);
    free(p->scratch);
    free(p);
    return NULL;
}

void krn_pool_destroy(krn_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, 1);
    pthread_cond_broadcast(&p->cv_work);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_started; i++) pthread_join(p->threads[i], NULL);
    pthread_cond_destroy(&p->cv_done);
    pthread_cond_destroy(&p->cv_work);
    pthread_mutex_destroy(&p->mu);
    for (int i = 0; i <= p->n_threads; i++) free(p->scratch[i].ptr);
    free(p->scratch);
    free(p->threads);
    free(p);
}

int krn_pool_size(const krn_pool *p) { return p ? p->n_threads : 1; }

static void run(krn_pool *p, krn_task_fn fn, krn_task_ex_fn fn_ex, void *arg, int n_tasks) {
    if (n_tasks <= 0) return;
    if (!p || p->n_threads == 1 || n_tasks == 1) {
        for (int t = 0; t < n_tasks; t++) {
            if (fn_ex)
                fn_ex(arg, t, n_tasks, 0);
            else
                fn(arg, t, n_tasks);
        }
        return;
    }
    p->fn = fn;
    p->fn_ex = fn_ex;
    p->arg = arg;
    p->n_tasks = n_tasks;
    atomic_store_explicit(&p->next, 0, memory_order_relaxed);
    unsigned g = atomic_load_explicit(&p->gen, memory_order_relaxed) + 1u;
    if (g == 0) g = 1; /* 0 means "closed" in `open` */
    atomic_store(&p->open, g);
    atomic_store(&p->gen, g); /* seq_cst: publishes the run, ordered before the check below */
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv_work);
        pthread_mutex_unlock(&p->mu);
    }
    run_tasks(p, 0);
    atomic_store(&p->open, 0u); /* every task is claimed: late workers stay out */
    wait_joined(p);
}

void krn_pool_run(krn_pool *p, krn_task_fn fn, void *arg, int n_tasks) {
    run(p, fn, NULL, arg, n_tasks);
}

void krn_pool_run_ex(krn_pool *p, krn_task_ex_fn fn, void *arg, int n_tasks) {
    run(p, NULL, fn, arg, n_tasks);
}

void *krn_pool_scratch(krn_pool *p, int worker, size_t bytes) {
    if (!p || worker < 0 || worker > p->n_threads) return NULL;
    krn_scratch *s = &p->scratch[worker];
    if (s->bytes >= bytes && s->ptr) return s->ptr;
    size_t want = (bytes + 63) & ~(size_t)63;
    if (want < bytes) return NULL;
    void *ptr = NULL;
    if (posix_memalign(&ptr, 64, want) != 0) return NULL;
    free(s->ptr);
    s->ptr = ptr;
    s->bytes = want;
    return ptr;
}
