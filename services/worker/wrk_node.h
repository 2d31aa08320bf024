/* wrk_node.h — a worker process as the cluster sees it: its identity and loading state, the
 * WorkerLink to the controller, and the pie.v1.Worker methods.
 *
 * Owns: the loading state Info reports (LOADING → READY or FAILED), registration over
 * WorkerLink (re-sent on every reconnect), credits (the configured number after each
 * `registered`, one with the results of every step), the stats heartbeat thread, link epochs
 * (results of a step received on an earlier connection are never sent on a later one), splitting
 * results larger than server.max_message at batch boundaries, Drain, the drain of SIGTERM
 * (WorkerUp.draining, then waiting for the controller's release),
 * Info and TpJoin (rank 0 of a group whose ranks start one by one admits them against its
 * offer, tp/wrk_tp.h; otherwise refused: a launcher forks its ranks itself). In a
 * tensor-parallel group only rank 0 has a node: it registers the group once with its tp_size.
 * Does not own: running batches (wrk_exec.c), what is announced (wrk_desc.c), loading the
 * model (wrk_main.c), the other ranks (tp/wrk_tp.c). */
#ifndef WRK_NODE_H
#define WRK_NODE_H

#include <stdbool.h>
#include <stdint.h>

#include "pie_metrics.h"
#include "rpc.h"
#include "svc.h"
#include "wrk_backend.h"
#include "wrk_desc.h"
#include "wrk_exec.h"

typedef struct wrk_node_config {
    const char *group_id;       /* worker group name ("" = <hostname>:<grpc port>) */
    const char *advertise;      /* host:port of this process's Worker service, for others */
    uint32_t credits;           /* steps granted after registering (>= 1) */
    uint64_t max_message_bytes; /* largest WorkerUp sent (server.max_message); 0 = no limit */
    uint32_t tp_size;           /* ranks of this worker group (0 or 1: no tensor parallelism) */
} wrk_node_config;

typedef struct wrk_node wrk_node;

/* Info says LOADING until wrk_node_set_ready or wrk_node_set_failed. cfg strings are borrowed
 * and must outlive the node. */
wrk_node *wrk_node_create(const wrk_node_config *cfg, pie_metrics *metrics, pie_status *st);

/* pie.v1.Worker methods bound to the node; *n gets the count. */
const rpc_method *wrk_node_methods(wrk_node *w, size_t *n);

struct wrk_tp_offer;
/* Rank 0 of a group whose ranks start one by one (before the group forms): TpJoin admits
 * ranks against this offer (copied) and answers with its epoch and collective endpoint. */
void wrk_node_set_tp_offer(wrk_node *w, const struct wrk_tp_offer *offer); /* NULL: none */

/* Loading failed: Info says FAILED with this status from now on. */
void wrk_node_set_failed(wrk_node *w, const pie_status *why);

typedef struct wrk_node_ready {
    const wrk_desc *desc; /* borrowed; must outlive the node */
    wrk_backend backend;  /* its ctx must outlive the node */
    const char *device;   /* e.g. "cpu: 16 threads" (copied) */
    uint64_t device_pool_bytes, host_pool_bytes;
    wrk_exec_group group; /* rank 0 of a tensor-parallel group: its hooks; zero otherwise */
    /* rank 0 of a group: every rank's report, in rank order (copied; registration and Info
     * carry them); NULL and 0 otherwise */
    const struct wrk_tp_rank_info *ranks;
    uint32_t n_ranks;
    /* the memory policy (borrowed; must outlive the node): registration, Info, stats, and
     * CapacityChange when expansion moves the effective capacity */
    struct wrk_memrt *mem;
    /* The backend may defer items (wrk_exec_opts.may_defer): the registration says may_defer,
     * and each link whose controller answers defer_ok runs its steps with deferral. */
    bool may_defer;
} wrk_node_ready;

/* The model is loaded: starts the executor; Info says READY. */
pie_code wrk_node_set_ready(wrk_node *w, const wrk_node_ready *r, pie_status *st);

/* Starts dialling the controller (reconnecting with backoff for the process's life) and the
 * heartbeat. After wrk_node_set_ready. An empty group id becomes <hostname>:<gRPC port of s>
 * here, before the first registration. */
pie_code wrk_node_link_start(wrk_node *w, const svc *s, const svc_dial_config *dial,
                             pie_status *st);

/* The drain of SIGTERM: tells the controller WorkerUp.draining (no new placements; also on any
 * later registration) and waits up to grace_ms until the controller releases the worker
 * (Drain{shutdown} once no instance is placed on it) or the link ends. Returns false when the
 * grace ran out first: closing the link then ends the instances still placed here. */
bool wrk_node_drain(wrk_node *w, int64_t grace_ms);

/* Stops the link (closing the stream so the controller sees the worker leave), the heartbeat
 * and the executor, and frees. Call after the server has shut down. NULL is fine. */
void wrk_node_destroy(wrk_node *w);

#endif
