/* wrk_tp_blame.h — which rank took a tensor-parallel group down (the launcher's verdict).
 *
 * A rank that exits WRK_TP_EXIT_GROUP_FAILED only saw its group fail, most often because another
 * rank died. The dead rank's own exit can reach the launcher *later*: a killed process releases
 * its robust futexes and sockets (which the others notice at once) before it becomes reapable,
 * and under a sanitizer its teardown takes long enough for a witness to exit first. So a
 * witness is blamed only when no other cause ends within WRK_TP_BLAME_GRACE_MS; any other
 * unclean end (a signal, another status) is blamed at once. Pure logic, clock passed in. */
#ifndef WRK_TP_BLAME_H
#define WRK_TP_BLAME_H

#include <stdbool.h>
#include <stdint.h>

#define WRK_TP_EXIT_GROUP_FAILED 3  /* a rank left because its group failed */
#define WRK_TP_BLAME_GRACE_MS    1000

typedef struct wrk_tp_blame {
    int culprit;         /* the rank blamed, -1 while undecided */
    int witness;         /* the first rank that exited WRK_TP_EXIT_GROUP_FAILED, -1 if none */
    int64_t deadline_ms; /* when the witness is blamed if nothing else ended */
} wrk_tp_blame;

void wrk_tp_blame_init(wrk_tp_blame *b);

/* Rank `rank` ended: cleanly (exit 0), as a witness (exit WRK_TP_EXIT_GROUP_FAILED) or
 * otherwise. True when this exit decided the culprit (b->culprit). */
bool wrk_tp_blame_exit(wrk_tp_blame *b, uint32_t rank, bool clean, bool witness, int64_t now_ms);

/* Time passed (or no rank is left, which ends the wait): true when the witness is now blamed. */
bool wrk_tp_blame_tick(wrk_tp_blame *b, int64_t now_ms, bool none_left);

/* How long the launcher may wait for the next exit before calling wrk_tp_blame_tick: -1 when
 * nothing is pending (wait without a limit). */
int64_t wrk_tp_blame_wait_ms(const wrk_tp_blame *b, int64_t now_ms);

#endif
