/* consumer.c — the consuming half of the messaging example (see messaging.h): subscribes to a
 * topic and passes every line it receives on to its own client.
 *
 * Owns: announcing itself until the producer starts, relaying lines. Does not own: delivery
 * (the controller's pub/sub).
 *
 * Arguments: --topic T (default "demo"). Output: one message per received line (the text, the
 * line number stripped; lines must arrive in order), then "received=<n>". */
#include <stdio.h>

#include "messaging.h"

int main(int argc, char **argv) {
    const char *topic = pie_arg_str(argc, argv, "topic", "demo");
    msg_subscribe(topic);
    pie_buf ready_topic = {0}, ready = {0}, msg = {0};
    pie_buf_appendf(&ready_topic, "%s%s", topic, MSG_READY_SUFFIX);
    pie_buf_appendf(&ready, "ready %lld", (long long)pie_instance_id());

    uint32_t f = msg_arm();
    /* The producer may subscribe after our first announcement: repeat it until a line comes. */
    do msg_broadcast(ready_topic.data, ready.data, ready.len);
    while (!msg_wait(f, 200, &msg));

    long n = 0;
    for (;;) {
        if (strncmp(msg.data, MSG_END_PREFIX, strlen(MSG_END_PREFIX)) == 0) break;
        char *tab = strchr(msg.data, '\t');
        if (!tab || strtol(msg.data, NULL, 10) != n)
            pie_fatal("line %ld expected, got \"%s\"", n, msg.data);
        pie_send_bytes(tab + 1, msg.len - (size_t)(tab + 1 - msg.data));
        n++;
        msg_wait(msg_arm(), -1, &msg);
    }
    pie_sendf("received=%ld", n);
    pie_buf_free(&ready_topic);
    pie_buf_free(&ready);
    pie_buf_free(&msg);
    return 0;
}
