/* pie_budget.c — see pie_budget.h. */
#include "pie_budget.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* How many of n bytes do not fit when cur are used (0: they fit). */
static uint64_t short_by(const pie_budget *b, uint64_t cur, uint64_t n) {
    if (b->max == 0) return 0;
    uint64_t avail = cur >= b->max ? 0 : b->max - cur;
    return n > avail ? n - avail : 0;
}

/* Asks the reclaimer for want bytes; whether it gave any back (so that trying again may pay). */
static bool reclaimed(pie_budget *b, uint64_t want) {
    return b->reclaim != NULL && b->reclaim(b->reclaim_arg, want) > 0;
}

/* pie_budget_take of b alone, its parent aside. */
static bool take_here(pie_budget *b, uint64_t n) {
    uint64_t cur = atomic_load_explicit(&b->used, memory_order_relaxed);
    for (;;) {
        uint64_t missing = short_by(b, cur, n);
        if (missing == 0) {
            if (atomic_compare_exchange_weak_explicit(&b->used, &cur, cur + n, memory_order_relaxed,
                                                      memory_order_relaxed))
                return true;
            continue; /* cur was reloaded */
        }
        if (!reclaimed(b, missing)) return false;
        cur = atomic_load_explicit(&b->used, memory_order_relaxed);
    }
}

bool pie_budget_take(pie_budget *b, uint64_t n) {
    if (b == NULL || n == 0) return true;
    if (!take_here(b, n)) return false;
    if (pie_budget_take(b->parent, n)) return true;
    atomic_fetch_sub_explicit(&b->used, n, memory_order_relaxed);
    return false;
}

bool pie_budget_room(pie_budget *b, uint64_t n) {
    if (b == NULL) return true;
    for (;;) {
        uint64_t missing = short_by(b, pie_budget_used(b), n);
        if (missing == 0) return pie_budget_room(b->parent, n);
        if (!reclaimed(b, missing)) return false;
    }
}

void pie_budget_set_reclaim(pie_budget *b, pie_budget_reclaim_fn fn, void *arg) {
    if (b == NULL) return;
    b->reclaim = fn;
    b->reclaim_arg = fn ? arg : NULL;
}

void pie_budget_force(pie_budget *b, uint64_t n) {
    for (; b; b = b->parent) atomic_fetch_add_explicit(&b->used, n, memory_order_relaxed);
}

void pie_budget_give(pie_budget *b, uint64_t n) {
    for (; b; b = b->parent) atomic_fetch_sub_explicit(&b->used, n, memory_order_relaxed);
}

uint64_t pie_budget_used(const pie_budget *b) {
    return b ? atomic_load_explicit(&b->used, memory_order_relaxed) : 0;
}

uint64_t pie_budget_free(const pie_budget *b) {
    if (b == NULL || b->max == 0) return UINT64_MAX;
    uint64_t used = pie_budget_used(b);
    return used >= b->max ? 0 : b->max - used;
}

/* A cgroup limit file's value, or 0 for "max", absent or unreadable. */
static uint64_t cgroup_limit(const char *path) {
    FILE *f = fopen(path, "r");
    if (f == NULL) return 0;
    char buf[64] = "";
    bool ok = fgets(buf, sizeof buf, f) != NULL;
    fclose(f);
    if (!ok || strncmp(buf, "max", 3) == 0) return 0;
    char *end;
    unsigned long long v = strtoull(buf, &end, 10);
    if (end == buf) return 0;
    /* cgroup v1 reports "no limit" as a huge page-aligned number */
    return v >= (1ull << 60) ? 0 : (uint64_t)v;
}

uint64_t pie_budget_process_memory(void) {
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    uint64_t phys = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 0;
    uint64_t cg = cgroup_limit("/sys/fs/cgroup/memory.max");
    if (cg == 0) cg = cgroup_limit("/sys/fs/cgroup/memory/memory.limit_in_bytes");
    return cg && (phys == 0 || cg < phys) ? cg : phys;
}
