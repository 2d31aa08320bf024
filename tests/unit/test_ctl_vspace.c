/* test_ctl_vspace.c — resource virtualisation (services/controller/ctl_vspace.h): physical
 * pools with reference counts, per-instance id spaces, exports and imports, release, the slot
 * changes a worker is told about, and every error an id list can have. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
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
    /* Long lists take the hashing path. */
    uint32_t many[100];
    for (uint32_t i = 0; i < 100; i++) many[i] = i * 7;
    cr_assert_eq(ctl_ids_check("x", "f", "kv page", many, 100, 4096, &st), PIE_OK);
    many[99] = 7 * 50;
    cr_assert_eq(ctl_ids_check("x", "f", "kv page", many, 100, 4096, &st), PIE_INVALID_ARGUMENT);
    cr_assert_str_eq(st.msg, "x: kv page 350 is listed twice in f");
}

/* The first id (in list order) that repeats an earlier one, by brute force; -1 if none. */
static int64_t first_dup_ref(const uint32_t *ids, uint32_t n) {
    for (uint32_t i = 1; i < n; i++)
        for (uint32_t j = 0; j < i; j++)
            if (ids[i] == ids[j]) return ids[i];
    return -1;
}

Test(ctl_vspace, duplicates_in_long_lists_are_found_as_by_brute_force) {
    static uint32_t ids[3000];
    unsigned seed = 99;
    pie_status st;
    for (int round = 0; round < 300; round++) {
        uint32_t n = 1 + (uint32_t)rand_r(&seed) % 3000;
        /* ids from a range a little larger than the list (repeats likely, not certain), the
         * extremes of uint32 included, now and then all distinct */
        uint32_t range = n + 1 + (uint32_t)rand_r(&seed) % (round % 3 == 0 ? 4u * n : n / 8 + 2);
        for (uint32_t i = 0; i < n; i++) {
            uint32_t r = (uint32_t)rand_r(&seed) % range;
            ids[i] = round % 5 == 0 ? UINT32_MAX - r : r;
        }
        if (round % 7 == 0)
            for (uint32_t i = 0; i < n; i++) ids[i] = UINT32_MAX - 3 * i; /* distinct */
        int64_t want = first_dup_ref(ids, n);
        pie_code rc = ctl_ids_check("x", "f", "kv page", ids, n, 4096, &st);
        if (want < 0) {
            cr_assert_eq(rc, PIE_OK, "round %d, %u ids: %s", round, n, st.msg);
        } else {
            char msg[128];
            snprintf(msg, sizeof msg, "x: kv page %u is listed twice in f", (uint32_t)want);
            cr_assert_eq(rc, PIE_INVALID_ARGUMENT, "round %d", round);
            cr_assert_str_eq(st.msg, msg, "round %d, %u ids", round, n);
        }
    }
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
    cr_assert_eq(p.kv_pending_at[s6], 0);
    ctl_pool_changes_sent(&p, 1, 0, 2, 0);
    cr_assert(!ctl_pool_has_changes(&p));
    ctl_vspace_release(&v);
    ctl_pool_destroy(&p);
}

/* ---- the slot changes against a worker that applies them ----------------------------------- */

/* What a worker holds after applying what the controller sent: frees first, then allocs, in
 * the order flush_changes (ctl_exec.c) takes the lists, cut by a budget. */
typedef struct fake_worker {
    bool kv[64], emb[64];
} fake_worker;

/* Sends up to budget changes in flush_changes' order and applies them to w. */
static void send_changes(ctl_pool *p, fake_worker *w, uint32_t budget) {
    ctl_slot_changes *c = &p->ch;
    uint32_t len[4] = {c->free_kv.n, c->free_emb.n, c->n_alloc_kv, c->alloc_emb.n}, k[4] = {0};
    for (int l = 0; l < 4 && budget > 0; l++) {
        k[l] = len[l] < budget ? len[l] : budget;
        budget -= k[l];
        if (k[l] < len[l]) break;
    }
    for (uint32_t i = 0; i < k[0]; i++) {
        uint32_t s = c->free_kv.v[i];
        cr_assert(w->kv[s], "free of kv slot %u, which the worker does not hold", s);
        w->kv[s] = false;
    }
    for (uint32_t i = 0; i < k[1]; i++) {
        uint32_t s = c->free_emb.v[i];
        cr_assert(w->emb[s], "free of embedding slot %u, which the worker does not hold", s);
        w->emb[s] = false;
    }
    for (uint32_t i = 0; i < k[2]; i++) {
        uint32_t s = c->alloc_kv[i].slot;
        cr_assert(!w->kv[s], "alloc of kv slot %u, which the worker holds", s);
        cr_assert_eq(c->alloc_kv[i].owner, 7);
        w->kv[s] = true;
    }
    for (uint32_t i = 0; i < k[3]; i++) {
        uint32_t s = c->alloc_emb.v[i];
        cr_assert(!w->emb[s], "alloc of embedding slot %u, which the worker holds", s);
        w->emb[s] = true;
    }
    ctl_pool_changes_sent(p, k[0], k[1], k[2], k[3]);
}

/* Every pending alloc's index is where the list holds it, and only pending slots have one. */
static void check_pending_index(const ctl_pool *p) {
    const ctl_slot_changes *c = &p->ch;
    uint32_t n_kv = 0, n_emb = 0;
    for (uint32_t s = 0; s < 64; s++) {
        uint32_t a = p->kv_pending_at[s], e = p->emb_pending_at[s];
        if (a) {
            cr_assert_leq(a, c->n_alloc_kv);
            cr_assert_eq(c->alloc_kv[a - 1].slot, s, "kv slot %u's index %u is stale", s, a);
            n_kv++;
        }
        if (e) {
            cr_assert_leq(e, c->alloc_emb.n);
            cr_assert_eq(c->alloc_emb.v[e - 1], s, "embedding slot %u's index %u is stale", s, e);
            n_emb++;
        }
    }
    cr_assert_eq(n_kv, c->n_alloc_kv, "a pending kv alloc without its index");
    cr_assert_eq(n_emb, c->alloc_emb.n, "a pending embedding alloc without its index");
}

Test(ctl_vspace, random_allocs_frees_and_partial_sends_leave_the_worker_holding_the_live_slots) {
    ctl_pool p = pool_of(64, 64);
    ctl_vspace v;
    ctl_vspace_init(&v, &p, 7);
    fake_worker w = {0};
    bool kv_id[64] = {0}, emb_id[64] = {0}; /* ids 0..63 bound in v */
    unsigned seed = 12345;
    pie_status st;
    for (int op = 0; op < 20000; op++) {
        uint32_t r = (uint32_t)rand_r(&seed);
        bool kv = (r >> 8) & 1;
        bool *bound = kv ? kv_id : emb_id;
        uint32_t ids[64], n = 0;
        switch (r % 4) {
        case 0: /* alloc up to 40 unbound ids that the pool has room for */
        case 1: {
            uint32_t want = 1 + (r >> 9) % 40,
                     avail = kv ? ctl_pool_kv_available(&p) : ctl_pool_emb_available(&p);
            for (uint32_t id = (r >> 16) % 64, i = 0; i < 64 && n < want && n < avail; i++)
                if (!bound[(id + i) % 64]) ids[n++] = (id + i) % 64;
            if (n == 0) break;
            pie_code rc = kv ? ctl_vspace_alloc_kv(&v, "a", ids, n, &st)
                             : ctl_vspace_alloc_emb(&v, "a", ids, n, &st);
            cr_assert_eq(rc, PIE_OK, "%s", st.msg);
            for (uint32_t i = 0; i < n; i++) bound[ids[i]] = true;
            break;
        }
        case 2: /* free a random part of the bound ids, in a random order */
            for (uint32_t id = (r >> 16) % 64, i = 0; i < 64; i++)
                if (bound[(id + 7 * i) % 64] && ((uint32_t)rand_r(&seed) & 1))
                    ids[n++] = (id + 7 * i) % 64;
            if (n == 0) break;
            cr_assert_eq(kv ? ctl_vspace_dealloc_kv(&v, "d", ids, n, &st)
                            : ctl_vspace_dealloc_emb(&v, "d", ids, n, &st),
                         PIE_OK, "%s", st.msg);
            for (uint32_t i = 0; i < n; i++) bound[ids[i]] = false;
            break;
        default: {
            uint32_t budget = (r >> 9) % 48; /* a step takes some of the changes */
            send_changes(&p, &w, budget);
            break;
        }
        }
        check_pending_index(&p);
    }
    send_changes(&p, &w, UINT32_MAX);
    cr_assert(!ctl_pool_has_changes(&p));
    for (uint32_t id = 0; id < 64; id++) {
        uint32_t s;
        if (kv_id[id]) cr_assert(ctl_vspace_kv(&v, id, &s) && w.kv[s], "kv page %u", id);
        if (emb_id[id]) cr_assert(ctl_vspace_emb(&v, id, &s) && w.emb[s], "embedding %u", id);
    }
    uint32_t held_kv = 0, held_emb = 0, n_kv = 0, n_emb = 0;
    for (uint32_t i = 0; i < 64; i++) {
        held_kv += w.kv[i];
        held_emb += w.emb[i];
        n_kv += kv_id[i];
        n_emb += emb_id[i];
    }
    cr_assert_eq(held_kv, n_kv, "the worker holds kv slots no page is bound to");
    cr_assert_eq(held_emb, n_emb, "the worker holds embedding slots no id is bound to");
    ctl_vspace_release(&v);
    ctl_pool_destroy(&p);
}
