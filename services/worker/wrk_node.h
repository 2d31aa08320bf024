/* wrk_node.h — a worker process as the cluster sees it: its identity, model description and
 * capacities, the WorkerLink to the controller, and the pie.v1.Worker methods.
 *
 * Owns: registration over WorkerLink (re-sent on every reconnect), Info, TpJoin. Does not own
 * (yet): the engine — the model-runtime and controller/worker issues add model loading and
 * batch execution beside this file; until then a batch is answered UNIMPLEMENTED. */
#ifndef WRK_NODE_H
#define WRK_NODE_H

#include <stdint.h>

#include "pie_metrics.h"
#include "rpc.h"
#include "svc.h"

typedef struct wrk_node_config {
    const char *group_id;          /* worker group name */
    const char *model_name;        /* ModelInfo.name announced */
    const char *model_description;
    uint32_t kv_page_size;         /* tokens per KV page */
    uint32_t kv_pages;             /* KV pages of the pool */
    uint32_t embed_slots;          /* embedding slots of the pool */
    uint32_t max_batch_tokens, max_batch_items;
    const char *advertise;         /* host:port of this process's Worker service, for others */
} wrk_node_config;

typedef struct wrk_node wrk_node;

/* cfg strings are borrowed and must outlive the node. */
wrk_node *wrk_node_create(const wrk_node_config *cfg, pie_metrics *metrics, pie_status *st);

/* pie.v1.Worker methods bound to the node; *n gets the count. */
const rpc_method *wrk_node_methods(wrk_node *w, size_t *n);

/* Starts dialling the controller (reconnecting with backoff for the process's life). An empty
 * group id becomes <hostname>:<gRPC port of s> here, before the first registration. */
pie_code wrk_node_link_start(wrk_node *w, const svc *s, const svc_dial_config *dial,
                             pie_status *st);

/* Stops the link (closing the stream so the controller sees the worker leave) and frees.
 * Call after the server has shut down. NULL is fine. */
void wrk_node_destroy(wrk_node *w);

#endif
