/* lc_http.c — see lc_http.h. */
#include "lc_http.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <curl/curl.h>

#include "pie_log.h"
#include "pie_metrics.h"
#include "pie_tenant.h"

/* A tenant's requests in the pool: waiting and running. */
typedef struct http_tenant {
    char name[PIE_TENANT_NAME_MAX + 1]; /* first (pie_tenant_tab); "": requests without one */
    unsigned waiting, running;
    uint64_t served; /* when a thread last took one of its requests (lc_http.clock) */
} http_tenant;

typedef struct http_job {
    struct http_job *next; /* in the queue, then in the running list */
    struct http_job *prev; /* in the running list (removal without a walk) */
    char tenant[PIE_TENANT_NAME_MAX + 1];
    char *url; /* NUL-terminated copies */
    char *body;
    size_t body_len;
    bool post;
    struct curl_slist *headers;
    const atomic_bool *cancel;
    lc_http_done_fn done;
    void *ctx;
    /* while it runs (the loop thread's) */
    struct lc_http *h;
    CURL *easy;
    char err[CURL_ERROR_SIZE];
    uint8_t *buf; /* u32 status + body */
    size_t len, cap;
    uint64_t charged; /* of h->budget: buf */
    bool too_big, no_memory;
} http_job;

struct lc_http {
    char *allow;       /* copy of the list, for messages */
    char **prefixes;   /* split */
    size_t n_prefixes;
    uint64_t timeout_ms, max_bytes;
    unsigned max_queued, max_running, tenant_running;
    pie_budget *budget; /* response buffers are charged to it while they fill */
    pthread_mutex_t mu; /* guards the queue, tenants and stop */
    http_job *head, *tail;
    unsigned queued;
    /* The tenants with requests waiting or running (a small table: forgotten when idle). When
     * a request may start, the loop takes the oldest of the tenant with the fewest running, of
     * those the one served least recently (round robin), so one tenant's slow requests never
     * hold the others' behind them; each tenant has at most half of max_queued waiting or
     * running and half of max_running running. */
    pie_tenant_tab tenants; /* of http_tenant */
    uint64_t clock;         /* counts requests started */
    atomic_bool stop;
    /* One thread runs every request through libcurl's multi interface: a request waiting on a
     * slow server holds a connection, not a thread. The rest is the thread's alone. */
    CURLM *multi;
    pthread_t thread;
    bool thread_started;
    http_job *running;
    unsigned n_running;
    /* metrics (NULL without a registry) */
    pie_gauge *g_waiting, *g_running;
    pie_counter *c_ended[5]; /* by outcome_names */
};

/* How requests end, as pie_lifecycle_http_requests_total's `code` label says it. */
static const char *const outcome_names[5] = {"OK", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED",
                                             "UNAVAILABLE", "CANCELLED"};

static pie_counter *outcome_counter(const lc_http *h, pie_code code) {
    switch (code) {
    case PIE_OK: return h->c_ended[0];
    case PIE_DEADLINE_EXCEEDED: return h->c_ended[1];
    case PIE_RESOURCE_EXHAUSTED: return h->c_ended[2];
    case PIE_CANCELLED: return h->c_ended[4];
    default: return h->c_ended[3];
    }
}

/* curl_global_init is process-wide state that libcurl requires once before any handle; one
 * lc_http per process is the normal case, and the count makes nested create/destroy pairs
 * (tests) balanced. */
static pthread_mutex_t http_global_mu = PTHREAD_MUTEX_INITIALIZER;
static unsigned http_global_users;

static bool http_global_init(void) {
    pthread_mutex_lock(&http_global_mu);
    bool ok = http_global_users > 0 || curl_global_init(CURL_GLOBAL_DEFAULT) == CURLE_OK;
    if (ok) http_global_users++;
    pthread_mutex_unlock(&http_global_mu);
    return ok;
}

static void http_global_release(void) {
    pthread_mutex_lock(&http_global_mu);
    if (--http_global_users == 0) curl_global_cleanup();
    pthread_mutex_unlock(&http_global_mu);
}

/* ---- allowlist ------------------------------------------------------------------------------ */

static bool split_allow(lc_http *h, const char *allow) {
    h->allow = strdup(allow ? allow : "");
    char *copy = strdup(h->allow ? h->allow : "");
    if (h->allow == NULL || copy == NULL) {
        free(copy);
        return false;
    }
    char *save = NULL;
    bool ok = true;
    for (char *p = strtok_r(copy, ",", &save); p && ok; p = strtok_r(NULL, ",", &save)) {
        while (*p == ' ') p++;
        size_t n = strlen(p);
        while (n && p[n - 1] == ' ') p[--n] = '\0';
        if (n == 0) continue;
        char **v = realloc(h->prefixes, (h->n_prefixes + 1) * sizeof *v);
        ok = v != NULL;
        if (ok) {
            h->prefixes = v;
            ok = (h->prefixes[h->n_prefixes] = strdup(p)) != NULL;
            if (ok) h->n_prefixes++;
        }
    }
    free(copy);
    return ok;
}

/* Whether url[0, len)'s path has a "." or ".." segment, literal or percent-encoded: curl and
 * servers resolve them, so "http://a/v1/../admin" would leave an allowed "http://a/v1/". */
static bool has_dot_segment(const char *url, size_t len) {
    const char *sep = memmem(url, len, "://", 3);
    size_t i = sep ? (size_t)(sep - url) + 3 : 0;
    for (; i < len && url[i] != '?' && url[i] != '#'; i++) {
        if (url[i] != '/') continue;
        size_t j = i + 1, dots = 0;
        for (;;) {
            if (j < len && url[j] == '.') {
                j++;
            } else if (j + 2 < len && url[j] == '%' && url[j + 1] == '2' &&
                       (url[j + 2] == 'e' || url[j + 2] == 'E')) {
                j += 3;
            } else {
                break;
            }
            dots++;
        }
        bool ends = j == len || url[j] == '/' || url[j] == '?' || url[j] == '#';
        if ((dots == 1 || dots == 2) && ends) return true;
    }
    return false;
}

pie_code lc_http_check_url(const lc_http *h, const char *url, size_t len, pie_status *st) {
    if (has_dot_segment(url, len))
        return pie_status_set(st, PIE_PERMISSION_DENIED,
                              "http_request: URL %.*s has a dot segment (. or ..) in its path: "
                              "not allowed, it could leave the allowlist's prefixes",
                              len > 200 ? 200 : (int)len, url);
    for (size_t i = 0; i < h->n_prefixes; i++) {
        const char *p = h->prefixes[i];
        size_t n = strlen(p);
        if (len < n || memcmp(url, p, n) != 0) continue;
        /* "http://a.com" must not admit "http://a.com.evil.net" or "http://a.com@evil.net". */
        if (p[n - 1] == '/' || len == n || url[n] == '/' || url[n] == '?' || url[n] == '#')
            return PIE_OK;
    }
    return pie_status_set(st, PIE_PERMISSION_DENIED,
                          "http_request: URL %.*s is not allowed (allowlist: %s)",
                          len > 200 ? 200 : (int)len, url, h->allow[0] ? h->allow : "empty");
}

/* ---- requests ------------------------------------------------------------------------------- */

static void job_free(http_job *j) {
    if (j == NULL) return;
    free(j->url);
    free(j->body);
    free(j->buf);
    curl_slist_free_all(j->headers);
    free(j);
}

/* Gives back what the job's response buffer charged (the buffer itself goes to its callback
 * or is freed with the job). */
static void job_uncharge(http_job *j) {
    pie_budget_give(j->h->budget, j->charged);
    j->charged = 0;
}

static bool has_ctl(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] < 0x20 || s[i] == 0x7f) return true;
    return false;
}

/* Whether name[0, n) is an HTTP token (RFC 9110 tchar). */
static bool is_token(const char *name, size_t n) {
    static const char extra[] = "!#$%&'*+-.^_`|~";
    for (size_t i = 0; i < n; i++) {
        char ch = name[i];
        bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                  (ch >= '0' && ch <= '9') || (ch != '\0' && strchr(extra, ch) != NULL);
        if (!ok) return false;
    }
    return n > 0;
}

/* Headers curl sets from the URL and the body: where the request goes and how it is framed.
 * An inferlet's Host would reach another virtual host behind an allowed address; its framing
 * headers could smuggle a second request through a proxy. */
static bool replica_owned(const char *name, size_t n) {
    static const char *const owned[] = {
        "host", "content-length", "transfer-encoding", "connection",       "upgrade",
        "te",   "trailer",        "keep-alive",        "proxy-connection", "expect"};
    for (size_t i = 0; i < sizeof owned / sizeof *owned; i++)
        if (strlen(owned[i]) == n && strncasecmp(owned[i], name, n) == 0) return true;
    return false;
}

/* Header lines → curl list. */
static pie_code job_headers(http_job *j, const char *hd, size_t n, pie_status *st) {
    size_t at = 0;
    while (at < n) {
        const char *nl = memchr(hd + at, '\n', n - at);
        size_t end = nl ? (size_t)(nl - hd) : n, ln = end - at;
        if (ln && hd[at + ln - 1] == '\r') ln--;
        if (ln > 0) {
            const char *colon = memchr(hd + at, ':', ln);
            size_t name_len = colon ? (size_t)(colon - (hd + at)) : 0;
            if (colon == NULL || !is_token(hd + at, name_len) || has_ctl(hd + at, ln) || ln > 8192)
                return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                      "http_request: header line \"%.*s\" is not \"Name: value\"",
                                      ln > 80 ? 80 : (int)ln, hd + at);
            if (replica_owned(hd + at, name_len))
                return pie_status_set(st, PIE_PERMISSION_DENIED,
                                      "http_request: header %.*s is set by the replica (from the "
                                      "URL and the body), not by an inferlet",
                                      (int)name_len, hd + at);
            char *line = strndup(hd + at, ln);
            struct curl_slist *l = line ? curl_slist_append(j->headers, line) : NULL;
            free(line);
            if (l == NULL) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
            j->headers = l;
        }
        at = end + 1;
    }
    return PIE_OK;
}

static http_job *job_new(const lc_http *h, const lc_http_request *r, pie_status *st) {
    bool get = r->method_len == 3 && memcmp(r->method, "GET", 3) == 0;
    bool post = r->method_len == 4 && memcmp(r->method, "POST", 4) == 0;
    if (!get && !post) {
        pie_status_set(st, PIE_INVALID_ARGUMENT,
                       "http_request: method \"%.*s\" is not GET or POST",
                       r->method_len > 16 ? 16 : (int)r->method_len, r->method);
        return NULL;
    }
    if (r->url_len == 0 || r->url_len > 8192 || has_ctl(r->url, r->url_len) ||
        memchr(r->url, ' ', r->url_len)) {
        pie_status_set(st, PIE_INVALID_ARGUMENT,
                       "http_request: url of %zu bytes is empty, too long or has spaces or control "
                       "characters",
                       r->url_len);
        return NULL;
    }
    if (lc_http_check_url(h, r->url, r->url_len, st) != PIE_OK) return NULL;
    http_job *j = calloc(1, sizeof *j);
    if (j == NULL || (j->url = strndup(r->url, r->url_len)) == NULL) goto oom;
    j->post = post;
    if (post) {
        j->body = malloc(r->body_len ? r->body_len : 1);
        if (j->body == NULL) goto oom;
        if (r->body_len) memcpy(j->body, r->body, r->body_len);
        j->body_len = r->body_len;
    }
    if (job_headers(j, r->headers, r->headers_len, st) != PIE_OK) {
        job_free(j);
        return NULL;
    }
    return j;
oom:
    job_free(j);
    pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
    return NULL;
}

/* Forgets t once it has nothing waiting or running. Caller holds mu. */
static void tenant_idle(lc_http *h, http_tenant *t) {
    if (t->waiting || t->running) return;
    pie_tenant_tab_remove(&h->tenants, t);
}

pie_code lc_http_submit(lc_http *h, const lc_http_request *req, const atomic_bool *cancel,
                        lc_http_done_fn done, void *ctx, pie_status *st) {
    http_job *j = job_new(h, req, st);
    if (j == NULL) return st ? st->code : PIE_INVALID_ARGUMENT;
    j->h = h;
    j->cancel = cancel;
    j->done = done;
    j->ctx = ctx;
    snprintf(j->tenant, sizeof j->tenant, "%s", req->tenant ? req->tenant : "");
    unsigned share = h->max_queued > 1 ? h->max_queued / 2 : 1;
    pthread_mutex_lock(&h->mu);
    http_tenant *t = pie_tenant_tab_get(&h->tenants, j->tenant);
    pie_code rc = PIE_OK;
    if (t == NULL)
        rc = pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "http_request: out of memory");
    else if (h->queued >= h->max_queued || atomic_load(&h->stop))
        rc = pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                            "http_request: %u requests are already waiting in this replica",
                            h->max_queued);
    else if (j->tenant[0] && t->waiting + t->running >= share)
        rc = pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                            "http_request: tenant \"%s\" has %u requests waiting or running in "
                            "this replica, its share (half of %u)",
                            j->tenant, t->waiting + t->running, h->max_queued);
    if (rc != PIE_OK) {
        if (t) tenant_idle(h, t);
        pthread_mutex_unlock(&h->mu);
        job_free(j);
        return rc;
    }
    t->waiting++;
    if (h->tail)
        h->tail->next = j;
    else
        h->head = j;
    h->tail = j;
    h->queued++;
    pie_gauge_add(h->g_waiting, 1); /* under mu: before take_next can count it out */
    pthread_mutex_unlock(&h->mu);
    curl_multi_wakeup(h->multi);
    return PIE_OK;
}

/* Takes the oldest waiting request of the tenant with the fewest running (ties: the one
 * started least recently) that may run another, or NULL. Caller holds mu. */
static http_job *take_next(lc_http *h) {
    http_job *best = NULL, *best_prev = NULL, *prev = NULL;
    http_tenant *bt = NULL;
    for (http_job *j = h->head; j; prev = j, j = j->next) {
        http_tenant *t = pie_tenant_tab_find(&h->tenants, j->tenant); /* listed: j waits */
        if (j->tenant[0] && t->running >= h->tenant_running) continue;
        if (best == NULL || t->running < bt->running ||
            (t->running == bt->running && t->served < bt->served)) {
            best = j;
            best_prev = prev;
            bt = t;
        }
    }
    if (best == NULL) return NULL;
    if (best_prev)
        best_prev->next = best->next;
    else
        h->head = best->next;
    if (h->tail == best) h->tail = best_prev;
    best->next = NULL;
    h->queued--;
    bt->waiting--;
    bt->running++;
    bt->served = ++h->clock;
    pie_gauge_add(h->g_waiting, -1);
    pie_gauge_add(h->g_running, 1);
    return best;
}

/* A request of tenant name ended. */
static void job_ended(lc_http *h, const char *name) {
    pthread_mutex_lock(&h->mu);
    http_tenant *t = pie_tenant_tab_find(&h->tenants, name);
    if (t) {
        t->running--;
        tenant_idle(h, t);
    }
    pie_gauge_add(h->g_running, -1);
    pthread_mutex_unlock(&h->mu);
}

static size_t on_body(char *data, size_t size, size_t nmemb, void *user) {
    http_job *j = user;
    size_t n = size * nmemb;
    if (j->len - 4 + n > j->h->max_bytes) {
        j->too_big = true;
        return 0; /* aborts the transfer: CURLE_WRITE_ERROR */
    }
    if (j->cap - j->len < n) {
        size_t cap = j->cap * 2;
        while (cap - j->len < n) cap *= 2;
        if (!pie_budget_take(j->h->budget, cap - j->cap)) {
            j->no_memory = true;
            return 0;
        }
        uint8_t *b = realloc(j->buf, cap);
        if (b == NULL) {
            pie_budget_give(j->h->budget, cap - j->cap);
            j->no_memory = true;
            return 0;
        }
        j->charged += cap - j->cap;
        j->buf = b;
        j->cap = cap;
    }
    memcpy(j->buf + j->len, data, n);
    j->len += n;
    return n;
}

static void job_setopts(http_job *j) {
    CURL *c = j->easy;
    curl_easy_setopt(c, CURLOPT_URL, j->url);
    curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 0L); /* a redirect could leave the allowlist */
    curl_easy_setopt(c, CURLOPT_PROXY, "");          /* no proxy from the environment */
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);       /* threads: no SIGALRM for DNS timeouts */
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, (long)j->h->timeout_ms);
    curl_easy_setopt(c, CURLOPT_MAXFILESIZE_LARGE, (curl_off_t)j->h->max_bytes);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, j);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, j->headers);
    curl_easy_setopt(c, CURLOPT_ERRORBUFFER, j->err);
    curl_easy_setopt(c, CURLOPT_PRIVATE, j);
    if (j->post) {
        curl_easy_setopt(c, CURLOPT_POST, 1L);
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, j->body);
        curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)j->body_len);
    }
}

/* Calls the job's completion once, ends it in its tenant's count and frees it. Loop thread. */
static void job_finish(http_job *j, pie_code code, const char *msg) {
    lc_http *h = j->h;
    if (j->easy) {
        curl_multi_remove_handle(h->multi, j->easy);
        curl_easy_cleanup(j->easy);
        j->easy = NULL;
    }
    job_uncharge(j);
    pie_counter_add(outcome_counter(h, code), 1);
    job_ended(h, j->tenant); /* counted out before its completion runs: what that sees is final */
    if (code == PIE_OK) {
        uint8_t *payload = j->buf;
        j->buf = NULL;
        j->done(j->ctx, PIE_OK, "", payload, j->len);
    } else {
        j->done(j->ctx, code, msg, NULL, 0);
    }
    job_free(j);
}

/* Starts a request taken from the queue: a handle of its own in the multi handle (whose
 * connection cache the requests share). Loop thread. */
static void job_start(lc_http *h, http_job *j) {
    j->cap = 4096;
    if (!pie_budget_take(h->budget, j->cap)) {
        job_finish(j, PIE_RESOURCE_EXHAUSTED,
                   "http_request: the replica's memory (limits.replica_memory) is full");
        return;
    }
    j->charged = j->cap;
    j->len = 4;
    if ((j->buf = malloc(j->cap)) == NULL || (j->easy = curl_easy_init()) == NULL) {
        job_finish(j, PIE_RESOURCE_EXHAUSTED, "http_request: out of memory");
        return;
    }
    job_setopts(j);
    if (curl_multi_add_handle(h->multi, j->easy) != CURLM_OK) {
        curl_easy_cleanup(j->easy);
        j->easy = NULL;
        job_finish(j, PIE_RESOURCE_EXHAUSTED, "http_request: curl_multi_add_handle failed");
        return;
    }
    j->prev = NULL;
    j->next = h->running;
    if (h->running) h->running->prev = j;
    h->running = j;
    h->n_running++;
}

static void running_remove(lc_http *h, http_job *j) {
    if (j->prev)
        j->prev->next = j->next;
    else
        h->running = j->next;
    if (j->next) j->next->prev = j->prev;
    j->next = j->prev = NULL;
    h->n_running--;
}

/* A transfer curl finished: its result for the completion. Loop thread. */
static void job_completed(lc_http *h, http_job *j, CURLcode cc) {
    char msg[CURL_ERROR_SIZE + 200] = "";
    pie_code code = PIE_OK;
    running_remove(h, j);
    if (cc == CURLE_OK) {
        long status = 0;
        curl_easy_getinfo(j->easy, CURLINFO_RESPONSE_CODE, &status);
        uint32_t s32 = (uint32_t)status;
        memcpy(j->buf, &s32, 4); /* little-endian hosts only (lc_host.c asserts it) */
    } else if (j->too_big || cc == CURLE_FILESIZE_EXCEEDED) {
        code = PIE_RESOURCE_EXHAUSTED;
        snprintf(msg, sizeof msg, "http_request: response from %s exceeds the cap of %llu bytes",
                 j->url, (unsigned long long)h->max_bytes);
    } else if (j->no_memory) {
        code = PIE_RESOURCE_EXHAUSTED;
        snprintf(msg, sizeof msg,
                 "http_request: no memory for the response from %s (limits.replica_memory)",
                 j->url);
    } else if (cc == CURLE_OPERATION_TIMEDOUT) {
        code = PIE_DEADLINE_EXCEEDED;
        snprintf(msg, sizeof msg, "http_request: %s did not answer within %llu ms", j->url,
                 (unsigned long long)h->timeout_ms);
    } else {
        code = PIE_UNAVAILABLE;
        snprintf(msg, sizeof msg, "http_request: %s failed: %s", j->url,
                 j->err[0] ? j->err : curl_easy_strerror(cc));
    }
    job_finish(j, code, msg);
}

/* Ends the running requests whose instance cancelled them, or all when stopping. */
static void cancel_running(lc_http *h, bool stopping) {
    char msg[256];
    for (http_job *j = h->running, *next; j; j = next) {
        next = j->next;
        if (!stopping && !(j->cancel && atomic_load(j->cancel))) continue;
        running_remove(h, j);
        snprintf(msg, sizeof msg, "http_request: %.200s cancelled", j->url);
        job_finish(j, PIE_CANCELLED, stopping ? "http_request: the service is stopping" : msg);
    }
}

/* How often the loop looks at the running requests' cancel flags while any runs. */
#define LC_HTTP_CANCEL_POLL_MS 50

static void *http_main(void *arg) {
    lc_http *h = arg;
    (void)pthread_setname_np(pthread_self(), "lc-http"); /* cosmetic */
    for (;;) {
        bool stopping = atomic_load(&h->stop);
        cancel_running(h, stopping);
        for (;;) { /* start what may start */
            pthread_mutex_lock(&h->mu);
            http_job *j = h->n_running < h->max_running || stopping ? take_next(h) : NULL;
            pthread_mutex_unlock(&h->mu);
            if (j == NULL) break;
            if (stopping)
                job_finish(j, PIE_CANCELLED, "http_request: the service is stopping");
            else
                job_start(h, j);
        }
        if (stopping) break;
        int still = 0;
        curl_multi_perform(h->multi, &still);
        CURLMsg *m;
        int left = 0;
        while ((m = curl_multi_info_read(h->multi, &left)) != NULL) {
            if (m->msg != CURLMSG_DONE) continue;
            char *priv = NULL;
            curl_easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, &priv);
            http_job *j = (http_job *)(void *)priv;
            CURLcode cc = m->data.result; /* m is invalid once its handle is removed */
            job_completed(h, j, cc);
        }
        /* Woken early by curl (its sockets and timers) and by curl_multi_wakeup (a submit, a
         * stop). */
        int wait_ms = h->n_running ? LC_HTTP_CANCEL_POLL_MS : 1000;
        curl_multi_poll(h->multi, NULL, 0, wait_ms, NULL);
    }
    return NULL;
}

/* ---- lifetime ------------------------------------------------------------------------------- */

static void http_free(lc_http *h) {
    for (size_t i = 0; i < h->n_prefixes; i++) free(h->prefixes[i]);
    free(h->prefixes);
    free(h->allow);
    pie_tenant_tab_free(&h->tenants);
    free(h);
}

lc_http *lc_http_create(const lc_http_config *cfg, pie_status *st) {
    lc_http *h = calloc(1, sizeof *h);
    if (h == NULL) goto oom;
    h->tenants = (pie_tenant_tab)PIE_TENANT_TAB_INIT(http_tenant);
    if (!split_allow(h, cfg->allow)) goto oom;
    h->timeout_ms = cfg->timeout_ms ? cfg->timeout_ms : 10000;
    h->max_bytes = cfg->max_bytes ? cfg->max_bytes : (1u << 20);
    h->max_queued = cfg->max_queued ? cfg->max_queued : 256;
    h->max_running = cfg->max_running ? cfg->max_running : LC_HTTP_MAX_RUNNING;
    h->tenant_running = h->max_running > 1 ? h->max_running / 2 : 1;
    h->budget = cfg->budget;
    atomic_init(&h->stop, false);
    if (cfg->metrics) {
        pie_status mst; /* a metric that cannot be made is left out, not fatal */
        const char *help = "Inferlets' HTTP requests in this replica: waiting to start, running.";
        h->g_waiting = pie_metrics_gauge(cfg->metrics, "pie_lifecycle_http_pending", help,
                                         (pie_metric_label[]){{"state", "waiting"}}, 1, &mst);
        h->g_running = pie_metrics_gauge(cfg->metrics, "pie_lifecycle_http_pending", help,
                                         (pie_metric_label[]){{"state", "running"}}, 1, &mst);
        for (int i = 0; i < 5; i++)
            h->c_ended[i] =
                pie_metrics_counter(cfg->metrics, "pie_lifecycle_http_requests_total",
                                    "Inferlets' HTTP requests ended, by outcome.",
                                    (pie_metric_label[]){{"code", outcome_names[i]}}, 1, &mst);
    }
    if (!http_global_init()) {
        http_free(h);
        pie_status_set(st, PIE_INTERNAL, "curl_global_init failed");
        return NULL;
    }
    if (pthread_mutex_init(&h->mu, NULL) != 0) {
        http_global_release();
        http_free(h);
        pie_status_set(st, PIE_INTERNAL, "lc_http: mutex init failed");
        return NULL;
    }
    h->multi = curl_multi_init();
    if (h->multi == NULL) {
        lc_http_destroy(h);
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "lc_http: curl_multi_init failed");
        return NULL;
    }
    /* Connections kept for reuse: enough for the requests that may run at once. */
    curl_multi_setopt(h->multi, CURLMOPT_MAXCONNECTS, (long)h->max_running);
    int rc = pthread_create(&h->thread, NULL, http_main, h);
    if (rc != 0) {
        lc_http_destroy(h);
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "lc_http: pthread_create: %s", strerror(rc));
        return NULL;
    }
    h->thread_started = true;
    return h;
oom:
    if (h) http_free(h);
    pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
    return NULL;
}

void lc_http_destroy(lc_http *h) {
    if (h == NULL) return;
    pthread_mutex_lock(&h->mu);
    atomic_store(&h->stop, true);
    pthread_mutex_unlock(&h->mu);
    if (h->thread_started) {
        curl_multi_wakeup(h->multi);
        pthread_join(h->thread, NULL);
    }
    /* The thread ended what ran and what waited (cancelled) before it exited. */
    if (h->multi) curl_multi_cleanup(h->multi);
    pthread_mutex_destroy(&h->mu);
    http_global_release();
    http_free(h);
}
