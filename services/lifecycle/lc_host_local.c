/* lc_host_local.c — the `pie` calls answered inside the lifecycle process: runtime (last_error,
 * instance_id, send, receive), models and traits (a snapshot of the Session's ModelsChanged),
 * the tokenizer (lc_tokreg), subscription_receive, and http_request (lc_http's pool).
 *
 * None of these leave the process except HTTP, which runs on lc_http's threads and resolves a
 * future. Does not own: futures and inboxes (lc_host.c), the calls to the controller
 * (lc_host_ctl.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lc_host_int.h"

/* ---- the models snapshot ---------------------------------------------------------------------- */

static void model_free(lc_model *m) {
    free(m->name);
    free(m->traits);
    free(m->stop_ids);
}

void lc_host_models_free(lc_host *h) {
    for (size_t i = 0; i < h->n_models; i++) model_free(&h->models[i]);
    free(h->models);
    h->models = NULL;
    h->n_models = 0;
}

static bool model_copy(lc_model *d, const Pie__V1__ModelInfo *s) {
    *d = (lc_model){0};
    const Pie__V1__TokenizerInfo *t = s->tokenizer;
    size_t tl = 0;
    for (size_t i = 0; i < s->n_traits; i++) tl += strlen(s->traits[i]) + 1;
    d->name = strdup(s->name);
    d->traits = malloc(tl + 1);
    size_t ns = t ? t->n_stop_token_ids : 0;
    d->stop_ids = malloc((ns ? ns : 1) * sizeof *d->stop_ids);
    if (!d->name || !d->traits || !d->stop_ids) {
        model_free(d);
        return false;
    }
    char *w = d->traits;
    for (size_t i = 0; i < s->n_traits; i++) {
        if (i) *w++ = '\n';
        size_t n = strlen(s->traits[i]);
        memcpy(w, s->traits[i], n);
        w += n;
    }
    *w = '\0';
    d->traits_len = (size_t)(w - d->traits);
    if (ns) memcpy(d->stop_ids, t->stop_token_ids, ns * sizeof *d->stop_ids);
    d->info = (pie_abi_model_info){
        .vocab_size = s->vocab_size,
        .num_tokens = t ? t->num_tokens : 0,
        .kv_page_size = s->kv_page_size,
        .max_context_tokens = s->max_context_tokens,
        .max_forward_tokens = s->max_forward_tokens,
        .default_top_k = s->default_top_k,
        .max_top_k = s->max_top_k,
        .bos_token_id = t ? t->bos_token_id : 0,
        .has_bos_token = t && t->has_bos_token ? 1 : 0,
        .n_stop_tokens = (uint32_t)ns,
        .num_layers = s->num_layers,
        .hidden_size = s->hidden_size,
        .num_heads = s->num_heads,
        .num_kv_heads = s->num_kv_heads,
        .head_dim = s->head_dim,
    };
    snprintf(d->tok_sha, sizeof d->tok_sha, "%s", t && t->tokenizer_sha256 ? t->tokenizer_sha256 : "");
    return true;
}

typedef struct snap {
    lc_model *v;
    size_t n;
    bool ok;
} snap;

static void snap_fill(void *ctx, const Pie__V1__ModelsChanged *mc) {
    snap *s = ctx;
    s->ok = true;
    if (mc == NULL || mc->n_models == 0) return;
    s->v = calloc(mc->n_models, sizeof *s->v);
    s->ok = s->v != NULL;
    for (size_t i = 0; s->ok && i < mc->n_models; i++) {
        s->ok = model_copy(&s->v[i], mc->models[i]);
        if (s->ok) s->n++;
    }
}

/* Brings the snapshot up to date (under models_mu). */
static void models_refresh(lc_host *h) {
    uint64_t gen = lc_session_models_gen(h->session);
    if (gen == h->models_gen) return;
    snap s = {0};
    gen = lc_session_models_visit(h->session, snap_fill, &s);
    if (!s.ok) { /* out of memory: keep the old snapshot, try again next time */
        for (size_t i = 0; i < s.n; i++) model_free(&s.v[i]);
        free(s.v);
        return;
    }
    lc_host_models_free(h);
    h->models = s.v;
    h->n_models = s.n;
    h->models_gen = gen;
}

/* The model named (len 0: the instance's default) in the snapshot (under models_mu). */
static const lc_model *model_find(lc_host_inst *hi, const char *name, size_t len) {
    lc_host *h = hi->h;
    models_refresh(h);
    if (len == 0) {
        name = hi->model;
        len = strlen(hi->model);
    }
    for (size_t i = 0; i < h->n_models; i++)
        if (strlen(h->models[i].name) == len && memcmp(h->models[i].name, name, len) == 0)
            return &h->models[i];
    return NULL;
}

bool lc_host_model(lc_host_inst *hi, const char *name, size_t len, pie_abi_model_info *info,
                   char *name_out) {
    pthread_mutex_lock(&hi->h->models_mu);
    const lc_model *m = model_find(hi, name, len);
    if (m) {
        if (info) *info = m->info;
        if (name_out) snprintf(name_out, 130, "%s", m->name);
    }
    pthread_mutex_unlock(&hi->h->models_mu);
    return m != NULL;
}

static uint32_t unknown_model(lc_host_inst *hi, const char *fn, const char *name, uint32_t len) {
    if (len == 0)
        return lc_host_fail(hi, PIE_NOT_FOUND, "%s: the default model \"%s\" is not served now",
                            fn, hi->model);
    return lc_host_fail(hi, PIE_NOT_FOUND, "%s: model \"%.*s\" is not served by this cluster", fn,
                        len > 128 ? 128 : (int)len, name);
}

/* The model's tokenizer, or NULL with *rc set. */
static const tok *model_tok(lc_host_inst *hi, lc_wasm_instance *inst, const char *fn,
                            uint32_t model, uint32_t model_len, uint32_t *rc) {
    const char *name = lc_host_mem(inst, fn, model, model_len);
    lc_host *h = hi->h;
    char key[130], sha[65];
    if (model_len > 128) {
        *rc = unknown_model(hi, fn, name, model_len);
        return NULL;
    }
    memcpy(key, name, model_len);
    key[model_len] = '\0';
    uint64_t gen = lc_session_models_gen(h->session);
    if (hi->tok_cache && hi->tok_cache_gen == gen && strcmp(hi->tok_cache_model, key) == 0)
        return hi->tok_cache; /* the common case: no lock at all */
    pthread_mutex_lock(&h->models_mu);
    const lc_model *m = model_find(hi, name, model_len);
    if (m) snprintf(sha, sizeof sha, "%s", m->tok_sha);
    gen = h->models_gen;
    pthread_mutex_unlock(&h->models_mu);
    if (m == NULL) {
        *rc = unknown_model(hi, fn, name, model_len);
        return NULL;
    }
    const tok *t = NULL;
    pie_status st;
    if (lc_tokreg_get(h->tokreg, sha, &t, &st) != PIE_OK) {
        *rc = lc_host_fail(hi, st.code, "%s: model \"%s\": %s", fn, key[0] ? key : hi->model,
                           st.msg);
        return NULL;
    }
    hi->tok_cache = t;
    hi->tok_cache_gen = gen;
    snprintf(hi->tok_cache_model, sizeof hi->tok_cache_model, "%s", key);
    return t;
}

/* ---- runtime ---------------------------------------------------------------------------------- */

static lc_host_inst *enter(Zpi *pie, lc_wasm_instance **inst) {
    *inst = lc_wasm_host_enter(pie);
    lc_host_inst *hi = pie->host;
    atomic_fetch_add(&hi->api_calls, 1);
    lc_host_scratch_reset(hi);
    return hi;
}

uint32_t Z_pieZ_last_error(Zpi *pie, uint32_t buf, uint32_t cap) {
    lc_wasm_instance *inst;
    lc_host_inst *hi = enter(pie, &inst);
    return lc_host_out(hi, inst, "last_error", buf, cap, hi->last_error, strlen(hi->last_error));
}

uint64_t Z_pieZ_instance_id(Zpi *pie) {
    lc_wasm_instance *inst;
    return enter(pie, &inst)->id;
}

uint32_t Z_pieZ_send(Zpi *pie, uint32_t msg, uint32_t len) {
    lc_wasm_instance *inst;
    lc_host_inst *hi = enter(pie, &inst);
    const void *p = lc_host_mem(inst, "send", msg, len);
    if (len > hi->limits.message_bytes)
        return lc_host_fail(hi, PIE_INVALID_ARGUMENT,
                            "send: message of %u bytes exceeds the instance's message_bytes limit "
                            "%llu",
                            len, (unsigned long long)hi->limits.message_bytes);
    if (hi->cb.send) hi->cb.send(hi->cb.ctx, p, len);
    return 0;
}

/* receive / subscription_receive: arm f on an inbox. */
static uint32_t inbox_arm(Zpi *pie, const char *fn, bool subs, uint32_t f) {
    lc_wasm_instance *inst;
    lc_host_inst *hi = enter(pie, &inst);
    if (f == 0) return lc_host_fail(hi, PIE_INVALID_ARGUMENT, "%s: future id 0 is reserved", fn);
    pthread_mutex_lock(&hi->mu);
    bool busy = pie_map64_get(&hi->futures, f) != NULL;
    uint32_t rc = busy ? 0
                       : lc_host_inbox_arm(hi, subs ? &hi->subs : &hi->inbox, f,
                                           subs ? LC_FUT_SUBSCRIPTION : LC_FUT_RECEIVE,
                                           !subs && hi->input_closed);
    pthread_mutex_unlock(&hi->mu);
    if (busy)
        return lc_host_fail(hi, PIE_ALREADY_EXISTS,
                            "%s: future %u is busy (consume it with future_result or drop it)", fn,
                            f);
    return rc;
}

uint32_t Z_pieZ_receive(Zpi *pie, uint32_t f) { return inbox_arm(pie, "receive", false, f); }

uint32_t Z_pieZ_subscription_receive(Zpi *pie, uint32_t f) {
    return inbox_arm(pie, "subscription_receive", true, f);
}

/* ---- models and traits ------------------------------------------------------------------------ */

uint32_t Z_pieZ_model_count(Zpi *pie) {
    lc_wasm_instance *inst;
    lc_host_inst *hi = enter(pie, &inst);
    pthread_mutex_lock(&hi->h->models_mu);
    models_refresh(hi->h);
    size_t n = hi->h->n_models;
    pthread_mutex_unlock(&hi->h->models_mu);
    return (uint32_t)n;
}

uint32_t Z_pieZ_model_name(Zpi *pie, uint32_t i, uint32_t buf, uint32_t cap) {
    lc_wasm_instance *inst;
    lc_host_inst *hi = enter(pie, &inst);
    lc_host_mem(inst, "model_name", buf, cap);
    char name[130] = "";
    pthread_mutex_lock(&hi->h->models_mu);
    models_refresh(hi->h);
    size_t n = hi->h->n_models;
    if (i < n) snprintf(name, sizeof name, "%s", hi->h->models[i].name);
    pthread_mutex_unlock(&hi->h->models_mu);
    if (i >= n)
        return lc_host_fail(hi, PIE_OUT_OF_RANGE, "model_name: index %u is not below %zu models",
                            i, n);
    return lc_host_out(hi, inst, "model_name", buf, cap, name, strlen(name));
}

uint32_t Z_pieZ_model_info(Zpi *pie, uint32_t model, uint32_t model_len, uint32_t info) {
    lc_wasm_instance *inst;
    lc_host_inst *hi = enter(pie, &inst);
    const char *name = lc_host_mem(inst, "model_info", model, model_len);
    void *dst = lc_host_mem(inst, "model_info", info, sizeof(pie_abi_model_info));
    pie_abi_model_info mi;
    if (!lc_host_model(hi, name, model_len, &mi, NULL))
        return unknown_model(hi, "model_info", name, model_len);
    memcpy(dst, &mi, sizeof mi);
    return 0;
}

uint32_t Z_pieZ_model_traits(Zpi *pie, uint32_t model, uint32_t model_len, uint32_t buf,
                             uint32_t cap) {
    lc_wasm_instance *inst;
    lc_host_inst *hi = enter(pie, &inst);
    const char *fn = "model_traits";
    const char *name = lc_host_mem(inst, fn, model, model_len);
    uint8_t *dst = lc_host_mem(inst, fn, buf, cap);
    pthread_mutex_lock(&hi->h->models_mu);
    const lc_model *m = model_find(hi, name, model_len);
    size_t len = m ? m->traits_len : 0;
    if (m && len) memcpy(dst, m->traits, len < cap ? len : cap);
    pthread_mutex_unlock(&hi->h->models_mu);
    if (m == NULL) return unknown_model(hi, fn, name, model_len);
    return (uint32_t)len;
}

uint32_t Z_pieZ_model_stop_tokens(Zpi *pie, uint32_t model, uint32_t model_len, uint32_t ids,
                                  uint32_t cap) {
    lc_wasm_instance *inst;
    lc_host_inst *hi = enter(pie, &inst);
    const char *fn = "model_stop_tokens";
    const char *name = lc_host_mem(inst, fn, model, model_len);
    uint8_t *dst = lc_host_mem(inst, fn, ids, (uint64_t)cap * 4);
    pthread_mutex_lock(&hi->h->models_mu);
    const lc_model *m = model_find(hi, name, model_len);
    uint32_t n = m ? m->info.n_stop_tokens : 0;
    if (m && n) memcpy(dst, m->stop_ids, (size_t)(n < cap ? n : cap) * 4);
    pthread_mutex_unlock(&hi->h->models_mu);
    if (m == NULL) return unknown_model(hi, fn, name, model_len);
    return n;
}

/* ---- tokenizer -------------------------------------------------------------------------------- */

uint32_t Z_pieZ_tokenize(Zpi *pie, uint32_t model, uint32_t model_len, uint32_t text,
                         uint32_t text_len, uint32_t allow_special, uint32_t ids, uint32_t cap) {
    lc_wasm_instance *inst;
    lc_host_inst *hi = enter(pie, &inst);
    const char *fn = "tokenize";
    const char *s = lc_host_mem(inst, fn, text, text_len);
    uint8_t *dst = lc_host_mem(inst, fn, ids, (uint64_t)cap * 4);
    uint32_t rc;
    const tok *t = model_tok(hi, inst, fn, model, model_len, &rc);
    if (t == NULL) return rc;
    uint32_t *v = NULL;
    size_t n = 0;
    pie_status st;
    if (tok_encode(t, s, text_len, allow_special != 0, &v, &n, &st) != PIE_OK)
        return lc_host_fail(hi, st.code, "%s: %s", fn, st.msg);
    if (n) memcpy(dst, v, (n < cap ? n : cap) * 4);
    free(v);
    return (uint32_t)n;
}

uint32_t Z_pieZ_detokenize(Zpi *pie, uint32_t model, uint32_t model_len, uint32_t ids,
                           uint32_t n, uint32_t buf, uint32_t cap) {
    lc_wasm_instance *inst;
    lc_host_inst *hi = enter(pie, &inst);
    const char *fn = "detokenize";
    uint32_t *v = lc_host_u32s(hi, inst, fn, ids, n);
    lc_host_mem(inst, fn, buf, cap);
    if (v == NULL) return lc_host_fail(hi, PIE_RESOURCE_EXHAUSTED, "%s: out of memory", fn);
    uint32_t rc;
    const tok *t = model_tok(hi, inst, fn, model, model_len, &rc);
    if (t == NULL) return rc;
    char *out = NULL;
    size_t len = 0;
    pie_status st;
    if (tok_decode(t, v, n, &out, &len, &st) != PIE_OK)
        return lc_host_fail(hi, st.code, "%s: %s", fn, st.msg);
    rc = lc_host_out(hi, inst, fn, buf, cap, out, len);
    free(out);
    return rc;
}

uint32_t Z_pieZ_token_bytes(Zpi *pie, uint32_t model, uint32_t model_len, uint32_t id,
                            uint32_t buf, uint32_t cap) {
    lc_wasm_instance *inst;
    lc_host_inst *hi = enter(pie, &inst);
    const char *fn = "token_bytes";
    lc_host_mem(inst, fn, buf, cap);
    uint32_t rc;
    const tok *t = model_tok(hi, inst, fn, model, model_len, &rc);
    if (t == NULL) return rc;
    size_t len = 0;
    const uint8_t *b = tok_token_bytes(t, id, &len);
    if (b == NULL)
        return lc_host_fail(hi, PIE_OUT_OF_RANGE, "%s: token id %u is not in the vocabulary (%u)",
                            fn, id, tok_vocab_size(t));
    return lc_host_out(hi, inst, fn, buf, cap, b, len);
}

/* ---- outbound HTTP ---------------------------------------------------------------------------- */

#define LC_HTTP_INFLIGHT_MAX 16u /* per instance */

typedef struct http_ctx {
    lc_host_inst *hi; /* a reference */
    uint32_t fid;
    uint64_t serial;
} http_ctx;

static void http_done(void *ctx, pie_code code, const char *msg, uint8_t *payload, size_t len) {
    http_ctx *c = ctx;
    lc_host_inst *hi = c->hi;
    pthread_mutex_lock(&hi->mu);
    hi->http_inflight--;
    lc_future *f = pie_map64_get(&hi->futures, c->fid);
    if (f && f->serial == c->serial && !f->done)
        lc_host_future_resolve(hi, f, code, msg, payload, len);
    else
        free(payload);
    pthread_mutex_unlock(&hi->mu);
    lc_host_inst_unref(hi);
    free(c);
}

uint32_t Z_pieZ_http_request(Zpi *pie, uint32_t method, uint32_t method_len, uint32_t url,
                             uint32_t url_len, uint32_t headers, uint32_t headers_len,
                             uint32_t body, uint32_t body_len, uint32_t f) {
    lc_wasm_instance *inst;
    lc_host_inst *hi = enter(pie, &inst);
    const char *fn = "http_request";
    lc_http_request r = {
        .method = lc_host_mem(inst, fn, method, method_len),
        .method_len = method_len,
        .url = lc_host_mem(inst, fn, url, url_len),
        .url_len = url_len,
        .headers = lc_host_mem(inst, fn, headers, headers_len),
        .headers_len = headers_len,
        .body = lc_host_mem(inst, fn, body, body_len),
        .body_len = body_len,
        .tenant = hi->tenant,
    };
    if (f == 0) return lc_host_fail(hi, PIE_INVALID_ARGUMENT, "%s: future id 0 is reserved", fn);
    http_ctx *c = malloc(sizeof *c);
    if (c == NULL) return lc_host_fail(hi, PIE_RESOURCE_EXHAUSTED, "%s: out of memory", fn);
    pthread_mutex_lock(&hi->mu);
    bool busy = pie_map64_get(&hi->futures, f) != NULL;
    bool full = hi->http_inflight >= LC_HTTP_INFLIGHT_MAX;
    lc_future *fu = busy || full ? NULL : lc_host_future_arm(hi, f, LC_FUT_HTTP);
    if (fu) hi->http_inflight++;
    pthread_mutex_unlock(&hi->mu);
    if (fu == NULL) {
        free(c);
        if (busy)
            return lc_host_fail(hi, PIE_ALREADY_EXISTS,
                                "%s: future %u is busy (consume it with future_result or drop it)",
                                fn, f);
        if (full)
            return lc_host_fail(hi, PIE_RESOURCE_EXHAUSTED,
                                "%s: %u requests of this instance are already in flight", fn,
                                LC_HTTP_INFLIGHT_MAX);
        return lc_host_fail(hi, PIE_RESOURCE_EXHAUSTED, "%s: out of memory", fn);
    }
    *c = (http_ctx){.hi = hi, .fid = f, .serial = fu->serial};
    lc_host_inst_ref(hi);
    pie_status st;
    if (lc_http_submit(hi->h->http, &r, &hi->http_cancel, http_done, c, &st) != PIE_OK) {
        pthread_mutex_lock(&hi->mu);
        hi->http_inflight--;
        lc_future *x = pie_map64_del(&hi->futures, f);
        pthread_mutex_unlock(&hi->mu);
        free(x);
        free(c);
        lc_host_inst_unref(hi);
        return lc_host_fail(hi, st.code, "%s", st.msg);
    }
    return 0;
}
