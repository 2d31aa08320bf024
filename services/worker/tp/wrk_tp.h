/* wrk_tp.h — a tensor-parallel worker group on one node, as pie-worker runs it: N rank
 * processes that one pie-worker process (the launcher) forks and supervises, joined by the host
 * collective (wrk_coll.h); rank 0 is the worker the controller sees.
 *
 * Owns: resolving the tp.* configuration with the LeaderWorkerSet environment and refusing what
 * cannot work (backends other than cpu and cuda, cuda without NCCL, inconsistent ranks); the launcher (fork the ranks,
 * supervise them: a rank that ends badly takes the group down and the launcher exits 1;
 * SIGTERM/SIGINT go to rank 0, whose orderly stop ends the others); ranks started one by one
 * (rank 0's TpJoin offer and its checks, a rank's TpJoin call; their collective is the TCP
 * transport); the group's collective (a fresh shm segment per launch, named by the launcher's
 * pid and a random epoch, or TCP); and the fan-out of steps: rank 0 broadcasts every
 * WorkerDown that holds batches (re-serialized), every reset of the slots and its stop, and
 * ranks 1..N-1 run the same executor steps on their shard and drop the results.
 * Does not own: the sharded math (engine/eng_cpu_tp.c), the link to the controller and the
 * registration (wrk_node.c, rank 0 only), running a step (wrk_exec.c).
 *
 * Why a launcher and not N independent processes: the pod is the unit Kubernetes restarts and a
 * group missing a rank cannot compute, so the group lives and dies with one process tree; the
 * ranks share one /dev/shm and the launcher can pick the collective's name and epoch before
 * forking, so no rendezvous service (Worker/TpJoin) is needed on one node.
 *
 * Threads: the launcher is single-threaded when it forks (main, before any service starts). In
 * a rank, the group is used by one thread at a time: rank 0's step runner (wrk_exec.c hands it
 * from thread to thread under its mutex), or main before the executor starts and after it
 * stopped; a follower's main thread does everything. */
#ifndef WRK_TP_H
#define WRK_TP_H

#include <stdbool.h>
#include <stdint.h>

#include "pie_status.h"
#include "wrk_exec.h"

struct wrk_coll;
struct wrk_nccl;

/* The tp.* keys of pie-worker (wrk_main.c). */
typedef struct wrk_tp_config {
    uint32_t size;       /* tp.size: ranks in the group (1 = no tensor parallelism) */
    int32_t rank;        /* tp.rank: -1 = not given (this process launches the group) */
    const char *leader;  /* tp.leader: rank 0's host:port for ranks in other pods ("" = none) */
    uint32_t timeout_ms; /* tp.timeout: longest wait for another rank within a step */
    uint32_t form_timeout_ms; /* tp.form_timeout: longest wait for the group to form (rank 0:
                               * every rank joined; the others: rank 0 answering); 0 = timeout_ms */
    uint64_t chunk_bytes;     /* tp.chunk: bytes per rank per collective step */
    uint16_t port;            /* tp.port: rank 0's collective listener for ranks started one by
                               * one (0 = any free port; fixed, a NetworkPolicy can allow it) */
} wrk_tp_config;

/* Fills tp.leader from LWS_LEADER_ADDRESS when empty, and tp.rank from LWS_WORKER_INDEX (and
 * tp.size from LWS_GROUP_SIZE when it is 1) in a LeaderWorkerSet group of several pods, one
 * rank per pod. Refuses, with a message naming the key or variable: tp.rank out of range, a
 * rank above 0 without tp.leader, tp.leader without tp.rank, a group of pods whose tp.size is
 * not its pod count, tp.size > 1 on a backend other than cpu and cuda, and on cuda in a build
 * without NCCL (wrk_tp_cuda_check). INVALID_ARGUMENT or
 * UNIMPLEMENTED. Afterwards tp.rank >= 0 with tp.size > 1 means "a rank started on its own":
 * rank 0 serves TpJoin, the others call it (wrk_tp_join). */
pie_code wrk_tp_resolve(wrk_tp_config *c, const char *backend, pie_status *st);

/* One rank of a launched group. */
typedef struct wrk_tp_rank {
    uint32_t rank, size;
    uint64_t epoch;     /* this launch's formation of the group */
    char coll_name[64]; /* the collective's shm name: "/pie-tp-<launcher pid>-<epoch hex>" */
    /* Ranks started on their own: the collective's TCP transport ("" = shared memory).
     * Rank 0: tcp_listen_fd is its listener (the group takes it over); the others:
     * tcp_leader is rank 0's collective endpoint "host:port". */
    char tcp_leader[320];
    int tcp_listen_fd;
    /* A cuda group (nccl: this rank runs backend cuda): the NCCL unique id of this formation,
     * when TpJoin carried it (ranks started one by one; rank 0 made it with its offer). A
     * launched group has none here: rank 0 makes it once the host collective formed. */
    bool nccl, has_nccl_id;
    uint8_t nccl_id[128];
} wrk_tp_rank;

/* What a rank started on its own shows rank 0 (TpJoin): the model's name as this worker will
 * announce it (model.name, or the basename of model.path) and the SHA-256 of its config.json. */
typedef struct wrk_tp_model_id {
    char name[160];
    char config_sha256[65];
} wrk_tp_model_id;

pie_code wrk_tp_model_id_load(const char *model_path, const char *model_name, wrk_tp_model_id *out,
                              pie_status *st);

/* Where rank 0's formation stands (what TpJoin answers a rank that asks now). */
typedef enum wrk_tp_offer_state {
    WRK_TP_OFFER_OPEN,   /* forming: ranks are admitted */
    WRK_TP_OFFER_FORMED, /* every rank joined: FAILED_PRECONDITION, the group is complete */
    WRK_TP_OFFER_ENDED,  /* the formation failed and rank 0 exits: UNAVAILABLE, try again (the
                          * restarted rank 0 forms the group under a new epoch) */
} wrk_tp_offer_state;

/* Rank 0 of a group whose ranks start one by one: what TpJoin checks and answers. */
typedef struct wrk_tp_offer {
    char group_id[160];
    uint32_t tp_size;
    uint64_t epoch;
    uint16_t port; /* the collective's listener */
    wrk_tp_model_id model;
    uint64_t joined; /* bit r: rank r asked to join this epoch */
    wrk_tp_offer_state state;
    bool has_nccl_id;     /* a cuda group: TpJoin answers COLLECTIVE_NCCL with this id */
    uint8_t nccl_id[128]; /* made for this epoch (wrk_nccl_unique_id) */
} wrk_tp_offer;

/* Rank 0: a fresh epoch and the collective's listener (all interfaces, `port`, 0 = any free
 * one) in *me, the offer TpJoin makes in *offer (OPEN). */
pie_code wrk_tp_offer_open(const char *group_id, const wrk_tp_model_id *id, uint16_t port,
                           wrk_tp_rank *me, wrk_tp_offer *offer, pie_status *st);

struct Pie__V1__TpJoinRequest;
/* Rank 0's TpJoin check of one request against its offer (marks the rank joined): the
 * contract's errors, INVALID_ARGUMENT naming the field that differs (group_id, tp_size, rank,
 * model, config_sha256, version), ALREADY_EXISTS for a rank that joined this epoch;
 * FAILED_PRECONDITION once the group formed (a rank joins only a forming group), UNAVAILABLE
 * once the formation ended without it (the caller retries and meets rank 0's next one). */
pie_code wrk_tp_offer_admit(wrk_tp_offer *offer, const struct Pie__V1__TpJoinRequest *r,
                            pie_status *st);

struct svc;
/* Ranks 1..N-1 started on their own: calls Worker/TpJoin on c->leader (a leader without a port,
 * as LWS_LEADER_ADDRESS gives it, gets own_listen's: every rank has the same config), retrying
 * while rank 0
 * is not up yet (the pods of a group start in any order) for up to 2 minutes or
 * tp.form_timeout (tp.timeout when that is 0), whichever is longer, and fills me->epoch and
 * me->tcp_leader (rank 0's host, the endpoint's port). A refusal comes back with its code and rank
 * 0's message. */
pie_code wrk_tp_join(const wrk_tp_config *c, const struct svc *s, const char *own_listen,
                     const char *group_id, const wrk_tp_model_id *id, const char *device,
                     wrk_tp_rank *me, pie_status *st);

/* Forks c->size rank processes and supervises them. Returns true in each rank (*me says which;
 * the rank carries on with main and, when it dies with its launcher, by PR_SET_PDEATHSIG), and
 * false in the launcher once every rank has ended: *exit_status is 0 when all of them exited
 * 0 (the orderly stop), else 1 (a rank died or failed: the others were killed). Call from a
 * single-threaded process. */
bool wrk_tp_launch(const wrk_tp_config *c, wrk_tp_rank *me, int *exit_status);

typedef struct wrk_tp_group wrk_tp_group;

/* Joins the group's collective (blocks until all ranks joined, at most c->timeout_ms). */
pie_code wrk_tp_group_open(const wrk_tp_config *c, const wrk_tp_rank *me, const char *group_id,
                           wrk_tp_group **out, pie_status *st);
struct wrk_coll *wrk_tp_group_coll(wrk_tp_group *g);

/* A cuda group, every rank, after wrk_tp_group_open: checks over the host collective that
 * every rank has its GPU (device 0 of its CUDA_VISIBLE_DEVICES), then joins the NCCL
 * communicator of me->nccl_id (TpJoin's), or of the id rank 0 makes now and broadcasts on the
 * host collective (a launched group). Blocks until all ranks joined. The group owns the
 * communicator (wrk_tp_group_nccl) and closes it; close the engine first. Without NCCL built:
 * UNIMPLEMENTED. */
pie_code wrk_tp_group_open_nccl(wrk_tp_group *g, const wrk_tp_rank *me, pie_status *st);
struct wrk_nccl *wrk_tp_group_nccl(wrk_tp_group *g);

/* What one rank reports of itself when the group forms (ClusterStatus, Info, piectl status). */
typedef struct wrk_tp_rank_info {
    uint32_t rank, pid;
    char device[128]; /* e.g. "cpu: 1 threads" */
    char host[65];    /* gethostname: the node or pod */
} wrk_tp_rank_info;

/* Every rank, once its shard is loaded: returns when all ranks are (no deadline: a load takes
 * what it takes; a rank that dies or fails ends the wait with UNAVAILABLE), then every rank
 * learns every rank's wrk_tp_rank_info (its own: device, this host and pid). Rank 0 goes READY
 * only after it, so no step waits for a rank that is still loading. */
pie_code wrk_tp_group_loaded(wrk_tp_group *g, const char *device, pie_status *st);

/* After wrk_tp_group_loaded: the size ranks' reports in rank order (owned by the group). */
const wrk_tp_rank_info *wrk_tp_group_ranks(const wrk_tp_group *g, uint32_t *n);

/* Rank 0: the executor hooks that broadcast steps and resets to the other ranks and make the
 * process leave (exit 3, the link closing with it) when the group fails. */
wrk_exec_group wrk_tp_group_leader_hooks(wrk_tp_group *g);
/* Ranks 1..N-1: the executor hooks for a follower (it leaves when the group fails). */
wrk_exec_group wrk_tp_group_follower_hooks(wrk_tp_group *g);

/* Rank 0, at exit, after its executor stopped: tells the other ranks to stop. Best effort (a
 * failed group has nobody to tell). */
void wrk_tp_group_stop(wrk_tp_group *g);

/* Ranks 1..N-1: runs every step rank 0 sends on x (its own executor, whose results are
 * dropped), waiting without a deadline while the group is idle. Returns PIE_OK at rank 0's
 * stop, else the group's failure (rank 0 died, a collective failed). */
pie_code wrk_tp_group_follow(wrk_tp_group *g, wrk_exec *x, pie_status *st);

void wrk_tp_group_close(wrk_tp_group *g); /* NULL is fine */

#endif
