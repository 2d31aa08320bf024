/* wrk_memrt.h — the memory policy of a running worker (issue 13): what the registration, Info,
 * WorkerStats and /metrics say about it, and the swap policy's adaptive expansion between
 * steps.
 *
 * Owns: the plan the worker loaded with (mem/wrk_mempol.h), the slot count the engine (or the
 * null backend's emulated device, mem/wrk_nulldev.h) runs at,
 * the effective KV capacity the controller places by (sent again as a CapacityChange whenever
 * expansion moves it), the metric families of the memory tiers (registered for every policy
 * and backend, zero where nothing swaps). Does not own: the sizing rules and the decision
 * (mem/), moving data (the engine's tier), sending (wrk_node.c, through on_capacity). */
#ifndef WRK_MEMRT_H
#define WRK_MEMRT_H

#include <stdint.h>

#include "eng.h"
#include "pie/v1/controller.pb-c.h"
#include "pie_metrics.h"
#include "pie_status.h"
#include "wrk_backend.h"
#include "wrk_mempol.h"
#include "wrk_offload.h"

typedef struct wrk_memrt wrk_memrt;

/* plan is copied; metrics: NULL for none. The engine side comes with wrk_memrt_use_backend
 * (cpu, cuda) or wrk_memrt_use_nulldev. */
wrk_memrt *wrk_memrt_create(const wrk_mem_plan *plan, pie_metrics *metrics, pie_status *st);
void wrk_memrt_destroy(wrk_memrt *r);
/* Policies swap and offload on the null backend: the emulated device (borrowed; it must
 * outlive r) stands in for the engine: under swap its stalls feed adaptive expansion, its slot
 * count follows it, its counters are the swap metrics; under offload its wait for host
 * attention moves the effective capacity. Nothing for the other policies or when r has an
 * engine. */
struct wrk_nulldev;
void wrk_memrt_use_nulldev(wrk_memrt *r, struct wrk_nulldev *d);
/* Policy swap on the cpu and cuda backends: the backend's engine (b borrowed; it must outlive
 * r) runs the slot count adaptive expansion sets, its counters are the swap metrics. Nothing
 * for the other policies or a backend without a swap side. */
void wrk_memrt_use_backend(wrk_memrt *r, const wrk_backend *b);
/* Offload's capacity rule with other knobs than the defaults (benchmarks; before the first
 * forward batch). */
void wrk_memrt_offload_tune(wrk_memrt *r, const wrk_off_adapt_opts *o);

Pie__V1__MemoryPolicy wrk_memrt_policy_pb(const wrk_memrt *r);
/* kv_pages_max, kv_pages_effective (now), kv_pages_gpu into c. */
void wrk_memrt_capacity(const wrk_memrt *r, Pie__V1__WorkerCapacity *c);
/* swap_in_bytes, swap_out_bytes into s. */
void wrk_memrt_stats(const wrk_memrt *r, Pie__V1__WorkerStats *s);

/* Called with the new effective capacity when expansion changes it (on the step thread). */
void wrk_memrt_on_capacity(wrk_memrt *r, void (*fn)(void *user, uint32_t kv_pages_effective),
                           void *user);

/* wrk_exec_opts.after_forward: one forward batch ran (user: the wrk_memrt). */
void wrk_memrt_after_forward(void *user, uint64_t tokens, uint64_t ns, uint32_t kv_live);
/* wrk_exec_opts.after_slots: a SlotBatch allocated KV pages. More live than the effective
 * capacity means the controller spilled (it may allocate up to kv_pages_max rather than
 * terminate an instance): the device moves to the most layers that hold them — fewer on the
 * device, more on the host — and the controller gets a CapacityChange. */
void wrk_memrt_after_slots(void *user, uint32_t kv_live);

#endif
