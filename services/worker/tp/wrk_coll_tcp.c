/* wrk_coll_tcp.c — see wrk_coll_tcp.h.
 *
 * Wire format (ranks of one group run the same build on the same architecture: host byte
 * order, IEEE floats):
 *   join     rank r → 0: tcp_hello {magic, rank, n_ranks, version, epoch}
 *            0 → rank r: tcp_reply {magic, code, len} + len bytes of message; code 0 (sent once
 *            every rank has joined) welcomes, another code refuses (and the connection closes)
 *   frame    tcp_frame {op, root, bytes} + bytes of payload, both directions
 *   abort    a frame of op ABORT whose payload is why the group failed (rank 0 → the others)
 * Every socket is non-blocking; every wait is a poll() bounded by the operation's deadline
 * (none for an idle broadcast's receives). */
#include "wrk_coll_tcp.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define TCP_MAGIC        0x50544354u /* "PTCT" */
#define TCP_VERSION      1u
#define TCP_RETRY_NS     20000000ull /* a rank retries connecting every 20 ms */
#define TCP_ABORT_MSG    400         /* longest reason carried by an ABORT frame */
#define TCP_HOSTPORT_MAX 300

enum { OP_ALLREDUCE = 1, OP_ALLGATHER = 2, OP_BCAST = 3, OP_BARRIER = 4, OP_ABORT = 5 };

static const char *op_name(uint32_t op) {
    switch (op) {
    case OP_ALLREDUCE: return "all-reduce";
    case OP_ALLGATHER: return "all-gather";
    case OP_BCAST: return "broadcast";
    case OP_BARRIER: return "barrier";
    case OP_ABORT: return "abort";
    default: return "unknown";
    }
}

typedef struct tcp_hello {
    uint32_t magic, rank, n_ranks, version;
    uint64_t epoch;
} tcp_hello;

typedef struct tcp_reply {
    uint32_t magic, code, len, reserved;
} tcp_reply;

typedef struct tcp_frame {
    uint32_t op, root;
    uint64_t bytes;
} tcp_frame;

struct wrk_coll_tcp {
    uint32_t rank, n;
    uint32_t timeout_ms;
    size_t chunk;    /* bytes of rank 0's receive scratch */
    int *fd;         /* rank 0: [n] (fd[0] unused, -1); others: fd[0] is the link to rank 0 */
    float *scratch;  /* rank 0: chunk bytes */
    pie_code failed; /* PIE_OK until the group fails (sticky) */
    char failed_msg[PIE_STATUS_MSG_MAX];
};

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t deadline_in(uint32_t ms) { return now_ns() + (uint64_t)ms * 1000000ull; }

/* poll() timeout until deadline_ns (0 = none: -1); 0 once it passed. */
static int poll_ms(uint64_t deadline_ns) {
    if (deadline_ns == 0) return -1;
    uint64_t now = now_ns();
    if (now >= deadline_ns) return 0;
    uint64_t ms = (deadline_ns - now + 999999ull) / 1000000ull;
    return ms > 60000 ? 60000 : (int)ms; /* re-checked in a loop: a long wait is slices */
}

/* ---- failure ----------------------------------------------------------------------------- */

/* Best effort, never blocking: tells fd why the group failed. */
static void send_abort(int fd, const char *msg) {
    char buf[sizeof(tcp_frame) + TCP_ABORT_MSG];
    size_t len = strnlen(msg, TCP_ABORT_MSG);
    tcp_frame f = {.op = OP_ABORT, .bytes = len};
    memcpy(buf, &f, sizeof f);
    memcpy(buf + sizeof f, msg, len);
    (void)send(fd, buf, sizeof f + len, MSG_NOSIGNAL | MSG_DONTWAIT);
}

/* Marks the group failed (the first failure wins). Rank 0 tells every other rank why; every
 * rank shuts its connections down, so a peer blocked on them wakes up. */
static pie_code tcp_fail(wrk_coll_tcp *t, pie_code code, pie_status *st, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static pie_code tcp_fail(wrk_coll_tcp *t, pie_code code, pie_status *st, const char *fmt, ...) {
    char msg[PIE_STATUS_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    (void)vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (t->failed == PIE_OK) {
        t->failed = code;
        (void)snprintf(t->failed_msg, sizeof t->failed_msg, "%s", msg);
        for (uint32_t r = 0; r < t->n; r++) {
            if (t->fd[r] < 0) continue;
            if (t->rank == 0) send_abort(t->fd[r], msg);
            (void)shutdown(t->fd[r], SHUT_RDWR);
        }
    }
    return pie_status_set(st, code, "%s", msg);
}

pie_code wrk_coll_tcp_check(wrk_coll_tcp *t, const char *op, pie_status *st) {
    if (t->failed == PIE_OK) return PIE_OK;
    return pie_status_set(st, t->failed, "wrk_coll %s: the group failed earlier: %s", op,
                          t->failed_msg);
}

void wrk_coll_tcp_abort(wrk_coll_tcp *t) {
    if (t) (void)tcp_fail(t, PIE_UNAVAILABLE, NULL, "the group was aborted by rank %u", t->rank);
}

/* ---- sockets ----------------------------------------------------------------------------- */

static int set_socket_opts(int fd) {
    int one = 1, fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) != 0) return -1;
    return setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/* "host:port" (host may be "[v6]") → addrinfo list; NULL with st set when it does not resolve. */
static struct addrinfo *resolve(const char *hostport, bool passive, pie_status *st) {
    char host[TCP_HOSTPORT_MAX];
    const char *colon = hostport ? strrchr(hostport, ':') : NULL;
    size_t hl = colon ? (size_t)(colon - hostport) : 0;
    if (!colon || hl == 0 || hl >= sizeof host || colon[1] == '\0') {
        pie_status_set(st, PIE_INVALID_ARGUMENT, "wrk_coll: tcp leader '%.200s' must be host:port",
                       hostport ? hostport : "");
        return NULL;
    }
    memcpy(host, hostport, hl);
    host[hl] = '\0';
    const char *h = host;
    if (host[0] == '[' && hl >= 2 && host[hl - 1] == ']') {
        host[hl - 1] = '\0';
        h = host + 1;
    }
    struct addrinfo hints = {
        .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = passive ? AI_PASSIVE : 0};
    struct addrinfo *ai = NULL;
    int rc = getaddrinfo(h, colon + 1, &hints, &ai);
    if (rc != 0) {
        pie_status_set(st, PIE_UNAVAILABLE, "wrk_coll: tcp leader '%.200s' does not resolve: %s",
                       hostport, gai_strerror(rc));
        return NULL;
    }
    return ai;
}

pie_code wrk_coll_tcp_listen(const char *hostport, int *fd_out, uint16_t *port_out,
                             pie_status *st) {
    struct addrinfo *ai = resolve(hostport, true, st);
    if (!ai) return st ? st->code : PIE_INVALID_ARGUMENT;
    int fd = -1, err = 0;
    for (struct addrinfo *a = ai; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) {
            err = errno;
            continue;
        }
        int one = 1;
        if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
            bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, WRK_COLL_MAX_RANKS) != 0) {
            err = errno;
            (void)close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(ai);
    if (fd < 0)
        return pie_status_set(st, PIE_UNAVAILABLE, "wrk_coll: cannot listen on %.200s: %s",
                              hostport, strerror(err));
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (getsockname(fd, (struct sockaddr *)&ss, &sl) != 0) {
        err = errno;
        (void)close(fd);
        return pie_status_set(st, PIE_INTERNAL, "wrk_coll: getsockname: %s", strerror(err));
    }
    uint16_t port = ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                             : ((struct sockaddr_in *)&ss)->sin_port;
    *fd_out = fd;
    if (port_out) *port_out = ntohs(port);
    return PIE_OK;
}

/* Moves len bytes to (write) or from fd, whose peer is rank peer, by deadline_ns (0 = none).
 * A closed connection or a timeout fails the group. */
static pie_code tcp_io(wrk_coll_tcp *t, uint32_t peer, void *buf, size_t len, bool write,
                       uint64_t deadline_ns, const char *op, pie_status *st) {
    int fd = t->rank == 0 ? t->fd[peer] : t->fd[0];
    char *p = buf;
    while (len > 0) {
        ssize_t k = write ? send(fd, p, len, MSG_NOSIGNAL) : recv(fd, p, len, 0);
        if (k > 0) {
            p += k;
            len -= (size_t)k;
            continue;
        }
        if (k == 0 && !write)
            return tcp_fail(t, PIE_UNAVAILABLE, st,
                            "wrk_coll %s: rank %u of %u is gone (its connection closed)", op, peer,
                            t->n);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
            return tcp_fail(t, PIE_UNAVAILABLE, st, "wrk_coll %s: rank %u of %u is gone (%s)", op,
                            peer, t->n, strerror(errno));
        struct pollfd pf = {.fd = fd, .events = write ? POLLOUT : POLLIN};
        int to = poll_ms(deadline_ns);
        if (to == 0)
            return tcp_fail(t, PIE_DEADLINE_EXCEEDED, st,
                            "wrk_coll %s: rank %u of %u did not arrive within %u ms", op, peer,
                            t->n, t->timeout_ms);
        if (poll(&pf, 1, to) < 0 && errno != EINTR)
            return tcp_fail(t, PIE_INTERNAL, st, "wrk_coll %s: poll: %s", op, strerror(errno));
    }
    return PIE_OK;
}

/* Reads exactly len bytes from fd (outside the group's failure handling) by deadline_ns; 0 on
 * success. */
static int read_by(int fd, void *buf, size_t len, uint64_t deadline_ns) {
    char *p = buf;
    while (len > 0) {
        ssize_t k = recv(fd, p, len, 0);
        if (k > 0) {
            p += k;
            len -= (size_t)k;
            continue;
        }
        if (k == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return -1;
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        int to = poll_ms(deadline_ns);
        if (to == 0 || (poll(&pf, 1, to) < 0 && errno != EINTR)) return -1;
    }
    return 0;
}

static pie_code send_frame(wrk_coll_tcp *t, uint32_t peer, uint32_t op, uint32_t root,
                           const void *payload, uint64_t bytes, uint64_t deadline_ns,
                           pie_status *st) {
    tcp_frame f = {.op = op, .root = root, .bytes = bytes};
    pie_code rc = tcp_io(t, peer, &f, sizeof f, true, deadline_ns, op_name(op), st);
    if (rc == PIE_OK && bytes)
        rc = tcp_io(t, peer, (void *)payload, bytes, true, deadline_ns, op_name(op), st);
    return rc;
}

/* Reads a frame header from peer and checks it is (op, root, bytes); an ABORT frame fails the
 * group with the reason it carries. */
static pie_code recv_header(wrk_coll_tcp *t, uint32_t peer, uint32_t op, uint32_t root,
                            uint64_t bytes, uint64_t deadline_ns, pie_status *st) {
    tcp_frame f;
    pie_code rc = tcp_io(t, peer, &f, sizeof f, false, deadline_ns, op_name(op), st);
    if (rc != PIE_OK) return rc;
    if (f.op == OP_ABORT) { /* rank 0 says why the group failed: read it raw, then fail */
        char why[TCP_ABORT_MSG + 1] = "";
        size_t len = f.bytes < TCP_ABORT_MSG ? (size_t)f.bytes : TCP_ABORT_MSG;
        if (read_by(t->fd[0], why, len, deadline_in(1000)) == 0) why[len] = '\0';
        return tcp_fail(t, PIE_UNAVAILABLE, st, "wrk_coll %s: the group failed: %s", op_name(op),
                        why[0] ? why : "rank 0 aborted it");
    }
    if (f.op != op || f.root != root || f.bytes != bytes)
        return tcp_fail(t, PIE_INTERNAL, st,
                        "wrk_coll %s: rank %u called %s (root %u, %llu bytes) where this rank "
                        "called %s (root %u, %llu bytes): the ranks' operations differ",
                        op_name(op), peer, op_name(f.op), f.root, (unsigned long long)f.bytes,
                        op_name(op), root, (unsigned long long)bytes);
    return PIE_OK;
}

static pie_code recv_frame(wrk_coll_tcp *t, uint32_t peer, uint32_t op, uint32_t root,
                           void *payload, uint64_t bytes, uint64_t deadline_ns, pie_status *st) {
    pie_code rc = recv_header(t, peer, op, root, bytes, deadline_ns, st);
    if (rc == PIE_OK && bytes)
        rc = tcp_io(t, peer, payload, bytes, false, deadline_ns, op_name(op), st);
    return rc;
}

/* ---- joining ----------------------------------------------------------------------------- */

static pie_code reply(int fd, pie_code code, const char *msg) {
    size_t len = strnlen(msg, TCP_ABORT_MSG);
    char buf[sizeof(tcp_reply) + TCP_ABORT_MSG];
    tcp_reply r = {.magic = TCP_MAGIC, .code = (uint32_t)code, .len = (uint32_t)len};
    memcpy(buf, &r, sizeof r);
    memcpy(buf + sizeof r, msg, len);
    return send(fd, buf, sizeof r + len, MSG_NOSIGNAL | MSG_DONTWAIT) == (ssize_t)(sizeof r + len)
               ? PIE_OK
               : PIE_UNAVAILABLE;
}

/* Rank 0: why hello h cannot join (code, msg), or PIE_OK. */
static pie_code check_hello(const wrk_coll_tcp *t, const tcp_hello *h, uint64_t epoch, char *msg,
                            size_t cap) {
    if (h->version != TCP_VERSION || h->n_ranks != t->n) {
        snprintf(msg, cap,
                 "rank %u joined a group of %u ranks (protocol %u), but this group has %u "
                 "(protocol %u)",
                 h->rank, h->n_ranks, h->version, t->n, TCP_VERSION);
        return PIE_FAILED_PRECONDITION;
    }
    if (h->epoch != epoch) {
        snprintf(msg, cap,
                 "rank %u joined with epoch %016llx, but this group's is %016llx (a rank of "
                 "another formation)",
                 h->rank, (unsigned long long)h->epoch, (unsigned long long)epoch);
        return PIE_FAILED_PRECONDITION;
    }
    if (h->rank == 0 || h->rank >= t->n) {
        snprintf(msg, cap, "rank %u is out of range [1, %u)", h->rank, t->n);
        return PIE_INVALID_ARGUMENT;
    }
    if (t->fd[h->rank] >= 0) {
        snprintf(msg, cap, "rank %u already joined this epoch", h->rank);
        return PIE_ALREADY_EXISTS;
    }
    return PIE_OK;
}

/* Rank 0: accepts connections on lfd until ranks 1..n-1 have joined (refusing the others),
 * then welcomes them all. */
static pie_code accept_ranks(wrk_coll_tcp *t, int lfd, uint64_t epoch, uint64_t deadline_ns,
                             pie_status *st) {
    uint32_t joined = 1;
    while (joined < t->n) {
        struct pollfd pf = {.fd = lfd, .events = POLLIN};
        int to = poll_ms(deadline_ns);
        if (to == 0)
            return pie_status_set(st, PIE_DEADLINE_EXCEEDED,
                                  "wrk_coll_open: %u of %u ranks joined within %u ms", joined, t->n,
                                  t->timeout_ms);
        if (poll(&pf, 1, to) <= 0) continue;
        int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) continue;
        tcp_hello h;
        char msg[TCP_ABORT_MSG];
        if (set_socket_opts(fd) != 0 || read_by(fd, &h, sizeof h, deadline_in(t->timeout_ms)) ||
            h.magic != TCP_MAGIC) {
            (void)close(fd); /* not a rank of ours: ignored */
            continue;
        }
        pie_code why = check_hello(t, &h, epoch, msg, sizeof msg);
        if (why != PIE_OK) {
            (void)reply(fd, why, msg);
            (void)close(fd);
            continue;
        }
        t->fd[h.rank] = fd;
        joined++;
    }
    for (uint32_t r = 1; r < t->n; r++)
        if (reply(t->fd[r], PIE_OK, "") != PIE_OK)
            return pie_status_set(st, PIE_UNAVAILABLE,
                                  "wrk_coll_open: rank %u left while the group formed", r);
    return PIE_OK;
}

/* Ranks 1..n-1: connects to rank 0 (retrying while it is not listening yet) by deadline_ns. */
static pie_code connect_leader(wrk_coll_tcp *t, const char *leader, uint64_t deadline_ns,
                               pie_status *st) {
    int err = 0;
    for (;;) {
        struct addrinfo *ai = resolve(leader, false, st);
        if (!ai && st && st->code == PIE_INVALID_ARGUMENT) return PIE_INVALID_ARGUMENT;
        for (struct addrinfo *a = ai; a; a = a->ai_next) {
            int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
            if (fd < 0) continue;
            if (set_socket_opts(fd) == 0 &&
                (connect(fd, a->ai_addr, a->ai_addrlen) == 0 || errno == EINPROGRESS)) {
                struct pollfd pf = {.fd = fd, .events = POLLOUT};
                socklen_t el = sizeof err;
                int to = poll_ms(deadline_ns);
                if (poll(&pf, 1, to < 0 || to > 1000 ? 1000 : to) == 1 &&
                    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) == 0 && err == 0) {
                    t->fd[0] = fd;
                    freeaddrinfo(ai);
                    return PIE_OK;
                }
            } else {
                err = errno;
            }
            (void)close(fd);
        }
        if (ai) freeaddrinfo(ai);
        if (now_ns() + TCP_RETRY_NS >= deadline_ns)
            return pie_status_set(st, PIE_DEADLINE_EXCEEDED,
                                  "wrk_coll_open: rank %u could not reach rank 0 at %.200s within "
                                  "%u ms (%s)",
                                  t->rank, leader, t->timeout_ms,
                                  err ? strerror(err) : "no answer");
        struct timespec ts = {0, (long)TCP_RETRY_NS};
        nanosleep(&ts, NULL);
    }
}

/* Ranks 1..n-1: says who it is and waits for rank 0's welcome or refusal. */
static pie_code join_leader(wrk_coll_tcp *t, uint64_t epoch, uint64_t deadline_ns, pie_status *st) {
    tcp_hello h = {.magic = TCP_MAGIC,
                   .rank = t->rank,
                   .n_ranks = t->n,
                   .version = TCP_VERSION,
                   .epoch = epoch};
    tcp_reply r;
    if (tcp_io(t, 0, &h, sizeof h, true, deadline_ns, "join", st) != PIE_OK ||
        tcp_io(t, 0, &r, sizeof r, false, deadline_ns, "join", st) != PIE_OK)
        return st ? st->code : PIE_UNAVAILABLE;
    if (r.magic != TCP_MAGIC)
        return pie_status_set(st, PIE_FAILED_PRECONDITION,
                              "wrk_coll_open: the leader's listener is not a pie collective");
    char msg[TCP_ABORT_MSG + 1] = "";
    size_t len = r.len < TCP_ABORT_MSG ? r.len : TCP_ABORT_MSG;
    if (len && tcp_io(t, 0, msg, len, false, deadline_ns, "join", NULL) == PIE_OK) msg[len] = '\0';
    if (r.code != PIE_OK)
        return pie_status_set(st, (pie_code)r.code, "wrk_coll_open: rank 0 refused: %s", msg);
    return PIE_OK;
}

pie_code wrk_coll_tcp_open(const wrk_coll_opts *o, size_t chunk_bytes, uint32_t timeout_ms,
                           wrk_coll_tcp **out, pie_status *st) {
    *out = NULL;
    wrk_coll_tcp *t = calloc(1, sizeof *t);
    if (!t) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "wrk_coll_open: out of memory");
    t->rank = o->rank;
    t->n = o->n_ranks;
    t->timeout_ms = o->join_timeout_ms ? o->join_timeout_ms : timeout_ms; /* joining */
    t->chunk = chunk_bytes;
    t->fd = malloc(t->n * sizeof *t->fd);
    pie_code rc = PIE_OK;
    int lfd = o->rank == 0 && o->tcp_listen_fd > 0 ? o->tcp_listen_fd : -1;
    if (!t->fd || (t->rank == 0 && !(t->scratch = malloc(t->chunk)))) {
        rc = pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "wrk_coll_open: out of memory");
        goto fail;
    }
    for (uint32_t r = 0; r < t->n; r++) t->fd[r] = -1;
    uint64_t deadline = deadline_in(t->timeout_ms);
    if (t->rank == 0) {
        if (lfd < 0 && (rc = wrk_coll_tcp_listen(o->tcp_leader, &lfd, NULL, st)) != PIE_OK)
            goto fail;
        rc = accept_ranks(t, lfd, o->epoch, deadline, st);
    } else {
        rc = connect_leader(t, o->tcp_leader, deadline, st);
        if (rc == PIE_OK) rc = join_leader(t, o->epoch, deadline, st);
    }
    if (rc != PIE_OK) goto fail;
    if (lfd >= 0) (void)close(lfd); /* a group does not re-form on its listener */
    t->timeout_ms = timeout_ms;     /* each operation's */
    *out = t;
    return PIE_OK;
fail:
    if (lfd >= 0) (void)close(lfd);
    wrk_coll_tcp_close(t);
    return rc;
}

void wrk_coll_tcp_close(wrk_coll_tcp *t) {
    if (!t) return;
    for (uint32_t r = 0; t->fd && r < t->n; r++)
        if (t->fd[r] >= 0) (void)close(t->fd[r]);
    free(t->fd);
    free(t->scratch);
    free(t);
}

/* ---- operations -------------------------------------------------------------------------- */

/* Rank 0: buf[n] += rank r's n floats, element by element, read a scratch chunk at a time. */
static pie_code add_from(wrk_coll_tcp *t, uint32_t r, float *buf, size_t n, uint64_t deadline_ns,
                         pie_status *st) {
    size_t per = t->chunk / sizeof(float);
    for (size_t off = 0; off < n;) {
        size_t m = n - off < per ? n - off : per;
        pie_code rc =
            tcp_io(t, r, t->scratch, m * sizeof(float), false, deadline_ns, "all-reduce", st);
        if (rc != PIE_OK) return rc;
        for (size_t j = 0; j < m; j++) buf[off + j] += t->scratch[j];
        off += m;
    }
    return PIE_OK;
}

pie_code wrk_coll_tcp_allreduce_sum_f32(wrk_coll_tcp *t, float *buf, size_t n, pie_status *st) {
    pie_code rc = wrk_coll_tcp_check(t, "all-reduce", st);
    if (rc != PIE_OK) return rc;
    uint64_t dl = deadline_in(t->timeout_ms), bytes = n * sizeof(float);
    if (t->rank != 0) {
        rc = send_frame(t, 0, OP_ALLREDUCE, 0, buf, bytes, dl, st);
        return rc == PIE_OK ? recv_frame(t, 0, OP_ALLREDUCE, 0, buf, bytes, dl, st) : rc;
    }
    for (uint32_t r = 1; r < t->n && rc == PIE_OK; r++) { /* rank order: ((v0 + v1) + v2) ... */
        rc = recv_header(t, r, OP_ALLREDUCE, 0, bytes, dl, st);
        if (rc == PIE_OK) rc = add_from(t, r, buf, n, dl, st);
    }
    for (uint32_t r = 1; r < t->n && rc == PIE_OK; r++)
        rc = send_frame(t, r, OP_ALLREDUCE, 0, buf, bytes, dl, st);
    return rc;
}

pie_code wrk_coll_tcp_allgather(wrk_coll_tcp *t, const void *in, size_t bytes, void *out,
                                pie_status *st) {
    pie_code rc = wrk_coll_tcp_check(t, "all-gather", st);
    if (rc != PIE_OK) return rc;
    uint64_t dl = deadline_in(t->timeout_ms), all = (uint64_t)bytes * t->n;
    if (t->rank != 0) {
        rc = send_frame(t, 0, OP_ALLGATHER, 0, in, bytes, dl, st);
        return rc == PIE_OK ? recv_frame(t, 0, OP_ALLGATHER, 0, out, all, dl, st) : rc;
    }
    memcpy(out, in, bytes);
    for (uint32_t r = 1; r < t->n && rc == PIE_OK; r++)
        rc = recv_frame(t, r, OP_ALLGATHER, 0, (char *)out + (size_t)r * bytes, bytes, dl, st);
    for (uint32_t r = 1; r < t->n && rc == PIE_OK; r++)
        rc = send_frame(t, r, OP_ALLGATHER, 0, out, all, dl, st);
    return rc;
}

pie_code wrk_coll_tcp_bcast(wrk_coll_tcp *t, uint32_t root, void *buf, size_t bytes,
                            bool no_deadline, pie_status *st) {
    pie_code rc = wrk_coll_tcp_check(t, "broadcast", st);
    if (rc != PIE_OK) return rc;
    uint64_t dl = deadline_in(t->timeout_ms), wait_dl = no_deadline ? 0 : dl;
    if (t->rank != 0) {
        if (t->rank == root) return send_frame(t, 0, OP_BCAST, root, buf, bytes, dl, st);
        return recv_frame(t, 0, OP_BCAST, root, buf, bytes, wait_dl, st);
    }
    if (root != 0) {
        rc = recv_frame(t, root, OP_BCAST, root, buf, bytes, wait_dl, st);
        dl = deadline_in(t->timeout_ms); /* the forwarding has its own deadline */
    }
    for (uint32_t r = 1; r < t->n && rc == PIE_OK; r++)
        if (r != root) rc = send_frame(t, r, OP_BCAST, root, buf, bytes, dl, st);
    return rc;
}

pie_code wrk_coll_tcp_barrier(wrk_coll_tcp *t, pie_status *st) {
    pie_code rc = wrk_coll_tcp_check(t, "barrier", st);
    if (rc != PIE_OK) return rc;
    uint64_t dl = deadline_in(t->timeout_ms);
    if (t->rank != 0) {
        rc = send_frame(t, 0, OP_BARRIER, 0, NULL, 0, dl, st);
        return rc == PIE_OK ? recv_frame(t, 0, OP_BARRIER, 0, NULL, 0, dl, st) : rc;
    }
    for (uint32_t r = 1; r < t->n && rc == PIE_OK; r++)
        rc = recv_frame(t, r, OP_BARRIER, 0, NULL, 0, dl, st);
    for (uint32_t r = 1; r < t->n && rc == PIE_OK; r++)
        rc = send_frame(t, r, OP_BARRIER, 0, NULL, 0, dl, st);
    return rc;
}
