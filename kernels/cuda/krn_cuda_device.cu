/* krn_cuda_device.cu — see krn_cuda_device.h. */
#include "krn_cuda_device.h"

#include <cuda_runtime.h>
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
