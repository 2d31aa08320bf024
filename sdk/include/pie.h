/* pie.h — the C SDK for inferlets (wasm32-wasi): what an inferlet author includes.
 *
 * Owns: the SDK's public interface — checked wrappers over the raw `pie` import module
 * (pie_abi.h, included below), id allocators for the caller-chosen object ids, futures with
 * growable result buffers, models and the tokenizer, messaging, next-token distributions,
 * samplers, stop conditions, the Context (pie_ctx: a sequence's KV pages, token history and
 * decode loop; fork, export/import, masks), a drafter interface for speculative decoding and a
 * beam search helper.
 * Does not own: the ABI itself (pie_abi.h is the contract with the host), anything host-side.
 * Implementation: the .c files of sdk/src; guide and examples: sdk/README.md, inferlets/.
 *
 * Conventions
 * * The raw ABI functions keep their pie_abi.h names (pie_forward, pie_tokenize, ...); the SDK's
 *   own names differ from all of them (pie_encode, pie_decode, ctx_*), so both mix freely.
 * * An SDK function checks every result: on failure it prints
 *   "pie: <what>: <pie_last_error>" to stderr and exits the instance with status 1. Where a
 *   failure is a condition a program may handle, a pie_x_try / ctx_x_try form returns the
 *   negative PIE_ABI_E_* code instead (the message is then in pie_error()).
 * * Inferlets are single-threaded; the SDK keeps per-instance tables (id pools, page reference
 *   counts, the default model) in globals for that reason.
 * * Sizes are size_t, ids uint32_t, token counts uint32_t. */
#ifndef PIE_H
#define PIE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pie_abi.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ==== errors ================================================================================= */

/* Prints "pie: <formatted message>" to stderr and exits with status 1. */
_Noreturn void pie_fatal(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* rc >= 0: returns rc. rc < 0: pie_fatal("<what>: <last error> (code <-rc>)"). */
int32_t pie_check(int32_t rc, const char *what);
/* The message of the instance's last failed pie call, in a static buffer (valid until the
 * next call of pie_error). */
const char *pie_error(void);
/* malloc / realloc / calloc that exit with a message instead of returning NULL. */
void *pie_xmalloc(size_t n);
void *pie_xrealloc(void *p, size_t n);
void *pie_xcalloc(size_t n, size_t size);
char *pie_xstrdup(const char *s);

/* ==== growable byte buffer =================================================================== */

typedef struct pie_buf {
    char *data; /* NUL-terminated after every append (data[len] == 0) when data != NULL */
    size_t len, cap;
} pie_buf;

void pie_buf_reserve(pie_buf *b, size_t cap);
void pie_buf_append(pie_buf *b, const void *p, size_t n);
void pie_buf_append_str(pie_buf *b, const char *s);
void pie_buf_appendf(pie_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void pie_buf_clear(pie_buf *b); /* len = 0, keeps the storage */
void pie_buf_free(pie_buf *b);

/* ==== id pools ================================================================================
 * Object ids are chosen by the inferlet. The SDK hands them out from one pool per kind (ids
 * start at 1 and are reused after release), so SDK objects and raw calls that also take ids
 * from these pools never collide. */

typedef enum pie_id_kind {
    PIE_ID_QUEUE,
    PIE_ID_KV_PAGE,
    PIE_ID_EMBED,
    PIE_ID_FUTURE,
    PIE_ID_KIND_COUNT
} pie_id_kind;

uint32_t pie_id_get(pie_id_kind kind);
void pie_id_put(pie_id_kind kind, uint32_t id);

/* ==== futures ================================================================================= */

/* A fresh future id for an arming call (pie_receive, pie_next_dist, ...). */
uint32_t pie_future_new(void);
/* Waits for f, stores its payload in *out (replacing its contents), releases f and its id.
 * Returns the payload length, or the negative error code of a failed future (message in
 * pie_error()). */
int32_t pie_future_take_try(uint32_t f, pie_buf *out);
/* As pie_future_take_try; a failure is fatal, naming what. */
size_t pie_future_take(uint32_t f, pie_buf *out, const char *what);
/* Drops f (a result still to come is discarded) and releases its id. */
void pie_future_discard(uint32_t f);

/* ==== models and the tokenizer ================================================================ */

typedef struct pie_model {
    char *name; /* "" = the instance's default model */
    uint32_t name_len;
    pie_abi_model_info info;
    uint32_t *stop_tokens; /* info.n_stop_tokens of them */
    char *traits;          /* '\n'-separated */
} pie_model;

/* The model by name (NULL or "" = the instance's default), loaded once and cached for the
 * instance's lifetime (do not free it). Fatal if unknown; _try returns NULL with pie_error(). */
const pie_model *pie_model_get(const char *name);
const pie_model *pie_model_get_try(const char *name);
bool pie_model_has_trait(const pie_model *m, const char *trait);
bool pie_model_is_stop_token(const pie_model *m, uint32_t token);

/* Token ids of text (special tokens matched when allow_special), malloc'd; *n set. */
uint32_t *pie_encode(const pie_model *m, const char *text, size_t len, bool allow_special,
                     size_t *n);
/* Raw bytes of ids concatenated, appended to out (may end inside a UTF-8 character). */
void pie_decode(const pie_model *m, const uint32_t *ids, size_t n, pie_buf *out);
/* Raw bytes of one token appended to out. */
void pie_token_append_bytes(const pie_model *m, uint32_t id, pie_buf *out);

/* Streaming detokenizer: bytes of a character split across tokens are held back until the
 * character is complete, so every chunk it yields is whole UTF-8 (invalid bytes pass through
 * once it is clear they can never complete). */
typedef struct pie_detok {
    const pie_model *model;
    pie_buf pending; /* bytes of an incomplete character */
} pie_detok;

void pie_detok_init(pie_detok *d, const pie_model *m);
/* Appends token's text to out; returns the number of bytes appended (0 while held back). */
size_t pie_detok_push(pie_detok *d, uint32_t token, pie_buf *out);
/* Appends whatever is still held back. */
size_t pie_detok_flush(pie_detok *d, pie_buf *out);
void pie_detok_free(pie_detok *d);

/* ==== messaging and arguments ================================================================= */

/* The next client message as a NUL-terminated malloc'd string (*len set when len != NULL), or
 * NULL once the client closed its input. Other failures are fatal. */
char *pie_receive_string(size_t *len);
void pie_send_string(const char *s);
void pie_send_bytes(const void *p, size_t n);
/* printf to the client as one message. */
void pie_sendf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Broadcast messaging between inferlets (topics are 1..256 bytes). pie_topic_receive waits for
 * the next broadcast to a subscribed topic and stores its topic and bytes (NUL-terminated). */
void pie_publish(const char *topic, const void *msg, size_t len);
void pie_topic_subscribe(const char *topic);
void pie_topic_unsubscribe(const char *topic);
void pie_topic_receive(pie_buf *topic, pie_buf *msg);

/* Outbound HTTP (the replica's allowlist applies). method "GET" or "POST"; headers "Name: value"
 * lines separated by '\n' (NULL = none); body for POST (NULL = none). Stores the response body in
 * *resp and returns the HTTP status, or a negative code (PERMISSION_DENIED: URL not allowed,
 * DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED: response too large; message in pie_error()). */
int32_t pie_http_try(const char *method, const char *url, const char *headers, const void *body,
                     size_t body_len, pie_buf *resp);

/* "--name value" or "--name=value" among argv[1..]; def when absent. A malformed number is
 * fatal, naming the flag and the value. */
const char *pie_arg_str(int argc, char **argv, const char *name, const char *def);
long pie_arg_int(int argc, char **argv, const char *name, long def);
double pie_arg_float(int argc, char **argv, const char *name, double def);
bool pie_arg_flag(int argc, char **argv, const char *name); /* "--name" present */

/* ==== queues and raw resources ================================================================ */

/* Creates a queue on model m (NULL = default) with an id from the pool. */
uint32_t pie_queue_create(const pie_model *m);
void pie_queue_destroy(uint32_t q);
/* Waits until every earlier call on q has completed; returns 0, or the first deferred error of
 * q since the previous synchronize (negative code, message in pie_error()). */
int32_t pie_queue_sync_try(uint32_t q);
void pie_queue_sync(uint32_t q, const char *what); /* fatal on a deferred error */

/* Allocates n ids from the pool and binds them on queue q. */
void pie_kv_pages_alloc(uint32_t q, uint32_t *ids, size_t n);
void pie_kv_pages_free(uint32_t q, const uint32_t *ids, size_t n); /* unbinds, returns ids */
void pie_embeds_alloc(uint32_t q, uint32_t *ids, size_t n);
void pie_embeds_free(uint32_t q, const uint32_t *ids, size_t n);

/* ==== distributions =========================================================================== */

/* One top-k next-token distribution: ids[0..k) with probs descending (as returned). A filter may
 * change probs (set 0 to forbid a token, reweight) without resorting: samplers do not assume
 * order after a filter ran. */
typedef struct pie_dist {
    uint32_t k;
    uint32_t *ids;
    float *probs;
} pie_dist;

/* n distributions sharing storage. */
typedef struct pie_dists {
    uint32_t n;
    pie_dist *d;
    uint32_t *ids_storage;
    float *probs_storage;
    pie_buf raw;
} pie_dists;

/* Issues next_dist for embeds[0..n) on queue q (k 0 = model default; temperature 1) and
 * returns the future to pass to pie_dists_take. A synchronize of q is armed just before it and
 * taken first by pie_dists_take / pie_future_take[_try]: a deferred failure of an earlier call
 * on q (a forward whose pages the quota refused, ...) is this future's failure. Take it with
 * those or drop it with pie_future_discard, never with the raw pie_future_result. */
uint32_t pie_next_dist_issue(uint32_t q, const uint32_t *embeds, size_t n, uint32_t top_k);
/* Waits for f and parses its payload into *out (reusing its storage). */
void pie_dists_take(uint32_t f, pie_dists *out);
void pie_dists_free(pie_dists *ds);

/* ==== random numbers ========================================================================== */

/* A deterministic PRNG (xorshift128+, seeded through splitmix64); seed 0 = from WASI random. */
typedef struct pie_rng {
    uint64_t s[2];
} pie_rng;

void pie_rng_seed(pie_rng *r, uint64_t seed);
uint64_t pie_rng_next(pie_rng *r);
double pie_rng_uniform(pie_rng *r); /* [0, 1) */

/* ==== samplers ================================================================================
 * A sampler picks the next token from a distribution. The built-in ones (pie_sample_default)
 * read temperature / top_k / top_p: the candidates with probability > 0, most likely first
 * (equal ones in payload order), cut to the top_k first, re-tempered (softmax(logits / T) over
 * them), cut to the smallest prefix whose tempered mass reaches top_p, renormalised and drawn
 * from; temperature <= 0 takes the argmax instead. A custom sampler sets .sample. .filter,
 * when set, runs first on every distribution: it may set probabilities to 0 or reweight them
 * (constrained decoding, watermarking); history is the context's token history up to the token
 * being chosen. */

typedef struct pie_sampler pie_sampler;
typedef void (*pie_dist_filter_fn)(void *state, const uint32_t *history, size_t n_history,
                                   pie_dist *d);
typedef uint32_t (*pie_sample_fn)(pie_sampler *s, const pie_dist *d);

struct pie_sampler {
    pie_sample_fn sample;   /* pie_sample_default unless custom */
    float temperature;      /* <= 0: greedy (argmax) */
    uint32_t top_k;         /* keep the k most likely (0 = every returned candidate) */
    float top_p;            /* keep the smallest set with mass >= top_p (>= 1 or <= 0 = off) */
    uint32_t dist_k;        /* k requested from next_dist (0 = model default) */
    pie_rng rng;
    pie_dist_filter_fn filter;
    void *filter_state;
    void *state; /* for custom samplers */
};

pie_sampler pie_sampler_greedy(void);
pie_sampler pie_sampler_temperature(float temperature, uint64_t seed);
pie_sampler pie_sampler_top_k(uint32_t k, float temperature, uint64_t seed);
pie_sampler pie_sampler_top_p(float p, float temperature, uint64_t seed);
uint32_t pie_sample_default(pie_sampler *s, const pie_dist *d);
/* Applies s->filter (if any) to d, then s->sample. Fatal if every candidate has probability 0. */
uint32_t pie_sample(pie_sampler *s, const uint32_t *history, size_t n_history, pie_dist *d);
/* The candidate with the highest probability (lowest index among equals). */
uint32_t pie_dist_argmax(const pie_dist *d);
/* Writes to idx[0..) the indices of d's n most likely candidates (zero probabilities included),
 * probability descending, equal ones by index; returns how many: min(n, d->k). */
uint32_t pie_dist_top(const pie_dist *d, uint32_t n, uint32_t *idx);
/* OpenAI's presence and frequency penalties on d's candidates: logit_i -= counts[id_i] *
 * frequency + (counts[id_i] > 0) * presence, with logit_i = ln(probs[i]); the probabilities are
 * then renormalised over the candidates (softmax of the penalised logits). counts[id] is how often
 * id occurred (indexed by token id: it covers every id of d). Candidates with probability 0 stay
 * 0; as with any filter, tokens outside the top-k are out of reach. */
void pie_dist_penalize(pie_dist *d, const uint32_t *counts, float presence, float frequency);

/* ==== stop conditions ========================================================================= */

typedef struct pie_stop {
    uint32_t max_tokens;              /* 0 = until another condition (bounded by the context) */
    const char *const *stop_strings;  /* NUL-terminated; the text stops before the first match */
    size_t n_stop_strings;
    const uint32_t *stop_tokens;      /* extra stop token ids */
    size_t n_stop_tokens;
    bool ignore_model_stop_tokens;    /* true: the model's eos/eot tokens do not stop */
} pie_stop;

typedef enum pie_stop_reason {
    PIE_STOP_NONE = 0,
    PIE_STOP_MAX_TOKENS,
    PIE_STOP_TOKEN,   /* a stop token was sampled (not part of the output) */
    PIE_STOP_STRING,  /* a stop string appeared (cut from the text) */
    PIE_STOP_CONTEXT, /* the model's context is full */
} pie_stop_reason;

const char *pie_stop_reason_name(pie_stop_reason r);

/* The result of a generation. Zero-initialise; set on_text to stream text as it is decided
 * (chunks are whole UTF-8 and never part of a stop string). */
typedef struct pie_output {
    pie_buf text;        /* completion text, stop string excluded */
    uint32_t *tokens;    /* generated tokens, stop token excluded */
    size_t n_tokens, cap_tokens;
    pie_stop_reason reason;
    void (*on_text)(void *arg, const char *s, size_t len);
    void *on_text_arg;
    /* internal: streaming state */
    pie_detok detok;
    size_t emitted; /* bytes of text already passed to on_text */
    bool started;
} pie_output;

void pie_output_free(pie_output *o);
/* Bytes of decoded text not yet passed to on_text: held back because they may still become a stop
 * string or are an incomplete UTF-8 character. 0 means the text so far is settled. */
size_t pie_output_held(const pie_output *o);

/* ==== Context ================================================================================
 * A sequence on one model: its command queue, its KV pages (in sequence order), the token
 * history and the hidden state of its last token. Invariants:
 *   history = tokens[0..n_tokens); the first n_tokens - n_pending have their K/V stored in
 *   pages (kv_len tokens, fewer if pages were dropped); the n_pending last ones are not
 *   forwarded yet. Pages shared with another context, imported or exported are read-only:
 *   before the first write into such a page the context copies it (copy-on-write).
 * Positions (RoPE) are next_pos, next_pos + 1, ...; dropping pages does not reuse positions. */

typedef struct pie_ctx {
    const pie_model *model;
    uint32_t queue;
    uint32_t *pages; /* [n_pages]; the first ceil(kv_len / page_size) hold the K/V */
    size_t n_pages, cap_pages;
    uint32_t kv_len;        /* tokens stored in pages */
    uint8_t *kv_masked;     /* [kv_len] 1 = hidden by ctx_mask_tokens */
    size_t cap_kv_masked;
    uint32_t *tokens;       /* history */
    size_t n_tokens, cap_tokens;
    uint32_t n_pending;     /* last tokens of history not forwarded yet */
    uint32_t next_pos;      /* position of the next forwarded token */
    uint32_t *in_embeds;    /* input embeddings owned by the context */
    uint32_t *out_embeds;   /* output embeddings owned by the context */
    uint32_t n_in_embeds, n_out_embeds;
    bool has_out;           /* out_embeds[0] holds the hidden state after the last token */
    bool add_bos;           /* prepend the model's BOS on the first fill (default: the model's) */
} pie_ctx;

/* A new empty context on m (NULL = default model) with its own queue. */
pie_ctx *ctx_new(const pie_model *m);
/* Synchronizes, releases pages (shared ones when their last holder goes), embeddings, queue. */
void ctx_free(pie_ctx *c);

/* Tokenizes text (special tokens allowed) and forwards it (BOS first on an empty context when
 * the model has one and add_bos). */
void ctx_fill(pie_ctx *c, const char *text);
/* ctx_fill without the forward: tokenizes text[0..len) (special tokens allowed), appends the
 * tokens as pending (BOS first under the same rule) and leaves them for the next flush, fill or
 * generate. c->n_tokens afterwards counts the prompt, before anything runs on the host. */
void ctx_append_text(pie_ctx *c, const char *text, size_t len);
void ctx_fill_tokens(pie_ctx *c, const uint32_t *tokens, size_t n);
/* Appends tokens to the history without forwarding (they are forwarded by the next fill,
 * generate or flush, batched with it). */
void ctx_append_tokens(pie_ctx *c, const uint32_t *tokens, size_t n);
/* Forwards pending tokens; afterwards the last token's hidden state is available. */
void ctx_flush(pie_ctx *c);

/* Low level: forwards the pending tokens (kept in KV) and returns, in outs[0..n_outputs), the
 * output embeddings of the last n_outputs of them (n_outputs <= pending,
 * <= max_forward_tokens; the embeddings stay owned by the context and are valid until its next
 * forward). The tokens go in chunks of at most max_forward_tokens and at most the input
 * embeddings the instance's embedding quota lets the context hold (probed by allocating and
 * synchronizing when the context needs more; see sdk/README.md). */
void ctx_forward_pending(pie_ctx *c, uint32_t n_outputs, const uint32_t **outs);
/* Removes the last n tokens from the history and their K/V (rollback of rejected drafts). The
 * hidden state is gone afterwards (the next step recomputes it). */
void ctx_truncate(pie_ctx *c, size_t n);

/* Issues next_dist on the last token's hidden state (flushing first); returns the future. */
uint32_t ctx_next_dist_issue(pie_ctx *c, uint32_t top_k);
/* Flush + next_dist + wait, into *out. */
void ctx_next_dist(pie_ctx *c, uint32_t top_k, pie_dists *out);

/* Decode loop: sample, append, check stop, forward; until a stop condition. Appends the
 * generated tokens and text to *out (see pie_output). The last sampled token stays pending. */
void ctx_generate(pie_ctx *c, pie_sampler *s, const pie_stop *stop, pie_output *out);
/* Convenience: greedy or sampled generation of text, returned malloc'd. */
char *ctx_generate_text(pie_ctx *c, pie_sampler *s, const pie_stop *stop);

/* Step-wise generation, to run several contexts side by side: each step issues every live
 * generation's next_dist before waiting for any, so their forwards and distributions batch.
 * ctx_generate is one pie_gen driven to its end. */
typedef struct pie_gen {
    pie_ctx *ctx;
    pie_sampler *sampler;
    const pie_stop *stop;
    pie_output *out;
    size_t generated;
    uint32_t future; /* armed next_dist, 0 = none */
    bool done;       /* out->reason says why */
    pie_dists dists; /* reused for every step; freed when done */
} pie_gen;

void pie_gen_start(pie_gen *g, pie_ctx *c, pie_sampler *s, const pie_stop *stop,
                   pie_output *out);
/* Flushes the context and issues next_dist; false (and done) if a stop condition holds. */
bool pie_gen_issue(pie_gen *g);
/* Waits for the issued distribution and takes one token; false once generation is done. */
bool pie_gen_take(pie_gen *g);
/* Drives n generations to their ends, interleaved step by step. */
void pie_gen_run_all(pie_gen *gens, size_t n);

/* A new context with the same history and K/V, sharing c's pages (copy-on-write); its own
 * queue. Waits for c's queue first so the shared pages are complete. */
pie_ctx *ctx_fork(pie_ctx *c);

/* Publishes c's pages (after a flush) under name; persistent outlives this instance. The
 * pages become read-only for c too (copy-on-write). */
void ctx_export(pie_ctx *c, const char *name, bool persistent);
int32_t ctx_export_try(pie_ctx *c, const char *name, bool persistent);
void ctx_unexport(pie_ctx *c, const char *name);
/* Binds the pages of export name to the empty context c, whose history becomes tokens[0..n)
 * (the tokens the exporter filled, BOS included). The export must hold exactly
 * ceil(n / page_size) pages. Returns 0 or a negative code (NOT_FOUND for an unknown name,
 * INVALID_ARGUMENT for a page count that does not match n). */
int32_t ctx_import_try(pie_ctx *c, const char *name, const uint32_t *tokens, size_t n);
void ctx_import(pie_ctx *c, const char *name, const uint32_t *tokens, size_t n);

/* Hides (masked = true) or shows KV tokens [start, start + count) (indices into the stored
 * K/V, 0..kv_len) from every later forward of c. */
void ctx_mask_tokens(pie_ctx *c, uint32_t start, uint32_t count, bool masked);
/* Deallocates every page except the last whose tokens are all masked, and removes it from the
 * sequence (kv_len shrinks by a page each); returns how many pages were dropped. */
size_t ctx_drop_masked_pages(pie_ctx *c);

/* The history's text (detokenized), malloc'd. */
char *ctx_text(const pie_ctx *c);

/* ==== speculative decoding ====================================================================
 * A drafter proposes up to max tokens that may follow history. ctx_generate_drafted verifies
 * them with the target model in one forward (pending token + drafts, one output per input),
 * samples with s at each position and keeps drafts while the sample equals the draft; the
 * output is distributed exactly as ctx_generate's (identical for greedy). */

typedef struct pie_drafter {
    size_t (*propose)(void *state, const uint32_t *history, size_t n_history, uint32_t *out,
                      size_t max);
    void *state;
    uint32_t max_draft; /* drafts per step (capped by max_forward_tokens - 1) */
} pie_drafter;

typedef struct pie_spec_stats {
    uint64_t steps;    /* verification forwards */
    uint64_t drafted;  /* draft tokens proposed */
    uint64_t accepted; /* draft tokens accepted */
} pie_spec_stats;

void ctx_generate_drafted(pie_ctx *c, pie_sampler *s, const pie_stop *stop, pie_drafter *d,
                          pie_output *out, pie_spec_stats *stats);

/* ==== beam search ============================================================================
 * Beams are forked contexts of c; each step keeps the `width` highest-scoring continuations
 * (score = sum of log-probabilities of the generated tokens). A beam ends at a stop token or
 * max_tokens. */

typedef struct pie_beam {
    uint32_t *tokens; /* generated tokens (stop token excluded) */
    size_t n_tokens;
    char *text;
    double score;
    bool finished; /* ended by a stop token */
} pie_beam;

/* Fills beams[0..width) (sorted by score, best first; fewer only if the search ran out of
 * candidates) and returns their count. c itself is left unchanged. */
size_t pie_beam_search(pie_ctx *c, uint32_t width, const pie_stop *stop, pie_beam *beams);
void pie_beams_free(pie_beam *beams, size_t n);

#ifdef __cplusplus
}
#endif

#endif
