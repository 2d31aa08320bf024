/* fuzz_rpc.c — see fuzz_rpc.h. */
#include "fuzz_rpc.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fuzz_util.h"

struct rpc_call {
    const rpc_method *m;
    atomic_int refs;
    pthread_mutex_t mu;
    void *data;
    bool visible;   /* the handler saw on_call */
    bool finished;  /* rpc_call_finish / reply, or the driver's INVALID_ARGUMENT */
    bool cancelled; /* rpc_call_cancel or the client */
    bool cancel_reported, done, replied;
    bool half_closed; /* the client's side: no message or half-close follows (gRPC) */
    bool waits_ended; /* rpc_call_end_waits */
};

struct fz_rpc {
    const rpc_method *methods;
    size_t n_methods;
    rpc_call *slot[FZ_RPC_SLOTS];
    fz_rpc_event_fn event; /* op 7, when set */
    void *event_user;
};

/* ---- rpc_call_* as handlers see them ------------------------------------------------------- */

static void call_unref(rpc_call *c) {
    if (atomic_fetch_sub(&c->refs, 1) == 1) {
        pthread_mutex_destroy(&c->mu);
        free(c);
    }
}

const char *rpc_call_method(const rpc_call *call) { return call->m->path; }
void rpc_call_set_data(rpc_call *call, void *data) { call->data = data; }
void *rpc_call_get_data(const rpc_call *call) { return call->data; }
/* Every fuzzed call is the anonymous tenant's (no tenants: the default deployment). */
const pie_tenant *rpc_call_tenant(const rpc_call *call) {
    (void)call;
    return &pie_tenant_anonymous;
}
int64_t rpc_call_deadline_ns(const rpc_call *call) {
    (void)call;
    return RPC_DEADLINE_NONE;
}
int64_t rpc_call_remaining_ms(const rpc_call *call) {
    (void)call;
    return INT64_MAX;
}
bool rpc_call_is_cancelled(const rpc_call *call) {
    rpc_call *c = (rpc_call *)call;
    pthread_mutex_lock(&c->mu);
    bool v = c->cancelled;
    pthread_mutex_unlock(&c->mu);
    return v;
}
const char *rpc_call_metadata(const rpc_call *call, const char *key) {
    (void)call;
    (void)key;
    return NULL;
}
const rpc_md *rpc_call_metadata_all(const rpc_call *call, size_t *n) {
    (void)call;
    *n = 0;
    return NULL;
}
pie_code rpc_call_add_metadata(rpc_call *call, const char *key, const char *value) {
    (void)call;
    (void)key;
    (void)value;
    return PIE_OK;
}
pie_code rpc_call_add_trailing_metadata(rpc_call *call, const char *key, const char *value) {
    (void)call;
    (void)key;
    (void)value;
    return PIE_OK;
}

/* Packs msg as rpc_call_send would (so ASan sees every byte the handler built). */
static pie_code send_msg(rpc_call *c, const ProtobufCMessage *msg, bool reply) {
    if (msg->descriptor != c->m->response)
        fuzz_fail("%s: handler sent a %s, the method's response type is %s", c->m->path,
                  msg->descriptor->name, c->m->response->name);
    size_t n = protobuf_c_message_get_packed_size(msg);
    uint8_t *buf = malloc(n ? n : 1);
    if (buf == NULL) abort();
    if (protobuf_c_message_pack(msg, buf) != n) fuzz_fail("%s: pack size mismatch", c->m->path);
    free(buf);
    pie_code rc = PIE_OK;
    pthread_mutex_lock(&c->mu);
    bool unary = c->m->kind == RPC_UNARY || c->m->kind == RPC_CLIENT_STREAM;
    if (c->cancelled)
        rc = PIE_CANCELLED;
    else if (c->finished || (unary && c->replied))
        rc = PIE_FAILED_PRECONDITION;
    else if (reply || unary)
        c->replied = true;
    if (reply && rc == PIE_OK) c->finished = true;
    pthread_mutex_unlock(&c->mu);
    return rc;
}

pie_code rpc_call_send(rpc_call *call, const ProtobufCMessage *msg) {
    return send_msg(call, msg, false);
}
pie_code rpc_call_send_wait(rpc_call *call, const ProtobufCMessage *msg, int64_t timeout_ms) {
    (void)timeout_ms;
    return send_msg(call, msg, false);
}
/* Sends here never queue: there is always room, until the call is over or its waits ended. */
pie_code rpc_call_wait_room(rpc_call *call, size_t max_msgs, size_t max_bytes,
                            int64_t deadline_ns) {
    (void)max_msgs;
    (void)max_bytes;
    (void)deadline_ns;
    pthread_mutex_lock(&call->mu);
    pie_code rc = call->waits_ended ? PIE_ABORTED
                  : call->cancelled ? PIE_CANCELLED
                  : call->finished  ? PIE_FAILED_PRECONDITION
                                    : PIE_OK;
    pthread_mutex_unlock(&call->mu);
    return rc;
}
void rpc_call_end_waits(rpc_call *call) {
    pthread_mutex_lock(&call->mu);
    call->waits_ended = true;
    pthread_mutex_unlock(&call->mu);
}
size_t rpc_call_send_queued(const rpc_call *call) {
    (void)call;
    return 0;
}
pie_code rpc_call_reply(rpc_call *call, const ProtobufCMessage *resp) {
    return send_msg(call, resp, true);
}
pie_code rpc_call_finish(rpc_call *call, pie_code code, const char *msg) {
    if (getenv("PIE_FUZZ_LOG"))
        fprintf(stderr, "fuzz_rpc: %s: finished %s: %s\n", call->m->path, pie_code_name(code),
                msg ? msg : "");
    pie_code rc = PIE_OK;
    pthread_mutex_lock(&call->mu);
    if (call->cancelled)
        rc = PIE_CANCELLED;
    else if (call->finished)
        rc = PIE_FAILED_PRECONDITION;
    call->finished = true;
    pthread_mutex_unlock(&call->mu);
    return rc;
}
pie_code rpc_call_finish_status(rpc_call *call, const pie_status *st) {
    return rpc_call_finish(call, st->code, st->msg);
}
void rpc_call_cancel(rpc_call *call, pie_code code, const char *msg) {
    if (getenv("PIE_FUZZ_LOG"))
        fprintf(stderr, "fuzz_rpc: %s: cancelled %s: %s\n", call->m->path, pie_code_name(code),
                msg);
    pthread_mutex_lock(&call->mu);
    if (!call->finished) call->cancelled = true;
    pthread_mutex_unlock(&call->mu);
}
void rpc_call_ref(rpc_call *call) { atomic_fetch_add(&call->refs, 1); }
void rpc_call_unref(rpc_call *call) { call_unref(call); }

/* ---- rpc_server_*: never called by a harness (it runs no server); defined so that the link
 * never needs rpc_server.o, whose rpc_call_* would clash with the ones above. ---------------- */

rpc_server *rpc_server_create(const rpc_server_opts *opts, pie_status *st) {
    (void)opts;
    pie_status_set(st, PIE_UNIMPLEMENTED, "fuzz_rpc: no server in a fuzz harness");
    return NULL;
}
pie_code rpc_server_add_methods(rpc_server *srv, const rpc_method *methods, size_t n,
                                pie_status *st) {
    (void)srv;
    (void)methods;
    (void)n;
    return pie_status_set(st, PIE_UNIMPLEMENTED, "fuzz_rpc: no server in a fuzz harness");
}
pie_code rpc_server_start(rpc_server *srv, pie_status *st) {
    (void)srv;
    return pie_status_set(st, PIE_UNIMPLEMENTED, "fuzz_rpc: no server in a fuzz harness");
}
int rpc_server_port(const rpc_server *srv) {
    (void)srv;
    return 0;
}
void rpc_server_shutdown(rpc_server *srv, int64_t grace_ms) {
    (void)srv;
    (void)grace_ms;
}
void rpc_server_destroy(rpc_server *srv) { (void)srv; }
/* The asynchronous link's hooks into a server (rpc_internal.h): no server, so no link is ever
 * attached to one; defined for the same reason as the rest of this section. */
struct grpc_completion_queue *rpc__server_attach_link(rpc_server *srv, rpc_link *l,
                                                      pie_status *st);
void rpc__server_forget_link(rpc_server *srv, rpc_link *l);
struct grpc_completion_queue *rpc__server_attach_link(rpc_server *srv, rpc_link *l,
                                                      pie_status *st) {
    (void)srv;
    (void)l;
    pie_status_set(st, PIE_UNIMPLEMENTED, "fuzz_rpc: no server in a fuzz harness");
    return NULL;
}
void rpc__server_forget_link(rpc_server *srv, rpc_link *l) {
    (void)srv;
    (void)l;
}
pie_code rpc_server_set_health(rpc_server *srv, const char *service, rpc_health_status status,
                               pie_status *st) {
    (void)srv;
    (void)service;
    (void)status;
    pie_status_ok(st);
    return PIE_OK;
}

/* ---- the driver ---------------------------------------------------------------------------- */

fz_rpc *fz_rpc_create(const rpc_method *methods, size_t n_methods) {
    fz_rpc *f = calloc(1, sizeof *f);
    if (f == NULL) abort();
    f->methods = methods;
    f->n_methods = n_methods;
    return f;
}

void fz_rpc_on_event(fz_rpc *f, fz_rpc_event_fn fn, void *user) {
    f->event = fn;
    f->event_user = user;
}

/* What rpc_server.c's call_try_done does once nothing is outstanding: on_cancel if the call
 * was cancelled and the handler has not heard, then on_done; the slot is free again. */
static void settle(fz_rpc *f, int s, bool client_gone) {
    rpc_call *c = f->slot[s];
    if (c == NULL) return;
    pthread_mutex_lock(&c->mu);
    if (client_gone && !c->finished) c->cancelled = true;
    bool over = c->finished || c->cancelled;
    bool cancelled = c->cancelled && !c->cancel_reported;
    if (cancelled) c->cancel_reported = true;
    pthread_mutex_unlock(&c->mu);
    if (!over) return;
    if (cancelled && c->visible && c->m->on_cancel) c->m->on_cancel(c, c->m->user);
    if (c->visible && c->m->on_done) c->m->on_done(c, c->m->user);
    c->done = true;
    f->slot[s] = NULL;
    call_unref(c);
}

/* A client of a unary or client-streaming call waits for its answer before its next call;
 * handlers that answer from a thread of their own (PutProgram, UploadProgram, DeleteProgram)
 * get up to 10 s, so that what one input does does not depend on thread timing. */
static void await_answer(rpc_call *c) {
    if (c->m->kind == RPC_BIDI || c->m->kind == RPC_SERVER_STREAM) return;
    for (int i = 0; i < 100000; i++) {
        pthread_mutex_lock(&c->mu);
        bool over = c->finished || c->cancelled;
        pthread_mutex_unlock(&c->mu);
        if (over) return;
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
    fuzz_fail("%s: no answer 10 s after the request was complete", c->m->path);
}

static void open_call(fz_rpc *f, int s, const uint8_t *p, size_t n) {
    if (f->slot[s]) settle(f, s, true);
    if (n == 0) return;
    const rpc_method *m = &f->methods[p[0] % f->n_methods];
    rpc_call *c = calloc(1, sizeof *c);
    if (c == NULL) abort();
    c->m = m;
    atomic_init(&c->refs, 1);
    pthread_mutex_init(&c->mu, NULL);
    f->slot[s] = c;
    if (m->kind == RPC_UNARY || m->kind == RPC_SERVER_STREAM) {
        ProtobufCMessage *req = protobuf_c_message_unpack(m->request, NULL, n - 1, p + 1);
        if (req == NULL) {
            c->finished = true; /* "cannot parse request as ..." INVALID_ARGUMENT */
        } else {
            c->visible = true;
            if (!m->on_call(c, req, m->user)) protobuf_c_message_free_unpacked(req, NULL);
            await_answer(c);
        }
    } else {
        c->visible = true;
        m->on_call(c, NULL, m->user);
    }
    settle(f, s, false);
}

static void message(fz_rpc *f, int s, const uint8_t *p, size_t n) {
    rpc_call *c = f->slot[s];
    if (c == NULL || c->m->kind == RPC_UNARY || c->m->kind == RPC_SERVER_STREAM) return;
    if (c->half_closed) return;
    pthread_mutex_lock(&c->mu);
    bool dropped = c->finished || c->cancelled;
    pthread_mutex_unlock(&c->mu);
    if (dropped) return;
    ProtobufCMessage *msg = protobuf_c_message_unpack(c->m->request, NULL, n, p);
    if (msg == NULL) {
        if (getenv("PIE_FUZZ_LOG"))
            fprintf(stderr, "fuzz_rpc: %s: unparseable message\n", c->m->path);
        rpc_call_cancel(c, PIE_INVALID_ARGUMENT, "cannot parse request");
    } else if (!c->m->on_message || !c->m->on_message(c, msg, c->m->user)) {
        protobuf_c_message_free_unpacked(msg, NULL);
    }
    settle(f, s, false);
}

static void half_close(fz_rpc *f, int s) {
    rpc_call *c = f->slot[s];
    if (c == NULL || c->half_closed) return;
    c->half_closed = true;
    pthread_mutex_lock(&c->mu);
    bool dropped = c->finished || c->cancelled;
    pthread_mutex_unlock(&c->mu);
    if (!dropped && c->m->on_half_close) {
        c->m->on_half_close(c, c->m->user);
        await_answer(c);
    }
    settle(f, s, false);
}

void fz_rpc_feed(fz_rpc *f, const uint8_t *data, size_t size) {
    size_t i = 0;
    while (i < size) {
        uint8_t op = data[i++];
        size_t len = 0;
        if (i < size) len = data[i++];
        if (i < size) len |= (size_t)data[i++] << 8;
        if (len > size - i) len = size - i;
        const uint8_t *p = data + i;
        i += len;
        int s = (op >> 3) % FZ_RPC_SLOTS;
        switch (op & 7) {
        case 1: message(f, s, p, len); break;
        case 2: half_close(f, s); break;
        case 3: settle(f, s, true); break;
        case 7:
            if (f->event) {
                f->event(f->event_user, p, len);
                break;
            }
            open_call(f, s, p, len);
            break;
        default: open_call(f, s, p, len); break;
        }
    }
    for (int s = 0; s < FZ_RPC_SLOTS; s++) settle(f, s, true);
}

void fz_rpc_destroy(fz_rpc *f) { free(f); }
