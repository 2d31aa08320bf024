/* krn_cuda_device.cu — see krn_cuda_device.h. */
#include "krn_cuda_device.h"

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

static void set_why(char *why, size_t why_len, const char *what, cudaError_t err) {
    if (why && why_len) snprintf(why, why_len, "%s: %s", what, cudaGetErrorString(err));
}

extern "C" int krn_cuda_device_count(char *why, size_t why_len) {
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
        set_why(why, why_len, "cudaGetDeviceCount", err);
        return 0;
    }
    if (n == 0 && why && why_len) snprintf(why, why_len, "no CUDA device");
    return n;
}

extern "C" int krn_cuda_device_info(int dev, char *name, size_t name_len, int *cc_major,
                                    int *cc_minor) {
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, dev) != cudaSuccess) return -1;
    if (name && name_len) snprintf(name, name_len, "%s", prop.name);
    if (cc_major) *cc_major = prop.major;
    if (cc_minor) *cc_minor = prop.minor;
    return 0;
}

__global__ static void axpy_kernel(float a, const float *x, float *y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}

extern "C" int krn_cuda_selftest_axpy(int dev, float a, const float *x, float *y, int n,
                                      char *why, size_t why_len) {
    float *dx = NULL, *dy = NULL;
    size_t bytes = (size_t)n * sizeof(float);
    int rc = -1;
    cudaError_t err;
    if ((err = cudaSetDevice(dev)) != cudaSuccess) { set_why(why, why_len, "cudaSetDevice", err); return -1; }
    if ((err = cudaMalloc(&dx, bytes)) != cudaSuccess) { set_why(why, why_len, "cudaMalloc", err); goto done; }
    if ((err = cudaMalloc(&dy, bytes)) != cudaSuccess) { set_why(why, why_len, "cudaMalloc", err); goto done; }
    if ((err = cudaMemcpy(dx, x, bytes, cudaMemcpyHostToDevice)) != cudaSuccess) { set_why(why, why_len, "cudaMemcpy", err); goto done; }
    if ((err = cudaMemcpy(dy, y, bytes, cudaMemcpyHostToDevice)) != cudaSuccess) { set_why(why, why_len, "cudaMemcpy", err); goto done; }
    axpy_kernel<<<(n + 255) / 256, 256>>>(a, dx, dy, n);
    if ((err = cudaGetLastError()) != cudaSuccess) { set_why(why, why_len, "axpy launch", err); goto done; }
    if ((err = cudaMemcpy(y, dy, bytes, cudaMemcpyDeviceToHost)) != cudaSuccess) { set_why(why, why_len, "cudaMemcpy", err); goto done; }
    rc = 0;
done:
    cudaFree(dx);
    cudaFree(dy);
    return rc;
}

/* Reads p[0, n) once over the grid; the XOR of everything read decides a store that (almost)
 * never happens, so the loads cannot be dropped. */
__global__ static void __launch_bounds__(1024)
    read_kernel(const uint4 *p, size_t n, uint32_t *sink) {
    uint32_t acc = 0;
    size_t stride = (size_t)gridDim.x * blockDim.x;
#pragma unroll 4
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        uint4 v = __ldg(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) sink[blockIdx.x & 255u] = acc;
}

extern "C" int krn_cuda_read_bandwidth(size_t bytes, int reps, double *bytes_per_s, char *why,
                                       size_t why_len) {
    void *buf = NULL;
    uint32_t *sink = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    int rc = -1, dev = 0, sms = 0, per_sm = 0;
    size_t n = bytes / sizeof(uint4);
    double best = 0;
    cudaError_t err;
#define RB_TRY(call)                           \
    do {                                       \
        if ((err = (call)) != cudaSuccess) {   \
            set_why(why, why_len, #call, err); \
            goto done;                         \
        }                                      \
    } while (0)
    RB_TRY(cudaGetDevice(&dev));
    RB_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    RB_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, read_kernel, 1024, 0));
    RB_TRY(cudaMalloc(&buf, n * sizeof(uint4)));
    RB_TRY(cudaMalloc((void **)&sink, 256 * sizeof(uint32_t)));
    RB_TRY(cudaMemset(buf, 1, n * sizeof(uint4)));
    RB_TRY(cudaEventCreate(&e0));
    RB_TRY(cudaEventCreate(&e1));
    for (int i = 0; i <= reps; i++) {
        float ms = 0;
        RB_TRY(cudaEventRecord(e0, 0));
        read_kernel<<<sms * (per_sm > 0 ? per_sm : 1), 1024>>>((const uint4 *)buf, n, sink);
        RB_TRY(cudaGetLastError());
        RB_TRY(cudaEventRecord(e1, 0));
        RB_TRY(cudaEventSynchronize(e1));
        RB_TRY(cudaEventElapsedTime(&ms, e0, e1));
        double bw = (double)(n * sizeof(uint4)) / (ms * 1e-3);
        if (i > 0 && bw > best) best = bw; /* the first pass warms up */
    }
#undef RB_TRY
    *bytes_per_s = best;
    rc = 0;
done:
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    cudaFree(buf);
    cudaFree(sink);
    return rc;
}
