/* test_ctl_registry.c — the controller's cluster storage alone
 * (services/controller/ctl_registry.c): tokenizers counted by the workers that supplied them,
 * programs bounded by bytes with the least recently used evicted, chunked reads and their bounds.
 * The RPCs around it are tested in tests/integration/test_cluster_store.c. */
#include <criterion/criterion.h>

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
    cr_assert_eq(ctl_registry_program_put(r, SHA_A, "a", filled(40, 'a'), 40, &already, &st),
                 PIE_OK, "%s", st.msg);
    cr_expect(!already);
    cr_assert_eq(ctl_registry_program_put(r, SHA_B, "b", filled(40, 'b'), 40, &already, &st),
                 PIE_OK, "%s", st.msg);
    ctl_registry_chunk c;
    /* a read makes A the most recently used: C (40 bytes) then evicts B */
    cr_assert_eq(ctl_registry_program_read(r, SHA_A, 0, 0, &c, &st), PIE_OK, "%s", st.msg);
    cr_expect(c.size == 40 && c.len == 0 && strcmp(c.name, "a") == 0);
    ctl_registry_chunk_free(&c);
    cr_assert_eq(ctl_registry_program_put(r, SHA_C, "c", filled(40, 'c'), 40, &already, &st),
                 PIE_OK, "%s", st.msg);
    cr_expect_eq(ctl_registry_program_read(r, SHA_B, 0, 0, &c, &st), PIE_NOT_FOUND);
    ctl_registry_chunk_free(&c);
    cr_expect_eq(ctl_registry_program_read(r, SHA_A, 0, 0, &c, &st), PIE_OK);
    ctl_registry_chunk_free(&c);
    cr_assert_eq(ctl_registry_program_read(r, SHA_C, 30, 64, &c, &st), PIE_OK);
    cr_expect(c.len == 10 && memcmp(c.data, "cccccccccc", 10) == 0, "len %zu", c.len);
    ctl_registry_chunk_free(&c);
    /* the same bytes again: already stored, the label is the latest */
    cr_assert_eq(ctl_registry_program_put(r, SHA_C, "c2", filled(40, 'c'), 40, &already, &st),
                 PIE_OK);
    cr_expect(already);
    cr_assert_eq(ctl_registry_program_read(r, SHA_C, 0, 0, &c, &st), PIE_OK);
    cr_expect_str_eq(c.name, "c2");
    ctl_registry_chunk_free(&c);
    /* larger than the whole registry: refused, nothing evicted */
    cr_expect_eq(ctl_registry_program_put(r, SHA_B, "big", filled(101, 'z'), 101, &already, &st),
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
