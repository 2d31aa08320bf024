/* nccl_tp1.c — NCCL on one GPU, the first step of issue 14's cuda groups: a communicator of one
 * rank (what tp 1 on the NCCL path is), its all-reduce (sum; f32 and bf16), all-gather and
 * broadcast on a stream, and an all-reduce captured in a CUDA graph (decode steps are graphs).
 * At one rank every result equals the input: the program checks that bit for bit, then times
 * each operation per message size (median of 5 loops, CUDA events).
 *
 * Standalone: not part of the CMake build (the engine's NCCL wrapper is services/worker/tp/
 * wrk_nccl.c; this program measures NCCL alone, as it was before that existed). Built by hand
 * where the CUDA toolkit and NCCL are (bench/results/tp.md has the run):
 *   cc -O2 -std=c11 -I/usr/local/cuda/include bench/tp/nccl_tp1.c -o nccl_tp1 \
 *      -L/usr/local/cuda/lib64 -lnccl -lcudart -Wl,-rpath,/usr/local/cuda/lib64
 * Exit status: 0 all checks passed, 1 a check or a call failed, 77 no CUDA device. */
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CK_CUDA(x)                                                                                 \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "nccl_tp1: %s: %s (line %d)\n", #x, cudaGetErrorString(e_), __LINE__); \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)
#define CK_NCCL(x)                                                                                 \
    do {                                                                                           \
        ncclResult_t r_ = (x);                                                                     \
        if (r_ != ncclSuccess) {                                                                   \
            fprintf(stderr, "nccl_tp1: %s: %s (line %d)\n", #x, ncclGetErrorString(r_), __LINE__); \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#define REPS 5

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

enum op { OP_ALLREDUCE_F32, OP_ALLREDUCE_BF16, OP_ALLGATHER, OP_BCAST, OP_GRAPH, N_OPS };
static const char *const op_names[N_OPS] = {"all-reduce f32", "all-reduce bf16", "all-gather",
                                            "broadcast", "all-reduce f32 in a CUDA graph"};

/* One operation on `bytes` of d_in into d_out (in place where NCCL allows it). */
static void run_op(enum op op, void *d_in, void *d_out, size_t bytes, ncclComm_t comm,
                   cudaStream_t s, cudaGraphExec_t graph) {
    switch (op) {
    case OP_ALLREDUCE_F32:
        CK_NCCL(ncclAllReduce(d_in, d_out, bytes / 4, ncclFloat32, ncclSum, comm, s));
        break;
    case OP_ALLREDUCE_BF16:
        CK_NCCL(ncclAllReduce(d_in, d_out, bytes / 2, ncclBfloat16, ncclSum, comm, s));
        break;
    case OP_ALLGATHER: CK_NCCL(ncclAllGather(d_in, d_out, bytes, ncclUint8, comm, s)); break;
    case OP_BCAST: CK_NCCL(ncclBroadcast(d_in, d_out, bytes, ncclUint8, 0, comm, s)); break;
    default: CK_CUDA(cudaGraphLaunch(graph, s));
    }
}

int main(void) {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
        printf("nccl_tp1: skipped: no CUDA device\n");
        return 77;
    }
    CK_CUDA(cudaSetDevice(0));
    struct cudaDeviceProp prop;
    CK_CUDA(cudaGetDeviceProperties(&prop, 0));
    int version = 0;
    CK_NCCL(ncclGetVersion(&version));
    ncclUniqueId id;
    CK_NCCL(ncclGetUniqueId(&id)); /* what rank 0 would hand out in TpJoin (COLLECTIVE_NCCL) */
    ncclComm_t comm;
    CK_NCCL(ncclCommInitRank(&comm, 1, id, 0));
    int n_ranks = 0, rank = -1;
    CK_NCCL(ncclCommCount(comm, &n_ranks));
    CK_NCCL(ncclCommUserRank(comm, &rank));
    cudaStream_t s;
    CK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    printf("device %s; NCCL %d; a communicator of %d rank (rank %d)\n\n", prop.name, version,
           n_ranks, rank);

    static const size_t sizes[] = {4, 1024, 16384, 65536, 1u << 20, 16u << 20, 64u << 20};
    const size_t top = 64u << 20;
    uint8_t *h_in = malloc(top), *h_out = malloc(top);
    void *d_in = NULL, *d_out = NULL;
    if (!h_in || !h_out) return 1;
    for (size_t i = 0; i < top; i++) h_in[i] = (uint8_t)(i * 2654435761u >> 24);
    CK_CUDA(cudaMalloc(&d_in, top));
    CK_CUDA(cudaMalloc(&d_out, top));
    cudaEvent_t e0, e1;
    CK_CUDA(cudaEventCreate(&e0));
    CK_CUDA(cudaEventCreate(&e1));
    int failed = 0;
    printf("| message | %s | %s | %s | %s | %s |\n| --- | --- | --- | --- | --- | --- |\n",
           op_names[0], op_names[1], op_names[2], op_names[3], op_names[4]);
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        size_t bytes = sizes[k];
        /* a graph of one all-reduce of this size, captured on s */
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CK_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
        CK_NCCL(ncclAllReduce(d_in, d_out, bytes / 4, ncclFloat32, ncclSum, comm, s));
        CK_CUDA(cudaStreamEndCapture(s, &g));
        CK_CUDA(cudaGraphInstantiate(&ge, g, 0));
        if (bytes >= (1u << 20))
            printf("| %zu MiB", bytes >> 20);
        else if (bytes >= 1024)
            printf("| %zu KiB", bytes >> 10);
        else
            printf("| %zu B", bytes);
        for (int op = 0; op < N_OPS; op++) {
            /* check: at one rank every operation copies its input */
            /* all on s: the legacy default stream does not order against a non-blocking one */
            CK_CUDA(cudaMemcpyAsync(d_in, h_in, bytes, cudaMemcpyHostToDevice, s));
            CK_CUDA(cudaMemsetAsync(d_out, 0xA5, bytes, s));
            run_op((enum op)op, d_in, d_out, bytes, comm, s, ge);
            CK_CUDA(cudaMemcpyAsync(h_out, d_out, bytes, cudaMemcpyDeviceToHost, s));
            CK_CUDA(cudaStreamSynchronize(s));
            if (memcmp(h_out, h_in, bytes) != 0) {
                fprintf(stderr, "nccl_tp1: %s of %zu bytes at 1 rank changed the data\n",
                        op_names[op], bytes);
                failed = 1;
            }
            /* time: REPS loops of iters calls */
            uint32_t iters = bytes <= 65536 ? 200 : (uint32_t)((256u << 20) / bytes);
            if (iters < 4) iters = 4;
            float t[REPS];
            for (int r = 0; r < REPS; r++) {
                CK_CUDA(cudaEventRecord(e0, s));
                for (uint32_t i = 0; i < iters; i++)
                    run_op((enum op)op, d_in, d_out, bytes, comm, s, ge);
                CK_CUDA(cudaEventRecord(e1, s));
                CK_CUDA(cudaEventSynchronize(e1));
                float ms = 0;
                CK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
                t[r] = ms * 1000.0f / (float)iters;
            }
            qsort(t, REPS, sizeof t[0], cmp_float);
            printf(" | %.2f us", t[REPS / 2]);
        }
        printf(" |\n");
        CK_CUDA(cudaGraphExecDestroy(ge));
        CK_CUDA(cudaGraphDestroy(g));
    }
    CK_NCCL(ncclCommDestroy(comm));
    CK_CUDA(cudaStreamDestroy(s));
    CK_CUDA(cudaFree(d_in));
    CK_CUDA(cudaFree(d_out));
    free(h_in);
    free(h_out);
    printf("\n%s\n", failed ? "FAIL: an operation changed the data"
                            : "ok: every operation left the data as it was (1 rank)");
    return failed;
}
