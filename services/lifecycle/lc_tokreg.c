/* lc_tokreg.c — see lc_tokreg.h. */
#include "lc_tokreg.h"

#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "pie_log.h"
#include "pie_sha256.h"

/* One tokenizer.json found under the path, hashed once. */
typedef struct tokreg_file {
    char *path;
    char sha[65];
} tokreg_file;

/* One looked-up hash: the loaded tokenizer, or why there is none. */
typedef struct tokreg_entry {
    char sha[65];
    tok *t;
    pie_code code;
    char *msg;
} tokreg_entry;

struct lc_tokreg {
    char *path;
    pthread_mutex_t mu; /* guards everything below */
    bool scanned;
    tokreg_file *files;
    size_t n_files;
    tokreg_entry *entries;
    size_t n_entries;
};

lc_tokreg *lc_tokreg_create(const char *path, pie_status *st) {
    lc_tokreg *r = calloc(1, sizeof *r);
    if (r == NULL || (r->path = strdup(path ? path : "")) == NULL ||
        pthread_mutex_init(&r->mu, NULL) != 0) {
        if (r) free(r->path);
        free(r);
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    return r;
}

void lc_tokreg_destroy(lc_tokreg *r) {
    if (r == NULL) return;
    for (size_t i = 0; i < r->n_files; i++) free(r->files[i].path);
    for (size_t i = 0; i < r->n_entries; i++) {
        tok_free(r->entries[i].t);
        free(r->entries[i].msg);
    }
    free(r->files);
    free(r->entries);
    free(r->path);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

/* SHA-256 of a whole file, or false if it cannot be read. */
static bool file_sha256(const char *path, char out[65]) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) return false;
    bool ok = false;
    char *buf = NULL;
    if (fseek(f, 0, SEEK_END) == 0) {
        long n = ftell(f);
        if (n >= 0 && fseek(f, 0, SEEK_SET) == 0 && (buf = malloc((size_t)n + 1)) != NULL &&
            fread(buf, 1, (size_t)n, f) == (size_t)n) {
            ok = pie_sha256_hex(buf, (size_t)n, out, NULL) == PIE_OK;
        }
    }
    free(buf);
    fclose(f);
    return ok;
}

static void add_file(lc_tokreg *r, const char *path) {
    struct stat sb;
    if (stat(path, &sb) != 0 || !S_ISREG(sb.st_mode)) return;
    for (size_t i = 0; i < r->n_files; i++)
        if (strcmp(r->files[i].path, path) == 0) return;
    tokreg_file f = {.path = strdup(path)};
    if (f.path == NULL || !file_sha256(path, f.sha)) {
        free(f.path);
        return;
    }
    tokreg_file *v = realloc(r->files, (r->n_files + 1) * sizeof *v);
    if (v == NULL) {
        free(f.path);
        return;
    }
    r->files = v;
    r->files[r->n_files++] = f;
}

/* dir/tokenizer.json and dir/<sub>/tokenizer.json. */
static void scan_dir(lc_tokreg *r, const char *dir) {
    char p[4096];
    snprintf(p, sizeof p, "%s/tokenizer.json", dir);
    add_file(r, p);
    DIR *d = opendir(dir);
    if (d == NULL) return;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.') continue;
        snprintf(p, sizeof p, "%s/%s/tokenizer.json", dir, e->d_name);
        add_file(r, p);
    }
    closedir(d);
}

static void scan(lc_tokreg *r) {
    char *copy = strdup(r->path);
    if (copy == NULL) return;
    char *save = NULL;
    for (char *d = strtok_r(copy, ":", &save); d; d = strtok_r(NULL, ":", &save))
        if (d[0]) scan_dir(r, d);
    free(copy);
    r->scanned = true;
}

/* Loads the tokenizer with this hash into a new entry (under r->mu). */
static tokreg_entry *load_entry(lc_tokreg *r, const char *sha) {
    tokreg_entry *v = realloc(r->entries, (r->n_entries + 1) * sizeof *v);
    if (v == NULL) return NULL;
    r->entries = v;
    tokreg_entry *e = &r->entries[r->n_entries];
    *e = (tokreg_entry){0};
    snprintf(e->sha, sizeof e->sha, "%s", sha);
    if (!r->scanned) scan(r);
    const char *path = NULL;
    for (size_t i = 0; i < r->n_files && !path; i++)
        if (strcmp(r->files[i].sha, sha) == 0) path = r->files[i].path;
    pie_status st;
    if (path == NULL) {
        pie_status_set(&st, PIE_FAILED_PRECONDITION,
                       "no tokenizer.json with SHA-256 %.16s... under the tokenizer path \"%s\" "
                       "(%zu tokenizer.json files seen)",
                       sha, r->path, r->n_files);
        e->code = st.code;
    } else {
        e->code = tok_load(path, &e->t, &st);
        if (e->code == PIE_OK)
            pie_log_info("lc.tokreg.loaded", "path=%s sha256=%.16s vocab=%u", path, sha,
                         tok_vocab_size(e->t));
    }
    if (e->code != PIE_OK) {
        e->msg = strdup(st.msg);
        pie_log_warn("lc.tokreg.missing", "sha256=%.16s error=\"%s\"", sha, st.msg);
    }
    r->n_entries++;
    return e;
}

pie_code lc_tokreg_get(lc_tokreg *r, const char *sha256_hex, const tok **out, pie_status *st) {
    *out = NULL;
    pthread_mutex_lock(&r->mu);
    tokreg_entry *e = NULL;
    for (size_t i = 0; i < r->n_entries && !e; i++)
        if (strcmp(r->entries[i].sha, sha256_hex) == 0) e = &r->entries[i];
    if (e == NULL) e = load_entry(r, sha256_hex);
    pie_code rc;
    if (e == NULL) {
        rc = pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
    } else if (e->code != PIE_OK) {
        rc = pie_status_set(st, e->code, "%s", e->msg ? e->msg : "tokenizer unavailable");
    } else {
        *out = e->t;
        rc = PIE_OK;
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}
