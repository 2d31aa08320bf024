/* rpc.h — Pie-C's RPC layer over the gRPC C core (Debian libgrpc 1.51) and protobuf-c.
 *
 * Owns: servers (completion-queue threads, registered unary/streaming methods, UNIMPLEMENTED for
 * unknown methods, bearer-token auth, the grpc.health.v1.Health service, graceful shutdown),
 * server call objects (callbacks, thread-safe queued sends, finish, metadata, deadline,
 * cancellation), client channels, blocking unary calls, client streams, and the reconnecting
 * bidi stream ("link") that lifecycle replicas and workers keep open to the controller.
 * Does not own: the wire contracts (proto/), what any method means (the services).
 * Threading model, handler how-to and pitfalls: services/common/rpc/README.md.
 *
 * Conventions. Every status code is a pie_code (= gRPC code). Functions taking a pie_status *st
 * accept NULL. Messages handed to callbacks are borrowed for the duration of the callback unless
 * the callback returns true ("kept"), in which case the callee owns them and frees them with
 * rpc_msg_free. Times: *_ms are relative milliseconds, *_ns are absolute CLOCK_MONOTONIC
 * nanoseconds (rpc_now_ns). */
#ifndef PIE_RPC_H
#define PIE_RPC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <protobuf-c/protobuf-c.h>

#include "pie_status.h"
#include "pie_tenant.h"

/* ---------------------------------------------------------------------------------------------
 * Common */

typedef enum rpc_kind {
    RPC_UNARY = 0,         /* one request, one response */
    RPC_CLIENT_STREAM = 1, /* many requests, one response */
    RPC_SERVER_STREAM = 2, /* one request, many responses */
    RPC_BIDI = 3,          /* many both ways */
} rpc_kind;

/* One metadata entry. Keys are lowercase ASCII; values are NUL-terminated text (keys ending in
 * "-bin" are not supported by this layer). */
typedef struct rpc_md {
    const char *key;
    const char *value;
} rpc_md;

#define RPC_DEADLINE_NONE INT64_MAX /* rpc_call_deadline_ns when the client set no deadline */

/* CLOCK_MONOTONIC in nanoseconds. */
int64_t rpc_now_ns(void);

/* Frees a message received from this layer (protobuf_c_message_free_unpacked). NULL is fine. */
void rpc_msg_free(ProtobufCMessage *msg);

/* ---------------------------------------------------------------------------------------------
 * Server */

typedef struct rpc_server rpc_server;
typedef struct rpc_call rpc_call; /* one server-side call; reference counted */

/* Method table entry. Callbacks of one call run on that call's completion-queue thread, one at
 * a time, never concurrently; they must not block (they stall every call on that thread). The
 * table entries are copied by rpc_server_add_methods; `user` is passed to every callback. */
typedef struct rpc_method {
    const char *path;                           /* "/pie.v1.Controller/Session" */
    rpc_kind kind;
    const ProtobufCMessageDescriptor *request;  /* type of request messages */
    const ProtobufCMessageDescriptor *response; /* type of response messages (documentation and
                                                   checks: rpc_call_send rejects other types) */
    /* Required. A new call. RPC_UNARY / RPC_SERVER_STREAM: req is the request. RPC_CLIENT_STREAM
     * / RPC_BIDI: req is NULL and requests follow through on_message. Return true to keep req.
     * The handler must eventually finish the call (rpc_call_reply / rpc_call_finish /
     * rpc_call_cancel), here or later from any thread, unless the call is cancelled first. */
    bool (*on_call)(rpc_call *call, ProtobufCMessage *req, void *user);
    /* Required for RPC_CLIENT_STREAM and RPC_BIDI: one request message; return true to keep it. */
    bool (*on_message)(rpc_call *call, ProtobufCMessage *msg, void *user);
    /* Optional: the client closed its sending side (no more on_message). Never called for a
     * cancelled call. */
    void (*on_half_close)(rpc_call *call, void *user);
    /* Optional: the call was cancelled before the handler's status was sent (client cancel,
     * deadline, connection loss, rpc_call_cancel, server shutdown). Called at most once. Later
     * sends and finish return PIE_CANCELLED. */
    void (*on_cancel)(rpc_call *call, void *user);
    /* Optional: the call is over (finished or cancelled) and no callback follows. Free per-call
     * state here. After it returns the layer drops its reference; references the handler took
     * with rpc_call_ref keep the object (not the gRPC call) alive. */
    void (*on_done)(rpc_call *call, void *user);
    void *user;
    bool no_auth; /* callable without the bearer token (the health service sets this by option) */
} rpc_method;

typedef struct rpc_server_opts {
    const char *addr;          /* "0.0.0.0:5000"; port 0 picks a free one (rpc_server_port).
                                  Several, comma-separated, are all bound, e.g.
                                  "0.0.0.0:50052,unix:/run/pie/controller.sock": a Unix
                                  socket for the services of the same machine (cheaper across
                                  cores than loopback TCP: bench/results/controller.md) */
    int n_threads;             /* completion-queue threads; 0 → 1. gRPC's epoll poller has
                                  one polling thread at a time, so with more CQ threads some
                                  events are read by one thread and handed to another (a
                                  wake-up, ~20-60 µs on 2 cores). More threads pay off only
                                  when callbacks themselves burn CPU. See README. */
    const char *token;         /* bearer token; NULL or "" → no auth. Calls whose `authorization`
                                  metadata is not exactly "Bearer <token>" get UNAUTHENTICATED */
    /* TLS (PEM text, borrowed until rpc_server_start): with a certificate and its key the
     * server speaks TLS only; with client_ca too it also requires and verifies client
     * certificates signed by it (mutual TLS). NULL → plaintext. */
    const char *tls_cert_pem, *tls_key_pem, *tls_client_ca_pem;
    const pie_tenants *tenants; /* client tenants (must outlive the server): when non-empty, a
                                  call's `authorization` must be one tenant's "Bearer <token>"
                                  (token above is then not accepted) and rpc_call_tenant names
                                  it; NULL or empty → token decides, every caller "anonymous" */
    /* Optional, for metrics: every call once it is over (after its status went out, or
     * cancelled: code CANCELLED), with its full method name and its time since arrival. Runs on
     * a completion-queue thread: keep it short. */
    void (*on_finished)(void *user, const char *method, pie_code code, int64_t dur_ns);
    void *on_finished_user;
    bool health_needs_token;   /* false (default): grpc.health.v1.Health is callable without the
                                  token, so Kubernetes probes work */
    bool health_not_serving;   /* false (default): overall health "" starts SERVING */
    int max_recv_bytes;        /* 0 → 4 MiB; -1 → unlimited; larger → RESOURCE_EXHAUSTED */
    int max_send_bytes;        /* 0 → 4 MiB; -1 → unlimited */
    size_t send_queue_max;     /* per call: messages queued and not yet handed to the transport
                                  before rpc_call_send says RESOURCE_EXHAUSTED; 0 → unbounded */
    size_t send_queue_max_bytes; /* per call: packed bytes of those messages; a message that
                                  would take them above it is refused the same way (an empty
                                  queue takes any one message); 0 → unbounded. A producer that
                                  cannot wait (rpc_call_send_wait) must treat the refusal as the
                                  end of the call — see README "Bounded send queues" */
    int keepalive_time_ms;     /* server pings idle connections this often; 0 → off (gRPC
                                  default: 2 h) */
    int keepalive_timeout_ms;  /* 0 → 20 s */
    int min_client_ping_ms;    /* accept client keepalive pings this often; 0 → 5 s */
} rpc_server_opts;

/* Creates a server (not yet listening). Calls grpc_init; rpc_server_destroy balances it. */
rpc_server *rpc_server_create(const rpc_server_opts *opts, pie_status *st);

/* Adds methods (copied, including path strings). Only before rpc_server_start. Paths must be
 * unique; INVALID_ARGUMENT names the offending entry. */
pie_code rpc_server_add_methods(rpc_server *srv, const rpc_method *methods, size_t n,
                                pie_status *st);

/* Binds opts->addr and starts the completion-queue threads. */
pie_code rpc_server_start(rpc_server *srv, pie_status *st);

/* The bound port (after start), e.g. the one the kernel chose for port 0: of the first
 * host:port address in the list; 0 when every address is a Unix socket. */
int rpc_server_port(const rpc_server *srv);

/* Graceful shutdown: stop accepting calls, set every health status to NOT_SERVING and end Watch
 * streams, let calls in flight finish for up to grace_ms, then cancel the rest (clients see
 * UNAVAILABLE), wait for every call's on_done, stop the threads. Idempotent. Do not call from a
 * handler callback. */
void rpc_server_shutdown(rpc_server *srv, int64_t grace_ms);

/* Shuts down with grace 0 if still running, frees everything, grpc_shutdown. NULL is fine. */
void rpc_server_destroy(rpc_server *srv);

/* grpc.health.v1 statuses (values as in health.proto). */
typedef enum rpc_health_status {
    RPC_HEALTH_UNKNOWN = 0,
    RPC_HEALTH_SERVING = 1,
    RPC_HEALTH_NOT_SERVING = 2,
    RPC_HEALTH_SERVICE_UNKNOWN = 3, /* setting this removes the service */
} rpc_health_status;

/* Sets the health of `service` ("" = the whole server) at any time, from any thread; watchers
 * of that service are sent the new status. Check of a service never set → NOT_FOUND; Watch of
 * one → SERVICE_UNKNOWN (and later updates if it appears). */
pie_code rpc_server_set_health(rpc_server *srv, const char *service, rpc_health_status status,
                               pie_status *st);

/* --- server calls: accessors (any thread; metadata/deadline valid until on_done returns) --- */

const char *rpc_call_method(const rpc_call *call);          /* the method's path */
/* Per-call handler state: a plain field, meant for the callbacks (one thread); synchronise
 * yourself if other threads touch it. */
void rpc_call_set_data(rpc_call *call, void *data);
void *rpc_call_get_data(const rpc_call *call);
int64_t rpc_call_deadline_ns(const rpc_call *call);         /* RPC_DEADLINE_NONE if none */
int64_t rpc_call_remaining_ms(const rpc_call *call);        /* INT64_MAX if no deadline; ≤0 past */
bool rpc_call_is_cancelled(const rpc_call *call);
/* The caller's tenant (rpc_server_opts.tenants), &pie_tenant_anonymous without tenants. */
const pie_tenant *rpc_call_tenant(const rpc_call *call);
/* First value of request metadata `key` (lowercase), or NULL. Owned by the call. */
const char *rpc_call_metadata(const rpc_call *call, const char *key);
/* All request metadata; *n gets the count. Owned by the call. */
const rpc_md *rpc_call_metadata_all(const rpc_call *call, size_t *n);

/* --- server calls: responses (thread-safe: any thread, any time) --- */

/* Adds response initial metadata. Only before the initial metadata goes out: inside on_call for
 * streaming methods (it is sent when on_call returns), or before rpc_call_reply / finish for
 * unary ones. FAILED_PRECONDITION afterwards, INVALID_ARGUMENT for an illegal key/value. */
pie_code rpc_call_add_metadata(rpc_call *call, const char *key, const char *value);
/* Adds response trailing metadata; before rpc_call_finish. */
pie_code rpc_call_add_trailing_metadata(rpc_call *call, const char *key, const char *value);

/* Queues one response message (packed now, in the caller's thread) and returns without waiting
 * for the network. Messages go out in order; at most one is in the transport at a time (when
 * none is, the caller's thread starts the send itself: no thread hop). PIE_CANCELLED if the call
 * was cancelled, FAILED_PRECONDITION if already finished or if a unary/client-streaming method
 * already sent its one response, RESOURCE_EXHAUSTED if larger than max_send_bytes or if the
 * queue is full (send_queue_max messages or send_queue_max_bytes bytes wait; the message is
 * then not queued), INVALID_ARGUMENT for a
 * message whose type is not the method's response type. */
pie_code rpc_call_send(rpc_call *call, const ProtobufCMessage *msg);
/* As rpc_call_send, but while the queue is full waits up to timeout_ms (<0: forever) for room:
 * DEADLINE_EXCEEDED if none came. From a callback (the call's own thread) it cannot wait and
 * behaves like rpc_call_send. */
pie_code rpc_call_send_wait(rpc_call *call, const ProtobufCMessage *msg, int64_t timeout_ms);
size_t rpc_call_send_queued(const rpc_call *call); /* messages waiting for the transport */
/* Back-pressure for a producer that must not outrun a slow client (not on a completion-queue
 * thread): waits until at most max_msgs messages of at most max_bytes packed bytes in all wait
 * for the transport (as rpc_call_send_queued counts them: not the one in flight), the call can
 * take no more messages, rpc_call_end_waits was called, or deadline_ns (rpc_now_ns clock;
 * RPC_DEADLINE_NONE: none; 0: only checks) passed. PIE_OK when there is room, ABORTED after
 * rpc_call_end_waits, DEADLINE_EXCEEDED, or what rpc_call_send would answer (CANCELLED,
 * FAILED_PRECONDITION). On the call's own completion-queue thread it cannot wait: a full queue
 * is RESOURCE_EXHAUSTED there. */
pie_code rpc_call_wait_room(rpc_call *call, size_t max_msgs, size_t max_bytes,
                            int64_t deadline_ns);
/* Ends every rpc_call_wait_room on call, now and later, with ABORTED: its producer must stop
 * waiting for this client (the producer was stopped, or no longer writes to this call). Any
 * thread. */
void rpc_call_end_waits(rpc_call *call);

/* Unary / client-streaming answer: resp then status OK, in one batch. */
pie_code rpc_call_reply(rpc_call *call, const ProtobufCMessage *resp);
/* Ends the call with code and message (msg may be NULL) after every queued message has gone.
 * Exactly once per call; FAILED_PRECONDITION the second time, CANCELLED after cancellation. */
pie_code rpc_call_finish(rpc_call *call, pie_code code, const char *msg);
pie_code rpc_call_finish_status(rpc_call *call, const pie_status *st);
/* Ends the call at once with code and message, dropping queued messages; on_cancel is called.
 * The client sees this status, or CANCELLED if a message was still in the transport at that
 * moment (the call is then cut with RST_STREAM). No-op if the call is already over. */
void rpc_call_cancel(rpc_call *call, pie_code code, const char *msg);

/* Extra references, e.g. for a scheduler thread that sends later. Thread-safe. */
void rpc_call_ref(rpc_call *call);
void rpc_call_unref(rpc_call *call);

/* ---------------------------------------------------------------------------------------------
 * Client */

typedef struct rpc_channel rpc_channel;

typedef struct rpc_channel_opts {
    const char *token;             /* sent as "authorization: Bearer <token>"; NULL → none */
    const char *tls_ca_pem;        /* TLS: PEM of the CA that signed the server's certificate
                                      (its name must match the target's host); NULL → plaintext */
    const char *tls_cert_pem, *tls_key_pem; /* a client certificate for mutual TLS (optional) */
    int max_recv_bytes;            /* 0 → 4 MiB; -1 → unlimited */
    int max_send_bytes;            /* 0 → 4 MiB; -1 → unlimited */
    int keepalive_time_ms;         /* 0 → no keepalive pings */
    int keepalive_timeout_ms;      /* 0 → 20 s */
    bool keepalive_without_calls;  /* ping even with no call open (long-lived links: true) */
    int reconnect_initial_ms;      /* subchannel reconnect backoff; 0 → gRPC default (1 s) */
    int reconnect_max_ms;          /* 0 → gRPC default (120 s) */
    int connect_timeout_ms;        /* how long one connection attempt (TCP, TLS, the server's
                                      HTTP/2 settings) may take before it is given up and
                                      redialled; 0 → 20 s (gRPC's default). Independent of the
                                      backoff: an attempt's deadline is the later of the two. */
    bool transparent_retries;      /* false (default): gRPC's retry machinery is off (it costs
                                      ~10% of a unary call); a call that races a server's
                                      GOAWAY then fails with UNAVAILABLE instead of being
                                      re-sent. true: on. */
    const char *service_config;    /* gRPC service config JSON (borrowed until the channel
                                      exists), e.g. round-robin over every address the target
                                      resolves to with client-side health checking:
                                      {"loadBalancingConfig":[{"round_robin":{}}],
                                       "healthCheckConfig":{"serviceName":"pie.v1.Lifecycle"}}
                                      NULL → gRPC's default (pick_first). */
    int spin_us;                   /* rpc_unary: poll for the reply without sleeping for up to
                                      this long before blocking. Trades CPU for latency: it
                                      saves the wake-up of the caller's thread (~20-40 us on a
                                      busy 2-core VM, see bench/results/rpc.md). 0 (default):
                                      never spin. */
} rpc_channel_opts;

/* Per-call options; NULL means all zero. */
typedef struct rpc_call_opts {
    int64_t timeout_ms;   /* deadline relative to now; ≤0 → no deadline */
    const rpc_md *md;     /* extra request metadata */
    size_t n_md;
    bool wait_for_ready;  /* queue the call while the channel connects instead of failing fast
                             with UNAVAILABLE */
} rpc_call_opts;

/* A channel to `target` ("127.0.0.1:5000", "dns:///controller:5000"). Connects lazily. Calls
 * grpc_init; rpc_channel_destroy balances it. Thread-safe; share one per target. */
rpc_channel *rpc_channel_create(const char *target, const rpc_channel_opts *opts,
                                pie_status *st);
/* Every call, stream and link on the channel must be gone first. NULL is fine. */
void rpc_channel_destroy(rpc_channel *ch);

/* Blocking unary call in the caller's thread. On PIE_OK *resp (of type resp_desc) is set and
 * the caller frees it with rpc_msg_free; otherwise *resp is NULL and st says why. */
pie_code rpc_unary(rpc_channel *ch, const char *path, const ProtobufCMessage *req,
                   const ProtobufCMessageDescriptor *resp_desc, ProtobufCMessage **resp,
                   const rpc_call_opts *opts, pie_status *st);

/* A client stream for any streaming kind: client-streaming = sends, close_send, one recv;
 * server-streaming = one send, close_send, recvs; bidi = both. One receiver thread and any
 * number of sender threads may use it concurrently; rpc_stream_cancel from any thread; finish
 * and destroy by the owner once the others are done with it. */
typedef struct rpc_stream rpc_stream;

rpc_stream *rpc_stream_open(rpc_channel *ch, const char *path,
                            const ProtobufCMessageDescriptor *resp_desc,
                            const rpc_call_opts *opts, pie_status *st);
/* Sends one message; blocks until the transport took it (flow control = backpressure).
 * On failure (the call ended) returns the code; rpc_stream_finish gives the call's status. */
pie_code rpc_stream_send(rpc_stream *s, const ProtobufCMessage *msg, pie_status *st);
/* Half-closes: no more sends. Idempotent. */
pie_code rpc_stream_close_send(rpc_stream *s, pie_status *st);

typedef enum rpc_recv_result {
    RPC_RECV_MESSAGE = 0, /* *msg set; free it with rpc_msg_free */
    RPC_RECV_END = 1,     /* no more messages (finished, failed or cancelled): rpc_stream_finish */
    RPC_RECV_TIMEOUT = 2, /* nothing within timeout_ms; the stream is still usable */
} rpc_recv_result;
/* Waits up to timeout_ms (<0: forever, 0: poll) for the next message. */
rpc_recv_result rpc_stream_recv(rpc_stream *s, ProtobufCMessage **msg, int64_t timeout_ms);
/* Waits up to timeout_ms (<0: forever) until the server accepted the stream (its initial
 * metadata arrived). PIE_OK, DEADLINE_EXCEEDED on timeout, else the code the call ended with. */
pie_code rpc_stream_wait_ready(rpc_stream *s, int64_t timeout_ms, pie_status *st);
/* Cancels the call (thread-safe, idempotent): blocked send/recv return, status CANCELLED. */
void rpc_stream_cancel(rpc_stream *s);
/* Closes the sending side if still open, discards unread messages, waits for and returns the
 * final status. */
pie_code rpc_stream_finish(rpc_stream *s, pie_status *st);
/* Response metadata: initial (after rpc_stream_wait_ready / the first message) and trailing
 * (after rpc_stream_finish). First value of key or NULL; owned by the stream. */
const char *rpc_stream_initial_metadata(rpc_stream *s, const char *key);
const char *rpc_stream_trailing_metadata(rpc_stream *s, const char *key);
/* Cancels if not finished, frees. NULL is fine. */
void rpc_stream_destroy(rpc_stream *s);

/* grpc.health.v1.Health/Check: *out gets the status on PIE_OK (NOT_FOUND for unknown service). */
pie_code rpc_health_check(rpc_channel *ch, const char *service, int64_t timeout_ms,
                          rpc_health_status *out, pie_status *st);

/* ---------------------------------------------------------------------------------------------
 * Reconnecting bidi stream: keeps one bidi call to `path` open, reopening it after any failure
 * with exponential backoff and jitter. Callbacks run on the link's own thread, one at a time. */

typedef struct rpc_link rpc_link;

typedef struct rpc_link_opts {
    const char *path;                           /* bidi method, e.g. "/pie.v1.Controller/WorkerLink" */
    const ProtobufCMessageDescriptor *response; /* type of messages from the server */
    const rpc_md *md;                           /* extra request metadata on every (re)open */
    size_t n_md;
    int64_t backoff_initial_ms;                 /* first retry delay; 0 → 100 */
    int64_t backoff_max_ms;                     /* cap; 0 → 5000 */
    double backoff_multiplier;                  /* 0 → 1.6 */
    double backoff_jitter;                      /* ± fraction of each delay; 0 → 0.2; <0 → none */
    /* The stream is open and the server accepted it (its initial metadata arrived): send the
     * registration here with rpc_link_send. Optional. The backoff restarts from
     * backoff_initial_ms once a connected stream received a message or lived 1 s. */
    void (*on_connect)(rpc_link *link, void *user);
    /* One message from the server; return true to keep it (free with rpc_msg_free). Required. */
    bool (*on_message)(rpc_link *link, ProtobufCMessage *msg, void *user);
    /* An attempt ended with *st: a connected stream that ended (on_connect was called for it)
     * or an attempt that never connected (e.g. UNAVAILABLE while the server is down). A reopen
     * follows after the backoff. Not called for the attempt rpc_link_stop ends. Optional. */
    void (*on_disconnect)(rpc_link *link, const pie_status *st, void *user);
    /* The link waits delay_ms before reopening; attempt counts the failed attempts since the
     * backoff last restarted (0 for the first). Called after on_disconnect, before the wait.
     * Optional: for logs and metrics, and so tests can check the backoff schedule exactly
     * instead of counting attempts per second of wall time. */
    void (*on_backoff)(rpc_link *link, unsigned attempt, int64_t delay_ms, void *user);
    void *user;
    /* Asynchronous link (optional): a started server whose first thread drives the stream, so
     * one polling thread does that server's and this link's I/O (no hand-off between two
     * pollers). on_connect and on_message then run on that server thread (they must not
     * block), on_disconnect and on_backoff on the link's own thread, and rpc_link_send never
     * waits for gRPC: it queues the message behind the one in flight and returns; a send the
     * transport fails later ends the stream (on_disconnect: UNAVAILABLE, "a send on the stream
     * failed"), so nothing after a lost message arrives without it. When the server shuts down
     * (rpc_server_shutdown, after its own calls), it gives the link up to 1 s to send what is
     * queued, ends the stream (on_disconnect: UNAVAILABLE) and the link opens no other; sends
     * then answer UNAVAILABLE. rpc_link_stop still frees it, before or after the server. */
    rpc_server *server;
    /* Asynchronous links: the most packed bytes waiting behind the message in flight (an empty
     * queue still takes one message). A send past it ends the stream as a peer that stopped
     * reading (UNAVAILABLE, to the sender and in on_disconnect; the link reconnects as after
     * any loss), so a stalled peer costs bounded memory. 0: RPC_LINK_QUEUE_MAX_BYTES. */
    size_t send_queue_max_bytes;
} rpc_link_opts;

#define RPC_LINK_QUEUE_MAX_BYTES ((size_t)64 << 20)

/* Starts the link's thread, which opens the stream at once. The channel must outlive the link. */
rpc_link *rpc_link_start(rpc_channel *ch, const rpc_link_opts *opts, pie_status *st);
/* Sends on the current stream (thread-safe; from callbacks too). UNAVAILABLE while not
 * connected (the message is dropped: re-send state from on_connect). Threaded links return
 * when the transport took the message; asynchronous ones (opts.server) once it is queued. */
pie_code rpc_link_send(rpc_link *link, const ProtobufCMessage *msg, pie_status *st);
/* Generations: every stream the link connects gets the next number (1, 2, ...; it equals
 * rpc_link_connects at its on_connect). A sender that packed messages for one stream sends
 * them with rpc_link_send_gen, so they can never leave on the stream of a later reconnect:
 * UNAVAILABLE once stream gen is gone (the message is dropped; the stream's on_disconnect has
 * run or is about to). rpc_link_generation: the connected stream's, 0 while not connected
 * (inside on_connect: the stream being connected). */
uint64_t rpc_link_generation(rpc_link *link);
pie_code rpc_link_send_gen(rpc_link *link, uint64_t gen, const ProtobufCMessage *msg,
                           pie_status *st);
/* Ends stream gen (if it is still the connected one; otherwise nothing) because what was sent
 * on it can no longer be trusted, e.g. a message was lost: the stream is cancelled, its
 * on_disconnect reports code and msg instead of CANCELLED, and the link reconnects after the
 * backoff. Any thread, callbacks included. */
void rpc_link_reset(rpc_link *link, uint64_t gen, pie_code code, const char *msg);
bool rpc_link_connected(rpc_link *link);
unsigned rpc_link_connects(rpc_link *link); /* how many times on_connect has been called */
/* Cancels the stream, stops the thread (no callback runs after it returns), frees. Not from a
 * link callback. NULL is fine. */
void rpc_link_stop(rpc_link *link);

#endif
