/* pie_budget.h — a byte budget shared by threads: what a lifecycle replica's instances may hold
 * at once (linear memories, queued calls, inboxes, uploads in flight; limits.replica_memory).
 *
 * Owns: the count and the bound, with atomic take/give (no lock). Does not own: what is charged
 * (each caller gives back exactly what it took). A zeroed struct is an unbounded budget; a NULL
 * budget takes everything. */
#ifndef PIE_BUDGET_H
#define PIE_BUDGET_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

typedef struct pie_budget {
    _Atomic uint64_t used;
    uint64_t max; /* 0 = unbounded (still counted) */
} pie_budget;

/* Charges n bytes if they fit (used + n <= max); false and nothing charged otherwise. */
bool pie_budget_take(pie_budget *b, uint64_t n);
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
