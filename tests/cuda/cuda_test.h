/* cuda_test.h — what every tests/cuda test shares: skipping visibly where there is no CUDA
 * device (CI), and small device-memory helpers for the kernel tests.
 *
 * A test starts with CUDA_TEST_REQUIRE_DEVICE(): without a device it prints
 * "skipped: no CUDA device (<driver's reason>)" and skips; ctest (SKIP_REGULAR_EXPRESSION in
 * kernels/cuda/CMakeLists.txt) then lists it as Skipped. */
#ifndef CUDA_TEST_H
#define CUDA_TEST_H

#include <criterion/criterion.h>
#include <cuda_runtime_api.h>
#include <stdio.h>

#include "krn_cuda_device.h"

#define CUDA_TEST_REQUIRE_DEVICE()                                   \
    do {                                                             \
        char why_[256] = "";                                         \
        if (krn_cuda_device_count(why_, sizeof why_) == 0) {         \
            fprintf(stderr, "skipped: no CUDA device (%s)\n", why_); \
            cr_skip_test("skipped: no CUDA device (%s)", why_);      \
        }                                                            \
    } while (0)

#define CUDA_OK(call)                                                           \
    do {                                                                        \
        cudaError_t e_ = (call);                                                \
        cr_assert_eq(e_, cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_)); \
    } while (0)

/* A device copy of host[bytes] (host may be NULL: zeroed). */
static inline void *cuda_test_up(const void *host, size_t bytes) {
    void *d = NULL;
    CUDA_OK(cudaMalloc(&d, bytes ? bytes : 1));
    if (host)
        CUDA_OK(cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice));
    else
        CUDA_OK(cudaMemset(d, 0, bytes ? bytes : 1));
    return d;
}

static inline void cuda_test_down(void *host, const void *dev, size_t bytes) {
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost));
}

#endif
