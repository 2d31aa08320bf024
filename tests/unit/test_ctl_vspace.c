/* test_ctl_vspace.c — resource virtualisation (services/controller/ctl_vspace.h): physical
 * pools with reference counts, per-instance id spaces, exports and imports, release, the slot
 * changes a worker is told about, and every error an id list can have. */
#include <criterion/criterion.h>

#include <string.h>

#include "ctl_vspace.h"

TestSuite(ctl_vspace);

static ctl_pool pool_of(uint32_t kv, uint32_t emb) {
    ctl_pool p;
    pie_status st;
    cr_assert_eq(ctl_pool_init(&p, kv, kv, emb, &st), PIE_OK, "%s", st.msg);
    return p;
}

static uint32_t slot_of(const ctl_vspace *v, uint32_t id) {
    uint32_t s = UINT32_MAX;
    cr_assert(ctl_vspace_kv(v, id, &s), "kv page %u is not bound", id);
    return s;
}

Test(ctl_vspace, alloc_binds_each_id_to_its_own_slot_with_one_reference) {
    ctl_pool p = pool_of(8, 8);
    ctl_vspace v;
    ctl_vspace_init(&v, &p, 42);
    pie_status st;
    uint32_t ids[] = {7, 1000000, 0xFFFFFFFFu};
    cr_assert_eq(ctl_vspace_alloc_kv(&v, "alloc_kv_pages", ids, 3, &st), PIE_OK, "%s", st.msg);
    uint32_t a = slot_of(&v, 7), b = slot_of(&v, 1000000), c = slot_of(&v, 0xFFFFFFFFu);
    cr_assert(a != b && b != c && a != c);
    cr_assert_eq(ctl_pool_kv_refs(&p, a), 1);
    cr_assert(ctl_pool_kv_writable(&p, a));
    cr_assert_eq(p.kv_used, 3);
    cr_assert_eq(p.kv_refs_total, 3);
    cr_assert_eq(ctl_pool_kv_available(&p), 5);
    /* The worker is told, with the owner. */
    cr_assert_eq(p.ch.n_alloc_kv, 3);
    cr_assert_eq(p.ch.alloc_kv[0].owner, 42);
    ctl_vspace_release(&v);
    ctl_pool_destroy(&p);
}

Test(ctl_vspace, allocating_a_bound_id_names_it) {
    ctl_pool p = pool_of(8, 8);
    ctl_vspace v;
    ctl_vspace_init(&v, &p, 1);
    pie_status st;
    cr_assert_eq(ctl_vspace_alloc_kv(&v, "alloc_kv_pages", (uint32_t[]){5}, 1, &st), PIE_OK);
    cr_assert_eq(ctl_vspace_alloc_kv(&v, "alloc_kv_pages", (uint32_t[]){6, 5}, 2, &st),
                 PIE_INVALID_ARGUMENT);
    cr_assert_str_eq(st.msg, "alloc_kv_pages: kv page 5 is already allocated in this instance");
    cr_assert_eq(p.kv_used, 1, "nothing changed");
    cr_assert(!ctl_vspace_kv(&v, 6, NULL));
    ctl_vspace_release(&v);
    ctl_pool_destroy(&p);
}

Test(ctl_vspace, id_lists_must_be_non_empty_bounded_and_distinct) {
    pie_status st;
    uint32_t ids[] = {3, 4, 3};
    cr_assert_eq(ctl_ids_check("alloc_kv_pages", "kv_page_ids", "kv page", ids, 0, 4096, &st),
                 PIE_INVALID_ARGUMENT);
    cr_assert_str_eq(st.msg, "alloc_kv_pages: kv_page_ids is empty");
    cr_assert_eq(ctl_ids_check("alloc_embeds", "embed_ids", "embedding", ids, 3, 4096, &st),
                 PIE_INVALID_ARGUMENT);
    cr_assert_str_eq(st.msg, "alloc_embeds: embedding 3 is listed twice in embed_ids");
    cr_assert_eq(ctl_ids_check("alloc_kv_pages", "kv_page_ids", "kv page", ids, 3, 2, &st),
                 PIE_INVALID_ARGUMENT);
    cr_assert_str_eq(st.msg, "alloc_kv_pages: kv_page_ids has 3 entries, more than the 2 allowed");
    /* Long lists take the sorting path. */
    uint32_t many[100];
    for (uint32_t i = 0; i < 100; i++) many[i] = i * 7;
    cr_assert_eq(ctl_ids_check("x", "f", "kv page", many, 100, 4096, &st), PIE_OK);
    many[99] = 7 * 50;
    cr_assert_eq(ctl_ids_check("x", "f", "kv page", many, 100, 4096, &st), PIE_INVALID_ARGUMENT);
    cr_assert_str_eq(st.msg, "x: kv page 350 is listed twice in f");
}

Test(ctl_vspace, dealloc_of_an_unbound_id_names_it_and_changes_nothing) {
    ctl_pool p = pool_of(8, 8);
    ctl_vspace v;
    ctl_vspace_init(&v, &p, 1);
    pie_status st;
    cr_assert_eq(ctl_vspace_alloc_kv(&v, "a", (uint32_t[]){1, 2}, 2, &st), PIE_OK);
    cr_assert_eq(ctl_vspace_dealloc_kv(&v, "dealloc_kv_pages", (uint32_t[]){1, 17}, 2, &st),
                 PIE_INVALID_ARGUMENT);
    cr_assert_str_eq(st.msg, "dealloc_kv_pages: kv page 17 is not allocated in this instance");
    cr_assert_eq(p.kv_used, 2);
    cr_assert(ctl_vspace_kv(&v, 1, NULL));
    cr_assert_eq(ctl_vspace_dealloc_emb(&v, "dealloc_embeds", (uint32_t[]){9}, 1, &st),
                 PIE_INVALID_ARGUMENT);
    cr_assert_str_eq(st.msg, "dealloc_embeds: embedding 9 is not allocated in this instance");
    ctl_vspace_release(&v);
    ctl_pool_destroy(&p);
}

Test(ctl_vspace, dealloc_frees_the_slot_for_reuse) {
    ctl_pool p = pool_of(2, 2);
    ctl_vspace v;
    ctl_vspace_init(&v, &p, 1);
    pie_status st;
    cr_assert_eq(ctl_vspace_alloc_kv(&v, "a", (uint32_t[]){1, 2}, 2, &st), PIE_OK);
    uint32_t s1 = slot_of(&v, 1);
    ctl_pool_changes_clear(&p); /* sent */
    cr_assert_eq(ctl_vspace_dealloc_kv(&v, "d", (uint32_t[]){1}, 1, &st), PIE_OK);
    cr_assert_eq(ctl_pool_kv_refs(&p, s1), 0);
    cr_assert_eq(p.ch.free_kv.n, 1);
    cr_assert_eq(p.ch.free_kv.v[0], s1);
    cr_assert_eq(ctl_vspace_alloc_kv(&v, "a", (uint32_t[]){3}, 1, &st), PIE_OK);
    cr_assert_eq(slot_of(&v, 3), s1, "the freed slot is reused");
    /* Frees apply before allocs on the worker, so "free s1, alloc s1" in one SlotBatch is right. */
    cr_assert_eq(p.ch.free_kv.n, 1);
    cr_assert_eq(p.ch.n_alloc_kv, 1);
    ctl_vspace_release(&v);
    ctl_pool_destroy(&p);
}

Test(ctl_vspace, a_slot_allocated_and_freed_before_the_worker_heard_of_it_is_never_sent) {
    ctl_pool p = pool_of(4, 4);
    ctl_vspace v;
    ctl_vspace_init(&v, &p, 1);
    pie_status st;
    cr_assert_eq(ctl_vspace_alloc_kv(&v, "a", (uint32_t[]){1, 2}, 2, &st), PIE_OK);
    cr_assert_eq(ctl_vspace_alloc_emb(&v, "a", (uint32_t[]){1}, 1, &st), PIE_OK);
    cr_assert_eq(ctl_vspace_dealloc_kv(&v, "d", (uint32_t[]){1}, 1, &st), PIE_OK);
    cr_assert_eq(ctl_vspace_dealloc_emb(&v, "d", (uint32_t[]){1}, 1, &st), PIE_OK);
    cr_assert_eq(p.ch.n_alloc_kv, 1);
    cr_assert_eq(p.ch.free_kv.n, 0);
    cr_assert_eq(p.ch.alloc_emb.n, 0);
    cr_assert_eq(p.ch.free_emb.n, 0);
    ctl_vspace_release(&v);
    cr_assert(!ctl_pool_has_changes(&p), "nothing the worker must hear about");
    ctl_pool_destroy(&p);
}

Test(ctl_vspace, an_embedding_slot_is_unwritten_from_each_allocation_until_marked) {
    ctl_pool p = pool_of(1, 1); /* one slot: every allocation gets it again */
    ctl_vspace a, b;
    ctl_vspace_init(&a, &p, 1);
    ctl_vspace_init(&b, &p, 2);
    pie_status st;
    uint32_t slot;
    cr_assert_eq(ctl_vspace_alloc_emb(&a, "a", (uint32_t[]){7}, 1, &st), PIE_OK, "%s", st.msg);
    cr_assert(ctl_vspace_emb(&a, 7, &slot));
    cr_assert(!ctl_pool_emb_written(&p, slot), "a fresh embedding is unwritten");
    ctl_pool_emb_set_written(&p, slot);
    cr_assert(ctl_pool_emb_written(&p, slot));
    cr_assert_eq(ctl_vspace_dealloc_emb(&a, "a", (uint32_t[]){7}, 1, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(ctl_vspace_alloc_emb(&b, "b", (uint32_t[]){7}, 1, &st), PIE_OK, "%s", st.msg);
    uint32_t again;
    cr_assert(ctl_vspace_emb(&b, 7, &again));
    cr_assert_eq(again, slot, "the pool has one slot");
    cr_assert(!ctl_pool_emb_written(&p, again), "another holder's write does not carry over");
    ctl_vspace_release(&a);
    ctl_vspace_release(&b);
    ctl_pool_destroy(&p);
}

Test(ctl_vspace, a_full_pool_refuses_and_names_the_counts) {
    ctl_pool p = pool_of(2, 1);
    ctl_vspace v;
    ctl_vspace_init(&v, &p, 1);
    pie_status st;
    cr_assert_eq(ctl_vspace_alloc_kv(&v, "alloc_kv_pages", (uint32_t[]){1, 2, 3}, 3, &st),
                 PIE_RESOURCE_EXHAUSTED);
    cr_assert_str_eq(st.msg, "alloc_kv_pages: 3 KV pages requested, the worker has 2 free");
    cr_assert_eq(ctl_vspace_alloc_emb(&v, "alloc_embeds", (uint32_t[]){1, 2}, 2, &st),
                 PIE_RESOURCE_EXHAUSTED);
    cr_assert_eq(p.kv_used, 0);
    cr_assert_eq(p.emb_used, 0);
    /* The effective capacity bounds live slots, whatever kv_max says. */
    p.kv_effective = 1;
    cr_assert_eq(ctl_pool_kv_available(&p), 1);
    ctl_vspace_release(&v);
    ctl_pool_destroy(&p);
}

/* ctl_exports_add for tenant t at time 0. */
static pie_code add(ctl_exports *ex, const char *op, const char *tenant, const char *name,
                    ctl_pool *p, const uint32_t *slots, uint32_t n, bool persistent,
                    uint64_t exporter, uint32_t *charge, pie_status *st) {
    ctl_export_spec spec = {.tenant = tenant, .name = name, .model = "m", .pool = p,
                            .slots = slots, .n = n, .persistent = persistent,
                            .exporter = exporter, .charge = charge};
    return ctl_exports_add(ex, op, &spec, st);
}

Test(ctl_vspace, export_and_import_share_pages_by_reference) {
    ctl_pool p = pool_of(8, 8);
    ctl_exports ex = {0};
    ctl_vspace a, b;
    ctl_vspace_init(&a, &p, 1);
    ctl_vspace_init(&b, &p, 2);
    pie_status st;
    cr_assert_eq(ctl_vspace_alloc_kv(&a, "a", (uint32_t[]){10, 11}, 2, &st), PIE_OK);
    uint32_t slots[2];
    cr_assert_eq(ctl_vspace_kv_slots(&a, "export_kv_pages", (uint32_t[]){10, 11}, 2, slots, &st),
                 PIE_OK);
    cr_assert_eq(
        add(&ex, "export_kv_pages", "t", "prefix", &p, slots, 2, false, 1, NULL, &st),
        PIE_OK, "%s", st.msg);
    cr_assert_eq(ctl_pool_kv_refs(&p, slots[0]), 2);
    cr_assert(!ctl_pool_kv_writable(&p, slots[0]), "exported pages are read-only");
    cr_assert_eq(p.kv_shared, 2);
    ctl_export *e = ctl_exports_get(&ex, "t", "prefix");
    cr_assert_not_null(e);
    cr_assert_eq(
        ctl_vspace_import_kv(&b, "import_kv_pages", (uint32_t[]){0, 1}, e->slots, e->n, &st),
        PIE_OK);
    cr_assert_eq(slot_of(&b, 0), slots[0]);
    cr_assert_eq(slot_of(&b, 1), slots[1]);
    cr_assert_eq(ctl_pool_kv_refs(&p, slots[1]), 3);
    cr_assert_eq(p.kv_used, 2, "no new slots");
    cr_assert_eq(p.kv_refs_total, 6);
    /* The exporter lets go: the export and the importer keep the pages. */
    cr_assert_eq(ctl_vspace_dealloc_kv(&a, "d", (uint32_t[]){10, 11}, 2, &st), PIE_OK);
    cr_assert_eq(ctl_pool_kv_refs(&p, slots[0]), 2);
    ctl_exports_remove(&ex, ctl_exports_get(&ex, "t", "prefix"));
    cr_assert_eq(ctl_pool_kv_refs(&p, slots[0]), 1);
    cr_assert(ctl_pool_kv_writable(&p, slots[0]), "sole holder again: writable");
    cr_assert_eq(p.kv_shared, 0);
    ctl_vspace_release(&b);
    cr_assert_eq(p.kv_used, 0);
    cr_assert_eq(p.kv_refs_total, 0);
    ctl_vspace_release(&a);
    ctl_exports_free(&ex);
    ctl_pool_destroy(&p);
}

Test(ctl_vspace, export_names_are_unique_and_bounded) {
    ctl_pool p = pool_of(4, 4);
    ctl_exports ex = {0};
    pie_status st;
    ctl_vspace a;
    ctl_vspace_init(&a, &p, 1);
    cr_assert_eq(ctl_vspace_alloc_kv(&a, "a", (uint32_t[]){1}, 1, &st), PIE_OK);
    uint32_t s = slot_of(&a, 1);
    cr_assert_eq(add(&ex, "export_kv_pages", "t", "x", &p, &s, 1, true, 1, NULL, &st),
                 PIE_OK);
    cr_assert_eq(add(&ex, "export_kv_pages", "t", "x", &p, &s, 1, true, 1, NULL, &st),
                 PIE_ALREADY_EXISTS);
    cr_assert_str_eq(st.msg, "export_kv_pages: export name \"x\" is already taken");
    cr_assert_eq(add(&ex, "export_kv_pages", "t", "", &p, &s, 1, true, 1, NULL, &st),
                 PIE_INVALID_ARGUMENT);
    cr_assert_str_eq(st.msg, "export_kv_pages: name is empty");
    char big[300];
    memset(big, 'n', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    cr_assert_eq(add(&ex, "export_kv_pages", "t", big, &p, &s, 1, true, 1, NULL, &st),
                 PIE_INVALID_ARGUMENT);
    cr_assert_str_eq(st.msg, "export_kv_pages: name is 299 bytes, more than 256");
    cr_assert_eq(ctl_pool_kv_refs(&p, s), 2, "only the first export holds a reference");
    ctl_vspace_release(&a);
    ctl_exports_free(&ex);
    ctl_pool_destroy(&p);
}

Test(ctl_vspace, tied_exports_go_with_their_exporter_and_persistent_ones_stay) {
    ctl_pool p = pool_of(4, 4);
    ctl_exports ex = {0};
    pie_status st;
    ctl_vspace a;
    ctl_vspace_init(&a, &p, 7);
    cr_assert_eq(ctl_vspace_alloc_kv(&a, "a", (uint32_t[]){1, 2}, 2, &st), PIE_OK);
    uint32_t s1 = slot_of(&a, 1), s2 = slot_of(&a, 2);
    cr_assert_eq(add(&ex, "e", "t", "tied", &p, &s1, 1, false, 7, NULL, &st), PIE_OK);
    cr_assert_eq(add(&ex, "e", "t", "kept", &p, &s2, 1, true, 7, NULL, &st), PIE_OK);
    cr_assert_eq(add(&ex, "e", "t", "other", &p, &s2, 1, false, 8, NULL, &st), PIE_OK);
    /* The exporter (instance 7) ends: its space is released and its tied exports dropped. */
    ctl_vspace_release(&a);
    ctl_exports_drop_tied(&ex, 7);
    cr_assert_null(ctl_exports_get(&ex, "t", "tied"));
    cr_assert_not_null(ctl_exports_get(&ex, "t", "kept"));
    cr_assert_not_null(ctl_exports_get(&ex, "t", "other"));
    cr_assert_eq(ctl_pool_kv_refs(&p, s1), 0, "nobody holds the tied export's page");
    cr_assert_eq(ctl_pool_kv_refs(&p, s2), 2, "two exports hold the other page");
    ctl_export **v;
    size_t n;
    cr_assert_eq(ctl_exports_sorted(&ex, &v, &n), 0);
    cr_assert_eq(n, 2);
    cr_assert_str_eq(v[0]->name, "kept");
    cr_assert_str_eq(v[1]->name, "other");
    free(v);
    ctl_exports_drop_pool(&ex, &p); /* the worker is gone */
    cr_assert_eq(ctl_exports_count(&ex), 0);
    ctl_exports_free(&ex);
    ctl_pool_destroy(&p);
}

/* Export names are per tenant; persistent exports charge their tenant's counter until they go
 * (removed, dropped with their pool, or expired after the TTL since their last use). */
Test(ctl_vspace, exports_are_per_tenant_charged_and_expire) {
    ctl_pool p = pool_of(8, 8);
    ctl_exports ex = {0};
    pie_status st;
    ctl_vspace a;
    ctl_vspace_init(&a, &p, 1);
    cr_assert_eq(ctl_vspace_alloc_kv(&a, "a", (uint32_t[]){1, 2, 3}, 3, &st), PIE_OK);
    uint32_t s[3] = {slot_of(&a, 1), slot_of(&a, 2), slot_of(&a, 3)};
    uint32_t alice = 0, bob = 0;
    cr_assert_eq(add(&ex, "e", "alice", "x", &p, s, 2, true, 1, &alice, &st), PIE_OK);
    cr_assert_eq(add(&ex, "e", "bob", "x", &p, s + 2, 1, true, 1, &bob, &st), PIE_OK,
                 "another tenant may use the same name");
    cr_assert_eq(add(&ex, "e", "bob", "tied", &p, s, 1, false, 1, &bob, &st), PIE_OK);
    cr_assert_eq(alice, 2);
    cr_assert_eq(bob, 1, "only persistent exports are charged");
    cr_assert_eq(ctl_exports_persistent(&ex), 2);
    cr_assert_eq(ctl_exports_get(&ex, "alice", "x")->n, 2);
    cr_assert_eq(ctl_exports_get(&ex, "bob", "x")->n, 1);
    cr_assert_null(ctl_exports_get(&ex, "carol", "x"));
    cr_assert_null(ctl_exports_get(&ex, "alice", "tied"));
    ctl_export **v;
    size_t n;
    cr_assert_eq(ctl_exports_sorted(&ex, &v, &n), 0);
    cr_assert_eq(n, 3);
    cr_assert_str_eq(v[0]->tenant, "alice");
    cr_assert_str_eq(v[1]->name, "tied");
    cr_assert_str_eq(v[2]->name, "x");
    free(v);
    /* alice's export was used at 5 s (an import), bob's at 0: a 10 s TTL at 12 s takes bob's. */
    ctl_exports_get(&ex, "alice", "x")->used_ns = 5000000000LL;
    ctl_exports_expire(&ex, 12000000000LL, 10000000000LL);
    cr_assert_null(ctl_exports_get(&ex, "bob", "x"));
    cr_assert_not_null(ctl_exports_get(&ex, "alice", "x"));
    cr_assert_not_null(ctl_exports_get(&ex, "bob", "tied"), "tied exports never expire");
    cr_assert_eq(bob, 0, "the expired export uncharged its tenant");
    cr_assert_eq(ctl_pool_kv_refs(&p, s[2]), 1, "its page is the exporter's alone again");
    ctl_exports_remove(&ex, ctl_exports_get(&ex, "alice", "x"));
    cr_assert_eq(alice, 0);
    cr_assert_eq(ctl_exports_persistent(&ex), 0);
    ctl_vspace_release(&a);
    ctl_exports_free(&ex);
    ctl_pool_destroy(&p);
}

Test(ctl_vspace, release_returns_every_slot_and_embedding) {
    ctl_pool p = pool_of(16, 16);
    ctl_vspace v;
    ctl_vspace_init(&v, &p, 1);
    pie_status st;
    uint32_t ids[10];
    for (uint32_t i = 0; i < 10; i++) ids[i] = i * 1000;
    cr_assert_eq(ctl_vspace_alloc_kv(&v, "a", ids, 10, &st), PIE_OK);
    cr_assert_eq(ctl_vspace_alloc_emb(&v, "a", ids, 10, &st), PIE_OK);
    ctl_pool_changes_clear(&p);
    ctl_vspace_release(&v);
    cr_assert_eq(p.kv_used, 0);
    cr_assert_eq(p.emb_used, 0);
    cr_assert_eq(p.ch.free_kv.n, 10);
    cr_assert_eq(p.ch.free_emb.n, 10);
    cr_assert_eq(v.kv.n, 0);
    ctl_pool_destroy(&p);
}

Test(ctl_vspace, importing_onto_bound_ids_is_refused) {
    ctl_pool p = pool_of(4, 4);
    ctl_vspace a;
    ctl_vspace_init(&a, &p, 1);
    pie_status st;
    cr_assert_eq(ctl_vspace_alloc_kv(&a, "a", (uint32_t[]){1, 2}, 2, &st), PIE_OK);
    uint32_t s = slot_of(&a, 1);
    cr_assert_eq(ctl_vspace_import_kv(&a, "import_kv_pages", (uint32_t[]){2}, &s, 1, &st),
                 PIE_INVALID_ARGUMENT);
    cr_assert_str_eq(st.msg, "import_kv_pages: kv page 2 is already allocated in this instance");
    cr_assert_eq(ctl_pool_kv_refs(&p, s), 1);
    ctl_vspace_release(&a);
    ctl_pool_destroy(&p);
}

Test(ctl_vspace, changes_sent_in_part_keep_the_rest_in_order) {
    ctl_pool p = pool_of(8, 8);
    ctl_vspace v;
    ctl_vspace_init(&v, &p, 1);
    pie_status st;
    cr_assert_eq(ctl_vspace_alloc_kv(&v, "a", (uint32_t[]){1, 2, 3}, 3, &st), PIE_OK);
    ctl_pool_changes_clear(&p);
    cr_assert_eq(ctl_vspace_dealloc_kv(&v, "d", (uint32_t[]){1, 2}, 2, &st), PIE_OK);
    cr_assert_eq(ctl_vspace_alloc_kv(&v, "a", (uint32_t[]){4, 5, 6}, 3, &st), PIE_OK);
    cr_assert_eq(ctl_pool_changes_count(&p), 5);
    /* A step took one free: the other free still precedes the allocs. */
    ctl_pool_changes_sent(&p, 1, 0, 0, 0);
    cr_assert_eq(p.ch.free_kv.n, 1);
    cr_assert_eq(p.ch.n_alloc_kv, 3);
    uint32_t s6 = slot_of(&v, 6);
    /* An alloc not yet sent and freed again is simply forgotten. */
    cr_assert_eq(ctl_vspace_dealloc_kv(&v, "d", (uint32_t[]){6}, 1, &st), PIE_OK);
    cr_assert_eq(p.ch.n_alloc_kv, 2);
    cr_assert_eq(p.kv_pending[s6], 0);
    ctl_pool_changes_sent(&p, 1, 0, 2, 0);
    cr_assert(!ctl_pool_has_changes(&p));
    ctl_vspace_release(&v);
    ctl_pool_destroy(&p);
}
