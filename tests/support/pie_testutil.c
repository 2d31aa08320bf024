/* pie_testutil.c — see pie_testutil.h. */
#include "pie_testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pie/v1/lifecycle.pb-c.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif

void pie_test_leak_check(void) {
#if defined(__SANITIZE_ADDRESS__)
    if (__lsan_do_recoverable_leak_check() != 0) {
        fprintf(stderr, "memory leaked: see the LeakSanitizer report above\n");
        abort();
    }
#endif
}

int64_t pie_test_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void pie_test_sleep_ms(int ms) {
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

size_t pie_test_wait_models(rpc_channel *ch, int64_t timeout_ms) {
    int64_t deadline = pie_test_now_ms() + timeout_ms;
    for (;;) {
        Pie__V1__ListModelsRequest req = PIE__V1__LIST_MODELS_REQUEST__INIT;
        rpc_call_opts o = {.timeout_ms = 5000, .wait_for_ready = true};
        ProtobufCMessage *r = NULL;
        pie_status st;
        size_t n = 0;
        if (rpc_unary(ch, "/pie.v1.Lifecycle/ListModels", &req.base,
                      &pie__v1__list_models_response__descriptor, &r, &o, &st) == PIE_OK)
            n = ((Pie__V1__ListModelsResponse *)r)->n_models;
        rpc_msg_free(r);
        if (n > 0 || pie_test_now_ms() >= deadline) return n;
        pie_test_sleep_ms(20);
    }
}

uint8_t *pie_test_wasm_variant(const uint8_t *wasm, size_t len, int number) {
    uint8_t *v = malloc(len + PIE_TEST_WASM_VARIANT_EXTRA);
    if (v == NULL) return NULL;
    memcpy(v, wasm, len);
    uint8_t *p = v + len;
    *p++ = 0;         /* custom section */
    *p++ = 1 + 4 + 4; /* its size: the name's length byte, the name, 4 bytes */
    *p++ = 4;
    memcpy(p, "pie!", 4);
    memcpy(p + 4, &number, 4);
    return v;
}
