/* test_eng_cuda_fault.c — how the cuda backend tells a device fault from other errors, and what
 * it records, without a device: these run (and count) in CI. That a real fault reaches them is
 * test_eng_cuda.c's a_device_fault_fails_the_call_and_every_later_one_with_its_reason (GPU). */
#include <criterion/criterion.h>
#include <string.h>

#include "eng_cuda.h"
#include "eng_cuda_impl.h"

Test(eng_cuda_fault, sticky_errors_are_faults_and_recoverable_ones_are_not) {
    static const cudaError_t faults[] = {
        cudaErrorIllegalAddress,    cudaErrorLaunchFailure,      cudaErrorIllegalInstruction,
        cudaErrorMisalignedAddress, cudaErrorHardwareStackError, cudaErrorAssert,
        cudaErrorECCUncorrectable,  cudaErrorLaunchTimeout,      cudaErrorInvalidPc};
    static const cudaError_t others[] = {cudaSuccess,
                                         cudaErrorInvalidValue,
                                         cudaErrorMemoryAllocation,
                                         cudaErrorNotReady,
                                         cudaErrorStreamCaptureInvalidated,
                                         cudaErrorStreamCaptureUnsupported,
                                         cudaErrorInvalidConfiguration,
                                         cudaErrorNoDevice,
                                         cudaErrorInsufficientDriver};
    for (size_t i = 0; i < sizeof faults / sizeof faults[0]; i++)
        cr_assert(eng_cuda_error_is_fault((int)faults[i]), "%s is a fault",
                  cudaGetErrorName(faults[i]));
    for (size_t i = 0; i < sizeof others / sizeof others[0]; i++)
        cr_assert_not(eng_cuda_error_is_fault((int)others[i]), "%s is not a fault",
                      cudaGetErrorName(others[i]));
}

static void count_fault(const char *why, void *arg) {
    cr_assert(strstr(why, "device fault") != NULL);
    (*(int *)arg)++;
}

Test(eng_cuda_fault, the_first_fault_is_recorded_once_and_calls_the_hook_once) {
    int hooks = 0;
    eng_cuda_on_fault(count_fault, &hooks);
    char why[PIE_STATUS_MSG_MAX] = "";
    pie_status st = {0};
    cr_assert_eq(ec_cuda_fail(&st, cudaErrorInvalidValue, "cudaMemcpyAsync", "x/eng_cuda.c", 7),
                 PIE_INTERNAL);
    cr_assert_str_eq(st.msg, "cuda: cudaMemcpyAsync failed at eng_cuda.c:7: invalid argument");
    cr_assert_not(eng_cuda_fault(why, sizeof why), "a recoverable error is not a fault");
    cr_assert_eq(hooks, 0);

    cr_assert_eq(
        ec_cuda_fail(&st, cudaErrorIllegalAddress, "cudaStreamSynchronize", "a/eng_cuda_fwd.c", 9),
        PIE_INTERNAL);
    const char *want = "cuda: device fault: cudaStreamSynchronize failed at eng_cuda_fwd.c:9: ";
    cr_assert(strncmp(st.msg, want, strlen(want)) == 0, "%s", st.msg);
    cr_assert(strstr(st.msg, "the worker must restart") != NULL, "%s", st.msg);
    cr_assert(eng_cuda_fault(why, sizeof why));
    cr_assert_str_eq(why, st.msg);
    cr_assert_eq(hooks, 1);

    pie_status later = {0};
    ec_cuda_fail(&later, cudaErrorLaunchFailure, "cudaMemcpyAsync", "eng_cuda.c", 1);
    cr_assert(strstr(later.msg, "device fault") != NULL, "a later call says so too");
    cr_assert(eng_cuda_fault(why, sizeof why));
    cr_assert_str_eq(why, st.msg, "the first fault stays the recorded one");
    cr_assert_eq(hooks, 1, "the hook runs once");
}
