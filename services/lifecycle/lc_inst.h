/* lc_inst.h — the instances of a lifecycle replica.
 *
 * Owns: the instance table (launch order, lookup by id, retention of exited instances by time
 * and count), one thread per instance (small stack, lc_wasm_thread_attr_init) that loads the
 * program, runs it and reports how it ended, instance ids ((replica index << 48) | random 48
 * bits), effective quotas (request → server defaults → server maxima), its tenant (who may see
 * it; the tenant's instance quota as far as this replica can count it), each instance's output
 * buffer (messages from send(), stdout, stderr; a per-instance cap with the oldest output
 * dropped first while no client is attached; charged to the replica's memory budget, whose
 * reclaimer drops what exited instances keep, earliest exit first), the one attached client
 * call (a Run's from its launch) with back-pressure (while attached, output is never dropped:
 * the writer waits while the same cap of output or 256 responses wait for the client, at most
 * until its wall deadline), client messages and end of input, the mapping of lc_wasm outcomes
 * onto InstanceExit statuses (lifecycle.proto), and the info log line of every instance's end
 * (lc.inst.exited / lc.inst.trapped: instance, program, tenant, status, reason).
 * Does not own: the RPC methods (lc_api.c), program storage (lc_program.c), the `pie` host API
 * (lc_host.c, driven here through lc_host_inst_*), the Wasm runtime (wasm/). */
#ifndef LC_INST_H
#define LC_INST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "lc_host.h"
#include "lc_program.h"
#include "lc_session.h"
#include "pie/v1/lifecycle.pb-c.h"
#include "pie_budget.h"
#include "pie_metrics.h"
#include "pie_status.h"
#include "rpc.h"

typedef struct lc_inst_mgr lc_inst_mgr;
typedef struct lc_inst lc_inst; /* reference counted */

/* The quota fields of ResourceLimits as plain numbers (0 never appears once configured). */
typedef struct lc_limits {
    uint64_t memory_bytes;
    uint32_t kv_pages, embeddings, queues;
    uint64_t message_bytes;
    int64_t cpu_ms, wall_ms; /* int64: the config's duration type */
} lc_limits;

typedef struct lc_inst_config {
    lc_limits defaults;           /* for fields a launch leaves at 0 */
    lc_limits maxima;             /* requested values above these are lowered to them */
    uint64_t output_buffer_bytes; /* per instance, while no client is attached */
    int64_t retention_ms;         /* how long exited instances stay listed and attachable */
    uint64_t retention_max;       /* most exited instances kept; the earliest exits go first */
    size_t thread_stack_bytes;    /* native stack of an instance thread */
    pie_metrics *metrics;         /* instance histograms and gauges; NULL: none */
    pie_budget *budget;           /* limits.replica_memory; NULL: none */
    /* limits.tenant_memory_share: with tenants and a bounded budget, the part of it one
     * tenant's instances' linear memories may hold (0 or >= 1: no share of their own) */
    double tenant_memory_share;
} lc_inst_config;

lc_inst_mgr *lc_inst_mgr_create(const lc_inst_config *cfg, lc_program_store *programs,
                                lc_host *host, lc_session *session, pie_status *st);
/* Refuses new launches from now on (UNAVAILABLE "... shutting down (draining its instances)
 * ..."); running instances go on. */
void lc_inst_mgr_refuse_launches(lc_inst_mgr *m);
/* The drain of SIGTERM: refuses new launches from now on (UNAVAILABLE "... shutting down
 * (draining its instances) ...") and waits up to grace_ms for the running instances to end by
 * themselves (attached clients get all their output and their own exit status). Returns how
 * many still run; lc_inst_mgr_stop ends them. */
size_t lc_inst_mgr_drain(lc_inst_mgr *m, int64_t grace_ms);
/* Refuses new launches, terminates every running instance (status UNAVAILABLE "lifecycle
 * replica shutting down: ... (server.shutdown_grace)"; attached clients get it) and waits for
 * their threads. */
void lc_inst_mgr_stop(lc_inst_mgr *m);
/* After lc_inst_mgr_stop and after the RPC server is gone. NULL is fine. */
void lc_inst_mgr_destroy(lc_inst_mgr *m);

/* Starts an instance as LaunchRequest says; *out gets a reference (lc_inst_unref) and *limits
 * the effective quotas. run_call (a Run call; NULL for Launch) is sent `started` (its id and
 * quotas) and attached before the instance can write anything, so none of its output is
 * buffered or dropped. Errors: NOT_FOUND (program, model), INVALID_ARGUMENT (args, model),
 * UNAVAILABLE (no controller session), RESOURCE_EXHAUSTED (no thread). */
pie_code lc_inst_launch(lc_inst_mgr *m, const Pie__V1__LaunchRequest *req,
                        const pie_tenant *tenant, rpc_call *run_call, lc_inst **out,
                        lc_limits *limits, pie_status *st);
/* The instance with this id, with a reference, if tenant may see it (its own; any for an admin
 * tenant or tenant NULL); NOT_FOUND (naming the owning replica for an id of another replica)
 * otherwise: another tenant's instance is reported exactly as an unknown one. */
lc_inst *lc_inst_find(lc_inst_mgr *m, uint64_t id, const pie_tenant *tenant, pie_status *st);
void lc_inst_unref(lc_inst *in); /* NULL is fine */
uint64_t lc_inst_id(const lc_inst *in);

/* Attaches call (an Attach call; the instance takes a reference): sends dropped_bytes if output
 * was dropped, the buffered output, then live output (none of it dropped: the instance's writes
 * wait while the client is slow), and at exit exit_status and finishes the call with OK.
 * FAILED_PRECONDITION if another call is attached. */
pie_code lc_inst_attach(lc_inst *in, rpc_call *call, pie_status *st);
/* Detaches call if it is the attached one; the instance keeps running. */
void lc_inst_detach(lc_inst *in, rpc_call *call);
/* A client message for receive(): INVALID_ARGUMENT above the instance's message_bytes. Ignored
 * once the instance exited. */
pie_code lc_inst_message(lc_inst *in, const void *msg, size_t len, pie_status *st);
void lc_inst_close_input(lc_inst *in);
/* Stops the instance with this exit status (the first stop wins); no-op once it exited. */
void lc_inst_stop(lc_inst *in, pie_code code, const char *msg);
/* Terminate: stops the instance (CANCELLED "terminated by client") and answers call with a
 * TerminateResponse once it has exited, its end queued to the controller ahead of anything
 * sent later — so a launch after the answer finds the tenant's instances quota freed. */
void lc_inst_terminate(lc_inst *in, rpc_call *call);

/* Every instance of the replica tenant may see (lc_inst_find), in launch order; free with
 * lc_inst_list_free. */
pie_code lc_inst_list(lc_inst_mgr *m, const pie_tenant *tenant, Pie__V1__InstanceInfo ***out,
                      size_t *n, pie_status *st);
void lc_inst_list_free(Pie__V1__InstanceInfo **list, size_t n);

/* ResourceLimits message fields from l (pointers into nothing: plain values). */
void lc_limits_to_pb(const lc_limits *l, Pie__V1__ResourceLimits *pb);

#endif
