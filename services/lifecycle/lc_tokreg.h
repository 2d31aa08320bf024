/* lc_tokreg.h — the lifecycle's tokenizer registry: one loaded tokenizer per model tokenizer.
 *
 * Owns: finding a model's tokenizer.json in the model store (lc_host_config.tokenizer_path:
 * ':'-separated directories, each a model directory or a directory of model directories),
 * matching it by the SHA-256 the worker announced (TokenizerInfo.tokenizer_sha256), loading it
 * once (services/common/tok) and keeping it until the registry is destroyed, so pointers handed
 * out stay valid and lock-free to use (a loaded tok is immutable).
 * Does not own: which model names which tokenizer (lc_host_local.c, from ModelsChanged). */
#ifndef LC_TOKREG_H
#define LC_TOKREG_H

#include "pie_status.h"
#include "tok.h"

typedef struct lc_tokreg lc_tokreg;

/* path may be NULL or empty (no tokenizer is ever found). Copied. */
lc_tokreg *lc_tokreg_create(const char *path, pie_status *st);
/* After every user of its tokenizers is gone. NULL is fine. */
void lc_tokreg_destroy(lc_tokreg *r);

/* The tokenizer whose tokenizer.json has this lowercase hex SHA-256 (64 characters). The first
 * lookup of a hash scans the path (hashing each tokenizer.json once per registry) and loads it;
 * later ones are a locked table lookup. Thread-safe. Errors: PIE_FAILED_PRECONDITION (no
 * tokenizer.json with that hash under the path: the message lists the directories searched),
 * or tok_load's error. A failure is remembered: later lookups of that hash fail the same way
 * without scanning again. */
pie_code lc_tokreg_get(lc_tokreg *r, const char *sha256_hex, const tok **out, pie_status *st);

#endif
