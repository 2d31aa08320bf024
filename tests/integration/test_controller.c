/* test_controller.c — the control layer through real processes: a pie-controller and real CPU
 * pie-workers (tiny-f32 from PIE_MODELS_DIR) on loopback, driven over the Session stream by this
 * test acting as a lifecycle replica with several instances.
 *
 * Covers: greedy generation through controller and worker gives, at every step, the top-k
 * distribution of a fresh forward of the whole context (tests/support/pie_testref.h; several
 * instances batched together; tiny-f32's greedy tokens alone repeat the last token whatever
 * came before, so the distributions are what can see a lost prefix or a wrong position);
 * export / import shares pages (reference counts in ClusterStatus, the importer's distribution
 * is the exporter's context's); contention terminates the newest instance while the others
 * finish; a worker killed mid-run fails only its instances; a worker that joins takes new
 * placements; invalid calls get their precise errors over the wire and nothing else is
 * affected; on SIGTERM the controller drains its workers (the step in flight finishes and its
 * results arrive) and the workers, left idle, link to the next controller.
 *
 * Everything waits with deadlines; sanitizer builds are slow, so the deadlines are generous. */
#include <criterion/criterion.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pie/v1/controller.pb-c.h"
#include "pie_proc.h"
#include "pie_testref.h"
#include "pie_testutil.h"
#include "rpc.h"

#define START_MS      30000
#define STOP_MS       20000
#define WAIT_MS       30000
#define MODEL         "tiny-f32"
#define PAGE          16
#define DIST_K        8 /* candidates of every next_dist of a generation */
#define ENV_RECONNECT "PIE_CONTROLLER_RECONNECT_INITIAL=50ms", "PIE_CONTROLLER_RECONNECT_MAX=200ms"

TestSuite(controller, .fini = pie_test_leak_check, .timeout = 240);

/* ---- processes --------------------------------------------------------------------------------
 */

static pie_proc *start_controller_env(const char *const *env) {
    pie_status st;
    pie_proc_opts o = {.env = env};
    pie_proc *p = pie_proc_start("pie-controller", &o, START_MS, &st);
    cr_assert(p, "%s", st.msg);
    return p;
}

static pie_proc *start_controller(void) { return start_controller_env(NULL); }

/* extra: one more "NAME=value" for the worker's environment, or NULL. */
static pie_proc *start_worker_env(const pie_proc *ctl, const char *group, unsigned kv_pages,
                                  const char *extra) {
    static char ctl_env[4][96], group_env[4][64], pages_env[4][64];
    static int k;
    int i = k++ % 4;
    pie_proc_env_controller(ctl, ctl_env[i], sizeof ctl_env[i]);
    snprintf(group_env[i], sizeof group_env[i], "PIE_WORKER_GROUP_ID=%s", group);
    snprintf(pages_env[i], sizeof pages_env[i], "PIE_POOL_KV_PAGES=%u", kv_pages);
    const char *env[] = {ctl_env[i],
                         group_env[i],
                         pages_env[i],
                         "PIE_MODEL_PATH=" PIE_MODELS_DIR "/" MODEL,
                         "PIE_BACKEND=cpu",
                         "PIE_ENGINE_THREADS=1",
                         "PIE_POOL_EMBED_SLOTS=512",
                         ENV_RECONNECT,
                         extra,
                         NULL};
    pie_proc_opts o = {.env = env};
    pie_status st;
    pie_proc *p = pie_proc_start("pie-worker", &o, START_MS, &st);
    cr_assert(p, "%s", st.msg);
    return p;
}

static pie_proc *start_worker(const pie_proc *ctl, const char *group, unsigned kv_pages) {
    return start_worker_env(ctl, group, kv_pages, NULL);
}

static void stop_ok(pie_proc *p) {
    pie_status st;
    int rc = pie_proc_stop(p, STOP_MS, &st);
    char *tail = pie_proc_log_tail(p, 3000);
    cr_assert_eq(rc, 0, "%s exited with %d: %s\nlog:\n%s", pie_proc_name(p), rc, st.msg,
                 tail ? tail : "");
    free(tail);
    pie_proc_destroy(p);
}

static rpc_channel *channel_to(const pie_proc *p) {
    pie_status st;
    rpc_channel_opts o = {.reconnect_initial_ms = 50,
                          .reconnect_max_ms = 200,
                          .max_recv_bytes = 64 << 20,
                          .max_send_bytes = 64 << 20};
    rpc_channel *ch = rpc_channel_create(pie_proc_addr(p), &o, &st);
    cr_assert(ch, "%s", st.msg);
    return ch;
}

static Pie__V1__ClusterStatusResponse *cluster_status(rpc_channel *ch) {
    Pie__V1__ClusterStatusRequest req = PIE__V1__CLUSTER_STATUS_REQUEST__INIT;
    rpc_call_opts co = {.timeout_ms = 5000};
    ProtobufCMessage *out = NULL;
    pie_status st;
    cr_assert_eq(rpc_unary(ch, "/pie.v1.Controller/ClusterStatus", &req.base,
                           &pie__v1__cluster_status_response__descriptor, &out, &co, &st),
                 PIE_OK, "ClusterStatus: %s", st.msg);
    return (Pie__V1__ClusterStatusResponse *)out;
}

/* Waits until n workers are linked. */
static void wait_workers(rpc_channel *ch, size_t n) {
    int64_t deadline = pie_test_now_ms() + WAIT_MS;
    for (;;) {
        Pie__V1__ClusterStatusResponse *s = cluster_status(ch);
        size_t got = s->n_workers;
        rpc_msg_free(&s->base);
        if (got == n) return;
        cr_assert(pie_test_now_ms() < deadline, "wanted %zu linked workers, have %zu", n, got);
        pie_test_sleep_ms(20);
    }
}

static const Pie__V1__WorkerStatus *worker_of(const Pie__V1__ClusterStatusResponse *s,
                                              const char *group) {
    for (size_t i = 0; i < s->n_workers; i++)
        if (strcmp(s->workers[i]->group_id, group) == 0) return s->workers[i];
    cr_assert_fail("worker %s is not in ClusterStatus", group);
    return NULL;
}

/* ---- a Session client (this test plays a lifecycle replica) ------------------------------------
 */

#define MAXDOWN 8192

typedef struct sess {
    rpc_stream *s;
    uint32_t replica;
    uint64_t next_inst, next_call;
    Pie__V1__SessionDown *down[MAXDOWN];
    int n_down;
    Pie__V1__ModelInfo *model; /* inside down[] */
} sess;

static void sess_take(sess *S, Pie__V1__SessionDown *d) {
    cr_assert_lt(S->n_down, MAXDOWN);
    S->down[S->n_down++] = d;
    if (d->welcome) S->replica = d->welcome->replica_index;
    for (size_t i = 0; i < d->n_events; i++)
        if (d->events[i]->event_case == PIE__V1__SESSION_EVENT__EVENT_MODELS_CHANGED)
            for (size_t k = 0; k < d->events[i]->models_changed->n_models; k++)
                if (strcmp(d->events[i]->models_changed->models[k]->name, MODEL) == 0)
                    S->model = d->events[i]->models_changed->models[k];
}

/* Reads one message within timeout; false on timeout. */
static bool sess_pump(sess *S, int64_t timeout_ms) {
    ProtobufCMessage *m = NULL;
    rpc_recv_result r = rpc_stream_recv(S->s, &m, timeout_ms);
    if (r == RPC_RECV_TIMEOUT) return false;
    cr_assert_eq(r, RPC_RECV_MESSAGE, "the Session stream ended");
    sess_take(S, (Pie__V1__SessionDown *)m);
    return true;
}

static sess *sess_open(rpc_channel *ch) {
    sess *S = calloc(1, sizeof *S);
    cr_assert(S);
    pie_status st;
    S->s = rpc_stream_open(ch, "/pie.v1.Controller/Session", &pie__v1__session_down__descriptor,
                           NULL, &st);
    cr_assert(S->s, "%s", st.msg);
    Pie__V1__SessionHello h = PIE__V1__SESSION_HELLO__INIT;
    h.replica_id = "test-replica";
    h.version = "pie-c/0.1.0";
    Pie__V1__SessionUp up = PIE__V1__SESSION_UP__INIT;
    up.hello = &h;
    cr_assert_eq(rpc_stream_send(S->s, &up.base, &st), PIE_OK, "%s", st.msg);
    int64_t deadline = pie_test_now_ms() + WAIT_MS;
    while (S->replica == 0 || S->model == NULL) {
        cr_assert(pie_test_now_ms() < deadline, "no welcome / model %s from the controller", MODEL);
        sess_pump(S, 500);
    }
    return S;
}

static void sess_close(sess *S) {
    pie_status st;
    rpc_stream_close_send(S->s, &st);
    rpc_stream_cancel(S->s);
    rpc_stream_finish(S->s, &st);
    rpc_stream_destroy(S->s);
    for (int i = 0; i < S->n_down; i++) rpc_msg_free(&S->down[i]->base);
    free(S);
}

static Pie__V1__CallResult *find_result(sess *S, uint64_t call_id) {
    for (int i = 0; i < S->n_down; i++)
        for (size_t k = 0; k < S->down[i]->n_results; k++)
            if (S->down[i]->results[k]->call_id == call_id) return S->down[i]->results[k];
    return NULL;
}

static Pie__V1__CallResult *wait_result(sess *S, uint64_t call_id) {
    int64_t deadline = pie_test_now_ms() + WAIT_MS;
    Pie__V1__CallResult *r;
    while ((r = find_result(S, call_id)) == NULL) {
        cr_assert(pie_test_now_ms() < deadline, "no result for call %llu", (unsigned long long)call_id);
        sess_pump(S, 200);
    }
    return r;
}

static Pie__V1__InstanceTerminated *find_terminated(sess *S, uint64_t inst) {
    for (int i = 0; i < S->n_down; i++)
        for (size_t k = 0; k < S->down[i]->n_events; k++) {
            Pie__V1__SessionEvent *e = S->down[i]->events[k];
            if (e->event_case == PIE__V1__SESSION_EVENT__EVENT_INSTANCE_TERMINATED &&
                e->instance_terminated->instance_id == inst)
                return e->instance_terminated;
        }
    return NULL;
}

static Pie__V1__InstanceTerminated *wait_terminated(sess *S, uint64_t inst) {
    int64_t deadline = pie_test_now_ms() + WAIT_MS;
    Pie__V1__InstanceTerminated *t;
    while ((t = find_terminated(S, inst)) == NULL) {
        cr_assert(pie_test_now_ms() < deadline, "instance %llu was not terminated",
                  (unsigned long long)inst);
        sess_pump(S, 200);
    }
    return t;
}

/* ---- SessionUp builder ------------------------------------------------------------------------
 */

#define MAXCALLS 256

typedef struct ub {
    Pie__V1__SessionUp up;
    Pie__V1__ApiCall c[MAXCALLS], *cp[MAXCALLS];
    Pie__V1__InstanceBegin b[8], *bp[8];
    Pie__V1__InstanceEnd e[8], *ep[8];
    /* storage for op messages and id lists, valid until the message is sent */
    unsigned char store[1 << 18];
    size_t used;
} ub;

static ub *ub_new(void) {
    ub *b = calloc(1, sizeof *b);
    cr_assert(b);
    pie__v1__session_up__init(&b->up);
    return b;
}

static void *ub_alloc(ub *b, size_t n) {
    n = (n + 15) & ~(size_t)15;
    cr_assert_leq(b->used + n, sizeof b->store);
    void *p = b->store + b->used;
    b->used += n;
    memset(p, 0, n);
    return p;
}

static uint32_t *ub_ids(ub *b, const uint32_t *v, size_t n) {
    uint32_t *p = ub_alloc(b, (n ? n : 1) * sizeof *p);
    if (n) memcpy(p, v, n * sizeof *p);
    return p;
}

static uint32_t *ub_range(ub *b, uint32_t from, size_t n) {
    uint32_t *p = ub_alloc(b, (n ? n : 1) * sizeof *p);
    for (size_t i = 0; i < n; i++) p[i] = from + (uint32_t)i;
    return p;
}

static uint64_t ub_begin(sess *S, ub *b) {
    uint64_t id = ((uint64_t)S->replica << 48) | ++S->next_inst;
    size_t i = b->up.n_begins++;
    pie__v1__instance_begin__init(&b->b[i]);
    b->b[i].instance_id = id;
    b->b[i].program_id = "test";
    b->b[i].model = MODEL;
    b->bp[i] = &b->b[i];
    b->up.begins = b->bp;
    return id;
}

static void ub_end(ub *b, uint64_t id) {
    size_t i = b->up.n_ends++;
    pie__v1__instance_end__init(&b->e[i]);
    b->e[i].instance_id = id;
    b->ep[i] = &b->e[i];
    b->up.ends = b->ep;
}

static uint64_t ub_call(sess *S, ub *b, uint64_t inst, uint32_t q, int op, void *msg) {
    size_t i = b->up.n_calls++;
    cr_assert_lt(i, MAXCALLS);
    Pie__V1__ApiCall *c = &b->c[i];
    pie__v1__api_call__init(c);
    c->instance_id = inst;
    c->queue_id = q;
    c->call_id = ++S->next_call;
    c->op_case = op;
    c->create_queue = msg;
    b->cp[i] = c;
    b->up.calls = b->cp;
    return c->call_id;
}

static void ub_send(sess *S, ub *b) {
    pie_status st;
    cr_assert_eq(rpc_stream_send(S->s, &b->up.base, &st), PIE_OK, "%s", st.msg);
    free(b);
}

#define OP(x) PIE__V1__API_CALL__OP_##x

static uint64_t c_create(sess *S, ub *b, uint64_t inst, uint32_t q) {
    Pie__V1__CreateQueue *m = ub_alloc(b, sizeof *m);
    pie__v1__create_queue__init(m);
    return ub_call(S, b, inst, q, OP(CREATE_QUEUE), m);
}

static uint64_t c_alloc_kv(sess *S, ub *b, uint64_t inst, uint32_t from, size_t n) {
    Pie__V1__AllocKvPages *m = ub_alloc(b, sizeof *m);
    pie__v1__alloc_kv_pages__init(m);
    m->kv_page_ids = ub_range(b, from, n);
    m->n_kv_page_ids = n;
    return ub_call(S, b, inst, 1, OP(ALLOC_KV_PAGES), m);
}

static uint64_t c_alloc_emb(sess *S, ub *b, uint64_t inst, uint32_t from, size_t n) {
    Pie__V1__AllocEmbeds *m = ub_alloc(b, sizeof *m);
    pie__v1__alloc_embeds__init(m);
    m->embed_ids = ub_range(b, from, n);
    m->n_embed_ids = n;
    return ub_call(S, b, inst, 1, OP(ALLOC_EMBEDS), m);
}

static uint64_t c_embed(sess *S, ub *b, uint64_t inst, uint32_t emb_from, const uint32_t *toks,
                        uint32_t pos_from, size_t n) {
    Pie__V1__EmbedText *m = ub_alloc(b, sizeof *m);
    pie__v1__embed_text__init(m);
    m->embed_ids = ub_range(b, emb_from, n);
    m->n_embed_ids = n;
    m->token_ids = ub_ids(b, toks, n);
    m->n_token_ids = n;
    m->positions = ub_range(b, pos_from, n);
    m->n_positions = n;
    return ub_call(S, b, inst, 1, OP(EMBED_TEXT), m);
}

/* forward over context pages [ctx0, ctx0+nctx) (last holds `last` tokens), inputs
 * [in0, in0+nin), appending to pages out[0..nout), output embedding oemb (or none if -1). */
static uint64_t c_forward(sess *S, ub *b, uint64_t inst, const uint32_t *ctx, size_t nctx,
                          uint32_t last, uint32_t in0, size_t nin, const uint32_t *out, size_t nout,
                          int64_t oemb) {
    Pie__V1__Forward *m = ub_alloc(b, sizeof *m);
    pie__v1__forward__init(m);
    m->kv_page_ids = ub_ids(b, ctx, nctx);
    m->n_kv_page_ids = nctx;
    m->kv_page_last_len = last;
    m->input_embed_ids = ub_range(b, in0, nin);
    m->n_input_embed_ids = nin;
    m->output_kv_page_ids = ub_ids(b, out, nout);
    m->n_output_kv_page_ids = nout;
    if (oemb >= 0) {
        m->output_embed_ids = ub_range(b, (uint32_t)oemb, 1);
        m->n_output_embed_ids = 1;
    }
    return ub_call(S, b, inst, 1, OP(FORWARD), m);
}

static uint64_t c_dist(sess *S, ub *b, uint64_t inst, uint32_t emb, uint32_t k) {
    Pie__V1__NextDist *m = ub_alloc(b, sizeof *m);
    pie__v1__next_dist__init(m);
    m->embed_ids = ub_range(b, emb, 1);
    m->n_embed_ids = 1;
    m->top_k = k;
    return ub_call(S, b, inst, 1, OP(NEXT_DIST), m);
}

/* ---- greedy generation over the Session -------------------------------------------------------
 *
 * A generation holds page ids 0.. (one per PAGE tokens) in its instance and embeddings 0..n-1
 * for the prompt; every step appends one token to the last page (or a new one). */

typedef struct gen {
    uint64_t inst;
    uint32_t prompt[64];
    size_t n_prompt;
    uint32_t out[64];
    pie_testref_dist dists[64]; /* dists[i]: the distribution out[i] was taken from */
    size_t n_out;
    uint32_t page_base; /* first page id of this generation's context */
    size_t reserve;     /* tokens beyond the prompt its pages have room for (0: 40) */
    uint64_t pending;   /* next_dist call in flight */
    bool dead;
} gen;

/* Context pages and the output page for appending one (or n) token(s) at position `pos`. */
static void append_shape(uint32_t base, uint32_t pos, size_t n, uint32_t *ctx, size_t *nctx,
                         uint32_t *last, uint32_t *out, size_t *nout) {
    *nctx = (pos + PAGE - 1) / PAGE;
    for (size_t i = 0; i < *nctx; i++) ctx[i] = base + (uint32_t)i;
    *last = pos ? (pos - 1) % PAGE + 1 : 0;
    uint32_t first =
        pos / PAGE; /* page receiving position pos: the last context page or a new one */
    uint32_t end = (uint32_t)((pos + n - 1) / PAGE);
    *nout = end - first + 1;
    for (size_t i = 0; i < *nout; i++) out[i] = base + first + (uint32_t)i;
}

/* Adds the prefill calls of g to b (alloc pages for the prompt and g->reserve more tokens). */
static void gen_prefill(sess *S, ub *b, gen *g) {
    size_t pages = (g->n_prompt + (g->reserve ? g->reserve : 40) + PAGE - 1) / PAGE;
    c_alloc_kv(S, b, g->inst, g->page_base, pages);
    c_alloc_emb(S, b, g->inst, 0, g->n_prompt);
    c_embed(S, b, g->inst, 0, g->prompt, 0, g->n_prompt);
    uint32_t ctx[64], out[64], last;
    size_t nctx, nout;
    append_shape(g->page_base, 0, g->n_prompt, ctx, &nctx, &last, out, &nout);
    c_forward(S, b, g->inst, ctx, nctx, last, 0, g->n_prompt, out, nout, (int64_t)g->n_prompt - 1);
    g->pending = c_dist(S, b, g->inst, (uint32_t)g->n_prompt - 1, DIST_K);
}

/* Adds one decode step of g: the last token generated, at its position. */
static void gen_decode(sess *S, ub *b, gen *g) {
    uint32_t pos = (uint32_t)(g->n_prompt + g->n_out - 1);
    uint32_t tok = g->out[g->n_out - 1];
    c_embed(S, b, g->inst, 0, &tok, pos, 1);
    uint32_t ctx[64], out[64], last;
    size_t nctx, nout;
    append_shape(g->page_base, pos, 1, ctx, &nctx, &last, out, &nout);
    c_forward(S, b, g->inst, ctx, nctx, last, 0, 1, out, nout, 0);
    g->pending = c_dist(S, b, g->inst, 0, DIST_K);
}

/* *out ← the one distribution of a successful next_dist result r of DIST_K candidates. */
static void dist_of(const Pie__V1__CallResult *r, pie_testref_dist *out) {
    cr_assert_eq(r->code, 0, "next_dist: %s %s", pie_code_name((int)r->code), r->message);
    cr_assert_eq(r->payload_case, PIE__V1__CALL_RESULT__PAYLOAD_DISTRIBUTIONS);
    cr_assert_eq(r->distributions->n_dists, 1);
    const Pie__V1__Distribution *d = r->distributions->dists[0];
    cr_assert_eq(d->n_token_ids, DIST_K);
    cr_assert_eq(d->n_probs, DIST_K);
    out->k = DIST_K;
    memcpy(out->ids, d->token_ids, DIST_K * sizeof *out->ids);
    memcpy(out->probs, d->probs, DIST_K * sizeof *out->probs);
}

/* Takes g's pending distribution: its argmax is the next token. */
static void gen_take(sess *S, gen *g) {
    Pie__V1__CallResult *r = wait_result(S, g->pending);
    cr_assert_eq(r->code, 0, "instance %llu next_dist: %s %s", (unsigned long long)g->inst,
                 pie_code_name((int)r->code), r->message);
    dist_of(r, &g->dists[g->n_out]);
    g->out[g->n_out] = g->dists[g->n_out].ids[0];
    g->n_out++;
}

/* Runs gens in lock-step (one SessionUp per step for all of them) for n_new tokens. */
static void gen_run(sess *S, gen *gens, size_t n, size_t n_new, bool begin) {
    ub *b = ub_new();
    for (size_t i = 0; i < n; i++) {
        if (begin) {
            gens[i].inst = ub_begin(S, b);
            c_create(S, b, gens[i].inst, 1);
        }
        gen_prefill(S, b, &gens[i]);
    }
    ub_send(S, b);
    for (size_t i = 0; i < n; i++) gen_take(S, &gens[i]);
    for (size_t step = 1; step < n_new; step++) {
        b = ub_new();
        for (size_t i = 0; i < n; i++) gen_decode(S, b, &gens[i]);
        ub_send(S, b);
        for (size_t i = 0; i < n; i++) gen_take(S, &gens[i]);
    }
}

/* Asserts that every distribution g received is the one of a fresh forward of its context. */
static void expect_reference(const char *label, const gen *g) {
    pie_testref *r = pie_testref_open(PIE_MODELS_DIR "/" MODEL);
    pie_testref_expect_gen(r, label, g->prompt, g->n_prompt, g->out, g->dists, g->n_out);
    pie_testref_close(r);
}

static void fill_prompt(gen *g, size_t n, uint32_t seed) {
    g->n_prompt = n;
    for (size_t i = 0; i < n; i++) g->prompt[i] = (seed * 131 + (uint32_t)i * 17) % 500 + 1;
}

/* ---- tests -------------------------------------------------------------------------------------
 */

Test(controller, greedy_generation_through_controller_and_worker_has_the_reference_distributions) {
    pie_proc *ctl = start_controller();
    pie_proc *w = start_worker(ctl, "w1", 256);
    rpc_channel *ch = channel_to(ctl);
    wait_workers(ch, 1);
    sess *S = sess_open(ch);
    cr_assert_eq(S->model->kv_page_size, PAGE);
    /* Three instances of different prompt lengths, batched together: crossing page borders. */
    gen g[3] = {0};
    fill_prompt(&g[0], 5, 1);
    fill_prompt(&g[1], 16, 2);
    fill_prompt(&g[2], 30, 3);
    const size_t n_new = 12;
    gen_run(S, g, 3, n_new, true);
    const char *labels[3] = {"instance 0 (5-token prompt)", "instance 1 (16-token prompt)",
                             "instance 2 (30-token prompt)"};
    for (size_t i = 0; i < 3; i++) {
        cr_assert_eq(g[i].n_out, n_new);
        expect_reference(labels[i], &g[i]);
    }
    sess_close(S);
    rpc_channel_destroy(ch);
    stop_ok(w);
    stop_ok(ctl);
}

Test(controller, export_and_import_share_pages_with_visible_reference_counts) {
    pie_proc *ctl = start_controller();
    pie_proc *w = start_worker(ctl, "w1", 64);
    rpc_channel *ch = channel_to(ctl);
    wait_workers(ch, 1);
    sess *S = sess_open(ch);
    /* A prefills 32 tokens (2 full pages) and exports them. */
    gen a = {0};
    fill_prompt(&a, 32, 7);
    ub *b = ub_new();
    a.inst = ub_begin(S, b);
    c_create(S, b, a.inst, 1);
    a.reserve = 1;
    gen_prefill(S, b, &a); /* pages 0..2 (room for one more token) */
    Pie__V1__ExportKvPages *ex = ub_alloc(b, sizeof *ex);
    pie__v1__export_kv_pages__init(ex);
    ex->kv_page_ids = ub_range(b, 0, 2);
    ex->n_kv_page_ids = 2;
    ex->name = "prefix-32";
    uint64_t exc = ub_call(S, b, a.inst, 1, OP(EXPORT_KV_PAGES), ex);
    ub_send(S, b);
    gen_take(S, &a);
    cr_assert_null(find_result(S, exc), "export succeeded silently");
    /* B imports them as its pages 100, 101 and continues from the same prefix. */
    b = ub_new();
    uint64_t bi = ub_begin(S, b);
    c_create(S, b, bi, 1);
    Pie__V1__ImportKvPages *im = ub_alloc(b, sizeof *im);
    pie__v1__import_kv_pages__init(im);
    im->kv_page_ids = ub_range(b, 100, 2);
    im->n_kv_page_ids = 2;
    im->name = "prefix-32";
    uint64_t imc = ub_call(S, b, bi, 1, OP(IMPORT_KV_PAGES), im);
    c_alloc_kv(S, b, bi, 102, 1);
    c_alloc_emb(S, b, bi, 0, 1);
    uint32_t tok = a.out[0];
    c_embed(S, b, bi, 0, &tok, 32, 1);
    uint32_t ctx[] = {100, 101}, out[] = {102};
    c_forward(S, b, bi, ctx, 2, PAGE, 0, 1, out, 1, 0);
    uint64_t bd = c_dist(S, b, bi, 0, DIST_K);
    /* Writing into an imported page is refused: it is shared. */
    uint32_t outbad[] = {101};
    uint64_t bad = c_forward(S, b, bi, ctx, 1, PAGE, 0, 1, outbad, 1, -1);
    ub_send(S, b);
    Pie__V1__CallResult *r = wait_result(S, imc);
    cr_assert_eq(r->code, 0, "%s", r->message);
    cr_assert_eq(r->imported->n_kv_page_ids, 2);
    pie_testref_dist b_dist;
    dist_of(wait_result(S, bd), &b_dist);
    r = wait_result(S, bad);
    cr_assert_eq(r->code, PIE_FAILED_PRECONDITION);
    cr_assert_str_eq(r->message, "forward: kv page 101 is read-only: it is shared (3 references: "
                                 "exports or other instances); copy it first");
    /* A's own next step from the same context gives the same token. */
    b = ub_new();
    gen_decode(S, b, &a);
    ub_send(S, b);
    gen_take(S, &a);
    expect_reference("A, the exporter", &a);
    /* B's distribution is the one after A's 32 prompt tokens and A's first token. */
    uint32_t b_ctx[33];
    memcpy(b_ctx, a.prompt, 32 * sizeof *b_ctx);
    b_ctx[32] = a.out[0];
    pie_testref *ref = pie_testref_open(PIE_MODELS_DIR "/" MODEL);
    pie_testref_dist want;
    pie_testref_next(ref, b_ctx, 33, DIST_K, &want);
    pie_testref_close(ref);
    char why[256];
    cr_assert(pie_testref_same(&b_dist, &want, PIE_TESTREF_TOL, why, sizeof why),
              "the importer does not see the exporter's K/V: %s", why);
    /* The references: A 3 pages, export 2, B 2 imported + 1 own → 8 refs over 4 slots. */
    Pie__V1__ClusterStatusResponse *s = cluster_status(ch);
    const Pie__V1__WorkerStatus *ws = worker_of(s, "w1");
    cr_assert_eq(ws->kv_pages_used, 4);
    cr_assert_eq(ws->kv_page_refs, 8);
    cr_assert_eq(ws->kv_pages_shared, 2);
    cr_assert_eq(s->exports, 1);
    rpc_msg_free(&s->base);
    /* A ends: its tied export goes; B still holds the shared pages, now alone. */
    b = ub_new();
    ub_end(b, a.inst);
    ub_send(S, b);
    int64_t deadline = pie_test_now_ms() + WAIT_MS;
    for (;;) {
        s = cluster_status(ch);
        ws = worker_of(s, "w1");
        bool done = ws->kv_pages_used == 3 && ws->kv_page_refs == 3 && s->exports == 0;
        uint64_t refs = ws->kv_page_refs;
        rpc_msg_free(&s->base);
        if (done) break;
        cr_assert(pie_test_now_ms() < deadline, "after A ended: refs %llu", (unsigned long long)refs);
        pie_test_sleep_ms(20);
    }
    sess_close(S);
    rpc_channel_destroy(ch);
    stop_ok(w);
    stop_ok(ctl);
}

Test(controller, contention_terminates_the_newest_instance_and_the_others_finish) {
    pie_proc *ctl = start_controller();
    pie_proc *w = start_worker(ctl, "w1", 6);
    rpc_channel *ch = channel_to(ctl);
    wait_workers(ch, 1);
    sess *S = sess_open(ch);
    gen g[3] = {0};
    for (int i = 0; i < 3; i++) {
        fill_prompt(&g[i], 8, 10 + (uint32_t)i);
        g[i].reserve = 24;
    }
    /* Each takes 2 of the 6 pages (8 prompt + up to 24 new tokens). */
    gen_run(S, g, 3, 1, true);
    /* A (the oldest) wants 2 more pages: the newest (C) is terminated for them. */
    ub *b = ub_new();
    uint64_t more = c_alloc_kv(S, b, g[0].inst, 50, 2);
    uint64_t sync =
        ub_call(S, b, g[0].inst, 1, OP(SYNCHRONIZE), ub_alloc(b, sizeof(Pie__V1__Synchronize)));
    pie__v1__synchronize__init((Pie__V1__Synchronize *)b->c[b->up.n_calls - 1].synchronize);
    ub_send(S, b);
    Pie__V1__InstanceTerminated *t = wait_terminated(S, g[2].inst);
    cr_assert_eq(t->status->code, PIE_RESOURCE_EXHAUSTED);
    cr_assert(strstr(t->status->message, "terminated by the system due to resource contention"),
              "%s", t->status->message);
    cr_assert_eq(wait_result(S, sync)->code, 0);
    cr_assert_null(find_result(S, more), "the allocation succeeded");
    /* A and B finish their generations. */
    for (size_t step = 1; step < 10; step++) {
        b = ub_new();
        gen_decode(S, b, &g[0]);
        gen_decode(S, b, &g[1]);
        ub_send(S, b);
        gen_take(S, &g[0]);
        gen_take(S, &g[1]);
    }
    cr_assert_null(find_terminated(S, g[0].inst));
    cr_assert_null(find_terminated(S, g[1].inst));
    expect_reference("A", &g[0]);
    expect_reference("B", &g[1]);
    sess_close(S);
    rpc_channel_destroy(ch);
    stop_ok(w);
    stop_ok(ctl);
}

Test(controller, a_worker_killed_mid_run_fails_only_its_instances_and_a_new_worker_takes_over) {
    pie_proc *ctl = start_controller();
    rpc_channel *ch = channel_to(ctl);
    pie_proc *w1 = start_worker(ctl, "w1", 64);
    wait_workers(ch, 1);
    sess *S = sess_open(ch);
    /* A is placed on w1 (the only worker). */
    gen g[2] = {0};
    fill_prompt(&g[0], 6, 21);
    fill_prompt(&g[1], 9, 22);
    gen_run(S, g, 1, 2, true);
    /* w2 joins: the next placement goes to it (empty, so least loaded). */
    pie_proc *w2 = start_worker(ctl, "w2", 64);
    wait_workers(ch, 2);
    gen_run(S, &g[1], 1, 2, true);
    Pie__V1__ClusterStatusResponse *s = cluster_status(ch);
    cr_assert_eq(worker_of(s, "w1")->instances, 1);
    cr_assert_eq(worker_of(s, "w2")->instances, 1, "the new worker took the new instance");
    rpc_msg_free(&s->base);
    /* Both run; w1 dies mid-run. */
    ub *b = ub_new();
    gen_decode(S, b, &g[0]);
    gen_decode(S, b, &g[1]);
    ub_send(S, b);
    gen_take(S, &g[1]);
    pie_status st;
    cr_assert_eq(pie_proc_signal(w1, SIGKILL, &st), PIE_OK, "%s", st.msg);
    pie_proc_wait(w1, STOP_MS, &st);
    pie_proc_destroy(w1);
    Pie__V1__InstanceTerminated *t = wait_terminated(S, g[0].inst);
    cr_assert_eq(t->status->code, PIE_UNAVAILABLE);
    cr_assert(strncmp(t->status->message, "worker w1 (" MODEL ") lost", 20) == 0, "%s",
              t->status->message);
    /* B finishes on w2 and matches the engine. */
    for (size_t step = 0; step < 8; step++) {
        b = ub_new();
        gen_decode(S, b, &g[1]);
        ub_send(S, b);
        gen_take(S, &g[1]);
    }
    cr_assert_null(find_terminated(S, g[1].inst));
    expect_reference("B, moved to w2", &g[1]);
    sess_close(S);
    rpc_channel_destroy(ch);
    stop_ok(w2);
    stop_ok(ctl);
}

Test(controller, invalid_calls_get_precise_errors_and_nothing_else_is_affected) {
    pie_proc *ctl = start_controller();
    pie_proc *w = start_worker(ctl, "w1", 64);
    rpc_channel *ch = channel_to(ctl);
    wait_workers(ch, 1);
    sess *S = sess_open(ch);
    const Pie__V1__ModelInfo *m = S->model;
    gen g = {0};
    fill_prompt(&g, 4, 31);
    gen_run(S, &g, 1, 1, true);
    ub *b = ub_new();
    uint32_t ctx[] = {0}, none[] = {0}, bogus[] = {77};
    uint64_t e1 = c_forward(S, b, g.inst, bogus, 1, 4, 0, 1, none, 0, 0);
    Pie__V1__NextDist *nd = ub_alloc(b, sizeof *nd);
    pie__v1__next_dist__init(nd);
    nd->embed_ids = ub_range(b, 0, 1);
    nd->n_embed_ids = 1;
    nd->top_k = m->max_top_k + 1;
    uint64_t e2 = ub_call(S, b, g.inst, 1, OP(NEXT_DIST), nd);
    Pie__V1__MaskKvPage *mk = ub_alloc(b, sizeof *mk);
    pie__v1__mask_kv_page__init(mk);
    mk->masked = ub_alloc(b, 3 * sizeof *mk->masked);
    mk->n_masked = 3;
    uint64_t e3 = ub_call(S, b, g.inst, 1, OP(MASK_KV_PAGE), mk);
    uint32_t tok = m->vocab_size;
    uint64_t e4 = c_embed(S, b, g.inst, 0, &tok, 0, 1);
    uint64_t e5 = c_forward(S, b, g.inst, ctx, 1, (uint32_t)PAGE + 1, 0, 1, none, 0, -1);
    uint64_t e6 =
        ub_call(S, b, g.inst, 9, OP(SYNCHRONIZE), ub_alloc(b, sizeof(Pie__V1__Synchronize)));
    pie__v1__synchronize__init((Pie__V1__Synchronize *)b->c[b->up.n_calls - 1].synchronize);
    ub_send(S, b);
    struct {
        uint64_t id;
        pie_code code;
        char msg[200];
    } want[6] = {
        {e1, PIE_INVALID_ARGUMENT, "forward: kv page 77 is not allocated in this instance"},
        {e2, PIE_INVALID_ARGUMENT, ""},
        {e3, PIE_INVALID_ARGUMENT, ""},
        {e4, PIE_INVALID_ARGUMENT, ""},
        {e5, PIE_INVALID_ARGUMENT, ""},
        {e6, PIE_NOT_FOUND, "synchronize: queue 9 is not found in this instance"},
    };
    snprintf(want[1].msg, sizeof want[1].msg,
             "next_dist: top_k %u is out of range [0, %u]", m->max_top_k + 1, m->max_top_k);
    snprintf(want[2].msg, sizeof want[2].msg,
             "mask_kv_page: masked has 3 entries, must have kv_page_size %u", PAGE);
    snprintf(want[3].msg, sizeof want[3].msg,
             "embed_text: token_ids[0] = %u is out of range [0, %u)", m->vocab_size,
             m->vocab_size);
    snprintf(want[4].msg, sizeof want[4].msg,
             "forward: kv_page_last_len %u is out of range [1, %u]", PAGE + 1, PAGE);
    for (int i = 0; i < 6; i++) {
        Pie__V1__CallResult *r = wait_result(S, want[i].id);
        cr_assert_eq(r->code, (uint32_t)want[i].code, "case %d: %s \"%s\"", i,
                     pie_code_name((int)r->code), r->message);
        cr_assert_str_eq(r->message, want[i].msg, "case %d", i);
    }
    /* The instance goes on generating correctly. */
    for (size_t step = 1; step < 6; step++) {
        b = ub_new();
        gen_decode(S, b, &g);
        ub_send(S, b);
        gen_take(S, &g);
    }
    expect_reference("the instance after the invalid calls", &g);
    sess_close(S);
    rpc_channel_destroy(ch);
    stop_ok(w);
    stop_ok(ctl);
}

/* Waits until p is in the stopped state (SIGSTOP is delivered asynchronously). */
static void wait_stopped(const pie_proc *p) {
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", pie_proc_pid(p));
    int64_t deadline = pie_test_now_ms() + WAIT_MS;
    for (;;) {
        FILE *f = fopen(path, "r");
        cr_assert(f, "%s: cannot open", path);
        size_t n = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[n] = '\0';
        const char *paren = strrchr(buf, ')'); /* "pid (comm) state ..." */
        if (paren && paren[1] == ' ' && paren[2] == 'T') return;
        cr_assert(pie_test_now_ms() < deadline, "%s did not stop: %s", pie_proc_name(p), buf);
        pie_test_sleep_ms(2);
    }
}

Test(controller, on_sigterm_the_controller_drains_workers_and_they_link_to_the_next_one) {
    const char *env1[] = {"PIE_SERVER_SHUTDOWN_GRACE=20s", NULL};
    pie_proc *ctl = start_controller_env(env1);
    int port = pie_proc_grpc_port(ctl);
    pie_proc *w = start_worker(ctl, "w1", 64);
    rpc_channel *ch = channel_to(ctl);
    wait_workers(ch, 1);
    sess *S = sess_open(ch);
    gen g[2] = {0};
    fill_prompt(&g[0], 12, 3);
    fill_prompt(&g[1], 20, 4);
    g[1].page_base = 8;
    gen_run(S, g, 2, 1, true);

    /* Freeze the worker, then send a decode step: it is sent and stays unanswered. */
    pie_status st;
    cr_assert_eq(pie_proc_signal(w, SIGSTOP, &st), PIE_OK, "%s", st.msg);
    wait_stopped(w);
    ub *b = ub_new();
    gen_decode(S, b, &g[0]);
    gen_decode(S, b, &g[1]);
    ub_send(S, b);
    int64_t deadline = pie_test_now_ms() + WAIT_MS;
    for (;;) {
        Pie__V1__ClusterStatusResponse *cs = cluster_status(ch);
        uint32_t in_flight = worker_of(cs, "w1")->batches_in_flight;
        rpc_msg_free(&cs->base);
        if (in_flight > 0) break;
        cr_assert(pie_test_now_ms() < deadline, "the step never left the controller");
        pie_test_sleep_ms(5);
    }

    /* SIGTERM: the controller sends Drain and waits for the step it has on the worker. */
    cr_assert_eq(pie_proc_signal(ctl, SIGTERM, &st), PIE_OK, "%s", st.msg);
    cr_assert(pie_proc_wait_log(ctl, "event=ctl.worker.drain worker_index=1 group=w1 steps_out=1",
                                1, WAIT_MS),
              "the controller sent no Drain");
    Pie__V1__ClusterStatusResponse *cs = cluster_status(ch);
    cr_assert_eq(worker_of(cs, "w1")->state, PIE__V1__WORKER_STATE__WORKER_STATE_DRAINING);
    cr_assert_gt(worker_of(cs, "w1")->batches_in_flight, 0);
    rpc_msg_free(&cs->base);
    cr_assert_eq(pie_proc_log_count(ctl, "event=ctl.drained"), 0,
                 "the controller stopped waiting while the step was on the worker");

    /* The worker resumes: it finishes the step, reports its results (which reach this replica
     * through the draining controller), and honours the Drain. */
    cr_assert_eq(pie_proc_signal(w, SIGCONT, &st), PIE_OK, "%s", st.msg);
    gen_take(S, &g[0]);
    gen_take(S, &g[1]);
    expect_reference("instance 0 (step 1 is the drained one)", &g[0]);
    expect_reference("instance 1 (step 1 is the drained one)", &g[1]);
    cr_assert(pie_proc_wait_log(w, "event=wrk.link.drain shutdown=0 reason=\"controller shutting "
                                   "down\"",
                                1, WAIT_MS),
              "the worker did not receive the Drain");
    sess_close(S);
    rpc_channel_destroy(ch);
    int rc = pie_proc_wait(ctl, STOP_MS, &st);
    cr_assert_eq(rc, 0, "the controller exited %d: %s", rc, st.msg);
    cr_assert_eq(pie_proc_log_count(ctl, "event=ctl.drained steps_unanswered=0"), 1,
                 "the drain did not complete");
    pie_proc_destroy(ctl);

    /* The worker stayed up (Drain without shutdown) and registers with the next controller at
     * the same address, which serves generations on it. */
    char listen[64];
    snprintf(listen, sizeof listen, "PIE_SERVER_LISTEN=127.0.0.1:%d", port);
    const char *env2[] = {listen, NULL};
    pie_proc *ctl2 = start_controller_env(env2);
    rpc_channel *ch2 = channel_to(ctl2);
    wait_workers(ch2, 1);
    cr_assert(pie_proc_wait_log(w, "event=wrk.link.registered", 2, WAIT_MS));
    sess *S2 = sess_open(ch2);
    gen g2 = {0};
    fill_prompt(&g2, 12, 3);
    gen_run(S2, &g2, 1, 2, true);
    cr_assert_eq(g2.out[1], g[0].out[1], "the worker computes the same tokens after the drain");
    expect_reference("after the drain", &g2);
    sess_close(S2);
    rpc_channel_destroy(ch2);
    stop_ok(w);
    stop_ok(ctl2);
}

Test(controller, results_larger_than_max_message_are_split_into_batches_and_messages_that_fit) {
    /* 16 KiB messages everywhere: 8 distributions of top_k 512 (the tiny model's vocabulary)
     * are about 3 KB each on the wire, 25 KB together. */
    const char *env[] = {"PIE_SERVER_MAX_MESSAGE=16KiB", NULL};
    pie_proc *ctl = start_controller_env(env);
    pie_proc *w = start_worker_env(ctl, "w1", 64, "PIE_SERVER_MAX_MESSAGE=16KiB");
    rpc_channel *ch = channel_to(ctl);
    wait_workers(ch, 1);
    sess *S = sess_open(ch);
    enum { N = 8 };
    gen g[N] = {0};
    for (int i = 0; i < N; i++) fill_prompt(&g[i], 10 + (size_t)i, 20 + (uint32_t)i);
    gen_run(S, g, N, 1, true);
    int downs_before = S->n_down;
    ub *b = ub_new();
    uint64_t d[N];
    for (int i = 0; i < N; i++)
        d[i] = c_dist(S, b, g[i].inst, (uint32_t)g[i].n_prompt - 1, S->model->max_top_k);
    ub_send(S, b);
    int first_down = 0, last_down = 0;
    for (int i = 0; i < N; i++) {
        Pie__V1__CallResult *r = wait_result(S, d[i]);
        cr_assert_eq(r->code, 0, "instance %d: %s %s", i, pie_code_name((int)r->code), r->message);
        const Pie__V1__Distribution *x = r->distributions->dists[0];
        cr_assert_eq(x->n_token_ids, S->model->max_top_k);
        cr_assert_eq(x->token_ids[0], g[i].out[0], "instance %d: the top token differs from the "
                                                   "greedy token of the same position", i);
        for (int k = downs_before; k < S->n_down; k++)
            for (size_t j = 0; j < S->down[k]->n_results; j++)
                if (S->down[k]->results[j] == r) {
                    if (i == 0) first_down = k;
                    last_down = k;
                }
    }
    cr_assert_gt(last_down, first_down, "all %d results came in one SessionDown", N);
    sess_close(S);
    rpc_channel_destroy(ch);
    stop_ok(w);
    stop_ok(ctl);
}
