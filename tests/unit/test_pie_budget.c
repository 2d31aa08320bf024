/* test_pie_budget.c — pie_budget: takes that fit, takes that do not, and the reclaimer that a
 * take or a room check asks for exactly what is missing (the lifecycle's exited instances give
 * up their kept output through it). */
#include <criterion/criterion.h>
#include <stdint.h>

#include "pie_budget.h"

/* A cache of `held` bytes charged to a budget, given back in pieces of `piece` on request. */
typedef struct cache {
    pie_budget *b;
    uint64_t held, piece;
    int calls;
    uint64_t last_want;
} cache;

static uint64_t cache_reclaim(void *arg, uint64_t want) {
    cache *c = arg;
    c->calls++;
    c->last_want = want;
    uint64_t n = c->piece < c->held ? c->piece : c->held;
    c->held -= n;
    pie_budget_give(c->b, n);
    return n;
}

Test(pie_budget, a_take_within_the_bound_charges_and_one_beyond_charges_nothing) {
    pie_budget b = {.max = 100};
    cr_assert(pie_budget_take(&b, 60));
    cr_assert(!pie_budget_take(&b, 41), "41 bytes fit in the 40 left");
    cr_assert_eq(pie_budget_used(&b), 60, "a refused take charged %llu",
                 (unsigned long long)pie_budget_used(&b) - 60);
    cr_assert(pie_budget_take(&b, 40));
    cr_assert_eq(pie_budget_free(&b), 0);
    pie_budget_give(&b, 100);
    cr_assert_eq(pie_budget_used(&b), 0);
}

Test(pie_budget, a_take_that_does_not_fit_asks_the_reclaimer_for_what_is_missing) {
    pie_budget b = {.max = 100};
    cache c = {.b = &b, .held = 80, .piece = 80};
    pie_budget_force(&b, c.held);
    pie_budget_set_reclaim(&b, cache_reclaim, &c);
    cr_assert(pie_budget_take(&b, 50), "the reclaimer had 80 bytes to give back");
    cr_assert_eq(c.calls, 1);
    cr_assert_eq(c.last_want, 30, "asked for %llu bytes, 30 were missing",
                 (unsigned long long)c.last_want);
    cr_assert_eq(pie_budget_used(&b), 50);
    cr_assert(pie_budget_take(&b, 50), "50 fit without reclaiming");
    cr_assert_eq(c.calls, 1, "the reclaimer was asked although the take fit");
}

Test(pie_budget, the_reclaimer_is_asked_until_it_has_nothing_left) {
    pie_budget b = {.max = 100};
    cache c = {.b = &b, .held = 90, .piece = 10};
    pie_budget_force(&b, c.held);
    pie_budget_set_reclaim(&b, cache_reclaim, &c);
    cr_assert(pie_budget_take(&b, 45), "9 pieces of 10 could make room for 45");
    cr_assert_eq(c.held, 50, "the reclaimer gave back %llu bytes, 35 were needed (in 10s: 40)",
                 (unsigned long long)(90 - c.held));
    cr_assert(!pie_budget_take(&b, 200), "200 bytes fit in a budget of 100");
    cr_assert_eq(c.held, 0, "a take that cannot fit stops asking only when nothing is left");
    cr_assert_eq(pie_budget_used(&b), 45, "a refused take kept a charge");
}

Test(pie_budget, room_reclaims_but_charges_nothing) {
    pie_budget b = {.max = 100};
    cache c = {.b = &b, .held = 100, .piece = 100};
    pie_budget_force(&b, c.held);
    cr_assert(!pie_budget_room(&b, 1), "room in a full budget without a reclaimer");
    pie_budget_set_reclaim(&b, cache_reclaim, &c);
    cr_assert(pie_budget_room(&b, 20));
    cr_assert_eq(pie_budget_used(&b), 0, "room charged %llu",
                 (unsigned long long)pie_budget_used(&b));
    pie_budget_set_reclaim(&b, NULL, NULL);
    pie_budget_force(&b, 100);
    cr_assert(!pie_budget_room(&b, 1), "the removed reclaimer was still asked");
}

Test(pie_budget, an_unbounded_or_absent_budget_takes_everything) {
    pie_budget b = {0};
    cr_assert(pie_budget_take(&b, UINT64_MAX / 2));
    cr_assert(pie_budget_room(&b, UINT64_MAX));
    cr_assert(pie_budget_take(NULL, 1));
    cr_assert(pie_budget_room(NULL, 1));
}

/* A tenant's share of the replica's budget: a charge fits only if it fits both, is counted in
 * both, and a refusal by the parent leaves nothing charged in the share. */
Test(pie_budget, a_share_charges_its_parent_and_fits_only_within_both) {
    pie_budget replica = {.max = 100};
    pie_budget alice = {.max = 50, .parent = &replica}, bob = {.max = 50, .parent = &replica};
    cr_assert(pie_budget_take(&alice, 40));
    cr_assert(!pie_budget_take(&alice, 11), "alice's 11 more fit in her share of 50");
    cr_expect_eq(pie_budget_used(&alice), 40);
    cr_assert(pie_budget_take(&bob, 50));
    cr_expect_eq(pie_budget_used(&replica), 90);
    pie_budget_force(&replica, 5); /* charged by someone else: 5 left */
    cr_assert(!pie_budget_take(&alice, 10), "the replica has 5 left");
    cr_expect_eq(pie_budget_used(&alice), 40, "a refusal by the parent left a charge");
    cr_expect(!pie_budget_room(&alice, 10) && pie_budget_room(&alice, 5));
    pie_budget_give(&bob, 50);
    cr_expect_eq(pie_budget_used(&replica), 45);
    cr_assert(pie_budget_take(&alice, 10));
    cr_expect_eq(pie_budget_used(&replica), 55);
}
