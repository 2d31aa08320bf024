/* bench_gemm.c — the cuda engine's linear layers as cuBLAS runs them, at the shapes of a prefill
 * and a batch-64 decode: is the f32 output the engine asks for (ec_linear: bf16 x bf16 -> f32,
 * compute f32) slower than a bf16 output, and how far is either from the device's peak?
 *
 * For each shape y[rows, out] = x[rows, in] · W[out, in]^T (the engine's TN call) it times
 * cublasGemmEx with a f32 and with a bf16 output (compute f32 both), median of --reps after a
 * warm-up, and prints TFLOP/s; then what the four linear layers of one layer cost at each
 * output type, times the layer count: the linear part of a prefill of `rows` tokens.
 * Prefill 2048 of the 8B shape ran at 0.60x transformers on the H100 (bench/results/cuda.md);
 * this says how much of that the GEMMs' output type and cuBLAS's choices explain.
 *
 * Usage: bench_gemm [--shape 8b|1b] [--reps 20]
 * Output: Markdown rows; no model needed (random bf16 inputs). */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CK(x)                                                                    \
    do {                                                                         \
        cudaError_t e_ = (x);                                                    \
        if (e_ != cudaSuccess) {                                                 \
            fprintf(stderr, "bench_gemm: %s: %s\n", #x, cudaGetErrorString(e_)); \
            exit(1);                                                             \
        }                                                                        \
    } while (0)
#define CB(x)                                                                   \
    do {                                                                        \
        cublasStatus_t s_ = (x);                                                \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                      \
            fprintf(stderr, "bench_gemm: %s: cublas status %d\n", #x, (int)s_); \
            exit(1);                                                            \
        }                                                                       \
    } while (0)

typedef struct shape {
    const char *name;
    int in, out;
} shape;

typedef struct model_shapes {
    const char *name;
    int layers;
    shape lin[4]; /* q|k|v, o, gate|up, down */
} model_shapes;

static const model_shapes k_models[] = {
    {"8b",
     32,
     {{"qkv", 4096, 6144}, {"o", 4096, 4096}, {"gate|up", 4096, 28672}, {"down", 14336, 4096}}},
    {"1b",
     16,
     {{"qkv", 2048, 3072}, {"o", 2048, 2048}, {"gate|up", 2048, 16384}, {"down", 8192, 2048}}},
};

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* Median ms of reps calls of y = x · W^T with y of type yt. */
static float time_gemm(cublasHandle_t h, int rows, int in, int out, const void *x, const void *w,
                       void *y, cudaDataType yt, int reps) {
    const float one = 1.0f, zero = 0.0f;
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    float *ms = calloc((size_t)reps, sizeof *ms);
    if (!ms) exit(1);
    for (int r = -2; r < reps; r++) { /* two warm-up calls: cuBLAS picks and loads its kernel */
        CK(cudaEventRecord(a, 0));
        CB(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, out, rows, in, &one, w, CUDA_R_16BF, in, x,
                        CUDA_R_16BF, in, &zero, y, yt, out, CUBLAS_COMPUTE_32F,
                        CUBLAS_GEMM_DEFAULT));
        CK(cudaEventRecord(b, 0));
        CK(cudaEventSynchronize(b));
        if (r >= 0) CK(cudaEventElapsedTime(&ms[r], a, b));
    }
    qsort(ms, (size_t)reps, sizeof *ms, cmp_float);
    float med = ms[reps / 2];
    free(ms);
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    return med;
}

static void fill_bf16(void *d, size_t n, unsigned seed) {
    unsigned short *h = malloc(n * sizeof *h);
    if (!h) exit(1);
    for (size_t i = 0; i < n; i++) { /* small values of either sign: bf16 of (±[0, 0.03)) */
        seed = seed * 1664525u + 1013904223u;
        float f = ((float)(seed >> 8) / 16777216.0f - 0.5f) * 0.06f;
        unsigned u;
        memcpy(&u, &f, sizeof u);
        h[i] = (unsigned short)(u >> 16);
    }
    CK(cudaMemcpy(d, h, n * sizeof *h, cudaMemcpyHostToDevice));
    free(h);
}

int main(int argc, char **argv) {
    const char *which = "8b";
    int reps = 20;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--shape") && i + 1 < argc)
            which = argv[++i];
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_gemm [--shape 8b|1b] [--reps 20]\n");
            return 2;
        }
    }
    const model_shapes *m = NULL;
    for (size_t i = 0; i < sizeof k_models / sizeof k_models[0]; i++)
        if (!strcmp(k_models[i].name, which)) m = &k_models[i];
    if (!m || reps < 1) {
        fprintf(stderr, "bench_gemm: unknown shape %s (8b, 1b) or reps < 1\n", which);
        return 2;
    }
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        fprintf(stderr, "bench_gemm: no CUDA device\n");
        return 77;
    }
    struct cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    static const int rows_list[] = {64, 2048};
    size_t max_in = 0, max_out = 0;
    for (int k = 0; k < 4; k++) {
        if ((size_t)m->lin[k].in > max_in) max_in = (size_t)m->lin[k].in;
        if ((size_t)m->lin[k].out > max_out) max_out = (size_t)m->lin[k].out;
    }
    void *x, *w, *y;
    CK(cudaMalloc(&x, 2048 * max_in * 2));
    CK(cudaMalloc(&w, max_in * max_out * 2));
    CK(cudaMalloc(&y, 2048 * max_out * 4));
    fill_bf16(x, 2048 * max_in, 1);
    fill_bf16(w, max_in * max_out, 2);
    cublasHandle_t h;
    CB(cublasCreate(&h));
    void *ws;
    CK(cudaMalloc(&ws, 32u << 20)); /* the engine's workspace size (EC_CUBLAS_WS) */
    CB(cublasSetWorkspace(h, ws, 32u << 20));
    printf("bench_gemm: %s, shape %s (%d layers), median of %d\n\n", p.name, m->name, m->layers,
           reps);
    printf("| rows | layer | in x out | f32 out: ms (TFLOP/s) | bf16 out: ms (TFLOP/s) |\n");
    printf("| --- | --- | --- | --- | --- |\n");
    for (size_t ri = 0; ri < sizeof rows_list / sizeof rows_list[0]; ri++) {
        int rows = rows_list[ri];
        double tot32 = 0, tot16 = 0;
        for (int k = 0; k < 4; k++) {
            const shape *s = &m->lin[k];
            float t32 = time_gemm(h, rows, s->in, s->out, x, w, y, CUDA_R_32F, reps);
            float t16 = time_gemm(h, rows, s->in, s->out, x, w, y, CUDA_R_16BF, reps);
            double flop = 2.0 * rows * s->in * (double)s->out;
            printf("| %d | %s | %d x %d | %.3f (%.0f) | %.3f (%.0f) |\n", rows, s->name, s->in,
                   s->out, t32, flop / t32 / 1e9, t16, flop / t16 / 1e9);
            tot32 += t32;
            tot16 += t16;
        }
        printf("| %d | all %d layers | | %.2f ms | %.2f ms |\n", rows, m->layers, tot32 * m->layers,
               tot16 * m->layers);
    }
    CB(cublasDestroy(h));
    CK(cudaFree(ws));
    CK(cudaFree(x));
    CK(cudaFree(w));
    CK(cudaFree(y));
    return 0;
}
