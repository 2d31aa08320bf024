/* rpc_internal.h — what the files of services/common/rpc share and nobody else uses.
 *
 * Owns: completion-queue tags, message packing/unpacking between protobuf-c and grpc byte
 * buffers, metadata copies, gpr time conversions, channel-argument building. */
#ifndef PIE_RPC_INTERNAL_H
#define PIE_RPC_INTERNAL_H

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/slice.h>
#include <grpc/support/time.h>

#include "rpc.h"

/* A completion-queue tag: every tag this layer passes to gRPC points at one of these, embedded
 * in the object the operation belongs to. */
typedef struct rpc_tag {
    int kind;  /* rpc_server.c: which operation completed */
    void *obj; /* the object it belongs to */
} rpc_tag;

#define RPC_DEFAULT_MAX_MSG (4 * 1024 * 1024)

/* max_*_bytes option → the value for gRPC's channel argument and our own checks (-1 = none). */
int rpc__max_bytes(int opt);

/* Packs msg straight into one grpc_slice (no intermediate buffer) and wraps it in a byte
 * buffer the caller destroys. RESOURCE_EXHAUSTED if the packed size exceeds max_bytes (≥0). */
pie_code rpc__pack(const ProtobufCMessage *msg, int max_bytes, grpc_byte_buffer **out,
                   pie_status *st);

/* Unpacks bb as desc: directly from the slice when bb holds one, else from one readall copy.
 * NULL if bb does not parse. Does not destroy bb. */
ProtobufCMessage *rpc__unpack(const ProtobufCMessageDescriptor *desc, grpc_byte_buffer *bb);

/* Copies a received metadata array into one allocation: *out (free() it) holds *n entries with
 * NUL-terminated keys and values. Returns 0, or -1 when out of memory. */
int rpc__md_copy(const grpc_metadata_array *arr, rpc_md **out, size_t *n);
const char *rpc__md_find(const rpc_md *md, size_t n, const char *key);
/* 1 if key/value are legal text metadata (lowercase key, printable value, no "-bin"). */
int rpc__md_legal(const char *key, const char *value);

/* gpr deadline ↔ our monotonic nanoseconds. */
gpr_timespec rpc__deadline_from_ms(int64_t timeout_ms); /* ≤0 → infinite */
int64_t rpc__ns_from_deadline(gpr_timespec deadline);   /* infinite → RPC_DEADLINE_NONE */

/* Text for a grpc_call_error, for log lines. */
const char *rpc__call_error_name(grpc_call_error e);

/* Channel arguments: a small fixed array filled by rpc__args_add_int. */
#define RPC_MAX_ARGS 16
typedef struct rpc_args {
    grpc_arg arg[RPC_MAX_ARGS];
    grpc_channel_args ca;
} rpc_args;
void rpc__args_init(rpc_args *a);
void rpc__args_add_int(rpc_args *a, const char *key, int value);
void rpc__args_add_string(rpc_args *a, const char *key, const char *value); /* value borrowed */
/* The arguments rpc_channel_create gives gRPC for opts (message limits, keepalive, reconnect
 * backoff); a function of its own so a unit test can read them. */
void rpc__channel_args(const rpc_channel_opts *opts, rpc_args *a);

/* Client internals (rpc_client.c) the asynchronous link (rpc_link.c) shares. */
/* Request metadata of one call: the token plus the caller's entries. */
#define RPC_MD_INLINE 8
typedef struct rpc_req_md {
    grpc_metadata inline_md[RPC_MD_INLINE];
    grpc_metadata *md;
    size_t n;
} rpc_req_md;
pie_code rpc__req_md_build(rpc_req_md *m, const rpc_channel *ch, const rpc_call_opts *o,
                           pie_status *st);
void rpc__req_md_free(rpc_req_md *m);
void *rpc__channel_method(rpc_channel *ch, const char *path); /* registered handle; NULL: OOM */
grpc_channel *rpc__channel_gc(const rpc_channel *ch);
int rpc__channel_max_send(const rpc_channel *ch);
pie_code rpc__status_to_pie(grpc_status_code code, grpc_slice details, pie_status *st);

/* Asynchronous links (rpc_link.c) run on a server's first completion queue (rpc_server.c).
 * Their tags carry these kinds; the server thread hands them to rpc__link_on_tag. */
enum {
    RPC_TAG_LINK_META = 100, /* SEND_INITIAL_METADATA + RECV_INITIAL_METADATA */
    RPC_TAG_LINK_READY,      /* the empty batch after it (connected unless the status came) */
    RPC_TAG_LINK_RECV,       /* RECV_MESSAGE */
    RPC_TAG_LINK_SEND,       /* SEND_MESSAGE */
    RPC_TAG_LINK_STATUS,     /* RECV_STATUS_ON_CLIENT */
};
void rpc__link_on_tag(rpc_tag *t, bool ok);
/* The server's completion queue for link l (registered: the server's shutdown detaches it).
 * NULL with *st when the server is not running. */
grpc_completion_queue *rpc__server_attach_link(rpc_server *srv, rpc_link *l, pie_status *st);
void rpc__server_forget_link(rpc_server *srv, rpc_link *l); /* rpc_link_stop before shutdown */
/* The server is stopping (its calls are over, its thread still polls): link l sends what it
 * has queued (up to flush_ms), ends its stream, collects its tags and opens no other. */
void rpc__link_detach(rpc_link *l, int64_t flush_ms);
/* How long a stopping server lets its links send what they queued (InstanceEnds and the like). */
#define RPC_LINK_FLUSH_MS 1000

/* Send queue: a ring of packed messages waiting for the transport (a server call's, an
 * asynchronous link's). Not thread-safe: the owner's lock guards it. */
typedef struct rpc_sendq {
    grpc_byte_buffer **bb;
    size_t cap, head, len;
    size_t bytes; /* packed bytes of the len messages */
} rpc_sendq;
int rpc__sendq_push(rpc_sendq *q, grpc_byte_buffer *bb); /* 0, or -1 when out of memory */
grpc_byte_buffer *rpc__sendq_pop(rpc_sendq *q);            /* NULL when empty */
void rpc__sendq_clear(rpc_sendq *q);                       /* destroys what it holds */
void rpc__sendq_free(rpc_sendq *q);                        /* clear, then its ring */

/* Health service (rpc_health.c), owned by a server. */
typedef struct rpc_health rpc_health;
rpc_health *rpc__health_create(bool start_not_serving);
void rpc__health_destroy(rpc_health *h);
/* Fills methods[0..1] (Check, Watch) for the server's table. */
void rpc__health_methods(rpc_health *h, bool needs_token, rpc_method methods[2]);
pie_code rpc__health_set(rpc_health *h, const char *service, rpc_health_status status,
                         pie_status *st);
/* Shutdown: everything NOT_SERVING, watchers told and their calls finished; later sets ignored. */
void rpc__health_shutdown(rpc_health *h);

#endif
