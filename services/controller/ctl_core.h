/* ctl_core.h — the control layer as a state machine, without transport.
 *
 * Owns: everything the controller knows — lifecycle replicas and their instances, worker
 * groups and the models they serve, placements, virtual spaces, exports, tenants and their
 * quotas, queues, the schedulers, pub/sub — and the reactions to every message of the Session and WorkerLink protocols. Input:
 * the functions below, each fed one decoded message. Output: through ctl_sink, at most one
 * SessionDown per replica and one WorkerDown per worker (per credit) for each input.
 * Does not own: gRPC, threads and locks (ctl_cluster.c calls these functions with its mutex
 * held; none of them blocks), the configuration file (ctl_main.c).
 *
 * Split over several files, each owning one subsystem (see services/controller/README.md):
 * ctl_core.c (instances, replicas, calls in, results out, dispatch), ctl_exec.c (what each
 * API call does and the batches it becomes), ctl_place.c (worker groups, placement,
 * contention), with ctl_vspace / ctl_queue / ctl_sched / ctl_pubsub as pure building blocks.
 *
 * Messages passed in are borrowed unless a function says it takes them (it then frees them with
 * protobuf_c_message_free_unpacked, possibly after keeping them for a while). */
#ifndef CTL_CORE_H
#define CTL_CORE_H

#include <stdbool.h>
#include <stdint.h>

#include "ctl_sched.h"
#include "pie/v1/controller.pb-c.h"
#include "pie_metrics.h"
#include "pie_status.h"

typedef struct ctl_core ctl_core;
typedef struct ctl_replica ctl_replica;
typedef struct ctl_worker ctl_worker;

typedef enum ctl_contention {
    CTL_CONTENTION_KILL_NEWEST = 0, /* FCFS (paper §5.2): terminate the newest later instance */
    CTL_CONTENTION_FAIL_CALL = 1,   /* fail the allocating call with RESOURCE_EXHAUSTED */
} ctl_contention;

extern const char *const ctl_contention_names[]; /* "kill_newest", "fail_call", NULL */

typedef struct ctl_core_config {
    ctl_sched_config sched;
    ctl_contention contention;
    uint32_t heartbeat_ms; /* WorkerRegistered.heartbeat_ms; a link silent 3x this is lost */
    /* server.max_message: no SessionDown or WorkerDown is formed larger than this (results are
     * split at result boundaries, steps end early at batch / call boundaries); 0 = 64 MiB. */
    uint64_t max_message_bytes;
    uint32_t export_max_pages; /* exports.max_pages: a tenant's persistent export pages; 0 = none */
    int64_t export_ttl_ms;     /* exports.ttl: persistent exports unused this long go; 0 = never */
    double export_pool_share;  /* exports.max_pool_share: of the pool they live on; 0 = off */
} ctl_core_config;

/* Where the core's output goes. Each function is called with the core's caller's lock held and
 * must not call back into the core. Messages are borrowed for the call's duration. */
typedef struct ctl_sink {
    void (*to_replica)(void *user, void *link, const Pie__V1__SessionDown *m);
    void (*to_worker)(void *user, void *link, const Pie__V1__WorkerDown *m);
    /* End a stream (protocol violation, silent worker); its leave function follows later. */
    void (*end_link)(void *user, void *link, pie_code code, const char *msg);
    void *user;
} ctl_sink;

/* metrics may be NULL; if not, it must outlive every call but ctl_core_destroy. */
ctl_core *ctl_core_create(const ctl_core_config *cfg, const ctl_sink *sink, pie_metrics *metrics,
                          pie_status *st);
void ctl_core_destroy(ctl_core *c);

/* ---- Session (one per lifecycle replica) ---------------------------------------------------- */

/* The replica's first message (its hello; anything else in it is processed as by
 * ctl_core_session_up). Sends welcome + ModelsChanged. NULL with st set (the caller ends the
 * stream with st and frees hello_msg) when refused; takes hello_msg on success. */
ctl_replica *ctl_core_replica_join(ctl_core *c, void *link, Pie__V1__SessionUp *hello_msg,
                                   int64_t now_ns, pie_status *st);
/* Any later message; takes it. */
void ctl_core_session_up(ctl_core *c, ctl_replica *r, Pie__V1__SessionUp *up, int64_t now_ns);
/* The stream ended: every instance of the replica ends. */
void ctl_core_replica_leave(ctl_core *c, ctl_replica *r, int64_t now_ns);

/* ---- WorkerLink (one per worker group) ------------------------------------------------------ */

/* The worker's first message (its registration; credits, capacity and stats in it count too).
 * Sends WorkerRegistered and tells replicas the models. NULL with st set when refused (the
 * caller ends the stream and frees reg_msg); takes reg_msg on success. */
ctl_worker *ctl_core_worker_join(ctl_core *c, void *link, Pie__V1__WorkerUp *reg_msg,
                                 int64_t now_ns, pie_status *st);
/* Any later message; takes it. */
void ctl_core_worker_up(ctl_core *c, ctl_worker *w, Pie__V1__WorkerUp *up, int64_t now_ns);
/* The link ended (status: why): instances placed on it are terminated, replicas are told. */
void ctl_core_worker_leave(ctl_core *c, ctl_worker *w, const pie_status *why, int64_t now_ns);

/* ---- cluster storage ------------------------------------------------------------------------ */

/* A program was dropped from the registry (Controller.DropProgram), or tenant (non-empty)
 * released its hold on it: every replica gets a SessionEvent program_dropped naming both. */
void ctl_core_program_dropped(ctl_core *c, const char *program_id, const char *tenant,
                              int64_t now_ns);

/* ---- time ----------------------------------------------------------------------------------- */

/* Fires what is due at now_ns (t_only / k_only batches, heartbeat checks). Returns the next
 * time something will be due (0: nothing scheduled). */
int64_t ctl_core_tick(ctl_core *c, int64_t now_ns);
/* The earliest time something is due (0: none), as of the last call into the core. */
int64_t ctl_core_next_wake(const ctl_core *c);

/* ---- drain (shutdown) ------------------------------------------------------------------------ */

/* The controller is shutting down: every worker gets Drain{shutdown = false, reason} and no
 * step after it. Steps already sent finish on the workers and their results still reach the
 * replicas; workers that register later are drained at once; no new placement is made (an
 * allocation then fails UNAVAILABLE). Workers stay idle and linked until the stream ends,
 * then dial the next controller. */
void ctl_core_drain(ctl_core *c, const char *reason, int64_t now_ns);
/* Steps sent to workers and not answered yet (all workers): 0 once a drain is complete. */
uint32_t ctl_core_steps_out(const ctl_core *c);
/* Ends every WorkerLink stream UNAVAILABLE `why` (after a drain: the workers then dial the
 * next controller instead of holding the server's shutdown until its grace runs out). */
void ctl_core_end_worker_links(ctl_core *c, const char *why);

/* ---- status --------------------------------------------------------------------------------- */

/* Calls fn with the ClusterStatusResponse (valid during the call only). */
/* ListTenantExports: fn gets the exports of tenant (NULL: all), or NULL when out of memory;
 * the response lives for the call only. */
void ctl_core_list_exports(ctl_core *c, const char *tenant,
                           void (*fn)(void *arg, const Pie__V1__ListTenantExportsResponse *r),
                           void *arg);
/* DeleteTenantExport: removes the tenant's export (persistent or not); *pages gets its size.
 * NOT_FOUND when the tenant has no such export, INVALID_ARGUMENT for a malformed name. */
pie_code ctl_core_delete_export(ctl_core *c, const char *tenant, const char *name,
                                uint32_t *pages, int64_t now_ns, pie_status *st);
/* Sets the gauges sampled at scrape time (per-worker KV pages, waiting instances): a metrics
 * collector calls it with the core's lock held. */
void ctl_core_sample_metrics(ctl_core *c);
void ctl_core_status(ctl_core *c, void (*fn)(void *arg, const Pie__V1__ClusterStatusResponse *r),
                     void *arg);

#endif
