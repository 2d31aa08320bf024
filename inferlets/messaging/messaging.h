/* messaging.h — what the two messaging inferlets (producer.c, consumer.c) agree on: topic names,
 * message formats, and a helper that waits for the next broadcast.
 *
 * Protocol on topic T (--topic): each consumer subscribes to T and broadcasts
 * "ready <instance id>" on T + "/ready" every 200 ms until the first line arrives; the producer
 * subscribes to T + "/ready", waits until --consumers distinct consumers are ready, then
 * broadcasts each generated line as "<i>\t<text>" on T and finally "end\t<count>". */
#ifndef MESSAGING_H
#define MESSAGING_H

#include <stdlib.h>
#include <string.h>

#include "pie.h"

#define MSG_READY_SUFFIX "/ready"
#define MSG_END_PREFIX   "end\t"

/* Waits up to timeout_ms (< 0: no limit) for the broadcast armed on f; true and its message
 * bytes in *msg (topic stripped; NUL-terminated, never NULL) when one came, false on
 * timeout (f stays armed). */
static inline bool msg_wait(uint32_t f, int64_t timeout_ms, pie_buf *msg) {
    int32_t rc = pie_check(pie_future_wait(f, timeout_ms), "future_wait (subscription)");
    if (rc == 0) return false;
    pie_buf raw = {0};
    size_t n = pie_future_take(f, &raw, "subscription_receive");
    uint32_t tl = 0;
    if (n >= 4) memcpy(&tl, raw.data, 4);
    if (n < 4 || tl > n - 4) pie_fatal("subscription_receive: malformed payload of %zu bytes", n);
    pie_buf_clear(msg);
    pie_buf_append(msg, raw.data + 4 + tl, n - 4 - tl);
    pie_buf_free(&raw);
    return true;
}

/* Arms a fresh future with the next broadcast delivered to this instance. */
static inline uint32_t msg_arm(void) {
    uint32_t f = pie_future_new();
    pie_check(pie_subscription_receive(f), "subscription_receive");
    return f;
}

static inline void msg_broadcast(const char *topic, const void *p, size_t n) {
    pie_check(pie_broadcast(topic, (uint32_t)strlen(topic), p, (uint32_t)n), "broadcast");
}

static inline void msg_subscribe(const char *topic) {
    pie_check(pie_subscribe(topic, (uint32_t)strlen(topic)), "subscribe");
}

#endif
