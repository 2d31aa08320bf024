/* ctl_vspace.c — see ctl_vspace.h. */
#include "ctl_vspace.h"

#include <stdlib.h>
#include <stdio.h>
#include <string.h>

/* ---- pool ---------------------------------------------------------------------------------- */

pie_code ctl_pool_init(ctl_pool *p, uint32_t kv_max, uint32_t kv_effective, uint32_t emb_slots,
                       pie_status *st) {
    memset(p, 0, sizeof *p);
    p->kv_max = kv_max;
    p->kv_effective = kv_effective < kv_max ? kv_effective : kv_max;
    p->emb_max = emb_slots;
    p->kv_refs = calloc(kv_max ? kv_max : 1, sizeof *p->kv_refs);
    p->kv_free = malloc((kv_max ? kv_max : 1) * sizeof *p->kv_free);
    p->kv_pending_at = calloc(kv_max ? kv_max : 1, sizeof *p->kv_pending_at);
    p->emb_free = malloc((emb_slots ? emb_slots : 1) * sizeof *p->emb_free);
    p->emb_pending_at = calloc(emb_slots ? emb_slots : 1, sizeof *p->emb_pending_at);
    p->emb_written = calloc(emb_slots ? emb_slots : 1, 1);
    if (!p->kv_refs || !p->kv_free || !p->kv_pending_at || !p->emb_free || !p->emb_pending_at ||
        !p->emb_written) {
        ctl_pool_destroy(p);
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "controller: out of memory for a pool of %u KV slots", kv_max);
    }
    return PIE_OK;
}

void ctl_pool_destroy(ctl_pool *p) {
    free(p->kv_refs);
    free(p->kv_free);
    free(p->kv_pending_at);
    free(p->emb_free);
    free(p->emb_pending_at);
    free(p->emb_written);
    free(p->ch.alloc_kv);
    ctl_vec32_free(&p->ch.free_kv);
    ctl_vec32_free(&p->ch.alloc_emb);
    ctl_vec32_free(&p->ch.free_emb);
    memset(p, 0, sizeof *p);
}

uint32_t ctl_pool_kv_available(const ctl_pool *p) {
    return p->kv_used >= p->kv_effective ? 0 : p->kv_effective - p->kv_used;
}

uint32_t ctl_pool_emb_available(const ctl_pool *p) { return p->emb_max - p->emb_used; }

uint32_t ctl_pool_kv_refs(const ctl_pool *p, uint32_t slot) {
    return slot < p->kv_max ? p->kv_refs[slot] : 0;
}

/* Room for n more entries in each change list, so that recording cannot fail midway. */
static int changes_reserve(ctl_pool *p, uint32_t kv_allocs, uint32_t kv_frees, uint32_t emb_allocs,
                           uint32_t emb_frees) {
    ctl_slot_changes *c = &p->ch;
    if (c->n_alloc_kv + kv_allocs > c->cap_alloc_kv) {
        uint32_t cap = c->cap_alloc_kv ? c->cap_alloc_kv : 64;
        while (cap < c->n_alloc_kv + kv_allocs) cap *= 2;
        ctl_kv_alloc *a = realloc(c->alloc_kv, (size_t)cap * sizeof *a);
        if (a == NULL) return -1;
        c->alloc_kv = a;
        c->cap_alloc_kv = cap;
    }
    if (ctl_vec32_reserve(&c->free_kv, c->free_kv.n + kv_frees) != 0) return -1;
    if (ctl_vec32_reserve(&c->alloc_emb, c->alloc_emb.n + emb_allocs) != 0) return -1;
    if (ctl_vec32_reserve(&c->free_emb, c->free_emb.n + emb_frees) != 0) return -1;
    return 0;
}

/* A fresh live KV slot with one reference (room in ch reserved by the caller). */
static uint32_t kv_take(ctl_pool *p, uint64_t owner) {
    uint32_t s = p->kv_nfree ? p->kv_free[--p->kv_nfree] : p->kv_next++;
    p->kv_refs[s] = 1;
    p->kv_used++;
    p->kv_refs_total++;
    p->ch.alloc_kv[p->ch.n_alloc_kv++] = (ctl_kv_alloc){s, owner};
    p->kv_pending_at[s] = p->ch.n_alloc_kv;
    return s;
}

/* Removes slot's pending alloc from ch; true if it was there. O(1): a call that frees pages it
 * has just allocated (a block of 256, say) must not cost a scan and a shift per page. */
static bool kv_unpend(ctl_pool *p, uint32_t s) {
    uint32_t at = p->kv_pending_at[s];
    if (at == 0) return false;
    p->kv_pending_at[s] = 0;
    ctl_slot_changes *c = &p->ch;
    uint32_t last = --c->n_alloc_kv;
    if (at - 1 != last) {
        c->alloc_kv[at - 1] = c->alloc_kv[last];
        p->kv_pending_at[c->alloc_kv[at - 1].slot] = at;
    }
    return true;
}

void ctl_pool_kv_ref(ctl_pool *p, uint32_t slot) {
    if (p->kv_refs[slot] == 1) p->kv_shared++;
    p->kv_refs[slot]++;
    p->kv_refs_total++;
}

void ctl_pool_kv_unref(ctl_pool *p, uint32_t slot) {
    uint32_t r = --p->kv_refs[slot];
    p->kv_refs_total--;
    if (r == 1) p->kv_shared--;
    if (r != 0) return;
    p->kv_used--;
    p->kv_free[p->kv_nfree++] = slot;
    /* A slot the worker never heard of needs no free. If memory for the free entry is short,
     * the worker keeps a stale slot live; the next alloc of this slot is harmless (SlotBatch
     * allocs of live slots reset them). */
    if (!kv_unpend(p, slot) && changes_reserve(p, 0, 1, 0, 0) == 0)
        p->ch.free_kv.v[p->ch.free_kv.n++] = slot;
}

static uint32_t emb_take(ctl_pool *p) {
    uint32_t s = p->emb_nfree ? p->emb_free[--p->emb_nfree] : p->emb_next++;
    p->emb_used++;
    p->emb_written[s] = 0;
    p->ch.alloc_emb.v[p->ch.alloc_emb.n++] = s;
    p->emb_pending_at[s] = p->ch.alloc_emb.n;
    return s;
}

/* Removes slot's pending alloc from ch (O(1), as kv_unpend); true if it was there. */
static bool emb_unpend(ctl_pool *p, uint32_t s) {
    uint32_t at = p->emb_pending_at[s];
    if (at == 0) return false;
    p->emb_pending_at[s] = 0;
    ctl_vec32 *a = &p->ch.alloc_emb;
    uint32_t last = --a->n;
    if (at - 1 != last) {
        a->v[at - 1] = a->v[last];
        p->emb_pending_at[a->v[at - 1]] = at;
    }
    return true;
}

static void emb_release(ctl_pool *p, uint32_t s) {
    p->emb_used--;
    p->emb_free[p->emb_nfree++] = s;
    if (!emb_unpend(p, s) && changes_reserve(p, 0, 0, 0, 1) == 0)
        p->ch.free_emb.v[p->ch.free_emb.n++] = s;
}

bool ctl_pool_has_changes(const ctl_pool *p) {
    const ctl_slot_changes *c = &p->ch;
    return c->n_alloc_kv || c->free_kv.n || c->alloc_emb.n || c->free_emb.n;
}

static void vec_drop_front(ctl_vec32 *v, uint32_t k) {
    if (k >= v->n) {
        v->n = 0;
        return;
    }
    memmove(v->v, v->v + k, (size_t)(v->n - k) * sizeof v->v[0]);
    v->n -= k;
}

void ctl_pool_changes_sent(ctl_pool *p, uint32_t free_kv, uint32_t free_emb, uint32_t alloc_kv,
                           uint32_t alloc_emb) {
    ctl_slot_changes *c = &p->ch;
    if (alloc_kv > c->n_alloc_kv) alloc_kv = c->n_alloc_kv;
    if (alloc_emb > c->alloc_emb.n) alloc_emb = c->alloc_emb.n;
    for (uint32_t i = 0; i < alloc_kv; i++) p->kv_pending_at[c->alloc_kv[i].slot] = 0;
    for (uint32_t i = 0; i < alloc_emb; i++) p->emb_pending_at[c->alloc_emb.v[i]] = 0;
    if (alloc_kv && c->n_alloc_kv > alloc_kv) {
        memmove(c->alloc_kv, c->alloc_kv + alloc_kv,
                (size_t)(c->n_alloc_kv - alloc_kv) * sizeof c->alloc_kv[0]);
        for (uint32_t i = 0; i < c->n_alloc_kv - alloc_kv; i++)
            p->kv_pending_at[c->alloc_kv[i].slot] = i + 1;
    }
    c->n_alloc_kv -= alloc_kv;
    vec_drop_front(&c->alloc_emb, alloc_emb);
    for (uint32_t i = 0; alloc_emb && i < c->alloc_emb.n; i++)
        p->emb_pending_at[c->alloc_emb.v[i]] = i + 1;
    vec_drop_front(&c->free_kv, free_kv);
    vec_drop_front(&c->free_emb, free_emb);
}

uint64_t ctl_pool_changes_count(const ctl_pool *p) {
    const ctl_slot_changes *c = &p->ch;
    return (uint64_t)c->n_alloc_kv + c->free_kv.n + c->alloc_emb.n + c->free_emb.n;
}

void ctl_pool_changes_clear(ctl_pool *p) {
    ctl_slot_changes *c = &p->ch;
    for (uint32_t i = 0; i < c->n_alloc_kv; i++) p->kv_pending_at[c->alloc_kv[i].slot] = 0;
    for (uint32_t i = 0; i < c->alloc_emb.n; i++) p->emb_pending_at[c->alloc_emb.v[i]] = 0;
    c->n_alloc_kv = 0;
    c->free_kv.n = c->alloc_emb.n = c->free_emb.n = 0;
}

/* ---- id lists ------------------------------------------------------------------------------ */

/* The first id, in list order, that repeats an earlier one, or -1 (OOM counts as none: the maps
 * catch duplicates anyway). Runs for every id list of every call — a forward's context pages
 * among them, hundreds at long contexts, every step — so it is linear: pairwise for short lists,
 * else an open-addressing set of twice the list's size (id + 1 stored: 0 marks a free cell), on
 * the stack up to 512 ids. Not a ctl_map32: its heap table and extra probe cost ~4 ns more per
 * id (the call flood's controller CPU: 168-207 ms against 127-138, flood_cpu.sh). */
static int64_t first_duplicate(const uint32_t *ids, uint32_t n) {
    if (n <= 32) {
        for (uint32_t i = 1; i < n; i++)
            for (uint32_t j = 0; j < i; j++)
                if (ids[i] == ids[j]) return ids[i];
        return -1;
    }
    unsigned bits = 7;
    while (((size_t)1 << bits) < 2 * (size_t)n) bits++;
    size_t cap = (size_t)1 << bits;
    uint64_t on_stack[1024];
    uint64_t *set = cap <= 1024 ? on_stack : calloc(cap, sizeof *set);
    if (set == NULL) return -1;
    if (set == on_stack) memset(on_stack, 0, cap * sizeof *set);
    int64_t dup = -1;
    for (uint32_t i = 0; i < n && dup < 0; i++) {
        uint64_t key = (uint64_t)ids[i] + 1;
        size_t h = (size_t)((key * 0x9E3779B97F4A7C15ull) >> (64 - bits));
        while (set[h] != 0 && set[h] != key) h = (h + 1) & (cap - 1);
        if (set[h] == key) dup = ids[i];
        set[h] = key;
    }
    if (set != on_stack) free(set);
    return dup;
}

pie_code ctl_ids_check(const char *op, const char *field, const char *what, const uint32_t *ids,
                       uint32_t n, uint32_t max, pie_status *st) {
    if (pie_check_count(PIE_AT(op), field, n, max, st) != PIE_OK) return st->code;
    int64_t dup = first_duplicate(ids, n);
    if (dup >= 0)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "%s: %s %u is listed twice in %s", op, what,
                              (uint32_t)dup, field);
    return PIE_OK;
}

/* ---- vspace -------------------------------------------------------------------------------- */

void ctl_vspace_init(ctl_vspace *v, ctl_pool *pool, uint64_t owner) {
    memset(v, 0, sizeof *v);
    v->pool = pool;
    v->owner = owner;
}

void ctl_vspace_release(ctl_vspace *v) {
    if (v->pool) {
        for (size_t i = 0; i < v->kv.cap; i++)
            if (v->kv.cells[i].val != CTL_MAP32_EMPTY)
                ctl_pool_kv_unref(v->pool, v->kv.cells[i].val);
        for (size_t i = 0; i < v->emb.cap; i++)
            if (v->emb.cells[i].val != CTL_MAP32_EMPTY) emb_release(v->pool, v->emb.cells[i].val);
    }
    ctl_map32_free(&v->kv);
    ctl_map32_free(&v->emb);
}

static pie_code unbound(const ctl_map32 *m, const char *op, const char *what, const uint32_t *ids,
                        uint32_t n, pie_status *st) {
    for (uint32_t i = 0; i < n; i++)
        if (ctl_map32_get(m, ids[i], NULL))
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "%s: %s %u is already allocated in this instance", op, what,
                                  ids[i]);
    return PIE_OK;
}

static pie_code bound(const ctl_map32 *m, const char *op, const char *what, const uint32_t *ids,
                      uint32_t n, pie_status *st) {
    for (uint32_t i = 0; i < n; i++)
        if (!ctl_map32_get(m, ids[i], NULL))
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "%s: %s %u is not allocated in this instance", op, what, ids[i]);
    return PIE_OK;
}

static pie_code oom(const char *op, pie_status *st) {
    return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "%s: controller out of memory", op);
}

pie_code ctl_vspace_alloc_kv(ctl_vspace *v, const char *op, const uint32_t *ids, uint32_t n,
                             pie_status *st) {
    if (unbound(&v->kv, op, "kv page", ids, n, st) != PIE_OK) return st->code;
    ctl_pool *p = v->pool;
    if (ctl_pool_kv_available(p) < n)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "%s: %u KV pages requested, the worker has %u free", op, n,
                              ctl_pool_kv_available(p));
    if (ctl_map32_reserve(&v->kv, v->kv.n + n) != 0 || changes_reserve(p, n, 0, 0, 0) != 0)
        return oom(op, st);
    for (uint32_t i = 0; i < n; i++) {
        uint32_t s = kv_take(p, v->owner);
        (void)ctl_map32_put(&v->kv, ids[i], s); /* reserved: cannot fail */
    }
    return PIE_OK;
}

pie_code ctl_vspace_alloc_emb(ctl_vspace *v, const char *op, const uint32_t *ids, uint32_t n,
                              pie_status *st) {
    if (unbound(&v->emb, op, "embedding", ids, n, st) != PIE_OK) return st->code;
    ctl_pool *p = v->pool;
    if (ctl_pool_emb_available(p) < n)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "%s: %u embeddings requested, the worker has %u free slots", op, n,
                              ctl_pool_emb_available(p));
    if (ctl_map32_reserve(&v->emb, v->emb.n + n) != 0 || changes_reserve(p, 0, 0, n, 0) != 0)
        return oom(op, st);
    for (uint32_t i = 0; i < n; i++) (void)ctl_map32_put(&v->emb, ids[i], emb_take(p));
    return PIE_OK;
}

pie_code ctl_vspace_dealloc_kv(ctl_vspace *v, const char *op, const uint32_t *ids, uint32_t n,
                               pie_status *st) {
    if (bound(&v->kv, op, "kv page", ids, n, st) != PIE_OK) return st->code;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t s;
        if (ctl_map32_del(&v->kv, ids[i], &s)) ctl_pool_kv_unref(v->pool, s);
    }
    return PIE_OK;
}

pie_code ctl_vspace_dealloc_emb(ctl_vspace *v, const char *op, const uint32_t *ids, uint32_t n,
                                pie_status *st) {
    if (bound(&v->emb, op, "embedding", ids, n, st) != PIE_OK) return st->code;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t s;
        if (ctl_map32_del(&v->emb, ids[i], &s)) emb_release(v->pool, s);
    }
    return PIE_OK;
}

pie_code ctl_vspace_import_kv(ctl_vspace *v, const char *op, const uint32_t *ids,
                              const uint32_t *slots, uint32_t n, pie_status *st) {
    if (unbound(&v->kv, op, "kv page", ids, n, st) != PIE_OK) return st->code;
    if (ctl_map32_reserve(&v->kv, v->kv.n + n) != 0) return oom(op, st);
    for (uint32_t i = 0; i < n; i++) {
        ctl_pool_kv_ref(v->pool, slots[i]);
        (void)ctl_map32_put(&v->kv, ids[i], slots[i]);
    }
    return PIE_OK;
}

pie_code ctl_vspace_kv_slots(const ctl_vspace *v, const char *op, const uint32_t *ids, uint32_t n,
                             uint32_t *out, pie_status *st) {
    for (uint32_t i = 0; i < n; i++)
        if (!ctl_map32_get(&v->kv, ids[i], &out[i]))
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "%s: kv page %u is not allocated in this instance", op, ids[i]);
    return PIE_OK;
}

/* ---- exports ------------------------------------------------------------------------------- */

pie_code ctl_name_check(const char *op, const char *field, const char *name, pie_status *st) {
    return pie_check_name(PIE_AT(op), field, name ? strlen(name) : 0, st);
}

static void export_free(ctl_exports *ex, ctl_export *e) {
    if (e == NULL) return;
    if (e->charge) *e->charge -= e->n < *e->charge ? e->n : *e->charge;
    if (e->persistent) ex->n_persistent--; /* set only once added */
    free(e->key);
    free(e->model);
    free(e->slots);
    free(e);
}

pie_code ctl_exports_add(ctl_exports *ex, const char *op, const ctl_export_spec *spec,
                         pie_status *st) {
    if (ctl_name_check(op, "name", spec->name, st) != PIE_OK) return st->code;
    if (ctl_exports_get(ex, spec->tenant, spec->name))
        return pie_status_set(st, PIE_ALREADY_EXISTS, "%s: export name \"%s\" is already taken",
                              op, spec->name);
    ctl_export *e = calloc(1, sizeof *e);
    if (e == NULL) return oom(op, st);
    size_t klen = strlen(spec->tenant) + 1 + strlen(spec->name) + 1;
    e->key = malloc(klen);
    if (e->key) {
        snprintf(e->key, klen, "%s:%s", spec->tenant, spec->name);
        e->name = e->key + strlen(spec->tenant) + 1;
    }
    snprintf(e->tenant, sizeof e->tenant, "%s", spec->tenant);
    e->model = strdup(spec->model ? spec->model : "");
    uint32_t n = spec->n;
    e->slots = malloc((size_t)(n ? n : 1) * sizeof *e->slots);
    if (!e->key || !e->model || !e->slots || ctl_mapstr_put(&ex->by_name, e->key, e) != 0) {
        export_free(ex, e);
        return oom(op, st);
    }
    memcpy(e->slots, spec->slots, (size_t)n * sizeof *spec->slots);
    e->n = n;
    e->pool = spec->pool;
    e->where = spec->where;
    e->persistent = spec->persistent;
    e->exporter = spec->exporter;
    e->used_ns = spec->now_ns;
    if (spec->persistent) {
        ex->n_persistent++;
        e->charge = spec->charge;
        if (e->charge) *e->charge += n;
    }
    for (uint32_t i = 0; i < n; i++) ctl_pool_kv_ref(e->pool, e->slots[i]);
    return PIE_OK;
}

ctl_export *ctl_exports_get(const ctl_exports *ex, const char *tenant, const char *name) {
    if (!tenant || !name) return NULL;
    char key[PIE_TENANT_NAME_MAX + 1 + PIE_MAX_NAME_BYTES + 1];
    if (snprintf(key, sizeof key, "%s:%s", tenant, name) >= (int)sizeof key) return NULL;
    return ctl_mapstr_get(&ex->by_name, key);
}

void ctl_exports_remove(ctl_exports *ex, ctl_export *e) {
    ctl_mapstr_del(&ex->by_name, e->key);
    for (uint32_t i = 0; i < e->n; i++) ctl_pool_kv_unref(e->pool, e->slots[i]);
    export_free(ex, e);
}

/* Removes the exports for which keep() is false; drop_refs: release their references. */
static void exports_filter(ctl_exports *ex, bool (*doomed)(const ctl_export *, const void *),
                           const void *arg, bool drop_refs) {
    ctl_mapstr *m = &ex->by_name;
    for (size_t i = 0; i < m->cap;) {
        ctl_export *e = m->cells[i].key ? m->cells[i].val : NULL;
        if (e && doomed(e, arg)) {
            /* Deletion shifts later cells back into i: look at i again. */
            if (drop_refs) {
                ctl_exports_remove(ex, e);
            } else {
                ctl_mapstr_del(m, e->key);
                export_free(ex, e);
            }
            continue;
        }
        i++;
    }
}

static bool on_pool(const ctl_export *e, const void *pool) { return e->pool == pool; }

static bool tied_to(const ctl_export *e, const void *exporter) {
    return !e->persistent && e->exporter == *(const uint64_t *)exporter;
}

void ctl_exports_drop_pool(ctl_exports *ex, const ctl_pool *pool) {
    exports_filter(ex, on_pool, pool, false);
}

void ctl_exports_drop_tied(ctl_exports *ex, uint64_t exporter) {
    exports_filter(ex, tied_to, &exporter, true);
}

typedef struct expiry {
    int64_t now_ns, ttl_ns;
} expiry;

static bool expired(const ctl_export *e, const void *arg) {
    const expiry *x = arg;
    return e->persistent && x->now_ns - e->used_ns >= x->ttl_ns;
}

void ctl_exports_expire(ctl_exports *ex, int64_t now_ns, int64_t ttl_ns) {
    if (ex->n_persistent == 0) return;
    expiry x = {now_ns, ttl_ns};
    exports_filter(ex, expired, &x, true);
}

size_t ctl_exports_count(const ctl_exports *ex) { return ex->by_name.n; }
size_t ctl_exports_persistent(const ctl_exports *ex) { return ex->n_persistent; }

/* By tenant, then name: the key "<tenant>:<name>" does not sort so ("a-b" vs "a:"). */
static int cmp_export(const void *a, const void *b) {
    const ctl_export *x = *(ctl_export *const *)a, *y = *(ctl_export *const *)b;
    int t = strcmp(x->tenant, y->tenant);
    return t ? t : strcmp(x->name, y->name);
}

int ctl_exports_sorted(const ctl_exports *ex, ctl_export ***out, size_t *n) {
    size_t k = 0;
    ctl_export **v = malloc((ex->by_name.n ? ex->by_name.n : 1) * sizeof *v);
    if (v == NULL) return -1;
    for (size_t i = 0; i < ex->by_name.cap; i++)
        if (ex->by_name.cells[i].key) v[k++] = ex->by_name.cells[i].val;
    qsort(v, k, sizeof *v, cmp_export);
    *out = v;
    *n = k;
    return 0;
}

void ctl_exports_free(ctl_exports *ex) {
    for (size_t i = 0; i < ex->by_name.cap; i++)
        if (ex->by_name.cells[i].key) export_free(ex, ex->by_name.cells[i].val);
    ctl_mapstr_free(&ex->by_name);
}
