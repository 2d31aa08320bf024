/* wrk_tp_cuda.c — see wrk_tp_cuda.h. */
#include "wrk_tp_cuda.h"

#include <stdio.h>
#include <string.h>

#include "pie/v1/worker.pb-c.h"

pie_code wrk_tp_cuda_check(uint32_t tp_size, bool nccl_built, pie_status *st) {
    if (tp_size <= 1 || nccl_built) return PIE_OK;
    return pie_status_set(st, PIE_UNIMPLEMENTED,
                          "tp.size %u with backend cuda needs NCCL, and this pie-worker was "
                          "built without it (nccl.h and libnccl were not found at build time; "
                          "docs/cuda.md)",
                          tp_size);
}

pie_code wrk_tp_cuda_visible(const char *parent, uint32_t rank, uint32_t size, char *out,
                             size_t cap, pie_status *st) {
    if (rank >= size)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "tp: rank %u is out of range [0, %u)", rank,
                              size);
    if (!parent || !parent[0]) {
        snprintf(out, cap, "%u", rank);
        return PIE_OK;
    }
    uint32_t n = 0;
    const char *p = parent, *mine = NULL;
    size_t mine_len = 0;
    for (;;) { /* comma-separated entries: indices or GPU-... UUIDs, passed on as written */
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        if (len > 0) {
            if (n == rank) mine = p, mine_len = len;
            n++;
        }
        if (!end) break;
        p = end + 1;
    }
    if (n < size)
        return pie_status_set(st, PIE_FAILED_PRECONDITION,
                              "tp.size %u needs %u GPUs, one per rank, but CUDA_VISIBLE_DEVICES "
                              "\"%.200s\" lists %u",
                              size, size, parent, n);
    if (mine_len + 1 > cap)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "tp: CUDA_VISIBLE_DEVICES entry %u is longer than %zu bytes", rank,
                              cap - 1);
    memcpy(out, mine, mine_len);
    out[mine_len] = '\0';
    return PIE_OK;
}

void wrk_tp_cuda_answer(struct Pie__V1__TpJoinResponse *resp, const uint8_t *id) {
    resp->collective = PIE__V1__COLLECTIVE__COLLECTIVE_NCCL;
    resp->nccl_unique_id.data = (uint8_t *)id; /* protobuf-c's field is not const */
    resp->nccl_unique_id.len = WRK_TP_NCCL_ID_BYTES;
}

pie_code wrk_tp_cuda_read_answer(const struct Pie__V1__TpJoinResponse *resp, bool want_nccl,
                                 uint8_t id[WRK_TP_NCCL_ID_BYTES], pie_status *st) {
    bool nccl = resp->collective == PIE__V1__COLLECTIVE__COLLECTIVE_NCCL;
    bool host = resp->collective == PIE__V1__COLLECTIVE__COLLECTIVE_HOST;
    if (want_nccl ? !nccl : !host)
        return pie_status_set(st, PIE_FAILED_PRECONDITION,
                              "TpJoin: rank 0 answered collective %d, but this rank runs backend "
                              "%s (rank 0 runs another backend: every rank needs the same one)",
                              resp->collective, want_nccl ? "cuda" : "cpu");
    if (!nccl) return PIE_OK;
    if (resp->nccl_unique_id.len != WRK_TP_NCCL_ID_BYTES || !resp->nccl_unique_id.data)
        return pie_status_set(st, PIE_FAILED_PRECONDITION,
                              "TpJoin: rank 0 answered an NCCL unique id of %zu bytes, not %d",
                              resp->nccl_unique_id.len, WRK_TP_NCCL_ID_BYTES);
    memcpy(id, resp->nccl_unique_id.data, WRK_TP_NCCL_ID_BYTES);
    return PIE_OK;
}
