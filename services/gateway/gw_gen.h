/* gw_gen.h — one completion request from body to response: the gateway's generation flow.
 *
 * Owns: the steps of POST /v1/completions and /v1/chat/completions — parse and validate
 * (gw_openai), find the model (gw_lc), render the chat template (gw_chat), start a Run of the
 * built-in inferlet and read its first message (so that a refused request is an HTTP error,
 * not a broken stream) — then either the whole response JSON or the Server-Sent Events of a
 * stream, one event at a time; and the request metrics. Knows nothing of HTTP sockets:
 * gw_http.c moves the bytes and says when the client went away. */
#ifndef GW_GEN_H
#define GW_GEN_H

#include <stdbool.h>
#include <stddef.h>

#include "gw_chat.h"
#include "gw_lc.h"
#include "gw_openai.h"
#include "pie_metrics.h"

/* Metric handles of the gateway (pie_metrics; NULL handles are fine). */
typedef struct gw_metrics {
    pie_counter *requests[2];         /* [endpoint] requests received */
    pie_counter *errors[2];           /* [endpoint] requests answered with an error */
    pie_counter *prompt_tokens, *completion_tokens;
    pie_gauge *active;                /* requests in flight */
    pie_histogram *latency[2];        /* [endpoint] seconds from request to last byte */
    pie_histogram *first_token[2];    /* [endpoint] seconds from request to the first token */
    pie_histogram *per_token[2];      /* [endpoint] seconds per output token after the first */
    pie_counter *disconnects;         /* clients that went away before the end */
} gw_metrics;

/* Registers the gateway's metrics in m into out. */
pie_code gw_metrics_register(pie_metrics *m, gw_metrics *out, pie_status *st);

typedef struct gw_gen_env {
    gw_lc *lc;
    gw_chat *chat;
    gw_metrics *mx;
} gw_gen_env;

typedef struct gw_gen gw_gen;

/* Asks whether the client is still there (gw_http: a poll of the socket). */
typedef bool (*gw_client_alive_fn)(void *arg);

/* Validates body, renders, launches, and waits for the inferlet's first message (asking
 * alive(arg) meanwhile: a long prefill of a client that left is cancelled). NULL with e filled
 * for any refusal (HTTP status in e->http_status). auth: the client's Authorization header
 * value or NULL. */
gw_gen *gw_gen_start(const gw_gen_env *env, gw_endpoint endpoint, const char *auth,
                     const char *body, size_t len, gw_client_alive_fn alive, void *arg,
                     gw_error *e);

bool gw_gen_streaming(const gw_gen *g);

/* Non-streaming: reads the Run to its end and returns the response body (malloc'd), or NULL
 * with e filled. alive(arg) is asked while waiting; a client that went away cancels the Run. */
char *gw_gen_collect(gw_gen *g, gw_client_alive_fn alive, void *arg, gw_error *e);

/* Streaming: the next bytes of the event stream (one or more whole "data: <json>" events,
 * malloc'd) into *out, its length into *len. Returns false when the stream is over (after "data: [DONE]") or
 * the client went away (alive false: the Run is cancelled). */
bool gw_gen_next_events(gw_gen *g, gw_client_alive_fn alive, void *arg, char **out,
                        size_t *len);

/* Cancels the Run if it still runs and frees everything (records the request's metrics). */
void gw_gen_free(gw_gen *g);

#endif
