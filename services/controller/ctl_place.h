/* ctl_place.h — worker groups, the models they serve, placement and contention.
 *
 * Owns: ctl_worker (one linked worker group: its registration, its physical pools, its batch
 * scheduler, its credits and the batches sent to it and not yet answered), ctl_model (a served
 * model and its ModelInfo), ctl_place (an instance's objects of one model on one worker group:
 * its virtual space), registration checks, the placement choice (the least loaded group serving
 * the model, or the group holding the KV pages an instance imports first), the contention
 * victim (FCFS: the newest instance launched after the requester that holds pages — or
 * embeddings, when those ran out — on the group), and the loss of a group (its instances are
 * terminated, its exports dropped). Does not own: what happens to a terminated instance
 * (ctl_core.c), batches' contents (ctl_exec.c). Internal to the controller: see ctl_core.h for the
 * public interface. */
#ifndef CTL_PLACE_H
#define CTL_PLACE_H

#include <stdbool.h>
#include <stdint.h>

#include "ctl_sched.h"
#include "ctl_vspace.h"
#include "pie/v1/controller.pb-c.h"

struct ctl_core;
struct ctl_inst;
struct ctl_call;
struct ctl_queue;

typedef struct ctl_model {
    char *name;
    Pie__V1__ModelInfo *info; /* owned copy (from the first registration) */
    uint32_t workers;         /* groups serving it now */
} ctl_model;

/* One call's share of a batch: its items are the next n_items of the batch. */
typedef struct ctl_batch_call {
    struct ctl_call *call;
    uint32_t n_items;
} ctl_batch_call;

/* A batch sent to a worker and not yet answered. */
typedef struct ctl_batch {
    struct ctl_batch *next;
    uint64_t id;
    int kind;        /* CTL_KIND_*; CTL_KIND_NONE for a SlotBatch */
    bool ends_step;  /* the last batch of its step (WorkerDown) */
    int64_t sent_ns; /* when its step was sent */
    uint32_t n_items;
    ctl_batch_call *calls; /* kept across reuse (slab free list) */
    uint32_t n_calls, cap_calls;
} ctl_batch;

typedef struct ctl_place {
    struct ctl_place *inst_next;       /* the instance's placements */
    struct ctl_place *w_prev, *w_next; /* the worker's placements */
    struct ctl_inst *inst;
    struct ctl_worker *w;
    uint32_t model;
    ctl_vspace vs;
} ctl_place;

typedef struct ctl_worker {
    struct ctl_worker *next;
    uint32_t index;             /* WorkerRegistered.worker_index */
    void *link;                 /* the transport's handle */
    Pie__V1__WorkerUp *reg_msg; /* kept: holds reg */
    const Pie__V1__WorkerRegistration *reg;
    Pie__V1__WorkerUp *stats_msg;      /* kept: holds the latest stats (NULL: in reg_msg) */
    const Pie__V1__WorkerStats *stats; /* the latest stats, or NULL */
    uint32_t model;                    /* index into the core's models */
    uint64_t connected_unix_ms;
    int64_t last_heard_ns; /* last WorkerUp */
    bool heard_stats;      /* silence is checked once it has sent stats */
    ctl_pool pool;
    ctl_sched sched;
    uint32_t max_items, max_tokens; /* WorkerCapacity.max_batch_items / max_batch_tokens */
    uint32_t credits;               /* steps it accepts now */
    uint64_t next_batch_id;
    ctl_batch *out, *out_tail; /* sent, awaiting results, in order */
    uint32_t n_out;
    uint32_t steps_out; /* steps sent and not fully answered */
    ctl_place *places;  /* placements on it */
    uint32_t n_places;
    struct ctl_queue *settle; /* queues whose head became a controller call mid-batch */
    int64_t wake_ns;          /* its scheduler's next due time (0: none) */
    bool draining;            /* Drain sent: no more steps, no new placements */
    /* WorkerUp.draining received (the worker got SIGTERM): no new placements; its instances
     * keep their steps, and Drain{shutdown} follows once it holds none (ctl_core_retire_worker) */
    bool leaving;
    /* Its registration said may_defer and the controller answered defer_ok: its items may come
     * back ItemResult.deferred (ctl_exec.c, "Deferral"); false: a deferred item is a protocol
     * violation. */
    bool defers;
    /* work_conserving: how long a step takes on the worker (moving average of the exec_us of
     * its batches), while one step runs when the next one is to be formed (0: none), and when
     * the last step's results arrived (a step sent while another ran starts about then). */
    int64_t exec_avg_ns, hold_ns, step_done_ns;
    uint64_t step_exec_us; /* exec_us of the answered batches of the oldest step so far */
    uint64_t steps, batches_sent;
} ctl_worker;

/* Registration checks against the models already served; on success *model_index is the
 * model's entry (created if new). */
pie_code ctl_place_check_registration(struct ctl_core *c, const Pie__V1__WorkerRegistration *r,
                                      uint32_t *model_index, pie_status *st);
/* The model named `name`, or UINT32_MAX. */
uint32_t ctl_place_model(const struct ctl_core *c, const char *name);
/* Whether some linked worker serves the model. */
bool ctl_place_served(const struct ctl_core *c, uint32_t model);
/* The least loaded worker serving the model, or NULL. */
ctl_worker *ctl_place_choose(struct ctl_core *c, uint32_t model);
/* The instance's placement for a model, or NULL. */
ctl_place *ctl_place_of(const struct ctl_inst *inst, uint32_t model);
/* Creates the instance's placement for model on w. NULL when out of memory. */
ctl_place *ctl_place_add(struct ctl_core *c, struct ctl_inst *inst, uint32_t model, ctl_worker *w);
/* Releases every object of the placement and frees it (unlinking it from its worker). */
void ctl_place_release(struct ctl_core *c, ctl_place *p);
/* The contention plan on w for requester req, which needs n more KV pages (kv) or embeddings
 * (!kv) where avail are free: the instances to end, newest first, among those launched after
 * req that hold some there (FCFS, paper §5.2) — one of another tenant only while that tenant
 * holds on w at least what req's tenant would after the allocation (its holdings + n), so a
 * tenant never ends the instances of a tenant holding less. Planning stops once avail plus
 * what the planned instances hold reaches n. out: *n_out instances (malloc'd; the caller
 * frees it). *holds: what they hold there (an upper bound of what ending them frees: shared
 * pages stay while another holder lives); *spared: a later instance was left to its tenant.
 * False when out of memory (nothing planned). */
bool ctl_place_plan_victims(const ctl_worker *w, const struct ctl_inst *req, bool kv, uint32_t n,
                            uint32_t avail, struct ctl_inst ***out, size_t *n_out, uint64_t *holds,
                            bool *spared);

#endif
