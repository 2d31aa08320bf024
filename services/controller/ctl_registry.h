/* ctl_registry.h — the controller's cluster storage: tokenizer.json files and programs, by
 * SHA-256, for lifecycle replicas that hold neither (controller.proto: GetTokenizer,
 * PutProgram, GetProgram, DropProgram; docs/deploy.md, "Programs and tokenizers across
 * replicas").
 *
 * Owns: tokenizers (one copy per hash, counted by the linked worker groups that supplied it and
 * freed when the last of them leaves), programs (at most a configured number of bytes, each
 * held by the tenants whose replicas put it; room is made from programs nobody holds, then
 * from the tenant holding the most bytes), their metrics, and one mutex of its own: the
 * RPC handlers use the registry without the core's mutex, so bulk copies never hold up the
 * control layer.
 * Does not own: hashing (callers check that bytes hash to their id before putting them), the
 * RPCs (ctl_cluster.c), telling replicas about a drop (ctl_core_program_dropped). */
#ifndef CTL_REGISTRY_H
#define CTL_REGISTRY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pie_metrics.h"
#include "pie_status.h"
#include "pie_tenant.h"

typedef struct ctl_registry ctl_registry;

/* program_bytes_max: most bytes of programs kept (programs.registry_size). metrics may be NULL;
 * if not, it must outlive the registry. */
ctl_registry *ctl_registry_create(uint64_t program_bytes_max, pie_metrics *metrics, pie_status *st);
void ctl_registry_destroy(ctl_registry *r); /* NULL is fine */

/* A part of a stored object, copied out: data[0..len) from offset of an object of size bytes. */
typedef struct ctl_registry_chunk {
    uint8_t *data; /* malloc'd (NULL when len is 0); the caller frees it */
    size_t len;
    uint64_t size;
    char *name; /* programs: the label, malloc'd; NULL for tokenizers */
} ctl_registry_chunk;
void ctl_registry_chunk_free(ctl_registry_chunk *c);

/* ---- tokenizers ------------------------------------------------------------------------------ */

/* A linked worker group supplies the tokenizer.json with this hash (checked by the caller).
 * Takes bytes (malloc'd): kept when the hash is new, freed otherwise; counts one reference. */
pie_code ctl_registry_tokenizer_add(ctl_registry *r, const char *sha256, uint8_t *bytes, size_t len,
                                    pie_status *st);
/* The group that added it left: drops one reference; the last frees the bytes. */
void ctl_registry_tokenizer_release(ctl_registry *r, const char *sha256);
/* Copies up to max_bytes from offset. NOT_FOUND (no linked group supplied it), INVALID_ARGUMENT
 * (offset beyond the size). */
pie_code ctl_registry_tokenizer_read(ctl_registry *r, const char *sha256, uint64_t offset,
                                     size_t max_bytes, ctl_registry_chunk *out, pie_status *st);

/* ---- programs -------------------------------------------------------------------------------- */

uint64_t ctl_registry_program_bytes_max(const ctl_registry *r);

/* Stores a program (bytes malloc'd, taken: kept or freed) under id with this label, held by
 * tenants[0..n_tenants) (valid tenant names; none: held by nobody). Room is made in this order:
 * the least recently used program nobody holds; else, of the tenant holding the most bytes
 * (the tenants putting count len as theirs; ties: the one whose oldest program is oldest), its
 * least recently used program: evicted, or only that tenant's hold on it when another tenant
 * holds it too. So a tenant's puts never evict a program of a tenant that holds fewer bytes
 * than the putter would. *already: the registry held it (tenants are added to its holders,
 * its label and recency refreshed). RESOURCE_EXHAUSTED when len alone exceeds the bound, or
 * when room could only be made by making a putting tenant the largest holder while it holds
 * nothing else (nothing is evicted then; bytes are freed). */
pie_code ctl_registry_program_put(ctl_registry *r, const char *id, const char *name, uint8_t *bytes,
                                  size_t len, const char *const *tenants, size_t n_tenants,
                                  bool *already, pie_status *st);
/* Adds tenants to the holders of a stored program; a use. NOT_FOUND when it is not stored. */
pie_code ctl_registry_program_hold(ctl_registry *r, const char *id, const char *const *tenants,
                                   size_t n_tenants, pie_status *st);
/* Copies up to max_bytes from offset (0: size and label only) and counts as a use. NOT_FOUND,
 * INVALID_ARGUMENT (offset beyond the size). */
pie_code ctl_registry_program_read(ctl_registry *r, const char *id, uint64_t offset,
                                   size_t max_bytes, ctl_registry_chunk *out, pie_status *st);
/* Whether a program is stored; not a use (its eviction order stays). */
bool ctl_registry_program_has(ctl_registry *r, const char *id);
/* Releases tenant's hold on a program, which stays stored (first to go once nobody holds it);
 * returns whether it is stored, *held whether tenant held it. */
bool ctl_registry_program_release(ctl_registry *r, const char *id, const char *tenant, bool *held);
/* Removes a program; returns whether it was stored. */
bool ctl_registry_program_drop(ctl_registry *r, const char *id);

#endif
