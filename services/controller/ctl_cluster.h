/* ctl_cluster.h — the controller's gRPC face: the three methods of pie.v1.Controller bound to
 * one ctl_core.
 *
 * Owns: the Session and WorkerLink streams as transport (first message → join, later messages
 * → the core, stream end → leave, the core's output → rpc_call_send / rpc_call_cancel),
 * ClusterStatus, the mutex that serialises every entry into the core, and the timer thread
 * that fires what is due (t_only / k_only batches, silent-worker detection).
 * Does not own: any protocol logic (ctl_core.h and the files it lists).
 *
 * Threading: the core runs on the RPC layer's completion-queue thread(s) under `mu`, so a
 * message that arrives is processed — calls validated, a step formed and sent to the worker,
 * results sent to replicas — without a thread hop; the timer thread takes the same mutex.
 * See services/controller/README.md for the measurement behind this choice. */
#ifndef CTL_CLUSTER_H
#define CTL_CLUSTER_H

#include <stddef.h>

#include "ctl_core.h"
#include "pie_metrics.h"
#include "rpc.h"

typedef struct ctl_cluster ctl_cluster;

/* NULL with st set on failure. */
ctl_cluster *ctl_cluster_create(const ctl_core_config *cfg, pie_metrics *metrics, pie_status *st);
/* After the server has shut down (no callback can run). NULL is fine. */
void ctl_cluster_destroy(ctl_cluster *c);

/* Shutdown, before the server stops: sends every worker Drain{shutdown = false, reason}
 * (ctl_core_drain) and waits up to timeout_ms for the steps they hold to be answered, so their
 * results still reach the replicas; then ends the WorkerLink streams (the workers dial the
 * next controller). Returns the steps still unanswered (0: drained). */
uint32_t ctl_cluster_drain(ctl_cluster *c, const char *reason, int64_t timeout_ms);

/* The method table of pie.v1.Controller bound to c; *n gets its length. */
const rpc_method *ctl_cluster_methods(ctl_cluster *c, size_t *n);

#endif
