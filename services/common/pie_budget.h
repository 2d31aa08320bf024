/* pie_budget.h — a byte budget shared by threads: what a lifecycle replica's instances may hold
 * at once (linear memories, queued calls, inboxes, uploads in flight, buffered output;
 * limits.replica_memory).
 *
 * Owns: the count and the bound, with atomic take/give (no lock), and the call to its one
 * reclaimer when a take does not fit, and the charge to its parent when it is a share of
 * another. Does not own: what is charged (each caller gives back exactly what it took) nor what
 * a reclaimer frees. A zeroed struct is an unbounded budget; a NULL budget takes everything. */
#ifndef PIE_BUDGET_H
#define PIE_BUDGET_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

/* Frees memory charged to the budget that its owner can do without (a cache: the output exited
 * instances keep) and gives it back; returns the bytes given back, at least `want` when it can.
 * Called from any thread that takes, whatever locks it holds: it must take no lock that such a
 * thread may hold (its own lock, taken last, and try-locks only). */
typedef uint64_t (*pie_budget_reclaim_fn)(void *arg, uint64_t want);

typedef struct pie_budget {
    _Atomic uint64_t used;
    uint64_t max; /* 0 = unbounded (still counted) */
    /* Set (pie_budget_set_reclaim) before the budget is shared and cleared after its last
     * concurrent taker, so read without synchronisation. */
    pie_budget_reclaim_fn reclaim;
    void *reclaim_arg;
    /* A share of a larger budget (a tenant's of the replica's): every charge here is charged
     * there too, and fits only if it fits both. Set before the budget is shared. */
    struct pie_budget *parent;
} pie_budget;

/* Charges n bytes if they fit (used + n <= max), asking the reclaimer for the difference when they
 * do not; false and nothing charged if they still do not fit. */
bool pie_budget_take(pie_budget *b, uint64_t n);
/* Whether n bytes are free, asking the reclaimer for the difference when they are not; charges
 * nothing (a check before work that takes its bytes later). */
bool pie_budget_room(pie_budget *b, uint64_t n);
/* Installs (fn) or removes (NULL) the budget's reclaimer; see pie_budget.reclaim for when. */
void pie_budget_set_reclaim(pie_budget *b, pie_budget_reclaim_fn fn, void *arg);
/* Charges n bytes whatever the bound (memory that exists already and must be counted). */
void pie_budget_force(pie_budget *b, uint64_t n);
/* Returns n bytes taken before. */
void pie_budget_give(pie_budget *b, uint64_t n);
uint64_t pie_budget_used(const pie_budget *b);
/* Bytes still free (UINT64_MAX when unbounded). */
uint64_t pie_budget_free(const pie_budget *b);

/* The memory this process may use: its cgroup's memory.max (v2) or memory.limit_in_bytes (v1)
 * when set, else the machine's physical memory. 0 if none can be read. */
uint64_t pie_budget_process_memory(void);

#endif
