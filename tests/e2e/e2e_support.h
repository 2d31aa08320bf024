/* e2e_support.h — what the end-to-end inferlet tests share: a three-service cluster on
 * loopback, the public Lifecycle API (upload a .wasm, run it with arguments and messages,
 * collect its messages, output and exit status), and an in-process reference engine
 * (greedy decoding and log-probabilities straight from eng.h on the same model, tokens from
 * the same tokenizer.json) that the inferlets' results are compared against.
 *
 * Owns: nothing between tests; every test starts its own cluster.
 * Does not own: the services (tests/support/pie_proc.h starts them), assertions on outcomes
 * (each test file). */
#ifndef E2E_SUPPORT_H
#define E2E_SUPPORT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pie/v1/controller.pb-c.h"
#include "pie/v1/lifecycle.pb-c.h"
#include "pie_proc.h"
#include "rpc.h"

/* small-f32, not tiny-f32: tiny's tied random embeddings make greedy decoding repeat the last
 * prompt token whatever came before it, which would hide context bugs from these tests. */
#define E2E_MODEL      "small-f32"
#define E2E_PAGE       16 /* the worker's pool.kv_page_size default */
#define E2E_MAX_TOKENS 512

/* ---- cluster ----------------------------------------------------------------------------- */

typedef struct e2e_cluster {
    pie_proc *ctl, *wrk, *lc;
    rpc_channel *ch; /* to pie-lifecycle */
    char *cache_dir;
} e2e_cluster;

/* Starts controller, CPU worker (E2E_MODEL) and lifecycle; asserts on failure. */
void e2e_cluster_start(e2e_cluster *c);
/* The same, with lc_env (NULL-terminated "PIE_KEY=value" settings: quotas, HTTP allowlist, ...)
 * appended to pie-lifecycle's environment; pie_proc strips the test's own PIE_* variables, so
 * settings must be passed here. At most 11. */
void e2e_cluster_start_env(e2e_cluster *c, const char *const *lc_env);
/* e2e_cluster_start_env whose channel to the lifecycle (c->ch) sends token (NULL: none), for a
 * lifecycle that requires one (auth.token, or a tenant's with tenants.dir). */
void e2e_cluster_start_token(e2e_cluster *c, const char *const *lc_env, const char *token);
/* e2e_cluster_start_token whose worker also gets wrk_env (NULL-terminated "PIE_KEY=value"
 * settings, at most 9, e.g. PIE_TP_SIZE=2; NULL: none). */
void e2e_cluster_start_full(e2e_cluster *c, const char *const *wrk_env, const char *const *lc_env,
                            const char *token);
/* e2e_cluster_start_full whose controller also gets ctl_env (NULL-terminated "PIE_KEY=value";
 * NULL: none), e.g. PIE_WORKER_HEARTBEAT=250ms. */
void e2e_cluster_start_ctl(e2e_cluster *c, const char *const *ctl_env, const char *const *wrk_env,
                           const char *const *lc_env, const char *token);
/* The lifecycle part of e2e_cluster_start_full, for a test that started c->ctl (and its
 * workers) itself: a pie-lifecycle linked to c->ctl with a cache directory of its own and
 * lc_env, c->ch to it (sending token), waiting until it knows a model. */
void e2e_cluster_start_lifecycle(e2e_cluster *c, const char *const *lc_env, const char *token);
/* A CPU worker serving E2E_MODEL that links to the controller named by ctl_env
 * ("PIE_CONTROLLER_ADDRESS=host:port"); asserts on failure. */
pie_proc *e2e_worker_start(const char *ctl_env);
/* The same with extra settings (NULL-terminated "PIE_KEY=value", at most 9; NULL: none). */
pie_proc *e2e_worker_start_env(const char *ctl_env, const char *const *extra);
/* The same worker, started without waiting for it to serve (a rank of a group that forms only
 * once its other ranks joined; pie_proc_wait_ready later). */
pie_proc *e2e_worker_spawn_env(const char *ctl_env, const char *const *extra);
/* Stops all three (each must exit 0) and frees. */
void e2e_cluster_stop(e2e_cluster *c);

/* Controller.ClusterStatus on ctl (a channel to the controller), waiting at most timeout_ms;
 * NULL while it does not answer. Free with rpc_msg_free. */
Pie__V1__ClusterStatusResponse *e2e_cluster_status(rpc_channel *ctl, int64_t timeout_ms);
/* Polls ClusterStatus until worker `group` is the only one linked (asserts within 60 s);
 * returns its memory policy. */
Pie__V1__MemoryPolicy e2e_wait_worker(rpc_channel *ctl, const char *group);
/* e2e_wait_worker, then until c's lifecycle lists a model again (its Session learns of a new
 * worker after the controller does: a Run in between fails "no model is served now"). */
Pie__V1__MemoryPolicy e2e_wait_serving(e2e_cluster *c, rpc_channel *ctl, const char *group);
/* Stops c's worker (it must exit 0; `what` names it in the failure) and starts one with env
 * (e2e_worker_start_env) in its place. */
void e2e_worker_replace(e2e_cluster *c, const char *what, const char *const *env);

/* ---- Lifecycle API ------------------------------------------------------------------------ */

/* Uploads PIE_INFERLETS_DIR/<name>.wasm; returns the program id (caller frees). */
char *e2e_upload(e2e_cluster *c, const char *name);
/* Uploads the .wasm at path under the program name `name`; returns the program id. */
char *e2e_upload_path(e2e_cluster *c, const char *path, const char *name);
/* The start of an upload, for tests of what the server refuses: opens UploadProgram (deadline
 * timeout_ms), sends the metadata declaring size_bytes and then bytes[0, len) in chunks (it
 * stops early if the server already ended the call) and leaves the stream open (half-close
 * it, or e2e_upload_end). */
rpc_stream *e2e_upload_begin(e2e_cluster *c, const char *name, uint64_t size_bytes,
                             const uint8_t *bytes, size_t len, int64_t timeout_ms);
/* Half-closes s, drains it and destroys it: the upload's final status (*st). */
pie_code e2e_upload_end(rpc_stream *s, pie_status *st);

typedef struct e2e_run {
    char **msgs; /* messages the inferlet sent, NUL-terminated copies */
    size_t *msg_lens;
    size_t n_msgs;
    char *out, *err; /* stdout / stderr, NUL-terminated */
    size_t out_len, err_len;
    bool exited;
    uint32_t status_code; /* InstanceExit.status.code */
    char *status_msg;
    int32_t exit_code;
    const e2e_cluster *cluster; /* e2e_run_program's: its services' logs go with a failure */
} e2e_run;

/* Run: launches program_id with args (NULL-terminated), sends the messages in (NULL-terminated
 * or NULL), closes input and collects everything until the exit status. Asserts that the call
 * itself works; the instance's outcome is in *r. */
void e2e_run_program(e2e_cluster *c, const char *program_id, const char *const *args,
                     const char *const *in, e2e_run *r);
/* The two halves of e2e_run_program, for instances that run while the caller does something
 * else: e2e_run_open launches, sends in and closes input without reading; e2e_run_collect reads
 * the stream to its end into *r and destroys it. */
rpc_stream *e2e_run_open(e2e_cluster *c, const char *program_id, const char *const *args,
                         const char *const *in);
void e2e_run_collect(rpc_stream *s, e2e_run *r);
/* Launch (detached) of program_id with args as c->ch's caller: the instance id, or 0 when the
 * call ends with another code than OK; asserts that the code is want (*st gets the status). */
uint64_t e2e_launch(e2e_cluster *c, const char *program_id, const char *const *args, pie_code want,
                    pie_status *st);
/* Terminate of id: its status code. */
pie_code e2e_terminate(e2e_cluster *c, uint64_t id, pie_status *st);
/* The instance id as ListInstances shows it to c->ch's caller (NULL: not listed); free with
 * rpc_msg_free on *resp. */
const Pie__V1__InstanceInfo *e2e_instance(e2e_cluster *c, uint64_t id,
                                          Pie__V1__ListInstancesResponse **resp);

/* Waits (up to 20 s, else asserts) until instance id holds at least bytes of linear memory, as
 * ListInstances shows it to c->ch's caller. */
void e2e_wait_memory(e2e_cluster *c, uint64_t id, uint64_t bytes);

/* Asserts that the instance ended with OK and exit code 0 (the message shows its stderr). */
void e2e_assert_success(const e2e_run *r, const char *what);
void e2e_run_free(e2e_run *r);

/* ---- the same programs on two workers ----------------------------------------------------- */

#define E2E_N_RUNS    5
#define E2E_TC_PROMPT "The quick brown fox jumps over the lazy dog."

/* text_completion's arguments in run 0: 32 tokens after E2E_TC_PROMPT, eos ignored. */
extern const char *const e2e_tc_args[];

/* Uploads text_completion, parallel_generation and prefix_caching into ids (free each). */
void e2e_upload_programs(e2e_cluster *c, char *ids[3]);
/* Runs the programs of e2e_upload_programs, each asserted to succeed: text completion of
 * E2E_TC_PROMPT; parallel generation (a fork into 3); prefix caching of a prefix named
 * prefix_name: miss (export), hit (import), unexport. */
void e2e_run_programs(e2e_cluster *c, char *const ids[3], const char *prefix_name,
                      e2e_run out[E2E_N_RUNS]);
/* Expects got's messages to be want's byte for byte; failures name what and the two sides
 * (got_side, want_side: "tp 2", "policy gpu"). */
void e2e_expect_same_msgs(const e2e_run *got, const e2e_run *want, const char *what,
                          const char *got_side, const char *want_side);

/* ---- a memory policy against policy gpu (test_swap.c, test_offload.c) ------------------------ */

typedef struct e2e_vs_gpu {
    e2e_cluster c;
    rpc_channel *ctl; /* to the controller */
    char *ids[3];     /* e2e_upload_programs */
    e2e_run gpu[E2E_N_RUNS], got[E2E_N_RUNS];
} e2e_vs_gpu;

/* Starts a cluster whose worker (group "gpu") runs e2e_run_programs, then replaces it by one
 * started with env (group `group`, which must report memory policy `policy`) that runs them
 * again (both with the prefix "<group>-prefix"); expects each run's messages to be the gpu worker's
 * byte for byte and prefix caching to miss, then hit. The cluster stays up for the caller's checks
 * of the second worker; e2e_vs_gpu_end stops it. */
void e2e_vs_gpu_run(e2e_vs_gpu *v, const char *group, const char *const *env,
                    Pie__V1__MemoryPolicy policy);
/* The same against a gpu worker started with gpu_env (which must set PIE_WORKER_GROUP_ID=gpu;
 * e.g. a tensor-parallel group, to compare policies at the same tp). */
void e2e_vs_gpu_run_at(e2e_vs_gpu *v, const char *const *gpu_env, const char *group,
                       const char *const *env, Pie__V1__MemoryPolicy policy);
void e2e_vs_gpu_end(e2e_vs_gpu *v);
/* The value of the metric series `series` (its whole name with labels) on p's metrics port;
 * asserts that it is there. */
double e2e_metric(const pie_proc *p, const char *series);
/* Polls ClusterStatus (the only worker's heartbeat) until it reports swap traffic both ways;
 * asserts within 60 s. */
void e2e_wait_swap_traffic(rpc_channel *ctl);

/* ---- reference engine --------------------------------------------------------------------- */

typedef struct e2e_ref e2e_ref;

e2e_ref *e2e_ref_open(void);
void e2e_ref_close(e2e_ref *r);
/* BOS (if the model has one) followed by the tokens of each part, encoded separately (as the
 * SDK's ctx_fill does part by part, special tokens allowed). Returns the count. */
size_t e2e_ref_prompt(e2e_ref *r, const char *const *parts, size_t n_parts, uint32_t *out);
/* Greedy decoding of up to max_new tokens after prompt; stops before any of the model's eos
 * tokens (config.json eos_token_id) unless ignore_eos. Returns the count written to out. */
size_t e2e_ref_greedy(e2e_ref *r, const uint32_t *prompt, size_t n_prompt, size_t max_new,
                      bool ignore_eos, uint32_t *out);
/* Raw bytes of the tokens (malloc'd, NUL-terminated, *len set). */
char *e2e_ref_text(e2e_ref *r, const uint32_t *toks, size_t n, size_t *len);
/* Sum of log p(toks[i] | prompt, toks[..i]) under the model. */
double e2e_ref_logprob(e2e_ref *r, const uint32_t *prompt, size_t n_prompt, const uint32_t *toks,
                       size_t n);
/* Token ids of text (no BOS), for comparisons with parsed output. */
size_t e2e_ref_encode(e2e_ref *r, const char *text, uint32_t *out, size_t cap);

#endif
