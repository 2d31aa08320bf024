/* pie_httpd.c — see pie_httpd.h.
 *
 * One thread, one poll(2) loop over: a wake pipe (stop), the listening socket (while there is
 * room), and every connection. A connection moves READING → WRITING → DRAINING → closed; each
 * state has a deadline. Requests are tiny, so a whole request head is buffered before it is
 * parsed, and the whole response is built before the first byte is sent. */
#include "pie_httpd.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "pie_log.h"

#define HTD_DEFAULT_MAX_REQUEST 8192
#define HTD_DEFAULT_MAX_CLIENTS 64
#define HTD_DEFAULT_TIMEOUT_MS 10000
#define HTD_ACCEPT_PAUSE_MS 100 /* after EMFILE and kin: let connections close first */

typedef enum htd_state { HTD_FREE, HTD_READING, HTD_WRITING, HTD_DRAINING } htd_state;

typedef struct htd_conn {
    int fd;
    htd_state state;
    char *req; /* [max_request_bytes] */
    size_t req_len;
    char *resp; /* status line + headers + body */
    size_t resp_len, resp_off;
    int64_t deadline_ms; /* CLOCK_MONOTONIC */
} htd_conn;

struct pie_httpd {
    pie_httpd_options opt;
    char host[256];
    int listen_fd;
    int wake[2]; /* pipe: pie_httpd_stop writes one byte */
    uint16_t port;
    pthread_t thread;
    htd_conn *conns;      /* [max_clients] */
    struct pollfd *pfds;  /* [max_clients + 2] */
    int *pfd_conn;        /* [max_clients + 2]: connection index of each pollfd, -1 for others */
    int n_open;
    int64_t accept_resume_ms;
};

static int64_t htd_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- responses ------------------------------------------------------------------------------ */

static const char *htd_reason(int code) {
    switch (code) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Unknown";
    }
}

/* Builds c->resp; the body is copied (and left out for HEAD). False if out of memory. */
static bool htd_respond(htd_conn *c, int code, const char *type, const char *body, size_t len,
                        bool head_only) {
    char hdr[512];
    int n = snprintf(hdr, sizeof hdr,
                     "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
                     "Connection: close\r\n%s\r\n",
                     code, htd_reason(code), type, len,
                     code == 405 ? "Allow: GET, HEAD\r\n" : "");
    if (n < 0 || (size_t)n >= sizeof hdr) return false;
    size_t body_len = head_only ? 0 : len;
    char *r = malloc((size_t)n + body_len);
    if (!r) return false;
    memcpy(r, hdr, (size_t)n);
    if (body_len) memcpy(r + n, body, body_len);
    free(c->resp);
    c->resp = r;
    c->resp_len = (size_t)n + body_len;
    c->resp_off = 0;
    return true;
}

static bool htd_respond_text(htd_conn *c, int code, const char *text, bool head_only) {
    return htd_respond(c, code, "text/plain; charset=utf-8", text, strlen(text), head_only);
}

static bool htd_serve_metrics(pie_httpd *h, htd_conn *c, bool head_only) {
    if (!h->opt.metrics) return htd_respond_text(c, 404, "not found\n", head_only);
    char *text;
    size_t len;
    if (pie_metrics_render(h->opt.metrics, &text, &len) != PIE_OK)
        return htd_respond_text(c, 500, "out of memory\n", head_only);
    bool ok = htd_respond(c, 200, "text/plain; version=0.0.4; charset=utf-8", text, len, head_only);
    free(text);
    return ok;
}

static bool htd_serve_health(pie_httpd *h, htd_conn *c, bool head_only) {
    char reason[256] = "";
    if (!h->opt.health || h->opt.health(h->opt.health_arg, reason, sizeof reason) == 0)
        return htd_respond_text(c, 200, "ok", head_only);
    reason[sizeof reason - 2] = '\0';
    size_t n = strlen(reason);
    reason[n] = '\n';
    reason[n + 1] = '\0';
    return htd_respond_text(c, 503, reason, head_only);
}

/* The request head c->req[0..len) is complete: route it. */
static bool htd_handle(pie_httpd *h, htd_conn *c, size_t len) {
    const char *p = c->req, *end = c->req + len;
    const char *eol = memchr(p, '\n', (size_t)(end - p));
    if (!eol) return htd_respond_text(c, 400, "bad request\n", false);
    size_t line_len = (size_t)(eol - p);
    if (line_len > 0 && p[line_len - 1] == '\r') line_len--;
    /* METHOD SP TARGET SP HTTP/x.y */
    const char *sp1 = memchr(p, ' ', line_len);
    const char *sp2 = sp1 ? memchr(sp1 + 1, ' ', line_len - (size_t)(sp1 + 1 - p)) : NULL;
    if (!sp1 || !sp2 || sp1 == p || sp2 == sp1 + 1)
        return htd_respond_text(c, 400, "bad request\n", false);
    const char *method = p, *target = sp1 + 1, *version = sp2 + 1;
    size_t mlen = (size_t)(sp1 - p), tlen = (size_t)(sp2 - target);
    size_t vlen = line_len - (size_t)(version - p);
    if (vlen != 8 || memcmp(version, "HTTP/", 5) != 0 || version[5] < '0' || version[5] > '9' ||
        version[6] != '.' || version[7] < '0' || version[7] > '9')
        return htd_respond_text(c, 400, "bad request\n", false);
    if (version[5] != '1')
        return htd_respond_text(c, 505, "http version not supported\n", false);
    for (size_t i = 0; i < mlen; i++)
        if (method[i] < 'A' || method[i] > 'Z')
            return htd_respond_text(c, 400, "bad request\n", false);
    bool get = mlen == 3 && memcmp(method, "GET", 3) == 0;
    bool head = mlen == 4 && memcmp(method, "HEAD", 4) == 0;
    if (!get && !head) return htd_respond_text(c, 405, "method not allowed\n", false);
    if (tlen > 7 && memcmp(target, "http://", 7) == 0) { /* absolute-form: drop scheme + host */
        const char *slash = memchr(target + 7, '/', tlen - 7);
        if (!slash) return htd_respond_text(c, 400, "bad request\n", false);
        tlen -= (size_t)(slash - target);
        target = slash;
    }
    const char *q = memchr(target, '?', tlen);
    size_t plen = q ? (size_t)(q - target) : tlen;
    if (plen == 8 && memcmp(target, "/metrics", 8) == 0) return htd_serve_metrics(h, c, head);
    if (plen == 8 && memcmp(target, "/healthz", 8) == 0) return htd_serve_health(h, c, head);
    return htd_respond_text(c, 404, "not found\n", head);
}

/* ---- connections ---------------------------------------------------------------------------- */

static void htd_close(pie_httpd *h, htd_conn *c) {
    (void)close(c->fd); /* nothing useful to do if it fails: the fd is gone either way */
    free(c->req);
    free(c->resp);
    *c = (htd_conn){.fd = -1, .state = HTD_FREE};
    h->n_open--;
}

static void htd_start_writing(pie_httpd *h, htd_conn *c, bool built) {
    if (!built) { /* out of memory: nothing to say, so say nothing */
        htd_close(h, c);
        return;
    }
    c->state = HTD_WRITING;
    c->deadline_ms = htd_now_ms() + h->opt.timeout_ms;
}

/* Finds the end of the request head (an empty line) at or after `from`; 0 if not yet there. */
static size_t htd_head_end(const char *buf, size_t len, size_t from) {
    for (size_t i = from; i < len; i++) {
        if (buf[i] != '\n') continue;
        if (i >= 1 && buf[i - 1] == '\n') return i + 1;
        if (i >= 2 && buf[i - 1] == '\r' && buf[i - 2] == '\n') return i + 1;
    }
    return 0;
}

static void htd_on_writable(pie_httpd *h, htd_conn *c) {
    while (c->resp_off < c->resp_len) {
        ssize_t w = send(c->fd, c->resp + c->resp_off, c->resp_len - c->resp_off, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        if (w < 0) {
            htd_close(h, c);
            return;
        }
        c->resp_off += (size_t)w;
    }
    /* All sent: half-close, then read until the client closes, so that unread request bytes
     * in our receive queue do not turn our close into a reset that eats the response. */
    if (shutdown(c->fd, SHUT_WR) != 0) {
        htd_close(h, c);
        return;
    }
    c->state = HTD_DRAINING;
    c->deadline_ms = htd_now_ms() + h->opt.timeout_ms;
}

static void htd_on_readable(pie_httpd *h, htd_conn *c) {
    for (;;) {
        size_t room = h->opt.max_request_bytes - c->req_len;
        ssize_t r = recv(c->fd, c->req + c->req_len, room, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        if (r <= 0) { /* the client went away before asking */
            htd_close(h, c);
            return;
        }
        size_t from = c->req_len > 3 ? c->req_len - 3 : 0;
        c->req_len += (size_t)r;
        size_t end = htd_head_end(c->req, c->req_len, from);
        if (end || c->req_len == h->opt.max_request_bytes) {
            bool built = end ? htd_handle(h, c, end)
                             : htd_respond_text(c, 431, "request header fields too large\n", false);
            htd_start_writing(h, c, built);
            if (c->state == HTD_WRITING) htd_on_writable(h, c); /* most answers fit at once */
            return;
        }
    }
}

static void htd_on_drain(pie_httpd *h, htd_conn *c) {
    char sink[4096];
    for (;;) {
        ssize_t r = recv(c->fd, sink, sizeof sink, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        if (r <= 0) {
            htd_close(h, c);
            return;
        }
    }
}

static void htd_on_deadline(pie_httpd *h, htd_conn *c) {
    if (c->state == HTD_READING) {
        htd_start_writing(h, c, htd_respond_text(c, 408, "request timeout\n", false));
        if (c->state == HTD_WRITING) htd_on_writable(h, c);
    } else {
        htd_close(h, c);
    }
}

static void htd_accept(pie_httpd *h) {
    while (h->n_open < h->opt.max_clients) {
        int fd = accept4(h->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            int e = errno;
            if (e == EINTR || e == ECONNABORTED || e == EPROTO) continue;
            if (e == EAGAIN || e == EWOULDBLOCK) return;
            char eb[128];
            pie_log_warn("httpd.accept_failed", "port=%u error=\"%s\"", h->port,
                         strerror_r(e, eb, sizeof eb));
            h->accept_resume_ms = htd_now_ms() + HTD_ACCEPT_PAUSE_MS;
            return;
        }
        int slot = 0;
        while (h->conns[slot].state != HTD_FREE) slot++; /* n_open < max: one is free */
        htd_conn *c = &h->conns[slot];
        c->req = malloc(h->opt.max_request_bytes);
        if (!c->req) {
            (void)close(fd); /* out of memory: refuse this one */
            continue;
        }
        c->fd = fd;
        c->state = HTD_READING;
        c->req_len = 0;
        c->deadline_ms = htd_now_ms() + h->opt.timeout_ms;
        h->n_open++;
    }
}

static void *htd_main(void *arg) {
    pie_httpd *h = arg;
    for (;;) {
        int64_t now = htd_now_ms();
        nfds_t n = 0;
        int timeout = -1;
        h->pfds[n] = (struct pollfd){.fd = h->wake[0], .events = POLLIN};
        h->pfd_conn[n++] = -1;
        int listen_at = -1;
        if (h->n_open < h->opt.max_clients) {
            if (now >= h->accept_resume_ms) {
                listen_at = (int)n;
                h->pfds[n] = (struct pollfd){.fd = h->listen_fd, .events = POLLIN};
                h->pfd_conn[n++] = -1;
            } else {
                timeout = (int)(h->accept_resume_ms - now);
            }
        }
        for (int i = 0; i < h->opt.max_clients; i++) {
            htd_conn *c = &h->conns[i];
            if (c->state == HTD_FREE) continue;
            short ev = c->state == HTD_WRITING ? POLLOUT : POLLIN;
            h->pfds[n] = (struct pollfd){.fd = c->fd, .events = ev};
            h->pfd_conn[n++] = i;
            int64_t left = c->deadline_ms > now ? c->deadline_ms - now : 0;
            if (timeout < 0 || left < timeout) timeout = (int)left;
        }
        int r = poll(h->pfds, n, timeout);
        if (r < 0 && errno != EINTR) {
            char eb[128];
            pie_log_error("httpd.poll_failed", "error=\"%s\"", strerror_r(errno, eb, sizeof eb));
            struct timespec pause = {0, 10 * 1000 * 1000};
            (void)nanosleep(&pause, NULL); /* ENOMEM: give the system a moment, then retry */
            continue;
        }
        if (r > 0 && (h->pfds[0].revents & (POLLIN | POLLHUP | POLLERR))) break; /* stop */
        now = htd_now_ms();
        for (nfds_t k = 1; r > 0 && k < n; k++) {
            int i = h->pfd_conn[k];
            short re = h->pfds[k].revents;
            if (i < 0 || !re) continue;
            htd_conn *c = &h->conns[i];
            if (c->state == HTD_READING) htd_on_readable(h, c);
            else if (c->state == HTD_WRITING) htd_on_writable(h, c);
            else if (c->state == HTD_DRAINING) htd_on_drain(h, c);
        }
        for (int i = 0; i < h->opt.max_clients; i++) {
            htd_conn *c = &h->conns[i];
            if (c->state != HTD_FREE && c->deadline_ms <= now) htd_on_deadline(h, c);
        }
        if (r > 0 && listen_at >= 0 && (h->pfds[listen_at].revents & POLLIN)) htd_accept(h);
    }
    return NULL;
}

/* ---- start / stop --------------------------------------------------------------------------- */

static void htd_free(pie_httpd *h) {
    for (int i = 0; h->conns && i < h->opt.max_clients; i++)
        if (h->conns[i].state != HTD_FREE) htd_close(h, &h->conns[i]);
    if (h->listen_fd >= 0) (void)close(h->listen_fd);
    if (h->wake[0] >= 0) (void)close(h->wake[0]);
    if (h->wake[1] >= 0) (void)close(h->wake[1]);
    free(h->conns);
    free(h->pfds);
    free(h->pfd_conn);
    free(h);
}

static pie_code htd_listen(pie_httpd *h, pie_status *st) {
    char port[8];
    snprintf(port, sizeof port, "%u", (unsigned)h->opt.port);
    struct addrinfo hints = {.ai_flags = AI_PASSIVE | AI_NUMERICSERV,
                             .ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM};
    struct addrinfo *res = NULL;
    int g = getaddrinfo(h->host, port, &hints, &res);
    if (g != 0)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "httpd: cannot resolve '%s': %s",
                              h->host, gai_strerror(g));
    int err = 0;
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                        a->ai_protocol);
        if (fd < 0) {
            err = errno;
            continue;
        }
        int one = 1;
        if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) == 0 &&
            bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 128) == 0) {
            h->listen_fd = fd;
            break;
        }
        err = errno;
        (void)close(fd);
    }
    freeaddrinfo(res);
    char eb[128];
    if (h->listen_fd < 0)
        return pie_status_set(st, PIE_UNAVAILABLE, "httpd: cannot listen on %s:%u: %s", h->host,
                              (unsigned)h->opt.port, strerror_r(err, eb, sizeof eb));
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (getsockname(h->listen_fd, (struct sockaddr *)&ss, &sl) != 0)
        return pie_status_set(st, PIE_INTERNAL, "httpd: getsockname: %s",
                              strerror_r(errno, eb, sizeof eb));
    if (ss.ss_family == AF_INET) h->port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
    else h->port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
    return PIE_OK;
}

pie_code pie_httpd_start(const pie_httpd_options *opt, pie_httpd **out, pie_status *st) {
    *out = NULL;
    if (!opt) return pie_status_set(st, PIE_INVALID_ARGUMENT, "httpd: options are NULL");
    if (opt->max_clients < 0 || opt->timeout_ms < 0)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "httpd: max_clients and timeout_ms must not be negative");
    if (opt->max_request_bytes != 0 && opt->max_request_bytes < 16)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "httpd: max_request_bytes %zu is too small (at least 16)",
                              opt->max_request_bytes);
    const char *host = opt->host ? opt->host : "127.0.0.1";
    if (strlen(host) >= sizeof((pie_httpd *)0)->host)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "httpd: host name is too long");
    pie_httpd *h = calloc(1, sizeof *h);
    if (!h) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
    h->opt = *opt;
    h->opt.host = h->host;
    snprintf(h->host, sizeof h->host, "%s", host);
    if (!h->opt.max_request_bytes) h->opt.max_request_bytes = HTD_DEFAULT_MAX_REQUEST;
    if (!h->opt.max_clients) h->opt.max_clients = HTD_DEFAULT_MAX_CLIENTS;
    if (!h->opt.timeout_ms) h->opt.timeout_ms = HTD_DEFAULT_TIMEOUT_MS;
    h->listen_fd = h->wake[0] = h->wake[1] = -1;
    pie_code rc;
    size_t nc = (size_t)h->opt.max_clients;
    h->conns = calloc(nc, sizeof *h->conns);
    h->pfds = calloc(nc + 2, sizeof *h->pfds);
    h->pfd_conn = calloc(nc + 2, sizeof *h->pfd_conn);
    if (!h->conns || !h->pfds || !h->pfd_conn) {
        rc = pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
        goto fail;
    }
    for (size_t i = 0; i < nc; i++) h->conns[i] = (htd_conn){.fd = -1, .state = HTD_FREE};
    char eb[128];
    if (pipe2(h->wake, O_NONBLOCK | O_CLOEXEC) != 0) {
        rc = pie_status_set(st, PIE_INTERNAL, "httpd: pipe: %s", strerror_r(errno, eb, sizeof eb));
        goto fail;
    }
    rc = htd_listen(h, st);
    if (rc != PIE_OK) goto fail;

    /* The server thread takes no signals: they belong to the service's main thread. */
    sigset_t all, old;
    sigfillset(&all);
    int e = pthread_sigmask(SIG_BLOCK, &all, &old);
    if (e == 0) {
        e = pthread_create(&h->thread, NULL, htd_main, h);
        int e2 = pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (e == 0 && e2 != 0) abort(); /* cannot happen with a valid `how`; never run masked */
    }
    if (e != 0) {
        rc = pie_status_set(st, PIE_INTERNAL, "httpd: cannot start thread: %s",
                            strerror_r(e, eb, sizeof eb));
        goto fail;
    }
    (void)pthread_setname_np(h->thread, "pie-httpd"); /* cosmetic: shows in top and gdb */
    pie_log_info("httpd.listen", "host=%s port=%u", h->host, (unsigned)h->port);
    *out = h;
    pie_status_ok(st);
    return PIE_OK;
fail:
    htd_free(h);
    return rc;
}

uint16_t pie_httpd_port(const pie_httpd *h) { return h->port; }

void pie_httpd_stop(pie_httpd *h) {
    if (!h) return;
    ssize_t w;
    do {
        w = write(h->wake[1], "x", 1);
    } while (w < 0 && errno == EINTR);
    /* EAGAIN means the pipe already holds a byte: the thread will wake either way. */
    int e = pthread_join(h->thread, NULL);
    if (e != 0) abort(); /* only EDEADLK/EINVAL/ESRCH: a misuse we must not paper over */
    htd_free(h);
}
