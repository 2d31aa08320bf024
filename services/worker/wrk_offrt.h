/* wrk_offrt.h — CPU attention offload in a running worker (issue 13): its metrics and, under
 * memory.policy auto, the choice made at load.
 *
 * Owns: the pie_worker_offload_* families (sampled from the engine's offload stats at each
 * scrape, or the null backend's emulated device's) and pie_worker_memory_auto_choice. Registered for every policy and backend (zero
 * where nothing is offloaded), like the swap families of wrk_memrt.h. Does not own: the
 * decisions (mem/wrk_offload.h), moving KV (engine/eng_cpu_offload.c). */
#ifndef WRK_OFFRT_H
#define WRK_OFFRT_H

#include "eng.h"
#include "pie_metrics.h"
#include "pie_status.h"
#include "wrk_backend.h"
#include "wrk_mempol.h"
#include "wrk_nulldev.h"

typedef struct wrk_offrt wrk_offrt;

/* b: the worker's backend (borrowed; its offload_get_stats, when it has one, feeds the metrics;
 * NULL: nothing is offloaded); auto_choice: the policy auto chose (WRK_MEM_SWAP or
 * WRK_MEM_OFFLOAD), or WRK_MEM_GPU when the worker was not started with auto. metrics must
 * outlive the result's registration (destroy it after the last scrape). */
wrk_offrt *wrk_offrt_create(const wrk_backend *b, wrk_mem_policy auto_choice, pie_metrics *metrics,
                            pie_status *st);
void wrk_offrt_destroy(wrk_offrt *r);
/* The null backend: the metrics follow its emulated device d (offload; zero otherwise) when
 * the worker has no engine. Before the first scrape. */
void wrk_offrt_use_nulldev(wrk_offrt *r, wrk_nulldev *d);
/* The emulated device's offload counters and profiled costs in the engine's shape. */
void wrk_offrt_nulldev_stats(wrk_nulldev *d, eng_offload_stats *out);

#endif
