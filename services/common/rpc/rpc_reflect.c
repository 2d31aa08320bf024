/* rpc_reflect.c — gRPC server reflection from a FileDescriptorSet (rpc_reflect.h).
 *
 * The set is read with a small protobuf wire-format reader rather than generated descriptor
 * code: reflection needs each file's bytes (sent unchanged), its name, its imports and the
 * names it defines — five fields of descriptor.proto. */
#include "rpc_reflect.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grpc/reflection/v1alpha/reflection.pb-c.h"

#define RPC_REFLECT_MAX_DEPTH 32 /* message nesting followed when indexing */

/* ---- protobuf wire format -------------------------------------------------------------------- */

typedef struct pb_rd {
    const uint8_t *p, *end;
    bool bad;
} pb_rd;

static uint64_t rd_varint(pb_rd *r) {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        if (r->p >= r->end) break;
        uint8_t b = *r->p++;
        v |= (uint64_t)(b & 0x7F) << shift;
        if (!(b & 0x80)) return v;
    }
    r->bad = true;
    return 0;
}

/* The next field: its number and, for length-delimited ones, the bytes (*d, *n); other wire
 * types are skipped (*d NULL). false at the end or on malformed input (r->bad). */
static bool rd_next(pb_rd *r, uint32_t *field, const uint8_t **d, size_t *n) {
    if (r->bad || r->p >= r->end) return false;
    uint64_t key = rd_varint(r);
    *field = (uint32_t)(key >> 3);
    *d = NULL;
    *n = 0;
    switch (key & 7) {
    case 0: rd_varint(r); break;
    case 1: if (r->end - r->p < 8) r->bad = true; else r->p += 8; break;
    case 5: if (r->end - r->p < 4) r->bad = true; else r->p += 4; break;
    case 2: {
        uint64_t len = rd_varint(r);
        if (r->bad || len > (uint64_t)(r->end - r->p)) {
            r->bad = true;
            break;
        }
        *d = r->p;
        *n = (size_t)len;
        r->p += len;
        break;
    }
    default: r->bad = true;
    }
    return !r->bad;
}

static pb_rd rd_of(const uint8_t *d, size_t n) { return (pb_rd){d, d + n, false}; }

/* ---- the index ------------------------------------------------------------------------------- */

typedef struct rr_file {
    const uint8_t *bytes;
    size_t len;
    char *name;
    char **deps;
    size_t n_deps;
} rr_file;

typedef struct rr_symbol {
    char *name;
    size_t file;
} rr_symbol;

struct rpc_reflect {
    rr_file *files;
    size_t n_files;
    rr_symbol *syms;
    size_t n_syms, cap_syms;
    char **services;
    size_t n_services;
    bool oom;
};

static char *str_of(const uint8_t *d, size_t n) {
    char *s = malloc(n + 1);
    if (s) {
        memcpy(s, d, n);
        s[n] = '\0';
    }
    return s;
}

/* Adds "<scope>.<name>" (or name when scope is empty) for file f. */
static char *add_symbol(rpc_reflect *r, const char *scope, const uint8_t *name, size_t n,
                        size_t f) {
    if (r->n_syms == r->cap_syms) {
        size_t cap = r->cap_syms ? r->cap_syms * 2 : 256;
        rr_symbol *s = realloc(r->syms, cap * sizeof *s);
        if (s == NULL) return r->oom = true, NULL;
        r->syms = s;
        r->cap_syms = cap;
    }
    size_t sl = strlen(scope);
    char *full = malloc(sl + 1 + n + 1);
    if (full == NULL) return r->oom = true, NULL;
    int o = sl ? snprintf(full, sl + 2, "%s.", scope) : 0;
    memcpy(full + o, name, n);
    full[(size_t)o + n] = '\0';
    r->syms[r->n_syms++] = (rr_symbol){full, f};
    return full;
}

/* The name (field 1) of a descriptor message d. */
static bool name_of(const uint8_t *d, size_t n, const uint8_t **name, size_t *name_len) {
    pb_rd rd = rd_of(d, n);
    uint32_t field;
    const uint8_t *v;
    size_t vn;
    while (rd_next(&rd, &field, &v, &vn))
        if (field == 1 && v) {
            *name = v;
            *name_len = vn;
            return true;
        }
    return false;
}

/* A DescriptorProto: the message, its nested messages (3) and enums (4). */
static void index_message(rpc_reflect *r, const char *scope, const uint8_t *d, size_t n,
                          size_t f, int depth) {
    const uint8_t *name;
    size_t nl;
    if (depth > RPC_REFLECT_MAX_DEPTH || !name_of(d, n, &name, &nl)) return;
    char *full = add_symbol(r, scope, name, nl, f);
    if (full == NULL) return;
    pb_rd rd = rd_of(d, n);
    uint32_t field;
    const uint8_t *v;
    size_t vn;
    while (rd_next(&rd, &field, &v, &vn)) {
        if (field == 3 && v) index_message(r, full, v, vn, f, depth + 1);
        if (field == 4 && v && name_of(v, vn, &name, &nl)) add_symbol(r, full, name, nl, f);
    }
}

/* A ServiceDescriptorProto: the service and its methods (2). */
static void index_service(rpc_reflect *r, const char *scope, const uint8_t *d, size_t n,
                          size_t f) {
    const uint8_t *name;
    size_t nl;
    if (!name_of(d, n, &name, &nl)) return;
    char *full = add_symbol(r, scope, name, nl, f);
    if (full == NULL) return;
    pb_rd rd = rd_of(d, n);
    uint32_t field;
    const uint8_t *v;
    size_t vn;
    while (rd_next(&rd, &field, &v, &vn))
        if (field == 2 && v && name_of(v, vn, &name, &nl)) add_symbol(r, full, name, nl, f);
}

/* A FileDescriptorProto: name (1), package (2), dependency (3), message_type (4),
 * enum_type (5), service (6). */
static bool index_file(rpc_reflect *r, size_t f) {
    rr_file *file = &r->files[f];
    char package[256] = "";
    pb_rd rd = rd_of(file->bytes, file->len);
    uint32_t field;
    const uint8_t *v;
    size_t vn;
    while (rd_next(&rd, &field, &v, &vn)) {
        if (field == 1 && v) file->name = str_of(v, vn);
        if (field == 2 && v && vn < sizeof package) {
            memcpy(package, v, vn);
            package[vn] = '\0';
        }
        if (field == 3 && v) {
            char **deps = realloc(file->deps, (file->n_deps + 1) * sizeof *deps);
            if (deps == NULL) return false;
            file->deps = deps;
            if ((deps[file->n_deps] = str_of(v, vn)) == NULL) return false;
            file->n_deps++;
        }
    }
    if (rd.bad || file->name == NULL) return false;
    rd = rd_of(file->bytes, file->len); /* package known: the definitions */
    while (rd_next(&rd, &field, &v, &vn)) {
        const uint8_t *name;
        size_t nl;
        if (field == 4 && v) index_message(r, package, v, vn, f, 0);
        if (field == 5 && v && name_of(v, vn, &name, &nl)) add_symbol(r, package, name, nl, f);
        if (field == 6 && v) index_service(r, package, v, vn, f);
    }
    return !rd.bad && !r->oom;
}

rpc_reflect *rpc_reflect_create(const uint8_t *set, size_t len, const char *const *services,
                                size_t n_services, pie_status *st) {
    rpc_reflect *r = calloc(1, sizeof *r);
    if (r == NULL) goto oom;
    pb_rd rd = rd_of(set, len);
    uint32_t field;
    const uint8_t *v;
    size_t vn;
    while (rd_next(&rd, &field, &v, &vn)) { /* FileDescriptorSet: repeated file = 1 */
        if (field != 1 || v == NULL) continue;
        rr_file *files = realloc(r->files, (r->n_files + 1) * sizeof *files);
        if (files == NULL) goto oom;
        r->files = files;
        r->files[r->n_files++] = (rr_file){.bytes = v, .len = vn};
        if (!index_file(r, r->n_files - 1)) {
            if (r->oom) goto oom;
            rd.bad = true;
        }
    }
    if (rd.bad || r->n_files == 0) {
        pie_status_set(st, PIE_INVALID_ARGUMENT, "rpc_reflect: not a FileDescriptorSet");
        rpc_reflect_destroy(r);
        return NULL;
    }
    r->services = calloc(n_services + 1, sizeof *r->services);
    if (r->services == NULL) goto oom;
    for (size_t i = 0; i < n_services; i++) {
        if ((r->services[i] = strdup(services[i])) == NULL) goto oom;
        r->n_services++;
    }
    return r;
oom:
    pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "rpc_reflect: out of memory");
    rpc_reflect_destroy(r);
    return NULL;
}

void rpc_reflect_destroy(rpc_reflect *r) {
    if (r == NULL) return;
    for (size_t i = 0; i < r->n_files; i++) {
        free(r->files[i].name);
        for (size_t j = 0; j < r->files[i].n_deps; j++) free(r->files[i].deps[j]);
        free(r->files[i].deps);
    }
    free(r->files);
    for (size_t i = 0; i < r->n_syms; i++) free(r->syms[i].name);
    free(r->syms);
    for (size_t i = 0; i < r->n_services; i++) free(r->services[i]);
    free(r->services);
    free(r);
}

static long file_index(const rpc_reflect *r, const char *name) {
    for (size_t i = 0; i < r->n_files; i++)
        if (strcmp(r->files[i].name, name) == 0) return (long)i;
    return -1;
}

static long symbol_file(const rpc_reflect *r, const char *symbol) {
    for (size_t i = 0; i < r->n_syms; i++)
        if (strcmp(r->syms[i].name, symbol) == 0) return (long)r->syms[i].file;
    return -1;
}

const char *rpc_reflect_file_of(const rpc_reflect *r, const char *symbol) {
    long f = symbol_file(r, symbol);
    return f < 0 ? NULL : r->files[f].name;
}

/* ---- the service ----------------------------------------------------------------------------- */

typedef struct rr_files_out {
    ProtobufCBinaryData *items;
    size_t n;
    bool *seen; /* [n_files] */
} rr_files_out;

/* Appends file f, then its imports (depth first, each file once). */
static void collect(const rpc_reflect *r, long f, rr_files_out *out, int depth) {
    if (f < 0 || out->seen[f] || depth > RPC_REFLECT_MAX_DEPTH) return;
    out->seen[f] = true;
    out->items[out->n++] = (ProtobufCBinaryData){r->files[f].len, (uint8_t *)r->files[f].bytes};
    for (size_t i = 0; i < r->files[f].n_deps; i++)
        collect(r, file_index(r, r->files[f].deps[i]), out, depth + 1);
}

static pie_code send_error(rpc_call *call, Grpc__Reflection__V1alpha__ServerReflectionResponse *resp,
                           int code, const char *msg) {
    Grpc__Reflection__V1alpha__ErrorResponse er = GRPC__REFLECTION__V1ALPHA__ERROR_RESPONSE__INIT;
    er.error_code = code;
    er.error_message = (char *)msg;
    resp->message_response_case =
        GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_ERROR_RESPONSE;
    resp->error_response = &er;
    return rpc_call_send(call, &resp->base);
}

static pie_code send_files(rpc_call *call, const rpc_reflect *r, long f,
                           Grpc__Reflection__V1alpha__ServerReflectionResponse *resp,
                           const char *what) {
    if (f < 0) {
        char msg[600];
        snprintf(msg, sizeof msg, "%.500s not found", what);
        return send_error(call, resp, PIE_NOT_FOUND, msg);
    }
    rr_files_out out = {calloc(r->n_files, sizeof *out.items), 0, calloc(r->n_files, 1)};
    pie_code rc = PIE_RESOURCE_EXHAUSTED;
    if (out.items && out.seen) {
        collect(r, f, &out, 0);
        Grpc__Reflection__V1alpha__FileDescriptorResponse fd =
            GRPC__REFLECTION__V1ALPHA__FILE_DESCRIPTOR_RESPONSE__INIT;
        fd.file_descriptor_proto = out.items;
        fd.n_file_descriptor_proto = out.n;
        resp->message_response_case = GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_FILE_DESCRIPTOR_RESPONSE;
        resp->file_descriptor_response = &fd;
        rc = rpc_call_send(call, &resp->base);
    }
    free(out.items);
    free(out.seen);
    return rc;
}

static pie_code send_services(rpc_call *call, const rpc_reflect *r,
                              Grpc__Reflection__V1alpha__ServerReflectionResponse *resp) {
    Grpc__Reflection__V1alpha__ServiceResponse *items = calloc(r->n_services + 1, sizeof *items);
    Grpc__Reflection__V1alpha__ServiceResponse **ptrs = calloc(r->n_services + 1, sizeof *ptrs);
    pie_code rc = PIE_RESOURCE_EXHAUSTED;
    if (items && ptrs) {
        for (size_t i = 0; i < r->n_services; i++) {
            grpc__reflection__v1alpha__service_response__init(&items[i]);
            items[i].name = r->services[i];
            ptrs[i] = &items[i];
        }
        Grpc__Reflection__V1alpha__ListServiceResponse ls =
            GRPC__REFLECTION__V1ALPHA__LIST_SERVICE_RESPONSE__INIT;
        ls.service = ptrs;
        ls.n_service = r->n_services;
        resp->message_response_case = GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_LIST_SERVICES_RESPONSE;
        resp->list_services_response = &ls;
        rc = rpc_call_send(call, &resp->base);
    }
    free(items);
    free(ptrs);
    return rc;
}

static bool on_request(rpc_call *call, ProtobufCMessage *msg, void *user) {
    const rpc_reflect *r = user;
    Grpc__Reflection__V1alpha__ServerReflectionRequest *req =
        (Grpc__Reflection__V1alpha__ServerReflectionRequest *)msg;
    Grpc__Reflection__V1alpha__ServerReflectionResponse resp =
        GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_RESPONSE__INIT;
    resp.valid_host = req->host ? req->host : "";
    resp.original_request = req;
    switch (req->message_request_case) {
    case GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_LIST_SERVICES:
        send_services(call, r, &resp);
        break;
    case GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_FILE_BY_FILENAME:
        send_files(call, r, file_index(r, req->file_by_filename), &resp, req->file_by_filename);
        break;
    case GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_FILE_CONTAINING_SYMBOL:
        send_files(call, r, symbol_file(r, req->file_containing_symbol), &resp,
                   req->file_containing_symbol);
        break;
    case GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_FILE_CONTAINING_EXTENSION:
    case GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_ALL_EXTENSION_NUMBERS_OF_TYPE:
        send_error(call, &resp, PIE_NOT_FOUND, "the contracts define no extensions");
        break;
    default:
        send_error(call, &resp, PIE_INVALID_ARGUMENT, "empty or unknown reflection request");
    }
    return false;
}

static bool on_start(rpc_call *call, ProtobufCMessage *req, void *user) {
    (void)call;
    (void)req;
    (void)user;
    return false;
}

static void on_half_close(rpc_call *call, void *user) {
    (void)user;
    rpc_call_finish(call, PIE_OK, NULL);
}

void rpc_reflect_methods(rpc_reflect *r, rpc_method out[2]) {
    static const char *const paths[2] = {
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    };
    for (int i = 0; i < 2; i++)
        out[i] = (rpc_method){
            .path = paths[i],
            .kind = RPC_BIDI,
            .request = &grpc__reflection__v1alpha__server_reflection_request__descriptor,
            .response = &grpc__reflection__v1alpha__server_reflection_response__descriptor,
            .on_call = on_start,
            .on_message = on_request,
            .on_half_close = on_half_close,
            .user = r,
        };
}
