/* ctl_registry.c — see ctl_registry.h.
 *
 * Both tables are plain vectors searched linearly: a cluster serves a handful of tokenizers, and
 * the registry holds at most thousands of programs, looked up once per replica per program (a
 * replica keeps what it fetched). Recency is a counter stamped on every put and read; eviction
 * takes the smallest stamp. */
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

typedef struct reg_program {
    char id[65];
    char *name;
    uint8_t *bytes;
    size_t len;
    uint64_t used; /* recency stamp */
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
    *p = r->progs[--r->n_progs];
}

static void update_gauges(ctl_registry *r) {
    pie_gauge_set(r->g_prog_bytes, (double)r->prog_bytes);
    pie_gauge_set(r->g_progs, (double)r->n_progs);
}

/* Evicts least recently used programs until len more bytes fit (under mu). */
static void make_room(ctl_registry *r, size_t len) {
    while (r->n_progs > 0 && r->prog_bytes + len > r->prog_bytes_max) {
        size_t lru = 0;
        for (size_t i = 1; i < r->n_progs; i++)
            if (r->progs[i].used < r->progs[lru].used) lru = i;
        pie_log_info("ctl.registry.program_evicted", "program=%s bytes=%zu", r->progs[lru].id,
                     r->progs[lru].len);
        pie_counter_add(r->c_evicted, 1);
        prog_remove(r, &r->progs[lru]);
    }
}

pie_code ctl_registry_program_put(ctl_registry *r, const char *id, const char *name, uint8_t *bytes,
                                  size_t len, bool *already, pie_status *st) {
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
    } else {
        make_room(r, len);
        if (r->n_progs == r->cap_progs) {
            size_t cap = r->cap_progs ? r->cap_progs * 2 : 16;
            reg_program *v = realloc(r->progs, cap * sizeof *v);
            if (v == NULL) {
                rc = pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                                    "controller registry: out of memory");
                free(bytes);
                free(label);
                goto done;
            }
            r->progs = v;
            r->cap_progs = cap;
        }
        p = &r->progs[r->n_progs++];
        *p = (reg_program){.name = label, .bytes = bytes, .len = len, .used = ++r->clock};
        snprintf(p->id, sizeof p->id, "%s", id);
        r->prog_bytes += len;
        pie_log_info("ctl.registry.program_stored", "program=%s name=\"%s\" bytes=%zu", id, label,
                     len);
    }
done:
    update_gauges(r);
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

bool ctl_registry_program_drop(ctl_registry *r, const char *id) {
    pthread_mutex_lock(&r->mu);
    reg_program *p = prog_find(r, id);
    if (p) prog_remove(r, p);
    update_gauges(r);
    pthread_mutex_unlock(&r->mu);
    return p != NULL;
}
