/* wrk_coll.c — the host collective of a tensor-parallel group (see wrk_coll.h).
 *
 * Owns: the segment's layout, joining, the barrier (per-rank sequence counters, spin then
 * FUTEX_WAIT, liveness checks and deadlines while sleeping), the group's failure state and
 * the three operations over double-buffered steps.
 *
 * Segment (one shm object, MAP_SHARED):
 *   coll_hdr                       64 bytes: magic (published last), epoch, shape, aborted
 *   coll_ctl[n_ranks]              one cache line per rank: its step counter, its sleepers
 *   data[2][n_ranks + 1][chunk]    per buffer set: one slot per rank, then the reduced result
 * A rank holds an OFD write lock on byte `rank` of the object for as long as it has the
 * handle; another rank that finds no lock there while waiting for it knows it died (the kernel
 * releases OFD locks when the last descriptor closes, which a crash does). */
#include "wrk_coll.h"
#include "wrk_coll_tcp.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define COLL_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define COLL_PAUSE() __asm__ volatile("yield")
#else
#define COLL_PAUSE() ((void)0)
#endif

#define COLL_MAGIC         0x50544331u /* "PTC1" */
#define COLL_VERSION       1u
#define COLL_LINE          64u
#define COLL_SPIN          256         /* polls before sleeping */
#define COLL_SLICE_NS      50000000ull /* longest sleep between liveness checks: 50 ms */
#define COLL_JOIN_POLL_NS  2000000ull  /* joining: the segment is looked for every 2 ms */
#define COLL_NAME_MAX      201
#define COLL_DEFAULT_CHUNK ((size_t)1 << 20)
#define COLL_DEFAULT_TMO   30000u

typedef struct coll_hdr {
    _Atomic uint32_t magic;   /* COLL_MAGIC once rank 0 has written the rest */
    _Atomic uint32_t aborted; /* 1: the group failed; every wait returns */
    uint32_t version, n_ranks;
    uint64_t epoch, chunk_bytes;
    char pad[COLL_LINE - 32];
} coll_hdr;

typedef struct coll_ctl {
    _Atomic uint32_t seq;     /* barriers this rank has reached (the futex word) */
    _Atomic uint32_t waiters; /* ranks sleeping on seq */
    char pad[COLL_LINE - 8];
} coll_ctl;

_Static_assert(sizeof(coll_hdr) == COLL_LINE, "coll_hdr is one cache line");
_Static_assert(sizeof(coll_ctl) == COLL_LINE, "coll_ctl is one cache line");

struct wrk_coll {
    uint32_t rank, n;
    size_t chunk; /* bytes per rank per step */
    uint32_t timeout_ms;
    char name[COLL_NAME_MAX + 1];
    int fd; /* -1 when n == 1 */
    void *map;
    size_t map_bytes;
    coll_hdr *hdr;
    coll_ctl *ctl;   /* [n] */
    char *data;      /* [2][n + 1][chunk] */
    uint32_t seq;    /* barriers this rank has passed */
    uint32_t step;   /* steps taken: the buffer set is step & 1 */
    bool stepwise;   /* opts.allreduce_stepwise */
    pie_code failed; /* PIE_OK until the group fails */
    char failed_msg[PIE_STATUS_MSG_MAX];
    wrk_coll_tcp *tcp; /* the TCP transport (opts.tcp_leader): every operation goes there */
};

/* ---- small pieces ------------------------------------------------------------------------ */

static uint64_t coll_now_ns(void) {
    struct timespec ts;
    (void)clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void coll_sleep_ns(uint64_t ns) {
    struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000ull),
                          .tv_nsec = (long)(ns % 1000000000ull)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
}

static long coll_futex(_Atomic uint32_t *word, int op, uint32_t val, const struct timespec *ts) {
    /* not FUTEX_PRIVATE_FLAG: the word is shared between processes */
    return syscall(SYS_futex, (uint32_t *)word, op, val, ts, NULL, 0);
}

static void coll_wake(_Atomic uint32_t *word) { (void)coll_futex(word, FUTEX_WAKE, INT_MAX, NULL); }

/* Whether counter value v has reached target (wrap-safe: ranks are never 2^31 steps apart). */
static int coll_reached(uint32_t v, uint32_t target) { return (int32_t)(v - target) >= 0; }

static size_t coll_data_offset(uint32_t n) {
    return sizeof(coll_hdr) + (size_t)n * sizeof(coll_ctl);
}

/* The segment's size, or 0 when it would overflow. */
static size_t coll_segment_bytes(uint32_t n, size_t chunk) {
    size_t slots = 2 * ((size_t)n + 1);
    if (chunk > (SIZE_MAX - coll_data_offset(n)) / slots) return 0;
    return coll_data_offset(n) + slots * chunk;
}

/* Slot `r` of buffer set `set` (r == n: the reduced result). */
static char *coll_slot(const wrk_coll *c, uint32_t set, uint32_t r) {
    return c->data + ((size_t)set * (c->n + 1) + r) * c->chunk;
}

/* ---- failure ----------------------------------------------------------------------------- */

/* Marks the group failed with this message (the first failure wins), wakes every sleeper. */
static pie_code coll_fail(wrk_coll *c, pie_code code, pie_status *st, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static pie_code coll_fail(wrk_coll *c, pie_code code, pie_status *st, const char *fmt, ...) {
    char msg[PIE_STATUS_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    (void)vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (c->failed == PIE_OK) {
        c->failed = code;
        (void)snprintf(c->failed_msg, sizeof c->failed_msg, "%s", msg);
    }
    if (c->tcp) wrk_coll_tcp_abort(c->tcp); /* the other ranks learn it from rank 0 */
    if (c->hdr) {
        atomic_store(&c->hdr->aborted, 1u);
        for (uint32_t i = 0; i < c->n; i++) coll_wake(&c->ctl[i].seq);
    }
    return pie_status_set(st, code, "%s", msg);
}

/* The sticky error of a failed handle, or of a group another rank marked failed, for
 * operation `op`. */
static pie_code coll_check(wrk_coll *c, const char *op, pie_status *st) {
    if (c->tcp) return wrk_coll_tcp_check(c->tcp, op, st);
    if (c->failed != PIE_OK)
        return pie_status_set(st, c->failed, "wrk_coll %s: the group failed earlier: %s", op,
                              c->failed_msg);
    if (c->hdr && atomic_load(&c->hdr->aborted))
        return coll_fail(c, PIE_UNAVAILABLE, st,
                         "wrk_coll %s: another rank of the group failed or aborted it", op);
    return PIE_OK;
}

void wrk_coll_abort(wrk_coll *c) {
    if (!c) return;
    if (c->tcp) {
        wrk_coll_tcp_abort(c->tcp);
        return;
    }
    (void)coll_fail(c, PIE_UNAVAILABLE, NULL, "the group was aborted by rank %u", c->rank);
}

/* ---- liveness and the barrier ------------------------------------------------------------ */

static int coll_lock_rank(int fd, uint32_t r) {
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = (off_t)r, .l_len = 1};
    return fcntl(fd, F_OFD_SETLK, &fl);
}

/* 0 when rank r holds no lock on its byte (its process is gone); 1 otherwise, also when the
 * kernel cannot tell (then the deadline decides). */
static int coll_alive(const wrk_coll *c, uint32_t r) {
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = (off_t)r, .l_len = 1};
    if (fcntl(c->fd, F_OFD_GETLK, &fl) != 0) return 1;
    return fl.l_type != F_UNLCK;
}

/* Waits until rank r's counter reaches target: polls, then sleeps on the counter in slices,
 * checking between slices that the group has not failed, that r is alive (once it has
 * joined: counter > 0) and that the deadline has not passed. */
static pie_code coll_wait_rank(wrk_coll *c, uint32_t r, uint32_t target, uint64_t deadline_ns,
                               const char *op, pie_status *st) {
    _Atomic uint32_t *word = &c->ctl[r].seq;
    for (int i = 0; i < COLL_SPIN; i++) {
        if (coll_reached(atomic_load(word), target)) return PIE_OK;
        COLL_PAUSE();
    }
    for (;;) {
        uint32_t v = atomic_load(word);
        if (coll_reached(v, target)) return PIE_OK;
        if (atomic_load(&c->hdr->aborted))
            return coll_fail(c, PIE_UNAVAILABLE, st,
                             "wrk_coll %s: another rank of the group failed or aborted it", op);
        if (v != 0 && !coll_alive(c, r))
            return coll_fail(c, PIE_UNAVAILABLE, st,
                             "wrk_coll %s: rank %u of %u is gone (its process exited)", op, r,
                             c->n);
        uint64_t now = coll_now_ns();
        if (now >= deadline_ns)
            return coll_fail(c, PIE_DEADLINE_EXCEEDED, st,
                             "wrk_coll %s: rank %u of %u did not arrive within %u ms", op, r, c->n,
                             c->timeout_ms);
        uint64_t slice = deadline_ns - now < COLL_SLICE_NS ? deadline_ns - now : COLL_SLICE_NS;
        struct timespec ts = {.tv_sec = (time_t)(slice / 1000000000ull),
                              .tv_nsec = (long)(slice % 1000000000ull)};
        (void)atomic_fetch_add(&c->ctl[r].waiters, 1u);
        /* returns at once when the counter is no longer v (EAGAIN); EINTR and ETIMEDOUT loop */
        (void)coll_futex(word, FUTEX_WAIT, v, &ts);
        (void)atomic_fetch_sub(&c->ctl[r].waiters, 1u);
    }
}

/* Publishes this rank's next barrier and waits for every other rank to reach it. The store
 * and the waiters load are sequentially consistent, as are the sleeper's increment and the
 * kernel's re-read of the word: either the writer sees the sleeper and wakes it, or the
 * sleeper's FUTEX_WAIT sees the new value. */
static pie_code coll_barrier_until(wrk_coll *c, const char *op, bool no_deadline, pie_status *st) {
    coll_ctl *me = &c->ctl[c->rank];
    c->seq++;
    atomic_store(&me->seq, c->seq);
    if (atomic_load(&me->waiters) != 0) coll_wake(&me->seq);
    /* UINT64_MAX: never reached, and every sleep is a whole slice (coll_wait_rank) */
    uint64_t deadline =
        no_deadline ? UINT64_MAX : coll_now_ns() + (uint64_t)c->timeout_ms * 1000000ull;
    for (uint32_t r = 0; r < c->n; r++) {
        if (r == c->rank) continue;
        pie_code rc = coll_wait_rank(c, r, c->seq, deadline, op, st);
        if (rc != PIE_OK) return rc;
    }
    return PIE_OK;
}

static pie_code coll_barrier(wrk_coll *c, const char *op, pie_status *st) {
    return coll_barrier_until(c, op, false, st);
}

/* ---- open / close ------------------------------------------------------------------------ */

static pie_code coll_check_opts(const wrk_coll_opts *o, pie_status *st) {
    if (o->n_ranks < 1 || o->n_ranks > WRK_COLL_MAX_RANKS)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "wrk_coll_open: n_ranks %u is out of range [1, %u]", o->n_ranks,
                              WRK_COLL_MAX_RANKS);
    if (o->rank >= o->n_ranks)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "wrk_coll_open: rank %u is out of range [0, %u)", o->rank,
                              o->n_ranks);
    if (o->n_ranks == 1 || (o->tcp_leader && o->tcp_leader[0])) return PIE_OK;
    const char *nm = o->name;
    size_t len = nm ? strlen(nm) : 0;
    int ok = nm && nm[0] == '/' && len >= 2 && len <= COLL_NAME_MAX;
    for (size_t i = 1; ok && i < len; i++) {
        char ch = nm[i];
        ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
             ch == '.' || ch == '_' || ch == '-';
    }
    if (!ok)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "wrk_coll_open: name '%.64s' must be '/' followed by 1 to %d "
                              "characters of [A-Za-z0-9._-]",
                              nm ? nm : "(null)", COLL_NAME_MAX - 1);
    return PIE_OK;
}

/* Maps fd's first `bytes` and points the handle into it. */
static pie_code coll_map(wrk_coll *c, size_t bytes, pie_status *st) {
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, c->fd, 0);
    if (p == MAP_FAILED)
        return pie_status_set(st, PIE_INTERNAL, "wrk_coll_open: mmap of %s (%zu bytes): %s",
                              c->name, bytes, strerror(errno));
    c->map = p;
    c->map_bytes = bytes;
    c->hdr = p;
    c->ctl = (coll_ctl *)((char *)p + sizeof(coll_hdr));
    c->data = (char *)p + coll_data_offset(c->n);
    return PIE_OK;
}

/* Rank 0: a fresh segment of this epoch under the name (a stale one is unlinked first). */
static pie_code coll_create(wrk_coll *c, uint64_t epoch, pie_status *st) {
    size_t bytes = coll_segment_bytes(c->n, c->chunk);
    if (shm_unlink(c->name) != 0 && errno != ENOENT)
        return pie_status_set(st, PIE_INTERNAL, "wrk_coll_open: cannot remove stale %s: %s",
                              c->name, strerror(errno));
    c->fd = shm_open(c->name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (c->fd < 0)
        return pie_status_set(st, PIE_INTERNAL, "wrk_coll_open: cannot create %s: %s", c->name,
                              strerror(errno));
    if (ftruncate(c->fd, (off_t)bytes) != 0)
        return pie_status_set(st, PIE_INTERNAL, "wrk_coll_open: cannot size %s to %zu bytes: %s",
                              c->name, bytes, strerror(errno));
    pie_code rc = coll_map(c, bytes, st);
    if (rc != PIE_OK) return rc;
    c->hdr->version = COLL_VERSION;
    c->hdr->n_ranks = c->n;
    c->hdr->epoch = epoch;
    c->hdr->chunk_bytes = c->chunk;
    atomic_store(&c->hdr->magic, COLL_MAGIC); /* publishes the fields above */
    return PIE_OK;
}

/* Ranks 1..n-1: waits for rank 0's segment of this epoch. */
static pie_code coll_attach(wrk_coll *c, uint64_t epoch, uint64_t deadline_ns, pie_status *st) {
    size_t bytes = coll_segment_bytes(c->n, c->chunk);
    for (;; coll_sleep_ns(COLL_JOIN_POLL_NS)) {
        if (coll_now_ns() >= deadline_ns)
            return pie_status_set(st, PIE_DEADLINE_EXCEEDED,
                                  "wrk_coll_open: rank %u: no segment %s of epoch %llu appeared "
                                  "within %u ms (is rank 0 running?)",
                                  c->rank, c->name, (unsigned long long)epoch, c->timeout_ms);
        c->fd = shm_open(c->name, O_RDWR | O_CLOEXEC, 0600);
        if (c->fd < 0) {
            if (errno == ENOENT) continue;
            return pie_status_set(st, PIE_INTERNAL, "wrk_coll_open: cannot open %s: %s", c->name,
                                  strerror(errno));
        }
        struct stat sb;
        pie_code rc = PIE_OK;
        if (fstat(c->fd, &sb) != 0 || (size_t)sb.st_size < sizeof(coll_hdr)) goto retry;
        rc = coll_map(c, (size_t)sb.st_size, st);
        if (rc != PIE_OK) return rc;
        if (atomic_load(&c->hdr->magic) != COLL_MAGIC || c->hdr->epoch != epoch) goto retry;
        if (c->hdr->version != COLL_VERSION || c->hdr->n_ranks != c->n ||
            c->hdr->chunk_bytes != c->chunk || (size_t)sb.st_size != bytes)
            return pie_status_set(st, PIE_FAILED_PRECONDITION,
                                  "wrk_coll_open: rank %u: segment %s of epoch %llu has %u ranks "
                                  "and chunk_bytes %llu, this rank expects %u and %zu",
                                  c->rank, c->name, (unsigned long long)epoch, c->hdr->n_ranks,
                                  (unsigned long long)c->hdr->chunk_bytes, c->n, c->chunk);
        return PIE_OK;
    retry: /* not there yet, or a stale segment rank 0 is about to replace */
        if (c->map) (void)munmap(c->map, c->map_bytes);
        c->map = NULL;
        c->hdr = NULL;
        (void)close(c->fd);
        c->fd = -1;
    }
}

pie_code wrk_coll_open(const wrk_coll_opts *o, wrk_coll **out, pie_status *st) {
    if (!o || !out)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "wrk_coll_open: o and out must not be NULL");
    *out = NULL;
    pie_code rc = coll_check_opts(o, st);
    if (rc != PIE_OK) return rc;
    wrk_coll *c = calloc(1, sizeof *c);
    if (!c) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "wrk_coll_open: out of memory");
    c->fd = -1;
    c->rank = o->rank;
    c->n = o->n_ranks;
    c->chunk = o->chunk_bytes ? (o->chunk_bytes + COLL_LINE - 1) / COLL_LINE * COLL_LINE
                              : COLL_DEFAULT_CHUNK;
    if (c->chunk < o->chunk_bytes) c->chunk = SIZE_MAX; /* rounding overflowed: refused below */
    c->timeout_ms = o->timeout_ms ? o->timeout_ms : COLL_DEFAULT_TMO;
    c->stepwise = o->allreduce_stepwise;
    if (c->n == 1) {
        *out = c;
        return PIE_OK;
    }
    if (o->tcp_leader && o->tcp_leader[0]) {
        rc = wrk_coll_tcp_open(o, c->chunk, c->timeout_ms, &c->tcp, st); /* join: its own */
        if (rc != PIE_OK) goto fail;
        *out = c;
        return PIE_OK;
    }
    (void)snprintf(c->name, sizeof c->name, "%s", o->name);
    if (coll_segment_bytes(c->n, c->chunk) == 0) {
        rc = pie_status_set(st, PIE_INVALID_ARGUMENT, "wrk_coll_open: chunk_bytes %zu is too large",
                            o->chunk_bytes);
        goto fail;
    }
    uint32_t step_ms = c->timeout_ms; /* joining waits join_timeout_ms instead */
    if (o->join_timeout_ms) c->timeout_ms = o->join_timeout_ms;
    uint64_t deadline = coll_now_ns() + (uint64_t)c->timeout_ms * 1000000ull;
    rc = c->rank == 0 ? coll_create(c, o->epoch, st) : coll_attach(c, o->epoch, deadline, st);
    if (rc != PIE_OK) goto fail;
    if (coll_lock_rank(c->fd, c->rank) != 0) {
        rc = pie_status_set(st, PIE_FAILED_PRECONDITION,
                            "wrk_coll_open: rank %u of %s is already held by another process (%s)",
                            c->rank, c->name, strerror(errno));
        goto fail;
    }
    rc = coll_barrier(c, "join", st); /* barrier 1: every rank has mapped the segment */
    if (rc != PIE_OK) goto fail;
    c->timeout_ms = step_ms;
    if (c->rank == 0) (void)shm_unlink(c->name); /* nothing stays behind in /dev/shm */
    *out = c;
    return PIE_OK;

fail:
    if (c->rank == 0 && c->fd >= 0) (void)shm_unlink(c->name);
    wrk_coll_close(c);
    return rc;
}

void wrk_coll_close(wrk_coll *c) {
    if (!c) return;
    wrk_coll_tcp_close(c->tcp);
    if (c->map) (void)munmap(c->map, c->map_bytes);
    if (c->fd >= 0) (void)close(c->fd);
    free(c);
}

uint32_t wrk_coll_rank(const wrk_coll *c) { return c->rank; }
uint32_t wrk_coll_size(const wrk_coll *c) { return c->n; }

/* ---- operations -------------------------------------------------------------------------- */

/* out[j] = slot 0[j] + slot 1[j] + ... for j in [lo, hi), in rank order. */
static void coll_sum(const wrk_coll *c, uint32_t set, size_t lo, size_t hi, float *out) {
    const float *s0 = (const float *)coll_slot(c, set, 0);
    memcpy(out + lo, s0 + lo, (hi - lo) * sizeof(float));
    for (uint32_t r = 1; r < c->n; r++) {
        const float *s = (const float *)coll_slot(c, set, r);
        for (size_t j = lo; j < hi; j++) out[j] += s[j];
    }
}

/* An all-reduce of several steps, pipelined: step s copies its input in, passes the step's
 * barrier, copies step s-1's result out (every rank reduced its slice of it before reaching
 * this barrier), then reduces its own slice of step s; one barrier after the last step. One
 * barrier per step instead of two. Buffers: step s writes slot set s&1 and result s&1; their
 * last readers (step s-2's reduction and its copy-out, which a rank does before reaching step
 * s's barrier) are done once this rank passed step s-1's barrier (the slots) or step s's (the
 * result, written only after it). */
static pie_code coll_allreduce_pipelined(wrk_coll *c, float *buf, size_t n, pie_status *st) {
    size_t per = c->chunk / sizeof(float), prev_off = 0, prev_m = 0;
    uint32_t prev_set = 0;
    for (size_t off = 0; off < n;) {
        size_t m = n - off < per ? n - off : per;
        uint32_t set = c->step++ & 1u;
        memcpy(coll_slot(c, set, c->rank), buf + off, m * sizeof(float));
        pie_code rc = coll_barrier(c, "all-reduce", st);
        if (rc != PIE_OK) return rc;
        if (prev_m) memcpy(buf + prev_off, coll_slot(c, prev_set, c->n), prev_m * sizeof(float));
        coll_sum(c, set, m * c->rank / c->n, m * (c->rank + 1) / c->n,
                 (float *)coll_slot(c, set, c->n));
        prev_off = off, prev_m = m, prev_set = set;
        off += m;
    }
    pie_code rc = coll_barrier(c, "all-reduce", st);
    if (rc != PIE_OK) return rc;
    memcpy(buf + prev_off, coll_slot(c, prev_set, c->n), prev_m * sizeof(float));
    return PIE_OK;
}

pie_code wrk_coll_allreduce_sum_f32(wrk_coll *c, float *buf, size_t n, pie_status *st) {
    pie_code rc = coll_check(c, "all-reduce", st);
    if (rc != PIE_OK || c->n == 1 || n == 0) return rc;
    if (!buf) return coll_fail(c, PIE_INVALID_ARGUMENT, st, "wrk_coll all-reduce: buf is NULL");
    if (c->tcp) return wrk_coll_tcp_allreduce_sum_f32(c->tcp, buf, n, st);
    size_t per = c->chunk / sizeof(float);
    if (n > per && !c->stepwise) return coll_allreduce_pipelined(c, buf, n, st);
    for (size_t off = 0; off < n;) {
        size_t m = n - off < per ? n - off : per;
        uint32_t set = c->step++ & 1u;
        memcpy(coll_slot(c, set, c->rank), buf + off, m * sizeof(float));
        rc = coll_barrier(c, "all-reduce", st);
        if (rc != PIE_OK) return rc;
        if (m * sizeof(float) <= WRK_COLL_DIRECT_BYTES) {
            coll_sum(c, set, 0, m, buf + off);
        } else { /* reduce a slice each into the result, then everyone copies it */
            float *res = (float *)coll_slot(c, set, c->n);
            coll_sum(c, set, m * c->rank / c->n, m * (c->rank + 1) / c->n, res);
            rc = coll_barrier(c, "all-reduce", st);
            if (rc != PIE_OK) return rc;
            memcpy(buf + off, res, m * sizeof(float));
        }
        off += m;
    }
    return PIE_OK;
}

pie_code wrk_coll_allgather(wrk_coll *c, const void *in, size_t bytes, void *out, pie_status *st) {
    pie_code rc = coll_check(c, "all-gather", st);
    if (rc != PIE_OK || bytes == 0) return rc;
    if (!in || !out)
        return coll_fail(c, PIE_INVALID_ARGUMENT, st,
                         "wrk_coll all-gather: in and out must not be NULL");
    if (c->n == 1) {
        memcpy(out, in, bytes);
        return PIE_OK;
    }
    if (c->tcp) return wrk_coll_tcp_allgather(c->tcp, in, bytes, out, st);
    for (size_t off = 0; off < bytes;) {
        size_t m = bytes - off < c->chunk ? bytes - off : c->chunk;
        uint32_t set = c->step++ & 1u;
        memcpy(coll_slot(c, set, c->rank), (const char *)in + off, m);
        rc = coll_barrier(c, "all-gather", st);
        if (rc != PIE_OK) return rc;
        for (uint32_t r = 0; r < c->n; r++)
            memcpy((char *)out + (size_t)r * bytes + off, coll_slot(c, set, r), m);
        off += m;
    }
    return PIE_OK;
}

/* wrk_coll_bcast; no_deadline: the barriers wait without a deadline (wrk_coll_bcast_idle). */
static pie_code coll_bcast(wrk_coll *c, uint32_t root, void *buf, size_t bytes, bool no_deadline,
                           pie_status *st) {
    pie_code rc = coll_check(c, "broadcast", st);
    if (rc != PIE_OK) return rc;
    if (root >= c->n)
        return coll_fail(c, PIE_INVALID_ARGUMENT, st,
                         "wrk_coll broadcast: root %u is out of range [0, %u)", root, c->n);
    if (c->n == 1 || bytes == 0) return PIE_OK;
    if (!buf) return coll_fail(c, PIE_INVALID_ARGUMENT, st, "wrk_coll broadcast: buf is NULL");
    if (c->tcp) return wrk_coll_tcp_bcast(c->tcp, root, buf, bytes, no_deadline, st);
    for (size_t off = 0; off < bytes;) {
        size_t m = bytes - off < c->chunk ? bytes - off : c->chunk;
        uint32_t set = c->step++ & 1u;
        if (c->rank == root) memcpy(coll_slot(c, set, root), (const char *)buf + off, m);
        rc = coll_barrier_until(c, "broadcast", no_deadline, st);
        if (rc != PIE_OK) return rc;
        if (c->rank != root) memcpy((char *)buf + off, coll_slot(c, set, root), m);
        off += m;
    }
    return PIE_OK;
}

pie_code wrk_coll_bcast(wrk_coll *c, uint32_t root, void *buf, size_t bytes, pie_status *st) {
    return coll_bcast(c, root, buf, bytes, false, st);
}

pie_code wrk_coll_bcast_idle(wrk_coll *c, uint32_t root, void *buf, size_t bytes, pie_status *st) {
    return coll_bcast(c, root, buf, bytes, true, st);
}

pie_code wrk_coll_check(wrk_coll *c, pie_status *st) { return coll_check(c, "check", st); }

pie_code wrk_coll_barrier(wrk_coll *c, pie_status *st) {
    pie_code rc = coll_check(c, "barrier", st);
    if (rc != PIE_OK || c->n == 1) return rc;
    if (c->tcp) return wrk_coll_tcp_barrier(c->tcp, st);
    return coll_barrier(c, "barrier", st);
}
