/* parallel_generation.c — several generations from one shared prefix, run side by side.
 *
 * The prompt is filled once; --n forks share its KV pages (copy-on-write of the last, partial
 * page) and each may continue with its own suffix. The forks decode in lock step, so every
 * step's forwards and distributions batch together in the controller.
 *
 * Arguments: --prompt TEXT, --n N (default 4), --suffixes "a|b|..." (fork i fills the i-th
 * suffix after the prompt; missing ones fill nothing), --max-tokens N (default 32),
 * --temperature T (0 = greedy, default), --seed S (fork i uses S + i), --ignore-eos.
 * Output: one message per fork, in fork order: its completion. */
#include <stdlib.h>
#include <string.h>

#include "pie.h"

/* The i-th '|'-separated field of list (malloc'd), or NULL when there is none. */
static char *field(const char *list, size_t i) {
    for (size_t k = 0; list; k++) {
        const char *bar = strchr(list, '|');
        size_t len = bar ? (size_t)(bar - list) : strlen(list);
        if (k == i) {
            char *s = pie_xmalloc(len + 1);
            memcpy(s, list, len);
            s[len] = 0;
            return s;
        }
        list = bar ? bar + 1 : NULL;
    }
    return NULL;
}

int main(int argc, char **argv) {
    const char *prompt = pie_arg_str(argc, argv, "prompt", "Once upon a time");
    const char *suffixes = pie_arg_str(argc, argv, "suffixes", NULL);
    long n = pie_arg_int(argc, argv, "n", 4);
    if (n < 1 || n > 256) pie_fatal("--n %ld: must be 1..256", n);
    float temperature = (float)pie_arg_float(argc, argv, "temperature", 0);
    long seed = pie_arg_int(argc, argv, "seed", 1);
    pie_stop stop = {
        .max_tokens = (uint32_t)pie_arg_int(argc, argv, "max-tokens", 32),
        .ignore_model_stop_tokens = pie_arg_flag(argc, argv, "ignore-eos"),
    };

    pie_ctx *root = ctx_new(NULL);
    ctx_fill(root, prompt);

    pie_ctx **forks = pie_xcalloc((size_t)n, sizeof *forks);
    pie_sampler *samplers = pie_xcalloc((size_t)n, sizeof *samplers);
    pie_output *outs = pie_xcalloc((size_t)n, sizeof *outs);
    pie_gen *gens = pie_xcalloc((size_t)n, sizeof *gens);
    for (long i = 0; i < n; i++) {
        forks[i] = ctx_fork(root);
        char *suffix = suffixes ? field(suffixes, (size_t)i) : NULL;
        if (suffix && *suffix) {
            size_t nt;
            uint32_t *toks = pie_encode(forks[i]->model, suffix, strlen(suffix), true, &nt);
            ctx_append_tokens(forks[i], toks, nt); /* forwarded by the first step */
            free(toks);
        }
        free(suffix);
        samplers[i] = temperature > 0 ? pie_sampler_temperature(temperature, (uint64_t)(seed + i))
                                      : pie_sampler_greedy();
        pie_gen_start(&gens[i], forks[i], &samplers[i], &stop, &outs[i]);
    }
    pie_gen_run_all(gens, (size_t)n);

    for (long i = 0; i < n; i++) {
        pie_send_bytes(outs[i].text.data, outs[i].text.len);
        pie_output_free(&outs[i]);
        ctx_free(forks[i]);
    }
    ctx_free(root);
    free(gens);
    free(outs);
    free(samplers);
    free(forks);
    return 0;
}
