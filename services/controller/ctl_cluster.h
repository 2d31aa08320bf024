/* ctl_cluster.h — the controller's view of the cluster: connected worker groups and lifecycle
 * replicas, and the three methods of pie.v1.Controller that maintain and report it.
 *
 * Owns: WorkerLink registration and loss, Session hello/welcome and model announcements,
 * ClusterStatus. Does not own (yet): resource virtualisation, command queues and the batch
 * scheduler (the controller/worker issue adds ctl_vspace, ctl_queue, ctl_sched beside this
 * file); until then every API call on a Session is answered UNIMPLEMENTED. */
#ifndef CTL_CLUSTER_H
#define CTL_CLUSTER_H

#include <stddef.h>

#include "pie_metrics.h"
#include "rpc.h"

typedef struct ctl_cluster ctl_cluster;

ctl_cluster *ctl_cluster_create(pie_metrics *metrics);
/* After the server has shut down (no callback can run). NULL is fine. */
void ctl_cluster_destroy(ctl_cluster *c);

/* The method table of pie.v1.Controller bound to c; *n gets its length. */
const rpc_method *ctl_cluster_methods(ctl_cluster *c, size_t *n);

#endif
