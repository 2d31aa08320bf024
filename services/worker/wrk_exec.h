/* wrk_exec.h — the worker's batch executor: one thread that runs the scheduling steps the
 * controller sends (WorkerDown.batches) in arrival order on the backend, and hands back one
 * WorkerUp per step with a BatchResult per batch and the step's credit.
 *
 * Owns: the step queue, the executor thread, the liveness of physical slots (SlotBatch), the
 * validation of every slot id against capacities and liveness, the translation of each batch
 * kind into backend calls over plain arrays, the mapping of failures to per-item or per-batch
 * results, and the execution counters of WorkerStats. Does not own: the link and its epochs
 * (wrk_node.c decides whether a result may still be sent), the compute (wrk_backend.h), the
 * other ranks of a tensor-parallel group (tp/wrk_tp.c, through wrk_exec_group).
 *
 * Failure rules (services/worker/README.md, "Results"):
 *   * Whole batch (BatchResult.code, items empty): a batch with no known kind (UNIMPLEMENTED),
 *     a malformed batch (embed_text lists of different lengths; any bad id in a SlotBatch,
 *     which then changes nothing), and any error the backend reports for the items that
 *     passed the worker's checks (the engine changes nothing when it refuses a call).
 *   * Per item (ItemResult.code, INVALID_ARGUMENT): an item that names a slot outside the
 *     capacities or not allocated by an earlier SlotBatch, or has a bad count, length, top_k
 *     or temperature. The other items of the batch still run.
 *   * Deferred (ItemResult.deferred, code UNAVAILABLE "deferred"; only with deferral on, see
 *     wrk_exec_set_defer): a forward item the backend's scheduler deferred (eng_forward_plan),
 *     every later item of the step that depends on a deferred one (mem/wrk_dep.h), and every
 *     other item of a call (EmbedTextBatch.call_items, NextDistBatch.call_items) with one. A
 *     deferred item is not run at all and not counted as executed.
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

/* Hooks of a rank of a tensor-parallel group (tp/wrk_tp.h); all NULL otherwise. Rank 0 sets
 * all of them, the other ranks only `failed`. They are called by the thread that runs steps,
 * in step order, so the other ranks see the same steps and resets in the same order as rank
 * 0's executor, ordered with the steps' own collectives. */
typedef struct wrk_exec_group {
    /* Before a step's batches run (steps with batches only): hands the step to the other
     * ranks. Not PIE_OK: the group failed. */
    pie_code (*step)(void *g, const Pie__V1__WorkerDown *down, pie_status *st);
    /* Before the slots are freed by a reset (wrk_exec_reset): tells the other ranks. */
    pie_code (*reset)(void *g, pie_status *st);
    /* After a step's batches ran: PIE_OK while the group works. Not PIE_OK: a collective
     * failed during the step, whose results are then not emitted. */
    pie_code (*check)(void *g, pie_status *st);
    /* The group failed (st says why): the process leaves the cluster; does not return. */
    void (*failed)(void *g, const pie_status *st);
    void *g;
} wrk_exec_group;

typedef struct wrk_exec_opts {
    wrk_backend backend;
    wrk_exec_group group; /* a rank of a tensor-parallel group; zero otherwise */
    wrk_exec_limits lim;
    /* One step's results: a WorkerUp with results (one per batch, in order) and credits = 1,
     * valid during the call; epoch is the one the step was submitted with. */
    void (*emit)(void *user, uint64_t epoch, const Pie__V1__WorkerUp *up);
    /* A step's Drain, after its batches' results were emitted. Optional. */
    void (*drain)(void *user, uint64_t epoch, const Pie__V1__Drain *drain);
    void *user;
    pie_metrics *metrics; /* NULL: no metrics */
    /* After each forward batch the backend ran: its input tokens, its time, the KV pages live
     * now; on the thread that runs steps, between batches (the swap policy's adaptive
     * expansion, wrk_memrt.h, may change the engine's slot count there). Optional. */
    void (*after_forward)(void *mem_user, uint64_t tokens, uint64_t ns, uint32_t kv_live);
    /* After each SlotBatch that allocated KV pages: the KV pages live now (the swap policy
     * grows its effective capacity to hold them when the controller spilled, wrk_memrt.h); on
     * the thread that runs steps, before the next batch. Optional. */
    void (*after_slots)(void *mem_user, uint32_t kv_live);
    void *mem_user;
    /* The backend may defer forward items (forward_plan and forward_skip set: the cpu engine
     * under offload with memory.offload_defer, tp_size 1). The executor defers only while
     * wrk_exec_set_defer says the link's controller agreed. */
    bool may_defer;
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

/* wrk_exec_reset done at once on the calling thread: every slot is freed before it returns.
 * Only while no step runs or is queued (the loop of a follower rank, tp/wrk_tp.c, which
 * submits one step at a time and so always finds the executor idle). */
void wrk_exec_reset_now(wrk_exec *x);

/* Deferral on or off for the steps that start from now on (on only with opts.may_defer): the
 * link's controller answered WorkerRegistered.defer_ok (on), or the link ended (off). */
void wrk_exec_set_defer(wrk_exec *x, bool on);

/* Whether steps run with deferral now (Info's controller_deferral). */
bool wrk_exec_defers(wrk_exec *x);

/* Execution counters and live slots now (the other WorkerStats fields are left alone). */
void wrk_exec_stats(wrk_exec *x, Pie__V1__WorkerStats *out);

/* Drops queued steps, waits for the step in progress, joins the thread, frees. NULL is fine. */
void wrk_exec_stop(wrk_exec *x);

#endif
