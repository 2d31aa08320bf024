/* lc_api.c — see lc_api.h. Callbacks run on completion-queue threads and must not block:
 * everything slow (validating and compiling an upload) runs on a thread of its own. */
#include "lc_api.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pie/v1/lifecycle.pb-c.h"
#include "pie_check.h"
#include "pie_log.h"
#include "pie_sha256.h"

#define LC_API_N_OWN       10 /* methods defined here */
#define LC_API_MAX_METHODS 16
#define LC_API_CHUNK_MAX   (1u << 20) /* UploadProgramRequest.chunk: 1 byte .. 1 MiB */
#define LC_API_MAX_UPLOADS 16u        /* programs.max_uploads default */
#define LC_API_WORKERS     8u         /* threads running jobs (uploads, fetches, deletes, exports) */
#define LC_API_JOB_QUEUE   256u       /* jobs waiting for one; more are refused */

/* One tenant's uploads in progress. */
typedef struct lc_tenant_uploads {
    char tenant[PIE_TENANT_NAME_MAX + 1]; /* first (pie_tenant_tab) */
    uint32_t n;
} lc_tenant_uploads;

struct lc_api {
    lc_program_store *programs;
    lc_inst_mgr *insts;
    lc_session *session;
    lc_store *store; /* the controller's registry; NULL or disabled: programs stay local */
    rpc_method methods[LC_API_MAX_METHODS];
    size_t n_methods;
    pthread_mutex_t mu; /* guards the job fields below */
    pthread_cond_t cv;  /* jobs reached 0 */
    size_t jobs;        /* jobs queued or running (uploads, fetches, deletes, exports) */
    /* A fixed pool of job threads, started as needed (LC_API_WORKERS at most) and joined by
     * lc_api_destroy, and a bounded queue in front of it: no thread per request. */
    pthread_cond_t work_cv; /* a job was queued, or stopping */
    pthread_t workers[LC_API_WORKERS];
    size_t n_workers, idle;
    struct {
        void *(*fn)(void *);
        void *arg;
    } queue[LC_API_JOB_QUEUE];
    size_t q_head, q_len;
    bool stopping;
    uint32_t max_uploads;  /* programs.max_uploads */
    atomic_uint uploads;   /* UploadProgram calls in progress */
    /* With tenants: each tenant's uploads in progress, at most max_tenant_uploads each, so one
     * tenant never takes every slot (a small table: the tenants uploading at this moment). */
    uint32_t max_tenant_uploads; /* programs.max_tenant_uploads, derived when 0 */
    pthread_mutex_t tenant_mu;   /* guards tenant_uploads */
    pie_tenant_tab tenant_uploads; /* of lc_tenant_uploads: tenants uploading now */
    pie_budget *budget;    /* limits.replica_memory: upload buffers are charged to it */
};

/* ---- jobs: what may block runs on the pool's threads ------------------------------------------ */

static void job_done(lc_api *a) {
    pthread_mutex_lock(&a->mu);
    if (--a->jobs == 0) pthread_cond_broadcast(&a->cv);
    pthread_mutex_unlock(&a->mu);
}

static void *job_worker(void *arg) {
    lc_api *a = arg;
    pthread_mutex_lock(&a->mu);
    for (;;) {
        while (a->q_len == 0 && !a->stopping) {
            a->idle++;
            pthread_cond_wait(&a->work_cv, &a->mu);
            a->idle--;
        }
        if (a->q_len == 0) break; /* stopping, nothing left */
        void *(*fn)(void *) = a->queue[a->q_head].fn;
        void *job = a->queue[a->q_head].arg;
        a->q_head = (a->q_head + 1) % LC_API_JOB_QUEUE;
        a->q_len--;
        pthread_mutex_unlock(&a->mu);
        fn(job); /* ends with job_done */
        pthread_mutex_lock(&a->mu);
    }
    pthread_mutex_unlock(&a->mu);
    return NULL;
}

/* Queues fn(arg) for the pool (a thread is started when none is idle and the pool is not
 * full), counted in a->jobs until fn's job_done (lc_api_destroy waits for them). 0, or EAGAIN
 * when the queue is full or no thread could run it (nothing queued). */
static int job_start(lc_api *a, void *(*fn)(void *), void *arg) {
    pthread_mutex_lock(&a->mu);
    if (a->q_len == LC_API_JOB_QUEUE || a->stopping) {
        pthread_mutex_unlock(&a->mu);
        return EAGAIN;
    }
    if (a->idle == 0 && a->n_workers < LC_API_WORKERS &&
        pthread_create(&a->workers[a->n_workers], NULL, job_worker, a) == 0)
        a->n_workers++;
    if (a->n_workers == 0) {
        pthread_mutex_unlock(&a->mu);
        return EAGAIN;
    }
    a->queue[(a->q_head + a->q_len) % LC_API_JOB_QUEUE].fn = fn;
    a->queue[(a->q_head + a->q_len) % LC_API_JOB_QUEUE].arg = arg;
    a->q_len++;
    a->jobs++;
    pthread_cond_signal(&a->work_cv);
    pthread_mutex_unlock(&a->mu);
    return 0;
}

static bool registry_on(const lc_api *a) { return lc_store_programs_enabled(a->store); }

/* The caller's tenant as the holder of what its upload or launch stores here. */
static lc_program_holder holder_of(rpc_call *call) {
    const pie_tenant *t = rpc_call_tenant(call);
    return (lc_program_holder){t->name, t->quota.program_bytes};
}

/* Whether a launch of id must first fetch the program from the registry: sharing is on, id is
 * well-formed and this replica does not hold it. */
static bool needs_fetch(lc_api *a, const char *id) {
    pie_status st;
    return registry_on(a) && pie_sha256_is_hex(id) &&
           lc_program_lookup(a->programs, id, NULL, 0, &st) == PIE_NOT_FOUND;
}

/* ---- UploadProgram ------------------------------------------------------------------------ */

/* One upload. The call's callbacks own it until the stream is complete; then the upload's
 * thread reads it too, while on_cancel / on_done may still fire the cancel token (the client
 * went away, its deadline passed, the server is shutting down): a reference each. */
typedef struct lc_upload {
    lc_api *api;
    rpc_call *call;
    atomic_int refs;       /* the call's (until on_done) and the upload thread's */
    lc_wasm_cancel cancel; /* fired when the call ends: the compile is killed */
    bool have_meta, failed;
    atomic_bool counted; /* in api->uploads (cleared by upload_release) */
    char tenant[PIE_TENANT_NAME_MAX + 1]; /* counted in api->tenant_uploads too ("": not) */
    uint64_t charged;    /* bytes of api->budget its buffer holds */
    char name[LC_PROGRAM_NAME_MAX + 1];
    char expected_sha256[65];
    uint8_t *buf;
    uint64_t size, got;
} lc_upload;

/* Counts an upload of tenant's (none: the anonymous tenant of a cluster without tenants, not
 * counted); false when it has max_tenant_uploads in progress already. */
static bool tenant_upload_begin(lc_api *a, const char *tenant) {
    if (tenant[0] == '\0') return true;
    pthread_mutex_lock(&a->tenant_mu);
    lc_tenant_uploads *u = pie_tenant_tab_get(&a->tenant_uploads, tenant);
    bool ok = u != NULL && u->n < a->max_tenant_uploads;
    if (ok)
        u->n++;
    else if (u && u->n == 0)
        pie_tenant_tab_remove(&a->tenant_uploads, u);
    pthread_mutex_unlock(&a->tenant_mu);
    return ok;
}

static void tenant_upload_end(lc_api *a, const char *tenant) {
    if (tenant[0] == '\0') return;
    pthread_mutex_lock(&a->tenant_mu);
    lc_tenant_uploads *u = pie_tenant_tab_find(&a->tenant_uploads, tenant);
    if (u && --u->n == 0) pie_tenant_tab_remove(&a->tenant_uploads, u); /* holds active ones */
    pthread_mutex_unlock(&a->tenant_mu);
}

/* Gives back what an upload holds of the replica (its programs.max_uploads slot, its buffer and
 * the budget it charged) once nothing more will read the bytes: before its answer is sent, so
 * that a client uploading one program after another (the common case with max_uploads = 1)
 * never finds its own finished upload still in the way. The call's callbacks and the upload's
 * thread never run this at once: the thread starts after the last callback that may fail. */
static void upload_release(lc_upload *u) {
    if (atomic_exchange(&u->counted, false)) {
        atomic_fetch_sub(&u->api->uploads, 1);
        tenant_upload_end(u->api, u->tenant);
    }
    pie_budget_give(u->api->budget, u->charged);
    u->charged = 0;
    free(u->buf);
    u->buf = NULL;
}

static void upload_unref(lc_upload *u) {
    if (atomic_fetch_sub(&u->refs, 1) != 1) return;
    upload_release(u);
    free(u);
}

static void upload_fail(lc_upload *u, pie_code code, const char *msg) {
    u->failed = true;
    upload_release(u);
    rpc_call_finish(u->call, code, msg);
}

static void upload_meta(lc_upload *u, const Pie__V1__ProgramMetadata *md) {
    pie_status st;
    uint64_t max = lc_program_max_bytes(u->api->programs);
    const pie_tenant *tenant = rpc_call_tenant(u->call);
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
    else if (tenant->quota.upload_bytes && md->size_bytes > tenant->quota.upload_bytes)
        pie_status_set(&st, PIE_RESOURCE_EXHAUSTED,
                       "metadata.size_bytes: %llu is above tenant \"%s\" quota upload_bytes "
                       "(%llu)",
                       (unsigned long long)md->size_bytes, tenant->name,
                       (unsigned long long)tenant->quota.upload_bytes);
    else if (md->expected_sha256 && md->expected_sha256[0] &&
             !pie_sha256_is_hex(md->expected_sha256))
        pie_status_set(&st, PIE_INVALID_ARGUMENT,
                       "metadata.expected_sha256: \"%.80s\" is not 64 lowercase hex digits",
                       md->expected_sha256);
    else if (!pie_budget_take(u->api->budget, md->size_bytes))
        pie_status_set(&st, PIE_RESOURCE_EXHAUSTED,
                       "metadata.size_bytes: this replica's memory budget "
                       "(limits.replica_memory) cannot hold %llu more bytes now; retry later",
                       (unsigned long long)md->size_bytes);
    else
        pie_status_ok(&st);
    if (st.code == PIE_OK) u->charged = md->size_bytes;
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
    lc_api *a = user;
    const pie_tenant *t = rpc_call_tenant(call);
    const char *tenant = t == &pie_tenant_anonymous ? "" : t->name;
    char msg[240];
    if (!tenant_upload_begin(a, tenant)) {
        snprintf(msg, sizeof msg,
                 "UploadProgram: tenant \"%s\" has %u uploads in progress on this replica, its "
                 "share of the %u (programs.max_tenant_uploads); retry later",
                 tenant, a->max_tenant_uploads, a->max_uploads);
        rpc_call_finish(call, PIE_RESOURCE_EXHAUSTED, msg);
        return false;
    }
    if (atomic_fetch_add(&a->uploads, 1) >= a->max_uploads) {
        atomic_fetch_sub(&a->uploads, 1);
        tenant_upload_end(a, tenant);
        snprintf(msg, sizeof msg,
                 "UploadProgram: %u uploads are in progress on this replica "
                 "(programs.max_uploads); retry later",
                 a->max_uploads);
        rpc_call_finish(call, PIE_RESOURCE_EXHAUSTED, msg);
        return false;
    }
    lc_upload *u = calloc(1, sizeof *u);
    if (u == NULL) {
        atomic_fetch_sub(&a->uploads, 1);
        tenant_upload_end(a, tenant);
        rpc_call_finish(call, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return false;
    }
    snprintf(u->tenant, sizeof u->tenant, "%s", tenant);
    atomic_init(&u->counted, true);
    u->api = user;
    u->call = call;
    atomic_init(&u->refs, 1);
    lc_wasm_cancel_init(&u->cancel);
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
    if (st.code == PIE_OK) {
        lc_program_holder h = holder_of(u->call);
        lc_program_put_cancel(a->programs, u->buf, u->size, u->expected_sha256[0] ? id : NULL,
                              u->name, &h, &u->cancel, id, &already, &st);
    }
    if (st.code == PIE_OK && registry_on(a)) {
        /* Before answering, so that a launch on another replica right after finds it. The
         * upload stands without it: the replica puts it again after its next (re)connect. */
        pie_status pst;
        const char *tenant = rpc_call_tenant(u->call)->name;
        if (lc_store_push_program(a->store, id, &tenant, 1, &pst) != PIE_OK)
            pie_log_warn("lc.program.register_failed", "program=%s code=%s error=\"%s\"", id,
                         pie_code_name(pst.code), pst.msg);
    }
    upload_release(u);
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
        if (st.code != PIE_CANCELLED)
            pie_log_info("lc.program.refused", "name=\"%s\" bytes=%llu code=%s error=\"%s\"",
                         u->name, (unsigned long long)u->size, pie_code_name(st.code), st.msg);
    }
    rpc_call_unref(u->call);
    upload_unref(u);
    job_done(a);
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
    atomic_fetch_add(&u->refs, 1); /* the thread's */
    rpc_call_ref(call);
    if (job_start(a, upload_finish_thread, u) != 0) {
        atomic_fetch_sub(&u->refs, 1);
        upload_fail(u, PIE_RESOURCE_EXHAUSTED, "upload: this replica has too many uploads, fetches and deletes in progress; retry later");
        rpc_call_unref(call);
    }
}

/* The client went away (or its deadline passed, or the server shuts down): a compile of its
 * program in progress is killed (lc_wasm_cancel_fire) instead of running on for nobody. */
static void upload_on_cancel(rpc_call *call, void *user) {
    (void)user;
    lc_upload *u = rpc_call_get_data(call);
    if (u != NULL) lc_wasm_cancel_fire(&u->cancel);
}

static void upload_on_done(rpc_call *call, void *user) {
    (void)user;
    lc_upload *u = rpc_call_get_data(call);
    if (u == NULL) return;
    rpc_call_set_data(call, NULL);
    lc_wasm_cancel_fire(&u->cancel); /* nobody waits for the answer any more */
    upload_unref(u);
}

/* ---- programs ----------------------------------------------------------------------------- */

static bool list_programs_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    (void)req;
    lc_api *a = user;
    pie_status st;
    Pie__V1__ListProgramsResponse r = PIE__V1__LIST_PROGRAMS_RESPONSE__INIT;
    const pie_tenant *t = rpc_call_tenant(call); /* a tenant lists its own, an admin all */
    if (lc_program_list(a->programs, t->admin ? NULL : t->name, &r.programs, &r.n_programs, &st) !=
        PIE_OK) {
        rpc_call_finish_status(call, &st);
        return false;
    }
    rpc_call_reply(call, &r.base);
    lc_program_list_free(r.programs, r.n_programs);
    return false;
}

typedef struct lc_delete_job {
    lc_api *a;
    rpc_call *call;     /* a reference */
    const char *tenant; /* NULL: an admin's delete; else the tenant releasing its hold */
    char id[65];
} lc_delete_job;

/* Deletes here (or releases the caller's hold), then tells the registry, which tells every
 * replica. */
static void *delete_thread(void *arg) {
    lc_delete_job *j = arg;
    lc_api *a = j->a;
    pie_status st, rst;
    bool held = true;
    pie_code local = j->tenant ? lc_program_release(a->programs, j->id, j->tenant, &held, &st)
                               : lc_program_delete(a->programs, j->id, &st);
    if (local == PIE_OK && !held)
        local = pie_status_set(&st, PIE_NOT_FOUND, "tenant \"%s\" holds no copy here", j->tenant);
    bool was = false, held_there = false;
    pie_code remote = PIE_OK;
    if (registry_on(a)) {
        remote = lc_store_drop_program(a->store, j->id, j->tenant, &was, &held_there, &rst);
        if (remote != PIE_OK)
            pie_log_warn("lc.program.drop_failed", "program=%s code=%s error=\"%s\"", j->id,
                         pie_code_name(remote), rst.msg);
    }
    if (j->tenant && local == PIE_NOT_FOUND && was && !held_there) {
        /* the registry knows the holders of what it stores (replicas put them with it): the
         * caller is none of them, so it held it nowhere (barring a hold not put there yet) */
        pie_status_set(&st, PIE_NOT_FOUND,
                       "program_id: tenant \"%s\" holds %s on no replica (it neither uploaded it "
                       "nor launched it where it was fetched); only an admin deletes another "
                       "tenant's program",
                       j->tenant, j->id);
        rpc_call_finish_status(j->call, &st);
    } else if (local == PIE_OK || was || held_there) {
        Pie__V1__DeleteProgramResponse resp = PIE__V1__DELETE_PROGRAM_RESPONSE__INIT;
        rpc_call_reply(j->call, &resp.base);
    } else if (local != PIE_NOT_FOUND) {
        rpc_call_finish_status(j->call, &st);
    } else if (!registry_on(a)) {
        pie_status_set(&st, PIE_NOT_FOUND, "program_id: %s is not stored on this replica%s", j->id,
                       j->tenant ? " as the caller's tenant's" : "");
        rpc_call_finish_status(j->call, &st);
    } else if (remote == PIE_OK) {
        pie_status_set(&st, PIE_NOT_FOUND,
                       "program_id: %s is not stored on this replica%s nor in the controller's "
                       "program registry",
                       j->id, j->tenant ? " as the caller's tenant's" : "");
        rpc_call_finish_status(j->call, &st);
    } else {
        pie_status_set(&st, remote,
                       "program_id: %s is not stored on this replica, and the controller's "
                       "program registry could not be asked: %.300s",
                       j->id, rst.msg);
        rpc_call_finish_status(j->call, &st);
    }
    rpc_call_unref(j->call);
    free(j);
    job_done(a);
    return NULL;
}

/* An admin's delete removes the program cluster-wide; another tenant's releases its hold
 * (programs are shared by content: one tenant never removes what another holds). On a job
 * thread: it touches the disk and may call the controller. */
static bool delete_program_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    lc_api *a = user;
    Pie__V1__DeleteProgramRequest *r = (Pie__V1__DeleteProgramRequest *)req;
    pie_status st;
    if (!pie_sha256_is_hex(r->program_id)) {
        pie_status_set(&st, PIE_INVALID_ARGUMENT,
                       "program_id: \"%.80s\" is not 64 lowercase hex digits (a SHA-256)",
                       r->program_id ? r->program_id : "");
        rpc_call_finish_status(call, &st);
        return false;
    }
    const pie_tenant *t = rpc_call_tenant(call);
    lc_delete_job *j = calloc(1, sizeof *j);
    if (j == NULL) {
        rpc_call_finish(call, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return false;
    }
    j->a = a;
    j->call = call;
    j->tenant = t->admin ? NULL : t->name; /* the tenant outlives the call (the tenants table) */
    snprintf(j->id, sizeof j->id, "%s", r->program_id);
    rpc_call_ref(call);
    if (job_start(a, delete_thread, j) != 0) {
        rpc_call_unref(call);
        free(j);
        rpc_call_finish(call, PIE_RESOURCE_EXHAUSTED,
                        "delete: this replica has too many jobs in progress; retry later");
    }
    return false;
}

/* ---- exports: the controller's, as the caller's tenant sees them ------------------------------ */

typedef struct lc_export_job {
    lc_api *a;
    rpc_call *call; /* a reference */
    const pie_tenant *tenant;
    bool all;           /* ListExports over every tenant */
    char *name, *owner; /* DeleteExport: the export and its tenant; NULL for ListExports */
} lc_export_job;

static void export_job_free(lc_export_job *j) {
    free(j->name);
    free(j->owner);
    free(j);
}

static void *export_job_thread(void *arg) {
    lc_export_job *j = arg;
    lc_api *a = j->a;
    pie_status st;
    if (j->name == NULL) {
        Pie__V1__ListTenantExportsResponse *cr = NULL;
        if (lc_store_list_exports(a->store, j->tenant->name, j->all, &cr, &st) == PIE_OK) {
            Pie__V1__ListExportsResponse r = PIE__V1__LIST_EXPORTS_RESPONSE__INIT;
            r.exports = cr->exports;
            r.n_exports = cr->n_exports;
            rpc_call_reply(j->call, &r.base);
        } else {
            rpc_call_finish_status(j->call, &st);
        }
        if (cr) rpc_msg_free(&cr->base);
    } else {
        uint32_t pages = 0;
        if (lc_store_delete_export(a->store, j->owner, j->name, &pages, &st) == PIE_OK) {
            pie_log_info("lc.export.deleted", "tenant=%s owner=%s pages=%u", j->tenant->name,
                         j->owner, pages);
            Pie__V1__DeleteExportResponse r = PIE__V1__DELETE_EXPORT_RESPONSE__INIT;
            r.page_count = pages;
            rpc_call_reply(j->call, &r.base);
        } else {
            rpc_call_finish_status(j->call, &st);
        }
    }
    rpc_call_unref(j->call);
    export_job_free(j);
    job_done(a);
    return NULL;
}

static void export_job_start(lc_api *a, rpc_call *call, lc_export_job *j) {
    if (a->store == NULL) {
        export_job_free(j);
        rpc_call_finish(call, PIE_UNAVAILABLE, "this replica has no link to the controller");
        return;
    }
    j->a = a;
    j->call = call;
    j->tenant = rpc_call_tenant(call);
    rpc_call_ref(call);
    if (job_start(a, export_job_thread, j) != 0) {
        rpc_call_unref(call);
        export_job_free(j);
        rpc_call_finish(call, PIE_RESOURCE_EXHAUSTED, "exports: this replica has too many jobs in progress; retry later");
    }
}

static bool list_exports_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    const Pie__V1__ListExportsRequest *r = (const Pie__V1__ListExportsRequest *)req;
    if (r->all_tenants && !rpc_call_tenant(call)->admin) {
        rpc_call_finish(call, PIE_PERMISSION_DENIED,
                        "all_tenants: only an admin tenant may list every tenant's exports");
        return false;
    }
    lc_export_job *j = calloc(1, sizeof *j);
    if (j == NULL) {
        rpc_call_finish(call, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return false;
    }
    j->all = r->all_tenants;
    export_job_start(user, call, j);
    return false;
}

static bool delete_export_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    const Pie__V1__DeleteExportRequest *r = (const Pie__V1__DeleteExportRequest *)req;
    const pie_tenant *me = rpc_call_tenant(call);
    const char *owner = r->tenant && r->tenant[0] ? r->tenant : me->name;
    pie_status st;
    if (pie_check_name(PIE_AT("DeleteExport"), "name", r->name ? strlen(r->name) : 0, &st) !=
        PIE_OK) {
        rpc_call_finish_status(call, &st);
        return false;
    }
    if (strcmp(owner, me->name) != 0 && !me->admin) {
        rpc_call_finish(call, PIE_PERMISSION_DENIED,
                        "tenant: only an admin tenant may delete another tenant's exports");
        return false;
    }
    lc_export_job *j = calloc(1, sizeof *j);
    if (j) {
        j->name = strdup(r->name);
        j->owner = strdup(owner);
    }
    if (!j || !j->name || !j->owner) {
        if (j) export_job_free(j);
        rpc_call_finish(call, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return false;
    }
    export_job_start(user, call, j);
    return false;
}

/* ---- instances ---------------------------------------------------------------------------- */

/* Launch once the program is here: the instance starts and the call gets its id. */
static void launch_reply(lc_api *a, rpc_call *call, const Pie__V1__LaunchRequest *req) {
    pie_status st;
    lc_inst *in = NULL;
    lc_limits l;
    if (lc_inst_launch(a->insts, req, rpc_call_tenant(call), NULL, &in, &l, &st) != PIE_OK) {
        rpc_call_finish_status(call, &st);
        return;
    }
    Pie__V1__ResourceLimits pl;
    lc_limits_to_pb(&l, &pl);
    Pie__V1__LaunchResponse r = PIE__V1__LAUNCH_RESPONSE__INIT;
    r.instance_id = lc_inst_id(in);
    r.limits = &pl;
    rpc_call_reply(call, &r.base);
    lc_inst_unref(in);
}

typedef struct lc_attach lc_attach;

/* A Launch or Run whose program this replica lacks: fetched from the registry on a job thread,
 * then launched there. */
typedef struct lc_fetch_job {
    lc_api *a;
    rpc_call *call;              /* a reference */
    Pie__V1__LaunchRequest *req; /* Launch: the kept request */
    lc_attach *at;               /* Run: its state (a reference) */
    char id[65];
} lc_fetch_job;

static void run_fetched(lc_api *a, rpc_call *call, lc_attach *at, const pie_status *fetched);

static void *fetch_thread(void *arg) {
    lc_fetch_job *j = arg;
    lc_api *a = j->a;
    pie_status st;
    pie_status_ok(&st);
    lc_program_holder h = holder_of(j->call);
    lc_store_fetch_program(a->store, j->id, &h, &st);
    if (j->at) {
        run_fetched(a, j->call, j->at, &st);
    } else {
        if (st.code == PIE_OK)
            launch_reply(a, j->call, j->req);
        else
            rpc_call_finish_status(j->call, &st);
        rpc_msg_free(&j->req->base);
    }
    rpc_call_unref(j->call);
    free(j);
    job_done(a);
    return NULL;
}

/* Starts the fetch of id for call; false (the call finished with the error) if it could not. */
static bool fetch_start(lc_api *a, rpc_call *call, Pie__V1__LaunchRequest *req, lc_attach *at,
                        const char *id) {
    lc_fetch_job *j = calloc(1, sizeof *j);
    if (j == NULL) {
        rpc_call_finish(call, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return false;
    }
    *j = (lc_fetch_job){.a = a, .call = call, .req = req, .at = at};
    snprintf(j->id, sizeof j->id, "%s", id);
    rpc_call_ref(call);
    if (job_start(a, fetch_thread, j) != 0) {
        rpc_call_unref(call);
        free(j);
        rpc_call_finish(call, PIE_RESOURCE_EXHAUSTED, "launch: this replica has too many program fetches in progress; retry later");
        return false;
    }
    return true;
}

static bool launch_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    lc_api *a = user;
    Pie__V1__LaunchRequest *r = (Pie__V1__LaunchRequest *)req;
    if (needs_fetch(a, r->program_id)) return fetch_start(a, call, r, NULL, r->program_id);
    launch_reply(a, call, r);
    return false;
}

static bool terminate_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    lc_api *a = user;
    pie_status st;
    lc_inst *in = lc_inst_find(a->insts, ((Pie__V1__TerminateRequest *)req)->instance_id,
                               rpc_call_tenant(call), &st);
    if (in == NULL) {
        rpc_call_finish_status(call, &st);
        return false;
    }
    lc_inst_terminate(in, call);
    lc_inst_unref(in);
    return false;
}

static bool list_instances_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    (void)req;
    lc_api *a = user;
    pie_status st;
    Pie__V1__ListInstancesResponse r = PIE__V1__LIST_INSTANCES_RESPONSE__INIT;
    if (lc_inst_list(a->insts, rpc_call_tenant(call), &r.instances, &r.n_instances, &st) != PIE_OK) {
        rpc_call_finish_status(call, &st);
        return false;
    }
    rpc_call_reply(call, &r.base);
    lc_inst_list_free(r.instances, r.n_instances);
    return false;
}

/* ---- Attach and Run ------------------------------------------------------------------------ */

/* The state of one Attach or Run call. Its callbacks run on the call's completion-queue thread;
 * while a Run waits for its program (fetching), the fetch job runs too, so everything is
 * under mu. The messages a Run client sends meanwhile are kept in order and replayed after
 * the launch. */
struct lc_attach {
    pthread_mutex_t mu;
    int refs;    /* the call's, and a fetch job's */
    lc_inst *in; /* a reference, once started */
    bool run;    /* Run (cancel terminates, half-close ends input) or Attach */
    bool over;   /* the call was ended by an error */
    bool fetching, cancelled, half_closed;
    Pie__V1__RunRequest *launch; /* fetching: the kept first message */
    ProtobufCMessage **backlog;  /* fetching: later messages, kept */
    size_t n_backlog;
};

static void attach_release(lc_attach *at) { /* mu held; unlocks, frees at the last reference */
    bool last = --at->refs == 0;
    pthread_mutex_unlock(&at->mu);
    if (!last) return;
    for (size_t i = 0; i < at->n_backlog; i++) rpc_msg_free(at->backlog[i]);
    free(at->backlog);
    rpc_msg_free(at->launch ? &at->launch->base : NULL);
    pthread_mutex_destroy(&at->mu);
    free(at);
}

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
    if (at == NULL || pthread_mutex_init(&at->mu, NULL) != 0) {
        free(at);
        rpc_call_finish(call, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return false;
    }
    at->refs = 1;
    at->run = strcmp(rpc_call_method(call), "/pie.v1.Lifecycle/Run") == 0;
    rpc_call_set_data(call, at);
    return false;
}

/* Run: launches the instance attached to the call (`started` first, then all its output). */
static void run_launch(lc_api *a, rpc_call *call, lc_attach *at,
                       const Pie__V1__LaunchRequest *req) {
    pie_status st;
    lc_limits l;
    if (lc_inst_launch(a->insts, req, rpc_call_tenant(call), call, &at->in, &l, &st) != PIE_OK) attach_fail(call, at, &st);
}

/* The first message: start (Attach) or launch (Run). Returns true when it keeps msg (a Run
 * whose program is being fetched). */
static bool attach_start(lc_api *a, rpc_call *call, lc_attach *at, int msg_case,
                         ProtobufCMessage *first, ProtobufCMessage *msg) {
    pie_status st;
    if (!at->run) {
        if (msg_case != PIE__V1__ATTACH_REQUEST__MSG_START) {
            pie_status_set(&st, PIE_INVALID_ARGUMENT, "the first message must be start");
            attach_fail(call, at, &st);
            return false;
        }
        at->in = lc_inst_find(a->insts, ((Pie__V1__AttachStart *)first)->instance_id,
                             rpc_call_tenant(call), &st);
        if (at->in == NULL || lc_inst_attach(at->in, call, &st) != PIE_OK)
            attach_fail(call, at, &st);
        return false;
    }
    if (msg_case != PIE__V1__RUN_REQUEST__MSG_LAUNCH) {
        pie_status_set(&st, PIE_INVALID_ARGUMENT, "the first message must be launch");
        attach_fail(call, at, &st);
        return false;
    }
    Pie__V1__LaunchRequest *req = (Pie__V1__LaunchRequest *)first;
    if (needs_fetch(a, req->program_id)) {
        at->fetching = true;
        at->launch = (Pie__V1__RunRequest *)msg;
        at->refs++; /* the job's */
        if (fetch_start(a, call, NULL, at, req->program_id)) return true;
        at->fetching = false; /* the call is finished */
        at->launch = NULL;
        at->refs--;
        at->over = true;
        return false;
    }
    run_launch(a, call, at, req);
    return false;
}

/* A client message or end of input, after the first message; again_first: another launch (Run)
 * or start (Attach), which the call cannot take twice. */
static void attach_input(rpc_call *call, lc_attach *at, bool is_message,
                         const ProtobufCBinaryData *msg, bool close_input, bool again_first) {
    pie_status st;
    if (is_message) {
        if (lc_inst_message(at->in, msg->data, msg->len, &st) != PIE_OK) attach_fail(call, at, &st);
    } else if (close_input) {
        lc_inst_close_input(at->in);
    } else if (again_first) {
        pie_status_set(&st, PIE_FAILED_PRECONDITION,
                       "%s: this call already %s instance %016llx; only its first message may "
                       "be %s",
                       at->run ? "launch" : "start", at->run ? "launched" : "is attached to",
                       (unsigned long long)lc_inst_id(at->in), at->run ? "launch" : "start");
        attach_fail(call, at, &st);
    } else {
        pie_status_set(&st, PIE_INVALID_ARGUMENT, "%s: the message sets none of its fields",
                       at->run ? "RunRequest" : "AttachRequest");
        attach_fail(call, at, &st);
    }
}

/* One client message (mu held, not fetching, not over). Returns true when it keeps msg. */
static bool attach_dispatch(lc_api *a, rpc_call *call, lc_attach *at, ProtobufCMessage *msg) {
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
    if (at->in == NULL) return attach_start(a, call, at, c, first, msg);
    attach_input(call, at, is_message, bytes, close_input, first != NULL);
    return false;
}

/* End of client input (mu held, not fetching, not over). */
static void attach_half_close(rpc_call *call, lc_attach *at) {
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

/* The fetch job of a Run ended (its thread): launch, then what the client sent meanwhile. */
static void run_fetched(lc_api *a, rpc_call *call, lc_attach *at, const pie_status *fetched) {
    pthread_mutex_lock(&at->mu);
    at->fetching = false;
    if (!at->over && !at->cancelled) {
        if (fetched->code != PIE_OK)
            attach_fail(call, at, fetched);
        else
            run_launch(a, call, at, at->launch->launch);
        for (size_t i = 0; i < at->n_backlog && !at->over; i++)
            attach_dispatch(a, call, at, at->backlog[i]);
        if (at->half_closed && !at->over) attach_half_close(call, at);
    }
    for (size_t i = 0; i < at->n_backlog; i++) rpc_msg_free(at->backlog[i]);
    at->n_backlog = 0;
    rpc_msg_free(&at->launch->base);
    at->launch = NULL;
    attach_release(at);
}

static bool attach_on_message(rpc_call *call, ProtobufCMessage *msg, void *user) {
    lc_attach *at = rpc_call_get_data(call);
    if (at == NULL) return false;
    bool kept = false;
    pthread_mutex_lock(&at->mu);
    if (at->over) {
        /* ended by an error: nothing more is read */
    } else if (at->fetching) {
        ProtobufCMessage **v = realloc(at->backlog, (at->n_backlog + 1) * sizeof *v);
        if (v == NULL) {
            pie_status st;
            pie_status_set(&st, PIE_RESOURCE_EXHAUSTED, "out of memory");
            attach_fail(call, at, &st);
        } else {
            at->backlog = v;
            at->backlog[at->n_backlog++] = msg;
            kept = true;
        }
    } else {
        kept = attach_dispatch(user, call, at, msg);
    }
    pthread_mutex_unlock(&at->mu);
    return kept;
}

static void attach_on_half_close(rpc_call *call, void *user) {
    (void)user;
    lc_attach *at = rpc_call_get_data(call);
    if (at == NULL) return;
    pthread_mutex_lock(&at->mu);
    if (at->fetching)
        at->half_closed = true;
    else if (!at->over)
        attach_half_close(call, at);
    pthread_mutex_unlock(&at->mu);
}

static void attach_on_cancel(rpc_call *call, void *user) {
    (void)user;
    lc_attach *at = rpc_call_get_data(call);
    if (at == NULL) return;
    pthread_mutex_lock(&at->mu);
    at->cancelled = true;
    if (at->in) {
        lc_inst_detach(at->in, call);
        if (at->run) lc_inst_stop(at->in, PIE_CANCELLED, "terminated: the Run call was cancelled");
    }
    pthread_mutex_unlock(&at->mu);
}

static void attach_on_done(rpc_call *call, void *user) {
    (void)user;
    lc_attach *at = rpc_call_get_data(call);
    if (at == NULL) return;
    rpc_call_set_data(call, NULL);
    pthread_mutex_lock(&at->mu);
    at->cancelled = true; /* a fetch job that ends later launches nothing */
    if (at->in) {
        lc_inst_detach(at->in, call);
        lc_inst_unref(at->in);
        at->in = NULL;
    }
    attach_release(at);
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
                      lc_store *store, pie_status *st) {
    lc_api *a = calloc(1, sizeof *a);
    if (a == NULL || pthread_mutex_init(&a->mu, NULL) != 0) {
        free(a);
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    a->tenant_uploads = (pie_tenant_tab)PIE_TENANT_TAB_INIT(lc_tenant_uploads);
    if (pthread_cond_init(&a->cv, NULL) != 0) {
        pthread_mutex_destroy(&a->mu);
        free(a);
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    if (pthread_cond_init(&a->work_cv, NULL) != 0) {
        pthread_cond_destroy(&a->cv);
        pthread_mutex_destroy(&a->mu);
        free(a);
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    if (pthread_mutex_init(&a->tenant_mu, NULL) != 0) {
        pthread_cond_destroy(&a->work_cv);
        pthread_cond_destroy(&a->cv);
        pthread_mutex_destroy(&a->mu);
        free(a);
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    a->programs = programs;
    lc_api_set_limits(a, 0, 0, NULL);
    atomic_init(&a->uploads, 0);
    a->insts = insts;
    a->session = session;
    a->store = store;
    rpc_method *m = a->methods;
    m[0] = (rpc_method){.path = "/pie.v1.Lifecycle/UploadProgram",
                        .kind = RPC_CLIENT_STREAM,
                        .request = &pie__v1__upload_program_request__descriptor,
                        .response = &pie__v1__upload_program_response__descriptor,
                        .on_call = upload_on_call,
                        .on_message = upload_on_message,
                        .on_half_close = upload_on_half_close,
                        .on_cancel = upload_on_cancel,
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
    m[8] = LC_UNARY("ListExports", pie__v1__list_exports_request, pie__v1__list_exports_response,
                    list_exports_on_call);
    m[9] = LC_UNARY("DeleteExport", pie__v1__delete_export_request,
                    pie__v1__delete_export_response, delete_export_on_call);
    a->n_methods = LC_API_N_OWN;
    size_t n_sess = 0;
    const rpc_method *sm = lc_session_methods(session, &n_sess);
    for (size_t i = 0; i < n_sess && a->n_methods < LC_API_MAX_METHODS; i++)
        a->methods[a->n_methods++] = sm[i];
    return a;
}

void lc_api_set_limits(lc_api *a, uint32_t max_uploads, uint32_t max_tenant_uploads,
                       pie_budget *budget) {
    a->max_uploads = max_uploads ? max_uploads : LC_API_MAX_UPLOADS;
    a->max_tenant_uploads = max_tenant_uploads ? max_tenant_uploads : (a->max_uploads + 1) / 2;
    a->budget = budget;
}

const rpc_method *lc_api_methods(lc_api *a, size_t *n) {
    *n = a->n_methods;
    return a->methods;
}

void lc_api_destroy(lc_api *a) {
    if (a == NULL) return;
    pthread_mutex_lock(&a->mu);
    while (a->jobs > 0) pthread_cond_wait(&a->cv, &a->mu);
    a->stopping = true;
    pthread_cond_broadcast(&a->work_cv);
    pthread_mutex_unlock(&a->mu);
    for (size_t i = 0; i < a->n_workers; i++) pthread_join(a->workers[i], NULL);
    pthread_cond_destroy(&a->work_cv);
    pthread_cond_destroy(&a->cv);
    pthread_mutex_destroy(&a->mu);
    pthread_mutex_destroy(&a->tenant_mu);
    pie_tenant_tab_free(&a->tenant_uploads);
    free(a);
}
