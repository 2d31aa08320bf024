/* ctl_core_int.h — the controller core's state, shared by ctl_core.c, ctl_exec.c and
 * ctl_place.c. Not for use outside services/controller (the glue and tests use ctl_core.h).
 *
 * All of this is touched by one thread at a time: the caller of the ctl_core_* functions holds
 * the controller's mutex (ctl_cluster.c). */
#ifndef CTL_CORE_INT_H
#define CTL_CORE_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ctl_arena.h"
#include "ctl_core.h"
#include "ctl_map.h"
#include "ctl_place.h"
#include "ctl_pubsub.h"
#include "ctl_queue.h"
#include "ctl_sched.h"
#include "ctl_vspace.h"
#include "pie_tenant.h"

/* A tenant's cluster-wide holdings against its quotas (InstanceBegin.tenant). Made at its first
 * instance and kept for the core's life: its persistent exports outlive its instances. */
typedef struct ctl_tenant {
    char name[PIE_TENANT_NAME_MAX + 1];
    uint32_t q_insts, q_kv, q_export; /* quotas, 0 = none (q_export 0: exports.max_pages) */
    uint32_t n_insts, n_kv;           /* live instances; KV pages they hold */
    uint32_t n_export_pages;          /* pages of its persistent exports */
} ctl_tenant;

/* A kept SessionUp, referenced by the calls that point into it. */
typedef struct ctl_msg {
    Pie__V1__SessionUp *up;
    uint32_t refs;
} ctl_msg;

typedef struct ctl_inst {
    uint64_t id;
    struct ctl_replica *rep;
    struct ctl_inst *rep_prev, *rep_next; /* the replica's instances */
    uint64_t launch;                      /* launch order, cluster-wide (FCFS) */
    char *model;                          /* default model of its queues */
    char *program_id;
    uint32_t lim_kv, lim_emb, lim_queues; /* ResourceLimits; 0 = no limit */
    uint32_t n_kv, n_emb;                 /* held now (allocated + imported); change n_kv
                                             with ctl_inst_kv_add (the tenant's sum follows) */
    ctl_tenant *tenant;
    ctl_map32 qids;                       /* queue id → index into qv */
    ctl_queue **qv;                       /* attached queues by index; NULL = free entry */
    uint32_t n_qv, cap_qv;
    ctl_vec32 qfree;   /* free qv indices */
    uint32_t n_queues; /* attached queues */
    ctl_queue **all;   /* every queue object, attached or draining */
    uint32_t n_all, cap_all;
    ctl_place *places;
    uint32_t n_tied_exports; /* non-persistent exports it made */
    ctl_subs subs;
    uint64_t batch_serial; /* serial of the batch its conflict chain is for */
    int32_t batch_first;   /* first entry of that chain in the step's conflict list */
    bool dead;
    bool counted; /* counted in tenant->n_insts (not when refused by its instance quota) */
    struct ctl_inst *grave_next;
} ctl_inst;

struct ctl_replica {
    struct ctl_replica *next;
    uint32_t index;
    void *link;
    char *replica_id, *address, *version; /* from its hello */
    uint64_t connected_unix_ms;
    uint64_t calls;
    uint32_t n_insts;
    ctl_inst *insts;
    /* Outbox: the SessionDown being assembled, sent once per core entry. */
    Pie__V1__CallResult *res;
    uint32_t n_res, cap_res;
    Pie__V1__SessionEvent *ev;
    uint32_t n_ev, cap_ev;
    ctl_arena arena; /* payloads of res / ev */
    bool dirty;
    struct ctl_replica *dirty_next;
};

/* One conflict-tracking entry of the batch being formed (forward and embed_text). */
typedef struct ctl_conf {
    ctl_inst *inst;
    int32_t next_same; /* next entry of the same instance, or -1 */
    uint32_t item;     /* forward: index into step items; embed: first slot in emb_slots */
    uint32_t n;        /* embed: slots */
} ctl_conf;

/* The WorkerDown under construction (one at a time: the core is single-threaded). */
typedef struct ctl_step {
    ctl_worker *w;
    const Pie__V1__ModelInfo *model;
    ctl_arena arena;  /* every struct and array of the message */
    ctl_vecp batches; /* Pie__V1__Batch * */
    ctl_vecp recs;    /* ctl_batch * (NULL for a SlotBatch without calls), same order */
    /* The batch being formed. */
    int kind;
    ctl_batch *rec;
    ctl_vecp items;      /* item structs of the batch (ForwardItem *, NextDistItem *, ...) */
    ctl_vec32 emb_slots; /* embed_text: slots of the admitted calls, in order */
    ctl_vecp emb_calls;  /* embed_text: the admitted calls, in order */
    uint32_t n_items, n_tokens;
    size_t bytes;        /* an upper bound of the step's size on the wire so far (ctl_msg_budget) */
    bool full;           /* the step reached its byte budget: no more batches or slot changes */
    size_t result_bytes; /* next_dist: an upper bound of the batch's result on the wire */
    uint64_t serial;
    ctl_conf *conf;
    uint32_t n_conf, cap_conf;
} ctl_step;

struct ctl_core {
    ctl_core_config cfg;
    ctl_sink sink;
    pie_map64 insts;
    uint32_t n_insts;
    ctl_replica *replicas;
    ctl_worker *workers;
    ctl_model *models;
    uint32_t n_models, cap_models;
    ctl_exports exports;
    ctl_mapstr tenants;       /* name → ctl_tenant * */
    int64_t export_sweep_ns;  /* next sweep of expired persistent exports (exports.ttl) */
    ctl_pubsub ps;
    uint64_t seq;    /* last call arrival number */
    uint64_t launch; /* last launch number */
    uint64_t batch_serial;
    int64_t now_ns; /* time of the current entry */
    uint64_t started_unix_ms;
    ctl_slab s_calls, s_msgs, s_batches, s_queues, s_places;
    ctl_replica *dirty;
    ctl_inst *grave; /* ended instances, freed at the end of the entry */
    ctl_vecp grave_queues;
    ctl_step step;
    uint32_t depth; /* entry nesting (the graveyard is emptied at depth 0) */
    bool draining;  /* ctl_core_drain was called: workers get no more steps */
    char drain_reason[128];
    /* metrics (may be NULL) */
    pie_counter *m_calls, *m_batches, *m_steps, *m_terminated, *m_items;
    pie_counter *m_kv_spills; /* KV allocations granted past a worker's effective capacity */
    pie_counter *m_deferred;  /* calls a worker deferred (taken back) */
    pie_counter *m_defer_failed; /* calls failed for being deferred more than CTL_DEFER_MAX */
    pie_gauge *m_instances, *m_workers, *m_replicas, *m_waiting;
    pie_histogram *m_wait;       /* GPU call: arrival → taken into a batch, seconds */
    pie_histogram *m_batch_size; /* items per batch sent */
    pie_metrics *metrics;        /* for the per-worker series (ctl_core_sample_metrics) */
};

/* ---- ctl_core.c ----------------------------------------------------------------------------- */

/* Brackets every entry point: the outermost leave dispatches to workers, sends the outboxes and
 * frees what died during the entry. */
void ctl_core_enter(ctl_core *c, int64_t now_ns);
void ctl_core_leave(ctl_core *c);

/* Runs q's head calls while they are controller calls; links q into its worker's ready list
 * if the head is then a GPU call. Not while a batch is being formed (use the settle list). */
void ctl_core_advance(ctl_core *c, ctl_queue *q);
/* A taken call completed: retire what can be retired on its queue (emitting results). */
void ctl_core_completed(ctl_core *c, ctl_call *call);
/* Frees a call record (its message reference, strings). */
void ctl_core_call_free(ctl_core *c, ctl_call *call);
/* Ends an instance on the controller's initiative: InstanceTerminated{code, msg} to its
 * replica, then as InstanceEnd. */
void ctl_core_terminate(ctl_core *c, ctl_inst *inst, pie_code code, const char *msg);
/* Sends w Drain{shutdown = false, the core's drain reason} once; it gets no step after it. */
void ctl_core_drain_worker(ctl_core *c, ctl_worker *w);
/* A leaving worker (WorkerUp.draining) holds no instance any more: sends it
 * Drain{shutdown = true} once, after which it gets no step and exits. */
void ctl_core_retire_worker(ctl_core *c, ctl_worker *w);
/* Adds a CallResult to the replica's outbox; returns it (payload to be set by the caller) or
 * NULL when out of memory. msg is copied. */
Pie__V1__CallResult *ctl_core_result(ctl_core *c, ctl_replica *r, uint64_t instance_id,
                                     uint64_t call_id, uint32_t code, const char *msg);
/* Adds an event to the replica's outbox (zeroed, its case to be set by the caller). */
Pie__V1__SessionEvent *ctl_core_event(ctl_core *c, ctl_replica *r);
/* Sends ModelsChanged (plus an optional event before it) to one replica or all. */
void ctl_core_announce_models(ctl_core *c, ctl_replica *to, const Pie__V1__SessionEvent *extra);

/* Per-worker KV page gauges of w (gone: zeroed, the group left). */
void ctl_core_worker_gauges(ctl_core *c, const ctl_worker *w, bool gone);

/* ---- ctl_exec.c ----------------------------------------------------------------------------- */

/* Runs a controller call taken from q (alloc, dealloc, export, unexport, import): completes
 * it. */
void ctl_exec_ctrl(ctl_core *c, ctl_queue *q, ctl_call *call);
/* Fails a GPU call of an instance with no objects of the queue's model (precise message). */
void ctl_exec_fail_unplaced(ctl_core *c, ctl_queue *q, ctl_call *call);
/* Forms and sends steps on w while it has credits and work. */
void ctl_exec_dispatch(ctl_core *c, ctl_worker *w);
/* Whether call, q's head, is a controller call that must wait because q has calls in flight on
 * a worker that may defer them (a deferred call must run before it). */
bool ctl_exec_ctrl_waits(const ctl_queue *q, const ctl_call *call);
/* After a WorkerUp's results: advances the queues whose last in-flight call was answered on w
 * (they waited: ctl_queue.held). */
void ctl_exec_wake(ctl_core *c, ctl_worker *w);
/* Applies one BatchResult to the oldest outstanding batch of w. Returns false on a protocol
 * violation (the link is ended by the caller with st). */
bool ctl_exec_result(ctl_core *c, ctl_worker *w, Pie__V1__BatchResult *r, pie_status *st);
/* Frees an answered / abandoned batch record, freeing its orphaned calls. */
void ctl_exec_batch_free(ctl_core *c, ctl_batch *b);
void ctl_exec_step_free(ctl_step *s);
/* Frees the batch-record slab, with the buffers its records keep. */
void ctl_exec_free_batches(ctl_slab *s);
/* ExportInfo copies (in a) of tenant's exports (NULL: every tenant's), by tenant then name. -1
 * when out of memory. */
int ctl_exec_export_infos(ctl_core *c, ctl_arena *a, const char *tenant,
                          Pie__V1__ExportInfo ***out, size_t *n);
/* Runs list_exports / broadcast / subscribe / unsubscribe for inst (no queue). */
void ctl_exec_queueless(ctl_core *c, ctl_inst *inst, const Pie__V1__ApiCall *api);

/* Persistent exports under exports.ttl are looked at this often: expiry is this coarse. */
#define CTL_EXPORT_SWEEP_NS (1000 * 1000000LL)

/* The instance's KV page count changes by delta; its tenant's sum follows. */
static inline void ctl_inst_kv_add(ctl_inst *inst, int64_t delta) {
    if (delta < 0 && (uint64_t)-delta > inst->n_kv) delta = -(int64_t)inst->n_kv;
    inst->n_kv = (uint32_t)((int64_t)inst->n_kv + delta);
    if (inst->tenant) {
        int64_t t = (int64_t)inst->tenant->n_kv + delta;
        inst->tenant->n_kv = t < 0 ? 0 : (uint32_t)t;
    }
}

/* RESOURCE_EXHAUSTED naming the tenant's quota when n more would exceed it. */
pie_code ctl_tenant_quota(const char *op, const ctl_tenant *t, const char *quota, uint32_t limit,
                          uint32_t held, uint32_t n, pie_status *st);
/* The persistent export page quota of t (its own, else exports.max_pages; 0 = none). */
uint32_t ctl_tenant_export_quota(const ctl_core *c, const ctl_tenant *t);

/* server.max_message as the core applies it (0 in the config: the contract's 64 MiB). */
static inline uint64_t ctl_msg_max(const ctl_core *c) {
    return c->cfg.max_message_bytes ? c->cfg.max_message_bytes : (uint64_t)64 << 20;
}

/* The bytes one SessionDown or WorkerDown may carry: server.max_message less room for the
 * message's own framing. */
static inline size_t ctl_msg_budget(const ctl_core *c) {
    uint64_t max = ctl_msg_max(c);
    return max > 1024 ? (size_t)(max - 256) : (size_t)(max / 2);
}

/* The model info of a queue. */
static inline const Pie__V1__ModelInfo *ctl_model_info(const ctl_core *c, uint32_t model) {
    return c->models[model].info;
}

#endif
