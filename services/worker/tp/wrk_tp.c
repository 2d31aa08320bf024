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
#include "pie/v1/worker.pb-c.h"
#include "pie_log.h"
#include "pie_sha256.h"
#include "rpc.h"
#include "svc.h"
#include "wrk_coll.h"
#include "wrk_tp_blame.h"
#include "wrk_tp_cuda.h"
#ifdef PIE_WITH_NCCL
#include "wrk_nccl.h"
#define WRK_TP_NCCL_BUILT true
#else
#define WRK_TP_NCCL_BUILT false
#endif


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
    struct wrk_nccl *nccl;   /* cuda groups: after wrk_tp_group_open_nccl */
    uint32_t timeout_ms;     /* tp.timeout, also the bound of a wait for NCCL's collectives */
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
    bool explicit_leader = c->leader != NULL && c->leader[0] != '\0';
    if (!explicit_leader && lws_leader != NULL) c->leader = lws_leader;
    if (c->leader == NULL) c->leader = "";
    long long index = env_index("LWS_WORKER_INDEX"), pods = env_index("LWS_GROUP_SIZE");
    if (index == -2 || pods == -2)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "LWS_WORKER_INDEX or LWS_GROUP_SIZE is not a non-negative integer "
                              "(\"%s\", \"%s\")",
                              getenv("LWS_WORKER_INDEX") ? getenv("LWS_WORKER_INDEX") : "",
                              getenv("LWS_GROUP_SIZE") ? getenv("LWS_GROUP_SIZE") : "");
    if (pods > WRK_COLL_MAX_RANKS || index >= WRK_COLL_MAX_RANKS)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "LWS_GROUP_SIZE %lld or LWS_WORKER_INDEX %lld: a group has at most "
                              "%u ranks",
                              pods, index, WRK_COLL_MAX_RANKS);
    if (pods > 1 || index > 0) { /* a LeaderWorkerSet group of pods: one rank per pod */
        if (pods < 1) pods = index + 1;
        if (c->size <= 1) c->size = (uint32_t)pods;
        if (c->size != (uint64_t)pods)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "tp.size %u in a LeaderWorkerSet group of %lld pods: a group "
                                  "across pods runs one rank per pod, so tp.size must be %lld",
                                  c->size, pods, pods);
        if (c->rank < 0) c->rank = (int32_t)(index < 0 ? 0 : index);
    }
    if (c->size <= 1) {
        if (c->rank > 0)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "tp.rank %d is out of range: tp.size is 1 (ranks 0 .. 0)",
                                  (int)c->rank);
        c->size = 1;
        c->rank = -1;
        return PIE_OK;
    }
    if (c->size > WRK_COLL_MAX_RANKS)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "tp.size %u is more than %u ranks", c->size,
                              WRK_COLL_MAX_RANKS);
    if (c->rank >= (int32_t)c->size)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "tp.rank %d is out of range: tp.size is %u (ranks 0 .. %u)",
                              (int)c->rank, c->size, c->size - 1);
    if (c->rank > 0 && c->leader[0] == '\0')
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "tp.rank %d needs tp.leader: rank 0's host:port (its gRPC server), "
                              "which LWS_LEADER_ADDRESS fills in a LeaderWorkerSet",
                              (int)c->rank);
    if (c->rank < 0 && explicit_leader)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "tp.leader \"%s\" without tp.rank: a rank started on its own says "
                              "which it is; leave both unset and one pie-worker with tp.size %u "
                              "starts all ranks itself",
                              c->leader, c->size);
    if (strcmp(backend, "cuda") == 0) {
#ifdef PIE_WITH_CUDA
        return wrk_tp_cuda_check(c->size, WRK_TP_NCCL_BUILT, st);
#else
        return pie_status_set(st, PIE_UNIMPLEMENTED,
                              "tp.size %u with backend cuda: this pie-worker was built without "
                              "the cuda backend (nvcc was not found at build time)",
                              c->size);
#endif
    }
    if (strcmp(backend, "cpu") != 0)
        return pie_status_set(st, PIE_UNIMPLEMENTED,
                              "tp.size %u needs backend cpu or cuda: the %s backend does not run "
                              "tensor-parallel groups",
                              c->size, backend);
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

static int64_t now_ms(void) {
    struct timespec ts;
    (void)clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* The verdict is in: say which rank took the group down and end the others. */
static void group_down(pid_t *pids, uint32_t n, int culprit) {
    pie_log_error("wrk.tp.group_failed",
                  "rank=%d tp_size=%u action=\"the group cannot compute without it: "
                  "killing the other ranks (rank 0's controller link ends with it), exit 1\"",
                  culprit, n);
    kill_all(pids, n);
}

/* Reaps ended ranks and feeds their ends to the verdict (wrk_tp_blame.h: a rank that only saw
 * the group fail waits for the rank that died). Returns how many ended. */
static uint32_t reap(pid_t *pids, uint32_t n, wrk_tp_blame *blame) {
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
        bool witness = WIFEXITED(status) && WEXITSTATUS(status) == WRK_TP_EXIT_GROUP_FAILED;
        if (WIFEXITED(status))
            pie_log_write(clean ? PIE_LOG_INFO : PIE_LOG_ERROR, "wrk.tp.rank_exited",
                          "rank=%u pid=%d status=%d", r, (int)p, WEXITSTATUS(status));
        else
            pie_log_error("wrk.tp.rank_exited", "rank=%u pid=%d signal=%d", r, (int)p,
                          WIFSIGNALED(status) ? WTERMSIG(status) : 0);
        if (wrk_tp_blame_exit(blame, r, clean, witness, now_ms()))
            group_down(pids, n, blame->culprit);
    }
    return ended;
}

/* Waits for a signal of `set`, at most `limit_ms` (-1: no limit). Returns it, 0 on timeout. */
static int wait_signal(const sigset_t *set, int64_t limit_ms, siginfo_t *si) {
    if (limit_ms < 0) return sigwaitinfo(set, si);
    struct timespec ts = {.tv_sec = limit_ms / 1000, .tv_nsec = (limit_ms % 1000) * 1000000};
    int sig = sigtimedwait(set, si, &ts);
    return sig < 0 && errno == EAGAIN ? 0 : sig;
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
    wrk_tp_blame blame;
    wrk_tp_blame_init(&blame);
    while (alive > 0) {
        siginfo_t si;
        int sig = wait_signal(&waitset, wrk_tp_blame_wait_ms(&blame, now_ms()), &si);
        if (sig < 0) {
            if (errno == EINTR) continue;
            pie_log_error("wrk.tp.supervise", "sigwaitinfo: %s", strerror(errno));
            failed = true;
            kill_all(pids, n);
            sig = SIGCHLD; /* reap what is left */
        }
        if (sig == SIGTERM || sig == SIGINT) {
            /* rank 0 stops in order (drain, leave the controller) and then stops the others */
            if (!stopping && !failed && blame.witness < 0 && blame.culprit < 0 && pids[0] > 0) {
                pie_log_info("wrk.tp.signal", "signal=%d action=\"stopping rank 0\"", sig);
                if (kill(pids[0], SIGTERM) != 0)
                    pie_log_error("wrk.tp.signal", "kill rank 0: %s", strerror(errno));
            }
            stopping = true;
            continue;
        }
        if (sig == SIGCHLD) alive -= reap(pids, n, &blame);
        if (wrk_tp_blame_tick(&blame, now_ms(), alive == 0)) group_down(pids, n, blame.culprit);
    }
    failed = failed || blame.culprit >= 0;
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

/* ---- ranks started one by one: TpJoin ---------------------------------------------------- */

#define WRK_TP_JOIN_MIN_MS   120000 /* a rank looks for rank 0 at least this long */
#define WRK_TP_JOIN_RETRY_MS 200

pie_code wrk_tp_model_id_load(const char *model_path, const char *model_name, wrk_tp_model_id *out,
                              pie_status *st) {
    memset(out, 0, sizeof *out);
    if (model_name && model_name[0]) {
        snprintf(out->name, sizeof out->name, "%s", model_name);
    } else { /* wrk_desc's default: the basename of model.path */
        size_t len = strlen(model_path);
        while (len > 1 && model_path[len - 1] == '/') len--;
        size_t b = len;
        while (b > 0 && model_path[b - 1] != '/') b--;
        snprintf(out->name, sizeof out->name, "%.*s", (int)(len - b), model_path + b);
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", model_path);
    FILE *f = fopen(path, "rb");
    if (!f)
        return pie_status_set(st, PIE_NOT_FOUND, "tp: cannot read %s: %s", path, strerror(errno));
    char *buf = NULL;
    size_t len = 0, cap = 0;
    pie_code rc = PIE_OK;
    for (;;) {
        if (len == cap) {
            cap = cap ? cap * 2 : 65536;
            char *nb = cap <= (64u << 20) ? realloc(buf, cap) : NULL;
            if (!nb) {
                rc = pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "tp: %s is too large", path);
                break;
            }
            buf = nb;
        }
        size_t k = fread(buf + len, 1, cap - len, f);
        len += k;
        if (k == 0) break;
    }
    if (rc == PIE_OK && ferror(f))
        rc = pie_status_set(st, PIE_INTERNAL, "tp: reading %s failed", path);
    if (rc == PIE_OK) rc = pie_sha256_hex(buf, len, out->config_sha256, st);
    free(buf);
    (void)fclose(f);
    return rc;
}

pie_code wrk_tp_offer_open(const char *group_id, const wrk_tp_model_id *id, uint16_t want_port,
                           wrk_tp_rank *me, wrk_tp_offer *offer, pie_status *st) {
    uint16_t port = 0;
    me->epoch = random_epoch();
    char listen[32];
    snprintf(listen, sizeof listen, "0.0.0.0:%u", want_port);
    pie_code rc = wrk_coll_tcp_listen(listen, &me->tcp_listen_fd, &port, st);
    if (rc != PIE_OK) return rc;
    /* rank 0 accepts on its listener: the address only marks the transport */
    snprintf(me->tcp_leader, sizeof me->tcp_leader, "0.0.0.0:%u", port);
    memset(offer, 0, sizeof *offer);
    snprintf(offer->group_id, sizeof offer->group_id, "%s", group_id);
    offer->tp_size = me->size;
    offer->epoch = me->epoch;
    offer->port = port;
    offer->model = *id;
    offer->joined = 1; /* rank 0 */
    offer->state = WRK_TP_OFFER_OPEN;
    return PIE_OK;
}

/* "pie-c/1.2.3" → 1; -1 when it is not of that form. */
static long version_major(const char *v) {
    const char *p = v ? strchr(v, '/') : NULL;
    if (!p || p[1] < '0' || p[1] > '9') return -1;
    return strtol(p + 1, NULL, 10);
}

pie_code wrk_tp_offer_admit(wrk_tp_offer *o, const Pie__V1__TpJoinRequest *r, pie_status *st) {
    const char *grp = r->group_id ? r->group_id : "", *model = r->model ? r->model : "";
    const char *sha = r->config_sha256 ? r->config_sha256 : "";
    if (o->state == WRK_TP_OFFER_FORMED)
        return pie_status_set(st, PIE_FAILED_PRECONDITION,
                              "TpJoin: rank %u: group %s formed already (epoch %016llx, all %u "
                              "ranks joined); a rank joins only while its group forms: restart "
                              "the group's rank 0 to form it again",
                              r->rank, o->group_id, (unsigned long long)o->epoch, o->tp_size);
    if (o->state == WRK_TP_OFFER_ENDED)
        return pie_status_set(st, PIE_UNAVAILABLE,
                              "TpJoin: rank %u: group %s's formation %016llx ended without all "
                              "its ranks; rank 0 exits and forms it again under a new epoch",
                              r->rank, o->group_id, (unsigned long long)o->epoch);
    if (strcmp(grp, o->group_id) != 0)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "TpJoin: rank %u: group_id \"%.160s\" is not this group's (\"%s\")",
                              r->rank, grp, o->group_id);
    if (r->tp_size != o->tp_size)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "TpJoin: rank %u: tp_size %u, but group %s has %u ranks", r->rank,
                              r->tp_size, o->group_id, o->tp_size);
    if (r->rank == 0 || r->rank >= o->tp_size)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "TpJoin: rank %u is out of range [1, %u) for group %s", r->rank,
                              o->tp_size, o->group_id);
    if (strcmp(model, o->model.name) != 0)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "TpJoin: rank %u: model \"%.160s\", but group %s serves \"%s\"",
                              r->rank, model, o->group_id, o->model.name);
    if (strcmp(sha, o->model.config_sha256) != 0)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "TpJoin: rank %u: config_sha256 %.64s differs from rank 0's %s (the "
                              "model's config.json is not the same file)",
                              r->rank, sha, o->model.config_sha256);
    if (version_major(r->version) != version_major("pie-c/" PIE_VERSION))
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "TpJoin: rank %u: version \"%.64s\" has another major version than "
                              "rank 0's \"pie-c/%s\"",
                              r->rank, r->version ? r->version : "", PIE_VERSION);
    if (o->joined & (1ull << r->rank))
        return pie_status_set(st, PIE_ALREADY_EXISTS,
                              "TpJoin: rank %u of group %s already joined this epoch (%016llx)",
                              r->rank, o->group_id, (unsigned long long)o->epoch);
    o->joined |= 1ull << r->rank;
    return PIE_OK;
}

/* target ← leader, with own_listen's port when leader has none ("host", "[v6]"). */
static void join_target(const char *leader, const char *own_listen, char *out, size_t cap) {
    bool has_port = leader[0] == '[' ? strstr(leader, "]:") != NULL
                                     : strchr(leader, ':') != NULL; /* bare IPv6: left alone */
    const char *port = own_listen ? strrchr(own_listen, ':') : NULL;
    if (has_port || !port)
        snprintf(out, cap, "%s", leader);
    else
        snprintf(out, cap, "%s%s", leader, port);
}

/* out ← target's host with the port of endpoint "host:port". */
static pie_code coll_target(const char *target, const char *endpoint, char *out, size_t cap,
                            pie_status *st) {
    const char *ep = endpoint ? strrchr(endpoint, ':') : NULL, *tc = strrchr(target, ':');
    if (!ep || ep[1] == '\0' || !tc)
        return pie_status_set(st, PIE_INTERNAL,
                              "TpJoin: rank 0 answered host_endpoint \"%.200s\", not host:port",
                              endpoint ? endpoint : "");
    snprintf(out, cap, "%.*s%s", (int)(tc - target), target, ep);
    return PIE_OK;
}

pie_code wrk_tp_join(const wrk_tp_config *c, const svc *s, const char *own_listen,
                     const char *group_id, const wrk_tp_model_id *id, const char *device,
                     wrk_tp_rank *me, pie_status *st) {
    char target[300];
    join_target(c->leader, own_listen, target, sizeof target);
    rpc_channel *ch = svc_channel(s, target, st);
    if (!ch) return st->code;
    Pie__V1__TpJoinRequest req = PIE__V1__TP_JOIN_REQUEST__INIT;
    req.group_id = (char *)group_id;
    req.rank = me->rank;
    req.tp_size = me->size;
    req.model = (char *)id->name;
    req.config_sha256 = (char *)id->config_sha256;
    req.version = "pie-c/" PIE_VERSION;
    req.device = (char *)device;
    uint64_t form_ms = c->form_timeout_ms ? c->form_timeout_ms : c->timeout_ms;
    uint64_t wait_ms = form_ms > WRK_TP_JOIN_MIN_MS ? form_ms : WRK_TP_JOIN_MIN_MS;
    int64_t deadline = rpc_now_ns() + (int64_t)wait_ms * 1000000;
    pie_code rc;
    ProtobufCMessage *m = NULL;
    for (;;) {
        rpc_call_opts co = {.timeout_ms = 10000};
        rc = rpc_unary(ch, "/pie.v1.Worker/TpJoin", &req.base,
                       &pie__v1__tp_join_response__descriptor, &m, &co, st);
        /* rank 0 not up yet (or still loading its server): try again */
        bool retry = rc == PIE_UNAVAILABLE || rc == PIE_DEADLINE_EXCEEDED;
        if (!retry || rpc_now_ns() > deadline) break;
        struct timespec ts = {0, WRK_TP_JOIN_RETRY_MS * 1000000L};
        nanosleep(&ts, NULL);
    }
    if (rc == PIE_OK) {
        const Pie__V1__TpJoinResponse *r = (const Pie__V1__TpJoinResponse *)m;
        if (r->tp_size != me->size || r->epoch == 0)
            rc = pie_status_set(st, PIE_FAILED_PRECONDITION,
                                "TpJoin: rank 0 at %s answered tp_size %u, epoch %llx: not a "
                                "group of %u ranks",
                                target, r->tp_size, (unsigned long long)r->epoch, me->size);
        else /* a cuda group's answer carries the NCCL id besides the host endpoint */
            rc = wrk_tp_cuda_read_answer(r, me->nccl, me->nccl_id, st);
        me->has_nccl_id = rc == PIE_OK && me->nccl;
        if (rc == PIE_OK)
            rc = coll_target(target, r->host_endpoint, me->tcp_leader, sizeof me->tcp_leader, st);
        me->epoch = r->epoch;
        rpc_msg_free(m);
    } else {
        char why[PIE_STATUS_MSG_MAX];
        snprintf(why, sizeof why, "%s", st->msg);
        pie_status_set(st, rc, "tp: rank %u could not join rank 0 at %s: %s", me->rank, target,
                       why);
    }
    rpc_channel_destroy(ch);
    return rc;
}

/* ---- the group ---------------------------------------------------------------------------- */

pie_code wrk_tp_group_open(const wrk_tp_config *c, const wrk_tp_rank *me, const char *group_id,
                           wrk_tp_group **out, pie_status *st) {
    wrk_tp_group *g = calloc(1, sizeof *g);
    if (g == NULL) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "tp group: out of memory");
    g->rank = me->rank;
    g->size = me->size;
    snprintf(g->group_id, sizeof g->group_id, "%s", group_id && group_id[0] ? group_id : "-");
    g->timeout_ms = c->timeout_ms;
    wrk_coll_opts o = {
        .name = me->coll_name,
        .epoch = me->epoch,
        .rank = me->rank,
        .n_ranks = me->size,
        .chunk_bytes = (size_t)c->chunk_bytes,
        .timeout_ms = c->timeout_ms,
        .join_timeout_ms = c->form_timeout_ms,
        .tcp_leader = me->tcp_leader[0] ? me->tcp_leader : NULL,
        .tcp_listen_fd = me->tcp_listen_fd,
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

/* After a step, every rank: the host collective, and on cuda the NCCL communicator — a
 * collective that failed there (a peer's network, NCCL's own error, a hung peer past
 * tp.timeout) failed the step's batches; the group must not go on serving with a dead
 * communicator, so it fails as a whole, and the host collective's abort tells the other ranks
 * at once instead of at their next timeout. */
static pie_code group_health(wrk_tp_group *g, pie_status *st) {
    pie_code rc = wrk_coll_check(g->coll, st);
#ifdef PIE_WITH_NCCL
    if (rc == PIE_OK && g->nccl) {
        rc = wrk_nccl_check(g->nccl, st);
        if (rc != PIE_OK) wrk_coll_abort(g->coll);
    }
#endif
    return rc;
}

static pie_code group_check(void *arg, pie_status *st) { return group_health(arg, st); }

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
            rc = group_health(g, st);
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

#ifdef PIE_WITH_NCCL
pie_code wrk_tp_group_open_nccl(wrk_tp_group *g, const wrk_tp_rank *me, pie_status *st) {
    /* every rank's GPU first, over the host collective: a rank without one fails the group
     * here, with its reason, instead of leaving the others in ncclCommInitRank */
    pie_status mine;
    pie_code ok = wrk_nccl_device_ok(0, &mine);
    char all[WRK_COLL_MAX_RANKS];
    char flag = ok == PIE_OK ? 1 : 0;
    pie_code rc = wrk_coll_allgather(g->coll, &flag, 1, all, st);
    if (rc != PIE_OK) return rc;
    if (ok != PIE_OK) return pie_status_set(st, ok, "tp: rank %u: %s", g->rank, mine.msg);
    for (uint32_t r = 0; r < g->size; r++)
        if (!all[r])
            return pie_status_set(st, PIE_UNAVAILABLE,
                                  "tp: rank %u of group %s has no usable CUDA device (its log "
                                  "says why); the group cannot form",
                                  r, g->group_id);
    /* the NCCL unique id: from TpJoin (ranks started one by one), else rank 0 makes one and
     * broadcasts it on the host collective (a launched group) */
    uint8_t id[WRK_NCCL_ID_BYTES];
    if (me->has_nccl_id) {
        memcpy(id, me->nccl_id, sizeof id);
    } else {
        if (g->rank == 0) rc = wrk_nccl_unique_id(id, st);
        /* a failed rank 0 still broadcasts (zeros): the others must not wait for nothing */
        if (g->rank == 0 && rc != PIE_OK) memset(id, 0, sizeof id);
        pie_status bst;
        pie_code brc = wrk_coll_bcast(g->coll, 0, id, sizeof id, &bst);
        if (rc != PIE_OK) return rc;
        if (brc != PIE_OK) {
            *st = bst;
            return brc;
        }
        static const uint8_t zero[WRK_NCCL_ID_BYTES];
        if (memcmp(id, zero, sizeof id) == 0)
            return pie_status_set(st, PIE_UNAVAILABLE,
                                  "tp: rank 0 could not make the NCCL unique id (its log says "
                                  "why)");
    }
    rc = wrk_nccl_open(id, g->rank, g->size, 0, &g->nccl, st);
    /* tp.timeout bounds a step's wait for the peers on the GPU as on the host collective */
    if (rc == PIE_OK && g->timeout_ms != 0) wrk_nccl_set_timeout(g->nccl, g->timeout_ms);
    return rc;
}
#else
pie_code wrk_tp_group_open_nccl(wrk_tp_group *g, const wrk_tp_rank *me, pie_status *st) {
    (void)g, (void)me;
    return wrk_tp_cuda_check(2, false, st);
}
#endif

struct wrk_nccl *wrk_tp_group_nccl(wrk_tp_group *g) {
    return g->nccl;
}

void wrk_tp_group_close(wrk_tp_group *g) {
    if (g == NULL) return;
#ifdef PIE_WITH_NCCL
    wrk_nccl_close(g->nccl);
#endif
    wrk_coll_close(g->coll);
    free(g->buf);
    free(g->ranks);
    free(g);
}
