/* wrk_tp_blame.c — the launcher's verdict on a failed group (see wrk_tp_blame.h for why a
 * witness waits for a grace period before it is blamed). */
#include "wrk_tp_blame.h"

void wrk_tp_blame_init(wrk_tp_blame *b) { *b = (wrk_tp_blame){.culprit = -1, .witness = -1}; }

bool wrk_tp_blame_exit(wrk_tp_blame *b, uint32_t rank, bool clean, bool witness, int64_t now_ms) {
    if (b->culprit >= 0 || clean) return false;
    if (!witness) {
        b->culprit = (int)rank;
        return true;
    }
    if (b->witness < 0) {
        b->witness = (int)rank;
        b->deadline_ms = now_ms + WRK_TP_BLAME_GRACE_MS;
    }
    return false;
}

bool wrk_tp_blame_tick(wrk_tp_blame *b, int64_t now_ms, bool none_left) {
    if (b->culprit >= 0 || b->witness < 0) return false;
    if (!none_left && now_ms < b->deadline_ms) return false;
    b->culprit = b->witness;
    return true;
}

int64_t wrk_tp_blame_wait_ms(const wrk_tp_blame *b, int64_t now_ms) {
    if (b->culprit >= 0 || b->witness < 0) return -1;
    return b->deadline_ms > now_ms ? b->deadline_ms - now_ms : 0;
}
