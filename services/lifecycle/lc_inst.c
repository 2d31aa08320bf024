/* lc_inst.c — see lc_inst.h.
 *
 * Locking: the manager's mutex guards the table and the live-thread count; each instance's
 * mutex guards its state, output buffer, attached call, stop request and host/wasm handles.
 * Order: manager, then instance, then an rpc call's own lock (rpc_call_send). lc_host calls back
 * into us (send, terminated) with no host lock held, so calling lc_host_inst_* under an
 * instance's mutex cannot deadlock.
 *
 * Output (send, stdout, stderr) is written on the instance's thread. While a client is attached
 * it goes to its call and is never dropped: when the call's queue is full (wait_for_room) the
 * writer waits on the call, without any lock of ours, until the client reads, detaches, the
 * instance is stopped (both end the wait through rpc_call_end_waits) or its wall deadline
 * passes. Completion-queue threads never wait here. While detached, output goes to the buffer
 * with oldest-first dropping.
 *
 * Retention: exited instances stay in the table for instances.retention, and at most
 * instances.retention_max of them (the earliest exits go first), in two lists in exit order
 * under the manager's exits_mu: every exited instance (for the count), and those that hold
 * output. Buffered output is charged to the replica's memory budget (limits.replica_memory),
 * and what exited instances keep for a later Attach is the first memory the replica gives up:
 * the budget's reclaimer (reclaim_kept) frees it, oldest exit first, when any take does not
 * fit — a launch, a memory.grow, an upload, another instance's output. exits_mu is taken
 * last: the reclaimer runs on whatever thread takes, with whatever locks it holds, so under
 * exits_mu it only try-locks an instance, and skips one that is busy. */
#include "lc_inst.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "pie_log.h"

#define LC_INST_MAX_ARGS       1024
#define LC_INST_MAX_ARGS_BYTES (64u << 10)
/* Back-pressure: while a client is attached, at most this many responses and
 * instances.output_buffer bytes wait on its call; a writer that finds no room waits until the
 * client has taken the queue down to LOW responses and a quarter of the buffer. */
#define LC_INST_SEND_QUEUE_HIGH 256
#define LC_INST_SEND_QUEUE_LOW  64
/* Past its wall deadline a blocked writer polls this often for the watchdog's interrupt. */
#define LC_INST_WALL_POLL_NS 5000000

typedef enum lc_out_kind { LC_OUT_MESSAGE, LC_OUT_STDOUT, LC_OUT_STDERR } lc_out_kind;

/* A place in one of the manager's lists of exited instances (under its exits_mu). */
typedef struct lc_link {
    struct lc_link *prev, *next;
    lc_inst *in;
    bool on;
} lc_link;

typedef struct lc_list {
    lc_link *head, *tail; /* oldest exit first */
    size_t n;
} lc_list;

typedef struct lc_out_chunk {
    struct lc_out_chunk *next;
    lc_out_kind kind;
    size_t len;
    uint8_t data[];
} lc_out_chunk;

/* A tenant's share of the replica's memory budget. */
typedef struct lc_tenant_budget {
    char tenant[PIE_TENANT_NAME_MAX + 1];
    pie_budget b; /* parent: the replica's budget */
} lc_tenant_budget;

struct lc_inst_mgr {
    lc_inst_config cfg;
    lc_program_store *programs;
    lc_host *host;
    lc_session *session;
    pthread_mutex_t mu; /* guards the fields below up to exits_mu */
    pthread_cond_t cv;  /* live reached 0 */
    lc_inst **table;    /* launch order */
    size_t n, cap;
    size_t live; /* instance threads not yet finished */
    bool stopping;
    /* exited instances in the table, and those of them that hold output; see the top */
    pthread_mutex_t exits_mu;
    lc_list exits, kept;
    /* metrics (NULL without a registry) */
    pie_histogram *h_life, *h_start, *h_first;
    pie_gauge *g_starting, *g_running;
    /* Each tenant's share of cfg.budget for its instances' linear memories, made at its first
     * launch and kept (one per tenant; each allocated alone: instances point at it). Under mu. */
    lc_tenant_budget **tenant_budgets;
    size_t n_tenant_budgets;
};

struct lc_inst {
    _Atomic int refs;
    lc_inst_mgr *mgr; /* valid while the instance's thread runs (the manager waits for it) */
    uint64_t id;
    char program_id[65];
    char program_name[LC_PROGRAM_NAME_MAX + 1];
    char model[256];
    const pie_tenant *tenant; /* whose instance (lives as long as the process's tenants) */
    pie_budget *budget;       /* its buffered output is charged here (outlives instances) */
    pie_budget *mem_budget;   /* its linear memory: its tenant's share, or budget */
    char **argv; /* argv[0] = program name */
    size_t argc;
    lc_limits limits;
    uint64_t started_unix_ms;
    int64_t started_ns;
    pthread_t thread;
    bool first_output; /* its first output was seen (under mu) */

    pthread_mutex_t mu; /* guards everything below */
    Pie__V1__InstanceState state;
    lc_host_inst *hi;        /* from launch until the run ended */
    lc_wasm_instance *winst; /* while it exists */
    bool stop_requested;
    pie_code stop_code;
    char stop_msg[256];
    rpc_call *attached; /* with a reference */
    rpc_call **terminating; /* Terminate calls answered at exit, each with a reference */
    size_t n_terminating;
    lc_out_chunk *head, *tail;
    uint64_t buffered_bytes; /* chunk_cost of the chunks held */
    uint64_t dropped_bytes;  /* output bytes dropped since the last attach */
    /* once EXITED: */
    pie_code exit_status;
    char exit_msg[PIE_STATUS_MSG_MAX];
    int32_t exit_code;
    uint64_t exited_unix_ms;
    int64_t exited_ns;
    Pie__V1__ResourceUsage usage; /* final usage once exited */

    /* once EXITED, under mgr->exits_mu: its places in the manager's lists */
    lc_link exit_link, kept_link;
    bool evicted; /* beyond instances.retention_max: sweep drops it (under mgr->mu) */
};

static uint64_t now_unix_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* ---- limits ------------------------------------------------------------------------------ */

static uint64_t pick(uint64_t req, uint64_t def, uint64_t max) {
    uint64_t v = req ? req : def;
    return max && v > max ? max : v;
}

/* The most linear memory the runtime gives an instance (lc_wasm.h): a request or a configured
 * maximum above it (such as the default 4GiB) gets this. */
#define LC_INST_MAX_MEMORY_BYTES ((uint64_t)LC_WASM_MAX_MEMORY_PAGES * 65536u)

static lc_limits effective_limits(const lc_inst_config *c, const Pie__V1__ResourceLimits *r) {
    Pie__V1__ResourceLimits zero = PIE__V1__RESOURCE_LIMITS__INIT;
    if (r == NULL) r = &zero;
    uint64_t memory = pick(r->memory_bytes, c->defaults.memory_bytes, c->maxima.memory_bytes);
    lc_limits l = {
        .memory_bytes = memory < LC_INST_MAX_MEMORY_BYTES ? memory : LC_INST_MAX_MEMORY_BYTES,
        .kv_pages = (uint32_t)pick(r->kv_pages, c->defaults.kv_pages, c->maxima.kv_pages),
        .embeddings = (uint32_t)pick(r->embeddings, c->defaults.embeddings, c->maxima.embeddings),
        .queues = (uint32_t)pick(r->queues, c->defaults.queues, c->maxima.queues),
        .message_bytes = pick(r->message_bytes, c->defaults.message_bytes, c->maxima.message_bytes),
        .cpu_ms =
            (int64_t)pick(r->cpu_ms, (uint64_t)c->defaults.cpu_ms, (uint64_t)c->maxima.cpu_ms),
        .wall_ms =
            (int64_t)pick(r->wall_ms, (uint64_t)c->defaults.wall_ms, (uint64_t)c->maxima.wall_ms),
    };
    return l;
}

void lc_limits_to_pb(const lc_limits *l, Pie__V1__ResourceLimits *pb) {
    pie__v1__resource_limits__init(pb);
    pb->memory_bytes = l->memory_bytes;
    pb->kv_pages = l->kv_pages;
    pb->embeddings = l->embeddings;
    pb->queues = l->queues;
    pb->message_bytes = l->message_bytes;
    pb->cpu_ms = (uint64_t)l->cpu_ms;
    pb->wall_ms = (uint64_t)l->wall_ms;
}

/* ---- instance objects ------------------------------------------------------------------- */

static void free_chunks(lc_out_chunk *c) {
    while (c) {
        lc_out_chunk *next = c->next;
        free(c);
        c = next;
    }
}

/* Frees the buffered output and gives its charge back. Caller holds in->mu (or the last
 * reference). */
static void release_output(lc_inst *in) {
    free_chunks(in->head);
    in->head = in->tail = NULL;
    pie_budget_give(in->budget, in->buffered_bytes);
    in->buffered_bytes = 0;
}

static void inst_free(lc_inst *in) {
    for (size_t i = 0; i < in->argc; i++) free(in->argv[i]);
    free(in->argv);
    free(in->terminating); /* answered at exit */
    release_output(in);
    pthread_mutex_destroy(&in->mu);
    free(in);
}

void lc_inst_unref(lc_inst *in) {
    if (in && atomic_fetch_sub(&in->refs, 1) == 1) inst_free(in);
}

static lc_inst *inst_ref(lc_inst *in) {
    atomic_fetch_add(&in->refs, 1);
    return in;
}

uint64_t lc_inst_id(const lc_inst *in) { return in->id; }

/* ---- output ------------------------------------------------------------------------------ */

/* Sends one output chunk on the attached call. Caller holds in->mu. */
static pie_code send_output(rpc_call *call, lc_out_kind kind, const void *data, size_t len) {
    Pie__V1__AttachResponse r = PIE__V1__ATTACH_RESPONSE__INIT;
    ProtobufCBinaryData b = {.len = len, .data = (uint8_t *)data};
    switch (kind) {
    case LC_OUT_MESSAGE:
        r.msg_case = PIE__V1__ATTACH_RESPONSE__MSG_MESSAGE;
        r.message = b;
        break;
    case LC_OUT_STDOUT:
        r.msg_case = PIE__V1__ATTACH_RESPONSE__MSG_STDOUT_DATA;
        r.stdout_data = b;
        break;
    case LC_OUT_STDERR:
        r.msg_case = PIE__V1__ATTACH_RESPONSE__MSG_STDERR_DATA;
        r.stderr_data = b;
        break;
    }
    return rpc_call_send(call, &r.base);
}

/* What a buffered chunk costs against the cap: its bytes plus its header, so that a storm of
 * empty messages cannot grow memory without bound either. */
static uint64_t chunk_cost(size_t len) { return (uint64_t)len + sizeof(lc_out_chunk); }

/* Drops all buffered output, counted in dropped_bytes. Caller holds in->mu. */
static void drop_output(lc_inst *in) {
    for (lc_out_chunk *c = in->head; c; c = c->next) in->dropped_bytes += c->len;
    release_output(in);
}

/* Drops the oldest buffered chunk. Caller holds in->mu; there is one. */
static void drop_oldest(lc_inst *in) {
    lc_out_chunk *c = in->head;
    in->head = c->next;
    if (in->head == NULL) in->tail = NULL;
    in->buffered_bytes -= chunk_cost(c->len);
    pie_budget_give(in->budget, chunk_cost(c->len));
    in->dropped_bytes += c->len;
    free(c);
}

/* Appends to the buffer, dropping the oldest output beyond the cap, then, while the replica's
 * budget has no room even after exited instances gave theirs up, this instance's oldest and
 * finally this chunk (dropped_bytes counts output bytes). Caller holds in->mu. */
static void buffer_output(lc_inst *in, lc_out_kind kind, const void *data, size_t len) {
    uint64_t cap = in->mgr->cfg.output_buffer_bytes, cost = chunk_cost(len);
    if (cost > cap) { /* could never be delivered whole: it and all before it go */
        drop_output(in);
        in->dropped_bytes += len;
        return;
    }
    while (in->head && in->buffered_bytes + cost > cap) drop_oldest(in);
    while (!pie_budget_take(in->budget, cost)) {
        if (in->head == NULL) {
            in->dropped_bytes += len;
            return;
        }
        drop_oldest(in);
    }
    lc_out_chunk *c = malloc(sizeof *c + len);
    if (c == NULL) {
        pie_budget_give(in->budget, cost);
        in->dropped_bytes += len;
        return;
    }
    c->next = NULL;
    c->kind = kind;
    c->len = len;
    memcpy(c->data, data, len);
    if (in->tail)
        in->tail->next = c;
    else
        in->head = c;
    in->tail = c;
    in->buffered_bytes += cost;
}

/* The deadline of a writer's wait: its wall deadline, or a short poll once that has passed (the
 * watchdog's interrupt is then due any moment); RPC_DEADLINE_NONE without a wall quota. */
static int64_t writer_deadline(lc_wasm_instance *w) {
    uint64_t wall = w ? lc_wasm_wall_deadline_ns(w) : UINT64_MAX;
    if (wall >= (uint64_t)RPC_DEADLINE_NONE) return RPC_DEADLINE_NONE;
    int64_t now = rpc_now_ns();
    return (int64_t)wall > now ? (int64_t)wall : now + LC_INST_WALL_POLL_NS;
}

/* Back-pressure (instance thread; in->mu held on entry and return, released while waiting):
 * waits until the attached call has room for len more output bytes — fewer than
 * LC_INST_SEND_QUEUE_HIGH responses and at most output_buffer bytes queued with it; output
 * longer than the buffer waits for an empty queue — or until no client is attached. Returns
 * false when the output must not be written: the instance was stopped or its wall time is up
 * (it ends at its next checkpoint). A call that takes no more messages (cancelled, finished)
 * ends the wait too: the send then fails and the output is buffered as if detached. */
static bool wait_for_room(lc_inst *in, size_t len) {
    uint64_t cap = in->mgr->cfg.output_buffer_bytes;
    size_t max_msgs = len <= cap ? LC_INST_SEND_QUEUE_HIGH - 1 : 0;
    size_t max_bytes = len <= cap ? (size_t)(cap - len) : 0;
    for (;;) {
        rpc_call *call = in->attached;
        if (call == NULL) return true;
        pie_code rc = rpc_call_wait_room(call, max_msgs, max_bytes, 0);
        if (rc != PIE_DEADLINE_EXCEEDED && rc != PIE_ABORTED) return true;
        if (in->stop_requested || (in->winst && lc_wasm_interrupted(in->winst))) return false;
        if (rc == PIE_ABORTED) return true; /* only stops and detaches end waits */
        int64_t deadline = writer_deadline(in->winst);
        rpc_call_ref(call);
        pthread_mutex_unlock(&in->mu);
        rpc_call_wait_room(call,
                           max_msgs < LC_INST_SEND_QUEUE_LOW ? max_msgs : LC_INST_SEND_QUEUE_LOW,
                           max_bytes < cap / 4 ? max_bytes : (size_t)(cap / 4), deadline);
        pthread_mutex_lock(&in->mu);
        rpc_call_unref(call);
    }
}

/* One chunk of output, on the instance's thread: to the attached client (waiting while it is
 * slow: never dropped), else into the buffer. */
static void output(lc_inst *in, lc_out_kind kind, const void *data, size_t len) {
    if (len == 0 && kind != LC_OUT_MESSAGE) return; /* an empty message is still a message */
    pthread_mutex_lock(&in->mu);
    if (!in->first_output) {
        in->first_output = true;
        pie_histogram_observe(in->mgr->h_first, (double)(rpc_now_ns() - in->started_ns) / 1e9);
    }
    bool write = wait_for_room(in, len);
    if (write && (in->attached == NULL || send_output(in->attached, kind, data, len) != PIE_OK))
        buffer_output(in, kind, data, len);
    lc_wasm_instance *w = in->winst;
    pthread_mutex_unlock(&in->mu);
    /* Stopped or out of wall time while waiting: end here rather than write on. Output comes
     * from inside a host call (send, fd_write) that holds nothing: it may unwind. */
    if (!write && w) lc_wasm_host_checkpoint(w);
}

static void on_wasm_output(void *ctx, int fd, const char *data, size_t len) {
    output(ctx, fd == 2 ? LC_OUT_STDERR : LC_OUT_STDOUT, data, len);
}

static void on_host_send(void *ctx, const void *msg, size_t len) {
    output(ctx, LC_OUT_MESSAGE, len ? msg : "", len);
}

static void on_host_terminated(void *ctx, pie_code code, const char *msg) {
    lc_inst_stop(ctx, code, msg);
}

/* ---- output kept after the exit ------------------------------------------------------------ */

static void list_push(lc_list *l, lc_link *k) {
    k->prev = l->tail;
    k->next = NULL;
    if (l->tail)
        l->tail->next = k;
    else
        l->head = k;
    l->tail = k;
    k->on = true;
    l->n++;
}

static void list_unlink(lc_list *l, lc_link *k) {
    if (!k->on) return;
    if (k->prev)
        k->prev->next = k->next;
    else
        l->head = k->next;
    if (k->next)
        k->next->prev = k->prev;
    else
        l->tail = k->prev;
    k->prev = k->next = NULL;
    k->on = false;
    l->n--;
}

/* Lists an instance that has just exited as the newest exit. Caller holds in->mu. */
static void exits_push(lc_inst_mgr *m, lc_inst *in) {
    pthread_mutex_lock(&m->exits_mu);
    list_push(&m->exits, &in->exit_link);
    if (in->head) list_push(&m->kept, &in->kept_link);
    pthread_mutex_unlock(&m->exits_mu);
}

/* Takes an instance off the lists before the table lets it go. */
static void exits_forget(lc_inst_mgr *m, lc_inst *in) {
    pthread_mutex_lock(&m->exits_mu);
    list_unlink(&m->exits, &in->exit_link);
    list_unlink(&m->kept, &in->kept_link);
    pthread_mutex_unlock(&m->exits_mu);
}

/* Marks the earliest exits beyond instances.retention_max for sweep to drop. Caller holds
 * m->mu. */
static void exits_evict(lc_inst_mgr *m) {
    pthread_mutex_lock(&m->exits_mu);
    while (m->exits.n > m->cfg.retention_max) {
        lc_inst *in = m->exits.head->in;
        list_unlink(&m->exits, &in->exit_link);
        list_unlink(&m->kept, &in->kept_link);
        in->evicted = true;
    }
    pthread_mutex_unlock(&m->exits_mu);
}

/* The budget's reclaimer (pie_budget_reclaim_fn): drops the output of exited instances, oldest
 * exit first, until want bytes are back; an instance whose mutex is busy (being attached to,
 * listed, or held by the very thread that takes) is skipped. Their next Attach gets
 * dropped_bytes, then the exit status. */
static uint64_t reclaim_kept(void *arg, uint64_t want) {
    lc_inst_mgr *m = arg;
    uint64_t freed = 0;
    pthread_mutex_lock(&m->exits_mu);
    for (lc_link *k = m->kept.head, *next; k && freed < want; k = next) {
        next = k->next;
        if (pthread_mutex_trylock(&k->in->mu) != 0) continue;
        freed += k->in->buffered_bytes;
        drop_output(k->in);
        pthread_mutex_unlock(&k->in->mu);
        list_unlink(&m->kept, k);
    }
    pthread_mutex_unlock(&m->exits_mu);
    if (freed)
        pie_log_debug("lc.inst.kept_output_dropped",
                      "bytes=%llu wanted=%llu reason=\"limits.replica_memory is short\"",
                      (unsigned long long)freed, (unsigned long long)want);
    return freed;
}

/* ---- exit -------------------------------------------------------------------------------- */

static void fill_exit(const lc_inst *in, Pie__V1__InstanceExit *ex, Pie__V1__Status *s) {
    pie__v1__status__init(s);
    s->code = (uint32_t)in->exit_status;
    s->message = (char *)(in->exit_status == PIE_OK ? "" : in->exit_msg);
    pie__v1__instance_exit__init(ex);
    ex->status = s;
    ex->exit_code = in->exit_status == PIE_OK ? in->exit_code : 0;
    ex->exited_unix_ms = in->exited_unix_ms;
}

/* Sends exit_status and ends the attached call with OK. Caller holds in->mu. */
static void finish_attached(lc_inst *in) {
    rpc_call *call = in->attached;
    if (call == NULL) return;
    Pie__V1__InstanceExit ex;
    Pie__V1__Status s;
    fill_exit(in, &ex, &s);
    Pie__V1__AttachResponse r = PIE__V1__ATTACH_RESPONSE__INIT;
    r.msg_case = PIE__V1__ATTACH_RESPONSE__MSG_EXIT_STATUS;
    r.exit_status = &ex;
    if (rpc_call_send(call, &r.base) == PIE_OK) rpc_call_finish(call, PIE_OK, NULL);
    in->attached = NULL;
    rpc_call_unref(call);
}

/* Answers the Terminate calls waiting for the exit. Caller holds in->mu. */
static void answer_terminating(lc_inst *in) {
    for (size_t i = 0; i < in->n_terminating; i++) {
        Pie__V1__TerminateResponse r = PIE__V1__TERMINATE_RESPONSE__INIT;
        rpc_call_reply(in->terminating[i], &r.base);
        rpc_call_unref(in->terminating[i]);
    }
    in->n_terminating = 0;
}

/* lc_wasm's outcome as an InstanceExit status (lifecycle.proto, InstanceExit.status) and its
 * message (msg, cap bytes). Caller holds in->mu. */
static pie_code exit_status_of(lc_inst *in, const lc_wasm_outcome *o, char *msg, size_t cap) {
    pie_code code;
    snprintf(msg, cap, "%s", o->message);
    switch (o->end) {
    case LC_WASM_EXITED: return PIE_OK;
    case LC_WASM_INTERRUPTED:
        if (o->trap == LC_WASM_TRAP_CPU_TIME || o->trap == LC_WASM_TRAP_WALL_TIME)
            return PIE_DEADLINE_EXCEEDED;
        code = PIE_CANCELLED;
        break;
    case LC_WASM_TRAPPED:
        /* A refused memory.grow followed by a trap is the allocation failing (malloc NULL →
         * abort): the memory quota, not a bug of the program. */
        if (o->trap == LC_WASM_TRAP_MEMORY_LIMIT || o->memory_refusals > 0)
            return PIE_RESOURCE_EXHAUSTED;
        if (!in->stop_requested) return PIE_ABORTED;
        code = PIE_ABORTED; /* a host call noticed the stop: reported as the stop below */
        break;
    default: return PIE_INTERNAL;
    }
    if (in->stop_requested) { /* Terminate, a cancelled Run, the controller, shutdown */
        snprintf(msg, cap, "%s", in->stop_msg);
        return in->stop_code;
    }
    return code;
}

/* Logs how the instance ended at info level: one line per instance, `lc.inst.trapped` when its
 * code trapped (the reason is the trap), else `lc.inst.exited`. */
static void log_exit(const lc_inst *in, pie_code code, const char *msg, int exit_code,
                     bool trapped) {
    char reason[PIE_STATUS_MSG_MAX + 8], name[2 * LC_PROGRAM_NAME_MAX + 8];
    pie_log_info(trapped ? "lc.inst.trapped" : "lc.inst.exited",
                 "instance=%016llx program=%s name=%s tenant=%s status=%s exit_code=%d "
                 "reason=%s",
                 (unsigned long long)in->id, in->program_id,
                 pie_log_quote(name, sizeof name, in->program_name), in->tenant->name,
                 pie_code_name(code), exit_code,
                 pie_log_quote(reason, sizeof reason, msg));
}

/* Records how the instance ended, logs it, tells the attached client. Called once, by its
 * thread. */
static void set_exited(lc_inst *in, pie_code code, const char *msg, int exit_code, bool trapped) {
    log_exit(in, code, msg, exit_code, trapped); /* before the client can see the exit */
    pthread_mutex_lock(&in->mu);
    in->exit_status = code;
    snprintf(in->exit_msg, sizeof in->exit_msg, "%s", msg);
    in->exit_code = exit_code;
    in->exited_unix_ms = now_unix_ms();
    in->exited_ns = rpc_now_ns();
    in->usage.wall_ms = (uint64_t)(in->exited_ns - in->started_ns) / 1000000;
    lc_inst_mgr *m = in->mgr;
    pie_gauge_add(in->state == PIE__V1__INSTANCE_STATE__INSTANCE_STATE_RUNNING ? m->g_running
                                                                             : m->g_starting,
                  -1);
    pie_histogram_observe(m->h_life, (double)(in->exited_ns - in->started_ns) / 1e9);
    in->state = PIE__V1__INSTANCE_STATE__INSTANCE_STATE_EXITED;
    finish_attached(in);
    answer_terminating(in);
    exits_push(m, in); /* order: instance, then exits_mu */
    pthread_mutex_unlock(&in->mu);
}

/* ---- the instance thread ------------------------------------------------------------------ */

static pie_code create_wasm(lc_inst *in, lc_wasm_instance **w, pie_status *st) {
    uint64_t pages = (in->limits.memory_bytes + 65535) / 65536;
    int64_t elapsed_ms = (rpc_now_ns() - in->started_ns) / 1000000;
    /* wall_ms counts from launch (lifecycle.proto), lc_wasm's from the run: give it the rest */
    uint64_t wall =
        in->limits.wall_ms > elapsed_ms ? (uint64_t)(in->limits.wall_ms - elapsed_ms) : 1;
    lc_wasm_instance_opts o = {
        .argv = (const char *const *)in->argv,
        .argc = in->argc,
        .limits = {.max_memory_pages = pages > LC_WASM_MAX_MEMORY_PAGES
                                           ? LC_WASM_MAX_MEMORY_PAGES
                                           : (pages ? (uint32_t)pages : 1),
                   .cpu_ms = (uint64_t)in->limits.cpu_ms,
                   .wall_ms = wall},
        .output = on_wasm_output,
        .output_ctx = in,
        .host = in->hi,
        .on_interrupt = lc_host_inst_wake,
        .budget = in->mem_budget,
    };
    return lc_program_instance(in->mgr->programs, in->program_id, &o, w, st);
}

static void run_instance(lc_inst *in) {
    pie_status st;
    lc_wasm_instance *w = NULL;
    lc_wasm_outcome out;
    memset(&out, 0, sizeof out);
    pie_code code;
    if (create_wasm(in, &w, &st) == PIE_OK) {
        pthread_mutex_lock(&in->mu);
        in->winst = w;
        in->state = PIE__V1__INSTANCE_STATE__INSTANCE_STATE_RUNNING;
        pie_gauge_add(in->mgr->g_starting, -1);
        pie_gauge_add(in->mgr->g_running, 1);
        pie_histogram_observe(in->mgr->h_start, (double)(rpc_now_ns() - in->started_ns) / 1e9);
        if (in->stop_requested) lc_wasm_instance_interrupt(w);
        pthread_mutex_unlock(&in->mu);
        code = lc_wasm_instance_run(w, &out, &st);
        if (code == PIE_OK) {
            pthread_mutex_lock(&in->mu);
            code = exit_status_of(in, &out, st.msg, sizeof st.msg);
            pthread_mutex_unlock(&in->mu);
        } else {
            code = PIE_INTERNAL;
        }
    } else {
        code = st.code; /* the program could not be loaded (deleted, corrupt cache, memory) */
    }
    lc_host_inst_end(in->hi, code, code == PIE_OK ? "" : st.msg);
    pthread_mutex_lock(&in->mu);
    lc_host_inst *hi = in->hi;
    lc_host_inst_usage(hi, &in->usage);
    in->usage.memory_bytes = (uint64_t)out.memory_pages * 65536;
    in->usage.cpu_ms = out.cpu_ns / 1000000;
    in->hi = NULL;
    in->winst = NULL;
    pthread_mutex_unlock(&in->mu);
    lc_host_inst_free(hi);
    lc_wasm_instance_free(w);
    set_exited(in, code, st.msg, code == PIE_OK ? out.exit_code : 0, out.end == LC_WASM_TRAPPED);
}

static void *inst_thread(void *arg) {
    lc_inst *in = arg;
    lc_inst_mgr *m = in->mgr;
    run_instance(in);
    lc_inst_unref(in); /* the thread's reference */
    pthread_mutex_lock(&m->mu);
    if (--m->live == 0) pthread_cond_broadcast(&m->cv);
    pthread_mutex_unlock(&m->mu);
    return NULL;
}

/* ---- manager ------------------------------------------------------------------------------ */

/* The instance metrics operators watch (docs/operators.md, "Metrics"). */
static void mgr_metrics(lc_inst_mgr *m, pie_metrics *reg) {
    if (reg == NULL) return;
    pie_status st;
    double life_b[20], start_b[16];
    pie_metrics_exponential_bounds(0.01, 2, 20, life_b);   /* 10 ms .. 1.5 h */
    pie_metrics_exponential_bounds(0.0005, 2, 16, start_b); /* 0.5 ms .. 16 s */
    m->h_life = pie_metrics_histogram(reg, "pie_lifecycle_instance_seconds",
                                      "Instance end-to-end time: launch to exit.", life_b, 20,
                                      NULL, 0, &st);
    m->h_start = pie_metrics_histogram(
        reg, "pie_lifecycle_instance_start_seconds",
        "Instance queue wait: launch until its code runs (program load or compile, thread).",
        start_b, 16, NULL, 0, &st);
    m->h_first = pie_metrics_histogram(
        reg, "pie_lifecycle_first_output_seconds",
        "Launch to the instance's first output (message, stdout or stderr): its time to first "
        "token when it streams tokens.",
        life_b, 20, NULL, 0, &st);
    m->g_starting =
        pie_metrics_gauge(reg, "pie_lifecycle_instances", "Instances of this replica by state.",
                          (pie_metric_label[]){{"state", "starting"}}, 1, &st);
    m->g_running =
        pie_metrics_gauge(reg, "pie_lifecycle_instances", "Instances of this replica by state.",
                          (pie_metric_label[]){{"state", "running"}}, 1, &st);
}

lc_inst_mgr *lc_inst_mgr_create(const lc_inst_config *cfg, lc_program_store *programs,
                                lc_host *host, lc_session *session, pie_status *st) {
    lc_inst_mgr *m = calloc(1, sizeof *m);
    if (m == NULL) goto oom;
    if (pthread_mutex_init(&m->mu, NULL) != 0) goto oom_free;
    if (pthread_cond_init(&m->cv, NULL) != 0) {
        pthread_mutex_destroy(&m->mu);
        goto oom_free;
    }
    if (pthread_mutex_init(&m->exits_mu, NULL) != 0) {
        pthread_cond_destroy(&m->cv);
        pthread_mutex_destroy(&m->mu);
        goto oom_free;
    }
    m->cfg = *cfg;
    m->programs = programs;
    m->host = host;
    m->session = session;
    mgr_metrics(m, cfg->metrics);
    pie_budget_set_reclaim(cfg->budget, reclaim_kept, m);
    return m;
oom_free:
    free(m);
oom:
    pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
    return NULL;
}

void lc_inst_mgr_refuse_launches(lc_inst_mgr *m) {
    pthread_mutex_lock(&m->mu);
    m->stopping = true;
    pthread_mutex_unlock(&m->mu);
}

size_t lc_inst_mgr_drain(lc_inst_mgr *m, int64_t grace_ms) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until); /* the condition variable's clock */
    until.tv_sec += grace_ms / 1000;
    until.tv_nsec += (grace_ms % 1000) * 1000000;
    if (until.tv_nsec >= 1000000000) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000;
    }
    pthread_mutex_lock(&m->mu);
    m->stopping = true; /* launches are refused from here on */
    int err = 0;
    while (m->live > 0 && err != ETIMEDOUT) err = pthread_cond_timedwait(&m->cv, &m->mu, &until);
    size_t left = m->live;
    pthread_mutex_unlock(&m->mu);
    return left;
}

void lc_inst_mgr_stop(lc_inst_mgr *m) {
    if (m == NULL) return;
    pthread_mutex_lock(&m->mu);
    m->stopping = true;
    for (size_t i = 0; i < m->n; i++)
        lc_inst_stop(m->table[i], PIE_UNAVAILABLE,
                     "lifecycle replica shutting down: the instance did not end within its "
                     "drain time (server.shutdown_grace)");
    while (m->live > 0) pthread_cond_wait(&m->cv, &m->mu);
    pthread_mutex_unlock(&m->mu);
}

void lc_inst_mgr_destroy(lc_inst_mgr *m) {
    if (m == NULL) return;
    lc_inst_mgr_stop(m);
    pie_budget_set_reclaim(m->cfg.budget, NULL, NULL); /* no taker is left (lc_main's order) */
    for (size_t i = 0; i < m->n; i++) {
        exits_forget(m, m->table[i]);
        lc_inst_unref(m->table[i]);
    }
    free(m->table);
    for (size_t i = 0; i < m->n_tenant_budgets; i++) free(m->tenant_budgets[i]);
    free(m->tenant_budgets);
    pthread_mutex_destroy(&m->exits_mu);
    pthread_cond_destroy(&m->cv);
    pthread_mutex_destroy(&m->mu);
    free(m);
}

/* Drops exited instances older than the retention period, and the earliest exits beyond
 * retention_max. Caller holds m->mu. */
static void sweep(lc_inst_mgr *m) {
    exits_evict(m);
    int64_t now = rpc_now_ns();
    size_t j = 0;
    for (size_t i = 0; i < m->n; i++) {
        lc_inst *in = m->table[i];
        pthread_mutex_lock(&in->mu);
        bool old = in->state == PIE__V1__INSTANCE_STATE__INSTANCE_STATE_EXITED &&
                   (in->evicted || now - in->exited_ns >= m->cfg.retention_ms * 1000000);
        pthread_mutex_unlock(&in->mu);
        if (old) {
            exits_forget(m, in);
            lc_inst_unref(in);
        } else {
            m->table[j++] = in;
        }
    }
    m->n = j;
}

/* Caller holds m->mu. */
static lc_inst *find_locked(lc_inst_mgr *m, uint64_t id) {
    for (size_t i = m->n; i-- > 0;)
        if (m->table[i]->id == id) return m->table[i];
    return NULL;
}

/* Whether tenant may see and act on in: its own instances; every one for an admin. */
static bool visible_to(const lc_inst *in, const pie_tenant *tenant) {
    return tenant == NULL || tenant->admin || in->tenant == tenant;
}

lc_inst *lc_inst_find(lc_inst_mgr *m, uint64_t id, const pie_tenant *tenant, pie_status *st) {
    pthread_mutex_lock(&m->mu);
    sweep(m);
    lc_inst *in = find_locked(m, id);
    if (in && !visible_to(in, tenant)) in = NULL; /* another tenant's: as if absent */
    if (in) inst_ref(in);
    pthread_mutex_unlock(&m->mu);
    if (in) return in;
    uint32_t mine = lc_session_replica_index(m->session), owner = (uint32_t)(id >> 48);
    if (id != 0 && owner != mine)
        pie_status_set(st, PIE_NOT_FOUND,
                       "instance_id: %llu (0x%016llx) belongs to lifecycle replica %u; this is "
                       "replica %u (Controller.ClusterStatus lists replica addresses)",
                       (unsigned long long)id, (unsigned long long)id, owner, mine);
    else
        pie_status_set(st, PIE_NOT_FOUND,
                       "instance_id: %llu (0x%016llx) is not a running or recently exited "
                       "instance of this replica",
                       (unsigned long long)id, (unsigned long long)id);
    return NULL;
}

/* A fresh id: replica index in the high 16 bits, random non-zero low 48. Caller holds m->mu. */
static pie_code new_id(lc_inst_mgr *m, uint64_t *out, pie_status *st) {
    uint32_t replica = lc_session_replica_index(m->session);
    if (replica == 0)
        return pie_status_set(st, PIE_UNAVAILABLE,
                              "launch: this lifecycle replica is not connected to the "
                              "controller (no replica index yet); retry shortly");
    for (int tries = 0; tries < 64; tries++) {
        uint64_t r;
        if (getrandom(&r, sizeof r, 0) != (ssize_t)sizeof r)
            return pie_status_set(st, PIE_INTERNAL, "launch: getrandom failed: %s",
                                  strerror(errno));
        r &= (1ull << 48) - 1;
        uint64_t id = ((uint64_t)(replica & 0xffff) << 48) | r;
        if (r != 0 && find_locked(m, id) == NULL) {
            *out = id;
            return PIE_OK;
        }
    }
    return pie_status_set(st, PIE_INTERNAL, "launch: no free instance id");
}

static pie_code check_args(const Pie__V1__LaunchRequest *req, pie_status *st) {
    if (req->n_args > LC_INST_MAX_ARGS)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "args: %zu arguments, at most %d",
                              req->n_args, LC_INST_MAX_ARGS);
    size_t total = 0;
    for (size_t i = 0; i < req->n_args; i++) total += strlen(req->args[i]);
    if (total > LC_INST_MAX_ARGS_BYTES)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "args: %zu bytes in total, at most %u",
                              total, LC_INST_MAX_ARGS_BYTES);
    return PIE_OK;
}

static lc_inst *inst_new(const Pie__V1__LaunchRequest *req, const char *argv0, pie_status *st) {
    lc_inst *in = calloc(1, sizeof *in);
    if (in == NULL) goto oom;
    if (pthread_mutex_init(&in->mu, NULL) != 0) {
        free(in);
        goto oom;
    }
    atomic_init(&in->refs, 1);
    in->exit_link.in = in->kept_link.in = in;
    pie__v1__resource_usage__init(&in->usage);
    in->argv = calloc(req->n_args + 1, sizeof *in->argv);
    if (in->argv == NULL) goto oom_free;
    in->argc = req->n_args + 1;
    for (size_t i = 0; i < in->argc; i++) {
        in->argv[i] = strdup(i == 0 ? argv0 : req->args[i - 1]);
        if (in->argv[i] == NULL) goto oom_free;
    }
    in->state = PIE__V1__INSTANCE_STATE__INSTANCE_STATE_STARTING;
    in->started_unix_ms = now_unix_ms();
    in->started_ns = rpc_now_ns();
    return in;
oom_free:
    inst_free(in);
oom:
    pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
    return NULL;
}

/* Adds in to the table and starts its thread. Caller holds m->mu. */
static pie_code start_locked(lc_inst_mgr *m, lc_inst *in, pie_status *st) {
    if (m->n == m->cap) {
        size_t cap = m->cap ? m->cap * 2 : 64;
        lc_inst **t = realloc(m->table, cap * sizeof *t);
        if (t == NULL) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
        m->table = t;
        m->cap = cap;
    }
    pthread_attr_t attr;
    int err = lc_wasm_thread_attr_init(&attr, m->cfg.thread_stack_bytes);
    if (err == 0) {
        err = pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        inst_ref(in); /* the thread's reference */
        if (err == 0) err = pthread_create(&in->thread, &attr, inst_thread, in);
        if (err != 0) atomic_fetch_sub(&in->refs, 1);
        pthread_attr_destroy(&attr);
    }
    if (err != 0)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "launch: cannot start the instance's thread: %s", strerror(err));
    m->live++;
    m->table[m->n++] = inst_ref(in);
    return PIE_OK;
}

/* Run: sends `started` on call and attaches it. Caller holds in->mu, taken before the instance's
 * thread started, so its first output already finds the call attached. */
static void attach_at_launch(lc_inst *in, rpc_call *call) {
    Pie__V1__ResourceLimits pl;
    lc_limits_to_pb(&in->limits, &pl);
    Pie__V1__InstanceStarted s = PIE__V1__INSTANCE_STARTED__INIT;
    s.instance_id = in->id;
    s.limits = &pl;
    Pie__V1__AttachResponse r = PIE__V1__ATTACH_RESPONSE__INIT;
    r.msg_case = PIE__V1__ATTACH_RESPONSE__MSG_STARTED;
    r.started = &s;
    rpc_call_send(call, &r.base);
    rpc_call_ref(call);
    in->attached = call;
}

/* Running instances of tenant on this replica. Caller holds m->mu. */
static uint32_t running_of_locked(const lc_inst_mgr *m, const pie_tenant *tenant) {
    uint32_t n = 0;
    for (size_t i = 0; i < m->n; i++)
        if (m->table[i]->tenant == tenant &&
            m->table[i]->state != PIE__V1__INSTANCE_STATE__INSTANCE_STATE_EXITED)
            n++;
    return n;
}

/* The tenant's instance quota, as far as this replica can tell (the controller counts the
 * whole cluster and ends an instance beyond it). Caller holds m->mu. */
static pie_code tenant_room_locked(const lc_inst_mgr *m, const pie_tenant *t, pie_status *st) {
    uint32_t held = t->quota.instances ? running_of_locked(m, t) : 0;
    if (t->quota.instances == 0 || held < t->quota.instances) return PIE_OK;
    return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                          "launch: tenant \"%s\" quota instances (%u) reached: %u held, 1 more "
                          "requested",
                          t->name, t->quota.instances, held);
}

/* What a launch needs free in the replica's memory budget: an inferlet's initial memory and
 * first allocations. Beyond that, instantiation charges its real initial memory. */
#define LC_INST_LAUNCH_MIN_BYTES (2u << 20)

/* The share of the replica's budget for tenant t's linear memories, or the replica's budget
 * when tenants have no share (anonymous, no bound, limits.tenant_memory_share off, or no memory
 * for the share). Caller holds m->mu. */
static pie_budget *tenant_budget_locked(lc_inst_mgr *m, const pie_tenant *t) {
    pie_budget *replica = m->cfg.budget;
    double share = m->cfg.tenant_memory_share;
    if (t == &pie_tenant_anonymous || replica == NULL || replica->max == 0 || share <= 0 ||
        share >= 1)
        return replica;
    for (size_t i = 0; i < m->n_tenant_budgets; i++)
        if (strcmp(m->tenant_budgets[i]->tenant, t->name) == 0) return &m->tenant_budgets[i]->b;
    lc_tenant_budget **v =
        realloc(m->tenant_budgets, (m->n_tenant_budgets + 1) * sizeof *m->tenant_budgets);
    if (v == NULL) return replica;
    m->tenant_budgets = v;
    lc_tenant_budget *tb = calloc(1, sizeof *tb);
    if (tb == NULL) return replica;
    snprintf(tb->tenant, sizeof tb->tenant, "%s", t->name);
    tb->b.max = (uint64_t)((double)replica->max * share);
    tb->b.parent = replica;
    m->tenant_budgets[m->n_tenant_budgets++] = tb;
    return &tb->b;
}

static pie_code budget_room(const lc_inst *in, pie_status *st) {
    pie_budget *b = in->budget;
    if (in->mem_budget != b && !pie_budget_room(in->mem_budget, LC_INST_LAUNCH_MIN_BYTES))
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "launch: tenant \"%s\" holds its share of this replica's memory "
                              "(limits.tenant_memory_share: %llu of %llu MiB) in its instances' "
                              "linear memories; end some, or launch on another replica",
                              in->tenant->name, (unsigned long long)(in->mem_budget->max >> 20),
                              (unsigned long long)(b->max >> 20));
    if (pie_budget_room(b, LC_INST_LAUNCH_MIN_BYTES)) return PIE_OK;
    return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                          "launch: this replica's memory budget (limits.replica_memory = %llu "
                          "MiB) is spent: its instances hold %llu MiB (linear memory, queued "
                          "calls, inboxes, uploads); launch on another replica or later",
                          (unsigned long long)(b->max >> 20),
                          (unsigned long long)(pie_budget_used(b) >> 20));
}

/* InstanceBegin's Tenant for t (strings borrowed from t). */
static void tenant_to_pb(const pie_tenant *t, Pie__V1__Tenant *pb) {
    pie__v1__tenant__init(pb);
    pb->name = (char *)t->name;
    pb->instances = t->quota.instances;
    pb->kv_pages = t->quota.kv_pages;
    pb->export_pages = t->quota.export_pages;
}

pie_code lc_inst_launch(lc_inst_mgr *m, const Pie__V1__LaunchRequest *req,
                        const pie_tenant *tenant, rpc_call *run_call, lc_inst **out,
                        lc_limits *limits, pie_status *st) {
    char name[LC_PROGRAM_NAME_MAX + 1], model[256];
    if (check_args(req, st) != PIE_OK ||
        lc_program_lookup(m->programs, req->program_id, name, sizeof name, st) != PIE_OK ||
        lc_session_resolve_model(m->session, req->model, model, sizeof model, st) != PIE_OK)
        return st->code;
    /* argv[0] is the program's label, or its id when it has none */
    lc_inst *in = inst_new(req, name[0] ? name : req->program_id, st);
    if (in == NULL) return st->code;
    snprintf(in->program_id, sizeof in->program_id, "%s", req->program_id);
    snprintf(in->program_name, sizeof in->program_name, "%s", name);
    snprintf(in->model, sizeof in->model, "%s", model);
    in->limits = effective_limits(&m->cfg, req->limits);
    in->tenant = tenant ? tenant : &pie_tenant_anonymous;
    in->budget = m->cfg.budget;
    pthread_mutex_lock(&m->mu);
    in->mem_budget = tenant_budget_locked(m, in->tenant);
    sweep(m);
    pie_code rc = m->stopping ? pie_status_set(st, PIE_UNAVAILABLE,
                                               "launch: this lifecycle replica is shutting down "
                                               "(draining its instances); launch on another")
                              : tenant_room_locked(m, in->tenant, st);
    if (rc == PIE_OK) rc = budget_room(in, st);
    if (rc == PIE_OK) rc = new_id(m, &in->id, st);
    if (rc == PIE_OK) {
        Pie__V1__ResourceLimits pb;
        lc_limits_to_pb(&in->limits, &pb);
        Pie__V1__Tenant tpb;
        tenant_to_pb(in->tenant, &tpb);
        lc_host_inst_cb cb = {.ctx = in, .send = on_host_send, .terminated = on_host_terminated};
        in->mgr = m;
        in->hi = lc_host_inst_begin(m->host, in->id, in->program_id, in->model, &pb, &tpb, &cb,
                                    st);
        pthread_mutex_lock(&in->mu); /* order: manager, then instance */
        pie_gauge_add(m->g_starting, 1); /* before its thread can move it to running */
        rc = in->hi ? start_locked(m, in, st) : st->code;
        if (rc != PIE_OK) pie_gauge_add(m->g_starting, -1);
        if (rc == PIE_OK && run_call) attach_at_launch(in, run_call);
        pthread_mutex_unlock(&in->mu);
        if (rc != PIE_OK && in->hi) {
            lc_host_inst_end(in->hi, rc, st->msg);
            lc_host_inst_free(in->hi);
            in->hi = NULL;
        }
    }
    pthread_mutex_unlock(&m->mu);
    if (rc != PIE_OK) {
        lc_inst_unref(in);
        return rc;
    }
    pie_log_debug("lc.inst.launched", "instance=%016llx program=%s model=%s tenant=%s",
                  (unsigned long long)in->id, in->program_id, in->model, in->tenant->name);
    *limits = in->limits;
    *out = in;
    return PIE_OK;
}

/* ---- clients ------------------------------------------------------------------------------ */

pie_code lc_inst_attach(lc_inst *in, rpc_call *call, pie_status *st) {
    pthread_mutex_lock(&in->mu);
    if (in->attached) {
        pthread_mutex_unlock(&in->mu);
        return pie_status_set(st, PIE_FAILED_PRECONDITION,
                              "instance_id: %llu already has a client attached (one at a time)",
                              (unsigned long long)in->id);
    }
    rpc_call_ref(call);
    in->attached = call;
    if (in->dropped_bytes) {
        Pie__V1__AttachResponse r = PIE__V1__ATTACH_RESPONSE__INIT;
        r.msg_case = PIE__V1__ATTACH_RESPONSE__MSG_DROPPED_BYTES;
        r.dropped_bytes = in->dropped_bytes;
        rpc_call_send(call, &r.base);
        in->dropped_bytes = 0;
    }
    for (lc_out_chunk *c = in->head; c; c = c->next) send_output(call, c->kind, c->data, c->len);
    release_output(in); /* an exited one stays listed as kept, with nothing left to reclaim */
    if (in->state == PIE__V1__INSTANCE_STATE__INSTANCE_STATE_EXITED) finish_attached(in);
    pthread_mutex_unlock(&in->mu);
    return PIE_OK;
}

void lc_inst_detach(lc_inst *in, rpc_call *call) {
    pthread_mutex_lock(&in->mu);
    bool was = in->attached == call;
    if (was) {
        in->attached = NULL;
        rpc_call_end_waits(call); /* a writer waiting for room buffers its output instead */
    }
    pthread_mutex_unlock(&in->mu);
    if (was) rpc_call_unref(call);
}

pie_code lc_inst_message(lc_inst *in, const void *msg, size_t len, pie_status *st) {
    if (len > in->limits.message_bytes)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "message: %zu bytes, above the instance's message_bytes quota of "
                              "%llu",
                              len, (unsigned long long)in->limits.message_bytes);
    pie_code rc = PIE_OK;
    pthread_mutex_lock(&in->mu);
    if (in->hi) rc = lc_host_inst_message(in->hi, msg, len, st);
    pthread_mutex_unlock(&in->mu);
    return rc;
}

void lc_inst_close_input(lc_inst *in) {
    pthread_mutex_lock(&in->mu);
    if (in->hi) lc_host_inst_close_input(in->hi);
    pthread_mutex_unlock(&in->mu);
}

/* lc_inst_stop under in->mu. */
static void stop_locked(lc_inst *in, pie_code code, const char *msg) {
    if (!in->stop_requested && in->state != PIE__V1__INSTANCE_STATE__INSTANCE_STATE_EXITED) {
        in->stop_requested = true;
        in->stop_code = code;
        snprintf(in->stop_msg, sizeof in->stop_msg, "%s", msg);
        if (in->winst) lc_wasm_instance_interrupt(in->winst);
        /* Not running yet: run_instance interrupts it as soon as it exists. */
        if (in->attached) rpc_call_end_waits(in->attached); /* a writer waiting for room */
    }
}

void lc_inst_stop(lc_inst *in, pie_code code, const char *msg) {
    pthread_mutex_lock(&in->mu);
    stop_locked(in, code, msg);
    pthread_mutex_unlock(&in->mu);
}

void lc_inst_terminate(lc_inst *in, rpc_call *call) {
    pthread_mutex_lock(&in->mu);
    stop_locked(in, PIE_CANCELLED, "terminated by client");
    bool now = in->state == PIE__V1__INSTANCE_STATE__INSTANCE_STATE_EXITED;
    if (!now) {
        rpc_call **v = realloc(in->terminating, (in->n_terminating + 1) * sizeof *v);
        now = v == NULL; /* out of memory: answered now, the stop requested */
        if (v) {
            in->terminating = v;
            in->terminating[in->n_terminating++] = call;
            rpc_call_ref(call);
        }
    }
    pthread_mutex_unlock(&in->mu);
    if (now) {
        Pie__V1__TerminateResponse r = PIE__V1__TERMINATE_RESPONSE__INIT;
        rpc_call_reply(call, &r.base);
    }
}

/* ---- listing ------------------------------------------------------------------------------ */

static uint64_t thread_cpu_ms(pthread_t t) {
    clockid_t cid;
    struct timespec ts;
    if (pthread_getcpuclockid(t, &cid) != 0 || clock_gettime(cid, &ts) != 0) return 0;
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* One InstanceInfo, allocated as a single block with its sub-messages. Caller holds in->mu. */
typedef struct lc_info_block {
    Pie__V1__InstanceInfo info; /* first: the list holds &info */
    lc_inst *in;                /* a reference: info points at its strings */
    Pie__V1__ResourceLimits limits;
    Pie__V1__ResourceUsage usage;
    Pie__V1__InstanceExit exit;
    Pie__V1__Status status;
    char exit_msg[PIE_STATUS_MSG_MAX];
} lc_info_block;

static Pie__V1__InstanceInfo *info_of(lc_inst *in) {
    lc_info_block *b = calloc(1, sizeof *b);
    if (b == NULL) return NULL;
    b->in = inst_ref(in);
    Pie__V1__InstanceInfo *i = &b->info;
    pie__v1__instance_info__init(i);
    i->instance_id = in->id;
    i->program_id = in->program_id;
    i->program_name = in->program_name;
    i->model = in->model;
    i->tenant = (char *)in->tenant->name;
    i->state = in->state;
    i->started_unix_ms = in->started_unix_ms;
    lc_limits_to_pb(&in->limits, &b->limits);
    i->limits = &b->limits;
    pie__v1__resource_usage__init(&b->usage);
    if (in->state == PIE__V1__INSTANCE_STATE__INSTANCE_STATE_EXITED) {
        b->usage = in->usage;
        fill_exit(in, &b->exit, &b->status);
        snprintf(b->exit_msg, sizeof b->exit_msg, "%s", b->status.message);
        b->status.message = b->exit_msg;
        i->exit_status = &b->exit;
    } else {
        if (in->hi) lc_host_inst_usage(in->hi, &b->usage);
        if (in->state == PIE__V1__INSTANCE_STATE__INSTANCE_STATE_RUNNING)
            b->usage.cpu_ms = thread_cpu_ms(in->thread);
        if (in->winst) b->usage.memory_bytes = lc_wasm_instance_memory_bytes(in->winst);
        b->usage.wall_ms = (uint64_t)(rpc_now_ns() - in->started_ns) / 1000000;
    }
    i->usage = &b->usage;
    i->attached = in->attached != NULL;
    return i;
}

pie_code lc_inst_list(lc_inst_mgr *m, const pie_tenant *tenant, Pie__V1__InstanceInfo ***out,
                      size_t *n, pie_status *st) {
    pthread_mutex_lock(&m->mu);
    sweep(m);
    Pie__V1__InstanceInfo **list = calloc(m->n ? m->n : 1, sizeof *list);
    size_t cnt = 0;
    for (size_t i = 0; list && i < m->n; i++) {
        lc_inst *in = m->table[i];
        if (!visible_to(in, tenant)) continue;
        pthread_mutex_lock(&in->mu);
        Pie__V1__InstanceInfo *info = info_of(in);
        pthread_mutex_unlock(&in->mu);
        if (info == NULL) {
            lc_inst_list_free(list, cnt);
            list = NULL;
            break;
        }
        list[cnt++] = info;
    }
    pthread_mutex_unlock(&m->mu);
    if (list == NULL) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
    *out = list;
    *n = cnt;
    return PIE_OK;
}

void lc_inst_list_free(Pie__V1__InstanceInfo **list, size_t n) {
    for (size_t i = 0; i < n; i++) {
        lc_info_block *b = (lc_info_block *)list[i];
        lc_inst_unref(b->in);
        free(b);
    }
    free(list);
}
