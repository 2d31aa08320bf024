/* beam_search.c — beam search as a user program.
 *
 * Each live beam is a forked context; every step issues all beams' distributions together,
 * keeps the --width best continuations by summed log-probability and forks a beam that
 * continues in several ways (sharing its pages). Beam width 1 is greedy decoding.
 *
 * Arguments: --prompt TEXT, --width W (default 4), --max-tokens N (default 16), --ignore-eos.
 * Output: one message per beam, best first: "<score>\t<finished 0|1>\t<n tokens>\t<text>"
 * (score printed with %.9g), then "beams=<count>". */
#include <stdio.h>
#include <string.h>

#include "pie.h"

int main(int argc, char **argv) {
    const char *prompt = pie_arg_str(argc, argv, "prompt", "The meaning of life is");
    long width = pie_arg_int(argc, argv, "width", 4);
    if (width < 1 || width > 64) pie_fatal("--width %ld: must be 1..64", width);
    pie_stop stop = {
        .max_tokens = (uint32_t)pie_arg_int(argc, argv, "max-tokens", 16),
        .ignore_model_stop_tokens = pie_arg_flag(argc, argv, "ignore-eos"),
    };

    pie_ctx *c = ctx_new(NULL);
    ctx_fill(c, prompt);
    pie_beam beams[64];
    size_t n = pie_beam_search(c, (uint32_t)width, &stop, beams);
    pie_buf msg = {0};
    for (size_t i = 0; i < n; i++) {
        pie_buf_clear(&msg);
        pie_buf_appendf(&msg, "%.9g\t%d\t%zu\t", beams[i].score, beams[i].finished ? 1 : 0,
                        beams[i].n_tokens);
        /* decode again for the exact bytes (beams[i].text stops at a NUL byte) */
        pie_decode(c->model, beams[i].tokens, beams[i].n_tokens, &msg);
        pie_send_bytes(msg.data, msg.len);
        printf("beam %zu: score %.4f: %s\n", i, beams[i].score, beams[i].text);
    }
    pie_sendf("beams=%zu", n);
    pie_buf_free(&msg);
    pie_beams_free(beams, n);
    ctx_free(c);
    return 0;
}
