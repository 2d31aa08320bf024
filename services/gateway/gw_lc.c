/* gw_lc.c — the lifecycle client of the gateway (gw_lc.h). */
#include "gw_lc.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pie/v1/lifecycle.pb-c.h"
#include "pie_file.h"
#include "pie_log.h"
#include "pie_sha256.h"
#include "rpc.h"

#define GW_PROGRAM_MAX_BYTES (64u << 20)
#define GW_UPLOAD_CHUNK (1u << 20)
#define GW_STDERR_TAIL 1024 /* bytes of the inferlet's stderr kept for error messages */

/* Round-robin over every resolved address; a replica is used only while its readiness
 * (pie.v1.Lifecycle health) is SERVING, so one that lost its controller or model is skipped. */
static const char gw_lc_service_config[] =
    "{\"loadBalancingConfig\":[{\"round_robin\":{}}],"
    "\"healthCheckConfig\":{\"serviceName\":\"pie.v1.Lifecycle\"}}";

struct gw_lc {
    gw_lc_opts o;
    rpc_channel *ch;
    uint8_t *program;
    size_t program_len;
    char program_id[65];
    atomic_uint_fast64_t uploads;

    pthread_mutex_t mu; /* the model cache */
    gw_model *models;
    size_t n_models;
    int64_t models_at_ns; /* 0 = none cached */
};

struct gw_run {
    rpc_stream *s;
    char stderr_tail[GW_STDERR_TAIL];
    size_t stderr_len;
    bool exited;
    pie_status exit_st;
};

gw_lc *gw_lc_create(const gw_lc_opts *o, pie_status *st) {
    gw_lc *lc = calloc(1, sizeof *lc);
    if (lc == NULL) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "gateway: out of memory");
        return NULL;
    }
    lc->o = *o;
    if (pthread_mutex_init(&lc->mu, NULL) != 0) {
        free(lc);
        pie_status_set(st, PIE_INTERNAL, "gateway: pthread_mutex_init failed");
        return NULL;
    }
    char *bytes = NULL;
    if (pie_file_read(o->program_path, "gateway.program", GW_PROGRAM_MAX_BYTES, &bytes,
                      &lc->program_len, st) != PIE_OK)
        goto fail;
    lc->program = (uint8_t *)bytes;
    if (pie_sha256_hex(lc->program, lc->program_len, lc->program_id, st) != PIE_OK) goto fail;
    rpc_channel_opts co = {
        .max_recv_bytes = (int)(o->max_message_bytes > INT32_MAX ? -1 : (int)o->max_message_bytes),
        .max_send_bytes = (int)(o->max_message_bytes > INT32_MAX ? -1 : (int)o->max_message_bytes),
        .keepalive_time_ms = 30000,
        .reconnect_initial_ms = 100,
        .reconnect_max_ms = 5000,
        .service_config = gw_lc_service_config,
        .tls_ca_pem = o->tls_ca_pem,
        .tls_cert_pem = o->tls_cert_pem,
        .tls_key_pem = o->tls_key_pem,
    };
    lc->ch = rpc_channel_create(o->target, &co, st);
    if (lc->ch == NULL) goto fail;
    return lc;
fail:
    gw_lc_destroy(lc);
    return NULL;
}

void gw_lc_destroy(gw_lc *lc) {
    if (lc == NULL) return;
    rpc_channel_destroy(lc->ch);
    gw_models_free(lc->models, lc->n_models);
    free(lc->program);
    pthread_mutex_destroy(&lc->mu);
    free(lc);
}

const char *gw_lc_program_id(const gw_lc *lc) { return lc->program_id; }
uint64_t gw_lc_uploads(const gw_lc *lc) { return atomic_load(&lc->uploads); }

pie_code gw_lc_health(gw_lc *lc, int64_t timeout_ms, rpc_health_status *out, pie_status *st) {
    return rpc_health_check(lc->ch, "pie.v1.Lifecycle", timeout_ms, out, st);
}

/* Call options carrying the client's authorization (md must live as long as the options). */
static rpc_call_opts call_opts(const char *auth, rpc_md *md, int64_t timeout_ms) {
    rpc_call_opts co = {.timeout_ms = timeout_ms};
    if (auth != NULL) {
        md->key = "authorization";
        md->value = auth;
        co.md = md;
        co.n_md = 1;
    }
    return co;
}

/* ------------------------------------------------------------------------------------------
 * Models */

static char *dup_or_empty(const char *s) { return strdup(s ? s : ""); }

static bool model_copy(gw_model *dst, const gw_model *src) {
    dst->name = dup_or_empty(src->name);
    dst->description = dup_or_empty(src->description);
    dst->chat_template = dup_or_empty(src->chat_template);
    dst->bos_token = dup_or_empty(src->bos_token);
    dst->eos_token = dup_or_empty(src->eos_token);
    dst->max_context_tokens = src->max_context_tokens;
    bool ok = dst->name && dst->description && dst->chat_template && dst->bos_token &&
              dst->eos_token;
    if (!ok) gw_model_free(dst);
    return ok;
}

void gw_model_free(gw_model *m) {
    free(m->name);
    free(m->description);
    free(m->chat_template);
    free(m->bos_token);
    free(m->eos_token);
    memset(m, 0, sizeof *m);
}

void gw_models_free(gw_model *models, size_t n) {
    for (size_t i = 0; models && i < n; i++) gw_model_free(&models[i]);
    free(models);
}

static bool models_from_pb(const Pie__V1__ListModelsResponse *r, gw_model **out, size_t *n) {
    gw_model *m = calloc(r->n_models ? r->n_models : 1, sizeof *m);
    if (m == NULL) return false;
    for (size_t i = 0; i < r->n_models; i++) {
        const Pie__V1__ModelInfo *mi = r->models[i];
        gw_model view = {
            .name = mi->name, .description = mi->description,
            .chat_template = mi->chat_template, .bos_token = mi->bos_token,
            .eos_token = mi->eos_token, .max_context_tokens = mi->max_context_tokens,
        };
        if (!model_copy(&m[i], &view)) {
            gw_models_free(m, i);
            return false;
        }
    }
    *out = m;
    *n = r->n_models;
    return true;
}

static bool models_copy(const gw_model *src, size_t n, gw_model **out) {
    gw_model *m = calloc(n ? n : 1, sizeof *m);
    if (m == NULL) return false;
    for (size_t i = 0; i < n; i++)
        if (!model_copy(&m[i], &src[i])) {
            gw_models_free(m, i);
            return false;
        }
    *out = m;
    return true;
}

/* Replaces the cache with a copy of models. */
static void cache_store(gw_lc *lc, const gw_model *models, size_t n) {
    gw_model *copy = NULL;
    if (!models_copy(models, n, &copy)) return; /* the cache is an optimisation */
    pthread_mutex_lock(&lc->mu);
    gw_models_free(lc->models, lc->n_models);
    lc->models = copy;
    lc->n_models = n;
    lc->models_at_ns = rpc_now_ns();
    pthread_mutex_unlock(&lc->mu);
}

pie_code gw_lc_models(gw_lc *lc, const char *auth, gw_model **models, size_t *n,
                      pie_status *st) {
    rpc_md md;
    rpc_call_opts co = call_opts(auth, &md, lc->o.call_timeout_ms);
    Pie__V1__ListModelsRequest req = PIE__V1__LIST_MODELS_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    pie_code rc = rpc_unary(lc->ch, "/pie.v1.Lifecycle/ListModels", &req.base,
                            &pie__v1__list_models_response__descriptor, &resp, &co, st);
    if (rc != PIE_OK) return rc;
    bool ok = models_from_pb((Pie__V1__ListModelsResponse *)resp, models, n);
    rpc_msg_free(resp);
    if (!ok) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "gateway: out of memory");
    cache_store(lc, *models, *n);
    return PIE_OK;
}

/* The cached model `name` into out when the cache is fresh: 1 found, 0 not cached or stale. */
static int cache_find(gw_lc *lc, const char *name, gw_model *out) {
    int found = 0;
    pthread_mutex_lock(&lc->mu);
    bool fresh = lc->models_at_ns != 0 &&
                 rpc_now_ns() - lc->models_at_ns < lc->o.models_cache_ms * 1000000;
    for (size_t i = 0; fresh && i < lc->n_models && !found; i++)
        if (strcmp(lc->models[i].name, name) == 0) found = model_copy(out, &lc->models[i]) ? 1 : 0;
    pthread_mutex_unlock(&lc->mu);
    return found;
}

pie_code gw_lc_model(gw_lc *lc, const char *auth, const char *name, gw_model *out,
                     pie_status *st) {
    memset(out, 0, sizeof *out);
    if (cache_find(lc, name, out)) return PIE_OK;
    gw_model *models = NULL;
    size_t n = 0;
    pie_code rc = gw_lc_models(lc, auth, &models, &n, st);
    if (rc != PIE_OK) return rc;
    rc = pie_status_set(st, PIE_NOT_FOUND, "The model `%s` does not exist.", name);
    for (size_t i = 0; i < n; i++)
        if (strcmp(models[i].name, name) == 0)
            rc = model_copy(out, &models[i])
                     ? PIE_OK
                     : pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "gateway: out of memory");
    if (rc == PIE_OK) pie_status_ok(st);
    gw_models_free(models, n);
    return rc;
}

/* ------------------------------------------------------------------------------------------
 * The program */

static pie_code upload_program(gw_lc *lc, const char *auth, pie_status *st) {
    rpc_md md;
    rpc_call_opts co = call_opts(auth, &md, lc->o.call_timeout_ms);
    rpc_stream *s = rpc_stream_open(lc->ch, "/pie.v1.Lifecycle/UploadProgram",
                                    &pie__v1__upload_program_response__descriptor, &co, st);
    if (s == NULL) return st ? st->code : PIE_INTERNAL;
    Pie__V1__ProgramMetadata meta = PIE__V1__PROGRAM_METADATA__INIT;
    meta.name = "openai_chat";
    meta.size_bytes = lc->program_len;
    meta.expected_sha256 = lc->program_id;
    Pie__V1__UploadProgramRequest r = PIE__V1__UPLOAD_PROGRAM_REQUEST__INIT;
    r.part_case = PIE__V1__UPLOAD_PROGRAM_REQUEST__PART_METADATA;
    r.metadata = &meta;
    pie_code rc = rpc_stream_send(s, &r.base, st);
    for (size_t off = 0; rc == PIE_OK && off < lc->program_len; off += GW_UPLOAD_CHUNK) {
        Pie__V1__UploadProgramRequest c = PIE__V1__UPLOAD_PROGRAM_REQUEST__INIT;
        c.part_case = PIE__V1__UPLOAD_PROGRAM_REQUEST__PART_CHUNK;
        c.chunk.data = lc->program + off;
        c.chunk.len = lc->program_len - off < GW_UPLOAD_CHUNK ? lc->program_len - off
                                                               : GW_UPLOAD_CHUNK;
        rc = rpc_stream_send(s, &c.base, st);
    }
    rpc_stream_close_send(s, NULL);
    ProtobufCMessage *m = NULL;
    if (rpc_stream_recv(s, &m, -1) == RPC_RECV_MESSAGE) rpc_msg_free(m);
    rc = rpc_stream_finish(s, st);
    rpc_stream_destroy(s);
    if (rc == PIE_OK) {
        atomic_fetch_add(&lc->uploads, 1);
        pie_log_info("gw.program_uploaded", "program=%s bytes=%zu", lc->program_id,
                     lc->program_len);
    }
    return rc;
}

/* ------------------------------------------------------------------------------------------
 * Runs */

static pie_code send_launch(gw_lc *lc, rpc_stream *s, const char *model, char *const *args,
                            size_t n_args, pie_status *st) {
    Pie__V1__LaunchRequest launch = PIE__V1__LAUNCH_REQUEST__INIT;
    launch.program_id = lc->program_id;
    launch.args = (char **)args;
    launch.n_args = n_args;
    launch.model = (char *)model;
    Pie__V1__RunRequest r = PIE__V1__RUN_REQUEST__INIT;
    r.msg_case = PIE__V1__RUN_REQUEST__MSG_LAUNCH;
    r.launch = &launch;
    return rpc_stream_send(s, &r.base, st);
}

static pie_code send_prompt(rpc_stream *s, const char *prompt, size_t len, pie_status *st) {
    Pie__V1__RunRequest m = PIE__V1__RUN_REQUEST__INIT;
    m.msg_case = PIE__V1__RUN_REQUEST__MSG_MESSAGE;
    m.message.data = (uint8_t *)prompt;
    m.message.len = len;
    pie_code rc = rpc_stream_send(s, &m.base, st);
    if (rc != PIE_OK) return rc;
    Pie__V1__CloseInput ci = PIE__V1__CLOSE_INPUT__INIT;
    Pie__V1__RunRequest c = PIE__V1__RUN_REQUEST__INIT;
    c.msg_case = PIE__V1__RUN_REQUEST__MSG_CLOSE_INPUT;
    c.close_input = &ci;
    return rpc_stream_send(s, &c.base, st);
}

/* Opens a Run and waits for InstanceStarted. NULL with st set when the launch failed. */
static rpc_stream *open_run(gw_lc *lc, const char *auth, const char *model, char *const *args,
                            size_t n_args, pie_status *st) {
    rpc_md md;
    rpc_call_opts co = call_opts(auth, &md, lc->o.run_timeout_ms);
    rpc_stream *s = rpc_stream_open(lc->ch, "/pie.v1.Lifecycle/Run",
                                    &pie__v1__attach_response__descriptor, &co, st);
    if (s == NULL) return NULL;
    ProtobufCMessage *m = NULL;
    bool started = send_launch(lc, s, model, args, n_args, st) == PIE_OK &&
                   rpc_stream_recv(s, &m, -1) == RPC_RECV_MESSAGE &&
                   ((Pie__V1__AttachResponse *)m)->msg_case ==
                       PIE__V1__ATTACH_RESPONSE__MSG_STARTED;
    rpc_msg_free(m);
    if (started) return s;
    pie_code rc = rpc_stream_finish(s, st);
    if (rc == PIE_OK) pie_status_set(st, PIE_INTERNAL, "Run: the lifecycle did not start it");
    rpc_stream_destroy(s);
    return NULL;
}

gw_run *gw_run_start(gw_lc *lc, const char *auth, const char *model, char *const *args,
                     size_t n_args, const char *prompt, size_t prompt_len, pie_status *st) {
    gw_run *r = calloc(1, sizeof *r);
    if (r == NULL) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "gateway: out of memory");
        return NULL;
    }
    pie_status lst;
    r->s = open_run(lc, auth, model, args, n_args, &lst);
    if (r->s == NULL && lst.code == PIE_NOT_FOUND && strstr(lst.msg, "program") != NULL) {
        /* The cluster has never seen this gateway's program: upload it (content-addressed, so
         * racing gateways store the same bytes once) and launch again. */
        if (upload_program(lc, auth, &lst) == PIE_OK)
            r->s = open_run(lc, auth, model, args, n_args, &lst);
    }
    if (r->s == NULL) {
        if (st) *st = lst;
        gw_run_free(r);
        return NULL;
    }
    /* A failed send means the call has ended: what ended it (the instance's exit, the
     * lifecycle's status) is what the stream says next, so reading goes on. */
    if (send_prompt(r->s, prompt, prompt_len, &lst) != PIE_OK)
        pie_log_warn("gw.prompt_not_sent", "error=\"%s\"", lst.msg);
    return r;
}

static void keep_stderr(gw_run *r, const uint8_t *data, size_t len) {
    if (len >= GW_STDERR_TAIL) {
        data += len - (GW_STDERR_TAIL - 1);
        len = GW_STDERR_TAIL - 1;
    }
    if (r->stderr_len + len >= GW_STDERR_TAIL) {
        size_t drop = r->stderr_len + len - (GW_STDERR_TAIL - 1);
        memmove(r->stderr_tail, r->stderr_tail + drop, r->stderr_len - drop);
        r->stderr_len -= drop;
    }
    memcpy(r->stderr_tail + r->stderr_len, data, len);
    r->stderr_len += len;
    r->stderr_tail[r->stderr_len] = '\0';
}

/* The instance's end as a status: OK for exit 0, else its status or exit code with stderr. */
static void note_exit(gw_run *r, const Pie__V1__InstanceExit *x) {
    r->exited = true;
    uint32_t code = x->status ? x->status->code : 0;
    const char *why = x->status && x->status->message ? x->status->message : "";
    while (r->stderr_len > 0 && r->stderr_tail[r->stderr_len - 1] == '\n')
        r->stderr_tail[--r->stderr_len] = '\0';
    if (code == PIE_OK && x->exit_code == 0) pie_status_ok(&r->exit_st);
    else if (code == PIE_OK)
        pie_status_set(&r->exit_st, PIE_INTERNAL, "the generation program exited with code %d%s%s",
                       x->exit_code, r->stderr_len ? ": " : "", r->stderr_tail);
    else
        pie_status_set(&r->exit_st, (pie_code)code, "the generation program ended: %s%s%s", why,
                       r->stderr_len ? ": " : "", r->stderr_tail);
}

gw_run_result gw_run_next(gw_run *r, int64_t timeout_ms, char **msg, size_t *len,
                          pie_status *st) {
    for (;;) {
        ProtobufCMessage *m = NULL;
        rpc_recv_result rr = rpc_stream_recv(r->s, &m, timeout_ms);
        if (rr == RPC_RECV_TIMEOUT) return GW_RUN_TIMEOUT;
        if (rr == RPC_RECV_END) {
            pie_status fst;
            pie_code rc = rpc_stream_finish(r->s, &fst);
            if (rc != PIE_OK) *st = fst;
            else if (r->exited) *st = r->exit_st;
            else pie_status_set(st, PIE_INTERNAL, "Run ended without the instance's exit status");
            return GW_RUN_EXIT;
        }
        Pie__V1__AttachResponse *a = (Pie__V1__AttachResponse *)m;
        bool is_msg = a->msg_case == PIE__V1__ATTACH_RESPONSE__MSG_MESSAGE;
        if (is_msg) {
            *msg = malloc(a->message.len + 1);
            if (*msg == NULL) {
                rpc_msg_free(m);
                pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "gateway: out of memory");
                return GW_RUN_EXIT;
            }
            memcpy(*msg, a->message.data, a->message.len);
            (*msg)[a->message.len] = '\0';
            *len = a->message.len;
        } else if (a->msg_case == PIE__V1__ATTACH_RESPONSE__MSG_STDERR_DATA) {
            keep_stderr(r, a->stderr_data.data, a->stderr_data.len);
        } else if (a->msg_case == PIE__V1__ATTACH_RESPONSE__MSG_EXIT_STATUS) {
            note_exit(r, a->exit_status);
        }
        rpc_msg_free(m);
        if (is_msg) return GW_RUN_MESSAGE;
    }
}

void gw_run_cancel(gw_run *r) {
    if (r != NULL && r->s != NULL) rpc_stream_cancel(r->s);
}

void gw_run_free(gw_run *r) {
    if (r == NULL) return;
    rpc_stream_destroy(r->s);
    free(r);
}
