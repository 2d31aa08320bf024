/* pie_tenant.c — see pie_tenant.h. Each tenant file goes through pie_config's loader with a
 * schema of its own, so its syntax, units and error messages are those of every config file. */
#include "pie_tenant.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "pie_config.h"

#define TENANT_TOKEN_MIN 16
#define TENANT_TOKEN_MAX 512
#define TENANTS_MAX      4096

const pie_tenant pie_tenant_anonymous = {.name = PIE_TENANT_ANONYMOUS, .admin = true};

typedef struct tenant_file {
    char *token;
    bool admin;
    uint32_t instances, kv_pages, export_pages;
    uint64_t upload_bytes, program_bytes;
} tenant_file;

static const pie_config_field tenant_fields[] = {
    {"token", PIE_CFG_STRING, PIE_CONFIG_AT(tenant_file, token),
     .flags = PIE_CONFIG_REQUIRED | PIE_CONFIG_SECRET, .doc = "the tenant's bearer token"},
    {"admin", PIE_CFG_BOOL, PIE_CONFIG_AT(tenant_file, admin), .def = "false",
     .doc = "may list and delete every tenant's exports and instances"},
    {"instances", PIE_CFG_UINT, PIE_CONFIG_AT(tenant_file, instances), .def = "0",
     .doc = "running instances, cluster-wide (0 = no limit)"},
    {"kv_pages", PIE_CFG_UINT, PIE_CONFIG_AT(tenant_file, kv_pages), .def = "0",
     .doc = "KV pages its instances hold at once, cluster-wide (0 = no limit)"},
    {"export_pages", PIE_CFG_UINT, PIE_CONFIG_AT(tenant_file, export_pages), .def = "0",
     .doc = "pages in its persistent exports (0 = the controller's exports.max_pages)"},
    {"upload_bytes", PIE_CFG_SIZE, PIE_CONFIG_AT(tenant_file, upload_bytes), .def = "0",
     .doc = "largest program it may upload (0 = no tenant limit)"},
    {"program_bytes", PIE_CFG_SIZE, PIE_CONFIG_AT(tenant_file, program_bytes), .def = "0",
     .doc = "bytes of the programs it holds stored on a lifecycle replica: those it uploaded "
            "there and those its launches fetched there (0 = no tenant limit)"},
};
static const pie_config_schema tenant_schema = PIE_CONFIG_SCHEMA(tenant_file, tenant_fields);

/* Whether name[0, len) is a tenant name. */
static bool name_valid(const char *name, size_t len) {
    if (len == 0 || len > PIE_TENANT_NAME_MAX) return false;
    for (size_t i = 0; i < len; i++) {
        char ch = name[i];
        bool ok = (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') ||
                  (i > 0 && (ch == '-' || ch == '_'));
        if (!ok) return false;
    }
    return true;
}

bool pie_tenant_name_valid(const char *name) {
    return name != NULL && name_valid(name, strnlen(name, PIE_TENANT_NAME_MAX + 1));
}

/* "<name>.yaml" with a valid name → name into out; false otherwise (the file is not a tenant). */
static bool tenant_name_of(const char *file, char out[PIE_TENANT_NAME_MAX + 1]) {
    size_t len = strlen(file);
    if (len <= 5 || strcmp(file + len - 5, ".yaml") != 0) return false;
    len -= 5;
    if (!name_valid(file, len)) return false;
    memcpy(out, file, len);
    out[len] = '\0';
    return true;
}

static int tenant_cmp(const void *a, const void *b) {
    return strcmp(((const pie_tenant *)a)->name, ((const pie_tenant *)b)->name);
}

static pie_code tenant_load_file(const char *dir, const char *file, const char *name,
                                 pie_tenant *t, pie_status *st) {
    char path[4096];
    if (snprintf(path, sizeof path, "%s/%s", dir, file) >= (int)sizeof path)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "tenants.dir: path too long: %s/%s",
                              dir, file);
    char *const no_env[] = {NULL}; /* PIE_TOKEN and the like must not override a tenant's file */
    tenant_file f;
    memset(&f, 0, sizeof f);
    if (pie_config_load(&tenant_schema, &f, path, no_env, st) != PIE_OK) return st->code;
    size_t tlen = strlen(f.token);
    pie_code rc = PIE_OK;
    if (tlen < TENANT_TOKEN_MIN || tlen > TENANT_TOKEN_MAX) {
        rc = pie_status_set(st, PIE_INVALID_ARGUMENT,
                            "%s: token: %zu bytes; a tenant token has %d..%d bytes", path, tlen,
                            TENANT_TOKEN_MIN, TENANT_TOKEN_MAX);
    } else if (strspn(f.token, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
                               "-._~+/=") != tlen) {
        rc = pie_status_set(st, PIE_INVALID_ARGUMENT,
                            "%s: token: only letters, digits and -._~+/= may appear in a bearer "
                            "token",
                            path);
    } else {
        size_t n = tlen + sizeof "Bearer ";
        t->bearer = malloc(n);
        if (!t->bearer) {
            rc = pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
        } else {
            snprintf(t->bearer, n, "Bearer %s", f.token);
            t->bearer_len = n - 1;
            snprintf(t->name, sizeof t->name, "%s", name);
            t->admin = f.admin;
            t->quota = (pie_tenant_quota){f.instances, f.kv_pages, f.export_pages, f.upload_bytes,
                                          f.program_bytes};
        }
    }
    pie_config_free(&tenant_schema, &f);
    return rc;
}

static bool regular_file(const char *dir, const char *file) {
    char path[4096];
    struct stat sb;
    if (snprintf(path, sizeof path, "%s/%s", dir, file) >= (int)sizeof path) return true;
    return stat(path, &sb) != 0 || S_ISREG(sb.st_mode); /* a vanished file fails at load */
}

/* Tokens are distinct and none is the service token. */
static pie_code tenants_check_tokens(const pie_tenants *t, const char *dir,
                                     const char *service_token, pie_status *st) {
    for (size_t i = 0; i < t->n; i++) {
        const char *tok = t->v[i].bearer + 7;
        if (service_token && service_token[0] && strcmp(tok, service_token) == 0)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "%s/%s.yaml: token: the internal service token (auth.token) "
                                  "must not be a tenant's",
                                  dir, t->v[i].name);
        for (size_t j = i + 1; j < t->n; j++)
            if (strcmp(t->v[i].bearer, t->v[j].bearer) == 0)
                return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                      "%s: tenants %s and %s have the same token", dir,
                                      t->v[i].name, t->v[j].name);
    }
    return PIE_OK;
}

pie_code pie_tenants_load(const char *dir, const char *service_token, pie_tenants *out,
                          pie_status *st) {
    memset(out, 0, sizeof *out);
    DIR *d = opendir(dir);
    if (!d)
        return pie_status_set(st, errno == ENOENT ? PIE_NOT_FOUND : PIE_INVALID_ARGUMENT,
                              "tenants.dir: cannot open '%s': %s", dir, strerror(errno));
    pie_code rc = PIE_OK;
    size_t cap = 0;
    struct dirent *e;
    while (rc == PIE_OK && (e = readdir(d)) != NULL) {
        char name[PIE_TENANT_NAME_MAX + 1];
        if (e->d_name[0] == '.') continue; /* ., .., and a Secret volume's ..data links */
        if (!tenant_name_of(e->d_name, name)) {
            if (regular_file(dir, e->d_name))
                rc = pie_status_set(st, PIE_INVALID_ARGUMENT,
                                    "tenants.dir: '%s/%s' is not <name>.yaml with a name "
                                    "of 1..%d of [a-z0-9_-] starting with a letter or digit",
                                    dir, e->d_name, PIE_TENANT_NAME_MAX);
            continue;
        }
        if (!regular_file(dir, e->d_name)) continue;
        if (out->n == TENANTS_MAX) {
            rc = pie_status_set(st, PIE_INVALID_ARGUMENT, "tenants.dir: more than %d tenants",
                                TENANTS_MAX);
            break;
        }
        if (out->n == cap) {
            size_t ncap = cap ? cap * 2 : 8;
            pie_tenant *nv = realloc(out->v, ncap * sizeof *nv);
            if (!nv) {
                rc = pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
                break;
            }
            out->v = nv;
            cap = ncap;
        }
        memset(&out->v[out->n], 0, sizeof out->v[out->n]);
        rc = tenant_load_file(dir, e->d_name, name, &out->v[out->n], st);
        if (rc == PIE_OK) out->n++;
    }
    closedir(d);
    if (rc == PIE_OK && out->n == 0)
        rc = pie_status_set(st, PIE_INVALID_ARGUMENT,
                            "tenants.dir: '%s' holds no <name>.yaml tenant file", dir);
    if (rc == PIE_OK) {
        qsort(out->v, out->n, sizeof *out->v, tenant_cmp);
        rc = tenants_check_tokens(out, dir, service_token, st);
    }
    if (rc != PIE_OK) pie_tenants_free(out);
    return rc;
}

void pie_tenants_free(pie_tenants *t) {
    for (size_t i = 0; i < t->n; i++) {
        memset(t->v[i].bearer, 0, t->v[i].bearer_len);
        free(t->v[i].bearer);
    }
    free(t->v);
    memset(t, 0, sizeof *t);
}

bool pie_secret_eq(const char *a, size_t alen, const char *b, size_t blen) {
    unsigned char diff = (unsigned char)(alen != blen);
    size_t n = alen < blen ? alen : blen;
    for (size_t i = 0; i < n; i++) diff |= (unsigned char)(a[i] ^ b[i]);
    return diff == 0;
}

const pie_tenant *pie_tenants_find(const pie_tenants *t, const char *value, size_t len) {
    const pie_tenant *found = NULL;
    for (size_t i = 0; i < t->n; i++) /* no early exit: every tenant costs the same */
        if (pie_secret_eq(value, len, t->v[i].bearer, t->v[i].bearer_len)) found = &t->v[i];
    return found;
}

const pie_tenant *pie_tenants_by_name(const pie_tenants *t, const char *name) {
    pie_tenant key;
    snprintf(key.name, sizeof key.name, "%s", name);
    if (strlen(name) > PIE_TENANT_NAME_MAX) return NULL;
    return bsearch(&key, t->v, t->n, sizeof *t->v, tenant_cmp);
}

void *pie_tenant_tab_find(const pie_tenant_tab *t, const char *name) {
    for (size_t i = 0; i < t->n; i++) {
        char *e = (char *)t->v + i * t->entry_size;
        if (strncmp(e, name, PIE_TENANT_NAME_MAX + 1) == 0) return e;
    }
    return NULL;
}

void *pie_tenant_tab_get(pie_tenant_tab *t, const char *name) {
    char *e = pie_tenant_tab_find(t, name);
    if (e) return e;
    char *v = realloc(t->v, (t->n + 1) * t->entry_size);
    if (v == NULL) return NULL;
    t->v = v;
    e = v + t->n++ * t->entry_size;
    memset(e, 0, t->entry_size);
    snprintf(e, PIE_TENANT_NAME_MAX + 1, "%s", name);
    return e;
}

void pie_tenant_tab_remove(pie_tenant_tab *t, void *entry) {
    char *last = (char *)t->v + --t->n * t->entry_size;
    if ((char *)entry != last) memcpy(entry, last, t->entry_size);
}

void pie_tenant_tab_free(pie_tenant_tab *t) {
    free(t->v);
    t->v = NULL;
    t->n = 0;
}
