/* speculative_decoding.c — n-gram prompt-lookup speculative decoding.
 *
 * The drafter looks for an earlier occurrence of the history's last g tokens (g = --ngram
 * down to 1) and proposes the tokens that followed it. The SDK verifies the
 * drafts in one forward (the pending token plus the drafts, one output each) and keeps those
 * the target model agrees with, so the output is exactly plain decoding's (greedy here) while
 * repetitive text takes several tokens per forward.
 *
 * Arguments: --prompt TEXT, --max-tokens N (default 64), --ngram G (default 3), --draft K
 * (drafts per step, default 4), --ignore-eos.
 * Output: the completion as a message, then "steps=<verification forwards>
 * drafted=<draft tokens> accepted=<accepted drafts> tokens=<generated>". */
#include <stdio.h>
#include <string.h>

#include "pie.h"

typedef struct ngram_drafter {
    size_t ngram;
} ngram_drafter;

/* Whether h[a..a+g) equals h[b..b+g). */
static bool same(const uint32_t *h, size_t a, size_t b, size_t g) {
    for (size_t i = 0; i < g; i++)
        if (h[a + i] != h[b + i]) return false;
    return true;
}

/* Among the earlier occurrences of the suffix h[n-g..n) (g = ngram, then shorter), the latest
 * one with the longest continuation (up to max tokens) wins; its continuation is the draft.
 * (The latest occurrence alone is often the overlapping one just before the end, which in
 * repetitive text leaves a single token to propose.) */
static size_t ngram_propose(void *state, const uint32_t *h, size_t n, uint32_t *out, size_t max) {
    const ngram_drafter *d = state;
    for (size_t g = d->ngram; g >= 1; g--) {
        if (n <= g) continue;
        size_t best = 0, best_j = 0;
        for (size_t j = n - g; j-- > 0 && best < max;) {
            if (!same(h, j, n - g, g)) continue;
            size_t follow = n - (j + g); /* tokens after this occurrence */
            if (follow > max) follow = max;
            if (follow > best) {
                best = follow;
                best_j = j;
            }
        }
        if (best) {
            memcpy(out, h + best_j + g, best * sizeof *out);
            return best;
        }
    }
    return 0;
}

int main(int argc, char **argv) {
    const char *prompt = pie_arg_str(argc, argv, "prompt", "one two three one two three one");
    long ngram = pie_arg_int(argc, argv, "ngram", 3), draft = pie_arg_int(argc, argv, "draft", 4);
    if (ngram < 1 || ngram > 16) pie_fatal("--ngram %ld: must be 1..16", ngram);
    if (draft < 0 || draft > 64) pie_fatal("--draft %ld: must be 0..64", draft);
    pie_stop stop = {
        .max_tokens = (uint32_t)pie_arg_int(argc, argv, "max-tokens", 64),
        .ignore_model_stop_tokens = pie_arg_flag(argc, argv, "ignore-eos"),
    };

    ngram_drafter nd = {.ngram = (size_t)ngram};
    pie_drafter drafter = {.propose = ngram_propose, .state = &nd, .max_draft = (uint32_t)draft};
    pie_ctx *c = ctx_new(NULL);
    ctx_fill(c, prompt);
    pie_sampler s = pie_sampler_greedy();
    pie_output out = {0};
    pie_spec_stats st = {0};
    ctx_generate_drafted(c, &s, &stop, &drafter, &out, &st);

    pie_send_bytes(out.text.data, out.text.len);
    pie_sendf("steps=%llu drafted=%llu accepted=%llu tokens=%zu", (unsigned long long)st.steps,
              (unsigned long long)st.drafted, (unsigned long long)st.accepted, out.n_tokens);
    printf("%s\n[steps %llu, accepted %llu of %llu drafts]\n", out.text.data ? out.text.data : "",
           (unsigned long long)st.steps, (unsigned long long)st.accepted,
           (unsigned long long)st.drafted);
    pie_output_free(&out);
    ctx_free(c);
    return 0;
}
