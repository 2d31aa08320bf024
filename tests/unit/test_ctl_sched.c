/* test_ctl_sched.c — the controller's batch scheduler (services/controller/ctl_sched.h) on its
 * own: a toy owner whose queues hold calls of given kinds, sizes, conflicts and failures, and
 * which records the batches the scheduler forms. Covers vertical and horizontal batching,
 * priorities, truncation at the worker's limit, the oldest-call-first choice, conflicts,
 * failed calls, and each strategy (work_conserving, eager, k_only, t_only). */
#include <criterion/criterion.h>

#include <string.h>

#include "ctl_sched.h"

#define MAXQ 16
#define MAXC 16
#define MAXB 64

typedef struct tcall {
    int kind;
    uint32_t size; /* items it takes */
    bool conflict; /* conflicts with the batch being formed (once) */
    bool fail;     /* fails validation */
    uint64_t seq;
    int64_t t_ns;
    int id; /* printed in recorded batches */
} tcall;

typedef struct tqueue {
    ctl_sq sq; /* first member: the scheduler hands back &sq */
    tcall calls[MAXC];
    int n, head;
} tqueue;

typedef struct towner {
    ctl_sched s;
    tqueue q[MAXQ];
    int nq;
    uint64_t seq;
    uint32_t max_items, cur_items;
    int kind[MAXB], len[MAXB], ids[MAXB][MAXC * MAXQ];
    int nb, settles, failed_ids[MAXC * MAXQ], n_failed;
} towner;

static void relink(towner *o, tqueue *q) {
    if (q->head < q->n)
        ctl_sched_ready(&o->s, &q->sq, q->calls[q->head].kind, q->calls[q->head].seq,
                        q->calls[q->head].t_ns);
    else
        ctl_sched_unready(&o->s, &q->sq);
}

static void t_open(void *user, int kind) {
    towner *o = user;
    cr_assert_lt(o->nb, MAXB);
    o->kind[o->nb] = kind;
    o->len[o->nb] = 0;
    o->cur_items = 0;
}

static ctl_admit t_admit(void *user, ctl_sq *sq, int kind) {
    towner *o = user;
    tqueue *q = (tqueue *)sq;
    cr_assert_lt(q->head, q->n, "admit of an empty queue");
    tcall *c = &q->calls[q->head];
    cr_assert_eq(c->kind, kind, "call %d of kind %d offered to a batch of kind %d", c->id, c->kind,
                 kind);
    if (c->fail) {
        o->failed_ids[o->n_failed++] = c->id;
        q->head++;
        relink(o, q);
        return CTL_ADMIT_FAILED;
    }
    if (c->conflict) {
        c->conflict = false;
        return CTL_ADMIT_CONFLICT;
    }
    if (o->cur_items + c->size > o->max_items) return CTL_ADMIT_FULL;
    o->cur_items += c->size;
    o->ids[o->nb][o->len[o->nb]++] = c->id;
    q->head++;
    relink(o, q);
    return CTL_ADMIT_TAKEN;
}

static void t_close(void *user, int kind, uint32_t n_taken) {
    towner *o = user;
    cr_assert_eq(o->kind[o->nb], kind);
    cr_assert_eq((int)n_taken, o->len[o->nb]);
    if (n_taken) o->nb++;
}

static void t_settle(void *user) { ((towner *)user)->settles++; }

static const ctl_sched_ops ops = {t_open, t_admit, t_close, t_settle};

static void setup(towner *o, ctl_strategy strat, uint32_t max_items) {
    memset(o, 0, sizeof *o);
    ctl_sched_config cfg = {.strategy = strat,
                            .k = 3,
                            .t_ns = 1000000,
                            .k_timeout_ns = 50000000,
                            .max_step_batches = 32};
    cr_assert_eq(ctl_sched_init(&o->s, &cfg), 0);
    o->max_items = max_items;
}

/* Adds a queue with the given kinds (one call each, size 1) arriving at t_ns; returns it. */
static tqueue *add_queue(towner *o, int rank, int64_t t_ns, int n, const int *kinds) {
    tqueue *q = &o->q[o->nq];
    q->sq.kind = CTL_KIND_NONE;
    q->sq.rank = rank;
    for (int i = 0; i < n; i++)
        q->calls[i] = (tcall){
            .kind = kinds[i], .size = 1, .seq = ++o->seq, .t_ns = t_ns, .id = o->nq * 10 + i};
    q->n = n;
    o->nq++;
    relink(o, q);
    return q;
}

static uint32_t step(towner *o, int64_t now, int64_t *wake) {
    int64_t w = 0;
    uint32_t n = ctl_sched_step(&o->s, now, &ops, o, &w);
    if (wake) *wake = w;
    return n;
}

/* Asserts batch b has kind and exactly the ids given. */
static void expect_batch(const towner *o, int b, int kind, int n, const int *ids) {
    cr_assert_lt(b, o->nb, "batch %d was not formed (%d formed)", b, o->nb);
    cr_assert_eq(o->kind[b], kind, "batch %d has kind %s, expected %s", b,
                 ctl_kind_name(o->kind[b]), ctl_kind_name(kind));
    cr_assert_eq(o->len[b], n, "batch %d has %d calls, expected %d", b, o->len[b], n);
    for (int i = 0; i < n; i++)
        cr_assert_eq(o->ids[b][i], ids[i], "batch %d call %d is %d, expected %d", b, i,
                     o->ids[b][i], ids[i]);
}

static const int EMB[] = {CTL_KIND_EMBED};

TestSuite(ctl_sched);

Test(ctl_sched, horizontal_batch_takes_the_ready_call_of_every_queue) {
    towner o;
    setup(&o, CTL_STRATEGY_WORK_CONSERVING, 100);
    for (int i = 0; i < 3; i++) add_queue(&o, CTL_RANK_NORMAL, 0, 1, EMB);
    cr_assert_eq(step(&o, 0, NULL), 1);
    expect_batch(&o, 0, CTL_KIND_EMBED, 3, (int[]){0, 10, 20});
    cr_assert_eq(ctl_sched_waiting(&o.s), 0);
    ctl_sched_destroy(&o.s);
}

Test(ctl_sched, vertical_batch_takes_consecutive_same_kind_calls_of_one_queue) {
    towner o;
    setup(&o, CTL_STRATEGY_WORK_CONSERVING, 100);
    add_queue(&o, CTL_RANK_NORMAL, 0, 3,
              (int[]){CTL_KIND_FORWARD, CTL_KIND_FORWARD, CTL_KIND_DIST});
    add_queue(&o, CTL_RANK_NORMAL, 0, 1, (int[]){CTL_KIND_FORWARD});
    cr_assert_eq(step(&o, 0, NULL), 2);
    expect_batch(&o, 0, CTL_KIND_FORWARD, 3, (int[]){0, 1, 10});
    expect_batch(&o, 1, CTL_KIND_DIST, 1, (int[]){2});
    ctl_sched_destroy(&o.s);
}

Test(ctl_sched, a_kind_change_ends_vertical_batching_and_the_chain_goes_in_one_step) {
    towner o;
    setup(&o, CTL_STRATEGY_WORK_CONSERVING, 100);
    add_queue(&o, CTL_RANK_NORMAL, 0, 4,
              (int[]){CTL_KIND_EMBED, CTL_KIND_FORWARD, CTL_KIND_DIST, CTL_KIND_EMBED});
    cr_assert_eq(step(&o, 0, NULL), 4);
    expect_batch(&o, 0, CTL_KIND_EMBED, 1, (int[]){0});
    expect_batch(&o, 1, CTL_KIND_FORWARD, 1, (int[]){1});
    expect_batch(&o, 2, CTL_KIND_DIST, 1, (int[]){2});
    expect_batch(&o, 3, CTL_KIND_EMBED, 1, (int[]){3});
    cr_assert_eq(o.settles, 4, "settle runs after every batch");
    ctl_sched_destroy(&o.s);
}

Test(ctl_sched, decode_steps_of_many_queues_become_three_batches) {
    towner o;
    setup(&o, CTL_STRATEGY_WORK_CONSERVING, 100);
    const int decode[] = {CTL_KIND_EMBED, CTL_KIND_FORWARD, CTL_KIND_DIST};
    for (int i = 0; i < 5; i++) add_queue(&o, CTL_RANK_NORMAL, 0, 3, decode);
    cr_assert_eq(step(&o, 0, NULL), 3);
    expect_batch(&o, 0, CTL_KIND_EMBED, 5, (int[]){0, 10, 20, 30, 40});
    expect_batch(&o, 1, CTL_KIND_FORWARD, 5, (int[]){1, 11, 21, 31, 41});
    expect_batch(&o, 2, CTL_KIND_DIST, 5, (int[]){2, 12, 22, 32, 42});
    ctl_sched_destroy(&o.s);
}

Test(ctl_sched, high_priority_calls_come_first_and_low_last_within_a_batch) {
    towner o;
    setup(&o, CTL_STRATEGY_WORK_CONSERVING, 100);
    add_queue(&o, CTL_RANK_LOW, 0, 1, EMB);    /* id 0, oldest */
    add_queue(&o, CTL_RANK_NORMAL, 0, 1, EMB); /* id 10 */
    add_queue(&o, CTL_RANK_HIGH, 0, 1, EMB);   /* id 20, newest */
    add_queue(&o, CTL_RANK_NORMAL, 0, 1, EMB); /* id 30 */
    cr_assert_eq(step(&o, 0, NULL), 1);
    expect_batch(&o, 0, CTL_KIND_EMBED, 4, (int[]){20, 10, 30, 0});
    ctl_sched_destroy(&o.s);
}

Test(ctl_sched, truncation_at_the_worker_limit_cuts_the_tail_into_the_next_batch) {
    towner o;
    setup(&o, CTL_STRATEGY_WORK_CONSERVING, 2);
    for (int i = 0; i < 3; i++) add_queue(&o, CTL_RANK_NORMAL, 0, 1, EMB);
    o.s.cfg.max_step_batches = 1;
    cr_assert_eq(step(&o, 0, NULL), 1);
    expect_batch(&o, 0, CTL_KIND_EMBED, 2, (int[]){0, 10});
    cr_assert_eq(ctl_sched_waiting(&o.s), 1, "the truncated call waits");
    cr_assert_eq(step(&o, 0, NULL), 1);
    expect_batch(&o, 1, CTL_KIND_EMBED, 1, (int[]){20});
    ctl_sched_destroy(&o.s);
}

Test(ctl_sched, truncation_keeps_priority_order_so_low_priority_calls_wait) {
    towner o;
    setup(&o, CTL_STRATEGY_WORK_CONSERVING, 2);
    add_queue(&o, CTL_RANK_LOW, 0, 1, EMB);
    add_queue(&o, CTL_RANK_HIGH, 0, 1, EMB);
    add_queue(&o, CTL_RANK_NORMAL, 0, 1, EMB);
    o.s.cfg.max_step_batches = 1;
    cr_assert_eq(step(&o, 0, NULL), 1);
    expect_batch(&o, 0, CTL_KIND_EMBED, 2, (int[]){10, 20});
    ctl_sched_destroy(&o.s);
}

Test(ctl_sched, a_call_larger_than_the_room_left_ends_the_batch) {
    towner o;
    setup(&o, CTL_STRATEGY_WORK_CONSERVING, 4);
    add_queue(&o, CTL_RANK_NORMAL, 0, 1, EMB);
    tqueue *big = add_queue(&o, CTL_RANK_NORMAL, 0, 1, EMB);
    big->calls[0].size = 4;
    add_queue(&o, CTL_RANK_NORMAL, 0, 1, EMB);
    o.s.cfg.max_step_batches = 1;
    cr_assert_eq(step(&o, 0, NULL), 1);
    /* Truncation from the tail: the small call after the big one waits too. */
    expect_batch(&o, 0, CTL_KIND_EMBED, 1, (int[]){0});
    ctl_sched_destroy(&o.s);
}

Test(ctl_sched, the_batch_holding_the_oldest_waiting_call_goes_first) {
    towner o;
    setup(&o, CTL_STRATEGY_WORK_CONSERVING, 100);
    add_queue(&o, CTL_RANK_NORMAL, 0, 1, (int[]){CTL_KIND_DIST});  /* seq 1: oldest */
    add_queue(&o, CTL_RANK_NORMAL, 0, 1, EMB);                     /* seq 2 */
    add_queue(&o, CTL_RANK_NORMAL, 0, 1, EMB);                     /* seq 3 */
    add_queue(&o, CTL_RANK_HIGH, 0, 1, (int[]){CTL_KIND_FORWARD}); /* seq 4: priority does not
                                                                     reorder kinds */
    cr_assert_eq(step(&o, 0, NULL), 3);
    expect_batch(&o, 0, CTL_KIND_DIST, 1, (int[]){0});
    expect_batch(&o, 1, CTL_KIND_EMBED, 2, (int[]){10, 20});
    expect_batch(&o, 2, CTL_KIND_FORWARD, 1, (int[]){30});
    ctl_sched_destroy(&o.s);
}

Test(ctl_sched, oldest_first_looks_at_every_queue_not_just_the_first_ready) {
    towner o;
    setup(&o, CTL_STRATEGY_WORK_CONSERVING, 100);
    /* q0 becomes ready for embed late (its head was a forward); q1's embed is older. */
    add_queue(&o, CTL_RANK_NORMAL, 0, 1, EMB);                       /* seq 1 */
    add_queue(&o, CTL_RANK_NORMAL, 0, 1, (int[]){CTL_KIND_FORWARD}); /* seq 2 */
    o.q[0].calls[0].seq = 9;
    relink(&o, &o.q[0]);
    o.s.cfg.max_step_batches = 1;
    cr_assert_eq(step(&o, 0, NULL), 1);
    expect_batch(&o, 0, CTL_KIND_FORWARD, 1, (int[]){10});
    ctl_sched_destroy(&o.s);
}

Test(ctl_sched, a_conflicting_call_waits_while_other_queues_fill_the_batch) {
    towner o;
    setup(&o, CTL_STRATEGY_WORK_CONSERVING, 100);
    tqueue *q0 = add_queue(&o, CTL_RANK_NORMAL, 0, 2, (int[]){CTL_KIND_FORWARD, CTL_KIND_FORWARD});
    add_queue(&o, CTL_RANK_NORMAL, 0, 1, (int[]){CTL_KIND_FORWARD});
    q0->calls[1].conflict = true;
    cr_assert_eq(step(&o, 0, NULL), 2);
    expect_batch(&o, 0, CTL_KIND_FORWARD, 2, (int[]){0, 10});
    expect_batch(&o, 1, CTL_KIND_FORWARD, 1, (int[]){1});
    ctl_sched_destroy(&o.s);
}

Test(ctl_sched, a_failed_call_is_consumed_and_its_queue_goes_on) {
    towner o;
    setup(&o, CTL_STRATEGY_WORK_CONSERVING, 100);
    tqueue *q0 = add_queue(&o, CTL_RANK_NORMAL, 0, 2, (int[]){CTL_KIND_EMBED, CTL_KIND_EMBED});
    q0->calls[0].fail = true;
    cr_assert_eq(step(&o, 0, NULL), 1);
    expect_batch(&o, 0, CTL_KIND_EMBED, 1, (int[]){1});
    cr_assert_eq(o.n_failed, 1);
    cr_assert_eq(o.failed_ids[0], 0);
    ctl_sched_destroy(&o.s);
}

Test(ctl_sched, a_step_holds_at_most_max_step_batches) {
    towner o;
    setup(&o, CTL_STRATEGY_WORK_CONSERVING, 100);
    add_queue(&o, CTL_RANK_NORMAL, 0, 3, (int[]){CTL_KIND_EMBED, CTL_KIND_FORWARD, CTL_KIND_DIST});
    o.s.cfg.max_step_batches = 2;
    cr_assert_eq(step(&o, 0, NULL), 2);
    cr_assert_eq(ctl_sched_waiting(&o.s), 1);
    ctl_sched_destroy(&o.s);
}

Test(ctl_sched, eager_sends_every_call_in_a_batch_of_its_own) {
    towner o;
    setup(&o, CTL_STRATEGY_EAGER, 100);
    for (int i = 0; i < 3; i++) add_queue(&o, CTL_RANK_NORMAL, 0, 1, EMB);
    add_queue(&o, CTL_RANK_NORMAL, 0, 2, (int[]){CTL_KIND_FORWARD, CTL_KIND_FORWARD});
    cr_assert_eq(step(&o, 0, NULL), 5);
    for (int b = 0; b < 5; b++) cr_assert_eq(o.len[b], 1, "batch %d holds %d calls", b, o.len[b]);
    expect_batch(&o, 0, CTL_KIND_EMBED, 1, (int[]){0});
    expect_batch(&o, 3, CTL_KIND_FORWARD, 1, (int[]){30});
    expect_batch(&o, 4, CTL_KIND_FORWARD, 1, (int[]){31});
    ctl_sched_destroy(&o.s);
}

Test(ctl_sched, k_only_waits_for_k_queues_then_fires_them_together) {
    towner o;
    setup(&o, CTL_STRATEGY_K_ONLY, 100); /* k = 3, k_timeout 50 ms */
    add_queue(&o, CTL_RANK_NORMAL, 1000, 1, EMB);
    add_queue(&o, CTL_RANK_NORMAL, 2000, 1, EMB);
    int64_t wake;
    cr_assert_eq(step(&o, 3000, &wake), 0, "2 of 3 queues: no batch");
    cr_assert_eq(wake, 1000 + 50000000, "wakes when the oldest call's k_timeout ends");
    add_queue(&o, CTL_RANK_NORMAL, 4000, 1, EMB);
    cr_assert_eq(step(&o, 5000, &wake), 1);
    expect_batch(&o, 0, CTL_KIND_EMBED, 3, (int[]){0, 10, 20});
    ctl_sched_destroy(&o.s);
}

Test(ctl_sched, k_only_batches_hold_at_most_k_queues_oldest_first) {
    towner o;
    setup(&o, CTL_STRATEGY_K_ONLY, 100); /* k = 3 */
    for (int i = 0; i < 7; i++) add_queue(&o, CTL_RANK_NORMAL, 1000 * (i + 1), 1, EMB);
    cr_assert_eq(step(&o, 10000, NULL), 2, "7 queues: two batches of 3, one call left over");
    expect_batch(&o, 0, CTL_KIND_EMBED, 3, (int[]){0, 10, 20});
    expect_batch(&o, 1, CTL_KIND_EMBED, 3, (int[]){30, 40, 50});
    cr_assert_eq(ctl_sched_waiting(&o.s), 1, "the seventh waits for two more queues");
    ctl_sched_destroy(&o.s);
}

Test(ctl_sched, k_only_fires_a_short_batch_once_k_timeout_passed) {
    towner o;
    setup(&o, CTL_STRATEGY_K_ONLY, 100);
    add_queue(&o, CTL_RANK_NORMAL, 0, 1, EMB);
    cr_assert_eq(step(&o, 49999999, NULL), 0);
    cr_assert_eq(step(&o, 50000000, NULL), 1);
    expect_batch(&o, 0, CTL_KIND_EMBED, 1, (int[]){0});
    ctl_sched_destroy(&o.s);
}

Test(ctl_sched, t_only_fires_once_the_oldest_call_waited_t) {
    towner o;
    setup(&o, CTL_STRATEGY_T_ONLY, 100); /* t = 1 ms */
    add_queue(&o, CTL_RANK_NORMAL, 10000, 1, EMB);
    add_queue(&o, CTL_RANK_NORMAL, 500000, 1, EMB);
    int64_t wake;
    cr_assert_eq(step(&o, 900000, &wake), 0);
    cr_assert_eq(wake, 10000 + 1000000);
    cr_assert_eq(step(&o, 1010000, &wake), 1);
    expect_batch(&o, 0, CTL_KIND_EMBED, 2, (int[]){0, 10});
    cr_assert_eq(wake, 0, "nothing waits any more");
    ctl_sched_destroy(&o.s);
}

Test(ctl_sched, t_only_lets_a_due_kind_fire_while_another_waits) {
    towner o;
    setup(&o, CTL_STRATEGY_T_ONLY, 100);
    add_queue(&o, CTL_RANK_NORMAL, 0, 1, (int[]){CTL_KIND_DIST});
    add_queue(&o, CTL_RANK_NORMAL, 900000, 1, EMB);
    int64_t wake;
    cr_assert_eq(step(&o, 1000000, &wake), 1);
    expect_batch(&o, 0, CTL_KIND_DIST, 1, (int[]){0});
    cr_assert_eq(wake, 1900000);
    ctl_sched_destroy(&o.s);
}

Test(ctl_sched, work_conserving_fires_whatever_is_ready_at_once) {
    towner o;
    setup(&o, CTL_STRATEGY_WORK_CONSERVING, 100);
    add_queue(&o, CTL_RANK_NORMAL, 0, 1, EMB);
    int64_t wake;
    cr_assert_eq(step(&o, 0, &wake), 1);
    cr_assert_eq(wake, 0);
    cr_assert_eq(step(&o, 0, &wake), 0, "nothing left");
    ctl_sched_destroy(&o.s);
}

Test(ctl_sched, ready_lists_track_queues_moving_between_kinds) {
    towner o;
    setup(&o, CTL_STRATEGY_WORK_CONSERVING, 100);
    tqueue *q = add_queue(&o, CTL_RANK_NORMAL, 0, 1, EMB);
    cr_assert_eq(o.s.n_ready[CTL_KIND_EMBED], 1);
    ctl_sched_ready(&o.s, &q->sq, CTL_KIND_DIST, 5, 0);
    cr_assert_eq(o.s.n_ready[CTL_KIND_EMBED], 0);
    cr_assert_eq(o.s.n_ready[CTL_KIND_DIST], 1);
    ctl_sched_unready(&o.s, &q->sq);
    ctl_sched_unready(&o.s, &q->sq); /* idempotent */
    cr_assert_eq(ctl_sched_waiting(&o.s), 0);
    cr_assert_eq(q->sq.kind, CTL_KIND_NONE);
    ctl_sched_destroy(&o.s);
}

Test(ctl_sched, strategy_names_match_the_enum) {
    cr_assert_str_eq(ctl_strategy_names[CTL_STRATEGY_WORK_CONSERVING], "work_conserving");
    cr_assert_str_eq(ctl_strategy_names[CTL_STRATEGY_EAGER], "eager");
    cr_assert_str_eq(ctl_strategy_names[CTL_STRATEGY_K_ONLY], "k_only");
    cr_assert_str_eq(ctl_strategy_names[CTL_STRATEGY_T_ONLY], "t_only");
    cr_assert_null(ctl_strategy_names[4]);
}
