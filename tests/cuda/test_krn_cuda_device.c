/* CUDA toolchain and device self-check. Skips visibly where no device exists (CI). */
#include "cuda_test.h"

Test(krn_cuda_device, axpy_round_trip_matches_host) {
    CUDA_TEST_REQUIRE_DEVICE();
    char why[256] = "";
    char name[128];
    int major = 0, minor = 0;
    cr_assert_eq(krn_cuda_device_info(0, name, sizeof name, &major, &minor), 0);
    enum { N = 1000 };
    float x[N], y[N];
    for (int i = 0; i < N; i++) x[i] = (float)i, y[i] = 1.0f;
    cr_assert_eq(krn_cuda_selftest_axpy(0, 2.0f, x, y, N, why, sizeof why), 0, "%s", why);
    for (int i = 0; i < N; i++) cr_assert_float_eq(y[i], 2.0f * (float)i + 1.0f, 1e-6, "y[%d]", i);
}
