/* krn_cuda_linear.cu — the small-batch linear layer: y = x · W^T for 1..8 rows of bf16 x.
 *
 * Owns: krn_cuda_gemv. At batch sizes where a matrix product is a matrix-vector product the
 * layer is bound by reading W once from HBM; one warp per output reads its weight row with
 * 16-byte loads and applies it to every input row, so W is read exactly once per call.
 * Does not own: larger batches (cuBLAS, called by the engine). */
#include "krn_cuda.h"
#include "krn_cuda_impl.cuh"

#define GEMV_WARPS 8

template <int M>
__global__ static void __launch_bounds__(GEMV_WARPS * 32)
    gemv_kernel(const krn_bf16 *x, int in, const krn_bf16 *w, int out, float *y, int ldy) {
    int lane = threadIdx.x & 31;
    int n = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (n >= out) return;
    const uint4 *wr = reinterpret_cast<const uint4 *>(w + (size_t)n * in);
    int n8 = in / 8;
    float acc[M];
#pragma unroll
    for (int m = 0; m < M; m++) acc[m] = 0.0f;
#pragma unroll 4
    for (int i = lane; i < n8; i += 32) {
        float wf[8], xf[8];
        krn_unpack8(__ldg(wr + i), wf);
#pragma unroll
        for (int m = 0; m < M; m++) {
            krn_unpack8(__ldg(reinterpret_cast<const uint4 *>(x + (size_t)m * in) + i), xf);
#pragma unroll
            for (int e = 0; e < 8; e++) acc[m] += wf[e] * xf[e];
        }
    }
#pragma unroll
    for (int m = 0; m < M; m++) {
        float s = krn_warp_sum(acc[m]);
        if (lane == 0) y[(size_t)m * ldy + n] = s;
    }
}

extern "C" int krn_cuda_gemv_fits(const void *x, const void *w, int n, int in) {
    return n >= 1 && n <= KRN_CUDA_GEMV_MAX_ROWS && in > 0 && in % 8 == 0 &&
           ((uintptr_t)x % 16) == 0 && ((uintptr_t)w % 16) == 0;
}

extern "C" cudaError_t krn_cuda_gemv(const krn_bf16 *x, int n, int in, const krn_bf16 *w, int out,
                                     float *y, int ldy, cudaStream_t stream) {
    if (!krn_cuda_gemv_fits(x, w, n, in) || out <= 0) return cudaErrorInvalidValue;
    unsigned blocks = (unsigned)((out + GEMV_WARPS - 1) / GEMV_WARPS);
    unsigned threads = GEMV_WARPS * 32;
    switch (n) {
    case 1: gemv_kernel<1><<<blocks, threads, 0, stream>>>(x, in, w, out, y, ldy); break;
    case 2: gemv_kernel<2><<<blocks, threads, 0, stream>>>(x, in, w, out, y, ldy); break;
    case 3: gemv_kernel<3><<<blocks, threads, 0, stream>>>(x, in, w, out, y, ldy); break;
    case 4: gemv_kernel<4><<<blocks, threads, 0, stream>>>(x, in, w, out, y, ldy); break;
    case 5: gemv_kernel<5><<<blocks, threads, 0, stream>>>(x, in, w, out, y, ldy); break;
    case 6: gemv_kernel<6><<<blocks, threads, 0, stream>>>(x, in, w, out, y, ldy); break;
    case 7: gemv_kernel<7><<<blocks, threads, 0, stream>>>(x, in, w, out, y, ldy); break;
    default: gemv_kernel<8><<<blocks, threads, 0, stream>>>(x, in, w, out, y, ldy); break;
    }
    return cudaGetLastError();
}
