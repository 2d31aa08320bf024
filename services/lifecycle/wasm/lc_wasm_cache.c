/* lc_wasm_cache.c — the cache directory's size bound and the removal of its entries.
 *
 * Owns: the runtime's estimate of the bytes under <cache_dir> (a scan when the runtime is
 * created, then what compiles add and removals take away, and a scan again at each prune), each
 * entry's last use (the mtime of its `lock` file, set by every load that opens the entry), and
 * removing entries: when the estimate passes opts.cache_max_bytes, entries no module of this
 * runtime holds are removed, least recently used first, down to 3/4 of the bound (so a busy
 * cache is not scanned at every compile); lc_wasm_rt_forget removes one (a deleted program's).
 * Everything here is rebuildable from the module's bytes, which the caller keeps: a removed
 * entry costs its next load a compile, nothing else.
 *
 * An entry is removed under its flock with the lock file unlinked last, so a loader that opened
 * the lock before and waited for it finds it unlinked once it has it and starts again
 * (lc_wasm_compile_load). Entries being compiled (their lock held) are skipped. Replicas that
 * share the directory each prune by their own estimate; one may remove an entry another has
 * loaded — its mapped code stays valid, and its next load compiles again. Does not own: what is
 * written into an entry (lc_wasm_compile.c). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "lc_wasm_int.h"

typedef struct cache_entry {
    char id[65];
    uint64_t bytes;
    struct timespec used;
} cache_entry;

/* out = a/b; false when it does not fit (no such path can be an entry's). */
static bool join(char out[PATH_MAX], const char *a, const char *b) {
    int n = snprintf(out, PATH_MAX, "%s/%s", a, b);
    return n > 0 && n < PATH_MAX;
}

static bool is_entry_name(const char *name) {
    size_t n = strlen(name);
    if (n != 64) return false;
    for (size_t i = 0; i < n; i++)
        if (!((name[i] >= '0' && name[i] <= '9') || (name[i] >= 'a' && name[i] <= 'f')))
            return false;
    return true;
}

/* Bytes the files of the entry directory dir take on disk (their blocks), and its last use (the
 * lock file's mtime, the directory's when it has none). */
static uint64_t entry_measure(const char *dir, struct timespec *used) {
    struct stat sb;
    if (stat(dir, &sb) != 0) return 0;
    uint64_t bytes = 0;
    if (used) *used = sb.st_mtim;
    DIR *d = opendir(dir);
    if (d == NULL) return bytes;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (e->d_name[0] == '.') continue;
        if (fstatat(dirfd(d), e->d_name, &sb, AT_SYMLINK_NOFOLLOW) != 0) continue;
        bytes += (uint64_t)sb.st_blocks * 512u;
        if (used && strcmp(e->d_name, "lock") == 0) *used = sb.st_mtim;
    }
    closedir(d);
    return bytes;
}

uint64_t lc_wasm_cache_entry_bytes(const char *dir) { return entry_measure(dir, NULL); }

/* Takes b from the estimate, never below 0 (an entry another replica wrote was never added). */
static void estimate_sub(lc_wasm_rt *rt, uint64_t b) {
    uint64_t cur = atomic_load(&rt->cache_bytes);
    while (!atomic_compare_exchange_weak(&rt->cache_bytes, &cur, cur > b ? cur - b : 0)) {}
}

void lc_wasm_cache_used(int lock_fd) {
    (void)futimens(lock_fd, NULL); /* best effort: a stale use only makes it an earlier victim */
}

/* Entries of the cache directory (malloc'd, *n of them); the estimate's total in *total. NULL
 * with *n 0 when the directory cannot be read or memory runs out. */
static cache_entry *scan(lc_wasm_rt *rt, size_t *n, uint64_t *total) {
    *n = 0;
    *total = 0;
    DIR *d = opendir(rt->cache_dir);
    if (d == NULL) return NULL;
    cache_entry *v = NULL;
    size_t cap = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (!is_entry_name(e->d_name)) continue;
        if (*n == cap) {
            size_t nc = cap ? cap * 2 : 64;
            cache_entry *nv = realloc(v, nc * sizeof *v);
            if (nv == NULL) break;
            v = nv;
            cap = nc;
        }
        char path[PATH_MAX];
        if (!join(path, rt->cache_dir, e->d_name)) continue;
        cache_entry *ce = &v[*n];
        memcpy(ce->id, e->d_name, 65);
        ce->bytes = entry_measure(path, &ce->used);
        *total += ce->bytes;
        (*n)++;
    }
    closedir(d);
    return v;
}

static bool listed(lc_wasm_rt *rt, const char *id) {
    pthread_mutex_lock(&rt->mu);
    const lc_wasm_module *m = rt->modules;
    while (m != NULL && strcmp(m->id, id) != 0) m = m->next;
    pthread_mutex_unlock(&rt->mu);
    return m != NULL;
}

/* Removes the files of the entry dir, the lock last, then dir. */
static void remove_files(const char *dir) {
    DIR *d = opendir(dir);
    if (d != NULL) {
        for (struct dirent *e; (e = readdir(d)) != NULL;)
            if (e->d_name[0] != '.' && strcmp(e->d_name, "lock") != 0)
                (void)unlinkat(dirfd(d), e->d_name, 0);
        closedir(d);
    }
    char lock[PATH_MAX];
    if (join(lock, dir, "lock")) (void)unlink(lock);
    (void)rmdir(dir); /* fails if a loader got in after the lock went: it rebuilds, that is all */
}

/* Removes entry id unless a module of this runtime holds it or a compile has its lock.
 * PIE_OK when removed (or absent), PIE_FAILED_PRECONDITION saying which when it is in use. */
static pie_code remove_entry(lc_wasm_rt *rt, const char *id, pie_status *st) {
    char dir[PATH_MAX], lock_path[PATH_MAX];
    if (!join(dir, rt->cache_dir, id) || !join(lock_path, dir, "lock"))
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "cache path too long: %s", id);
    /* Created if missing, as a loader does: both sides then follow the same protocol even for
     * an entry whose loader has made the directory but not yet its lock. */
    int lock = open(lock_path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (lock < 0 && errno == ENOENT) { /* no such entry */
        pie_status_ok(st);
        return PIE_OK;
    }
    if (lock < 0)
        return pie_status_set(st, PIE_INTERNAL, "open %s: %s", lock_path, strerror(errno));
    if (flock(lock, LOCK_EX | LOCK_NB) != 0) {
        close(lock);
        return pie_status_set(st, PIE_FAILED_PRECONDITION, "%s is being compiled", id);
    }
    pie_code rc = PIE_OK;
    struct stat sb;
    if (fstat(lock, &sb) != 0 || sb.st_nlink == 0) {
        pie_status_ok(st); /* removed by another meanwhile; a new entry may be in its place */
    } else if (listed(rt, id)) {
        rc = pie_status_set(st, PIE_FAILED_PRECONDITION, "%s is loaded", id);
    } else {
        remove_files(dir);
        pie_status_ok(st);
    }
    flock(lock, LOCK_UN);
    close(lock);
    return rc;
}

static int by_use(const void *a, const void *b) {
    const struct timespec *x = &((const cache_entry *)a)->used,
                          *y = &((const cache_entry *)b)->used;
    if (x->tv_sec != y->tv_sec) return x->tv_sec < y->tv_sec ? -1 : 1;
    if (x->tv_nsec != y->tv_nsec) return x->tv_nsec < y->tv_nsec ? -1 : 1;
    return strcmp(((const cache_entry *)a)->id, ((const cache_entry *)b)->id);
}

/* Scans the directory and removes the least recently used entries nobody here holds until it is
 * at 3/4 of the bound. One prune at a time; a caller that finds one running leaves it to it. */
static void prune(lc_wasm_rt *rt) {
    bool idle = false;
    if (!atomic_compare_exchange_strong(&rt->cache_pruning, &idle, true)) return;
    size_t n;
    uint64_t total;
    cache_entry *v = scan(rt, &n, &total);
    atomic_store(&rt->cache_bytes, total);
    uint64_t target = rt->cache_max / 4 * 3;
    if (v != NULL && total > rt->cache_max) {
        qsort(v, n, sizeof *v, by_use);
        for (size_t i = 0; i < n && total > target; i++) {
            pie_status ignored;
            if (remove_entry(rt, v[i].id, &ignored) != PIE_OK) continue;
            total -= v[i].bytes;
            estimate_sub(rt, v[i].bytes);
            atomic_fetch_add(&rt->cache_removals, 1u);
        }
    }
    free(v);
    atomic_store(&rt->cache_pruning, false);
}

void lc_wasm_cache_init(lc_wasm_rt *rt) {
    size_t n;
    uint64_t total;
    free(scan(rt, &n, &total));
    atomic_store(&rt->cache_bytes, total);
}

void lc_wasm_cache_grew(lc_wasm_rt *rt, uint64_t before, uint64_t after) {
    if (after >= before)
        atomic_fetch_add(&rt->cache_bytes, after - before);
    else
        estimate_sub(rt, before - after);
    if (rt->cache_max != 0 && atomic_load(&rt->cache_bytes) > rt->cache_max) prune(rt);
}

pie_code lc_wasm_rt_forget(lc_wasm_rt *rt, const char *id, pie_status *st) {
    if (id == NULL || !is_entry_name(id))
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "not a module id (64 hex digits): %s",
                              id ? id : "(null)");
    char dir[PATH_MAX];
    if (!join(dir, rt->cache_dir, id))
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "cache path too long: %s", id);
    uint64_t bytes = lc_wasm_cache_entry_bytes(dir);
    if (remove_entry(rt, id, st) != PIE_OK) return st->code;
    estimate_sub(rt, bytes);
    return PIE_OK;
}
