/* producer.c — the producing half of the messaging example (see messaging.h): generates text
 * line by line and broadcasts each line to the consumers subscribed to a topic.
 *
 * Owns: waiting for the consumers, generation in --lines chunks of --tokens-per-line tokens (one
 * Context, greedy: together they are one greedy completion of the prompt), the broadcasts.
 * Does not own: delivery (the controller's pub/sub).
 *
 * Arguments: --topic T (default "demo"), --prompt TEXT, --lines N (3), --tokens-per-line K (8),
 * --consumers C (1). Output: one message per line (its text, as broadcast), then
 * "consumers=<C> lines=<N>". */
#include "messaging.h"

/* Waits until `want` distinct consumers said "ready <id>" on topic/ready. */
static void wait_for_consumers(const char *topic, long want) {
    pie_buf ready = {0}, msg = {0};
    pie_buf_appendf(&ready, "%s%s", topic, MSG_READY_SUFFIX);
    msg_subscribe(ready.data);
    char **seen = pie_xcalloc((size_t)want, sizeof *seen);
    long n = 0;
    while (n < want) {
        msg_wait(msg_arm(), -1, &msg);
        bool known = false;
        for (long i = 0; i < n && !known; i++) known = strcmp(seen[i], msg.data) == 0;
        if (!known) seen[n++] = pie_xstrdup(msg.data);
    }
    pie_check(pie_unsubscribe(ready.data, (uint32_t)ready.len), "unsubscribe");
    for (long i = 0; i < n; i++) free(seen[i]);
    free(seen);
    pie_buf_free(&ready);
    pie_buf_free(&msg);
}

int main(int argc, char **argv) {
    const char *topic = pie_arg_str(argc, argv, "topic", "demo");
    const char *prompt = pie_arg_str(argc, argv, "prompt", "Once upon a time");
    long lines = pie_arg_int(argc, argv, "lines", 3), per = pie_arg_int(argc, argv, "tokens-per-line", 8);
    long consumers = pie_arg_int(argc, argv, "consumers", 1);
    if (lines < 1 || per < 1 || consumers < 1 || consumers > 64)
        pie_fatal("--lines %ld --tokens-per-line %ld --consumers %ld: need >= 1 (consumers <= 64)",
                  lines, per, consumers);

    pie_ctx *ctx = ctx_new(NULL);
    ctx_fill(ctx, prompt); /* while the consumers start */
    wait_for_consumers(topic, consumers);
    pie_sampler s = pie_sampler_greedy();
    pie_stop stop = {.max_tokens = (uint32_t)per, .ignore_model_stop_tokens = true};
    pie_buf line = {0};
    for (long i = 0; i < lines; i++) {
        char *text = ctx_generate_text(ctx, &s, &stop);
        pie_buf_clear(&line);
        pie_buf_appendf(&line, "%ld\t%s", i, text);
        msg_broadcast(topic, line.data, line.len);
        pie_send_string(text);
        free(text);
    }
    pie_buf_clear(&line);
    pie_buf_appendf(&line, MSG_END_PREFIX "%ld", lines);
    msg_broadcast(topic, line.data, line.len);
    pie_sendf("consumers=%ld lines=%ld", consumers, lines);
    pie_buf_free(&line);
    ctx_free(ctx);
    return 0;
}
