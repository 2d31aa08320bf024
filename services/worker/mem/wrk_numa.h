/* wrk_numa.h — the host pool on a chosen NUMA node (issue 13: `memory.host_numa_node`).
 *
 * Owns: whether a node exists (/sys/devices/system/node/node<N>), binding a freshly mapped
 * range to one node (mbind(2), MPOL_BIND, before its pages are touched: each page is allocated
 * on that node when it is first written, and the kernel fails the fault rather than fall back
 * to another node), and where a page is and under which policy (get_mempolicy(2): tests and
 * logs). Raw system calls: these are the two calls libnuma would wrap, so the worker needs no
 * extra library. Does not own: which memory is the host pool (the swap tier's host region,
 * offload's host page region), the choice of node (configuration). Nodes 0..63. */
#ifndef WRK_NUMA_H
#define WRK_NUMA_H

#include <stdbool.h>
#include <stddef.h>

#include "pie_status.h"

#define WRK_NUMA_MAX_NODES 64

/* Whether node is an online NUMA node of this machine (node 0 on a machine without NUMA). */
bool wrk_numa_node_exists(int node);
/* The highest online node + 1 (1 on a machine without NUMA). */
int wrk_numa_nodes(void);

/* Binds [p, p + bytes) (page aligned, not yet touched) to node; `what` names the memory in the
 * error: INVALID_ARGUMENT for a node out of range, UNAVAILABLE with the system's reason when
 * the kernel refuses. */
pie_code wrk_numa_bind(void *p, size_t bytes, int node, const char *what, pie_status *st);

/* The node the page at p is on (-1 when not known: untouched, or the call failed); *bound is
 * set to whether the page's policy binds it (MPOL_BIND), if bound is not NULL. */
int wrk_numa_node_of(const void *p, bool *bound);

#endif
