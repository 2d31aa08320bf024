/* wrk_nccl.c — see wrk_nccl.h. */
#include "wrk_nccl.h"

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

_Static_assert(WRK_NCCL_ID_BYTES == NCCL_UNIQUE_ID_BYTES, "the unique id's size");
_Static_assert(sizeof(ncclUniqueId) == WRK_NCCL_ID_BYTES, "ncclUniqueId is its bytes");

struct wrk_nccl {
    ncclComm_t comm;
    uint32_t rank, size;
    int device;
    bool failed; /* aborted after an asynchronous error or a timeout: every call fails */
    uint32_t timeout_ms; /* wrk_nccl_sync's bound; 0: none */
    char why[PIE_STATUS_MSG_MAX - 64];
};

/* r → PIE_INTERNAL naming the operation, NCCL's string for r and its last error text. */
static pie_code wrk_nccl_fail(const wrk_nccl *c, ncclResult_t r, const char *op, pie_status *st) {
    const char *last = ncclGetLastError(c ? c->comm : NULL);
    return pie_status_set(st, PIE_INTERNAL, "nccl: %s failed (rank %u of %u): %s%s%.300s", op,
                          c ? c->rank : 0, c ? c->size : 0, ncclGetErrorString(r),
                          last && last[0] ? ": " : "", last ? last : "");
}

static pie_code wrk_nccl_usable(const wrk_nccl *c, pie_status *st) {
    if (!c->failed) return PIE_OK;
    return pie_status_set(st, PIE_UNAVAILABLE, "nccl: the group's communicator failed: %s", c->why);
}

pie_code wrk_nccl_unique_id(uint8_t id[WRK_NCCL_ID_BYTES], pie_status *st) {
    ncclUniqueId u;
    ncclResult_t r = ncclGetUniqueId(&u);
    if (r != ncclSuccess) return wrk_nccl_fail(NULL, r, "ncclGetUniqueId", st);
    memcpy(id, u.internal, WRK_NCCL_ID_BYTES);
    return PIE_OK;
}

pie_code wrk_nccl_open(const uint8_t id[WRK_NCCL_ID_BYTES], uint32_t rank, uint32_t size,
                       int device, wrk_nccl **out, pie_status *st) {
    *out = NULL;
    if (size == 0 || rank >= size || size > (uint32_t)INT32_MAX)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "nccl: rank %u is out of range [0, %u)",
                              rank, size);
    wrk_nccl *c = calloc(1, sizeof *c);
    if (!c) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "nccl: out of memory");
    c->rank = rank;
    c->size = size;
    c->device = device;
    c->timeout_ms = WRK_NCCL_DEFAULT_TIMEOUT_MS;
    cudaError_t err = cudaSetDevice(device);
    if (err != cudaSuccess) {
        pie_status_set(st, PIE_UNAVAILABLE, "nccl: rank %u: cudaSetDevice(%d) failed: %s", rank,
                       device, cudaGetErrorString(err));
        free(c);
        return PIE_UNAVAILABLE;
    }
    ncclUniqueId u;
    memcpy(u.internal, id, WRK_NCCL_ID_BYTES);
    ncclResult_t r = ncclCommInitRank(&c->comm, (int)size, u, (int)rank);
    if (r != ncclSuccess) {
        pie_code rc = wrk_nccl_fail(c, r, "ncclCommInitRank", st);
        free(c);
        return rc;
    }
    *out = c;
    return PIE_OK;
}

void wrk_nccl_close(wrk_nccl *c) {
    if (!c) return;
    if (c->comm) {
        /* abort, not finalize + destroy: a finalize waits for the peers, and at close a peer
         * may be gone (the group is closed when it failed or stops); abort frees this rank's
         * resources without them */
        (void)cudaSetDevice(c->device);
        (void)ncclCommAbort(c->comm);
    }
    free(c);
}

uint32_t wrk_nccl_rank(const wrk_nccl *c) { return c->rank; }
uint32_t wrk_nccl_size(const wrk_nccl *c) { return c->size; }

pie_code wrk_nccl_allreduce_sum(wrk_nccl *c, void *buf, size_t count, wrk_nccl_dtype dtype,
                                struct CUstream_st *stream, pie_status *st) {
    pie_code rc = wrk_nccl_usable(c, st);
    if (rc != PIE_OK || count == 0) return rc;
    ncclDataType_t t = dtype == WRK_NCCL_BF16 ? ncclBfloat16 : ncclFloat32;
    ncclResult_t r = ncclAllReduce(buf, buf, count, t, ncclSum, c->comm, stream);
    return r == ncclSuccess ? PIE_OK : wrk_nccl_fail(c, r, "ncclAllReduce", st);
}

pie_code wrk_nccl_allgather(wrk_nccl *c, const void *send, void *recv, size_t bytes,
                            struct CUstream_st *stream, pie_status *st) {
    pie_code rc = wrk_nccl_usable(c, st);
    if (rc != PIE_OK || bytes == 0) return rc;
    ncclResult_t r = ncclAllGather(send, recv, bytes, ncclUint8, c->comm, stream);
    return r == ncclSuccess ? PIE_OK : wrk_nccl_fail(c, r, "ncclAllGather", st);
}

pie_code wrk_nccl_bcast(wrk_nccl *c, void *buf, size_t bytes, uint32_t root,
                        struct CUstream_st *stream, pie_status *st) {
    pie_code rc = wrk_nccl_usable(c, st);
    if (rc != PIE_OK || bytes == 0) return rc;
    if (root >= c->size)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "nccl: broadcast root %u is out of "
                              "range [0, %u)",
                              root, c->size);
    ncclResult_t r = ncclBroadcast(buf, buf, bytes, ncclUint8, (int)root, c->comm, stream);
    return r == ncclSuccess ? PIE_OK : wrk_nccl_fail(c, r, "ncclBroadcast", st);
}

/* The communicator cannot be used any more: aborted (which also makes its kernels that wait
 * for a peer return), and every later call fails UNAVAILABLE with `why`. */
static pie_code wrk_nccl_fail_for_good(wrk_nccl *c, const char *why, pie_status *st) {
    snprintf(c->why, sizeof c->why, "%.440s", why);
    c->failed = true;
    (void)ncclCommAbort(c->comm);
    c->comm = NULL;
    return pie_status_set(st, PIE_UNAVAILABLE, "%s", why);
}

pie_code wrk_nccl_check(wrk_nccl *c, pie_status *st) {
    pie_code rc = wrk_nccl_usable(c, st);
    if (rc != PIE_OK) return rc;
    ncclResult_t async = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(c->comm, &async);
    if (r != ncclSuccess) async = r;
    if (async == ncclSuccess || async == ncclInProgress) return PIE_OK;
    pie_status why;
    wrk_nccl_fail(c, async, "the group's communicator", &why);
    return wrk_nccl_fail_for_good(c, why.msg, st);
}

void wrk_nccl_set_timeout(wrk_nccl *c, uint32_t timeout_ms) { c->timeout_ms = timeout_ms; }

static uint64_t wrk_nccl_now_ns(void) {
    struct timespec ts;
    (void)clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Polling: the first WRK_NCCL_SPIN_NS back to back (a decode step's wait is a few ms: as
 * prompt as cudaStreamSynchronize's own spinning), then every WRK_NCCL_NAP_NS so that a long
 * wait leaves the core to the rest of the worker; the communicator and the clock every
 * WRK_NCCL_CHECK_NS. */
#define WRK_NCCL_SPIN_NS 2000000ull
#define WRK_NCCL_NAP_NS 50000l
#define WRK_NCCL_CHECK_NS 1000000ull

pie_code wrk_nccl_sync(wrk_nccl *c, struct CUstream_st *stream, int *cuda_err, pie_status *st) {
    *cuda_err = 0;
    pie_code rc = wrk_nccl_usable(c, st);
    if (rc != PIE_OK) return rc;
    uint64_t start = wrk_nccl_now_ns(), next_check = start + WRK_NCCL_CHECK_NS;
    for (;;) {
        cudaError_t q = cudaStreamQuery(stream);
        if (q != cudaErrorNotReady) {
            *cuda_err = (int)q;
            return q == cudaSuccess ? wrk_nccl_check(c, st) : PIE_OK;
        }
        uint64_t now = wrk_nccl_now_ns();
        if (now >= next_check) {
            next_check = now + WRK_NCCL_CHECK_NS;
            rc = wrk_nccl_check(c, st);
            if (rc != PIE_OK) return rc;
            if (c->timeout_ms != 0 && now - start >= (uint64_t)c->timeout_ms * 1000000ull) {
                char why[PIE_STATUS_MSG_MAX];
                snprintf(why, sizeof why,
                         "nccl: rank %u of %u: the step's collectives did not finish within "
                         "tp.timeout (%u ms): a peer rank hangs or is stopped",
                         c->rank, c->size, c->timeout_ms);
                return wrk_nccl_fail_for_good(c, why, st);
            }
        }
        if (now - start >= WRK_NCCL_SPIN_NS) {
            struct timespec nap = {.tv_sec = 0, .tv_nsec = WRK_NCCL_NAP_NS};
            (void)nanosleep(&nap, NULL);
        }
    }
}

pie_code wrk_nccl_device_ok(int device, pie_status *st) {
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess)
        return pie_status_set(
            st, PIE_UNAVAILABLE, "no CUDA device (%s; CUDA_VISIBLE_DEVICES=%.64s)",
            cudaGetErrorString(err),
            getenv("CUDA_VISIBLE_DEVICES") ? getenv("CUDA_VISIBLE_DEVICES") : "(unset)");
    if (device < 0 || device >= n)
        return pie_status_set(
            st, PIE_UNAVAILABLE,
            "no CUDA device %d: this process sees %d (CUDA_VISIBLE_DEVICES=%.64s)", device, n,
            getenv("CUDA_VISIBLE_DEVICES") ? getenv("CUDA_VISIBLE_DEVICES") : "(unset)");
    return PIE_OK;
}

void wrk_nccl_version(char *out, size_t cap) {
    int v = 0;
    if (ncclGetVersion(&v) != ncclSuccess) {
        snprintf(out, cap, "unknown");
        return;
    }
    /* NCCL_VERSION(X, Y, Z): X * 10000 + Y * 100 + Z from 2.9 on */
    snprintf(out, cap, "%d.%d.%d", v / 10000, v / 100 % 100, v % 100);
}
