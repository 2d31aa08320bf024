/* ctl_cluster.c — see ctl_cluster.h. */
#include "ctl_cluster.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ctl_registry.h"
#include "pie/v1/controller.pb-c.h"
#include "pie_log.h"
#include "pie_sha256.h"

#define CTL_CHUNK_MAX        (1u << 20) /* GetTokenizer / GetProgram / PutProgram chunks */
#define CTL_PROGRAM_NAME_MAX 256        /* PutProgramHeader.name, as ProgramMetadata.name */
#define CTL_PUT_TENANTS_MAX  256        /* PutProgramHeader.tenants */

struct ctl_cluster {
    pthread_mutex_t mu;    /* serialises every call into core; also guards puts */
    pthread_cond_t cv;     /* wakes the timer thread (CLOCK_MONOTONIC) */
    pthread_cond_t put_cv; /* puts reached 0 */
    pthread_t timer;
    bool timer_started, stop;
    int64_t timer_due; /* what the timer thread sleeps until; 0: no deadline */
    size_t puts;       /* PutProgram threads still running */
    ctl_core *core;
    ctl_registry *reg;
    uint64_t program_max_bytes;
    rpc_method methods[9];
};

/* Per-stream state (rpc_call data). */
typedef struct ctl_stream {
    ctl_replica *r;   /* Session, once joined */
    ctl_worker *w;    /* WorkerLink, once registered */
    char tok_sha[65]; /* WorkerLink: the tokenizer it added to the registry, or "" */
} ctl_stream;

/* ---- sink: the core's output ------------------------------------------------------------------
 */

/* Sends m on a Session or WorkerLink stream. The core calls this under the cluster's one lock,
 * so it must never wait for a peer: one slow lifecycle replica or worker would stall every
 * other. The stream's queue is bounded instead (streams.send_queue*, ctl_main.c); a message
 * that does not fit, or any other failed send, means this stream lost a message the peer is
 * waiting for, so the stream is ended at once with UNAVAILABLE and the reason: the replica
 * fails its instances (their futures wake with the error) or the worker's steps fail, both
 * reconnect, and nothing waits for an answer that will never come. A healthy peer that reads
 * does not get near the bound: what the controller sends a replica answers calls it sent
 * (capped per instance and queue by the lifecycle; topic deliveries are the exception), and a
 * worker gets steps only as its credits allow. */
static void send_checked(rpc_call *call, const ProtobufCMessage *m, const char *what) {
    pie_code rc = rpc_call_send(call, m);
    if (rc == PIE_OK || rc == PIE_CANCELLED) return; /* cancelled: the stream is ending anyway */
    char why[256];
    if (rc == PIE_RESOURCE_EXHAUSTED)
        snprintf(why, sizeof why,
                 "controller: the %s stream's send queue is full (%zu messages wait; the peer "
                 "does not read fast enough) or a message exceeds server.max_message; the "
                 "stream is ended so that its calls fail instead of waiting for lost results",
                 what, rpc_call_send_queued(call));
    else
        snprintf(why, sizeof why, "controller: sending on the %s stream failed (%s)", what,
                 pie_code_name(rc));
    pie_log_warn("ctl.send_failed", "stream=%s code=%s queued=%zu", what, pie_code_name(rc),
                 rpc_call_send_queued(call));
    rpc_call_cancel(call, PIE_UNAVAILABLE, why);
}

static void sink_replica(void *user, void *link, const Pie__V1__SessionDown *m) {
    (void)user;
    send_checked(link, &m->base, "session");
}

static void sink_worker(void *user, void *link, const Pie__V1__WorkerDown *m) {
    (void)user;
    send_checked(link, &m->base, "worker_link");
}

static void sink_end(void *user, void *link, pie_code code, const char *msg) {
    (void)user;
    rpc_call_cancel(link, code, msg);
}

/* After an entry into the core (mu held): wake the timer thread if something is now due
 * earlier than it planned for. */
static void kick_timer(ctl_cluster *c) {
    int64_t wake = ctl_core_next_wake(c->core);
    if (wake != 0 && (c->timer_due == 0 || wake < c->timer_due)) {
        c->timer_due = wake;
        pthread_cond_signal(&c->cv);
    }
}

static void *timer_main(void *arg) {
    ctl_cluster *c = arg;
    pthread_mutex_lock(&c->mu);
    while (!c->stop) {
        int64_t now = rpc_now_ns();
        int64_t due = ctl_core_next_wake(c->core);
        if (due != 0 && due <= now) {
            ctl_core_tick(c->core, now);
            continue;
        }
        c->timer_due = due;
        if (due == 0) {
            pthread_cond_wait(&c->cv, &c->mu);
        } else {
            struct timespec ts = {.tv_sec = due / 1000000000, .tv_nsec = due % 1000000000};
            pthread_cond_timedwait(&c->cv, &c->mu, &ts);
        }
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* ---- streams ------------------------------------------------------------------------------- */

static bool stream_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    (void)req;
    (void)user;
    ctl_stream *s = calloc(1, sizeof *s);
    if (s == NULL) {
        rpc_call_cancel(call, PIE_RESOURCE_EXHAUSTED, "controller: out of memory");
        return false;
    }
    rpc_call_set_data(call, s);
    return false;
}

static void stream_on_half_close(rpc_call *call, void *user) {
    (void)user;
    rpc_call_finish(call, PIE_OK, NULL);
}

static bool session_on_message(rpc_call *call, ProtobufCMessage *msg, void *user) {
    ctl_cluster *c = user;
    ctl_stream *s = rpc_call_get_data(call);
    Pie__V1__SessionUp *up = (Pie__V1__SessionUp *)msg;
    if (s == NULL) return false;
    int64_t now = rpc_now_ns();
    bool kept = true;
    pthread_mutex_lock(&c->mu);
    if (s->r == NULL) {
        if (up->hello == NULL) {
            rpc_call_cancel(call, PIE_FAILED_PRECONDITION,
                            "Session: the first SessionUp must carry a hello");
            kept = false;
        } else {
            pie_status st;
            s->r = ctl_core_replica_join(c->core, call, up, now, &st);
            if (s->r == NULL) {
                rpc_call_cancel(call, st.code, st.msg);
                kept = false;
            }
        }
    } else {
        ctl_core_session_up(c->core, s->r, up, now);
    }
    kick_timer(c);
    pthread_mutex_unlock(&c->mu);
    return kept;
}

static void session_on_done(rpc_call *call, void *user) {
    ctl_cluster *c = user;
    ctl_stream *s = rpc_call_get_data(call);
    if (s == NULL) return;
    if (s->r) {
        pthread_mutex_lock(&c->mu);
        ctl_core_replica_leave(c->core, s->r, rpc_now_ns());
        kick_timer(c);
        pthread_mutex_unlock(&c->mu);
    }
    rpc_call_set_data(call, NULL);
    free(s);
}

/* Takes a registration's tokenizer.json out of the message (the core keeps the message for the
 * link's lifetime; the registry keeps one copy per hash) after checking that it hashes to the
 * announced tokenizer_sha256. *bytes stays NULL when the registration carries none. Runs
 * before the core's mutex is taken: hashing a tokenizer of several MiB takes milliseconds. */
static pie_code take_tokenizer(Pie__V1__WorkerRegistration *reg, char sha[65], uint8_t **bytes,
                               size_t *len, pie_status *st) {
    *bytes = NULL;
    *len = 0;
    if (reg->tokenizer_json.len == 0) return PIE_OK;
    const char *want =
        reg->model && reg->model->tokenizer && reg->model->tokenizer->tokenizer_sha256
            ? reg->model->tokenizer->tokenizer_sha256
            : "";
    if (!pie_sha256_is_hex(want))
        return pie_status_set(st, PIE_FAILED_PRECONDITION,
                              "WorkerRegistration.tokenizer_json: %zu bytes, but "
                              "model.tokenizer.tokenizer_sha256 \"%.80s\" is not a SHA-256",
                              reg->tokenizer_json.len, want);
    if (pie_sha256_hex(reg->tokenizer_json.data, reg->tokenizer_json.len, sha, st) != PIE_OK)
        return st->code;
    if (strcmp(sha, want) != 0)
        return pie_status_set(st, PIE_FAILED_PRECONDITION,
                              "WorkerRegistration.tokenizer_json: its %zu bytes hash to %s, not "
                              "to model.tokenizer.tokenizer_sha256 %s",
                              reg->tokenizer_json.len, sha, want);
    /* protobuf-c unpacked the message with the default allocator (malloc): the buffer is ours
     * to take, and free_unpacked skips a NULL one. */
    *bytes = reg->tokenizer_json.data;
    *len = reg->tokenizer_json.len;
    reg->tokenizer_json.data = NULL;
    reg->tokenizer_json.len = 0;
    return PIE_OK;
}

/* The first WorkerUp of a link (mu not held): its tokenizer, then the core's join. */
static bool worker_register(ctl_cluster *c, rpc_call *call, ctl_stream *s, Pie__V1__WorkerUp *up,
                            int64_t now) {
    pie_status st;
    char sha[65] = "";
    uint8_t *tok = NULL;
    size_t tok_len = 0;
    if (up->registration == NULL) {
        pie_status_set(&st, PIE_FAILED_PRECONDITION,
                       "WorkerLink: the first WorkerUp must carry a registration");
    } else if (take_tokenizer(up->registration, sha, &tok, &tok_len, &st) == PIE_OK) {
        /* Into the registry first: replicas that hear of the model from the join can fetch
         * its tokenizer at once. */
        bool added =
            tok == NULL || ctl_registry_tokenizer_add(c->reg, sha, tok, tok_len, &st) == PIE_OK;
        if (tok != NULL && !added)
            pie_log_error("ctl.registry.tokenizer_failed", "sha256=%.16s error=\"%s\"", sha,
                          st.msg);
        pthread_mutex_lock(&c->mu);
        s->w = ctl_core_worker_join(c->core, call, up, now, &st);
        kick_timer(c);
        pthread_mutex_unlock(&c->mu);
        if (tok != NULL && added) {
            if (s->w)
                snprintf(s->tok_sha, sizeof s->tok_sha, "%s", sha);
            else
                ctl_registry_tokenizer_release(c->reg, sha);
        }
    }
    if (s->w == NULL) {
        pie_log_warn("ctl.worker.refused", "group=%s code=%s error=\"%s\"",
                     up->registration ? up->registration->group_id : "", pie_code_name(st.code),
                     st.msg);
        rpc_call_cancel(call, st.code, st.msg);
        return false;
    }
    return true; /* the core keeps up */
}

static bool worker_on_message(rpc_call *call, ProtobufCMessage *msg, void *user) {
    ctl_cluster *c = user;
    ctl_stream *s = rpc_call_get_data(call);
    Pie__V1__WorkerUp *up = (Pie__V1__WorkerUp *)msg;
    if (s == NULL) return false;
    int64_t now = rpc_now_ns();
    if (s->w == NULL) return worker_register(c, call, s, up, now);
    pthread_mutex_lock(&c->mu);
    ctl_core_worker_up(c->core, s->w, up, now);
    kick_timer(c);
    pthread_mutex_unlock(&c->mu);
    return true; /* the core takes it */
}

static void worker_on_done(rpc_call *call, void *user) {
    ctl_cluster *c = user;
    ctl_stream *s = rpc_call_get_data(call);
    if (s == NULL) return;
    if (s->w) {
        pie_status why;
        pie_status_set(&why, PIE_UNAVAILABLE, "%s",
                       rpc_call_is_cancelled(call) ? "link cancelled or lost" : "link closed");
        pthread_mutex_lock(&c->mu);
        ctl_core_worker_leave(c->core, s->w, &why, rpc_now_ns());
        kick_timer(c);
        pthread_mutex_unlock(&c->mu);
    }
    if (s->tok_sha[0]) ctl_registry_tokenizer_release(c->reg, s->tok_sha);
    rpc_call_set_data(call, NULL);
    free(s);
}

/* ---- ClusterStatus ------------------------------------------------------------------------- */

static void status_reply(void *arg, const Pie__V1__ClusterStatusResponse *r) {
    rpc_call *call = arg;
    if (r == NULL)
        rpc_call_finish(call, PIE_RESOURCE_EXHAUSTED, "controller: out of memory");
    else
        rpc_call_reply(call, &r->base); /* packs now */
}

static bool status_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    (void)req;
    ctl_cluster *c = user;
    pthread_mutex_lock(&c->mu);
    ctl_core_status(c->core, status_reply, call);
    pthread_mutex_unlock(&c->mu);
    return false;
}

/* ---- cluster storage ----------------------------------------------------------------------- */

static bool check_sha(rpc_call *call, const char *field, const char *v) {
    if (pie_sha256_is_hex(v)) return true;
    char msg[200];
    snprintf(msg, sizeof msg, "%s: \"%.80s\" is not 64 lowercase hex digits (a SHA-256)", field,
             v ? v : "");
    rpc_call_finish(call, PIE_INVALID_ARGUMENT, msg);
    return false;
}

static bool get_tokenizer_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    ctl_cluster *c = user;
    const Pie__V1__GetTokenizerRequest *r = (const Pie__V1__GetTokenizerRequest *)req;
    if (!check_sha(call, "tokenizer_sha256", r->tokenizer_sha256)) return false;
    size_t max = r->max_bytes == 0 || r->max_bytes > CTL_CHUNK_MAX ? CTL_CHUNK_MAX : r->max_bytes;
    pie_status st;
    ctl_registry_chunk ch;
    if (ctl_registry_tokenizer_read(c->reg, r->tokenizer_sha256, r->offset, max, &ch, &st) !=
        PIE_OK) {
        rpc_call_finish_status(call, &st);
        return false;
    }
    Pie__V1__GetTokenizerResponse resp = PIE__V1__GET_TOKENIZER_RESPONSE__INIT;
    resp.size_bytes = ch.size;
    resp.data.data = ch.data;
    resp.data.len = ch.len;
    rpc_call_reply(call, &resp.base); /* packs now */
    ctl_registry_chunk_free(&ch);
    return false;
}

static bool get_program_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    ctl_cluster *c = user;
    const Pie__V1__GetProgramRequest *r = (const Pie__V1__GetProgramRequest *)req;
    if (!check_sha(call, "program_id", r->program_id)) return false;
    size_t max = r->max_bytes > CTL_CHUNK_MAX ? CTL_CHUNK_MAX : r->max_bytes;
    pie_status st;
    ctl_registry_chunk ch;
    if (ctl_registry_program_read(c->reg, r->program_id, r->offset, max, &ch, &st) != PIE_OK) {
        rpc_call_finish_status(call, &st);
        return false;
    }
    Pie__V1__GetProgramResponse resp = PIE__V1__GET_PROGRAM_RESPONSE__INIT;
    resp.size_bytes = ch.size;
    resp.name = ch.name ? ch.name : "";
    resp.data.data = ch.data;
    resp.data.len = ch.len;
    rpc_call_reply(call, &resp.base);
    ctl_registry_chunk_free(&ch);
    return false;
}

static bool drop_program_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    ctl_cluster *c = user;
    const Pie__V1__DropProgramRequest *r = (const Pie__V1__DropProgramRequest *)req;
    if (!check_sha(call, "program_id", r->program_id)) return false;
    const char *tenant = r->tenant ? r->tenant : "";
    /* a release: the registry keeps it, first to go once nobody holds it */
    bool held = false;
    bool was = tenant[0] ? ctl_registry_program_release(c->reg, r->program_id, tenant, &held)
                         : ctl_registry_program_drop(c->reg, r->program_id);
    pthread_mutex_lock(&c->mu);
    ctl_core_program_dropped(c->core, r->program_id, tenant, rpc_now_ns());
    kick_timer(c);
    pthread_mutex_unlock(&c->mu);
    pie_log_info("ctl.registry.program_dropped", "program=%s tenant=%s was_stored=%d",
                 r->program_id, tenant[0] ? tenant : "(all)", was);
    Pie__V1__DropProgramResponse resp = PIE__V1__DROP_PROGRAM_RESPONSE__INIT;
    resp.was_stored = was;
    resp.was_held = held;
    rpc_call_reply(call, &resp.base);
    return false;
}

/* ---- exports (operators' and tenants' view, through the lifecycle) --------------------------- */

static void list_exports_reply(void *arg, const Pie__V1__ListTenantExportsResponse *r) {
    if (r == NULL)
        rpc_call_finish(arg, PIE_RESOURCE_EXHAUSTED, "ListTenantExports: controller out of memory");
    else
        rpc_call_reply(arg, &r->base); /* packs now */
}

static bool list_exports_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    ctl_cluster *c = user;
    const Pie__V1__ListTenantExportsRequest *r = (const Pie__V1__ListTenantExportsRequest *)req;
    pthread_mutex_lock(&c->mu);
    ctl_core_list_exports(c->core, r->all ? NULL : r->tenant, list_exports_reply, call);
    pthread_mutex_unlock(&c->mu);
    return false;
}

static bool delete_export_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    ctl_cluster *c = user;
    const Pie__V1__DeleteTenantExportRequest *r = (const Pie__V1__DeleteTenantExportRequest *)req;
    pie_status st;
    uint32_t pages = 0;
    pthread_mutex_lock(&c->mu);
    pie_code rc = ctl_core_delete_export(c->core, r->tenant, r->name, &pages, rpc_now_ns(), &st);
    kick_timer(c);
    pthread_mutex_unlock(&c->mu);
    if (rc != PIE_OK) {
        rpc_call_finish_status(call, &st);
        return false;
    }
    Pie__V1__DeleteTenantExportResponse resp = PIE__V1__DELETE_TENANT_EXPORT_RESPONSE__INIT;
    resp.page_count = pages;
    rpc_call_reply(call, &resp.base);
    return false;
}

/* One PutProgram stream: the header, then the bytes as they arrive. */
typedef struct ctl_put {
    ctl_cluster *c;
    rpc_call *call;
    bool have_header, failed;
    char id[65];
    char name[CTL_PROGRAM_NAME_MAX + 1];
    char (*tenants)[PIE_TENANT_NAME_MAX + 1]; /* header.tenants, checked */
    const char **tenant_ptrs;                 /* into tenants, for the registry */
    size_t n_tenants;
    uint8_t *buf; /* allocated at the first chunk: a hold (no chunk) allocates nothing */
    uint64_t size, got;
} ctl_put;

static void put_free(ctl_put *p) {
    free(p->buf);
    free(p->tenants);
    free(p->tenant_ptrs);
    free(p);
}

static void put_fail(ctl_put *p, pie_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void put_fail(ctl_put *p, pie_code code, const char *fmt, ...) {
    char msg[PIE_STATUS_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    p->failed = true;
    rpc_call_finish(p->call, code, msg);
}

/* Checks and copies header.tenants (duplicates kept once). */
static void put_tenants(ctl_put *p, const Pie__V1__PutProgramHeader *h) {
    if (h->n_tenants > CTL_PUT_TENANTS_MAX) {
        put_fail(p, PIE_INVALID_ARGUMENT, "header.tenants: %zu, want at most %d", h->n_tenants,
                 CTL_PUT_TENANTS_MAX);
        return;
    }
    size_t n = h->n_tenants ? h->n_tenants : 1;
    p->tenants = calloc(n, sizeof *p->tenants);
    p->tenant_ptrs = calloc(n, sizeof *p->tenant_ptrs);
    if (p->tenants == NULL || p->tenant_ptrs == NULL) {
        put_fail(p, PIE_RESOURCE_EXHAUSTED, "controller: out of memory");
        return;
    }
    for (size_t i = 0; i < h->n_tenants; i++) {
        const char *t = h->tenants[i];
        if (!pie_tenant_name_valid(t)) {
            put_fail(p, PIE_INVALID_ARGUMENT,
                     "header.tenants[%zu]: \"%.80s\" is not a tenant name ([a-z0-9_-], 1..%d "
                     "bytes, starting with a letter or digit)",
                     i, t, PIE_TENANT_NAME_MAX);
            return;
        }
        bool dup = false;
        for (size_t k = 0; k < p->n_tenants && !dup; k++) dup = strcmp(p->tenants[k], t) == 0;
        if (dup) continue;
        snprintf(p->tenants[p->n_tenants], sizeof p->tenants[0], "%s", t);
        p->tenant_ptrs[p->n_tenants] = p->tenants[p->n_tenants];
        p->n_tenants++;
    }
}

static void put_header(ctl_put *p, const Pie__V1__PutProgramHeader *h) {
    uint64_t max = p->c->program_max_bytes;
    size_t name_len = h->name ? strlen(h->name) : 0;
    if (!pie_sha256_is_hex(h->program_id))
        put_fail(p, PIE_INVALID_ARGUMENT,
                 "header.program_id: \"%.80s\" is not 64 lowercase hex digits (a SHA-256)",
                 h->program_id ? h->program_id : "");
    else if (h->size_bytes == 0)
        put_fail(p, PIE_INVALID_ARGUMENT, "header.size_bytes: 0, want at least 1");
    else if (h->size_bytes > max)
        put_fail(p, PIE_RESOURCE_EXHAUSTED,
                 "header.size_bytes: %llu is above the controller's programs.max_size of %llu",
                 (unsigned long long)h->size_bytes, (unsigned long long)max);
    else if (h->size_bytes > ctl_registry_program_bytes_max(p->c->reg))
        put_fail(p, PIE_RESOURCE_EXHAUSTED,
                 "header.size_bytes: %llu is above the controller's program registry size "
                 "(programs.registry_size = %llu bytes)",
                 (unsigned long long)h->size_bytes,
                 (unsigned long long)ctl_registry_program_bytes_max(p->c->reg));
    else if (name_len > CTL_PROGRAM_NAME_MAX)
        put_fail(p, PIE_INVALID_ARGUMENT, "header.name: %zu bytes, want at most %d", name_len,
                 CTL_PROGRAM_NAME_MAX);
    else
        put_tenants(p, h);
    if (p->failed) return;
    p->have_header = true;
    p->size = h->size_bytes;
    snprintf(p->id, sizeof p->id, "%s", h->program_id);
    snprintf(p->name, sizeof p->name, "%s", h->name ? h->name : "");
}

static bool put_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    (void)req;
    ctl_put *p = calloc(1, sizeof *p);
    if (p == NULL) {
        rpc_call_finish(call, PIE_RESOURCE_EXHAUSTED, "controller: out of memory");
        return false;
    }
    p->c = user;
    p->call = call;
    rpc_call_set_data(call, p);
    return false;
}

static bool put_on_message(rpc_call *call, ProtobufCMessage *msg, void *user) {
    (void)user;
    ctl_put *p = rpc_call_get_data(call);
    const Pie__V1__PutProgramRequest *r = (const Pie__V1__PutProgramRequest *)msg;
    if (p == NULL || p->failed) return false;
    if (!p->have_header) {
        if (r->part_case != PIE__V1__PUT_PROGRAM_REQUEST__PART_HEADER)
            put_fail(p, PIE_INVALID_ARGUMENT, "the first message must carry the header");
        else
            put_header(p, r->header);
    } else if (r->part_case != PIE__V1__PUT_PROGRAM_REQUEST__PART_CHUNK) {
        put_fail(p, PIE_INVALID_ARGUMENT, "header: only the first message carries it");
    } else if (r->chunk.len == 0 || r->chunk.len > CTL_CHUNK_MAX) {
        put_fail(p, PIE_INVALID_ARGUMENT, "chunk: %zu bytes, want 1..%u", r->chunk.len,
                 CTL_CHUNK_MAX);
    } else if (p->got + r->chunk.len > p->size) {
        put_fail(p, PIE_INVALID_ARGUMENT,
                 "chunk: the chunks add up to more than header.size_bytes (%llu)",
                 (unsigned long long)p->size);
    } else if (p->buf == NULL && (p->buf = malloc(p->size)) == NULL) {
        put_fail(p, PIE_RESOURCE_EXHAUSTED, "header.size_bytes: cannot allocate %llu",
                 (unsigned long long)p->size);
    } else {
        memcpy(p->buf + p->got, r->chunk.data, r->chunk.len);
        p->got += r->chunk.len;
    }
    return false;
}

/* A stream of the header alone: add header.tenants to a program the registry holds. */
static void put_hold(ctl_put *p) {
    pie_status st;
    if (ctl_registry_program_hold(p->c->reg, p->id, p->tenant_ptrs, p->n_tenants, &st) != PIE_OK) {
        put_fail(p, st.code, "%s", st.msg);
        return;
    }
    Pie__V1__PutProgramResponse r = PIE__V1__PUT_PROGRAM_RESPONSE__INIT;
    r.already_stored = true;
    rpc_call_reply(p->call, &r.base);
}

/* Hashing a program of up to programs.max_size takes too long for a completion-queue thread:
 * the last part of a put runs on a thread of its own. */
static void *put_finish_thread(void *arg) {
    ctl_put *p = arg;
    ctl_cluster *c = p->c;
    pie_status st;
    pie_status_ok(&st);
    char sha[65];
    bool already = false;
    if (pie_sha256_hex(p->buf, p->size, sha, &st) == PIE_OK && strcmp(sha, p->id) != 0)
        pie_status_set(&st, PIE_INVALID_ARGUMENT,
                       "header.program_id: %s, but the bytes received hash to %s", p->id, sha);
    if (st.code == PIE_OK) {
        ctl_registry_program_put(c->reg, p->id, p->name, p->buf, p->size, p->tenant_ptrs,
                                 p->n_tenants, &already, &st);
        p->buf = NULL; /* taken */
    }
    if (st.code == PIE_OK) {
        Pie__V1__PutProgramResponse r = PIE__V1__PUT_PROGRAM_RESPONSE__INIT;
        r.already_stored = already;
        rpc_call_reply(p->call, &r.base);
    } else {
        pie_log_warn("ctl.registry.put_refused", "program=%s code=%s error=\"%s\"", p->id,
                     pie_code_name(st.code), st.msg);
        rpc_call_finish_status(p->call, &st);
    }
    rpc_call_unref(p->call);
    put_free(p);
    pthread_mutex_lock(&c->mu);
    if (--c->puts == 0) pthread_cond_broadcast(&c->put_cv);
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

static void put_on_half_close(rpc_call *call, void *user) {
    ctl_cluster *c = user;
    ctl_put *p = rpc_call_get_data(call);
    if (p == NULL || p->failed) return;
    if (!p->have_header) {
        put_fail(p, PIE_INVALID_ARGUMENT, "no header: the stream was empty");
        return;
    }
    if (p->got == 0) {
        put_hold(p);
        return;
    }
    if (p->got != p->size) {
        put_fail(p, PIE_INVALID_ARGUMENT, "chunk: received %llu bytes, header.size_bytes says %llu",
                 (unsigned long long)p->got, (unsigned long long)p->size);
        return;
    }
    rpc_call_set_data(call, NULL); /* the thread owns p now */
    rpc_call_ref(call);
    pthread_mutex_lock(&c->mu);
    c->puts++;
    pthread_mutex_unlock(&c->mu);
    pthread_t t;
    pthread_attr_t attr;
    int err = pthread_attr_init(&attr);
    if (err == 0) {
        err = pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (err == 0) err = pthread_create(&t, &attr, put_finish_thread, p);
        pthread_attr_destroy(&attr);
    }
    if (err != 0) {
        rpc_call_set_data(call, p);
        put_fail(p, PIE_RESOURCE_EXHAUSTED, "PutProgram: cannot start a thread: %s", strerror(err));
        rpc_call_unref(call);
        pthread_mutex_lock(&c->mu);
        if (--c->puts == 0) pthread_cond_broadcast(&c->put_cv);
        pthread_mutex_unlock(&c->mu);
    }
}

static void put_on_done(rpc_call *call, void *user) {
    (void)user;
    ctl_put *p = rpc_call_get_data(call);
    if (p == NULL) return;
    put_free(p);
    rpc_call_set_data(call, NULL);
}

/* ---- lifecycle ----------------------------------------------------------------------------- */

/* Metrics collector: the gauges sampled at scrape time, under the core's lock. */
static void sample_metrics(void *arg) {
    ctl_cluster *c = arg;
    pthread_mutex_lock(&c->mu);
    ctl_core_sample_metrics(c->core);
    pthread_mutex_unlock(&c->mu);
}

ctl_cluster *ctl_cluster_create(const ctl_cluster_config *cfg, pie_metrics *metrics,
                                pie_status *st) {
    ctl_cluster *c = calloc(1, sizeof *c);
    if (c == NULL) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "controller: out of memory");
        return NULL;
    }
    pthread_condattr_t ca;
    bool mu_ok = pthread_mutex_init(&c->mu, NULL) == 0;
    bool cv_ok = pthread_condattr_init(&ca) == 0;
    if (cv_ok) {
        cv_ok = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC) == 0 &&
                pthread_cond_init(&c->cv, &ca) == 0;
        pthread_condattr_destroy(&ca);
    }
    bool put_ok = cv_ok && pthread_cond_init(&c->put_cv, NULL) == 0;
    if (!mu_ok || !cv_ok || !put_ok) {
        if (cv_ok) pthread_cond_destroy(&c->cv);
        if (mu_ok) pthread_mutex_destroy(&c->mu);
        free(c);
        pie_status_set(st, PIE_INTERNAL,
                       "controller: cannot create its mutex / condition variable");
        return NULL;
    }
    ctl_sink sink = {.to_replica = sink_replica, .to_worker = sink_worker, .end_link = sink_end};
    c->program_max_bytes = cfg->program_max_bytes;
    c->reg = ctl_registry_create(cfg->registry_bytes, metrics, st);
    c->core = c->reg ? ctl_core_create(&cfg->core, &sink, metrics, st) : NULL;
    if (c->core == NULL) {
        ctl_registry_destroy(c->reg);
        pthread_cond_destroy(&c->put_cv);
        pthread_cond_destroy(&c->cv);
        pthread_mutex_destroy(&c->mu);
        free(c);
        return NULL;
    }
    if (metrics && pie_metrics_add_collector(metrics, sample_metrics, c, st) != PIE_OK) {
        ctl_cluster_destroy(c);
        return NULL;
    }
    if (pthread_create(&c->timer, NULL, timer_main, c) != 0) {
        ctl_cluster_destroy(c);
        pie_status_set(st, PIE_INTERNAL, "controller: cannot start its timer thread");
        return NULL;
    }
    c->timer_started = true;
    c->methods[0] = (rpc_method){
        .path = "/pie.v1.Controller/WorkerLink",
        .kind = RPC_BIDI,
        .request = &pie__v1__worker_up__descriptor,
        .response = &pie__v1__worker_down__descriptor,
        .on_call = stream_on_call,
        .on_message = worker_on_message,
        .on_half_close = stream_on_half_close,
        .on_done = worker_on_done,
        .user = c,
    };
    c->methods[1] = (rpc_method){
        .path = "/pie.v1.Controller/Session",
        .kind = RPC_BIDI,
        .request = &pie__v1__session_up__descriptor,
        .response = &pie__v1__session_down__descriptor,
        .on_call = stream_on_call,
        .on_message = session_on_message,
        .on_half_close = stream_on_half_close,
        .on_done = session_on_done,
        .user = c,
    };
    c->methods[2] = (rpc_method){
        .path = "/pie.v1.Controller/ClusterStatus",
        .kind = RPC_UNARY,
        .request = &pie__v1__cluster_status_request__descriptor,
        .response = &pie__v1__cluster_status_response__descriptor,
        .on_call = status_on_call,
        .user = c,
    };
    c->methods[3] = (rpc_method){
        .path = "/pie.v1.Controller/GetTokenizer",
        .kind = RPC_UNARY,
        .request = &pie__v1__get_tokenizer_request__descriptor,
        .response = &pie__v1__get_tokenizer_response__descriptor,
        .on_call = get_tokenizer_on_call,
        .user = c,
    };
    c->methods[4] = (rpc_method){
        .path = "/pie.v1.Controller/PutProgram",
        .kind = RPC_CLIENT_STREAM,
        .request = &pie__v1__put_program_request__descriptor,
        .response = &pie__v1__put_program_response__descriptor,
        .on_call = put_on_call,
        .on_message = put_on_message,
        .on_half_close = put_on_half_close,
        .on_done = put_on_done,
        .user = c,
    };
    c->methods[5] = (rpc_method){
        .path = "/pie.v1.Controller/GetProgram",
        .kind = RPC_UNARY,
        .request = &pie__v1__get_program_request__descriptor,
        .response = &pie__v1__get_program_response__descriptor,
        .on_call = get_program_on_call,
        .user = c,
    };
    c->methods[6] = (rpc_method){
        .path = "/pie.v1.Controller/DropProgram",
        .kind = RPC_UNARY,
        .request = &pie__v1__drop_program_request__descriptor,
        .response = &pie__v1__drop_program_response__descriptor,
        .on_call = drop_program_on_call,
        .user = c,
    };
    c->methods[7] = (rpc_method){
        .path = "/pie.v1.Controller/ListTenantExports",
        .kind = RPC_UNARY,
        .request = &pie__v1__list_tenant_exports_request__descriptor,
        .response = &pie__v1__list_tenant_exports_response__descriptor,
        .on_call = list_exports_on_call,
        .user = c,
    };
    c->methods[8] = (rpc_method){
        .path = "/pie.v1.Controller/DeleteTenantExport",
        .kind = RPC_UNARY,
        .request = &pie__v1__delete_tenant_export_request__descriptor,
        .response = &pie__v1__delete_tenant_export_response__descriptor,
        .on_call = delete_export_on_call,
        .user = c,
    };
    return c;
}

uint32_t ctl_cluster_drain(ctl_cluster *c, const char *reason, int64_t timeout_ms) {
    const int64_t deadline = rpc_now_ns() + timeout_ms * 1000000;
    pthread_mutex_lock(&c->mu);
    ctl_core_drain(c->core, reason, rpc_now_ns());
    kick_timer(c);
    uint32_t out = ctl_core_steps_out(c->core);
    /* Results arrive on the completion-queue thread, which needs the mutex: poll (shutdown
     * only, so a 1 ms period costs nothing that matters). */
    while (out > 0 && rpc_now_ns() < deadline) {
        pthread_mutex_unlock(&c->mu);
        struct timespec ts = {.tv_sec = 0, .tv_nsec = 1000000};
        nanosleep(&ts, NULL);
        pthread_mutex_lock(&c->mu);
        out = ctl_core_steps_out(c->core);
    }
    ctl_core_end_worker_links(c->core, "controller shutting down (drained)");
    pthread_mutex_unlock(&c->mu);
    return out;
}

const rpc_method *ctl_cluster_methods(ctl_cluster *c, size_t *n) {
    *n = sizeof c->methods / sizeof c->methods[0];
    return c->methods;
}

void ctl_cluster_destroy(ctl_cluster *c) {
    if (c == NULL) return;
    pthread_mutex_lock(&c->mu);
    while (c->puts > 0) pthread_cond_wait(&c->put_cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
    if (c->timer_started) {
        pthread_mutex_lock(&c->mu);
        c->stop = true;
        pthread_cond_signal(&c->cv);
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->timer, NULL);
    }
    ctl_core_destroy(c->core);
    ctl_registry_destroy(c->reg);
    pthread_cond_destroy(&c->put_cv);
    pthread_cond_destroy(&c->cv);
    pthread_mutex_destroy(&c->mu);
    free(c);
}
