/* rpc_client.c — the client side of the RPC layer: channels, blocking unary calls, streams.
 *
 * Owns: rpc_channel (a grpc_channel with our arguments, the bearer token and a cache of
 * registered method handles), rpc_unary (one batch of six ops, plucked in the caller's thread:
 * no thread hop) and rpc_stream (a call with its own pluck completion queue, so a sender thread,
 * a receiver thread and the owner each wait for their own tag).
 * Does not own: the reconnecting link (rpc_link.c), the server (rpc_server.c). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>

#include "grpc/health/v1/health.pb-c.h"
#include "rpc_internal.h"

typedef struct rpc_reg {
    char *path;
    void *handle;
} rpc_reg;

struct rpc_channel {
    grpc_channel *gc;
    char *target;
    char *auth; /* "Bearer <token>" or NULL */
    int max_send;
    int64_t spin_ns;    /* rpc_channel_opts.spin_us */
    pthread_mutex_t mu; /* guards reg */
    rpc_reg *reg;
    size_t n_reg, cap_reg;
};

struct rpc_stream {
    rpc_channel *ch;
    grpc_call *gc;
    grpc_completion_queue *cq;
    const ProtobufCMessageDescriptor *desc;
    rpc_req_md req_md;
    atomic_bool cancelled;

    /* Tags: one distinct address per kind of batch. */
    char t_meta, t_status, t_send, t_close, t_recv;

    pthread_mutex_t send_mu; /* serialises senders and close_send */
    bool send_closed;

    pthread_mutex_t meta_mu; /* whoever waits for the initial metadata */
    bool meta_done, meta_ok;
    grpc_metadata_array init_md;
    rpc_md *imd;
    size_t n_imd;

    pthread_mutex_t status_mu; /* whoever waits for the final status */
    bool status_done;
    grpc_metadata_array trail_md;
    grpc_status_code status;
    grpc_slice details;
    rpc_md *tmd;
    size_t n_tmd;

    /* Receiver only. */
    grpc_byte_buffer *recv_bb;
    bool recv_pending, ended;
};

/* ---------------------------------------------------------------------------------------------
 * Channels */

void rpc__channel_args(const rpc_channel_opts *opts, rpc_args *a) {
    rpc__args_init(a);
    rpc__args_add_int(a, GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, rpc__max_bytes(opts->max_recv_bytes));
    rpc__args_add_int(a, GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, rpc__max_bytes(opts->max_send_bytes));
    /* Each rpc_channel gets its own connection, as its user expects. */
    rpc__args_add_int(a, GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    rpc__args_add_int(a, GRPC_ARG_ENABLE_RETRIES, opts->transparent_retries ? 1 : 0);
    if (opts->keepalive_time_ms > 0) {
        rpc__args_add_int(a, GRPC_ARG_KEEPALIVE_TIME_MS, opts->keepalive_time_ms);
        rpc__args_add_int(a, GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                          opts->keepalive_timeout_ms > 0 ? opts->keepalive_timeout_ms : 20000);
        rpc__args_add_int(a, GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS,
                          opts->keepalive_without_calls ? 1 : 0);
        rpc__args_add_int(a, GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    }
    if (opts->reconnect_initial_ms > 0)
        rpc__args_add_int(a, GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, opts->reconnect_initial_ms);
    /* Despite its name gRPC reads this as the least time one connection attempt gets (its
     * "min connect timeout"), not as a backoff: tied to reconnect_initial_ms it gave attempts
     * 100-200 ms, and a peer slower than that to answer was redialled forever. */
    if (opts->connect_timeout_ms > 0)
        rpc__args_add_int(a, GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, opts->connect_timeout_ms);
    if (opts->reconnect_max_ms > 0)
        rpc__args_add_int(a, GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, opts->reconnect_max_ms);
    if (opts->service_config && opts->service_config[0])
        rpc__args_add_string(a, GRPC_ARG_SERVICE_CONFIG, opts->service_config);
}

rpc_channel *rpc_channel_create(const char *target, const rpc_channel_opts *opts, pie_status *st) {
    static const rpc_channel_opts zero;
    if (!opts) opts = &zero;
    if (!target || !target[0]) {
        pie_status_set(st, PIE_INVALID_ARGUMENT, "rpc_channel_create: target is empty");
        return NULL;
    }
    rpc_channel *ch = calloc(1, sizeof *ch);
    if (!ch) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "rpc_channel_create: out of memory");
        return NULL;
    }
    if (pthread_mutex_init(&ch->mu, NULL) != 0) {
        free(ch);
        pie_status_set(st, PIE_INTERNAL, "rpc_channel_create: pthread_mutex_init failed");
        return NULL;
    }
    grpc_init();
    ch->max_send = rpc__max_bytes(opts->max_send_bytes);
    ch->spin_ns = opts->spin_us > 0 ? (int64_t)opts->spin_us * 1000 : 0;
    ch->target = strdup(target);
    if (!ch->target) goto oom;
    if (opts->token && opts->token[0]) {
        size_t n = strlen(opts->token) + sizeof "Bearer ";
        ch->auth = malloc(n);
        if (!ch->auth) goto oom;
        snprintf(ch->auth, n, "Bearer %s", opts->token);
        if (!rpc__md_legal("authorization", ch->auth)) {
            pie_status_set(st, PIE_INVALID_ARGUMENT,
                           "rpc_channel_create: token contains characters not allowed in metadata");
            rpc_channel_destroy(ch);
            return NULL;
        }
    }
    rpc_args a;
    rpc__channel_args(opts, &a);
    grpc_channel_credentials *creds;
    if (opts->tls_ca_pem) {
        grpc_ssl_pem_key_cert_pair pair = {opts->tls_key_pem, opts->tls_cert_pem};
        creds = grpc_ssl_credentials_create(opts->tls_ca_pem,
                                            opts->tls_cert_pem && opts->tls_key_pem ? &pair : NULL,
                                            NULL, NULL);
    } else {
        creds = grpc_insecure_credentials_create();
    }
    if (creds == NULL) {
        pie_status_set(st, PIE_INVALID_ARGUMENT,
                       "rpc_channel_create: the TLS CA or client certificate is not usable PEM");
        rpc_channel_destroy(ch);
        return NULL;
    }
    ch->gc = grpc_channel_create(target, creds, &a.ca);
    grpc_channel_credentials_release(creds);
    if (!ch->gc) {
        pie_status_set(st, PIE_INVALID_ARGUMENT,
                       "rpc_channel_create: cannot create a channel to %s", target);
        rpc_channel_destroy(ch);
        return NULL;
    }
    return ch;
oom:
    pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "rpc_channel_create: out of memory");
    rpc_channel_destroy(ch);
    return NULL;
}

void rpc_channel_destroy(rpc_channel *ch) {
    if (!ch) return;
    if (ch->gc) grpc_channel_destroy(ch->gc);
    for (size_t i = 0; i < ch->n_reg; i++) free(ch->reg[i].path);
    free(ch->reg);
    free(ch->auth);
    free(ch->target);
    pthread_mutex_destroy(&ch->mu);
    free(ch);
    grpc_shutdown();
}

/* The registered-call handle for path (registered once per channel). NULL if out of memory. */
void *rpc__channel_method(rpc_channel *ch, const char *path) {
    void *h = NULL;
    pthread_mutex_lock(&ch->mu);
    for (size_t i = 0; i < ch->n_reg; i++)
        if (strcmp(ch->reg[i].path, path) == 0) {
            h = ch->reg[i].handle;
            goto out;
        }
    if (ch->n_reg == ch->cap_reg) {
        size_t ncap = ch->cap_reg ? ch->cap_reg * 2 : 8;
        rpc_reg *nr = realloc(ch->reg, ncap * sizeof *nr);
        if (!nr) goto out;
        ch->reg = nr;
        ch->cap_reg = ncap;
    }
    char *p = strdup(path);
    if (!p) goto out;
    h = grpc_channel_register_call(ch->gc, path, NULL, NULL);
    if (!h) {
        free(p);
        goto out;
    }
    ch->reg[ch->n_reg++] = (rpc_reg){p, h};
out:
    pthread_mutex_unlock(&ch->mu);
    return h;
}

pie_code rpc__req_md_build(rpc_req_md *m, const rpc_channel *ch, const rpc_call_opts *o,
                             pie_status *st) {
    size_t n = (ch->auth ? 1 : 0) + o->n_md;
    m->n = 0;
    m->md = n <= RPC_MD_INLINE ? m->inline_md : calloc(n, sizeof *m->md);
    if (!m->md)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "rpc: out of memory for metadata");
    memset(m->md, 0, n * sizeof *m->md);
    if (ch->auth) {
        /* The channel outlives its calls, so its strings can be lent without a copy. */
        m->md[m->n].key = grpc_slice_from_static_string("authorization");
        m->md[m->n].value = grpc_slice_from_static_string(ch->auth);
        m->n++;
    }
    for (size_t i = 0; i < o->n_md; i++) {
        if (!rpc__md_legal(o->md[i].key, o->md[i].value)) {
            for (size_t j = 0; j < m->n; j++) {
                grpc_slice_unref(m->md[j].key);
                grpc_slice_unref(m->md[j].value);
            }
            if (m->md != m->inline_md) free(m->md);
            m->md = NULL;
            m->n = 0;
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "rpc: metadata[%zu] key \"%s\" or its value is not legal text "
                                  "metadata",
                                  i, o->md[i].key ? o->md[i].key : "(null)");
        }
        m->md[m->n].key = grpc_slice_from_copied_string(o->md[i].key);
        m->md[m->n].value = grpc_slice_from_copied_string(o->md[i].value);
        m->n++;
    }
    return PIE_OK;
}

void rpc__req_md_free(rpc_req_md *m) {
    if (!m->md) return;
    for (size_t i = 0; i < m->n; i++) {
        grpc_slice_unref(m->md[i].key);
        grpc_slice_unref(m->md[i].value);
    }
    if (m->md != m->inline_md) free(m->md);
    m->md = NULL;
    m->n = 0;
}

static uint32_t initial_md_flags(const rpc_call_opts *o) {
    return o->wait_for_ready ? GRPC_INITIAL_METADATA_WAIT_FOR_READY |
                                   GRPC_INITIAL_METADATA_WAIT_FOR_READY_EXPLICITLY_SET
                             : 0;
}

pie_code rpc__status_to_pie(grpc_status_code code, grpc_slice details, pie_status *st) {
    pie_code c = (code >= 0 && code <= GRPC_STATUS_UNAUTHENTICATED) ? (pie_code)code : PIE_UNKNOWN;
    if (c == PIE_OK) {
        pie_status_ok(st);
        return PIE_OK;
    }
    return pie_status_set(st, c, "%.*s", (int)GRPC_SLICE_LENGTH(details),
                          (const char *)GRPC_SLICE_START_PTR(details));
}

/* ---------------------------------------------------------------------------------------------
 * Unary */

pie_code rpc_unary(rpc_channel *ch, const char *path, const ProtobufCMessage *req,
                   const ProtobufCMessageDescriptor *resp_desc, ProtobufCMessage **resp,
                   const rpc_call_opts *opts, pie_status *st) {
    static const rpc_call_opts zero;
    if (!opts) opts = &zero;
    *resp = NULL;
    grpc_byte_buffer *send_bb = NULL;
    pie_code rc = rpc__pack(req, ch->max_send, &send_bb, st);
    if (rc != PIE_OK) return rc;
    rpc_req_md md = {0};
    rc = rpc__req_md_build(&md, ch, opts, st);
    if (rc != PIE_OK) {
        grpc_byte_buffer_destroy(send_bb);
        return rc;
    }
    void *handle = rpc__channel_method(ch, path);
    grpc_completion_queue *cq = handle ? grpc_completion_queue_create_for_pluck(NULL) : NULL;
    grpc_call *call = NULL;
    if (cq)
        call =
            grpc_channel_create_registered_call(ch->gc, NULL, GRPC_PROPAGATE_DEFAULTS, cq, handle,
                                                rpc__deadline_from_ms(opts->timeout_ms), NULL);
    if (!call) {
        rc = pie_status_set(st, PIE_INTERNAL, "rpc_unary %s: cannot create the call", path);
        goto out;
    }
    grpc_metadata_array init_md, trail_md;
    grpc_metadata_array_init(&init_md);
    grpc_metadata_array_init(&trail_md);
    grpc_byte_buffer *recv_bb = NULL;
    grpc_status_code status = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();
    grpc_op ops[6];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].flags = initial_md_flags(opts);
    ops[0].data.send_initial_metadata.count = md.n;
    ops[0].data.send_initial_metadata.metadata = md.md;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = send_bb;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &init_md;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &recv_bb;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &trail_md;
    ops[5].data.recv_status_on_client.status = &status;
    ops[5].data.recv_status_on_client.status_details = &details;
    int tag;
    grpc_call_error e = grpc_call_start_batch(call, ops, 6, &tag, NULL);
    if (e != GRPC_CALL_OK) {
        rc = pie_status_set(st, PIE_INTERNAL, "rpc_unary %s: start_batch: %s", path,
                            rpc__call_error_name(e));
    } else {
        grpc_event ev = {.type = GRPC_QUEUE_TIMEOUT};
        if (ch->spin_ns > 0) { /* a zero-deadline pluck polls the transport without sleeping */
            int64_t spin_until = rpc_now_ns() + ch->spin_ns;
            do {
                ev = grpc_completion_queue_pluck(cq, &tag, gpr_time_0(GPR_CLOCK_MONOTONIC), NULL);
            } while (ev.type == GRPC_QUEUE_TIMEOUT && rpc_now_ns() < spin_until);
        }
        if (ev.type == GRPC_QUEUE_TIMEOUT)
            ev = grpc_completion_queue_pluck(cq, &tag, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type != GRPC_OP_COMPLETE) {
            rc = pie_status_set(st, PIE_INTERNAL, "rpc_unary %s: completion queue failed", path);
        } else {
            rc = rpc__status_to_pie(status, details, st);
            if (rc == PIE_OK) {
                if (!recv_bb)
                    rc = pie_status_set(st, PIE_INTERNAL, "rpc_unary %s: server sent no response",
                                        path);
                else if (!(*resp = rpc__unpack(resp_desc, recv_bb)))
                    rc = pie_status_set(st, PIE_INTERNAL,
                                        "rpc_unary %s: cannot parse the response as %s", path,
                                        resp_desc->name);
            }
        }
    }
    if (recv_bb) grpc_byte_buffer_destroy(recv_bb);
    grpc_slice_unref(details);
    grpc_metadata_array_destroy(&init_md);
    grpc_metadata_array_destroy(&trail_md);
    grpc_call_unref(call);
out:
    if (cq) {
        grpc_completion_queue_shutdown(cq);
        grpc_completion_queue_destroy(cq);
    }
    rpc__req_md_free(&md);
    grpc_byte_buffer_destroy(send_bb);
    return rc;
}

pie_code rpc_health_check(rpc_channel *ch, const char *service, int64_t timeout_ms,
                          rpc_health_status *out, pie_status *st) {
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    req.service = (char *)(service ? service : "");
    ProtobufCMessage *resp = NULL;
    rpc_call_opts o = {.timeout_ms = timeout_ms};
    pie_code rc = rpc_unary(ch, "/grpc.health.v1.Health/Check", &req.base,
                            &grpc__health__v1__health_check_response__descriptor, &resp, &o, st);
    if (rc == PIE_OK) {
        *out = (rpc_health_status)((Grpc__Health__V1__HealthCheckResponse *)resp)->status;
        rpc_msg_free(resp);
    }
    return rc;
}

/* ---------------------------------------------------------------------------------------------
 * Streams */

static grpc_event pluck(rpc_stream *s, void *tag, int64_t timeout_ms) {
    gpr_timespec d = timeout_ms < 0 ? gpr_inf_future(GPR_CLOCK_REALTIME)
                                    : gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                                   gpr_time_from_millis(timeout_ms, GPR_TIMESPAN));
    return grpc_completion_queue_pluck(s->cq, tag, d, NULL);
}

rpc_stream *rpc_stream_open(rpc_channel *ch, const char *path,
                            const ProtobufCMessageDescriptor *resp_desc, const rpc_call_opts *opts,
                            pie_status *st) {
    static const rpc_call_opts zero;
    if (!opts) opts = &zero;
    rpc_stream *s = calloc(1, sizeof *s);
    if (!s) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "rpc_stream_open: out of memory");
        return NULL;
    }
    s->ch = ch;
    s->desc = resp_desc;
    s->details = grpc_empty_slice();
    atomic_init(&s->cancelled, false);
    grpc_metadata_array_init(&s->init_md);
    grpc_metadata_array_init(&s->trail_md);
    bool mu1 = pthread_mutex_init(&s->send_mu, NULL) == 0;
    bool mu2 = pthread_mutex_init(&s->meta_mu, NULL) == 0;
    bool mu3 = pthread_mutex_init(&s->status_mu, NULL) == 0;
    if (!mu1 || !mu2 || !mu3) {
        if (mu1) pthread_mutex_destroy(&s->send_mu);
        if (mu2) pthread_mutex_destroy(&s->meta_mu);
        if (mu3) pthread_mutex_destroy(&s->status_mu);
        free(s);
        pie_status_set(st, PIE_INTERNAL, "rpc_stream_open: pthread_mutex_init failed");
        return NULL;
    }
    if (rpc__req_md_build(&s->req_md, ch, opts, st) != PIE_OK) goto fail;
    void *handle = rpc__channel_method(ch, path);
    if (!handle) {
        pie_status_set(st, PIE_INTERNAL, "rpc_stream_open %s: cannot register the method", path);
        goto fail;
    }
    s->cq = grpc_completion_queue_create_for_pluck(NULL);
    if (!s->cq) {
        pie_status_set(st, PIE_INTERNAL, "rpc_stream_open %s: cannot create a completion queue",
                       path);
        goto fail;
    }
    s->gc =
        grpc_channel_create_registered_call(ch->gc, NULL, GRPC_PROPAGATE_DEFAULTS, s->cq, handle,
                                            rpc__deadline_from_ms(opts->timeout_ms), NULL);
    if (!s->gc) {
        pie_status_set(st, PIE_INTERNAL, "rpc_stream_open %s: cannot create the call", path);
        goto fail;
    }
    grpc_op ops[2];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].flags = initial_md_flags(opts);
    ops[0].data.send_initial_metadata.count = s->req_md.n;
    ops[0].data.send_initial_metadata.metadata = s->req_md.md;
    ops[1].op = GRPC_OP_RECV_INITIAL_METADATA; /* without it RECV_MESSAGE never completes */
    ops[1].data.recv_initial_metadata.recv_initial_metadata = &s->init_md;
    grpc_call_error e = grpc_call_start_batch(s->gc, ops, 2, &s->t_meta, NULL);
    if (e != GRPC_CALL_OK) {
        pie_status_set(st, PIE_INTERNAL, "rpc_stream_open %s: start_batch: %s", path,
                       rpc__call_error_name(e));
        goto fail;
    }
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[0].data.recv_status_on_client.trailing_metadata = &s->trail_md;
    ops[0].data.recv_status_on_client.status = &s->status;
    ops[0].data.recv_status_on_client.status_details = &s->details;
    e = grpc_call_start_batch(s->gc, ops, 1, &s->t_status, NULL);
    if (e != GRPC_CALL_OK) {
        /* Unreachable in practice; the metadata batch is out, so cancel and collect it. */
        pie_status_set(st, PIE_INTERNAL, "rpc_stream_open %s: start_batch(status): %s", path,
                       rpc__call_error_name(e));
        grpc_call_cancel(s->gc, NULL);
        (void)pluck(s, &s->t_meta, -1);
        goto fail;
    }
    return s;
fail:
    if (s->gc) grpc_call_unref(s->gc);
    if (s->cq) {
        grpc_completion_queue_shutdown(s->cq);
        grpc_completion_queue_destroy(s->cq);
    }
    rpc__req_md_free(&s->req_md);
    grpc_metadata_array_destroy(&s->init_md);
    grpc_metadata_array_destroy(&s->trail_md);
    pthread_mutex_destroy(&s->send_mu);
    pthread_mutex_destroy(&s->meta_mu);
    pthread_mutex_destroy(&s->status_mu);
    free(s);
    return NULL;
}

static pie_code ended_code(rpc_stream *s, pie_status *st, const char *what) {
    if (atomic_load(&s->cancelled))
        return pie_status_set(st, PIE_CANCELLED, "%s: the stream was cancelled", what);
    return pie_status_set(st, PIE_UNAVAILABLE,
                          "%s: the call has ended (rpc_stream_finish has its status)", what);
}

pie_code rpc_stream_send(rpc_stream *s, const ProtobufCMessage *msg, pie_status *st) {
    grpc_byte_buffer *bb;
    pie_code rc = rpc__pack(msg, s->ch->max_send, &bb, st);
    if (rc != PIE_OK) return rc;
    pthread_mutex_lock(&s->send_mu);
    if (s->send_closed) {
        pthread_mutex_unlock(&s->send_mu);
        grpc_byte_buffer_destroy(bb);
        return pie_status_set(st, PIE_FAILED_PRECONDITION,
                              "rpc_stream_send: sending side is closed");
    }
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_SEND_MESSAGE;
    op.data.send_message.send_message = bb;
    grpc_call_error e = grpc_call_start_batch(s->gc, &op, 1, &s->t_send, NULL);
    bool ok = false;
    if (e == GRPC_CALL_OK) {
        grpc_event ev = pluck(s, &s->t_send, -1);
        ok = ev.type == GRPC_OP_COMPLETE && ev.success;
    }
    pthread_mutex_unlock(&s->send_mu);
    grpc_byte_buffer_destroy(bb);
    if (e != GRPC_CALL_OK)
        return pie_status_set(st, PIE_INTERNAL, "rpc_stream_send: start_batch: %s",
                              rpc__call_error_name(e));
    return ok ? PIE_OK : ended_code(s, st, "rpc_stream_send");
}

pie_code rpc_stream_close_send(rpc_stream *s, pie_status *st) {
    pie_code rc = PIE_OK;
    pthread_mutex_lock(&s->send_mu);
    if (!s->send_closed) {
        s->send_closed = true;
        grpc_op op;
        memset(&op, 0, sizeof op);
        op.op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
        grpc_call_error e = grpc_call_start_batch(s->gc, &op, 1, &s->t_close, NULL);
        if (e != GRPC_CALL_OK) {
            rc = pie_status_set(st, PIE_INTERNAL, "rpc_stream_close_send: start_batch: %s",
                                rpc__call_error_name(e));
        } else {
            grpc_event ev = pluck(s, &s->t_close, -1);
            if (ev.type != GRPC_OP_COMPLETE || !ev.success)
                rc = ended_code(s, st, "rpc_stream_close_send");
        }
    }
    pthread_mutex_unlock(&s->send_mu);
    return rc;
}

rpc_recv_result rpc_stream_recv(rpc_stream *s, ProtobufCMessage **msg, int64_t timeout_ms) {
    *msg = NULL;
    if (s->ended) return RPC_RECV_END;
    if (!s->recv_pending) {
        grpc_op op;
        memset(&op, 0, sizeof op);
        op.op = GRPC_OP_RECV_MESSAGE;
        op.data.recv_message.recv_message = &s->recv_bb;
        if (grpc_call_start_batch(s->gc, &op, 1, &s->t_recv, NULL) != GRPC_CALL_OK) {
            s->ended = true;
            return RPC_RECV_END;
        }
        s->recv_pending = true;
    }
    grpc_event ev = pluck(s, &s->t_recv, timeout_ms);
    if (ev.type == GRPC_QUEUE_TIMEOUT) return RPC_RECV_TIMEOUT;
    s->recv_pending = false;
    grpc_byte_buffer *bb = s->recv_bb;
    s->recv_bb = NULL;
    if (ev.type != GRPC_OP_COMPLETE || !ev.success || !bb) {
        if (bb) grpc_byte_buffer_destroy(bb);
        s->ended = true;
        return RPC_RECV_END;
    }
    *msg = rpc__unpack(s->desc, bb);
    grpc_byte_buffer_destroy(bb);
    if (!*msg) {
        char text[256];
        snprintf(text, sizeof text, "cannot parse a response as %s", s->desc->name);
        grpc_call_cancel_with_status(s->gc, GRPC_STATUS_INTERNAL, text, NULL);
        s->ended = true;
        return RPC_RECV_END;
    }
    return RPC_RECV_MESSAGE;
}

/* Waits for the final status (the call is over); idempotent. */
static void stream_wait_status(rpc_stream *s) {
    pthread_mutex_lock(&s->status_mu);
    if (!s->status_done) {
        (void)pluck(s, &s->t_status, -1); /* always completes: it is how every call ends */
        s->status_done = true;
        if (rpc__md_copy(&s->trail_md, &s->tmd, &s->n_tmd) != 0) s->n_tmd = 0;
    }
    pthread_mutex_unlock(&s->status_mu);
}

/* Collects the initial-metadata batch if it completes within timeout_ms. Returns whether the
 * batch is done; *ok gets its success. */
static bool stream_wait_meta(rpc_stream *s, int64_t timeout_ms, bool *ok) {
    pthread_mutex_lock(&s->meta_mu);
    if (!s->meta_done) {
        grpc_event ev = pluck(s, &s->t_meta, timeout_ms);
        if (ev.type == GRPC_OP_COMPLETE) {
            s->meta_done = true;
            s->meta_ok = ev.success != 0;
            if (s->meta_ok && rpc__md_copy(&s->init_md, &s->imd, &s->n_imd) != 0) s->n_imd = 0;
        }
    }
    bool done = s->meta_done;
    *ok = done && s->meta_ok;
    pthread_mutex_unlock(&s->meta_mu);
    return done;
}

pie_code rpc_stream_wait_ready(rpc_stream *s, int64_t timeout_ms, pie_status *st) {
    bool ok;
    if (!stream_wait_meta(s, timeout_ms, &ok))
        return pie_status_set(st, PIE_DEADLINE_EXCEEDED,
                              "rpc_stream_wait_ready: no answer from the server within %lld ms",
                              (long long)timeout_ms);
    /* A trailers-only answer (e.g. UNAUTHENTICATED) also completes the metadata batch: if the
     * status is already here, the stream is not ready but over. */
    pthread_mutex_lock(&s->status_mu);
    if (!s->status_done) {
        grpc_event ev = pluck(s, &s->t_status, 0);
        if (ev.type == GRPC_OP_COMPLETE) {
            s->status_done = true;
            if (rpc__md_copy(&s->trail_md, &s->tmd, &s->n_tmd) != 0) s->n_tmd = 0;
        }
    }
    bool over = s->status_done;
    pthread_mutex_unlock(&s->status_mu);
    if (!ok && !over) {
        stream_wait_status(s);
        over = true;
    }
    if (over) {
        pie_code c = rpc__status_to_pie(s->status, s->details, st);
        if (c == PIE_OK)
            return pie_status_set(st, PIE_UNAVAILABLE,
                                  "rpc_stream_wait_ready: the server ended the stream at once");
        return c;
    }
    pie_status_ok(st);
    return PIE_OK;
}

void rpc_stream_cancel(rpc_stream *s) {
    atomic_store(&s->cancelled, true);
    grpc_call_cancel(s->gc, NULL);
}

pie_code rpc_stream_finish(rpc_stream *s, pie_status *st) {
    (void)rpc_stream_close_send(s, NULL); /* fails only if the call is already over */
    ProtobufCMessage *m;
    while (rpc_stream_recv(s, &m, -1) == RPC_RECV_MESSAGE) rpc_msg_free(m);
    stream_wait_status(s);
    bool ok;
    (void)stream_wait_meta(s, -1, &ok);
    return rpc__status_to_pie(s->status, s->details, st);
}

const char *rpc_stream_initial_metadata(rpc_stream *s, const char *key) {
    pthread_mutex_lock(&s->meta_mu);
    const char *v = s->meta_done ? rpc__md_find(s->imd, s->n_imd, key) : NULL;
    pthread_mutex_unlock(&s->meta_mu);
    return v;
}

const char *rpc_stream_trailing_metadata(rpc_stream *s, const char *key) {
    pthread_mutex_lock(&s->status_mu);
    const char *v = s->status_done ? rpc__md_find(s->tmd, s->n_tmd, key) : NULL;
    pthread_mutex_unlock(&s->status_mu);
    return v;
}

void rpc_stream_destroy(rpc_stream *s) {
    if (!s) return;
    pthread_mutex_lock(&s->status_mu);
    bool over = s->status_done;
    pthread_mutex_unlock(&s->status_mu);
    if (!over || s->recv_pending) rpc_stream_cancel(s);
    (void)rpc_stream_finish(s, NULL); /* collects every outstanding tag */
    grpc_call_unref(s->gc);
    grpc_completion_queue_shutdown(s->cq);
    grpc_completion_queue_destroy(s->cq);
    rpc__req_md_free(&s->req_md);
    grpc_metadata_array_destroy(&s->init_md);
    grpc_metadata_array_destroy(&s->trail_md);
    grpc_slice_unref(s->details);
    free(s->imd);
    free(s->tmd);
    pthread_mutex_destroy(&s->send_mu);
    pthread_mutex_destroy(&s->meta_mu);
    pthread_mutex_destroy(&s->status_mu);
    free(s);
}

grpc_channel *rpc__channel_gc(const rpc_channel *ch) { return ch->gc; }
int rpc__channel_max_send(const rpc_channel *ch) { return ch->max_send; }
