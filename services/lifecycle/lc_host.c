/* lc_host.c — the `pie` host API: host and instance lifetime, futures, and what comes back from
 * the controller (CallResults, InstanceTerminated, TopicDelivery, a lost Session).
 * See lc_host.h; the calls themselves are in lc_host_ctl.c and lc_host_local.c, the shared
 * layouts in lc_host_int.h.
 *
 * Threads. An instance's pie functions run on its own thread and are the only ones to stage
 * calls, arm futures and consume them. The Session thread (lc_session's link) resolves futures
 * and records deferred errors; HTTP pool threads resolve HTTP futures; the instance manager
 * delivers client messages. All of that meets under the instance's mutex, and a wait is a
 * condition-variable wait on it, woken by every resolution and by lc_host_inst_wake. Lookups
 * by instance id take a reference, so a result racing lc_host_inst_free is harmless. */
#include "lc_host_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pie_log.h"
#include "rpc.h"

/* ---- helpers shared by the pie functions ------------------------------------------------------ */

uint32_t lc_host_fail(lc_host_inst *hi, pie_code code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(hi->last_error, sizeof hi->last_error, fmt, ap);
    va_end(ap);
    return (uint32_t)-(int32_t)code;
}

void *lc_host_mem(lc_wasm_instance *inst, const char *fn, uint32_t addr, uint64_t len) {
    void *p = len <= UINT32_MAX ? lc_wasm_mem(inst, addr, (uint32_t)len) : NULL;
    if (p == NULL)
        lc_wasm_host_trap(inst, "%s: memory range [%u, %u + %llu) is outside linear memory", fn,
                          addr, addr, (unsigned long long)len);
    return p;
}

#define LC_SCRATCH_BLOCK (64u << 10) /* kept between calls; larger blocks go after each call */

static void scratch_free_block(lc_host_inst *hi, lc_arena_block *b) {
    pie_budget_give(hi->h->cfg.budget, sizeof *b + b->cap);
    free(b);
}

void lc_host_scratch_reset(lc_host_inst *hi) {
    lc_arena_block *b = hi->arena;
    if (b == NULL) return;
    lc_arena_block *n = b->next;
    while (n) {
        lc_arena_block *x = n->next;
        scratch_free_block(hi, n);
        n = x;
    }
    b->next = NULL;
    b->used = 0;
    if (b->cap > LC_SCRATCH_BLOCK) { /* one large call must not pin its memory for good */
        scratch_free_block(hi, b);
        hi->arena = NULL;
    }
}

/* Host memory a call needs for its arguments: charged to the replica's budget (NULL when the
 * budget or the heap has no room) and given back after the call (lc_host_scratch_reset). */
void *lc_host_scratch(lc_host_inst *hi, size_t bytes) {
    bytes = (bytes + 15) & ~(size_t)15;
    lc_arena_block *b = hi->arena;
    for (lc_arena_block *x = b; x; x = x->next)
        if (x->cap - x->used >= bytes) {
            void *p = x->data + x->used;
            x->used += bytes;
            return p;
        }
    size_t cap = bytes > LC_SCRATCH_BLOCK ? bytes : LC_SCRATCH_BLOCK;
    if (!pie_budget_take(hi->h->cfg.budget, sizeof(lc_arena_block) + cap)) return NULL;
    lc_arena_block *nb = malloc(sizeof *nb + cap);
    if (nb == NULL) {
        pie_budget_give(hi->h->cfg.budget, sizeof *nb + cap);
        return NULL;
    }
    nb->cap = cap;
    nb->used = bytes;
    if (b == NULL) {
        nb->next = NULL;
        hi->arena = nb;
    } else {
        nb->next = b->next;
        b->next = nb;
    }
    return nb->data;
}

uint32_t *lc_host_u32s(lc_host_inst *hi, lc_wasm_instance *inst, const char *fn, uint32_t addr,
                       uint32_t n) {
    const void *src = lc_host_mem(inst, fn, addr, (uint64_t)n * 4);
    uint32_t *dst = lc_host_scratch(hi, (size_t)n * 4 + 4);
    if (dst && n) memcpy(dst, src, (size_t)n * 4); /* wasm pointers need not be aligned */
    return dst;
}

uint32_t lc_host_out(lc_host_inst *hi, lc_wasm_instance *inst, const char *fn, uint32_t buf,
                     uint32_t cap, const void *data, size_t len) {
    uint8_t *dst = lc_host_mem(inst, fn, buf, cap);
    if (len > INT32_MAX)
        return lc_host_fail(hi, PIE_OUT_OF_RANGE, "%s: result of %zu bytes is too large", fn, len);
    if (len) memcpy(dst, data, len < cap ? len : cap);
    return (uint32_t)len;
}

static void inst_terminate(lc_host_inst *hi, pie_code code, const char *msg);

/* Moves the staged parts to the session; false (st says why) if the session they were made for
 * is gone or could not take them. */
static bool inst_flush(lc_host_inst *hi, pie_status *st) {
    bool woken = atomic_exchange(&hi->gather_woken, false);
    if (hi->stage.len == 0 && !woken) return true;
    if (lc_session_flush(hi->h->session, hi->epoch, &hi->stage, woken, st) == PIE_OK) return true;
    pie_log_debug("lc.host.flush_dropped", "instance=%llx error=\"%s\"",
                  (unsigned long long)hi->id, st->msg);
    return false;
}

/* The instance was counted as woken by results (on_down) and will stage nothing more for now:
 * the session's sender must not hold its send for it (lc_session_gather_add). May run under
 * hi->mu: lock order hi->mu, then the session's outbox lock; nothing takes them the other way. */
static void gather_release(lc_host_inst *hi) {
    if (!atomic_exchange(&hi->gather_woken, false)) return;
    lc_session_stage none = {0};
    pie_status st;
    (void)lc_session_flush(hi->h->session, hi->epoch, &none, true, &st); /* nothing: no error */
}

void lc_host_inst_flush(lc_host_inst *hi) {
    /* A Session that reconnected forgot this instance, or its calls could not be queued: they
     * would never be answered. */
    pie_status st;
    if (!inst_flush(hi, &st)) inst_terminate(hi, PIE_UNAVAILABLE, st.msg);
}

void lc_host_inst_ref(lc_host_inst *hi) { atomic_fetch_add(&hi->refs, 1); }

/* ---- futures ---------------------------------------------------------------------------------- */

static void future_free(lc_future *f) {
    if (f == NULL) return;
    free(f->msg);
    free(f->payload);
    free(f);
}

lc_future *lc_host_future_arm(lc_host_inst *hi, uint32_t fid, uint8_t kind) {
    if (hi->futures.n >= LC_MAX_FUTURES) return NULL; /* callers report RESOURCE_EXHAUSTED */
    lc_future *f = calloc(1, sizeof *f);
    if (f == NULL) return NULL;
    f->id = fid;
    f->kind = kind;
    f->serial = ++hi->next_serial;
    if (pie_map64_put(&hi->futures, fid, f) != 0) {
        free(f);
        return NULL;
    }
    return f;
}

void lc_host_future_resolve(lc_host_inst *hi, lc_future *f, pie_code code, const char *msg,
                            uint8_t *payload, size_t len) {
    if (f->done) {
        free(payload);
        return;
    }
    f->done = true;
    f->code = code;
    if (code != PIE_OK) {
        f->msg = strdup(msg && msg[0] ? msg : pie_code_name(code));
        free(payload);
    } else {
        f->payload = payload;
        f->len = len;
    }
    if (hi->defer_wake)
        hi->wake_due = true;
    else
        pthread_cond_broadcast(&hi->cv);
}

/* Fails every pending future (under hi->mu). */
static void futures_fail_all(lc_host_inst *hi, pie_code code, const char *msg) {
    for (size_t i = 0; i < hi->futures.cap; i++)
        if (hi->futures.cells[i].key)
            lc_host_future_resolve(hi, hi->futures.cells[i].val, code, msg, NULL, 0);
}

/* ---- inboxes ---------------------------------------------------------------------------------- */

static void waiter_remove(lc_inbox *b, uint32_t fid) {
    for (size_t i = 0; i < b->n_waiters; i++)
        if (b->waiters[i] == fid) {
            memmove(b->waiters + i, b->waiters + i + 1, (b->n_waiters - i - 1) * sizeof *b->waiters);
            b->n_waiters--;
            return;
        }
}

bool lc_host_inbox_put(lc_host_inst *hi, lc_inbox *b, const void *a, size_t alen, const void *m,
                       size_t mlen) {
    uint8_t *p = malloc(alen + mlen + 1);
    if (p == NULL) return false;
    if (alen) memcpy(p, a, alen);
    if (mlen) memcpy(p + alen, m, mlen);
    while (b->n_waiters) {
        uint32_t fid = b->waiters[0];
        memmove(b->waiters, b->waiters + 1, (b->n_waiters - 1) * sizeof *b->waiters);
        b->n_waiters--;
        lc_future *f = pie_map64_get(&hi->futures, fid);
        if (f && !f->done && (f->kind == LC_FUT_RECEIVE || f->kind == LC_FUT_SUBSCRIPTION)) {
            lc_host_future_resolve(hi, f, PIE_OK, NULL, p, alen + mlen);
            return true;
        }
    }
    if (!pie_budget_take(hi->h->cfg.budget, alen + mlen)) { /* the replica is full */
        free(p);
        return false;
    }
    lc_msg *msg = malloc(sizeof *msg + alen + mlen);
    if (msg == NULL) {
        pie_budget_give(hi->h->cfg.budget, alen + mlen);
        free(p);
        return false;
    }
    msg->next = NULL;
    msg->len = alen + mlen;
    memcpy(msg->data, p, alen + mlen);
    free(p);
    if (b->tail)
        b->tail->next = msg;
    else
        b->head = msg;
    b->tail = msg;
    b->n++;
    b->bytes += msg->len;
    return true;
}

uint32_t lc_host_inbox_arm(lc_host_inst *hi, lc_inbox *b, uint32_t fid, uint8_t kind,
                           bool closed) {
    if (b->head == NULL && !closed && b->n_waiters == b->cap_waiters) {
        size_t cap = b->cap_waiters ? b->cap_waiters * 2 : 4;
        uint32_t *w = realloc(b->waiters, cap * sizeof *w);
        if (w == NULL) return lc_host_fail(hi, PIE_RESOURCE_EXHAUSTED, "out of memory");
        b->waiters = w;
        b->cap_waiters = cap;
    }
    lc_future *f = lc_host_future_arm(hi, fid, kind);
    if (f == NULL)
        return lc_host_fail(hi, PIE_RESOURCE_EXHAUSTED,
                            "future %u: out of memory or more than %u futures armed", fid,
                            LC_MAX_FUTURES);
    if (b->head) {
        lc_msg *m = b->head;
        b->head = m->next;
        if (b->head == NULL) b->tail = NULL;
        b->n--;
        b->bytes -= m->len;
        pie_budget_give(hi->h->cfg.budget, m->len);
        uint8_t *p = malloc(m->len + 1);
        if (p) memcpy(p, m->data, m->len);
        lc_host_future_resolve(hi, f, p ? PIE_OK : PIE_RESOURCE_EXHAUSTED, "out of memory", p,
                               m->len);
        free(m);
    } else if (closed) {
        lc_host_future_resolve(hi, f, PIE_OUT_OF_RANGE, "input closed", NULL, 0);
    } else {
        b->waiters[b->n_waiters++] = fid;
    }
    return 0;
}

static void inbox_free(lc_host *h, lc_inbox *b) {
    pie_budget_give(h->cfg.budget, b->bytes);
    for (lc_msg *m = b->head; m;) {
        lc_msg *n = m->next;
        free(m);
        m = n;
    }
    free(b->waiters);
    *b = (lc_inbox){0};
}

/* ---- waiting ---------------------------------------------------------------------------------- */

static uint64_t now_ns(void) { return (uint64_t)rpc_now_ns(); }

/* Waits on hi->cv (mu held) until deadline_ns (UINT64_MAX: none), the instance's wall deadline
 * or an interrupt; returns false when it should stop waiting. */
static bool wait_step(lc_host_inst *hi, lc_wasm_instance *inst, uint64_t deadline_ns) {
    if (lc_wasm_interrupted(inst)) return false;
    uint64_t now = now_ns();
    if (now >= deadline_ns) return false;
    uint64_t until = deadline_ns;
    uint64_t wall = lc_wasm_wall_deadline_ns(inst);
    /* Past the wall deadline the watchdog interrupts us any moment: poll for it. */
    if (wall <= now) until = now + 5000000;
    else if (wall < until) until = wall;
    /* Woken by results that did not end this wait (another future's): it stages nothing now. */
    gather_release(hi);
    if (until == UINT64_MAX) {
        pthread_cond_wait(&hi->cv, &hi->mu);
    } else {
        struct timespec ts = {.tv_sec = (time_t)(until / 1000000000u),
                              .tv_nsec = (long)(until % 1000000000u)};
        pthread_cond_timedwait(&hi->cv, &hi->mu, &ts);
    }
    return true;
}

static uint64_t deadline_of(int64_t timeout_ms) {
    uint64_t now = now_ns();
    if (timeout_ms < 0 || (uint64_t)timeout_ms > (UINT64_MAX - now) / 1000000u) return UINT64_MAX;
    return now + (uint64_t)timeout_ms * 1000000u;
}

/* ---- pie functions: futures ------------------------------------------------------------------- */

uint32_t Z_pieZ_future_poll(struct Z_pie_instance_t *pie, uint32_t fid) {
    lc_wasm_host_enter(pie);
    lc_host_inst *hi = pie->host;
    atomic_fetch_add(&hi->api_calls, 1);
    lc_host_inst_flush(hi);
    pthread_mutex_lock(&hi->mu);
    lc_future *f = pie_map64_get(&hi->futures, fid);
    int done = f ? f->done : -1;
    pthread_mutex_unlock(&hi->mu);
    if (done < 0) return lc_host_fail(hi, PIE_NOT_FOUND, "future_poll: future %u is not armed", fid);
    return (uint32_t)done;
}

uint32_t Z_pieZ_future_wait(struct Z_pie_instance_t *pie, uint32_t fid, uint64_t timeout_ms) {
    lc_wasm_instance *inst = lc_wasm_host_enter(pie);
    lc_host_inst *hi = pie->host;
    atomic_fetch_add(&hi->api_calls, 1);
    lc_host_inst_flush(hi);
    uint64_t deadline = deadline_of((int64_t)timeout_ms);
    pthread_mutex_lock(&hi->mu);
    lc_future *f;
    while ((f = pie_map64_get(&hi->futures, fid)) != NULL && !f->done &&
           wait_step(hi, inst, deadline)) {}
    int r = f ? f->done : -1;
    pthread_mutex_unlock(&hi->mu);
    lc_wasm_host_checkpoint(inst);
    if (r < 0) return lc_host_fail(hi, PIE_NOT_FOUND, "future_wait: future %u is not armed", fid);
    return (uint32_t)r;
}

uint32_t Z_pieZ_future_wait_any(struct Z_pie_instance_t *pie, uint32_t ids, uint32_t n,
                                 uint64_t timeout_ms) {
    lc_wasm_instance *inst = lc_wasm_host_enter(pie);
    lc_host_inst *hi = pie->host;
    atomic_fetch_add(&hi->api_calls, 1);
    lc_host_scratch_reset(hi);
    if (n == 0 || n > PIE_MAX_IDS)
        return lc_host_fail(hi, PIE_INVALID_ARGUMENT, "future_wait_any: n is %u, must be 1..%u", n,
                            PIE_MAX_IDS);
    uint32_t *v = lc_host_u32s(hi, inst, "future_wait_any", ids, n);
    if (v == NULL) return lc_host_fail(hi, PIE_RESOURCE_EXHAUSTED, "out of memory");
    lc_host_inst_flush(hi);
    uint64_t deadline = deadline_of((int64_t)timeout_ms);
    int64_t found = -1;
    uint32_t missing = 0;
    bool any_missing = false;
    pthread_mutex_lock(&hi->mu);
    for (;;) {
        for (uint32_t i = 0; i < n && found < 0 && !any_missing; i++) {
            lc_future *f = pie_map64_get(&hi->futures, v[i]);
            if (f == NULL) {
                any_missing = true;
                missing = v[i];
            } else if (f->done) {
                found = i;
            }
        }
        if (found >= 0 || any_missing || !wait_step(hi, inst, deadline)) break;
    }
    pthread_mutex_unlock(&hi->mu);
    lc_wasm_host_checkpoint(inst);
    if (any_missing)
        return lc_host_fail(hi, PIE_NOT_FOUND, "future_wait_any: future %u is not armed", missing);
    if (found < 0)
        return lc_host_fail(hi, PIE_DEADLINE_EXCEEDED,
                            "future_wait_any: none of %u futures resolved within %lld ms", n,
                            (long long)timeout_ms);
    return (uint32_t)found;
}

uint32_t Z_pieZ_future_result(struct Z_pie_instance_t *pie, uint32_t fid, uint32_t buf,
                              uint32_t cap) {
    lc_wasm_instance *inst = lc_wasm_host_enter(pie);
    lc_host_inst *hi = pie->host;
    atomic_fetch_add(&hi->api_calls, 1);
    uint8_t *dst = lc_host_mem(inst, "future_result", buf, cap);
    lc_host_inst_flush(hi);
    pthread_mutex_lock(&hi->mu);
    lc_future *f;
    while ((f = pie_map64_get(&hi->futures, fid)) != NULL && !f->done &&
           wait_step(hi, inst, UINT64_MAX)) {}
    bool ready = f && f->done;
    pthread_mutex_unlock(&hi->mu);
    lc_wasm_host_checkpoint(inst);
    if (f == NULL) return lc_host_fail(hi, PIE_NOT_FOUND, "future_result: future %u is not armed", fid);
    if (!ready) /* only an interrupt ends the wait, and the checkpoint did not return then */
        return lc_host_fail(hi, PIE_ABORTED, "future_result: future %u: wait interrupted", fid);
    /* Resolved futures are touched by this thread only: no lock needed from here. */
    if (f->code != PIE_OK) {
        uint32_t rc = lc_host_fail(hi, f->code, "%s", f->msg ? f->msg : "");
        pthread_mutex_lock(&hi->mu);
        pie_map64_del(&hi->futures, fid);
        pthread_mutex_unlock(&hi->mu);
        future_free(f);
        return rc;
    }
    if (f->len > INT32_MAX)
        return lc_host_fail(hi, PIE_OUT_OF_RANGE, "future_result: payload of %zu bytes", f->len);
    size_t len = f->len;
    if (len) memcpy(dst, f->payload, len < cap ? len : cap);
    if (cap >= len) {
        pthread_mutex_lock(&hi->mu);
        pie_map64_del(&hi->futures, fid);
        pthread_mutex_unlock(&hi->mu);
        future_free(f);
    }
    return (uint32_t)len;
}

uint32_t Z_pieZ_future_drop(struct Z_pie_instance_t *pie, uint32_t fid) {
    lc_wasm_host_enter(pie);
    lc_host_inst *hi = pie->host;
    atomic_fetch_add(&hi->api_calls, 1);
    pthread_mutex_lock(&hi->mu);
    lc_future *f = pie_map64_del(&hi->futures, fid);
    if (f && (f->kind == LC_FUT_RECEIVE || f->kind == LC_FUT_SUBSCRIPTION)) {
        waiter_remove(&hi->inbox, fid);
        waiter_remove(&hi->subs, fid);
    }
    pthread_mutex_unlock(&hi->mu);
    if (f == NULL) return lc_host_fail(hi, PIE_NOT_FOUND, "future_drop: future %u is not armed", fid);
    future_free(f); /* a result still to come finds no future with its serial and is dropped */
    return 0;
}

/* ---- results and events from the controller --------------------------------------------------- */

static lc_host_inst *inst_get(lc_host *h, uint64_t id) {
    pthread_mutex_lock(&h->mu);
    lc_host_inst *hi = pie_map64_get(&h->insts, id);
    if (hi) lc_host_inst_ref(hi);
    pthread_mutex_unlock(&h->mu);
    return hi;
}

/* Marks the instance ended by the controller, tells the manager, then fails its futures. The
 * manager hears first so that it can interrupt the run: an inferlet woken by a failed future
 * could otherwise finish as if nothing happened before the manager knows. */
static void inst_terminate(lc_host_inst *hi, pie_code code, const char *msg) {
    pthread_mutex_lock(&hi->mu);
    bool first = !hi->ended && !hi->terminated;
    bool call = first && !hi->closed && hi->cb.terminated;
    if (first) {
        hi->dead_code = code;
        hi->dead_msg = strdup(msg);
        hi->terminated = true; /* new calls fail at once from here on */
    }
    if (call) hi->cb_busy++;
    pthread_mutex_unlock(&hi->mu);
    if (!first) return;
    if (call) {
        pie_counter_add(hi->h->c_terminated, 1);
        hi->cb.terminated(hi->cb.ctx, code, msg);
    }
    pthread_mutex_lock(&hi->mu);
    if (!hi->ended) futures_fail_all(hi, code, msg);
    if (call) hi->cb_busy--;
    pthread_cond_broadcast(&hi->cv);
    pthread_mutex_unlock(&hi->mu);
}

static void on_delivery(lc_host *h, const Pie__V1__TopicDelivery *d) {
    uint32_t tl = (uint32_t)strlen(d->topic);
    uint8_t hdr[4 + PIE_MAX_NAME_BYTES];
    if (tl > PIE_MAX_NAME_BYTES) return;
    memcpy(hdr, &tl, 4);
    memcpy(hdr + 4, d->topic, tl);
    for (size_t i = 0; i < d->n_instance_ids; i++) {
        lc_host_inst *hi = inst_get(h, d->instance_ids[i]);
        if (hi == NULL) continue;
        pthread_mutex_lock(&hi->mu);
        /* A subscriber that never reads must not grow without bound: drop beyond the caps. */
        if (!hi->ended && !hi->terminated) {
            if (hi->subs.n >= LC_MAX_SUBS_MSGS ||
                hi->subs.bytes + 4 + tl + d->message.len > LC_MAX_SUBS_BYTES ||
                !lc_host_inbox_put(hi, &hi->subs, hdr, 4 + tl, d->message.data, d->message.len))
                hi->subs_dropped++;
        }
        pthread_mutex_unlock(&hi->mu);
        lc_host_inst_unref(hi);
    }
}

/* Applies results[i..] that belong to hi's instance (one lock) and wakes the instance once if
 * they resolved a future; returns the index after them. */
static size_t down_results(lc_host *h, lc_host_inst *hi, const Pie__V1__SessionDown *down,
                           size_t i) {
    pthread_mutex_lock(&hi->mu);
    hi->defer_wake = true;
    for (; i < down->n_results && down->results[i]->instance_id == hi->id; i++)
        if (!hi->ended && !hi->terminated) lc_host_call_result(hi, down->results[i]);
    hi->defer_wake = false;
    bool wake = hi->wake_due;
    hi->wake_due = false;
    /* Counted before the instance can run (and flush) again; at most once until it does. */
    if (wake && !atomic_exchange(&hi->gather_woken, true)) lc_session_gather_add(h->session);
    pthread_mutex_unlock(&hi->mu);
    if (wake) pthread_cond_broadcast(&hi->cv); /* hi is referenced: cv stays valid */
    return i;
}

static void on_down(void *ctx, const Pie__V1__SessionDown *down) {
    lc_host *h = ctx;
    for (size_t i = 0; i < down->n_results;) {
        lc_host_inst *hi = inst_get(h, down->results[i]->instance_id);
        if (hi == NULL) {
            i++;
            continue;
        }
        i = down_results(h, hi, down, i);
        lc_host_inst_unref(hi);
    }
    for (size_t i = 0; i < down->n_events; i++) {
        const Pie__V1__SessionEvent *e = down->events[i];
        if (e->event_case == PIE__V1__SESSION_EVENT__EVENT_INSTANCE_TERMINATED) {
            const Pie__V1__InstanceTerminated *t = e->instance_terminated;
            lc_host_inst *x = inst_get(h, t->instance_id);
            if (x == NULL) continue;
            pie_code code = t->status && t->status->code ? (pie_code)t->status->code : PIE_ABORTED;
            inst_terminate(x, code, t->status && t->status->message[0]
                                        ? t->status->message
                                        : "terminated by the controller");
            lc_host_inst_unref(x);
        } else if (e->event_case == PIE__V1__SESSION_EVENT__EVENT_DELIVERY) {
            on_delivery(h, e->delivery);
        }
    }
}

/* The controller forgot every instance: end them all with UNAVAILABLE and why. */
static void on_lost(void *ctx, const pie_status *why) {
    lc_host *h = ctx;
    pthread_mutex_lock(&h->mu);
    size_t n = 0, live = h->insts.n;
    lc_host_inst **v = live ? malloc(live * sizeof *v) : NULL;
    for (size_t i = 0; v && i < h->insts.cap; i++)
        if (h->insts.cells[i].key) {
            v[n] = h->insts.cells[i].val;
            lc_host_inst_ref(v[n++]);
        }
    pthread_mutex_unlock(&h->mu);
    if (live && v == NULL) pie_log_error("lc.host.session_lost", "error=\"out of memory\"");
    char msg[PIE_STATUS_MSG_MAX + 32];
    snprintf(msg, sizeof msg, "controller session lost: %s",
             why && why->msg[0] ? why->msg : "the stream ended");
    for (size_t i = 0; i < n; i++) {
        inst_terminate(v[i], PIE_UNAVAILABLE, msg);
        lc_host_inst_unref(v[i]);
    }
    free(v);
}

/* ---- host lifetime ---------------------------------------------------------------------------- */

lc_host *lc_host_create(const lc_host_config *cfg, lc_session *session, pie_metrics *metrics,
                        pie_status *st) {
    lc_host *h = calloc(1, sizeof *h);
    if (h == NULL) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    h->cfg = *cfg;
    h->session = session;
    h->http_allow = strdup(cfg->http_allow ? cfg->http_allow : "");
    h->tokenizer_path = strdup(cfg->tokenizer_path ? cfg->tokenizer_path : "");
    if (!h->http_allow || !h->tokenizer_path || pthread_mutex_init(&h->mu, NULL) != 0) {
        free(h->http_allow);
        free(h->tokenizer_path);
        free(h);
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    if (pthread_mutex_init(&h->models_mu, NULL) != 0) {
        pthread_mutex_destroy(&h->mu);
        free(h->http_allow);
        free(h->tokenizer_path);
        free(h);
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    h->cfg.http_allow = h->http_allow;
    h->cfg.tokenizer_path = h->tokenizer_path;
    if (cfg->tokreg) {
        h->tokreg = cfg->tokreg;
    } else {
        lc_tokreg_config tc = {.path = h->tokenizer_path};
        h->tokreg = lc_tokreg_create(&tc, st);
        h->own_tokreg = true;
    }
    lc_http_config hc = {.allow = h->http_allow,
                         .timeout_ms = cfg->http_timeout_ms,
                         .max_bytes = cfg->http_max_bytes,
                         .max_running = cfg->http_max_running,
                         .budget = cfg->budget,
                         .metrics = metrics};
    if (h->tokreg) h->http = lc_http_create(&hc, st);
    if (h->http == NULL) {
        lc_host_destroy(h);
        return NULL;
    }
    h->c_terminated = pie_metrics_counter(metrics, "pie_lifecycle_instances_terminated_total",
                                          "Instances ended by the controller or a lost Session.",
                                          NULL, 0, NULL);
    lc_session_sink sink = {.ctx = h, .on_down = on_down, .on_lost = on_lost};
    lc_session_set_sink(session, &sink);
    return h;
}

void lc_host_destroy(lc_host *h) {
    if (h == NULL) return;
    lc_http_destroy(h->http); /* its callbacks release the instances they hold */
    if (h->own_tokreg) lc_tokreg_destroy(h->tokreg);
    lc_host_models_free(h);
    pie_map64_free(&h->insts);
    pthread_mutex_destroy(&h->models_mu);
    pthread_mutex_destroy(&h->mu);
    free(h->http_allow);
    free(h->tokenizer_path);
    free(h);
}

/* ---- instance lifetime ------------------------------------------------------------------------ */

static int inst_init_sync(lc_host_inst *hi) {
    if (pthread_mutex_init(&hi->mu, NULL) != 0) return -1;
    pthread_condattr_t ca;
    int rc = pthread_condattr_init(&ca);
    if (rc == 0) {
        rc = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        if (rc == 0) rc = pthread_cond_init(&hi->cv, &ca);
        pthread_condattr_destroy(&ca);
    }
    if (rc != 0) pthread_mutex_destroy(&hi->mu);
    return rc;
}

lc_host_inst *lc_host_inst_begin(lc_host *h, uint64_t instance_id, const char *program_id,
                                 const char *model, const Pie__V1__ResourceLimits *limits,
                                 const Pie__V1__Tenant *tenant, const lc_host_inst_cb *cb,
                                 pie_status *st) {
    uint64_t epoch = lc_session_epoch(h->session);
    if (epoch == 0) {
        pie_status_set(st, PIE_UNAVAILABLE, "not connected to the controller");
        return NULL;
    }
    lc_host_inst *hi = calloc(1, sizeof *hi);
    if (hi == NULL) goto oom;
    if (inst_init_sync(hi) != 0) {
        free(hi);
        goto oom;
    }
    hi->h = h;
    atomic_init(&hi->refs, 1);
    atomic_init(&hi->api_calls, 0);
    atomic_init(&hi->http_cancel, false);
    hi->id = instance_id;
    hi->epoch = epoch;
    hi->program_id = strdup(program_id ? program_id : "");
    hi->model = strdup(model ? model : "");
    if (tenant && tenant->name && strcmp(tenant->name, PIE_TENANT_ANONYMOUS) != 0)
        snprintf(hi->tenant, sizeof hi->tenant, "%s", tenant->name);
    if (limits) {
        hi->limits = *limits;
        hi->limits.base.n_unknown_fields = 0;
        hi->limits.base.unknown_fields = NULL;
    } else {
        pie__v1__resource_limits__init(&hi->limits);
    }
    if (cb) hi->cb = *cb;
    Pie__V1__InstanceBegin b = PIE__V1__INSTANCE_BEGIN__INIT;
    b.instance_id = instance_id;
    b.program_id = hi->program_id;
    b.model = hi->model;
    b.limits = &hi->limits;
    b.tenant = (Pie__V1__Tenant *)tenant; /* packed right away by lc_session_stage_add */
    if (!hi->program_id || !hi->model) goto fail;
    if (lc_session_stage_add(&hi->stage, LC_SESSION_BEGIN, &b.base, st) != PIE_OK) goto fail;
    pthread_mutex_lock(&h->mu);
    int rc = pie_map64_get(&h->insts, instance_id) ? 1 : pie_map64_put(&h->insts, instance_id, hi);
    pthread_mutex_unlock(&h->mu);
    if (rc != 0) {
        if (rc == 1)
            pie_status_set(st, PIE_ALREADY_EXISTS, "instance %llx is already registered",
                           (unsigned long long)instance_id);
        else
            pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
        lc_host_inst_unref(hi);
        return NULL;
    }
    pie_status fst;
    if (!inst_flush(hi, &fst)) { /* the controller knows the instance from now on */
        pthread_mutex_lock(&h->mu);
        pie_map64_del(&h->insts, instance_id);
        pthread_mutex_unlock(&h->mu);
        lc_host_inst_unref(hi);
        pie_status_set(st, PIE_UNAVAILABLE, "%s", fst.msg);
        return NULL;
    }
    return hi;
fail:
    lc_host_inst_unref(hi);
oom:
    pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
    return NULL;
}

pie_code lc_host_inst_message(lc_host_inst *hi, const void *msg, size_t len, pie_status *st) {
    pthread_mutex_lock(&hi->mu);
    size_t queued = hi->inbox.n, queued_bytes = hi->inbox.bytes;
    bool full = queued >= LC_MAX_INBOX_MSGS || queued_bytes + len > LC_MAX_INBOX_BYTES;
    bool closed = hi->input_closed;
    bool ok = closed || full ? false : lc_host_inbox_put(hi, &hi->inbox, NULL, 0, msg, len);
    pthread_mutex_unlock(&hi->mu);
    if (closed) return pie_status_set(st, PIE_FAILED_PRECONDITION, "the input is closed");
    if (full)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "the inferlet has not read %zu messages (%zu bytes) sent to it; "
                              "at most %u messages or %u bytes wait",
                              queued, queued_bytes, LC_MAX_INBOX_MSGS, LC_MAX_INBOX_BYTES);
    if (!ok) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
    return PIE_OK;
}

void lc_host_inst_close_input(lc_host_inst *hi) {
    pthread_mutex_lock(&hi->mu);
    hi->input_closed = true;
    /* The inbox is empty exactly when waiters exist: all of them learn the input ended. */
    for (size_t i = 0; i < hi->inbox.n_waiters; i++) {
        lc_future *f = pie_map64_get(&hi->futures, hi->inbox.waiters[i]);
        if (f && f->kind == LC_FUT_RECEIVE)
            lc_host_future_resolve(hi, f, PIE_OUT_OF_RANGE, "input closed", NULL, 0);
    }
    hi->inbox.n_waiters = 0;
    pthread_mutex_unlock(&hi->mu);
}

void lc_host_inst_wake(void *p) {
    lc_host_inst *hi = p;
    pthread_mutex_lock(&hi->mu);
    pthread_cond_broadcast(&hi->cv);
    pthread_mutex_unlock(&hi->mu);
}

void lc_host_inst_usage(lc_host_inst *hi, Pie__V1__ResourceUsage *u) {
    pthread_mutex_lock(&hi->mu);
    u->kv_pages = hi->kv_pages;
    u->embeddings = hi->embeds;
    u->queues = hi->queues_held;
    pthread_mutex_unlock(&hi->mu);
    u->api_calls = atomic_load(&hi->api_calls);
}

void lc_host_inst_end(lc_host_inst *hi, pie_code code, const char *msg) {
    if (hi == NULL) return;
    atomic_store(&hi->http_cancel, true);
    pthread_mutex_lock(&hi->mu);
    bool send = !hi->ended && !hi->terminated;
    hi->ended = true;
    futures_fail_all(hi, PIE_CANCELLED, "the instance ended");
    pthread_mutex_unlock(&hi->mu);
    if (!send) {
        hi->stage.len = hi->stage.n = 0;
        return;
    }
    Pie__V1__Status s = PIE__V1__STATUS__INIT;
    s.code = (uint32_t)code;
    s.message = (char *)(msg ? msg : "");
    Pie__V1__InstanceEnd e = PIE__V1__INSTANCE_END__INIT;
    e.instance_id = hi->id;
    e.status = &s;
    pie_status st;
    if (lc_session_stage_add(&hi->stage, LC_SESSION_END, &e.base, &st) != PIE_OK)
        pie_log_error("lc.host.end_failed", "instance=%llx error=\"%s\"",
                      (unsigned long long)hi->id, st.msg);
    pie_status fst; /* a failure ends the Session, which forgets the instance: nothing to do */
    (void)inst_flush(hi, &fst); /* its last calls, then the end, in one part of the outbox */
}

static void inst_destroy(lc_host_inst *hi) {
    for (size_t i = 0; i < hi->futures.cap; i++)
        if (hi->futures.cells[i].key) future_free(hi->futures.cells[i].val);
    for (size_t i = 0; i < hi->calls.cap; i++)
        if (hi->calls.cells[i].key) free(hi->calls.cells[i].val);
    for (size_t i = 0; i < hi->queues.cap; i++)
        if (hi->queues.cells[i].key) lc_queue_free(hi->queues.cells[i].val);
    pie_map64_free(&hi->futures);
    pie_map64_free(&hi->calls);
    pie_map64_free(&hi->queues);
    inbox_free(hi->h, &hi->inbox);
    inbox_free(hi->h, &hi->subs);
    pie_budget_give(hi->h->cfg.budget, hi->pending_bytes); /* calls never answered */
    lc_host_scratch_reset(hi);
    if (hi->arena) scratch_free_block(hi, hi->arena);
    lc_session_stage_free(&hi->stage);
    free(hi->program_id);
    free(hi->model);
    free(hi->dead_msg);
    pthread_cond_destroy(&hi->cv);
    pthread_mutex_destroy(&hi->mu);
    free(hi);
}

void lc_host_inst_unref(lc_host_inst *hi) {
    if (atomic_fetch_sub(&hi->refs, 1) != 1) return;
    gather_release(hi); /* woken by results it never got to flush after */
    inst_destroy(hi);
}

void lc_host_inst_free(lc_host_inst *hi) {
    if (hi == NULL) return;
    lc_host *h = hi->h;
    atomic_store(&hi->http_cancel, true);
    pthread_mutex_lock(&h->mu);
    if (pie_map64_get(&h->insts, hi->id) == hi) pie_map64_del(&h->insts, hi->id);
    pthread_mutex_unlock(&h->mu);
    pthread_mutex_lock(&hi->mu);
    hi->closed = true;
    while (hi->cb_busy) pthread_cond_wait(&hi->cv, &hi->mu); /* a terminated() in progress */
    pthread_mutex_unlock(&hi->mu);
    lc_host_inst_unref(hi);
}

/* ---- the import module ------------------------------------------------------------------------ */


static const lc_wasm_host_fn host_fns[] = {
    LC_WASM_HOST_FN(last_error, "(param i32 i32) (result i32)"),
    LC_WASM_HOST_FN(instance_id, "(result i64)"),
    LC_WASM_HOST_FN(send, "(param i32 i32) (result i32)"),
    LC_WASM_HOST_FN(receive, "(param i32) (result i32)"),
    LC_WASM_HOST_FN(future_poll, "(param i32) (result i32)"),
    LC_WASM_HOST_FN(future_wait, "(param i32 i64) (result i32)"),
    LC_WASM_HOST_FN(future_wait_any, "(param i32 i32 i64) (result i32)"),
    LC_WASM_HOST_FN(future_result, "(param i32 i32 i32) (result i32)"),
    LC_WASM_HOST_FN(future_drop, "(param i32) (result i32)"),
    LC_WASM_HOST_FN(model_count, "(result i32)"),
    LC_WASM_HOST_FN(model_name, "(param i32 i32 i32) (result i32)"),
    LC_WASM_HOST_FN(model_info, "(param i32 i32 i32) (result i32)"),
    LC_WASM_HOST_FN(model_traits, "(param i32 i32 i32 i32) (result i32)"),
    LC_WASM_HOST_FN(model_stop_tokens, "(param i32 i32 i32 i32) (result i32)"),
    LC_WASM_HOST_FN(tokenize, "(param i32 i32 i32 i32 i32 i32 i32) (result i32)"),
    LC_WASM_HOST_FN(detokenize, "(param i32 i32 i32 i32 i32 i32) (result i32)"),
    LC_WASM_HOST_FN(token_bytes, "(param i32 i32 i32 i32 i32) (result i32)"),
    LC_WASM_HOST_FN(create_queue, "(param i32 i32 i32) (result i32)"),
    LC_WASM_HOST_FN(destroy_queue, "(param i32) (result i32)"),
    LC_WASM_HOST_FN(set_queue_priority, "(param i32 i32) (result i32)"),
    LC_WASM_HOST_FN(synchronize, "(param i32 i32) (result i32)"),
    LC_WASM_HOST_FN(alloc_kv_pages, "(param i32 i32 i32) (result i32)"),
    LC_WASM_HOST_FN(dealloc_kv_pages, "(param i32 i32 i32) (result i32)"),
    LC_WASM_HOST_FN(alloc_embeds, "(param i32 i32 i32) (result i32)"),
    LC_WASM_HOST_FN(dealloc_embeds, "(param i32 i32 i32) (result i32)"),
    LC_WASM_HOST_FN(copy_kv_page, "(param i32 i32 i32 i32 i32 i32) (result i32)"),
    LC_WASM_HOST_FN(mask_kv_page, "(param i32 i32 i32 i32) (result i32)"),
    LC_WASM_HOST_FN(export_kv_pages, "(param i32 i32 i32 i32 i32 i32) (result i32)"),
    LC_WASM_HOST_FN(unexport_kv_pages, "(param i32 i32 i32) (result i32)"),
    LC_WASM_HOST_FN(import_kv_pages, "(param i32 i32 i32 i32 i32 i32) (result i32)"),
    LC_WASM_HOST_FN(list_exports, "(param i32) (result i32)"),
    LC_WASM_HOST_FN(embed_text, "(param i32 i32 i32 i32 i32) (result i32)"),
    LC_WASM_HOST_FN(forward, "(param i32 i32) (result i32)"),
    LC_WASM_HOST_FN(next_dist, "(param i32 i32 i32 i32 f32 i32) (result i32)"),
    LC_WASM_HOST_FN(broadcast, "(param i32 i32 i32 i32) (result i32)"),
    LC_WASM_HOST_FN(subscribe, "(param i32 i32) (result i32)"),
    LC_WASM_HOST_FN(unsubscribe, "(param i32 i32) (result i32)"),
    LC_WASM_HOST_FN(subscription_receive, "(param i32) (result i32)"),
    LC_WASM_HOST_FN(http_request, "(param i32 i32 i32 i32 i32 i32 i32 i32 i32) (result i32)"),
};


const lc_wasm_host_fn *lc_host_fns(size_t *n) {
    *n = sizeof host_fns / sizeof host_fns[0];
    return host_fns;
}
