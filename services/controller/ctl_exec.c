/* ctl_exec.c — what each API call does, and the batches calls become.
 *
 * Owns:
 *  * the controller calls, run when they reach their queue's head: alloc / dealloc of KV pages
 *    and embeddings (bookkeeping plus a SlotBatch entry, no worker round trip), export,
 *    unexport, import (placement on the export's group), with quotas and contention;
 *  * the queue-less calls, run on arrival: list_exports, broadcast, subscribe, unsubscribe;
 *  * validation of GPU calls and their translation into batch items over physical slots
 *    (embed_text, forward, mask_kv_page, copy_kv_page, next_dist), including the conflict
 *    rules that keep two calls out of one batch;
 *  * the step under construction (ctl_step): the scheduler's callbacks, SlotBatches placed
 *    before the batches that depend on them, and sending the step when the worker has a credit;
 *  * applying BatchResults: completing calls with their data or errors, and taking back the
 *    calls a worker deferred (below, "Deferral").
 * Does not own: when a call reaches its head (ctl_core.c), which batch is next (ctl_sched.c),
 * slot bookkeeping itself (ctl_vspace.c).
 *
 * Every error names the call, the field or id and the value (docs/wire-contracts.md
 * "Errors"). The rules every layer checks (counts, ranges, page lengths, masks) are
 * pie_check.h's; this file adds what needs the controller's state: ids → slots, page layout,
 * read-only pages, conflicts within a batch. */
#include "ctl_core_int.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pie_check.h"
#include "pie_log.h"

/* ---- helpers ------------------------------------------------------------------------------- */

static const char *model_name(const ctl_core *c, uint32_t model) { return c->models[model].name; }

/* Resolves a page (kv) or embedding id on q's placement, naming what is wrong otherwise. */
static pie_code map_id(const ctl_core *c, const ctl_queue *q, bool kv, const char *op, uint32_t id,
                       uint32_t *slot, pie_status *st) {
    const ctl_place *pl = q->place;
    if (pl && (kv ? ctl_vspace_kv(&pl->vs, id, slot) : ctl_vspace_emb(&pl->vs, id, slot)))
        return PIE_OK;
    const char *what = kv ? "kv page" : "embedding";
    for (const ctl_place *p = q->inst->places; p; p = p->inst_next) {
        if (p == pl) continue;
        if (kv ? ctl_vspace_kv(&p->vs, id, NULL) : ctl_vspace_emb(&p->vs, id, NULL))
            return pie_status_set(
                st, PIE_INVALID_ARGUMENT,
                "%s: %s %u belongs to model \"%s\", but queue %u runs model \"%s\"", op, what, id,
                model_name(c, p->model), q->id, model_name(c, q->model));
    }
    return pie_status_set(st, PIE_INVALID_ARGUMENT, "%s: %s %u is not allocated in this instance",
                          op, what, id);
}

/* Ids that must be unbound in every placement of the instance (alloc / import). */
static pie_code unbound_everywhere(const ctl_core *c, const ctl_queue *q, bool kv, const char *op,
                                   const uint32_t *ids, uint32_t n, pie_status *st) {
    for (const ctl_place *p = q->inst->places; p; p = p->inst_next) {
        const ctl_map32 *m = kv ? &p->vs.kv : &p->vs.emb;
        if (m->n == 0) continue;
        for (uint32_t i = 0; i < n; i++) {
            if (!ctl_map32_get(m, ids[i], NULL)) continue;
            if (p == q->place)
                return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                      "%s: %s %u is already allocated in this instance", op,
                                      kv ? "kv page" : "embedding", ids[i]);
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "%s: %s %u is already allocated in this instance (model \"%s\")",
                                  op, kv ? "kv page" : "embedding", ids[i],
                                  model_name(c, p->model));
        }
    }
    return PIE_OK;
}

static pie_code writable(const ctl_place *pl, const char *op, uint32_t id, uint32_t slot,
                         pie_status *st) {
    uint32_t refs = ctl_pool_kv_refs(&pl->w->pool, slot);
    if (refs <= 1) return PIE_OK;
    return pie_status_set(st, PIE_FAILED_PRECONDITION,
                          "%s: kv page %u is read-only: it is shared (%u references: exports or "
                          "other instances); copy it first",
                          op, id, refs);
}

/* An embedding (bound on q's placement to slot) is read only once its holder wrote it: what
 * a slot held before is never visible (the worker zeroes it on allocation), and reading what
 * was never written is the program's bug, reported at the call. */
static pie_code written(const ctl_queue *q, const char *op, const char *what, uint32_t id,
                        uint32_t slot, pie_status *st) {
    if (ctl_pool_emb_written(&q->place->w->pool, slot)) return PIE_OK;
    return pie_status_set(st, PIE_FAILED_PRECONDITION, "%s: %s %u was never written", op, what, id);
}

/* Marks the embedding slots a call taken into a batch writes. */
static void mark_written(ctl_queue *q, const uint32_t *slots, size_t n) {
    for (size_t i = 0; i < n; i++) ctl_pool_emb_set_written(&q->place->w->pool, slots[i]);
}

/* The instance's placement for q's model, creating it on w (or the least loaded group). */
static ctl_place *place_for(ctl_core *c, ctl_queue *q, ctl_worker *w, const char *op,
                            pie_status *st) {
    if (q->place) return q->place;
    q->place = ctl_place_of(q->inst, q->model);
    if (q->place) return q->place;
    if (w == NULL) w = ctl_place_choose(c, q->model);
    if (w == NULL) {
        pie_status_set(st, PIE_UNAVAILABLE, "%s: no worker serves model \"%s\" now%s", op,
                       model_name(c, q->model),
                       c->draining ? " (the controller is shutting down)" : "");
        return NULL;
    }
    q->place = ctl_place_add(c, q->inst, q->model, w);
    if (q->place == NULL)
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "%s: controller out of memory", op);
    return q->place;
}

/* ---- controller calls ---------------------------------------------------------------------- */

/* Spill (issue 13): a worker whose memory policy keeps KV in its host pool too (not gpu) grows
 * its effective capacity on demand, up to kv_pages_max (the host pool full): the allocation is
 * granted, and the worker, holding more live pages than its effective capacity, moves layers to
 * the host until they fit and reports the new capacity (CapacityChange). True if it did. */
static bool spill(ctl_core *c, ctl_worker *w, uint32_t n, const char *op) {
    Pie__V1__MemoryPolicy p = w->reg->memory_policy;
    if (p == PIE__V1__MEMORY_POLICY__MEMORY_POLICY_GPU ||
        p == PIE__V1__MEMORY_POLICY__MEMORY_POLICY_UNSPECIFIED)
        return false;
    uint64_t need = (uint64_t)w->pool.kv_used + n;
    if (need > w->pool.kv_max) return false;
    pie_log_info("ctl.kv.spill",
                 "worker_index=%u group=%s op=%s requested=%u used=%u kv_pages_effective=%u->%llu "
                 "kv_pages_max=%u",
                 w->index, w->reg->group_id, op, n, w->pool.kv_used, w->pool.kv_effective,
                 (unsigned long long)need, w->pool.kv_max);
    w->pool.kv_effective = (uint32_t)need;
    if (c->m_kv_spills) pie_counter_add(c->m_kv_spills, 1);
    return true;
}

/* Frees KV pages (kv) or embedding slots (!kv) on w for inst by the contention policy; true
 * if n are available after. Both kinds of memory follow the same FCFS rule (paper §5.2); KV
 * pages spill to the worker's host pool first where its memory policy has one. */
static bool reclaim(ctl_core *c, ctl_worker *w, ctl_inst *inst, bool kv, uint32_t n, const char *op,
                    pie_status *st) {
    const char *what = kv ? "KV pages" : "embedding slots";
    uint32_t avail = kv ? ctl_pool_kv_available(&w->pool) : ctl_pool_emb_available(&w->pool);
    if (avail >= n) return true;
    if (kv && spill(c, w, n, op)) return true;
    if (c->cfg.contention == CTL_CONTENTION_FAIL_CALL) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                       "%s: %u %s requested, worker %s has %u free (contention.policy fail_call)",
                       op, n, what, w->reg->group_id, avail);
        return false;
    }
    ctl_inst **victims;
    size_t n_victims;
    uint64_t holds;
    bool spared;
    if (!ctl_place_plan_victims(w, inst, kv, n, avail, &victims, &n_victims, &holds, &spared)) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "%s: controller out of memory", op);
        return false;
    }
    if (avail + holds < n) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                       "%s: %u %s requested, worker %s has %u free and instances launched after "
                       "this one hold %llu there%s",
                       op, n, what, w->reg->group_id, avail, (unsigned long long)holds,
                       spared ? " that may be ended (not those of tenants holding fewer there "
                                "than this tenant would)"
                              : "");
        free(victims);
        return false;
    }
    char why[PIE_STATUS_MSG_MAX];
    snprintf(why, sizeof why,
             "terminated by the system due to resource contention: instance %llu, launched "
             "earlier, needed %s on worker %s",
             (unsigned long long)inst->id, what, w->reg->group_id);
    /* Ending a victim may free less than it holds (pages it shares stay): plan again while the
     * plan still names someone. */
    while (n_victims > 0) {
        for (size_t i = 0; i < n_victims && avail < n; i++) {
            ctl_core_terminate(c, victims[i], PIE_RESOURCE_EXHAUSTED, why);
            avail = kv ? ctl_pool_kv_available(&w->pool) : ctl_pool_emb_available(&w->pool);
        }
        free(victims);
        victims = NULL;
        if (avail >= n) return true;
        if (!ctl_place_plan_victims(w, inst, kv, n, avail, &victims, &n_victims, &holds, &spared))
            break;
    }
    free(victims);
    pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                   "%s: %u %s requested, worker %s has %u free after reclaiming those of later "
                   "instances (the rest are shared)",
                   op, n, what, w->reg->group_id, avail);
    return false;
}

static pie_code quota(const char *op, const char *what, uint32_t limit, uint32_t held, uint32_t n,
                      pie_status *st) {
    if (limit == 0 || (uint64_t)held + n <= limit) return PIE_OK;
    return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                          "%s: %u more %s would exceed the instance's limit of %u (%u held)", op, n,
                          what, limit, held);
}

static pie_code do_alloc(ctl_core *c, ctl_queue *q, bool kv, const Pie__V1__ApiCall *api,
                         pie_status *st) {
    const char *op = kv ? "alloc_kv_pages" : "alloc_embeds";
    const uint32_t *ids = kv ? api->alloc_kv_pages->kv_page_ids : api->alloc_embeds->embed_ids;
    uint32_t n =
        (uint32_t)(kv ? api->alloc_kv_pages->n_kv_page_ids : api->alloc_embeds->n_embed_ids);
    ctl_inst *inst = q->inst;
    if (ctl_ids_check(op, kv ? "kv_page_ids" : "embed_ids", kv ? "kv page" : "embedding", ids, n,
                      PIE_MAX_IDS, st) != PIE_OK ||
        unbound_everywhere(c, q, kv, op, ids, n, st) != PIE_OK ||
        quota(op, kv ? "KV pages" : "embeddings", kv ? inst->lim_kv : inst->lim_emb,
              kv ? inst->n_kv : inst->n_emb, n, st) != PIE_OK ||
        (kv && ctl_tenant_quota(op, inst->tenant, "kv_pages", inst->tenant->q_kv,
                                inst->tenant->n_kv, n, st) != PIE_OK))
        return st->code;
    ctl_place *pl = place_for(c, q, NULL, op, st);
    if (pl == NULL) return st->code;
    if (!reclaim(c, pl->w, inst, kv, n, op, st)) return st->code;
    if (kv) {
        if (ctl_vspace_alloc_kv(&pl->vs, op, ids, n, st) != PIE_OK) return st->code;
        ctl_inst_kv_add(inst, n);
    } else {
        if (ctl_vspace_alloc_emb(&pl->vs, op, ids, n, st) != PIE_OK) return st->code;
        inst->n_emb += n;
    }
    return PIE_OK;
}

/* Checks that every id is bound on q's placement (naming foreign or unknown ids). */
static pie_code all_bound(const ctl_core *c, const ctl_queue *q, bool kv, const char *op,
                          const uint32_t *ids, uint32_t n, uint32_t *slots, pie_status *st) {
    for (uint32_t i = 0; i < n; i++) {
        uint32_t s;
        if (map_id(c, q, kv, op, ids[i], &s, st) != PIE_OK) return st->code;
        if (slots) slots[i] = s;
    }
    return PIE_OK;
}

static pie_code do_dealloc(ctl_core *c, ctl_queue *q, bool kv, const Pie__V1__ApiCall *api,
                           pie_status *st) {
    const char *op = kv ? "dealloc_kv_pages" : "dealloc_embeds";
    const uint32_t *ids = kv ? api->dealloc_kv_pages->kv_page_ids : api->dealloc_embeds->embed_ids;
    uint32_t n =
        (uint32_t)(kv ? api->dealloc_kv_pages->n_kv_page_ids : api->dealloc_embeds->n_embed_ids);
    if (ctl_ids_check(op, kv ? "kv_page_ids" : "embed_ids", kv ? "kv page" : "embedding", ids, n,
                      PIE_MAX_IDS, st) != PIE_OK ||
        all_bound(c, q, kv, op, ids, n, NULL, st) != PIE_OK)
        return st->code;
    ctl_place *pl = q->place;
    if (kv) {
        if (ctl_vspace_dealloc_kv(&pl->vs, op, ids, n, st) != PIE_OK) return st->code;
        ctl_inst_kv_add(q->inst, -(int64_t)n);
    } else {
        if (ctl_vspace_dealloc_emb(&pl->vs, op, ids, n, st) != PIE_OK) return st->code;
        q->inst->n_emb -= n;
    }
    return PIE_OK;
}

static pie_code do_export(ctl_core *c, ctl_queue *q, const Pie__V1__ApiCall *api, pie_status *st) {
    const char *op = "export_kv_pages";
    const Pie__V1__ExportKvPages *e = api->export_kv_pages;
    uint32_t n = (uint32_t)e->n_kv_page_ids;
    if (ctl_ids_check(op, "kv_page_ids", "kv page", e->kv_page_ids, n, PIE_MAX_IDS, st) != PIE_OK ||
        ctl_name_check(op, "name", e->name, st) != PIE_OK)
        return st->code;
    ctl_tenant *t = q->inst->tenant;
    if (e->persistent && ctl_tenant_quota(op, t, "export_pages", ctl_tenant_export_quota(c, t),
                                          t->n_export_pages, n, st) != PIE_OK)
        return st->code;
    if (e->persistent && q->place && c->cfg.export_pool_share > 0) {
        uint32_t share = (uint32_t)(c->cfg.export_pool_share * q->place->w->pool.kv_max);
        if (ctl_tenant_quota(op, t, "exports.max_pool_share", share ? share : 1,
                             t->n_export_pages, n, st) != PIE_OK)
            return st->code;
    }
    uint32_t *slots = malloc(n * sizeof *slots);
    if (slots == NULL)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "%s: controller out of memory", op);
    pie_code rc = all_bound(c, q, true, op, e->kv_page_ids, n, slots, st);
    if (rc == PIE_OK) {
        ctl_export_spec spec = {.tenant = t->name,
                                .name = e->name,
                                .model = model_name(c, q->model),
                                .pool = &q->place->w->pool,
                                .where = q->place->w,
                                .slots = slots,
                                .n = n,
                                .persistent = e->persistent,
                                .exporter = q->inst->id,
                                .charge = &t->n_export_pages,
                                .now_ns = c->now_ns};
        rc = ctl_exports_add(&c->exports, op, &spec, st);
    }
    free(slots);
    if (rc == PIE_OK && !e->persistent) q->inst->n_tied_exports++;
    return rc;
}

static pie_code do_unexport(ctl_core *c, ctl_queue *q, const Pie__V1__ApiCall *api,
                            pie_status *st) {
    const char *op = "unexport_kv_pages";
    const char *name = api->unexport_kv_pages->name;
    if (ctl_name_check(op, "name", name, st) != PIE_OK) return st->code;
    ctl_export *e = ctl_exports_get(&c->exports, q->inst->tenant->name, name);
    if (e == NULL)
        return pie_status_set(st, PIE_NOT_FOUND, "%s: export \"%s\" is not found", op, name);
    if (!e->persistent && e->exporter != q->inst->id)
        return pie_status_set(st, PIE_FAILED_PRECONDITION,
                              "%s: export \"%s\" is not persistent: only its exporter (instance "
                              "%llu) may remove it",
                              op, name, (unsigned long long)e->exporter);
    if (!e->persistent && q->inst->n_tied_exports) q->inst->n_tied_exports--;
    ctl_exports_remove(&c->exports, e);
    return PIE_OK;
}

static pie_code do_import(ctl_core *c, ctl_queue *q, ctl_call *call, pie_status *st) {
    const char *op = "import_kv_pages";
    const Pie__V1__ImportKvPages *im = call->api->import_kv_pages;
    if (ctl_name_check(op, "name", im->name, st) != PIE_OK) return st->code;
    ctl_export *e = ctl_exports_get(&c->exports, q->inst->tenant->name, im->name);
    if (e == NULL)
        return pie_status_set(st, PIE_NOT_FOUND, "%s: export \"%s\" is not found", op, im->name);
    if (strcmp(e->model, model_name(c, q->model)) != 0)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "%s: export \"%s\" holds pages of model \"%s\", but queue %u runs "
                              "model \"%s\"",
                              op, im->name, e->model, q->id, model_name(c, q->model));
    uint32_t n = (uint32_t)im->n_kv_page_ids;
    if (n < e->n)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "%s: %u kv_page_ids for export \"%s\" of %u pages", op, n, im->name,
                              e->n);
    if (ctl_ids_check(op, "kv_page_ids", "kv page", im->kv_page_ids, n, PIE_MAX_IDS, st) !=
            PIE_OK ||
        unbound_everywhere(c, q, true, op, im->kv_page_ids, e->n, st) != PIE_OK ||
        quota(op, "KV pages", q->inst->lim_kv, q->inst->n_kv, e->n, st) != PIE_OK ||
        ctl_tenant_quota(op, q->inst->tenant, "kv_pages", q->inst->tenant->q_kv,
                         q->inst->tenant->n_kv, e->n, st) != PIE_OK)
        return st->code;
    ctl_worker *where = e->where;
    ctl_place *pl = q->place ? q->place : ctl_place_of(q->inst, q->model);
    if (pl && pl->w != where)
        return pie_status_set(
            st, PIE_FAILED_PRECONDITION,
            "%s: export \"%s\" lives on worker %s, but this instance's objects of "
            "model \"%s\" live on worker %s",
            op, im->name, where->reg->group_id, model_name(c, q->model), pl->w->reg->group_id);
    pl = place_for(c, q, where, op, st);
    if (pl == NULL) return st->code;
    call->out_ids = malloc(e->n * sizeof *call->out_ids);
    if (call->out_ids == NULL)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "%s: controller out of memory", op);
    if (ctl_vspace_import_kv(&pl->vs, op, im->kv_page_ids, e->slots, e->n, st) != PIE_OK)
        return st->code;
    memcpy(call->out_ids, im->kv_page_ids, e->n * sizeof *call->out_ids);
    call->n_out_ids = e->n;
    call->has_result = true;
    ctl_inst_kv_add(q->inst, e->n);
    e->used_ns = c->now_ns; /* a used persistent export stays (exports.ttl) */
    return PIE_OK;
}

void ctl_exec_ctrl(ctl_core *c, ctl_queue *q, ctl_call *call) {
    pie_status st;
    pie_status_ok(&st);
    const Pie__V1__ApiCall *api = call->api;
    pie_code rc;
    /* A queue whose first call frees or copies objects another queue of the same model made
     * (an SDK context freed right after a fork) joins the instance's existing placement. */
    if (q->place == NULL) q->place = ctl_place_of(q->inst, q->model);
    switch (api->op_case) {
    case PIE__V1__API_CALL__OP_ALLOC_KV_PAGES: rc = do_alloc(c, q, true, api, &st); break;
    case PIE__V1__API_CALL__OP_ALLOC_EMBEDS: rc = do_alloc(c, q, false, api, &st); break;
    case PIE__V1__API_CALL__OP_DEALLOC_KV_PAGES: rc = do_dealloc(c, q, true, api, &st); break;
    case PIE__V1__API_CALL__OP_DEALLOC_EMBEDS: rc = do_dealloc(c, q, false, api, &st); break;
    case PIE__V1__API_CALL__OP_EXPORT_KV_PAGES: rc = do_export(c, q, api, &st); break;
    case PIE__V1__API_CALL__OP_UNEXPORT_KV_PAGES: rc = do_unexport(c, q, api, &st); break;
    case PIE__V1__API_CALL__OP_IMPORT_KV_PAGES: rc = do_import(c, q, call, &st); break;
    default:
        rc = pie_status_set(&st, PIE_UNIMPLEMENTED, "call %llu: not a controller call",
                            (unsigned long long)api->call_id);
        break;
    }
    ctl_queue_done(call, rc == PIE_OK ? 0 : (uint32_t)rc, rc == PIE_OK ? NULL : st.msg);
}

/* ---- queue-less calls ---------------------------------------------------------------------- */

/* Unix time (ms) at which an export last used at used_ns expires under exports.ttl; 0: never. */
static uint64_t export_expiry_unix_ms(const ctl_core *c, const ctl_export *e) {
    if (!e->persistent || c->cfg.export_ttl_ms == 0) return 0;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    int64_t now_ms = (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
    int64_t left_ms = (e->used_ns - c->now_ns) / 1000000 + c->cfg.export_ttl_ms;
    return (uint64_t)(now_ms + (left_ms > 0 ? left_ms : 0));
}

int ctl_exec_export_infos(ctl_core *c, ctl_arena *a, const char *tenant,
                          Pie__V1__ExportInfo ***out, size_t *n_out) {
    ctl_export **v = NULL;
    size_t n = 0, k = 0;
    if (ctl_exports_sorted(&c->exports, &v, &n) != 0) return -1;
    Pie__V1__ExportInfo *infos = ctl_arena_alloc(a, (n + 1) * sizeof *infos);
    Pie__V1__ExportInfo **ptrs = ctl_arena_alloc(a, (n + 1) * sizeof *ptrs);
    if (!infos || !ptrs) goto oom;
    for (size_t i = 0; i < n; i++) {
        if (tenant && strcmp(v[i]->tenant, tenant) != 0) continue;
        Pie__V1__ExportInfo *x = &infos[k];
        pie__v1__export_info__init(x);
        /* Copies: the export may be removed before the message is sent. */
        x->name = ctl_arena_strdup(a, v[i]->name);
        x->model = ctl_arena_strdup(a, v[i]->model);
        x->tenant = ctl_arena_strdup(a, v[i]->tenant);
        if (!x->name || !x->model || !x->tenant) goto oom;
        x->page_count = v[i]->n;
        x->persistent = v[i]->persistent;
        x->exporter_instance_id = v[i]->exporter;
        x->expires_unix_ms = export_expiry_unix_ms(c, v[i]);
        ptrs[k++] = x;
    }
    free(v);
    *out = ptrs;
    *n_out = k;
    return 0;
oom:
    free(v);
    return -1;
}

static void list_exports(ctl_core *c, ctl_inst *inst, const Pie__V1__ApiCall *api) {
    ctl_replica *r = inst->rep;
    Pie__V1__ExportList *el = ctl_arena_alloc(&r->arena, sizeof *el);
    if (!el) goto oom;
    pie__v1__export_list__init(el);
    if (ctl_exec_export_infos(c, &r->arena, inst->tenant->name, &el->exports, &el->n_exports) != 0)
        goto oom;
    Pie__V1__CallResult *res = ctl_core_result(c, r, inst->id, api->call_id, 0, NULL);
    if (res == NULL) goto oom;
    res->payload_case = PIE__V1__CALL_RESULT__PAYLOAD_EXPORTS;
    res->exports = el;
    return;
oom:
    ctl_core_result(c, r, inst->id, api->call_id, PIE_RESOURCE_EXHAUSTED,
                    "list_exports: controller out of memory");
}

/* One TopicDelivery per replica with subscribers, listing them. */
/* Topics are per tenant, as export names are: the table's key is "<tenant>:<topic>" (':' is
 * not in tenant names), so one tenant's instances never hear another's broadcasts nor speak
 * into its topics. Deliveries carry the topic as the inferlet named it. */
typedef struct topic_key {
    char s[PIE_TENANT_NAME_MAX + 1 + PIE_MAX_NAME_BYTES + 1];
} topic_key;

static topic_key topic_key_of(const ctl_inst *inst, const char *topic) {
    topic_key k;
    snprintf(k.s, sizeof k.s, "%s:%s", inst->tenant->name, topic);
    return k;
}

static void broadcast(ctl_core *c, ctl_inst *inst, const Pie__V1__ApiCall *api) {
    const Pie__V1__Broadcast *b = api->broadcast;
    pie_status st;
    if (ctl_name_check("broadcast", "topic", b->topic, &st) != PIE_OK) {
        ctl_core_result(c, inst->rep, inst->id, api->call_id, st.code, st.msg);
        return;
    }
    const ctl_topic *t = ctl_pubsub_topic(&c->ps, topic_key_of(inst, b->topic).s);
    if (t == NULL) return;
    for (ctl_replica *r = c->replicas; r; r = r->next) {
        uint32_t n = 0;
        for (uint32_t i = 0; i < t->n; i++) n += ((ctl_inst *)t->subs[i].who)->rep == r;
        if (n == 0) continue;
        uint64_t *ids = ctl_arena_alloc(&r->arena, n * sizeof *ids);
        Pie__V1__TopicDelivery *td = ctl_arena_alloc(&r->arena, sizeof *td);
        Pie__V1__SessionEvent *e = ids && td ? ctl_core_event(c, r) : NULL;
        if (e == NULL) {
            pie_log_error("ctl.broadcast.oom", "replica_index=%u topic_bytes=%zu", r->index,
                          strlen(b->topic));
            continue;
        }
        uint32_t k = 0;
        for (uint32_t i = 0; i < t->n; i++) {
            const ctl_inst *s = t->subs[i].who;
            if (s->rep == r) ids[k++] = s->id;
        }
        pie__v1__topic_delivery__init(td);
        /* topic and message point into the SessionUp, which outlives the outbox's sending. */
        td->topic = b->topic;
        td->message = b->message;
        td->sender_instance_id = inst->id;
        td->instance_ids = ids;
        td->n_instance_ids = k;
        e->event_case = PIE__V1__SESSION_EVENT__EVENT_DELIVERY;
        e->delivery = td;
    }
}

void ctl_exec_queueless(ctl_core *c, ctl_inst *inst, const Pie__V1__ApiCall *api) {
    pie_status st;
    switch (api->op_case) {
    case PIE__V1__API_CALL__OP_LIST_EXPORTS: list_exports(c, inst, api); return;
    case PIE__V1__API_CALL__OP_BROADCAST: broadcast(c, inst, api); return;
    case PIE__V1__API_CALL__OP_SUBSCRIBE:
        if (ctl_name_check("subscribe", "topic", api->subscribe->topic, &st) == PIE_OK)
            ctl_pubsub_subscribe(&c->ps, &inst->subs, inst,
                                 topic_key_of(inst, api->subscribe->topic).s, &st);
        break;
    case PIE__V1__API_CALL__OP_UNSUBSCRIBE:
        if (ctl_name_check("unsubscribe", "topic", api->unsubscribe->topic, &st) == PIE_OK) {
            ctl_pubsub_unsubscribe(&c->ps, &inst->subs,
                                   topic_key_of(inst, api->unsubscribe->topic).s);
            return;
        }
        break;
    default: return;
    }
    if (st.code != PIE_OK) ctl_core_result(c, inst->rep, inst->id, api->call_id, st.code, st.msg);
}

/* ---- GPU calls: validation and items ----------------------------------------------------------
 *
 * Each check_* validates a call against q's placement and, when `b` is set, writes its item(s)
 * into the step's arena. Static checks come first so that the message names the first thing
 * wrong with the input. */

typedef struct build {
    ctl_step *s;
    void *item; /* the item built (kind-specific), or NULL */
} build;

static uint32_t *arena_u32(ctl_step *s, size_t n) {
    return ctl_arena_alloc(&s->arena, (n ? n : 1) * 4);
}

static pie_code oom_st(const char *op, pie_status *st) {
    return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "%s: controller out of memory", op);
}

static pie_code check_embed(const ctl_core *c, const ctl_queue *q, const Pie__V1__ApiCall *api,
                            ctl_step *s, pie_status *st) {
    const char *op = "embed_text";
    const Pie__V1__EmbedText *e = api->embed_text;
    const Pie__V1__ModelInfo *m = ctl_model_info(c, q->model);
    size_t n = e->n_embed_ids;
    if (pie_check_count(PIE_AT(op), "embed_ids", n, pie_check_limit(m->max_forward_tokens), st) !=
        PIE_OK)
        return st->code;
    if (e->n_token_ids != n || e->n_positions != n)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "%s: embed_ids, token_ids and positions must have equal lengths, got "
                              "%zu, %zu and %zu",
                              op, n, e->n_token_ids, e->n_positions);
    if (pie_check_below(PIE_AT(op), "token_ids", e->token_ids, n, pie_check_limit(m->vocab_size),
                        st) != PIE_OK ||
        pie_check_below(PIE_AT(op), "positions", e->positions, n,
                        pie_check_limit(m->max_context_tokens), st) != PIE_OK)
        return st->code;
    if (ctl_ids_check(op, "embed_ids", "embedding", e->embed_ids, (uint32_t)n, UINT32_MAX, st) !=
        PIE_OK)
        return st->code;
    if (s && ctl_vec32_reserve(&s->emb_slots, s->emb_slots.n + (uint32_t)n) != 0)
        return oom_st(op, st);
    for (size_t i = 0; i < n; i++) {
        uint32_t slot;
        if (map_id(c, q, false, op, e->embed_ids[i], &slot, st) != PIE_OK) return st->code;
        if (s) s->emb_slots.v[s->emb_slots.n + i] = slot;
    }
    return PIE_OK;
}

static bool in_list(const uint32_t *v, size_t n, uint32_t x) {
    for (size_t i = 0; i < n; i++)
        if (v[i] == x) return true;
    return false;
}

static pie_code check_forward(const ctl_core *c, const ctl_queue *q, const Pie__V1__ApiCall *api,
                              ctl_step *s, Pie__V1__ForwardItem **out, pie_status *st) {
    const char *op = "forward";
    const Pie__V1__Forward *f = api->forward;
    const Pie__V1__ModelInfo *m = ctl_model_info(c, q->model);
    const uint32_t P = m->kv_page_size;
    size_t N = f->n_input_embed_ids, Cp = f->n_kv_page_ids, O = f->n_output_kv_page_ids,
           M = f->n_output_embed_ids;
    uint32_t last = f->kv_page_last_len;
    const pie_check_fwd shape = {.in = "input_embed_ids",
                                 .out = "output_embed_ids",
                                 .pages = "kv_page_ids",
                                 .last = "kv_page_last_len",
                                 .n_in = N,
                                 .n_out = M,
                                 .n_pages = Cp,
                                 .last_len = last};
    if (pie_check_forward(PIE_AT(op), &shape, P, pie_check_limit(m->max_forward_tokens), st) !=
        PIE_OK)
        return st->code;
    if (Cp && ctl_ids_check(op, "kv_page_ids", "kv page", f->kv_page_ids, (uint32_t)Cp, UINT32_MAX,
                            st) != PIE_OK)
        return st->code;
    if (O && ctl_ids_check(op, "output_kv_page_ids", "kv page", f->output_kv_page_ids, (uint32_t)O,
                           UINT32_MAX, st) != PIE_OK)
        return st->code;
    if (M && ctl_ids_check(op, "output_embed_ids", "embedding", f->output_embed_ids, (uint32_t)M,
                           UINT32_MAX, st) != PIE_OK)
        return st->code;
    bool cont = false;
    uint64_t C = Cp ? (uint64_t)(Cp - 1) * P + last : 0;
    if (O) {
        cont = Cp > 0 && f->output_kv_page_ids[0] == f->kv_page_ids[Cp - 1];
        for (size_t j = cont ? 1 : 0; j < O; j++)
            if (in_list(f->kv_page_ids, Cp, f->output_kv_page_ids[j]))
                return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                      "%s: output kv page %u is also a context page (only the last "
                                      "context page may be output_kv_page_ids[0])",
                                      op, f->output_kv_page_ids[j]);
        if (!cont && Cp > 0 && last != P)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "%s: output_kv_page_ids[0] (kv page %u) is not the last context "
                                  "page (kv page %u), which holds %u of %u tokens: append to it",
                                  op, f->output_kv_page_ids[0], f->kv_page_ids[Cp - 1], last, P);
        uint64_t room0 = cont ? P - last : P;
        if (cont && room0 == 0)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "%s: the last context page (kv page %u) is full: "
                                  "output_kv_page_ids[0] must be a new page",
                                  op, f->kv_page_ids[Cp - 1]);
        uint64_t cap = room0 + (uint64_t)(O - 1) * P;
        uint64_t min = O == 1 ? 1 : room0 + (uint64_t)(O - 2) * P + 1;
        if (N > cap || N < min)
            return pie_status_set(
                st, PIE_INVALID_ARGUMENT,
                "%s: output_kv_page_ids (%zu pages) take %llu to %llu tokens here, "
                "but there are %zu input tokens",
                op, O, (unsigned long long)min, (unsigned long long)cap, N);
    }
    if (f->mask && pie_check_mask(PIE_AT(op), f->mask->runs, f->mask->n_runs, (uint32_t)C,
                                  (uint32_t)N, st) != PIE_OK)
        return st->code;

    /* Ids → slots (and the item). */
    size_t n_seq = Cp + (O ? (cont ? O - 1 : O) : 0);
    Pie__V1__ForwardItem *fi = NULL;
    uint32_t *kv = NULL, *in = NULL, *outs = NULL;
    if (s) {
        fi = ctl_arena_alloc(&s->arena, sizeof *fi);
        kv = arena_u32(s, n_seq);
        in = arena_u32(s, N);
        outs = arena_u32(s, M);
        if (!fi || !kv || !in || !outs) return oom_st(op, st);
    }
    uint32_t slot;
    for (size_t j = 0; j < Cp; j++) {
        if (map_id(c, q, true, op, f->kv_page_ids[j], &slot, st) != PIE_OK) return st->code;
        if (kv) kv[j] = slot;
    }
    for (size_t j = 0; j < O; j++) {
        if (map_id(c, q, true, op, f->output_kv_page_ids[j], &slot, st) != PIE_OK ||
            writable(q->place, op, f->output_kv_page_ids[j], slot, st) != PIE_OK)
            return st->code;
        if (kv && !(cont && j == 0)) kv[Cp + j - (cont ? 1 : 0)] = slot;
    }
    for (size_t j = 0; j < N; j++) {
        if (map_id(c, q, false, op, f->input_embed_ids[j], &slot, st) != PIE_OK ||
            written(q, op, "input embedding", f->input_embed_ids[j], slot, st) != PIE_OK)
            return st->code;
        if (in) in[j] = slot;
    }
    for (size_t j = 0; j < M; j++) {
        if (map_id(c, q, false, op, f->output_embed_ids[j], &slot, st) != PIE_OK) return st->code;
        if (outs) outs[j] = slot;
    }
    if (fi) {
        pie__v1__forward_item__init(fi);
        fi->kv_slots = kv;
        fi->n_kv_slots = n_seq;
        fi->kv_last_page_len = O ? (uint32_t)(C + N - (uint64_t)(n_seq - 1) * P) : last;
        fi->append_kv = O > 0;
        fi->input_embed_slots = in;
        fi->n_input_embed_slots = N;
        fi->output_embed_slots = outs;
        fi->n_output_embed_slots = M;
        fi->mask = f->mask; /* same encoding; the SessionUp outlives the send */
        fi->owner = q->inst->id;
        *out = fi;
    }
    return PIE_OK;
}

static pie_code check_mask_page(const ctl_core *c, const ctl_queue *q, const Pie__V1__ApiCall *api,
                                ctl_step *s, Pie__V1__MaskPageItem **out, pie_status *st) {
    const char *op = "mask_kv_page";
    const Pie__V1__MaskKvPage *mk = api->mask_kv_page;
    uint32_t P = ctl_model_info(c, q->model)->kv_page_size;
    if (pie_check_page_len(PIE_AT(op), "masked", mk->n_masked, P, st) != PIE_OK) return st->code;
    uint32_t slot;
    if (map_id(c, q, true, op, mk->kv_page_id, &slot, st) != PIE_OK ||
        writable(q->place, op, mk->kv_page_id, slot, st) != PIE_OK)
        return st->code;
    if (s) {
        Pie__V1__MaskPageItem *it = ctl_arena_alloc(&s->arena, sizeof *it);
        if (it == NULL) return oom_st(op, st);
        pie__v1__mask_page_item__init(it);
        it->kv_slot = slot;
        it->masked = mk->masked; /* points into the SessionUp */
        it->n_masked = mk->n_masked;
        *out = it;
    }
    return PIE_OK;
}

static pie_code check_copy(const ctl_core *c, const ctl_queue *q, const Pie__V1__ApiCall *api,
                           ctl_step *s, Pie__V1__CopyPageItem **out, pie_status *st) {
    const char *op = "copy_kv_page";
    const Pie__V1__CopyKvPage *cp = api->copy_kv_page;
    uint32_t P = ctl_model_info(c, q->model)->kv_page_size;
    if (pie_check_copy(PIE_AT(op), cp->src_kv_page_id, cp->dst_kv_page_id, cp->src_offset,
                       cp->dst_offset, cp->token_count, P, st) != PIE_OK)
        return st->code;
    uint32_t src, dst;
    if (map_id(c, q, true, op, cp->src_kv_page_id, &src, st) != PIE_OK ||
        map_id(c, q, true, op, cp->dst_kv_page_id, &dst, st) != PIE_OK ||
        writable(q->place, op, cp->dst_kv_page_id, dst, st) != PIE_OK)
        return st->code;
    if (s) {
        Pie__V1__CopyPageItem *it = ctl_arena_alloc(&s->arena, sizeof *it);
        if (it == NULL) return oom_st(op, st);
        pie__v1__copy_page_item__init(it);
        it->src_kv_slot = src;
        it->dst_kv_slot = dst;
        it->src_offset = cp->src_offset;
        it->dst_offset = cp->dst_offset;
        it->token_count = cp->token_count;
        *out = it;
    }
    return PIE_OK;
}

/* The top_k a NextDist call gets (0 → the model's default). */
static uint32_t dist_k(const Pie__V1__ModelInfo *m, const Pie__V1__NextDist *d) {
    return d->top_k ? d->top_k : (m->default_top_k ? m->default_top_k : 256);
}

static pie_code check_dist(const ctl_core *c, const ctl_queue *q, const Pie__V1__ApiCall *api,
                           ctl_step *s, pie_status *st) {
    const char *op = "next_dist";
    const Pie__V1__NextDist *d = api->next_dist;
    const Pie__V1__ModelInfo *m = ctl_model_info(c, q->model);
    size_t n = d->n_embed_ids;
    uint32_t k = dist_k(m, d);
    float t = d->temperature;
    if (pie_check_count(PIE_AT(op), "embed_ids", n, pie_check_limit(m->max_forward_tokens), st) !=
            PIE_OK ||
        pie_check_range(PIE_AT(op), "top_k", k, 0, pie_check_limit(m->max_top_k), st) != PIE_OK ||
        pie_check_temperature(PIE_AT(op), t, true, st) != PIE_OK)
        return st->code;
    if (t == 0) t = 1.0f;
    for (size_t i = 0; i < n; i++) {
        uint32_t slot;
        if (map_id(c, q, false, op, d->embed_ids[i], &slot, st) != PIE_OK ||
            written(q, op, "embedding", d->embed_ids[i], slot, st) != PIE_OK)
            return st->code;
        if (s) {
            Pie__V1__NextDistItem *it = ctl_arena_alloc(&s->arena, sizeof *it);
            if (it == NULL || ctl_vecp_push(&s->items, it) != 0) return oom_st(op, st);
            pie__v1__next_dist_item__init(it);
            it->embed_slot = slot;
            it->top_k = k;
            it->temperature = t;
        }
    }
    return PIE_OK;
}

/* Runs the check of a GPU call without building anything: its first error. */
static pie_code check_only(const ctl_core *c, const ctl_queue *q, const Pie__V1__ApiCall *api,
                           pie_status *st) {
    switch (api->op_case) {
    case PIE__V1__API_CALL__OP_EMBED_TEXT: return check_embed(c, q, api, NULL, st);
    case PIE__V1__API_CALL__OP_FORWARD: return check_forward(c, q, api, NULL, NULL, st);
    case PIE__V1__API_CALL__OP_MASK_KV_PAGE: return check_mask_page(c, q, api, NULL, NULL, st);
    case PIE__V1__API_CALL__OP_COPY_KV_PAGE: return check_copy(c, q, api, NULL, NULL, st);
    case PIE__V1__API_CALL__OP_NEXT_DIST: return check_dist(c, q, api, NULL, st);
    default: return pie_status_set(st, PIE_INTERNAL, "controller: not a GPU call");
    }
}

void ctl_exec_fail_unplaced(ctl_core *c, ctl_queue *q, ctl_call *call) {
    pie_status st;
    if (check_only(c, q, call->api, &st) == PIE_OK) /* cannot pass without objects; be safe */
        pie_status_set(&st, PIE_INVALID_ARGUMENT,
                       "%s: the instance holds no objects of model \"%s\"",
                       ctl_kind_name(call->kind), model_name(c, q->model));
    ctl_queue_done(call, st.code, st.msg);
}

/* ---- conflicts within a batch (same instance only: other instances cannot write a page this
 * instance reads — shared pages are read-only — nor touch its embeddings) ------------------- */

/* Whether forward item b (added later) may not share a batch with a (earlier). */
static bool forward_conflict(const Pie__V1__ForwardItem *a, const Pie__V1__ForwardItem *b,
                             uint32_t P) {
    /* b's inputs must not be a's outputs; b's outputs must not be a's inputs or outputs. */
    for (size_t i = 0; i < b->n_input_embed_slots; i++)
        if (in_list(a->output_embed_slots, a->n_output_embed_slots, b->input_embed_slots[i]))
            return true;
    for (size_t i = 0; i < b->n_output_embed_slots; i++)
        if (in_list(a->input_embed_slots, a->n_input_embed_slots, b->output_embed_slots[i]) ||
            in_list(a->output_embed_slots, a->n_output_embed_slots, b->output_embed_slots[i]))
            return true;
    if (!b->append_kv || b->n_kv_slots == 0) return false;
    /* b writes positions [T-N, T) of its sequence; a covers [0, Ta) of its sequence. A written
     * page position of b that a's sequence covers is a conflict (a would see b's write, or both
     * write it). b reading what a writes is the intended order and allowed. */
    uint64_t T = (uint64_t)(b->n_kv_slots - 1) * P + b->kv_last_page_len;
    uint64_t from = T - b->n_input_embed_slots;
    for (uint64_t pg = from / P; pg < b->n_kv_slots; pg++) {
        uint32_t lo = pg * P < from ? (uint32_t)(from - pg * P) : 0;
        uint32_t slot = b->kv_slots[pg];
        for (size_t k = 0; k < a->n_kv_slots; k++) {
            if (a->kv_slots[k] != slot) continue;
            uint32_t covered = k + 1 == a->n_kv_slots ? a->kv_last_page_len : P;
            uint32_t hi = pg + 1 == b->n_kv_slots ? b->kv_last_page_len : P;
            if (lo < covered && lo < hi) return true;
        }
    }
    return false;
}

static ctl_conf *conf_add(ctl_step *s, ctl_inst *inst, uint32_t item, uint32_t n) {
    if (s->n_conf == s->cap_conf) {
        uint32_t cap = s->cap_conf ? s->cap_conf * 2 : 64;
        ctl_conf *p = realloc(s->conf, cap * sizeof *p);
        if (p == NULL) return NULL;
        s->conf = p;
        s->cap_conf = cap;
    }
    ctl_conf *e = &s->conf[s->n_conf];
    e->inst = inst;
    e->item = item;
    e->n = n;
    if (inst->batch_serial != s->serial) {
        inst->batch_serial = s->serial;
        e->next_same = -1;
    } else {
        e->next_same = inst->batch_first;
    }
    inst->batch_first = (int32_t)s->n_conf++;
    return e;
}

/* The earlier entries of inst in this batch: first index or -1. */
static int32_t conf_first(const ctl_step *s, const ctl_inst *inst) {
    return inst->batch_serial == s->serial ? inst->batch_first : -1;
}

/* ---- admit (scheduler callbacks) ----------------------------------------------------------- */

/* After q's head was taken during batch forming: where q goes now. */
static void requeue(ctl_worker *w, ctl_queue *q) {
    ctl_call *h = ctl_queue_head(q);
    if (h && h->kind != CTL_KIND_CTRL) {
        ctl_sched_ready(&w->sched, &q->sq, h->kind, h->seq, h->t_ns);
        q->sched = &w->sched;
        return;
    }
    ctl_sched_unready(&w->sched, &q->sq);
    q->sched = NULL;
    if (h && !q->in_settle) { /* a controller call: run it once the batch is closed */
        q->in_settle = true;
        q->settle_next = w->settle;
        w->settle = q;
    }
}

static ctl_admit admit_fail(ctl_core *c, ctl_queue *q, const pie_status *st) {
    ctl_call *call = ctl_queue_take(q);
    ctl_queue_done(call, st->code, st->msg);
    requeue(c->step.w, q);
    ctl_core_completed(c, call);
    return CTL_ADMIT_FAILED;
}

static ctl_admit admit_take(ctl_core *c, ctl_queue *q, uint32_t n_items) {
    ctl_step *s = &c->step;
    ctl_batch *b = s->rec;
    ctl_call *call = ctl_queue_take(q);
    if (call->deferrals == 0) /* the wait until first taken; a deferral's shows as latency */
        pie_histogram_observe(c->m_wait, (double)(c->now_ns - call->t_ns) / 1e9);
    b->calls[b->n_calls++] = (ctl_batch_call){call, n_items};
    b->n_items += n_items;
    s->n_items += n_items;
    requeue(s->w, q);
    return CTL_ADMIT_TAKEN;
}

#define CTL_SLOT_CHANGE_BYTES 16u /* a KV allocation: slot (5) + owner (10) + rounding */
#define CTL_BATCH_BYTES       48u /* a Batch's framing: tag, length, batch_id, kind header */

/* Adds an upper bound of n bytes to the step; false (and the step is full) when it does not
 * fit in the message budget. (A call too large for any step is refused before this:
 * admit_bytes.) */
static bool step_bytes(ctl_core *c, size_t n) {
    ctl_step *s = &c->step;
    if (s->bytes + n > ctl_msg_budget(c)) {
        s->full = true;
        return false;
    }
    s->bytes += n;
    return true;
}

/* Bytes of a call's items on the wire (n, an upper bound): CTL_ADMIT_TAKEN when they fit in
 * the step, CTL_ADMIT_FULL when they would fit in a step of their own (the call waits for the
 * next step), else the call fails: it could never be sent. */
static ctl_admit admit_bytes(ctl_core *c, ctl_queue *q, const char *op, size_t n) {
    if (n + 2 * CTL_BATCH_BYTES > ctl_msg_budget(c)) {
        pie_status st;
        pie_status_set(&st, PIE_INVALID_ARGUMENT,
                       "%s: the call takes up to %zu bytes in the message to the worker, more "
                       "than server.max_message %llu allows",
                       op, n, (unsigned long long)ctl_msg_max(c));
        return admit_fail(c, q, &st);
    }
    return step_bytes(c, n) ? CTL_ADMIT_TAKEN : CTL_ADMIT_FULL;
}

/* Wire bytes of a call's entry in EmbedTextBatch.call_items / NextDistBatch.call_items (a
 * varint of at most 5 bytes), sent only to a worker that may defer. */
static size_t call_items_bytes(const ctl_worker *w) { return w->defers ? 5 : 0; }

/* Wire bytes of one item in its batch: tag, length, body. */
static size_t item_bytes(const ProtobufCMessage *m) {
    return 6 + protobuf_c_message_get_packed_size(m);
}

static ctl_admit admit(void *user, ctl_sq *sq, int kind) {
    ctl_core *c = user;
    ctl_step *s = &c->step;
    ctl_worker *w = s->w;
    ctl_queue *q = (ctl_queue *)sq; /* sq is the first member */
    ctl_call *call = ctl_queue_head(q);
    const Pie__V1__ApiCall *api = call->api;
    pie_status st;
    ctl_batch *b = s->rec;
    if (b == NULL || s->full) return CTL_ADMIT_FULL;
    ctl_admit fits;
    if (b->n_calls == b->cap_calls) {
        uint32_t cap = b->cap_calls ? b->cap_calls * 2 : 64;
        ctl_batch_call *p = realloc(b->calls, cap * sizeof *p);
        if (p == NULL) return CTL_ADMIT_FULL;
        b->calls = p;
        b->cap_calls = cap;
    }
    const uint32_t P = s->model ? s->model->kv_page_size : 1;
    switch (kind) {
    case CTL_KIND_EMBED: {
        uint32_t n = (uint32_t)api->embed_text->n_embed_ids;
        if (n > w->max_tokens) { /* can never fit: fail it (with its own error, if it has one) */
            if (check_only(c, q, api, &st) == PIE_OK)
                pie_status_set(&st, PIE_INVALID_ARGUMENT,
                               "embed_text: %u tokens exceed the worker's max_batch_tokens %u", n,
                               w->max_tokens);
            return admit_fail(c, q, &st);
        }
        if (s->n_tokens + n > w->max_tokens) return CTL_ADMIT_FULL;
        if ((fits = admit_bytes(c, q, "embed_text", 15 * (size_t)n + call_items_bytes(w))) !=
            CTL_ADMIT_TAKEN)
            return fits;
        if (check_embed(c, q, api, s, &st) != PIE_OK) return admit_fail(c, q, &st);
        /* Same-instance calls of this batch must not write the same embedding. */
        const uint32_t *mine = &s->emb_slots.v[s->emb_slots.n];
        for (int32_t e = conf_first(s, q->inst); e >= 0; e = s->conf[e].next_same)
            for (uint32_t i = 0; i < n; i++)
                if (in_list(&s->emb_slots.v[s->conf[e].item], s->conf[e].n, mine[i]))
                    return CTL_ADMIT_CONFLICT;
        if (conf_add(s, q->inst, s->emb_slots.n, n) == NULL ||
            ctl_vecp_push(&s->emb_calls, call) != 0)
            return CTL_ADMIT_FULL;
        mark_written(q, mine, n);
        s->emb_slots.n += n;
        s->n_tokens += n;
        return admit_take(c, q, n);
    }
    case CTL_KIND_FORWARD: {
        uint32_t n = (uint32_t)api->forward->n_input_embed_ids;
        Pie__V1__ForwardItem *fi = NULL;
        if (n > w->max_tokens) {
            if (check_only(c, q, api, &st) == PIE_OK)
                pie_status_set(&st, PIE_INVALID_ARGUMENT,
                               "forward: %u input tokens exceed the worker's max_batch_tokens %u",
                               n, w->max_tokens);
            return admit_fail(c, q, &st);
        }
        if (s->n_tokens + n > w->max_tokens || s->n_items + 1 > w->max_items) return CTL_ADMIT_FULL;
        if (check_forward(c, q, api, s, &fi, &st) != PIE_OK) return admit_fail(c, q, &st);
        for (int32_t e = conf_first(s, q->inst); e >= 0; e = s->conf[e].next_same)
            if (forward_conflict(s->items.v[s->conf[e].item], fi, P)) return CTL_ADMIT_CONFLICT;
        if ((fits = admit_bytes(c, q, "forward", item_bytes(&fi->base))) != CTL_ADMIT_TAKEN)
            return fits;
        if (conf_add(s, q->inst, (uint32_t)s->items.n, 1) == NULL ||
            ctl_vecp_push(&s->items, fi) != 0)
            return CTL_ADMIT_FULL;
        mark_written(q, fi->output_embed_slots, fi->n_output_embed_slots);
        s->n_tokens += n;
        return admit_take(c, q, 1);
    }
    case CTL_KIND_MASK:
    case CTL_KIND_COPY: {
        if (s->n_items + 1 > w->max_items) return CTL_ADMIT_FULL;
        void *it = NULL;
        pie_code rc = kind == CTL_KIND_MASK
                          ? check_mask_page(c, q, api, s, (Pie__V1__MaskPageItem **)&it, &st)
                          : check_copy(c, q, api, s, (Pie__V1__CopyPageItem **)&it, &st);
        if (rc != PIE_OK) return admit_fail(c, q, &st);
        fits = admit_bytes(c, q, kind == CTL_KIND_MASK ? "mask_kv_page" : "copy_kv_page",
                           item_bytes((const ProtobufCMessage *)it));
        if (fits != CTL_ADMIT_TAKEN) return fits;
        if (ctl_vecp_push(&s->items, it) != 0) return CTL_ADMIT_FULL;
        return admit_take(c, q, 1);
    }
    case CTL_KIND_DIST: {
        uint32_t n = (uint32_t)api->next_dist->n_embed_ids;
        if (n > w->max_items) {
            if (check_only(c, q, api, &st) == PIE_OK)
                pie_status_set(&st, PIE_INVALID_ARGUMENT,
                               "next_dist: %u embed_ids exceed the worker's max_batch_items %u", n,
                               w->max_items);
            return admit_fail(c, q, &st);
        }
        if (s->n_items + n > w->max_items) return CTL_ADMIT_FULL;
        /* The worker answers a batch in one BatchResult (it splits WorkerUps only between
         * batches): the batch's distributions must fit in one message too. */
        size_t rb =
            (size_t)n * (24 + 9 * (size_t)dist_k(ctl_model_info(c, q->model), api->next_dist));
        if (rb + 2 * CTL_BATCH_BYTES > ctl_msg_budget(c)) {
            pie_status_set(&st, PIE_INVALID_ARGUMENT,
                           "next_dist: %u distributions take up to %zu bytes in the worker's "
                           "result, more than server.max_message %llu allows",
                           n, rb, (unsigned long long)ctl_msg_max(c));
            return admit_fail(c, q, &st);
        }
        if (s->result_bytes + rb + 2 * CTL_BATCH_BYTES > ctl_msg_budget(c)) return CTL_ADMIT_FULL;
        if ((fits = admit_bytes(c, q, "next_dist", 32 * (size_t)n + call_items_bytes(w))) !=
            CTL_ADMIT_TAKEN)
            return fits;
        s->result_bytes += rb;
        size_t before = s->items.n;
        if (check_dist(c, q, api, s, &st) != PIE_OK) {
            s->items.n = before;
            return admit_fail(c, q, &st);
        }
        return admit_take(c, q, n);
    }
    default: return CTL_ADMIT_FULL;
    }
}

/* ---- the step ------------------------------------------------------------------------------- */

static ctl_batch *rec_new(ctl_core *c, int kind) {
    ctl_batch *b = ctl_slab_get(&c->s_batches);
    if (b == NULL) return NULL;
    b->next = NULL;
    b->id = 0;
    b->kind = kind;
    b->ends_step = false;
    b->n_items = 0;
    b->n_calls = 0;
    return b;
}

static void rec_put(ctl_core *c, ctl_batch *b) { ctl_slab_put(&c->s_batches, b); }

/* Appends a finished batch to the step. */
static bool step_push(ctl_core *c, Pie__V1__Batch *pb, ctl_batch *rec) {
    ctl_step *s = &c->step;
    if (ctl_vecp_reserve(&s->batches, s->batches.n + 1) != 0 ||
        ctl_vecp_reserve(&s->recs, s->recs.n + 1) != 0)
        return false;
    rec->id = pb->batch_id = ++s->w->next_batch_id;
    s->batches.v[s->batches.n++] = pb;
    s->recs.v[s->recs.n++] = rec;
    return true;
}

/* Copies a u32 list into the arena. */
static uint32_t *dup_u32(ctl_step *s, const uint32_t *v, size_t n) {
    uint32_t *p = arena_u32(s, n);
    if (p && n) memcpy(p, v, n * sizeof *p);
    return p;
}

/* Deferrals of one call after which it fails (ctl_exec.c, "Deferral"): generous against the
 * worker's own bound (8 steps in a row for a request, plus what a dependent waits for). */
#define CTL_DEFER_MAX 64u

/* Most slot changes one step carries (at most 16 bytes each on the wire; the byte budget of
 * the step, ctl_msg_budget, may cut it further). More wait for the next step. */
#define CTL_STEP_MAX_SLOT_CHANGES 65536u

/* The pool's pending slot changes become SlotBatch(es) at the current point of the step: frees
 * first, at most max_batch_items entries per SlotBatch, at most `cap` entries in all. Returns
 * whether everything pending went out. */
static bool flush_changes(ctl_core *c, uint64_t cap) {
    ctl_step *s = &c->step;
    ctl_pool *pool = &s->w->pool;
    if (!ctl_pool_has_changes(pool)) return true;
    ctl_slot_changes *ch = &pool->ch;
    /* The four lists in application order: free kv, free emb, alloc kv, alloc emb. */
    size_t len[4] = {ch->free_kv.n, ch->free_emb.n, ch->n_alloc_kv, ch->alloc_emb.n};
    size_t pos[4] = {0, 0, 0, 0};
    uint32_t max = s->w->max_items;
    uint64_t budget = cap;
    int list = 0;
    while (list < 4 && budget > 0) {
        Pie__V1__Batch *pb = ctl_arena_alloc(&s->arena, sizeof *pb);
        Pie__V1__SlotBatch *sb = ctl_arena_alloc(&s->arena, sizeof *sb);
        ctl_batch *rec = rec_new(c, CTL_KIND_NONE);
        if (!pb || !sb || !rec) {
            rec_put(c, rec);
            pie_log_error("ctl.step.oom", "worker_index=%u what=slot_batch", s->w->index);
            break; /* what was not sent stays pending */
        }
        pie__v1__batch__init(pb);
        pie__v1__slot_batch__init(sb);
        uint32_t room = budget < max ? (uint32_t)budget : max;
        size_t lim = ctl_msg_budget(c), used = s->bytes + CTL_BATCH_BYTES;
        size_t fit = used < lim ? (lim - used) / CTL_SLOT_CHANGE_BYTES : 0;
        if (fit < room) room = (uint32_t)fit;
        if (room == 0) { /* the step is full: the rest goes out with the next one */
            rec_put(c, rec);
            s->full = true;
            break;
        }
        bool oom = false;
        for (; list < 4 && room > 0 && !oom; list += pos[list] == len[list]) {
            size_t k = len[list] - pos[list];
            if (k > room) k = room;
            if (k == 0) continue;
            switch (list) {
            case 0:
                sb->free_kv_slots = dup_u32(s, ch->free_kv.v + pos[0], k);
                sb->n_free_kv_slots = k;
                oom = sb->free_kv_slots == NULL;
                break;
            case 1:
                sb->free_embed_slots = dup_u32(s, ch->free_emb.v + pos[1], k);
                sb->n_free_embed_slots = k;
                oom = sb->free_embed_slots == NULL;
                break;
            case 2: {
                uint32_t *sl = arena_u32(s, k);
                uint64_t *ow = ctl_arena_alloc(&s->arena, k * sizeof *ow);
                oom = sl == NULL || ow == NULL;
                if (oom) break;
                for (size_t i = 0; i < k; i++) {
                    sl[i] = ch->alloc_kv[pos[2] + i].slot;
                    ow[i] = ch->alloc_kv[pos[2] + i].owner;
                }
                sb->alloc_kv_slots = sl;
                sb->alloc_kv_owners = ow;
                sb->n_alloc_kv_slots = sb->n_alloc_kv_owners = k;
                break;
            }
            case 3:
                sb->alloc_embed_slots = dup_u32(s, ch->alloc_emb.v + pos[3], k);
                sb->n_alloc_embed_slots = k;
                oom = sb->alloc_embed_slots == NULL;
                break;
            }
            if (oom) break;
            pos[list] += k;
            room -= (uint32_t)k;
            budget -= k;
        }
        if (oom) { /* this SlotBatch's last list did not fit: send what it holds before */
            pie_log_error("ctl.step.oom", "worker_index=%u what=slot_batch", s->w->index);
            switch (list) {
            case 0: sb->n_free_kv_slots = 0; break;
            case 1: sb->n_free_embed_slots = 0; break;
            case 2: sb->n_alloc_kv_slots = sb->n_alloc_kv_owners = 0; break;
            default: sb->n_alloc_embed_slots = 0; break;
            }
            budget = 0;
        }
        pb->kind_case = PIE__V1__BATCH__KIND_SLOTS;
        pb->slots = sb;
        s->bytes += CTL_BATCH_BYTES +
                    CTL_SLOT_CHANGE_BYTES * (sb->n_free_kv_slots + sb->n_free_embed_slots +
                                             sb->n_alloc_kv_slots + sb->n_alloc_embed_slots);
        if (!step_push(c, pb, rec)) {
            rec_put(c, rec);
            pie_log_error("ctl.step.oom", "worker_index=%u what=slot_batch", s->w->index);
            break;
        }
    }
    ctl_pool_changes_sent(pool, (uint32_t)pos[0], (uint32_t)pos[1], (uint32_t)pos[2],
                          (uint32_t)pos[3]);
    return !ctl_pool_has_changes(pool);
}

static void on_open(void *user, int kind) {
    ctl_core *c = user;
    ctl_step *s = &c->step;
    /* Slot changes so far precede this batch; if they do not all fit, no batch may follow
     * them in this step (admit refuses while the step is full). */
    if (!flush_changes(c, UINT64_MAX)) s->full = true;
    if (!s->full) s->full = !step_bytes(c, CTL_BATCH_BYTES);
    s->kind = kind;
    s->rec = rec_new(c, kind);
    s->items.n = 0;
    s->emb_slots.n = 0;
    s->emb_calls.n = 0;
    s->n_items = s->n_tokens = 0;
    s->result_bytes = 0;
    s->n_conf = 0;
    s->serial = ++c->batch_serial;
}

/* To a worker that may defer: the items of each call of rec, in order (a worker defers a call
 * whole: EmbedTextBatch.call_items). *n ← 0 and NULL for another worker; false when out of
 * memory. */
static bool call_items(ctl_step *s, const ctl_batch *rec, uint32_t **v, size_t *n) {
    *v = NULL;
    *n = 0;
    if (!s->w->defers) return true;
    if ((*v = arena_u32(s, rec->n_calls)) == NULL) return false;
    for (uint32_t i = 0; i < rec->n_calls; i++) (*v)[i] = rec->calls[i].n_items;
    *n = rec->n_calls;
    return true;
}

/* The Batch message of the batch just formed (its calls: rec). */
static Pie__V1__Batch *build_batch(ctl_core *c, int kind, const ctl_batch *rec) {
    ctl_step *s = &c->step;
    Pie__V1__Batch *pb = ctl_arena_alloc(&s->arena, sizeof *pb);
    if (pb == NULL) return NULL;
    pie__v1__batch__init(pb);
    size_t n = s->items.n;
    void **items = NULL;
    if (kind != CTL_KIND_EMBED) {
        items = ctl_arena_alloc(&s->arena, (n ? n : 1) * sizeof *items);
        if (items == NULL) return NULL;
        if (n) memcpy(items, s->items.v, n * sizeof *items);
    }
    switch (kind) {
    case CTL_KIND_EMBED: {
        Pie__V1__EmbedTextBatch *eb = ctl_arena_alloc(&s->arena, sizeof *eb);
        uint32_t total = s->emb_slots.n;
        uint32_t *slots = dup_u32(s, s->emb_slots.v, total);
        uint32_t *toks = arena_u32(s, total), *pos = arena_u32(s, total);
        if (!eb || !slots || !toks || !pos) return NULL;
        pie__v1__embed_text_batch__init(eb);
        if (!call_items(s, rec, &eb->call_items, &eb->n_call_items)) return NULL;
        uint32_t at = 0;
        for (size_t i = 0; i < s->emb_calls.n; i++) {
            const Pie__V1__EmbedText *e = ((ctl_call *)s->emb_calls.v[i])->api->embed_text;
            memcpy(toks + at, e->token_ids, e->n_token_ids * sizeof *toks);
            memcpy(pos + at, e->positions, e->n_positions * sizeof *pos);
            at += (uint32_t)e->n_token_ids;
        }
        eb->embed_slots = slots;
        eb->n_embed_slots = total;
        eb->token_ids = toks;
        eb->n_token_ids = total;
        eb->positions = pos;
        eb->n_positions = total;
        pb->kind_case = PIE__V1__BATCH__KIND_EMBED_TEXT;
        pb->embed_text = eb;
        break;
    }
    case CTL_KIND_FORWARD: {
        Pie__V1__ForwardBatch *fb = ctl_arena_alloc(&s->arena, sizeof *fb);
        if (fb == NULL) return NULL;
        pie__v1__forward_batch__init(fb);
        fb->items = (Pie__V1__ForwardItem **)items;
        fb->n_items = n;
        pb->kind_case = PIE__V1__BATCH__KIND_FORWARD;
        pb->forward = fb;
        break;
    }
    case CTL_KIND_MASK: {
        Pie__V1__MaskPageBatch *mb = ctl_arena_alloc(&s->arena, sizeof *mb);
        if (mb == NULL) return NULL;
        pie__v1__mask_page_batch__init(mb);
        mb->items = (Pie__V1__MaskPageItem **)items;
        mb->n_items = n;
        pb->kind_case = PIE__V1__BATCH__KIND_MASK_PAGE;
        pb->mask_page = mb;
        break;
    }
    case CTL_KIND_COPY: {
        Pie__V1__CopyPageBatch *cb = ctl_arena_alloc(&s->arena, sizeof *cb);
        if (cb == NULL) return NULL;
        pie__v1__copy_page_batch__init(cb);
        cb->items = (Pie__V1__CopyPageItem **)items;
        cb->n_items = n;
        pb->kind_case = PIE__V1__BATCH__KIND_COPY_PAGE;
        pb->copy_page = cb;
        break;
    }
    case CTL_KIND_DIST: {
        Pie__V1__NextDistBatch *db = ctl_arena_alloc(&s->arena, sizeof *db);
        if (db == NULL) return NULL;
        pie__v1__next_dist_batch__init(db);
        if (!call_items(s, rec, &db->call_items, &db->n_call_items)) return NULL;
        db->items = (Pie__V1__NextDistItem **)items;
        db->n_items = n;
        pb->kind_case = PIE__V1__BATCH__KIND_NEXT_DIST;
        pb->next_dist = db;
        break;
    }
    default: return NULL;
    }
    return pb;
}

/* Fails every call of a batch that cannot be sent (out of memory). */
static void fail_batch_calls(ctl_core *c, ctl_batch *b, pie_code code, const char *msg) {
    for (uint32_t i = 0; i < b->n_calls; i++) {
        ctl_call *call = b->calls[i].call;
        if (call->q) ctl_queue_done(call, code, msg);
        ctl_core_completed(c, call);
    }
    b->n_calls = 0;
}

static void on_close(void *user, int kind, uint32_t n_taken) {
    ctl_core *c = user;
    ctl_step *s = &c->step;
    ctl_batch *rec = s->rec;
    s->rec = NULL;
    s->kind = CTL_KIND_NONE;
    if (rec == NULL) return;
    if (n_taken == 0) {
        rec_put(c, rec);
        return;
    }
    Pie__V1__Batch *pb = build_batch(c, kind, rec);
    if (pb == NULL || !step_push(c, pb, rec)) {
        fail_batch_calls(c, rec, PIE_RESOURCE_EXHAUSTED,
                         "controller: out of memory forming a batch");
        rec_put(c, rec);
    }
}

static void on_settle(void *user) {
    ctl_core *c = user;
    ctl_worker *w = c->step.w;
    while (w->settle) {
        ctl_queue *q = w->settle;
        w->settle = q->settle_next;
        q->settle_next = NULL;
        q->in_settle = false;
        if (!q->dead) ctl_core_advance(c, q);
    }
}

static const ctl_sched_ops sched_ops = {
    .open = on_open, .admit = admit, .close = on_close, .settle = on_settle};

static void step_reset(ctl_step *s) {
    ctl_arena_reset(&s->arena);
    s->bytes = 0;
    s->full = false;
    s->batches.n = 0;
    s->recs.n = 0;
    s->w = NULL;
    s->rec = NULL;
    s->kind = CTL_KIND_NONE;
}

/* work_conserving over a network. The paper's policy dispatches a batch the moment the GPU is
 * idle (seeds/001 §6.1); its dispatcher sits next to the GPU. Here a step travels controller →
 * worker and its results back, so a step formed only once the previous one's results have
 * arrived leaves the worker idle for that round trip on every step. So the controller keeps
 * at most CTL_WC_STEPS steps on a worker — the one running and the next — and forms the next
 * one as late as it can while still reaching the worker before the running one ends: at the
 * running step's start plus 3/4 of the recent step execution time. The start, as the
 * controller sees it, is the step's send time, or the arrival of the previous step's results
 * when it was sent while that one ran (it queued on the worker until then); the one-way delay
 * is on both sides of the sum and cancels, and the quarter is the margin against a step running
 * shorter than average. Timing from the send time alone fired a queued step's successor at
 * once, splitting the instances into ever more, smaller steps. Calls arriving while the worker computes join that step instead of
 * waiting a whole step behind it. Steps shorter than CTL_WC_HOLD_MIN_NS (the null backend, a
 * tiny batch) are not held: a timer wake-up costs about as much as it could gather. */
#define CTL_WC_STEPS       2u
#define CTL_WC_HOLD_MIN_NS 300000

/* Whether w may be sent a step now: never beyond the credits the worker grants (with its
 * default of one credit every strategy sends only to an idle worker); work_conserving as above
 * (w->hold_ns gets the time it waits for); the other strategies fire on their own conditions,
 * bounded only by the credits. */
static bool may_send(const ctl_core *c, ctl_worker *w) {
    w->hold_ns = 0;
    if (w->credits == 0 || w->draining) return false;
    if (c->cfg.sched.strategy != CTL_STRATEGY_WORK_CONSERVING) return true;
    if (w->steps_out == 0) return true;
    if (w->steps_out >= CTL_WC_STEPS || w->out == NULL) return false;
    int64_t est = w->exec_avg_ns;
    if (est < CTL_WC_HOLD_MIN_NS) return true;
    int64_t start = w->out->sent_ns > w->step_done_ns ? w->out->sent_ns : w->step_done_ns;
    int64_t due = start + est - est / 4;
    if (c->now_ns >= due) return true;
    w->hold_ns = due;
    return false;
}

/* ---- Deferral ----------------------------------------------------------------------------------
 *
 * A worker that registered may_defer (and got defer_ok) may answer an item ItemResult.deferred:
 * not run at all, offered again. It defers whole calls, and with a call every later item of the
 * same step that depends on it through a page or an embedding (services/worker/wrk_dep.h), so
 * what ran never depends on what did not. What the controller adds:
 *  * a deferred call goes back to the front of its queue (ctl_queue_defer: the redo list, before
 *    every call never taken, in issue order; it keeps its place in the completion FIFO, so
 *    results still come in issue order) and is offered in a later step to the same worker (an
 *    instance's objects of a model live on one worker) — validated and mapped again when taken,
 *    like any call;
 *  * one step at a time per queue: once a step is sent, its queues are held (ctl_queue.held):
 *    none of their calls joins a later step, and their controller calls (alloc, dealloc,
 *    export, ...; not synchronize, which retires in order anyway) wait, until every call of
 *    theirs in flight is answered. Otherwise a call taken into the next step, or a dealloc of a
 *    page a deferred forward writes, could overtake a call the worker defers. Calls of one step
 *    still batch vertically. The price: a queue whose consecutive calls did not fit in one step
 *    waits a round trip between them (a decode loop, whose next call needs the previous result,
 *    never does);
 *  * a next_dist done behind a deferred call of its queue runs again (its distributions live
 *    only in the WorkerUp being processed, and it only reads);
 *  * a bound: a call deferred more than CTL_DEFER_MAX times fails INTERNAL. The worker's own
 *    rule runs a request deferred WRK_OFF_DEFER_MAX (8) steps in a row at its next step, and a
 *    dependent waits for what it depends on, so a correct worker stays far below it; a worker
 *    that defers forever costs its instances an error, not a livelock.
 * A worker that did not register may_defer and answers deferred breaks the contract: its link
 * ends (INVALID_ARGUMENT). */

bool ctl_exec_ctrl_waits(const ctl_queue *q, const ctl_call *call) {
    /* synchronize need not wait: it completes when it retires, after every call before it in
     * the completion FIFO — deferred ones included. The SDK issues one between a step's
     * forward and its next_dist: waiting would split every decode over two steps. */
    if (call->kind != CTL_KIND_CTRL || call->api->op_case == PIE__V1__API_CALL__OP_SYNCHRONIZE)
        return false;
    return q->n_inflight > 0 && q->place && q->place->w->defers;
}

/* Holds every queue with a call in the step just sent (its worker may defer). */
static void hold_step_queues(ctl_step *s) {
    for (size_t i = 0; i < s->recs.n; i++) {
        const ctl_batch *b = s->recs.v[i];
        for (uint32_t k = 0; k < b->n_calls; k++) {
            ctl_queue *q = b->calls[k].call->q;
            if (q == NULL || q->held) continue;
            q->held = true;
            if (q->sched) ctl_sched_unready(q->sched, &q->sq);
            q->sched = NULL;
        }
    }
}

/* q's last in-flight call was answered: if it was held, advance it once the WorkerUp is
 * processed (ctl_exec_wake; the worker's settle list is empty outside batch forming). */
static void wake_later(ctl_worker *w, ctl_queue *q) {
    if (q->dead || !q->held || q->n_inflight > 0 || q->in_settle) return;
    q->in_settle = true;
    q->settle_next = w->settle;
    w->settle = q;
}

void ctl_exec_wake(ctl_core *c, ctl_worker *w) {
    while (w->settle) {
        ctl_queue *q = w->settle;
        w->settle = q->settle_next;
        q->settle_next = NULL;
        q->in_settle = false;
        if (q->dead || q->n_inflight > 0) continue;
        q->held = false;
        ctl_core_advance(c, q);
    }
}

void ctl_exec_dispatch(ctl_core *c, ctl_worker *w) {
    ctl_step *s = &c->step;
    while (may_send(c, w)) {
        step_reset(s);
        s->w = w;
        s->model = ctl_model_info(c, w->model);
        int64_t wake = 0;
        uint32_t formed = 0;
        if (ctl_pool_changes_count(&w->pool) > CTL_STEP_MAX_SLOT_CHANGES) {
            /* A backlog of slot changes (mass allocation while the worker was busy): send it
             * in bounded steps before any batch that could depend on it. */
            flush_changes(c, CTL_STEP_MAX_SLOT_CHANGES);
        } else {
            formed = ctl_sched_step(&w->sched, c->now_ns, &sched_ops, c, &wake);
            w->wake_ns = wake;
            flush_changes(c, UINT64_MAX); /* whatever the last batches' controller calls changed */
        }
        if (s->batches.n == 0) break;
        Pie__V1__WorkerDown down = PIE__V1__WORKER_DOWN__INIT;
        down.n_batches = s->batches.n;
        down.batches = (Pie__V1__Batch **)s->batches.v;
        c->sink.to_worker(c->sink.user, w->link, &down);
        uint64_t items = 0;
        ((ctl_batch *)s->recs.v[s->recs.n - 1])->ends_step = true;
        w->steps_out++;
        for (size_t i = 0; i < s->recs.n; i++) {
            ctl_batch *b = s->recs.v[i];
            b->sent_ns = c->now_ns;
            items += b->n_items;
            if (b->n_items) pie_histogram_observe(c->m_batch_size, b->n_items);
            if (w->out_tail)
                w->out_tail->next = b;
            else
                w->out = b;
            w->out_tail = b;
            w->n_out++;
        }
        if (w->defers) hold_step_queues(s);
        w->credits--;
        w->steps++;
        w->batches_sent += s->batches.n;
        if (c->m_steps) pie_counter_add(c->m_steps, 1);
        if (c->m_batches) pie_counter_add(c->m_batches, s->batches.n);
        if (c->m_items) pie_counter_add(c->m_items, items);
        if (formed == 0) break; /* only slot changes went out */
    }
    step_reset(s);
}

/* ---- results ------------------------------------------------------------------------------- */

void ctl_exec_batch_free(ctl_core *c, ctl_batch *b) {
    for (uint32_t i = 0; i < b->n_calls; i++) {
        ctl_call *call = b->calls[i].call;
        if (call->q == NULL) ctl_core_call_free(c, call);
    }
    b->n_calls = 0;
    rec_put(c, b);
}

/* A call's items in r (from at, n of them): how many the worker deferred. */
static uint32_t deferred_items(const Pie__V1__BatchResult *r, uint32_t at, uint32_t n) {
    uint32_t d = 0;
    for (uint32_t k = at; k < at + n && k < r->n_items; k++) d += r->items[k]->deferred;
    return d;
}

/* A result may carry deferred items only from a worker that may defer, and never for a slot
 * batch (slot changes are not deferred). */
static bool deferrals_allowed(const ctl_worker *w, const ctl_batch *b,
                              const Pie__V1__BatchResult *r, pie_status *st) {
    if (r->code != 0 || deferred_items(r, 0, (uint32_t)r->n_items) == 0) return true;
    if (!w->defers)
        pie_status_set(st, PIE_INVALID_ARGUMENT,
                       "WorkerLink: batch %llu has deferred items, but the worker's registration "
                       "did not say may_defer",
                       (unsigned long long)r->batch_id);
    else if (b->kind == CTL_KIND_NONE)
        pie_status_set(st, PIE_INVALID_ARGUMENT,
                       "WorkerLink: batch %llu is a slot batch, whose items are never deferred",
                       (unsigned long long)r->batch_id);
    else
        return true;
    return false;
}

/* The worker deferred every item of call: it goes back to its queue's front, or fails once it
 * was deferred more than CTL_DEFER_MAX times. */
static void take_back(ctl_core *c, ctl_worker *w, ctl_call *call, const char *kname) {
    if (call->deferrals < CTL_DEFER_MAX) {
        ctl_queue_defer(call);
        if (c->m_deferred) pie_counter_add(c->m_deferred, 1);
        return;
    }
    char msg[PIE_STATUS_MSG_MAX];
    snprintf(msg, sizeof msg,
             "%s: worker %s deferred this call %u times without running it (a worker runs a "
             "deferred call within a few steps); giving up",
             kname, w->reg->group_id, call->deferrals + 1);
    pie_log_warn("ctl.worker.defer_bound", "worker_index=%u group=%s call_kind=%s deferrals=%u",
                 w->index, w->reg->group_id, kname, call->deferrals + 1);
    if (c->m_defer_failed) pie_counter_add(c->m_defer_failed, 1);
    ctl_queue_done(call, PIE_INTERNAL, msg);
}

bool ctl_exec_result(ctl_core *c, ctl_worker *w, Pie__V1__BatchResult *r, pie_status *st) {
    ctl_batch *b = w->out;
    if (b == NULL) {
        pie_status_set(st, PIE_INVALID_ARGUMENT,
                       "WorkerLink: result for batch %llu, but no batch is outstanding",
                       (unsigned long long)r->batch_id);
        return false;
    }
    if (r->batch_id != b->id) {
        pie_status_set(st, PIE_INVALID_ARGUMENT,
                       "WorkerLink: result for batch %llu, expected batch %llu (results come in "
                       "batch order)",
                       (unsigned long long)r->batch_id, (unsigned long long)b->id);
        return false;
    }
    if (!deferrals_allowed(w, b, r, st)) return false;
    w->out = b->next;
    if (w->out == NULL) w->out_tail = NULL;
    w->n_out--;
    w->step_exec_us += r->exec_us;
    if (b->ends_step) {
        if (w->steps_out) w->steps_out--;
        w->step_done_ns = c->now_ns;
        /* Moving average of a step's execution time (work_conserving's timing). */
        int64_t t = (int64_t)w->step_exec_us * 1000;
        w->exec_avg_ns = w->exec_avg_ns ? (3 * w->exec_avg_ns + t) / 4 : t;
        w->step_exec_us = 0;
    }
    const char *kname = ctl_kind_name(b->kind);
    char msg[PIE_STATUS_MSG_MAX];
    if (b->kind == CTL_KIND_NONE && (r->code != 0 || r->n_items)) {
        for (size_t i = 0; i < r->n_items; i++) {
            if (r->items[i]->code == 0) continue;
            pie_log_error("ctl.worker.slot_failed",
                          "worker_index=%u batch=%llu item=%zu code=%s "
                          "error=\"%s\"",
                          w->index, (unsigned long long)b->id, i,
                          pie_code_name((int)r->items[i]->code), r->items[i]->message);
            break;
        }
        if (r->code)
            pie_log_error("ctl.worker.slot_failed",
                          "worker_index=%u batch=%llu code=%s error=\"%s\"", w->index,
                          (unsigned long long)b->id, pie_code_name((int)r->code), r->message);
    }
    uint32_t fail_code = 0;
    if (r->code != 0) {
        fail_code = r->code;
        snprintf(msg, sizeof msg, "%s",
                 r->message && r->message[0] ? r->message : "worker: batch failed");
    } else if (r->n_items == 0 && b->kind == CTL_KIND_DIST) {
        fail_code = PIE_INTERNAL;
        snprintf(msg, sizeof msg, "next_dist: worker %s returned no distributions",
                 w->reg->group_id);
    } else if (r->n_items != 0 && r->n_items != b->n_items) {
        fail_code = PIE_INTERNAL;
        snprintf(msg, sizeof msg, "%s: worker %s returned %zu item results for a batch of %u items",
                 kname, w->reg->group_id, r->n_items, b->n_items);
    }
    uint32_t at = 0;
    for (uint32_t i = 0; i < b->n_calls; i++) {
        ctl_call *call = b->calls[i].call;
        uint32_t n = b->calls[i].n_items;
        /* The call may be freed by ctl_core_completed; a held queue is not (its destroy_queue
         * waits behind its calls in flight), so only a held queue is looked at after it. */
        ctl_queue *q = call->q;
        ctl_queue *held = q && q->held ? q : NULL;
        uint32_t n_def = fail_code || r->n_items == 0 ? 0 : deferred_items(r, at, n);
        if (q && n_def == 0 && !fail_code && b->kind == CTL_KIND_DIST && q->redo &&
            q->redo->seq < call->seq)
            n_def = n; /* behind a deferred call: its distributions would have to outlive this
                          message until that one ran; it only reads, so it runs again instead */
        if (q && n_def > 0 && n_def == n) {
            take_back(c, w, call, kname);
            at += n;
            if (call->state == CTL_CALL_DONE) ctl_core_completed(c, call);
            if (held) wake_later(w, held);
            continue;
        }
        if (q) {
            if (fail_code) {
                ctl_queue_done(call, fail_code, msg);
            } else if (r->n_items == 0) {
                ctl_queue_done(call, 0, NULL);
            } else if (n_def) { /* the contract defers calls whole */
                char part[PIE_STATUS_MSG_MAX];
                snprintf(part, sizeof part,
                         "%s: worker %s deferred %u of the call's %u items (it must defer a call "
                         "whole)",
                         kname, w->reg->group_id, n_def, n);
                ctl_queue_done(call, PIE_INTERNAL, part);
            } else {
                uint32_t code = 0;
                const char *m = NULL;
                for (uint32_t k = at; k < at + n && code == 0; k++) {
                    const Pie__V1__ItemResult *it = r->items[k];
                    if (it->code) {
                        code = it->code;
                        m = it->message && it->message[0] ? it->message : "worker: item failed";
                    } else if (b->kind == CTL_KIND_DIST && it->distribution == NULL) {
                        code = PIE_INTERNAL;
                        snprintf(msg, sizeof msg,
                                 "next_dist: worker %s returned no distribution "
                                 "for item %u",
                                 w->reg->group_id, k);
                        m = msg;
                    }
                }
                if (code == 0 && b->kind == CTL_KIND_DIST) {
                    call->items = &r->items[at];
                    call->n_items = n;
                    call->has_result = true;
                }
                ctl_queue_done(call, code, m);
            }
        }
        at += n;
        ctl_core_completed(c, call);
        if (held) wake_later(w, held);
    }
    b->n_calls = 0;
    rec_put(c, b);
    return true;
}

static void batch_dtor(void *obj) {
    ctl_batch *b = obj;
    free(b->calls);
}

void ctl_exec_step_free(ctl_step *s) {
    ctl_arena_free(&s->arena);
    ctl_vecp_free(&s->batches);
    ctl_vecp_free(&s->recs);
    ctl_vecp_free(&s->items);
    ctl_vec32_free(&s->emb_slots);
    ctl_vecp_free(&s->emb_calls);
    free(s->conf);
    memset(s, 0, sizeof *s);
}

void ctl_exec_free_batches(ctl_slab *s) { ctl_slab_free_each(s, batch_dtor); }
