/* wrk_tp.c — see wrk_tp.h.
 *
 * The fan-out protocol, over the group's collective (rank 0 is the root of every broadcast):
 *   header  wrk_tp_msg {kind, bytes}: followers wait for it without a deadline (an idle group
 *           must not time out; a dead rank 0 or a failed group still ends the wait)
 *   STEP    then `bytes` of a packed pie.v1.WorkerDown (the step as rank 0's executor runs it)
 *   RESET   the link was lost: every slot is freed (before rank 0's next step)
 *   STOP    rank 0 is exiting in order: the followers exit 0
 * Followers run each step through their own executor (the same validation, so the same engine
 * calls in the same order on every rank) and drop its results. */
#include "wrk_tp.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "pie/v1/controller.pb-c.h"
#include "pie_log.h"
#include "rpc.h"
#include "wrk_coll.h"

#define WRK_TP_EXIT_GROUP_FAILED 3 /* a rank left because its group failed */

enum { WRK_TP_STEP = 1, WRK_TP_RESET = 2, WRK_TP_STOP = 3 };

typedef struct wrk_tp_msg {
    uint32_t kind, reserved;
    uint64_t bytes;
} wrk_tp_msg;

struct wrk_tp_group {
    wrk_coll *coll;
    uint32_t rank, size;
    char group_id[160]; /* for messages */
    uint8_t *buf;       /* a packed step; grows, reused */
    size_t cap;
    bool stepped; /* rank 0: a step went out since the last RESET (the followers may hold slots) */
    wrk_tp_rank_info *ranks; /* [size] after wrk_tp_group_loaded */
};

/* ---- configuration ------------------------------------------------------------------------ */

/* A non-negative decimal environment variable: its value, -1 when unset or empty, -2 when
 * malformed. */
static long long env_index(const char *name) {
    const char *v = getenv(name);
    if (v == NULL || v[0] == '\0') return -1;
    char *end;
    errno = 0;
    long long n = strtoll(v, &end, 10);
    if (errno != 0 || *end != '\0' || n < 0) return -2;
    return n;
}

pie_code wrk_tp_resolve(wrk_tp_config *c, const char *backend, pie_status *st) {
    const char *lws_leader = getenv("LWS_LEADER_ADDRESS");
    if ((c->leader == NULL || c->leader[0] == '\0') && lws_leader != NULL) c->leader = lws_leader;
    if (c->leader == NULL) c->leader = "";
    long long index = env_index("LWS_WORKER_INDEX"), pods = env_index("LWS_GROUP_SIZE");
    if (index == -2 || pods == -2)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "LWS_WORKER_INDEX or LWS_GROUP_SIZE is not a non-negative integer "
                              "(\"%s\", \"%s\")",
                              getenv("LWS_WORKER_INDEX") ? getenv("LWS_WORKER_INDEX") : "",
                              getenv("LWS_GROUP_SIZE") ? getenv("LWS_GROUP_SIZE") : "");
    if (pods > 1 || index > 0)
        return pie_status_set(st, PIE_UNIMPLEMENTED,
                              "tp: this pod is pod %lld of a LeaderWorkerSet group of %lld pods "
                              "(leader %s); a group across pods or nodes needs a TCP collective, "
                              "which is not implemented: run the group in one pod (tp.size = "
                              "the pod's ranks, tensorParallel.nodes 1)",
                              index < 0 ? 0 : index, pods < 0 ? 1 : pods,
                              c->leader[0] ? c->leader : "unknown");
    if (c->size <= 1) {
        if (c->rank > 0)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "tp.rank %d is out of range: tp.size is 1 (ranks 0 .. 0)",
                                  (int)c->rank);
        c->size = 1;
        return PIE_OK;
    }
    if (c->rank >= 0)
        return pie_status_set(st, PIE_UNIMPLEMENTED,
                              "tp.rank %d with tp.size %u: a rank started on its own would join "
                              "rank 0 through Worker/TpJoin, which is not implemented; leave "
                              "tp.rank unset and one pie-worker with tp.size %u starts all %u "
                              "ranks itself",
                              (int)c->rank, c->size, c->size, c->size);
    if (c->leader[0] != '\0' && lws_leader == NULL)
        return pie_status_set(st, PIE_UNIMPLEMENTED,
                              "tp.leader \"%s\": joining a rank 0 in another process is not "
                              "implemented (Worker/TpJoin); leave tp.leader empty and one "
                              "pie-worker with tp.size %u starts all ranks itself",
                              c->leader, c->size);
    if (strcmp(backend, "cpu") != 0)
        return pie_status_set(st, PIE_UNIMPLEMENTED,
                              "tp.size %u needs backend cpu: the %s backend does not run "
                              "tensor-parallel groups yet (NCCL is not implemented)",
                              c->size, backend);
    if (c->size > WRK_COLL_MAX_RANKS)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "tp.size %u is more than %u ranks", c->size,
                              WRK_COLL_MAX_RANKS);
    return PIE_OK;
}

/* ---- the launcher ------------------------------------------------------------------------- */

static uint64_t random_epoch(void) {
    uint64_t e = 0;
    while (e == 0) {
        ssize_t n = getrandom(&e, sizeof e, 0);
        if (n != (ssize_t)sizeof e) { /* no entropy source: time and pid still differ per launch */
            struct timespec ts;
            (void)clock_gettime(CLOCK_REALTIME, &ts);
            e = ((uint64_t)ts.tv_sec << 32) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 16);
        }
    }
    return e;
}

/* Kills every rank still running with SIGKILL. */
static void kill_all(const pid_t *pids, uint32_t n) {
    for (uint32_t r = 0; r < n; r++)
        if (pids[r] > 0 && kill(pids[r], SIGKILL) != 0 && errno != ESRCH)
            pie_log_error("wrk.tp.kill", "rank=%u pid=%d error=\"%s\"", r, (int)pids[r],
                          strerror(errno));
}

/* In a freshly forked rank: dies with the launcher, takes SIGCHLD back. */
static void rank_setup(pid_t launcher) {
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    (void)sigprocmask(SIG_UNBLOCK, &chld, NULL);
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != launcher) _exit(1);
}

/* Reaps ended ranks; on the first that did not exit 0 kills the rest. Returns how many ended. */
static uint32_t reap(pid_t *pids, uint32_t n, bool *failed) {
    uint32_t ended = 0;
    for (;;) {
        int status;
        pid_t p = waitpid(-1, &status, WNOHANG);
        if (p < 0 && errno == EINTR) continue;
        if (p <= 0) break;
        uint32_t r = 0;
        while (r < n && pids[r] != p) r++;
        if (r == n) continue; /* not a rank (cannot happen: the launcher forks nothing else) */
        pids[r] = 0;
        ended++;
        bool clean = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        if (WIFEXITED(status))
            pie_log_write(clean ? PIE_LOG_INFO : PIE_LOG_ERROR, "wrk.tp.rank_exited",
                          "rank=%u pid=%d status=%d", r, (int)p, WEXITSTATUS(status));
        else
            pie_log_error("wrk.tp.rank_exited", "rank=%u pid=%d signal=%d", r, (int)p,
                          WIFSIGNALED(status) ? WTERMSIG(status) : 0);
        if (!clean && !*failed) {
            *failed = true;
            pie_log_error("wrk.tp.group_failed",
                          "rank=%u tp_size=%u action=\"the group cannot compute without it: "
                          "killing the other ranks (rank 0's controller link ends with it), "
                          "exit 1\"",
                          r, n);
            kill_all(pids, n);
        }
    }
    return ended;
}

bool wrk_tp_launch(const wrk_tp_config *c, wrk_tp_rank *me, int *exit_status) {
    uint32_t n = c->size;
    pid_t self = getpid();
    uint64_t epoch = random_epoch();
    *me = (wrk_tp_rank){.size = n, .epoch = epoch};
    snprintf(me->coll_name, sizeof me->coll_name, "/pie-tp-%d-%016llx", (int)self,
             (unsigned long long)epoch);
    /* SIGCHLD is taken by sigwaitinfo below, like SIGTERM and SIGINT (svc_block_signals). */
    sigset_t waitset;
    sigemptyset(&waitset);
    sigaddset(&waitset, SIGCHLD);
    sigaddset(&waitset, SIGTERM);
    sigaddset(&waitset, SIGINT);
    if (sigprocmask(SIG_BLOCK, &waitset, NULL) != 0) {
        pie_log_error("wrk.tp.launch_failed", "sigprocmask: %s", strerror(errno));
        *exit_status = 1;
        return false;
    }
    pid_t pids[WRK_COLL_MAX_RANKS] = {0};
    bool failed = false;
    uint32_t alive = 0;
    pie_log_info("wrk.tp.launch", "tp_size=%u collective=%s epoch=%016llx", n, me->coll_name,
                 (unsigned long long)epoch);
    for (uint32_t r = 0; r < n; r++) {
        (void)fflush(NULL); /* nothing buffered is written twice */
        pid_t p = fork();
        if (p == 0) {
            rank_setup(self);
            me->rank = r;
            return true;
        }
        if (p < 0) {
            pie_log_error("wrk.tp.launch_failed", "rank=%u fork: %s", r, strerror(errno));
            failed = true;
            kill_all(pids, n);
            break;
        }
        pids[r] = p;
        alive++;
        pie_log_info("wrk.tp.rank_started", "rank=%u pid=%d", r, (int)p);
    }
    bool stopping = false;
    while (alive > 0) {
        siginfo_t si;
        int sig = sigwaitinfo(&waitset, &si);
        if (sig < 0) {
            if (errno == EINTR) continue;
            pie_log_error("wrk.tp.supervise", "sigwaitinfo: %s", strerror(errno));
            failed = true;
            kill_all(pids, n);
            sig = SIGCHLD; /* reap what is left */
        }
        if (sig == SIGTERM || sig == SIGINT) {
            /* rank 0 stops in order (drain, leave the controller) and then stops the others */
            if (!stopping && !failed && pids[0] > 0) {
                pie_log_info("wrk.tp.signal", "signal=%d action=\"stopping rank 0\"", sig);
                if (kill(pids[0], SIGTERM) != 0)
                    pie_log_error("wrk.tp.signal", "kill rank 0: %s", strerror(errno));
            }
            stopping = true;
            continue;
        }
        alive -= reap(pids, n, &failed);
    }
    /* Rank 0 unlinks the segment's name once every rank joined; a group that failed before
     * that would leave it in /dev/shm. */
    if (shm_unlink(me->coll_name) == 0)
        pie_log_info("wrk.tp.shm_removed", "name=%s reason=\"the group never formed\"",
                     me->coll_name);
    pie_log_write(failed ? PIE_LOG_ERROR : PIE_LOG_INFO, "wrk.tp.exit", "status=%d",
                  failed ? 1 : 0);
    *exit_status = failed ? 1 : 0;
    return false;
}

/* ---- the group ---------------------------------------------------------------------------- */

pie_code wrk_tp_group_open(const wrk_tp_config *c, const wrk_tp_rank *me, const char *group_id,
                           wrk_tp_group **out, pie_status *st) {
    wrk_tp_group *g = calloc(1, sizeof *g);
    if (g == NULL) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "tp group: out of memory");
    g->rank = me->rank;
    g->size = me->size;
    snprintf(g->group_id, sizeof g->group_id, "%s", group_id && group_id[0] ? group_id : "-");
    wrk_coll_opts o = {
        .name = me->coll_name,
        .epoch = me->epoch,
        .rank = me->rank,
        .n_ranks = me->size,
        .chunk_bytes = (size_t)c->chunk_bytes,
        .timeout_ms = c->timeout_ms,
    };
    pie_code rc = wrk_coll_open(&o, &g->coll, st);
    if (rc != PIE_OK) {
        free(g);
        return rc;
    }
    *out = g;
    return PIE_OK;
}

struct wrk_coll *wrk_tp_group_coll(wrk_tp_group *g) {
    return g->coll;
}

pie_code wrk_tp_group_loaded(wrk_tp_group *g, const char *device, pie_status *st) {
    uint64_t ranks = g->size;
    pie_code rc = wrk_coll_bcast_idle(g->coll, 0, &ranks, sizeof ranks, st);
    if (rc != PIE_OK) return rc;
    /* every rank is here: the exchange of reports is bounded by the group's timeout */
    wrk_tp_rank_info me;
    memset(&me, 0, sizeof me); /* the record travels as bytes: no uninitialised padding */
    me.rank = g->rank;
    me.pid = (uint32_t)getpid();
    snprintf(me.device, sizeof me.device, "%s", device ? device : "");
    if (gethostname(me.host, sizeof me.host - 1) != 0) snprintf(me.host, sizeof me.host, "?");
    free(g->ranks);
    g->ranks = calloc(g->size, sizeof *g->ranks);
    if (g->ranks == NULL) {
        wrk_coll_abort(g->coll); /* the others would wait in the all-gather */
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "tp group: out of memory");
    }
    rc = wrk_coll_allgather(g->coll, &me, sizeof me, g->ranks, st);
    if (rc != PIE_OK) return rc;
    for (uint32_t r = 0; r < g->size; r++) { /* a report is text for humans: terminate it */
        g->ranks[r].device[sizeof g->ranks[r].device - 1] = '\0';
        g->ranks[r].host[sizeof g->ranks[r].host - 1] = '\0';
    }
    return PIE_OK;
}

const wrk_tp_rank_info *wrk_tp_group_ranks(const wrk_tp_group *g, uint32_t *n) {
    *n = g->ranks ? g->size : 0;
    return g->ranks;
}

static bool group_reserve(wrk_tp_group *g, size_t bytes) {
    if (bytes <= g->cap && g->buf != NULL) return true;
    size_t cap = g->cap ? g->cap : 4096;
    while (cap < bytes) {
        if (cap > SIZE_MAX / 2) return false;
        cap *= 2;
    }
    uint8_t *p = realloc(g->buf, cap);
    if (p == NULL) return false;
    g->buf = p;
    g->cap = cap;
    return true;
}

static pie_code leader_send(wrk_tp_group *g, uint32_t kind, void *body, size_t bytes,
                            pie_status *st) {
    wrk_tp_msg m = {.kind = kind, .bytes = bytes};
    pie_code rc = wrk_coll_bcast(g->coll, 0, &m, sizeof m, st);
    if (rc == PIE_OK && bytes > 0) rc = wrk_coll_bcast(g->coll, 0, body, bytes, st);
    return rc;
}

static pie_code leader_step(void *arg, const Pie__V1__WorkerDown *down, pie_status *st) {
    wrk_tp_group *g = arg;
    size_t bytes = protobuf_c_message_get_packed_size(&down->base);
    if (!group_reserve(g, bytes))
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "tp group: out of memory for a step of %zu bytes", bytes);
    size_t packed = protobuf_c_message_pack(&down->base, g->buf);
    if (packed != bytes)
        return pie_status_set(st, PIE_INTERNAL, "tp group: a step packed to %zu bytes, not %zu",
                              packed, bytes);
    g->stepped = true;
    return leader_send(g, WRK_TP_STEP, g->buf, bytes, st);
}

/* Every failed redial of the controller resets the executor; the followers need to hear of it
 * only when a step ran since the last time (before that, all their slots are free). */
static pie_code leader_reset(void *arg, pie_status *st) {
    wrk_tp_group *g = arg;
    if (!g->stepped) return PIE_OK;
    g->stepped = false;
    return leader_send(g, WRK_TP_RESET, NULL, 0, st);
}

static pie_code group_check(void *arg, pie_status *st) {
    wrk_tp_group *g = arg;
    return wrk_coll_check(g->coll, st);
}

/* The group cannot compute any more: leave at once. Exiting closes rank 0's controller link
 * (its instances end UNAVAILABLE naming the group, as for any lost worker); the launcher sees
 * the exit and ends the other ranks. Nothing of the step is sent. */
static void group_failed(void *arg, const pie_status *st) {
    wrk_tp_group *g = arg;
    pie_log_error("wrk.tp.group_failed",
                  "group=%s rank=%u tp_size=%u code=%s error=\"%s\" action=\"exit %d\"",
                  g->group_id, g->rank, g->size, pie_code_name(st->code), st->msg,
                  WRK_TP_EXIT_GROUP_FAILED);
    _exit(WRK_TP_EXIT_GROUP_FAILED);
}

wrk_exec_group wrk_tp_group_leader_hooks(wrk_tp_group *g) {
    return (wrk_exec_group){
        .step = leader_step,
        .reset = leader_reset,
        .check = group_check,
        .failed = group_failed,
        .g = g,
    };
}

wrk_exec_group wrk_tp_group_follower_hooks(wrk_tp_group *g) {
    return (wrk_exec_group){.failed = group_failed, .g = g};
}

void wrk_tp_group_stop(wrk_tp_group *g) {
    if (g == NULL) return;
    pie_status st;
    if (leader_send(g, WRK_TP_STOP, NULL, 0, &st) != PIE_OK)
        pie_log_warn("wrk.tp.stop", "the other ranks were not told to stop: %s", st.msg);
}

pie_code wrk_tp_group_follow(wrk_tp_group *g, wrk_exec *x, pie_status *st) {
    for (;;) {
        wrk_tp_msg m;
        pie_code rc = wrk_coll_bcast_idle(g->coll, 0, &m, sizeof m, st);
        if (rc != PIE_OK) return rc;
        switch (m.kind) {
        case WRK_TP_STOP: return PIE_OK;
        case WRK_TP_RESET:
            wrk_exec_reset_now(x);
            pie_log_info("wrk.tp.rank_reset",
                         "rank=%u reason=\"rank 0 lost its controller "
                         "link: every slot is free\"",
                         g->rank);
            break;
        case WRK_TP_STEP: {
            if (m.bytes == 0 || !group_reserve(g, (size_t)m.bytes)) {
                wrk_coll_abort(g->coll);
                return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                                      "tp group: rank %u has no room for a step of %llu bytes",
                                      g->rank, (unsigned long long)m.bytes);
            }
            rc = wrk_coll_bcast(g->coll, 0, g->buf, (size_t)m.bytes, st);
            if (rc != PIE_OK) return rc;
            ProtobufCMessage *down = protobuf_c_message_unpack(&pie__v1__worker_down__descriptor,
                                                               NULL, (size_t)m.bytes, g->buf);
            if (down == NULL) {
                wrk_coll_abort(g->coll);
                return pie_status_set(st, PIE_INTERNAL,
                                      "tp group: rank %u cannot decode a step of %llu bytes",
                                      g->rank, (unsigned long long)m.bytes);
            }
            /* runs here, now: the executor is idle between steps (the executor frees down) */
            wrk_exec_submit(x, (Pie__V1__WorkerDown *)down, 0);
            rc = wrk_coll_check(g->coll, st);
            if (rc != PIE_OK) return rc;
            break;
        }
        default:
            wrk_coll_abort(g->coll);
            return pie_status_set(st, PIE_INTERNAL, "tp group: rank %u got message kind %u",
                                  g->rank, m.kind);
        }
    }
}

void wrk_tp_group_close(wrk_tp_group *g) {
    if (g == NULL) return;
    wrk_coll_close(g->coll);
    free(g->buf);
    free(g->ranks);
    free(g);
}
