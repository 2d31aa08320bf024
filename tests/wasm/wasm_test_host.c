/* wasm_test_host.c — see wasm_test_host.h. */
#include "wasm_test_host.h"

uint32_t Z_pieZ_test_add(struct Z_pie_instance_t *pie, uint32_t a, uint32_t b) {
    lc_wasm_host_enter(pie);
    return a + b;
}

/* Blocks until the test releases it or the instance is interrupted (on_interrupt wakes it). */
void Z_pieZ_test_park(struct Z_pie_instance_t *pie) {
    lc_wasm_instance *inst = lc_wasm_host_enter(pie);
    park_ctx *p = pie->host;
    pthread_mutex_lock(&p->mu);
    p->parked++;
    pthread_cond_broadcast(&p->cv);
    while (!p->released && !lc_wasm_interrupted(inst)) pthread_cond_wait(&p->cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
    lc_wasm_host_checkpoint(inst);
}

void Z_pieZ_test_fail(struct Z_pie_instance_t *pie, uint32_t code) {
    lc_wasm_host_trap(lc_wasm_host_enter(pie), "test_fail(%u) ended the instance", code);
}

/* Enters with the address of a variable that holds pie, the pointer that wasm2c 1.0.32's code
 * passes to an import called through a table: lc_wasm_host_enter must trap the instance. */
void Z_pieZ_test_wrong_pie(struct Z_pie_instance_t *pie) {
    struct Z_pie_instance_t *holder = pie;
    lc_wasm_host_enter((struct Z_pie_instance_t *)(void *)&holder);
}

void park_wake(void *host) {
    park_ctx *p = host;
    pthread_mutex_lock(&p->mu);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

const lc_wasm_host_fn wasm_test_host_fns[] = {
    LC_WASM_HOST_FN(test_add, "(param i32 i32) (result i32)"),
    LC_WASM_HOST_FN(test_park, ""),
    LC_WASM_HOST_FN(test_fail, "(param i32)"),
    LC_WASM_HOST_FN(test_wrong_pie, ""),
};
const size_t wasm_test_host_n_fns = sizeof wasm_test_host_fns / sizeof wasm_test_host_fns[0];
