/* lc_session.c — see lc_session.h. */
#include "lc_session.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "pie/v1/controller.pb-c.h"
#include "pie/v1/lifecycle.pb-c.h"
#include "pie_log.h"
#include "svc.h"

struct lc_session {
    lc_session_config cfg;
    svc *sv; /* for cfg.ready_health; set by lc_session_start */
    char replica_id[320];
    rpc_channel *ch;
    rpc_link *link;
    _Atomic uint32_t replica_index; /* from the controller's welcome; 0 while not connected */
    pthread_mutex_t mu;             /* guards models */
    Pie__V1__SessionDown *models;   /* kept message holding the last ModelsChanged */
    Pie__V1__ModelsChanged *models_changed;
    _Atomic uint64_t models_gen; /* bumped by take_models */
    rpc_method methods[1];
    pie_gauge *g_connected, *g_models;
    pie_counter *c_up; /* SessionUp messages sent */
    lc_session_sink sink;
    lc_session_store_hooks store;
    lc_session_model_gate gate;

    /* Outbound: instance threads append packed parts to out; the sender thread swaps it out and
     * sends it as one SessionUp (split only above LC_SESSION_UP_MAX bytes or
     * LC_SESSION_UP_PARTS parts). */
    pthread_mutex_t out_mu; /* guards the fields below */
    pthread_cond_t out_cv;
    lc_session_stage out;
    /* The connection the outbox fills for: the link's generation of the stream whose hello
     * went out (rpc_link_generation), 0 while none is open or after a part of it was lost.
     * The sender sends a swapped-out outbox only on the stream of the epoch it was filled for
     * (rpc_link_send_gen), so a reconnect between swap and send cannot carry stale parts to
     * the new stream. */
    uint64_t epoch;
    bool stop, sender_started;
    /* The sender's SessionUp fields, made once (lc_session_create): the send path allocates
     * nothing, so it cannot lose parts to an allocation failure. */
    ProtobufCMessageUnknownField *fields;
    lc_session_test_hooks hooks; /* test-only injection points; zero in services */
    bool gathering;              /* the sender waits for woken instances (lc_session_gather_add) */
    bool sending; /* a thread is in sender_send (the sender, or an instance sending inline) */
    pthread_t sender;
    /* Instances woken by results that have not flushed since (lc_session_gather_add): the
     * sender holds a send while this is above 0, for at most gather_ns. Signed: an instance
     * may flush before its wake is counted. */
    _Atomic int64_t gather_pending;
    int64_t gather_ns;
    char lost_why[PIE_STATUS_MSG_MAX]; /* why parts were lost last (under out_mu); "" if never */
};

/* A SessionUp stays well under the Session's 64 MiB message limit (docs/wire-contracts.md). */
#define LC_SESSION_UP_MAX (16u << 20)
/* Most parts in one SessionUp: the size of the sender's field array (24 bytes each). */
#define LC_SESSION_UP_PARTS 4096u
/* The longest the sender holds parts for instances still running after their results arrived
 * (sender_gather). */
#define LC_SESSION_GATHER_NS 200000

/* Ends connection `epoch` because parts of it were lost (why): the link cancels that stream
 * and reconnects; on_disconnect then fails every instance of it with UNAVAILABLE and why. */
static void session_restart(lc_session *s, uint64_t epoch, const char *why) {
    pie_log_warn("lc.session.restart", "epoch=%llu reason=\"%s\"", (unsigned long long)epoch, why);
    if (s->link) rpc_link_reset(s->link, epoch, PIE_UNAVAILABLE, why);
}

static void session_on_connect(rpc_link *link, void *user) {
    lc_session *s = user;
    Pie__V1__SessionHello hello = PIE__V1__SESSION_HELLO__INIT;
    hello.replica_id = s->replica_id;
    hello.version = "pie-c/" PIE_VERSION;
    hello.address = (char *)s->cfg.advertise;
    Pie__V1__SessionUp up = PIE__V1__SESSION_UP__INIT;
    up.hello = &hello;
    pie_status st;
    uint64_t gen = rpc_link_generation(link);
    if (rpc_link_send_gen(link, gen, &up.base, &st) != PIE_OK) {
        /* A stream without its hello is useless: end it (if it is not ending already) so the
         * link reconnects instead of leaving the replica unable to launch. */
        pie_log_warn("lc.session.hello_failed", "error=\"%s\"", st.msg);
        rpc_link_reset(link, gen, PIE_UNAVAILABLE, "the Session's hello could not be sent");
        return;
    }
    /* Parts may follow the hello from now on, never before it, and only on this stream. */
    pthread_mutex_lock(&s->out_mu);
    s->epoch = gen;
    s->out.len = s->out.n = 0; /* anything left belongs to no live instance */
    s->lost_why[0] = '\0';
    pthread_cond_signal(&s->out_cv);
    pthread_mutex_unlock(&s->out_mu);
}

/* Publishes whether this replica can serve now: connected, knowing a model, and the gate
 * agreeing (every model's tokenizer loaded). */
static void update_ready(lc_session *s) {
    if (s->sv == NULL || s->cfg.ready_health == NULL) return;
    pthread_mutex_lock(&s->mu);
    bool ready =
        atomic_load(&s->replica_index) != 0 && s->models_changed && s->models_changed->n_models > 0;
    if (ready && s->gate.ready) ready = s->gate.ready(s->gate.ctx, s->models_changed);
    pthread_mutex_unlock(&s->mu);
    svc_set_health_ready(s->sv, s->cfg.ready_health, ready);
}

void lc_session_update_ready(lc_session *s) { update_ready(s); }

/* Keeps down (returns true) when it holds the newest model list. */
static bool take_models(lc_session *s, Pie__V1__SessionDown *down) {
    Pie__V1__ModelsChanged *mc = NULL;
    for (size_t i = 0; i < down->n_events; i++)
        if (down->events[i]->event_case == PIE__V1__SESSION_EVENT__EVENT_MODELS_CHANGED)
            mc = down->events[i]->models_changed;
    if (mc == NULL) return false;
    pthread_mutex_lock(&s->mu);
    rpc_msg_free(s->models ? &s->models->base : NULL);
    s->models = down;
    s->models_changed = mc;
    atomic_fetch_add(&s->models_gen, 1);
    if (s->gate.changed) s->gate.changed(s->gate.ctx, mc);
    pthread_mutex_unlock(&s->mu);
    pie_gauge_set(s->g_models, (double)mc->n_models);
    pie_log_info("lc.session.models", "count=%zu", mc->n_models);
    return true;
}

static bool session_on_message(rpc_link *link, ProtobufCMessage *msg, void *user) {
    (void)link;
    lc_session *s = user;
    Pie__V1__SessionDown *down = (Pie__V1__SessionDown *)msg;
    if (down->welcome) {
        atomic_store(&s->replica_index, down->welcome->replica_index);
        pie_gauge_set(s->g_connected, 1);
        pie_log_info("lc.session.welcome", "replica_index=%u controller_version=%s",
                     down->welcome->replica_index, down->welcome->version);
    }
    for (size_t i = 0; i < down->n_events; i++) {
        const Pie__V1__SessionEvent *e = down->events[i];
        if (e->event_case == PIE__V1__SESSION_EVENT__EVENT_WORKER_LOST)
            pie_log_warn("lc.session.worker_lost", "worker_index=%u group=%s",
                         e->worker_lost->worker_index, e->worker_lost->group_id);
        else if (e->event_case == PIE__V1__SESSION_EVENT__EVENT_PROGRAM_DROPPED &&
                 s->store.program_dropped && e->program_dropped->program_id)
            s->store.program_dropped(s->store.ctx, e->program_dropped->program_id,
                                     e->program_dropped->tenant ? e->program_dropped->tenant : "");
    }
    if (down->welcome && s->store.welcomed) s->store.welcomed(s->store.ctx);
    if ((down->n_results || down->n_events) && s->sink.on_down) s->sink.on_down(s->sink.ctx, down);
    bool kept = take_models(s, down);
    if (kept || down->welcome) update_ready(s);
    return kept;
}

void lc_session_deliver(lc_session *s, Pie__V1__SessionDown *down) {
    if (!session_on_message(NULL, &down->base, s)) rpc_msg_free(&down->base);
}

static void session_on_disconnect(rpc_link *link, const pie_status *st, void *user) {
    (void)link;
    lc_session *s = user;
    uint32_t was = atomic_exchange(&s->replica_index, 0);
    pie_gauge_set(s->g_connected, 0);
    pthread_mutex_lock(&s->out_mu);
    s->epoch = 0;
    s->out.len = s->out.n = 0;
    pthread_mutex_unlock(&s->out_mu);
    if (s->sink.on_lost) s->sink.on_lost(s->sink.ctx, st);
    update_ready(s);
    if (was)
        pie_log_warn("lc.session.lost", "replica_index=%u code=%s error=\"%s\"", was,
                     pie_code_name(st->code), st->msg);
}

/* ListModels answers from the cache: models as this replica last heard from the controller. */
static bool list_models_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    (void)req;
    lc_session *s = user;
    Pie__V1__ListModelsResponse resp = PIE__V1__LIST_MODELS_RESPONSE__INIT;
    pthread_mutex_lock(&s->mu);
    if (s->models_changed) {
        resp.n_models = s->models_changed->n_models;
        resp.models = s->models_changed->models;
    }
    rpc_call_reply(call, &resp.base); /* packs now: safe to release the lock after */
    pthread_mutex_unlock(&s->mu);
    return false;
}

/* ---- outbound -------------------------------------------------------------------------------- */

/* Makes room for `more` bytes; grow: realloc, or a test's injected allocator. */
static bool stage_reserve_with(lc_session_stage *sg, size_t more,
                               void *(*grow)(void *ctx, void *p, size_t bytes), void *ctx) {
    if (sg->cap - sg->len >= more) return true;
    size_t cap = sg->cap ? sg->cap : 4096;
    while (cap - sg->len < more) cap *= 2;
    uint8_t *b = grow ? grow(ctx, sg->buf, cap) : realloc(sg->buf, cap);
    if (b == NULL) return false;
    sg->buf = b;
    sg->cap = cap;
    return true;
}

static bool stage_reserve(lc_session_stage *sg, size_t more) {
    return stage_reserve_with(sg, more, NULL, NULL);
}

pie_code lc_session_stage_add(lc_session_stage *sg, unsigned field, const ProtobufCMessage *part,
                              pie_status *st) {
    size_t n = protobuf_c_message_get_packed_size(part);
    if (n > LC_SESSION_UP_MAX)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "a call of %zu bytes exceeds the Session's message limit of %u", n,
                              LC_SESSION_UP_MAX);
    if (!stage_reserve(sg, 8 + 5 + n))
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
    /* protobuf-c packs an unknown field as tag + data, so data holds the length prefix too. */
    uint8_t *w = sg->buf + sg->len + 8;
    size_t v = n, k = 0;
    do {
        w[k++] = (uint8_t)((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
        v >>= 7;
    } while (v);
    protobuf_c_message_pack(part, w + k);
    uint32_t hdr[2] = {(uint32_t)field, (uint32_t)(k + n)};
    memcpy(sg->buf + sg->len, hdr, sizeof hdr);
    sg->len += 8 + k + n;
    sg->n++;
    return PIE_OK;
}

void lc_session_stage_free(lc_session_stage *sg) {
    free(sg->buf);
    *sg = (lc_session_stage){0};
}

static void sender_send(lc_session *s, uint64_t epoch, const uint8_t *buf, size_t len);

void lc_session_gather_add(lc_session *s) { atomic_fetch_add(&s->gather_pending, 1); }

/* Counts a woken instance as done (out_mu held); wakes a gathering sender when it was the last. */
static void gather_done(lc_session *s) {
    if (atomic_fetch_sub(&s->gather_pending, 1) <= 1 && s->gathering)
        pthread_cond_signal(&s->out_cv);
}

pie_code lc_session_flush(lc_session *s, uint64_t epoch, lc_session_stage *sg, bool woken,
                          pie_status *st) {
    if (sg->len == 0) {
        if (woken) {
            pthread_mutex_lock(&s->out_mu);
            gather_done(s);
            pthread_mutex_unlock(&s->out_mu);
        }
        return PIE_OK;
    }
    pie_code rc = PIE_OK;
    uint64_t lost = 0; /* the connection whose parts could not be queued */
    char why[PIE_STATUS_MSG_MAX];
    pthread_mutex_lock(&s->out_mu);
    if (woken) gather_done(s);
    if (epoch == 0 || epoch != s->epoch) {
        rc = pie_status_set(st, PIE_UNAVAILABLE, "controller session lost%s%s",
                            s->lost_why[0] ? ": " : "", s->lost_why);
    } else if (!stage_reserve_with(&s->out, sg->len, s->hooks.outbox_realloc, s->hooks.ctx)) {
        /* These parts cannot reach the controller, and the parts after them would reach it
         * without them: this connection is over. Nothing more is queued for it, and the
         * restart fails every instance of it at once (on_lost) instead of leaving their
         * calls unanswered. */
        snprintf(s->lost_why, sizeof s->lost_why,
                 "out of memory queuing %zu bytes of calls for the controller; the Session "
                 "restarts",
                 sg->len);
        lost = s->epoch;
        snprintf(why, sizeof why, "%s", s->lost_why);
        s->epoch = 0;
        s->out.len = s->out.n = 0;
        rc = pie_status_set(st, PIE_UNAVAILABLE, "controller session lost: %s", s->lost_why);
    } else if (!s->sending && s->out.len == 0 && atomic_load(&s->gather_pending) <= 0) {
        /* Nothing queued, no send under way and no woken instance about to add parts: there
         * is nothing to coalesce with, so this instance sends its parts itself. Handing them
         * to the sender thread would cost a wake-up of that thread on every decode step of a
         * lone instance (issue 17 item 3: a futex wake and a context switch on the critical
         * path). Parts stay in order: one instance flushes one stage at a time, and
         * `sending` keeps the sender thread out until this send is done. */
        s->sending = true;
        uint64_t e = s->epoch;
        pthread_mutex_unlock(&s->out_mu);
        if (s->hooks.before_send) s->hooks.before_send(s->hooks.ctx, e, sg->n);
        sender_send(s, e, sg->buf, sg->len);
        pthread_mutex_lock(&s->out_mu);
        s->sending = false;
        if (s->out.len > 0 || s->stop) pthread_cond_signal(&s->out_cv); /* parts queued meanwhile */
    } else {
        memcpy(s->out.buf + s->out.len, sg->buf, sg->len);
        s->out.len += sg->len;
        s->out.n += sg->n;
        /* No syscall when the sender is already awake (glibc: no waiters, no futex call); a
         * gathering sender is woken only by the last woken instance (gather_done). */
        if (!s->gathering) pthread_cond_signal(&s->out_cv);
    }
    pthread_mutex_unlock(&s->out_mu);
    sg->len = sg->n = 0;
    if (lost) session_restart(s, lost, why);
    return rc;
}

void lc_session_settle(lc_session *s, int64_t timeout_ms) {
    /* Polls: shutdown only, and the sender's condition variable stays the sender's. */
    int64_t until = rpc_now_ns() + timeout_ms * 1000000;
    for (;;) {
        pthread_mutex_lock(&s->out_mu);
        bool busy = s->sender_started && (s->sending || (s->out.len > 0 && s->epoch != 0));
        pthread_mutex_unlock(&s->out_mu);
        if (!busy || rpc_now_ns() >= until) return;
        struct timespec ms = {.tv_sec = 0, .tv_nsec = 1000000};
        (void)nanosleep(&ms, NULL);
    }
}

uint64_t lc_session_epoch(lc_session *s) {
    pthread_mutex_lock(&s->out_mu);
    uint64_t e = s->epoch;
    pthread_mutex_unlock(&s->out_mu);
    return e;
}

/* Sends the records of buf[0..len) as SessionUp messages of at most LC_SESSION_UP_MAX bytes
 * and LC_SESSION_UP_PARTS parts on the stream of connection `epoch` only: each record becomes
 * an "unknown field" of an otherwise empty SessionUp, which protobuf-c packs verbatim — on the
 * wire exactly the repeated begins/calls/ends. Nothing is dropped without its instances
 * failing: when that stream is gone, its on_disconnect fails every instance of it; when a send
 * on it fails otherwise, the stream is restarted with the reason, which does the same. */
static void sender_send(lc_session *s, uint64_t epoch, const uint8_t *buf, size_t len) {
    ProtobufCMessageUnknownField *fields = s->fields;
    size_t off = 0;
    while (off < len) {
        size_t k = 0, bytes = 0;
        while (off < len && k < LC_SESSION_UP_PARTS) {
            uint32_t hdr[2];
            memcpy(hdr, buf + off, sizeof hdr);
            if (k > 0 && bytes + hdr[1] + 16 > LC_SESSION_UP_MAX) break;
            fields[k++] = (ProtobufCMessageUnknownField){
                .tag = hdr[0],
                .wire_type = PROTOBUF_C_WIRE_TYPE_LENGTH_PREFIXED,
                .len = hdr[1],
                .data = (uint8_t *)(buf + off + 8),
            };
            bytes += hdr[1] + 16;
            off += 8 + hdr[1];
        }
        Pie__V1__SessionUp up = PIE__V1__SESSION_UP__INIT;
        up.base.n_unknown_fields = (unsigned)k;
        up.base.unknown_fields = fields;
        pie_status st;
        if (rpc_link_send_gen(s->link, epoch, &up.base, &st) != PIE_OK) {
            if (rpc_link_generation(s->link) != epoch) {
                /* Made for a connection that has ended: on the stream open now they would be
                 * stale (the controller forgot those instances); on_lost failed them. */
                pie_log_warn("lc.session.stale_parts_dropped", "epoch=%llu error=\"%s\"",
                             (unsigned long long)epoch, st.msg);
                return;
            }
            char why[PIE_STATUS_MSG_MAX];
            snprintf(why, sizeof why,
                     "sending %zu calls to the controller failed (%.300s); the "
                     "Session restarts",
                     k, st.msg);
            pie_log_warn("lc.session.send_failed", "epoch=%llu parts=%zu error=\"%s\"",
                         (unsigned long long)epoch, k, st.msg);
            pthread_mutex_lock(&s->out_mu);
            snprintf(s->lost_why, sizeof s->lost_why, "%s", why);
            if (s->epoch == epoch) {
                s->epoch = 0; /* nothing more for this stream: its instances are failing */
                s->out.len = s->out.n = 0;
            }
            pthread_mutex_unlock(&s->out_mu);
            session_restart(s, epoch, why);
            return;
        }
        pie_counter_add(s->c_up, 1);
    }
}

/* Called with out_mu held and parts in the outbox: while instances woken by the last results are
 * still running (sampling, staging their next calls), waits for them — at most gather_ns — so
 * that their calls leave in one SessionUp and reach the controller together instead of as a
 * trickle of small messages, each a wake-up of the controller and a chance to form a step from
 * the first few calls only. With one instance the count is 0 by the time it flushed: no wait. */
static void sender_gather(lc_session *s) {
    if (s->gather_ns <= 0 || atomic_load(&s->gather_pending) <= 0) return;
    int64_t until = rpc_now_ns() + s->gather_ns;
    struct timespec ts = {.tv_sec = (time_t)(until / 1000000000),
                          .tv_nsec = (long)(until % 1000000000)};
    s->gathering = true;
    while (!s->stop && s->epoch != 0 && atomic_load(&s->gather_pending) > 0 && rpc_now_ns() < until)
        pthread_cond_timedwait(&s->out_cv, &s->out_mu, &ts);
    s->gathering = false;
}

static void *sender_main(void *arg) {
    lc_session *s = arg;
    (void)pthread_setname_np(pthread_self(), "lc-session-tx"); /* cosmetic */
    lc_session_stage mine = {0};
    pthread_mutex_lock(&s->out_mu);
    for (;;) {
        while ((!s->stop && (s->out.len == 0 || s->epoch == 0)) || s->sending)
            pthread_cond_wait(&s->out_cv, &s->out_mu);
        if (s->out.len == 0 || s->epoch == 0) break; /* stopping with nothing to send */
        sender_gather(s);
        if (s->epoch == 0) continue; /* the Session ended while gathering: the outbox is gone */
        lc_session_stage t = s->out; /* swap: instance threads fill the other buffer meanwhile */
        s->out = mine;
        s->out.len = s->out.n = 0;
        mine = t;
        uint64_t epoch = s->epoch; /* what mine was filled for: it goes on that stream or none */
        s->sending = true;
        pthread_mutex_unlock(&s->out_mu);
        if (s->hooks.before_send) s->hooks.before_send(s->hooks.ctx, epoch, mine.n);
        sender_send(s, epoch, mine.buf, mine.len);
        pthread_mutex_lock(&s->out_mu);
        s->sending = false;
    }
    pthread_mutex_unlock(&s->out_mu);
    lc_session_stage_free(&mine);
    return NULL;
}

void lc_session_set_sink(lc_session *s, const lc_session_sink *sink) { s->sink = *sink; }

void lc_session_set_test_hooks(lc_session *s, const lc_session_test_hooks *h) { s->hooks = *h; }

void lc_session_set_store_hooks(lc_session *s, const lc_session_store_hooks *h) { s->store = *h; }

void lc_session_set_model_gate(lc_session *s, const lc_session_model_gate *g) { s->gate = *g; }

rpc_channel *lc_session_channel(lc_session *s) { return s->ch; }

uint64_t lc_session_models_gen(lc_session *s) { return atomic_load(&s->models_gen); }

uint64_t lc_session_models_visit(lc_session *s,
                                 void (*fn)(void *ctx, const Pie__V1__ModelsChanged *mc),
                                 void *ctx) {
    pthread_mutex_lock(&s->mu);
    uint64_t gen = atomic_load(&s->models_gen);
    fn(ctx, s->models_changed);
    pthread_mutex_unlock(&s->mu);
    return gen;
}

/* ---- lifetime ------------------------------------------------------------------------------- */

static pie_code session_init_sync(lc_session *s) {
    if (pthread_mutex_init(&s->mu, NULL) != 0) return PIE_RESOURCE_EXHAUSTED;
    if (pthread_mutex_init(&s->out_mu, NULL) != 0) {
        pthread_mutex_destroy(&s->mu);
        return PIE_RESOURCE_EXHAUSTED;
    }
    pthread_condattr_t ca;
    int rc = pthread_condattr_init(&ca);
    if (rc == 0) { /* sender_gather waits against rpc_now_ns, a CLOCK_MONOTONIC time */
        rc = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        if (rc == 0) rc = pthread_cond_init(&s->out_cv, &ca);
        pthread_condattr_destroy(&ca);
    }
    if (rc != 0) {
        pthread_mutex_destroy(&s->out_mu);
        pthread_mutex_destroy(&s->mu);
        return PIE_RESOURCE_EXHAUSTED;
    }
    return PIE_OK;
}

lc_session *lc_session_create(const lc_session_config *cfg, pie_metrics *metrics, pie_status *st) {
    lc_session *s = calloc(1, sizeof *s);
    if (s == NULL || session_init_sync(s) != PIE_OK) {
        free(s);
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    s->cfg = *cfg;
    s->gather_ns = LC_SESSION_GATHER_NS;
    s->fields = calloc(LC_SESSION_UP_PARTS, sizeof *s->fields);
    if (s->fields == NULL) {
        lc_session_destroy(s);
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    s->c_up = pie_metrics_counter(metrics, "pie_lifecycle_session_up_messages_total",
                                  "SessionUp messages sent (each coalescing calls of many "
                                  "instances).",
                                  NULL, 0, st);
    s->g_connected =
        pie_metrics_gauge(metrics, "pie_lifecycle_session_connected",
                          "1 while the Session with the controller is open.", NULL, 0, st);
    s->g_models = pie_metrics_gauge(metrics, "pie_lifecycle_models",
                                    "Models the cluster serves, as last announced.", NULL, 0, st);
    s->methods[0] = (rpc_method){
        .path = "/pie.v1.Lifecycle/ListModels",
        .kind = RPC_UNARY,
        .request = &pie__v1__list_models_request__descriptor,
        .response = &pie__v1__list_models_response__descriptor,
        .on_call = list_models_on_call,
        .user = s,
    };
    return s;
}

const rpc_method *lc_session_methods(lc_session *s, size_t *n) {
    *n = sizeof s->methods / sizeof s->methods[0];
    return s->methods;
}

pie_code lc_session_start(lc_session *s, svc *sv, const svc_dial_config *dial, pie_status *st) {
    int grpc_port = svc_port(sv);
    s->sv = sv;
    if (s->cfg.ready_health) svc_set_health_ready(sv, s->cfg.ready_health, false);
    if (s->cfg.replica_id && s->cfg.replica_id[0]) {
        snprintf(s->replica_id, sizeof s->replica_id, "%s", s->cfg.replica_id);
    } else {
        char host[256] = "lifecycle";
        if (gethostname(host, sizeof host - 1) != 0) snprintf(host, sizeof host, "lifecycle");
        snprintf(s->replica_id, sizeof s->replica_id, "%s:%d", host, grpc_port);
    }
    rpc_link_opts lo = {
        .path = "/pie.v1.Controller/Session",
        .response = &pie__v1__session_down__descriptor,
        .on_connect = session_on_connect,
        .on_message = session_on_message,
        .on_disconnect = session_on_disconnect,
        .user = s,
        /* The Session's stream runs on the gRPC server's thread: one poller for the clients'
         * calls and the controller's stream, and instances' sends never wait for gRPC (issue 17
         * item 3: the hand-offs between two polling threads cost wake-ups on every token). */
        .server = svc_rpc_server(sv),
    };
    if (svc_dial_controller(sv, dial, &lo, &s->ch, &s->link, st) != PIE_OK) return st->code;
    int rc = pthread_create(&s->sender, NULL, sender_main, s);
    if (rc != 0)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "lifecycle session: pthread_create: %s",
                              strerror(rc));
    s->sender_started = true;
    pie_log_info("lc.session.dialling", "replica_id=%s", s->replica_id);
    return PIE_OK;
}

uint32_t lc_session_replica_index(lc_session *s) { return atomic_load(&s->replica_index); }

pie_code lc_session_resolve_model(lc_session *s, const char *requested, char *out, size_t cap,
                                  pie_status *st) {
    pie_code rc = PIE_OK;
    pthread_mutex_lock(&s->mu);
    size_t n = s->models_changed ? s->models_changed->n_models : 0;
    Pie__V1__ModelInfo **models = n ? s->models_changed->models : NULL;
    if (n == 0) {
        rc = pie_status_set(st, PIE_UNAVAILABLE, "no model is served now (controller %s)",
                            atomic_load(&s->replica_index) ? "connected, no worker registered"
                                                           : "not connected");
    } else if (requested == NULL || requested[0] == '\0') {
        if (n == 1)
            snprintf(out, cap, "%s", models[0]->name);
        else
            rc = pie_status_set(st, PIE_INVALID_ARGUMENT,
                                "model: empty, but the cluster serves %zu models (%s, %s%s); "
                                "name one",
                                n, models[0]->name, models[1]->name, n > 2 ? ", ..." : "");
    } else {
        size_t i = 0;
        while (i < n && strcmp(models[i]->name, requested) != 0) i++;
        if (i < n)
            snprintf(out, cap, "%s", requested);
        else
            rc = pie_status_set(st, PIE_NOT_FOUND, "model \"%s\" is not served by this cluster",
                                requested);
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

void lc_session_destroy(lc_session *s) {
    if (s == NULL) return;
    if (s->sender_started) { /* sends what instances flushed last (their InstanceEnds) first */
        pthread_mutex_lock(&s->out_mu);
        s->stop = true;
        pthread_cond_signal(&s->out_cv);
        pthread_mutex_unlock(&s->out_mu);
        int rc = pthread_join(s->sender, NULL);
        if (rc != 0) pie_log_error("lc.session.join", "error=\"%s\"", strerror(rc));
    }
    rpc_link_stop(s->link);
    rpc_channel_destroy(s->ch);
    rpc_msg_free(s->models ? &s->models->base : NULL);
    lc_session_stage_free(&s->out);
    free(s->fields);
    pthread_cond_destroy(&s->out_cv);
    pthread_mutex_destroy(&s->out_mu);
    pthread_mutex_destroy(&s->mu);
    free(s);
}
