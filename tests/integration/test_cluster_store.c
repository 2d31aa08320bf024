/* test_cluster_store.c — the controller's cluster storage (controller.proto: GetTokenizer,
 * PutProgram, GetProgram, DropProgram) and a lifecycle replica's checks on what it fetches.
 *
 * The first two tests drive a real pie-controller from this process, playing the worker groups
 * (WorkerLink registrations carrying tokenizer.json) and a lifecycle replica (a Session that
 * must hear of dropped programs). The third plays the controller for a real pie-lifecycle that
 * has no model files: the controller announces a model and hands out a tokenizer.json that
 * does not hash to the announced value.
 *
 * Covers: a linked worker's tokenizer is handed out in chunks, byte for byte, while it is
 * linked and not after; a registration whose tokenizer bytes hash to another value is refused
 * FAILED_PRECONDITION naming both hashes; malformed hashes, unknown hashes and offsets beyond
 * the end are refused clearly; programs are put and read back in chunks, a second put of the
 * same bytes says so, the least recently used program is evicted when the registry
 * (programs.registry_size) is full — from the tenant holding the most, when tenants hold them —
 * a header alone adds a holder, bytes that do not hash to their id and programs larger
 * than the registry are refused, and a drop reaches every replica as program_dropped; a
 * replica refuses a tokenizer of the wrong hash (DATA_LOSS, nothing cached, readiness stays
 * NOT_SERVING) and becomes ready once the right bytes come. */
#include <criterion/criterion.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pie/v1/controller.pb-c.h"
#include "pie_proc.h"
#include "pie_sha256.h"
#include "pie_testutil.h"
#include "rpc.h"

#define START_MS 30000
#define STOP_MS  20000
#define WAIT_MS  30000 /* hang guard of every wait and poll */
#define CHUNK    (1u << 20)

TestSuite(cluster_store, .fini = pie_test_leak_check, .timeout = 180);

/* ---- helpers ------------------------------------------------------------------------------ */

/* n deterministic pseudo-random bytes (seeded), malloc'd. */
static uint8_t *bytes_of(size_t n, uint32_t seed) {
    uint8_t *b = malloc(n);
    cr_assert(b);
    uint32_t x = seed * 2654435761u + 1;
    for (size_t i = 0; i < n; i++) {
        x = x * 1664525u + 1013904223u;
        b[i] = (uint8_t)(x >> 24);
    }
    return b;
}

static void sha_of(const uint8_t *b, size_t n, char out[65]) {
    cr_assert_eq(pie_sha256_hex(b, n, out, NULL), PIE_OK);
}

static pie_proc *start_controller(const char *const *env) {
    pie_proc_opts o = {.env = env};
    pie_status st;
    pie_proc *p = pie_proc_start("pie-controller", &o, START_MS, &st);
    cr_assert(p, "%s", st.msg);
    return p;
}

static void stop_ok(pie_proc *p) {
    pie_status st;
    int rc = pie_proc_stop(p, STOP_MS, &st);
    static char *tail; /* reachable if the assertion ends the test */
    tail = pie_proc_log_tail(p, 3000);
    cr_assert_eq(rc, 0, "%s exited with %d: %s\nlog:\n%s", pie_proc_name(p), rc, st.msg,
                 tail ? tail : "");
    free(tail);
    tail = NULL;
    pie_proc_destroy(p);
}

static rpc_channel *channel_to(const char *addr) {
    rpc_channel_opts co = {.max_recv_bytes = -1, .max_send_bytes = -1};
    pie_status st;
    rpc_channel *ch = rpc_channel_create(addr, &co, &st);
    cr_assert(ch, "%s", st.msg);
    return ch;
}

static pie_code unary(rpc_channel *ch, const char *method, const ProtobufCMessage *req,
                      const ProtobufCMessageDescriptor *rd, ProtobufCMessage **resp,
                      pie_status *st) {
    char path[96];
    snprintf(path, sizeof path, "/pie.v1.Controller/%s", method);
    rpc_call_opts o = {.timeout_ms = WAIT_MS};
    ProtobufCMessage *r = NULL;
    pie_code rc = rpc_unary(ch, path, req, rd, &r, &o, st);
    if (resp)
        *resp = r;
    else
        rpc_msg_free(r);
    return rc;
}

/* ---- playing a worker group ---------------------------------------------------------------- */

/* Opens a WorkerLink and registers group with a model whose tokenizer hash is `announced` and
 * the tokenizer bytes json[0..len). Returns the stream; *code gets the outcome: OK (registered)
 * or the code the controller ended the stream with (its message in st). */
static rpc_stream *register_worker(rpc_channel *ch, const char *group, const char *announced,
                                   const uint8_t *json, size_t len, pie_code *code,
                                   pie_status *st) {
    rpc_call_opts o = {.timeout_ms = 120000};
    rpc_stream *s = rpc_stream_open(ch, "/pie.v1.Controller/WorkerLink",
                                    &pie__v1__worker_down__descriptor, &o, st);
    cr_assert(s, "%s", st->msg);
    Pie__V1__TokenizerInfo ti = PIE__V1__TOKENIZER_INFO__INIT;
    ti.kind = "bpe-bytelevel";
    ti.tokenizer_sha256 = (char *)announced;
    ti.num_tokens = 256;
    Pie__V1__ModelInfo m = PIE__V1__MODEL_INFO__INIT;
    m.name = "fake-model";
    m.kv_page_size = 16;
    m.vocab_size = 256;
    m.max_context_tokens = 1024;
    m.max_forward_tokens = 64;
    m.default_top_k = 16;
    m.max_top_k = 64;
    m.tokenizer = &ti;
    Pie__V1__WorkerCapacity cap = PIE__V1__WORKER_CAPACITY__INIT;
    cap.kv_pages_max = cap.kv_pages_effective = cap.kv_pages_gpu = 16;
    cap.embed_slots = 16;
    cap.max_batch_items = 8;
    cap.max_batch_tokens = 64;
    Pie__V1__WorkerRegistration reg = PIE__V1__WORKER_REGISTRATION__INIT;
    reg.group_id = (char *)group;
    reg.version = "pie-c/0.1.0";
    reg.model = &m;
    reg.backend = PIE__V1__BACKEND__BACKEND_CPU;
    reg.memory_policy = PIE__V1__MEMORY_POLICY__MEMORY_POLICY_GPU;
    reg.capacity = &cap;
    reg.tp_size = 1;
    reg.tokenizer_json.data = (uint8_t *)json;
    reg.tokenizer_json.len = len;
    Pie__V1__WorkerUp up = PIE__V1__WORKER_UP__INIT;
    up.registration = &reg;
    cr_assert_eq(rpc_stream_send(s, &up.base, st), PIE_OK, "%s", st->msg);
    ProtobufCMessage *msg = NULL;
    rpc_recv_result rr = rpc_stream_recv(s, &msg, WAIT_MS);
    cr_assert_neq(rr, RPC_RECV_TIMEOUT, "no answer to the registration of %s", group);
    if (rr == RPC_RECV_MESSAGE) {
        cr_assert(((Pie__V1__WorkerDown *)msg)->registered,
                  "%s: the first WorkerDown is not "
                  "`registered`",
                  group);
        rpc_msg_free(msg);
        *code = PIE_OK;
    } else {
        *code = rpc_stream_finish(s, st);
    }
    return s;
}

/* The whole tokenizer through GetTokenizer, 1 MiB at a time (malloc'd; *len set). */
static uint8_t *get_tokenizer(rpc_channel *ch, const char *sha, size_t *len) {
    uint8_t *all = NULL;
    uint64_t size = 0, got = 0;
    int calls = 0;
    do {
        Pie__V1__GetTokenizerRequest req = PIE__V1__GET_TOKENIZER_REQUEST__INIT;
        req.tokenizer_sha256 = (char *)sha;
        req.offset = got;
        ProtobufCMessage *m = NULL;
        pie_status st;
        cr_assert_eq(unary(ch, "GetTokenizer", &req.base,
                           &pie__v1__get_tokenizer_response__descriptor, &m, &st),
                     PIE_OK, "GetTokenizer at %llu: %s", (unsigned long long)got, st.msg);
        const Pie__V1__GetTokenizerResponse *r = (const Pie__V1__GetTokenizerResponse *)m;
        if (all == NULL) {
            size = r->size_bytes;
            all = malloc(size ? size : 1);
            cr_assert(all);
        }
        cr_assert_eq(r->size_bytes, size);
        cr_assert_leq(r->data.len, CHUNK, "a chunk of %zu bytes", r->data.len);
        cr_assert_gt(r->data.len, 0);
        cr_assert_leq(got + r->data.len, size);
        memcpy(all + got, r->data.data, r->data.len);
        got += r->data.len;
        rpc_msg_free(m);
        calls++;
    } while (got < size);
    cr_assert_eq(calls, (int)((size + CHUNK - 1) / CHUNK), "%d calls for %llu bytes", calls,
                 (unsigned long long)size);
    *len = (size_t)size;
    return all;
}

Test(cluster_store,
     controller_hands_out_a_linked_workers_tokenizer_and_refuses_bytes_of_another_hash) {
    pie_proc *ctl = start_controller(NULL);
    rpc_channel *ch = channel_to(pie_proc_addr(ctl));
    const size_t n = (5u << 20) / 2; /* 2.5 MiB: three chunks */
    uint8_t *json = bytes_of(n, 1), *other = bytes_of(n, 2);
    char sha[65], other_sha[65];
    sha_of(json, n, sha);
    sha_of(other, n, other_sha);
    pie_status st;
    pie_code code;

    /* A group whose bytes hash to what it announces: kept and handed out byte for byte. */
    rpc_stream *w1 = register_worker(ch, "w1", sha, json, n, &code, &st);
    cr_assert_eq(code, PIE_OK, "registration refused: %s", st.msg);
    size_t len;
    uint8_t *back = get_tokenizer(ch, sha, &len);
    cr_assert(len == n && memcmp(back, json, n) == 0, "GetTokenizer returned other bytes");
    free(back);
    Pie__V1__GetTokenizerRequest req = PIE__V1__GET_TOKENIZER_REQUEST__INIT;
    req.tokenizer_sha256 = sha;
    req.offset = 5;
    req.max_bytes = 1000;
    ProtobufCMessage *m = NULL;
    cr_assert_eq(
        unary(ch, "GetTokenizer", &req.base, &pie__v1__get_tokenizer_response__descriptor, &m, &st),
        PIE_OK, "%s", st.msg);
    Pie__V1__GetTokenizerResponse *r = (Pie__V1__GetTokenizerResponse *)m;
    cr_expect(r->data.len == 1000 && memcmp(r->data.data, json + 5, 1000) == 0,
              "offset 5, max_bytes 1000: %zu bytes", r->data.len);
    rpc_msg_free(m);

    /* Bad requests. */
    req.offset = n + 1;
    cr_expect_eq(unary(ch, "GetTokenizer", &req.base, &pie__v1__get_tokenizer_response__descriptor,
                       NULL, &st),
                 PIE_INVALID_ARGUMENT, "offset beyond the end: %s", st.msg);
    cr_expect(strstr(st.msg, "offset") != NULL, "%s", st.msg);
    req.offset = 0;
    req.tokenizer_sha256 = "not-a-hash";
    cr_expect_eq(unary(ch, "GetTokenizer", &req.base, &pie__v1__get_tokenizer_response__descriptor,
                       NULL, &st),
                 PIE_INVALID_ARGUMENT, "%s", st.msg);
    cr_expect(strstr(st.msg, "tokenizer_sha256: \"not-a-hash\"") != NULL, "%s", st.msg);
    req.tokenizer_sha256 = other_sha;
    cr_expect_eq(unary(ch, "GetTokenizer", &req.base, &pie__v1__get_tokenizer_response__descriptor,
                       NULL, &st),
                 PIE_NOT_FOUND, "%s", st.msg);

    /* A group announcing sha but sending other bytes is refused, naming both hashes. */
    rpc_stream *w2 = register_worker(ch, "w2", sha, other, n, &code, &st);
    cr_expect_eq(code, PIE_FAILED_PRECONDITION, "%s", st.msg);
    cr_expect(strstr(st.msg, other_sha) && strstr(st.msg, sha) && strstr(st.msg, "tokenizer_json"),
              "the refusal does not name the field and both hashes: %s", st.msg);
    rpc_stream_destroy(w2);

    /* Once the only group serving it leaves, the tokenizer is gone. */
    rpc_stream_cancel(w1);
    rpc_stream_finish(w1, NULL);
    rpc_stream_destroy(w1);
    req.tokenizer_sha256 = sha;
    int64_t until = pie_test_now_ms() + WAIT_MS;
    pie_code rc;
    while ((rc = unary(ch, "GetTokenizer", &req.base, &pie__v1__get_tokenizer_response__descriptor,
                       NULL, &st)) == PIE_OK &&
           pie_test_now_ms() < until)
        pie_test_sleep_ms(10);
    cr_expect_eq(rc, PIE_NOT_FOUND, "after the worker left: %s", st.msg);

    free(json);
    free(other);
    rpc_channel_destroy(ch);
    stop_ok(ctl);
}

/* ---- the program registry ------------------------------------------------------------------- */

/* PutProgram of bytes[0..len) under id (1 MiB chunks) held by tenant (NULL: nobody); bytes
 * NULL: the header alone (a hold). *already from the response. */
static pie_code put_program_as(rpc_channel *ch, const char *tenant, const char *id,
                               const char *name, const uint8_t *bytes, size_t len, bool *already,
                               pie_status *st) {
    rpc_call_opts o = {.timeout_ms = WAIT_MS};
    rpc_stream *s = rpc_stream_open(ch, "/pie.v1.Controller/PutProgram",
                                    &pie__v1__put_program_response__descriptor, &o, st);
    cr_assert(s, "%s", st->msg);
    Pie__V1__PutProgramHeader h = PIE__V1__PUT_PROGRAM_HEADER__INIT;
    h.program_id = (char *)id;
    h.size_bytes = len;
    h.name = (char *)name;
    char *tenants[] = {(char *)tenant};
    h.tenants = tenants;
    h.n_tenants = tenant ? 1 : 0;
    Pie__V1__PutProgramRequest r = PIE__V1__PUT_PROGRAM_REQUEST__INIT;
    r.part_case = PIE__V1__PUT_PROGRAM_REQUEST__PART_HEADER;
    r.header = &h;
    pie_code rc = rpc_stream_send(s, &r.base, st);
    for (size_t off = 0; rc == PIE_OK && bytes && off < len; off += CHUNK) {
        Pie__V1__PutProgramRequest c = PIE__V1__PUT_PROGRAM_REQUEST__INIT;
        c.part_case = PIE__V1__PUT_PROGRAM_REQUEST__PART_CHUNK;
        c.chunk.data = (uint8_t *)bytes + off;
        c.chunk.len = len - off < CHUNK ? len - off : CHUNK;
        rc = rpc_stream_send(s, &c.base, st);
    }
    rpc_stream_close_send(s, NULL);
    ProtobufCMessage *m = NULL;
    if (rpc_stream_recv(s, &m, WAIT_MS) == RPC_RECV_MESSAGE) {
        if (already) *already = ((Pie__V1__PutProgramResponse *)m)->already_stored;
        rpc_msg_free(m);
    }
    rc = rpc_stream_finish(s, st);
    rpc_stream_destroy(s);
    return rc;
}

static pie_code put_program(rpc_channel *ch, const char *id, const char *name, const uint8_t *bytes,
                            size_t len, bool *already, pie_status *st) {
    return put_program_as(ch, NULL, id, name, bytes, len, already, st);
}

/* GetProgram of the whole program, chunk by chunk, compared with want[0..len). */
static void expect_program(rpc_channel *ch, const char *id, const char *name, const uint8_t *want,
                           size_t len) {
    uint64_t got = 0;
    while (got < len) {
        Pie__V1__GetProgramRequest req = PIE__V1__GET_PROGRAM_REQUEST__INIT;
        req.program_id = (char *)id;
        req.offset = got;
        req.max_bytes = 4u << 20; /* more than the chunk limit: 1 MiB comes back */
        ProtobufCMessage *m = NULL;
        pie_status st;
        cr_assert_eq(
            unary(ch, "GetProgram", &req.base, &pie__v1__get_program_response__descriptor, &m, &st),
            PIE_OK, "GetProgram %.16s at %llu: %s", id, (unsigned long long)got, st.msg);
        Pie__V1__GetProgramResponse *r = (Pie__V1__GetProgramResponse *)m;
        cr_assert_eq(r->size_bytes, len);
        cr_assert_str_eq(r->name, name);
        cr_assert(r->data.len > 0 && r->data.len <= CHUNK, "chunk of %zu bytes", r->data.len);
        cr_assert(memcmp(r->data.data, want + got, r->data.len) == 0,
                  "GetProgram %.16s: bytes at %llu differ", id, (unsigned long long)got);
        got += r->data.len;
        rpc_msg_free(m);
    }
}

static pie_code program_present(rpc_channel *ch, const char *id, pie_status *st) {
    Pie__V1__GetProgramRequest req = PIE__V1__GET_PROGRAM_REQUEST__INIT;
    req.program_id = (char *)id;
    ProtobufCMessage *m = NULL;
    pie_code rc =
        unary(ch, "GetProgram", &req.base, &pie__v1__get_program_response__descriptor, &m, st);
    if (rc == PIE_OK) cr_expect_eq(((Pie__V1__GetProgramResponse *)m)->data.len, 0);
    rpc_msg_free(m);
    return rc;
}

Test(cluster_store, program_registry_stores_evicts_and_drops_programs_and_tells_every_replica) {
    const char *env[] = {"PIE_PROGRAMS_REGISTRY_SIZE=3MiB", NULL};
    pie_proc *ctl = start_controller(env);
    rpc_channel *ch = channel_to(pie_proc_addr(ctl));
    pie_status st;

    /* A replica's Session, to hear of drops. */
    rpc_call_opts so = {.timeout_ms = 120000};
    rpc_stream *sess = rpc_stream_open(ch, "/pie.v1.Controller/Session",
                                       &pie__v1__session_down__descriptor, &so, &st);
    cr_assert(sess, "%s", st.msg);
    Pie__V1__SessionHello hello = PIE__V1__SESSION_HELLO__INIT;
    hello.replica_id = "fake-replica";
    hello.version = "pie-c/0.1.0";
    Pie__V1__SessionUp up = PIE__V1__SESSION_UP__INIT;
    up.hello = &hello;
    cr_assert_eq(rpc_stream_send(sess, &up.base, &st), PIE_OK, "%s", st.msg);
    ProtobufCMessage *m = NULL;
    cr_assert_eq(rpc_stream_recv(sess, &m, WAIT_MS), RPC_RECV_MESSAGE, "no welcome");
    cr_assert(((Pie__V1__SessionDown *)m)->welcome);
    rpc_msg_free(m);

    const size_t n = 1200u << 10; /* 1.2 MiB: two fit in 3 MiB, three do not */
    uint8_t *p1 = bytes_of(n, 11), *p2 = bytes_of(n, 12), *p3 = bytes_of(n, 13);
    char id1[65], id2[65], id3[65];
    sha_of(p1, n, id1);
    sha_of(p2, n, id2);
    sha_of(p3, n, id3);
    bool already = true;
    cr_assert_eq(put_program(ch, id1, "one", p1, n, &already, &st), PIE_OK, "%s", st.msg);
    cr_expect(!already);
    cr_assert_eq(put_program(ch, id2, "two", p2, n, &already, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(put_program(ch, id1, "one again", p1, n, &already, &st), PIE_OK, "%s", st.msg);
    cr_expect(already, "a second put of the same bytes must say already_stored");
    expect_program(ch, id1, "one again", p1, n);
    expect_program(ch, id2, "two", p2, n);

    /* p1 was read last: a third program evicts p2, the least recently used. */
    expect_program(ch, id1, "one again", p1, n);
    cr_assert_eq(put_program(ch, id3, "three", p3, n, &already, &st), PIE_OK, "%s", st.msg);
    cr_expect_eq(program_present(ch, id1, &st), PIE_OK, "%s", st.msg);
    cr_expect_eq(program_present(ch, id3, &st), PIE_OK, "%s", st.msg);
    cr_expect_eq(program_present(ch, id2, &st), PIE_NOT_FOUND, "p2 should have been evicted: %s",
                 st.msg);
    cr_expect(strstr(st.msg, "not in the controller's program registry") != NULL, "%s", st.msg);

    /* Refused: bytes of another id, a program larger than the registry, a malformed id. */
    cr_expect_eq(put_program(ch, id1, "liar", p2, n, NULL, &st), PIE_INVALID_ARGUMENT, "%s",
                 st.msg);
    cr_expect(strstr(st.msg, id2) != NULL, "the refusal does not name the real hash: %s", st.msg);
    uint8_t *big = bytes_of(4u << 20, 14);
    char big_id[65];
    sha_of(big, 4u << 20, big_id);
    cr_expect_eq(put_program(ch, big_id, "big", big, 4u << 20, NULL, &st), PIE_RESOURCE_EXHAUSTED,
                 "%s", st.msg);
    cr_expect(strstr(st.msg, "programs.registry_size") != NULL, "%s", st.msg);
    free(big);
    cr_expect_eq(program_present(ch, "ABC", &st), PIE_INVALID_ARGUMENT, "%s", st.msg);

    /* A drop removes it and reaches the replica as program_dropped. */
    Pie__V1__DropProgramRequest dr = PIE__V1__DROP_PROGRAM_REQUEST__INIT;
    dr.program_id = id1;
    cr_assert_eq(
        unary(ch, "DropProgram", &dr.base, &pie__v1__drop_program_response__descriptor, &m, &st),
        PIE_OK, "%s", st.msg);
    cr_expect(((Pie__V1__DropProgramResponse *)m)->was_stored);
    rpc_msg_free(m);
    cr_expect_eq(program_present(ch, id1, &st), PIE_NOT_FOUND, "%s", st.msg);
    bool heard = false;
    while (!heard) {
        m = NULL;
        rpc_recv_result rr = rpc_stream_recv(sess, &m, WAIT_MS);
        cr_assert_eq(rr, RPC_RECV_MESSAGE, "the replica never heard of the drop");
        Pie__V1__SessionDown *d = (Pie__V1__SessionDown *)m;
        for (size_t i = 0; i < d->n_events; i++)
            if (d->events[i]->event_case == PIE__V1__SESSION_EVENT__EVENT_PROGRAM_DROPPED)
                heard = strcmp(d->events[i]->program_dropped->program_id, id1) == 0;
        rpc_msg_free(m);
    }

    rpc_stream_cancel(sess);
    rpc_stream_finish(sess, NULL);
    rpc_stream_destroy(sess);
    free(p1);
    free(p2);
    free(p3);
    rpc_channel_destroy(ch);
    stop_ok(ctl);
}

/* The registry's room is shared between the tenants whose replicas put programs: the one
 * holding the most pays for a put, so one tenant's uploads cannot push out another's programs
 * (before: the least recently used went, whoever held it). A header alone adds a holder. */
Test(cluster_store, the_registry_makes_room_from_the_tenant_holding_the_most) {
    const char *env[] = {"PIE_PROGRAMS_REGISTRY_SIZE=3MiB", NULL};
    pie_proc *ctl = start_controller(env);
    rpc_channel *ch = channel_to(pie_proc_addr(ctl));
    pie_status st;
    const size_t n = 1200u << 10; /* two fit in 3 MiB, three do not */
    uint8_t *p[3];
    char id[3][65];
    for (int i = 0; i < 3; i++) {
        p[i] = bytes_of(n, 21 + (uint32_t)i);
        sha_of(p[i], n, id[i]);
    }
    bool already = true;
    cr_assert_eq(put_program_as(ch, "alice", id[0], "a", p[0], n, &already, &st), PIE_OK, "%s",
                 st.msg);
    cr_assert_eq(put_program_as(ch, "bob", id[1], "b1", p[1], n, &already, &st), PIE_OK, "%s",
                 st.msg);
    cr_assert_eq(put_program_as(ch, "bob", id[2], "b2", p[2], n, &already, &st), PIE_OK, "%s",
                 st.msg);
    cr_expect_eq(program_present(ch, id[0], &st), PIE_OK, "bob's put evicted alice's program: %s",
                 st.msg);
    cr_expect_eq(program_present(ch, id[1], &st), PIE_NOT_FOUND, "bob's older program stayed");
    cr_expect_eq(program_present(ch, id[2], &st), PIE_OK, "%s", st.msg);

    /* holds: the header alone */
    already = false;
    cr_assert_eq(put_program_as(ch, "carol", id[0], "", NULL, n, &already, &st), PIE_OK, "%s",
                 st.msg);
    cr_expect(already, "a hold must say already_stored");
    cr_expect_eq(put_program_as(ch, "carol", id[1], "", NULL, n, NULL, &st), PIE_NOT_FOUND, "%s",
                 st.msg);
    cr_expect_eq(put_program_as(ch, "Not A Tenant", id[0], "", NULL, n, NULL, &st),
                 PIE_INVALID_ARGUMENT, "%s", st.msg);
    cr_expect(strstr(st.msg, "header.tenants[0]") != NULL, "%s", st.msg);

    /* a tenant's drop releases its hold: the registry keeps the program */
    Pie__V1__DropProgramRequest dr = PIE__V1__DROP_PROGRAM_REQUEST__INIT;
    dr.program_id = id[0];
    dr.tenant = "alice";
    ProtobufCMessage *m = NULL;
    cr_assert_eq(
        unary(ch, "DropProgram", &dr.base, &pie__v1__drop_program_response__descriptor, &m, &st),
        PIE_OK, "%s", st.msg);
    cr_expect(((Pie__V1__DropProgramResponse *)m)->was_stored);
    rpc_msg_free(m);
    cr_expect_eq(program_present(ch, id[0], &st), PIE_OK, "%s", st.msg);
    for (int i = 0; i < 3; i++) free(p[i]);
    rpc_channel_destroy(ch);
    stop_ok(ctl);
}

/* ---- playing the controller for a replica without model files -------------------------------- */

typedef struct fake_ctl {
    rpc_server *srv;
    uint8_t *json; /* the model's real tokenizer.json */
    size_t len;
    char sha[65];
    atomic_bool honest; /* GetTokenizer hands out the real bytes (else: one byte changed) */
    atomic_int tokenizer_calls;
} fake_ctl;

static bool fake_session_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    (void)call;
    (void)req;
    (void)user;
    return false;
}

/* The hello: welcome and one model whose tokenizer is f->sha. */
static bool fake_session_on_message(rpc_call *call, ProtobufCMessage *msg, void *user) {
    fake_ctl *f = user;
    if (((Pie__V1__SessionUp *)msg)->hello == NULL) return false;
    Pie__V1__TokenizerInfo ti = PIE__V1__TOKENIZER_INFO__INIT;
    ti.kind = "bpe-bytelevel";
    ti.tokenizer_sha256 = f->sha;
    Pie__V1__ModelInfo mi = PIE__V1__MODEL_INFO__INIT;
    mi.name = "tiny-f32";
    mi.kv_page_size = 16;
    mi.vocab_size = 256;
    mi.tokenizer = &ti;
    Pie__V1__ModelInfo *models[] = {&mi};
    Pie__V1__ModelsChanged mc = PIE__V1__MODELS_CHANGED__INIT;
    mc.n_models = 1;
    mc.models = models;
    Pie__V1__SessionEvent ev = PIE__V1__SESSION_EVENT__INIT;
    ev.event_case = PIE__V1__SESSION_EVENT__EVENT_MODELS_CHANGED;
    ev.models_changed = &mc;
    Pie__V1__SessionEvent *evs[] = {&ev};
    Pie__V1__SessionWelcome w = PIE__V1__SESSION_WELCOME__INIT;
    w.replica_index = 1;
    w.version = "pie-c/0.1.0";
    Pie__V1__SessionDown down = PIE__V1__SESSION_DOWN__INIT;
    down.welcome = &w;
    down.n_events = 1;
    down.events = evs;
    rpc_call_send(call, &down.base);
    return false;
}

static void fake_session_on_half_close(rpc_call *call, void *user) {
    (void)user;
    rpc_call_finish(call, PIE_OK, NULL);
}

static bool fake_tokenizer_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    fake_ctl *f = user;
    const Pie__V1__GetTokenizerRequest *r = (const Pie__V1__GetTokenizerRequest *)req;
    atomic_fetch_add(&f->tokenizer_calls, 1);
    if (strcmp(r->tokenizer_sha256, f->sha) != 0 || r->offset > f->len) {
        rpc_call_finish(call, PIE_NOT_FOUND, "fake controller: unknown tokenizer");
        return false;
    }
    uint8_t *copy = malloc(f->len);
    cr_assert(copy);
    memcpy(copy, f->json, f->len);
    if (!atomic_load(&f->honest)) copy[f->len / 2] ^= 0x20; /* same size, another hash */
    size_t n = f->len - (size_t)r->offset < CHUNK ? f->len - (size_t)r->offset : CHUNK;
    Pie__V1__GetTokenizerResponse resp = PIE__V1__GET_TOKENIZER_RESPONSE__INIT;
    resp.size_bytes = f->len;
    resp.data.data = copy + r->offset;
    resp.data.len = n;
    rpc_call_reply(call, &resp.base);
    free(copy);
    return false;
}

static void fake_start(fake_ctl *f) {
    memset(f, 0, sizeof *f);
    FILE *fp = fopen(PIE_MODELS_DIR "/tiny-f32/tokenizer.json", "rb");
    cr_assert(fp, "no tiny-f32 tokenizer.json");
    cr_assert_eq(fseek(fp, 0, SEEK_END), 0);
    long n = ftell(fp);
    cr_assert_eq(fseek(fp, 0, SEEK_SET), 0);
    f->json = malloc((size_t)n);
    cr_assert(f->json);
    cr_assert_eq(fread(f->json, 1, (size_t)n, fp), (size_t)n);
    fclose(fp);
    f->len = (size_t)n;
    sha_of(f->json, f->len, f->sha);
    pie_status st;
    rpc_server_opts so = {
        .addr = "127.0.0.1:0", .n_threads = 1, .max_recv_bytes = -1, .max_send_bytes = -1};
    f->srv = rpc_server_create(&so, &st);
    cr_assert(f->srv, "%s", st.msg);
    rpc_method m[] = {
        {.path = "/pie.v1.Controller/Session",
         .kind = RPC_BIDI,
         .request = &pie__v1__session_up__descriptor,
         .response = &pie__v1__session_down__descriptor,
         .on_call = fake_session_on_call,
         .on_message = fake_session_on_message,
         .on_half_close = fake_session_on_half_close,
         .user = f},
        {.path = "/pie.v1.Controller/GetTokenizer",
         .kind = RPC_UNARY,
         .request = &pie__v1__get_tokenizer_request__descriptor,
         .response = &pie__v1__get_tokenizer_response__descriptor,
         .on_call = fake_tokenizer_on_call,
         .user = f},
    };
    cr_assert_eq(rpc_server_add_methods(f->srv, m, 2, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(rpc_server_start(f->srv, &st), PIE_OK, "%s", st.msg);
}

static void fake_stop(fake_ctl *f) {
    rpc_server_shutdown(f->srv, 0);
    rpc_server_destroy(f->srv);
    free(f->json);
}

static rpc_health_status readiness(rpc_channel *ch) {
    rpc_health_status hs = RPC_HEALTH_UNKNOWN;
    pie_status st;
    if (rpc_health_check(ch, "pie.v1.Lifecycle", 5000, &hs, &st) != PIE_OK)
        return RPC_HEALTH_UNKNOWN;
    return hs;
}

Test(cluster_store,
     a_replica_refuses_a_tokenizer_of_another_hash_and_stays_unready_until_the_right_bytes_come) {
    fake_ctl f;
    fake_start(&f);
    pie_status st;
    char *dir = pie_proc_tmpdir(&st);
    cr_assert(dir, "%s", st.msg);
    char ctl_env[96], cache_env[4200], cached[4400];
    snprintf(ctl_env, sizeof ctl_env, "PIE_CONTROLLER_ADDRESS=127.0.0.1:%d",
             rpc_server_port(f.srv));
    snprintf(cache_env, sizeof cache_env, "PIE_RUNTIME_CACHE_DIR=%s", dir);
    snprintf(cached, sizeof cached, "%s/tokenizers/%s.json", dir, f.sha);
    const char *env[] = {ctl_env, cache_env, "PIE_RUNTIME_TIER1=false",
                         "PIE_CONTROLLER_RECONNECT_INITIAL=50ms", NULL};
    pie_proc_opts o = {.env = env};
    pie_proc *lc = pie_proc_start("pie-lifecycle", &o, START_MS, &st);
    cr_assert(lc, "%s", st.msg);
    rpc_channel *ch = channel_to(pie_proc_addr(lc));

    /* The bytes do not hash to the announced value: refused, nothing cached, not ready. */
    char needle[200];
    snprintf(needle, sizeof needle, "but the %zu bytes the controller sent hash to", f.len);
    cr_assert(pie_proc_wait_log(lc, needle, 1, WAIT_MS),
              "the replica did not refuse the tampered tokenizer");
    cr_expect_geq(pie_proc_log_count(lc, "code=DATA_LOSS"), 1);
    cr_expect_eq(pie_proc_log_count(lc, "event=lc.tokreg.loaded"), 0,
                 "a tokenizer of the wrong hash was loaded");
    cr_expect_neq(readiness(ch), RPC_HEALTH_SERVING, "ready with no usable tokenizer");
    FILE *fp = fopen(cached, "rb");
    cr_expect(fp == NULL, "a refused tokenizer was cached at %s", cached);
    if (fp) fclose(fp);

    /* The right bytes: the retry loads them, caches them, and the replica is ready. */
    atomic_store(&f.honest, true);
    int64_t until = pie_test_now_ms() + WAIT_MS;
    while (readiness(ch) != RPC_HEALTH_SERVING && pie_test_now_ms() < until) pie_test_sleep_ms(20);
    cr_assert_eq(readiness(ch), RPC_HEALTH_SERVING, "never ready after the right bytes came");
    cr_expect_eq(pie_proc_log_count(lc, "event=lc.tokreg.loaded source=controller"), 1);
    fp = fopen(cached, "rb");
    cr_assert(fp, "the fetched tokenizer was not cached at %s", cached);
    fclose(fp);

    rpc_channel_destroy(ch);
    stop_ok(lc);
    fake_stop(&f);
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_expect_eq(system(cmd), 0);
    free(dir);
}
