/* wrk_numa.c — see wrk_numa.h. */
#include "wrk_numa.h"

#include <errno.h>
#include <linux/mempolicy.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

bool wrk_numa_node_exists(int node) {
    if (node < 0 || node >= WRK_NUMA_MAX_NODES) return false;
    char path[64];
    snprintf(path, sizeof path, "/sys/devices/system/node/node%d", node);
    struct stat sb;
    if (stat(path, &sb) == 0) return true;
    return node == 0 && stat("/sys/devices/system/node", &sb) != 0; /* no NUMA sysfs: node 0 */
}

int wrk_numa_nodes(void) {
    int n = 1;
    for (int node = 1; node < WRK_NUMA_MAX_NODES; node++)
        if (wrk_numa_node_exists(node)) n = node + 1;
    return n;
}

pie_code wrk_numa_bind(void *p, size_t bytes, int node, const char *what, pie_status *st) {
    if (node < 0 || node >= WRK_NUMA_MAX_NODES)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "NUMA node %d for %s is out of range [0, %d)", node, what,
                              WRK_NUMA_MAX_NODES);
    unsigned long mask = 1ul << node;
    if (syscall(SYS_mbind, p, bytes, MPOL_BIND, &mask, sizeof mask * 8, 0) != 0)
        return pie_status_set(st, PIE_UNAVAILABLE, "cannot bind %s (%zu bytes) to NUMA node %d: %s",
                              what, bytes, node, strerror(errno));
    return PIE_OK;
}

int wrk_numa_node_of(const void *p, bool *bound) {
    int node = -1, mode = -1;
    unsigned long mask = 0;
    if (bound) {
        *bound = false;
        if (syscall(SYS_get_mempolicy, &mode, &mask, sizeof mask * 8, p, MPOL_F_ADDR) == 0)
            *bound = mode == MPOL_BIND;
    }
    if (syscall(SYS_get_mempolicy, &node, NULL, 0, p, MPOL_F_NODE | MPOL_F_ADDR) != 0) return -1;
    return node;
}
