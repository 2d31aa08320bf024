/* watermark.c — a statistical watermark (Kirchenbauer et al. 2023, "soft" variant) and its
 * detector.
 *
 * Generation: before sampling each token, the distribution is reweighted so that "green" tokens
 * are e^delta times more likely. Whether token t is green after token p is a keyed hash:
 *   green(p, t) = splitmix64(key ^ (p * 0x9E3779B97F4A7C15) ^ (t * 0xC2B2AE3D27D4EB4F)) >> 11
 *                 < gamma * 2^53
 * so about a gamma fraction of the vocabulary is green after any token, a different fraction
 * after each. Detection needs only the key: count green tokens G among the T scored ones (each
 * scored against its predecessor; a (predecessor, token) pair that occurred before is not scored
 * again, so repetitive text cannot inflate the count) and compute
 * z = (G - gamma T) / sqrt(T gamma (1 - gamma)). Watermarked text has a high z; other text has
 * z near 0.
 *
 * Owns: the green list, the reweighting filter and the detector. Does not own: sampling (the
 * SDK's temperature sampler runs after the filter).
 *
 * Arguments: --prompt TEXT, --max-tokens N (64), --delta D (4; 0 = no watermark), --gamma G
 * (0.5), --key K (15485863), --temperature T (1), --seed S (1); --detect: score the text of the
 * first client message instead (tokenized without BOS, the first token unscored).
 * Output (generation): message 1 the text; message 2 "tokens=<generated> scored=<T> green=<G>
 * z=<z %.4f> ids=<generated ids>" (the first generated token is scored against the prompt's last
 * token). Output (--detect): "scored=<T> green=<G> z=<z %.4f>". */
#include <math.h>
#include <stdlib.h>

#include "pie.h"

typedef struct wm {
    uint64_t key;
    double gamma, boost; /* boost = e^delta */
} wm;

static uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static bool green(const wm *w, uint32_t prev, uint32_t tok) {
    uint64_t h = splitmix64(w->key ^ ((uint64_t)prev * 0x9E3779B97F4A7C15ull) ^
                            ((uint64_t)tok * 0xC2B2AE3D27D4EB4Full));
    return (double)(h >> 11) < w->gamma * 9007199254740992.0; /* 2^53 */
}

static void reweight(void *state, const uint32_t *history, size_t n, pie_dist *d) {
    const wm *w = state;
    if (n == 0) return;
    for (uint32_t i = 0; i < d->k; i++)
        if (green(w, history[n - 1], d->ids[i])) d->probs[i] = (float)(d->probs[i] * w->boost);
}

/* Whether the pair (toks[i-1], toks[i]) occurred earlier in toks. */
static bool seen_pair(const uint32_t *toks, size_t i) {
    for (size_t j = 1; j < i; j++)
        if (toks[j - 1] == toks[i - 1] && toks[j] == toks[i]) return true;
    return false;
}

/* Scores toks[1..n) each against its predecessor (first occurrences of pairs only); *n_scored
 * and *n_green set; returns z. */
static double z_score(const wm *w, const uint32_t *toks, size_t n, size_t *n_scored,
                      size_t *n_green) {
    size_t g = 0, t = 0;
    for (size_t i = 1; i < n; i++) {
        if (seen_pair(toks, i)) continue;
        t++;
        g += green(w, toks[i - 1], toks[i]);
    }
    *n_scored = t;
    *n_green = g;
    if (t == 0) return 0;
    return ((double)g - w->gamma * (double)t) / sqrt((double)t * w->gamma * (1 - w->gamma));
}

static void detect(const wm *w) {
    size_t len, n, t, g;
    char *text = pie_receive_string(&len);
    if (!text) pie_fatal("--detect: no client message to score");
    uint32_t *toks = pie_encode(pie_model_get(NULL), text, len, false, &n);
    double z = z_score(w, toks, n, &t, &g);
    pie_sendf("scored=%zu green=%zu z=%.4f", t, g, z);
    free(toks);
    free(text);
}

int main(int argc, char **argv) {
    double gamma = pie_arg_float(argc, argv, "gamma", 0.5);
    double delta = pie_arg_float(argc, argv, "delta", 4);
    if (!(gamma > 0 && gamma < 1) || delta < 0 || delta > 20)
        pie_fatal("--gamma %g --delta %g: need 0 < gamma < 1, 0 <= delta <= 20", gamma, delta);
    wm w = {.key = (uint64_t)pie_arg_int(argc, argv, "key", 15485863), .gamma = gamma,
            .boost = exp(delta)};
    if (pie_arg_flag(argc, argv, "detect")) {
        detect(&w);
        return 0;
    }
    const char *prompt = pie_arg_str(argc, argv, "prompt", "Once upon a time");
    float temperature = (float)pie_arg_float(argc, argv, "temperature", 1);
    pie_sampler s = pie_sampler_temperature(temperature, (uint64_t)pie_arg_int(argc, argv, "seed", 1));
    if (delta > 0) s.filter = reweight, s.filter_state = &w;
    pie_stop stop = {.max_tokens = (uint32_t)pie_arg_int(argc, argv, "max-tokens", 64),
                     .ignore_model_stop_tokens = true};

    pie_ctx *ctx = ctx_new(NULL);
    ctx_fill(ctx, prompt);
    size_t start = ctx->n_tokens - 1; /* the prompt's last token scores the first generated one */
    pie_output out = {0};
    ctx_generate(ctx, &s, &stop, &out);
    size_t t, g;
    double z = z_score(&w, ctx->tokens + start, ctx->n_tokens - start, &t, &g);

    pie_send_bytes(out.text.data, out.text.len);
    pie_buf m = {0};
    pie_buf_appendf(&m, "tokens=%zu scored=%zu green=%zu z=%.4f ids=", out.n_tokens, t, g, z);
    for (size_t i = 0; i < out.n_tokens; i++) pie_buf_appendf(&m, i ? ",%u" : "%u", out.tokens[i]);
    pie_send_bytes(m.data, m.len);
    pie_buf_free(&m);
    pie_output_free(&out);
    ctx_free(ctx);
    return 0;
}
