/* lc_host_ctl.c — the `pie` calls that go to the controller as pie.v1.ApiCall: queues, KV pages,
 * embeddings, exports, embed_text, forward, next_dist, broadcast/subscribe; and applying their
 * CallResults (futures, deferred queue errors, usage counters).
 *
 * Every call checks its arguments locally first (the shared rules of pie_check.h against the
 * queue's model, plus what only this layer knows: its queues, futures and linear memory), so
 * most mistakes come back at once as -code with last_error set; what only the
 * controller can know (an id that is not allocated, a quota) comes back later: in the call's
 * future, or for calls without a result as the deferred error of its queue, delivered by the
 * next synchronize. Calls are packed on the instance's thread into its staging buffer and leave
 * the process when the instance next waits (lc_host_inst_flush), so the calls of a decode step
 * travel in one SessionUp. Does not own: futures' storage and waiting (lc_host.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lc_host_int.h"
#include "pie_log.h"

#define OP(x) PIE__V1__API_CALL__OP_##x
/* A staging buffer this large is sent without waiting for the instance to block. */
#define LC_STAGE_FLUSH_BYTES (1u << 20)
#define LC_STAGE_FLUSH_PARTS 256u

/* ---- queues ----------------------------------------------------------------------------------- */

void lc_queue_free(lc_queue *q) {
    if (q == NULL) return;
    free(q->msg);
    free(q->ring);
    free(q);
}

static lc_queue *queue_make(lc_host_inst *hi, uint32_t q) { /* under mu */
    lc_queue *lq = pie_map64_get(&hi->queues, (uint64_t)q + 1);
    if (lq) return lq;
    lq = calloc(1, sizeof *lq);
    if (lq == NULL) return NULL;
    lq->id = q;
    if (pie_map64_put(&hi->queues, (uint64_t)q + 1, lq) != 0) { /* +1: queue 0 is a key too */
        free(lq);
        return NULL;
    }
    return lq;
}

static lc_queue *queue_get(lc_host_inst *hi, uint32_t q) {
    return pie_map64_get(&hi->queues, (uint64_t)q + 1);
}

static bool ring_push(lc_queue *lq, lc_void_call v) {
    if (lq->n >= LC_MAX_UNANSWERED) return false;
    if (lq->n == lq->cap) {
        size_t cap = lq->cap ? lq->cap * 2 : 16;
        lc_void_call *r = malloc(cap * sizeof *r);
        if (r == NULL) return false;
        for (size_t i = 0; i < lq->n; i++) r[i] = lq->ring[(lq->head + i) % lq->cap];
        free(lq->ring);
        lq->ring = r;
        lq->cap = cap;
        lq->head = 0;
    }
    lq->ring[(lq->head + lq->n++) % lq->cap] = v;
    return true;
}

static lc_void_call *ring_at(lc_queue *lq, size_t i) { return &lq->ring[(lq->head + i) % lq->cap]; }

/* Drops the k oldest entries; returns their packed bytes. */
static size_t ring_pop(lc_queue *lq, size_t k) {
    size_t bytes = 0;
    for (size_t i = 0; i < k; i++) bytes += ring_at(lq, i)->bytes;
    lq->head = (lq->head + k) % (lq->cap ? lq->cap : 1);
    lq->n -= k;
    return bytes;
}

/* Void calls before call_id on this queue succeeded: forget them. */
static void ring_prune(lc_host_inst *hi, lc_queue *lq, uint64_t call_id) {
    size_t k = 0;
    while (k < lq->n && ring_at(lq, k)->call_id < call_id) k++;
    lc_host_pending_release(hi, ring_pop(lq, k));
}

void lc_host_pending_release(lc_host_inst *hi, size_t n) {
    n = n < hi->pending_bytes ? n : hi->pending_bytes;
    hi->pending_bytes -= n;
    pie_budget_give(hi->h->cfg.budget, n);
}

/* Counts a staged call of bytes (under mu); false when the instance or the replica has no room
 * for more unanswered calls. */
static bool pending_take(lc_host_inst *hi, size_t bytes) {
    if (hi->pending_bytes + bytes > LC_MAX_PENDING_BYTES) return false;
    if (!pie_budget_take(hi->h->cfg.budget, bytes)) return false;
    hi->pending_bytes += bytes;
    return true;
}

/* Index of call_id in the ring (ascending ids), or -1. */
static long ring_find(lc_queue *lq, uint64_t call_id) {
    size_t lo = 0, hi = lq->n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (ring_at(lq, mid)->call_id < call_id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < lq->n && ring_at(lq, lo)->call_id == call_id ? (long)lo : -1;
}

/* ---- usage ------------------------------------------------------------------------------------ */

static void usage_apply(lc_host_inst *hi, uint32_t op, uint32_t count, int sign) { /* under mu */
    uint32_t *c = NULL;
    int s = sign;
    switch (op) {
    case OP(ALLOC_KV_PAGES): c = &hi->kv_pages; break;
    case OP(DEALLOC_KV_PAGES): c = &hi->kv_pages, s = -sign; break;
    case OP(ALLOC_EMBEDS): c = &hi->embeds; break;
    case OP(DEALLOC_EMBEDS): c = &hi->embeds, s = -sign; break;
    case OP(CREATE_QUEUE): c = &hi->queues_held, count = 1; break;
    case OP(DESTROY_QUEUE): c = &hi->queues_held, count = 1, s = -sign; break;
    default: return;
    }
    if (s > 0)
        *c += count;
    else
        *c = *c > count ? *c - count : 0;
}

/* ---- staging a call --------------------------------------------------------------------------- */

/* An ApiCall of kind op whose message is msg (the Pie__V1__<Op> of that kind). */
static void api_call_set(Pie__V1__ApiCall *c, uint32_t op, void *msg) {
    c->op_case = (Pie__V1__ApiCall__OpCase)op;
    switch (op) {
    case OP(CREATE_QUEUE): c->create_queue = msg; break;
    case OP(DESTROY_QUEUE): c->destroy_queue = msg; break;
    case OP(SET_PRIORITY): c->set_priority = msg; break;
    case OP(SYNCHRONIZE): c->synchronize = msg; break;
    case OP(ALLOC_KV_PAGES): c->alloc_kv_pages = msg; break;
    case OP(DEALLOC_KV_PAGES): c->dealloc_kv_pages = msg; break;
    case OP(ALLOC_EMBEDS): c->alloc_embeds = msg; break;
    case OP(DEALLOC_EMBEDS): c->dealloc_embeds = msg; break;
    case OP(COPY_KV_PAGE): c->copy_kv_page = msg; break;
    case OP(MASK_KV_PAGE): c->mask_kv_page = msg; break;
    case OP(EXPORT_KV_PAGES): c->export_kv_pages = msg; break;
    case OP(UNEXPORT_KV_PAGES): c->unexport_kv_pages = msg; break;
    case OP(IMPORT_KV_PAGES): c->import_kv_pages = msg; break;
    case OP(LIST_EXPORTS): c->list_exports = msg; break;
    case OP(EMBED_TEXT): c->embed_text = msg; break;
    case OP(FORWARD): c->forward = msg; break;
    case OP(NEXT_DIST): c->next_dist = msg; break;
    case OP(BROADCAST): c->broadcast = msg; break;
    case OP(SUBSCRIBE): c->subscribe = msg; break;
    case OP(UNSUBSCRIBE): c->unsubscribe = msg; break;
    default: c->op_case = PIE__V1__API_CALL__OP__NOT_SET; break;
    }
}

uint32_t lc_host_call(lc_host_inst *hi, const char *fn, uint32_t q, uint32_t op, void *msg,
                      uint32_t fid, uint32_t count) {
    Pie__V1__ApiCall call = PIE__V1__API_CALL__INIT, *c = &call;
    api_call_set(c, op, msg);
    c->instance_id = hi->id;
    c->queue_id = q;
    c->call_id = hi->next_call + 1;
    if (fid) {
        pthread_mutex_lock(&hi->mu);
        bool busy = pie_map64_get(&hi->futures, fid) != NULL;
        pthread_mutex_unlock(&hi->mu);
        if (busy)
            return lc_host_fail(hi, PIE_ALREADY_EXISTS,
                                "%s: future %u is busy (consume it with future_result or drop it)",
                                fn, fid);
    }
    size_t mark = hi->stage.len, mark_n = hi->stage.n;
    pie_status st;
    if (lc_session_stage_add(&hi->stage, LC_SESSION_CALL, &c->base, &st) != PIE_OK)
        return lc_host_fail(hi, st.code, "%s: %s", fn, st.msg);
    bool ok = true, pending = true;
    uint32_t bytes = (uint32_t)(hi->stage.len - mark);
    pthread_mutex_lock(&hi->mu);
    lc_queue *lq = queue_make(hi, q);
    if (lq == NULL) {
        ok = false;
    } else if (!pending_take(hi, bytes)) {
        ok = pending = false;
    } else if (fid) {
        lc_call *cl = malloc(sizeof *cl);
        lc_future *f = cl ? lc_host_future_arm(hi, fid, LC_FUT_CALL) : NULL;
        if (f == NULL || pie_map64_put(&hi->calls, c->call_id, cl) != 0) {
            if (f) free(pie_map64_del(&hi->futures, fid));
            free(cl);
            ok = false;
        } else {
            *cl = (lc_call){.fid = fid,
                            .queue = q,
                            .op = op,
                            .count = count,
                            .bytes = bytes,
                            .serial = f->serial};
        }
    } else {
        ok = ring_push(lq, (lc_void_call){
                               .call_id = c->call_id, .op = op, .count = count, .bytes = bytes});
    }
    if (ok) usage_apply(hi, op, count, +1);
    else if (pending && lq) lc_host_pending_release(hi, bytes);
    size_t held = hi->pending_bytes;
    pthread_mutex_unlock(&hi->mu);
    if (!pending) {
        hi->stage.len = mark;
        hi->stage.n = mark_n;
        return lc_host_fail(hi, PIE_RESOURCE_EXHAUSTED,
                            "%s: %zu bytes of calls wait for the controller (at most %u per "
                            "instance, within the replica's limits.replica_memory): synchronize "
                            "or wait for results before issuing more",
                            fn, held, LC_MAX_PENDING_BYTES);
    }
    if (!ok) {
        hi->stage.len = mark;
        hi->stage.n = mark_n;
        return lc_host_fail(hi, PIE_RESOURCE_EXHAUSTED,
                            "%s: out of memory, or more than %u futures armed or %u calls on "
                            "queue %u not yet confirmed (synchronize the queue)",
                            fn, LC_MAX_FUTURES, LC_MAX_UNANSWERED, q);
    }
    hi->next_call++;
    if (hi->stage.len >= LC_STAGE_FLUSH_BYTES || hi->stage.n >= LC_STAGE_FLUSH_PARTS)
        lc_host_inst_flush(hi);
    return 0;
}

/* ---- results ---------------------------------------------------------------------------------- */

static uint8_t *payload_dists(const Pie__V1__DistributionList *dl, size_t *len) {
    size_t n = 0;
    for (size_t i = 0; dl && i < dl->n_dists; i++) n += 4 + dl->dists[i]->n_token_ids * 8;
    uint8_t *p = malloc(n + 1), *w = p;
    if (p == NULL) return NULL;
    for (size_t i = 0; dl && i < dl->n_dists; i++) {
        const Pie__V1__Distribution *d = dl->dists[i];
        uint32_t k = (uint32_t)d->n_token_ids;
        size_t kp = d->n_probs < k ? d->n_probs : k;
        memcpy(w, &k, 4);
        memcpy(w + 4, d->token_ids, (size_t)k * 4);
        memset(w + 4 + (size_t)k * 4, 0, (size_t)k * 4);
        if (kp) memcpy(w + 4 + (size_t)k * 4, d->probs, kp * 4);
        w += 4 + (size_t)k * 8;
    }
    *len = n;
    return p;
}

static uint8_t *payload_imported(const Pie__V1__ImportedKvPages *im, size_t *len) {
    uint32_t n = im ? (uint32_t)im->n_kv_page_ids : 0;
    uint8_t *p = malloc(4 + (size_t)n * 4);
    if (p == NULL) return NULL;
    memcpy(p, &n, 4);
    if (n) memcpy(p + 4, im->kv_page_ids, (size_t)n * 4);
    *len = 4 + (size_t)n * 4;
    return p;
}

static void put_u32(uint8_t **w, uint32_t v) {
    memcpy(*w, &v, 4);
    *w += 4;
}

static void put_str(uint8_t **w, const char *s) {
    uint32_t n = (uint32_t)strlen(s);
    put_u32(w, n);
    memcpy(*w, s, n);
    *w += n;
}

static uint8_t *payload_exports(const Pie__V1__ExportList *el, size_t *len) {
    size_t n = 4, count = el ? el->n_exports : 0;
    for (size_t i = 0; i < count; i++)
        n += 4 + strlen(el->exports[i]->name) + 4 + strlen(el->exports[i]->model) + 16;
    uint8_t *p = malloc(n), *w = p;
    if (p == NULL) return NULL;
    put_u32(&w, (uint32_t)count);
    for (size_t i = 0; i < count; i++) {
        const Pie__V1__ExportInfo *e = el->exports[i];
        put_str(&w, e->name);
        put_str(&w, e->model);
        put_u32(&w, e->page_count);
        put_u32(&w, e->persistent ? 1 : 0);
        memcpy(w, &e->exporter_instance_id, 8);
        w += 8;
    }
    *len = n;
    return p;
}

/* The OK result of a call with a result. */
static void result_ok(lc_host_inst *hi, const lc_call *cl, lc_queue *lq, lc_future *f,
                      const Pie__V1__CallResult *r) {
    uint8_t *p = NULL;
    size_t len = 0;
    pie_code code = PIE_OK;
    const char *msg = NULL;
    switch (cl->op) {
    case OP(SYNCHRONIZE):
        if (lq && lq->code != PIE_OK) {
            code = lq->code;
            msg = lq->msg;
        }
        break;
    case OP(NEXT_DIST):
        p = payload_dists(r->payload_case == PIE__V1__CALL_RESULT__PAYLOAD_DISTRIBUTIONS
                              ? r->distributions
                              : NULL,
                          &len);
        break;
    case OP(IMPORT_KV_PAGES): {
        const Pie__V1__ImportedKvPages *im =
            r->payload_case == PIE__V1__CALL_RESULT__PAYLOAD_IMPORTED ? r->imported : NULL;
        hi->kv_pages += im ? (uint32_t)im->n_kv_page_ids : 0;
        p = payload_imported(im, &len);
        break;
    }
    case OP(LIST_EXPORTS):
        p = payload_exports(
            r->payload_case == PIE__V1__CALL_RESULT__PAYLOAD_EXPORTS ? r->exports : NULL, &len);
        break;
    default: break;
    }
    if (f) {
        if (code == PIE_OK && p == NULL && cl->op != OP(SYNCHRONIZE)) {
            code = PIE_RESOURCE_EXHAUSTED;
            msg = "out of memory";
        }
        lc_host_future_resolve(hi, f, code, msg, p, len);
    } else {
        free(p);
    }
    if (cl->op == OP(SYNCHRONIZE) && lq) { /* delivered (or dropped with its future) */
        lq->code = PIE_OK;
        free(lq->msg);
        lq->msg = NULL;
    }
}

/* The error of a call without a result: the deferred error of its queue. */
static void result_void_error(lc_host_inst *hi, const Pie__V1__CallResult *r) {
    for (size_t i = 0; i < hi->queues.cap; i++) {
        if (hi->queues.cells[i].key == 0) continue;
        lc_queue *lq = hi->queues.cells[i].val;
        long at = ring_find(lq, r->call_id);
        if (at < 0) continue;
        lc_void_call v = *ring_at(lq, (size_t)at);
        lc_host_pending_release(hi, ring_pop(lq, (size_t)at + 1));
        usage_apply(hi, v.op, v.count, -1);
        if (v.op == OP(CREATE_QUEUE)) lq->live = false;
        if (lq->code == PIE_OK) {
            lq->code = r->code ? (pie_code)r->code : PIE_UNKNOWN;
            lq->msg = strdup(r->message ? r->message : "");
        }
        return;
    }
    pie_log_debug("lc.host.orphan_result", "instance=%llx call=%llu code=%u",
                  (unsigned long long)hi->id, (unsigned long long)r->call_id, r->code);
}

void lc_host_call_result(lc_host_inst *hi, const Pie__V1__CallResult *r) {
    lc_call *cl = pie_map64_del(&hi->calls, r->call_id);
    if (cl == NULL) {
        if (r->code != 0) result_void_error(hi, r);
        return;
    }
    lc_queue *lq = queue_get(hi, cl->queue);
    if (lq) ring_prune(hi, lq, r->call_id);
    lc_host_pending_release(hi, cl->bytes);
    lc_future *f = pie_map64_get(&hi->futures, cl->fid);
    if (f && (f->serial != cl->serial || f->done)) f = NULL; /* dropped (and maybe re-armed) */
    if (r->code != 0) {
        if (f) lc_host_future_resolve(hi, f, (pie_code)r->code, r->message, NULL, 0);
    } else {
        result_ok(hi, cl, lq, f, r);
    }
    free(cl);
}

/* ---- argument checks -------------------------------------------------------------------------- */

/* Returns -code if the controller ended the instance (its calls would be dropped), else 0. */
static uint32_t dead_check(lc_host_inst *hi, const char *fn) {
    pthread_mutex_lock(&hi->mu);
    bool dead = hi->terminated;
    pthread_mutex_unlock(&hi->mu);
    if (!dead) return 0; /* dead_code/dead_msg are set before terminated and never change */
    return lc_host_fail(hi, hi->dead_code, "%s: %s", fn,
                        hi->dead_msg ? hi->dead_msg : "the instance was terminated");
}

/* Common start of a queue call: the instance is alive and q is a live queue of it; *m gets the
 * queue's model. Returns 0 or -code. */
static uint32_t queue_check(lc_host_inst *hi, const char *fn, uint32_t q, pie_abi_model_info *m) {
    atomic_fetch_add(&hi->api_calls, 1);
    lc_host_scratch_reset(hi);
    uint32_t rc = dead_check(hi, fn);
    if (rc) return rc;
    pthread_mutex_lock(&hi->mu);
    lc_queue *lq = q ? queue_get(hi, q) : NULL;
    bool live = lq && lq->live;
    if (live) *m = lq->model;
    char why[300] = "";
    if (lq && !live && lq->msg) snprintf(why, sizeof why, " (%s)", lq->msg);
    pthread_mutex_unlock(&hi->mu);
    if (q == 0) return lc_host_fail(hi, PIE_INVALID_ARGUMENT, "%s: queue id 0 is reserved", fn);
    if (!live)
        return lc_host_fail(hi, PIE_NOT_FOUND, "%s: queue %u does not exist in this instance%s",
                            fn, q, why);
    return 0;
}

/* The outcome of a shared check (pie_check.h): 0, or -code with its message as last_error. */
static uint32_t checked(lc_host_inst *hi, pie_code c, const pie_status *st) {
    return c == PIE_OK ? 0 : lc_host_fail(hi, st->code, "%s", st->msg);
}

static uint32_t check_fid(lc_host_inst *hi, const char *fn, uint32_t f) {
    if (f == 0) return lc_host_fail(hi, PIE_INVALID_ARGUMENT, "%s: future id 0 is reserved", fn);
    return 0;
}

static uint32_t oom(lc_host_inst *hi, const char *fn) {
    return lc_host_fail(hi, PIE_RESOURCE_EXHAUSTED, "%s: out of memory", fn);
}

/* A name (export, topic) of 1..PIE_MAX_NAME_BYTES bytes copied into scratch as a C string. */
static char *name_arg(lc_host_inst *hi, lc_wasm_instance *inst, const char *fn, const char *what,
                      uint32_t p, uint32_t len, uint32_t *rc) {
    pie_status st;
    *rc = checked(hi, pie_check_name(PIE_AT(fn), what, len, &st), &st);
    if (*rc) return NULL;
    const char *s = lc_host_mem(inst, fn, p, len);
    char *c = lc_host_scratch(hi, (size_t)len + 1);
    if (c == NULL) {
        *rc = oom(hi, fn);
        return NULL;
    }
    memcpy(c, s, len);
    c[len] = '\0';
    if (strlen(c) != len) {
        *rc = lc_host_fail(hi, PIE_INVALID_ARGUMENT, "%s: %s contains a NUL byte", fn, what);
        return NULL;
    }
    return c;
}

/* An id list argument (ids, n) of 1..PIE_MAX_IDS ids copied into scratch; NULL with *rc set. */
static uint32_t *ids_arg(lc_host_inst *hi, lc_wasm_instance *inst, const char *fn, uint32_t ids,
                         uint32_t n, uint32_t *rc) {
    pie_status st;
    *rc = checked(hi, pie_check_count(PIE_AT(fn), "ids", n, PIE_MAX_IDS, &st), &st);
    if (*rc) return NULL;
    uint32_t *v = lc_host_u32s(hi, inst, fn, ids, n);
    if (v == NULL) *rc = oom(hi, fn);
    return v;
}

/* ---- queues ----------------------------------------------------------------------------------- */

uint32_t Z_pieZ_create_queue(Zpi *pie, uint32_t q, uint32_t model, uint32_t model_len) {
    lc_wasm_instance *inst = lc_wasm_host_enter(pie);
    lc_host_inst *hi = pie->host;
    const char *fn = "create_queue";
    atomic_fetch_add(&hi->api_calls, 1);
    uint32_t rc = dead_check(hi, fn);
    if (rc) return rc;
    if (q == 0) return lc_host_fail(hi, PIE_INVALID_ARGUMENT, "%s: queue id 0 is reserved", fn);
    const char *name = lc_host_mem(inst, fn, model, model_len);
    pie_abi_model_info info;
    char resolved[130];
    if (!lc_host_model(hi, name, model_len, &info, resolved))
        return lc_host_fail(hi, PIE_NOT_FOUND, "%s: model \"%.*s\" is not served by this cluster",
                            fn, model_len > 128 ? 128 : (int)model_len, name);
    pthread_mutex_lock(&hi->mu);
    lc_queue *lq = queue_make(hi, q);
    bool exists = lq && lq->live;
    if (lq && !exists) {
        lq->live = true;
        lq->model = info;
    }
    pthread_mutex_unlock(&hi->mu);
    if (lq == NULL) return oom(hi, fn);
    if (exists) return lc_host_fail(hi, PIE_ALREADY_EXISTS, "%s: queue %u already exists", fn, q);
    Pie__V1__CreateQueue m = PIE__V1__CREATE_QUEUE__INIT;
    m.model = resolved;
    rc = lc_host_call(hi, fn, q, OP(CREATE_QUEUE), &m, 0, 1);
    if (rc) {
        pthread_mutex_lock(&hi->mu);
        lq->live = false;
        pthread_mutex_unlock(&hi->mu);
    }
    return rc;
}

uint32_t Z_pieZ_destroy_queue(Zpi *pie, uint32_t q) {
    lc_wasm_host_enter(pie);
    lc_host_inst *hi = pie->host;
    pie_abi_model_info m;
    uint32_t rc = queue_check(hi, "destroy_queue", q, &m);
    if (rc) return rc;
    Pie__V1__DestroyQueue d = PIE__V1__DESTROY_QUEUE__INIT;
    rc = lc_host_call(hi, "destroy_queue", q, OP(DESTROY_QUEUE), &d, 0, 1);
    if (rc == 0) {
        pthread_mutex_lock(&hi->mu);
        queue_get(hi, q)->live = false; /* later calls naming it fail here, at once */
        pthread_mutex_unlock(&hi->mu);
    }
    return rc;
}

uint32_t Z_pieZ_set_queue_priority(Zpi *pie, uint32_t q, uint32_t priority) {
    lc_wasm_host_enter(pie);
    lc_host_inst *hi = pie->host;
    const char *fn = "set_queue_priority";
    pie_abi_model_info m;
    uint32_t rc = queue_check(hi, fn, q, &m);
    if (rc) return rc;
    if (priority > PIE_ABI_PRIORITY_HIGH)
        return lc_host_fail(hi, PIE_INVALID_ARGUMENT, "%s: priority %u is not 0, 1 or 2", fn,
                            priority);
    Pie__V1__SetQueuePriority p = PIE__V1__SET_QUEUE_PRIORITY__INIT;
    p.priority = (Pie__V1__QueuePriority)priority;
    return lc_host_call(hi, fn, q, OP(SET_PRIORITY), &p, 0, 0);
}

uint32_t Z_pieZ_synchronize(Zpi *pie, uint32_t q, uint32_t f) {
    lc_wasm_host_enter(pie);
    lc_host_inst *hi = pie->host;
    pie_abi_model_info m;
    uint32_t rc = queue_check(hi, "synchronize", q, &m);
    if (rc || (rc = check_fid(hi, "synchronize", f))) return rc;
    Pie__V1__Synchronize s = PIE__V1__SYNCHRONIZE__INIT;
    return lc_host_call(hi, "synchronize", q, OP(SYNCHRONIZE), &s, f, 0);
}

/* ---- KV pages and embeddings ------------------------------------------------------------------ */

/* alloc/dealloc of pages or embeddings: the four share everything but the message. */
static uint32_t id_list_call(Zpi *pie, const char *fn, uint32_t op, uint32_t q, uint32_t ids,
                             uint32_t n) {
    lc_wasm_instance *inst = lc_wasm_host_enter(pie);
    lc_host_inst *hi = pie->host;
    pie_abi_model_info m;
    uint32_t rc = queue_check(hi, fn, q, &m);
    uint32_t *v = rc ? NULL : ids_arg(hi, inst, fn, ids, n, &rc);
    if (v == NULL) return rc;
    Pie__V1__AllocKvPages ak = PIE__V1__ALLOC_KV_PAGES__INIT;
    Pie__V1__DeallocKvPages dk = PIE__V1__DEALLOC_KV_PAGES__INIT;
    Pie__V1__AllocEmbeds ae = PIE__V1__ALLOC_EMBEDS__INIT;
    Pie__V1__DeallocEmbeds de = PIE__V1__DEALLOC_EMBEDS__INIT;
    void *msg;
    switch (op) {
    case OP(ALLOC_KV_PAGES): ak.kv_page_ids = v, ak.n_kv_page_ids = n, msg = &ak; break;
    case OP(DEALLOC_KV_PAGES): dk.kv_page_ids = v, dk.n_kv_page_ids = n, msg = &dk; break;
    case OP(ALLOC_EMBEDS): ae.embed_ids = v, ae.n_embed_ids = n, msg = &ae; break;
    default: de.embed_ids = v, de.n_embed_ids = n, msg = &de; break;
    }
    return lc_host_call(hi, fn, q, op, msg, 0, n);
}

uint32_t Z_pieZ_alloc_kv_pages(Zpi *pie, uint32_t q, uint32_t ids, uint32_t n) {
    return id_list_call(pie, "alloc_kv_pages", OP(ALLOC_KV_PAGES), q, ids, n);
}
uint32_t Z_pieZ_dealloc_kv_pages(Zpi *pie, uint32_t q, uint32_t ids, uint32_t n) {
    return id_list_call(pie, "dealloc_kv_pages", OP(DEALLOC_KV_PAGES), q, ids, n);
}
uint32_t Z_pieZ_alloc_embeds(Zpi *pie, uint32_t q, uint32_t ids, uint32_t n) {
    return id_list_call(pie, "alloc_embeds", OP(ALLOC_EMBEDS), q, ids, n);
}
uint32_t Z_pieZ_dealloc_embeds(Zpi *pie, uint32_t q, uint32_t ids, uint32_t n) {
    return id_list_call(pie, "dealloc_embeds", OP(DEALLOC_EMBEDS), q, ids, n);
}

uint32_t Z_pieZ_copy_kv_page(Zpi *pie, uint32_t q, uint32_t src, uint32_t dst,
                             uint32_t src_offset, uint32_t dst_offset, uint32_t token_count) {
    lc_wasm_host_enter(pie);
    lc_host_inst *hi = pie->host;
    const char *fn = "copy_kv_page";
    pie_abi_model_info m;
    pie_status st;
    uint32_t rc = queue_check(hi, fn, q, &m);
    if (rc || (rc = checked(hi,
                            pie_check_copy(PIE_AT(fn), src, dst, src_offset, dst_offset,
                                           token_count, m.kv_page_size, &st),
                            &st)))
        return rc;
    Pie__V1__CopyKvPage cp = PIE__V1__COPY_KV_PAGE__INIT;
    cp.src_kv_page_id = src;
    cp.dst_kv_page_id = dst;
    cp.src_offset = src_offset;
    cp.dst_offset = dst_offset;
    cp.token_count = token_count;
    return lc_host_call(hi, fn, q, OP(COPY_KV_PAGE), &cp, 0, 0);
}

uint32_t Z_pieZ_mask_kv_page(Zpi *pie, uint32_t q, uint32_t page, uint32_t masked, uint32_t n) {
    lc_wasm_instance *inst = lc_wasm_host_enter(pie);
    lc_host_inst *hi = pie->host;
    const char *fn = "mask_kv_page";
    pie_abi_model_info m;
    pie_status st;
    uint32_t rc = queue_check(hi, fn, q, &m);
    if (rc ||
        (rc = checked(hi, pie_check_page_len(PIE_AT(fn), "masked", n, m.kv_page_size, &st), &st)))
        return rc;
    const uint8_t *src = lc_host_mem(inst, fn, masked, n);
    protobuf_c_boolean *b = lc_host_scratch(hi, (size_t)n * sizeof *b);
    if (b == NULL) return oom(hi, fn);
    for (uint32_t i = 0; i < n; i++) b[i] = src[i] != 0;
    Pie__V1__MaskKvPage mk = PIE__V1__MASK_KV_PAGE__INIT;
    mk.kv_page_id = page;
    mk.masked = b;
    mk.n_masked = n;
    return lc_host_call(hi, fn, q, OP(MASK_KV_PAGE), &mk, 0, 0);
}

uint32_t Z_pieZ_export_kv_pages(Zpi *pie, uint32_t q, uint32_t ids, uint32_t n, uint32_t name,
                                uint32_t name_len, uint32_t persistent) {
    lc_wasm_instance *inst = lc_wasm_host_enter(pie);
    lc_host_inst *hi = pie->host;
    const char *fn = "export_kv_pages";
    pie_abi_model_info m;
    uint32_t rc = queue_check(hi, fn, q, &m);
    uint32_t *v = rc ? NULL : ids_arg(hi, inst, fn, ids, n, &rc);
    char *nm = v ? name_arg(hi, inst, fn, "name", name, name_len, &rc) : NULL;
    if (nm == NULL) return rc;
    Pie__V1__ExportKvPages e = PIE__V1__EXPORT_KV_PAGES__INIT;
    e.kv_page_ids = v;
    e.n_kv_page_ids = n;
    e.name = nm;
    e.persistent = persistent != 0;
    return lc_host_call(hi, fn, q, OP(EXPORT_KV_PAGES), &e, 0, 0);
}

uint32_t Z_pieZ_unexport_kv_pages(Zpi *pie, uint32_t q, uint32_t name, uint32_t name_len) {
    lc_wasm_instance *inst = lc_wasm_host_enter(pie);
    lc_host_inst *hi = pie->host;
    const char *fn = "unexport_kv_pages";
    pie_abi_model_info m;
    uint32_t rc = queue_check(hi, fn, q, &m);
    if (rc) return rc;
    char *nm = name_arg(hi, inst, fn, "name", name, name_len, &rc);
    if (nm == NULL) return rc;
    Pie__V1__UnexportKvPages u = PIE__V1__UNEXPORT_KV_PAGES__INIT;
    u.name = nm;
    return lc_host_call(hi, fn, q, OP(UNEXPORT_KV_PAGES), &u, 0, 0);
}

uint32_t Z_pieZ_import_kv_pages(Zpi *pie, uint32_t q, uint32_t ids, uint32_t n, uint32_t name,
                                uint32_t name_len, uint32_t f) {
    lc_wasm_instance *inst = lc_wasm_host_enter(pie);
    lc_host_inst *hi = pie->host;
    const char *fn = "import_kv_pages";
    pie_abi_model_info m;
    uint32_t rc = queue_check(hi, fn, q, &m);
    if (rc || (rc = check_fid(hi, fn, f))) return rc;
    uint32_t *v = ids_arg(hi, inst, fn, ids, n, &rc);
    char *nm = v ? name_arg(hi, inst, fn, "name", name, name_len, &rc) : NULL;
    if (nm == NULL) return rc;
    Pie__V1__ImportKvPages im = PIE__V1__IMPORT_KV_PAGES__INIT;
    im.kv_page_ids = v;
    im.n_kv_page_ids = n;
    im.name = nm;
    return lc_host_call(hi, fn, q, OP(IMPORT_KV_PAGES), &im, f, n);
}

/* Calls that take no queue (queue 0 on the wire). */
static uint32_t noqueue_check(lc_host_inst *hi, const char *fn) {
    atomic_fetch_add(&hi->api_calls, 1);
    lc_host_scratch_reset(hi);
    return dead_check(hi, fn);
}

uint32_t Z_pieZ_list_exports(Zpi *pie, uint32_t f) {
    lc_wasm_host_enter(pie);
    lc_host_inst *hi = pie->host;
    uint32_t rc = noqueue_check(hi, "list_exports");
    if (rc || (rc = check_fid(hi, "list_exports", f))) return rc;
    Pie__V1__ListExports l = PIE__V1__LIST_EXPORTS__INIT;
    return lc_host_call(hi, "list_exports", 0, OP(LIST_EXPORTS), &l, f, 0);
}

/* ---- embed, forward, distributions ------------------------------------------------------------ */

uint32_t Z_pieZ_embed_text(Zpi *pie, uint32_t q, uint32_t embeds, uint32_t tokens,
                           uint32_t positions, uint32_t n) {
    lc_wasm_instance *inst = lc_wasm_host_enter(pie);
    lc_host_inst *hi = pie->host;
    const char *fn = "embed_text";
    pie_abi_model_info m;
    pie_status st;
    uint32_t rc = queue_check(hi, fn, q, &m);
    if (rc || (rc = checked(hi,
                            pie_check_count(PIE_AT(fn), "embeds", n,
                                            pie_check_limit(m.max_forward_tokens), &st),
                            &st)))
        return rc;
    uint32_t *e = lc_host_u32s(hi, inst, fn, embeds, n);
    uint32_t *t = lc_host_u32s(hi, inst, fn, tokens, n);
    uint32_t *p = lc_host_u32s(hi, inst, fn, positions, n);
    if (!e || !t || !p) return oom(hi, fn);
    if ((rc = checked(
             hi, pie_check_below(PIE_AT(fn), "tokens", t, n, pie_check_limit(m.vocab_size), &st),
             &st)) ||
        (rc = checked(hi,
                      pie_check_below(PIE_AT(fn), "positions", p, n,
                                      pie_check_limit(m.max_context_tokens), &st),
                      &st)))
        return rc;
    Pie__V1__EmbedText et = PIE__V1__EMBED_TEXT__INIT;
    et.embed_ids = e, et.n_embed_ids = n;
    et.token_ids = t, et.n_token_ids = n;
    et.positions = p, et.n_positions = n;
    return lc_host_call(hi, fn, q, OP(EMBED_TEXT), &et, 0, 0);
}

/* The pie_abi_forward descriptor's counts, checked against the queue's model: the shared rules,
 * then bounds on what this layer copies out of linear memory (the controller checks the page
 * layout and the mask against the ids). */
static uint32_t forward_check(lc_host_inst *hi, const pie_abi_forward *d,
                              const pie_abi_model_info *m) {
    const char *fn = "forward";
    uint32_t max_pages = m->max_context_tokens / (m->kv_page_size ? m->kv_page_size : 1) + 2;
    const pie_check_fwd f = {.in = "input_embed_ids",
                             .out = "output_embed_ids",
                             .pages = "kv_page_ids",
                             .last = "kv_page_last_len",
                             .n_in = d->n_inputs,
                             .n_out = d->n_outputs,
                             .n_pages = d->n_kv_pages,
                             .last_len = d->kv_page_last_len};
    pie_status st;
    pie_code c = pie_check_range(PIE_AT(fn), "n_kv_pages", d->n_kv_pages, 0, max_pages, &st);
    if (c == PIE_OK)
        c = pie_check_forward(PIE_AT(fn), &f, m->kv_page_size,
                              pie_check_limit(m->max_forward_tokens), &st);
    if (c == PIE_OK)
        c = pie_check_range(PIE_AT(fn), "n_output_kv_pages", d->n_output_kv_pages, 0, d->n_inputs,
                            &st);
    if (c == PIE_OK)
        c = pie_check_range(PIE_AT(fn), "n_mask_runs", d->n_mask_runs, 0, 1u << 24, &st);
    return checked(hi, c, &st);
}

uint32_t Z_pieZ_forward(Zpi *pie, uint32_t q, uint32_t desc) {
    lc_wasm_instance *inst = lc_wasm_host_enter(pie);
    lc_host_inst *hi = pie->host;
    const char *fn = "forward";
    pie_abi_model_info m;
    uint32_t rc = queue_check(hi, fn, q, &m);
    if (rc) return rc;
    pie_abi_forward d;
    memcpy(&d, lc_host_mem(inst, fn, desc, sizeof d), sizeof d);
    if ((rc = forward_check(hi, &d, &m))) return rc;
    Pie__V1__Forward fw = PIE__V1__FORWARD__INIT;
    Pie__V1__AttentionMask mask = PIE__V1__ATTENTION_MASK__INIT;
    fw.kv_page_ids = lc_host_u32s(hi, inst, fn, d.kv_page_ids, d.n_kv_pages);
    fw.n_kv_page_ids = d.n_kv_pages;
    fw.kv_page_last_len = d.kv_page_last_len;
    fw.input_embed_ids = lc_host_u32s(hi, inst, fn, d.input_embed_ids, d.n_inputs);
    fw.n_input_embed_ids = d.n_inputs;
    fw.output_kv_page_ids = lc_host_u32s(hi, inst, fn, d.output_kv_page_ids, d.n_output_kv_pages);
    fw.n_output_kv_page_ids = d.n_output_kv_pages;
    fw.output_embed_ids = lc_host_u32s(hi, inst, fn, d.output_embed_ids, d.n_outputs);
    fw.n_output_embed_ids = d.n_outputs;
    if (d.n_mask_runs) {
        mask.runs = lc_host_u32s(hi, inst, fn, d.mask_runs, d.n_mask_runs);
        mask.n_runs = d.n_mask_runs;
        fw.mask = &mask;
        if (mask.runs == NULL) return oom(hi, fn);
    }
    if (!fw.kv_page_ids || !fw.input_embed_ids || !fw.output_kv_page_ids || !fw.output_embed_ids)
        return oom(hi, fn);
    return lc_host_call(hi, fn, q, OP(FORWARD), &fw, 0, 0);
}

uint32_t Z_pieZ_next_dist(Zpi *pie, uint32_t q, uint32_t embeds, uint32_t n, uint32_t top_k,
                          float temperature, uint32_t f) {
    lc_wasm_instance *inst = lc_wasm_host_enter(pie);
    lc_host_inst *hi = pie->host;
    const char *fn = "next_dist";
    pie_abi_model_info m;
    uint32_t rc = queue_check(hi, fn, q, &m);
    if (rc) return rc;
    pie_status st;
    pie_code ok =
        pie_check_count(PIE_AT(fn), "embeds", n, pie_check_limit(m.max_forward_tokens), &st);
    if (ok == PIE_OK)
        ok = pie_check_range(PIE_AT(fn), "top_k", top_k, 0, pie_check_limit(m.max_top_k), &st);
    if (ok == PIE_OK) ok = pie_check_temperature(PIE_AT(fn), temperature, true, &st);
    if ((rc = checked(hi, ok, &st)) || (rc = check_fid(hi, fn, f))) return rc;
    uint32_t *e = lc_host_u32s(hi, inst, fn, embeds, n);
    if (e == NULL) return oom(hi, fn);
    Pie__V1__NextDist nd = PIE__V1__NEXT_DIST__INIT;
    nd.embed_ids = e;
    nd.n_embed_ids = n;
    nd.top_k = top_k;
    nd.temperature = temperature;
    return lc_host_call(hi, fn, q, OP(NEXT_DIST), &nd, f, n);
}

/* ---- messaging between inferlets -------------------------------------------------------------- */

uint32_t Z_pieZ_broadcast(Zpi *pie, uint32_t topic, uint32_t topic_len, uint32_t msg,
                          uint32_t len) {
    lc_wasm_instance *inst = lc_wasm_host_enter(pie);
    lc_host_inst *hi = pie->host;
    const char *fn = "broadcast";
    uint32_t rc = noqueue_check(hi, fn);
    if (rc) return rc;
    char *t = name_arg(hi, inst, fn, "topic", topic, topic_len, &rc);
    if (t == NULL) return rc;
    if (len > hi->limits.message_bytes)
        return lc_host_fail(hi, PIE_INVALID_ARGUMENT,
                            "%s: message of %u bytes exceeds the instance's message_bytes limit "
                            "%llu",
                            fn, len, (unsigned long long)hi->limits.message_bytes);
    Pie__V1__Broadcast b = PIE__V1__BROADCAST__INIT;
    b.topic = t;
    b.message.data = lc_host_mem(inst, fn, msg, len);
    b.message.len = len;
    return lc_host_call(hi, fn, 0, OP(BROADCAST), &b, 0, 0);
}

static uint32_t topic_call(Zpi *pie, const char *fn, bool sub, uint32_t topic,
                           uint32_t topic_len) {
    lc_wasm_instance *inst = lc_wasm_host_enter(pie);
    lc_host_inst *hi = pie->host;
    uint32_t rc = noqueue_check(hi, fn);
    if (rc) return rc;
    char *t = name_arg(hi, inst, fn, "topic", topic, topic_len, &rc);
    if (t == NULL) return rc;
    Pie__V1__Subscribe s = PIE__V1__SUBSCRIBE__INIT;
    Pie__V1__Unsubscribe u = PIE__V1__UNSUBSCRIBE__INIT;
    s.topic = u.topic = t;
    return lc_host_call(hi, fn, 0, sub ? OP(SUBSCRIBE) : OP(UNSUBSCRIBE), sub ? (void *)&s : &u, 0,
                        0);
}

uint32_t Z_pieZ_subscribe(Zpi *pie, uint32_t topic, uint32_t topic_len) {
    return topic_call(pie, "subscribe", true, topic, topic_len);
}

uint32_t Z_pieZ_unsubscribe(Zpi *pie, uint32_t topic, uint32_t topic_len) {
    return topic_call(pie, "unsubscribe", false, topic, topic_len);
}
