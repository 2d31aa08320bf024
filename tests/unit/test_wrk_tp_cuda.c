/* test_wrk_tp_cuda.c — what cuda groups need beyond cpu ones (services/worker/tp/wrk_tp_cuda.h),
 * on any machine: the refusal of a build without NCCL, each forked rank's GPU (and the refusal
 * of more ranks than GPUs), and the NCCL unique id through a real TpJoinResponse — packed and
 * unpacked as it crosses the wire, with fake bytes (a real id needs NCCL and a network). */
#include <criterion/criterion.h>
#include <string.h>

#include "pie/v1/worker.pb-c.h"
#include "wrk_tp_cuda.h"

Test(wrk_tp_cuda, a_build_without_nccl_refuses_cuda_groups_naming_the_library) {
    pie_status st;
    cr_assert_eq(wrk_tp_cuda_check(1, false, &st), PIE_OK, "tp 1 needs no NCCL");
    cr_assert_eq(wrk_tp_cuda_check(4, true, &st), PIE_OK);
    cr_assert_eq(wrk_tp_cuda_check(2, false, &st), PIE_UNIMPLEMENTED);
    cr_assert(strstr(st.msg, "tp.size 2 with backend cuda needs NCCL") && strstr(st.msg, "libnccl"),
              "%s", st.msg);
}

Test(wrk_tp_cuda, each_forked_rank_gets_one_gpu_of_the_launchers_list) {
    char out[64];
    pie_status st;
    cr_assert_eq(wrk_tp_cuda_visible(NULL, 3, 4, out, sizeof out, &st), PIE_OK);
    cr_assert_str_eq(out, "3", "no list: the rank's index");
    cr_assert_eq(wrk_tp_cuda_visible("", 0, 2, out, sizeof out, &st), PIE_OK);
    cr_assert_str_eq(out, "0");
    cr_assert_eq(wrk_tp_cuda_visible("4,5,6,7", 2, 4, out, sizeof out, &st), PIE_OK);
    cr_assert_str_eq(out, "6", "the launcher's third GPU");
    cr_assert_eq(wrk_tp_cuda_visible("GPU-aa,GPU-bb,GPU-cc", 1, 2, out, sizeof out, &st), PIE_OK);
    cr_assert_str_eq(out, "GPU-bb", "UUIDs pass as written");
}

Test(wrk_tp_cuda, more_ranks_than_visible_gpus_are_refused) {
    char out[64];
    pie_status st;
    cr_assert_eq(wrk_tp_cuda_visible("0,1", 0, 4, out, sizeof out, &st), PIE_FAILED_PRECONDITION);
    cr_assert(strstr(st.msg, "tp.size 4 needs 4 GPUs, one per rank, but CUDA_VISIBLE_DEVICES "
                             "\"0,1\" lists 2"),
              "%s", st.msg);
    cr_assert_eq(wrk_tp_cuda_visible("0,,1", 2, 3, out, sizeof out, &st), PIE_FAILED_PRECONDITION,
                 "an empty entry is no GPU");
    cr_assert_eq(wrk_tp_cuda_visible("0,1", 2, 2, out, sizeof out, &st), PIE_INVALID_ARGUMENT);
}

/* resp packed and unpacked, as the joining rank receives it. */
static Pie__V1__TpJoinResponse *over_the_wire(const Pie__V1__TpJoinResponse *resp) {
    size_t n = pie__v1__tp_join_response__get_packed_size(resp);
    uint8_t *buf = malloc(n ? n : 1);
    cr_assert_not_null(buf);
    cr_assert_eq(pie__v1__tp_join_response__pack(resp, buf), n);
    Pie__V1__TpJoinResponse *r = pie__v1__tp_join_response__unpack(NULL, n, buf);
    free(buf);
    cr_assert_not_null(r, "the answer does not unpack");
    return r;
}

Test(wrk_tp_cuda, the_unique_id_reaches_a_joining_rank_byte_for_byte) {
    uint8_t id[WRK_TP_NCCL_ID_BYTES], got[WRK_TP_NCCL_ID_BYTES];
    for (int i = 0; i < WRK_TP_NCCL_ID_BYTES; i++) id[i] = (uint8_t)(i * 37 + 11); /* fake */
    Pie__V1__TpJoinResponse resp = PIE__V1__TP_JOIN_RESPONSE__INIT;
    resp.tp_size = 2;
    resp.epoch = 0x1234;
    resp.host_endpoint = "rank0:7000";
    wrk_tp_cuda_answer(&resp, id);
    Pie__V1__TpJoinResponse *r = over_the_wire(&resp);
    pie_status st;
    memset(got, 0, sizeof got);
    cr_assert_eq(wrk_tp_cuda_read_answer(r, true, got, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(memcmp(got, id, sizeof id), 0, "the id changed on its way");
    cr_assert_str_eq(r->host_endpoint, "rank0:7000", "the host collective's endpoint stays");
    /* a cpu rank meeting a cuda rank 0 */
    cr_assert_eq(wrk_tp_cuda_read_answer(r, false, got, &st), PIE_FAILED_PRECONDITION);
    cr_assert(strstr(st.msg, "rank 0 runs another backend"), "%s", st.msg);
    pie__v1__tp_join_response__free_unpacked(r, NULL);
}

Test(wrk_tp_cuda, answers_without_a_whole_id_or_for_another_backend_are_refused) {
    pie_status st;
    uint8_t got[WRK_TP_NCCL_ID_BYTES];
    Pie__V1__TpJoinResponse host = PIE__V1__TP_JOIN_RESPONSE__INIT;
    host.collective = PIE__V1__COLLECTIVE__COLLECTIVE_HOST;
    cr_assert_eq(wrk_tp_cuda_read_answer(&host, false, got, &st), PIE_OK, "a cpu group");
    cr_assert_eq(wrk_tp_cuda_read_answer(&host, true, got, &st), PIE_FAILED_PRECONDITION,
                 "a cuda rank answered by a cpu rank 0");
    Pie__V1__TpJoinResponse none = PIE__V1__TP_JOIN_RESPONSE__INIT; /* COLLECTIVE_UNSPECIFIED */
    cr_assert_eq(wrk_tp_cuda_read_answer(&none, false, got, &st), PIE_FAILED_PRECONDITION);
    cr_assert_eq(wrk_tp_cuda_read_answer(&none, true, got, &st), PIE_FAILED_PRECONDITION);
    uint8_t short_id[16] = {1};
    Pie__V1__TpJoinResponse cut = PIE__V1__TP_JOIN_RESPONSE__INIT;
    cut.collective = PIE__V1__COLLECTIVE__COLLECTIVE_NCCL;
    cut.nccl_unique_id.data = short_id;
    cut.nccl_unique_id.len = sizeof short_id;
    Pie__V1__TpJoinResponse *r = over_the_wire(&cut);
    cr_assert_eq(wrk_tp_cuda_read_answer(r, true, got, &st), PIE_FAILED_PRECONDITION);
    cr_assert(strstr(st.msg, "NCCL unique id of 16 bytes, not 128"), "%s", st.msg);
    pie__v1__tp_join_response__free_unpacked(r, NULL);
}
