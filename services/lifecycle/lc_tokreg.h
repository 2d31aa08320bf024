/* lc_tokreg.h — the lifecycle's tokenizer registry: one loaded tokenizer per model tokenizer.
 *
 * Owns: finding a tokenizer.json by the SHA-256 the worker announced
 * (TokenizerInfo.tokenizer_sha256) — on the tokenizer path (':'-separated directories, each a
 * model directory or a directory of model directories), else in its disk cache
 * (<runtime.cache_dir>/tokenizers/<sha256>.json), else fetched from the cluster through a
 * callback (lc_store: Controller.GetTokenizer) and kept in that cache — checking that the bytes
 * hash to it whatever their source (a cached or fetched file that does not is refused, and a
 * bad cache file is removed), loading it once (services/common/tok) and keeping it until the
 * registry is destroyed, so pointers handed out stay valid and lock-free to use (a loaded tok
 * is immutable). Also the prefetch thread: the tokenizers of the served models are loaded
 * (fetched) as soon as the model list names them, failures retried with backoff, so that the
 * replica reports ready only once tokenization works (lc_tokreg_models_ready).
 * Does not own: which model names which tokenizer (the Session's ModelsChanged), the transfer
 * itself (the fetch callback). No lock is held during file or network I/O. */
#ifndef LC_TOKREG_H
#define LC_TOKREG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pie/v1/controller.pb-c.h"
#include "pie_status.h"
#include "tok.h"

typedef struct lc_tokreg lc_tokreg;

/* Fetches the tokenizer.json with this hash from the cluster, blocking: *bytes (malloc'd, the
 * registry frees it) and *len. The registry checks the hash. */
typedef pie_code (*lc_tokreg_fetch_fn)(void *ctx, const char *sha256, uint8_t **bytes, size_t *len,
                                       pie_status *st);

typedef struct lc_tokreg_config {
    const char *path;         /* tokenizer.path; NULL or "" = none */
    const char *cache_dir;    /* where fetched files are kept (created); NULL or "" = not kept */
    lc_tokreg_fetch_fn fetch; /* NULL: never fetch */
    void *fetch_ctx;
    /* The prefetch thread loaded a tokenizer (called on that thread, no lock held): readiness
     * may have changed. NULL: nothing to tell. */
    void (*loaded)(void *ctx);
    void *loaded_ctx;
} lc_tokreg_config;

/* Strings are copied. */
lc_tokreg *lc_tokreg_create(const lc_tokreg_config *cfg, pie_status *st);
/* Stops the prefetch thread (waits for a fetch in progress); no callback runs after it.
 * Idempotent. */
void lc_tokreg_stop(lc_tokreg *r);
/* After every user of its tokenizers is gone (stops the prefetch thread if still running).
 * NULL is fine. */
void lc_tokreg_destroy(lc_tokreg *r);

/* The tokenizer whose tokenizer.json has this lowercase hex SHA-256 (64 characters). The first
 * lookup of a hash scans the path (hashing each tokenizer.json once per registry), then reads
 * the cache, then fetches: slow, blocking. Later ones are a locked table lookup. Concurrent
 * lookups of one hash wait for the one loading it. Thread-safe. Errors: FAILED_PRECONDITION
 * (not on the path, and no fetch: the message lists the directories searched), the fetch's
 * error (UNAVAILABLE, NOT_FOUND ...), DATA_LOSS (fetched bytes of another hash), or
 * tok_load's error. A failure is remembered for a short while (lookups fail the same way
 * without retrying), then retried. */
pie_code lc_tokreg_get(lc_tokreg *r, const char *sha256_hex, const tok **out, pie_status *st);
/* Whether the tokenizer with this hash is loaded (never blocks). "" counts as loaded: a model
 * without a tokenizer (null backend) needs none. */
bool lc_tokreg_loaded(lc_tokreg *r, const char *sha256_hex);

/* The models now served (NULL: none): the prefetch thread loads their tokenizers. Never blocks
 * (callable under the Session's lock). */
void lc_tokreg_want_models(lc_tokreg *r, const Pie__V1__ModelsChanged *mc);
/* Whether every model of mc has its tokenizer loaded (never blocks). */
bool lc_tokreg_models_ready(lc_tokreg *r, const Pie__V1__ModelsChanged *mc);

#endif
