/* lc_http.h — outbound HTTP for inferlets (pie_http_request), through libcurl.
 *
 * Owns: the URL allowlist (prefixes from lc_host_config.http_allow), the queue of requests and
 * the one thread that runs up to max_running of them at once through libcurl's multi interface,
 * so that instance threads never wait on the network and a slow server holds a connection, not
 * a thread (shared fairly between tenants: round robin, half the queue and half the running
 * requests each at most), per-request timeout and response size cap (response buffers charged
 * to the replica's memory budget while they fill), and the restrictions that keep the
 * allowlist meaningful: http/https only, no redirects, no proxy from the environment.
 * Does not own: futures (the completion callback hands the result to lc_host). */
#ifndef LC_HTTP_H
#define LC_HTTP_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "pie_budget.h"
#include "pie_status.h"

#define LC_HTTP_MAX_RUNNING 16u /* http.max_running default */

typedef struct lc_http lc_http;

typedef struct lc_http_config {
    const char *allow;   /* ','-separated URL prefixes ("" or NULL: nothing is allowed) */
    uint64_t timeout_ms; /* whole request; 0 = 10 s */
    uint64_t max_bytes;  /* response body cap; 0 = 1 MiB */
    unsigned max_running; /* requests running at once; 0 = LC_HTTP_MAX_RUNNING */
    unsigned max_queued;  /* requests waiting to start before submit refuses; 0 = 256 */
    pie_budget *budget;   /* response buffers are charged to it (NULL: not counted) */
    struct pie_metrics *metrics; /* pie_lifecycle_http_pending, _requests_total (NULL: none) */
} lc_http_config;

lc_http *lc_http_create(const lc_http_config *cfg, pie_status *st);
/* Cancels requests in progress and queued (their callbacks run with PIE_CANCELLED), joins the
 * thread. NULL is fine. */
void lc_http_destroy(lc_http *h);

/* PIE_OK if url (len bytes) starts with an allowed prefix at a boundary (the prefix ends with
 * '/', or the URL continues with '/', '?', '#' or ends), else PERMISSION_DENIED naming the URL
 * and the allowlist. */
pie_code lc_http_check_url(const lc_http *h, const char *url, size_t len, pie_status *st);

/* Completion: code PIE_OK with payload = u32 little-endian HTTP status then the body (len bytes
 * in all, malloc'd: the callee owns it), or an error code with msg and payload NULL:
 * DEADLINE_EXCEEDED (timeout), RESOURCE_EXHAUSTED (body above the cap), UNAVAILABLE (connect or
 * transfer failed), CANCELLED; RESOURCE_EXHAUSTED also when the replica's memory budget has no
 * room for the response. Runs on lc_http's thread, exactly once: it must not block. */
typedef void (*lc_http_done_fn)(void *ctx, pie_code code, const char *msg, uint8_t *payload,
                                size_t len);

typedef struct lc_http_request {
    const char *method; /* "GET" or "POST" (checked) */
    size_t method_len;
    const char *url;
    size_t url_len;
    const char *headers; /* "Name: value" lines separated by '\n' */
    size_t headers_len;
    const void *body; /* POST only */
    size_t body_len;
    const char *tenant; /* whose instance asks ("" or NULL: one shared share) */
} lc_http_request;

/* Checks and copies the request and queues it. cancel (may be NULL) is polled while the request
 * runs (every 50 ms): once true the request stops with PIE_CANCELLED; it must stay valid until done
 * is called. Errors (done is then not called): INVALID_ARGUMENT (method, header line without ':',
 * control characters), PERMISSION_DENIED (allowlist), RESOURCE_EXHAUSTED (too many queued). */
pie_code lc_http_submit(lc_http *h, const lc_http_request *req, const atomic_bool *cancel,
                        lc_http_done_fn done, void *ctx, pie_status *st);

#endif
