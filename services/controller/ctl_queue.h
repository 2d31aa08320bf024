/* ctl_queue.h — command queues and the call records in them.
 *
 * Owns: ctl_call (one API call from its arrival until its result, if any, has been handed to
 * the replica's outbox) and ctl_queue (one inferlet queue: the calls not yet taken, in issue
 * order, and the calls taken but not yet retired, in issue order too — the completion FIFO).
 *
 * Life of a call on a queue: PENDING (waiting behind earlier calls) → taken from the head when
 * every earlier call has been taken: either sent to the worker in a batch (INFLIGHT) or
 * completed by the controller on the spot (DONE) → DONE when its batch result arrives →
 * retired from the FIFO front, in issue order, its result emitted. So results of one queue
 * arrive in issue order, and a synchronize (DONE as soon as it is taken) is emitted exactly
 * when everything before it completed, without holding up the calls after it.
 *
 * A call a worker deferred (ItemResult.deferred: not run, to be offered again) goes from
 * INFLIGHT to DEFERRED: it keeps its place in the completion FIFO (nothing after it retires
 * before it) and joins the queue's redo list, which comes before the pending calls: the head is
 * the oldest deferred call, taken again (back to INFLIGHT, same FIFO place) before any call
 * never taken. So the calls of a queue are taken, run and retired in issue order however often
 * a worker defers them.
 *
 * A queue is destroyed when its destroy_queue call retires. When its instance ends, pending,
 * deferred and retired calls are freed and in-flight ones are orphaned (q = NULL): the batch
 * that holds them frees them when its result arrives or its worker is lost.
 * Does not own: what calls mean (ctl_exec.c), scheduling (ctl_sched.c). */
#ifndef CTL_QUEUE_H
#define CTL_QUEUE_H

#include <stdbool.h>
#include <stdint.h>

#include "ctl_sched.h"
#include "pie/v1/controller.pb-c.h"

typedef enum ctl_call_state {
    CTL_CALL_PENDING = 0,
    CTL_CALL_INFLIGHT = 1,
    CTL_CALL_DONE = 2,
    CTL_CALL_DEFERRED = 3, /* in the FIFO and the redo list: to be taken again */
} ctl_call_state;

struct ctl_queue;
struct ctl_msg;

typedef struct ctl_call {
    struct ctl_call *next;       /* pending list or completion FIFO; free list of the slab */
    struct ctl_call *redo_next;  /* DEFERRED: the queue's redo list */
    struct ctl_queue *q;         /* NULL once orphaned */
    const Pie__V1__ApiCall *api; /* inside msg */
    struct ctl_msg *msg;         /* the kept SessionUp that holds api (refcounted) */
    uint64_t seq;                /* arrival order, cluster-wide */
    int64_t t_ns;                /* arrival time */
    int8_t kind;                 /* CTL_KIND_* */
    uint8_t state;               /* ctl_call_state */
    bool has_result;             /* DONE with something to emit (an error or data) */
    uint32_t code;               /* when DONE: 0 or the error code */
    char *err;                   /* when code != 0: malloc'd message */
    uint32_t *out_ids;           /* import_kv_pages: the ids bound (malloc'd) */
    uint32_t n_out_ids;
    uint32_t deferrals; /* times a worker deferred it (bounded: CTL_DEFER_MAX, ctl_exec.c) */
    /* next_dist, only while its WorkerUp is being processed: the items of its batch result. */
    Pie__V1__ItemResult **items;
    uint32_t n_items;
} ctl_call;

typedef struct ctl_queue {
    ctl_sq sq; /* scheduler node: while the head is a GPU call, in a ready list */
    uint32_t id;
    uint32_t model; /* index into the core's model table */
    struct ctl_inst *inst;
    bool detached;  /* destroy_queue arrived: the id no longer names this queue */
    bool dead;      /* its instance ended: waits to be freed (core graveyard) */
    bool in_settle; /* in its worker's settle list */
    struct ctl_queue *settle_next;
    ctl_call *pend, *pend_tail; /* not yet taken, issue order */
    ctl_call *fifo, *fifo_tail; /* taken, not yet retired, issue order */
    ctl_call *redo;             /* DEFERRED calls, issue order: taken before pend */
    uint32_t n_pend, n_fifo;
    uint32_t n_inflight; /* taken and neither done nor deferred (in a batch, or running) */
    /* On a worker that may defer: the queue has calls in a step sent and not answered, so
     * none of its calls joins another step and its controller calls wait (ctl_exec.c,
     * "Deferral"). Cleared when its last in-flight call is answered. */
    bool held;
    uint32_t vindex;         /* index in the instance's queue table */
    struct ctl_place *place; /* the instance's objects of this model, once placed */
    ctl_sched *sched;        /* the scheduler whose ready list holds sq, or NULL */
} ctl_queue;

void ctl_queue_init(ctl_queue *q, uint32_t id, uint32_t model, struct ctl_inst *inst);
/* Priority from the wire value (QueuePriority) to a scheduler rank. */
int ctl_queue_rank(int wire_priority);

void ctl_queue_push(ctl_queue *q, ctl_call *c);
/* The next call to take: the oldest deferred one, else the oldest pending one. */
static inline ctl_call *ctl_queue_head(const ctl_queue *q) { return q->redo ? q->redo : q->pend; }
/* Takes the head call as INFLIGHT and returns it: a pending call moves to the completion
 * FIFO's end, a deferred one keeps its FIFO place. */
ctl_call *ctl_queue_take(ctl_queue *q);
/* Marks a taken call DONE with a result code (err: message, copied; NULL for none). */
void ctl_queue_done(ctl_call *c, uint32_t code, const char *err);
/* A worker deferred an in-flight call: DEFERRED, into the redo list in issue order (by seq),
 * its deferrals counted. */
void ctl_queue_defer(ctl_call *c);
/* The FIFO front if it is DONE, removed from the FIFO; NULL otherwise. */
ctl_call *ctl_queue_retire(ctl_queue *q);
/* Whether the queue holds nothing (neither pending nor unretired calls). */
static inline bool ctl_queue_empty(const ctl_queue *q) {
    return q->pend == NULL && q->fifo == NULL;
}
/* Whether the queue's next call waits to be taken: pending or deferred. */
static inline bool ctl_queue_waiting(const ctl_queue *q) { return q->redo || q->pend; }

#endif
