/* test_wrk_dep.c — the footprint of a step's deferred items and the dependency rule
 * (services/worker/mem/wrk_dep.h): a later item depends on what was deferred when it reads a
 * slot a deferred item writes, or writes one a deferred item reads or writes; reads beside
 * reads never depend; a new step starts empty. */
#include <criterion/criterion.h>

#include "pie_testutil.h"
#include "wrk_dep.h"

TestSuite(wrk_dep, .fini = pie_test_leak_check);

static wrk_dep dep_new(void) {
    wrk_dep d;
    pie_status st = {0};
    cr_assert_eq(wrk_dep_init(&d, 16, 8, &st), PIE_OK, "%s", st.msg);
    return d;
}

static wrk_dep_access kv(const uint32_t *r, uint32_t nr, const uint32_t *w, uint32_t nw) {
    return (wrk_dep_access){.kv_read = r, .n_kv_read = nr, .kv_write = w, .n_kv_write = nw};
}

static wrk_dep_access emb(const uint32_t *r, uint32_t nr, const uint32_t *w, uint32_t nw) {
    return (wrk_dep_access){.emb_read = r, .n_emb_read = nr, .emb_write = w, .n_emb_write = nw};
}

/* An item's whole access: the pages of k (a kv()) and the embedding slots of e (an emb()). */
static wrk_dep_access kv_and_emb(wrk_dep_access k, wrk_dep_access e) {
    k.emb_read = e.emb_read, k.n_emb_read = e.n_emb_read;
    k.emb_write = e.emb_write, k.n_emb_write = e.n_emb_write;
    return k;
}

Test(wrk_dep, nothing_depends_on_an_empty_footprint) {
    wrk_dep d = dep_new();
    const uint32_t p[] = {1, 2};
    wrk_dep_access a = kv(p, 2, p, 2);
    cr_assert(wrk_dep_empty(&d));
    cr_assert_not(wrk_dep_hits(&d, &a));
    wrk_dep_free(&d);
}

Test(wrk_dep, a_deferred_decode_holds_back_its_readers_and_the_writers_of_what_it_reads) {
    wrk_dep d = dep_new();
    /* a decode reads pages 3, 4 and embedding 1, appends to page 4, outputs embedding 2 */
    const uint32_t pages[] = {3, 4}, last[] = {4}, in[] = {1}, out[] = {2};
    wrk_dep_access decode = kv_and_emb(kv(pages, 2, last, 1), emb(in, 1, out, 1));
    wrk_dep_add(&d, &decode);
    const uint32_t p3[] = {3}, p4[] = {4}, p5[] = {5}, e1[] = {1}, e2[] = {2}, e3[] = {3};
    wrk_dep_access next_dist_of_output = emb(e2, 1, NULL, 0);
    wrk_dep_access reader_of_its_page = kv(p4, 1, NULL, 0);
    wrk_dep_access mask_of_its_context = kv(NULL, 0, p3, 1);
    wrk_dep_access embed_into_its_input = emb(NULL, 0, e1, 1);
    wrk_dep_access writer_of_its_output = emb(NULL, 0, e2, 1);
    cr_assert(wrk_dep_hits(&d, &next_dist_of_output), "read after write (embedding)");
    cr_assert(wrk_dep_hits(&d, &reader_of_its_page), "read after write (page)");
    cr_assert(wrk_dep_hits(&d, &mask_of_its_context), "write after read (page)");
    cr_assert(wrk_dep_hits(&d, &embed_into_its_input), "write after read (embedding)");
    cr_assert(wrk_dep_hits(&d, &writer_of_its_output), "write after write");
    wrk_dep_access reader_of_its_context = kv(p3, 1, NULL, 0);
    wrk_dep_access reader_of_its_input = emb(e1, 1, NULL, 0);
    wrk_dep_access elsewhere = kv_and_emb(kv(p5, 1, p5, 1), emb(e3, 1, e3, 1));
    cr_assert_not(wrk_dep_hits(&d, &reader_of_its_context), "reads beside reads");
    cr_assert_not(wrk_dep_hits(&d, &reader_of_its_input));
    cr_assert_not(wrk_dep_hits(&d, &elsewhere));
    wrk_dep_free(&d);
}

Test(wrk_dep, dependents_join_the_footprint_and_a_new_step_starts_empty) {
    wrk_dep d = dep_new();
    const uint32_t e2[] = {2}, p7[] = {7}, p9[] = {9};
    wrk_dep_access decode = emb(NULL, 0, e2, 1);
    wrk_dep_add(&d, &decode);
    /* a copy reading page 7 into page 9 would not depend; one of its readers then would not
     * either, until the copy itself is deferred */
    wrk_dep_access copy = kv(p7, 1, p9, 1), reader = kv(p9, 1, NULL, 0);
    cr_assert_not(wrk_dep_hits(&d, &copy));
    cr_assert_not(wrk_dep_hits(&d, &reader));
    wrk_dep_add(&d, &copy);
    cr_assert(wrk_dep_hits(&d, &reader), "the chain is followed");
    wrk_dep_clear(&d);
    cr_assert(wrk_dep_empty(&d));
    cr_assert_not(wrk_dep_hits(&d, &reader));
    wrk_dep_access again = emb(e2, 1, NULL, 0);
    cr_assert_not(wrk_dep_hits(&d, &again), "cleared slots do not linger");
    wrk_dep_free(&d);
}

Test(wrk_dep, ids_past_the_pools_are_ignored) {
    wrk_dep d = dep_new();
    const uint32_t big[] = {16, 1u << 31}, ebig[] = {8};
    wrk_dep_access a = kv_and_emb(kv(big, 2, big, 2), emb(ebig, 1, ebig, 1));
    wrk_dep_add(&d, &a);
    cr_assert(wrk_dep_empty(&d));
    cr_assert_not(wrk_dep_hits(&d, &a));
    wrk_dep_free(&d);
}
