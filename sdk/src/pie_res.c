/* pie_res.c — queues, KV pages, embeddings and next-token distributions.
 *
 * Owns: the KV page table (holders and pins of every page allocated through the SDK; global
 * because page ids are instance-wide and several contexts share pages), checked wrappers over
 * the queue / allocation calls, and parsing of next_dist payloads.
 * Does not own: which pages a sequence uses (pie_ctx.c), the id pools (pie_core.c). */
#include <stdlib.h>
#include <string.h>

#include "pie_int.h"

/* ==== queues ================================================================================== */

uint32_t pie_queue_create(const pie_model *m) {
    if (!m) m = pie_model_get(NULL);
    uint32_t q = pie_id_get(PIE_ID_QUEUE);
    if (pie_create_queue(q, m->name, m->name_len) < 0)
        pie_fatal("create_queue %u on model \"%s\": %s", (unsigned)q, m->name, pie_error());
    return q;
}

void pie_queue_destroy(uint32_t q) {
    if (pie_destroy_queue(q) < 0) pie_fatal("destroy_queue %u: %s", (unsigned)q, pie_error());
    pie_id_put(PIE_ID_QUEUE, q);
}

int32_t pie_queue_sync_try(uint32_t q) {
    uint32_t f = pie_future_new();
    int32_t rc = pie_synchronize(q, f);
    if (rc < 0) {
        pie_id_put(PIE_ID_FUTURE, f);
        return rc;
    }
    pie_buf b = {0};
    rc = pie_future_take_try(f, &b);
    pie_buf_free(&b);
    return rc < 0 ? rc : 0;
}

void pie_queue_sync(uint32_t q, const char *what) {
    int32_t rc = pie_queue_sync_try(q);
    if (rc < 0) pie_fatal("%s (queue %u): %s (code %d)", what, (unsigned)q, pie_error(), (int)-rc);
}

/* ==== page table ============================================================================== */

typedef struct page_entry {
    uint32_t holders; /* 0 = not tracked */
    bool pinned;
} page_entry;

/* Indexed by page id (ids are dense: they come from the pool). See the file comment. */
static page_entry *pie_page_table;
static size_t pie_page_table_cap;

static page_entry *page_at(uint32_t id) {
    if (id >= pie_page_table_cap) {
        size_t cap = pie_page_table_cap ? pie_page_table_cap : 256;
        while (cap <= id) cap *= 2;
        pie_page_table = pie_xrealloc(pie_page_table, cap * sizeof *pie_page_table);
        memset(pie_page_table + pie_page_table_cap, 0,
               (cap - pie_page_table_cap) * sizeof *pie_page_table);
        pie_page_table_cap = cap;
    }
    return &pie_page_table[id];
}

void pie_page_track(uint32_t id) { *page_at(id) = (page_entry){.holders = 1}; }
void pie_page_untrack(uint32_t id) { *page_at(id) = (page_entry){0}; }
void pie_page_ref(uint32_t id) { page_at(id)->holders++; }
void pie_page_pin(uint32_t id) { page_at(id)->pinned = true; }
uint32_t pie_page_holders(uint32_t id) { return page_at(id)->holders; }

uint32_t pie_page_unref(uint32_t id) {
    page_entry *e = page_at(id);
    if (e->holders == 0) pie_fatal("kv page %u released more often than held", (unsigned)id);
    return --e->holders;
}

bool pie_page_writable(uint32_t id) {
    page_entry *e = page_at(id);
    return e->holders == 1 && !e->pinned;
}

/* ==== allocation ============================================================================== */

/* The ABI takes at most 4096 ids per call (pie.v1 wire contract). */
#define MAX_IDS_PER_CALL 4096

typedef int32_t (*ids_call)(uint32_t q, const uint32_t *ids, uint32_t n);

static void ids_in_chunks(ids_call fn, const char *what, uint32_t q, const uint32_t *ids,
                          size_t n) {
    for (size_t at = 0; at < n; at += MAX_IDS_PER_CALL) {
        size_t k = n - at < MAX_IDS_PER_CALL ? n - at : MAX_IDS_PER_CALL;
        if (fn(q, ids + at, (uint32_t)k) < 0)
            pie_fatal("%s (queue %u, %zu ids from %u): %s", what, (unsigned)q, k,
                      (unsigned)ids[at], pie_error());
    }
}

void pie_kv_pages_alloc(uint32_t q, uint32_t *ids, size_t n) {
    for (size_t i = 0; i < n; i++) ids[i] = pie_id_get(PIE_ID_KV_PAGE);
    ids_in_chunks(pie_alloc_kv_pages, "alloc_kv_pages", q, ids, n);
    for (size_t i = 0; i < n; i++) pie_page_track(ids[i]);
}

void pie_kv_pages_free(uint32_t q, const uint32_t *ids, size_t n) {
    ids_in_chunks(pie_dealloc_kv_pages, "dealloc_kv_pages", q, ids, n);
    for (size_t i = 0; i < n; i++) {
        pie_page_untrack(ids[i]);
        pie_id_put(PIE_ID_KV_PAGE, ids[i]);
    }
}

void pie_embeds_alloc(uint32_t q, uint32_t *ids, size_t n) {
    for (size_t i = 0; i < n; i++) ids[i] = pie_id_get(PIE_ID_EMBED);
    ids_in_chunks(pie_alloc_embeds, "alloc_embeds", q, ids, n);
}

void pie_embeds_free(uint32_t q, const uint32_t *ids, size_t n) {
    ids_in_chunks(pie_dealloc_embeds, "dealloc_embeds", q, ids, n);
    for (size_t i = 0; i < n; i++) pie_id_put(PIE_ID_EMBED, ids[i]);
}

/* ==== distributions =========================================================================== */

uint32_t pie_next_dist_issue(uint32_t q, const uint32_t *embeds, size_t n, uint32_t top_k) {
    /* The distributions are only as good as the forwards before them: check those first. */
    uint32_t s = pie_future_new();
    if (pie_synchronize(q, s) < 0)
        pie_fatal("synchronize (queue %u) before next_dist: %s", (unsigned)q, pie_error());
    uint32_t f = pie_future_new();
    if (pie_next_dist(q, embeds, (uint32_t)n, top_k, 1.0f, f) < 0)
        pie_fatal("next_dist (queue %u, %zu embeddings, top_k %u): %s", (unsigned)q, n,
                  (unsigned)top_k, pie_error());
    pie_future_set_check(f, s);
    return f;
}

static uint32_t read_u32(const char *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

void pie_dists_take(uint32_t f, pie_dists *out) {
    size_t len = pie_future_take(f, &out->raw, "next_dist");
    const char *p = out->raw.data;
    /* First pass: count distributions and candidates; the payload is u32 k, k ids, k probs. */
    size_t n = 0, total = 0, at = 0;
    while (at < len) {
        if (len - at < 4) pie_fatal("next_dist: truncated payload (%zu bytes)", len);
        uint32_t k = read_u32(p + at);
        if ((len - at - 4) / 8 < k) pie_fatal("next_dist: payload too short for k = %u", k);
        at += 4 + (size_t)k * 8;
        total += k;
        n++;
    }
    free(out->d);
    free(out->ids_storage);
    free(out->probs_storage);
    out->n = (uint32_t)n;
    out->d = pie_xcalloc(n, sizeof *out->d);
    out->ids_storage = pie_xcalloc(total, sizeof *out->ids_storage);
    out->probs_storage = pie_xcalloc(total, sizeof *out->probs_storage);
    at = 0;
    size_t off = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t k = read_u32(p + at);
        pie_dist *d = &out->d[i];
        d->k = k;
        d->ids = out->ids_storage + off;
        d->probs = out->probs_storage + off;
        memcpy(d->ids, p + at + 4, (size_t)k * 4);
        memcpy(d->probs, p + at + 4 + (size_t)k * 4, (size_t)k * 4);
        at += 4 + (size_t)k * 8;
        off += k;
    }
}

void pie_dists_free(pie_dists *ds) {
    free(ds->d);
    free(ds->ids_storage);
    free(ds->probs_storage);
    pie_buf_free(&ds->raw);
    *ds = (pie_dists){0};
}
