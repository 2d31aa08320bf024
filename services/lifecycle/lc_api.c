/* lc_api.c — see lc_api.h. Callbacks run on completion-queue threads and must not block:
 * everything slow (validating and compiling an upload) runs on a thread of its own. */
#include "lc_api.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pie/v1/lifecycle.pb-c.h"
#include "pie_log.h"
#include "pie_sha256.h"

#define LC_API_N_OWN       8 /* methods defined here */
#define LC_API_MAX_METHODS 16
#define LC_API_CHUNK_MAX   (1u << 20) /* UploadProgramRequest.chunk: 1 byte .. 1 MiB */

struct lc_api {
    lc_program_store *programs;
    lc_inst_mgr *insts;
    lc_session *session;
    rpc_method methods[LC_API_MAX_METHODS];
    size_t n_methods;
    pthread_mutex_t mu; /* guards uploads */
    pthread_cond_t cv;  /* uploads reached 0 */
    size_t uploads;     /* finishing threads still running */
};

/* ---- UploadProgram ------------------------------------------------------------------------ */

typedef struct lc_upload {
    lc_api *api;
    rpc_call *call;
    bool have_meta, failed;
    char name[LC_PROGRAM_NAME_MAX + 1];
    char expected_sha256[65];
    uint8_t *buf;
    uint64_t size, got;
} lc_upload;

static void upload_fail(lc_upload *u, pie_code code, const char *msg) {
    u->failed = true;
    rpc_call_finish(u->call, code, msg);
}

static bool is_hex64(const char *s) {
    if (strlen(s) != 64) return false;
    for (int i = 0; i < 64; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f'))) return false;
    return true;
}

static void upload_meta(lc_upload *u, const Pie__V1__ProgramMetadata *md) {
    pie_status st;
    uint64_t max = lc_program_max_bytes(u->api->programs);
    size_t name_len = md->name ? strlen(md->name) : 0;
    if (name_len == 0 || name_len > LC_PROGRAM_NAME_MAX)
        pie_status_set(&st, PIE_INVALID_ARGUMENT, "metadata.name: %zu bytes, want 1..%d", name_len,
                       LC_PROGRAM_NAME_MAX);
    else if (md->size_bytes == 0)
        pie_status_set(&st, PIE_INVALID_ARGUMENT, "metadata.size_bytes: 0, want at least 1");
    else if (md->size_bytes > max)
        pie_status_set(&st, PIE_RESOURCE_EXHAUSTED,
                       "metadata.size_bytes: %llu is above this replica's program size limit "
                       "of %llu bytes",
                       (unsigned long long)md->size_bytes, (unsigned long long)max);
    else if (md->expected_sha256 && md->expected_sha256[0] && !is_hex64(md->expected_sha256))
        pie_status_set(&st, PIE_INVALID_ARGUMENT,
                       "metadata.expected_sha256: \"%.80s\" is not 64 lowercase hex digits",
                       md->expected_sha256);
    else
        pie_status_ok(&st);
    if (st.code == PIE_OK && (u->buf = malloc(md->size_bytes)) == NULL)
        pie_status_set(&st, PIE_RESOURCE_EXHAUSTED, "metadata.size_bytes: cannot allocate %llu",
                       (unsigned long long)md->size_bytes);
    if (st.code != PIE_OK) {
        upload_fail(u, st.code, st.msg);
        return;
    }
    u->have_meta = true;
    u->size = md->size_bytes;
    snprintf(u->name, sizeof u->name, "%s", md->name);
    snprintf(u->expected_sha256, sizeof u->expected_sha256, "%s",
             md->expected_sha256 ? md->expected_sha256 : "");
}

static void upload_chunk(lc_upload *u, const ProtobufCBinaryData *c) {
    char msg[200];
    if (c->len == 0 || c->len > LC_API_CHUNK_MAX) {
        snprintf(msg, sizeof msg, "chunk: %zu bytes, want 1..%u", c->len, LC_API_CHUNK_MAX);
        upload_fail(u, PIE_INVALID_ARGUMENT, msg);
    } else if (u->got + c->len > u->size) {
        snprintf(msg, sizeof msg,
                 "chunk: the chunks add up to more than metadata.size_bytes (%llu)",
                 (unsigned long long)u->size);
        upload_fail(u, PIE_INVALID_ARGUMENT, msg);
    } else {
        memcpy(u->buf + u->got, c->data, c->len);
        u->got += c->len;
    }
}

static bool upload_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    (void)req;
    lc_upload *u = calloc(1, sizeof *u);
    if (u == NULL) {
        rpc_call_finish(call, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return false;
    }
    u->api = user;
    u->call = call;
    rpc_call_set_data(call, u);
    return false;
}

static bool upload_on_message(rpc_call *call, ProtobufCMessage *msg, void *user) {
    (void)user;
    lc_upload *u = rpc_call_get_data(call);
    Pie__V1__UploadProgramRequest *r = (Pie__V1__UploadProgramRequest *)msg;
    if (u == NULL || u->failed) return false;
    if (!u->have_meta) {
        if (r->part_case != PIE__V1__UPLOAD_PROGRAM_REQUEST__PART_METADATA)
            upload_fail(u, PIE_INVALID_ARGUMENT, "the first message must carry metadata");
        else
            upload_meta(u, r->metadata);
    } else if (r->part_case != PIE__V1__UPLOAD_PROGRAM_REQUEST__PART_CHUNK) {
        upload_fail(u, PIE_INVALID_ARGUMENT, "metadata: only the first message carries it");
    } else {
        upload_chunk(u, &r->chunk);
    }
    return false;
}

/* The slow part of an upload (hash check, validation, compile, store), on its own thread. */
static void *upload_finish_thread(void *arg) {
    lc_upload *u = arg;
    lc_api *a = u->api;
    pie_status st;
    pie_status_ok(&st);
    char id[65];
    bool already = false;
    if (u->expected_sha256[0]) {
        if (pie_sha256_hex(u->buf, u->size, id, &st) == PIE_OK &&
            strcmp(id, u->expected_sha256) != 0)
            pie_status_set(&st, PIE_INVALID_ARGUMENT,
                           "metadata.expected_sha256: %s, but the bytes received hash to %s",
                           u->expected_sha256, id);
    }
    if (st.code == PIE_OK) lc_program_put(a->programs, u->buf, u->size, u->name, id, &already, &st);
    if (st.code == PIE_OK) {
        Pie__V1__UploadProgramResponse r = PIE__V1__UPLOAD_PROGRAM_RESPONSE__INIT;
        r.program_id = id;
        r.size_bytes = u->size;
        r.already_cached = already;
        rpc_call_reply(u->call, &r.base);
        pie_log_info("lc.program.uploaded", "program=%s name=\"%s\" bytes=%llu cached=%d", id,
                     u->name, (unsigned long long)u->size, already);
    } else {
        rpc_call_finish(u->call, st.code, st.msg);
    }
    rpc_call_unref(u->call);
    free(u->buf);
    free(u);
    pthread_mutex_lock(&a->mu);
    if (--a->uploads == 0) pthread_cond_broadcast(&a->cv);
    pthread_mutex_unlock(&a->mu);
    return NULL;
}

static void upload_on_half_close(rpc_call *call, void *user) {
    lc_api *a = user;
    lc_upload *u = rpc_call_get_data(call);
    if (u == NULL || u->failed) return;
    char msg[200];
    if (!u->have_meta) {
        upload_fail(u, PIE_INVALID_ARGUMENT, "no metadata: the stream was empty");
        return;
    }
    if (u->got != u->size) {
        snprintf(msg, sizeof msg, "chunk: received %llu bytes, metadata.size_bytes says %llu",
                 (unsigned long long)u->got, (unsigned long long)u->size);
        upload_fail(u, PIE_INVALID_ARGUMENT, msg);
        return;
    }
    rpc_call_set_data(call, NULL); /* the thread owns u now */
    rpc_call_ref(call);
    pthread_mutex_lock(&a->mu);
    a->uploads++;
    pthread_mutex_unlock(&a->mu);
    pthread_t t;
    pthread_attr_t attr;
    int err = pthread_attr_init(&attr);
    if (err == 0) {
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        err = pthread_create(&t, &attr, upload_finish_thread, u);
        pthread_attr_destroy(&attr);
    }
    if (err != 0) {
        rpc_call_set_data(call, u);
        upload_fail(u, PIE_RESOURCE_EXHAUSTED, "upload: cannot start a thread");
        rpc_call_unref(call);
        pthread_mutex_lock(&a->mu);
        a->uploads--;
        pthread_cond_broadcast(&a->cv);
        pthread_mutex_unlock(&a->mu);
    }
}

static void upload_on_done(rpc_call *call, void *user) {
    (void)user;
    lc_upload *u = rpc_call_get_data(call);
    if (u == NULL) return;
    free(u->buf);
    free(u);
    rpc_call_set_data(call, NULL);
}

/* ---- programs ----------------------------------------------------------------------------- */

static bool list_programs_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    (void)req;
    lc_api *a = user;
    pie_status st;
    Pie__V1__ListProgramsResponse r = PIE__V1__LIST_PROGRAMS_RESPONSE__INIT;
    if (lc_program_list(a->programs, &r.programs, &r.n_programs, &st) != PIE_OK) {
        rpc_call_finish_status(call, &st);
        return false;
    }
    rpc_call_reply(call, &r.base);
    lc_program_list_free(r.programs, r.n_programs);
    return false;
}

static bool delete_program_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    lc_api *a = user;
    Pie__V1__DeleteProgramRequest *r = (Pie__V1__DeleteProgramRequest *)req;
    pie_status st;
    if (lc_program_delete(a->programs, r->program_id, &st) != PIE_OK) {
        rpc_call_finish_status(call, &st);
        return false;
    }
    Pie__V1__DeleteProgramResponse resp = PIE__V1__DELETE_PROGRAM_RESPONSE__INIT;
    rpc_call_reply(call, &resp.base);
    return false;
}

/* ---- instances ---------------------------------------------------------------------------- */

static bool launch_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    lc_api *a = user;
    pie_status st;
    lc_inst *in = NULL;
    lc_limits l;
    if (lc_inst_launch(a->insts, (Pie__V1__LaunchRequest *)req, &in, &l, &st) != PIE_OK) {
        rpc_call_finish_status(call, &st);
        return false;
    }
    Pie__V1__ResourceLimits pl;
    lc_limits_to_pb(&l, &pl);
    Pie__V1__LaunchResponse r = PIE__V1__LAUNCH_RESPONSE__INIT;
    r.instance_id = lc_inst_id(in);
    r.limits = &pl;
    rpc_call_reply(call, &r.base);
    lc_inst_unref(in);
    return false;
}

static bool terminate_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    lc_api *a = user;
    pie_status st;
    lc_inst *in = lc_inst_find(a->insts, ((Pie__V1__TerminateRequest *)req)->instance_id, &st);
    if (in == NULL) {
        rpc_call_finish_status(call, &st);
        return false;
    }
    lc_inst_stop(in, PIE_CANCELLED, "terminated by client");
    lc_inst_unref(in);
    Pie__V1__TerminateResponse r = PIE__V1__TERMINATE_RESPONSE__INIT;
    rpc_call_reply(call, &r.base);
    return false;
}

static bool list_instances_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    (void)req;
    lc_api *a = user;
    pie_status st;
    Pie__V1__ListInstancesResponse r = PIE__V1__LIST_INSTANCES_RESPONSE__INIT;
    if (lc_inst_list(a->insts, &r.instances, &r.n_instances, &st) != PIE_OK) {
        rpc_call_finish_status(call, &st);
        return false;
    }
    rpc_call_reply(call, &r.base);
    lc_inst_list_free(r.instances, r.n_instances);
    return false;
}

/* ---- Attach and Run ------------------------------------------------------------------------ */

typedef struct lc_attach {
    lc_inst *in; /* a reference, once started */
    bool run;    /* Run (cancel terminates, half-close ends input) or Attach */
    bool over;   /* the call was ended by an error */
} lc_attach;

/* Ends the call with st. A Run's instance lives only as long as its call: it is terminated. */
static void attach_fail(rpc_call *call, lc_attach *at, const pie_status *st) {
    at->over = true;
    if (at->in) {
        lc_inst_detach(at->in, call);
        if (at->run) {
            char msg[PIE_STATUS_MSG_MAX + 64];
            snprintf(msg, sizeof msg, "terminated: the Run call ended: %s", st->msg);
            lc_inst_stop(at->in, PIE_CANCELLED, msg);
        }
    }
    rpc_call_finish_status(call, st);
}

static bool attach_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    (void)req;
    (void)user;
    lc_attach *at = calloc(1, sizeof *at);
    if (at == NULL) {
        rpc_call_finish(call, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return false;
    }
    at->run = strcmp(rpc_call_method(call), "/pie.v1.Lifecycle/Run") == 0;
    rpc_call_set_data(call, at);
    return false;
}

/* The first message: start (Attach) or launch (Run). */
static void attach_start(lc_api *a, rpc_call *call, lc_attach *at, int msg_case,
                         ProtobufCMessage *first) {
    pie_status st;
    if (!at->run) {
        if (msg_case != PIE__V1__ATTACH_REQUEST__MSG_START) {
            pie_status_set(&st, PIE_INVALID_ARGUMENT, "the first message must be start");
            attach_fail(call, at, &st);
            return;
        }
        at->in = lc_inst_find(a->insts, ((Pie__V1__AttachStart *)first)->instance_id, &st);
    } else {
        if (msg_case != PIE__V1__RUN_REQUEST__MSG_LAUNCH) {
            pie_status_set(&st, PIE_INVALID_ARGUMENT, "the first message must be launch");
            attach_fail(call, at, &st);
            return;
        }
        lc_limits l;
        if (lc_inst_launch(a->insts, (Pie__V1__LaunchRequest *)first, &at->in, &l, &st) == PIE_OK) {
            Pie__V1__ResourceLimits pl;
            lc_limits_to_pb(&l, &pl);
            Pie__V1__InstanceStarted s = PIE__V1__INSTANCE_STARTED__INIT;
            s.instance_id = lc_inst_id(at->in);
            s.limits = &pl;
            Pie__V1__AttachResponse r = PIE__V1__ATTACH_RESPONSE__INIT;
            r.msg_case = PIE__V1__ATTACH_RESPONSE__MSG_STARTED;
            r.started = &s;
            rpc_call_send(call, &r.base);
        }
    }
    if (at->in == NULL || lc_inst_attach(at->in, call, &st) != PIE_OK) attach_fail(call, at, &st);
}

/* A client message or end of input, after the first message. */
static void attach_input(rpc_call *call, lc_attach *at, bool is_message,
                         const ProtobufCBinaryData *msg, bool close_input) {
    pie_status st;
    if (is_message) {
        if (lc_inst_message(at->in, msg->data, msg->len, &st) != PIE_OK) attach_fail(call, at, &st);
    } else if (close_input) {
        lc_inst_close_input(at->in);
    } else {
        pie_status_set(&st, PIE_INVALID_ARGUMENT, "%s: only the first message may be one",
                       at->run ? "launch" : "start");
        attach_fail(call, at, &st);
    }
}

static bool attach_on_message(rpc_call *call, ProtobufCMessage *msg, void *user) {
    lc_attach *at = rpc_call_get_data(call);
    if (at == NULL || at->over) return false;
    int c;
    ProtobufCMessage *first;
    bool is_message, close_input;
    const ProtobufCBinaryData *bytes;
    /* msg is a oneof: a member may be read only when msg_case names it */
    if (at->run) {
        Pie__V1__RunRequest *r = (Pie__V1__RunRequest *)msg;
        c = (int)r->msg_case;
        first = c == PIE__V1__RUN_REQUEST__MSG_LAUNCH ? &r->launch->base : NULL;
        is_message = c == PIE__V1__RUN_REQUEST__MSG_MESSAGE;
        close_input = c == PIE__V1__RUN_REQUEST__MSG_CLOSE_INPUT;
        bytes = is_message ? &r->message : NULL;
    } else {
        Pie__V1__AttachRequest *r = (Pie__V1__AttachRequest *)msg;
        c = (int)r->msg_case;
        first = c == PIE__V1__ATTACH_REQUEST__MSG_START ? &r->start->base : NULL;
        is_message = c == PIE__V1__ATTACH_REQUEST__MSG_MESSAGE;
        close_input = c == PIE__V1__ATTACH_REQUEST__MSG_CLOSE_INPUT;
        bytes = is_message ? &r->message : NULL;
    }
    if (at->in == NULL)
        attach_start(user, call, at, c, first);
    else
        attach_input(call, at, is_message, bytes, close_input);
    return false;
}

static void attach_on_half_close(rpc_call *call, void *user) {
    (void)user;
    lc_attach *at = rpc_call_get_data(call);
    if (at == NULL || at->over) return;
    if (at->in == NULL) {
        pie_status st;
        pie_status_set(&st, PIE_INVALID_ARGUMENT, "the stream ended before its first message");
        attach_fail(call, at, &st);
    } else if (at->run) {
        lc_inst_close_input(at->in); /* Run: output keeps flowing until the exit status */
    } else {
        /* Attach: ending the call detaches; the instance keeps running (lifecycle.proto) */
        at->over = true;
        lc_inst_detach(at->in, call);
        rpc_call_finish(call, PIE_OK, NULL);
    }
}

static void attach_on_cancel(rpc_call *call, void *user) {
    (void)user;
    lc_attach *at = rpc_call_get_data(call);
    if (at == NULL || at->in == NULL) return;
    lc_inst_detach(at->in, call);
    if (at->run) lc_inst_stop(at->in, PIE_CANCELLED, "terminated: the Run call was cancelled");
}

static void attach_on_done(rpc_call *call, void *user) {
    (void)user;
    lc_attach *at = rpc_call_get_data(call);
    if (at == NULL) return;
    if (at->in) {
        lc_inst_detach(at->in, call);
        lc_inst_unref(at->in);
    }
    free(at);
    rpc_call_set_data(call, NULL);
}

/* ---- table -------------------------------------------------------------------------------- */

#define LC_UNARY(p, req, resp, fn)                                                        \
    (rpc_method) {                                                                        \
        .path = "/pie.v1.Lifecycle/" p, .kind = RPC_UNARY, .request = &req##__descriptor, \
        .response = &resp##__descriptor, .on_call = fn, .user = a                         \
    }
#define LC_BIDI(p, req)                                                                  \
    (rpc_method) {                                                                       \
        .path = "/pie.v1.Lifecycle/" p, .kind = RPC_BIDI, .request = &req##__descriptor, \
        .response = &pie__v1__attach_response__descriptor, .on_call = attach_on_call,    \
        .on_message = attach_on_message, .on_half_close = attach_on_half_close,          \
        .on_cancel = attach_on_cancel, .on_done = attach_on_done, .user = a              \
    }

lc_api *lc_api_create(lc_program_store *programs, lc_inst_mgr *insts, lc_session *session,
                      pie_status *st) {
    lc_api *a = calloc(1, sizeof *a);
    if (a == NULL || pthread_mutex_init(&a->mu, NULL) != 0) {
        free(a);
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    if (pthread_cond_init(&a->cv, NULL) != 0) {
        pthread_mutex_destroy(&a->mu);
        free(a);
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    a->programs = programs;
    a->insts = insts;
    a->session = session;
    rpc_method *m = a->methods;
    m[0] = (rpc_method){.path = "/pie.v1.Lifecycle/UploadProgram",
                        .kind = RPC_CLIENT_STREAM,
                        .request = &pie__v1__upload_program_request__descriptor,
                        .response = &pie__v1__upload_program_response__descriptor,
                        .on_call = upload_on_call,
                        .on_message = upload_on_message,
                        .on_half_close = upload_on_half_close,
                        .on_done = upload_on_done,
                        .user = a};
    m[1] = LC_UNARY("ListPrograms", pie__v1__list_programs_request, pie__v1__list_programs_response,
                    list_programs_on_call);
    m[2] = LC_UNARY("DeleteProgram", pie__v1__delete_program_request,
                    pie__v1__delete_program_response, delete_program_on_call);
    m[3] = LC_UNARY("Launch", pie__v1__launch_request, pie__v1__launch_response, launch_on_call);
    m[4] = LC_UNARY("Terminate", pie__v1__terminate_request, pie__v1__terminate_response,
                    terminate_on_call);
    m[5] = LC_UNARY("ListInstances", pie__v1__list_instances_request,
                    pie__v1__list_instances_response, list_instances_on_call);
    m[6] = LC_BIDI("Attach", pie__v1__attach_request);
    m[7] = LC_BIDI("Run", pie__v1__run_request);
    a->n_methods = LC_API_N_OWN;
    size_t n_sess = 0;
    const rpc_method *sm = lc_session_methods(session, &n_sess);
    for (size_t i = 0; i < n_sess && a->n_methods < LC_API_MAX_METHODS; i++)
        a->methods[a->n_methods++] = sm[i];
    return a;
}

const rpc_method *lc_api_methods(lc_api *a, size_t *n) {
    *n = a->n_methods;
    return a->methods;
}

void lc_api_destroy(lc_api *a) {
    if (a == NULL) return;
    pthread_mutex_lock(&a->mu);
    while (a->uploads > 0) pthread_cond_wait(&a->cv, &a->mu);
    pthread_mutex_unlock(&a->mu);
    pthread_cond_destroy(&a->cv);
    pthread_mutex_destroy(&a->mu);
    free(a);
}
