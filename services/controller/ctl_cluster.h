/* ctl_cluster.h — the controller's gRPC face: the methods of pie.v1.Controller bound to one
 * ctl_core and one ctl_registry.
 *
 * Owns: the Session and WorkerLink streams as transport (first message → join, later messages
 * → the core, stream end → leave, the core's output → rpc_call_send / rpc_call_cancel),
 * ClusterStatus, the mutex that serialises every entry into the core, the timer thread that
 * fires what is due (t_only / k_only batches, silent-worker detection), and the cluster
 * storage calls (GetTokenizer, PutProgram, GetProgram, DropProgram) over ctl_registry: a
 * registration's tokenizer.json is checked against its hash and moved into the registry
 * before the core sees the registration; a put is hashed on a thread of its own.
 * Does not own: any protocol logic (ctl_core.h and the files it lists), storage
 * (ctl_registry.h).
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

typedef struct ctl_cluster_config {
    ctl_core_config core;
    uint64_t registry_bytes;    /* programs.registry_size: most bytes of programs kept */
    uint64_t program_max_bytes; /* programs.max_size: largest program PutProgram accepts */
} ctl_cluster_config;

/* NULL with st set on failure. */
ctl_cluster *ctl_cluster_create(const ctl_cluster_config *cfg, pie_metrics *metrics,
                                pie_status *st);
/* After the server has shut down (no callback can run); waits for puts being hashed. NULL is
 * fine. */
void ctl_cluster_destroy(ctl_cluster *c);

/* Shutdown, before the server stops: sends every worker Drain{shutdown = false, reason}
 * (ctl_core_drain) and waits up to timeout_ms for the steps they hold to be answered, so their
 * results still reach the replicas; then ends the WorkerLink streams (the workers dial the
 * next controller). Returns the steps still unanswered (0: drained). */
uint32_t ctl_cluster_drain(ctl_cluster *c, const char *reason, int64_t timeout_ms);

/* The method table of pie.v1.Controller bound to c; *n gets its length. */
const rpc_method *ctl_cluster_methods(ctl_cluster *c, size_t *n);

#endif
