/* wrk_exec.h — the worker's batch executor: one thread that runs the scheduling steps the
 * controller sends (WorkerDown.batches) in arrival order on the backend, and hands back one
 * WorkerUp per step with a BatchResult per batch and the step's credit.
 *
 * Owns: the step queue, the executor thread, the liveness of physical slots (SlotBatch), the
 * validation of every slot id against capacities and liveness, the translation of each batch
 * kind into backend calls over plain arrays, the mapping of failures to per-item or per-batch
 * results, and the execution counters of WorkerStats. Does not own: the link and its epochs
 * (wrk_node.c decides whether a result may still be sent), the compute (wrk_backend.h).
 *
 * Failure rules (services/worker/README.md, "Results"):
 *   * Whole batch (BatchResult.code, items empty): a batch with no known kind (UNIMPLEMENTED),
 *     a malformed batch (embed_text lists of different lengths; any bad id in a SlotBatch,
 *     which then changes nothing), and any error the backend reports for the items that
 *     passed the worker's checks (the engine changes nothing when it refuses a call).
 *   * Per item (ItemResult.code, INVALID_ARGUMENT): an item that names a slot outside the
 *     capacities or not allocated by an earlier SlotBatch, or has a bad count, length, top_k
 *     or temperature. The other items of the batch still run.
 *
 * Threads: submit, reset, stats and stop may be called from any thread; emit and drain are
 * called on the thread that runs the step: the executor thread, or the submitter itself when
 * the executor was idle (submit then returns after the step: one submitting thread, the
 * link's, keeps the order). */
#ifndef WRK_EXEC_H
#define WRK_EXEC_H

#include <stdint.h>

#include "pie/v1/controller.pb-c.h"
#include "pie_metrics.h"
#include "pie_status.h"
#include "wrk_backend.h"

typedef struct wrk_exec_limits {
    uint32_t kv_pages, embed_slots; /* slot ids are below these */
    uint32_t kv_page_size;
    uint32_t vocab_size;         /* token ids are below this */
    uint32_t max_context_tokens; /* positions are below this */
    uint32_t max_top_k, default_top_k;
} wrk_exec_limits;

typedef struct wrk_exec_opts {
    wrk_backend backend;
    wrk_exec_limits lim;
    /* One step's results: a WorkerUp with results (one per batch, in order) and credits = 1,
     * valid during the call; epoch is the one the step was submitted with. */
    void (*emit)(void *user, uint64_t epoch, const Pie__V1__WorkerUp *up);
    /* A step's Drain, after its batches' results were emitted. Optional. */
    void (*drain)(void *user, uint64_t epoch, const Pie__V1__Drain *drain);
    void *user;
    pie_metrics *metrics; /* NULL: no metrics */
} wrk_exec_opts;

typedef struct wrk_exec wrk_exec;

/* Starts the executor thread. NULL on failure (st says why). */
wrk_exec *wrk_exec_start(const wrk_exec_opts *opts, pie_status *st);

/* Queues a message holding batches and/or a drain; the executor owns it from now on (frees it
 * with rpc_msg_free). Never blocks on execution. */
void wrk_exec_submit(wrk_exec *x, Pie__V1__WorkerDown *down, uint64_t epoch);

/* The link was lost: drops the queued steps and, before the next step runs, frees every slot
 * (the controller treats a re-registered worker as new). Pool contents are kept. */
void wrk_exec_reset(wrk_exec *x);

/* Execution counters and live slots now (the other WorkerStats fields are left alone). */
void wrk_exec_stats(wrk_exec *x, Pie__V1__WorkerStats *out);

/* Drops queued steps, waits for the step in progress, joins the thread, frees. NULL is fine. */
void wrk_exec_stop(wrk_exec *x);

#endif
