/* pie_tenant.h — tenants: whom a client token belongs to and what that tenant may hold.
 *
 * Owns: the tenants directory (`tenants.dir`: one YAML file per tenant, `<name>.yaml`, as
 * a Kubernetes Secret mounts its keys), its validation, token → tenant lookup, and the one
 * anonymous tenant of a cluster without tenants, and the small table services keep their
 * per-tenant counters in (pie_tenant_tab). Does not own: enforcing the quotas (the
 * lifecycle counts uploads and running instances per replica; the controller counts instances,
 * KV pages and export pages cluster-wide) or the internal service token (auth.token, svc.h).
 *
 * A tenant file:
 *     token: "s3cr3t"        # required, 16..512 bytes, unique, never the service token
 *     admin: false           # true: may list and delete every tenant's exports and instances
 *     instances: 8           # running instances, cluster-wide (0 = no limit)
 *     kv_pages: 4096         # KV pages its instances hold at once, cluster-wide (0 = no limit)
 *     export_pages: 512      # pages in its persistent exports (0 = controller exports.max_pages)
 *     upload_bytes: 64MiB    # largest program it may upload (0 = programs.max_size only)
 *     program_bytes: 1GiB    # programs it holds stored on a replica (0 = programs.store_size only)
 */
#ifndef PIE_TENANT_H
#define PIE_TENANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pie_status.h"

#define PIE_TENANT_NAME_MAX 63 /* [a-z0-9_-], starting with a letter or digit */
#define PIE_TENANT_ANONYMOUS "anonymous"

typedef struct pie_tenant_quota {
    uint32_t instances;    /* 0 = no limit */
    uint32_t kv_pages;     /* 0 = no limit */
    uint32_t export_pages; /* 0 = the controller's exports.max_pages */
    uint64_t upload_bytes; /* 0 = no tenant limit */
    uint64_t program_bytes; /* 0 = no tenant limit */
} pie_tenant_quota;

typedef struct pie_tenant {
    char name[PIE_TENANT_NAME_MAX + 1];
    char *bearer; /* "Bearer <token>", as the authorization header carries it */
    size_t bearer_len;
    bool admin;
    pie_tenant_quota quota;
} pie_tenant;

typedef struct pie_tenants {
    pie_tenant *v; /* sorted by name */
    size_t n;
} pie_tenants;

/* The tenant of every call when no tenants are configured: no quotas of its own, admin (it is
 * the only tenant, so it sees everything there is). */
extern const pie_tenant pie_tenant_anonymous;

/* Loads every `<name>.yaml` regular file (symlinks followed; names starting with '.' skipped)
 * of dir into *out. INVALID_ARGUMENT naming the file for a bad name, an unknown key, a missing
 * or short token, a token used twice or equal to service_token (the internal token must never
 * be a client's); NOT_FOUND when dir cannot be opened; an empty directory is an error too
 * (no client could call). On failure *out is empty. */
pie_code pie_tenants_load(const char *dir, const char *service_token, pie_tenants *out,
                          pie_status *st);
void pie_tenants_free(pie_tenants *t);

/* The tenant whose "Bearer <token>" equals the header value, or NULL. Compares against every
 * tenant in constant time per tenant, so timing does not tell how much of a token matched. */
const pie_tenant *pie_tenants_find(const pie_tenants *t, const char *value, size_t len);

/* Constant-time equality of two byte strings (bearer tokens): the time depends on the lengths,
 * never on where they differ. */
bool pie_secret_eq(const char *a, size_t alen, const char *b, size_t blen);

/* Whether name is a valid tenant name (PIE_TENANT_NAME_MAX bytes of [a-z0-9_-], the first a
 * letter or digit). */
bool pie_tenant_name_valid(const char *name);

/* A tenant by name, or NULL. */
const pie_tenant *pie_tenants_by_name(const pie_tenants *t, const char *name);

/* What a service counts per tenant at this moment (uploads in progress, HTTP requests waiting
 * or running): a small table of entries keyed by tenant name, searched linearly (it holds the
 * tenants active right now). Each entry is entry_size bytes and starts with its name, a
 * char[PIE_TENANT_NAME_MAX + 1]; entries move when one is added or removed, so hold none across
 * those. Not locked: the owner's lock guards it. */
typedef struct pie_tenant_tab {
    void *v;
    size_t n, entry_size;
} pie_tenant_tab;

#define PIE_TENANT_TAB_INIT(type) \
    { .v = NULL, .n = 0, .entry_size = sizeof(type) }

/* The entry of name, or NULL. */
void *pie_tenant_tab_find(const pie_tenant_tab *t, const char *name);
/* The entry of name, appended zeroed (but for its name) when absent; NULL when out of memory. */
void *pie_tenant_tab_get(pie_tenant_tab *t, const char *name);
/* Removes an entry (the last one takes its place). */
void pie_tenant_tab_remove(pie_tenant_tab *t, void *entry);
void pie_tenant_tab_free(pie_tenant_tab *t);

#endif
