/* openai_chat.c — the built-in inferlet behind the OpenAI-compatible gateway: one completion
 * request, its choices streamed to the client as JSON objects, one per message.
 *
 * The gateway launches it per request (Run) with the request's settings as arguments and sends
 * the prompt as the first client message: a rendered chat template with --chat, plain text
 * otherwise. The prompt is filled once; for --n > 1 every further choice is a fork of it (shared
 * KV pages) and the choices decode in lock step, so their forwards and distributions batch as in
 * parallel_generation. Decoding, stop strings, stop tokens and the context limit are the SDK's
 * (pie_gen); this file adds what the API asks for on top: argument checks with OpenAI's errors,
 * presence and frequency penalties, logprobs, and the per-token messages.
 *
 * Owns: the protocol with the gateway — arguments, messages, errors — specified in README.md
 * in this folder (keep the two in step).
 * Does not own: HTTP, chat templates, request JSON (services/gateway/). */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pie.h"

#define OAI_MAX_N        16
#define OAI_MAX_STOPS    4
#define OAI_MAX_LOGPROBS 20
#define OAI_LOGPROB_NONE "-9999.0" /* ln 0, as OpenAI writes it */

/* Error codes of a refused request (the "code" of its error message). */
#define OAI_E_REQUEST "invalid_request_error" /* the arguments' shape; no or an empty prompt */
#define OAI_E_VALUE   "invalid_value"         /* a malformed or out-of-range value */
#define OAI_E_CONTEXT "context_length_exceeded"

/* ==== JSON output ============================================================================= */

/* Length of the valid UTF-8 character at p[0..n), 0 when none starts there (a stray or
 * truncated byte, an overlong form, a surrogate, above U+10FFFF). */
static size_t utf8_char_len(const unsigned char *p, size_t n) {
    unsigned char b = p[0], lo = 0x80, hi = 0xBF;
    size_t len;
    if (b < 0x80) return 1;
    if (b >= 0xC2 && b <= 0xDF) {
        len = 2;
    } else if (b >= 0xE0 && b <= 0xEF) {
        len = 3;
        if (b == 0xE0) lo = 0xA0;
        if (b == 0xED) hi = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
        len = 4;
        if (b == 0xF0) lo = 0x90;
        if (b == 0xF4) hi = 0x8F;
    } else {
        return 0;
    }
    if (n < len || p[1] < lo || p[1] > hi) return 0;
    for (size_t i = 2; i < len; i++)
        if ((p[i] & 0xC0) != 0x80) return 0;
    return len;
}

/* Appends s[0..n) as a JSON string: '"' and '\' escaped, control characters as \u00XX, every
 * byte that is not part of a valid UTF-8 character replaced by U+FFFD. */
static void json_str(pie_buf *b, const char *s, size_t n) {
    const unsigned char *p = (const unsigned char *)s;
    pie_buf_append(b, "\"", 1);
    for (size_t i = 0; i < n;) {
        unsigned char c = p[i];
        size_t len = utf8_char_len(p + i, n - i);
        if (c == '"' || c == '\\') {
            char esc[2] = {'\\', (char)c};
            pie_buf_append(b, esc, 2);
        } else if (c < 0x20) {
            pie_buf_appendf(b, "\\u%04x", c);
        } else if (len) {
            pie_buf_append(b, p + i, len);
            i += len;
            continue;
        } else {
            pie_buf_append(b, "\xEF\xBF\xBD", 3);
        }
        i++;
    }
    pie_buf_append(b, "\"", 1);
}

/* Sends {"error":{"code":code,"message":...}}: the first and only message of a request that
 * cannot run. */
static void send_error(const char *code, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void send_error(const char *code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    pie_buf b = {0};
    pie_buf_appendf(&b, "{\"error\":{\"code\":\"%s\",\"message\":", code);
    json_str(&b, msg, strlen(msg));
    pie_buf_append_str(&b, "}}");
    pie_send_bytes(b.data, b.len);
    pie_buf_free(&b);
}

/* ==== arguments =============================================================================== */

typedef struct oai_req {
    uint64_t max_tokens; /* per choice; 0 = until the context is full */
    double temperature;  /* 0 = greedy */
    double top_p;
    double presence, frequency;
    bool seeded;
    int64_t seed;
    uint32_t n;
    const char *stops[OAI_MAX_STOPS];
    size_t n_stops;
    int32_t logprobs; /* alternatives per token; -1 = no logprobs */
    bool chat, ignore_eos;
} oai_req;

enum {
    OPT_MAX_TOKENS,
    OPT_TEMPERATURE,
    OPT_TOP_P,
    OPT_SEED,
    OPT_N,
    OPT_STOP,
    OPT_LOGPROBS,
    OPT_PRESENCE,
    OPT_FREQUENCY,
    OPT_CHAT, /* flags (no value) from here on */
    OPT_IGNORE_EOS,
    OPT_COUNT
};

static const char *const opt_names[OPT_COUNT] = {
    "max-tokens",       "temperature",       "top-p", "seed",      "n", "stop", "logprobs",
    "presence-penalty", "frequency-penalty", "chat",  "ignore-eos"};

static bool parse_int(const char *name, const char *v, long long lo, long long hi, long long *out,
                      char *err, size_t cap) {
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi) {
        snprintf(err, cap, "--%s \"%s\": expected an integer from %lld to %lld", name, v, lo, hi);
        return false;
    }
    *out = x;
    return true;
}

static bool parse_float(const char *name, const char *v, double lo, double hi, double *out,
                        char *err, size_t cap) {
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (errno || end == v || *end || !(x >= lo && x <= hi)) { /* NaN fails too */
        snprintf(err, cap, "--%s \"%s\": expected a number from %g to %g", name, v, lo, hi);
        return false;
    }
    *out = x;
    return true;
}

/* Stores the value v of option o in r; false with err set when it is out of range. */
static bool opt_set(oai_req *r, int o, const char *v, char *err, size_t cap) {
    const char *name = opt_names[o];
    long long x = 0;
    switch (o) {
    case OPT_MAX_TOKENS:
        if (!parse_int(name, v, 0, INT64_MAX, &x, err, cap)) return false;
        r->max_tokens = (uint64_t)x;
        return true;
    case OPT_TEMPERATURE: return parse_float(name, v, 0, 2, &r->temperature, err, cap);
    case OPT_TOP_P: return parse_float(name, v, 0, 1, &r->top_p, err, cap);
    case OPT_PRESENCE: return parse_float(name, v, -2, 2, &r->presence, err, cap);
    case OPT_FREQUENCY: return parse_float(name, v, -2, 2, &r->frequency, err, cap);
    case OPT_SEED:
        r->seeded = true;
        if (!parse_int(name, v, INT64_MIN, INT64_MAX, &x, err, cap)) return false;
        r->seed = x;
        return true;
    case OPT_N:
        if (!parse_int(name, v, 1, OAI_MAX_N, &x, err, cap)) return false;
        r->n = (uint32_t)x;
        return true;
    case OPT_LOGPROBS:
        if (!parse_int(name, v, 0, OAI_MAX_LOGPROBS, &x, err, cap)) return false;
        r->logprobs = (int32_t)x;
        return true;
    case OPT_STOP:
        if (r->n_stops == OAI_MAX_STOPS) {
            snprintf(err, cap, "--stop: at most %d stop strings", OAI_MAX_STOPS);
            return false;
        }
        r->stops[r->n_stops++] = v;
        return true;
    case OPT_CHAT: r->chat = true; return true;
    case OPT_IGNORE_EOS: r->ignore_eos = true; return true;
    }
    return false;
}

/* Reads "--name value" / "--name=value" options (flags without a value). Returns NULL, or the
 * error code with err set: OAI_E_REQUEST for a positional argument, an unknown or repeated
 * option (--stop may repeat), a flag with a value, a missing value; OAI_E_VALUE for a value
 * opt_set refuses. */
static const char *req_parse(int argc, char **argv, oai_req *r, char *err, size_t cap) {
    *r = (oai_req){.temperature = 1, .top_p = 1, .n = 1, .logprobs = -1};
    bool seen[OPT_COUNT] = {false};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strncmp(a, "--", 2) != 0) {
            snprintf(err, cap, "unexpected argument \"%s\"", a);
            return OAI_E_REQUEST;
        }
        const char *eq = strchr(a + 2, '=');
        size_t nl = eq ? (size_t)(eq - a - 2) : strlen(a + 2);
        int o = 0;
        while (o < OPT_COUNT && !(strlen(opt_names[o]) == nl && !memcmp(opt_names[o], a + 2, nl)))
            o++;
        if (o == OPT_COUNT) {
            snprintf(err, cap, "unknown argument --%.*s", (int)nl, a + 2);
            return OAI_E_REQUEST;
        }
        if (seen[o] && o != OPT_STOP) {
            snprintf(err, cap, "--%s is given more than once", opt_names[o]);
            return OAI_E_REQUEST;
        }
        seen[o] = true;
        const char *v = NULL;
        if (o >= OPT_CHAT) {
            if (eq) {
                snprintf(err, cap, "--%s takes no value", opt_names[o]);
                return OAI_E_REQUEST;
            }
        } else if (eq) {
            v = eq + 1;
        } else if (i + 1 < argc) {
            v = argv[++i];
        } else {
            snprintf(err, cap, "--%s needs a value", opt_names[o]);
            return OAI_E_REQUEST;
        }
        if (!opt_set(r, o, v, err, cap)) return OAI_E_VALUE;
    }
    return NULL;
}

static bool req_penalized(const oai_req *r) { return r->presence != 0 || r->frequency != 0; }

/* ==== one choice ==============================================================================
 * A token's message carries the text its sampling released. Text the output holds back (a
 * possible stop string, an incomplete character) is released later: by a later token, or at
 * the end, when it belongs to the last token of the text. So a token's message waits while the
 * output holds text back (held), and is sent at the next token or at the end. */

typedef struct oai_choice {
    uint32_t index;
    const oai_req *req;
    pie_ctx *ctx;
    pie_sampler sampler;
    pie_output out;
    pie_gen gen;
    bool finished;
    uint32_t picked; /* the token the last step sampled */
    /* penalties: how often each token id occurs among history[n_prompt..n_counted) */
    uint32_t *counts; /* [vocab_size] */
    size_t n_counted;
    /* logprobs: the last step's distribution as the host sent it (before penalties) */
    uint32_t *raw_ids;
    float *raw_probs;
    uint32_t raw_k, raw_cap;
    pie_buf released;   /* text the output passed on since a token message took it */
    bool held;          /* a token message waits (held_text, held_token) */
    pie_buf held_text;  /* its text */
    pie_buf held_token; /* its ,"token":{...} member (logprobs) */
    pie_buf scratch;
} oai_choice;

static void on_text(void *arg, const char *s, size_t len) {
    oai_choice *ch = arg;
    pie_buf_append(&ch->released, s, len);
}

/* Filter: keeps the host's distribution for logprobs, then applies the penalties. */
static void choice_filter(void *state, const uint32_t *history, size_t n_history, pie_dist *d) {
    oai_choice *ch = state;
    if (ch->req->logprobs >= 0) {
        if (d->k > ch->raw_cap) {
            ch->raw_cap = d->k;
            ch->raw_ids = pie_xrealloc(ch->raw_ids, d->k * sizeof *ch->raw_ids);
            ch->raw_probs = pie_xrealloc(ch->raw_probs, d->k * sizeof *ch->raw_probs);
        }
        ch->raw_k = d->k;
        memcpy(ch->raw_ids, d->ids, d->k * sizeof *d->ids);
        memcpy(ch->raw_probs, d->probs, d->k * sizeof *d->probs);
    }
    if (req_penalized(ch->req)) {
        uint32_t vocab = ch->ctx->model->info.vocab_size;
        for (; ch->n_counted < n_history; ch->n_counted++)
            if (history[ch->n_counted] < vocab) ch->counts[history[ch->n_counted]]++;
        pie_dist_penalize(d, ch->counts, (float)ch->req->presence, (float)ch->req->frequency);
    }
}

static uint32_t choice_sample(pie_sampler *s, const pie_dist *d) {
    oai_choice *ch = s->state;
    ch->picked = pie_sample_default(s, d);
    return ch->picked;
}

/* ---- logprobs ------------------------------------------------------------------------------ */

static void json_logprob(pie_buf *b, float p) {
    if (!(p > 0)) {
        pie_buf_append_str(b, OAI_LOGPROB_NONE);
        return;
    }
    float lp = logf(p);
    pie_buf_appendf(b, "%.9g", lp < 0 ? (double)lp : 0.0); /* a rounding p > 1 is still ln 1 */
}

/* Appends {"id":I,"bytes":[...],"logprob":L (the caller closes it). */
static void json_token_entry(oai_choice *ch, uint32_t id, float p, pie_buf *b) {
    pie_buf_clear(&ch->scratch);
    pie_token_append_bytes(ch->ctx->model, id, &ch->scratch);
    pie_buf_appendf(b, "{\"id\":%u,\"bytes\":[", (unsigned)id);
    for (size_t i = 0; i < ch->scratch.len; i++)
        pie_buf_appendf(b, i ? ",%u" : "%u", (unsigned)(unsigned char)ch->scratch.data[i]);
    pie_buf_append_str(b, "],\"logprob\":");
    json_logprob(b, p);
}

/* The ,"token":{...} member for the sampled token: its logprob and the req->logprobs most
 * likely candidates, from the host's distribution. */
static void json_token(oai_choice *ch, pie_buf *b) {
    pie_dist raw = {.k = ch->raw_k, .ids = ch->raw_ids, .probs = ch->raw_probs};
    float p = 0; /* a sampled token is always a candidate; 0 would print as ln 0 */
    for (uint32_t i = 0; i < raw.k; i++)
        if (raw.ids[i] == ch->picked) p = raw.probs[i];
    pie_buf_append_str(b, ",\"token\":");
    json_token_entry(ch, ch->picked, p, b);
    pie_buf_append_str(b, ",\"top\":[");
    uint32_t idx[OAI_MAX_LOGPROBS];
    uint32_t n = pie_dist_top(&raw, (uint32_t)ch->req->logprobs, idx);
    for (uint32_t j = 0; j < n; j++) {
        if (j) pie_buf_append_str(b, ",");
        json_token_entry(ch, raw.ids[idx[j]], raw.probs[idx[j]], b);
        pie_buf_append_str(b, "}");
    }
    pie_buf_append_str(b, "]}");
}

/* ---- messages ------------------------------------------------------------------------------ */

static void send_token_msg(oai_choice *ch, const pie_buf *text, const pie_buf *token) {
    pie_buf *b = &ch->scratch;
    pie_buf_clear(b);
    pie_buf_appendf(b, "{\"c\":%u,\"text\":", (unsigned)ch->index);
    json_str(b, text->data, text->len);
    pie_buf_append(b, token->data, token->len);
    pie_buf_append_str(b, "}");
    pie_send_bytes(b->data, b->len);
}

/* Sends the waiting token message, if any. */
static void send_held(oai_choice *ch) {
    if (!ch->held) return;
    send_token_msg(ch, &ch->held_text, &ch->held_token);
    ch->held = false;
}

/* The end of the choice released the text still held back: it belongs to the waiting message
 * (there is one: without a waiting message nothing was held). */
static void release_into_held(oai_choice *ch) {
    if (ch->released.len && !ch->held)
        pie_fatal("openai_chat: choice %u: %zu bytes of text released with no token to carry them",
                  (unsigned)ch->index, ch->released.len);
    pie_buf_append(&ch->held_text, ch->released.data, ch->released.len);
    pie_buf_clear(&ch->released);
    send_held(ch);
}

static void choice_finish(oai_choice *ch, bool sampled_stop_token) {
    pie_stop_reason r = ch->out.reason;
    const char *why = r == PIE_STOP_TOKEN || r == PIE_STOP_STRING ? "stop" : "length";
    pie_sendf("{\"c\":%u,\"finish\":\"%s\",\"completion_tokens\":%zu}", (unsigned)ch->index, why,
              ch->out.n_tokens + (sampled_stop_token ? 1 : 0));
    ch->finished = true;
}

/* After pie_gen_take: the step sampled ch->picked; n_before is the output's token count before
 * it (the token joined the text unless it is a stop token). */
static void choice_took(oai_choice *ch, size_t n_before) {
    bool stop_token = ch->out.n_tokens == n_before;
    if (stop_token) {
        release_into_held(ch);
        if (ch->req->logprobs >= 0) {
            pie_buf none = {0}, token = {0};
            json_token(ch, &token);
            send_token_msg(ch, &none, &token);
            pie_buf_free(&token);
        }
    } else {
        send_held(ch); /* an earlier token's text is settled now */
        ch->held = true;
        pie_buf_clear(&ch->held_text);
        pie_buf_append(&ch->held_text, ch->released.data, ch->released.len);
        pie_buf_clear(&ch->released);
        pie_buf_clear(&ch->held_token);
        if (ch->req->logprobs >= 0) json_token(ch, &ch->held_token);
        if (ch->gen.done || pie_output_held(&ch->out) == 0) send_held(ch);
    }
    if (ch->gen.done) choice_finish(ch, stop_token);
}

/* The choice's budget (max tokens, the context) ended it before sampling. */
static void choice_ran_out(oai_choice *ch) {
    release_into_held(ch);
    choice_finish(ch, false);
}

/* The seed of choice i: S + i with --seed S, else 0 (pie_rng_seed draws one from WASI). */
static uint64_t choice_seed(const oai_req *r, uint32_t i) {
    if (!r->seeded) return 0;
    uint64_t s = (uint64_t)r->seed + i;
    return s ? s : 0x9E3779B97F4A7C15u; /* a fixed stand-in: 0 would mean "random" */
}

static void choice_start(oai_choice *ch, uint32_t i, const oai_req *r, pie_ctx *ctx,
                         const pie_stop *stop) {
    *ch = (oai_choice){.index = i, .req = r, .ctx = ctx};
    const pie_abi_model_info *info = &ctx->model->info;
    bool sampled = r->temperature > 0;
    if (sampled) /* top-p 0: only the most likely candidate (pie_sampler's 0 would mean off) */
        ch->sampler = pie_sampler_top_p(r->top_p > 0 ? (float)r->top_p : 1e-30f,
                                        (float)r->temperature, choice_seed(r, i));
    else
        ch->sampler = pie_sampler_greedy();
    /* k: the model's default for sampling or penalties, 1 for plain greedy; >= the logprobs */
    uint32_t k = sampled || req_penalized(r) ? info->default_top_k : 1;
    if (r->logprobs > 0 && (uint32_t)r->logprobs > k) k = (uint32_t)r->logprobs;
    if (k == 0) k = 1;
    if (info->max_top_k && k > info->max_top_k) k = info->max_top_k;
    ch->sampler.dist_k = k;
    ch->sampler.sample = choice_sample;
    ch->sampler.state = ch;
    if (r->logprobs >= 0 || req_penalized(r)) {
        ch->sampler.filter = choice_filter;
        ch->sampler.filter_state = ch;
    }
    if (req_penalized(r)) {
        ch->counts = pie_xcalloc(info->vocab_size ? info->vocab_size : 1, sizeof *ch->counts);
        ch->n_counted = ctx->n_tokens; /* the prompt does not count */
    }
    ch->out.on_text = on_text;
    ch->out.on_text_arg = ch;
    pie_gen_start(&ch->gen, ctx, &ch->sampler, stop, &ch->out);
}

static void choice_free(oai_choice *ch) {
    pie_output_free(&ch->out);
    free(ch->counts);
    free(ch->raw_ids);
    free(ch->raw_probs);
    pie_buf_free(&ch->released);
    pie_buf_free(&ch->held_text);
    pie_buf_free(&ch->held_token);
    pie_buf_free(&ch->scratch);
}

/* Decodes every choice to its end in lock step: each step issues every live choice's
 * distribution before taking any (pie_gen_run_all, with the messages in between). */
static void choices_run(oai_choice *chs, uint32_t n) {
    for (;;) {
        uint32_t live = 0;
        for (uint32_t i = 0; i < n; i++) {
            if (chs[i].finished) continue;
            if (pie_gen_issue(&chs[i].gen))
                live++;
            else
                choice_ran_out(&chs[i]);
        }
        if (!live) return;
        for (uint32_t i = 0; i < n; i++) {
            if (!chs[i].gen.future) continue;
            size_t before = chs[i].out.n_tokens;
            pie_gen_take(&chs[i].gen);
            choice_took(&chs[i], before);
        }
    }
}

/* ==== the request ============================================================================= */

/* Sends the error that keeps a prompt of n_prompt tokens from running, if any; true if sent. */
static bool prompt_refused(const oai_req *r, const pie_model *m, uint64_t n_prompt) {
    uint64_t ctx = m->info.max_context_tokens;
    if (n_prompt == 0) {
        send_error(OAI_E_REQUEST, "The prompt is empty: it has no tokens.");
        return true;
    }
    if (r->max_tokens && n_prompt + r->max_tokens > ctx) {
        send_error(OAI_E_CONTEXT,
                   "This model's maximum context length is %llu tokens. However, you requested "
                   "%llu tokens (%llu in the messages, %llu in the completion). Please reduce the "
                   "length of the messages or completion.",
                   (unsigned long long)ctx, (unsigned long long)(n_prompt + r->max_tokens),
                   (unsigned long long)n_prompt, (unsigned long long)r->max_tokens);
        return true;
    }
    if (!r->max_tokens && n_prompt >= ctx) {
        send_error(OAI_E_CONTEXT,
                   "This model's maximum context length is %llu tokens. However, your messages "
                   "resulted in %llu tokens. Please reduce the length of the messages.",
                   (unsigned long long)ctx, (unsigned long long)n_prompt);
        return true;
    }
    return false;
}

int main(int argc, char **argv) {
    oai_req req;
    char err[256];
    const char *code = req_parse(argc, argv, &req, err, sizeof err);
    if (code) {
        send_error(code, "%s", err);
        return 0;
    }
    size_t prompt_len;
    char *prompt = pie_receive_string(&prompt_len);
    if (!prompt) {
        send_error(OAI_E_REQUEST, "No prompt: the client sent no message.");
        return 0;
    }

    pie_ctx *root = ctx_new(NULL);
    root->add_bos = root->add_bos && !req.chat; /* a chat template writes its own BOS */
    ctx_append_text(root, prompt, prompt_len);
    free(prompt);
    if (prompt_refused(&req, root->model, root->n_tokens)) {
        ctx_free(root);
        return 0;
    }
    pie_sendf("{\"prompt_tokens\":%zu}", root->n_tokens);
    ctx_flush(root); /* the prefill, once for every choice */

    pie_stop stop = {
        .max_tokens = (uint32_t)req.max_tokens, /* fits: at most the context (checked above) */
        .stop_strings = req.stops,
        .n_stop_strings = req.n_stops,
        .ignore_model_stop_tokens = req.ignore_eos,
    };
    /* Choice 0 continues the prompt's own context, the others are forks of it: n queues in
     * all, which the instance's default quota of 16 allows for every n. */
    oai_choice *chs = pie_xcalloc(req.n, sizeof *chs);
    for (uint32_t i = 0; i < req.n; i++)
        choice_start(&chs[i], i, &req, i == 0 ? root : ctx_fork(root), &stop);
    choices_run(chs, req.n);

    for (uint32_t i = req.n; i-- > 0;) {
        ctx_free(chs[i].ctx); /* the forks first, the context they share pages with last */
        choice_free(&chs[i]);
    }
    free(chs);
    return 0;
}
