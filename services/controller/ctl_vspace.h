/* ctl_vspace.h — resource virtualisation: physical slot pools, per-instance virtual id spaces,
 * reference-counted sharing, exports and imports.
 *
 * Owns:
 *  * ctl_pool — the physical KV slots and embedding slots of one worker group: which are live,
 *    each KV slot's reference count (holders + exports), free lists, the effective capacity,
 *    and the slot changes (allocs / frees) the worker has not been told about yet; they leave
 *    as SlotBatch entries (ctl_exec.c).
 *  * ctl_vspace — one instance's objects of one model: its KV page ids and embedding ids (any
 *    uint32 the inferlet chose) mapped to slots of the pool of the group it is placed on.
 *  * ctl_exports — the cluster-wide export names; an export holds one reference per page.
 * Does not own: which instance or worker these belong to, quotas and contention (ctl_place.c
 * and ctl_exec.c decide before calling here), the wire format.
 *
 * Sharing rule (docs/wire-contracts.md): a KV slot referenced more than once (by an export, or
 * by several holders) is read-only for everyone. An embedding belongs to exactly one holder,
 * and may be read only once its holder wrote it (the pool tracks that per slot).
 *
 * Errors name the operation, the field and the value, e.g.
 * "dealloc_kv_pages: kv page 17 is not allocated in this instance". Functions that change
 * state validate everything first: on error nothing changed. */
#ifndef CTL_VSPACE_H
#define CTL_VSPACE_H

#include <stdbool.h>
#include <stdint.h>

#include "ctl_arena.h"
#include "ctl_map.h"
#include "pie_check.h"
#include "pie_status.h"
#include "pie_tenant.h"

/* Ids per call and name lengths: PIE_MAX_IDS and PIE_MAX_NAME_BYTES (pie_check.h). */

/* One KV allocation the worker has not been told about. */
typedef struct ctl_kv_alloc {
    uint32_t slot;
    uint64_t owner; /* instance id: SlotBatch.alloc_kv_owners */
} ctl_kv_alloc;

/* Slot changes not yet sent (one SlotBatch's worth). Frees apply before allocs on the worker;
 * a slot allocated and freed again before being sent is dropped from both lists (from
 * alloc_kv or alloc_emb by moving the list's last entry into the hole: pending allocs have no
 * order). */
typedef struct ctl_slot_changes {
    ctl_kv_alloc *alloc_kv;
    uint32_t n_alloc_kv, cap_alloc_kv;
    ctl_vec32 free_kv, alloc_emb, free_emb;
} ctl_slot_changes;

typedef struct ctl_pool {
    uint32_t kv_max;            /* slot ids 0 .. kv_max-1 */
    uint32_t kv_effective;      /* live slots allowed at once now */
    uint32_t kv_used;           /* live KV slots */
    uint32_t kv_shared;         /* live KV slots with more than one reference */
    uint64_t kv_refs_total;     /* sum of the reference counts of live KV slots */
    uint32_t *kv_refs;          /* [kv_max]: 0 = free */
    uint32_t *kv_free;          /* freed slots, a stack (reused first: warm memory) */
    uint32_t kv_nfree, kv_next; /* slots kv_next .. kv_max-1 were never used */
    uint32_t *kv_pending_at;    /* [kv_max]: 1 + its index in ch.alloc_kv while its alloc
                                   waits there (so a free of it before it went out is O(1)),
                                   0 otherwise */
    uint32_t emb_max, emb_used;
    uint32_t *emb_free;
    uint32_t emb_nfree, emb_next;
    uint32_t *emb_pending_at; /* [emb_max]: as kv_pending_at, for ch.alloc_emb */
    /* [emb_max]: 1 once a call that writes the live slot (embed_text, a forward's output) was
     * taken into a batch; 0 from its allocation until then: reading it is refused. */
    uint8_t *emb_written;
    ctl_slot_changes ch;
} ctl_pool;

pie_code ctl_pool_init(ctl_pool *p, uint32_t kv_max, uint32_t kv_effective, uint32_t emb_slots,
                       pie_status *st);
void ctl_pool_destroy(ctl_pool *p);
/* KV slots that may still be allocated now (effective capacity minus live slots, floor 0). */
uint32_t ctl_pool_kv_available(const ctl_pool *p);
uint32_t ctl_pool_emb_available(const ctl_pool *p);
uint32_t ctl_pool_kv_refs(const ctl_pool *p, uint32_t slot);
static inline bool ctl_pool_kv_writable(const ctl_pool *p, uint32_t slot) {
    return p->kv_refs[slot] == 1;
}
static inline bool ctl_pool_emb_written(const ctl_pool *p, uint32_t slot) {
    return p->emb_written[slot] != 0;
}
static inline void ctl_pool_emb_set_written(ctl_pool *p, uint32_t slot) {
    p->emb_written[slot] = 1;
}
/* Adds / drops one reference of a live KV slot; the last drop frees it (a slot change). */
void ctl_pool_kv_ref(ctl_pool *p, uint32_t slot);
void ctl_pool_kv_unref(ctl_pool *p, uint32_t slot);
bool ctl_pool_has_changes(const ctl_pool *p);
/* Empties `ch` once its contents were sent (or when the worker is gone). */
void ctl_pool_changes_clear(ctl_pool *p);
/* Drops the first entries of each list of `ch` (those just sent; the rest stays for the next
 * step, still in application order: frees before allocs). */
void ctl_pool_changes_sent(ctl_pool *p, uint32_t free_kv, uint32_t free_emb, uint32_t alloc_kv,
                           uint32_t alloc_emb);
/* Entries waiting in `ch`. */
uint64_t ctl_pool_changes_count(const ctl_pool *p);

/* One instance's objects of one model, on one pool. */
typedef struct ctl_vspace {
    ctl_pool *pool;
    uint64_t owner; /* instance id */
    ctl_map32 kv;   /* page id → KV slot */
    ctl_map32 emb;  /* embedding id → embedding slot */
} ctl_vspace;

void ctl_vspace_init(ctl_vspace *v, ctl_pool *pool, uint64_t owner);
/* Drops every reference and embedding the space holds and frees its tables. */
void ctl_vspace_release(ctl_vspace *v);
static inline bool ctl_vspace_kv(const ctl_vspace *v, uint32_t id, uint32_t *slot) {
    return ctl_map32_get(&v->kv, id, slot);
}
static inline bool ctl_vspace_emb(const ctl_vspace *v, uint32_t id, uint32_t *slot) {
    return ctl_map32_get(&v->emb, id, slot);
}

/* Checks an id list of an alloc / dealloc / export / import call: 1..max entries, distinct.
 * what: "kv page" or "embedding"; field: the proto field for the count message. */
pie_code ctl_ids_check(const char *op, const char *field, const char *what, const uint32_t *ids,
                       uint32_t n, uint32_t max, pie_status *st);

/* Binds each id (checked distinct, none bound here) to a fresh slot. INVALID_ARGUMENT names an
 * id already allocated; RESOURCE_EXHAUSTED if the pool lacks room (callers settle contention
 * before) or memory ran out. */
pie_code ctl_vspace_alloc_kv(ctl_vspace *v, const char *op, const uint32_t *ids, uint32_t n,
                             pie_status *st);
pie_code ctl_vspace_alloc_emb(ctl_vspace *v, const char *op, const uint32_t *ids, uint32_t n,
                              pie_status *st);
/* Unbinds each id (all must be bound here); KV slots lose one reference. */
pie_code ctl_vspace_dealloc_kv(ctl_vspace *v, const char *op, const uint32_t *ids, uint32_t n,
                               pie_status *st);
pie_code ctl_vspace_dealloc_emb(ctl_vspace *v, const char *op, const uint32_t *ids, uint32_t n,
                                pie_status *st);
/* Binds ids[i] to slots[i] (live slots of v->pool), adding a reference to each. The ids must
 * be unbound here. */
pie_code ctl_vspace_import_kv(ctl_vspace *v, const char *op, const uint32_t *ids,
                              const uint32_t *slots, uint32_t n, pie_status *st);
/* Slots of bound page ids, in order, into out[n]. */
pie_code ctl_vspace_kv_slots(const ctl_vspace *v, const char *op, const uint32_t *ids, uint32_t n,
                             uint32_t *out, pie_status *st);

/* ---- exports -------------------------------------------------------------------------------- */

typedef struct ctl_export {
    char *key;       /* "<tenant>:<name>", the map key (tenant names hold no ':') */
    const char *name; /* the export's name, within key */
    char tenant[PIE_TENANT_NAME_MAX + 1];
    char *model;     /* model the pages belong to */
    ctl_pool *pool;  /* where the pages live */
    void *where;     /* the owner's handle for that pool (the worker group) */
    uint32_t *slots; /* [n], one reference each */
    uint32_t n;
    bool persistent;
    uint64_t exporter; /* instance id */
    uint32_t *charge;  /* persistent: the tenant's page count holding n of them, or NULL */
    int64_t used_ns;   /* export or last import (exports.ttl counts from it) */
} ctl_export;

typedef struct ctl_exports {
    ctl_mapstr by_name; /* key → export */
    size_t n_persistent;
} ctl_exports;

/* Checks a name: 1..256 bytes. field: "name" / "topic". */
pie_code ctl_name_check(const char *op, const char *field, const char *name, pie_status *st);
/* What ctl_exports_add publishes. */
typedef struct ctl_export_spec {
    const char *tenant, *name, *model;
    ctl_pool *pool;        /* where the slots live */
    void *where;           /* the owner's handle for that pool */
    const uint32_t *slots; /* [n] */
    uint32_t n;
    bool persistent;
    uint64_t exporter;
    uint32_t *charge; /* persistent: counter charged n now, uncharged when the export goes */
    int64_t now_ns;
} ctl_export_spec;

/* Publishes spec's slots under (tenant, name): ALREADY_EXISTS if the tenant has that name. */
pie_code ctl_exports_add(ctl_exports *ex, const char *op, const ctl_export_spec *spec,
                         pie_status *st);
/* The tenant's export of that name, or NULL. */
ctl_export *ctl_exports_get(const ctl_exports *ex, const char *tenant, const char *name);
/* Removes an export, dropping its references. */
void ctl_exports_remove(ctl_exports *ex, ctl_export *e);
/* Removes every export living on pool without touching the pool (it is being destroyed). */
void ctl_exports_drop_pool(ctl_exports *ex, const ctl_pool *pool);
/* Removes the non-persistent exports of an instance. */
void ctl_exports_drop_tied(ctl_exports *ex, uint64_t exporter);
/* Removes persistent exports unused (not exported or imported) for ttl_ns. */
void ctl_exports_expire(ctl_exports *ex, int64_t now_ns, int64_t ttl_ns);
size_t ctl_exports_count(const ctl_exports *ex);
size_t ctl_exports_persistent(const ctl_exports *ex);
/* Every export sorted by tenant, then name into *out (malloc'd array; the caller frees it). -1 on OOM. */
int ctl_exports_sorted(const ctl_exports *ex, ctl_export ***out, size_t *n);
void ctl_exports_free(ctl_exports *ex);

#endif
