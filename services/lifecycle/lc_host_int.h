/* lc_host_int.h — the structures behind lc_host.h, shared by the lc_host*.c files.
 *
 * Owns: the host and per-instance state layouts (their id maps are pie_map64, services/common),
 * and the helpers every `pie` function shares (argument checks, errors, staging calls, waits).
 * lc_host.c: host + instance lifetime, futures, results and events from the controller, the
 * function table. lc_host_ctl.c: the calls that go to the controller. lc_host_local.c: the calls
 * answered in-process (runtime, models, tokenizer, messaging, HTTP). */
#ifndef LC_HOST_INT_H
#define LC_HOST_INT_H

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "lc_host.h"
#include "lc_http.h"
#include "lc_tokreg.h"
#include "pie_abi.h"
#include "pie_check.h"
#include "pie_map64.h"

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the pie ABI's payloads are little-endian and copied as is: little-endian hosts only"
#endif

/* ---- u64 → pointer map (key 0 reserved; open addressing, backward-shift deletion) ----------- */

/* ---- models (a snapshot of the session's ModelsChanged, refreshed when it changes) ---------- */
typedef struct lc_model {
    char *name;
    pie_abi_model_info info;
    char *traits; /* '\n'-separated */
    size_t traits_len;
    uint32_t *stop_ids;
    char tok_sha[65];
} lc_model;

struct lc_host {
    lc_host_config cfg;
    char *http_allow, *tokenizer_path; /* copies behind cfg's pointers */
    lc_session *session;
    lc_tokreg *tokreg;
    bool own_tokreg; /* made from cfg.tokenizer_path (cfg.tokreg was NULL) */
    lc_http *http;
    pthread_mutex_t mu;        /* guards insts */
    pie_map64 insts;           /* instance id → lc_host_inst (a reference is taken by lookups) */
    pthread_mutex_t models_mu; /* guards the snapshot */
    lc_model *models;
    size_t n_models;
    uint64_t models_gen;
    pie_counter *c_terminated;
};

/* ---- futures and outstanding calls ------------------------------------------------------------
 */
enum { LC_FUT_CALL = 1, LC_FUT_RECEIVE, LC_FUT_SUBSCRIPTION, LC_FUT_HTTP };

typedef struct lc_future {
    uint32_t id;
    uint8_t kind;
    bool done;
    pie_code code;
    char *msg;        /* when failed */
    uint8_t *payload; /* when OK */
    size_t len;
    uint64_t serial; /* which arming: a result for an earlier arming of the same id is dropped */
} lc_future;

/* A call with a result (synchronize, import, list_exports, next_dist), until its result. */
typedef struct lc_call {
    uint32_t fid, queue, op, count;
    uint32_t bytes; /* its packed size, counted in pending_bytes until its result */
    uint64_t serial;
} lc_call;

/* A call without a result, until a later result on its queue proves it succeeded (results of a
 * queue arrive in issue order) or its error arrives. */
typedef struct lc_void_call {
    uint64_t call_id;
    uint32_t op, count;
    uint32_t bytes; /* its packed size, counted in pending_bytes until confirmed */
} lc_void_call;

typedef struct lc_queue {
    uint32_t id;
    bool live;                /* created here and neither destroyed nor refused */
    pie_abi_model_info model; /* of its model, for local checks */
    pie_code code;            /* first deferred error since the last synchronize */
    char *msg;
    lc_void_call *ring; /* outstanding void calls, ascending call ids */
    size_t head, n, cap;
} lc_queue;

/* A message waiting in an inbox (client messages, broadcasts). */
typedef struct lc_msg {
    struct lc_msg *next;
    size_t len;
    uint8_t data[];
} lc_msg;

typedef struct lc_inbox {
    lc_msg *head, *tail;
    size_t n, bytes;   /* queued messages and their payload bytes */
    uint32_t *waiters; /* armed futures waiting for the next message, FIFO */
    size_t n_waiters, cap_waiters;
} lc_inbox;

/* Per-call scratch memory for arguments copied out of linear memory (aligned, stable). */
typedef struct lc_arena_block {
    struct lc_arena_block *next;
    size_t used, cap;
    _Alignas(16) uint8_t data[];
} lc_arena_block;

struct lc_host_inst {
    lc_host *h;
    atomic_int refs;
    uint64_t id, epoch;
    char *program_id, *model;
    char tenant[PIE_TENANT_NAME_MAX + 1]; /* "" : the anonymous tenant (HTTP shares by it) */
    Pie__V1__ResourceLimits limits;
    lc_host_inst_cb cb;
    /* Instance thread only. */
    lc_session_stage stage;
    uint64_t next_call, next_serial;
    lc_arena_block *arena;
    char last_error[512];
    const tok *tok_cache; /* tokenizer of tok_cache_model at models generation tok_cache_gen */
    char tok_cache_model[130];
    uint64_t tok_cache_gen;
    atomic_uint_fast64_t api_calls;
    atomic_bool http_cancel;
    /* Set by on_down when its results woke the instance, cleared by the instance's next flush:
     * the session's sender counts such instances (lc_session_gather_add). */
    atomic_bool gather_woken;
    /* Guarded by mu. */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pie_map64 futures; /* id → lc_future */
    pie_map64 calls;   /* call id → lc_call */
    pie_map64 queues;  /* queue id → lc_queue (queue 0: calls that take no queue) */
    lc_inbox inbox, subs;
    bool input_closed;
    bool ended;      /* lc_host_inst_end ran */
    bool terminated; /* the controller ended it or the Session was lost: no InstanceEnd */
    bool closed;     /* lc_host_inst_free ran: no more callbacks */
    unsigned cb_busy;
    /* on_down applying results: lc_host_future_resolve only notes wake_due, and on_down wakes
     * the instance once, after unlocking mu (a thread woken under the lock would block on it). */
    bool defer_wake, wake_due;
    pie_code dead_code; /* terminated: why */
    char *dead_msg;
    uint32_t kv_pages, embeds, queues_held;
    uint32_t http_inflight;
    uint64_t subs_dropped;
    /* Packed bytes of its calls the controller has not answered yet (charged to the replica's
     * budget too): at most LC_MAX_PENDING_BYTES. */
    size_t pending_bytes;
};

/* ---- shared helpers (lc_host.c) ---------------------------------------------------------------
 */
/* Ids per call and name lengths: PIE_MAX_IDS and PIE_MAX_NAME_BYTES (pie_check.h). */
/* Host memory an instance can make the lifecycle hold, whatever it does: armed futures, and calls
 * without a result that are remembered until a later result on the same queue shows they
 * succeeded (to report their errors through synchronize). Beyond these a call fails with
 * RESOURCE_EXHAUSTED instead of growing the host. */
#define LC_MAX_FUTURES    65536u
#define LC_MAX_UNANSWERED 1048576u /* per queue: 16 MiB of tracking */
/* Client messages queued for an inferlet that does not read them: a client that floods gets
 * RESOURCE_EXHAUSTED on its Attach/Run call instead of growing the host. */
#define LC_MAX_INBOX_MSGS  65536u
#define LC_MAX_INBOX_BYTES (64u << 20)
/* Broadcasts queued for a subscriber that does not read them: beyond either, dropped (counted
 * in subs_dropped). */
#define LC_MAX_SUBS_MSGS  4096u
#define LC_MAX_SUBS_BYTES (16u << 20)
/* Calls an instance has issued and the controller not yet answered, in packed bytes: a call
 * flood fails with RESOURCE_EXHAUSTED instead of growing the host. */
#define LC_MAX_PENDING_BYTES (16u << 20)

/* Gives back n pending call bytes (under mu). */
void lc_host_pending_release(lc_host_inst *hi, size_t n);

/* Records the message as last_error and returns -code as the wasm i32. */
uint32_t lc_host_fail(lc_host_inst *hi, pie_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Linear memory [addr, addr+len) or a trap naming fn. */
void *lc_host_mem(lc_wasm_instance *inst, const char *fn, uint32_t addr, uint64_t len);
/* n u32 values at addr copied to aligned scratch memory (valid until the next call). */
uint32_t *lc_host_u32s(lc_host_inst *hi, lc_wasm_instance *inst, const char *fn, uint32_t addr,
                       uint32_t n);
void *lc_host_scratch(lc_host_inst *hi, size_t bytes); /* NULL when out of memory */
void lc_host_scratch_reset(lc_host_inst *hi);
/* Writes min(len, cap) bytes to buf; returns len as the wasm i32 (checked for range first). */
uint32_t lc_host_out(lc_host_inst *hi, lc_wasm_instance *inst, const char *fn, uint32_t buf,
                     uint32_t cap, const void *data, size_t len);
/* Sends what the instance staged (before it waits); if the Session it began on is gone, the
 * instance is terminated with UNAVAILABLE. */
void lc_host_inst_flush(lc_host_inst *hi);
/* The model (empty = default) copied out of the snapshot; false if the cluster does not serve
 * it. name_out (may be NULL) gets the resolved name (130 bytes). */
bool lc_host_model(lc_host_inst *hi, const char *name, size_t len, pie_abi_model_info *info,
                   char *name_out);
/* Arms future fid of kind (under hi->mu, caller checked it is free); NULL when out of memory. */
lc_future *lc_host_future_arm(lc_host_inst *hi, uint32_t fid, uint8_t kind);
/* Resolves f (under hi->mu); takes payload, copies msg. */
void lc_host_future_resolve(lc_host_inst *hi, lc_future *f, pie_code code, const char *msg,
                            uint8_t *payload, size_t len);
/* Inbox delivery (under hi->mu): resolves the first waiter, else queues a copy. */
bool lc_host_inbox_put(lc_host_inst *hi, lc_inbox *b, const void *a, size_t alen, const void *m,
                       size_t mlen);
/* Arms fid on an inbox (under hi->mu). closed: resolve with OUT_OF_RANGE when empty. */
uint32_t lc_host_inbox_arm(lc_host_inst *hi, lc_inbox *b, uint32_t fid, uint8_t kind, bool closed);
void lc_host_inst_ref(lc_host_inst *hi);
void lc_host_inst_unref(lc_host_inst *hi);

/* lc_host_ctl.c: the ApiCall plumbing. */
/* Stages an ApiCall of kind op (a PIE__V1__API_CALL__OP_* value) on queue q whose message is msg
 * (the Pie__V1__<Op> of that kind). fid != 0: arms fid with LC_FUT_CALL and records op for the
 * result. count: the pages, embeddings or queues it holds, for the usage counters. Returns 0 or
 * -code. */
uint32_t lc_host_call(lc_host_inst *hi, const char *fn, uint32_t q, uint32_t op, void *msg,
                      uint32_t fid, uint32_t count);
/* Applies a CallResult (link thread, under hi->mu). */
void lc_host_call_result(lc_host_inst *hi, const Pie__V1__CallResult *r);
void lc_queue_free(lc_queue *q);

/* lc_host_local.c */
void lc_host_models_free(lc_host *h);

/* ---- the `pie` functions (wasm2c names; i32 → uint32_t, i64 → uint64_t, f32 → float) ------- */
typedef struct Z_pie_instance_t Zpi;
uint32_t Z_pieZ_last_error(Zpi *, uint32_t buf, uint32_t cap);
uint64_t Z_pieZ_instance_id(Zpi *);
uint32_t Z_pieZ_send(Zpi *, uint32_t msg, uint32_t len);
uint32_t Z_pieZ_receive(Zpi *, uint32_t f);
uint32_t Z_pieZ_future_poll(Zpi *, uint32_t f);
uint32_t Z_pieZ_future_wait(Zpi *, uint32_t f, uint64_t timeout_ms);
uint32_t Z_pieZ_future_wait_any(Zpi *, uint32_t ids, uint32_t n, uint64_t timeout_ms);
uint32_t Z_pieZ_future_result(Zpi *, uint32_t f, uint32_t buf, uint32_t cap);
uint32_t Z_pieZ_future_drop(Zpi *, uint32_t f);
uint32_t Z_pieZ_model_count(Zpi *);
uint32_t Z_pieZ_model_name(Zpi *, uint32_t i, uint32_t buf, uint32_t cap);
uint32_t Z_pieZ_model_info(Zpi *, uint32_t model, uint32_t model_len, uint32_t info);
uint32_t Z_pieZ_model_traits(Zpi *, uint32_t model, uint32_t model_len, uint32_t buf, uint32_t cap);
uint32_t Z_pieZ_model_stop_tokens(Zpi *, uint32_t model, uint32_t model_len, uint32_t ids,
                                  uint32_t cap);
uint32_t Z_pieZ_tokenize(Zpi *, uint32_t model, uint32_t model_len, uint32_t text,
                         uint32_t text_len, uint32_t allow_special, uint32_t ids, uint32_t cap);
uint32_t Z_pieZ_detokenize(Zpi *, uint32_t model, uint32_t model_len, uint32_t ids, uint32_t n,
                           uint32_t buf, uint32_t cap);
uint32_t Z_pieZ_token_bytes(Zpi *, uint32_t model, uint32_t model_len, uint32_t id, uint32_t buf,
                            uint32_t cap);
uint32_t Z_pieZ_create_queue(Zpi *, uint32_t q, uint32_t model, uint32_t model_len);
uint32_t Z_pieZ_destroy_queue(Zpi *, uint32_t q);
uint32_t Z_pieZ_set_queue_priority(Zpi *, uint32_t q, uint32_t priority);
uint32_t Z_pieZ_synchronize(Zpi *, uint32_t q, uint32_t f);
uint32_t Z_pieZ_alloc_kv_pages(Zpi *, uint32_t q, uint32_t ids, uint32_t n);
uint32_t Z_pieZ_dealloc_kv_pages(Zpi *, uint32_t q, uint32_t ids, uint32_t n);
uint32_t Z_pieZ_alloc_embeds(Zpi *, uint32_t q, uint32_t ids, uint32_t n);
uint32_t Z_pieZ_dealloc_embeds(Zpi *, uint32_t q, uint32_t ids, uint32_t n);
uint32_t Z_pieZ_copy_kv_page(Zpi *, uint32_t q, uint32_t src, uint32_t dst, uint32_t src_offset,
                             uint32_t dst_offset, uint32_t token_count);
uint32_t Z_pieZ_mask_kv_page(Zpi *, uint32_t q, uint32_t page, uint32_t masked, uint32_t n);
uint32_t Z_pieZ_export_kv_pages(Zpi *, uint32_t q, uint32_t ids, uint32_t n, uint32_t name,
                                uint32_t name_len, uint32_t persistent);
uint32_t Z_pieZ_unexport_kv_pages(Zpi *, uint32_t q, uint32_t name, uint32_t name_len);
uint32_t Z_pieZ_import_kv_pages(Zpi *, uint32_t q, uint32_t ids, uint32_t n, uint32_t name,
                                uint32_t name_len, uint32_t f);
uint32_t Z_pieZ_list_exports(Zpi *, uint32_t f);
uint32_t Z_pieZ_embed_text(Zpi *, uint32_t q, uint32_t embeds, uint32_t tokens, uint32_t positions,
                           uint32_t n);
uint32_t Z_pieZ_forward(Zpi *, uint32_t q, uint32_t desc);
uint32_t Z_pieZ_next_dist(Zpi *, uint32_t q, uint32_t embeds, uint32_t n, uint32_t top_k,
                          float temperature, uint32_t f);
uint32_t Z_pieZ_broadcast(Zpi *, uint32_t topic, uint32_t topic_len, uint32_t msg, uint32_t len);
uint32_t Z_pieZ_subscribe(Zpi *, uint32_t topic, uint32_t topic_len);
uint32_t Z_pieZ_unsubscribe(Zpi *, uint32_t topic, uint32_t topic_len);
uint32_t Z_pieZ_subscription_receive(Zpi *, uint32_t f);
uint32_t Z_pieZ_http_request(Zpi *, uint32_t method, uint32_t method_len, uint32_t url,
                             uint32_t url_len, uint32_t headers, uint32_t headers_len,
                             uint32_t body, uint32_t body_len, uint32_t f);

#endif
