/* test_ctl_core.c — the control layer (services/controller/ctl_core.h) driven message by
 * message, without gRPC: fake lifecycle replicas send SessionUp messages and read the
 * SessionDown messages the core emits; fake worker groups read WorkerDown steps and answer them
 * like a real worker would, checking the contract as they go (slots are allocated before use
 * and never twice, ids stay within capacity, one step per credit).
 *
 * Covers: one decode step as one step, results in issue order per queue, synchronize,
 * every kind of invalid call and its exact error, quotas, export / import with reference counts,
 * release when an instance ends, contention (kill_newest and fail_call), placement across
 * worker groups and their loss, a leaving worker (WorkerUp.draining: no new placements,
 * Drain{shutdown} after its last instance), pub/sub, priorities inside a batch, vertical batching and
 * conflicts, batch and item failures from the worker, protocol violations, k_only timing. */
#include <criterion/criterion.h>

#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "ctl_core.h"
#include "pie_log.h"

/* ---- fake transport ------------------------------------------------------------------------ */

#define MAXMSG 512

typedef struct flink {
    bool worker;
    ProtobufCMessage *msgs[MAXMSG]; /* deep copies of what the core sent */
    int n, read;                    /* read: how many the test (or fake worker) consumed */
    bool ended;
    pie_code end_code;
    char end_msg[PIE_STATUS_MSG_MAX];
} flink;

static ProtobufCMessage *deep_copy(const ProtobufCMessage *m) {
    size_t n = protobuf_c_message_get_packed_size(m);
    uint8_t *buf = malloc(n ? n : 1);
    cr_assert_not_null(buf);
    protobuf_c_message_pack(m, buf);
    ProtobufCMessage *c = protobuf_c_message_unpack(m->descriptor, NULL, n, buf);
    free(buf);
    cr_assert_not_null(c);
    return c;
}

/* Every message the core sends must fit in its configured server.max_message (u points to it;
 * 0 = not checked). */
static void check_size(void *u, const ProtobufCMessage *m) {
    uint64_t max = *(const uint64_t *)u;
    size_t n = protobuf_c_message_get_packed_size(m);
    if (max)
        cr_assert_leq(n, max, "a %s of %zu bytes exceeds max_message %llu", m->descriptor->name, n,
                      (unsigned long long)max);
}

static void sink_rep(void *u, void *link, const Pie__V1__SessionDown *m) {
    check_size(u, &m->base);
    flink *l = link;
    cr_assert_lt(l->n, MAXMSG);
    l->msgs[l->n++] = deep_copy(&m->base);
}

static void sink_wrk(void *u, void *link, const Pie__V1__WorkerDown *m) {
    check_size(u, &m->base);
    flink *l = link;
    cr_assert_lt(l->n, MAXMSG);
    l->msgs[l->n++] = deep_copy(&m->base);
}

static void sink_end(void *u, void *link, pie_code code, const char *msg) {
    (void)u;
    flink *l = link;
    l->ended = true;
    l->end_code = code;
    snprintf(l->end_msg, sizeof l->end_msg, "%s", msg);
}

/* ---- the world ------------------------------------------------------------------------------ */

#define PAGE       4
#define KV_PAGES   16
#define EMB_SLOTS  64
#define MAX_ITEMS  8
#define MAX_TOKENS 32

typedef struct fworker {
    flink link;
    ctl_worker *w;
    char group[32];
    uint8_t kv_live[KV_PAGES], emb_live[EMB_SLOTS];
    uint32_t kv_pages;
    int steps_answered;
    /* Failure injection for the next answered batch of a kind. */
    Pie__V1__Batch__KindCase fail_kind;
    uint32_t fail_code; /* whole batch */
    int fail_item;      /* or one item (>= 0) */
    uint64_t exec_us;   /* reported as every batch's execution time */
    /* The last forward batch answered (copies of items' kv_slots etc. via the message). */
    Pie__V1__ForwardBatch *last_forward;
    /* Deferral (WorkerRegistration.may_defer): in the next defer_steps steps (-1: every step)
     * with a forward batch, the forward items whose index is in defer_mask are deferred, and so
     * is every next_dist call (whole, by call_items) that reads one of their output embeddings,
     * as a worker defers dependents. defer_partial: in the next next_dist batch, only the first
     * item of its first call is deferred (a contract violation). */
    bool may_defer;
    uint32_t defer_mask;
    int defer_steps;
    bool defer_partial;
    uint64_t deferred_items; /* items answered deferred, summed */
} fworker;

typedef struct world {
    ctl_core *core;
    flink rl[3];
    ctl_replica *r[3];
    int nr;
    fworker wk[3];
    int nw;
    int64_t now;
    uint64_t call_id;
    /* results collected from replica 0..2, flattened */
    Pie__V1__CallResult *res[3][1024];
    int nres[3];
    Pie__V1__SessionEvent *ev[3][256];
    int nev[3];
    uint64_t max_message; /* cfg.max_message_bytes, for check_size */
} world;

static void world_free(world *W) {
    ctl_core_destroy(W->core);
    for (int i = 0; i < 3; i++)
        for (int k = 0; k < W->rl[i].n; k++)
            protobuf_c_message_free_unpacked(W->rl[i].msgs[k], NULL);
    for (int i = 0; i < 3; i++)
        for (int k = 0; k < W->wk[i].link.n; k++)
            protobuf_c_message_free_unpacked(W->wk[i].link.msgs[k], NULL);
    free(W);
}

static ctl_core_config base_cfg(void) {
    ctl_core_config cfg = {
        .sched = {.strategy = CTL_STRATEGY_WORK_CONSERVING,
                  .k = 2,
                  .t_ns = 1000000,
                  .k_timeout_ns = 5000000,
                  .max_step_batches = 32},
        .contention = CTL_CONTENTION_KILL_NEWEST,
        .heartbeat_ms = 1000,
    };
    return cfg;
}

static world *world_new(const ctl_core_config *cfg) {
    world *W = calloc(1, sizeof *W);
    cr_assert_not_null(W);
    W->max_message = cfg->max_message_bytes;
    ctl_sink sink = {sink_rep, sink_wrk, sink_end, &W->max_message};
    pie_status st;
    W->core = ctl_core_create(cfg, &sink, NULL, &st);
    cr_assert_not_null(W->core, "%s", st.msg);
    W->now = 1000000000;
    return W;
}

static ProtobufCMessage *heap_copy(const ProtobufCMessage *m) { return deep_copy(m); }

static int add_replica(world *W) {
    int i = W->nr++;
    Pie__V1__SessionHello h = PIE__V1__SESSION_HELLO__INIT;
    char id[16];
    snprintf(id, sizeof id, "lc-%d", i);
    h.replica_id = id;
    h.version = "pie-c/0.1.0";
    Pie__V1__SessionUp up = PIE__V1__SESSION_UP__INIT;
    up.hello = &h;
    pie_status st;
    Pie__V1__SessionUp *copy = (Pie__V1__SessionUp *)heap_copy(&up.base);
    W->r[i] = ctl_core_replica_join(W->core, &W->rl[i], copy, W->now, &st);
    cr_assert_not_null(W->r[i], "%s", st.msg);
    return i;
}

static Pie__V1__ModelInfo model_info(const char *name) {
    Pie__V1__ModelInfo m = PIE__V1__MODEL_INFO__INIT;
    m.name = (char *)name;
    m.kv_page_size = PAGE;
    m.vocab_size = 100;
    m.max_context_tokens = 1024;
    m.max_forward_tokens = 64;
    m.default_top_k = 4;
    m.max_top_k = 8;
    m.dtype = "f32";
    return m;
}

/* A worker group serving `model` with KV_PAGES pages (or kv_pages if non-zero) under policy
 * gpu, or (kv_effective non-zero) a swap worker offering kv_effective of them now. */
static int add_worker_mem(world *W, const char *model, uint32_t kv_pages, uint32_t credits,
                          uint32_t kv_effective) {
    int i = W->nw++;
    fworker *f = &W->wk[i];
    f->link.worker = true;
    f->fail_item = -1;
    f->kv_pages = kv_pages ? kv_pages : KV_PAGES;
    snprintf(f->group, sizeof f->group, "g%d", i + 1);
    Pie__V1__ModelInfo m = model_info(model);
    Pie__V1__WorkerCapacity cap = PIE__V1__WORKER_CAPACITY__INIT;
    cap.kv_pages_max = cap.kv_pages_effective = cap.kv_pages_gpu = f->kv_pages;
    if (kv_effective) cap.kv_pages_effective = cap.kv_pages_gpu = kv_effective;
    cap.embed_slots = EMB_SLOTS;
    cap.max_batch_items = MAX_ITEMS;
    cap.max_batch_tokens = MAX_TOKENS;
    Pie__V1__WorkerRegistration reg = PIE__V1__WORKER_REGISTRATION__INIT;
    reg.group_id = f->group;
    reg.version = "pie-c/0.1.0";
    reg.model = &m;
    reg.backend = PIE__V1__BACKEND__BACKEND_CPU;
    reg.memory_policy = kv_effective ? PIE__V1__MEMORY_POLICY__MEMORY_POLICY_SWAP
                                     : PIE__V1__MEMORY_POLICY__MEMORY_POLICY_GPU;
    reg.capacity = &cap;
    reg.tp_size = 1;
    reg.may_defer = f->may_defer;
    Pie__V1__WorkerUp up = PIE__V1__WORKER_UP__INIT;
    up.registration = &reg;
    up.credits = credits;
    pie_status st;
    f->w = ctl_core_worker_join(W->core, &f->link, (Pie__V1__WorkerUp *)heap_copy(&up.base), W->now,
                                &st);
    cr_assert_not_null(f->w, "%s", st.msg);
    cr_assert_eq(f->link.n, 1);
    Pie__V1__WorkerDown *d = (Pie__V1__WorkerDown *)f->link.msgs[0];
    cr_assert_not_null(d->registered);
    cr_assert_eq(d->registered->defer_ok, f->may_defer, "defer_ok answers may_defer");
    f->link.read = 1;
    return i;
}

static int add_worker_n(world *W, const char *model, uint32_t kv_pages, uint32_t credits) {
    return add_worker_mem(W, model, kv_pages, credits, 0);
}

static int add_worker(world *W, const char *model) { return add_worker_n(W, model, 0, 1); }

/* A worker group whose registration says may_defer (the fake defers what defer_mask says). */
static int add_deferring_worker(world *W, const char *model, uint32_t credits) {
    W->wk[W->nw].may_defer = true;
    return add_worker_n(W, model, 0, credits);
}

/* A batch's call_items must be present for a worker that may defer (adding up to its n items)
 * and absent otherwise; returns them (n_calls ← how many). */
static const uint32_t *check_call_items(const fworker *f, const uint32_t *v, size_t n_v,
                                        size_t n_items, size_t *n_calls) {
    if (!f->may_defer) {
        cr_assert_eq(n_v, 0, "call_items sent to a worker that does not defer");
        *n_calls = 0;
        return NULL;
    }
    size_t sum = 0;
    for (size_t k = 0; k < n_v; k++) sum += v[k];
    cr_assert(n_v > 0 && sum == n_items, "call_items (%zu calls) add up to %zu of %zu items", n_v,
              sum, n_items);
    *n_calls = n_v;
    return v;
}

/* An item the fake worker deferred. */
static void item_deferred(Pie__V1__ItemResult *it) {
    pie__v1__item_result__init(it);
    it->code = PIE_UNAVAILABLE;
    it->message = "deferred";
    it->deferred = true;
}

/* ---- SessionUp builder ------------------------------------------------------------------------
 */

typedef struct ub {
    Pie__V1__SessionUp up;
    Pie__V1__ApiCall calls[64], *cp[64];
    Pie__V1__InstanceBegin begins[8], *bp[8];
    Pie__V1__ResourceLimits lim[8];
    Pie__V1__InstanceEnd ends[8], *ep[8];
} ub;

static void ub_init(ub *b) {
    memset(b, 0, sizeof *b);
    pie__v1__session_up__init(&b->up);
}

static uint64_t inst_id(int replica, uint64_t n) { return ((uint64_t)(replica + 1) << 48) | n; }

static void ub_begin(ub *b, uint64_t id, const char *model, uint32_t kv, uint32_t emb,
                     uint32_t queues) {
    size_t i = b->up.n_begins++;
    pie__v1__instance_begin__init(&b->begins[i]);
    pie__v1__resource_limits__init(&b->lim[i]);
    b->lim[i].kv_pages = kv;
    b->lim[i].embeddings = emb;
    b->lim[i].queues = queues;
    b->begins[i].instance_id = id;
    b->begins[i].model = (char *)model;
    b->begins[i].program_id = "prog";
    b->begins[i].limits = &b->lim[i];
    b->bp[i] = &b->begins[i];
    b->up.begins = b->bp;
}

static void ub_end(ub *b, uint64_t id) {
    size_t i = b->up.n_ends++;
    pie__v1__instance_end__init(&b->ends[i]);
    b->ends[i].instance_id = id;
    b->ep[i] = &b->ends[i];
    b->up.ends = b->ep;
}

/* Adds a call; msg is the op's message (any of the oneof's types). Returns its call id. */
static uint64_t ub_call(world *W, ub *b, uint64_t inst, uint32_t q, int op, void *msg) {
    size_t i = b->up.n_calls++;
    cr_assert_lt(i, 64);
    Pie__V1__ApiCall *c = &b->calls[i];
    pie__v1__api_call__init(c);
    c->instance_id = inst;
    c->queue_id = q;
    c->call_id = ++W->call_id;
    c->op_case = op;
    c->create_queue = msg; /* the oneof's members share one pointer */
    b->cp[i] = c;
    b->up.calls = b->cp;
    return c->call_id;
}

static void send_up(world *W, int replica, ub *b) {
    ctl_core_session_up(W->core, W->r[replica], (Pie__V1__SessionUp *)heap_copy(&b->up.base),
                        W->now);
}

/* Shorthands for common calls (their messages live in static storage per call site). */
#define OP(x)    PIE__V1__API_CALL__OP_##x
#define U32(...) ((uint32_t[]){__VA_ARGS__})
#define N32(...) (sizeof((uint32_t[]){__VA_ARGS__}) / sizeof(uint32_t))

/* A zeroed message of descriptor d in static storage that the next 1023 calls do not reuse (a
 * SessionUp built from these is copied by send_up long before). */
static void *msg_new(const ProtobufCMessageDescriptor *d) {
    static _Alignas(max_align_t) unsigned char ring[1024][256];
    static unsigned k;
    cr_assert_leq(d->sizeof_message, sizeof ring[0], "%s does not fit the ring", d->name);
    void *m = ring[k++ % 1024];
    protobuf_c_message_init(d, m);
    return m;
}

static Pie__V1__CreateQueue *mk_create(const char *model) {
    Pie__V1__CreateQueue *x = msg_new(&pie__v1__create_queue__descriptor);
    x->model = (char *)(model ? model : "");
    return x;
}

static Pie__V1__AllocKvPages *mk_alloc_kv(uint32_t *ids, size_t n) {
    Pie__V1__AllocKvPages *x = msg_new(&pie__v1__alloc_kv_pages__descriptor);
    x->kv_page_ids = ids;
    x->n_kv_page_ids = n;
    return x;
}

static Pie__V1__AllocEmbeds *mk_alloc_emb(uint32_t *ids, size_t n) {
    Pie__V1__AllocEmbeds *x = msg_new(&pie__v1__alloc_embeds__descriptor);
    x->embed_ids = ids;
    x->n_embed_ids = n;
    return x;
}

static Pie__V1__DeallocKvPages *mk_dealloc_kv(uint32_t *ids, size_t n) {
    Pie__V1__DeallocKvPages *x = msg_new(&pie__v1__dealloc_kv_pages__descriptor);
    x->kv_page_ids = ids;
    x->n_kv_page_ids = n;
    return x;
}

static Pie__V1__DeallocEmbeds *mk_dealloc_emb(uint32_t *ids, size_t n) {
    Pie__V1__DeallocEmbeds *x = msg_new(&pie__v1__dealloc_embeds__descriptor);
    x->embed_ids = ids;
    x->n_embed_ids = n;
    return x;
}

static Pie__V1__EmbedText *mk_embed(uint32_t *ids, uint32_t *toks, uint32_t *pos, size_t n) {
    Pie__V1__EmbedText *x = msg_new(&pie__v1__embed_text__descriptor);
    x->embed_ids = ids;
    x->token_ids = toks;
    x->positions = pos;
    x->n_embed_ids = x->n_token_ids = x->n_positions = n;
    return x;
}

static Pie__V1__Forward *mk_forward(uint32_t *kv, size_t nkv, uint32_t last, uint32_t *in,
                                    size_t nin, uint32_t *okv, size_t nokv, uint32_t *oemb,
                                    size_t noemb) {
    Pie__V1__Forward *x = msg_new(&pie__v1__forward__descriptor);
    x->kv_page_ids = kv;
    x->n_kv_page_ids = nkv;
    x->kv_page_last_len = last;
    x->input_embed_ids = in;
    x->n_input_embed_ids = nin;
    x->output_kv_page_ids = okv;
    x->n_output_kv_page_ids = nokv;
    x->output_embed_ids = oemb;
    x->n_output_embed_ids = noemb;
    return x;
}

static Pie__V1__NextDist *mk_dist(uint32_t *ids, size_t n, uint32_t k, float t) {
    Pie__V1__NextDist *x = msg_new(&pie__v1__next_dist__descriptor);
    x->embed_ids = ids;
    x->n_embed_ids = n;
    x->top_k = k;
    x->temperature = t;
    return x;
}

/* The message of a call without fields: synchronize, destroy_queue or list_exports. */
static void *mk_empty(int op) {
    return msg_new(op == OP(SYNCHRONIZE)     ? &pie__v1__synchronize__descriptor
                   : op == OP(DESTROY_QUEUE) ? &pie__v1__destroy_queue__descriptor
                                             : &pie__v1__list_exports__descriptor);
}

static Pie__V1__CopyKvPage *cp(uint32_t src, uint32_t dst, uint32_t so, uint32_t doff, uint32_t n) {
    Pie__V1__CopyKvPage *x = msg_new(&pie__v1__copy_kv_page__descriptor);
    x->src_kv_page_id = src;
    x->dst_kv_page_id = dst;
    x->src_offset = so;
    x->dst_offset = doff;
    x->token_count = n;
    return x;
}

static Pie__V1__ExportKvPages *mk_export(uint32_t *ids, size_t n, const char *name,
                                         bool persistent) {
    Pie__V1__ExportKvPages *x = msg_new(&pie__v1__export_kv_pages__descriptor);
    x->kv_page_ids = ids;
    x->n_kv_page_ids = n;
    x->name = (char *)name;
    x->persistent = persistent;
    return x;
}

static Pie__V1__ImportKvPages *mk_import(uint32_t *ids, size_t n, const char *name) {
    Pie__V1__ImportKvPages *x = msg_new(&pie__v1__import_kv_pages__descriptor);
    x->kv_page_ids = ids;
    x->n_kv_page_ids = n;
    x->name = (char *)name;
    return x;
}

static Pie__V1__UnexportKvPages *mk_unexport(const char *name) {
    Pie__V1__UnexportKvPages *x = msg_new(&pie__v1__unexport_kv_pages__descriptor);
    x->name = (char *)name;
    return x;
}

/* ---- fake worker ------------------------------------------------------------------------------
 */

/* Answers up to max unread steps of worker i, oldest first, one WorkerUp per step with one
 * credit, like services/worker does; checks slot discipline. Returns steps answered. */
static int serve_n(world *W, int i, int max) {
    fworker *f = &W->wk[i];
    int answered = 0;
    while (f->link.read < f->link.n && answered < max) {
        Pie__V1__WorkerDown *d = (Pie__V1__WorkerDown *)f->link.msgs[f->link.read++];
        cr_assert(d->n_batches > 0, "a WorkerDown without batches used a credit");
        Pie__V1__BatchResult *res = calloc(d->n_batches, sizeof *res);
        Pie__V1__BatchResult **rp = calloc(d->n_batches, sizeof *rp);
        Pie__V1__ItemResult *items = calloc(4096, sizeof *items);
        Pie__V1__ItemResult **ip = calloc(4096, sizeof *ip);
        Pie__V1__Distribution *dists = calloc(4096, sizeof *dists);
        uint32_t *tok = calloc(4096, sizeof *tok);
        float *prob = calloc(4096, sizeof *prob);
        size_t ni = 0;
        uint8_t def_emb[EMB_SLOTS] = {0}; /* outputs of the forward items deferred this step */
        bool defer_now = f->defer_steps != 0 && f->defer_mask != 0;
        for (size_t b = 0; b < d->n_batches; b++) {
            const Pie__V1__Batch *bt = d->batches[b];
            pie__v1__batch_result__init(&res[b]);
            res[b].batch_id = bt->batch_id;
            res[b].exec_us = f->exec_us;
            rp[b] = &res[b];
            size_t n_items = 0;
            switch (bt->kind_case) {
            case PIE__V1__BATCH__KIND_SLOTS: {
                const Pie__V1__SlotBatch *s = bt->slots;
                for (size_t k = 0; k < s->n_free_kv_slots; k++) {
                    uint32_t v = s->free_kv_slots[k];
                    cr_assert(v < f->kv_pages && f->kv_live[v],
                              "free of kv slot %u that is not live", v);
                    f->kv_live[v] = 0;
                }
                for (size_t k = 0; k < s->n_free_embed_slots; k++) {
                    uint32_t v = s->free_embed_slots[k];
                    cr_assert(v < EMB_SLOTS && f->emb_live[v], "free of emb slot %u not live", v);
                    f->emb_live[v] = 0;
                }
                cr_assert_eq(s->n_alloc_kv_owners, s->n_alloc_kv_slots);
                for (size_t k = 0; k < s->n_alloc_kv_slots; k++) {
                    uint32_t v = s->alloc_kv_slots[k];
                    cr_assert(v < f->kv_pages && !f->kv_live[v], "alloc of kv slot %u that is live",
                              v);
                    f->kv_live[v] = 1;
                }
                for (size_t k = 0; k < s->n_alloc_embed_slots; k++) {
                    uint32_t v = s->alloc_embed_slots[k];
                    cr_assert(v < EMB_SLOTS && !f->emb_live[v], "alloc of emb slot %u live", v);
                    f->emb_live[v] = 1;
                }
                break;
            }
            case PIE__V1__BATCH__KIND_EMBED_TEXT: {
                for (size_t k = 0; k < bt->embed_text->n_embed_slots; k++)
                    cr_assert(f->emb_live[bt->embed_text->embed_slots[k]],
                              "embed into a dead slot");
                n_items = bt->embed_text->n_embed_slots;
                size_t n_calls;
                check_call_items(f, bt->embed_text->call_items, bt->embed_text->n_call_items,
                                 n_items, &n_calls);
                break;
            }
            case PIE__V1__BATCH__KIND_FORWARD:
                cr_assert_leq(bt->forward->n_items, MAX_ITEMS);
                for (size_t k = 0; k < bt->forward->n_items; k++) {
                    const Pie__V1__ForwardItem *it = bt->forward->items[k];
                    for (size_t j = 0; j < it->n_kv_slots; j++)
                        cr_assert(f->kv_live[it->kv_slots[j]], "forward over dead kv slot %u",
                                  it->kv_slots[j]);
                }
                f->last_forward = bt->forward;
                n_items = bt->forward->n_items;
                if (defer_now) {
                    res[b].items = &ip[ni];
                    res[b].n_items = n_items;
                    for (size_t k = 0; k < n_items; k++, ni++) {
                        const Pie__V1__ForwardItem *it = bt->forward->items[k];
                        ip[ni] = &items[ni];
                        if (!(k < 32 && (f->defer_mask >> k) & 1)) {
                            pie__v1__item_result__init(&items[ni]);
                            continue;
                        }
                        item_deferred(&items[ni]);
                        f->deferred_items++;
                        for (size_t j = 0; j < it->n_output_embed_slots; j++)
                            def_emb[it->output_embed_slots[j]] = 1;
                    }
                    if (f->defer_steps > 0) f->defer_steps--;
                    defer_now = false;
                }
                break;
            case PIE__V1__BATCH__KIND_MASK_PAGE: n_items = bt->mask_page->n_items; break;
            case PIE__V1__BATCH__KIND_COPY_PAGE: n_items = bt->copy_page->n_items; break;
            case PIE__V1__BATCH__KIND_NEXT_DIST: {
                n_items = bt->next_dist->n_items;
                res[b].items = &ip[ni];
                res[b].n_items = n_items;
                size_t n_calls;
                const uint32_t *ci = check_call_items(
                    f, bt->next_dist->call_items, bt->next_dist->n_call_items, n_items, &n_calls);
                /* which items are deferred: whole calls reading a deferred output */
                uint8_t dfr[MAX_ITEMS * 64] = {0};
                for (size_t c0 = 0, c = 0; c < n_calls; c0 += ci[c++]) {
                    bool any = false;
                    for (size_t k = c0; k < c0 + ci[c]; k++)
                        any = any || def_emb[bt->next_dist->items[k]->embed_slot];
                    for (size_t k = c0; k < c0 + ci[c]; k++) dfr[k] = any;
                }
                if (f->defer_partial && n_items > 1) {
                    memset(dfr, 0, sizeof dfr);
                    dfr[0] = 1;
                    f->defer_partial = false;
                }
                for (size_t k = 0; k < n_items; k++) {
                    if (dfr[k]) {
                        item_deferred(&items[ni]);
                        f->deferred_items++;
                        ip[ni] = &items[ni];
                        ni++;
                        continue;
                    }
                    const Pie__V1__NextDistItem *it = bt->next_dist->items[k];
                    cr_assert(f->emb_live[it->embed_slot]);
                    cr_assert(it->top_k >= 1 && it->top_k <= 8, "top_k %u", it->top_k);
                    cr_assert(it->temperature > 0);
                    pie__v1__item_result__init(&items[ni]);
                    pie__v1__distribution__init(&dists[ni]);
                    tok[ni] = it->embed_slot; /* the slot, so tests can check the mapping */
                    prob[ni] = it->temperature;
                    dists[ni].token_ids = &tok[ni];
                    dists[ni].n_token_ids = 1;
                    dists[ni].probs = &prob[ni];
                    dists[ni].n_probs = 1;
                    items[ni].distribution = &dists[ni];
                    ip[ni] = &items[ni];
                    ni++;
                }
                break;
            }
            default: cr_assert_fail("batch of no kind");
            }
            if (f->fail_kind == bt->kind_case && f->fail_code) {
                res[b].code = f->fail_code;
                res[b].message = "worker: injected batch failure";
                res[b].items = NULL;
                res[b].n_items = 0;
                f->fail_kind = 0;
                f->fail_code = 0;
            } else if (f->fail_kind == bt->kind_case && f->fail_item >= 0) {
                if (res[b].n_items == 0) {
                    res[b].items = &ip[ni];
                    res[b].n_items = n_items;
                    for (size_t k = 0; k < n_items; k++) {
                        pie__v1__item_result__init(&items[ni]);
                        ip[ni] = &items[ni];
                        ni++;
                    }
                }
                res[b].items[f->fail_item]->code = PIE_INTERNAL;
                res[b].items[f->fail_item]->message = "worker: injected item failure";
                res[b].items[f->fail_item]->distribution = NULL;
                f->fail_kind = 0;
                f->fail_item = -1;
            }
        }
        Pie__V1__WorkerUp up = PIE__V1__WORKER_UP__INIT;
        up.results = rp;
        up.n_results = d->n_batches;
        up.credits = 1;
        Pie__V1__WorkerUp *copy = (Pie__V1__WorkerUp *)heap_copy(&up.base);
        free(res);
        free(rp);
        free(items);
        free(ip);
        free(dists);
        free(tok);
        free(prob);
        ctl_core_worker_up(W->core, f->w, copy, W->now);
        answered++;
        f->steps_answered++;
    }
    return answered;
}

/* Serves every worker until none has anything left. */
static int serve(world *W, int i) { return serve_n(W, i, INT_MAX); }

static void serve_all(world *W) {
    for (int rounds = 0; rounds < 100; rounds++) {
        int any = 0;
        for (int i = 0; i < W->nw; i++)
            if (W->wk[i].w) any += serve(W, i);
        if (!any) return;
    }
    cr_assert_fail("workers never went idle");
}

/* Unread SessionDowns of replica r: results and events into W->res / W->ev. Returns how many
 * messages were read. */
static int collect(world *W, int r) {
    flink *l = &W->rl[r];
    int msgs = 0;
    while (l->read < l->n) {
        Pie__V1__SessionDown *d = (Pie__V1__SessionDown *)l->msgs[l->read++];
        msgs++;
        for (size_t i = 0; i < d->n_results; i++) W->res[r][W->nres[r]++] = d->results[i];
        for (size_t i = 0; i < d->n_events; i++) W->ev[r][W->nev[r]++] = d->events[i];
    }
    return msgs;
}

static Pie__V1__CallResult *result_of(world *W, int r, uint64_t call_id) {
    collect(W, r);
    for (int i = 0; i < W->nres[r]; i++)
        if (W->res[r][i]->call_id == call_id) return W->res[r][i];
    return NULL;
}

/* Asserts call_id failed with code and exactly msg. */
static void expect_error(world *W, int r, uint64_t call_id, pie_code code, const char *msg) {
    Pie__V1__CallResult *res = result_of(W, r, call_id);
    cr_assert_not_null(res, "call %llu produced no result (expected %s \"%s\")",
                       (unsigned long long)call_id, pie_code_name(code), msg);
    cr_assert_eq(res->code, (uint32_t)code, "call %llu: code %s, expected %s; message \"%s\"",
                 (unsigned long long)call_id, pie_code_name((int)res->code), pie_code_name(code),
                 res->message);
    cr_assert_str_eq(res->message, msg, "call %llu: message differs", (unsigned long long)call_id);
}

static void expect_no_result(world *W, int r, uint64_t call_id) {
    Pie__V1__CallResult *res = result_of(W, r, call_id);
    cr_assert_null(res, "call %llu has a result: %s \"%s\"", (unsigned long long)call_id,
                   res ? pie_code_name((int)res->code) : "", res ? res->message : "");
}

/* The terminated event for instance id at replica r, or NULL. */
static Pie__V1__InstanceTerminated *terminated(world *W, int r, uint64_t id) {
    collect(W, r);
    for (int i = 0; i < W->nev[r]; i++)
        if (W->ev[r][i]->event_case == PIE__V1__SESSION_EVENT__EVENT_INSTANCE_TERMINATED &&
            W->ev[r][i]->instance_terminated->instance_id == id)
            return W->ev[r][i]->instance_terminated;
    return NULL;
}

static const Pie__V1__WorkerStatus *worker_of_group(const Pie__V1__ClusterStatusResponse *s,
                                                    const char *group) {
    for (size_t i = 0; i < s->n_workers; i++)
        if (strcmp(s->workers[i]->group_id, group) == 0) return s->workers[i];
    cr_assert_fail("worker %s not in status", group);
    return NULL;
}

typedef struct status_copy {
    Pie__V1__ClusterStatusResponse *r;
} status_copy;

static void take_status(void *arg, const Pie__V1__ClusterStatusResponse *r) {
    cr_assert_not_null(r);
    ((status_copy *)arg)->r = (Pie__V1__ClusterStatusResponse *)deep_copy(&r->base);
}

static Pie__V1__ClusterStatusResponse *status(world *W) {
    status_copy s = {0};
    ctl_core_status(W->core, take_status, &s);
    return s.r;
}

static const Pie__V1__WorkerStatus *worker_status(const Pie__V1__ClusterStatusResponse *s,
                                                  uint32_t index) {
    for (size_t i = 0; i < s->n_workers; i++)
        if (s->workers[i]->worker_index == index) return s->workers[i];
    cr_assert_fail("worker %u not in status", index);
    return NULL;
}

/* An instance on replica r: queue 1, kv pages 0..npages-1, embeddings 0..nemb-1; written:
 * one embed_text writes every embedding (token 1, positions 0..nemb-1), as a program must
 * before it reads them. */
/* An instance of tenant (NULL: none) with npages KV pages and nemb embeddings (written when
 * written). */
static uint64_t tenant_instance_ex(world *W, int r, uint64_t n, uint32_t npages, uint32_t nemb,
                                   bool written, const char *tenant) {
    ub b;
    ub_init(&b);
    uint64_t id = inst_id(r, n);
    ub_begin(&b, id, "m", 0, 0, 0);
    Pie__V1__Tenant t = PIE__V1__TENANT__INIT;
    t.name = (char *)tenant;
    if (tenant) b.begins[0].tenant = &t;
    ub_call(W, &b, id, 1, OP(CREATE_QUEUE), mk_create(NULL));
    static uint32_t ids[64], ones[64];
    for (uint32_t i = 0; i < 64; i++) ids[i] = i, ones[i] = 1;
    if (npages) ub_call(W, &b, id, 1, OP(ALLOC_KV_PAGES), mk_alloc_kv(ids, npages));
    if (nemb) ub_call(W, &b, id, 1, OP(ALLOC_EMBEDS), mk_alloc_emb(ids, nemb));
    if (nemb && written) ub_call(W, &b, id, 1, OP(EMBED_TEXT), mk_embed(ids, ones, ids, nemb));
    send_up(W, r, &b);
    return id;
}

static uint64_t instance_ex(world *W, int r, uint64_t n, uint32_t npages, uint32_t nemb,
                            bool written) {
    return tenant_instance_ex(W, r, n, npages, nemb, written, NULL);
}

/* A standard instance of tenant: npages KV pages, one embedding. */
static uint64_t tenant_instance(world *W, uint64_t n, uint32_t npages, const char *tenant) {
    return tenant_instance_ex(W, 0, n, npages, 1, false, tenant);
}

/* A standard instance: its embeddings allocated, not written. */
static uint64_t std_instance(world *W, int r, uint64_t n, uint32_t npages, uint32_t nemb) {
    return instance_ex(W, r, n, npages, nemb, false);
}

/* A standard instance whose embeddings were written (they may be read). */
static uint64_t written_instance(world *W, int r, uint64_t n, uint32_t npages, uint32_t nemb) {
    return instance_ex(W, r, n, npages, nemb, true);
}

/* Adds a decode step of inst on queue 1 to b: token 1 at position 0 embedded into e_in,
 * forwarded without context into KV page `page` and embedding e_out, then next_dist of e_out.
 * Returns the next_dist's call id. */
static uint64_t ub_decode(world *W, ub *b, uint64_t inst, uint32_t e_in, uint32_t page,
                          uint32_t e_out) {
    /* e_in, page, e_out, token 1, position 0: they outlive this call (b points at them) */
    static uint32_t ids[64][5];
    static unsigned k;
    uint32_t *v = ids[k++ % 64];
    v[0] = e_in, v[1] = page, v[2] = e_out, v[3] = 1, v[4] = 0;
    ub_call(W, b, inst, 1, OP(EMBED_TEXT), mk_embed(&v[0], &v[3], &v[4], 1));
    ub_call(W, b, inst, 1, OP(FORWARD), mk_forward(NULL, 0, 0, &v[0], 1, &v[1], 1, &v[2], 1));
    return ub_call(W, b, inst, 1, OP(NEXT_DIST), mk_dist(&v[2], 1, 0, 0));
}

/* Sends one call for inst on queue q; returns its call id. */
static uint64_t one(world *W, int r, uint64_t inst, uint32_t q, int op, void *msg) {
    ub b;
    ub_init(&b);
    uint64_t cid = ub_call(W, &b, inst, q, op, msg);
    send_up(W, r, &b);
    return cid;
}

/* A world with one worker group serving model "m" and one lifecycle replica (cfg NULL: the
 * base configuration). */
static world *world_std(const ctl_core_config *cfg) {
    ctl_core_config base = base_cfg();
    world *W = world_new(cfg ? cfg : &base);
    add_worker(W, "m");
    add_replica(W);
    return W;
}

/* world_std's, with a worker that may defer (credits steps in flight at a time). */
static world *world_deferring(uint32_t credits) {
    ctl_core_config base = base_cfg();
    world *W = world_new(&base);
    add_deferring_worker(W, "m", credits);
    add_replica(W);
    return W;
}

/* Worker 0 defers the first forward item of its next `steps` steps with a forward batch (-1:
 * of every such step). */
static void defer_forwards(world *W, int steps) {
    W->wk[0].defer_mask = 1;
    W->wk[0].defer_steps = steps;
}

static void quiet(void) { pie_log_set_level(PIE_LOG_OFF); }

TestSuite(ctl_core, .init = quiet);

/* ---- tests ----------------------------------------------------------------------------------- */

Test(ctl_core, welcome_and_served_models_arrive_in_the_first_message) {
    world *W = world_std(NULL);
    add_replica(W);
    cr_assert_eq(W->rl[0].n, 1);
    Pie__V1__SessionDown *d = (Pie__V1__SessionDown *)W->rl[0].msgs[0];
    cr_assert_not_null(d->welcome);
    cr_assert_eq(d->welcome->replica_index, 1);
    cr_assert_eq(d->n_events, 1);
    cr_assert_eq(d->events[0]->event_case, PIE__V1__SESSION_EVENT__EVENT_MODELS_CHANGED);
    cr_assert_eq(d->events[0]->models_changed->n_models, 1);
    cr_assert_str_eq(d->events[0]->models_changed->models[0]->name, "m");
    cr_assert_eq(((Pie__V1__SessionDown *)W->rl[1].msgs[0])->welcome->replica_index, 2);
    world_free(W);
}

Test(ctl_core, a_decode_step_travels_as_one_step_and_its_distribution_comes_back) {
    world *W = world_std(NULL);
    ub b;
    ub_init(&b);
    uint64_t id = inst_id(0, 1);
    ub_begin(&b, id, "m", 0, 0, 0);
    ub_call(W, &b, id, 1, OP(CREATE_QUEUE), mk_create(NULL));
    ub_call(W, &b, id, 1, OP(ALLOC_KV_PAGES), mk_alloc_kv(U32(7), 1));
    ub_call(W, &b, id, 1, OP(ALLOC_EMBEDS), mk_alloc_emb(U32(3), 1));
    ub_call(W, &b, id, 1, OP(EMBED_TEXT), mk_embed(U32(3), U32(42), U32(0), 1));
    ub_call(W, &b, id, 1, OP(FORWARD), mk_forward(NULL, 0, 0, U32(3), 1, U32(7), 1, U32(3), 1));
    uint64_t dist = ub_call(W, &b, id, 1, OP(NEXT_DIST), mk_dist(U32(3), 1, 0, 0));
    send_up(W, 0, &b);
    /* One WorkerDown: [slots, embed_text, forward, next_dist]. */
    fworker *f = &W->wk[0];
    cr_assert_eq(f->link.n - f->link.read, 1, "one step");
    Pie__V1__WorkerDown *d = (Pie__V1__WorkerDown *)f->link.msgs[f->link.read];
    cr_assert_eq(d->n_batches, 4);
    cr_assert_eq(d->batches[0]->kind_case, PIE__V1__BATCH__KIND_SLOTS);
    cr_assert_eq(d->batches[1]->kind_case, PIE__V1__BATCH__KIND_EMBED_TEXT);
    cr_assert_eq(d->batches[2]->kind_case, PIE__V1__BATCH__KIND_FORWARD);
    cr_assert_eq(d->batches[3]->kind_case, PIE__V1__BATCH__KIND_NEXT_DIST);
    for (size_t i = 0; i < 4; i++) cr_assert_eq(d->batches[i]->batch_id, i + 1);
    const Pie__V1__SlotBatch *sb = d->batches[0]->slots;
    cr_assert_eq(sb->n_alloc_kv_slots, 1);
    cr_assert_eq(sb->alloc_kv_owners[0], id);
    cr_assert_eq(sb->n_alloc_embed_slots, 1);
    uint32_t kv_slot = sb->alloc_kv_slots[0], emb_slot = sb->alloc_embed_slots[0];
    cr_assert_eq(d->batches[1]->embed_text->embed_slots[0], emb_slot);
    cr_assert_eq(d->batches[1]->embed_text->token_ids[0], 42);
    const Pie__V1__ForwardItem *fi = d->batches[2]->forward->items[0];
    cr_assert_eq(fi->n_kv_slots, 1);
    cr_assert_eq(fi->kv_slots[0], kv_slot);
    cr_assert_eq(fi->kv_last_page_len, 1);
    cr_assert(fi->append_kv);
    cr_assert_eq(fi->owner, id);
    cr_assert_eq(d->batches[3]->next_dist->items[0]->top_k, 4, "k 0 = the model's default_top_k");
    cr_assert_float_eq(d->batches[3]->next_dist->items[0]->temperature, 1.0f, 1e-6);
    collect(W, 0);
    int before = W->rl[0].n;
    serve(W, 0);
    cr_assert_eq(W->rl[0].n - before, 1, "one SessionDown for the step's results");
    Pie__V1__CallResult *r = result_of(W, 0, dist);
    cr_assert_not_null(r);
    cr_assert_eq(r->code, 0);
    cr_assert_eq(r->payload_case, PIE__V1__CALL_RESULT__PAYLOAD_DISTRIBUTIONS);
    cr_assert_eq(r->distributions->n_dists, 1);
    cr_assert_eq(r->distributions->dists[0]->token_ids[0], emb_slot);
    cr_assert_eq(W->nres[0], 1, "void calls that succeeded produce nothing");
    world_free(W);
}

Test(ctl_core, results_of_a_queue_arrive_in_issue_order_and_synchronize_waits) {
    world *W = world_std(NULL);
    uint64_t id = std_instance(W, 0, 1, 1, 2);
    ub b;
    ub_init(&b);
    ub_call(W, &b, id, 1, OP(EMBED_TEXT), mk_embed(U32(0), U32(1), U32(0), 1));
    uint64_t d1 = ub_call(W, &b, id, 1, OP(NEXT_DIST), mk_dist(U32(0), 1, 2, 0.5f));
    uint64_t bad =
        ub_call(W, &b, id, 1, OP(FORWARD), mk_forward(NULL, 0, 0, U32(9), 1, NULL, 0, NULL, 0));
    uint64_t sync = ub_call(W, &b, id, 1, OP(SYNCHRONIZE), mk_empty(OP(SYNCHRONIZE)));
    send_up(W, 0, &b);
    /* The forward failed at once, but its error waits behind next_dist, still in flight. */
    expect_no_result(W, 0, bad);
    expect_no_result(W, 0, sync);
    serve_all(W);
    collect(W, 0);
    cr_assert_eq(W->nres[0], 3);
    cr_assert_eq(W->res[0][0]->call_id, d1);
    cr_assert_eq(W->res[0][1]->call_id, bad);
    cr_assert_str_eq(W->res[0][1]->message,
                     "forward: embedding 9 is not allocated in this instance");
    cr_assert_eq(W->res[0][2]->call_id, sync);
    cr_assert_eq(W->res[0][2]->code, 0);
    cr_assert_eq(W->res[0][2]->payload_case, PIE__V1__CALL_RESULT__PAYLOAD_SYNCED);
    world_free(W);
}

Test(ctl_core, synchronize_of_an_idle_queue_completes_at_once) {
    world *W = world_std(NULL);
    uint64_t id = std_instance(W, 0, 1, 0, 0);
    uint64_t s = one(W, 0, id, 1, OP(SYNCHRONIZE), mk_empty(OP(SYNCHRONIZE)));
    Pie__V1__CallResult *r = result_of(W, 0, s);
    cr_assert_not_null(r);
    cr_assert_eq(r->payload_case, PIE__V1__CALL_RESULT__PAYLOAD_SYNCED);
    world_free(W);
}

/* ---- invalid calls --------------------------------------------------------------------------- */

/* A message of type Pie__V1__<T> with the given fields, as a compound literal (static storage
 * at file scope). MSG0: one without fields. */
#define MSG(T, t, ...) \
    (&(Pie__V1__##T){.base = PROTOBUF_C_MESSAGE_INIT(&pie__v1__##t##__descriptor), __VA_ARGS__})
#define MSG0(T, t) (&(Pie__V1__##T){.base = PROTOBUF_C_MESSAGE_INIT(&pie__v1__##t##__descriptor)})
/* A repeated field: its values and its count. */
#define IDS(f, ...) .f = U32(__VA_ARGS__), .n_##f = N32(__VA_ARGS__)
/* A forward over one context page holding 2 tokens (C = 2) with 2 inputs, masked by runs. */
#define FWD_MASKED(...)                                                                           \
    MSG(Forward, forward, IDS(kv_page_ids, 0), .kv_page_last_len = 2, IDS(input_embed_ids, 0, 1), \
        .mask = MSG(AttentionMask, attention_mask, IDS(runs, __VA_ARGS__)))

static uint32_t zeros[4097]; /* ids for the counts over a limit (the count is checked first) */
static char long_topic[258]; /* 257 bytes, filled by the test */
static protobuf_c_boolean bits[PAGE];

typedef struct bad_case {
    int op;
    uint32_t queue;
    void *msg; /* the op's message */
    pie_code code;
    const char *err; /* NULL: the UNIMPLEMENTED message, built in the test */
} bad_case;

/* The instance holds pages 0, 1 and embeddings 0, 1; the model has pages of PAGE = 4 tokens,
 * vocab_size 100, max_context_tokens 1024, max_forward_tokens 64, max_top_k 8; the worker
 * takes 32 tokens and 8 items per batch. */
static const bad_case bad_cases[] = {
    {OP(CREATE_QUEUE), 0, MSG(CreateQueue, create_queue, .model = ""), PIE_INVALID_ARGUMENT,
     "create_queue: queue id 0 is reserved"},
    {OP(CREATE_QUEUE), 1, MSG(CreateQueue, create_queue, .model = ""), PIE_ALREADY_EXISTS,
     "create_queue: queue 1 already exists"},
    {OP(CREATE_QUEUE), 2, MSG(CreateQueue, create_queue, .model = "nope"), PIE_NOT_FOUND,
     "create_queue: model \"nope\" is not served"},
    {OP(SYNCHRONIZE), 9, MSG0(Synchronize, synchronize), PIE_NOT_FOUND,
     "synchronize: queue 9 is not found in this instance"},
    {OP(SET_PRIORITY), 1, MSG(SetQueuePriority, set_queue_priority, .priority = 7),
     PIE_INVALID_ARGUMENT, "set_priority: priority 7 is not a QueuePriority"},
    {OP(ALLOC_KV_PAGES), 1, MSG(AllocKvPages, alloc_kv_pages, IDS(kv_page_ids, 5, 5)),
     PIE_INVALID_ARGUMENT, "alloc_kv_pages: kv page 5 is listed twice in kv_page_ids"},
    {OP(ALLOC_KV_PAGES), 1, MSG(AllocKvPages, alloc_kv_pages, IDS(kv_page_ids, 0)),
     PIE_INVALID_ARGUMENT, "alloc_kv_pages: kv page 0 is already allocated in this instance"},
    {OP(ALLOC_KV_PAGES), 1, MSG0(AllocKvPages, alloc_kv_pages), PIE_INVALID_ARGUMENT,
     "alloc_kv_pages: kv_page_ids is empty"},
    {OP(ALLOC_KV_PAGES), 1,
     MSG(AllocKvPages, alloc_kv_pages, .kv_page_ids = zeros, .n_kv_page_ids = 4097),
     PIE_INVALID_ARGUMENT,
     "alloc_kv_pages: kv_page_ids has 4097 entries, more than the 4096 allowed"},
    {OP(DEALLOC_KV_PAGES), 1, MSG(DeallocKvPages, dealloc_kv_pages, IDS(kv_page_ids, 0, 17)),
     PIE_INVALID_ARGUMENT, "dealloc_kv_pages: kv page 17 is not allocated in this instance"},
    {OP(EMBED_TEXT), 1,
     MSG(EmbedText, embed_text, IDS(embed_ids, 0, 1), IDS(token_ids, 1, 2), IDS(positions, 0)),
     PIE_INVALID_ARGUMENT,
     "embed_text: embed_ids, token_ids and positions must have equal lengths, got 2, 2 and 1"},
    {OP(EMBED_TEXT), 1,
     MSG(EmbedText, embed_text, IDS(embed_ids, 0, 1), IDS(token_ids, 1, 100), IDS(positions, 0, 1)),
     PIE_INVALID_ARGUMENT, "embed_text: token_ids[1] = 100 is out of range [0, 100)"},
    {OP(EMBED_TEXT), 1,
     MSG(EmbedText, embed_text, IDS(embed_ids, 0), IDS(token_ids, 1), IDS(positions, 1024)),
     PIE_INVALID_ARGUMENT, "embed_text: positions[0] = 1024 is out of range [0, 1024)"},
    {OP(EMBED_TEXT), 1,
     MSG(EmbedText, embed_text, IDS(embed_ids, 0, 12), IDS(token_ids, 1, 2), IDS(positions, 0, 1)),
     PIE_INVALID_ARGUMENT, "embed_text: embedding 12 is not allocated in this instance"},
    {OP(EMBED_TEXT), 1,
     MSG(EmbedText, embed_text, IDS(embed_ids, 1, 1), IDS(token_ids, 1, 2), IDS(positions, 0, 1)),
     PIE_INVALID_ARGUMENT, "embed_text: embedding 1 is listed twice in embed_ids"},
    {OP(FORWARD), 1, MSG0(Forward, forward), PIE_INVALID_ARGUMENT,
     "forward: input_embed_ids is empty"},
    {OP(FORWARD), 1, MSG(Forward, forward, .input_embed_ids = zeros, .n_input_embed_ids = 65),
     PIE_INVALID_ARGUMENT, "forward: input_embed_ids has 65 entries, more than the 64 allowed"},
    {OP(FORWARD), 1, MSG(Forward, forward, .input_embed_ids = zeros, .n_input_embed_ids = 40),
     PIE_INVALID_ARGUMENT, "forward: 40 input tokens exceed the worker's max_batch_tokens 32"},
    {OP(FORWARD), 1, MSG(Forward, forward, .kv_page_last_len = 2, IDS(input_embed_ids, 0)),
     PIE_INVALID_ARGUMENT, "forward: kv_page_last_len 2 must be 0 when kv_page_ids is empty"},
    {OP(FORWARD), 1,
     MSG(Forward, forward, IDS(kv_page_ids, 0), .kv_page_last_len = 5, IDS(input_embed_ids, 0)),
     PIE_INVALID_ARGUMENT, "forward: kv_page_last_len 5 is out of range [1, 4]"},
    {OP(FORWARD), 1, MSG(Forward, forward, IDS(input_embed_ids, 0), IDS(output_embed_ids, 0, 1)),
     PIE_INVALID_ARGUMENT,
     "forward: output_embed_ids has 2 entries, more than the 1 of input_embed_ids"},
    {OP(FORWARD), 1,
     MSG(Forward, forward, IDS(kv_page_ids, 0, 9), .kv_page_last_len = 1, IDS(input_embed_ids, 0)),
     PIE_INVALID_ARGUMENT, "forward: kv page 9 is not allocated in this instance"},
    {OP(FORWARD), 1, MSG(Forward, forward, IDS(input_embed_ids, 0), IDS(output_kv_page_ids, 0, 1)),
     PIE_INVALID_ARGUMENT,
     "forward: output_kv_page_ids (2 pages) take 5 to 8 tokens here, but there are 1 input tokens"},
    {OP(FORWARD), 1,
     MSG(Forward, forward, IDS(kv_page_ids, 0), .kv_page_last_len = 2, IDS(input_embed_ids, 0),
         IDS(output_kv_page_ids, 1)),
     PIE_INVALID_ARGUMENT,
     "forward: output_kv_page_ids[0] (kv page 1) is not the last context page (kv page 0), which "
     "holds 2 of 4 tokens: append to it"},
    {OP(FORWARD), 1,
     MSG(Forward, forward, IDS(kv_page_ids, 0), .kv_page_last_len = 4, IDS(input_embed_ids, 0),
         IDS(output_kv_page_ids, 0)),
     PIE_INVALID_ARGUMENT,
     "forward: the last context page (kv page 0) is full: output_kv_page_ids[0] must be a new "
     "page"},
    {OP(FORWARD), 1,
     MSG(Forward, forward, IDS(kv_page_ids, 0, 1), .kv_page_last_len = 4, IDS(input_embed_ids, 0),
         IDS(output_kv_page_ids, 2, 0)),
     PIE_INVALID_ARGUMENT,
     "forward: output kv page 0 is also a context page (only the last context page may be "
     "output_kv_page_ids[0])"},
    {OP(FORWARD), 1, FWD_MASKED(2, 2), PIE_INVALID_ARGUMENT,
     "forward: mask run 1 (length 2) crosses the end of row 0 (3 tokens)"},
    {OP(FORWARD), 1, FWD_MASKED(2, 1, 1, 3), PIE_INVALID_ARGUMENT,
     "forward: mask row 0 hides its own token (the last of its 3)"},
    {OP(FORWARD), 1, FWD_MASKED(3, 4, 1), PIE_INVALID_ARGUMENT,
     "forward: mask has 1 runs left over after row 1"},
    {OP(FORWARD), 1, FWD_MASKED(3), PIE_INVALID_ARGUMENT,
     "forward: mask runs end in row 1 (0 of its 4 tokens covered)"},
    {OP(NEXT_DIST), 1, MSG(NextDist, next_dist, IDS(embed_ids, 0), .top_k = 9),
     PIE_INVALID_ARGUMENT, "next_dist: top_k 9 is out of range [0, 8]"},
    {OP(NEXT_DIST), 1, MSG(NextDist, next_dist, IDS(embed_ids, 0), .top_k = 1, .temperature = -1),
     PIE_INVALID_ARGUMENT, "next_dist: temperature -1 is not a finite number >= 0"},
    {OP(NEXT_DIST), 1, MSG(NextDist, next_dist, IDS(embed_ids, 0), .top_k = 1, .temperature = NAN),
     PIE_INVALID_ARGUMENT, "next_dist: temperature nan is not a finite number >= 0"},
    {OP(NEXT_DIST), 1, MSG(NextDist, next_dist, IDS(embed_ids, 4), .top_k = 1),
     PIE_INVALID_ARGUMENT, "next_dist: embedding 4 is not allocated in this instance"},
    {OP(NEXT_DIST), 1, MSG(NextDist, next_dist, .embed_ids = zeros, .n_embed_ids = 9, .top_k = 1),
     PIE_INVALID_ARGUMENT, "next_dist: 9 embed_ids exceed the worker's max_batch_items 8"},
    {OP(MASK_KV_PAGE), 1, MSG(MaskKvPage, mask_kv_page, .masked = bits, .n_masked = 3),
     PIE_INVALID_ARGUMENT, "mask_kv_page: masked has 3 entries, must have kv_page_size 4"},
    {OP(MASK_KV_PAGE), 1,
     MSG(MaskKvPage, mask_kv_page, .kv_page_id = 33, .masked = bits, .n_masked = PAGE),
     PIE_INVALID_ARGUMENT, "mask_kv_page: kv page 33 is not allocated in this instance"},
#define COPY(src, dst, so, doff, n)                                                               \
    MSG(CopyKvPage, copy_kv_page, .src_kv_page_id = src, .dst_kv_page_id = dst, .src_offset = so, \
        .dst_offset = doff, .token_count = n)
    {OP(COPY_KV_PAGE), 1, COPY(0, 1, 4, 0, 1), PIE_INVALID_ARGUMENT,
     "copy_kv_page: src_offset 4 + token_count 1 exceeds kv_page_size 4"},
    {OP(COPY_KV_PAGE), 1, COPY(0, 1, 0, 0, 0), PIE_INVALID_ARGUMENT,
     "copy_kv_page: token_count 0 is out of range [1, 4]"},
    {OP(COPY_KV_PAGE), 1, COPY(0, 1, 2, 0, 3), PIE_INVALID_ARGUMENT,
     "copy_kv_page: src_offset 2 + token_count 3 exceeds kv_page_size 4"},
    {OP(COPY_KV_PAGE), 1, COPY(0, 0, 0, 1, 2), PIE_INVALID_ARGUMENT,
     "copy_kv_page: source [0, 2) and destination [1, 3) overlap in kv page 0"},
    {OP(COPY_KV_PAGE), 1, COPY(0, 8, 0, 0, 1), PIE_INVALID_ARGUMENT,
     "copy_kv_page: kv page 8 is not allocated in this instance"},
    {OP(EXPORT_KV_PAGES), 1, MSG(ExportKvPages, export_kv_pages, IDS(kv_page_ids, 0), .name = ""),
     PIE_INVALID_ARGUMENT, "export_kv_pages: name is empty"},
    {OP(EXPORT_KV_PAGES), 1,
     MSG(ExportKvPages, export_kv_pages, IDS(kv_page_ids, 0, 3), .name = "x"), PIE_INVALID_ARGUMENT,
     "export_kv_pages: kv page 3 is not allocated in this instance"},
    {OP(UNEXPORT_KV_PAGES), 1, MSG(UnexportKvPages, unexport_kv_pages, .name = "none"),
     PIE_NOT_FOUND, "unexport_kv_pages: export \"none\" is not found"},
    {OP(IMPORT_KV_PAGES), 1,
     MSG(ImportKvPages, import_kv_pages, IDS(kv_page_ids, 40), .name = "none"), PIE_NOT_FOUND,
     "import_kv_pages: export \"none\" is not found"},
    {OP(BROADCAST), 0, MSG(Broadcast, broadcast, .topic = ""), PIE_INVALID_ARGUMENT,
     "broadcast: topic is empty"},
    {OP(SUBSCRIBE), 0, MSG(Subscribe, subscribe, .topic = long_topic), PIE_INVALID_ARGUMENT,
     "subscribe: topic is 257 bytes, more than 256"},
    {0, 1, NULL, PIE_UNIMPLEMENTED, NULL},
};

Test(ctl_core, every_kind_of_invalid_call_fails_alone_with_its_precise_error) {
    world *W = world_std(NULL);
    uint64_t id = written_instance(W, 0, 1, 2, 2); /* pages 0, 1; embeddings 0, 1 */
    uint64_t other = written_instance(W, 0, 2, 1, 1);
    serve_all(W);
    memset(long_topic, 't', 257);
    for (size_t i = 0; i < sizeof bad_cases / sizeof bad_cases[0]; i++) {
        const bad_case *c = &bad_cases[i];
        uint64_t cid = one(W, 0, id, c->queue, c->op, c->msg);
        serve_all(W);
        char noop[96];
        const char *msg = c->err;
        if (msg == NULL) {
            snprintf(noop, sizeof noop,
                     "call %llu: no op set, or an op this controller does not know",
                     (unsigned long long)cid);
            msg = noop;
        }
        expect_error(W, 0, cid, c->code, msg);
    }
    /* Nothing else was affected: both instances still run a decode step. */
    ub b;
    ub_init(&b);
    uint64_t d1 = ub_decode(W, &b, id, 0, 0, 0);
    uint64_t d2 = ub_decode(W, &b, other, 0, 0, 0);
    send_up(W, 0, &b);
    serve_all(W);
    cr_assert_eq(result_of(W, 0, d1)->code, 0);
    cr_assert_eq(result_of(W, 0, d2)->code, 0);
    cr_assert_null(terminated(W, 0, id));
    world_free(W);
}

Test(ctl_core, reading_an_embedding_never_written_fails_at_the_call) {
    world *W = world_std(NULL);
    uint64_t id = std_instance(W, 0, 1, 1, 3); /* page 0; embeddings 0, 1, 2, none written */
    serve_all(W);
    uint64_t d = one(W, 0, id, 1, OP(NEXT_DIST), mk_dist(U32(0), 1, 0, 0));
    uint64_t f =
        one(W, 0, id, 1, OP(FORWARD), mk_forward(NULL, 0, 0, U32(1), 1, U32(0), 1, U32(2), 1));
    serve_all(W);
    expect_error(W, 0, d, PIE_FAILED_PRECONDITION, "next_dist: embedding 0 was never written");
    expect_error(W, 0, f, PIE_FAILED_PRECONDITION, "forward: input embedding 1 was never written");

    /* embed_text writes its embeddings, a forward its outputs: both may then be read, also
     * by calls sent in the same message. */
    ub b;
    ub_init(&b);
    ub_call(W, &b, id, 1, OP(EMBED_TEXT), mk_embed(U32(0), U32(1), U32(0), 1));
    uint64_t d0 = ub_call(W, &b, id, 1, OP(NEXT_DIST), mk_dist(U32(0), 1, 0, 0));
    ub_call(W, &b, id, 1, OP(FORWARD), mk_forward(NULL, 0, 0, U32(0), 1, U32(0), 1, U32(2), 1));
    uint64_t d2 = ub_call(W, &b, id, 1, OP(NEXT_DIST), mk_dist(U32(2), 1, 0, 0));
    send_up(W, 0, &b);
    serve_all(W);
    cr_assert_eq(result_of(W, 0, d0)->code, 0, "%s", result_of(W, 0, d0)->message);
    cr_assert_eq(result_of(W, 0, d2)->code, 0, "%s", result_of(W, 0, d2)->message);

    /* Freed and allocated again, an embedding is unwritten again (whatever slot it gets). */
    ub_init(&b);
    ub_call(W, &b, id, 1, OP(DEALLOC_EMBEDS), mk_dealloc_emb(U32(0, 2), 2));
    ub_call(W, &b, id, 1, OP(ALLOC_EMBEDS), mk_alloc_emb(U32(0, 2), 2));
    uint64_t again = ub_call(W, &b, id, 1, OP(NEXT_DIST), mk_dist(U32(2), 1, 0, 0));
    send_up(W, 0, &b);
    serve_all(W);
    expect_error(W, 0, again, PIE_FAILED_PRECONDITION, "next_dist: embedding 2 was never written");

    /* Another instance that gets this one's slots after it ended finds them unwritten. */
    ub_init(&b);
    ub_call(W, &b, id, 1, OP(EMBED_TEXT), mk_embed(U32(0, 1, 2), U32(1, 1, 1), U32(0, 1, 2), 3));
    ub_end(&b, id);
    send_up(W, 0, &b);
    serve_all(W);
    uint64_t next = std_instance(W, 0, 2, 0, 3);
    uint64_t dn = one(W, 0, next, 1, OP(NEXT_DIST), mk_dist(U32(0, 1, 2), 3, 0, 0));
    serve_all(W);
    expect_error(W, 0, dn, PIE_FAILED_PRECONDITION, "next_dist: embedding 0 was never written");
    world_free(W);
}

Test(ctl_core, writes_to_shared_pages_fail_as_read_only) {
    world *W = world_std(NULL);
    uint64_t id = std_instance(W, 0, 1, 2, 1);
    one(W, 0, id, 1, OP(EXPORT_KV_PAGES), mk_export(U32(0), 1, "shared", false));
    uint64_t f =
        one(W, 0, id, 1, OP(FORWARD), mk_forward(NULL, 0, 0, U32(0), 1, U32(0), 1, NULL, 0));
    serve_all(W);
    expect_error(W, 0, f, PIE_FAILED_PRECONDITION,
                 "forward: kv page 0 is read-only: it is shared (2 references: exports or other "
                 "instances); copy it first");
    uint64_t c = one(W, 0, id, 1, OP(COPY_KV_PAGE), cp(1, 0, 0, 0, 1));
    serve_all(W);
    expect_error(
        W, 0, c, PIE_FAILED_PRECONDITION,
        "copy_kv_page: kv page 0 is read-only: it is shared (2 references: exports or other "
        "instances); copy it first");
    /* Copying the other way (into the private page) is fine. */
    uint64_t ok = one(W, 0, id, 1, OP(COPY_KV_PAGE), cp(0, 1, 0, 0, 1));
    serve_all(W);
    expect_no_result(W, 0, ok);
    world_free(W);
}

Test(ctl_core, an_id_of_another_model_is_named_as_such) {
    ctl_core_config cfg = base_cfg();
    world *W = world_new(&cfg);
    add_worker(W, "m");
    add_worker(W, "m2");
    add_replica(W);
    uint64_t id = std_instance(W, 0, 1, 1, 1);
    one(W, 0, id, 2, OP(CREATE_QUEUE), mk_create("m2"));
    uint64_t e = one(W, 0, id, 2, OP(NEXT_DIST), mk_dist(U32(0), 1, 0, 0));
    expect_error(W, 0, e, PIE_INVALID_ARGUMENT,
                 "next_dist: embedding 0 belongs to model \"m\", but queue 2 runs model \"m2\"");
    uint64_t a = one(W, 0, id, 2, OP(ALLOC_KV_PAGES), mk_alloc_kv(U32(0), 1));
    expect_error(W, 0, a, PIE_INVALID_ARGUMENT,
                 "alloc_kv_pages: kv page 0 is already allocated in this instance (model \"m\")");
    world_free(W);
}

Test(ctl_core, quotas_from_instance_begin_are_enforced) {
    world *W = world_std(NULL);
    ub b;
    ub_init(&b);
    uint64_t id = inst_id(0, 1);
    ub_begin(&b, id, "m", 3, 2, 1);
    ub_call(W, &b, id, 1, OP(CREATE_QUEUE), mk_create(NULL));
    uint64_t q2 = ub_call(W, &b, id, 2, OP(CREATE_QUEUE), mk_create(NULL));
    ub_call(W, &b, id, 1, OP(ALLOC_KV_PAGES), mk_alloc_kv(U32(0, 1), 2));
    uint64_t kv = ub_call(W, &b, id, 1, OP(ALLOC_KV_PAGES), mk_alloc_kv(U32(2, 3), 2));
    uint64_t emb = ub_call(W, &b, id, 1, OP(ALLOC_EMBEDS), mk_alloc_emb(U32(0, 1, 2), 3));
    send_up(W, 0, &b);
    expect_error(W, 0, q2, PIE_RESOURCE_EXHAUSTED,
                 "create_queue: the instance holds 1 queues, its limit");
    expect_error(W, 0, kv, PIE_RESOURCE_EXHAUSTED,
                 "alloc_kv_pages: 2 more KV pages would exceed the instance's limit of 3 (2 held)");
    expect_error(W, 0, emb, PIE_RESOURCE_EXHAUSTED,
                 "alloc_embeds: 3 more embeddings would exceed the instance's limit of 2 (0 held)");
    /* Freed pages count again. */
    one(W, 0, id, 1, OP(DEALLOC_KV_PAGES), mk_dealloc_kv(U32(0), 1));
    uint64_t ok = one(W, 0, id, 1, OP(ALLOC_KV_PAGES), mk_alloc_kv(U32(2, 3), 2));
    expect_no_result(W, 0, ok);
    world_free(W);
}

Test(ctl_core, export_import_share_pages_and_status_shows_the_references) {
    world *W = world_std(NULL);
    uint64_t a = std_instance(W, 0, 1, 2, 0);
    one(W, 0, a, 1, OP(EXPORT_KV_PAGES), mk_export(U32(0, 1), 2, "prefix", false));
    uint64_t b = std_instance(W, 0, 2, 0, 1);
    uint64_t im = one(W, 0, b, 1, OP(IMPORT_KV_PAGES), mk_import(U32(10, 11, 12), 3, "prefix"));
    Pie__V1__CallResult *r = result_of(W, 0, im);
    cr_assert_not_null(r);
    cr_assert_eq(r->code, 0, "%s", r->message);
    cr_assert_eq(r->payload_case, PIE__V1__CALL_RESULT__PAYLOAD_IMPORTED);
    cr_assert_eq(r->imported->n_kv_page_ids, 2, "the first page_count ids are bound");
    cr_assert_eq(r->imported->kv_page_ids[0], 10);
    cr_assert_eq(r->imported->kv_page_ids[1], 11);
    serve_all(W);
    Pie__V1__ClusterStatusResponse *s = status(W);
    const Pie__V1__WorkerStatus *ws = worker_status(s, 1);
    cr_assert_eq(ws->kv_pages_used, 2, "importing adds references, not pages");
    cr_assert_eq(ws->kv_page_refs, 6, "exporter 2 + export 2 + importer 2");
    cr_assert_eq(ws->kv_pages_shared, 2);
    cr_assert_eq(s->exports, 1);
    protobuf_c_message_free_unpacked(&s->base, NULL);
    /* The importer reads the shared prefix: a forward with it as context is fine. */
    ub u;
    ub_init(&u);
    ub_call(W, &u, b, 1, OP(EMBED_TEXT), mk_embed(U32(0), U32(1), U32(8), 1));
    uint64_t fw = ub_call(W, &u, b, 1, OP(FORWARD),
                          mk_forward(U32(10, 11), 2, 4, U32(0), 1, NULL, 0, U32(0), 1));
    send_up(W, 0, &u);
    serve_all(W);
    expect_no_result(W, 0, fw);
    /* list_exports */
    uint64_t le = one(W, 0, b, 0, OP(LIST_EXPORTS), mk_empty(OP(LIST_EXPORTS)));
    r = result_of(W, 0, le);
    cr_assert_eq(r->exports->n_exports, 1);
    cr_assert_str_eq(r->exports->exports[0]->name, "prefix");
    cr_assert_str_eq(r->exports->exports[0]->model, "m");
    cr_assert_eq(r->exports->exports[0]->page_count, 2);
    cr_assert_eq(r->exports->exports[0]->exporter_instance_id, a);
    /* The exporter ends: its tied export goes, the importer keeps the pages (now its own). */
    ub e;
    ub_init(&e);
    ub_end(&e, a);
    send_up(W, 0, &e);
    serve_all(W);
    s = status(W);
    ws = worker_status(s, 1);
    cr_assert_eq(ws->kv_pages_used, 2);
    cr_assert_eq(ws->kv_page_refs, 2);
    cr_assert_eq(ws->kv_pages_shared, 0);
    cr_assert_eq(s->exports, 0);
    protobuf_c_message_free_unpacked(&s->base, NULL);
    uint64_t w2 = one(W, 0, b, 1, OP(COPY_KV_PAGE), cp(10, 11, 0, 0, 1));
    serve_all(W);
    expect_no_result(W, 0, w2);
    /* And the importer's end frees everything. */
    ub_init(&e);
    ub_end(&e, b);
    send_up(W, 0, &e);
    serve_all(W);
    s = status(W);
    cr_assert_eq(worker_status(s, 1)->kv_pages_used, 0);
    cr_assert_eq(worker_status(s, 1)->embed_slots_used, 0);
    cr_assert_eq(s->instances, 0);
    protobuf_c_message_free_unpacked(&s->base, NULL);
    world_free(W);
}

Test(ctl_core, persistent_exports_outlive_their_exporter_until_anyone_unexports) {
    world *W = world_std(NULL);
    uint64_t a = std_instance(W, 0, 1, 1, 0);
    one(W, 0, a, 1, OP(EXPORT_KV_PAGES), mk_export(U32(0), 1, "keep", true));
    one(W, 0, a, 1, OP(EXPORT_KV_PAGES), mk_export(U32(0), 1, "mine", false));
    uint64_t b = std_instance(W, 0, 2, 0, 0);
    uint64_t u1 = one(W, 0, b, 1, OP(UNEXPORT_KV_PAGES), mk_unexport("mine"));
    char msg[200];
    snprintf(msg, sizeof msg,
             "unexport_kv_pages: export \"mine\" is not persistent: only its exporter (instance "
             "%llu) may remove it",
             (unsigned long long)a);
    expect_error(W, 0, u1, PIE_FAILED_PRECONDITION, msg);
    ub e;
    ub_init(&e);
    ub_end(&e, a);
    send_up(W, 0, &e);
    serve_all(W);
    Pie__V1__ClusterStatusResponse *s = status(W);
    cr_assert_eq(s->exports, 1);
    cr_assert_eq(worker_status(s, 1)->kv_pages_used, 1, "the persistent export holds the page");
    protobuf_c_message_free_unpacked(&s->base, NULL);
    uint64_t u2 = one(W, 0, b, 1, OP(UNEXPORT_KV_PAGES), mk_unexport("keep"));
    serve_all(W);
    expect_no_result(W, 0, u2);
    s = status(W);
    cr_assert_eq(s->exports, 0);
    cr_assert_eq(worker_status(s, 1)->kv_pages_used, 0);
    protobuf_c_message_free_unpacked(&s->base, NULL);
    world_free(W);
}

Test(ctl_core, an_ended_instance_releases_everything_and_its_pending_calls_vanish) {
    world *W = world_std(NULL);
    uint64_t a = std_instance(W, 0, 1, 4, 4);
    serve_all(W);
    /* A step in flight, then more calls queued behind it, then the end in the same message. */
    ub b;
    ub_init(&b);
    ub_call(W, &b, a, 1, OP(EMBED_TEXT), mk_embed(U32(0), U32(1), U32(0), 1));
    uint64_t d = ub_call(W, &b, a, 1, OP(NEXT_DIST), mk_dist(U32(0), 1, 0, 0));
    send_up(W, 0, &b);
    ub_init(&b);
    uint64_t s2 = ub_call(W, &b, a, 1, OP(SYNCHRONIZE), mk_empty(OP(SYNCHRONIZE)));
    ub_end(&b, a);
    send_up(W, 0, &b);
    serve_all(W);
    expect_no_result(W, 0, d);
    expect_no_result(W, 0, s2);
    Pie__V1__ClusterStatusResponse *s = status(W);
    cr_assert_eq(worker_status(s, 1)->kv_pages_used, 0);
    cr_assert_eq(worker_status(s, 1)->embed_slots_used, 0);
    cr_assert_eq(worker_status(s, 1)->instances, 0);
    cr_assert_eq(s->instances, 0);
    protobuf_c_message_free_unpacked(&s->base, NULL);
    /* The worker was told to free the slots (the fake worker checks the slot discipline). */
    for (uint32_t i = 0; i < KV_PAGES; i++)
        cr_assert_eq(W->wk[0].kv_live[i], 0, "kv slot %u live", i);
    /* Calls of the ended instance are dropped without results. */
    uint64_t late = one(W, 0, a, 1, OP(SYNCHRONIZE), mk_empty(OP(SYNCHRONIZE)));
    expect_no_result(W, 0, late);
    world_free(W);
}

Test(ctl_core, contention_terminates_the_newest_later_instance_and_the_others_go_on) {
    world *W = world_std(NULL);
    uint64_t a = std_instance(W, 0, 1, 8, 1);
    uint64_t b = std_instance(W, 0, 2, 4, 1);
    uint64_t c = std_instance(W, 0, 3, 4, 1); /* the pool (16) is full */
    serve_all(W);
    uint64_t more = one(W, 0, a, 1, OP(ALLOC_KV_PAGES), mk_alloc_kv(U32(20, 21), 2));
    serve_all(W);
    expect_no_result(W, 0, more);
    Pie__V1__InstanceTerminated *t = terminated(W, 0, c);
    cr_assert_not_null(t, "the newest instance was not terminated");
    cr_assert_eq(t->status->code, PIE_RESOURCE_EXHAUSTED);
    cr_assert(strstr(t->status->message, "terminated by the system due to resource contention"),
              "%s", t->status->message);
    cr_assert_null(terminated(W, 0, b));
    /* b goes on. */
    ub u;
    ub_init(&u);
    uint64_t d = ub_decode(W, &u, b, 0, 0, 0);
    send_up(W, 0, &u);
    serve_all(W);
    cr_assert_eq(result_of(W, 0, d)->code, 0);
    /* The newest instance itself gets no victim: its own allocation fails. */
    uint64_t nb = one(W, 0, b, 1, OP(ALLOC_KV_PAGES), mk_alloc_kv(U32(30, 31, 32), 3));
    expect_error(W, 0, nb, PIE_RESOURCE_EXHAUSTED,
                 "alloc_kv_pages: 3 KV pages requested, worker g1 has 2 free and instances "
                 "launched after this one hold 0 there");
    cr_assert_null(terminated(W, 0, a));
    world_free(W);
}

/* With tenants, kill_newest let one tenant's old instance end any other tenant's newer ones:
 * bob's growth ended alice's instance although bob held three times her pages. Another
 * tenant's instance is ended only while that tenant holds at least as many pages on the
 * worker as the requester's tenant would after the allocation; the requester's own tenant's
 * later instances go as before (FCFS), and a plan that cannot free enough ends nobody. */
Test(ctl_core, contention_ends_another_tenants_instance_only_when_that_tenant_holds_as_much) {
    world *W = world_std(NULL);
    uint64_t a = tenant_instance(W, 1, 8, "bob");
    uint64_t c = tenant_instance(W, 2, 4, "bob");
    uint64_t b = tenant_instance(W, 3, 4, "alice"); /* the newest; the pool (16) is full */
    serve_all(W);
    /* bob would hold 16, alice holds 4: not her instance, though it is the newest */
    uint64_t big = one(W, 0, a, 1, OP(ALLOC_KV_PAGES), mk_alloc_kv(U32(20, 21, 22, 23, 24), 5));
    expect_error(W, 0, big, PIE_RESOURCE_EXHAUSTED,
                 "alloc_kv_pages: 5 KV pages requested, worker g1 has 0 free and instances "
                 "launched after this one hold 4 there that may be ended (not those of tenants "
                 "holding fewer there than this tenant would)");
    cr_assert_null(terminated(W, 0, c), "a plan that could not free 5 pages ended bob's c");
    uint64_t more = one(W, 0, a, 1, OP(ALLOC_KV_PAGES), mk_alloc_kv(U32(20, 21, 22, 23), 4));
    serve_all(W);
    expect_no_result(W, 0, more);
    cr_assert_null(terminated(W, 0, b), "bob's growth ended alice's instance");
    cr_assert_not_null(terminated(W, 0, c), "bob's own later instance was not ended");
    world_free(W);

    /* alice's growth may end bob's later instance: bob holds 14, alice would hold 6 */
    W = world_std(NULL);
    uint64_t x = tenant_instance(W, 1, 2, "alice");
    uint64_t y = tenant_instance(W, 2, 10, "bob");
    uint64_t z = tenant_instance(W, 3, 4, "bob");
    serve_all(W);
    more = one(W, 0, x, 1, OP(ALLOC_KV_PAGES), mk_alloc_kv(U32(20, 21, 22, 23), 4));
    serve_all(W);
    expect_no_result(W, 0, more);
    cr_assert_not_null(terminated(W, 0, z));
    cr_assert_null(terminated(W, 0, y));
    world_free(W);
}

/* Issue 13: a swap worker (8 pages now, 16 with its host pool full) takes an allocation
 * beyond its effective capacity by spilling — growing the capacity it is told to hold — and
 * nobody is terminated; the worker's CapacityChange then says what it really offers. Beyond
 * kv_pages_max the FCFS kill happens as before. */
Test(ctl_core, contention_spills_to_a_swap_workers_host_pool_before_killing) {
    ctl_core_config cfg = base_cfg();
    world *W = world_new(&cfg);
    add_worker_mem(W, "m", KV_PAGES, 1, 8);
    add_replica(W);
    uint64_t a = std_instance(W, 0, 1, 4, 1);
    uint64_t b = std_instance(W, 0, 2, 2, 1);
    uint64_t c = std_instance(W, 0, 3, 2, 1); /* the effective capacity (8) is full */
    serve_all(W);
    uint64_t more = one(W, 0, a, 1, OP(ALLOC_KV_PAGES), mk_alloc_kv(U32(20, 21), 2));
    serve_all(W);
    expect_no_result(W, 0, more);
    cr_assert_null(terminated(W, 0, b), "b was killed although the host pool had room");
    cr_assert_null(terminated(W, 0, c), "c was killed although the host pool had room");
    Pie__V1__ClusterStatusResponse *s = status(W);
    cr_assert_eq(worker_status(s, 1)->kv_pages_used, 10);
    cr_assert_eq(worker_status(s, 1)->capacity->kv_pages_effective, 10, "grown to hold them");
    protobuf_c_message_free_unpacked(&s->base, NULL);
    /* the new pages work: a decode step of a into page 21 */
    ub u;
    ub_init(&u);
    uint64_t d = ub_decode(W, &u, a, 0, 21, 0);
    send_up(W, 0, &u);
    serve_all(W);
    cr_assert_eq(result_of(W, 0, d)->code, 0);
    /* the worker reports what it moved to (more than asked: whole layers) */
    Pie__V1__CapacityChange cc = PIE__V1__CAPACITY_CHANGE__INIT;
    cc.kv_pages_effective = 12;
    Pie__V1__WorkerUp up = PIE__V1__WORKER_UP__INIT;
    up.capacity = &cc;
    ctl_core_worker_up(W->core, W->wk[0].w, (Pie__V1__WorkerUp *)heap_copy(&up.base), W->now);
    serve_all(W);
    s = status(W);
    cr_assert_eq(worker_status(s, 1)->capacity->kv_pages_effective, 12);
    protobuf_c_message_free_unpacked(&s->base, NULL);
    /* up to kv_pages_max (16) it goes on spilling: b takes 6 more */
    uint64_t mb = one(W, 0, b, 1, OP(ALLOC_KV_PAGES), mk_alloc_kv(U32(30, 31, 32, 33, 34, 35), 6));
    serve_all(W);
    expect_no_result(W, 0, mb);
    cr_assert_null(terminated(W, 0, c));
    s = status(W);
    cr_assert_eq(worker_status(s, 1)->capacity->kv_pages_effective, 16);
    protobuf_c_message_free_unpacked(&s->base, NULL);
    /* the host pool is full too (16 of 16 used): the newest later instance is terminated */
    uint64_t last = one(W, 0, a, 1, OP(ALLOC_KV_PAGES), mk_alloc_kv(U32(22), 1));
    serve_all(W);
    expect_no_result(W, 0, last);
    Pie__V1__InstanceTerminated *t = terminated(W, 0, c);
    cr_assert_not_null(t, "with the host pool full the FCFS kill must happen");
    cr_assert(strstr(t->status->message, "terminated by the system due to resource contention"),
              "%s", t->status->message);
    cr_assert_null(terminated(W, 0, b));
    world_free(W);
}

Test(ctl_core, contention_policy_fail_call_fails_the_allocation_instead) {
    static const struct {
        uint32_t pages, embeds; /* each of the two instances holds these: the pool is full */
        bool kv;                /* the third allocation asks for a KV page, else an embedding */
        const char *err;
    } k[] = {
        {8, 0, true,
         "alloc_kv_pages: 1 KV pages requested, worker g1 has 0 free (contention.policy "
         "fail_call)"},
        {1, 32, false,
         "alloc_embeds: 1 embedding slots requested, worker g1 has 0 free (contention.policy "
         "fail_call)"},
    };
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
        ctl_core_config cfg = base_cfg();
        cfg.contention = CTL_CONTENTION_FAIL_CALL;
        world *W = world_std(&cfg);
        uint64_t a = std_instance(W, 0, 1, k[i].pages, k[i].embeds);
        uint64_t b = std_instance(W, 0, 2, k[i].pages, k[i].embeds);
        serve_all(W);
        uint64_t more = k[i].kv ? one(W, 0, a, 1, OP(ALLOC_KV_PAGES), mk_alloc_kv(U32(20), 1))
                                : one(W, 0, a, 1, OP(ALLOC_EMBEDS), mk_alloc_emb(U32(40), 1));
        expect_error(W, 0, more, PIE_RESOURCE_EXHAUSTED, k[i].err);
        cr_assert_null(terminated(W, 0, b));
        world_free(W);
    }
}

Test(ctl_core, embedding_exhaustion_terminates_the_newest_later_instance_holding_embeddings) {
    world *W = world_std(NULL);
    /* EMB_SLOTS (64) embedding slots: a 24, b 20, c 20 (full); c holds no KV pages, d (newer
     * still) holds pages but no embeddings: only holders of embeddings are victims. */
    uint64_t a = std_instance(W, 0, 1, 2, 24);
    uint64_t b = std_instance(W, 0, 2, 2, 20);
    uint64_t c = std_instance(W, 0, 3, 0, 20);
    uint64_t d = std_instance(W, 0, 4, 2, 0);
    serve_all(W);
    uint64_t more = one(W, 0, a, 1, OP(ALLOC_EMBEDS), mk_alloc_emb(U32(40, 41, 42), 3));
    serve_all(W);
    expect_no_result(W, 0, more);
    Pie__V1__InstanceTerminated *t = terminated(W, 0, c);
    cr_assert_not_null(t, "the newest instance holding embeddings was not terminated");
    cr_assert_eq(t->status->code, PIE_RESOURCE_EXHAUSTED);
    cr_assert(strstr(t->status->message, "terminated by the system due to resource contention") &&
                  strstr(t->status->message, "needed embedding slots on worker g1"),
              "%s", t->status->message);
    cr_assert_null(terminated(W, 0, d), "d holds no embeddings: it must not be a victim");
    cr_assert_null(terminated(W, 0, b));
    Pie__V1__ClusterStatusResponse *s = status(W);
    cr_assert_eq(worker_status(s, 1)->embed_slots_used, 24 + 20 + 3);
    cr_assert_eq(s->instances, 3);
    protobuf_c_message_free_unpacked(&s->base, NULL);
    /* a's new embeddings work: a decode step over them. */
    ub u;
    ub_init(&u);
    uint64_t dist = ub_decode(W, &u, a, 40, 0, 41);
    send_up(W, 0, &u);
    serve_all(W);
    cr_assert_eq(result_of(W, 0, dist)->code, 0, "%s", result_of(W, 0, dist)->message);
    /* The newest holder cannot reclaim from anyone: its own allocation fails. */
    uint64_t nb =
        one(W, 0, b, 1, OP(ALLOC_EMBEDS),
            mk_alloc_emb(
                U32(50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 30, 31, 32, 33), 18));
    expect_error(W, 0, nb, PIE_RESOURCE_EXHAUSTED,
                 "alloc_embeds: 18 embedding slots requested, worker g1 has 17 free and "
                 "instances launched after this one hold 0 there");
    cr_assert_null(terminated(W, 0, a));
    world_free(W);
}

Test(ctl_core, steps_and_result_messages_are_cut_to_fit_max_message) {
    ctl_core_config cfg = base_cfg();
    cfg.max_message_bytes = 2048; /* every message sent is checked against it (check_size) */
    world *W = world_std(&cfg);
    enum { N = 16 };
    uint64_t inst[N], dist[N];
    for (int i = 0; i < N; i++) inst[i] = std_instance(W, 0, (uint64_t)i + 1, 1, 4);
    serve_all(W);
    int before = W->wk[0].link.n;
    /* All in one SessionUp: 16 x (embed_text of 4 tokens + next_dist of 4 embeddings with
     * top_k 8): 64 tokens of embed_text (up to 960 bytes) and 64 distributions (up to 4,608 bytes
     * of worker results, more than 2,048) do not fit in one step. */
    ub b;
    ub_init(&b);
    for (int i = 0; i < N; i++) {
        ub_call(W, &b, inst[i], 1, OP(EMBED_TEXT),
                mk_embed(U32(0, 1, 2, 3), U32(5, 6, 7, 8), U32(0, 1, 2, 3), 4));
        dist[i] = ub_call(W, &b, inst[i], 1, OP(NEXT_DIST), mk_dist(U32(0, 1, 2, 3), 4, 8, 0));
    }
    send_up(W, 0, &b);
    serve_all(W);
    for (int i = 0; i < N; i++) {
        const Pie__V1__CallResult *r = result_of(W, 0, dist[i]);
        cr_assert_eq(r->code, 0, "instance %d: %s", i, r->message);
        cr_assert_eq(r->distributions->n_dists, 4);
        cr_assert_eq(r->distributions->dists[3]->n_token_ids, 1); /* the fake worker's */
    }
    /* Several steps, each under the limit (check_size). */
    int steps = 0;
    for (int k = before; k < W->wk[0].link.n; k++)
        steps += ((const Pie__V1__WorkerDown *)W->wk[0].link.msgs[k])->n_batches > 0;
    cr_assert_geq(steps, 2, "the calls went out in %d step(s) (one without the limit)", steps);
    /* The results reached the replica in several SessionDowns. */
    int downs = 0;
    for (int k = 0; k < W->rl[0].n; k++)
        downs += ((const Pie__V1__SessionDown *)W->rl[0].msgs[k])->n_results > 0;
    cr_assert_geq(downs, 2);
    world_free(W);
}

Test(ctl_core, a_call_that_can_never_fit_in_max_message_fails_with_the_sizes) {
    ctl_core_config cfg = base_cfg();
    cfg.max_message_bytes = 1024;
    world *W = world_std(&cfg);
    uint64_t a = written_instance(W, 0, 1, 1, 8);
    serve_all(W);
    /* 8 distributions of top_k 8: up to 8 x (24 + 72) = 768 bytes of results, more than a
     * 1 KiB message holds next to its framing. */
    uint64_t d = one(W, 0, a, 1, OP(NEXT_DIST), mk_dist(U32(0, 1, 2, 3, 4, 5, 6, 7), 8, 8, 0));
    serve_all(W);
    expect_error(W, 0, d, PIE_INVALID_ARGUMENT,
                 "next_dist: 8 distributions take up to 768 bytes in the worker's result, more "
                 "than server.max_message 1024 allows");
    /* The instance goes on with calls that fit. */
    uint64_t d2 = one(W, 0, a, 1, OP(NEXT_DIST), mk_dist(U32(0), 1, 8, 0));
    serve_all(W);
    cr_assert_eq(result_of(W, 0, d2)->code, 0);
    world_free(W);
}

/* The Drain{shutdown} messages sent on worker i's link so far. */
static int drains_sent(world *W, int i, bool *shutdown) {
    int n = 0;
    for (int k = 0; k < W->wk[i].link.n; k++) {
        const Pie__V1__WorkerDown *d = (const Pie__V1__WorkerDown *)W->wk[i].link.msgs[k];
        if (d->drain) n++, *shutdown = d->drain->shutdown;
    }
    return n;
}

Test(ctl_core,
     a_leaving_worker_gets_no_new_placements_and_is_released_when_its_last_instance_ends) {
    ctl_core_config cfg = base_cfg();
    world *W = world_new(&cfg);
    add_worker(W, "m");
    add_worker(W, "m");
    add_replica(W);
    uint64_t a = std_instance(W, 0, 1, 1, 2); /* g1 (both empty: the lower index) */
    std_instance(W, 0, 2, 4, 0);              /* g2 (g1 holds a page) */
    serve_all(W);
    /* g1 got SIGTERM: WorkerUp.draining. */
    Pie__V1__WorkerUp up = PIE__V1__WORKER_UP__INIT;
    up.draining = true;
    ctl_core_worker_up(W->core, W->wk[0].w, (Pie__V1__WorkerUp *)heap_copy(&up.base), W->now);
    bool shutdown = false;
    cr_assert_eq(drains_sent(W, 0, &shutdown), 0, "g1 was released while an instance is on it");
    /* The next instance goes to g2, though g1 is the less loaded one (1 page against 4). */
    std_instance(W, 0, 3, 1, 0);
    serve_all(W);
    Pie__V1__ClusterStatusResponse *s = status(W);
    cr_assert_eq(worker_status(s, 1)->state, PIE__V1__WORKER_STATE__WORKER_STATE_DRAINING);
    cr_assert_eq(worker_status(s, 1)->instances, 1);
    cr_assert_eq(worker_status(s, 2)->instances, 2, "the new instance was not placed on g2");
    protobuf_c_message_free_unpacked(&s->base, NULL);
    /* The instance on g1 keeps working. */
    ub b;
    ub_init(&b);
    uint64_t d = ub_decode(W, &b, a, 0, 0, 1);
    send_up(W, 0, &b);
    serve_all(W);
    cr_assert_eq(result_of(W, 0, d)->code, 0, "%s", result_of(W, 0, d)->message);
    /* Its end releases g1: Drain{shutdown: true}, once. */
    ub e;
    ub_init(&e);
    ub_end(&e, a);
    send_up(W, 0, &e);
    cr_assert_eq(drains_sent(W, 0, &shutdown), 1, "g1 was not released after its last instance");
    cr_assert(shutdown, "the release is Drain{shutdown: false}");
    cr_assert_eq(drains_sent(W, 1, &shutdown), 0, "g2 was drained");
    world_free(W);
}

Test(ctl_core, a_lost_worker_fails_only_its_instances_and_a_new_one_takes_placements) {
    ctl_core_config cfg = base_cfg();
    world *W = world_new(&cfg);
    add_worker(W, "m");
    add_worker(W, "m");
    add_replica(W);
    uint64_t a = std_instance(W, 0, 1, 4, 1); /* least loaded: both empty → lower index g1 */
    uint64_t b = std_instance(W, 0, 2, 4, 1); /* g1 now holds pages → g2 */
    serve_all(W);
    Pie__V1__ClusterStatusResponse *s = status(W);
    cr_assert_eq(worker_status(s, 1)->instances, 1);
    cr_assert_eq(worker_status(s, 2)->instances, 1);
    protobuf_c_message_free_unpacked(&s->base, NULL);
    /* b has a step in flight on g2 when g1 is lost. */
    ub u;
    ub_init(&u);
    ub_call(W, &u, b, 1, OP(EMBED_TEXT), mk_embed(U32(0), U32(1), U32(0), 1));
    uint64_t d = ub_call(W, &u, b, 1, OP(NEXT_DIST), mk_dist(U32(0), 1, 0, 0));
    ub_call(W, &u, a, 1, OP(EMBED_TEXT), mk_embed(U32(0), U32(1), U32(0), 1));
    uint64_t da = ub_call(W, &u, a, 1, OP(NEXT_DIST), mk_dist(U32(0), 1, 0, 0));
    send_up(W, 0, &u);
    pie_status why;
    pie_status_set(&why, PIE_UNAVAILABLE, "link closed");
    ctl_core_worker_leave(W->core, W->wk[0].w, &why, W->now);
    W->wk[0].w = NULL;
    Pie__V1__InstanceTerminated *t = terminated(W, 0, a);
    cr_assert_not_null(t);
    cr_assert_eq(t->status->code, PIE_UNAVAILABLE);
    cr_assert_str_eq(t->status->message, "worker g1 (m) lost: link closed");
    expect_no_result(W, 0, da);
    cr_assert_null(terminated(W, 0, b));
    bool lost = false, models = false;
    for (int i = 0; i < W->nev[0]; i++) {
        if (W->ev[0][i]->event_case == PIE__V1__SESSION_EVENT__EVENT_WORKER_LOST) {
            lost = true;
            cr_assert_str_eq(W->ev[0][i]->worker_lost->group_id, "g1");
        }
        if (W->ev[0][i]->event_case == PIE__V1__SESSION_EVENT__EVENT_MODELS_CHANGED && lost)
            models = W->ev[0][i]->models_changed->n_models == 1;
    }
    cr_assert(lost && models, "WorkerLost then ModelsChanged (m still served by g2)");
    serve_all(W);
    cr_assert_eq(result_of(W, 0, d)->code, 0, "b finishes on g2");
    /* A third worker joins: empty, so it takes the next placement. */
    add_worker(W, "m");
    uint64_t c = std_instance(W, 0, 3, 1, 0);
    serve_all(W);
    s = status(W);
    cr_assert_eq(worker_of_group(s, "g3")->worker_index, 1, "the freed index is reused");
    cr_assert_eq(worker_of_group(s, "g3")->instances, 1);
    cr_assert_eq(worker_of_group(s, "g3")->kv_pages_used, 1);
    protobuf_c_message_free_unpacked(&s->base, NULL);
    (void)c;
    world_free(W);
}

Test(ctl_core, an_import_places_the_instance_where_the_export_lives) {
    ctl_core_config cfg = base_cfg();
    world *W = world_new(&cfg);
    add_worker(W, "m");
    add_worker(W, "m");
    add_replica(W);
    uint64_t a = std_instance(W, 0, 1, 2, 0); /* g1 */
    uint64_t x = std_instance(W, 0, 2, 1, 0); /* g2 */
    one(W, 0, x, 1, OP(EXPORT_KV_PAGES), mk_export(U32(0), 1, "on-g2", true));
    /* A fresh instance whose first resource call is the import goes to g2, though g2 is the
     * more loaded one. */
    uint64_t n = std_instance(W, 0, 3, 0, 0);
    uint64_t im = one(W, 0, n, 1, OP(IMPORT_KV_PAGES), mk_import(U32(5), 1, "on-g2"));
    cr_assert_eq(result_of(W, 0, im)->code, 0);
    Pie__V1__ClusterStatusResponse *s = status(W);
    cr_assert_eq(worker_status(s, 2)->instances, 2);
    protobuf_c_message_free_unpacked(&s->base, NULL);
    /* a lives on g1: importing from g2 is refused. */
    uint64_t bad = one(W, 0, a, 1, OP(IMPORT_KV_PAGES), mk_import(U32(5), 1, "on-g2"));
    expect_error(W, 0, bad, PIE_FAILED_PRECONDITION,
                 "import_kv_pages: export \"on-g2\" lives on worker g2, but this instance's "
                 "objects of model \"m\" live on worker g1");
    uint64_t few = one(W, 0, n, 1, OP(IMPORT_KV_PAGES), mk_import(NULL, 0, "on-g2"));
    expect_error(W, 0, few, PIE_INVALID_ARGUMENT,
                 "import_kv_pages: 0 kv_page_ids for export \"on-g2\" of 1 pages");
    world_free(W);
}

Test(ctl_core, broadcast_reaches_subscribers_once_per_replica) {
    world *W = world_std(NULL);
    add_replica(W);
    uint64_t a = std_instance(W, 0, 1, 0, 0), b = std_instance(W, 0, 2, 0, 0);
    uint64_t c = std_instance(W, 1, 1, 0, 0);
    static Pie__V1__Subscribe sub;
    pie__v1__subscribe__init(&sub);
    sub.topic = "news";
    one(W, 0, a, 0, OP(SUBSCRIBE), &sub);
    one(W, 0, b, 0, OP(SUBSCRIBE), &sub);
    one(W, 0, b, 0, OP(SUBSCRIBE), &sub); /* idempotent */
    one(W, 1, c, 0, OP(SUBSCRIBE), &sub);
    collect(W, 0);
    collect(W, 1);
    int ev0 = W->nev[0], ev1 = W->nev[1];
    static Pie__V1__Broadcast bc;
    pie__v1__broadcast__init(&bc);
    bc.topic = "news";
    bc.message.data = (uint8_t *)"hi";
    bc.message.len = 2;
    uint64_t bcall = one(W, 1, c, 0, OP(BROADCAST), &bc);
    expect_no_result(W, 1, bcall);
    collect(W, 0);
    collect(W, 1);
    cr_assert_eq(W->nev[0] - ev0, 1);
    cr_assert_eq(W->nev[1] - ev1, 1);
    Pie__V1__TopicDelivery *d0 = W->ev[0][ev0]->delivery;
    cr_assert_str_eq(d0->topic, "news");
    cr_assert_eq(d0->message.len, 2);
    cr_assert_eq(memcmp(d0->message.data, "hi", 2), 0);
    cr_assert_eq(d0->sender_instance_id, c);
    cr_assert_eq(d0->n_instance_ids, 2);
    cr_assert_eq(W->ev[1][ev1]->delivery->n_instance_ids, 1);
    cr_assert_eq(W->ev[1][ev1]->delivery->instance_ids[0], c);
    /* Unsubscribe and end stop deliveries. */
    static Pie__V1__Unsubscribe un;
    pie__v1__unsubscribe__init(&un);
    un.topic = "news";
    one(W, 0, a, 0, OP(UNSUBSCRIBE), &un);
    ub e;
    ub_init(&e);
    ub_end(&e, c);
    send_up(W, 1, &e);
    collect(W, 0);
    collect(W, 1);
    ev0 = W->nev[0];
    ev1 = W->nev[1];
    one(W, 0, b, 0, OP(BROADCAST), &bc);
    collect(W, 0);
    collect(W, 1);
    cr_assert_eq(W->nev[0] - ev0, 1);
    cr_assert_eq(W->ev[0][ev0]->delivery->n_instance_ids, 1);
    cr_assert_eq(W->ev[0][ev0]->delivery->instance_ids[0], b);
    cr_assert_eq(W->nev[1] - ev1, 0);
    world_free(W);
}

Test(ctl_core, high_priority_queues_lead_their_batch) {
    ctl_core_config cfg = base_cfg();
    world *W = world_new(&cfg);
    add_worker_n(W, "m", 0, 0); /* no credit yet: calls accumulate */
    add_replica(W);
    uint64_t a = written_instance(W, 0, 1, 1, 1), b = written_instance(W, 0, 2, 1, 1);
    static Pie__V1__SetQueuePriority hi;
    pie__v1__set_queue_priority__init(&hi);
    hi.priority = PIE__V1__QUEUE_PRIORITY__QUEUE_PRIORITY_HIGH;
    one(W, 0, b, 1, OP(SET_PRIORITY), &hi);
    one(W, 0, a, 1, OP(FORWARD), mk_forward(NULL, 0, 0, U32(0), 1, U32(0), 1, NULL, 0));
    one(W, 0, b, 1, OP(FORWARD), mk_forward(NULL, 0, 0, U32(0), 1, U32(0), 1, NULL, 0));
    cr_assert_eq(W->wk[0].link.n, 1, "nothing sent without a credit");
    Pie__V1__WorkerUp up = PIE__V1__WORKER_UP__INIT;
    up.credits = 1;
    ctl_core_worker_up(W->core, W->wk[0].w, (Pie__V1__WorkerUp *)heap_copy(&up.base), W->now);
    cr_assert_eq(W->wk[0].link.n, 2);
    Pie__V1__WorkerDown *d = (Pie__V1__WorkerDown *)W->wk[0].link.msgs[1];
    cr_assert_eq(d->n_batches, 3, "slots + one embed_text batch + one forward batch");
    Pie__V1__ForwardBatch *fb = d->batches[2]->forward;
    cr_assert_eq(fb->n_items, 2);
    cr_assert_eq(fb->items[0]->owner, b, "the high-priority queue's call comes first");
    cr_assert_eq(fb->items[1]->owner, a);
    world_free(W);
}

Test(ctl_core, a_split_prefill_batches_vertically_but_overlapping_writes_do_not) {
    ctl_core_config cfg = base_cfg();
    world *W = world_new(&cfg);
    add_worker_n(W, "m", 0, 0);
    add_replica(W);
    uint64_t a = written_instance(W, 0, 1, 2, 4);
    ub b;
    ub_init(&b);
    /* Tokens 0-1 into page 0, then tokens 2-3 appended to page 0: one batch. */
    ub_call(W, &b, a, 1, OP(FORWARD), mk_forward(NULL, 0, 0, U32(0, 1), 2, U32(0), 1, NULL, 0));
    ub_call(W, &b, a, 1, OP(FORWARD), mk_forward(U32(0), 1, 2, U32(2, 3), 2, U32(0), 1, U32(3), 1));
    /* Rewriting position 0 of page 0 would change what the others read: next batch. */
    ub_call(W, &b, a, 1, OP(FORWARD), mk_forward(NULL, 0, 0, U32(1), 1, U32(0), 1, NULL, 0));
    send_up(W, 0, &b);
    Pie__V1__WorkerUp up = PIE__V1__WORKER_UP__INIT;
    up.credits = 1;
    ctl_core_worker_up(W->core, W->wk[0].w, (Pie__V1__WorkerUp *)heap_copy(&up.base), W->now);
    Pie__V1__WorkerDown *d = (Pie__V1__WorkerDown *)W->wk[0].link.msgs[1];
    cr_assert_eq(d->n_batches, 4, "slots, embed_text, forward x2, forward x1");
    cr_assert_eq(d->batches[2]->forward->n_items, 2);
    const Pie__V1__ForwardItem *second = d->batches[2]->forward->items[1];
    cr_assert_eq(second->n_kv_slots, 1);
    cr_assert_eq(second->kv_last_page_len, 4);
    cr_assert_eq(d->batches[3]->forward->n_items, 1);
    world_free(W);
}

Test(ctl_core, worker_failures_fail_the_calls_of_the_batch_or_the_item) {
    world *W = world_std(NULL);
    uint64_t a = written_instance(W, 0, 1, 1, 2), b = written_instance(W, 0, 2, 1, 2);
    serve_all(W);
    W->wk[0].fail_kind = PIE__V1__BATCH__KIND_NEXT_DIST;
    W->wk[0].fail_item = 1; /* b's distribution */
    ub u;
    ub_init(&u);
    uint64_t da = ub_call(W, &u, a, 1, OP(NEXT_DIST), mk_dist(U32(0), 1, 0, 0));
    uint64_t db = ub_call(W, &u, b, 1, OP(NEXT_DIST), mk_dist(U32(0), 1, 0, 0));
    send_up(W, 0, &u);
    serve_all(W);
    cr_assert_eq(result_of(W, 0, da)->code, 0);
    expect_error(W, 0, db, PIE_INTERNAL, "worker: injected item failure");
    W->wk[0].fail_kind = PIE__V1__BATCH__KIND_FORWARD;
    W->wk[0].fail_code = PIE_INTERNAL;
    ub_init(&u);
    uint64_t fa =
        ub_call(W, &u, a, 1, OP(FORWARD), mk_forward(NULL, 0, 0, U32(0), 1, U32(0), 1, NULL, 0));
    uint64_t fb =
        ub_call(W, &u, b, 1, OP(FORWARD), mk_forward(NULL, 0, 0, U32(0), 1, U32(0), 1, NULL, 0));
    send_up(W, 0, &u);
    serve_all(W);
    expect_error(W, 0, fa, PIE_INTERNAL, "worker: injected batch failure");
    expect_error(W, 0, fb, PIE_INTERNAL, "worker: injected batch failure");
    world_free(W);
}

Test(ctl_core, protocol_violations_end_the_stream) {
    world *W = world_std(NULL);
    ub b;
    ub_init(&b);
    ub_begin(&b, inst_id(0, 1), "m", 0, 0, 0);
    ub_begin(&b, inst_id(0, 1), "m", 0, 0, 0);
    send_up(W, 0, &b);
    cr_assert(W->rl[0].ended);
    cr_assert_eq(W->rl[0].end_code, PIE_INVALID_ARGUMENT);
    char msg[128];
    snprintf(msg, sizeof msg, "InstanceBegin: instance %llu is already live",
             (unsigned long long)inst_id(0, 1));
    cr_assert_str_eq(W->rl[0].end_msg, msg);
    add_replica(W);
    ub_init(&b);
    ub_begin(&b, inst_id(0, 5), "m", 0, 0, 0); /* replica 2 using replica 1's prefix */
    send_up(W, 1, &b);
    cr_assert(W->rl[1].ended);
    cr_assert_eq(W->rl[1].end_code, PIE_INVALID_ARGUMENT);
    /* A worker answering a batch it never got. */
    Pie__V1__BatchResult br = PIE__V1__BATCH_RESULT__INIT;
    br.batch_id = 77;
    Pie__V1__BatchResult *brp = &br;
    Pie__V1__WorkerUp up = PIE__V1__WORKER_UP__INIT;
    up.results = &brp;
    up.n_results = 1;
    ctl_core_worker_up(W->core, W->wk[0].w, (Pie__V1__WorkerUp *)heap_copy(&up.base), W->now);
    cr_assert(W->wk[0].link.ended);
    cr_assert_str_eq(W->wk[0].link.end_msg,
                     "WorkerLink: result for batch 77, but no batch is outstanding");
    world_free(W);
}

Test(ctl_core, a_registration_that_disagrees_on_the_model_is_refused) {
    ctl_core_config cfg = base_cfg();
    world *W = world_new(&cfg);
    add_worker(W, "m");
    Pie__V1__ModelInfo m = model_info("m");
    m.kv_page_size = 8;
    Pie__V1__WorkerCapacity cap = PIE__V1__WORKER_CAPACITY__INIT;
    cap.kv_pages_max = cap.kv_pages_effective = 4;
    cap.embed_slots = 4;
    cap.max_batch_items = cap.max_batch_tokens = 4;
    Pie__V1__WorkerRegistration reg = PIE__V1__WORKER_REGISTRATION__INIT;
    reg.group_id = "odd";
    reg.version = "pie-c/0.1.0";
    reg.model = &m;
    reg.capacity = &cap;
    reg.tp_size = 1;
    Pie__V1__WorkerUp up = PIE__V1__WORKER_UP__INIT;
    up.registration = &reg;
    flink l = {0};
    pie_status st;
    Pie__V1__WorkerUp *copy = (Pie__V1__WorkerUp *)heap_copy(&up.base);
    cr_assert_null(ctl_core_worker_join(W->core, &l, copy, W->now, &st));
    protobuf_c_message_free_unpacked(&copy->base, NULL);
    cr_assert_eq(st.code, PIE_FAILED_PRECONDITION);
    cr_assert_str_eq(st.msg, "WorkerLink registration: model \"m\" differs from what the linked "
                             "workers serve: kv_page_size 8, not 4");
    reg.group_id = "g1";
    m.kv_page_size = 4;
    copy = (Pie__V1__WorkerUp *)heap_copy(&up.base);
    cr_assert_null(ctl_core_worker_join(W->core, &l, copy, W->now, &st));
    protobuf_c_message_free_unpacked(&copy->base, NULL);
    cr_assert_eq(st.code, PIE_ALREADY_EXISTS);
    world_free(W);
}

Test(ctl_core, destroy_queue_retires_it_and_later_calls_name_it_unknown) {
    world *W = world_std(NULL);
    ub b;
    ub_init(&b);
    uint64_t id = inst_id(0, 1);
    ub_begin(&b, id, "m", 0, 0, 1);
    ub_call(W, &b, id, 1, OP(CREATE_QUEUE), mk_create(NULL));
    ub_call(W, &b, id, 1, OP(DESTROY_QUEUE), mk_empty(OP(DESTROY_QUEUE)));
    uint64_t after = ub_call(W, &b, id, 1, OP(SYNCHRONIZE), mk_empty(OP(SYNCHRONIZE)));
    uint64_t again =
        ub_call(W, &b, id, 1, OP(CREATE_QUEUE), mk_create(NULL)); /* limit 1: room again */
    send_up(W, 0, &b);
    expect_error(W, 0, after, PIE_NOT_FOUND, "synchronize: queue 1 is not found in this instance");
    expect_no_result(W, 0, again);
    world_free(W);
}

Test(ctl_core, calls_of_unknown_instances_are_dropped_silently) {
    world *W = world_std(NULL);
    int before = W->rl[0].n;
    one(W, 0, inst_id(0, 99), 1, OP(SYNCHRONIZE), mk_empty(OP(SYNCHRONIZE)));
    cr_assert_eq(W->rl[0].n, before, "nothing sent");
    world_free(W);
}

Test(ctl_core, k_only_holds_a_lone_call_until_k_timeout_then_tick_fires_it) {
    ctl_core_config cfg = base_cfg();
    cfg.sched.strategy = CTL_STRATEGY_K_ONLY; /* k = 2, k_timeout 5 ms */
    world *W = world_std(&cfg);
    uint64_t a = written_instance(W, 0, 1, 0, 1);
    serve_all(W); /* slot changes alone go out at once; the lone embed_text waits k_timeout */
    W->now += 5000000;
    ctl_core_tick(W->core, W->now);
    serve_all(W);
    uint64_t d = one(W, 0, a, 1, OP(NEXT_DIST), mk_dist(U32(0), 1, 0, 0));
    int sent = W->wk[0].link.n;
    int64_t wake = ctl_core_next_wake(W->core);
    cr_assert_eq(wake, W->now + 5000000);
    cr_assert_eq(ctl_core_tick(W->core, W->now + 4000000), wake, "not yet");
    cr_assert_eq(W->wk[0].link.n, sent);
    ctl_core_tick(W->core, W->now + 5000000);
    cr_assert_eq(W->wk[0].link.n, sent + 1, "fired at k_timeout");
    serve_all(W);
    cr_assert_eq(result_of(W, 0, d)->code, 0);
    world_free(W);
}

Test(ctl_core, work_conserving_forms_the_next_step_near_the_end_of_the_running_one) {
    ctl_core_config cfg = base_cfg();
    world *W = world_new(&cfg);
    add_worker_n(W, "m", 0, 4);
    add_replica(W);
    W->wk[0].exec_us = 1000; /* the first steps hold two batches (slots, embed_text): 2 ms */
    uint64_t a = written_instance(W, 0, 1, 0, 1), b = written_instance(W, 0, 2, 0, 1),
             c = written_instance(W, 0, 3, 0, 1);
    serve_all(W);            /* (the slot steps: 2 ms each, so the average is 2 ms) */
    W->wk[0].exec_us = 2000; /* from now on every batch takes 2 ms on this worker */
    int sent = W->wk[0].link.n;
    one(W, 0, a, 1, OP(NEXT_DIST), mk_dist(U32(0), 1, 0, 0));
    cr_assert_eq(W->wk[0].link.n, sent + 1, "an idle worker gets a step at once");
    /* b arrives while a's step runs: its step is formed 3/4 of a step later (1.5 ms), so
     * that calls arriving meanwhile (c) join it, and it still reaches the worker in time. */
    one(W, 0, b, 1, OP(NEXT_DIST), mk_dist(U32(0), 1, 0, 0));
    cr_assert_eq(W->wk[0].link.n, sent + 1, "the next step was formed at once");
    cr_assert_eq(ctl_core_next_wake(W->core), W->now + 1500000);
    W->now += 1000000;
    one(W, 0, c, 1, OP(NEXT_DIST), mk_dist(U32(0), 1, 0, 0));
    cr_assert_eq(W->wk[0].link.n, sent + 1);
    ctl_core_tick(W->core, W->now + 500000);
    cr_assert_eq(W->wk[0].link.n, sent + 2, "the held step was not sent at its time");
    const Pie__V1__WorkerDown *d = (const Pie__V1__WorkerDown *)W->wk[0].link.msgs[sent + 1];
    cr_assert_eq(d->n_batches, 1);
    cr_assert_eq(d->batches[0]->next_dist->n_items, 2, "b and c travel together");
    serve_all(W);
    collect(W, 0);
    cr_assert_eq(W->nres[0], 3);
    world_free(W);
}

Test(ctl_core, work_conserving_times_a_queued_step_from_when_it_started_not_when_it_was_sent) {
    ctl_core_config cfg = base_cfg();
    world *W = world_new(&cfg);
    add_worker_n(W, "m", 0, 4);
    add_replica(W);
    W->wk[0].exec_us = 1000; /* the first steps hold two batches (slots, embed_text): 2 ms */
    uint64_t a = written_instance(W, 0, 1, 0, 1), b = written_instance(W, 0, 2, 0, 1),
             c = written_instance(W, 0, 3, 0, 1);
    serve_all(W);
    W->wk[0].exec_us = 2000; /* from now on every batch takes 2 ms on this worker */
    int sent = W->wk[0].link.n;
    one(W, 0, a, 1, OP(NEXT_DIST), mk_dist(U32(0), 1, 0, 0)); /* a runs from t = 0 */
    one(W, 0, b, 1, OP(NEXT_DIST), mk_dist(U32(0), 1, 0, 0));
    int64_t t0 = W->now;
    ctl_core_tick(W->core, t0 + 1500000); /* b's step is sent and queues behind a's */
    cr_assert_eq(W->wk[0].link.n, sent + 2);
    W->now = t0 + 2000000; /* a's step ends: b's starts now, not when it was sent */
    cr_assert_eq(serve_n(W, 0, 1), 1);
    W->now = t0 + 2100000;
    one(W, 0, c, 1, OP(NEXT_DIST), mk_dist(U32(0), 1, 0, 0));
    cr_assert_eq(W->wk[0].link.n, sent + 2, "c was sent at once, not with the next step");
    cr_assert_eq(ctl_core_next_wake(W->core), t0 + 2000000 + 1500000,
                 "the step after b's is formed 3/4 of a step after b's step started");
    serve_all(W);
    collect(W, 0);
    cr_assert_eq(W->nres[0], 3);
    world_free(W);
}

Test(ctl_core, eager_sends_each_call_in_its_own_batch) {
    ctl_core_config cfg = base_cfg();
    cfg.sched.strategy = CTL_STRATEGY_EAGER;
    world *W = world_new(&cfg);
    add_worker_n(W, "m", 0, 0);
    add_replica(W);
    uint64_t a = written_instance(W, 0, 1, 0, 1), b = written_instance(W, 0, 2, 0, 1);
    one(W, 0, a, 1, OP(NEXT_DIST), mk_dist(U32(0), 1, 0, 0));
    one(W, 0, b, 1, OP(NEXT_DIST), mk_dist(U32(0), 1, 0, 0));
    Pie__V1__WorkerUp up = PIE__V1__WORKER_UP__INIT;
    up.credits = 1;
    ctl_core_worker_up(W->core, W->wk[0].w, (Pie__V1__WorkerUp *)heap_copy(&up.base), W->now);
    Pie__V1__WorkerDown *d = (Pie__V1__WorkerDown *)W->wk[0].link.msgs[1];
    cr_assert_eq(d->n_batches, 5, "slots + two single-call embed_text and next_dist batches each");
    for (size_t i = 1; i < 5; i++) {
        const Pie__V1__Batch *bt = d->batches[i];
        cr_assert_eq(bt->kind_case == PIE__V1__BATCH__KIND_NEXT_DIST
                         ? bt->next_dist->n_items
                         : bt->embed_text->n_embed_slots,
                     1, "batch %zu holds one call", i);
    }
    world_free(W);
}

Test(ctl_core, a_silent_worker_is_ended_after_three_heartbeats) {
    ctl_core_config cfg = base_cfg();
    world *W = world_new(&cfg);
    add_worker(W, "m");
    /* Silence counts only once the worker has reported stats. */
    ctl_core_tick(W->core, W->now + 10000000000);
    cr_assert(!W->wk[0].link.ended);
    Pie__V1__WorkerStats stats = PIE__V1__WORKER_STATS__INIT;
    Pie__V1__WorkerUp up = PIE__V1__WORKER_UP__INIT;
    up.stats = &stats;
    ctl_core_worker_up(W->core, W->wk[0].w, (Pie__V1__WorkerUp *)heap_copy(&up.base), W->now);
    ctl_core_tick(W->core, W->now + 2999000000);
    cr_assert(!W->wk[0].link.ended);
    ctl_core_tick(W->core, W->now + 3000000000);
    cr_assert(W->wk[0].link.ended);
    cr_assert_eq(W->wk[0].link.end_code, PIE_UNAVAILABLE);
    world_free(W);
}

Test(ctl_core, many_instances_churn_without_leaking_slots) {
    world *W = world_std(NULL);
    for (uint64_t round = 0; round < 50; round++) {
        uint64_t a = std_instance(W, 0, 100 + round, 3, 2);
        ub b;
        ub_init(&b);
        ub_call(W, &b, a, 1, OP(EMBED_TEXT), mk_embed(U32(0, 1), U32(1, 2), U32(0, 1), 2));
        ub_call(W, &b, a, 1, OP(FORWARD),
                mk_forward(NULL, 0, 0, U32(0, 1), 2, U32(0), 1, U32(1), 1));
        ub_call(W, &b, a, 1, OP(NEXT_DIST), mk_dist(U32(1), 1, 0, 0));
        ub_call(W, &b, a, 1, OP(DEALLOC_KV_PAGES), mk_dealloc_kv(U32(2), 1));
        if (round % 2) ub_end(&b, a);
        send_up(W, 0, &b);
        if (round % 3 == 0) serve_all(W);
        if (round % 2 == 0) {
            ub e;
            ub_init(&e);
            ub_end(&e, a);
            send_up(W, 0, &e);
        }
    }
    serve_all(W);
    Pie__V1__ClusterStatusResponse *s = status(W);
    cr_assert_eq(s->instances, 0);
    cr_assert_eq(worker_status(s, 1)->kv_pages_used, 0);
    cr_assert_eq(worker_status(s, 1)->embed_slots_used, 0);
    cr_assert_eq(worker_status(s, 1)->batches_in_flight, 0);
    protobuf_c_message_free_unpacked(&s->base, NULL);
    world_free(W);
}

Test(ctl_core, work_conserving_keeps_one_step_queued_behind_the_running_one_others_use_credits) {
    for (int strat = 0; strat < 2; strat++) {
        ctl_core_config cfg = base_cfg();
        cfg.sched.strategy = strat ? CTL_STRATEGY_K_ONLY : CTL_STRATEGY_WORK_CONSERVING;
        cfg.sched.k = 1;
        world *W = world_new(&cfg);
        add_worker_n(W, "m", 0, 4); /* the worker accepts 4 steps at once */
        add_replica(W);
        uint64_t a = written_instance(W, 0, 1, 0, 1), b = written_instance(W, 0, 2, 0, 1),
                 c = written_instance(W, 0, 3, 0, 1);
        serve_all(W); /* the slot changes are answered: the worker is idle */
        int before = W->wk[0].link.n;
        one(W, 0, a, 1, OP(NEXT_DIST), mk_dist(U32(0), 1, 0, 0));
        cr_assert_eq(W->wk[0].link.n, before + 1, "an idle worker gets a step at once");
        one(W, 0, b, 1, OP(NEXT_DIST), mk_dist(U32(0), 1, 0, 0));
        cr_assert_eq(W->wk[0].link.n, before + 2,
                     "a step waits on the worker behind the running one, so it never idles");
        one(W, 0, c, 1, OP(NEXT_DIST), mk_dist(U32(0), 1, 0, 0));
        if (strat == 0)
            cr_assert_eq(W->wk[0].link.n, before + 2,
                         "work_conserving: one step running, one queued: c waits");
        else
            cr_assert_eq(W->wk[0].link.n, before + 3,
                         "k_only: a step per call, credits permitting");
        serve_all(W);
        collect(W, 0);
        cr_assert_eq(W->nres[0], 3);
        world_free(W);
    }
}

/* A tensor-parallel group registers its ranks (issue 14): ClusterStatus lists them; a list
 * that does not name every rank in order is refused. */
Test(ctl_core, a_group_registers_its_ranks_and_cluster_status_lists_them) {
    ctl_core_config cfg = base_cfg();
    world *W = world_new(&cfg);
    Pie__V1__ModelInfo m = model_info("m");
    Pie__V1__WorkerCapacity cap = PIE__V1__WORKER_CAPACITY__INIT;
    cap.kv_pages_max = cap.kv_pages_effective = 4;
    cap.embed_slots = 4;
    cap.max_batch_items = cap.max_batch_tokens = 4;
    Pie__V1__TpRank r0 = PIE__V1__TP_RANK__INIT, r1 = PIE__V1__TP_RANK__INIT;
    r0.rank = 0, r0.device = "cpu: 1 threads", r0.host = "node-a", r0.pid = 100;
    r1.rank = 1, r1.device = "cpu: 1 threads", r1.host = "node-b", r1.pid = 200;
    Pie__V1__TpRank *ranks[2] = {&r1, &r0}; /* out of order first */
    Pie__V1__WorkerRegistration reg = PIE__V1__WORKER_REGISTRATION__INIT;
    reg.group_id = "grp";
    reg.version = "pie-c/0.1.0";
    reg.model = &m;
    reg.capacity = &cap;
    reg.tp_size = 2;
    reg.n_ranks = 2;
    reg.ranks = ranks;
    Pie__V1__WorkerUp up = PIE__V1__WORKER_UP__INIT;
    up.registration = &reg;
    fworker *f = &W->wk[W->nw++]; /* world_free frees what the core sends it */
    f->link.worker = true;
    f->fail_item = -1;
    f->kv_pages = 4;
    flink *l = &f->link;
    pie_status st;
    Pie__V1__WorkerUp *copy = (Pie__V1__WorkerUp *)heap_copy(&up.base);
    cr_assert_null(ctl_core_worker_join(W->core, l, copy, W->now, &st));
    protobuf_c_message_free_unpacked(&copy->base, NULL);
    cr_assert_eq(st.code, PIE_INVALID_ARGUMENT);
    cr_assert_str_eq(st.msg, "WorkerLink registration: ranks[0] is rank 1 (the list must be in "
                             "rank order)");
    reg.n_ranks = 1; /* one rank of two */
    ranks[0] = &r0;
    copy = (Pie__V1__WorkerUp *)heap_copy(&up.base);
    cr_assert_null(ctl_core_worker_join(W->core, l, copy, W->now, &st));
    protobuf_c_message_free_unpacked(&copy->base, NULL);
    cr_assert_eq(st.code, PIE_INVALID_ARGUMENT);
    cr_assert_str_eq(st.msg, "WorkerLink registration: ranks lists 1 ranks for tp_size 2 (it "
                             "must list all or none)");
    reg.n_ranks = 2;
    ranks[1] = &r1;
    f->w = ctl_core_worker_join(W->core, l, (Pie__V1__WorkerUp *)heap_copy(&up.base), W->now,
                                &st);
    cr_assert_not_null(f->w, "%s", st.msg);
    Pie__V1__ClusterStatusResponse *s = status(W);
    const Pie__V1__WorkerStatus *ws = worker_of_group(s, "grp");
    cr_assert_eq(ws->tp_size, 2);
    cr_assert_eq(ws->n_ranks, 2);
    for (uint32_t i = 0; i < 2; i++) {
        const Pie__V1__TpRank *want = i ? &r1 : &r0, *got = ws->ranks[i];
        cr_expect_eq(got->rank, i);
        cr_expect_str_eq(got->device, want->device);
        cr_expect_str_eq(got->host, want->host);
        cr_expect_eq(got->pid, want->pid);
    }
    protobuf_c_message_free_unpacked(&s->base, NULL);
    world_free(W);
}

/* ---- deferral (ItemResult.deferred: the worker did not run an item; offer it again) ------- */

/* The unread steps of worker i, oldest first (n ← how many). */
static Pie__V1__WorkerDown *unread_step(world *W, int i, int k) {
    fworker *f = &W->wk[i];
    cr_assert_lt(f->link.read + k, f->link.n, "worker %d has no unread step %d", i, k);
    return (Pie__V1__WorkerDown *)f->link.msgs[f->link.read + k];
}

/* The batch of a kind in step d, or NULL. */
static const Pie__V1__Batch *batch_of(const Pie__V1__WorkerDown *d, Pie__V1__Batch__KindCase k) {
    for (size_t i = 0; i < d->n_batches; i++)
        if (d->batches[i]->kind_case == k) return d->batches[i];
    return NULL;
}

/* The deferral tests' common start: world_deferring(1) with a written instance (2 KV pages,
 * 4 embeddings), its setup served, then worker 0 set to defer the forwards of its next `steps`
 * steps (defer_forwards): what the test sends next is what gets deferred. *inst ← the instance. */
static world *world_deferring_forwards(int steps, uint64_t *inst) {
    world *W = world_deferring(1);
    *inst = written_instance(W, 0, 1, 2, 4);
    serve_all(W);
    defer_forwards(W, steps);
    return W;
}

Test(ctl_core, a_deferred_call_goes_back_first_and_results_keep_issue_order) {
    uint64_t a;
    world *W = world_deferring_forwards(1, &a);
    ub b;
    ub_init(&b);
    uint64_t dist = ub_decode(W, &b, a, 0, 0, 1);
    uint64_t sync = ub_call(W, &b, a, 1, OP(SYNCHRONIZE), mk_empty(OP(SYNCHRONIZE)));
    send_up(W, 0, &b);
    const Pie__V1__WorkerDown *d1 = unread_step(W, 0, 0);
    const Pie__V1__Batch *e1 = batch_of(d1, PIE__V1__BATCH__KIND_EMBED_TEXT);
    cr_assert_not_null(e1);
    cr_assert_eq(e1->embed_text->n_call_items, 1, "call_items go to a worker that may defer");
    cr_assert_eq(e1->embed_text->call_items[0], 1);
    cr_assert_not_null(batch_of(d1, PIE__V1__BATCH__KIND_NEXT_DIST), "one step for the decode");
    const Pie__V1__ForwardItem *f1 = batch_of(d1, PIE__V1__BATCH__KIND_FORWARD)->forward->items[0];
    serve_n(W, 0, 1);
    cr_assert_eq(W->wk[0].deferred_items, 2, "the forward and the next_dist reading its output");
    expect_no_result(W, 0, dist);
    expect_no_result(W, 0, sync);
    /* the next step offers the forward again, then its next_dist; the embed_text ran */
    const Pie__V1__WorkerDown *d2 = unread_step(W, 0, 0);
    cr_assert_null(batch_of(d2, PIE__V1__BATCH__KIND_EMBED_TEXT), "the embed_text is not rerun");
    const Pie__V1__Batch *fw = batch_of(d2, PIE__V1__BATCH__KIND_FORWARD);
    const Pie__V1__Batch *nd = batch_of(d2, PIE__V1__BATCH__KIND_NEXT_DIST);
    cr_assert(fw && nd && fw->batch_id < nd->batch_id, "forward, then next_dist");
    cr_assert_eq(fw->forward->n_items, 1);
    cr_assert_eq(fw->forward->items[0]->kv_slots[0], f1->kv_slots[0], "the same forward");
    cr_assert_eq(fw->forward->items[0]->output_embed_slots[0], f1->output_embed_slots[0]);
    serve_all(W);
    collect(W, 0);
    cr_assert_eq(W->nres[0], 2);
    cr_assert_eq(W->res[0][0]->call_id, dist, "issue order: the distribution first");
    cr_assert_eq(W->res[0][0]->code, 0);
    cr_assert_eq(W->res[0][0]->distributions->dists[0]->token_ids[0], f1->output_embed_slots[0]);
    cr_assert_eq(W->res[0][1]->call_id, sync);
    world_free(W);
}

/* A call of the queue done after one the worker deferred waits for it in the completion FIFO;
 * a next_dist there runs again instead (its distributions live in the WorkerUp). */
Test(ctl_core, calls_done_behind_a_deferred_one_wait_for_it_and_a_next_dist_runs_again) {
    uint64_t a;
    world *W = world_deferring_forwards(1, &a);
    ub b;
    ub_init(&b);
    /* the forward writes embedding 1 (deferred); the next_dist reads embedding 2 (written) */
    ub_call(W, &b, a, 1, OP(FORWARD), mk_forward(NULL, 0, 0, U32(0), 1, U32(0), 1, U32(1), 1));
    uint64_t dist = ub_call(W, &b, a, 1, OP(NEXT_DIST), mk_dist(U32(2), 1, 0, 0));
    uint64_t sync = ub_call(W, &b, a, 1, OP(SYNCHRONIZE), mk_empty(OP(SYNCHRONIZE)));
    send_up(W, 0, &b);
    serve_n(W, 0, 1);
    cr_assert_eq(W->wk[0].deferred_items, 1, "only the forward was deferred");
    expect_no_result(W, 0, dist);
    expect_no_result(W, 0, sync);
    const Pie__V1__WorkerDown *d2 = unread_step(W, 0, 0);
    cr_assert_not_null(batch_of(d2, PIE__V1__BATCH__KIND_FORWARD));
    cr_assert_not_null(batch_of(d2, PIE__V1__BATCH__KIND_NEXT_DIST), "the next_dist runs again");
    serve_all(W);
    collect(W, 0);
    cr_assert_eq(W->nres[0], 2);
    cr_assert_eq(W->res[0][0]->call_id, dist);
    cr_assert_eq(W->res[0][0]->code, 0);
    cr_assert_eq(W->res[0][1]->call_id, sync);
    world_free(W);
}

/* While a step holding a queue's calls is out, none of its calls joins another step and its
 * controller calls wait: a dealloc of the page a deferred forward writes is applied only after
 * that forward ran. Other queues go on meanwhile. */
Test(ctl_core, a_queue_with_a_step_out_waits_for_it_and_its_dealloc_follows_the_deferred_call) {
    world *W = world_deferring(2);
    uint64_t a = written_instance(W, 0, 1, 2, 4), c = written_instance(W, 0, 2, 1, 2);
    serve_all(W);
    defer_forwards(W, 1);
    int before = W->wk[0].link.n;
    one(W, 0, a, 1, OP(FORWARD), mk_forward(NULL, 0, 0, U32(0), 1, U32(1), 1, U32(1), 1));
    cr_assert_eq(W->wk[0].link.n, before + 1, "step 1: a's forward");
    ub b;
    ub_init(&b);
    uint64_t a2 = ub_call(W, &b, a, 1, OP(NEXT_DIST), mk_dist(U32(2), 1, 0, 0));
    uint64_t dealloc = ub_call(W, &b, a, 1, OP(DEALLOC_KV_PAGES), mk_dealloc_kv(U32(1), 1));
    uint64_t cd = ub_call(W, &b, c, 1, OP(NEXT_DIST), mk_dist(U32(0), 1, 0, 0));
    send_up(W, 0, &b);
    cr_assert_eq(W->wk[0].link.n, before + 2, "step 2, while step 1 runs");
    const Pie__V1__WorkerDown *d2 = unread_step(W, 0, 1);
    cr_assert_null(batch_of(d2, PIE__V1__BATCH__KIND_SLOTS), "the dealloc waits");
    const Pie__V1__Batch *nd = batch_of(d2, PIE__V1__BATCH__KIND_NEXT_DIST);
    cr_assert(nd && nd->next_dist->n_items == 1, "only c's next_dist: a's queue is held");
    serve_n(W, 0, 2); /* step 1 defers a's forward; step 2 runs c's next_dist */
    cr_assert_eq(result_of(W, 0, cd)->code, 0);
    expect_no_result(W, 0, a2);
    const Pie__V1__WorkerDown *d3 = unread_step(W, 0, 0);
    cr_assert_null(batch_of(d3, PIE__V1__BATCH__KIND_SLOTS), "the dealloc still waits");
    cr_assert_not_null(batch_of(d3, PIE__V1__BATCH__KIND_FORWARD), "the forward again");
    const Pie__V1__Batch *nd3 = batch_of(d3, PIE__V1__BATCH__KIND_NEXT_DIST);
    cr_assert(nd3 && nd3->batch_id > batch_of(d3, PIE__V1__BATCH__KIND_FORWARD)->batch_id,
              "then a's next_dist");
    serve_n(W, 0, 1);
    const Pie__V1__WorkerDown *d4 = unread_step(W, 0, 0);
    const Pie__V1__Batch *sb = batch_of(d4, PIE__V1__BATCH__KIND_SLOTS);
    cr_assert(sb && sb->slots->n_free_kv_slots == 1, "the dealloc, once the forward ran");
    serve_all(W);
    cr_assert_eq(result_of(W, 0, a2)->code, 0);
    expect_no_result(W, 0, dealloc);
    Pie__V1__ClusterStatusResponse *s = status(W);
    cr_assert_eq(worker_status(s, 1)->batches_in_flight, 0);
    protobuf_c_message_free_unpacked(&s->base, NULL);
    world_free(W);
}

Test(ctl_core, a_call_deferred_more_than_64_times_fails_and_the_queue_goes_on) {
    uint64_t a;
    world *W = world_deferring_forwards(-1, &a); /* a worker that never runs it */
    ub b;
    ub_init(&b);
    uint64_t fwd =
        ub_call(W, &b, a, 1, OP(FORWARD), mk_forward(NULL, 0, 0, U32(0), 1, U32(0), 1, NULL, 0));
    uint64_t sync = ub_call(W, &b, a, 1, OP(SYNCHRONIZE), mk_empty(OP(SYNCHRONIZE)));
    send_up(W, 0, &b);
    int steps = serve_n(W, 0, 1000);
    cr_assert_eq(steps, 65, "offered 65 times");
    cr_assert_eq(W->wk[0].deferred_items, 65);
    expect_error(W, 0, fwd, PIE_INTERNAL,
                 "forward: worker g1 deferred this call 65 times without running it (a worker "
                 "runs a deferred call within a few steps); giving up");
    cr_assert_eq(result_of(W, 0, sync)->code, 0);
    /* the queue serves on */
    W->wk[0].defer_steps = 0;
    uint64_t d = one(W, 0, a, 1, OP(NEXT_DIST), mk_dist(U32(2), 1, 0, 0));
    serve_all(W);
    cr_assert_eq(result_of(W, 0, d)->code, 0);
    world_free(W);
}

Test(ctl_core, deferrals_from_a_worker_that_did_not_offer_them_end_its_link) {
    world *W = world_std(NULL);
    uint64_t a = written_instance(W, 0, 1, 2, 4);
    serve_all(W);
    defer_forwards(W, 1);
    one(W, 0, a, 1, OP(FORWARD), mk_forward(NULL, 0, 0, U32(0), 1, U32(0), 1, NULL, 0));
    serve_n(W, 0, 1);
    cr_assert(W->wk[0].link.ended);
    cr_assert_eq(W->wk[0].link.end_code, PIE_INVALID_ARGUMENT);
    cr_assert(strstr(W->wk[0].link.end_msg, "did not say may_defer") != NULL, "%s",
              W->wk[0].link.end_msg);
    world_free(W);
}

Test(ctl_core, a_call_deferred_in_part_fails_internal) {
    world *W = world_deferring(1);
    uint64_t a = written_instance(W, 0, 1, 1, 4);
    serve_all(W);
    W->wk[0].defer_partial = true;
    uint64_t d = one(W, 0, a, 1, OP(NEXT_DIST), mk_dist(U32(0, 1), 2, 0, 0));
    serve_all(W);
    expect_error(W, 0, d, PIE_INTERNAL,
                 "next_dist: worker g1 deferred 1 of the call's 2 items (it must defer a call "
                 "whole)");
    world_free(W);
}

/* On a worker that may defer, a controller call behind a call in flight waits for its result
 * (a dealloc must not free a page a deferred forward writes), but synchronize does not (it
 * retires in order anyway): the SDK's embed, forward, synchronize, next_dist stay one step. */
Test(ctl_core, a_synchronize_keeps_a_decode_in_one_step_but_a_dealloc_waits_for_the_results) {
    world *W = world_deferring(1);
    uint64_t a = written_instance(W, 0, 1, 2, 4);
    serve_all(W);
    ub b;
    ub_init(&b);
    ub_call(W, &b, a, 1, OP(EMBED_TEXT), mk_embed(U32(0), U32(1), U32(0), 1));
    ub_call(W, &b, a, 1, OP(FORWARD), mk_forward(NULL, 0, 0, U32(0), 1, U32(0), 1, U32(1), 1));
    uint64_t sync = ub_call(W, &b, a, 1, OP(SYNCHRONIZE), mk_empty(OP(SYNCHRONIZE)));
    uint64_t dist = ub_call(W, &b, a, 1, OP(NEXT_DIST), mk_dist(U32(1), 1, 0, 0));
    ub_call(W, &b, a, 1, OP(DEALLOC_KV_PAGES), mk_dealloc_kv(U32(1), 1));
    send_up(W, 0, &b);
    const Pie__V1__WorkerDown *d1 = unread_step(W, 0, 0);
    cr_assert_not_null(batch_of(d1, PIE__V1__BATCH__KIND_FORWARD));
    cr_assert_not_null(batch_of(d1, PIE__V1__BATCH__KIND_NEXT_DIST), "the decode is one step");
    const Pie__V1__Batch *sb = batch_of(d1, PIE__V1__BATCH__KIND_SLOTS);
    cr_assert(sb == NULL || sb->slots->n_free_kv_slots == 0, "the dealloc waits for the results");
    serve_n(W, 0, 1);
    const Pie__V1__WorkerDown *d2 = unread_step(W, 0, 0);
    sb = batch_of(d2, PIE__V1__BATCH__KIND_SLOTS);
    cr_assert(sb && sb->slots->n_free_kv_slots == 1, "then the dealloc goes out");
    serve_all(W);
    collect(W, 0);
    cr_assert_eq(W->nres[0], 2);
    cr_assert_eq(W->res[0][0]->call_id, sync);
    cr_assert_eq(W->res[0][1]->call_id, dist);
    world_free(W);
}
