/* text_completion.c — completes a prompt: the smallest useful inferlet.
 *
 * Arguments: --prompt TEXT (absent: the first client message is the prompt), --max-tokens N
 * (default 32), --temperature T (default 0 = greedy), --top-p P, --top-k K (the host is asked
 * for exactly K candidates: at most the model's max_top_k), --seed S (0 = WASI random), --stop
 * STRING (one stop string), --ignore-eos (the model's stop tokens do not stop).
 * Output: the completion streams to stdout as it is decided; at the end it is sent as one
 * message, then a second message "reason=<why> tokens=<n>". A failed call (an exhausted KV or
 * embedding quota, ...) ends it at that call: exit status 1, "pie: <call>: <error>" on stderr,
 * no messages (the SDK's convention; see sdk/README.md). */
#include <stdio.h>
#include <stdlib.h>

#include "pie.h"

static void print_chunk(void *arg, const char *s, size_t len) {
    (void)arg;
    fwrite(s, 1, len, stdout);
    fflush(stdout);
}

int main(int argc, char **argv) {
    const char *prompt = pie_arg_str(argc, argv, "prompt", NULL);
    char *received = NULL;
    if (!prompt) {
        received = pie_receive_string(NULL);
        if (!received) pie_fatal("no --prompt and no client message");
        prompt = received;
    }
    float temperature = (float)pie_arg_float(argc, argv, "temperature", 0);
    uint64_t seed = (uint64_t)pie_arg_int(argc, argv, "seed", 0);
    pie_sampler s = pie_sampler_greedy();
    if (temperature > 0) {
        uint32_t top_k = (uint32_t)pie_arg_int(argc, argv, "top-k", 0);
        float top_p = (float)pie_arg_float(argc, argv, "top-p", 1);
        s = top_k ? pie_sampler_top_k(top_k, temperature, seed)
                  : pie_sampler_top_p(top_p, temperature, seed);
        s.top_p = top_p;
    }
    const char *stop_string = pie_arg_str(argc, argv, "stop", NULL);
    pie_stop stop = {
        .max_tokens = (uint32_t)pie_arg_int(argc, argv, "max-tokens", 32),
        .stop_strings = &stop_string,
        .n_stop_strings = stop_string ? 1 : 0,
        .ignore_model_stop_tokens = pie_arg_flag(argc, argv, "ignore-eos"),
    };

    pie_ctx *ctx = ctx_new(NULL);
    ctx_fill(ctx, prompt);
    pie_output out = {.on_text = print_chunk};
    ctx_generate(ctx, &s, &stop, &out);
    putchar('\n');

    pie_send_bytes(out.text.data, out.text.len);
    pie_sendf("reason=%s tokens=%zu", pie_stop_reason_name(out.reason), out.n_tokens);
    pie_output_free(&out);
    ctx_free(ctx);
    free(received);
    return 0;
}
