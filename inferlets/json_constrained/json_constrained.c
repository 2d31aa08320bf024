/* json_constrained.c — constrained decoding: the output always has the JSON shape
 *   {"name": "<1..--max-name letters or spaces>", "age": <integer 0..999>}
 * however the model would like to continue.
 *
 * A byte automaton of the shape says which bytes may come next. Before each sampling step a
 * distribution filter sets the probability of every token whose bytes the automaton would
 * reject to 0; the sampler then picks among the rest (greedy, or --temperature with --seed).
 * The model's largest top-k is requested; when the vocabulary is larger than that and no
 * candidate is allowed, the filter forces the shape's default next byte as a single-byte token:
 * the literal's next byte, '"' to close a non-empty name (else 'A'), '}' to close a non-empty
 * age (else '0'). Generation ends when the automaton accepts.
 *
 * Owns: the automaton and the filter. Does not own: sampling and the decode loop (the SDK).
 *
 * Arguments: --prompt TEXT, --max-name N (default 12), --temperature T (0 = greedy), --seed S.
 * Output: message 1 the JSON text; message 2
 * "tokens=<n> k=<candidates per step> forced=<steps with no allowed candidate> ids=<ids>". */
#include <stdlib.h>
#include <string.h>

#include "pie.h"

#define LIT_NAME "{\"name\": \""
#define LIT_AGE  ", \"age\": "

typedef enum { S_LIT_NAME, S_NAME, S_LIT_AGE, S_AGE, S_DONE } shape_seg;

typedef struct shape {
    shape_seg seg;
    uint32_t at; /* bytes into the current segment */
    uint32_t max_name;
    bool first_zero; /* the age began with 0: nothing may follow but '}' */
} shape;

static bool is_name_byte(unsigned char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == ' ';
}

/* Inside a literal: c must be its next byte; after the last one the shape moves on to next. */
static bool literal_step(shape *s, const char *lit, unsigned char c, shape_seg next) {
    if (c != (unsigned char)lit[s->at]) return false;
    if (lit[++s->at] == 0) {
        s->seg = next;
        s->at = 0;
    }
    return true;
}

/* Advances *s by byte c; false (s unspecified) if the shape forbids c here. */
static bool shape_step(shape *s, unsigned char c) {
    switch (s->seg) {
    case S_LIT_NAME: return literal_step(s, LIT_NAME, c, S_NAME);
    case S_NAME:
        if (c == '"' && s->at > 0) {
            s->seg = S_LIT_AGE;
            s->at = 0;
            return true;
        }
        if (!is_name_byte(c) || s->at >= s->max_name) return false;
        s->at++;
        return true;
    case S_LIT_AGE: return literal_step(s, LIT_AGE, c, S_AGE);
    case S_AGE:
        if (c == '}' && s->at > 0) {
            s->seg = S_DONE;
            return true;
        }
        if (c < '0' || c > '9' || s->at >= 3 || s->first_zero) return false;
        if (s->at == 0 && c == '0') s->first_zero = true;
        s->at++;
        return true;
    case S_DONE: return false;
    }
    return false;
}

typedef struct constraint {
    const pie_model *model;
    shape now;          /* state after the tokens generated so far */
    pie_buf *tok_bytes; /* [num_tokens] bytes of each token */
    uint32_t byte_tok[256]; /* the lowest-id token that is exactly this byte; UINT32_MAX = none */
    size_t forced;
} constraint;

/* The byte the shape takes when the model offers nothing allowed. */
static unsigned char shape_default(const shape *s) {
    switch (s->seg) {
    case S_LIT_NAME: return (unsigned char)LIT_NAME[s->at];
    case S_NAME: return s->at > 0 ? '"' : 'A';
    case S_LIT_AGE: return (unsigned char)LIT_AGE[s->at];
    case S_AGE: return s->at > 0 ? '}' : '0';
    case S_DONE: break;
    }
    pie_fatal("json: the shape is complete");
}

static bool token_allowed(const constraint *k, uint32_t id) {
    if (id >= k->model->info.num_tokens || pie_model_is_stop_token(k->model, id)) return false;
    const pie_buf *b = &k->tok_bytes[id];
    if (b->len == 0) return false;
    shape s = k->now;
    for (size_t i = 0; i < b->len; i++)
        if (!shape_step(&s, (unsigned char)b->data[i])) return false;
    return true;
}

static void mask_shape(void *state, const uint32_t *history, size_t n, pie_dist *d) {
    (void)history, (void)n;
    constraint *k = state;
    bool any = false;
    for (uint32_t i = 0; i < d->k; i++) {
        if (!token_allowed(k, d->ids[i])) d->probs[i] = 0;
        else any = true;
    }
    if (any || d->k == 0) return;
    unsigned char b = shape_default(&k->now);
    if (k->byte_tok[b] == UINT32_MAX) pie_fatal("json: no single-byte token for '%c'", b);
    d->ids[0] = k->byte_tok[b]; /* the only candidate left */
    d->probs[0] = 1;
    k->forced++;
}

static void constraint_init(constraint *k, const pie_model *m, uint32_t max_name) {
    *k = (constraint){.model = m, .now = {.max_name = max_name}};
    k->tok_bytes = pie_xcalloc(m->info.num_tokens, sizeof *k->tok_bytes);
    for (int b = 0; b < 256; b++) k->byte_tok[b] = UINT32_MAX;
    for (uint32_t id = 0; id < m->info.num_tokens; id++) {
        pie_token_append_bytes(m, id, &k->tok_bytes[id]);
        if (k->tok_bytes[id].len == 1 && !pie_model_is_stop_token(m, id) &&
            k->byte_tok[(unsigned char)k->tok_bytes[id].data[0]] == UINT32_MAX)
            k->byte_tok[(unsigned char)k->tok_bytes[id].data[0]] = id;
    }
}

static void constraint_free(constraint *k) {
    for (uint32_t id = 0; id < k->model->info.num_tokens; id++) pie_buf_free(&k->tok_bytes[id]);
    free(k->tok_bytes);
}

int main(int argc, char **argv) {
    const char *prompt = pie_arg_str(argc, argv, "prompt", "A person, as JSON:");
    long max_name = pie_arg_int(argc, argv, "max-name", 12);
    if (max_name < 1 || max_name > 256) pie_fatal("--max-name %ld: must be 1..256", max_name);
    float temperature = (float)pie_arg_float(argc, argv, "temperature", 0);
    uint64_t seed = (uint64_t)pie_arg_int(argc, argv, "seed", 1);

    pie_ctx *ctx = ctx_new(NULL);
    constraint k;
    constraint_init(&k, ctx->model, (uint32_t)max_name);
    ctx_fill(ctx, prompt);
    pie_sampler s = temperature > 0 ? pie_sampler_temperature(temperature, seed) : pie_sampler_greedy();
    s.dist_k = ctx->model->info.max_top_k; /* as much of the vocabulary as the model gives */
    s.filter = mask_shape;
    s.filter_state = &k;
    /* a bound that the shape can never exceed: literals + name + '"' + digits + '}' */
    pie_stop stop = {.max_tokens = (uint32_t)(sizeof LIT_NAME + sizeof LIT_AGE + max_name + 8),
                     .ignore_model_stop_tokens = true};
    pie_output out = {0};
    pie_gen g;
    pie_gen_start(&g, ctx, &s, &stop, &out);
    while (k.now.seg != S_DONE && pie_gen_issue(&g) && pie_gen_take(&g)) {
        const pie_buf *b = &k.tok_bytes[out.tokens[out.n_tokens - 1]];
        for (size_t i = 0; i < b->len; i++)
            if (!shape_step(&k.now, (unsigned char)b->data[i]))
                pie_fatal("json: token %u was sampled against the shape", out.tokens[out.n_tokens - 1]);
    }
    if (k.now.seg != S_DONE) pie_fatal("json: generation ended (%s) before the shape was complete",
                                       pie_stop_reason_name(out.reason));

    pie_send_bytes(out.text.data, out.text.len);
    pie_buf ids = {0};
    pie_buf_appendf(&ids, "tokens=%zu k=%u forced=%zu ids=", out.n_tokens, s.dist_k, k.forced);
    for (size_t i = 0; i < out.n_tokens; i++) pie_buf_appendf(&ids, i ? ",%u" : "%u", out.tokens[i]);
    pie_send_bytes(ids.data, ids.len);
    pie_buf_free(&ids);
    pie_dists_free(&g.dists);
    pie_output_free(&out);
    constraint_free(&k);
    ctx_free(ctx);
    return 0;
}
