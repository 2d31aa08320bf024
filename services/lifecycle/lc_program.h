/* lc_program.h — the program store of a lifecycle replica.
 *
 * Owns: programs on disk under <cache dir>/programs (<id>.wasm holds the module bytes, <id>.meta
 * the label and first-upload time; both written to a temporary name and renamed, so replicas
 * and concurrent uploads sharing the directory never see a partial file), validation at upload
 * by lc_wasm_module_load (which also compiles tier 0, so the first launch is warm), the size
 * limit, listing and deletion, and one loaded lc_wasm_module per recently used program kept for
 * launches (at most programs.max_loaded, the least recently used unloaded first).
 * Does not own: the upload stream (lc_api.c), instances (lc_inst.c), compilation and the native
 * code cache (wasm/). */
#ifndef LC_PROGRAM_H
#define LC_PROGRAM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "lc_wasm.h"
#include "pie/v1/lifecycle.pb-c.h"
#include "pie_metrics.h"
#include "pie_status.h"

typedef struct lc_program_store lc_program_store;

#define LC_PROGRAM_NAME_MAX 256 /* bytes of a program label (ProgramMetadata.name) */

/* Opens (creating) <dir>/programs. rt compiles and caches modules in native_dir (its
 * lc_wasm_rt_opts.cache_dir, read here only to report tiers of programs not loaded yet);
 * max_bytes is the upload size limit. */
lc_program_store *lc_program_store_create(const char *dir, const char *native_dir, lc_wasm_rt *rt,
                                          uint64_t max_bytes, pie_status *st);
void lc_program_store_destroy(lc_program_store *ps); /* NULL is fine */
/* Keeps at most n programs loaded (programs.max_loaded; 0: no bound, the default), unloading
 * the least recently loaded or launched first. */
void lc_program_store_set_max_loaded(lc_program_store *ps, size_t n);
/* Keeps the stored programs' module bytes within bytes (programs.store_size; 0: no bound, the
 * default): a put that would pass it is refused RESOURCE_EXHAUSTED. Counted over the directory,
 * so replicas sharing it share the bound (each may pass it by the uploads it has in flight). */
void lc_program_store_set_max_stored(lc_program_store *ps, uint64_t bytes);
uint64_t lc_program_max_bytes(const lc_program_store *ps);
/* Registers the store's and its runtime's gauges and counters (programs loaded, tier-1 queue,
 * compiles, the native cache), sampled at each scrape. Scrapes must end (svc_drain) before
 * lc_program_store_destroy. */
pie_code lc_program_store_metrics(lc_program_store *ps, pie_metrics *m, pie_status *st);

/* Who a put is for: the tenant that holds the program on this replica from then on (its upload,
 * or its launch that fetched it) and that tenant's bound on what it holds (quota
 * program_bytes). A tenant's hold counts the program's size against that bound until it is
 * released (lc_program_release); a program stays stored while any tenant holds it. */
typedef struct lc_program_holder {
    const char *tenant; /* NULL: nobody's */
    uint64_t max_bytes; /* 0: no bound */
} lc_program_holder;

/* Validates and stores len bytes under their SHA-256 with this label. sha256: that hash when
 * the caller computed it (the bytes are then not hashed again; it must be theirs), else NULL.
 * id_out gets the id (65 bytes), *already that the bytes were stored before. INVALID_ARGUMENT
 * (lc_wasm's reason) for a module that cannot run here, RESOURCE_EXHAUSTED past
 * programs.store_size. Slow the first time (compiles): not on an RPC thread. */
pie_code lc_program_put(lc_program_store *ps, const void *wasm, size_t len, const char *sha256,
                        const char *name, const lc_program_holder *holder, char id_out[65],
                        bool *already, pie_status *st);
/* lc_program_put that gives up (PIE_CANCELLED, the compile killed) when cancel fires: an
 * upload whose client went away. INVALID_ARGUMENT for a module beyond the complexity limits
 * (programs.max_*), RESOURCE_EXHAUSTED when the compile ran out of time or the compile queue
 * is full, UNAVAILABLE during shutdown (lc_wasm.h). */
pie_code lc_program_put_cancel(lc_program_store *ps, const void *wasm, size_t len,
                               const char *sha256, const char *name,
                               const lc_program_holder *holder, lc_wasm_cancel *cancel,
                               char id_out[65], bool *already, pie_status *st);

/* Whether program id is stored; copies its label to name (cap bytes) when name is not NULL.
 * NOT_FOUND otherwise (INVALID_ARGUMENT for an id that is not 64 lowercase hex digits). */
pie_code lc_program_lookup(lc_program_store *ps, const char *id, char *name, size_t cap,
                           pie_status *st);

/* Creates an instance of program id (lc_wasm_instance_create with opts): from the module in
 * memory, else after loading it from disk (compiling when the native cache lacks it: slow, so
 * not on an RPC thread). */
pie_code lc_program_instance(lc_program_store *ps, const char *id,
                             const lc_wasm_instance_opts *opts, lc_wasm_instance **out,
                             pie_status *st);

/* The stored bytes of program id (*bytes malloc'd, the caller frees it) and its label (cap
 * bytes; "" when it has none). NOT_FOUND when not stored here. */
pie_code lc_program_bytes(lc_program_store *ps, const char *id, uint8_t **bytes, size_t *len,
                          char *name, size_t cap, pie_status *st);

/* The stored programs ordered by id: those tenant holds here (without holders), or with tenant
 * NULL every one with the tenants holding it (ProgramInfo.holders, sorted). Free with
 * lc_program_list_free. */
pie_code lc_program_list(lc_program_store *ps, const char *tenant, Pie__V1__ProgramInfo ***out,
                         size_t *n, pie_status *st);
void lc_program_list_free(Pie__V1__ProgramInfo **list, size_t n);

/* Removes program id (disk and memory) and every hold on it; running instances keep their
 * module. */
pie_code lc_program_delete(lc_program_store *ps, const char *id, pie_status *st);
/* Releases tenant's hold on program id (*held: it had one here) and deletes the program once no
 * tenant holds it. A program stored before holds were recorded is held by nobody: only
 * lc_program_delete removes it. */
pie_code lc_program_release(lc_program_store *ps, const char *id, const char *tenant, bool *held,
                            pie_status *st);

#endif
