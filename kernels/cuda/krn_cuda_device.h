/* krn_cuda_device.h — CUDA device discovery, a self-check kernel, a bandwidth probe.
 *
 * Owns: answering "is there a usable CUDA device, and which" for the worker's backend choice,
 * a tiny kernel round trip that proves the toolchain, driver and device agree, and the
 * device's measured read bandwidth (bench_cuda's floor). The
 * engine's kernels live beside this file (CUDA backend issue). Callable from C. */
#ifndef KRN_CUDA_DEVICE_H
#define KRN_CUDA_DEVICE_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Number of CUDA devices (0 when there is no driver or no device); why is filled with the
 * driver's reason when 0 is returned because of an error. */
int krn_cuda_device_count(char *why, size_t why_len);

/* Name and compute capability of device dev; returns 0 on success. */
int krn_cuda_device_info(int dev, char *name, size_t name_len, int *cc_major, int *cc_minor);

/* y[i] = a * x[i] + y[i] on device dev, through device memory; returns 0 on success, or -1 with
 * the CUDA error text in why. */
int krn_cuda_selftest_axpy(int dev, float a, const float *x, float *y, int n, char *why,
                           size_t why_len);

/* The device's read bandwidth in bytes per second: the best of `reps` timed passes (after one
 * untimed) of a kernel that reads `bytes` of device memory once with 16-byte loads, as a decode
 * step reads its weights. A copy's bandwidth (read + write) is not the same number. Allocates
 * and frees its own buffer on the current device; returns 0, or -1 with the reason in why. */
int krn_cuda_read_bandwidth(size_t bytes, int reps, double *bytes_per_s, char *why, size_t why_len);

#ifdef __cplusplus
}
#endif

#endif
