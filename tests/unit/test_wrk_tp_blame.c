/* The launcher's verdict on a failed group: a rank that only witnessed the failure (exit 3) is
 * not blamed while the rank that really died is still on its way to being reaped
 * (e2e/test_tp's killed-follower test saw rank 0 blamed for rank 1's SIGKILL under ASan). */
#include <criterion/criterion.h>

#include "wrk_tp_blame.h"

Test(tp_blame, a_killed_rank_is_blamed_at_once) {
    wrk_tp_blame b;
    wrk_tp_blame_init(&b);
    cr_assert(wrk_tp_blame_exit(&b, 1, false, false, 100));
    cr_assert_eq(b.culprit, 1);
    cr_assert_eq(wrk_tp_blame_wait_ms(&b, 100), -1);
    /* later exits change nothing */
    cr_assert_not(wrk_tp_blame_exit(&b, 0, false, false, 101));
    cr_assert_not(wrk_tp_blame_tick(&b, 5000, true));
    cr_assert_eq(b.culprit, 1);
}

Test(tp_blame, a_witness_reaped_before_the_dead_rank_is_not_blamed) {
    wrk_tp_blame b;
    wrk_tp_blame_init(&b);
    cr_assert_not(wrk_tp_blame_exit(&b, 0, false, true, 1000));
    cr_assert_eq(b.culprit, -1);
    cr_assert_eq(wrk_tp_blame_wait_ms(&b, 1000), WRK_TP_BLAME_GRACE_MS);
    cr_assert_not(wrk_tp_blame_tick(&b, 1000 + WRK_TP_BLAME_GRACE_MS / 2, false));
    cr_assert(wrk_tp_blame_exit(&b, 1, false, false, 1000 + WRK_TP_BLAME_GRACE_MS / 2));
    cr_assert_eq(b.culprit, 1);
}

Test(tp_blame, a_witness_is_blamed_when_nothing_else_ends_within_the_grace) {
    wrk_tp_blame b;
    wrk_tp_blame_init(&b);
    cr_assert_not(wrk_tp_blame_exit(&b, 2, false, true, 0));
    cr_assert_not(wrk_tp_blame_exit(&b, 3, false, true, 10)); /* a second witness */
    cr_assert_not(wrk_tp_blame_exit(&b, 1, true, false, 20)); /* a clean exit is no cause */
    cr_assert_eq(wrk_tp_blame_wait_ms(&b, 20), WRK_TP_BLAME_GRACE_MS - 20);
    cr_assert_not(wrk_tp_blame_tick(&b, WRK_TP_BLAME_GRACE_MS - 1, false));
    cr_assert(wrk_tp_blame_tick(&b, WRK_TP_BLAME_GRACE_MS, false));
    cr_assert_eq(b.culprit, 2, "the first witness, not the second");
}

Test(tp_blame, no_rank_left_ends_the_wait) {
    wrk_tp_blame b;
    wrk_tp_blame_init(&b);
    cr_assert_not(wrk_tp_blame_exit(&b, 0, false, true, 0));
    cr_assert(wrk_tp_blame_tick(&b, 1, true));
    cr_assert_eq(b.culprit, 0);
}

Test(tp_blame, clean_exits_decide_nothing) {
    wrk_tp_blame b;
    wrk_tp_blame_init(&b);
    for (uint32_t r = 0; r < 4; r++) cr_assert_not(wrk_tp_blame_exit(&b, r, true, false, r));
    cr_assert_not(wrk_tp_blame_tick(&b, 1 << 20, true));
    cr_assert_eq(b.culprit, -1);
    cr_assert_eq(wrk_tp_blame_wait_ms(&b, 0), -1);
}
