/* ctl_core.c — the control layer's state machine: lifecycle replicas and their instances, API
 * calls in, results and events out.
 *
 * Owns: replicas (join, leave, outbox), instances (InstanceBegin, InstanceEnd, termination:
 * everything an instance holds is released however it ends), command queues' lifetimes
 * (create, destroy, priorities), the arrival of calls (each is routed: queue-less calls run at
 * once, queue calls join their queue) and their retirement (results in issue order per queue),
 * the end of every entry (dispatch to the workers, one SessionDown per replica, freeing what
 * died), ClusterStatus.
 * Does not own: what a call does (ctl_exec.c), worker groups and placement (ctl_place.c).
 * Entry points are in ctl_core.h; the caller serialises them (ctl_cluster.c's mutex). */
#include "ctl_core_int.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pie_log.h"

const char *const ctl_contention_names[] = {"kill_newest", "fail_call", NULL};

#define CTL_VERSION "pie-c/0.1.0"

static uint64_t unix_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void free_msg(void *m) {
    if (m) protobuf_c_message_free_unpacked((ProtobufCMessage *)m, NULL);
}

/* ---- entry bracket --------------------------------------------------------------------------- */

static void enter(ctl_core *c, int64_t now_ns) {
    if (c->depth++ == 0) c->now_ns = now_ns;
}

/* Results per SessionDown at most: a replica's outbox can hold the results of thousands of
 * instances; smaller messages let the replica start on the first results sooner. Events ride
 * in the last message. Messages are also cut by bytes (server.max_message). */
#define CTL_DOWN_MAX_RESULTS 1024u

/* Bytes a varint-length-delimited field of n body bytes takes: tag, length, body. */
static size_t field_bytes(size_t n) {
    size_t len = 1;
    for (size_t v = n; v >= 0x80; v >>= 7) len++;
    return 1 + len + n;
}

/* An upper bound of the bytes a CallResult adds to a SessionDown, without walking the
 * distributions entry by entry (this runs for every result): ids and call ids 11 bytes each,
 * a distribution entry at most 5 (id) + 4 (probability) bytes plus its list headers. */
static size_t result_bytes(const Pie__V1__CallResult *r) {
    size_t n = 11 + 11 + 6 + (r->message ? field_bytes(strlen(r->message)) : 0);
    switch (r->payload_case) {
    case PIE__V1__CALL_RESULT__PAYLOAD_DISTRIBUTIONS: {
        size_t d = 0;
        for (size_t i = 0; i < r->distributions->n_dists; i++) {
            const Pie__V1__Distribution *x = r->distributions->dists[i];
            d += 6 + 6 + 6 + 5 * x->n_token_ids + 4 * x->n_probs;
        }
        n += 6 + 6 + d;
        break;
    }
    case PIE__V1__CALL_RESULT__PAYLOAD_IMPORTED: n += 12 + 5 * r->imported->n_kv_page_ids; break;
    case PIE__V1__CALL_RESULT__PAYLOAD_EXPORTS:
        n += protobuf_c_message_get_packed_size(&r->exports->base) + 6;
        break;
    default: n += 6; break;
    }
    return field_bytes(n);
}

/* Sends the outbox: results in order, as many per SessionDown as fit (in count and bytes),
 * events in the last message (in as many more as they need). A single result or event larger
 * than the limit is sent alone (gRPC then fails it; the lifecycle never produces one: its own
 * limits on message sizes are smaller). */
static void flush_replica(ctl_core *c, ctl_replica *r) {
    Pie__V1__CallResult **rp = r->n_res ? ctl_arena_alloc(&r->arena, r->n_res * sizeof *rp) : NULL;
    Pie__V1__SessionEvent **ep = r->n_ev ? ctl_arena_alloc(&r->arena, r->n_ev * sizeof *ep) : NULL;
    if ((r->n_res && rp == NULL) || (r->n_ev && ep == NULL)) {
        pie_log_error("ctl.outbox.oom", "replica_index=%u results=%u events=%u", r->index, r->n_res,
                      r->n_ev);
    } else {
        for (uint32_t i = 0; i < r->n_res; i++) rp[i] = &r->res[i];
        for (uint32_t i = 0; i < r->n_ev; i++) ep[i] = &r->ev[i];
        const size_t budget = ctl_msg_budget(c);
        uint32_t at = 0, ev_at = 0;
        do {
            Pie__V1__SessionDown down = PIE__V1__SESSION_DOWN__INIT;
            size_t bytes = 0;
            uint32_t n = 0;
            while (at + n < r->n_res && n < CTL_DOWN_MAX_RESULTS) {
                size_t b = result_bytes(rp[at + n]);
                if (n > 0 && bytes + b > budget) break;
                bytes += b;
                n++;
            }
            down.n_results = n;
            down.results = n ? rp + at : NULL;
            at += n;
            if (at == r->n_res) {
                uint32_t m = 0;
                while (ev_at + m < r->n_ev) {
                    size_t b =
                        field_bytes(protobuf_c_message_get_packed_size(&ep[ev_at + m]->base));
                    if ((n > 0 || m > 0) && bytes + b > budget) break;
                    bytes += b;
                    m++;
                }
                down.n_events = m;
                down.events = m ? ep + ev_at : NULL;
                ev_at += m;
            }
            c->sink.to_replica(c->sink.user, r->link, &down);
        } while (at < r->n_res || ev_at < r->n_ev);
    }
    r->n_res = r->n_ev = 0;
    ctl_arena_reset(&r->arena);
}

static void inst_free(ctl_inst *inst);
static void queue_free(ctl_core *c, ctl_queue *q);

/* Ends an entry: at the outermost level, dispatch to every worker that can take work, send
 * each replica its SessionDown, free what died. */
static void leave(ctl_core *c) {
    if (--c->depth != 0) return;
    for (ctl_worker *w = c->workers; w; w = w->next) {
        if (w->credits && (ctl_sched_waiting(&w->sched) || ctl_pool_has_changes(&w->pool)))
            ctl_exec_dispatch(c, w); /* it decides whether the strategy lets it send */
        else
            w->hold_ns = 0; /* nothing waits: nothing to hold */
    }
    while (c->dirty) {
        ctl_replica *r = c->dirty;
        c->dirty = r->dirty_next;
        r->dirty = false;
        r->dirty_next = NULL;
        flush_replica(c, r);
    }
    for (size_t i = 0; i < c->grave_queues.n; i++) queue_free(c, c->grave_queues.v[i]);
    c->grave_queues.n = 0;
    while (c->grave) {
        ctl_inst *inst = c->grave;
        c->grave = inst->grave_next;
        inst_free(inst);
    }
    if (c->m_instances) pie_gauge_set(c->m_instances, (double)c->n_insts);
    if (c->m_workers) {
        size_t nw = 0, nr = 0;
        for (ctl_worker *w = c->workers; w; w = w->next) nw++;
        for (ctl_replica *r = c->replicas; r; r = r->next) nr++;
        pie_gauge_set(c->m_workers, (double)nw);
        pie_gauge_set(c->m_replicas, (double)nr);
    }
}

void ctl_core_enter(ctl_core *c, int64_t now_ns) { enter(c, now_ns); }
void ctl_core_leave(ctl_core *c) { leave(c); }

/* ---- outbox -------------------------------------------------------------------------------- */

static void mark_dirty(ctl_core *c, ctl_replica *r) {
    if (r->dirty) return;
    r->dirty = true;
    r->dirty_next = c->dirty;
    c->dirty = r;
}

Pie__V1__CallResult *ctl_core_result(ctl_core *c, ctl_replica *r, uint64_t instance_id,
                                     uint64_t call_id, uint32_t code, const char *msg) {
    if (r->n_res == r->cap_res) {
        uint32_t cap = r->cap_res ? r->cap_res * 2 : 64;
        Pie__V1__CallResult *p = realloc(r->res, cap * sizeof *p);
        if (p == NULL) return NULL;
        /* Payload pointers point into the arena, never into res: moving res is safe. */
        r->res = p;
        r->cap_res = cap;
    }
    Pie__V1__CallResult *res = &r->res[r->n_res];
    pie__v1__call_result__init(res);
    res->instance_id = instance_id;
    res->call_id = call_id;
    res->code = code;
    if (code != 0 && msg) {
        char *m = ctl_arena_strdup(&r->arena, msg);
        if (m) res->message = m;
    }
    r->n_res++;
    mark_dirty(c, r);
    return res;
}

Pie__V1__SessionEvent *ctl_core_event(ctl_core *c, ctl_replica *r) {
    if (r->n_ev == r->cap_ev) {
        uint32_t cap = r->cap_ev ? r->cap_ev * 2 : 16;
        Pie__V1__SessionEvent *p = realloc(r->ev, cap * sizeof *p);
        if (p == NULL) return NULL;
        r->ev = p;
        r->cap_ev = cap;
    }
    Pie__V1__SessionEvent *e = &r->ev[r->n_ev++];
    pie__v1__session_event__init(e);
    mark_dirty(c, r);
    return e;
}

/* Result of a call that has no call record (queue-less calls, unknown queues). */
static void fail_now(ctl_core *c, ctl_inst *inst, const Pie__V1__ApiCall *api, pie_code code,
                     const char *fmt, ...) __attribute__((format(printf, 5, 6)));
static void fail_now(ctl_core *c, ctl_inst *inst, const Pie__V1__ApiCall *api, pie_code code,
                     const char *fmt, ...) {
    char msg[PIE_STATUS_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    ctl_core_result(c, inst->rep, inst->id, api->call_id, code, msg);
}

static int cmp_model_info(const void *a, const void *b) {
    return strcmp((*(Pie__V1__ModelInfo *const *)a)->name, (*(Pie__V1__ModelInfo *const *)b)->name);
}

/* Fills mc with the served models (array from arena). */
static bool fill_models(ctl_core *c, ctl_arena *a, Pie__V1__ModelsChanged *mc) {
    pie__v1__models_changed__init(mc);
    Pie__V1__ModelInfo **v = ctl_arena_alloc(a, (c->n_models ? c->n_models : 1) * sizeof *v);
    if (v == NULL) return false;
    size_t n = 0;
    for (uint32_t i = 0; i < c->n_models; i++)
        if (c->models[i].workers) v[n++] = c->models[i].info;
    qsort(v, n, sizeof *v, cmp_model_info);
    mc->models = v;
    mc->n_models = n;
    return true;
}

void ctl_core_announce_models(ctl_core *c, ctl_replica *to, const Pie__V1__SessionEvent *extra) {
    for (ctl_replica *r = c->replicas; r; r = r->next) {
        if (to && r != to) continue;
        if (extra) {
            Pie__V1__SessionEvent *e = ctl_core_event(c, r);
            if (e) *e = *extra;
        }
        Pie__V1__ModelsChanged *mc = ctl_arena_alloc(&r->arena, sizeof *mc);
        Pie__V1__SessionEvent *e = mc ? ctl_core_event(c, r) : NULL;
        if (e == NULL || !fill_models(c, &r->arena, mc)) {
            if (e) r->n_ev--;
            pie_log_error("ctl.models.oom", "replica_index=%u", r->index);
            continue;
        }
        e->event_case = PIE__V1__SESSION_EVENT__EVENT_MODELS_CHANGED;
        e->models_changed = mc;
    }
}

void ctl_core_program_dropped(ctl_core *c, const char *program_id, const char *tenant,
                              int64_t now_ns) {
    enter(c, now_ns);
    for (ctl_replica *r = c->replicas; r; r = r->next) {
        Pie__V1__ProgramDropped *pd = ctl_arena_alloc(&r->arena, sizeof *pd);
        char *id = pd ? ctl_arena_strdup(&r->arena, program_id) : NULL;
        char *who = id && tenant[0] ? ctl_arena_strdup(&r->arena, tenant) : NULL;
        Pie__V1__SessionEvent *e = id && (who || !tenant[0]) ? ctl_core_event(c, r) : NULL;
        if (e == NULL) {
            pie_log_error("ctl.program_dropped.oom", "replica_index=%u", r->index);
            continue;
        }
        pie__v1__program_dropped__init(pd);
        pd->program_id = id;
        if (who) pd->tenant = who;
        e->event_case = PIE__V1__SESSION_EVENT__EVENT_PROGRAM_DROPPED;
        e->program_dropped = pd;
    }
    leave(c);
}

/* ---- calls ----------------------------------------------------------------------------------- */

void ctl_core_call_free(ctl_core *c, ctl_call *call) {
    free(call->err);
    free(call->out_ids);
    ctl_msg *m = call->msg;
    if (m && --m->refs == 0) {
        free_msg(m->up);
        ctl_slab_put(&c->s_msgs, m);
    }
    ctl_slab_put(&c->s_calls, call);
}

/* Puts a retired call's result (if it has one) in the outbox. */
static void emit(ctl_core *c, ctl_inst *inst, ctl_call *call) {
    const Pie__V1__ApiCall *api = call->api;
    ctl_replica *r = inst->rep;
    if (call->code != 0) {
        ctl_core_result(c, r, inst->id, api->call_id, call->code,
                        call->err ? call->err : "controller: out of memory");
        return;
    }
    switch (api->op_case) {
    case PIE__V1__API_CALL__OP_SYNCHRONIZE: {
        Pie__V1__SyncDone *sd = ctl_arena_alloc(&r->arena, sizeof *sd);
        Pie__V1__CallResult *res =
            sd ? ctl_core_result(c, r, inst->id, api->call_id, 0, NULL) : NULL;
        if (res == NULL) break;
        pie__v1__sync_done__init(sd);
        res->payload_case = PIE__V1__CALL_RESULT__PAYLOAD_SYNCED;
        res->synced = sd;
        return;
    }
    case PIE__V1__API_CALL__OP_IMPORT_KV_PAGES: {
        Pie__V1__ImportedKvPages *ip = ctl_arena_alloc(&r->arena, sizeof *ip);
        uint32_t *ids = ctl_arena_alloc(&r->arena, (call->n_out_ids + 1) * sizeof *ids);
        Pie__V1__CallResult *res =
            ip && ids ? ctl_core_result(c, r, inst->id, api->call_id, 0, NULL) : NULL;
        if (res == NULL) break;
        pie__v1__imported_kv_pages__init(ip);
        memcpy(ids, call->out_ids, call->n_out_ids * sizeof *ids);
        ip->kv_page_ids = ids;
        ip->n_kv_page_ids = call->n_out_ids;
        res->payload_case = PIE__V1__CALL_RESULT__PAYLOAD_IMPORTED;
        res->imported = ip;
        return;
    }
    case PIE__V1__API_CALL__OP_NEXT_DIST: {
        Pie__V1__DistributionList *dl = ctl_arena_alloc(&r->arena, sizeof *dl);
        Pie__V1__Distribution **d = ctl_arena_alloc(&r->arena, (call->n_items + 1) * sizeof *d);
        Pie__V1__CallResult *res =
            dl && d ? ctl_core_result(c, r, inst->id, api->call_id, 0, NULL) : NULL;
        if (res == NULL) break;
        pie__v1__distribution_list__init(dl);
        /* The distributions stay in the WorkerUp being processed until the outbox is sent. */
        for (uint32_t i = 0; i < call->n_items; i++) d[i] = call->items[i]->distribution;
        dl->dists = d;
        dl->n_dists = call->n_items;
        res->payload_case = PIE__V1__CALL_RESULT__PAYLOAD_DISTRIBUTIONS;
        res->distributions = dl;
        return;
    }
    default: return; /* succeeded, returns no data */
    }
    ctl_core_result(c, r, inst->id, api->call_id, PIE_RESOURCE_EXHAUSTED,
                    "controller: out of memory building the result");
}

void ctl_core_completed(ctl_core *c, ctl_call *call) {
    ctl_queue *q = call->q;
    if (q == NULL) { /* orphaned: its instance ended while it was in flight */
        ctl_core_call_free(c, call);
        return;
    }
    ctl_call *r;
    while ((r = ctl_queue_retire(q)) != NULL) {
        bool destroy = r->api->op_case == PIE__V1__API_CALL__OP_DESTROY_QUEUE;
        emit(c, q->inst, r);
        ctl_core_call_free(c, r);
        if (destroy && ctl_queue_empty(q) && !q->dead) {
            /* Retire the queue object: detached already, nothing follows its destroy. */
            ctl_inst *inst = q->inst;
            for (uint32_t i = 0; i < inst->n_all; i++) {
                if (inst->all[i] == q) {
                    inst->all[i] = inst->all[--inst->n_all];
                    break;
                }
            }
            q->dead = true;
            if (ctl_vecp_push(&c->grave_queues, q) != 0)
                queue_free(c, q); /* nothing refers to it */
            return;
        }
    }
}

/* The scheduler q is ready in, if any, loses it. */
static void unready(ctl_queue *q) {
    if (q->sched) ctl_sched_unready(q->sched, &q->sq);
    q->sched = NULL;
}

void ctl_core_advance(ctl_core *c, ctl_queue *q) {
    ctl_call *call;
    while (!q->dead && (call = ctl_queue_head(q)) != NULL) {
        /* Deferral (ctl_exec.c): a queue with calls in a step sent to a worker that may defer
         * them waits for that step's results; a controller call (but synchronize) also waits
         * for calls taken into the step being formed (a deferred call runs again before it). */
        if (q->held || ctl_exec_ctrl_waits(q, call)) {
            unready(q);
            return;
        }
        if (call->kind == CTL_KIND_CTRL) {
            unready(q);
            ctl_queue_take(q);
            switch (call->api->op_case) {
            case PIE__V1__API_CALL__OP_SYNCHRONIZE:
                ctl_queue_done(call, 0, NULL);
                call->has_result = true;
                break;
            case PIE__V1__API_CALL__OP_DESTROY_QUEUE: ctl_queue_done(call, 0, NULL); break;
            default: ctl_exec_ctrl(c, q, call); break;
            }
            ctl_core_completed(c, call);
            continue;
        }
        if (q->place == NULL) q->place = ctl_place_of(q->inst, q->model);
        if (q->place == NULL) {
            unready(q);
            ctl_queue_take(q);
            ctl_exec_fail_unplaced(c, q, call);
            ctl_core_completed(c, call);
            continue;
        }
        ctl_sched *s = &q->place->w->sched;
        if (q->sched && q->sched != s) unready(q);
        ctl_sched_ready(s, &q->sq, call->kind, call->seq, call->t_ns);
        q->sched = s;
        return;
    }
    if (!q->dead) unready(q);
}

/* ---- queues -------------------------------------------------------------------------------- */

static void queue_free(ctl_core *c, ctl_queue *q) { ctl_slab_put(&c->s_queues, q); }

/* The attached queue id of inst, or NULL. */
static ctl_queue *queue_get(const ctl_inst *inst, uint32_t id) {
    uint32_t idx;
    if (!ctl_map32_get(&inst->qids, id, &idx)) return NULL;
    return inst->qv[idx];
}

static const char *op_name(int op) {
    switch (op) {
    case PIE__V1__API_CALL__OP_CREATE_QUEUE: return "create_queue";
    case PIE__V1__API_CALL__OP_DESTROY_QUEUE: return "destroy_queue";
    case PIE__V1__API_CALL__OP_SET_PRIORITY: return "set_priority";
    case PIE__V1__API_CALL__OP_SYNCHRONIZE: return "synchronize";
    case PIE__V1__API_CALL__OP_ALLOC_KV_PAGES: return "alloc_kv_pages";
    case PIE__V1__API_CALL__OP_DEALLOC_KV_PAGES: return "dealloc_kv_pages";
    case PIE__V1__API_CALL__OP_ALLOC_EMBEDS: return "alloc_embeds";
    case PIE__V1__API_CALL__OP_DEALLOC_EMBEDS: return "dealloc_embeds";
    case PIE__V1__API_CALL__OP_COPY_KV_PAGE: return "copy_kv_page";
    case PIE__V1__API_CALL__OP_MASK_KV_PAGE: return "mask_kv_page";
    case PIE__V1__API_CALL__OP_EXPORT_KV_PAGES: return "export_kv_pages";
    case PIE__V1__API_CALL__OP_UNEXPORT_KV_PAGES: return "unexport_kv_pages";
    case PIE__V1__API_CALL__OP_IMPORT_KV_PAGES: return "import_kv_pages";
    case PIE__V1__API_CALL__OP_LIST_EXPORTS: return "list_exports";
    case PIE__V1__API_CALL__OP_EMBED_TEXT: return "embed_text";
    case PIE__V1__API_CALL__OP_FORWARD: return "forward";
    case PIE__V1__API_CALL__OP_NEXT_DIST: return "next_dist";
    case PIE__V1__API_CALL__OP_BROADCAST: return "broadcast";
    case PIE__V1__API_CALL__OP_SUBSCRIBE: return "subscribe";
    case PIE__V1__API_CALL__OP_UNSUBSCRIBE: return "unsubscribe";
    default: return "call";
    }
}

static int op_kind(int op) {
    switch (op) {
    case PIE__V1__API_CALL__OP_EMBED_TEXT: return CTL_KIND_EMBED;
    case PIE__V1__API_CALL__OP_FORWARD: return CTL_KIND_FORWARD;
    case PIE__V1__API_CALL__OP_MASK_KV_PAGE: return CTL_KIND_MASK;
    case PIE__V1__API_CALL__OP_COPY_KV_PAGE: return CTL_KIND_COPY;
    case PIE__V1__API_CALL__OP_NEXT_DIST: return CTL_KIND_DIST;
    default: return CTL_KIND_CTRL;
    }
}

static void create_queue(ctl_core *c, ctl_inst *inst, const Pie__V1__ApiCall *api) {
    uint32_t id = api->queue_id;
    if (id == 0) {
        fail_now(c, inst, api, PIE_INVALID_ARGUMENT, "create_queue: queue id 0 is reserved");
        return;
    }
    if (queue_get(inst, id)) {
        fail_now(c, inst, api, PIE_ALREADY_EXISTS, "create_queue: queue %u already exists", id);
        return;
    }
    if (inst->lim_queues && inst->n_queues >= inst->lim_queues) {
        fail_now(c, inst, api, PIE_RESOURCE_EXHAUSTED,
                 "create_queue: the instance holds %u queues, its limit", inst->n_queues);
        return;
    }
    const char *name = api->create_queue->model;
    if (name == NULL || name[0] == '\0') name = inst->model;
    uint32_t model = ctl_place_model(c, name);
    if (model == UINT32_MAX || !ctl_place_served(c, model)) {
        fail_now(c, inst, api, PIE_NOT_FOUND, "create_queue: model \"%s\" is not served", name);
        return;
    }
    ctl_queue *q = ctl_slab_get(&c->s_queues);
    uint32_t idx = inst->qfree.n ? inst->qfree.v[inst->qfree.n - 1] : inst->n_qv;
    bool grow_qv = idx == inst->n_qv && inst->n_qv == inst->cap_qv;
    bool grow_all = inst->n_all == inst->cap_all;
    if (q && grow_qv) {
        uint32_t cap = inst->cap_qv ? inst->cap_qv * 2 : 4;
        ctl_queue **v = realloc(inst->qv, cap * sizeof *v);
        if (v) {
            inst->qv = v;
            inst->cap_qv = cap;
            grow_qv = false;
        }
    }
    if (q && grow_all) {
        uint32_t cap = inst->cap_all ? inst->cap_all * 2 : 4;
        ctl_queue **v = realloc(inst->all, cap * sizeof *v);
        if (v) {
            inst->all = v;
            inst->cap_all = cap;
            grow_all = false;
        }
    }
    if (q == NULL || grow_qv || grow_all || ctl_map32_put(&inst->qids, id, idx) != 0) {
        ctl_slab_put(&c->s_queues, q);
        fail_now(c, inst, api, PIE_RESOURCE_EXHAUSTED, "create_queue: controller out of memory");
        return;
    }
    ctl_queue_init(q, id, model, inst);
    q->vindex = idx;
    if (idx == inst->n_qv)
        inst->n_qv++;
    else
        inst->qfree.n--;
    inst->qv[idx] = q;
    inst->all[inst->n_all++] = q;
    inst->n_queues++;
}

static void detach_queue(ctl_inst *inst, ctl_queue *q) {
    ctl_map32_del(&inst->qids, q->id, NULL);
    inst->qv[q->vindex] = NULL;
    if (ctl_vec32_push(&inst->qfree, q->vindex) != 0 && q->vindex + 1 == inst->n_qv) inst->n_qv--;
    q->detached = true;
    inst->n_queues--;
}

/* A queue call: a record on its queue. */
static void enqueue(ctl_core *c, ctl_inst *inst, ctl_queue *q, ctl_msg *m,
                    const Pie__V1__ApiCall *api, int64_t now_ns) {
    ctl_call *call = ctl_slab_get(&c->s_calls);
    if (call == NULL) {
        fail_now(c, inst, api, PIE_RESOURCE_EXHAUSTED, "%s: controller out of memory",
                 op_name(api->op_case));
        return;
    }
    memset(call, 0, sizeof *call);
    call->api = api;
    call->msg = m;
    m->refs++;
    call->seq = ++c->seq;
    call->t_ns = now_ns;
    call->kind = (int8_t)op_kind(api->op_case);
    bool was_idle = ctl_queue_head(q) == NULL;
    ctl_queue_push(q, call);
    if (was_idle) ctl_core_advance(c, q);
}

static void call_in(ctl_core *c, ctl_replica *r, ctl_msg *m, const Pie__V1__ApiCall *api,
                    int64_t now_ns) {
    ctl_inst *inst = pie_map64_get(&c->insts, api->instance_id);
    if (inst == NULL || inst->rep != r || inst->dead) return; /* not live: dropped */
    switch (api->op_case) {
    case PIE__V1__API_CALL__OP_LIST_EXPORTS:
    case PIE__V1__API_CALL__OP_BROADCAST:
    case PIE__V1__API_CALL__OP_SUBSCRIBE:
    case PIE__V1__API_CALL__OP_UNSUBSCRIBE: ctl_exec_queueless(c, inst, api); return;
    case PIE__V1__API_CALL__OP_CREATE_QUEUE: create_queue(c, inst, api); return;
    case PIE__V1__API_CALL__OP_SET_PRIORITY:
    case PIE__V1__API_CALL__OP_DESTROY_QUEUE:
    case PIE__V1__API_CALL__OP_SYNCHRONIZE:
    case PIE__V1__API_CALL__OP_ALLOC_KV_PAGES:
    case PIE__V1__API_CALL__OP_DEALLOC_KV_PAGES:
    case PIE__V1__API_CALL__OP_ALLOC_EMBEDS:
    case PIE__V1__API_CALL__OP_DEALLOC_EMBEDS:
    case PIE__V1__API_CALL__OP_COPY_KV_PAGE:
    case PIE__V1__API_CALL__OP_MASK_KV_PAGE:
    case PIE__V1__API_CALL__OP_EXPORT_KV_PAGES:
    case PIE__V1__API_CALL__OP_UNEXPORT_KV_PAGES:
    case PIE__V1__API_CALL__OP_IMPORT_KV_PAGES:
    case PIE__V1__API_CALL__OP_EMBED_TEXT:
    case PIE__V1__API_CALL__OP_FORWARD:
    case PIE__V1__API_CALL__OP_NEXT_DIST: break;
    default:
        fail_now(c, inst, api, PIE_UNIMPLEMENTED,
                 "call %llu: no op set, or an op this controller does not know",
                 (unsigned long long)api->call_id);
        return;
    }
    const char *op = op_name(api->op_case);
    ctl_queue *q = api->queue_id ? queue_get(inst, api->queue_id) : NULL;
    if (q == NULL) {
        fail_now(c, inst, api, PIE_NOT_FOUND, "%s: queue %u is not found in this instance", op,
                 api->queue_id);
        return;
    }
    if (api->op_case == PIE__V1__API_CALL__OP_SET_PRIORITY) {
        int p = (int)api->set_priority->priority;
        if (p != PIE__V1__QUEUE_PRIORITY__QUEUE_PRIORITY_NORMAL &&
            p != PIE__V1__QUEUE_PRIORITY__QUEUE_PRIORITY_LOW &&
            p != PIE__V1__QUEUE_PRIORITY__QUEUE_PRIORITY_HIGH) {
            fail_now(c, inst, api, PIE_INVALID_ARGUMENT,
                     "set_priority: priority %d is not a QueuePriority", p);
            return;
        }
        q->sq.rank = ctl_queue_rank(p);
        return;
    }
    if (api->op_case == PIE__V1__API_CALL__OP_DESTROY_QUEUE) detach_queue(inst, q);
    enqueue(c, inst, q, m, api, now_ns);
}

/* ---- instances ----------------------------------------------------------------------------- */

static void inst_free(ctl_inst *inst) {
    free(inst->model);
    free(inst->program_id);
    free(inst);
}

/* Drops every call of q: pending, deferred and retired-pending calls are freed, calls in flight
 * are orphaned (their batch frees them). */
static void queue_drop_calls(ctl_core *c, ctl_queue *q) {
    ctl_call *call = q->pend;
    while (call) {
        ctl_call *next = call->next;
        ctl_core_call_free(c, call);
        call = next;
    }
    call = q->fifo;
    while (call) {
        ctl_call *next = call->next;
        if (call->state == CTL_CALL_INFLIGHT) {
            call->q = NULL;
            call->next = NULL;
        } else {
            ctl_core_call_free(c, call);
        }
        call = next;
    }
    q->pend = q->pend_tail = q->fifo = q->fifo_tail = q->redo = NULL;
    q->n_pend = q->n_fifo = q->n_inflight = 0;
}

/* Everything an instance holds is released; it is freed at the end of the entry. */
static void end_instance(ctl_core *c, ctl_inst *inst) {
    if (inst->dead) return;
    inst->dead = true;
    pie_map64_del(&c->insts, inst->id);
    c->n_insts--;
    ctl_replica *r = inst->rep;
    if (inst->rep_prev)
        inst->rep_prev->rep_next = inst->rep_next;
    else
        r->insts = inst->rep_next;
    if (inst->rep_next) inst->rep_next->rep_prev = inst->rep_prev;
    r->n_insts--;
    for (uint32_t i = 0; i < inst->n_all; i++) {
        ctl_queue *q = inst->all[i];
        unready(q);
        queue_drop_calls(c, q);
        q->dead = true;
        if (ctl_vecp_push(&c->grave_queues, q) != 0 && !q->in_settle) queue_free(c, q);
    }
    free(inst->all);
    inst->all = NULL;
    inst->n_all = 0;
    free(inst->qv);
    inst->qv = NULL;
    ctl_map32_free(&inst->qids);
    ctl_vec32_free(&inst->qfree);
    while (inst->places) {
        ctl_place *p = inst->places;
        inst->places = p->inst_next;
        ctl_place_release(c, p);
    }
    if (inst->n_tied_exports) ctl_exports_drop_tied(&c->exports, inst->id);
    ctl_inst_kv_add(inst, -(int64_t)inst->n_kv);
    if (inst->counted && inst->tenant->n_insts) inst->tenant->n_insts--;
    ctl_pubsub_drop(&c->ps, &inst->subs);
    inst->grave_next = c->grave;
    c->grave = inst;
}

void ctl_core_terminate(ctl_core *c, ctl_inst *inst, pie_code code, const char *msg) {
    if (inst->dead) return;
    ctl_replica *r = inst->rep;
    Pie__V1__InstanceTerminated *it = ctl_arena_alloc(&r->arena, sizeof *it);
    Pie__V1__Status *s = ctl_arena_alloc(&r->arena, sizeof *s);
    char *m = ctl_arena_strdup(&r->arena, msg);
    Pie__V1__SessionEvent *e = it && s && m ? ctl_core_event(c, r) : NULL;
    if (e) {
        pie__v1__instance_terminated__init(it);
        pie__v1__status__init(s);
        s->code = code;
        s->message = m;
        it->instance_id = inst->id;
        it->status = s;
        e->event_case = PIE__V1__SESSION_EVENT__EVENT_INSTANCE_TERMINATED;
        e->instance_terminated = it;
    }
    pie_log_info("ctl.instance.terminated", "instance=%llu code=%s reason=\"%s\"",
                 (unsigned long long)inst->id, pie_code_name((int)code), msg);
    if (c->m_terminated) pie_counter_add(c->m_terminated, 1);
    end_instance(c, inst);
}

/* ---- tenants --------------------------------------------------------------------------------- */

/* The tenant an InstanceBegin names (made on first sight), its quotas refreshed from it; NULL
 * when out of memory. No tenant: the anonymous one without quotas. */
static ctl_tenant *tenant_of(ctl_core *c, const Pie__V1__Tenant *bt) {
    const char *name = bt && bt->name && bt->name[0] ? bt->name : PIE_TENANT_ANONYMOUS;
    ctl_tenant *t = ctl_mapstr_get(&c->tenants, name);
    if (t == NULL) {
        if (strlen(name) > PIE_TENANT_NAME_MAX || (t = calloc(1, sizeof *t)) == NULL) return NULL;
        snprintf(t->name, sizeof t->name, "%s", name);
        if (ctl_mapstr_put(&c->tenants, t->name, t) != 0) {
            free(t);
            return NULL;
        }
    }
    t->q_insts = bt ? bt->instances : 0;
    t->q_kv = bt ? bt->kv_pages : 0;
    t->q_export = bt ? bt->export_pages : 0;
    return t;
}

pie_code ctl_tenant_quota(const char *op, const ctl_tenant *t, const char *quota, uint32_t limit,
                          uint32_t held, uint32_t n, pie_status *st) {
    if (t == NULL || limit == 0 || (uint64_t)held + n <= limit) return PIE_OK;
    return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                          "%s: tenant \"%s\" quota %s (%u) reached: %u held, %u more requested", op,
                          t->name, quota, limit, held, n);
}

uint32_t ctl_tenant_export_quota(const ctl_core *c, const ctl_tenant *t) {
    return t && t->q_export ? t->q_export : c->cfg.export_max_pages;
}

static void tenants_free(ctl_core *c) {
    for (size_t i = 0; i < c->tenants.cap; i++)
        if (c->tenants.cells[i].key) free(c->tenants.cells[i].val);
    ctl_mapstr_free(&c->tenants);
}

/* Instances of t that up ends (its ends are processed after its begins and calls). */
static uint32_t ending_in(const ctl_core *c, const ctl_replica *r, const Pie__V1__SessionUp *up,
                          const ctl_tenant *t) {
    uint32_t n = 0;
    for (size_t i = 0; i < up->n_ends; i++) {
        const ctl_inst *inst = pie_map64_get(&c->insts, up->ends[i]->instance_id);
        n += inst && inst->rep == r && inst->tenant == t && inst->counted;
    }
    return n;
}

/* InstanceBegin b of up; false on a protocol violation (st set). */
static bool begin_instance(ctl_core *c, ctl_replica *r, const Pie__V1__SessionUp *up,
                           const Pie__V1__InstanceBegin *b, pie_status *st) {
    uint64_t id = b->instance_id;
    if ((id >> 48) != r->index || (id & 0xFFFFFFFFFFFFull) == 0) {
        pie_status_set(st, PIE_INVALID_ARGUMENT,
                       "InstanceBegin: instance id %llu must carry replica index %u in its high "
                       "16 bits and a non-zero low part",
                       (unsigned long long)id, r->index);
        return false;
    }
    if (pie_map64_get(&c->insts, id)) {
        pie_status_set(st, PIE_INVALID_ARGUMENT, "InstanceBegin: instance %llu is already live",
                       (unsigned long long)id);
        return false;
    }
    ctl_inst *inst = calloc(1, sizeof *inst);
    if (inst) {
        inst->model = strdup(b->model ? b->model : "");
        inst->program_id = strdup(b->program_id ? b->program_id : "");
    }
    if (inst == NULL || !inst->model || !inst->program_id ||
        pie_map64_put(&c->insts, id, inst) != 0) {
        if (inst) inst_free(inst);
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "controller: out of memory");
        return false;
    }
    inst->id = id;
    inst->rep = r;
    inst->launch = ++c->launch;
    inst->tenant = tenant_of(c, b->tenant);
    if (inst->tenant == NULL) {
        pie_map64_del(&c->insts, id);
        inst_free(inst);
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "controller: out of memory");
        return false;
    }
    if (b->limits) {
        inst->lim_kv = b->limits->kv_pages;
        inst->lim_emb = b->limits->embeddings;
        inst->lim_queues = b->limits->queues;
    }
    inst->rep_next = r->insts;
    if (r->insts) r->insts->rep_prev = inst;
    r->insts = inst;
    r->n_insts++;
    c->n_insts++;
    /* Over the tenant's instance quota: it ends at once (the replica reports it to the client);
     * not a protocol violation, the replica could not know the cluster-wide count. */
    ctl_tenant *t = inst->tenant;
    pie_status q;
    if (ctl_tenant_quota("launch", t, "instances", t->q_insts, t->n_insts, 1, &q) != PIE_OK &&
        t->n_insts - ending_in(c, r, up, t) >= t->q_insts) { /* one that ends now makes room */
        ctl_core_terminate(c, inst, q.code, q.msg);
        return true;
    }
    t->n_insts++;
    inst->counted = true;
    return true;
}

/* ---- Session entry points ------------------------------------------------------------------ */

static void process_up(ctl_core *c, ctl_replica *r, Pie__V1__SessionUp *up, int64_t now_ns,
                       bool first);

static void replica_free(ctl_replica *r) {
    free(r->res);
    free(r->ev);
    ctl_arena_free(&r->arena);
    free(r->replica_id);
    free(r->address);
    free(r->version);
    free(r);
}

ctl_replica *ctl_core_replica_join(ctl_core *c, void *link, Pie__V1__SessionUp *hello_msg,
                                   int64_t now_ns, pie_status *st) {
    const Pie__V1__SessionHello *h = hello_msg->hello;
    if (h == NULL) {
        pie_status_set(st, PIE_FAILED_PRECONDITION,
                       "Session: the first SessionUp must carry a hello");
        return NULL;
    }
    if (h->version == NULL || strncmp(h->version, "pie-c/0.", 8) != 0) {
        pie_status_set(st, PIE_FAILED_PRECONDITION,
                       "Session: version \"%s\" is not compatible with %s",
                       h->version ? h->version : "", CTL_VERSION);
        return NULL;
    }
    uint32_t index = 0;
    for (uint32_t i = 1; i <= 65535 && index == 0; i++) {
        bool used = false;
        for (ctl_replica *r = c->replicas; r && !used; r = r->next) used = r->index == i;
        if (!used) index = i;
    }
    if (index == 0) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "controller: 65535 replicas linked");
        return NULL;
    }
    ctl_replica *r = calloc(1, sizeof *r);
    if (r == NULL) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "controller: out of memory");
        return NULL;
    }
    enter(c, now_ns);
    r->index = index;
    r->link = link;
    r->replica_id = strdup(h->replica_id ? h->replica_id : "");
    r->address = strdup(h->address ? h->address : "");
    r->version = strdup(h->version ? h->version : "");
    if (!r->replica_id || !r->address || !r->version) {
        replica_free(r);
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "controller: out of memory");
        leave(c);
        return NULL;
    }
    r->connected_unix_ms = unix_ms();
    r->next = c->replicas;
    c->replicas = r;
    /* welcome and the models in one message */
    Pie__V1__SessionWelcome w = PIE__V1__SESSION_WELCOME__INIT;
    w.replica_index = index;
    w.version = CTL_VERSION;
    Pie__V1__ModelsChanged mc;
    Pie__V1__SessionEvent ev = PIE__V1__SESSION_EVENT__INIT;
    Pie__V1__SessionEvent *evp = &ev;
    Pie__V1__SessionDown down = PIE__V1__SESSION_DOWN__INIT;
    down.welcome = &w;
    if (fill_models(c, &r->arena, &mc)) {
        ev.event_case = PIE__V1__SESSION_EVENT__EVENT_MODELS_CHANGED;
        ev.models_changed = &mc;
        down.n_events = 1;
        down.events = &evp;
    }
    c->sink.to_replica(c->sink.user, link, &down);
    ctl_arena_reset(&r->arena);
    pie_log_info("ctl.replica.joined", "replica_index=%u replica_id=%s", index, r->replica_id);
    leave(c);
    process_up(c, r, hello_msg, now_ns, true); /* begins / calls / ends it may carry */
    return r;
}

/* Processes a SessionUp (the hello part excepted when it is the replica's first) and frees it
 * once no call refers to it. */
static void process_up(ctl_core *c, ctl_replica *r, Pie__V1__SessionUp *up, int64_t now_ns,
                       bool first) {
    enter(c, now_ns);
    ctl_msg *m = ctl_slab_get(&c->s_msgs);
    if (m == NULL) {
        c->sink.end_link(c->sink.user, r->link, PIE_RESOURCE_EXHAUSTED,
                         "controller: out of memory");
        free_msg(up);
        leave(c);
        return;
    }
    m->up = up;
    m->refs = 1; /* this function's own reference, dropped after the outboxes are sent */
    pie_status st;
    if (up->hello && !first) {
        c->sink.end_link(c->sink.user, r->link, PIE_FAILED_PRECONDITION,
                         "Session: hello sent twice");
        goto out;
    }
    for (size_t i = 0; i < up->n_begins; i++) {
        if (!begin_instance(c, r, up, up->begins[i], &st)) {
            c->sink.end_link(c->sink.user, r->link, st.code, st.msg);
            goto out;
        }
    }
    r->calls += up->n_calls;
    if (c->m_calls) pie_counter_add(c->m_calls, up->n_calls);
    for (size_t i = 0; i < up->n_calls; i++) call_in(c, r, m, up->calls[i], now_ns);
    for (size_t i = 0; i < up->n_ends; i++) {
        ctl_inst *inst = pie_map64_get(&c->insts, up->ends[i]->instance_id);
        if (inst && inst->rep == r) end_instance(c, inst);
    }
out:
    leave(c);
    if (--m->refs == 0) {
        free_msg(up);
        ctl_slab_put(&c->s_msgs, m);
    }
}

void ctl_core_session_up(ctl_core *c, ctl_replica *r, Pie__V1__SessionUp *up, int64_t now_ns) {
    process_up(c, r, up, now_ns, false);
}

void ctl_core_replica_leave(ctl_core *c, ctl_replica *r, int64_t now_ns) {
    enter(c, now_ns);
    while (r->insts) end_instance(c, r->insts);
    for (ctl_replica **p = &c->replicas; *p; p = &(*p)->next) {
        if (*p == r) {
            *p = r->next;
            break;
        }
    }
    if (r->dirty) {
        for (ctl_replica **p = &c->dirty; *p; p = &(*p)->dirty_next) {
            if (*p == r) {
                *p = r->dirty_next;
                break;
            }
        }
    }
    pie_log_info("ctl.replica.left", "replica_index=%u", r->index);
    replica_free(r);
    leave(c);
}

/* ---- create / destroy ------------------------------------------------------------------------ */

ctl_core *ctl_core_create(const ctl_core_config *cfg, const ctl_sink *sink, pie_metrics *metrics,
                          pie_status *st) {
    ctl_core *c = calloc(1, sizeof *c);
    if (c == NULL) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "controller: out of memory");
        return NULL;
    }
    c->cfg = *cfg;
    if (c->cfg.heartbeat_ms == 0) c->cfg.heartbeat_ms = 1000;
    c->sink = *sink;
    c->started_unix_ms = unix_ms();
    ctl_slab_init(&c->s_calls, sizeof(ctl_call), 1024);
    ctl_slab_init(&c->s_msgs, sizeof(ctl_msg), 256);
    ctl_slab_init(&c->s_batches, sizeof(ctl_batch), 64);
    ctl_slab_init(&c->s_queues, sizeof(ctl_queue), 256);
    ctl_slab_init(&c->s_places, sizeof(ctl_place), 256);
    c->step.kind = CTL_KIND_NONE;
    if (metrics) {
        pie_status ms;
        c->m_calls = pie_metrics_counter(metrics, "pie_controller_api_calls_total",
                                         "API calls received over Session streams.", NULL, 0, &ms);
        c->m_batches = pie_metrics_counter(metrics, "pie_controller_batches_total",
                                           "Batches sent to workers (all kinds).", NULL, 0, &ms);
        c->m_steps = pie_metrics_counter(
            metrics, "pie_controller_steps_total",
            "Scheduling steps (WorkerDown messages with batches) sent.", NULL, 0, &ms);
        c->m_items = pie_metrics_counter(metrics, "pie_controller_batch_items_total",
                                         "Items in the batches sent to workers.", NULL, 0, &ms);
        c->m_terminated = pie_metrics_counter(
            metrics, "pie_controller_instances_terminated_total",
            "Instances the controller ended (contention, worker loss).", NULL, 0, &ms);
        c->m_kv_spills = pie_metrics_counter(
            metrics, "pie_controller_kv_spills_total",
            "KV allocations granted past a worker's effective capacity (up to kv_pages_max: its "
            "host pool) instead of settling contention.",
            NULL, 0, &ms);
        c->m_deferred = pie_metrics_counter(
            metrics, "pie_controller_deferred_calls_total",
            "Calls a worker deferred (ItemResult.deferred: not run) and the controller offered "
            "again.",
            NULL, 0, &ms);
        c->m_defer_failed = pie_metrics_counter(
            metrics, "pie_controller_deferral_failures_total",
            "Calls failed because a worker deferred them more than 64 times.", NULL, 0, &ms);
        c->m_instances =
            pie_metrics_gauge(metrics, "pie_controller_instances", "Live instances.", NULL, 0, &ms);
        c->m_workers = pie_metrics_gauge(metrics, "pie_controller_workers",
                                         "Worker groups registered over WorkerLink.", NULL, 0, &ms);
        c->m_replicas = pie_metrics_gauge(metrics, "pie_controller_replicas",
                                          "Lifecycle replicas with an open Session.", NULL, 0, &ms);
        c->m_waiting = pie_metrics_gauge(
            metrics, "pie_controller_instances_waiting",
            "Live instances with a GPU call waiting for a batch (sampled at scrape).", NULL, 0,
            &ms);
        double wait_b[20], size_b[12];
        pie_metrics_exponential_bounds(0.0001, 2, 20, wait_b); /* 100 µs .. 52 s */
        pie_metrics_exponential_bounds(1, 2, 12, size_b);      /* 1 .. 2048 items */
        c->m_wait = pie_metrics_histogram(
            metrics, "pie_controller_call_wait_seconds",
            "Queue wait of GPU calls: arrival at the controller to being taken into a batch.",
            wait_b, 20, NULL, 0, &ms);
        c->m_batch_size = pie_metrics_histogram(metrics, "pie_controller_batch_size",
                                                "Items per batch sent to a worker.", size_b, 12,
                                                NULL, 0, &ms);
        c->metrics = metrics;
    }
    return c;
}

void ctl_core_destroy(ctl_core *c) {
    if (c == NULL) return;
    /* The metrics registry may be gone already (svc_stop frees it first): touch it no more. */
    c->m_calls = c->m_batches = c->m_steps = c->m_items = c->m_terminated = NULL;
    c->m_kv_spills = c->m_deferred = c->m_defer_failed = NULL;
    c->m_instances = c->m_workers = c->m_replicas = c->m_waiting = NULL;
    c->m_wait = c->m_batch_size = NULL;
    c->metrics = NULL;
    enter(c, c->now_ns);
    while (c->replicas) {
        ctl_replica *r = c->replicas;
        while (r->insts) end_instance(c, r->insts);
        c->replicas = r->next;
        replica_free(r);
    }
    c->dirty = NULL;
    pie_status why;
    pie_status_set(&why, PIE_UNAVAILABLE, "controller shutting down");
    while (c->workers) ctl_core_worker_leave(c, c->workers, &why, c->now_ns);
    c->dirty = NULL;
    leave(c);
    for (uint32_t i = 0; i < c->n_models; i++) {
        free(c->models[i].name);
        free_msg(c->models[i].info);
    }
    free(c->models);
    ctl_exports_free(&c->exports);
    tenants_free(c); /* after the exports: they uncharge their tenant when freed */
    ctl_pubsub_free(&c->ps);
    pie_map64_free(&c->insts);
    ctl_vecp_free(&c->grave_queues);
    ctl_exec_step_free(&c->step);
    ctl_slab_free(&c->s_calls);
    ctl_slab_free(&c->s_msgs);
    ctl_exec_free_batches(&c->s_batches);
    ctl_slab_free(&c->s_queues);
    ctl_slab_free(&c->s_places);
    free(c);
}

/* ---- time ------------------------------------------------------------------------------------ */

int64_t ctl_core_next_wake(const ctl_core *c) {
    int64_t wake = 0;
    int64_t hb_ns = (int64_t)c->cfg.heartbeat_ms * 3 * 1000000;
    for (const ctl_worker *w = c->workers; w; w = w->next) {
        if (w->credits && w->wake_ns && (wake == 0 || w->wake_ns < wake)) wake = w->wake_ns;
        /* (wake_ns is only set by strategies with deadlines, which ignore steps_out.) */
        if (w->credits && w->hold_ns && (wake == 0 || w->hold_ns < wake)) wake = w->hold_ns;
        if (w->heard_stats) {
            int64_t t = w->last_heard_ns + hb_ns;
            if (wake == 0 || t < wake) wake = t;
        }
    }
    if (c->cfg.export_ttl_ms && ctl_exports_persistent(&c->exports) &&
        (wake == 0 || c->export_sweep_ns < wake))
        wake = c->export_sweep_ns ? c->export_sweep_ns : 1;
    return wake;
}

/* ---- drain ---------------------------------------------------------------------------------- */

void ctl_core_drain_worker(ctl_core *c, ctl_worker *w) {
    if (w->draining) return;
    w->draining = true;
    Pie__V1__Drain dr = PIE__V1__DRAIN__INIT;
    dr.shutdown = false;
    dr.reason = c->drain_reason;
    Pie__V1__WorkerDown down = PIE__V1__WORKER_DOWN__INIT;
    down.drain = &dr;
    c->sink.to_worker(c->sink.user, w->link, &down);
    pie_log_info("ctl.worker.drain", "worker_index=%u group=%s steps_out=%u reason=\"%s\"",
                 w->index, w->reg->group_id, w->steps_out, c->drain_reason);
}

void ctl_core_retire_worker(ctl_core *c, ctl_worker *w) {
    if (w->draining) return;
    w->draining = true;
    Pie__V1__Drain dr = PIE__V1__DRAIN__INIT;
    dr.shutdown = true;
    dr.reason = "the worker is shutting down and no instance is placed on it any more";
    Pie__V1__WorkerDown down = PIE__V1__WORKER_DOWN__INIT;
    down.drain = &dr;
    c->sink.to_worker(c->sink.user, w->link, &down);
    pie_log_info("ctl.worker.retired", "worker_index=%u group=%s steps_out=%u", w->index,
                 w->reg->group_id, w->steps_out);
}

void ctl_core_drain(ctl_core *c, const char *reason, int64_t now_ns) {
    enter(c, now_ns);
    if (!c->draining) {
        c->draining = true;
        snprintf(c->drain_reason, sizeof c->drain_reason, "%s", reason ? reason : "");
    }
    for (ctl_worker *w = c->workers; w; w = w->next) ctl_core_drain_worker(c, w);
    ctl_core_leave(c);
}

void ctl_core_end_worker_links(ctl_core *c, const char *why) {
    for (ctl_worker *w = c->workers; w; w = w->next)
        c->sink.end_link(c->sink.user, w->link, PIE_UNAVAILABLE, why);
}

uint32_t ctl_core_steps_out(const ctl_core *c) {
    uint32_t n = 0;
    for (const ctl_worker *w = c->workers; w; w = w->next) n += w->steps_out;
    return n;
}

int64_t ctl_core_tick(ctl_core *c, int64_t now_ns) {
    enter(c, now_ns);
    int64_t hb_ns = (int64_t)c->cfg.heartbeat_ms * 3 * 1000000;
    for (ctl_worker *w = c->workers; w; w = w->next) {
        if (w->heard_stats && now_ns - w->last_heard_ns >= hb_ns) {
            char msg[160];
            snprintf(msg, sizeof msg, "WorkerLink: worker %s sent nothing for 3 heartbeats (%u ms)",
                     w->reg->group_id, 3 * c->cfg.heartbeat_ms);
            w->heard_stats = false; /* once: the link's end follows */
            pie_log_warn("ctl.worker.silent", "worker_index=%u group=%s", w->index,
                         w->reg->group_id);
            c->sink.end_link(c->sink.user, w->link, PIE_UNAVAILABLE, msg);
        }
    }
    if (c->cfg.export_ttl_ms && now_ns >= c->export_sweep_ns) {
        ctl_exports_expire(&c->exports, now_ns, c->cfg.export_ttl_ms * 1000000);
        c->export_sweep_ns = now_ns + CTL_EXPORT_SWEEP_NS;
    }
    leave(c); /* dispatches what became due */
    return ctl_core_next_wake(c);
}

/* ---- status ---------------------------------------------------------------------------------- */

static int cmp_ws(const void *a, const void *b) {
    uint32_t x = (*(Pie__V1__WorkerStatus *const *)a)->worker_index;
    uint32_t y = (*(Pie__V1__WorkerStatus *const *)b)->worker_index;
    return (x > y) - (x < y);
}

static int cmp_rs(const void *a, const void *b) {
    uint32_t x = (*(Pie__V1__ReplicaStatus *const *)a)->replica_index;
    uint32_t y = (*(Pie__V1__ReplicaStatus *const *)b)->replica_index;
    return (x > y) - (x < y);
}

void ctl_core_list_exports(ctl_core *c, const char *tenant,
                           void (*fn)(void *arg, const Pie__V1__ListTenantExportsResponse *r),
                           void *arg) {
    ctl_arena a = {0};
    Pie__V1__ListTenantExportsResponse resp = PIE__V1__LIST_TENANT_EXPORTS_RESPONSE__INIT;
    bool ok = ctl_exec_export_infos(c, &a, tenant, &resp.exports, &resp.n_exports) == 0;
    fn(arg, ok ? &resp : NULL);
    ctl_arena_free(&a);
}

pie_code ctl_core_delete_export(ctl_core *c, const char *tenant, const char *name,
                                uint32_t *pages, int64_t now_ns, pie_status *st) {
    const char *op = "DeleteExport";
    if (ctl_name_check(op, "name", name, st) != PIE_OK) return st->code;
    ctl_export *e = ctl_exports_get(&c->exports, tenant, name);
    if (e == NULL)
        return pie_status_set(st, PIE_NOT_FOUND, "%s: tenant \"%s\" has no export \"%s\"", op,
                              tenant ? tenant : "", name);
    enter(c, now_ns);
    *pages = e->n;
    if (!e->persistent) {
        ctl_inst *owner = pie_map64_get(&c->insts, e->exporter);
        if (owner && owner->n_tied_exports) owner->n_tied_exports--;
    }
    pie_log_info("ctl.export.deleted", "tenant=%s name=\"%s\" pages=%u persistent=%d",
                 e->tenant, e->name, e->n, e->persistent);
    ctl_exports_remove(&c->exports, e);
    leave(c); /* freed slots may let waiting work run */
    return PIE_OK;
}

/* ---- metrics sampled at scrape ---------------------------------------------------------------- */

void ctl_core_worker_gauges(ctl_core *c, const ctl_worker *w, bool gone) {
    if (c->metrics == NULL) return;
    pie_status st;
    pie_metric_label l[2] = {{"worker", w->reg->group_id}, {"model", w->reg->model->name}};
    pie_gauge *used = pie_metrics_gauge(c->metrics, "pie_controller_worker_kv_pages_used",
                                        "KV pages in use on a worker group (a departed group "
                                        "reads 0).",
                                        l, 2, &st);
    pie_gauge *total = pie_metrics_gauge(c->metrics, "pie_controller_worker_kv_pages_total",
                                         "KV pages a worker group offers now (its effective "
                                         "capacity; a departed group reads 0).",
                                         l, 2, &st);
    pie_gauge_set(used, gone ? 0 : w->pool.kv_used);
    pie_gauge_set(total, gone ? 0 : w->pool.kv_effective);
}

/* Whether inst has a GPU call that waits for a batch (its queue's head, not yet taken). */
static bool inst_waiting(const ctl_inst *inst) {
    for (uint32_t i = 0; i < inst->n_all; i++) {
        const ctl_queue *q = inst->all[i];
        const ctl_call *h = q ? ctl_queue_head(q) : NULL;
        if (h && h->kind != CTL_KIND_CTRL) return true;
    }
    return false;
}

void ctl_core_sample_metrics(ctl_core *c) {
    if (c->metrics == NULL) return;
    for (const ctl_worker *w = c->workers; w; w = w->next) ctl_core_worker_gauges(c, w, false);
    uint32_t waiting = 0;
    for (const ctl_replica *r = c->replicas; r; r = r->next)
        for (const ctl_inst *inst = r->insts; inst; inst = inst->rep_next)
            waiting += inst_waiting(inst);
    pie_gauge_set(c->m_waiting, waiting);
}

void ctl_core_status(ctl_core *c, void (*fn)(void *arg, const Pie__V1__ClusterStatusResponse *r),
                     void *arg) {
    ctl_arena a = {0};
    size_t nw = 0, nr = 0;
    for (ctl_worker *w = c->workers; w; w = w->next) nw++;
    for (ctl_replica *r = c->replicas; r; r = r->next) nr++;
    Pie__V1__ClusterStatusResponse resp = PIE__V1__CLUSTER_STATUS_RESPONSE__INIT;
    Pie__V1__WorkerStatus **wp = ctl_arena_zalloc(&a, (nw + 1) * sizeof *wp);
    Pie__V1__ReplicaStatus **rp = ctl_arena_zalloc(&a, (nr + 1) * sizeof *rp);
    Pie__V1__ModelStatus **mp = ctl_arena_zalloc(&a, (c->n_models + 1) * sizeof *mp);
    if (!wp || !rp || !mp) goto done;
    resp.version = CTL_VERSION;
    resp.started_unix_ms = c->started_unix_ms;
    for (uint32_t i = 0; i < c->n_models; i++) {
        if (c->models[i].workers == 0) continue;
        Pie__V1__ModelStatus *m = ctl_arena_alloc(&a, sizeof *m);
        if (m == NULL) goto done;
        pie__v1__model_status__init(m);
        m->info = c->models[i].info;
        m->workers = c->models[i].workers;
        mp[resp.n_models++] = m;
    }
    for (ctl_worker *w = c->workers; w; w = w->next) {
        Pie__V1__WorkerStatus *s = ctl_arena_alloc(&a, sizeof *s);
        Pie__V1__WorkerCapacity *cap = ctl_arena_alloc(&a, sizeof *cap);
        if (s == NULL || cap == NULL) goto done;
        pie__v1__worker_status__init(s);
        const Pie__V1__WorkerRegistration *reg = w->reg;
        *cap = *reg->capacity;
        cap->kv_pages_effective = w->pool.kv_effective;
        s->worker_index = w->index;
        s->group_id = reg->group_id;
        s->model = reg->model->name;
        s->backend = reg->backend;
        s->memory_policy = reg->memory_policy;
        s->tp_size = reg->tp_size;
        s->device = reg->device;
        s->address = reg->address;
        s->state = w->draining || w->leaving ? PIE__V1__WORKER_STATE__WORKER_STATE_DRAINING
                                             : PIE__V1__WORKER_STATE__WORKER_STATE_READY;
        s->connected_unix_ms = w->connected_unix_ms;
        s->capacity = cap;
        s->kv_pages_used = w->pool.kv_used;
        s->embed_slots_used = w->pool.emb_used;
        s->instances = w->n_places;
        s->batches_in_flight = w->n_out;
        s->stats = (Pie__V1__WorkerStats *)w->stats;
        s->kv_page_refs = w->pool.kv_refs_total;
        s->kv_pages_shared = w->pool.kv_shared;
        s->n_ranks = reg->n_ranks; /* the registration lives as long as the worker */
        s->ranks = reg->ranks;
        wp[resp.n_workers++] = s;
        for (size_t i = 0; i < resp.n_models; i++) {
            if (mp[i]->info != c->models[w->model].info) continue;
            mp[i]->kv_pages_effective += w->pool.kv_effective;
            mp[i]->kv_pages_used += w->pool.kv_used;
            mp[i]->instances += w->n_places;
        }
    }
    for (ctl_replica *r = c->replicas; r; r = r->next) {
        Pie__V1__ReplicaStatus *s = ctl_arena_alloc(&a, sizeof *s);
        if (s == NULL) goto done;
        pie__v1__replica_status__init(s);
        s->replica_index = r->index;
        s->replica_id = r->replica_id;
        s->address = r->address;
        s->version = r->version;
        s->connected_unix_ms = r->connected_unix_ms;
        s->instances = r->n_insts;
        s->calls = r->calls;
        rp[resp.n_replicas++] = s;
    }
    qsort(wp, resp.n_workers, sizeof *wp, cmp_ws);
    qsort(rp, resp.n_replicas, sizeof *rp, cmp_rs);
    resp.workers = wp;
    resp.replicas = rp;
    resp.models = mp;
    resp.instances = c->n_insts;
    resp.exports = (uint32_t)ctl_exports_count(&c->exports);
    fn(arg, &resp);
    ctl_arena_free(&a);
    return;
done:
    ctl_arena_free(&a);
    fn(arg, NULL);
}
