/* lc_store.c — see lc_store.h.
 *
 * Transfers are chunked (1 MiB, controller.proto "Cluster storage") over the Session's channel
 * as separate calls, so the Session stream itself never carries bulk bytes. */
#include "lc_store.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pie/v1/controller.pb-c.h"
#include "pie_log.h"
#include "pie_sha256.h"
#include "rpc.h"

#define LC_STORE_CHUNK (1u << 20) /* bytes per GetTokenizer / GetProgram / PutProgram chunk */

struct lc_store {
    lc_store_config cfg;
    lc_session *session;
    lc_program_store *programs;
    pie_counter *c_prog_fetched, *c_prog_pushed, *c_tok_fetched;

    /* The re-put thread: wakes on every Session welcome. */
    pthread_mutex_t mu; /* guards the three below */
    pthread_cond_t cv;
    bool resync, stop;
    pthread_t thread;
    bool thread_started;
};

bool lc_store_programs_enabled(const lc_store *s) { return s && s->cfg.programs; }

static pie_code call(lc_store *s, const char *method, const ProtobufCMessage *req,
                     const ProtobufCMessageDescriptor *rd, ProtobufCMessage **resp,
                     pie_status *st) {
    rpc_channel *ch = lc_session_channel(s->session);
    if (ch == NULL || lc_session_replica_index(s->session) == 0)
        return pie_status_set(st, PIE_UNAVAILABLE, "the controller is not connected");
    char path[96];
    snprintf(path, sizeof path, "/pie.v1.Controller/%s", method);
    rpc_call_opts o = {.timeout_ms = s->cfg.call_timeout_ms};
    return rpc_unary(ch, path, req, rd, resp, &o, st);
}

/* The bytes of one object read in chunks: first = the first response's size, later responses
 * must agree (an object replaced meanwhile is refused: the caller's hash check would catch it
 * anyway, but this says why). */
typedef struct lc_store_buf {
    uint8_t *data;
    uint64_t size, got;
} lc_store_buf;

static pie_code take_chunk(lc_store_buf *b, const char *what, uint64_t size, uint64_t max,
                           const ProtobufCBinaryData *data, pie_status *st) {
    if (b->data == NULL) {
        if (size > max)
            return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                                  "%s: %llu bytes is above this replica's limit of %llu", what,
                                  (unsigned long long)size, (unsigned long long)max);
        b->size = size;
        if ((b->data = malloc(size ? size : 1)) == NULL)
            return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "%s: out of memory for %llu bytes",
                                  what, (unsigned long long)size);
    }
    if (size != b->size || data->len > b->size - b->got || (data->len == 0 && b->got < b->size))
        return pie_status_set(st, PIE_ABORTED,
                              "%s: the controller's copy changed while it was read (size %llu, "
                              "then %llu)",
                              what, (unsigned long long)b->size, (unsigned long long)size);
    memcpy(b->data + b->got, data->data, data->len);
    b->got += data->len;
    return PIE_OK;
}

pie_code lc_store_fetch_tokenizer(void *store, const char *sha256, uint8_t **bytes, size_t *len,
                                  pie_status *st) {
    lc_store *s = store;
    *bytes = NULL;
    *len = 0;
    char what[96];
    snprintf(what, sizeof what, "tokenizer %.16s...", sha256);
    lc_store_buf b = {0};
    pie_code rc = PIE_OK;
    do {
        Pie__V1__GetTokenizerRequest req = PIE__V1__GET_TOKENIZER_REQUEST__INIT;
        req.tokenizer_sha256 = (char *)sha256;
        req.offset = b.got;
        req.max_bytes = LC_STORE_CHUNK;
        ProtobufCMessage *m = NULL;
        rc = call(s, "GetTokenizer", &req.base, &pie__v1__get_tokenizer_response__descriptor, &m,
                  st);
        if (rc != PIE_OK) break;
        const Pie__V1__GetTokenizerResponse *r = (const Pie__V1__GetTokenizerResponse *)m;
        rc = take_chunk(&b, what, r->size_bytes, s->cfg.max_tokenizer_bytes, &r->data, st);
        rpc_msg_free(m);
    } while (rc == PIE_OK && b.got < b.size);
    if (rc != PIE_OK) {
        free(b.data);
        return rc;
    }
    pie_counter_add(s->c_tok_fetched, 1);
    *bytes = b.data;
    *len = (size_t)b.size;
    return PIE_OK;
}

static pie_code registry_hold(lc_store *s, const char *id, const char *const *tenants,
                              size_t n_tenants, pie_status *st);

/* The launching tenant holds what it fetched here: in the registry too, so that its share
 * there counts it (a failure only leaves the registry's holders as they were). */
static void hold_fetched(lc_store *s, const char *id, const lc_program_holder *holder) {
    if (holder == NULL || holder->tenant == NULL) return;
    pie_status st;
    if (registry_hold(s, id, &holder->tenant, 1, &st) != PIE_OK)
        pie_log_warn("lc.program.hold_failed", "program=%s tenant=%s code=%s error=\"%s\"", id,
                     holder->tenant, pie_code_name(st.code), st.msg);
}

pie_code lc_store_fetch_program(lc_store *s, const char *id, const lc_program_holder *holder,
                                pie_status *st) {
    lc_store_buf b = {0};
    char name[LC_PROGRAM_NAME_MAX + 1] = "";
    pie_code rc = PIE_OK;
    do {
        Pie__V1__GetProgramRequest req = PIE__V1__GET_PROGRAM_REQUEST__INIT;
        req.program_id = (char *)id;
        req.offset = b.got;
        req.max_bytes = LC_STORE_CHUNK;
        ProtobufCMessage *m = NULL;
        rc = call(s, "GetProgram", &req.base, &pie__v1__get_program_response__descriptor, &m, st);
        if (rc != PIE_OK) break;
        const Pie__V1__GetProgramResponse *r = (const Pie__V1__GetProgramResponse *)m;
        rc = take_chunk(&b, "program", r->size_bytes, s->cfg.max_program_bytes, &r->data, st);
        if (rc == PIE_OK && r->size_bytes == 0)
            rc =
                pie_status_set(st, PIE_DATA_LOSS, "program_id: %s has 0 bytes in the registry", id);
        snprintf(name, sizeof name, "%s", r->name ? r->name : "");
        rpc_msg_free(m);
    } while (rc == PIE_OK && b.got < b.size);
    if (rc == PIE_NOT_FOUND)
        pie_status_set(st, PIE_NOT_FOUND,
                       "program_id: %s is not stored on this replica nor in the controller's "
                       "program registry (upload it first)",
                       id);
    else if (rc != PIE_OK && rc != PIE_RESOURCE_EXHAUSTED && rc != PIE_DATA_LOSS) {
        char why[PIE_STATUS_MSG_MAX];
        snprintf(why, sizeof why, "%s", st->msg); /* st->msg is rewritten below */
        pie_status_set(st, rc,
                       "program_id: %s is not stored on this replica and fetching it from the "
                       "controller failed: %.300s",
                       id, why);
    }
    char got[65];
    if (rc == PIE_OK) rc = pie_sha256_hex(b.data, b.size, got, st);
    if (rc == PIE_OK && strcmp(got, id) != 0)
        rc = pie_status_set(st, PIE_DATA_LOSS,
                            "program_id: %s, but the bytes the controller's registry returned "
                            "hash to %s; not stored",
                            id, got);
    bool already = false;
    if (rc == PIE_OK)
        rc = lc_program_put(s->programs, b.data, (size_t)b.size, got, name, holder, got, &already,
                            st);
    if (rc == PIE_OK) {
        pie_counter_add(s->c_prog_fetched, 1);
        pie_log_info("lc.program.fetched", "program=%s name=\"%s\" bytes=%llu", id, name,
                     (unsigned long long)b.size);
        hold_fetched(s, id, holder);
    }
    free(b.data);
    return rc;
}

/* A PutProgram stream: the header with tenants, then bytes[0, len) in chunks (none: a hold,
 * NOT_FOUND when the registry lacks the program). */
static pie_code put_stream(lc_store *s, const char *id, const char *name, const uint8_t *bytes,
                           size_t len, const char *const *tenants, size_t n_tenants, uint64_t size,
                           pie_status *st) {
    rpc_channel *ch = lc_session_channel(s->session);
    if (ch == NULL) return pie_status_set(st, PIE_UNAVAILABLE, "the controller is not connected");
    rpc_call_opts o = {.timeout_ms = s->cfg.call_timeout_ms};
    rpc_stream *stream = rpc_stream_open(ch, "/pie.v1.Controller/PutProgram",
                                         &pie__v1__put_program_response__descriptor, &o, st);
    if (stream == NULL) return st->code;
    Pie__V1__PutProgramHeader h = PIE__V1__PUT_PROGRAM_HEADER__INIT;
    h.program_id = (char *)id;
    h.size_bytes = size;
    h.name = (char *)name;
    h.tenants = (char **)tenants;
    h.n_tenants = n_tenants;
    Pie__V1__PutProgramRequest r = PIE__V1__PUT_PROGRAM_REQUEST__INIT;
    r.part_case = PIE__V1__PUT_PROGRAM_REQUEST__PART_HEADER;
    r.header = &h;
    pie_status send_st;
    pie_code rc = rpc_stream_send(stream, &r.base, &send_st);
    for (size_t off = 0; rc == PIE_OK && off < len; off += LC_STORE_CHUNK) {
        Pie__V1__PutProgramRequest c = PIE__V1__PUT_PROGRAM_REQUEST__INIT;
        c.part_case = PIE__V1__PUT_PROGRAM_REQUEST__PART_CHUNK;
        c.chunk.data = (uint8_t *)bytes + off;
        c.chunk.len = len - off < LC_STORE_CHUNK ? len - off : LC_STORE_CHUNK;
        rc = rpc_stream_send(stream, &c.base, &send_st);
    }
    ProtobufCMessage *m = NULL;
    if (rc == PIE_OK) rpc_stream_close_send(stream, NULL);
    if (rc == PIE_OK && rpc_stream_recv(stream, &m, s->cfg.call_timeout_ms) == RPC_RECV_MESSAGE)
        rpc_msg_free(m);
    rc = rpc_stream_finish(stream, st); /* the call's status says why a send failed */
    rpc_stream_destroy(stream);
    return rc;
}

/* Adds tenants to the holders of id in the registry: NOT_FOUND when it lacks id. */
static pie_code registry_hold(lc_store *s, const char *id, const char *const *tenants,
                              size_t n_tenants, pie_status *st) {
    /* the size is not checked for a hold; 1 keeps the header valid */
    return put_stream(s, id, "", NULL, 0, tenants, n_tenants, 1, st);
}

pie_code lc_store_push_program(lc_store *s, const char *id, const char *const *tenants,
                               size_t n_tenants, pie_status *st) {
    pie_code rc = registry_hold(s, id, tenants, n_tenants, st);
    if (rc != PIE_NOT_FOUND) return rc;
    uint8_t *bytes = NULL;
    size_t len = 0;
    char name[LC_PROGRAM_NAME_MAX + 1];
    if (lc_program_bytes(s->programs, id, &bytes, &len, name, sizeof name, st) != PIE_OK)
        return st->code;
    rc = put_stream(s, id, name, bytes, len, tenants, n_tenants, len, st);
    free(bytes);
    if (rc == PIE_OK) {
        pie_counter_add(s->c_prog_pushed, 1);
        pie_log_info("lc.program.registered", "program=%s bytes=%zu tenants=%zu", id, len,
                     n_tenants);
    }
    return rc;
}

pie_code lc_store_drop_program(lc_store *s, const char *id, const char *tenant, bool *was,
                               bool *held, pie_status *st) {
    *was = false;
    if (held) *held = false;
    Pie__V1__DropProgramRequest req = PIE__V1__DROP_PROGRAM_REQUEST__INIT;
    req.program_id = (char *)id;
    req.tenant = (char *)(tenant ? tenant : "");
    ProtobufCMessage *m = NULL;
    pie_code rc =
        call(s, "DropProgram", &req.base, &pie__v1__drop_program_response__descriptor, &m, st);
    if (rc == PIE_OK) {
        *was = ((Pie__V1__DropProgramResponse *)m)->was_stored;
        if (held) *held = ((Pie__V1__DropProgramResponse *)m)->was_held;
    }
    rpc_msg_free(m);
    return rc;
}

/* ---- exports (Controller.ListTenantExports / DeleteTenantExport) ------------------------------ */

pie_code lc_store_list_exports(lc_store *s, const char *tenant, bool all,
                               Pie__V1__ListTenantExportsResponse **out, pie_status *st) {
    Pie__V1__ListTenantExportsRequest req = PIE__V1__LIST_TENANT_EXPORTS_REQUEST__INIT;
    req.tenant = (char *)tenant;
    req.all = all;
    ProtobufCMessage *m = NULL;
    pie_code rc = call(s, "ListTenantExports", &req.base,
                       &pie__v1__list_tenant_exports_response__descriptor, &m, st);
    *out = rc == PIE_OK ? (Pie__V1__ListTenantExportsResponse *)m : NULL;
    if (rc != PIE_OK) rpc_msg_free(m);
    return rc;
}

pie_code lc_store_delete_export(lc_store *s, const char *tenant, const char *name,
                                uint32_t *pages, pie_status *st) {
    Pie__V1__DeleteTenantExportRequest req = PIE__V1__DELETE_TENANT_EXPORT_REQUEST__INIT;
    req.tenant = (char *)tenant;
    req.name = (char *)name;
    ProtobufCMessage *m = NULL;
    pie_code rc = call(s, "DeleteTenantExport", &req.base,
                       &pie__v1__delete_tenant_export_response__descriptor, &m, st);
    *pages = rc == PIE_OK ? ((Pie__V1__DeleteTenantExportResponse *)m)->page_count : 0;
    rpc_msg_free(m);
    return rc;
}

/* ---- session hooks and the re-put thread ----------------------------------------------------- */

static void on_welcome(void *ctx) {
    lc_store *s = ctx;
    pthread_mutex_lock(&s->mu);
    s->resync = true;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* Another replica deleted the program (or this one did): the local copy goes too. Or a
 * tenant released its hold: the local copy goes once nobody holds it. */
static void on_program_dropped(void *ctx, const char *id, const char *tenant) {
    lc_store *s = ctx;
    pie_status st;
    bool held = true;
    pie_code rc = tenant[0] ? lc_program_release(s->programs, id, tenant, &held, &st)
                            : lc_program_delete(s->programs, id, &st);
    if (rc == PIE_OK && held)
        pie_log_info("lc.program.dropped", "program=%s tenant=%s", id,
                     tenant[0] ? tenant : "(all)");
    else if (rc != PIE_OK && rc != PIE_NOT_FOUND)
        pie_log_warn("lc.program.drop_failed", "program=%s error=\"%s\"", id, st.msg);
}

/* Puts every local program the registry lacks, and every holder it lacks (after a
 * (re)connect). */
static void resync(lc_store *s) {
    Pie__V1__ProgramInfo **list = NULL;
    size_t n = 0;
    pie_status st;
    if (lc_program_list(s->programs, NULL, &list, &n, &st) != PIE_OK) {
        pie_log_warn("lc.program.resync_failed", "error=\"%s\"", st.msg);
        return;
    }
    size_t failed = 0;
    for (size_t i = 0; i < n; i++) {
        pthread_mutex_lock(&s->mu);
        bool stop = s->stop;
        pthread_mutex_unlock(&s->mu);
        if (stop) break;
        if (lc_store_push_program(s, list[i]->program_id, (const char *const *)list[i]->holders,
                                  list[i]->n_holders, &st) != PIE_OK) {
            failed++;
            pie_log_warn("lc.program.resync_failed", "program=%s code=%s error=\"%s\"",
                         list[i]->program_id, pie_code_name(st.code), st.msg);
        }
    }
    pie_log_debug("lc.program.resynced", "programs=%zu failed=%zu", n, failed);
    lc_program_list_free(list, n);
}

static void *resync_main(void *arg) {
    lc_store *s = arg;
    (void)pthread_setname_np(pthread_self(), "lc-store"); /* cosmetic */
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->stop && !s->resync) pthread_cond_wait(&s->cv, &s->mu);
        if (s->stop) break;
        s->resync = false;
        pthread_mutex_unlock(&s->mu);
        resync(s);
        pthread_mutex_lock(&s->mu);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

lc_store *lc_store_create(const lc_store_config *cfg, lc_session *session,
                          lc_program_store *programs, pie_metrics *metrics, pie_status *st) {
    lc_store *s = calloc(1, sizeof *s);
    if (s == NULL) goto oom;
    if (pthread_mutex_init(&s->mu, NULL) != 0) goto oom_free;
    if (pthread_cond_init(&s->cv, NULL) != 0) {
        pthread_mutex_destroy(&s->mu);
        goto oom_free;
    }
    s->cfg = *cfg;
    s->session = session;
    s->programs = programs;
    s->c_prog_fetched = pie_metrics_counter(
        metrics, "pie_lifecycle_programs_fetched_total",
        "Programs fetched from the controller's registry by a launch of an id this replica "
        "lacked.",
        NULL, 0, NULL);
    s->c_prog_pushed = pie_metrics_counter(
        metrics, "pie_lifecycle_programs_registered_total",
        "Programs this replica put into the controller's registry (uploads, re-puts after a "
        "reconnect).",
        NULL, 0, NULL);
    s->c_tok_fetched =
        pie_metrics_counter(metrics, "pie_lifecycle_tokenizers_fetched_total",
                            "tokenizer.json files fetched from the controller.", NULL, 0, NULL);
    if (cfg->programs) {
        int rc = pthread_create(&s->thread, NULL, resync_main, s);
        if (rc != 0) {
            pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "lifecycle store: pthread_create: %s",
                           strerror(rc));
            lc_store_destroy(s);
            return NULL;
        }
        s->thread_started = true;
        lc_session_store_hooks h = {
            .ctx = s, .welcomed = on_welcome, .program_dropped = on_program_dropped};
        lc_session_set_store_hooks(session, &h);
    }
    return s;
oom_free:
    free(s);
oom:
    pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
    return NULL;
}

void lc_store_stop(lc_store *s) {
    if (s == NULL || !s->thread_started) return;
    pthread_mutex_lock(&s->mu);
    s->stop = true;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    int rc = pthread_join(s->thread, NULL);
    if (rc != 0) pie_log_error("lc.store.join", "error=\"%s\"", strerror(rc));
    s->thread_started = false;
}

void lc_store_destroy(lc_store *s) {
    if (s == NULL) return;
    lc_store_stop(s);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    free(s);
}
