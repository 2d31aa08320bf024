/* lc_store.h — this replica's side of the controller's cluster storage (controller.proto:
 * GetTokenizer, PutProgram, GetProgram, DropProgram), so that a replica needs neither model
 * files nor the uploads other replicas received (docs/deploy.md, "Programs and tokenizers
 * across replicas").
 *
 * Owns: fetching a tokenizer.json by hash (for lc_tokreg, which checks and caches it),
 * fetching a program this replica lacks into its program store (checked against its id before
 * it is stored), putting an uploaded program into the registry, dropping one cluster-wide, the
 * SessionEvent program_dropped (the local copy goes), and the re-put of every local program
 * after each (re)connect of the Session — a restarted controller starts with an empty registry
 * and learns the programs back from the replicas that hold them.
 * Does not own: the Session and its channel (lc_session.c), the program store (lc_program.c),
 * when to fetch (lc_api.c: a launch of an unknown id; lc_tokreg.c: a tokenizer not on the
 * path). Every call here blocks on the network: never on a completion-queue thread. */
#ifndef LC_STORE_H
#define LC_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "lc_program.h"
#include "lc_session.h"
#include "pie_metrics.h"
#include "pie/v1/controller.pb-c.h"
#include "pie_status.h"

typedef struct lc_store lc_store;

typedef struct lc_store_config {
    bool programs;                /* programs.registry: share programs through the controller */
    uint64_t max_program_bytes;   /* largest program fetched (programs.max_size) */
    uint64_t max_tokenizer_bytes; /* largest tokenizer.json fetched */
    int64_t call_timeout_ms;      /* deadline of one call to the controller */
} lc_store_config;

/* Registers with the session for its (re)connects and program_dropped events; starts the
 * re-put thread when cfg->programs. Before lc_session_start. */
lc_store *lc_store_create(const lc_store_config *cfg, lc_session *session,
                          lc_program_store *programs, pie_metrics *metrics, pie_status *st);
/* Stops the re-put thread (waits for a re-put in progress): no call on the Session's channel
 * after it. Before lc_session_destroy. Idempotent; NULL is fine. */
void lc_store_stop(lc_store *s);
/* After lc_session_destroy (its thread calls the hooks until then), before
 * lc_program_store_destroy. NULL is fine. */
void lc_store_destroy(lc_store *s);

/* Whether programs are shared through the controller (lc_store_config.programs). */
bool lc_store_programs_enabled(const lc_store *s);

/* The tokenizer.json with this hash, from the controller: *bytes (malloc'd, the caller frees
 * it) and *len, NOT yet checked against the hash (the caller does). UNAVAILABLE (Session not
 * connected, controller unreachable), NOT_FOUND (no linked worker supplied it),
 * RESOURCE_EXHAUSTED (larger than max_tokenizer_bytes). Signature of lc_tokreg_fetch_fn. */
pie_code lc_store_fetch_tokenizer(void *store, const char *sha256, uint8_t **bytes, size_t *len,
                                  pie_status *st);

/* Fetches program id from the registry, checks that its bytes hash to id, and stores it in the
 * program store (validating and compiling it, as an upload does) as holder's (the launching
 * tenant's: it counts against its quota program_bytes). NOT_FOUND naming both places when the
 * registry lacks it; DATA_LOSS when the bytes hash to another id; RESOURCE_EXHAUSTED past
 * programs.store_size or the holder's quota. */
pie_code lc_store_fetch_program(lc_store *s, const char *id, const lc_program_holder *holder,
                                pie_status *st);

/* Puts local program id into the registry, held by tenants[0..n_tenants) there: a hold when
 * the registry has it already (no bytes sent), else its bytes. */
pie_code lc_store_push_program(lc_store *s, const char *id, const char *const *tenants,
                               size_t n_tenants, pie_status *st);

/* Drops id from the registry and so from every connected replica; *was: the registry held it.
 * With tenant (not NULL or ""), releases only that tenant's hold on every replica and in the
 * registry, which keeps the program (*was: it holds it; *held: tenant held it there). held may
 * be NULL. */
pie_code lc_store_drop_program(lc_store *s, const char *id, const char *tenant, bool *was,
                               bool *held, pie_status *st);

/* The exports of tenant (all: every tenant's), from the controller: *out is freed with
 * rpc_msg_free. UNAVAILABLE while the controller is not connected. Blocks. */
pie_code lc_store_list_exports(lc_store *s, const char *tenant, bool all,
                               Pie__V1__ListTenantExportsResponse **out, pie_status *st);
/* Removes tenant's export name in the controller; *pages gets its size. Blocks. */
pie_code lc_store_delete_export(lc_store *s, const char *tenant, const char *name,
                                uint32_t *pages, pie_status *st);

#endif
