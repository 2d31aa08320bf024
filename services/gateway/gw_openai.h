/* gw_openai.h — the OpenAI API as the gateway speaks it: requests in, responses out.
 *
 * Owns: parsing and validating the JSON bodies of POST /v1/completions and
 * /v1/chat/completions into a gw_req (OpenAI's limits and error wording: an error names the
 * parameter), the launch arguments of the openai_chat inferlet for a request, the per-choice
 * state fed by the inferlet's messages (inferlets/openai_chat/README.md), and the JSON of
 * responses, stream chunks and errors. Pure functions of their inputs: no I/O, no threads.
 * Does not own: HTTP (gw_http.c), talking to the lifecycle (gw_lc.c), chat templates
 * (gw_chat.c). */
#ifndef GW_OPENAI_H
#define GW_OPENAI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "pie_status.h"

#define GW_MAX_STOP 4          /* OpenAI: up to 4 stop sequences */
#define GW_MAX_N 16            /* choices per request (OpenAI allows 128; each is a KV fork) */
#define GW_MAX_TOP_LOGPROBS 20 /* OpenAI's limit for chat; completions' logprobs up to the same */

/* An OpenAI error: HTTP status, error.type, error.param (NULL = null), error.code (NULL =
 * null) and the message. */
typedef struct gw_error {
    int http_status;
    const char *type, *param, *code;
    char message[512];
} gw_error;

/* Sets e and returns false, so validators can `return gw_error_set(...)`. */
bool gw_error_set(gw_error *e, int http_status, const char *type, const char *param,
                  const char *code, const char *fmt, ...) __attribute__((format(printf, 6, 7)));

/* The HTTP error for a failed lifecycle call or Run: UNAUTHENTICATED 401 invalid_api_key,
 * PERMISSION_DENIED 403, NOT_FOUND 404 model_not_found, INVALID_ARGUMENT / OUT_OF_RANGE /
 * FAILED_PRECONDITION 400, RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, DEADLINE_EXCEEDED 504,
 * anything else 500; the message is the status's. */
void gw_error_from_status(const pie_status *st, gw_error *e);

/* {"error":{"message":..,"type":..,"param":..,"code":..}}, malloc'd. NULL if out of memory. */
char *gw_error_json(const gw_error *e);

typedef enum gw_endpoint { GW_COMPLETIONS, GW_CHAT } gw_endpoint;

/* One validated request. Strings are owned by it (gw_req_free). */
typedef struct gw_req {
    gw_endpoint endpoint;
    char *model;
    char *prompt;          /* completions: the prompt; chat: NULL until rendered (gw_chat) */
    json_t *messages;      /* chat: the "messages" array (a reference; gw_req_free drops it) */
    json_t *tools;         /* chat: the "tools" array for the template, or NULL */
    uint32_t max_tokens;   /* 0 = until the context is full */
    double temperature;    /* 0..2, default 1 */
    double top_p;          /* (0..1], default 1 */
    double presence_penalty, frequency_penalty; /* -2..2 */
    bool has_seed;
    int64_t seed;
    char *stop[GW_MAX_STOP];
    size_t n_stop;
    uint32_t n;             /* 1..GW_MAX_N */
    bool logprobs;          /* logprobs wanted */
    uint32_t top_logprobs;  /* alternatives per token, 0..GW_MAX_TOP_LOGPROBS */
    bool stream, include_usage;
    bool ignore_eos;        /* vLLM's extension "ignore_eos" */
} gw_req;

/* Parses body[0..len) for endpoint into r. false with e filled (HTTP 400, param named) when the
 * body is not JSON, not an object, or a known field has a bad type or value. Unknown fields are
 * ignored, as OpenAI does. On failure r holds nothing to free. */
bool gw_req_parse(gw_endpoint endpoint, const char *body, size_t len, gw_req *r, gw_error *e);
void gw_req_free(gw_req *r);

/* The openai_chat inferlet's launch arguments for r (its README): argv-style strings into
 * args[0..*n), each malloc'd (gw_args_free). false only when out of memory. */
bool gw_req_args(const gw_req *r, char ***args, size_t *n);
void gw_args_free(char **args, size_t n);

/* ------------------------------------------------------------------------------------------
 * Results: the inferlet's messages folded into per-choice state. */

typedef struct gw_choice {
    char *text; /* everything released so far (non-streaming responses) */
    size_t text_len, text_cap;
    json_t *logprobs;      /* chat: array of content entries; completions: the four arrays */
    const char *finish;    /* "stop" / "length" once finished, else NULL */
    uint32_t completion_tokens;
} gw_choice;

typedef struct gw_result {
    gw_endpoint endpoint;
    uint32_t n;
    gw_choice *choices;    /* [n] */
    bool have_prompt_tokens;
    uint32_t prompt_tokens;
    uint32_t finished;     /* choices with a finish reason */
    char id[40];           /* "chatcmpl-…" / "cmpl-…" */
    int64_t created;       /* unix seconds */
    const char *model;     /* borrowed from the request */
    json_t *last;          /* the last message gw_result_apply parsed (gw_event.text points in) */
} gw_result;

/* What one inferlet message was. */
typedef enum gw_event_kind {
    GW_EV_PROMPT,   /* {"prompt_tokens":N} */
    GW_EV_TOKEN,    /* a token of choice `choice` released `text` (maybe empty) */
    GW_EV_FINISH,   /* choice `choice` ended */
    GW_EV_ERROR,    /* the inferlet refused the request: e filled (HTTP 400) */
} gw_event_kind;

typedef struct gw_event {
    gw_event_kind kind;
    uint32_t choice;
    const char *text; /* GW_EV_TOKEN: borrowed from the parsed message (valid until next call) */
    size_t text_len;
    json_t *logprob;  /* GW_EV_TOKEN with logprobs: this token's entry in the response's shape
                         (a new reference the caller drops), else NULL */
} gw_event;

/* Prepares res for r (n choices, id, created). false when out of memory. */
bool gw_result_init(gw_result *res, const gw_req *r);
void gw_result_free(gw_result *res);

/* Folds one inferlet message into res and describes it in ev. false with e filled (HTTP 500,
 * "the generation program sent ...") for a message that does not follow the protocol. The
 * parsed message is kept in res until the next call (ev->text points into it). */
bool gw_result_apply(gw_result *res, const char *msg, size_t len, gw_event *ev, gw_error *e);

/* The complete (non-streaming) response body, malloc'd; NULL if out of memory. */
char *gw_result_json(const gw_result *res);

/* Stream chunks (the JSON of one SSE event, malloc'd; NULL if out of memory): the first chunk
 * of a chat choice (delta.role), a token's chunk, a choice's final chunk, the usage chunk. */
char *gw_chunk_role(const gw_result *res, uint32_t choice);
char *gw_chunk_token(const gw_result *res, const gw_event *ev);
char *gw_chunk_finish(const gw_result *res, uint32_t choice);
char *gw_chunk_usage(const gw_result *res);

/* A JSON string value for arbitrary bytes: valid UTF-8 is kept, every invalid byte becomes
 * U+FFFD (what OpenAI-compatible servers show for a partial character). New reference. */
json_t *gw_json_text(const char *s, size_t len);

#endif
