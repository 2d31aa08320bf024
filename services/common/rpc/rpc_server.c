/* rpc_server.c — the server side of the RPC layer.
 *
 * Owns: the grpc_server, its completion-queue threads (one CQ each; a call lives on the thread
 * whose armed request it matched), the registered methods and the generic request that answers
 * UNIMPLEMENTED, bearer-token checks, and server call objects (rpc_call): their callbacks,
 * thread-safe send queue, finish/cancel, metadata and reference counts, and graceful shutdown.
 * Does not own: the health service's state (rpc_health.c), the client side (rpc_client.c).
 *
 * Call state machine. Receive-side state (recv/close pending, half-close, done) is touched only
 * by the call's CQ thread: no lock. Send-side state (queue, in-flight send batch, finish
 * request, metadata to send, closed) is under call->mu, because any thread may send: the sender
 * starts the SEND batch itself when none is in flight (no thread hop); otherwise the message is
 * queued and the CQ thread starts the next batch when the previous one completes. All send-side
 * grpc_call_start_batch calls happen under call->mu, so send batches of one call never race.
 * Each outstanding tag holds a reference; the layer holds one more until on_done. */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/grpc_security.h>

#include "pie_log.h"
#include "rpc_internal.h"

enum {
    TAG_NEW_CALL = 1, /* a registered request matched a call (obj: rpc_call) */
    TAG_RECV,         /* RECV_MESSAGE (obj: rpc_call) */
    TAG_CLOSE,        /* RECV_CLOSE_ON_SERVER (obj: rpc_call) */
    TAG_SEND,         /* a send-side batch (obj: rpc_call) */
    TAG_SEND_CLOSE,   /* a final send batch that also holds RECV_CLOSE (obj: rpc_call) */
    TAG_GENERIC_NEW,  /* the generic request matched an unknown method (obj: rpc_generic) */
    TAG_GENERIC_DONE, /* its UNIMPLEMENTED answer finished (obj: rpc_generic) */
    TAG_SHUTDOWN,     /* grpc_server_shutdown_and_notify (obj: rpc_server) */
};

typedef struct rpc_srv_method {
    rpc_method m; /* path points at path_buf */
    char *path_buf;
    void *reg; /* grpc_server_register_method handle */
} rpc_srv_method;

typedef struct rpc_srv_thread {
    rpc_server *srv;
    int idx;
    grpc_completion_queue *cq;
    pthread_t th;
    bool running;
} rpc_srv_thread;

struct rpc_server {
    char *addr;
    char *auth_expected; /* "Bearer <token>", NULL when no auth */
    size_t auth_len;
    const pie_tenants *tenants;               /* rpc_server_opts.tenants */
    char *tls_cert, *tls_key, *tls_client_ca; /* copies of the PEM options (NULL: plaintext) */
    void (*on_finished)(void *user, const char *method, pie_code code, int64_t dur_ns);
    void *on_finished_user;
    int max_recv, max_send;
    size_t send_queue_max;       /* messages per call's queue; 0: unbounded */
    size_t send_queue_max_bytes; /* packed bytes per call's queue; 0: unbounded */
    int n_threads;
    bool health_needs_token;

    grpc_server *gs;
    rpc_srv_method *methods;
    size_t n_methods, cap_methods;
    rpc_srv_thread *threads;
    rpc_health *health;
    int port;

    atomic_bool shutting_down; /* read by CQ threads before re-arming requests */
    atomic_long live_calls;    /* calls between arrival and on_done (for logs and tests) */
    rpc_tag t_shutdown;

    pthread_mutex_t mu; /* guards the fields below */
    pthread_cond_t cv;
    bool started, shutdown_started, shutdown_notified, shutdown_done;
    rpc_link **links; /* asynchronous links on threads[0]'s queue (rpc__server_attach_link) */
    size_t n_links, cap_links;
};

struct rpc_call {
    rpc_server *srv;
    rpc_srv_thread *th;
    const rpc_srv_method *meth;
    atomic_int refs;
    atomic_bool cancelled;
    void *data;
    const pie_tenant *tenant; /* who called (set before on_call; never NULL after) */
    int64_t arrived_ns;       /* when the call was matched (rpc_server_opts.on_finished) */

    /* Filled by grpc_server_request_registered_call; immutable afterwards until release. */
    grpc_call *gcall;
    gpr_timespec g_deadline;
    grpc_metadata_array req_md;
    grpc_byte_buffer *payload;
    int64_t deadline_ns;
    rpc_md *md;
    size_t n_md;

    rpc_tag t_new, t_recv, t_close, t_send, t_send_close;

    /* CQ-thread only. */
    grpc_byte_buffer *recv_bb;
    int close_cancelled;
    bool recv_pending, close_pending, half_closed, handler_visible, cancel_reported, done;

    /* Send side: under mu. */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    rpc_sendq q;
    grpc_byte_buffer *inflight_bb;
    bool send_inflight;
    bool defer_send;        /* on_call is running on the CQ thread: batch up, send after it */
    bool close_with_status; /* CQ thread only, around one pump: add RECV_CLOSE to the batch */
    bool want_initial_md, initial_md_sent;
    bool finish_requested, status_sent, cancel_requested;
    bool send_failed; /* a send batch failed: the call is broken */
    bool closed;      /* RECV_CLOSE came back: the call is over */
    bool waits_ended; /* rpc_call_end_waits: rpc_call_wait_room answers ABORTED */
    unsigned n_msgs;  /* messages accepted by rpc_call_send / reply */
    grpc_metadata *init_md, *trail_md;
    size_t n_init_md, cap_init_md, n_trail_md, cap_trail_md;
    grpc_status_code fin_code;
    grpc_slice fin_details;
    bool fin_details_set;
};

typedef struct rpc_generic {
    rpc_tag tag;
    rpc_srv_thread *th;
    grpc_call *gcall;
    grpc_call_details details;
    grpc_metadata_array md;
    grpc_slice status_msg;
    bool status_msg_set;
    int cancelled;
} rpc_generic;

/* The CQ thread running on this OS thread, or NULL. Thread-local, not global: it lets
 * rpc_call_send_wait refuse to block the very thread that would drain the queue. */
static _Thread_local rpc_srv_thread *tls_thread;

static void call_unref_internal(rpc_call *c);

/* ---------------------------------------------------------------------------------------------
 * Small helpers */

static int cond_init_monotonic(pthread_cond_t *cv) {
    pthread_condattr_t a;
    if (pthread_condattr_init(&a) != 0) return -1;
    int rc = pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    if (rc == 0) rc = pthread_cond_init(cv, &a);
    pthread_condattr_destroy(&a);
    return rc == 0 ? 0 : -1;
}

/* Waits on cv until deadline_ns (RPC_DEADLINE_NONE: forever). Returns ETIMEDOUT or 0. */
static int cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu, int64_t deadline_ns) {
    if (deadline_ns == RPC_DEADLINE_NONE) return pthread_cond_wait(cv, mu);
    struct timespec ts = {.tv_sec = deadline_ns / 1000000000, .tv_nsec = deadline_ns % 1000000000};
    return pthread_cond_timedwait(cv, mu, &ts);
}

static void md_list_free(grpc_metadata *md, size_t n) {
    for (size_t i = 0; i < n; i++) {
        grpc_slice_unref(md[i].key);
        grpc_slice_unref(md[i].value);
    }
    free(md);
}

static pie_code md_list_add(grpc_metadata **md, size_t *n, size_t *cap, const char *key,
                            const char *value) {
    if (*n == *cap) {
        size_t ncap = *cap ? *cap * 2 : 4;
        grpc_metadata *nm = realloc(*md, ncap * sizeof *nm);
        if (!nm) return PIE_RESOURCE_EXHAUSTED;
        *md = nm;
        *cap = ncap;
    }
    grpc_metadata *e = &(*md)[(*n)++];
    memset(e, 0, sizeof *e);
    e->key = grpc_slice_from_copied_string(key);
    e->value = grpc_slice_from_copied_string(value);
    return PIE_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Call objects */

static rpc_call *call_new(rpc_srv_thread *th, const rpc_srv_method *m) {
    rpc_call *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    if (pthread_mutex_init(&c->mu, NULL) != 0) {
        free(c);
        return NULL;
    }
    if (cond_init_monotonic(&c->cv) != 0) {
        pthread_mutex_destroy(&c->mu);
        free(c);
        return NULL;
    }
    c->srv = th->srv;
    c->th = th;
    c->meth = m;
    atomic_init(&c->refs, 1); /* the layer's reference, dropped after on_done */
    atomic_init(&c->cancelled, false);
    c->t_new = (rpc_tag){TAG_NEW_CALL, c};
    c->t_recv = (rpc_tag){TAG_RECV, c};
    c->t_close = (rpc_tag){TAG_CLOSE, c};
    c->t_send = (rpc_tag){TAG_SEND, c};
    c->t_send_close = (rpc_tag){TAG_SEND_CLOSE, c};
    grpc_metadata_array_init(&c->req_md);
    return c;
}

/* Releases everything that belongs to gRPC; the object itself may live on (handler refs). */
static void call_release_grpc(rpc_call *c) {
    pthread_mutex_lock(&c->mu);
    rpc__sendq_clear(&c->q);
    if (c->inflight_bb) {
        grpc_byte_buffer_destroy(c->inflight_bb);
        c->inflight_bb = NULL;
    }
    md_list_free(c->init_md, c->n_init_md);
    md_list_free(c->trail_md, c->n_trail_md);
    c->init_md = c->trail_md = NULL;
    c->n_init_md = c->n_trail_md = c->cap_init_md = c->cap_trail_md = 0;
    if (c->fin_details_set) {
        grpc_slice_unref(c->fin_details);
        c->fin_details_set = false;
    }
    c->closed = true;
    pthread_mutex_unlock(&c->mu);
    if (c->payload) {
        grpc_byte_buffer_destroy(c->payload);
        c->payload = NULL;
    }
    if (c->recv_bb) {
        grpc_byte_buffer_destroy(c->recv_bb);
        c->recv_bb = NULL;
    }
    grpc_metadata_array_destroy(&c->req_md);
    grpc_metadata_array_init(&c->req_md);
    free(c->md);
    c->md = NULL;
    c->n_md = 0;
    if (c->gcall) {
        grpc_call_unref(c->gcall);
        c->gcall = NULL;
    }
}

static void call_free(rpc_call *c) {
    call_release_grpc(c);
    rpc__sendq_free(&c->q);
    pthread_cond_destroy(&c->cv);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

void rpc_call_ref(rpc_call *c) { atomic_fetch_add_explicit(&c->refs, 1, memory_order_relaxed); }

static void call_unref_internal(rpc_call *c) {
    if (atomic_fetch_sub_explicit(&c->refs, 1, memory_order_acq_rel) == 1) call_free(c);
}

void rpc_call_unref(rpc_call *c) {
    if (c) call_unref_internal(c);
}

/* Starts the next send-side batch if none is in flight: initial metadata (when due), the next
 * queued message, and the status once the queue is empty. Called with c->mu held. */
static void call_pump_locked(rpc_call *c) {
    if (c->defer_send || c->send_inflight || c->closed || c->send_failed || c->status_sent) return;
    grpc_op ops[4];
    size_t n = 0;
    memset(ops, 0, sizeof ops);
    bool has_msg = c->q.len > 0;
    bool do_status = c->finish_requested && c->q.len <= 1;
    if (!c->initial_md_sent && (c->want_initial_md || has_msg || do_status)) {
        ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
        ops[n].data.send_initial_metadata.count = c->n_init_md;
        ops[n].data.send_initial_metadata.metadata = c->init_md;
        n++;
        c->initial_md_sent = true;
    }
    if (has_msg) {
        c->inflight_bb = rpc__sendq_pop(&c->q);
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n].data.send_message.send_message = c->inflight_bb;
        n++;
    }
    if (do_status) {
        ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
        ops[n].data.send_status_from_server.status = c->fin_code;
        ops[n].data.send_status_from_server.status_details =
            c->fin_details_set ? &c->fin_details : NULL;
        ops[n].data.send_status_from_server.trailing_metadata_count = c->n_trail_md;
        ops[n].data.send_status_from_server.trailing_metadata = c->trail_md;
        n++;
        c->status_sent = true;
    }
    if (n == 0) return;
    rpc_tag *tag = &c->t_send;
    bool with_close = do_status && c->close_with_status;
    if (with_close) {
        /* The whole answer is ready when on_call returns (a synchronous unary reply, an auth
         * failure): one batch and one completion instead of two. */
        ops[n].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
        ops[n].data.recv_close_on_server.cancelled = &c->close_cancelled;
        n++;
        c->close_pending = true;
        tag = &c->t_send_close;
    }
    rpc_call_ref(c);
    c->send_inflight = true;
    grpc_call_error e = grpc_call_start_batch(c->gcall, ops, n, tag, NULL);
    if (e != GRPC_CALL_OK) {
        pie_log_error("rpc.send_batch", "method=%s err=%s", c->meth->m.path,
                      rpc__call_error_name(e));
        if (with_close) {
            c->close_pending = false;
            c->closed = true;
        }
        c->send_inflight = false;
        c->send_failed = true;
        if (c->inflight_bb) {
            grpc_byte_buffer_destroy(c->inflight_bb);
            c->inflight_bb = NULL;
        }
        rpc__sendq_clear(&c->q);
        atomic_fetch_sub(&c->refs, 1); /* cannot be the last: the layer holds one */
        grpc_call_cancel(c->gcall, NULL);
    }
}

/* Records the status to send; called with c->mu held. */
static void call_set_status_locked(rpc_call *c, pie_code code, const char *msg) {
    c->fin_code = (grpc_status_code)code;
    if (c->fin_details_set) grpc_slice_unref(c->fin_details);
    c->fin_details_set = false;
    if (msg && msg[0]) {
        c->fin_details = grpc_slice_from_copied_string(msg);
        c->fin_details_set = true;
    }
    c->finish_requested = true;
}

/* Why the call cannot take sends now (PIE_OK if it can). Called with c->mu held. */
static pie_code call_sendable_locked(const rpc_call *c) {
    if (atomic_load(&c->cancelled) || c->cancel_requested || c->send_failed) return PIE_CANCELLED;
    if (c->finish_requested) return PIE_FAILED_PRECONDITION;
    if (c->closed) return PIE_CANCELLED;
    return PIE_OK;
}

static void call_mark_cancelled(rpc_call *c) {
    atomic_store(&c->cancelled, true);
    pthread_mutex_lock(&c->mu);
    rpc__sendq_clear(&c->q);
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

static void call_report_cancel(rpc_call *c) {
    if (c->handler_visible && !c->cancel_reported && !c->done) {
        c->cancel_reported = true;
        if (c->meth->m.on_cancel) c->meth->m.on_cancel(c, c->meth->m.user);
    }
}

/* If nothing is outstanding any more: on_done, release gRPC resources, drop the layer's ref. */
static void call_try_done(rpc_call *c) {
    if (c->done || c->recv_pending || c->close_pending) return;
    pthread_mutex_lock(&c->mu);
    bool busy = c->send_inflight || !c->closed;
    pthread_mutex_unlock(&c->mu);
    if (busy) return;
    if (atomic_load(&c->cancelled) || c->cancel_requested) call_report_cancel(c);
    c->done = true;
    if (c->srv->on_finished) {
        pie_code code = c->status_sent ? (pie_code)c->fin_code : PIE_CANCELLED;
        c->srv->on_finished(c->srv->on_finished_user, c->meth->m.path, code,
                            rpc_now_ns() - c->arrived_ns);
    }
    if (c->handler_visible && c->meth->m.on_done) c->meth->m.on_done(c, c->meth->m.user);
    call_release_grpc(c);
    atomic_fetch_sub(&c->srv->live_calls, 1);
    call_unref_internal(c);
}

static void call_start_recv(rpc_call *c) {
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &c->recv_bb;
    rpc_call_ref(c);
    c->recv_pending = true;
    grpc_call_error e = grpc_call_start_batch(c->gcall, &op, 1, &c->t_recv, NULL);
    if (e != GRPC_CALL_OK) {
        pie_log_error("rpc.recv_batch", "method=%s err=%s", c->meth->m.path,
                      rpc__call_error_name(e));
        c->recv_pending = false;
        atomic_fetch_sub(&c->refs, 1);
        grpc_call_cancel(c->gcall, NULL);
    }
}

static bool call_start_close(rpc_call *c) {
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = &c->close_cancelled;
    rpc_call_ref(c);
    c->close_pending = true;
    grpc_call_error e = grpc_call_start_batch(c->gcall, &op, 1, &c->t_close, NULL);
    if (e != GRPC_CALL_OK) {
        pie_log_error("rpc.close_batch", "method=%s err=%s", c->meth->m.path,
                      rpc__call_error_name(e));
        c->close_pending = false;
        atomic_fetch_sub(&c->refs, 1);
        grpc_call_cancel(c->gcall, NULL);
        pthread_mutex_lock(&c->mu);
        c->closed = true;
        pthread_mutex_unlock(&c->mu);
        return false;
    }
    return true;
}

/* Layer-internal finish (auth failure, bad request): no handler involved. */
static void call_finish_internal(rpc_call *c, pie_code code, const char *msg) {
    pthread_mutex_lock(&c->mu);
    if (!c->finish_requested) {
        call_set_status_locked(c, code, msg);
        call_pump_locked(c);
    }
    pthread_mutex_unlock(&c->mu);
}

static void arm_method(rpc_srv_thread *th, const rpc_srv_method *m);

/* NULL when the call may proceed (c->tenant set), else why not. Exactly one authorization
 * header counts: with several, which one a proxy in front checked is unknowable, so none is
 * trusted. With tenants, only a tenant's token is accepted (never the service token). */
static const char *call_auth_refusal(rpc_call *c) {
    const rpc_server *srv = c->srv;
    c->tenant = &pie_tenant_anonymous;
    if ((!srv->auth_expected && !srv->tenants) || c->meth->m.no_auth) return NULL;
    const grpc_metadata *auth = NULL;
    for (size_t i = 0; i < c->req_md.count; i++) {
        const grpc_metadata *e = &c->req_md.metadata[i];
        if (grpc_slice_str_cmp(e->key, "authorization") != 0) continue;
        if (auth != NULL) return "more than one authorization header";
        auth = e;
    }
    if (auth == NULL) return "missing or invalid bearer token";
    const char *value = (const char *)GRPC_SLICE_START_PTR(auth->value);
    size_t len = GRPC_SLICE_LENGTH(auth->value);
    if (srv->tenants) {
        const pie_tenant *t = pie_tenants_find(srv->tenants, value, len);
        if (!t) return "missing or invalid bearer token";
        c->tenant = t;
        return NULL;
    }
    if (!pie_secret_eq(value, len, srv->auth_expected, srv->auth_len))
        return "missing or invalid bearer token";
    return NULL;
}

static void on_new_call(rpc_srv_thread *th, rpc_call *c, bool ok) {
    rpc_server *srv = th->srv;
    if (!ok) { /* server shutting down: the request was never matched */
        call_free(c);
        return;
    }
    arm_method(th, c->meth);
    atomic_fetch_add(&srv->live_calls, 1);
    c->deadline_ns = rpc__ns_from_deadline(c->g_deadline);
    c->arrived_ns = rpc_now_ns();
    const rpc_method *m = &c->meth->m;
    c->defer_send = true; /* no send batch until the handler's first callback returned */

    const char *refusal = call_auth_refusal(c);
    if (refusal != NULL) {
        call_finish_internal(c, PIE_UNAUTHENTICATED, refusal);
        goto started;
    }
    if (rpc__md_copy(&c->req_md, &c->md, &c->n_md) != 0) {
        call_finish_internal(c, PIE_RESOURCE_EXHAUSTED, "out of memory copying metadata");
        goto started;
    }
    if (m->kind == RPC_UNARY || m->kind == RPC_SERVER_STREAM) {
        if (!c->payload) { /* the client half-closed without sending one */
            call_finish_internal(c, PIE_INVALID_ARGUMENT, "request message missing");
            goto started;
        }
        ProtobufCMessage *req = rpc__unpack(m->request, c->payload);
        grpc_byte_buffer_destroy(c->payload);
        c->payload = NULL;
        if (!req) {
            char msg[256];
            snprintf(msg, sizeof msg, "cannot parse request as %s", m->request->name);
            call_finish_internal(c, PIE_INVALID_ARGUMENT, msg); /* the client's bytes */
            goto started;
        }
        c->handler_visible = true;
        if (!m->on_call(c, req, m->user)) rpc_msg_free(req);
    } else {
        call_start_recv(c);
        c->handler_visible = true;
        m->on_call(c, NULL, m->user);
    }
started:
    /* If the whole answer is already known, send it and wait for the close in one batch;
     * otherwise keep RECV_CLOSE outstanding on its own so cancellation is seen at once. */
    pthread_mutex_lock(&c->mu);
    c->defer_send = false;
    bool combine = c->finish_requested && !c->send_inflight && c->q.len <= 1 && !c->closed;
    if (combine) {
        c->close_with_status = true;
        call_pump_locked(c);
        c->close_with_status = false;
    }
    pthread_mutex_unlock(&c->mu);
    if (!combine && call_start_close(c)) {
        pthread_mutex_lock(&c->mu);
        /* Streams: tell the client now that the call is accepted (the link's on_connect). */
        if (m->kind != RPC_UNARY && c->handler_visible) c->want_initial_md = true;
        call_pump_locked(c);
        pthread_mutex_unlock(&c->mu);
    }
    call_try_done(c);
}

static void on_recv(rpc_call *c, bool ok) {
    c->recv_pending = false;
    grpc_byte_buffer *bb = c->recv_bb;
    c->recv_bb = NULL;
    const rpc_method *m = &c->meth->m;
    pthread_mutex_lock(&c->mu);
    bool handler_finished = c->finish_requested || c->closed;
    pthread_mutex_unlock(&c->mu);

    if (!ok || !bb) {
        /* NULL message: half-close, or the call failed (cancel, deadline, lost connection). */
        if (!ok || grpc_call_failed_before_recv_message(c->gcall)) {
            if (!handler_finished) {
                call_mark_cancelled(c);
                call_report_cancel(c);
            }
        } else if (!c->half_closed) {
            c->half_closed = true;
            if (!handler_finished && !atomic_load(&c->cancelled) && m->on_half_close)
                m->on_half_close(c, m->user);
        }
    } else if (handler_finished || atomic_load(&c->cancelled)) {
        grpc_byte_buffer_destroy(bb); /* nobody wants it any more; stop reading */
    } else {
        ProtobufCMessage *msg = rpc__unpack(m->request, bb);
        grpc_byte_buffer_destroy(bb);
        if (!msg) {
            char text[256];
            snprintf(text, sizeof text, "cannot parse request as %s", m->request->name);
            rpc_call_cancel(c, PIE_INVALID_ARGUMENT, text);
        } else {
            if (!m->on_message || !m->on_message(c, msg, m->user)) rpc_msg_free(msg);
            pthread_mutex_lock(&c->mu);
            bool more = !c->closed && !c->finish_requested;
            pthread_mutex_unlock(&c->mu);
            if (more && !atomic_load(&c->cancelled)) call_start_recv(c);
        }
    }
    call_try_done(c);
    call_unref_internal(c);
}

static void on_close(rpc_call *c, bool ok) {
    c->close_pending = false;
    pthread_mutex_lock(&c->mu);
    c->closed = true;
    rpc__sendq_clear(&c->q);
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    if (!ok || c->close_cancelled) {
        atomic_store(&c->cancelled, true);
        call_report_cancel(c);
    }
    call_try_done(c);
    call_unref_internal(c);
}

static void on_send(rpc_call *c, bool ok);

/* The final send batch that also carried RECV_CLOSE: both completions at once. */
static void on_send_close(rpc_call *c, bool ok) {
    rpc_call_ref(c); /* the batch held one reference; on_send and on_close each drop one */
    on_send(c, ok);
    on_close(c, ok);
}

static void on_send(rpc_call *c, bool ok) {
    pthread_mutex_lock(&c->mu);
    c->send_inflight = false;
    if (c->inflight_bb) {
        grpc_byte_buffer_destroy(c->inflight_bb);
        c->inflight_bb = NULL;
    }
    if (!ok) {
        c->send_failed = true;
        rpc__sendq_clear(&c->q);
    } else {
        call_pump_locked(c);
    }
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    call_try_done(c);
    call_unref_internal(c);
}

/* ---------------------------------------------------------------------------------------------
 * Unknown methods: the generic request, kept armed on every thread */

static void arm_generic(rpc_srv_thread *th) {
    rpc_server *srv = th->srv;
    if (atomic_load(&srv->shutting_down)) return;
    rpc_generic *g = calloc(1, sizeof *g);
    if (!g) {
        pie_log_error("rpc.arm", "what=generic err=out_of_memory");
        return;
    }
    g->th = th;
    g->tag = (rpc_tag){TAG_GENERIC_NEW, g};
    grpc_call_details_init(&g->details);
    grpc_metadata_array_init(&g->md);
    grpc_call_error e =
        grpc_server_request_call(srv->gs, &g->gcall, &g->details, &g->md, th->cq, th->cq, &g->tag);
    if (e != GRPC_CALL_OK) {
        pie_log_error("rpc.arm", "what=generic err=%s", rpc__call_error_name(e));
        grpc_call_details_destroy(&g->details);
        grpc_metadata_array_destroy(&g->md);
        free(g);
    }
}

static void generic_free(rpc_generic *g) {
    if (g->gcall) grpc_call_unref(g->gcall);
    if (g->status_msg_set) grpc_slice_unref(g->status_msg);
    grpc_call_details_destroy(&g->details);
    grpc_metadata_array_destroy(&g->md);
    free(g);
}

static void on_generic_new(rpc_srv_thread *th, rpc_generic *g, bool ok) {
    if (!ok) {
        generic_free(g);
        return;
    }
    arm_generic(th);
    char text[300];
    int mlen = (int)GRPC_SLICE_LENGTH(g->details.method);
    if (mlen > 200) mlen = 200;
    snprintf(text, sizeof text, "unknown method %.*s", mlen,
             (const char *)GRPC_SLICE_START_PTR(g->details.method));
    g->status_msg = grpc_slice_from_copied_string(text);
    g->status_msg_set = true;
    grpc_op ops[3];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[1].data.send_status_from_server.status = GRPC_STATUS_UNIMPLEMENTED;
    ops[1].data.send_status_from_server.status_details = &g->status_msg;
    ops[2].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    ops[2].data.recv_close_on_server.cancelled = &g->cancelled;
    g->tag.kind = TAG_GENERIC_DONE;
    grpc_call_error e = grpc_call_start_batch(g->gcall, ops, 3, &g->tag, NULL);
    if (e != GRPC_CALL_OK) {
        pie_log_error("rpc.unimplemented", "err=%s", rpc__call_error_name(e));
        grpc_call_cancel(g->gcall, NULL);
        generic_free(g);
    }
}

/* ---------------------------------------------------------------------------------------------
 * Threads */

static void arm_method(rpc_srv_thread *th, const rpc_srv_method *m) {
    rpc_server *srv = th->srv;
    if (atomic_load(&srv->shutting_down)) return;
    rpc_call *c = call_new(th, m);
    if (!c) {
        pie_log_error("rpc.arm", "method=%s err=out_of_memory", m->m.path);
        return;
    }
    bool payload = m->m.kind == RPC_UNARY || m->m.kind == RPC_SERVER_STREAM;
    grpc_call_error e = grpc_server_request_registered_call(
        srv->gs, m->reg, &c->gcall, &c->g_deadline, &c->req_md, payload ? &c->payload : NULL,
        th->cq, th->cq, &c->t_new);
    if (e != GRPC_CALL_OK) {
        pie_log_error("rpc.arm", "method=%s err=%s", m->m.path, rpc__call_error_name(e));
        call_free(c);
    }
}

/* Binds every address of srv->addr's comma-separated list; srv->port is the first host:port
 * address's port (gRPC answers 1 for a Unix socket: not a port). */
static pie_code add_ports(rpc_server *srv, grpc_server_credentials *creds, pie_status *st) {
    char one[1024];
    const char *p = srv->addr;
    srv->port = 0;
    for (;;) {
        size_t len = strcspn(p, ",");
        if (len == 0 || len >= sizeof one)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "rpc_server_start: '%s' has an empty or overlong address",
                                  srv->addr);
        memcpy(one, p, len);
        one[len] = '\0';
        int port = grpc_server_add_http2_port(srv->gs, one, creds);
        if (port == 0)
            return pie_status_set(st, PIE_UNAVAILABLE, "rpc_server_start: cannot listen on %s",
                                  one);
        if (srv->port == 0 && strncmp(one, "unix:", 5) != 0) srv->port = port;
        if (p[len] == '\0') return PIE_OK;
        p += len + 1;
    }
}

/* Fairness between connections. gRPC reads sockets only while some thread polls, and
 * grpc_completion_queue_next returns a queued event without polling. A receive whose message
 * the transport already holds completes at once, so a thread kept busy by one stream's
 * buffered messages (one read can bring hundreds) would serve them to the last before reading
 * any other connection: the controller, busy with one replica's call flood, heard its worker
 * ~1 s late and dropped it as silent. So a thread that has worked RPC_SRV_POLL_EVERY_NS without
 * once waiting for an event polls once: a zero-timeout next() on a private, always empty queue
 * is a pass of the poller over every connection, whose completions then queue behind the
 * current ones. Idle and lightly loaded threads wait in next() anyway and never pay for it.
 * (Under gRPC's `poll` engine, which the worker selects, a queue polls only its own descriptors
 * and this pass reads nothing; the worker has no second connection to be fair to.) */
#define RPC_SRV_POLL_EVERY_NS 2000000 /* 2 ms of callbacks back to back */
#define RPC_SRV_WAITED_NS     50000   /* a next() this long waited: the poller ran */

static void srv_thread_poll_others(grpc_completion_queue *poll_cq) {
    (void)grpc_completion_queue_next(poll_cq, gpr_time_0(GPR_CLOCK_MONOTONIC), NULL);
}

static void srv_thread_poll_end(grpc_completion_queue *poll_cq) {
    grpc_completion_queue_shutdown(poll_cq);
    while (grpc_completion_queue_next(poll_cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {}
    grpc_completion_queue_destroy(poll_cq);
}

static void *srv_thread_main(void *arg) {
    rpc_srv_thread *th = arg;
    rpc_server *srv = th->srv;
    tls_thread = th;
    char name[16];
    snprintf(name, sizeof name, "rpc-srv-%d", th->idx);
    (void)pthread_setname_np(pthread_self(), name); /* cosmetic; failure is harmless */
    for (size_t i = 0; i < srv->n_methods; i++) arm_method(th, &srv->methods[i]);
    arm_generic(th);
    grpc_completion_queue *poll_cq = grpc_completion_queue_create_for_next(NULL);
    int64_t busy_since = rpc_now_ns();
    for (;;) {
        int64_t before = rpc_now_ns();
        if (before - busy_since >= RPC_SRV_POLL_EVERY_NS) {
            srv_thread_poll_others(poll_cq);
            busy_since = before;
        }
        grpc_event ev =
            grpc_completion_queue_next(th->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        int64_t after = rpc_now_ns();
        if (after - before >= RPC_SRV_WAITED_NS) busy_since = after;
        if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
        if (ev.type != GRPC_OP_COMPLETE) continue;
        rpc_tag *t = ev.tag;
        bool ok = ev.success != 0;
        switch (t->kind) {
        case TAG_NEW_CALL: on_new_call(th, t->obj, ok); break;
        case TAG_RECV: on_recv(t->obj, ok); break;
        case TAG_CLOSE: on_close(t->obj, ok); break;
        case TAG_SEND: on_send(t->obj, ok); break;
        case TAG_SEND_CLOSE: on_send_close(t->obj, ok); break;
        case TAG_GENERIC_NEW: on_generic_new(th, t->obj, ok); break;
        case TAG_GENERIC_DONE: generic_free(t->obj); break;
        case TAG_SHUTDOWN:
            pthread_mutex_lock(&srv->mu);
            srv->shutdown_notified = true;
            pthread_cond_broadcast(&srv->cv);
            pthread_mutex_unlock(&srv->mu);
            break;
        default:
            if (t->kind >= RPC_TAG_LINK_META && t->kind <= RPC_TAG_LINK_STATUS)
                rpc__link_on_tag(t, ok);
            else
                pie_log_error("rpc.tag", "kind=%d", t->kind);
            break;
        }
    }
    srv_thread_poll_end(poll_cq);
    tls_thread = NULL;
    return NULL;
}

/* ---------------------------------------------------------------------------------------------
 * Server lifecycle */

rpc_server *rpc_server_create(const rpc_server_opts *opts, pie_status *st) {
    if (!opts || !opts->addr || !opts->addr[0]) {
        pie_status_set(st, PIE_INVALID_ARGUMENT, "rpc_server_create: opts.addr is empty");
        return NULL;
    }
    if (opts->n_threads < 0 || opts->n_threads > 256) {
        pie_status_set(st, PIE_INVALID_ARGUMENT,
                       "rpc_server_create: opts.n_threads=%d is outside 0..256", opts->n_threads);
        return NULL;
    }
    rpc_server *srv = calloc(1, sizeof *srv);
    if (!srv) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "rpc_server_create: out of memory");
        return NULL;
    }
    if (pthread_mutex_init(&srv->mu, NULL) != 0) {
        free(srv);
        pie_status_set(st, PIE_INTERNAL, "rpc_server_create: pthread_mutex_init failed");
        return NULL;
    }
    if (cond_init_monotonic(&srv->cv) != 0) {
        pthread_mutex_destroy(&srv->mu);
        free(srv);
        pie_status_set(st, PIE_INTERNAL, "rpc_server_create: pthread_cond_init failed");
        return NULL;
    }
    grpc_init();
    srv->n_threads = opts->n_threads ? opts->n_threads : 1;
    srv->max_recv = rpc__max_bytes(opts->max_recv_bytes);
    srv->max_send = rpc__max_bytes(opts->max_send_bytes);
    srv->send_queue_max = opts->send_queue_max;
    srv->send_queue_max_bytes = opts->send_queue_max_bytes;
    srv->health_needs_token = opts->health_needs_token;
    srv->t_shutdown = (rpc_tag){TAG_SHUTDOWN, srv};
    atomic_init(&srv->shutting_down, false);
    atomic_init(&srv->live_calls, 0);
    srv->addr = strdup(opts->addr);
    if (!srv->addr) goto oom;
    srv->tenants = opts->tenants && opts->tenants->n ? opts->tenants : NULL;
    if ((opts->tls_cert_pem != NULL) != (opts->tls_key_pem != NULL) ||
        (opts->tls_client_ca_pem && !opts->tls_cert_pem)) {
        pie_status_set(st, PIE_INVALID_ARGUMENT,
                       "rpc_server_create: TLS needs a certificate and its key (and a client CA "
                       "only with them)");
        rpc_server_destroy(srv);
        return NULL;
    }
    if (opts->tls_cert_pem) {
        srv->tls_cert = strdup(opts->tls_cert_pem);
        srv->tls_key = strdup(opts->tls_key_pem);
        srv->tls_client_ca = opts->tls_client_ca_pem ? strdup(opts->tls_client_ca_pem) : NULL;
        if (!srv->tls_cert || !srv->tls_key || (opts->tls_client_ca_pem && !srv->tls_client_ca))
            goto oom;
    }
    srv->on_finished = opts->on_finished;
    srv->on_finished_user = opts->on_finished_user;
    if (opts->token && opts->token[0]) {
        size_t n = strlen(opts->token) + sizeof "Bearer ";
        srv->auth_expected = malloc(n);
        if (!srv->auth_expected) goto oom;
        snprintf(srv->auth_expected, n, "Bearer %s", opts->token);
        srv->auth_len = strlen(srv->auth_expected);
    }
    srv->health = rpc__health_create(opts->health_not_serving);
    if (!srv->health) goto oom;

    rpc_args a;
    rpc__args_init(&a);
    rpc__args_add_int(&a, GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, srv->max_recv);
    rpc__args_add_int(&a, GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, srv->max_send);
    /* A second server on our port must fail to bind, not silently share it. */
    rpc__args_add_int(&a, GRPC_ARG_ALLOW_REUSEPORT, 0);
    if (opts->keepalive_time_ms > 0) {
        rpc__args_add_int(&a, GRPC_ARG_KEEPALIVE_TIME_MS, opts->keepalive_time_ms);
        rpc__args_add_int(&a, GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                          opts->keepalive_timeout_ms > 0 ? opts->keepalive_timeout_ms : 20000);
    }
    /* Half our clients' 10 s keepalive (svc.c): the same value would leave no margin against
     * timer jitter, and three early pings on an idle link end every call on it (GOAWAY). */
    rpc__args_add_int(&a, GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                      opts->min_client_ping_ms > 0 ? opts->min_client_ping_ms : 5000);
    rpc__args_add_int(&a, GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    srv->gs = grpc_server_create(&a.ca, NULL);
    if (!srv->gs) {
        pie_status_set(st, PIE_INTERNAL, "rpc_server_create: grpc_server_create failed");
        rpc_server_destroy(srv);
        return NULL;
    }
    rpc_method hm[2];
    rpc__health_methods(srv->health, srv->health_needs_token, hm);
    if (rpc_server_add_methods(srv, hm, 2, st) != PIE_OK) {
        rpc_server_destroy(srv);
        return NULL;
    }
    return srv;
oom:
    pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "rpc_server_create: out of memory");
    rpc_server_destroy(srv);
    return NULL;
}

pie_code rpc_server_add_methods(rpc_server *srv, const rpc_method *methods, size_t n,
                                pie_status *st) {
    pthread_mutex_lock(&srv->mu);
    bool started = srv->started;
    pthread_mutex_unlock(&srv->mu);
    if (started)
        return pie_status_set(st, PIE_FAILED_PRECONDITION,
                              "rpc_server_add_methods: the server is already started");
    for (size_t i = 0; i < n; i++) {
        const rpc_method *m = &methods[i];
        if (!m->path || m->path[0] != '/' || !strchr(m->path + 1, '/'))
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "rpc_server_add_methods: methods[%zu].path \"%s\" is not "
                                  "\"/package.Service/Method\"",
                                  i, m->path ? m->path : "(null)");
        if (m->kind < RPC_UNARY || m->kind > RPC_BIDI)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "rpc_server_add_methods: %s: kind %d is not an rpc_kind", m->path,
                                  (int)m->kind);
        if (!m->request || !m->response || !m->on_call)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "rpc_server_add_methods: %s: request, response and on_call "
                                  "are required",
                                  m->path);
        if ((m->kind == RPC_CLIENT_STREAM || m->kind == RPC_BIDI) && !m->on_message)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "rpc_server_add_methods: %s: a streaming-request method needs "
                                  "on_message",
                                  m->path);
        for (size_t j = 0; j < srv->n_methods; j++)
            if (strcmp(srv->methods[j].m.path, m->path) == 0)
                return pie_status_set(st, PIE_ALREADY_EXISTS,
                                      "rpc_server_add_methods: %s is already registered", m->path);
        for (size_t j = 0; j < i; j++)
            if (strcmp(methods[j].path, m->path) == 0)
                return pie_status_set(st, PIE_ALREADY_EXISTS,
                                      "rpc_server_add_methods: %s appears twice", m->path);
    }
    if (srv->n_methods + n > srv->cap_methods) {
        size_t ncap = srv->cap_methods ? srv->cap_methods : 8;
        while (ncap < srv->n_methods + n) ncap *= 2;
        rpc_srv_method *nm = realloc(srv->methods, ncap * sizeof *nm);
        if (!nm)
            return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                                  "rpc_server_add_methods: out of memory");
        srv->methods = nm;
        srv->cap_methods = ncap;
    }
    for (size_t i = 0; i < n; i++) {
        char *p = strdup(methods[i].path);
        if (!p)
            return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                                  "rpc_server_add_methods: out of memory");
        rpc_srv_method *sm = &srv->methods[srv->n_methods++];
        sm->m = methods[i];
        sm->m.path = p;
        sm->path_buf = p;
        sm->reg = NULL;
    }
    return PIE_OK;
}

pie_code rpc_server_start(rpc_server *srv, pie_status *st) {
    pthread_mutex_lock(&srv->mu);
    bool started = srv->started;
    pthread_mutex_unlock(&srv->mu);
    if (started)
        return pie_status_set(st, PIE_FAILED_PRECONDITION, "rpc_server_start: already started");
    for (size_t i = 0; i < srv->n_methods; i++) {
        rpc_srv_method *m = &srv->methods[i];
        bool payload = m->m.kind == RPC_UNARY || m->m.kind == RPC_SERVER_STREAM;
        m->reg = grpc_server_register_method(
            srv->gs, m->m.path, NULL,
            payload ? GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER : GRPC_SRM_PAYLOAD_NONE, 0);
        if (!m->reg)
            return pie_status_set(st, PIE_INTERNAL, "rpc_server_start: cannot register %s",
                                  m->m.path);
    }
    srv->threads = calloc((size_t)srv->n_threads, sizeof *srv->threads);
    if (!srv->threads)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "rpc_server_start: out of memory");
    for (int i = 0; i < srv->n_threads; i++) {
        rpc_srv_thread *th = &srv->threads[i];
        th->srv = srv;
        th->idx = i;
        th->cq = grpc_completion_queue_create_for_next(NULL);
        if (!th->cq)
            return pie_status_set(st, PIE_INTERNAL, "rpc_server_start: cannot create a CQ");
        grpc_server_register_completion_queue(srv->gs, th->cq, NULL);
    }
    grpc_server_credentials *creds;
    if (srv->tls_cert && srv->tls_key) {
        grpc_ssl_pem_key_cert_pair pair = {srv->tls_key, srv->tls_cert};
        creds = grpc_ssl_server_credentials_create_ex(
            srv->tls_client_ca, &pair, 1,
            srv->tls_client_ca ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                               : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
            NULL);
    } else {
        creds = grpc_insecure_server_credentials_create();
    }
    if (creds == NULL)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "rpc_server_start: the TLS certificate or key is not usable PEM");
    pie_code bound = add_ports(srv, creds, st);
    grpc_server_credentials_release(creds);
    /* Started even when a later address failed: gRPC destroys a server that holds listeners
     * only after a shutdown, and rpc_server_destroy's shutdown of a server whose threads never
     * ran (as after a failed pthread_create below) is the one tested path for that. */
    grpc_server_start(srv->gs);
    pthread_mutex_lock(&srv->mu);
    srv->started = true;
    pthread_mutex_unlock(&srv->mu);
    if (bound != PIE_OK) return bound;
    for (int i = 0; i < srv->n_threads; i++) {
        rpc_srv_thread *th = &srv->threads[i];
        int rc = pthread_create(&th->th, NULL, srv_thread_main, th);
        if (rc != 0) {
            pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "rpc_server_start: pthread_create: %s",
                           strerror(rc));
            rpc_server_shutdown(srv, 0);
            return st ? st->code : PIE_RESOURCE_EXHAUSTED;
        }
        th->running = true;
    }
    pie_log_info("rpc.listen", "addr=%s port=%d threads=%d methods=%zu auth=%s", srv->addr,
                 srv->port, srv->n_threads, srv->n_methods,
                 srv->tenants         ? "tenants"
                 : srv->auth_expected ? "bearer"
                                      : "none");
    return PIE_OK;
}

int rpc_server_port(const rpc_server *srv) { return srv->port; }

grpc_completion_queue *rpc__server_attach_link(rpc_server *srv, rpc_link *l, pie_status *st) {
    grpc_completion_queue *cq = NULL;
    pthread_mutex_lock(&srv->mu);
    if (!srv->started || srv->shutdown_started || !srv->threads || !srv->threads[0].running) {
        pie_status_set(st, PIE_FAILED_PRECONDITION,
                       "rpc_link_start: opts.server is not running (start it first)");
        goto out;
    }
    if (srv->n_links == srv->cap_links) {
        size_t ncap = srv->cap_links ? 2 * srv->cap_links : 4;
        rpc_link **nl = realloc(srv->links, ncap * sizeof *nl);
        if (!nl) {
            pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "rpc_link_start: out of memory");
            goto out;
        }
        srv->links = nl;
        srv->cap_links = ncap;
    }
    srv->links[srv->n_links++] = l;
    cq = srv->threads[0].cq;
out:
    pthread_mutex_unlock(&srv->mu);
    return cq;
}

void rpc__server_forget_link(rpc_server *srv, rpc_link *l) {
    pthread_mutex_lock(&srv->mu);
    for (size_t i = 0; i < srv->n_links; i++)
        if (srv->links[i] == l) {
            srv->links[i] = srv->links[--srv->n_links];
            break;
        }
    pthread_mutex_unlock(&srv->mu);
}

pie_code rpc_server_set_health(rpc_server *srv, const char *service, rpc_health_status status,
                               pie_status *st) {
    return rpc__health_set(srv->health, service, status, st);
}

void rpc_server_shutdown(rpc_server *srv, int64_t grace_ms) {
    pthread_mutex_lock(&srv->mu);
    if (!srv->started) {
        pthread_mutex_unlock(&srv->mu);
        return;
    }
    if (srv->shutdown_started) {
        while (!srv->shutdown_done) pthread_cond_wait(&srv->cv, &srv->mu);
        pthread_mutex_unlock(&srv->mu);
        return;
    }
    srv->shutdown_started = true;
    pthread_mutex_unlock(&srv->mu);

    int64_t t0 = rpc_now_ns();
    atomic_store(&srv->shutting_down, true);
    rpc__health_shutdown(srv->health);
    grpc_server_shutdown_and_notify(srv->gs, srv->threads[0].cq, &srv->t_shutdown);
    int64_t deadline = t0 + (grace_ms > 0 ? grace_ms : 0) * 1000000;
    if (!srv->threads[0].running) {
        /* Start failed before any thread ran: nothing is armed; poll the notification here. */
        grpc_server_cancel_all_calls(srv->gs);
        for (;;) {
            grpc_event ev = grpc_completion_queue_next(srv->threads[0].cq,
                                                       gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
            if (ev.type == GRPC_OP_COMPLETE && ev.tag == &srv->t_shutdown) break;
        }
        srv->shutdown_notified = true;
    }
    pthread_mutex_lock(&srv->mu);
    while (!srv->shutdown_notified && cond_wait_until(&srv->cv, &srv->mu, deadline) != ETIMEDOUT) {}
    if (!srv->shutdown_notified) {
        pthread_mutex_unlock(&srv->mu);
        pie_log_info("rpc.shutdown_cancel", "addr=%s grace_ms=%lld live_calls=%ld", srv->addr,
                     (long long)grace_ms, atomic_load(&srv->live_calls));
        grpc_server_cancel_all_calls(srv->gs);
        pthread_mutex_lock(&srv->mu);
        while (!srv->shutdown_notified) pthread_cond_wait(&srv->cv, &srv->mu);
    }
    /* Links on threads[0]'s queue end here, while that thread still polls for them (their
     * calls would keep the queue from shutting down). */
    rpc_link **links = srv->links;
    size_t n_links = srv->n_links;
    srv->links = NULL;
    srv->n_links = srv->cap_links = 0;
    pthread_mutex_unlock(&srv->mu);
    for (size_t i = 0; i < n_links; i++) rpc__link_detach(links[i], RPC_LINK_FLUSH_MS);
    free(links);
    for (int i = 0; i < srv->n_threads; i++) grpc_completion_queue_shutdown(srv->threads[i].cq);
    for (int i = 0; i < srv->n_threads; i++) {
        rpc_srv_thread *th = &srv->threads[i];
        if (th->running) {
            int rc = pthread_join(th->th, NULL);
            if (rc != 0) pie_log_error("rpc.shutdown", "pthread_join: %s", strerror(rc));
            th->running = false;
        } else { /* never ran: drain its queue here */
            while (
                grpc_completion_queue_next(th->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
                GRPC_QUEUE_SHUTDOWN) {}
        }
    }
    pie_log_info("rpc.stopped", "addr=%s port=%d ms=%.1f", srv->addr, srv->port,
                 (double)(rpc_now_ns() - t0) / 1e6);
    pthread_mutex_lock(&srv->mu);
    srv->shutdown_done = true;
    pthread_cond_broadcast(&srv->cv);
    pthread_mutex_unlock(&srv->mu);
}

void rpc_server_destroy(rpc_server *srv) {
    if (!srv) return;
    rpc_server_shutdown(srv, 0);
    if (srv->gs) grpc_server_destroy(srv->gs);
    if (srv->threads) {
        for (int i = 0; i < srv->n_threads; i++) {
            grpc_completion_queue *cq = srv->threads[i].cq;
            if (!cq) continue;
            if (!srv->shutdown_done) { /* start failed before the threads ran */
                grpc_completion_queue_shutdown(cq);
                while (
                    grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
                    GRPC_QUEUE_SHUTDOWN) {}
            }
            grpc_completion_queue_destroy(cq);
        }
        free(srv->threads);
    }
    for (size_t i = 0; i < srv->n_methods; i++) free(srv->methods[i].path_buf);
    free(srv->methods);
    free(srv->links); /* NULL unless start failed with links attached */
    rpc__health_destroy(srv->health);
    free(srv->auth_expected);
    free(srv->addr);
    free(srv->tls_cert);
    if (srv->tls_key) memset(srv->tls_key, 0, strlen(srv->tls_key)); /* a private key */
    free(srv->tls_key);
    free(srv->tls_client_ca);
    pthread_cond_destroy(&srv->cv);
    pthread_mutex_destroy(&srv->mu);
    free(srv);
    grpc_shutdown();
}

/* ---------------------------------------------------------------------------------------------
 * Call accessors and responses */

const char *rpc_call_method(const rpc_call *c) { return c->meth->m.path; }

void rpc_call_set_data(rpc_call *c, void *data) { c->data = data; }

void *rpc_call_get_data(const rpc_call *c) { return c->data; }
const pie_tenant *rpc_call_tenant(const rpc_call *c) {
    return c->tenant ? c->tenant : &pie_tenant_anonymous;
}

int64_t rpc_call_deadline_ns(const rpc_call *c) { return c->deadline_ns; }

int64_t rpc_call_remaining_ms(const rpc_call *c) {
    if (c->deadline_ns == RPC_DEADLINE_NONE) return INT64_MAX;
    return (c->deadline_ns - rpc_now_ns()) / 1000000;
}

bool rpc_call_is_cancelled(const rpc_call *c) { return atomic_load(&((rpc_call *)c)->cancelled); }

const char *rpc_call_metadata(const rpc_call *c, const char *key) {
    return rpc__md_find(c->md, c->n_md, key);
}

const rpc_md *rpc_call_metadata_all(const rpc_call *c, size_t *n) {
    *n = c->n_md;
    return c->md;
}

pie_code rpc_call_add_metadata(rpc_call *c, const char *key, const char *value) {
    if (!rpc__md_legal(key, value)) return PIE_INVALID_ARGUMENT;
    pthread_mutex_lock(&c->mu);
    pie_code rc = PIE_FAILED_PRECONDITION;
    if (!c->initial_md_sent && !c->closed)
        rc = md_list_add(&c->init_md, &c->n_init_md, &c->cap_init_md, key, value);
    pthread_mutex_unlock(&c->mu);
    return rc;
}

pie_code rpc_call_add_trailing_metadata(rpc_call *c, const char *key, const char *value) {
    if (!rpc__md_legal(key, value)) return PIE_INVALID_ARGUMENT;
    pthread_mutex_lock(&c->mu);
    pie_code rc = PIE_FAILED_PRECONDITION;
    if (!c->finish_requested && !c->closed)
        rc = md_list_add(&c->trail_md, &c->n_trail_md, &c->cap_trail_md, key, value);
    pthread_mutex_unlock(&c->mu);
    return rc;
}

/* Whether the send queue has no room for a message of `bytes` packed bytes: send_queue_max
 * messages wait, or it would take the waiting bytes above send_queue_max_bytes. An empty queue
 * always takes one message (max_send_bytes bounds it), so a byte bound below the largest
 * message slows that message down but never refuses it for good. Called with c->mu held. */
static bool call_queue_full_locked(const rpc_call *c, size_t bytes) {
    const rpc_server *srv = c->srv;
    if (srv->send_queue_max && c->q.len >= srv->send_queue_max) return true;
    return srv->send_queue_max_bytes && c->q.len > 0 &&
           c->q.bytes + bytes > srv->send_queue_max_bytes;
}

/* Packs msg, then queues it (and the OK status when finish is set) once there is room. */
static pie_code call_send_impl(rpc_call *c, const ProtobufCMessage *msg, bool wait,
                               int64_t timeout_ms, bool finish) {
    const rpc_method *m = &c->meth->m;
    if (!msg || msg->descriptor != m->response) return PIE_INVALID_ARGUMENT;
    if (atomic_load(&c->cancelled)) return PIE_CANCELLED;
    grpc_byte_buffer *bb;
    pie_code rc = rpc__pack(msg, c->srv->max_send, &bb, NULL);
    if (rc != PIE_OK) return rc;
    int64_t deadline = timeout_ms < 0 ? RPC_DEADLINE_NONE : rpc_now_ns() + timeout_ms * 1000000;
    bool single = m->kind == RPC_UNARY || m->kind == RPC_CLIENT_STREAM;
    pthread_mutex_lock(&c->mu);
    rc = call_sendable_locked(c);
    if (rc == PIE_OK && single && c->n_msgs > 0)
        rc = PIE_FAILED_PRECONDITION; /* one response only */
    while (rc == PIE_OK && call_queue_full_locked(c, grpc_byte_buffer_length(bb))) {
        if (!wait || tls_thread == c->th) {
            rc = PIE_RESOURCE_EXHAUSTED;
            break;
        }
        if (cond_wait_until(&c->cv, &c->mu, deadline) == ETIMEDOUT) {
            rc = PIE_DEADLINE_EXCEEDED;
            break;
        }
        rc = call_sendable_locked(c);
    }
    if (rc == PIE_OK && rpc__sendq_push(&c->q, bb) != 0) rc = PIE_RESOURCE_EXHAUSTED;
    if (rc != PIE_OK) {
        pthread_mutex_unlock(&c->mu);
        grpc_byte_buffer_destroy(bb);
        return rc;
    }
    c->n_msgs++;
    if (finish) call_set_status_locked(c, PIE_OK, NULL);
    call_pump_locked(c);
    pthread_mutex_unlock(&c->mu);
    return PIE_OK;
}

pie_code rpc_call_send(rpc_call *c, const ProtobufCMessage *msg) {
    return call_send_impl(c, msg, false, 0, false);
}

pie_code rpc_call_send_wait(rpc_call *c, const ProtobufCMessage *msg, int64_t timeout_ms) {
    return call_send_impl(c, msg, true, timeout_ms, false);
}

size_t rpc_call_send_queued(const rpc_call *c) {
    rpc_call *mc = (rpc_call *)c;
    pthread_mutex_lock(&mc->mu);
    size_t n = mc->q.len;
    pthread_mutex_unlock(&mc->mu);
    return n;
}

pie_code rpc_call_wait_room(rpc_call *c, size_t max_msgs, size_t max_bytes, int64_t deadline_ns) {
    pthread_mutex_lock(&c->mu);
    pie_code rc;
    for (;;) {
        rc = call_sendable_locked(c);
        if (rc != PIE_OK) break;
        if (c->waits_ended) {
            rc = PIE_ABORTED;
            break;
        }
        if (c->q.len <= max_msgs && c->q.bytes <= max_bytes) break; /* room */
        if (tls_thread == c->th) { /* the thread that would drain the queue */
            rc = PIE_RESOURCE_EXHAUSTED;
            break;
        }
        if (deadline_ns != RPC_DEADLINE_NONE && rpc_now_ns() >= deadline_ns) {
            rc = PIE_DEADLINE_EXCEEDED;
            break;
        }
        cond_wait_until(&c->cv, &c->mu, deadline_ns); /* on_send, cancel, close, end_waits */
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

void rpc_call_end_waits(rpc_call *c) {
    pthread_mutex_lock(&c->mu);
    c->waits_ended = true;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

pie_code rpc_call_reply(rpc_call *c, const ProtobufCMessage *resp) {
    return call_send_impl(c, resp, false, 0, true);
}

pie_code rpc_call_finish(rpc_call *c, pie_code code, const char *msg) {
    if ((int)code < 0 || (int)code > PIE_UNAUTHENTICATED) code = PIE_UNKNOWN;
    pthread_mutex_lock(&c->mu);
    pie_code rc = call_sendable_locked(c);
    if (rc == PIE_OK) {
        call_set_status_locked(c, code, msg);
        call_pump_locked(c);
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

pie_code rpc_call_finish_status(rpc_call *c, const pie_status *st) {
    return rpc_call_finish(c, st->code, st->msg);
}

void rpc_call_cancel(rpc_call *c, pie_code code, const char *msg) {
    if (code == PIE_OK) code = PIE_CANCELLED;
    pthread_mutex_lock(&c->mu);
    if (c->closed || c->status_sent || c->cancel_requested || !c->gcall) {
        pthread_mutex_unlock(&c->mu);
        return;
    }
    c->cancel_requested = true;
    atomic_store(&c->cancelled, true);
    rpc__sendq_clear(&c->q);
    pthread_cond_broadcast(&c->cv);
    call_set_status_locked(c, code, msg);
    if (c->send_inflight) {
        /* A message is in the transport (maybe stuck on flow control): cut the call now. The
         * client then sees this code only if its status has not arrived yet. */
        grpc_call_cancel_with_status(c->gcall, (grpc_status_code)code, msg ? msg : "", NULL);
    } else {
        call_pump_locked(c);
    }
    pthread_mutex_unlock(&c->mu);
}
