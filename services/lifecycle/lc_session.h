/* lc_session.h — this lifecycle replica's Session with the controller and what it learns
 * over it: the replica index and the models the cluster serves.
 *
 * Owns: the reconnecting Session stream (hello on every (re)connect), the cached model list
 * (ModelsChanged events), and the ListModels method answered from that cache. Does not own
 * (yet): instances, the Wasm runtime and the host API — the lifecycle issue adds them beside
 * this file and sends their API calls over this session. */
#ifndef LC_SESSION_H
#define LC_SESSION_H

#include <stdint.h>

#include "pie_metrics.h"
#include "rpc.h"
#include "svc.h"

typedef struct lc_session_config {
    const char *replica_id;  /* stable name of this replica (empty = hostname:port) */
    const char *advertise;   /* host:port clients use to reach this replica ("" = unknown) */
} lc_session_config;

typedef struct lc_session lc_session;

lc_session *lc_session_create(const lc_session_config *cfg, pie_metrics *metrics,
                              pie_status *st);

/* pie.v1.Lifecycle methods implemented so far; *n gets the count. */
const rpc_method *lc_session_methods(lc_session *s, size_t *n);

/* Starts the Session (reconnecting with backoff). An empty replica id becomes
 * <hostname>:<gRPC port of sv>. */
pie_code lc_session_start(lc_session *s, const svc *sv, const svc_dial_config *dial,
                          pie_status *st);

/* The replica index from the controller's welcome; 0 while the Session is not connected. */
uint32_t lc_session_replica_index(lc_session *s);

/* Resolves a launch's model name: `requested` if the cluster serves it, or the only model when
 * `requested` is empty. PIE_NOT_FOUND (not served), PIE_INVALID_ARGUMENT (empty and several
 * models), PIE_UNAVAILABLE (no model known: not connected or no worker). Copies the name to
 * out (cap bytes, NUL-terminated). */
pie_code lc_session_resolve_model(lc_session *s, const char *requested, char *out, size_t cap,
                                  pie_status *st);

/* After the server has shut down. NULL is fine. */
void lc_session_destroy(lc_session *s);

#endif
