/* gw_http.h — the gateway's HTTP/1.1 server (libmicrohttpd).
 *
 * Owns: the listening socket and its threads (one thread per connection, so a request may
 * block on its Run: a streamed response is written as the inferlet produces it, with HTTP/1.1
 * chunked encoding), routing, request bodies (bounded), the Authorization header, noticing a
 * client that went away (its socket hung up) and the endpoints' HTTP shape:
 *   POST /v1/completions, /v1/chat/completions   JSON, or text/event-stream when "stream"
 *   GET  /v1/models, /v1/models/{id}             the cluster's models (ListModels)
 *   GET  /healthz                                200 while the process serves
 *   GET  /readyz                                 200 while a lifecycle replica is SERVING
 *   GET  /metrics                                Prometheus text format
 * Errors are OpenAI's JSON with the matching status (404 unknown path, 405 wrong method, 413
 * body too large, 400 bad JSON, 401 refused key, ...).
 * Does not own: the generation flow (gw_gen.c). */
#ifndef GW_HTTP_H
#define GW_HTTP_H

#include <stdint.h>

#include "gw_gen.h"
#include "pie_metrics.h"
#include "pie_status.h"

typedef struct gw_http_opts {
    const char *listen;       /* "host:port"; port 0 = any free port */
    unsigned max_connections; /* beyond this, new connections are refused */
    uint64_t max_body_bytes;  /* larger request bodies get 413 */
    unsigned idle_timeout_s;  /* a connection silent this long is closed (not while streaming) */
} gw_http_opts;

typedef struct gw_http gw_http;

/* Starts serving. env and metrics must outlive the server. */
gw_http *gw_http_start(const gw_http_opts *o, const gw_gen_env *env, pie_metrics *metrics,
                       pie_status *st);
int gw_http_port(const gw_http *h);
/* Graceful drain: stops accepting connections (new ones are refused; /readyz fails first, see
 * gw_http_set_draining), then waits up to grace_ms for the requests in flight — streams
 * included — to finish. Returns how many were still running. */
unsigned gw_http_drain(gw_http *h, int64_t grace_ms);
/* From now on /readyz answers 503 "draining" so load balancers stop sending here. */
void gw_http_set_draining(gw_http *h);
/* Stops: ends connections (streams still in flight are cut, their Runs cancelled), frees. */
void gw_http_stop(gw_http *h);

#endif
