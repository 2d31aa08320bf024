/* lc_program.c — see lc_program.h. */
#include "lc_program.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "pie_file.h"
#include "pie_sha256.h"
#include "pie_tenant.h"

typedef struct lc_program_loaded {
    char id[65];
    lc_wasm_module *m; /* the store's reference */
    uint64_t used;     /* the store's clock at its last load or launch */
} lc_program_loaded;

struct lc_program_store {
    char dir[4096];    /* <dir>/programs */
    char native[4096]; /* lc_wasm cache directory */
    lc_wasm_rt *rt;
    uint64_t max_bytes;
    pthread_mutex_t mu; /* guards the fields below */
    lc_program_loaded *loaded;
    size_t n_loaded, cap_loaded;
    size_t max_loaded; /* 0: no bound */
    uint64_t max_stored; /* programs.store_size: bytes of module files; 0: no bound */
    uint64_t clock;    /* counts loads and launches: the loaded modules' recency */
    /* metrics (lc_program_store_metrics); seen: the runtime's counters at the last scrape */
    pie_gauge *g_loaded, *g_t1_queued, *g_cache_bytes, *g_stored, *g_stored_bytes, *g_store_size;
    pie_counter *c_compiles[2], *c_cache_removals;
    pthread_mutex_t scrape_mu; /* collectors may run on several threads at once */
    pthread_mutex_t put_mu;    /* one upload at a time checks the bound and writes its module */
    lc_wasm_rt_stats seen;
};

static pie_code check_id(const char *id, pie_status *st) {
    if (pie_sha256_is_hex(id)) return PIE_OK;
    return pie_status_set(st, PIE_INVALID_ARGUMENT,
                          "program_id: \"%.80s\" is not 64 lowercase hex digits (a SHA-256)",
                          id ? id : "");
}

static void path_of(const lc_program_store *ps, const char *id, const char *ext, char *out,
                    size_t cap) {
    snprintf(out, cap, "%s/%s.%s", ps->dir, id, ext);
}

static uint64_t now_unix_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

lc_program_store *lc_program_store_create(const char *dir, const char *native_dir, lc_wasm_rt *rt,
                                          uint64_t max_bytes, pie_status *st) {
    lc_program_store *ps = calloc(1, sizeof *ps);
    if (ps == NULL || pthread_mutex_init(&ps->mu, NULL) != 0) {
        free(ps);
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    if (pthread_mutex_init(&ps->scrape_mu, NULL) != 0) {
        pthread_mutex_destroy(&ps->mu);
        free(ps);
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    if (pthread_mutex_init(&ps->put_mu, NULL) != 0) {
        pthread_mutex_destroy(&ps->scrape_mu);
        pthread_mutex_destroy(&ps->mu);
        free(ps);
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    snprintf(ps->dir, sizeof ps->dir, "%s/programs", dir);
    snprintf(ps->native, sizeof ps->native, "%s", native_dir);
    ps->rt = rt;
    ps->max_bytes = max_bytes;
    if ((mkdir(dir, 0700) != 0 && errno != EEXIST) ||
        (mkdir(ps->dir, 0700) != 0 && errno != EEXIST)) {
        pie_status_set(st, PIE_FAILED_PRECONDITION, "runtime cache dir: cannot create %s: %s",
                       ps->dir, strerror(errno));
        lc_program_store_destroy(ps);
        return NULL;
    }
    return ps;
}

/* A tenant's hold on a stored program is an empty file <id>.by.<tenant> beside it: created
 * and removed atomically, shared by replicas sharing the directory. */
static void holder_path(const lc_program_store *ps, const char *id, const char *tenant, char *out,
                        size_t cap) {
    snprintf(out, cap, "%s/%s.by.%s", ps->dir, id, tenant);
}

/* The size of <id>.wasm for a directory entry named <id><rest>; false when it is not stored. */
static bool module_size_of(DIR *d, const char *entry, uint64_t *size) {
    char name[70];
    memcpy(name, entry, 64);
    memcpy(name + 64, ".wasm", 6);
    struct stat sb;
    if (fstatat(dirfd(d), name, &sb, 0) != 0) return false;
    *size = (uint64_t)sb.st_size;
    return true;
}

/* The programs in the directory and their module bytes; *held: the bytes of those tenant
 * (NULL: none) holds. A scan rather than counts kept in memory: replicas may share the
 * directory, and uploads are rare beside a readdir of it. */
static void store_usage(const lc_program_store *ps, const char *tenant, uint64_t *n,
                        uint64_t *bytes, uint64_t *held) {
    *n = *bytes = *held = 0;
    DIR *d = opendir(ps->dir);
    if (d == NULL) return;
    size_t tlen = tenant ? strlen(tenant) : 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        size_t len = strlen(e->d_name);
        uint64_t size;
        char id[65];
        if (len < 64) continue;
        memcpy(id, e->d_name, 64);
        id[64] = '\0';
        if (!pie_sha256_is_hex(id)) continue;
        if (len == 69 && strcmp(e->d_name + 64, ".wasm") == 0) {
            if (!module_size_of(d, e->d_name, &size)) continue;
            (*n)++;
            *bytes += size;
        } else if (tenant && len == 68 + tlen && memcmp(e->d_name + 64, ".by.", 4) == 0 &&
                   strcmp(e->d_name + 68, tenant) == 0 && module_size_of(d, e->d_name, &size)) {
            *held += size;
        }
    }
    closedir(d);
}

static void store_collect(void *arg) {
    lc_program_store *ps = arg;
    uint64_t n, bytes, held;
    store_usage(ps, NULL, &n, &bytes, &held);
    pie_gauge_set(ps->g_stored, (double)n);
    pie_gauge_set(ps->g_stored_bytes, (double)bytes);
    pthread_mutex_lock(&ps->put_mu);
    pie_gauge_set(ps->g_store_size, (double)ps->max_stored);
    pthread_mutex_unlock(&ps->put_mu);
    lc_wasm_rt_stats s = lc_wasm_rt_stats_get(ps->rt);
    pie_gauge_set(ps->g_loaded, s.modules_loaded);
    pie_gauge_set(ps->g_t1_queued, s.tier1_queued);
    pie_gauge_set(ps->g_cache_bytes, (double)s.cache_bytes);
    pthread_mutex_lock(&ps->scrape_mu);
    pie_counter_add(ps->c_compiles[0], s.tier0_compiles - ps->seen.tier0_compiles);
    pie_counter_add(ps->c_compiles[1], s.tier1_compiles - ps->seen.tier1_compiles);
    pie_counter_add(ps->c_cache_removals, s.cache_removals - ps->seen.cache_removals);
    ps->seen = s;
    pthread_mutex_unlock(&ps->scrape_mu);
}

pie_code lc_program_store_metrics(lc_program_store *ps, pie_metrics *m, pie_status *st) {
    struct {
        pie_gauge **g;
        const char *name, *help;
    } gauges[] = {
        {&ps->g_loaded, "pie_lifecycle_programs_loaded",
         "programs loaded now (native code mapped): those programs.max_loaded keeps, and those "
         "running instances hold"},
        {&ps->g_t1_queued, "pie_lifecycle_tier1_queued",
         "loaded programs waiting for their tier-1 compile (cc -O2)"},
        {&ps->g_cache_bytes, "pie_lifecycle_native_cache_bytes",
         "disk the native code cache takes, as this replica counts it (runtime.cache_size)"},
        {&ps->g_stored, "pie_lifecycle_programs_stored",
         "programs in the store directory (uploaded, or fetched from the registry to launch)"},
        {&ps->g_stored_bytes, "pie_lifecycle_programs_stored_bytes",
         "bytes of the stored programs' modules (programs.store_size)"},
        {&ps->g_store_size, "pie_lifecycle_programs_store_size_bytes",
         "programs.store_size: the bound on pie_lifecycle_programs_stored_bytes (0: none)"},
    };
    for (size_t i = 0; i < sizeof gauges / sizeof gauges[0]; i++)
        if (!(*gauges[i].g = pie_metrics_gauge(m, gauges[i].name, gauges[i].help, NULL, 0, st)))
            return st->code;
    for (int t = 0; t < 2; t++) {
        pie_metric_label l = {"tier", t ? "1" : "0"};
        if (!(ps->c_compiles[t] = pie_metrics_counter(
                  m, "pie_lifecycle_compiles_total",
                  "programs compiled to native code, by tier (0: tcc, at upload or first launch; "
                  "1: cc -O2 in the background)",
                  &l, 1, st)))
            return st->code;
    }
    if (!(ps->c_cache_removals = pie_metrics_counter(
              m, "pie_lifecycle_native_cache_removals_total",
              "programs' native code removed to keep the cache within runtime.cache_size", NULL, 0,
              st)))
        return st->code;
    ps->seen = lc_wasm_rt_stats_get(ps->rt);
    return pie_metrics_add_collector(m, store_collect, ps, st);
}

void lc_program_store_set_max_loaded(lc_program_store *ps, size_t n) {
    pthread_mutex_lock(&ps->mu);
    ps->max_loaded = n;
    pthread_mutex_unlock(&ps->mu);
}

void lc_program_store_set_max_stored(lc_program_store *ps, uint64_t bytes) {
    pthread_mutex_lock(&ps->put_mu);
    ps->max_stored = bytes;
    pthread_mutex_unlock(&ps->put_mu);
}

void lc_program_store_destroy(lc_program_store *ps) {
    if (ps == NULL) return;
    for (size_t i = 0; i < ps->n_loaded; i++) lc_wasm_module_release(ps->loaded[i].m);
    free(ps->loaded);
    pthread_mutex_destroy(&ps->put_mu);
    pthread_mutex_destroy(&ps->scrape_mu);
    pthread_mutex_destroy(&ps->mu);
    free(ps);
}

uint64_t lc_program_max_bytes(const lc_program_store *ps) { return ps->max_bytes; }

/* Reads the .meta file: "<uploaded_unix_ms>\n<name>" (name to the end). */
static bool read_meta(const lc_program_store *ps, const char *id, char *name, size_t cap,
                      uint64_t *uploaded_ms) {
    char path[4200], buf[LC_PROGRAM_NAME_MAX + 64];
    path_of(ps, id, "meta", path, sizeof path);
    FILE *f = fopen(path, "re");
    if (f == NULL) return false;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    char *nl = strchr(buf, '\n');
    if (nl == NULL) return false;
    *nl = '\0';
    if (uploaded_ms) *uploaded_ms = strtoull(buf, NULL, 10);
    if (name) snprintf(name, cap, "%s", nl + 1);
    return true;
}

static pie_code write_meta(const lc_program_store *ps, const char *id, const char *name,
                           uint64_t uploaded_ms, pie_status *st) {
    char path[4200], buf[LC_PROGRAM_NAME_MAX + 64];
    path_of(ps, id, "meta", path, sizeof path);
    int n = snprintf(buf, sizeof buf, "%llu\n%s", (unsigned long long)uploaded_ms, name);
    return lc_wasm_write_file(path, buf, (size_t)n, st);
}

/* Takes the least recently used module out of the loaded set when it is full (max_loaded), for
 * the caller to release outside the lock; NULL when there is room. Caller holds ps->mu. */
static lc_wasm_module *evict_lru_locked(lc_program_store *ps) {
    if (ps->max_loaded == 0 || ps->n_loaded < ps->max_loaded) return NULL;
    size_t lru = 0;
    for (size_t i = 1; i < ps->n_loaded; i++)
        if (ps->loaded[i].used < ps->loaded[lru].used) lru = i;
    lc_wasm_module *m = ps->loaded[lru].m;
    ps->loaded[lru] = ps->loaded[--ps->n_loaded];
    return m;
}

/* Keeps m as the store's module for id (takes the reference), unless one is there already or
 * the program was deleted meanwhile; unloads the least recently used one when the set is full
 * (instances keep their own references, so running ones are not touched). The stored check is
 * under ps->mu, as a delete's removal from the set is (after it unlinks the file): a delete
 * either finds m in the set or has unlinked the file before the check. */
static void keep_loaded(lc_program_store *ps, const char *id, lc_wasm_module *m) {
    char path[4200];
    path_of(ps, id, "wasm", path, sizeof path);
    pthread_mutex_lock(&ps->mu);
    bool drop = access(path, F_OK) != 0;
    for (size_t i = 0; i < ps->n_loaded && !drop; i++) drop = strcmp(ps->loaded[i].id, id) == 0;
    if (drop) {
        pthread_mutex_unlock(&ps->mu);
        lc_wasm_module_release(m);
        return;
    }
    lc_wasm_module *evicted = evict_lru_locked(ps);
    if (ps->n_loaded == ps->cap_loaded) {
        size_t cap = ps->cap_loaded ? ps->cap_loaded * 2 : 16;
        lc_program_loaded *l = realloc(ps->loaded, cap * sizeof *l);
        if (l == NULL) { /* not fatal: the module is loaded again at the next launch */
            pthread_mutex_unlock(&ps->mu);
            lc_wasm_module_release(m);
            lc_wasm_module_release(evicted);
            return;
        }
        ps->loaded = l;
        ps->cap_loaded = cap;
    }
    lc_program_loaded *e = &ps->loaded[ps->n_loaded++];
    snprintf(e->id, sizeof e->id, "%s", id);
    e->m = m;
    e->used = ++ps->clock;
    pthread_mutex_unlock(&ps->mu);
    lc_wasm_module_release(evicted); /* unmapped once its last instance is gone */
}

pie_code lc_program_put(lc_program_store *ps, const void *wasm, size_t len, const char *sha256,
                        const char *name, const lc_program_holder *holder, char id_out[65],
                        bool *already, pie_status *st) {
    return lc_program_put_cancel(ps, wasm, len, sha256, name, holder, NULL, id_out, already, st);
}

/* Whether len more bytes of program id fit: within programs.store_size unless id is stored
 * already (its file is replaced by the same bytes), and within the holder's quota unless it
 * holds id already. RESOURCE_EXHAUSTED naming the bound otherwise. Caller holds put_mu for the
 * check that precedes a write. */
static pie_code check_room(const lc_program_store *ps, const char *id, size_t len,
                           const lc_program_holder *h, pie_status *st) {
    char path[4200];
    path_of(ps, id, "wasm", path, sizeof path);
    bool stored = access(path, F_OK) == 0, held = false;
    if (h && h->tenant) {
        holder_path(ps, id, h->tenant, path, sizeof path);
        held = access(path, F_OK) == 0;
    }
    bool store_counts = ps->max_stored && !stored;
    bool quota_counts = h && h->tenant && h->max_bytes && !held;
    if (!store_counts && !quota_counts) return PIE_OK;
    uint64_t n, used, mine;
    store_usage(ps, quota_counts ? h->tenant : NULL, &n, &used, &mine);
    if (store_counts && used + len > ps->max_stored)
        return pie_status_set(
            st, PIE_RESOURCE_EXHAUSTED,
            "program store full: %llu programs hold %llu bytes, %zu more would pass "
            "programs.store_size (%llu); delete programs (piectl delete) or raise it",
            (unsigned long long)n, (unsigned long long)used, len,
            (unsigned long long)ps->max_stored);
    if (quota_counts && mine + len > h->max_bytes)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "tenant \"%s\" quota program_bytes (%llu) reached: the programs it "
                              "holds on this replica take %llu bytes, %zu more requested; delete "
                              "some (piectl delete)",
                              h->tenant, (unsigned long long)h->max_bytes, (unsigned long long)mine,
                              len);
    return PIE_OK;
}

/* Records h's hold on stored program id. Caller holds put_mu. */
static pie_code hold(const lc_program_store *ps, const char *id, const lc_program_holder *h,
                     pie_status *st) {
    if (h == NULL || h->tenant == NULL) return PIE_OK;
    char path[4200];
    holder_path(ps, id, h->tenant, path, sizeof path);
    int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0)
        return pie_status_set(st, PIE_INTERNAL, "program store: cannot create %s: %s", path,
                              strerror(errno));
    close(fd);
    return PIE_OK;
}

pie_code lc_program_put_cancel(lc_program_store *ps, const void *wasm, size_t len,
                               const char *sha256, const char *name,
                               const lc_program_holder *holder, lc_wasm_cancel *cancel,
                               char id_out[65], bool *already, pie_status *st) {
    /* Refused before its compile when it clearly does not fit; checked again before the write,
     * since other uploads may have filled the store while this one compiled. */
    char id[65];
    pie_code rc = PIE_OK;
    if (sha256)
        snprintf(id, sizeof id, "%s", sha256);
    else
        rc = pie_sha256_hex(wasm, len, id, st);
    pthread_mutex_lock(&ps->put_mu);
    if (rc == PIE_OK) rc = check_room(ps, id, len, holder, st);
    pthread_mutex_unlock(&ps->put_mu);
    if (rc != PIE_OK) return rc;
    lc_wasm_module *m = NULL;
    if (lc_wasm_module_load_id(ps->rt, wasm, len, id, cancel, &m, st) != PIE_OK) return st->code;
    snprintf(id_out, 65, "%s", lc_wasm_module_id(m));
    char path[4200];
    path_of(ps, id_out, "wasm", path, sizeof path);
    struct stat sb;
    uint64_t uploaded_ms = now_unix_ms();
    pthread_mutex_lock(&ps->put_mu);
    *already = stat(path, &sb) == 0 && (uint64_t)sb.st_size == len &&
               read_meta(ps, id_out, NULL, 0, &uploaded_ms);
    rc = check_room(ps, id_out, len, holder, st);
    if (rc == PIE_OK && !*already) rc = lc_wasm_write_file(path, wasm, len, st);
    if (rc == PIE_OK) rc = write_meta(ps, id_out, name, uploaded_ms, st);
    if (rc == PIE_OK) rc = hold(ps, id_out, holder, st);
    pthread_mutex_unlock(&ps->put_mu);
    if (rc != PIE_OK) {
        lc_wasm_module_release(m);
        return rc;
    }
    keep_loaded(ps, id_out, m);
    return PIE_OK;
}

pie_code lc_program_lookup(lc_program_store *ps, const char *id, char *name, size_t cap,
                           pie_status *st) {
    if (check_id(id, st) != PIE_OK) return st->code;
    char path[4200];
    path_of(ps, id, "wasm", path, sizeof path);
    if (access(path, R_OK) != 0)
        return pie_status_set(st, PIE_NOT_FOUND,
                              "program_id: %s is not stored on this replica "
                              "(upload it first)",
                              id);
    if (name && !read_meta(ps, id, name, cap, NULL)) snprintf(name, cap, "%s", "");
    return PIE_OK;
}

/* lc_wasm_instance_create from the module in memory; NOT_FOUND when none is loaded. The
 * store's lock keeps the module alive while the instance takes its own reference. */
static pie_code instance_from_loaded(lc_program_store *ps, const char *id,
                                     const lc_wasm_instance_opts *opts, lc_wasm_instance **out,
                                     pie_status *st) {
    pie_code rc = PIE_NOT_FOUND;
    pthread_mutex_lock(&ps->mu);
    for (size_t i = 0; i < ps->n_loaded; i++)
        if (strcmp(ps->loaded[i].id, id) == 0) {
            ps->loaded[i].used = ++ps->clock;
            rc = lc_wasm_instance_create(ps->loaded[i].m, opts, out, st);
            break;
        }
    pthread_mutex_unlock(&ps->mu);
    return rc;
}

/* A stored program: no size cap here, the upload limit applied when it was stored (a lower
 * limit configured since must not make stored programs unreadable). */
static pie_code read_program(const char *path, uint8_t **out, size_t *len, pie_status *st) {
    char *buf = NULL;
    pie_code rc = pie_file_read(path, "program", SIZE_MAX, &buf, len, st);
    *out = (uint8_t *)buf;
    return rc;
}

pie_code lc_program_bytes(lc_program_store *ps, const char *id, uint8_t **bytes, size_t *len,
                          char *name, size_t cap, pie_status *st) {
    *bytes = NULL;
    *len = 0;
    if (check_id(id, st) != PIE_OK) return st->code;
    char path[4200];
    path_of(ps, id, "wasm", path, sizeof path);
    if (read_program(path, bytes, len, st) != PIE_OK) return st->code;
    if (!read_meta(ps, id, name, cap, NULL)) snprintf(name, cap, "%s", "");
    return PIE_OK;
}

pie_code lc_program_instance(lc_program_store *ps, const char *id,
                             const lc_wasm_instance_opts *opts, lc_wasm_instance **out,
                             pie_status *st) {
    if (check_id(id, st) != PIE_OK) return st->code;
    pie_code rc = instance_from_loaded(ps, id, opts, out, st);
    if (rc != PIE_NOT_FOUND) return rc;
    /* Stored by another replica or before a restart: load from disk (the native cache makes
     * this a dlopen unless no one compiled it yet). */
    char path[4200];
    path_of(ps, id, "wasm", path, sizeof path);
    uint8_t *wasm = NULL;
    size_t len = 0;
    if (read_program(path, &wasm, &len, st) != PIE_OK) return st->code;
    lc_wasm_module *m = NULL;
    rc = lc_wasm_module_load(ps->rt, wasm, len, &m, st);
    free(wasm);
    if (rc != PIE_OK) return rc;
    if (strcmp(lc_wasm_module_id(m), id) != 0) {
        lc_wasm_module_release(m);
        return pie_status_set(st, PIE_DATA_LOSS, "program store: %s does not hash to its id", path);
    }
    /* The instance comes from the module in hand: with more programs launched at once than
     * programs.max_loaded, another launch may unload it from the set before a lookup there
     * (which failed such launches "was deleted"). */
    rc = lc_wasm_instance_create(m, opts, out, st);
    keep_loaded(ps, id, m);
    return rc;
}

/* Best tier for a program: the loaded module's, else what the native cache holds. */
static Pie__V1__ProgramTier tier_of(lc_program_store *ps, const char *id) {
    int t = -1;
    pthread_mutex_lock(&ps->mu);
    for (size_t i = 0; i < ps->n_loaded; i++)
        if (strcmp(ps->loaded[i].id, id) == 0) t = lc_wasm_module_tier(ps->loaded[i].m);
    pthread_mutex_unlock(&ps->mu);
    if (t < 0) {
        char path[4300];
        snprintf(path, sizeof path, "%s/%s/t1.so", ps->native, id);
        if (access(path, R_OK) == 0) return PIE__V1__PROGRAM_TIER__PROGRAM_TIER_OPTIMIZED;
        snprintf(path, sizeof path, "%s/%s/t0.so", ps->native, id);
        return access(path, R_OK) == 0 ? PIE__V1__PROGRAM_TIER__PROGRAM_TIER_QUICK
                                       : PIE__V1__PROGRAM_TIER__PROGRAM_TIER_NONE;
    }
    return t == 1 ? PIE__V1__PROGRAM_TIER__PROGRAM_TIER_OPTIMIZED
                  : PIE__V1__PROGRAM_TIER__PROGRAM_TIER_QUICK;
}

/* The holds on id: glob's result (0: g lists them, to globfree; GLOB_NOMATCH: none). */
static int holds_of(const lc_program_store *ps, const char *id, glob_t *g) {
    char pattern[4200];
    holder_path(ps, id, "*", pattern, sizeof pattern);
    return glob(pattern, GLOB_NOSORT, NULL, g);
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* pi->holders: the tenants holding id, sorted. False when out of memory. */
static bool fill_holders(const lc_program_store *ps, const char *id, Pie__V1__ProgramInfo *pi) {
    glob_t g;
    int rc = holds_of(ps, id, &g);
    if (rc == GLOB_NOMATCH) return true;
    if (rc != 0) return false;
    bool ok = (pi->holders = calloc(g.gl_pathc, sizeof *pi->holders)) != NULL;
    for (size_t i = 0; ok && i < g.gl_pathc; i++) {
        const char *by = strrchr(g.gl_pathv[i], '/'); /* "/<id>.by.<tenant>" */
        by = by ? by + 1 + 64 + 4 : "";
        if (!pie_tenant_name_valid(by)) continue;
        ok = (pi->holders[pi->n_holders] = strdup(by)) != NULL;
        pi->n_holders += ok;
    }
    globfree(&g);
    if (pi->n_holders > 1) qsort(pi->holders, pi->n_holders, sizeof *pi->holders, cmp_str);
    return ok;
}

static void info_free(Pie__V1__ProgramInfo *pi) {
    free(pi->program_id);
    free(pi->name);
    for (size_t i = 0; i < pi->n_holders; i++) free(pi->holders[i]);
    free(pi->holders);
    free(pi);
}

/* What ListPrograms says of id; with its holders when holders. NULL when it is not stored. */
static Pie__V1__ProgramInfo *info_of(lc_program_store *ps, const char *id, bool holders) {
    Pie__V1__ProgramInfo *pi = calloc(1, sizeof *pi);
    char *name = malloc(LC_PROGRAM_NAME_MAX + 1);
    char *pid = strdup(id);
    if (pi == NULL || name == NULL || pid == NULL) goto fail;
    pie__v1__program_info__init(pi);
    char path[4200];
    struct stat sb;
    path_of(ps, id, "wasm", path, sizeof path);
    if (stat(path, &sb) != 0) goto fail; /* deleted meanwhile */
    if (!read_meta(ps, id, name, LC_PROGRAM_NAME_MAX + 1, &pi->uploaded_unix_ms)) name[0] = '\0';
    pi->program_id = pid;
    pi->name = name;
    pi->size_bytes = (uint64_t)sb.st_size;
    pi->tier = tier_of(ps, id);
    if (holders && !fill_holders(ps, id, pi)) {
        info_free(pi);
        return NULL;
    }
    return pi;
fail:
    free(pi);
    free(name);
    free(pid);
    return NULL;
}

static int cmp_info(const void *a, const void *b) {
    return strcmp((*(Pie__V1__ProgramInfo *const *)a)->program_id,
                  (*(Pie__V1__ProgramInfo *const *)b)->program_id);
}

pie_code lc_program_list(lc_program_store *ps, const char *tenant, Pie__V1__ProgramInfo ***out,
                         size_t *n, pie_status *st) {
    *out = NULL;
    *n = 0;
    DIR *d = opendir(ps->dir);
    if (d == NULL)
        return pie_status_set(st, PIE_INTERNAL, "program store: cannot list %s: %s", ps->dir,
                              strerror(errno));
    Pie__V1__ProgramInfo **list = NULL;
    size_t cnt = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        char id[65];
        if (strlen(e->d_name) != 69 || strcmp(e->d_name + 64, ".wasm") != 0) continue;
        memcpy(id, e->d_name, 64);
        id[64] = '\0';
        if (!pie_sha256_is_hex(id)) continue;
        if (tenant) {
            char path[4200];
            holder_path(ps, id, tenant, path, sizeof path);
            if (access(path, F_OK) != 0) continue; /* not the caller's */
        }
        Pie__V1__ProgramInfo *pi = info_of(ps, id, tenant == NULL);
        if (pi == NULL) continue;
        if (cnt == cap) {
            cap = cap ? cap * 2 : 16;
            Pie__V1__ProgramInfo **l = realloc(list, cap * sizeof *l);
            if (l == NULL) {
                lc_program_list_free(&pi, 1);
                lc_program_list_free(list, cnt);
                closedir(d);
                return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
            }
            list = l;
        }
        list[cnt++] = pi;
    }
    closedir(d);
    if (cnt > 1) qsort(list, cnt, sizeof *list, cmp_info);
    *out = list;
    *n = cnt;
    return PIE_OK;
}

void lc_program_list_free(Pie__V1__ProgramInfo **list, size_t n) {
    for (size_t i = 0; i < n; i++) info_free(list[i]);
    free(list);
}

/* Removes every tenant's hold on id (its module is gone). */
static void unhold_all(const lc_program_store *ps, const char *id) {
    glob_t g;
    if (holds_of(ps, id, &g) != 0) return; /* none (or no memory: kept) */
    for (size_t i = 0; i < g.gl_pathc; i++) unlink(g.gl_pathv[i]);
    globfree(&g);
}

/* Whether any tenant holds id. */
static bool held_by_anyone(const lc_program_store *ps, const char *id) {
    glob_t g;
    int rc = holds_of(ps, id, &g);
    if (rc == 0) globfree(&g);
    return rc != GLOB_NOMATCH; /* an error counts as held: nothing is removed on a doubt */
}

/* lc_program_delete of a checked id under put_mu. */
static pie_code delete_locked(lc_program_store *ps, const char *id, pie_status *st) {
    char path[4200];
    path_of(ps, id, "wasm", path, sizeof path);
    pie_code rc = PIE_OK;
    int err = unlink(path) == 0 ? 0 : errno;
    if (err != 0 && err != ENOENT)
        return pie_status_set(st, PIE_INTERNAL, "program store: cannot remove %s: %s", path,
                              strerror(err));
    if (err == ENOENT) /* or a replica sharing the directory removed it: unloaded below */
        rc = pie_status_set(st, PIE_NOT_FOUND, "program_id: %s is not stored on this replica", id);
    path_of(ps, id, "meta", path, sizeof path);
    unlink(path); /* a missing label only loses the name */
    unhold_all(ps, id);
    lc_wasm_module *m = NULL;
    pthread_mutex_lock(&ps->mu);
    for (size_t i = 0; i < ps->n_loaded; i++)
        if (strcmp(ps->loaded[i].id, id) == 0) {
            m = ps->loaded[i].m;
            ps->loaded[i] = ps->loaded[--ps->n_loaded];
            break;
        }
    pthread_mutex_unlock(&ps->mu);
    lc_wasm_module_release(m); /* running instances hold their own references */
    pie_status ignored; /* loaded by a running instance: the cache's bound removes it later */
    (void)lc_wasm_rt_forget(ps->rt, id, &ignored);
    return rc;
}

pie_code lc_program_release(lc_program_store *ps, const char *id, const char *tenant, bool *held,
                            pie_status *st) {
    *held = false;
    if (check_id(id, st) != PIE_OK) return st->code;
    char path[4200];
    holder_path(ps, id, tenant, path, sizeof path);
    pthread_mutex_lock(&ps->put_mu); /* no put adds a hold between the check and the delete */
    *held = unlink(path) == 0;
    pie_code rc = PIE_OK;
    if (*held && !held_by_anyone(ps, id)) {
        rc = delete_locked(ps, id, st);
        if (rc == PIE_NOT_FOUND) rc = PIE_OK; /* a replica sharing the directory deleted it */
    }
    pthread_mutex_unlock(&ps->put_mu);
    return rc;
}

pie_code lc_program_delete(lc_program_store *ps, const char *id, pie_status *st) {
    if (check_id(id, st) != PIE_OK) return st->code;
    pthread_mutex_lock(&ps->put_mu); /* a put of the same bytes meanwhile keeps its hold */
    pie_code rc = delete_locked(ps, id, st);
    pthread_mutex_unlock(&ps->put_mu);
    return rc;
}
