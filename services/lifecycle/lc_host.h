/* lc_host.h — the `pie` host API of the lifecycle service (sdk/include/pie_abi.h, host side).
 *
 * Owns: the Z_pieZ_* functions that inferlets import, each instance's host state (futures,
 * deferred queue errors, client-message inbox, subscription inbox, call counters), answering
 * non-GPU calls in-process (tokenizer, models, HTTP through lc_http) and streaming GPU calls to
 * the controller over the Session (lc_session), routing CallResults and SessionEvents back to
 * the instance they belong to.
 * Does not own: instance threads, program storage, the public Lifecycle API (lc_inst.c,
 * lc_program.c); the Wasm runtime (wasm/). lc_inst.c drives an instance's host state through
 * the functions below, in this order: lc_host_inst_begin → (lc_wasm run on the instance's
 * thread, with opts.host = the lc_host_inst and opts.on_interrupt = lc_host_inst_wake) →
 * lc_host_inst_end → lc_host_inst_free. */
#ifndef LC_HOST_H
#define LC_HOST_H

#include <stddef.h>
#include <stdint.h>

#include "lc_session.h"
#include "lc_wasm.h"
#include "pie/v1/common.pb-c.h"
#include "pie_metrics.h"
#include "pie_budget.h"
#include "pie_status.h"

typedef struct lc_host lc_host;           /* one per process */
typedef struct lc_host_inst lc_host_inst; /* one per instance */

typedef struct lc_host_config {
    /* The tokenizers (not owned; must outlive the host). NULL: the host makes its own from
     * tokenizer_path, with no cache and no fetching. */
    struct lc_tokreg *tokreg;
    const char *tokenizer_path; /* without tokreg: ':'-separated directories searched for a
                                   model's tokenizer.json (each a model directory or a directory
                                   of model directories), matched by
                                   TokenizerInfo.tokenizer_sha256 */
    const char *http_allow;     /* ','-separated URL prefixes inferlets may fetch ("" = none) */
    uint64_t http_timeout_ms;   /* per request */
    uint64_t http_max_bytes;    /* response body cap */
    unsigned http_max_running;  /* requests running at once (0 = LC_HTTP_MAX_RUNNING) */
    /* limits.replica_memory (not owned; may be NULL): queued client and broadcast messages and
     * calls not yet answered are charged to it. */
    pie_budget *budget;
} lc_host_config;

/* Callbacks from the host state into the instance manager; called on any thread, with no host
 * lock held. */
typedef struct lc_host_inst_cb {
    void *ctx;
    /* The inferlet called send(): a message for the client. */
    void (*send)(void *ctx, const void *msg, size_t len);
    /* The controller ended the instance (InstanceTerminated) or the Session was lost: stop it
     * with this status (code is a pie_code; UNAVAILABLE for a lost Session). */
    void (*terminated)(void *ctx, pie_code code, const char *msg);
} lc_host_inst_cb;

/* Creates the host API over an existing (not necessarily connected) session. */
lc_host *lc_host_create(const lc_host_config *cfg, lc_session *session, pie_metrics *metrics,
                        pie_status *st);
/* After every instance was freed and after lc_session_destroy (the Session's thread calls into
 * the host until then). NULL is fine. */
void lc_host_destroy(lc_host *h);
/* The `pie` import module, for lc_wasm_rt_opts.host_fns. */
const lc_wasm_host_fn *lc_host_fns(size_t *n);

/* Registers an instance and sends its InstanceBegin. limits are the effective quotas (copied);
 * model is the default model (already resolved: never empty); tenant (NULL: anonymous) is
 * whose it is, with that tenant's cluster-wide quotas for the controller. */
lc_host_inst *lc_host_inst_begin(lc_host *h, uint64_t instance_id, const char *program_id,
                                 const char *model, const Pie__V1__ResourceLimits *limits,
                                 const Pie__V1__Tenant *tenant, const lc_host_inst_cb *cb,
                                 pie_status *st);
/* A client message for the inferlet's receive(). Caller checked the size. */
pie_code lc_host_inst_message(lc_host_inst *hi, const void *msg, size_t len, pie_status *st);
/* The client closed its input: receive() reports OUT_OF_RANGE once the inbox is empty. */
void lc_host_inst_close_input(lc_host_inst *hi);
/* lc_wasm_instance_opts.on_interrupt: wakes host calls blocked in a wait. `hi` is the
 * lc_host_inst. */
void lc_host_inst_wake(void *hi);
/* Current usage counters (kv_pages, embeddings, queues, api_calls; other fields untouched). */
void lc_host_inst_usage(lc_host_inst *hi, Pie__V1__ResourceUsage *u);
/* The instance's run ended with this status: sends InstanceEnd (unless the controller ended
 * it), fails its pending futures. The run must be over (no host call in progress). */
void lc_host_inst_end(lc_host_inst *hi, pie_code code, const char *msg);
void lc_host_inst_free(lc_host_inst *hi); /* after lc_host_inst_end; NULL is fine */

#endif
