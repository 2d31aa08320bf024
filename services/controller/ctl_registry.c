/* ctl_registry.c — see ctl_registry.h.
 *
 * Both tables are plain vectors searched linearly: a cluster serves a handful of tokenizers, and
 * the registry holds at most thousands of programs, looked up once per replica per program (a
 * replica keeps what it fetched). Recency is a counter stamped on every put, hold and read.
 *
 * Fair eviction: a program is charged in full to every tenant holding it. Making room is
 * planned before anything is removed (programs and holds marked `going`), so a put that turns
 * out impossible — the putting tenant would become the largest holder with nothing of its own
 * left to give — is refused with everything still in place. */
#include "ctl_registry.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pie_log.h"

typedef struct reg_tokenizer {
    char sha[65];
    uint8_t *bytes;
    size_t len;
    uint32_t refs; /* linked worker groups that supplied it */
} reg_tokenizer;

typedef struct reg_hold {
    char tenant[PIE_TENANT_NAME_MAX + 1];
    bool going; /* released by the room being planned */
} reg_hold;

typedef struct reg_program {
    char id[65];
    char *name;
    uint8_t *bytes;
    size_t len;
    uint64_t used; /* recency stamp */
    reg_hold *holds;
    size_t n_holds;
    bool going; /* evicted by the room being planned */
} reg_program;

struct ctl_registry {
    pthread_mutex_t mu; /* guards everything below */
    reg_tokenizer *toks;
    size_t n_toks;
    reg_program *progs;
    size_t n_progs, cap_progs;
    uint64_t prog_bytes, prog_bytes_max, clock;
    pie_gauge *g_prog_bytes, *g_progs, *g_toks;
    pie_counter *c_evicted;
};

ctl_registry *ctl_registry_create(uint64_t program_bytes_max, pie_metrics *metrics,
                                  pie_status *st) {
    ctl_registry *r = calloc(1, sizeof *r);
    if (r == NULL || pthread_mutex_init(&r->mu, NULL) != 0) {
        free(r);
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "controller registry: out of memory");
        return NULL;
    }
    r->prog_bytes_max = program_bytes_max;
    if (metrics) {
        r->g_prog_bytes = pie_metrics_gauge(
            metrics, "pie_controller_registry_program_bytes",
            "Bytes of programs in the controller's program registry (programs.registry_size "
            "bounds it).",
            NULL, 0, NULL);
        r->g_progs =
            pie_metrics_gauge(metrics, "pie_controller_registry_programs",
                              "Programs in the controller's program registry.", NULL, 0, NULL);
        r->g_toks = pie_metrics_gauge(metrics, "pie_controller_registry_tokenizers",
                                      "tokenizer.json files the controller holds for lifecycle "
                                      "replicas (one per hash served by a linked worker).",
                                      NULL, 0, NULL);
        r->c_evicted = pie_metrics_counter(
            metrics, "pie_controller_registry_programs_evicted_total",
            "Programs evicted from the registry to make room (least recently used first).", NULL, 0,
            NULL);
    }
    return r;
}

void ctl_registry_destroy(ctl_registry *r) {
    if (r == NULL) return;
    for (size_t i = 0; i < r->n_toks; i++) free(r->toks[i].bytes);
    for (size_t i = 0; i < r->n_progs; i++) {
        free(r->progs[i].bytes);
        free(r->progs[i].name);
        free(r->progs[i].holds);
    }
    free(r->toks);
    free(r->progs);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

void ctl_registry_chunk_free(ctl_registry_chunk *c) {
    free(c->data);
    free(c->name);
    *c = (ctl_registry_chunk){0};
}

/* Copies [offset, offset + max) of bytes[0..len) into out (under mu). */
static pie_code copy_chunk(const char *what, const char *id, const uint8_t *bytes, size_t len,
                           uint64_t offset, size_t max_bytes, ctl_registry_chunk *out,
                           pie_status *st) {
    *out = (ctl_registry_chunk){.size = len};
    if (offset > len)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "offset: %llu is beyond the %zu bytes of %s %.16s...",
                              (unsigned long long)offset, len, what, id);
    size_t n = len - (size_t)offset < max_bytes ? len - (size_t)offset : max_bytes;
    if (n == 0) return PIE_OK;
    if ((out->data = malloc(n)) == NULL)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "controller registry: out of memory");
    memcpy(out->data, bytes + offset, n);
    out->len = n;
    return PIE_OK;
}

/* ---- tokenizers ------------------------------------------------------------------------------ */

static reg_tokenizer *tok_find(ctl_registry *r, const char *sha) {
    for (size_t i = 0; i < r->n_toks; i++)
        if (strcmp(r->toks[i].sha, sha) == 0) return &r->toks[i];
    return NULL;
}

pie_code ctl_registry_tokenizer_add(ctl_registry *r, const char *sha256, uint8_t *bytes, size_t len,
                                    pie_status *st) {
    pie_code rc = PIE_OK;
    pthread_mutex_lock(&r->mu);
    reg_tokenizer *t = tok_find(r, sha256);
    if (t) {
        t->refs++;
        free(bytes);
    } else {
        reg_tokenizer *v = realloc(r->toks, (r->n_toks + 1) * sizeof *v);
        if (v == NULL) {
            free(bytes);
            rc = pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "controller registry: out of memory");
        } else {
            r->toks = v;
            t = &r->toks[r->n_toks++];
            *t = (reg_tokenizer){.bytes = bytes, .len = len, .refs = 1};
            snprintf(t->sha, sizeof t->sha, "%s", sha256);
            pie_log_info("ctl.registry.tokenizer_added", "sha256=%.16s bytes=%zu", sha256, len);
        }
    }
    pie_gauge_set(r->g_toks, (double)r->n_toks);
    pthread_mutex_unlock(&r->mu);
    return rc;
}

void ctl_registry_tokenizer_release(ctl_registry *r, const char *sha256) {
    pthread_mutex_lock(&r->mu);
    reg_tokenizer *t = tok_find(r, sha256);
    if (t && --t->refs == 0) {
        free(t->bytes);
        *t = r->toks[--r->n_toks];
        pie_log_info("ctl.registry.tokenizer_dropped", "sha256=%.16s", sha256);
    }
    pie_gauge_set(r->g_toks, (double)r->n_toks);
    pthread_mutex_unlock(&r->mu);
}

pie_code ctl_registry_tokenizer_read(ctl_registry *r, const char *sha256, uint64_t offset,
                                     size_t max_bytes, ctl_registry_chunk *out, pie_status *st) {
    *out = (ctl_registry_chunk){0};
    pthread_mutex_lock(&r->mu);
    reg_tokenizer *t = tok_find(r, sha256);
    pie_code rc = t ? copy_chunk("tokenizer", sha256, t->bytes, t->len, offset, max_bytes, out, st)
                    : pie_status_set(st, PIE_NOT_FOUND,
                                     "tokenizer_sha256: no linked worker supplied a "
                                     "tokenizer.json with SHA-256 %s",
                                     sha256);
    pthread_mutex_unlock(&r->mu);
    return rc;
}

/* ---- programs -------------------------------------------------------------------------------- */

uint64_t ctl_registry_program_bytes_max(const ctl_registry *r) { return r->prog_bytes_max; }

static reg_program *prog_find(ctl_registry *r, const char *id) {
    for (size_t i = 0; i < r->n_progs; i++)
        if (strcmp(r->progs[i].id, id) == 0) return &r->progs[i];
    return NULL;
}

static void prog_remove(ctl_registry *r, reg_program *p) {
    r->prog_bytes -= p->len;
    free(p->bytes);
    free(p->name);
    free(p->holds);
    *p = r->progs[--r->n_progs];
}

static void update_gauges(ctl_registry *r) {
    pie_gauge_set(r->g_prog_bytes, (double)r->prog_bytes);
    pie_gauge_set(r->g_progs, (double)r->n_progs);
}

static reg_hold *hold_find(reg_program *p, const char *tenant) {
    for (size_t i = 0; i < p->n_holds; i++)
        if (strcmp(p->holds[i].tenant, tenant) == 0) return &p->holds[i];
    return NULL;
}

/* Adds the tenants p lacks to its holders (under mu). */
static pie_code add_holds(reg_program *p, const char *const *tenants, size_t n, pie_status *st) {
    for (size_t i = 0; i < n; i++) {
        if (hold_find(p, tenants[i])) continue;
        reg_hold *v = realloc(p->holds, (p->n_holds + 1) * sizeof *v);
        if (v == NULL)
            return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "controller registry: out of memory");
        p->holds = v;
        v = &p->holds[p->n_holds++];
        *v = (reg_hold){0};
        snprintf(v->tenant, sizeof v->tenant, "%s", tenants[i]);
    }
    return PIE_OK;
}

/* Whether a tenant still holds p in the plan. */
static bool held_in_plan(const reg_program *p) {
    for (size_t i = 0; i < p->n_holds; i++)
        if (!p->holds[i].going) return true;
    return false;
}

/* A tenant's bytes in the plan, and its least recently used program. */
typedef struct reg_charge {
    const char *tenant;
    uint64_t bytes;
    reg_program *lru; /* NULL: it holds nothing stored (a putting tenant) */
} reg_charge;

static reg_charge *charge_of(reg_charge *c, size_t *n, const char *tenant) {
    for (size_t i = 0; i < *n; i++)
        if (strcmp(c[i].tenant, tenant) == 0) return &c[i];
    c[*n] = (reg_charge){.tenant = tenant};
    return &c[(*n)++];
}

/* The tenant holding the most bytes in the plan, the putting tenants counting len (under mu);
 * ties go to the one whose least recently used program is oldest. c has room for every hold
 * and putting tenant. NULL when nobody holds anything. */
static reg_charge *largest_holder(ctl_registry *r, reg_charge *c, const char *const *tenants,
                                  size_t n_tenants, size_t len) {
    size_t n = 0;
    for (size_t i = 0; i < n_tenants; i++) charge_of(c, &n, tenants[i])->bytes = len;
    for (size_t i = 0; i < r->n_progs; i++) {
        reg_program *p = &r->progs[i];
        if (p->going) continue;
        for (size_t k = 0; k < p->n_holds; k++) {
            if (p->holds[k].going) continue;
            reg_charge *t = charge_of(c, &n, p->holds[k].tenant);
            t->bytes += p->len;
            if (t->lru == NULL || p->used < t->lru->used) t->lru = p;
        }
    }
    reg_charge *max = NULL;
    for (size_t i = 0; i < n; i++) {
        uint64_t age = c[i].lru ? c[i].lru->used : UINT64_MAX;
        if (max == NULL || c[i].bytes > max->bytes ||
            (c[i].bytes == max->bytes && age < (max->lru ? max->lru->used : UINT64_MAX)))
            max = &c[i];
    }
    return max;
}

/* The least recently used program nobody holds in the plan, or NULL. */
static reg_program *lru_unheld(ctl_registry *r) {
    reg_program *lru = NULL;
    for (size_t i = 0; i < r->n_progs; i++) {
        reg_program *p = &r->progs[i];
        if (!p->going && !held_in_plan(p) && (lru == NULL || p->used < lru->used)) lru = p;
    }
    return lru;
}

/* Marks what makes room for len more bytes held by tenants (under mu). False, with nothing
 * marked, when a putting tenant would become the largest holder with nothing left to give
 * (*who: that tenant). */
static bool plan_room(ctl_registry *r, size_t len, const char *const *tenants, size_t n_tenants,
                      reg_charge *c, const char **who) {
    uint64_t freed = 0;
    while (r->prog_bytes - freed + len > r->prog_bytes_max) {
        reg_program *p = lru_unheld(r);
        if (p == NULL) {
            reg_charge *max = largest_holder(r, c, tenants, n_tenants, len);
            if (max == NULL || max->lru == NULL) {
                *who = max ? max->tenant : "";
                for (size_t i = 0; i < r->n_progs; i++) {
                    r->progs[i].going = false;
                    for (size_t k = 0; k < r->progs[i].n_holds; k++)
                        r->progs[i].holds[k].going = false;
                }
                return false;
            }
            hold_find(max->lru, max->tenant)->going = true;
            if (held_in_plan(max->lru)) continue; /* another tenant holds it: it stays */
            p = max->lru;
        }
        p->going = true;
        freed += p->len;
    }
    return true;
}

/* Carries out plan_room's marks (under mu). */
static void apply_room(ctl_registry *r) {
    for (size_t i = 0; i < r->n_progs;) {
        reg_program *p = &r->progs[i];
        if (p->going) {
            pie_log_info("ctl.registry.program_evicted", "program=%s bytes=%zu", p->id, p->len);
            pie_counter_add(r->c_evicted, 1);
            prog_remove(r, p); /* the last program moves to i */
            continue;
        }
        size_t kept = 0;
        for (size_t k = 0; k < p->n_holds; k++) {
            if (p->holds[k].going)
                pie_log_info("ctl.registry.hold_evicted", "program=%s tenant=%s", p->id,
                             p->holds[k].tenant);
            else
                p->holds[kept++] = p->holds[k];
        }
        p->n_holds = kept;
        i++;
    }
}

/* Makes room for len more bytes held by tenants (under mu); see ctl_registry_program_put. */
static pie_code make_room(ctl_registry *r, size_t len, const char *const *tenants, size_t n_tenants,
                          pie_status *st) {
    size_t holds = n_tenants;
    for (size_t i = 0; i < r->n_progs; i++) holds += r->progs[i].n_holds;
    reg_charge *c = malloc((holds ? holds : 1) * sizeof *c);
    if (c == NULL)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "controller registry: out of memory");
    const char *who = "";
    bool ok = plan_room(r, len, tenants, n_tenants, c, &who);
    free(c);
    if (!ok)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "program registry full: room for these %zu bytes would make tenant "
                              "\"%s\" hold more of it than any tenant whose programs could go "
                              "(programs.registry_size = %llu bytes, shared fairly); the upload "
                              "stands on its replica",
                              len, who, (unsigned long long)r->prog_bytes_max);
    apply_room(r);
    return PIE_OK;
}

pie_code ctl_registry_program_put(ctl_registry *r, const char *id, const char *name, uint8_t *bytes,
                                  size_t len, const char *const *tenants, size_t n_tenants,
                                  bool *already, pie_status *st) {
    *already = false;
    if ((uint64_t)len > r->prog_bytes_max) {
        free(bytes);
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "header.size_bytes: %zu is above the controller's program registry "
                              "size (programs.registry_size = %llu bytes)",
                              len, (unsigned long long)r->prog_bytes_max);
    }
    char *label = strdup(name ? name : "");
    if (label == NULL) {
        free(bytes);
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "controller registry: out of memory");
    }
    pie_code rc = PIE_OK;
    pthread_mutex_lock(&r->mu);
    reg_program *p = prog_find(r, id);
    if (p) {
        *already = true;
        free(p->name);
        p->name = label;
        p->used = ++r->clock;
        free(bytes);
        rc = add_holds(p, tenants, n_tenants, st);
        goto done;
    }
    if (r->n_progs == r->cap_progs) {
        size_t cap = r->cap_progs ? r->cap_progs * 2 : 16;
        reg_program *v = realloc(r->progs, cap * sizeof *v);
        if (v == NULL) {
            rc = pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "controller registry: out of memory");
            goto refused;
        }
        r->progs = v;
        r->cap_progs = cap;
    }
    if ((rc = make_room(r, len, tenants, n_tenants, st)) != PIE_OK) goto refused;
    p = &r->progs[r->n_progs++];
    *p = (reg_program){.name = label, .bytes = bytes, .len = len, .used = ++r->clock};
    snprintf(p->id, sizeof p->id, "%s", id);
    r->prog_bytes += len;
    rc = add_holds(p, tenants, n_tenants, st); /* on failure: stored, held by fewer */
    pie_log_info("ctl.registry.program_stored", "program=%s name=\"%s\" bytes=%zu holders=%zu", id,
                 label, len, p->n_holds);
    goto done;
refused:
    free(bytes);
    free(label);
done:
    update_gauges(r);
    pthread_mutex_unlock(&r->mu);
    return rc;
}

pie_code ctl_registry_program_hold(ctl_registry *r, const char *id, const char *const *tenants,
                                   size_t n_tenants, pie_status *st) {
    pthread_mutex_lock(&r->mu);
    reg_program *p = prog_find(r, id);
    pie_code rc;
    if (p == NULL) {
        rc = pie_status_set(st, PIE_NOT_FOUND,
                            "program_id: %s is not in the controller's program registry", id);
    } else {
        p->used = ++r->clock;
        rc = add_holds(p, tenants, n_tenants, st);
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

pie_code ctl_registry_program_read(ctl_registry *r, const char *id, uint64_t offset,
                                   size_t max_bytes, ctl_registry_chunk *out, pie_status *st) {
    *out = (ctl_registry_chunk){0};
    pie_code rc;
    pthread_mutex_lock(&r->mu);
    reg_program *p = prog_find(r, id);
    if (p == NULL) {
        rc = pie_status_set(st, PIE_NOT_FOUND,
                            "program_id: %s is not in the controller's program registry", id);
    } else {
        p->used = ++r->clock;
        rc = copy_chunk("program", id, p->bytes, p->len, offset, max_bytes, out, st);
        if (rc == PIE_OK && (out->name = strdup(p->name)) == NULL) {
            ctl_registry_chunk_free(out);
            rc = pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "controller registry: out of memory");
        }
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

bool ctl_registry_program_has(ctl_registry *r, const char *id) {
    pthread_mutex_lock(&r->mu);
    bool has = prog_find(r, id) != NULL;
    pthread_mutex_unlock(&r->mu);
    return has;
}

bool ctl_registry_program_release(ctl_registry *r, const char *id, const char *tenant, bool *held) {
    pthread_mutex_lock(&r->mu);
    reg_program *p = prog_find(r, id);
    reg_hold *h = p ? hold_find(p, tenant) : NULL;
    *held = h != NULL;
    if (h) *h = p->holds[--p->n_holds];
    pthread_mutex_unlock(&r->mu);
    return p != NULL;
}

bool ctl_registry_program_drop(ctl_registry *r, const char *id) {
    pthread_mutex_lock(&r->mu);
    reg_program *p = prog_find(r, id);
    if (p) prog_remove(r, p);
    update_gauges(r);
    pthread_mutex_unlock(&r->mu);
    return p != NULL;
}
