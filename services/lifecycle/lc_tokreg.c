/* lc_tokreg.c — see lc_tokreg.h.
 *
 * Entries live behind pointers (never moved), each LOADING, OK or FAILED. One thread loads a
 * hash at a time (it set LOADING); others wait on cv. Every slow step — scanning the path,
 * reading a file, fetching — runs with mu released. */
#include "lc_tokreg.h"

#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "lc_wasm.h"
#include "pie_file.h"
#include "pie_log.h"
#include "pie_sha256.h"

#define TOKREG_RETRY_MIN_NS 200000000LL  /* first retry of a failed tokenizer: 200 ms */
#define TOKREG_RETRY_MAX_NS 5000000000LL /* retries back off to once every 5 s */
#define TOKREG_FILE_MAX     (512u << 20) /* larger tokenizer.json files are refused */

/* One tokenizer.json found under the path, hashed once. */
typedef struct tokreg_file {
    char *path;
    char sha[65];
} tokreg_file;

typedef enum tokreg_state { TOKREG_LOADING, TOKREG_OK, TOKREG_FAILED } tokreg_state;

/* One looked-up hash: the loaded tokenizer, or why there is none (yet). */
typedef struct tokreg_entry {
    char sha[65];
    tokreg_state state;
    tok *t;
    pie_code code;
    char *msg;
    unsigned fails;   /* consecutive failures */
    int64_t retry_ns; /* FAILED: lookups before this fail at once; CLOCK_MONOTONIC */
} tokreg_entry;

struct lc_tokreg {
    lc_tokreg_config cfg;
    char *path, *cache_dir; /* copies behind cfg's pointers */
    pthread_mutex_t mu;     /* guards everything below */
    pthread_cond_t cv;      /* an entry left LOADING, the scan ended, want changed, stop */
    bool scanned, scanning;
    tokreg_file *files;
    size_t n_files;
    tokreg_entry **entries;
    size_t n_entries;
    char (*want)[65]; /* hashes of the served models, for the prefetch thread */
    size_t n_want;
    bool stop, thread_started;
    pthread_t thread;
};

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ---- files ----------------------------------------------------------------------------------- */

/* A tokenizer file into *buf (malloc'd, NUL-terminated), or false if it cannot be read or is
 * too large: such a file is skipped, so why is not reported. */
static bool read_tokenizer(const char *path, char **buf, size_t *len) {
    pie_status st;
    return pie_file_read(path, "tokenizer", TOKREG_FILE_MAX, buf, len, &st) == PIE_OK;
}

/* Adds path to v if it is a readable file, hashed. */
static void add_file(tokreg_file **v, size_t *n, const char *path) {
    for (size_t i = 0; i < *n; i++)
        if (strcmp((*v)[i].path, path) == 0) return;
    char *buf;
    size_t len;
    if (!read_tokenizer(path, &buf, &len)) return;
    tokreg_file f = {.path = strdup(path)};
    bool ok = f.path && pie_sha256_hex(buf, len, f.sha, NULL) == PIE_OK;
    free(buf);
    tokreg_file *nv = ok ? realloc(*v, (*n + 1) * sizeof *nv) : NULL;
    if (nv == NULL) {
        free(f.path);
        return;
    }
    *v = nv;
    (*v)[(*n)++] = f;
}

/* dir/tokenizer.json and dir/<sub>/tokenizer.json. */
static void scan_dir(tokreg_file **v, size_t *n, const char *dir) {
    char p[4096];
    snprintf(p, sizeof p, "%s/tokenizer.json", dir);
    add_file(v, n, p);
    DIR *d = opendir(dir);
    if (d == NULL) return;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.') continue;
        snprintf(p, sizeof p, "%s/%s/tokenizer.json", dir, e->d_name);
        add_file(v, n, p);
    }
    closedir(d);
}

/* Scans the path once per registry (mu held on entry and exit, released while scanning). */
static void ensure_scanned(lc_tokreg *r) {
    while (r->scanning) pthread_cond_wait(&r->cv, &r->mu);
    if (r->scanned) return;
    r->scanning = true;
    pthread_mutex_unlock(&r->mu);
    tokreg_file *v = NULL;
    size_t n = 0;
    char *copy = strdup(r->path);
    char *save = NULL;
    for (char *d = copy ? strtok_r(copy, ":", &save) : NULL; d; d = strtok_r(NULL, ":", &save))
        if (d[0]) scan_dir(&v, &n, d);
    free(copy);
    pthread_mutex_lock(&r->mu);
    r->files = v;
    r->n_files = n;
    r->scanned = true;
    r->scanning = false;
    pthread_cond_broadcast(&r->cv);
}

/* ---- loading one hash (mu not held) ---------------------------------------------------------- */

/* From the disk cache: PIE_OK with *t, NOT_FOUND (no usable file: absent, or removed because it
 * did not hash to its name), or tok_load's error. */
static pie_code load_cached(lc_tokreg *r, const char *sha, tok **t, pie_status *st) {
    if (r->cache_dir[0] == '\0') return PIE_NOT_FOUND;
    char path[4200], got[65];
    snprintf(path, sizeof path, "%s/%s.json", r->cache_dir, sha);
    char *buf;
    size_t len;
    if (!read_tokenizer(path, &buf, &len)) return PIE_NOT_FOUND;
    pie_code rc;
    if (pie_sha256_hex(buf, len, got, st) != PIE_OK || strcmp(got, sha) != 0) {
        pie_log_warn("lc.tokreg.cache_refused",
                     "path=%s sha256=%.16s got=%.16s: the cached file does not hash to its name; "
                     "removed",
                     path, sha, got);
        if (unlink(path) != 0 && errno != ENOENT)
            pie_log_warn("lc.tokreg.cache_unlink", "path=%s error=\"%s\"", path, strerror(errno));
        rc = PIE_NOT_FOUND;
    } else {
        rc = tok_load_json(buf, len, path, t, st);
    }
    free(buf);
    return rc;
}

/* From the cluster: fetch, check the hash, keep a copy in the cache, load. */
static pie_code load_fetched(lc_tokreg *r, const char *sha, tok **t, pie_status *st) {
    uint8_t *bytes = NULL;
    size_t len = 0;
    char got[65];
    pie_status fst;
    if (r->cfg.fetch(r->cfg.fetch_ctx, sha, &bytes, &len, &fst) != PIE_OK)
        return pie_status_set(st, fst.code,
                              "no tokenizer.json with SHA-256 %s under the tokenizer path "
                              "\"%s\", and fetching it from the controller failed: %s",
                              sha, r->path, fst.msg);
    pie_code rc = pie_sha256_hex(bytes, len, got, st);
    if (rc == PIE_OK && strcmp(got, sha) != 0)
        rc = pie_status_set(st, PIE_DATA_LOSS,
                            "tokenizer_sha256: %s, but the %zu bytes the controller sent hash to "
                            "%s; refused",
                            sha, len, got);
    if (rc == PIE_OK && r->cache_dir[0]) {
        char path[4200];
        pie_status wst;
        snprintf(path, sizeof path, "%s/%s.json", r->cache_dir, sha);
        if (lc_wasm_write_file(path, bytes, len, &wst) != PIE_OK) /* only the cache is lost */
            pie_log_warn("lc.tokreg.cache_write", "path=%s error=\"%s\"", path, wst.msg);
    }
    if (rc == PIE_OK) {
        char name[96];
        snprintf(name, sizeof name, "tokenizer %.16s... (from the controller)", sha);
        rc = tok_load_json((const char *)bytes, len, name, t, st);
    }
    free(bytes);
    return rc;
}

/* Path, then cache, then cluster. *source says which one answered. */
static pie_code load(lc_tokreg *r, const char *sha, tok **t, const char **source, pie_status *st) {
    *t = NULL;
    pthread_mutex_lock(&r->mu);
    ensure_scanned(r);
    char *path = NULL;
    for (size_t i = 0; i < r->n_files && !path; i++)
        if (strcmp(r->files[i].sha, sha) == 0) path = strdup(r->files[i].path);
    size_t n_files = r->n_files;
    pthread_mutex_unlock(&r->mu);
    if (path) {
        *source = "path";
        pie_code rc = tok_load(path, t, st);
        if (rc == PIE_OK)
            pie_log_info("lc.tokreg.loaded", "source=path path=%s sha256=%.16s vocab=%u", path, sha,
                         tok_vocab_size(*t));
        free(path);
        return rc;
    }
    pie_code rc = load_cached(r, sha, t, st);
    *source = "cache";
    if (rc == PIE_NOT_FOUND && r->cfg.fetch) {
        rc = load_fetched(r, sha, t, st);
        *source = "controller";
    } else if (rc == PIE_NOT_FOUND) {
        rc = pie_status_set(st, PIE_FAILED_PRECONDITION,
                            "no tokenizer.json with SHA-256 %.16s... under the tokenizer path "
                            "\"%s\" (%zu tokenizer.json files seen)",
                            sha, r->path, n_files);
    }
    if (rc == PIE_OK)
        pie_log_info("lc.tokreg.loaded", "source=%s sha256=%.16s vocab=%u", *source, sha,
                     tok_vocab_size(*t));
    return rc;
}

/* ---- lookups --------------------------------------------------------------------------------- */

static tokreg_entry *find(lc_tokreg *r, const char *sha) {
    for (size_t i = 0; i < r->n_entries; i++)
        if (strcmp(r->entries[i]->sha, sha) == 0) return r->entries[i];
    return NULL;
}

static tokreg_entry *add_entry(lc_tokreg *r, const char *sha) {
    tokreg_entry *e = calloc(1, sizeof *e);
    tokreg_entry **v = e ? realloc(r->entries, (r->n_entries + 1) * sizeof *v) : NULL;
    if (v == NULL) {
        free(e);
        return NULL;
    }
    r->entries = v;
    r->entries[r->n_entries++] = e;
    snprintf(e->sha, sizeof e->sha, "%s", sha);
    e->state = TOKREG_FAILED; /* retry_ns 0: due now */
    return e;
}

pie_code lc_tokreg_get(lc_tokreg *r, const char *sha256_hex, const tok **out, pie_status *st) {
    *out = NULL;
    if (!pie_sha256_is_hex(sha256_hex))
        return pie_status_set(st, PIE_FAILED_PRECONDITION,
                              "the model announces no tokenizer (tokenizer_sha256 \"%.80s\")",
                              sha256_hex ? sha256_hex : "");
    pthread_mutex_lock(&r->mu);
    tokreg_entry *e = find(r, sha256_hex);
    if (e == NULL) e = add_entry(r, sha256_hex);
    while (e && e->state == TOKREG_LOADING) pthread_cond_wait(&r->cv, &r->mu);
    if (e && e->state == TOKREG_FAILED && now_ns() >= e->retry_ns) {
        e->state = TOKREG_LOADING;
        pthread_mutex_unlock(&r->mu);
        tok *t = NULL;
        const char *source = "";
        pie_status lst;
        pie_code lrc = load(r, sha256_hex, &t, &source, &lst);
        char *msg = lrc == PIE_OK ? NULL : strdup(lst.msg);
        pthread_mutex_lock(&r->mu);
        if (lrc == PIE_OK) {
            e->state = TOKREG_OK;
            e->t = t;
            e->fails = 0;
        } else {
            e->state = TOKREG_FAILED;
            e->code = lrc;
            free(e->msg);
            e->msg = msg;
            int64_t backoff = TOKREG_RETRY_MIN_NS << (e->fails < 5 ? e->fails : 5);
            e->retry_ns =
                now_ns() + (backoff < TOKREG_RETRY_MAX_NS ? backoff : TOKREG_RETRY_MAX_NS);
            e->fails++;
            pie_log_warn("lc.tokreg.missing", "sha256=%.16s code=%s error=\"%s\"", sha256_hex,
                         pie_code_name(lrc), lst.msg);
        }
        pthread_cond_broadcast(&r->cv);
    }
    pie_code rc;
    if (e == NULL) {
        rc = pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
    } else if (e->state != TOKREG_OK) {
        rc = pie_status_set(st, e->code ? e->code : PIE_UNAVAILABLE, "%s",
                            e->msg ? e->msg : "tokenizer unavailable");
    } else {
        *out = e->t;
        rc = PIE_OK;
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

bool lc_tokreg_loaded(lc_tokreg *r, const char *sha256_hex) {
    if (sha256_hex == NULL || sha256_hex[0] == '\0') return true;
    pthread_mutex_lock(&r->mu);
    tokreg_entry *e = find(r, sha256_hex);
    bool ok = e && e->state == TOKREG_OK;
    pthread_mutex_unlock(&r->mu);
    return ok;
}

static const char *model_sha(const Pie__V1__ModelInfo *m) {
    return m->tokenizer && m->tokenizer->tokenizer_sha256 ? m->tokenizer->tokenizer_sha256 : "";
}

bool lc_tokreg_models_ready(lc_tokreg *r, const Pie__V1__ModelsChanged *mc) {
    for (size_t i = 0; mc && i < mc->n_models; i++)
        if (!lc_tokreg_loaded(r, model_sha(mc->models[i]))) return false;
    return true;
}

/* ---- the prefetch thread --------------------------------------------------------------------- */

void lc_tokreg_want_models(lc_tokreg *r, const Pie__V1__ModelsChanged *mc) {
    size_t n = mc ? mc->n_models : 0;
    char(*v)[65] = n ? calloc(n, sizeof *v) : NULL;
    size_t k = 0;
    for (size_t i = 0; v && i < n; i++)
        if (pie_sha256_is_hex(model_sha(mc->models[i])))
            snprintf(v[k++], sizeof v[0], "%s", model_sha(mc->models[i]));
    if (n && v == NULL) {
        pie_log_error("lc.tokreg.want", "error=\"out of memory\" models=%zu", n);
        return;
    }
    pthread_mutex_lock(&r->mu);
    free(r->want);
    r->want = v;
    r->n_want = k;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

/* The first wanted hash due for a (re)load, copied to sha; else the earliest retry time in
 * *wake_ns (0: nothing to wait for). mu held. */
static bool next_due(lc_tokreg *r, char sha[65], int64_t *wake_ns) {
    int64_t now = now_ns();
    *wake_ns = 0;
    for (size_t i = 0; i < r->n_want; i++) {
        tokreg_entry *e = find(r, r->want[i]);
        if (e && (e->state == TOKREG_OK || e->state == TOKREG_LOADING)) continue;
        if (e == NULL || now >= e->retry_ns) {
            snprintf(sha, 65, "%s", r->want[i]);
            return true;
        }
        if (*wake_ns == 0 || e->retry_ns < *wake_ns) *wake_ns = e->retry_ns;
    }
    return false;
}

static void *prefetch_main(void *arg) {
    lc_tokreg *r = arg;
    (void)pthread_setname_np(pthread_self(), "lc-tokreg"); /* cosmetic */
    pthread_mutex_lock(&r->mu);
    while (!r->stop) {
        char sha[65];
        int64_t wake;
        if (next_due(r, sha, &wake)) {
            pthread_mutex_unlock(&r->mu);
            const tok *t;
            pie_status st;
            if (lc_tokreg_get(r, sha, &t, &st) == PIE_OK && r->cfg.loaded)
                r->cfg.loaded(r->cfg.loaded_ctx);
            pthread_mutex_lock(&r->mu);
        } else if (wake == 0) {
            pthread_cond_wait(&r->cv, &r->mu);
        } else {
            struct timespec ts = {.tv_sec = (time_t)(wake / 1000000000),
                                  .tv_nsec = (long)(wake % 1000000000)};
            pthread_cond_timedwait(&r->cv, &r->mu, &ts);
        }
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

/* ---- lifetime -------------------------------------------------------------------------------- */

static pie_code init_sync(lc_tokreg *r) {
    if (pthread_mutex_init(&r->mu, NULL) != 0) return PIE_RESOURCE_EXHAUSTED;
    pthread_condattr_t ca;
    int rc = pthread_condattr_init(&ca);
    if (rc == 0) { /* prefetch_main waits for retry times of now_ns, a CLOCK_MONOTONIC time */
        rc = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        if (rc == 0) rc = pthread_cond_init(&r->cv, &ca);
        pthread_condattr_destroy(&ca);
    }
    if (rc != 0) {
        pthread_mutex_destroy(&r->mu);
        return PIE_RESOURCE_EXHAUSTED;
    }
    return PIE_OK;
}

lc_tokreg *lc_tokreg_create(const lc_tokreg_config *cfg, pie_status *st) {
    lc_tokreg *r = calloc(1, sizeof *r);
    if (r == NULL) goto oom;
    r->cfg = *cfg;
    r->path = strdup(cfg->path ? cfg->path : "");
    r->cache_dir = strdup(cfg->cache_dir ? cfg->cache_dir : "");
    if (r->path == NULL || r->cache_dir == NULL) goto oom_free;
    if (init_sync(r) != PIE_OK) goto oom_free;
    r->cfg.path = r->path;
    r->cfg.cache_dir = r->cache_dir;
    if (r->cache_dir[0] && mkdir(r->cache_dir, 0700) != 0 && errno != EEXIST) {
        pie_status_set(st, PIE_FAILED_PRECONDITION, "tokenizer cache: cannot create %s: %s",
                       r->cache_dir, strerror(errno));
        lc_tokreg_destroy(r);
        return NULL;
    }
    int rc = pthread_create(&r->thread, NULL, prefetch_main, r);
    if (rc != 0) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "tokenizer registry: pthread_create: %s",
                       strerror(rc));
        lc_tokreg_destroy(r);
        return NULL;
    }
    r->thread_started = true;
    return r;
oom_free:
    free(r->path);
    free(r->cache_dir);
    free(r);
oom:
    pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
    return NULL;
}

void lc_tokreg_stop(lc_tokreg *r) {
    if (r == NULL || !r->thread_started) return;
    pthread_mutex_lock(&r->mu);
    r->stop = true;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    int rc = pthread_join(r->thread, NULL);
    if (rc != 0) pie_log_error("lc.tokreg.join", "error=\"%s\"", strerror(rc));
    r->thread_started = false;
}

void lc_tokreg_destroy(lc_tokreg *r) {
    if (r == NULL) return;
    lc_tokreg_stop(r);
    for (size_t i = 0; i < r->n_files; i++) free(r->files[i].path);
    for (size_t i = 0; i < r->n_entries; i++) {
        tok_free(r->entries[i]->t);
        free(r->entries[i]->msg);
        free(r->entries[i]);
    }
    free(r->files);
    free(r->entries);
    free(r->want);
    free(r->path);
    free(r->cache_dir);
    pthread_cond_destroy(&r->cv);
    pthread_mutex_destroy(&r->mu);
    free(r);
}
