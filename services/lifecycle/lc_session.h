/* lc_session.h — this lifecycle replica's Session with the controller and what it learns
 * over it: the replica index and the models the cluster serves.
 *
 * Owns: the reconnecting Session stream (hello on every (re)connect), the cached model list
 * (ModelsChanged events), the ListModels method answered from that cache, and the outbound
 * path of the stream: instance threads pack SessionUp parts (InstanceBegin, ApiCall,
 * InstanceEnd) into a staging buffer of their own and flush it into the session's outbox; one
 * sender thread coalesces whatever the outbox holds into one SessionUp (docs/wire-contracts.md,
 * "one message each way per hop"), so no instance thread waits on the network; it holds a send
 * briefly while instances woken by the last results are still staging (lc_session_gather_add),
 * so that their calls leave together. Inbound results
 * and events go to a sink (lc_host).
 * Does not own: what the calls mean and whom results belong to (lc_host*.c), instances
 * (lc_inst.c). */
#ifndef LC_SESSION_H
#define LC_SESSION_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pie/v1/controller.pb-c.h"
#include "pie_metrics.h"
#include "rpc.h"
#include "svc.h"

typedef struct lc_session_config {
    const char *replica_id; /* stable name of this replica (empty = hostname:port) */
    const char *advertise;  /* host:port clients use to reach this replica ("" = unknown) */
    /* A health name (registered with svc_add_health) that is ready only while the Session is
     * connected, knows a model to launch on and the model gate (lc_session_set_model_gate)
     * agrees: the readiness probe's name. NULL: none. */
    const char *ready_health;
} lc_session_config;

typedef struct lc_session lc_session;

lc_session *lc_session_create(const lc_session_config *cfg, pie_metrics *metrics, pie_status *st);

/* pie.v1.Lifecycle methods implemented so far; *n gets the count. */
const rpc_method *lc_session_methods(lc_session *s, size_t *n);

/* Starts the Session (reconnecting with backoff). An empty replica id becomes
 * <hostname>:<gRPC port of sv>. cfg.ready_health of sv is not ready until the first model
 * list arrives. */
pie_code lc_session_start(lc_session *s, svc *sv, const svc_dial_config *dial, pie_status *st);

/* The replica index from the controller's welcome; 0 while the Session is not connected. */
uint32_t lc_session_replica_index(lc_session *s);

/* Resolves a launch's model name: `requested` if the cluster serves it, or the only model when
 * `requested` is empty. PIE_NOT_FOUND (not served), PIE_INVALID_ARGUMENT (empty and several
 * models), PIE_UNAVAILABLE (no model known: not connected or no worker). Copies the name to
 * out (cap bytes, NUL-terminated). */
pie_code lc_session_resolve_model(lc_session *s, const char *requested, char *out, size_t cap,
                                  pie_status *st);

/* ---- inbound: results and events ----------------------------------------------------------- */

/* Receives what the controller sends besides the welcome and the model list. Callbacks run on
 * the Session's thread, one at a time; they must not block. */
typedef struct lc_session_sink {
    void *ctx;
    /* A SessionDown with results and/or events (borrowed for the call). */
    void (*on_down)(void *ctx, const Pie__V1__SessionDown *down);
    /* The Session ended (why: its status, UNAVAILABLE with the reason when this replica
     * restarted it because parts of it were lost): the controller has forgotten every instance
     * of this replica; their calls will never be answered. */
    void (*on_lost)(void *ctx, const pie_status *why);
} lc_session_sink;
/* Sets the sink (copied); before lc_session_start. */
void lc_session_set_sink(lc_session *s, const lc_session_sink *sink);

/* ---- outbound: SessionUp parts ---------------------------------------------------------------
 * Each part is packed once, on the thread that makes it, into a staging buffer; the sender
 * thread later puts the packed parts into a SessionUp as they are (as its repeated fields
 * begins = 2, calls = 3, ends = 4), so nothing is copied twice or re-packed. */
enum { LC_SESSION_BEGIN = 2, LC_SESSION_CALL = 3, LC_SESSION_END = 4 };

typedef struct lc_session_stage {
    uint8_t *buf; /* records: u32 field, u32 len, len bytes (varint length + packed message) */
    size_t len, cap;
    size_t n; /* records */
} lc_session_stage;

/* Appends one part (an InstanceBegin, ApiCall or InstanceEnd for field). Fails only when out of
 * memory. */
pie_code lc_session_stage_add(lc_session_stage *sg, unsigned field, const ProtobufCMessage *part,
                              pie_status *st);
/* Moves the staged parts to the outbox and wakes the sender; sg is empty afterwards. Parts staged
 * for an earlier connection (epoch is not the current one) are discarded: the controller forgot
 * those instances; returns PIE_UNAVAILABLE then. When the outbox cannot take the parts (out of
 * memory) they cannot be dropped alone — later parts would reach the controller without them —
 * so the connection ends: PIE_UNAVAILABLE with the reason, nothing more is queued for it, and
 * the Session restarts, failing every instance of it (on_lost) at once. woken: the instance was
 * counted by lc_session_gather_add since its last flush (it is done now, even with nothing
 * staged). */
pie_code lc_session_flush(lc_session *s, uint64_t epoch, lc_session_stage *sg, bool woken,
                          pie_status *st);
/* Counts an instance that results just woke (link thread): until it flushes (woken = true) the
 * sender holds what the outbox has, briefly, so the woken instances' next calls leave together. */
void lc_session_gather_add(lc_session *s);
void lc_session_stage_free(lc_session_stage *sg);
/* Waits (at most timeout_ms) until what instances flushed has been handed to the Session's
 * stream: before the gRPC server stops, which ends that stream (rpc_link_opts.server). */
void lc_session_settle(lc_session *s, int64_t timeout_ms);
/* The current connection (changes on every reconnect), or 0 while the Session is not open (no
 * hello sent). Instances remember the epoch they began in. */
uint64_t lc_session_epoch(lc_session *s);

/* ---- cluster storage --------------------------------------------------------------------------
 */

/* The channel to the controller (the Session's), for the cluster storage calls (lc_store.c);
 * NULL before lc_session_start. Valid until lc_session_destroy. */
rpc_channel *lc_session_channel(lc_session *s);

/* What lc_store hears from the Session. Callbacks run on the Session's thread and must not
 * block on the network. */
typedef struct lc_session_store_hooks {
    void *ctx;
    void (*welcomed)(void *ctx); /* the controller accepted a (re)connect */
    /* SessionEvent program_dropped: delete the local copy, or release tenant's hold on it when
     * tenant is not "" (quick disk work is fine). */
    void (*program_dropped)(void *ctx, const char *program_id, const char *tenant);
} lc_session_store_hooks;
/* Sets the hooks (copied); before lc_session_start. */
void lc_session_set_store_hooks(lc_session *s, const lc_session_store_hooks *h);

/* ---- readiness ------------------------------------------------------------------------------ */

/* A further condition of readiness (cfg.ready_health) on the model list: `ready` says whether
 * every model of mc can be served now (e.g. its tokenizer is loaded), `changed` hears of every
 * new list. Both run under the Session's lock: they must not block or call the session. */
typedef struct lc_session_model_gate {
    void *ctx;
    bool (*ready)(void *ctx, const Pie__V1__ModelsChanged *mc);
    void (*changed)(void *ctx, const Pie__V1__ModelsChanged *mc);
} lc_session_model_gate;
/* Sets the gate (copied); before lc_session_start. */
void lc_session_set_model_gate(lc_session *s, const lc_session_model_gate *g);
/* Re-evaluates readiness (call when the gate's answer may have changed). Thread-safe. */
void lc_session_update_ready(lc_session *s);

/* ---- models --------------------------------------------------------------------------------- */

/* Increases whenever the model list changes (starts at 0: no list yet). */
uint64_t lc_session_models_gen(lc_session *s);
/* Calls fn with the current model list (NULL if none yet) under the session's lock: fn copies
 * what it needs and must not call back into the session. Returns the list's generation. */
uint64_t lc_session_models_visit(lc_session *s,
                                 void (*fn)(void *ctx, const Pie__V1__ModelsChanged *mc),
                                 void *ctx);

/* ---- tests ----------------------------------------------------------------------------------
 * Injection points for tests that force the races and failures of the outbound path
 * (tests/integration/test_session_failures.c). Services never set them: all zero, no effect. */
typedef struct lc_session_test_hooks {
    void *ctx;
    /* The sender thread took `parts` parts filled for connection `epoch` out of the outbox and
     * is about to send them, outside every lock: a test may block here while it forces a
     * reconnect. */
    void (*before_send)(void *ctx, uint64_t epoch, size_t parts);
    /* Grows the outbox instead of realloc (same contract): a test returns NULL to fail it. */
    void *(*outbox_realloc)(void *ctx, void *p, size_t bytes);
} lc_session_test_hooks;
/* Sets the hooks (copied); before lc_session_start. */
void lc_session_set_test_hooks(lc_session *s, const lc_session_test_hooks *h);

/* After the server has shut down. NULL is fine. */
/* Processes one SessionDown as if the controller had sent it on the Session (what the link's
 * message callback does): for the fuzz harness of the Session (tests/fuzz/fuzz_lc_session.c).
 * Takes down: freed here, or kept and freed later (the models snapshot). */
void lc_session_deliver(lc_session *s, Pie__V1__SessionDown *down);
void lc_session_destroy(lc_session *s);

#endif
