/* rpc_link.c — a long-lived bidi stream that reopens itself.
 *
 * Owns: the link thread (open → wait until the server accepts → on_connect → receive loop →
 * on_disconnect → on_backoff → backoff with jitter → reopen), rpc_link_send from any thread,
 * and stopping.
 * Two ways to drive the stream:
 *  - threaded (default): built on rpc_stream (rpc_client.c); the link thread waits for each
 *    message on the stream's own queue and a send waits until the transport took it;
 *  - asynchronous (opts.server): the stream is created on that server's first completion queue
 *    and driven by its thread, so one polling thread does the server's and the link's I/O;
 *    on_connect and on_message run on the server thread; a send never waits for gRPC (queued,
 *    issued when the previous one completes); the link thread only opens, backs off and
 *    reports on_disconnect.
 * Lifecycle replicas and worker groups hold one link each to the controller; on_connect is
 * where they (re-)register. */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pie_log.h"
#include "rpc_internal.h"

struct rpc_link {
    rpc_channel *ch;
    rpc_link_opts o; /* path and md point at the copies below */
    char *path;
    rpc_md *md;
    char *md_strings;
    pthread_t th;
    unsigned seed; /* jitter; per link, so no shared random state */
    atomic_uint connects;

    pthread_mutex_t mu; /* guards the fields below */
    pthread_cond_t cv;
    rpc_stream *stream; /* the open stream while the thread is in an attempt */
    bool connected;
    bool stop;
    unsigned senders; /* rpc_link_send calls using stream right now */
    uint64_t gen;     /* generation of the connected stream (its on_connect count); 0: none */
    bool reset;       /* rpc_link_reset ended the stream of gen: on_disconnect gets reset_st */
    pie_status reset_st;

    /* Asynchronous mode only (opts.server); fields under mu unless said otherwise. */
    rpc_server *srv;           /* registered with it until it detaches us (rpc__link_detach) */
    grpc_completion_queue *cq; /* the server thread's */
    void *method;              /* registered method handle of path */
    rpc_req_md req_md;         /* built once: token + opts.md, sent on every open */
    grpc_call *call;           /* the stream of the current attempt, NULL between attempts */
    int outstanding;           /* tags of call not yet delivered by the server thread */
    bool status_done;          /* call is over (RECV_STATUS_ON_CLIENT completed) */
    bool was_connected, got_msg;
    bool detached;             /* the server stopped: no further stream */
    bool detaching;            /* rpc__link_detach waits for the queue to drain */
    grpc_metadata_array init_md, trail_md; /* of call; read only after their tags */
    grpc_status_code status;
    grpc_slice details;
    grpc_byte_buffer *recv_bb; /* server thread only */
    rpc_sendq q;               /* packed messages behind the one in flight */
    grpc_byte_buffer *inflight;
    rpc_tag t_meta, t_ready, t_recv, t_send, t_status;
};

/* A connected stream that lived this long (or delivered a message) resets the backoff. */
#define RPC_LINK_HEALTHY_NS (1000LL * 1000000)

static int64_t link_delay_ms(rpc_link *l, unsigned attempt) {
    double d = (double)l->o.backoff_initial_ms;
    for (unsigned i = 0; i < attempt && d < (double)l->o.backoff_max_ms; i++)
        d *= l->o.backoff_multiplier;
    if (d > (double)l->o.backoff_max_ms) d = (double)l->o.backoff_max_ms;
    if (l->o.backoff_jitter > 0) {
        double u = (double)rand_r(&l->seed) / (double)RAND_MAX; /* [0,1] */
        d *= 1.0 + l->o.backoff_jitter * (2.0 * u - 1.0);
    }
    return d < 1 ? 1 : (int64_t)d;
}

/* Sleeps ms unless stopped first. Returns true if the link is stopping. */
static bool link_sleep(rpc_link *l, int64_t ms) {
    int64_t deadline = rpc_now_ns() + ms * 1000000;
    struct timespec ts = {.tv_sec = deadline / 1000000000, .tv_nsec = deadline % 1000000000};
    pthread_mutex_lock(&l->mu);
    while (!l->stop && pthread_cond_timedwait(&l->cv, &l->mu, &ts) != ETIMEDOUT) {}
    bool stop = l->stop;
    pthread_mutex_unlock(&l->mu);
    return stop;
}

/* After an attempt (mu held): if the link ended it itself (rpc_link_reset; asynchronous mode
 * also on a failed send or at the send queue's bound), *st becomes the reason it was ended
 * rather than the CANCELLED of our own cancel; a status the server sent first (e.g. its reason
 * for ending) is kept. */
static void link_take_reset_locked(rpc_link *l, pie_status *st) {
    if (!l->reset) return;
    if (st->code == PIE_CANCELLED || st->code == PIE_OK) *st = l->reset_st;
    l->reset = false;
}

/* The end of an attempt that ended without a stop (mu not held), for both ways of driving the
 * stream: on_disconnect says why (st; a clean end from the server is UNAVAILABLE too), then
 * on_backoff and the wait before the next attempt. An attempt opened at t_open_ns that
 * connected and then delivered a message or lived RPC_LINK_HEALTHY_NS starts the backoff over
 * (*attempt = 0). Returns true if the link is stopping. */
static bool link_after_attempt(rpc_link *l, pie_status *st, bool connected, bool got_msg,
                               int64_t t_open_ns, unsigned *attempt) {
    if (st->code == PIE_OK) pie_status_set(st, PIE_UNAVAILABLE, "the server ended the stream");
    if (l->o.on_disconnect) l->o.on_disconnect(l, st, l->o.user);
    if (connected && (got_msg || rpc_now_ns() - t_open_ns >= RPC_LINK_HEALTHY_NS)) *attempt = 0;
    int64_t delay = link_delay_ms(l, *attempt);
    if (l->o.on_backoff) l->o.on_backoff(l, *attempt, delay, l->o.user);
    if (*attempt < 64) (*attempt)++;
    pie_log_debug("rpc.link_retry", "path=%s code=%s delay_ms=%lld", l->path,
                  pie_code_name(st->code), (long long)delay);
    return link_sleep(l, delay);
}

/* ---- asynchronous mode ----------------------------------------------------------------------
 * The call and its tags belong to the server's thread (rpc__link_on_tag); the link thread opens
 * it, waits until every tag of it is back, releases it and backs off. outstanding counts the
 * tags gRPC still holds; the attempt is over when the status is in and outstanding is 0. */

static void alink_wake(rpc_link *l) { pthread_cond_broadcast(&l->cv); }

/* Starts a batch of call (mu held) and counts its tag. */
static bool alink_start(rpc_link *l, const grpc_op *ops, size_t n, rpc_tag *tag) {
    grpc_call_error e = grpc_call_start_batch(l->call, ops, n, tag, NULL);
    if (e != GRPC_CALL_OK) {
        pie_log_error("rpc.link_batch", "path=%s tag=%d err=%s", l->path, tag->kind,
                      rpc__call_error_name(e));
        return false;
    }
    l->outstanding++;
    return true;
}

static bool alink_start_send(rpc_link *l, grpc_byte_buffer *bb) {
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_SEND_MESSAGE;
    op.data.send_message.send_message = bb;
    if (!alink_start(l, &op, 1, &l->t_send)) return false;
    l->inflight = bb;
    return true;
}

static void alink_start_recv(rpc_link *l) {
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &l->recv_bb;
    if (!alink_start(l, &op, 1, &l->t_recv)) grpc_call_cancel(l->call, NULL);
}

/* Opens a stream on the server's queue (mu held). false with *st when no call could be made. */
static bool alink_open_locked(rpc_link *l, pie_status *st) {
    l->call = grpc_channel_create_registered_call(rpc__channel_gc(l->ch), NULL,
                                                  GRPC_PROPAGATE_DEFAULTS, l->cq, l->method,
                                                  gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (!l->call) {
        pie_status_set(st, PIE_INTERNAL, "rpc_link %s: cannot create the call", l->path);
        return false;
    }
    l->outstanding = 0;
    l->status_done = l->was_connected = l->got_msg = false;
    l->status = GRPC_STATUS_OK;
    l->details = grpc_empty_slice();
    grpc_metadata_array_init(&l->init_md);
    grpc_metadata_array_init(&l->trail_md);
    grpc_op ops[2];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].data.send_initial_metadata.count = l->req_md.n;
    ops[0].data.send_initial_metadata.metadata = l->req_md.md;
    ops[1].op = GRPC_OP_RECV_INITIAL_METADATA; /* without it RECV_MESSAGE never completes */
    ops[1].data.recv_initial_metadata.recv_initial_metadata = &l->init_md;
    bool meta = alink_start(l, ops, 2, &l->t_meta);
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[0].data.recv_status_on_client.trailing_metadata = &l->trail_md;
    ops[0].data.recv_status_on_client.status = &l->status;
    ops[0].data.recv_status_on_client.status_details = &l->details;
    if (!meta || !alink_start(l, ops, 1, &l->t_status)) {
        /* Unreachable in practice: end the call; the tags out come back, then it is released. */
        grpc_call_cancel(l->call, NULL);
        l->status_done = true;
        l->status = GRPC_STATUS_INTERNAL;
    }
    return true;
}

/* The attempt's call is over and all of its tags are back (mu held): its status into *st,
 * everything of it freed. */
static void alink_release_locked(rpc_link *l, pie_status *st) {
    (void)rpc__status_to_pie(l->status, l->details, st);
    grpc_slice_unref(l->details);
    grpc_metadata_array_destroy(&l->init_md);
    grpc_metadata_array_destroy(&l->trail_md);
    grpc_call_unref(l->call);
    l->call = NULL;
    rpc__sendq_clear(&l->q); /* messages of an ended stream never go on the next one */
}

static bool alink_over(const rpc_link *l) { return l->status_done && l->outstanding == 0; }

void rpc__link_on_tag(rpc_tag *t, bool ok) {
    rpc_link *l = t->obj;
    pthread_mutex_lock(&l->mu);
    l->outstanding--;
    switch (t->kind) {
    case RPC_TAG_LINK_META:
        /* A trailers-only answer (UNAUTHENTICATED, UNIMPLEMENTED) completes this batch too, and
         * its status may already wait in the queue behind it: an empty batch goes behind it
         * and decides (RPC_TAG_LINK_READY). */
        if (ok && !l->status_done && !l->stop && !l->detached) {
            if (!alink_start(l, NULL, 0, &l->t_ready)) grpc_call_cancel(l->call, NULL);
        } else if (!l->status_done) {
            grpc_call_cancel(l->call, NULL);
        }
        break;
    case RPC_TAG_LINK_READY:
        if (!l->status_done && !l->stop && !l->detached) {
            l->connected = l->was_connected = true;
            l->gen = (uint64_t)atomic_fetch_add(&l->connects, 1) + 1;
            alink_start_recv(l);
            pthread_mutex_unlock(&l->mu);
            if (l->o.on_connect) l->o.on_connect(l, l->o.user);
            return; /* the receive holds a tag: the attempt is not over */
        }
        break;
    case RPC_TAG_LINK_RECV: {
        grpc_byte_buffer *bb = l->recv_bb;
        l->recv_bb = NULL;
        if (!ok || !bb) { /* the server ended the stream, or it was cancelled */
            if (bb) grpc_byte_buffer_destroy(bb);
            break;
        }
        ProtobufCMessage *m = rpc__unpack(l->o.response, bb);
        grpc_byte_buffer_destroy(bb);
        if (!m) {
            char text[256];
            snprintf(text, sizeof text, "cannot parse a message as %s", l->o.response->name);
            grpc_call_cancel_with_status(l->call, GRPC_STATUS_INTERNAL, text, NULL);
            break;
        }
        l->got_msg = true;
        l->outstanding++; /* the next receive's, so that the attempt cannot end meanwhile */
        pthread_mutex_unlock(&l->mu);
        if (!l->o.on_message(l, m, l->o.user)) rpc_msg_free(m);
        pthread_mutex_lock(&l->mu);
        l->outstanding--;
        alink_start_recv(l); /* completes at once (no message) once the call is over */
        break;
    }
    case RPC_TAG_LINK_SEND:
        grpc_byte_buffer_destroy(l->inflight);
        l->inflight = NULL;
        if (!ok) { /* the transport refused it: what follows would arrive without it */
            if (!l->status_done && !l->reset && !l->stop) {
                l->reset = true;
                pie_status_set(&l->reset_st, PIE_UNAVAILABLE,
                               "rpc_link %s: a send on the stream failed", l->path);
                grpc_call_cancel(l->call, NULL);
            }
            rpc__sendq_clear(&l->q);
        } else if (!l->status_done && l->q.len > 0) {
            grpc_byte_buffer *next = rpc__sendq_pop(&l->q);
            if (!alink_start_send(l, next)) {
                grpc_byte_buffer_destroy(next);
                grpc_call_cancel(l->call, NULL);
            }
        }
        break;
    case RPC_TAG_LINK_STATUS:
        l->status_done = true;
        l->connected = false;
        rpc__sendq_clear(&l->q);
        break;
    default: break;
    }
    /* Only when a waiter's condition may hold: a wake-up per tag would cost the link thread a
     * context switch per message. */
    if (alink_over(l) || l->detaching) alink_wake(l);
    pthread_mutex_unlock(&l->mu);
}

static void *alink_main(void *arg) {
    rpc_link *l = arg;
    (void)pthread_setname_np(pthread_self(), "rpc-alink"); /* cosmetic */
    unsigned attempt = 0;
    pthread_mutex_lock(&l->mu);
    for (;;) {
        pie_status st;
        pie_status_ok(&st);
        int64_t t_open = rpc_now_ns();
        if (l->stop) break;
        bool connected = false, got_msg = false;
        if (l->detached) { /* between attempts: nothing was open, nothing to report */
            while (!l->stop) pthread_cond_wait(&l->cv, &l->mu);
            break;
        }
        if (alink_open_locked(l, &st)) {
            while (!alink_over(l)) pthread_cond_wait(&l->cv, &l->mu);
            connected = l->was_connected;
            got_msg = l->got_msg;
            alink_release_locked(l, &st);
            l->gen = 0;
            alink_wake(l); /* a detach waits for the release */
            link_take_reset_locked(l, &st);
            if (l->detached && !l->stop) {
                if (st.code == PIE_CANCELLED || st.code == PIE_OK)
                    pie_status_set(&st, PIE_UNAVAILABLE,
                                   "rpc_link %s: the server it runs on stopped", l->path);
            }
        }
        if (l->stop) break;
        pthread_mutex_unlock(&l->mu);
        bool stop = link_after_attempt(l, &st, connected, got_msg, t_open, &attempt);
        pthread_mutex_lock(&l->mu);
        if (stop) break;
    }
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

/* Queues or starts one packed message on the connected stream (mu held). */
static pie_code alink_send_locked(rpc_link *l, grpc_byte_buffer *bb, pie_status *st) {
    if (l->reset || l->status_done) { /* ending: what it would queue is dropped with it */
        grpc_byte_buffer_destroy(bb);
        return pie_status_set(st, PIE_UNAVAILABLE, "rpc_link_send %s: the stream is ending",
                              l->path);
    }
    if (l->inflight == NULL && l->q.len == 0) {
        if (!alink_start_send(l, bb)) {
            grpc_byte_buffer_destroy(bb);
            return pie_status_set(st, PIE_INTERNAL, "rpc_link_send %s: start_batch failed",
                                  l->path);
        }
        return PIE_OK;
    }
    size_t max = l->o.send_queue_max_bytes ? l->o.send_queue_max_bytes : RPC_LINK_QUEUE_MAX_BYTES;
    size_t len = grpc_byte_buffer_length(bb);
    if (l->q.len > 0 && (l->q.bytes > max || len > max - l->q.bytes)) {
        /* The peer stopped reading (flow control holds the transport): end the stream rather
         * than hold an ever longer queue; everything queued is dropped with it, and the
         * sender's own message is refused, so nothing later arrives without the lost ones. */
        size_t queued = l->q.bytes;
        grpc_byte_buffer_destroy(bb);
        if (!l->status_done && !l->reset && !l->stop) {
            l->reset = true;
            pie_status_set(&l->reset_st, PIE_UNAVAILABLE,
                           "rpc_link %s: the peer stopped reading (%zu bytes queued, bound %zu)",
                           l->path, queued, max);
            grpc_call_cancel(l->call, NULL);
        }
        rpc__sendq_clear(&l->q);
        return pie_status_set(st, PIE_UNAVAILABLE,
                              "rpc_link_send %s: the peer stopped reading (%zu bytes queued, "
                              "bound %zu)",
                              l->path, queued, max);
    }
    if (rpc__sendq_push(&l->q, bb) != 0) {
        grpc_byte_buffer_destroy(bb);
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "rpc_link_send %s: out of memory",
                              l->path);
    }
    return PIE_OK;
}

void rpc__link_detach(rpc_link *l, int64_t flush_ms) {
    int64_t deadline = rpc_now_ns() + flush_ms * 1000000;
    struct timespec ts = {.tv_sec = deadline / 1000000000, .tv_nsec = deadline % 1000000000};
    pthread_mutex_lock(&l->mu);
    l->detaching = true;
    while (l->call && !l->status_done && (l->inflight || l->q.len > 0) &&
           pthread_cond_timedwait(&l->cv, &l->mu, &ts) != ETIMEDOUT) {}
    l->detaching = false;
    l->detached = true;
    l->srv = NULL;
    l->connected = false;
    if (l->call && !l->status_done) grpc_call_cancel(l->call, NULL);
    /* Until the link thread has released the call: gRPC objects of the server's queue are
     * gone when the server is. */
    while (l->call) pthread_cond_wait(&l->cv, &l->mu);
    pthread_mutex_unlock(&l->mu);
}

static void *link_main(void *arg) {
    rpc_link *l = arg;
    (void)pthread_setname_np(pthread_self(), "rpc-link"); /* cosmetic */
    unsigned attempt = 0;
    rpc_call_opts co = {.md = l->o.md, .n_md = l->o.n_md};
    for (;;) {
        pie_status st;
        pie_status_ok(&st);
        bool connected = false, got_msg = false;
        int64_t t_open = rpc_now_ns();
        rpc_stream *s = rpc_stream_open(l->ch, l->path, l->o.response, &co, &st);
        if (s) {
            pthread_mutex_lock(&l->mu);
            bool stop = l->stop;
            if (!stop) l->stream = s;
            pthread_mutex_unlock(&l->mu);
            if (stop) {
                rpc_stream_destroy(s);
                break;
            }
            if (rpc_stream_wait_ready(s, -1, &st) == PIE_OK) {
                connected = true;
                pthread_mutex_lock(&l->mu);
                l->connected = true;
                l->gen = (uint64_t)atomic_fetch_add(&l->connects, 1) + 1;
                pthread_mutex_unlock(&l->mu);
                if (l->o.on_connect) l->o.on_connect(l, l->o.user);
                ProtobufCMessage *m;
                while (rpc_stream_recv(s, &m, -1) == RPC_RECV_MESSAGE) {
                    got_msg = true;
                    if (!l->o.on_message(l, m, l->o.user)) rpc_msg_free(m);
                }
            }
            pthread_mutex_lock(&l->mu);
            l->connected = false;
            l->stream = NULL;
            l->gen = 0;
            while (l->senders > 0) /* their sends fail at once: the call is over or cancelled */
                pthread_cond_wait(&l->cv, &l->mu);
            pthread_mutex_unlock(&l->mu);
            if (connected || st.code == PIE_OK) (void)rpc_stream_finish(s, &st);
            rpc_stream_destroy(s);
            pthread_mutex_lock(&l->mu);
            link_take_reset_locked(l, &st);
            pthread_mutex_unlock(&l->mu);
        }
        pthread_mutex_lock(&l->mu);
        bool stop = l->stop;
        pthread_mutex_unlock(&l->mu);
        if (stop) break;
        if (link_after_attempt(l, &st, connected, got_msg, t_open, &attempt)) break;
    }
    return NULL;
}

static void link_free(rpc_link *l) {
    rpc__req_md_free(&l->req_md);
    rpc__sendq_free(&l->q);
    free(l->path);
    free(l->md);
    free(l->md_strings);
    free(l);
}

rpc_link *rpc_link_start(rpc_channel *ch, const rpc_link_opts *opts, pie_status *st) {
    if (!ch || !opts || !opts->path || !opts->response || !opts->on_message) {
        pie_status_set(
            st, PIE_INVALID_ARGUMENT,
            "rpc_link_start: channel, opts.path, opts.response and opts.on_message are required");
        return NULL;
    }
    rpc_link *l = calloc(1, sizeof *l);
    if (!l) goto oom;
    l->ch = ch;
    l->o = *opts;
    if (l->o.backoff_initial_ms <= 0) l->o.backoff_initial_ms = 100;
    if (l->o.backoff_max_ms <= 0) l->o.backoff_max_ms = 5000;
    if (l->o.backoff_max_ms < l->o.backoff_initial_ms)
        l->o.backoff_max_ms = l->o.backoff_initial_ms;
    if (l->o.backoff_multiplier < 1.0) l->o.backoff_multiplier = 1.6;
    if (l->o.backoff_jitter == 0) l->o.backoff_jitter = 0.2;
    if (l->o.backoff_jitter > 1) l->o.backoff_jitter = 1;
    l->seed = (unsigned)rpc_now_ns() ^ (unsigned)(uintptr_t)l;
    atomic_init(&l->connects, 0);
    l->path = strdup(opts->path);
    if (!l->path) goto oom;
    l->o.path = l->path;
    if (opts->n_md) {
        size_t bytes = 0;
        for (size_t i = 0; i < opts->n_md; i++)
            bytes += strlen(opts->md[i].key) + strlen(opts->md[i].value) + 2;
        l->md = calloc(opts->n_md, sizeof *l->md);
        l->md_strings = malloc(bytes);
        if (!l->md || !l->md_strings) goto oom;
        char *p = l->md_strings;
        for (size_t i = 0; i < opts->n_md; i++) {
            size_t kl = strlen(opts->md[i].key) + 1, vl = strlen(opts->md[i].value) + 1;
            memcpy(p, opts->md[i].key, kl);
            l->md[i].key = p;
            p += kl;
            memcpy(p, opts->md[i].value, vl);
            l->md[i].value = p;
            p += vl;
        }
        l->o.md = l->md;
    }
    if (pthread_mutex_init(&l->mu, NULL) != 0) {
        link_free(l);
        pie_status_set(st, PIE_INTERNAL, "rpc_link_start: pthread_mutex_init failed");
        return NULL;
    }
    pthread_condattr_t ca;
    int rc = pthread_condattr_init(&ca);
    if (rc == 0) {
        rc = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        if (rc == 0) rc = pthread_cond_init(&l->cv, &ca);
        pthread_condattr_destroy(&ca);
    }
    if (rc != 0) {
        pthread_mutex_destroy(&l->mu);
        link_free(l);
        pie_status_set(st, PIE_INTERNAL, "rpc_link_start: pthread_cond_init failed");
        return NULL;
    }
    if (opts->server) { /* asynchronous: the stream runs on the server's thread */
        rpc_call_opts co = {.md = l->o.md, .n_md = l->o.n_md};
        l->t_meta = (rpc_tag){RPC_TAG_LINK_META, l};
        l->t_ready = (rpc_tag){RPC_TAG_LINK_READY, l};
        l->t_recv = (rpc_tag){RPC_TAG_LINK_RECV, l};
        l->t_send = (rpc_tag){RPC_TAG_LINK_SEND, l};
        l->t_status = (rpc_tag){RPC_TAG_LINK_STATUS, l};
        l->method = rpc__channel_method(ch, l->path);
        if (!l->method) {
            pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "rpc_link_start %s: cannot register it",
                           l->path);
            goto fail_sync;
        }
        if (rpc__req_md_build(&l->req_md, ch, &co, st) != PIE_OK) goto fail_sync;
        l->cq = rpc__server_attach_link(opts->server, l, st);
        if (!l->cq) goto fail_sync;
        l->srv = opts->server;
    }
    rc = pthread_create(&l->th, NULL, opts->server ? alink_main : link_main, l);
    if (rc != 0) {
        if (l->srv) rpc__server_forget_link(l->srv, l);
        pthread_cond_destroy(&l->cv);
        pthread_mutex_destroy(&l->mu);
        link_free(l);
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "rpc_link_start: pthread_create: %s",
                       strerror(rc));
        return NULL;
    }
    return l;
fail_sync:
    pthread_cond_destroy(&l->cv);
    pthread_mutex_destroy(&l->mu);
    link_free(l);
    return NULL;
oom:
    if (l) link_free(l);
    pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "rpc_link_start: out of memory");
    return NULL;
}

/* Sends on the connected stream if its generation is gen (0: whichever is connected). */
static pie_code link_send(rpc_link *l, uint64_t gen, const ProtobufCMessage *msg, pie_status *st) {
    grpc_byte_buffer *bb = NULL;
    if (l->cq) { /* asynchronous: pack outside the lock; never waits for the transport */
        pie_code rc = rpc__pack(msg, rpc__channel_max_send(l->ch), &bb, st);
        if (rc != PIE_OK) return rc;
    }
    pthread_mutex_lock(&l->mu);
    rpc_stream *s = l->connected ? l->stream : NULL;
    if (!l->connected || (!l->cq && !s)) {
        pthread_mutex_unlock(&l->mu);
        if (bb) grpc_byte_buffer_destroy(bb);
        return pie_status_set(st, PIE_UNAVAILABLE, "rpc_link_send %s: not connected", l->path);
    }
    if (gen != 0 && l->gen != gen) {
        uint64_t now = l->gen;
        pthread_mutex_unlock(&l->mu);
        if (bb) grpc_byte_buffer_destroy(bb);
        return pie_status_set(st, PIE_UNAVAILABLE,
                              "rpc_link_send %s: stream %llu ended (stream %llu is open now)",
                              l->path, (unsigned long long)gen, (unsigned long long)now);
    }
    if (l->cq) {
        pie_code rc = alink_send_locked(l, bb, st);
        pthread_mutex_unlock(&l->mu);
        return rc;
    }
    l->senders++;
    pthread_mutex_unlock(&l->mu);
    pie_code rc = rpc_stream_send(s, msg, st);
    pthread_mutex_lock(&l->mu);
    if (--l->senders == 0) pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
    return rc;
}

pie_code rpc_link_send(rpc_link *l, const ProtobufCMessage *msg, pie_status *st) {
    return link_send(l, 0, msg, st);
}

pie_code rpc_link_send_gen(rpc_link *l, uint64_t gen, const ProtobufCMessage *msg, pie_status *st) {
    if (gen == 0)
        return pie_status_set(st, PIE_UNAVAILABLE, "rpc_link_send %s: not connected", l->path);
    return link_send(l, gen, msg, st);
}

uint64_t rpc_link_generation(rpc_link *l) {
    pthread_mutex_lock(&l->mu);
    uint64_t g = l->connected ? l->gen : 0;
    pthread_mutex_unlock(&l->mu);
    return g;
}

void rpc_link_reset(rpc_link *l, uint64_t gen, pie_code code, const char *msg) {
    pthread_mutex_lock(&l->mu);
    if (gen != 0 && l->connected && l->gen == gen && (l->stream || l->call) && !l->reset &&
        !l->stop) {
        l->reset = true;
        pie_status_set(&l->reset_st, code, "%s", msg ? msg : pie_code_name(code));
        /* the receive ends, then on_disconnect (on the link thread) */
        if (l->call)
            grpc_call_cancel(l->call, NULL);
        else
            rpc_stream_cancel(l->stream);
    }
    pthread_mutex_unlock(&l->mu);
}

bool rpc_link_connected(rpc_link *l) {
    pthread_mutex_lock(&l->mu);
    bool c = l->connected;
    pthread_mutex_unlock(&l->mu);
    return c;
}

unsigned rpc_link_connects(rpc_link *l) { return atomic_load(&l->connects); }

void rpc_link_stop(rpc_link *l) {
    if (!l) return;
    pthread_mutex_lock(&l->mu);
    l->stop = true;
    if (l->stream) rpc_stream_cancel(l->stream);
    if (l->call && !l->status_done) grpc_call_cancel(l->call, NULL);
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
    int rc = pthread_join(l->th, NULL); /* asynchronous: after every tag of the call is back */
    if (rc != 0) pie_log_error("rpc.link_stop", "pthread_join: %s", strerror(rc));
    if (l->call) { /* stopped while an attempt was open: its tags are back (alink_main) */
        pie_status ignored;
        alink_release_locked(l, &ignored);
    }
    if (l->srv) rpc__server_forget_link(l->srv, l); /* not detached: the server still runs */
    pthread_cond_destroy(&l->cv);
    pthread_mutex_destroy(&l->mu);
    link_free(l);
}
