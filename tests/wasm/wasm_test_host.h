/* wasm_test_host.h — the `pie` host functions that the wasm fixtures import, shared by
 * tests/unit/test_lc_wasm.c and bench/wasm/bench_wasm.c (compiled into both; the executables
 * export them to the dlopen'ed modules).
 *
 *   pie.test_add  (param i32 i32) (result i32)  returns a + b
 *   pie.test_park                                blocks until park_ctx.released or interrupted
 *   pie.test_fail (param i32)                    ends the instance: "test_fail(<n>) ended the
 *                                                instance"
 *   pie.test_wrong_pie                           calls lc_wasm_host_enter with a wrong pointer
 * The instance's host context (lc_wasm_instance_opts.host) is a park_ctx for test_park. */
#ifndef WASM_TEST_HOST_H
#define WASM_TEST_HOST_H

#include <pthread.h>
#include <stdbool.h>

#include "lc_wasm.h"

typedef struct park_ctx {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int parked;    /* instances that entered test_park */
    bool released; /* set (under mu, with a broadcast) to let them return */
} park_ctx;

uint32_t Z_pieZ_test_add(struct Z_pie_instance_t *pie, uint32_t a, uint32_t b);
void Z_pieZ_test_park(struct Z_pie_instance_t *pie);
void Z_pieZ_test_fail(struct Z_pie_instance_t *pie, uint32_t code);
void Z_pieZ_test_wrong_pie(struct Z_pie_instance_t *pie);

/* lc_wasm_instance_opts.on_interrupt for instances whose host context is a park_ctx. */
void park_wake(void *host);

extern const lc_wasm_host_fn wasm_test_host_fns[];
extern const size_t wasm_test_host_n_fns;

#endif
