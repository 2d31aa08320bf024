/* test_ctl_registry.c — the controller's cluster storage alone
 * (services/controller/ctl_registry.c): tokenizers counted by the workers that supplied them,
 * programs bounded by bytes with the least recently used evicted and the room shared fairly
 * between the tenants that hold them, chunked reads and their bounds.
 * The RPCs around it are tested in tests/integration/test_cluster_store.c. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ctl_registry.h"
#include "pie_testutil.h"

TestSuite(ctl_registry, .fini = pie_test_leak_check);

#define SHA_A "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
#define SHA_B "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
#define SHA_C "cccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc"

/* n bytes of value v, malloc'd (the registry takes them). */
static uint8_t *filled(size_t n, uint8_t v) {
    uint8_t *b = malloc(n);
    cr_assert(b);
    memset(b, v, n);
    return b;
}

/* A distinct program id: 64 hex digits, the last two n. */
static void id_of(char id[65], int n) {
    memset(id, 'e', 64);
    snprintf(id + 62, 3, "%02x", n & 0xff);
}

/* Puts program n (20 bytes) held by tenants (a NULL-terminated list; NULL: nobody). */
static pie_code put_n(ctl_registry *r, int n, const char *const *tenants, pie_status *st) {
    char id[65];
    id_of(id, n);
    size_t k = 0;
    while (tenants && tenants[k]) k++;
    bool already;
    return ctl_registry_program_put(r, id, "p", filled(20, (uint8_t)n), 20, tenants, k, &already,
                                    st);
}

static bool stored(ctl_registry *r, int n) {
    char id[65];
    id_of(id, n);
    return ctl_registry_program_has(r, id);
}

static pie_code read_tok(ctl_registry *r, const char *sha, uint64_t off, size_t max,
                         ctl_registry_chunk *c) {
    pie_status st;
    return ctl_registry_tokenizer_read(r, sha, off, max, c, &st);
}

Test(ctl_registry, a_tokenizer_lives_while_a_worker_that_supplied_it_is_linked) {
    pie_status st;
    ctl_registry *r = ctl_registry_create(1024, NULL, &st);
    cr_assert(r, "%s", st.msg);
    cr_assert_eq(ctl_registry_tokenizer_add(r, SHA_A, filled(10, 'x'), 10, &st), PIE_OK);
    /* a second worker of the same model: its copy is dropped, the count rises */
    cr_assert_eq(ctl_registry_tokenizer_add(r, SHA_A, filled(10, 'y'), 10, &st), PIE_OK);
    ctl_registry_chunk c;
    cr_assert_eq(read_tok(r, SHA_A, 2, 5, &c), PIE_OK);
    cr_expect(c.size == 10 && c.len == 5 && memcmp(c.data, "xxxxx", 5) == 0, "size %llu len %zu",
              (unsigned long long)c.size, c.len);
    ctl_registry_chunk_free(&c);
    cr_assert_eq(read_tok(r, SHA_A, 10, 5, &c), PIE_OK,
                 "reading at the end is empty, not an error");
    cr_expect_eq(c.len, 0);
    ctl_registry_chunk_free(&c);
    cr_expect_eq(read_tok(r, SHA_A, 11, 5, &c), PIE_INVALID_ARGUMENT);
    ctl_registry_chunk_free(&c);
    ctl_registry_tokenizer_release(r, SHA_A);
    cr_expect_eq(read_tok(r, SHA_A, 0, 5, &c), PIE_OK, "one worker still supplies it");
    ctl_registry_chunk_free(&c);
    ctl_registry_tokenizer_release(r, SHA_A);
    cr_expect_eq(read_tok(r, SHA_A, 0, 5, &c), PIE_NOT_FOUND);
    cr_expect_eq(read_tok(r, SHA_B, 0, 5, &c), PIE_NOT_FOUND);
    ctl_registry_destroy(r);
}

Test(ctl_registry, programs_beyond_the_bound_evict_the_least_recently_used) {
    pie_status st;
    ctl_registry *r = ctl_registry_create(100, NULL, &st);
    cr_assert(r, "%s", st.msg);
    bool already;
    cr_assert_eq(
        ctl_registry_program_put(r, SHA_A, "a", filled(40, 'a'), 40, NULL, 0, &already, &st),
        PIE_OK, "%s", st.msg);
    cr_expect(!already);
    cr_assert_eq(
        ctl_registry_program_put(r, SHA_B, "b", filled(40, 'b'), 40, NULL, 0, &already, &st),
        PIE_OK, "%s", st.msg);
    ctl_registry_chunk c;
    /* a read makes A the most recently used: C (40 bytes) then evicts B */
    cr_assert_eq(ctl_registry_program_read(r, SHA_A, 0, 0, &c, &st), PIE_OK, "%s", st.msg);
    cr_expect(c.size == 40 && c.len == 0 && strcmp(c.name, "a") == 0);
    ctl_registry_chunk_free(&c);
    cr_assert_eq(
        ctl_registry_program_put(r, SHA_C, "c", filled(40, 'c'), 40, NULL, 0, &already, &st),
        PIE_OK, "%s", st.msg);
    cr_expect_eq(ctl_registry_program_read(r, SHA_B, 0, 0, &c, &st), PIE_NOT_FOUND);
    ctl_registry_chunk_free(&c);
    cr_expect_eq(ctl_registry_program_read(r, SHA_A, 0, 0, &c, &st), PIE_OK);
    ctl_registry_chunk_free(&c);
    cr_assert_eq(ctl_registry_program_read(r, SHA_C, 30, 64, &c, &st), PIE_OK);
    cr_expect(c.len == 10 && memcmp(c.data, "cccccccccc", 10) == 0, "len %zu", c.len);
    ctl_registry_chunk_free(&c);
    /* the same bytes again: already stored, the label is the latest */
    cr_assert_eq(
        ctl_registry_program_put(r, SHA_C, "c2", filled(40, 'c'), 40, NULL, 0, &already, &st),
        PIE_OK);
    cr_expect(already);
    cr_assert_eq(ctl_registry_program_read(r, SHA_C, 0, 0, &c, &st), PIE_OK);
    cr_expect_str_eq(c.name, "c2");
    ctl_registry_chunk_free(&c);
    /* larger than the whole registry: refused, nothing evicted */
    cr_expect_eq(
        ctl_registry_program_put(r, SHA_B, "big", filled(101, 'z'), 101, NULL, 0, &already, &st),
        PIE_RESOURCE_EXHAUSTED);
    cr_expect(strstr(st.msg, "programs.registry_size") != NULL, "%s", st.msg);
    cr_expect_eq(ctl_registry_program_read(r, SHA_A, 0, 0, &c, &st), PIE_OK);
    ctl_registry_chunk_free(&c);
    cr_expect(ctl_registry_program_drop(r, SHA_A));
    cr_expect(!ctl_registry_program_drop(r, SHA_A));
    cr_expect_eq(ctl_registry_program_read(r, SHA_A, 0, 0, &c, &st), PIE_NOT_FOUND);
    ctl_registry_chunk_free(&c);
    ctl_registry_destroy(r);
}

static const char *const ALICE[] = {"alice", NULL}, *const BOB[] = {"bob", NULL},
                         *const CAROL[] = {"carol", NULL}, *const BOTH[] = {"alice", "bob", NULL};

/* The registry is shared by every tenant: one tenant's distinct uploads used to evict the
 * least recently used program whoever held it. Now the tenant holding the most pays. */
Test(ctl_registry, a_tenants_puts_evict_its_own_programs_not_those_of_a_tenant_holding_less) {
    pie_status st;
    ctl_registry *r = ctl_registry_create(100, NULL, &st);
    cr_assert(r, "%s", st.msg);
    cr_assert_eq(put_n(r, 1, ALICE, &st), PIE_OK, "%s", st.msg);
    for (int n = 10; n < 14; n++) cr_assert_eq(put_n(r, n, BOB, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(put_n(r, 14, BOB, &st), PIE_OK, "%s", st.msg); /* full: bob holds 100 with it */
    cr_expect(stored(r, 1), "bob's put evicted alice's program (the least recently used)");
    cr_expect(!stored(r, 10), "bob's least recently used program stayed");
    cr_assert_eq(put_n(r, 2, ALICE, &st), PIE_OK, "%s", st.msg); /* alice 40, bob 80: bob pays */
    cr_expect(stored(r, 1) && stored(r, 2) && !stored(r, 11) && stored(r, 12));
    ctl_registry_destroy(r);
}

/* Programs nobody holds (released by every tenant, or put without tenants) go first; a program
 * two tenants hold loses only the paying tenant's hold and stays for the other. */
Test(ctl_registry, programs_nobody_holds_go_first_and_a_shared_program_stays_for_its_other_holder) {
    pie_status st;
    ctl_registry *r = ctl_registry_create(100, NULL, &st);
    cr_assert(r, "%s", st.msg);
    cr_assert_eq(put_n(r, 1, BOTH, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(put_n(r, 10, BOB, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(put_n(r, 11, BOB, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(put_n(r, 20, NULL, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(put_n(r, 2, ALICE, &st), PIE_OK, "%s", st.msg); /* full */
    cr_assert_eq(put_n(r, 12, BOB, &st), PIE_OK, "%s", st.msg);
    cr_expect(!stored(r, 20), "the program nobody holds stayed");
    cr_expect(stored(r, 1) && stored(r, 10), "a held program went before the one nobody holds");
    /* bob holds 1, 10, 11, 12 and the new 13: his oldest, 1, is alice's too: only his hold
     * goes, then his 10 */
    cr_assert_eq(put_n(r, 13, BOB, &st), PIE_OK, "%s", st.msg);
    cr_expect(stored(r, 1), "the program alice holds too was evicted");
    cr_expect(!stored(r, 10) && stored(r, 11));
    /* alice releases 2: nobody holds it, so it goes before anything held */
    char id[65];
    id_of(id, 2);
    bool held = false;
    cr_expect(ctl_registry_program_release(r, id, "alice", &held));
    cr_expect(held);
    cr_expect(stored(r, 2), "a release removed the program from the registry");
    cr_assert_eq(put_n(r, 14, BOB, &st), PIE_OK, "%s", st.msg);
    cr_expect(!stored(r, 2) && stored(r, 1) && stored(r, 11));
    ctl_registry_destroy(r);
}

/* A put that would make its tenant hold more than any tenant whose programs could make room is
 * refused: it would evict the programs of tenants holding less. A hold adds tenants to a
 * stored program only. */
Test(ctl_registry, a_put_that_would_make_its_tenant_the_largest_holder_evicts_nobody_else) {
    pie_status st;
    ctl_registry *r = ctl_registry_create(100, NULL, &st);
    cr_assert(r, "%s", st.msg);
    for (int n = 1; n < 4; n++) cr_assert_eq(put_n(r, n, ALICE, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(put_n(r, 10, BOB, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(put_n(r, 11, BOB, &st), PIE_OK, "%s", st.msg); /* full: alice 60, bob 40 */
    /* carol's 50 bytes: alice would give 20, then carol would hold the most: refused, and
     * nothing evicted for it */
    bool already;
    cr_expect_eq(
        ctl_registry_program_put(r, SHA_C, "big", filled(50, 'c'), 50, CAROL, 1, &already, &st),
        PIE_RESOURCE_EXHAUSTED);
    cr_expect(strstr(st.msg, "\"carol\"") && strstr(st.msg, "programs.registry_size"), "%s",
              st.msg);
    cr_expect(stored(r, 1) && stored(r, 2) && stored(r, 3) && stored(r, 10) && stored(r, 11),
              "a refused put evicted programs");
    /* 20 bytes: carol holds less than alice; alice's oldest goes */
    cr_assert_eq(put_n(r, 30, CAROL, &st), PIE_OK, "%s", st.msg);
    cr_expect(!stored(r, 1) && stored(r, 2) && stored(r, 10) && stored(r, 30));
    /* holds */
    cr_expect_eq(ctl_registry_program_hold(r, SHA_C, CAROL, 1, &st), PIE_NOT_FOUND);
    char id[65];
    id_of(id, 11);
    cr_assert_eq(ctl_registry_program_hold(r, id, CAROL, 1, &st), PIE_OK, "%s", st.msg);
    bool held = false;
    cr_expect(ctl_registry_program_release(r, id, "bob", &held));
    cr_expect(held);
    cr_expect(ctl_registry_program_release(r, id, "bob", &held), "a second release removed it");
    cr_expect(!held, "bob's hold was released twice");
    cr_expect(!ctl_registry_program_release(r, SHA_C, "bob", &held),
              "released a program not stored");
    /* 11 is carol's alone now (the hold refreshed it): she holds 40 of the 100 and with her
     * next put 60, so it evicts her least recently used, 30, not alice's 2 or bob's 10 */
    cr_assert_eq(put_n(r, 31, CAROL, &st), PIE_OK, "%s", st.msg);
    cr_expect(stored(r, 2) && stored(r, 3) && stored(r, 10) && stored(r, 11) && !stored(r, 30) &&
              stored(r, 31));
    ctl_registry_destroy(r);
}
