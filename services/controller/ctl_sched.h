/* ctl_sched.h — the controller's batch scheduler (one per worker group).
 *
 * Owns: the ready lists (command queues whose next call is a GPU call, by the kind of that
 * call), the choice of the next batch — among the kinds whose candidate batch may fire under
 * the strategy, the one holding the oldest waiting call — and the forming of a batch: queues in
 * priority order (high, normal, low; older heads first within a priority), several consecutive
 * same-kind calls of a queue (vertical batching) and calls of many queues (horizontal), cut at
 * the worker's limits (the first call that does not fit ends the batch: truncation from the
 * tail). A scheduling step is a sequence of such batches, sent to the worker as one message.
 * Does not own: the calls and what they mean (the owner's admit callback validates a call, maps
 * its ids and appends it to the batch under construction), queues (ctl_queue.c), credits
 * (ctl_core.c decides when a step may be formed).
 * Paper: seeds/001 §5.2 "批处理调度器" and §6.1; strategies as compared in its Table 5:
 *   work_conserving — fire when the worker is idle (no step outstanding): the default;
 *   eager           — no batching: every batch holds one call, fired at once;
 *   k_only          — fixed-size batching: a kind fires once K queues wait with a call of
 *                     that kind, and a batch holds the calls of at most K queues (the oldest
 *                     first; the rest wait for the next batch); so that a tail of fewer than K
 *                     instances cannot stall, a kind also fires once its oldest call waited
 *                     k_timeout;
 *   t_only          — a kind fires once its oldest call waited T.
 * Whether a step may be formed at all (credits; work_conserving also waits for the worker to
 * be idle, the others fire on their own conditions while earlier steps run) is the owner's
 * decision (ctl_exec.c).
 * No I/O, no locks, no allocation after warm-up: unit-tested directly (test_ctl_sched.c). */
#ifndef CTL_SCHED_H
#define CTL_SCHED_H

#include <stdbool.h>
#include <stdint.h>

/* Kinds of GPU calls, i.e. of batches (SlotBatch is not scheduled: see ctl_exec.c). */
typedef enum ctl_kind {
    CTL_KIND_EMBED = 0,   /* embed_text */
    CTL_KIND_FORWARD = 1, /* forward */
    CTL_KIND_MASK = 2,    /* mask_kv_page */
    CTL_KIND_COPY = 3,    /* copy_kv_page */
    CTL_KIND_DIST = 4,    /* next_dist */
    CTL_KIND_N = 5,
    CTL_KIND_CTRL = 6, /* a call the controller completes itself (alloc, export, ...) */
    CTL_KIND_NONE = -1,
} ctl_kind;

const char *ctl_kind_name(int kind);

typedef enum ctl_strategy {
    CTL_STRATEGY_WORK_CONSERVING = 0,
    CTL_STRATEGY_EAGER = 1,
    CTL_STRATEGY_K_ONLY = 2,
    CTL_STRATEGY_T_ONLY = 3,
} ctl_strategy;

/* Config names, in enum order, NULL-terminated ("work_conserving", "eager", "k_only",
 * "t_only"). */
extern const char *const ctl_strategy_names[];

typedef struct ctl_sched_config {
    ctl_strategy strategy;
    uint32_t k;                /* k_only: queues waiting with a call of the kind */
    int64_t t_ns;              /* t_only: wait of the oldest call */
    int64_t k_timeout_ns;      /* k_only: fire anyway once the oldest call waited this long */
    uint32_t max_step_batches; /* batches in one step (one WorkerDown) at most */
} ctl_sched_config;

/* Queue priorities as ranks: higher is scheduled first. */
enum { CTL_RANK_LOW = 0, CTL_RANK_NORMAL = 1, CTL_RANK_HIGH = 2 };

/* The scheduler's node in a command queue (intrusive). The owner keeps `rank` current; kind,
 * seq and t_ns describe the queue's head call while it is in a ready list. */
typedef struct ctl_sq {
    struct ctl_sq *prev, *next;
    int kind;     /* CTL_KIND_* of the head call while ready; CTL_KIND_NONE otherwise */
    int rank;     /* CTL_RANK_* */
    uint64_t seq; /* arrival order of the head call (cluster-wide, increasing) */
    int64_t t_ns; /* arrival time of the head call (CLOCK_MONOTONIC) */
} ctl_sq;

typedef struct ctl_sched {
    ctl_sched_config cfg;
    ctl_sq ready[CTL_KIND_N]; /* list heads (sentinels) */
    uint32_t n_ready[CTL_KIND_N];
    ctl_sq **scratch; /* the queues of the batch being formed, sorted */
    uint32_t scratch_cap;
} ctl_sched;

/* What the owner's admit callback did with the head call of a queue. */
typedef enum ctl_admit {
    CTL_ADMIT_TAKEN = 0,    /* the call is in the batch; the queue's head advanced */
    CTL_ADMIT_FAILED = 1,   /* the call failed validation and was consumed (not in the batch) */
    CTL_ADMIT_CONFLICT = 2, /* the call conflicts with calls already in the batch: left for a
                               later batch; other queues may still add calls */
    CTL_ADMIT_FULL = 3,     /* the call does not fit: the batch is complete */
} ctl_admit;

typedef struct ctl_sched_ops {
    /* A batch of `kind` begins. */
    void (*open)(void *user, int kind);
    /* Offer the head call of q (its kind is the batch's). The owner takes it or not and, when
     * the head changed, updates q through ctl_sched_ready / ctl_sched_unready. */
    ctl_admit (*admit)(void *user, ctl_sq *q, int kind);
    /* The batch is complete with n_taken calls (0: discard it). */
    void (*close)(void *user, int kind, uint32_t n_taken);
    /* Between batches: the owner may now run calls it could not run while the batch was open
     * (controller calls that became queue heads). Optional. */
    void (*settle)(void *user);
} ctl_sched_ops;

/* Initialises an empty scheduler. Returns -1 when out of memory. */
int ctl_sched_init(ctl_sched *s, const ctl_sched_config *cfg);
void ctl_sched_destroy(ctl_sched *s);

/* Puts q in the ready list of `kind` (moving it if it is in another), its head call having
 * arrival order seq at time t_ns. */
void ctl_sched_ready(ctl_sched *s, ctl_sq *q, int kind, uint64_t seq, int64_t t_ns);
/* Takes q out of its ready list, if it is in one. */
void ctl_sched_unready(ctl_sched *s, ctl_sq *q);
/* Queues waiting with a call of any kind. */
uint32_t ctl_sched_waiting(const ctl_sched *s);

/* Forms one step at time now_ns: up to cfg.max_step_batches batches, each chosen and formed as
 * described above, calling ops->settle after each. Returns the number of batches formed (with
 * at least one call). *wake_ns gets the earliest time at which a kind that may not fire now
 * will be due (k_only / t_only), or 0 if none. */
uint32_t ctl_sched_step(ctl_sched *s, int64_t now_ns, const ctl_sched_ops *ops, void *user,
                        int64_t *wake_ns);

#endif
