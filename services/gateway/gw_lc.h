/* gw_lc.h — the gateway as a gRPC client of the lifecycle replicas.
 *
 * Owns: one channel to the lifecycle target (round-robin over every address it resolves to,
 * skipping replicas whose pie.v1.Lifecycle health is not SERVING), the model list (ListModels,
 * cached briefly), the built-in openai_chat program (its bytes and content id; uploaded the
 * first time a launch finds the cluster without it) and Runs of it: launch, the prompt as the
 * first message, then the inferlet's messages until its exit. Every call carries the client's
 * own `authorization` header, so the lifecycle authenticates the client, not the gateway.
 * Does not own: OpenAI's JSON (gw_openai.c), HTTP (gw_http.c). */
#ifndef GW_LC_H
#define GW_LC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pie_status.h"
#include "rpc.h"

typedef struct gw_lc_opts {
    const char *target;        /* gRPC target of the lifecycle: "host:port", "dns:///svc:port",
                                  "ipv4:127.0.0.1:1,127.0.0.1:2" */
    const char *program_path;  /* openai_chat.wasm */
    int64_t call_timeout_ms;   /* ListModels / UploadProgram deadline */
    int64_t run_timeout_ms;    /* a whole Run (≤0: none) */
    int64_t models_cache_ms;   /* how long a ListModels answer is reused */
    uint64_t max_message_bytes;
    /* TLS towards the lifecycle (svc_tls_client: tls.ca_file and the gateway's certificate);
     * NULL ca: plaintext. Borrowed until gw_lc_create returns. */
    const char *tls_ca_pem, *tls_cert_pem, *tls_key_pem;
} gw_lc_opts;

typedef struct gw_model {
    char *name, *description;
    char *chat_template; /* "" when the model has none */
    char *bos_token, *eos_token;
    uint32_t max_context_tokens;
} gw_model;

typedef struct gw_lc gw_lc;

/* Reads the program, creates the channel (connects lazily). */
gw_lc *gw_lc_create(const gw_lc_opts *o, pie_status *st);
void gw_lc_destroy(gw_lc *lc);

/* The content id of the built-in program (lowercase hex SHA-256). */
const char *gw_lc_program_id(const gw_lc *lc);

/* The models the cluster serves (ListModels with the client's authorization value `auth`, e.g.
 * "Bearer sk-…", or NULL). *models is a malloc'd copy (gw_models_free). */
pie_code gw_lc_models(gw_lc *lc, const char *auth, gw_model **models, size_t *n, pie_status *st);
void gw_models_free(gw_model *models, size_t n);

/* One model by name into *out (a copy: gw_model_free), from the cached list when it is
 * fresh. NOT_FOUND when the cluster does not serve it. */
pie_code gw_lc_model(gw_lc *lc, const char *auth, const char *name, gw_model *out,
                     pie_status *st);
void gw_model_free(gw_model *m);

/* A Run of the built-in program. */
typedef struct gw_run gw_run;

/* Launches the program on `model` with args and sends prompt as its first message, then closes
 * the input. A cluster that lacks the program gets it uploaded once (with the same auth), and
 * the launch is retried. On failure NULL and st says why (the lifecycle's code). */
gw_run *gw_run_start(gw_lc *lc, const char *auth, const char *model, char *const *args,
                     size_t n_args, const char *prompt, size_t prompt_len, pie_status *st);

typedef enum gw_run_result {
    GW_RUN_MESSAGE, /* *msg / *len: one message of the inferlet (malloc'd) */
    GW_RUN_EXIT,    /* the instance ended (or the Run failed): st OK only for a clean exit 0 */
    GW_RUN_TIMEOUT, /* nothing within timeout_ms; call again */
} gw_run_result;

/* The next message of the inferlet, waiting up to timeout_ms (<0: forever). On GW_RUN_EXIT, st
 * describes how it ended: OK for exit code 0; otherwise the instance's status and the tail of
 * its stderr, or the Run's own failure. */
gw_run_result gw_run_next(gw_run *r, int64_t timeout_ms, char **msg, size_t *len,
                          pie_status *st);

/* Cancels the Run (thread-safe): the lifecycle terminates the instance. */
void gw_run_cancel(gw_run *r);
void gw_run_free(gw_run *r);

/* grpc.health.v1 Check of "pie.v1.Lifecycle" through the channel (some SERVING replica). */
pie_code gw_lc_health(gw_lc *lc, int64_t timeout_ms, rpc_health_status *out, pie_status *st);

/* How many uploads of the program this gateway made (metrics, tests). */
uint64_t gw_lc_uploads(const gw_lc *lc);

#endif
