/* ctl_place.c — see ctl_place.h. Also implements the WorkerLink entry points of ctl_core.h
 * (a worker group joins, reports, leaves). */
#include "ctl_core_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pie_log.h"

static void free_msg(void *m) {
    if (m) protobuf_c_message_free_unpacked((ProtobufCMessage *)m, NULL);
}

static uint64_t unix_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* ---- models ---------------------------------------------------------------------------------- */

uint32_t ctl_place_model(const ctl_core *c, const char *name) {
    for (uint32_t i = 0; i < c->n_models; i++)
        if (strcmp(c->models[i].name, name) == 0) return i;
    return UINT32_MAX;
}

bool ctl_place_served(const ctl_core *c, uint32_t model) {
    return model < c->n_models && c->models[model].workers > 0;
}

static Pie__V1__ModelInfo *model_copy(const Pie__V1__ModelInfo *m) {
    size_t n = protobuf_c_message_get_packed_size(&m->base);
    uint8_t *buf = malloc(n ? n : 1);
    if (buf == NULL) return NULL;
    protobuf_c_message_pack(&m->base, buf);
    Pie__V1__ModelInfo *copy = pie__v1__model_info__unpack(NULL, n, buf);
    free(buf);
    return copy;
}

static bool model_equal(const Pie__V1__ModelInfo *a, const Pie__V1__ModelInfo *b) {
    size_t na = protobuf_c_message_get_packed_size(&a->base);
    size_t nb = protobuf_c_message_get_packed_size(&b->base);
    if (na != nb) return false;
    uint8_t *x = malloc(na ? na : 1), *y = malloc(nb ? nb : 1);
    bool eq = false;
    if (x && y) {
        protobuf_c_message_pack(&a->base, x);
        protobuf_c_message_pack(&b->base, y);
        eq = memcmp(x, y, na) == 0;
    }
    free(x);
    free(y);
    return eq;
}

/* The first numeric field where two ModelInfos differ, for the refusal message. */
static void model_diff(const Pie__V1__ModelInfo *a, const Pie__V1__ModelInfo *b, char *out,
                       size_t n) {
    const struct {
        const char *name;
        uint32_t x, y;
    } f[] = {
        {"kv_page_size", a->kv_page_size, b->kv_page_size},
        {"vocab_size", a->vocab_size, b->vocab_size},
        {"max_context_tokens", a->max_context_tokens, b->max_context_tokens},
        {"max_forward_tokens", a->max_forward_tokens, b->max_forward_tokens},
        {"default_top_k", a->default_top_k, b->default_top_k},
        {"max_top_k", a->max_top_k, b->max_top_k},
        {"num_layers", a->num_layers, b->num_layers},
        {"hidden_size", a->hidden_size, b->hidden_size},
        {"num_heads", a->num_heads, b->num_heads},
        {"num_kv_heads", a->num_kv_heads, b->num_kv_heads},
        {"head_dim", a->head_dim, b->head_dim},
    };
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        if (f[i].x != f[i].y) {
            snprintf(out, n, "%s %u, not %u", f[i].name, f[i].x, f[i].y);
            return;
        }
    }
    if (strcmp(a->dtype, b->dtype) != 0) {
        snprintf(out, n, "dtype \"%s\", not \"%s\"", a->dtype, b->dtype);
        return;
    }
    snprintf(out, n, "its description, traits, architecture, tokenizer or chat template differ");
}

static bool valid_model_name(const char *s) {
    size_t n = strlen(s);
    if (n == 0 || n > 128) return false;
    for (size_t i = 0; i < n; i++) {
        char ch = s[i];
        bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                  (ch >= '0' && ch <= '9') || ch == '.' || ch == '_' || ch == '-';
        if (!ok) return false;
    }
    return true;
}

pie_code ctl_place_check_registration(ctl_core *c, const Pie__V1__WorkerRegistration *r,
                                      uint32_t *model_index, pie_status *st) {
    const char *p = "WorkerLink registration";
    size_t glen = r->group_id ? strlen(r->group_id) : 0;
    if (glen == 0 || glen > 253)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "%s: group_id must be 1..253 bytes, got %zu", p, glen);
    if (r->version == NULL || strncmp(r->version, "pie-c/0.", 8) != 0)
        return pie_status_set(st, PIE_FAILED_PRECONDITION,
                              "%s: version \"%s\" is not compatible with pie-c/0.x", p,
                              r->version ? r->version : "");
    for (ctl_worker *w = c->workers; w; w = w->next)
        if (strcmp(w->reg->group_id, r->group_id) == 0)
            return pie_status_set(st, PIE_ALREADY_EXISTS, "%s: group \"%s\" is already linked", p,
                                  r->group_id);
    const Pie__V1__ModelInfo *m = r->model;
    if (m == NULL) return pie_status_set(st, PIE_INVALID_ARGUMENT, "%s: model is missing", p);
    if (!valid_model_name(m->name))
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "%s: model.name \"%s\" must be 1..128 bytes of [A-Za-z0-9._-]", p,
                              m->name);
    if (m->kv_page_size == 0 || m->kv_page_size > 256)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "%s: model.kv_page_size %u is out of range [1, 256]", p,
                              m->kv_page_size);
    const Pie__V1__WorkerCapacity *cap = r->capacity;
    if (cap == NULL) return pie_status_set(st, PIE_INVALID_ARGUMENT, "%s: capacity is missing", p);
    if (cap->kv_pages_max == 0)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "%s: capacity.kv_pages_max is 0", p);
    if (cap->kv_pages_effective > cap->kv_pages_max)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "%s: capacity.kv_pages_effective %u exceeds kv_pages_max %u", p,
                              cap->kv_pages_effective, cap->kv_pages_max);
    if (cap->embed_slots == 0)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "%s: capacity.embed_slots is 0", p);
    if (cap->max_batch_items == 0 || cap->max_batch_tokens == 0)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "%s: capacity.max_batch_items (%u) and max_batch_tokens (%u) must be "
                              "at least 1",
                              p, cap->max_batch_items, cap->max_batch_tokens);
    if (r->tp_size == 0) return pie_status_set(st, PIE_INVALID_ARGUMENT, "%s: tp_size is 0", p);
    if (r->n_ranks != 0 && r->n_ranks != r->tp_size)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "%s: ranks lists %zu ranks for tp_size %u (it must list all or none)",
                              p, r->n_ranks, r->tp_size);
    for (size_t i = 0; i < r->n_ranks; i++)
        if (r->ranks[i]->rank != i)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "%s: ranks[%zu] is rank %u (the list must be in rank order)", p,
                                  i, r->ranks[i]->rank);
    uint32_t idx = ctl_place_model(c, m->name);
    if (idx != UINT32_MAX && c->models[idx].workers > 0 && !model_equal(c->models[idx].info, m)) {
        char diff[200];
        model_diff(m, c->models[idx].info, diff, sizeof diff);
        return pie_status_set(st, PIE_FAILED_PRECONDITION,
                              "%s: model \"%s\" differs from what the linked workers serve: %s", p,
                              m->name, diff);
    }
    if (idx == UINT32_MAX) {
        if (c->n_models == c->cap_models) {
            uint32_t ncap = c->cap_models ? c->cap_models * 2 : 4;
            ctl_model *v = realloc(c->models, ncap * sizeof *v);
            if (v == NULL) goto oom;
            c->models = v;
            c->cap_models = ncap;
        }
        ctl_model *nm = &c->models[c->n_models];
        memset(nm, 0, sizeof *nm);
        nm->name = strdup(m->name);
        nm->info = model_copy(m);
        if (!nm->name || !nm->info) {
            free(nm->name);
            free_msg(nm->info);
            goto oom;
        }
        idx = c->n_models++;
    } else if (c->models[idx].workers == 0) {
        /* Served again, maybe by a newer build: the new registration defines the model. */
        Pie__V1__ModelInfo *info = model_copy(m);
        if (info == NULL) goto oom;
        free_msg(c->models[idx].info);
        c->models[idx].info = info;
    }
    *model_index = idx;
    return PIE_OK;
oom:
    return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "controller: out of memory");
}

/* ---- placement ------------------------------------------------------------------------------- */

ctl_worker *ctl_place_choose(ctl_core *c, uint32_t model) {
    ctl_worker *best = NULL;
    for (ctl_worker *w = c->workers; w; w = w->next) {
        if (w->model != model || w->draining || w->leaving) continue;
        if (best == NULL) {
            best = w;
            continue;
        }
        /* Less loaded = smaller used / effective (cross-multiplied); then fewer instances. */
        uint64_t a =
            (uint64_t)w->pool.kv_used * (best->pool.kv_effective ? best->pool.kv_effective : 1);
        uint64_t b =
            (uint64_t)best->pool.kv_used * (w->pool.kv_effective ? w->pool.kv_effective : 1);
        if (w->pool.kv_effective == 0) continue;
        if (best->pool.kv_effective == 0 || a < b ||
            (a == b && (w->n_places < best->n_places ||
                        (w->n_places == best->n_places && w->index < best->index))))
            best = w;
    }
    return best;
}

ctl_place *ctl_place_of(const ctl_inst *inst, uint32_t model) {
    for (ctl_place *p = inst->places; p; p = p->inst_next)
        if (p->model == model) return p;
    return NULL;
}

ctl_place *ctl_place_add(ctl_core *c, ctl_inst *inst, uint32_t model, ctl_worker *w) {
    ctl_place *p = ctl_slab_get(&c->s_places);
    if (p == NULL) return NULL;
    memset(p, 0, sizeof *p);
    p->inst = inst;
    p->w = w;
    p->model = model;
    ctl_vspace_init(&p->vs, &w->pool, inst->id);
    p->inst_next = inst->places;
    inst->places = p;
    p->w_next = w->places;
    if (w->places) w->places->w_prev = p;
    w->places = p;
    w->n_places++;
    return p;
}

void ctl_place_release(ctl_core *c, ctl_place *p) {
    ctl_inst *inst = p->inst;
    ctl_inst_kv_add(inst, -(int64_t)p->vs.kv.n);
    inst->n_emb -= p->vs.emb.n < inst->n_emb ? p->vs.emb.n : inst->n_emb;
    ctl_vspace_release(&p->vs);
    ctl_worker *w = p->w;
    if (p->w_prev)
        p->w_prev->w_next = p->w_next;
    else
        w->places = p->w_next;
    if (p->w_next) p->w_next->w_prev = p->w_prev;
    w->n_places--;
    ctl_slab_put(&c->s_places, p);
    if (w->leaving && w->n_places == 0) ctl_core_retire_worker(c, w);
}

/* Objects of one kind a placement holds. */
static uint32_t held(const ctl_place *p, bool kv) { return kv ? p->vs.kv.n : p->vs.emb.n; }

/* A tenant's holdings on the worker being planned for. */
typedef struct plan_tenant {
    const ctl_tenant *t; /* NULL: the anonymous tenant */
    uint64_t held;
} plan_tenant;

static plan_tenant *plan_tenant_of(plan_tenant *v, size_t *n, const ctl_tenant *t) {
    for (size_t i = 0; i < *n; i++)
        if (v[i].t == t) return &v[i];
    v[*n] = (plan_tenant){.t = t};
    return &v[(*n)++];
}

/* A later instance that could be ended, with what it holds on the worker (an instance has one
 * placement per model, so one on the worker). */
typedef struct plan_cand {
    ctl_inst *inst;
    uint32_t held;
} plan_cand;

static int newest_first(const void *a, const void *b) {
    uint64_t x = ((const plan_cand *)a)->inst->launch, y = ((const plan_cand *)b)->inst->launch;
    return x < y ? 1 : x > y ? -1 : 0;
}

bool ctl_place_plan_victims(const ctl_worker *w, const ctl_inst *req, bool kv, uint32_t n,
                            uint32_t avail, ctl_inst ***out, size_t *n_out, uint64_t *holds,
                            bool *spared) {
    *out = NULL;
    *n_out = 0;
    *holds = 0;
    *spared = false;
    size_t places = 0;
    for (const ctl_place *p = w->places; p; p = p->w_next) places++;
    plan_cand *cand = malloc((places ? places : 1) * sizeof *cand);
    plan_tenant *tenants = malloc((places + 1) * sizeof *tenants);
    ctl_inst **victims = malloc((places ? places : 1) * sizeof *victims);
    if (cand == NULL || tenants == NULL || victims == NULL) {
        free(cand);
        free(tenants);
        free(victims);
        return false;
    }
    size_t n_cand = 0, n_tenants = 0;
    for (const ctl_place *p = w->places; p; p = p->w_next) {
        if (p->inst->dead) continue;
        plan_tenant_of(tenants, &n_tenants, p->inst->tenant)->held += held(p, kv);
        if (p->inst->launch > req->launch && held(p, kv) > 0)
            cand[n_cand++] = (plan_cand){.inst = p->inst, .held = held(p, kv)};
    }
    uint64_t would = plan_tenant_of(tenants, &n_tenants, req->tenant)->held + n;
    qsort(cand, n_cand, sizeof *cand, newest_first);
    size_t k = 0;
    for (size_t i = 0; i < n_cand && avail + *holds < n; i++) {
        plan_tenant *t = plan_tenant_of(tenants, &n_tenants, cand[i].inst->tenant);
        if (cand[i].inst->tenant != req->tenant && t->held < would) {
            *spared = true;
            continue;
        }
        victims[k++] = cand[i].inst;
        *holds += cand[i].held;
        t->held -= cand[i].held;
    }
    free(cand);
    free(tenants);
    *out = victims;
    *n_out = k;
    return true;
}

/* ---- WorkerLink entry points ----------------------------------------------------------------- */

ctl_worker *ctl_core_worker_join(ctl_core *c, void *link, Pie__V1__WorkerUp *reg_msg,
                                 int64_t now_ns, pie_status *st) {
    const Pie__V1__WorkerRegistration *r = reg_msg->registration;
    uint32_t model;
    if (ctl_place_check_registration(c, r, &model, st) != PIE_OK) return NULL;
    uint32_t index = 0;
    for (uint32_t i = 1; i <= 65535 && index == 0; i++) {
        bool used = false;
        for (ctl_worker *w = c->workers; w && !used; w = w->next) used = w->index == i;
        if (!used) index = i;
    }
    if (index == 0) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "controller: 65535 worker groups linked");
        return NULL;
    }
    ctl_worker *w = calloc(1, sizeof *w);
    if (w == NULL) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "controller: out of memory");
        return NULL;
    }
    const Pie__V1__WorkerCapacity *cap = r->capacity;
    if (ctl_pool_init(&w->pool, cap->kv_pages_max, cap->kv_pages_effective, cap->embed_slots, st) !=
        PIE_OK) {
        free(w);
        return NULL;
    }
    if (ctl_sched_init(&w->sched, &c->cfg.sched) != 0) {
        ctl_pool_destroy(&w->pool);
        free(w);
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "controller: out of memory");
        return NULL;
    }
    ctl_core_enter(c, now_ns);
    w->index = index;
    w->link = link;
    w->reg_msg = reg_msg;
    w->reg = r;
    w->model = model;
    w->connected_unix_ms = unix_ms();
    w->last_heard_ns = now_ns;
    w->max_items = cap->max_batch_items;
    w->max_tokens = cap->max_batch_tokens;
    w->defers = r->may_defer; /* this controller takes deferred items back whenever offered */
    w->next = c->workers;
    c->workers = w;
    c->models[model].workers++;
    Pie__V1__WorkerRegistered reg = PIE__V1__WORKER_REGISTERED__INIT;
    reg.worker_index = index;
    reg.version = "pie-c/0.1.0";
    reg.heartbeat_ms = c->cfg.heartbeat_ms;
    reg.defer_ok = w->defers;
    Pie__V1__WorkerDown down = PIE__V1__WORKER_DOWN__INIT;
    down.registered = &reg;
    c->sink.to_worker(c->sink.user, link, &down);
    ctl_core_announce_models(c, NULL, NULL);
    if (c->draining) ctl_core_drain_worker(c, w); /* it joined a controller shutting down */
    /* The registration message may already grant credits and report capacity or stats. */
    w->credits = reg_msg->credits > 1024 ? 1024 : reg_msg->credits;
    if (reg_msg->capacity && reg_msg->capacity->kv_pages_effective <= w->pool.kv_max)
        w->pool.kv_effective = reg_msg->capacity->kv_pages_effective;
    if (reg_msg->stats) {
        w->stats = reg_msg->stats;
        w->heard_stats = true;
    }
    pie_log_info("ctl.worker.registered",
                 "worker_index=%u group=%s model=%s kv_pages=%u embed_slots=%u max_items=%u "
                 "max_tokens=%u defers=%s",
                 index, r->group_id, r->model->name, cap->kv_pages_effective, cap->embed_slots,
                 cap->max_batch_items, cap->max_batch_tokens, w->defers ? "true" : "false");
    ctl_core_leave(c);
    return w;
}

void ctl_core_worker_up(ctl_core *c, ctl_worker *w, Pie__V1__WorkerUp *up, int64_t now_ns) {
    ctl_core_enter(c, now_ns);
    w->last_heard_ns = now_ns;
    bool keep = false;
    pie_status st;
    if (up->registration) {
        c->sink.end_link(c->sink.user, w->link, PIE_FAILED_PRECONDITION,
                         "WorkerLink: registration sent twice");
        goto out;
    }
    for (size_t i = 0; i < up->n_results; i++) {
        if (!ctl_exec_result(c, w, up->results[i], &st)) {
            pie_log_warn("ctl.worker.protocol", "worker_index=%u error=\"%s\"", w->index, st.msg);
            c->sink.end_link(c->sink.user, w->link, st.code, st.msg);
            goto out;
        }
    }
    if (up->credits) {
        uint64_t cr = (uint64_t)w->credits + up->credits;
        w->credits = cr > 1024 ? 1024 : (uint32_t)cr;
    }
    if (up->capacity) {
        uint32_t eff = up->capacity->kv_pages_effective;
        if (eff > w->pool.kv_max) {
            char msg[160];
            snprintf(msg, sizeof msg,
                     "WorkerLink: capacity.kv_pages_effective %u exceeds kv_pages_max %u", eff,
                     w->pool.kv_max);
            c->sink.end_link(c->sink.user, w->link, PIE_INVALID_ARGUMENT, msg);
            goto out;
        }
        w->pool.kv_effective = eff;
    }
    if (up->draining && !w->leaving) {
        w->leaving = true;
        pie_log_info("ctl.worker.leaving", "worker_index=%u group=%s instances=%u", w->index,
                     w->reg->group_id, w->n_places);
        if (w->n_places == 0) ctl_core_retire_worker(c, w);
    }
    if (up->stats) {
        free_msg(w->stats_msg);
        w->stats_msg = up;
        w->stats = up->stats;
        w->heard_stats = true;
        keep = true;
    }
out:
    ctl_exec_wake(c, w); /* queues whose results all came back: before dispatching */
    ctl_core_leave(c);   /* dispatches, then sends the results that point into up */
    if (!keep) free_msg(up);
}

void ctl_core_worker_leave(ctl_core *c, ctl_worker *w, const pie_status *why, int64_t now_ns) {
    ctl_core_enter(c, now_ns);
    for (ctl_worker **p = &c->workers; *p; p = &(*p)->next) {
        if (*p == w) {
            *p = w->next;
            break;
        }
    }
    const Pie__V1__WorkerRegistration *r = w->reg;
    char msg[PIE_STATUS_MSG_MAX + 600];
    if (w->leaving) /* it was draining: its server.shutdown_grace ran out */
        snprintf(msg, sizeof msg,
                 "worker %s (%s) shut down: the instance was still placed on it when the "
                 "worker's drain time (server.shutdown_grace) ran out",
                 r->group_id, r->model->name);
    else
        snprintf(msg, sizeof msg, "worker %s (%s) lost: %.400s", r->group_id, r->model->name,
                 why && why->msg[0] ? why->msg : "link ended");
    w->draining = true; /* its link is gone: nothing is sent to it (no Drain when it empties) */
    ctl_core_worker_gauges(c, w, true);
    uint32_t n_terminated = 0;
    while (w->places) {
        ctl_core_terminate(c, w->places->inst, PIE_UNAVAILABLE, msg);
        n_terminated++;
    }
    while (w->out) {
        ctl_batch *b = w->out;
        w->out = b->next;
        ctl_exec_batch_free(c, b);
    }
    w->out_tail = NULL;
    w->n_out = 0;
    w->steps_out = 0;
    ctl_exports_drop_pool(&c->exports, &w->pool);
    c->models[w->model].workers--;
    Pie__V1__Status status = PIE__V1__STATUS__INIT;
    status.code = why ? (uint32_t)why->code : PIE_UNAVAILABLE;
    status.message = (char *)(why && why->msg[0] ? why->msg : "link ended");
    Pie__V1__WorkerLost lost = PIE__V1__WORKER_LOST__INIT;
    lost.worker_index = w->index;
    lost.group_id = r->group_id;
    lost.model = r->model->name;
    lost.status = &status;
    Pie__V1__SessionEvent ev = PIE__V1__SESSION_EVENT__INIT;
    ev.event_case = PIE__V1__SESSION_EVENT__EVENT_WORKER_LOST;
    ev.worker_lost = &lost;
    /* The event and the strings it points to must outlive this function: copy into each
     * replica's arena. */
    for (ctl_replica *rep = c->replicas; rep; rep = rep->next) {
        Pie__V1__WorkerLost *wl = ctl_arena_alloc(&rep->arena, sizeof *wl);
        Pie__V1__Status *s = ctl_arena_alloc(&rep->arena, sizeof *s);
        char *g = ctl_arena_strdup(&rep->arena, r->group_id);
        char *mn = ctl_arena_strdup(&rep->arena, r->model->name);
        char *sm = ctl_arena_strdup(&rep->arena, status.message);
        if (!wl || !s || !g || !mn || !sm) continue;
        *s = status;
        s->message = sm;
        *wl = lost;
        wl->group_id = g;
        wl->model = mn;
        wl->status = s;
        Pie__V1__SessionEvent e = ev;
        e.worker_lost = wl;
        ctl_core_announce_models(c, rep, &e);
    }
    pie_log_warn("ctl.worker.lost",
                 "worker_index=%u group=%s instances_terminated=%u reason=\"%s\"", w->index,
                 r->group_id, n_terminated, status.message);
    ctl_sched_destroy(&w->sched);
    ctl_pool_destroy(&w->pool);
    free_msg(w->stats_msg);
    free_msg(w->reg_msg);
    free(w);
    ctl_core_leave(c);
}
