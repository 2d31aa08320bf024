/* rpc_common.c — pieces shared by the server and the client side of the RPC layer.
 *
 * Owns: protobuf-c ↔ grpc byte buffer conversion (pack into one slice, unpack from one slice or
 * a readall copy), metadata copies and checks, time conversion, channel arguments. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <grpc/support/alloc.h>

#include "rpc_internal.h"

int64_t rpc_now_ns(void) {
    struct timespec ts;
    /* CLOCK_MONOTONIC cannot fail on Linux for a valid pointer; keep the check anyway. */
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0) return 0;
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

void rpc_msg_free(ProtobufCMessage *msg) {
    if (msg) protobuf_c_message_free_unpacked(msg, NULL);
}

int rpc__max_bytes(int opt) {
    if (opt == 0) return RPC_DEFAULT_MAX_MSG;
    return opt < 0 ? -1 : opt;
}

pie_code rpc__pack(const ProtobufCMessage *msg, int max_bytes, grpc_byte_buffer **out,
                   pie_status *st) {
    *out = NULL;
    if (!msg) return pie_status_set(st, PIE_INVALID_ARGUMENT, "rpc: message is NULL");
    size_t n = protobuf_c_message_get_packed_size(msg);
    if (max_bytes >= 0 && n > (size_t)max_bytes)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "rpc: %s message of %zu bytes exceeds the limit of %d bytes",
                              msg->descriptor->name, n, max_bytes);
    grpc_slice s = grpc_slice_malloc(n);
    size_t w = protobuf_c_message_pack(msg, GRPC_SLICE_START_PTR(s));
    if (w != n) {
        grpc_slice_unref(s);
        return pie_status_set(st, PIE_INTERNAL, "rpc: packing %s wrote %zu of %zu bytes",
                              msg->descriptor->name, w, n);
    }
    *out = grpc_raw_byte_buffer_create(&s, 1); /* takes its own reference */
    grpc_slice_unref(s);
    return PIE_OK;
}

ProtobufCMessage *rpc__unpack(const ProtobufCMessageDescriptor *desc, grpc_byte_buffer *bb) {
    grpc_byte_buffer_reader r;
    if (!bb || !grpc_byte_buffer_reader_init(&r, bb)) return NULL;
    size_t total = grpc_byte_buffer_length(bb);
    ProtobufCMessage *m = NULL;
    grpc_slice *first = NULL;
    if (total == 0) {
        m = protobuf_c_message_unpack(desc, NULL, 0, (const uint8_t *)"");
    } else if (grpc_byte_buffer_reader_peek(&r, &first) && GRPC_SLICE_LENGTH(*first) == total) {
        /* One slice holds the whole message: parse in place. */
        m = protobuf_c_message_unpack(desc, NULL, total, GRPC_SLICE_START_PTR(*first));
    } else {
        /* Several slices (it happens even for small messages): one copy. The reader was
         * advanced by peek, so start a fresh one. */
        grpc_byte_buffer_reader_destroy(&r);
        if (!grpc_byte_buffer_reader_init(&r, bb)) return NULL;
        grpc_slice all = grpc_byte_buffer_reader_readall(&r);
        m = protobuf_c_message_unpack(desc, NULL, GRPC_SLICE_LENGTH(all),
                                      GRPC_SLICE_START_PTR(all));
        grpc_slice_unref(all);
    }
    grpc_byte_buffer_reader_destroy(&r);
    return m;
}

int rpc__md_copy(const grpc_metadata_array *arr, rpc_md **out, size_t *n) {
    *out = NULL;
    *n = 0;
    if (arr->count == 0) return 0;
    size_t bytes = arr->count * sizeof(rpc_md);
    for (size_t i = 0; i < arr->count; i++)
        bytes +=
            GRPC_SLICE_LENGTH(arr->metadata[i].key) + GRPC_SLICE_LENGTH(arr->metadata[i].value) + 2;
    rpc_md *md = malloc(bytes);
    if (!md) return -1;
    char *p = (char *)(md + arr->count);
    for (size_t i = 0; i < arr->count; i++) {
        const grpc_slice *k = &arr->metadata[i].key, *v = &arr->metadata[i].value;
        md[i].key = p;
        memcpy(p, GRPC_SLICE_START_PTR(*k), GRPC_SLICE_LENGTH(*k));
        p += GRPC_SLICE_LENGTH(*k);
        *p++ = '\0';
        md[i].value = p;
        memcpy(p, GRPC_SLICE_START_PTR(*v), GRPC_SLICE_LENGTH(*v));
        p += GRPC_SLICE_LENGTH(*v);
        *p++ = '\0';
    }
    *out = md;
    *n = arr->count;
    return 0;
}

const char *rpc__md_find(const rpc_md *md, size_t n, const char *key) {
    for (size_t i = 0; i < n; i++)
        if (strcmp(md[i].key, key) == 0) return md[i].value;
    return NULL;
}

int rpc__md_legal(const char *key, const char *value) {
    if (!key || !value || !key[0]) return 0;
    size_t kl = strlen(key);
    if (kl >= 4 && strcmp(key + kl - 4, "-bin") == 0) return 0;
    if (key[0] == ':' || strncmp(key, "grpc-", 5) == 0) return 0;
    return grpc_header_key_is_legal(grpc_slice_from_static_string(key)) &&
           grpc_header_nonbin_value_is_legal(grpc_slice_from_static_string(value));
}

gpr_timespec rpc__deadline_from_ms(int64_t timeout_ms) {
    if (timeout_ms <= 0) return gpr_inf_future(GPR_CLOCK_MONOTONIC);
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                        gpr_time_from_millis(timeout_ms, GPR_TIMESPAN));
}

int64_t rpc__ns_from_deadline(gpr_timespec deadline) {
    if (gpr_time_cmp(deadline, gpr_inf_future(deadline.clock_type)) == 0) return RPC_DEADLINE_NONE;
    /* gRPC's monotonic clock has its own epoch: go through "time left". */
    gpr_timespec mono = gpr_convert_clock_type(deadline, GPR_CLOCK_MONOTONIC);
    gpr_timespec left = gpr_time_sub(mono, gpr_now(GPR_CLOCK_MONOTONIC));
    return rpc_now_ns() + left.tv_sec * 1000000000 + left.tv_nsec;
}

const char *rpc__call_error_name(grpc_call_error e) {
    switch (e) {
    case GRPC_CALL_OK: return "OK";
    case GRPC_CALL_ERROR: return "ERROR";
    case GRPC_CALL_ERROR_NOT_ON_SERVER: return "NOT_ON_SERVER";
    case GRPC_CALL_ERROR_NOT_ON_CLIENT: return "NOT_ON_CLIENT";
    case GRPC_CALL_ERROR_ALREADY_ACCEPTED: return "ALREADY_ACCEPTED";
    case GRPC_CALL_ERROR_ALREADY_INVOKED: return "ALREADY_INVOKED";
    case GRPC_CALL_ERROR_NOT_INVOKED: return "NOT_INVOKED";
    case GRPC_CALL_ERROR_ALREADY_FINISHED: return "ALREADY_FINISHED";
    case GRPC_CALL_ERROR_TOO_MANY_OPERATIONS: return "TOO_MANY_OPERATIONS";
    case GRPC_CALL_ERROR_INVALID_FLAGS: return "INVALID_FLAGS";
    case GRPC_CALL_ERROR_INVALID_METADATA: return "INVALID_METADATA";
    case GRPC_CALL_ERROR_INVALID_MESSAGE: return "INVALID_MESSAGE";
    case GRPC_CALL_ERROR_NOT_SERVER_COMPLETION_QUEUE: return "NOT_SERVER_COMPLETION_QUEUE";
    case GRPC_CALL_ERROR_BATCH_TOO_BIG: return "BATCH_TOO_BIG";
    case GRPC_CALL_ERROR_PAYLOAD_TYPE_MISMATCH: return "PAYLOAD_TYPE_MISMATCH";
    case GRPC_CALL_ERROR_COMPLETION_QUEUE_SHUTDOWN: return "COMPLETION_QUEUE_SHUTDOWN";
    }
    return "UNKNOWN_CALL_ERROR";
}

void rpc__args_init(rpc_args *a) {
    memset(a, 0, sizeof *a);
    a->ca.args = a->arg;
}

void rpc__args_add_int(rpc_args *a, const char *key, int value) {
    if (a->ca.num_args >= RPC_MAX_ARGS) return; /* callers add a fixed, smaller number */
    grpc_arg *g = &a->arg[a->ca.num_args++];
    g->type = GRPC_ARG_INTEGER;
    g->key = (char *)key; /* gRPC copies args; it never writes through key */
    g->value.integer = value;
}

void rpc__args_add_string(rpc_args *a, const char *key, const char *value) {
    if (a->ca.num_args >= RPC_MAX_ARGS) return; /* callers add a fixed, smaller number */
    grpc_arg *g = &a->arg[a->ca.num_args++];
    g->type = GRPC_ARG_STRING;
    g->key = (char *)key;     /* gRPC copies args; it never writes through key or value */
    g->value.string = (char *)value;
}

/* ---------------------------------------------------------------------------------------------
 * Send queues */

int rpc__sendq_push(rpc_sendq *q, grpc_byte_buffer *bb) {
    if (q->len == q->cap) {
        size_t ncap = q->cap ? q->cap * 2 : 4;
        grpc_byte_buffer **nb = malloc(ncap * sizeof *nb);
        if (!nb) return -1;
        for (size_t i = 0; i < q->len; i++) nb[i] = q->bb[(q->head + i) % q->cap];
        free(q->bb);
        q->bb = nb;
        q->cap = ncap;
        q->head = 0;
    }
    q->bb[(q->head + q->len) % q->cap] = bb;
    q->len++;
    q->bytes += grpc_byte_buffer_length(bb);
    return 0;
}

grpc_byte_buffer *rpc__sendq_pop(rpc_sendq *q) {
    if (q->len == 0) return NULL;
    grpc_byte_buffer *bb = q->bb[q->head];
    q->head = (q->head + 1) % q->cap;
    q->len--;
    q->bytes -= grpc_byte_buffer_length(bb);
    return bb;
}

void rpc__sendq_clear(rpc_sendq *q) {
    grpc_byte_buffer *bb;
    while ((bb = rpc__sendq_pop(q)) != NULL) grpc_byte_buffer_destroy(bb);
}

void rpc__sendq_free(rpc_sendq *q) {
    rpc__sendq_clear(q);
    free(q->bb);
    *q = (rpc_sendq){0};
}
