/* pie_httpd.h — the small HTTP/1.1 endpoint every service runs for Prometheus and probes.
 *
 * Owns: one listening socket and one thread that serves it with poll(2):
 *   GET|HEAD /metrics  200, the registry in text format 0.0.4,
 *                      Content-Type: text/plain; version=0.0.4; charset=utf-8
 *                      (404 when no registry was given)
 *   GET|HEAD /healthz  200 "ok", or 503 with the health callback's reason
 *   other paths        404 "not found\n"
 *   other methods      405 "method not allowed\n" with Allow: GET, HEAD
 *   malformed request  400; HTTP major version other than 1: 505
 *   request line + headers over max_request_bytes: 431
 *   no complete request within timeout_ms: 408
 * A query string is ignored. Every response carries Content-Length and Connection: close;
 * the server answers one request per connection, then half-closes and drains what the client
 * still sends (bounded by timeout_ms) so the answer is not lost to a reset. Many clients are
 * served at once (up to max_clients; beyond that new connections wait in the listen backlog),
 * requests may arrive in any number of pieces.
 * Does not own: the metrics (pie_metrics.h) or what "healthy" means (the service's callback). */
#ifndef PIE_HTTPD_H
#define PIE_HTTPD_H

#include <stddef.h>
#include <stdint.h>

#include "pie_metrics.h"
#include "pie_status.h"

typedef struct pie_httpd pie_httpd;

typedef struct pie_httpd_options {
    const char *host;        /* address to bind: "127.0.0.1" when NULL, "0.0.0.0", "::", a name */
    uint16_t port;           /* 0: an ephemeral port, see pie_httpd_port */
    pie_metrics *metrics;    /* served at /metrics; NULL: 404 there */
    /* /healthz: NULL → always 200 "ok". Otherwise called on the server thread; return 0 for
     * healthy, or nonzero after writing a one-line reason into reason[0..n) → 503 <reason>. */
    int (*health)(void *arg, char *reason, size_t n);
    void *health_arg;
    size_t max_request_bytes; /* request line + headers; 0 → 8192 */
    int max_clients;          /* connections served at once; 0 → 64 */
    int timeout_ms;           /* per connection, to send the request or take the answer; 0 → 10000 */
} pie_httpd_options;

/* Binds, listens and starts the server thread. Errors: PIE_INVALID_ARGUMENT (bad options or
 * host: "httpd: cannot resolve '<host>': <reason>"), PIE_UNAVAILABLE ("httpd: cannot listen on
 * <host>:<port>: <strerror>"), PIE_RESOURCE_EXHAUSTED / PIE_INTERNAL (out of memory, threads). */
pie_code pie_httpd_start(const pie_httpd_options *opt, pie_httpd **out, pie_status *st);

/* The bound port (the ephemeral one when options.port was 0). */
uint16_t pie_httpd_port(const pie_httpd *h);

/* Stops the thread, closes every connection and the socket, frees h. NULL is a no-op. */
void pie_httpd_stop(pie_httpd *h);

#endif
