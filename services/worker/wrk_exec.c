/* wrk_exec.c — see wrk_exec.h.
 *
 * Memory: everything a step needs is reserved before its first batch runs, in arrays that grow
 * by doubling and are reused from step to step (results, item results, distributions and their
 * token/probability storage, the compacted item arrays handed to the backend), so a steady
 * load allocates nothing here beyond what protobuf unpacking did. Only failure messages of
 * single items are malloc'd (and freed once the step's results are out). */
#include "wrk_exec.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pie_check.h"
#include "pie_log.h"
#include "rpc.h"
#include "wrk_dep.h"

/* ---- growable arrays ---------------------------------------------------------------------------
 */

typedef struct wrk_buf {
    void *p;
    size_t cap; /* elements */
} wrk_buf;

/* Room for n elements of elt bytes; false when out of memory (the old contents stay). The
 * buffer exists even for n = 0: cursors are added to p, and NULL + 0 is undefined behaviour
 * (found by tests/fuzz/fuzz_wrk_exec: a first step whose next_dist items all fail). */
static bool buf_reserve(wrk_buf *b, size_t n, size_t elt) {
    if (n <= b->cap && b->p != NULL) return true;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < n) {
        if (cap > SIZE_MAX / 2 / elt) return false;
        cap *= 2;
    }
    void *p = realloc(b->p, cap * elt);
    if (p == NULL) return false;
    b->p = p;
    b->cap = cap;
    return true;
}

static void buf_free(wrk_buf *b) {
    free(b->p);
    b->p = NULL;
    b->cap = 0;
}

/* ---- the executor ------------------------------------------------------------------------------
 */

enum { WRK_KINDS = 6 }; /* slots, embed_text, forward, mask_page, copy_page, next_dist */
static const char *const wrk_kind_names[WRK_KINDS] = {"slots",     "embed_text", "forward",
                                                      "mask_page", "copy_page",  "next_dist"};

typedef struct wrk_step {
    Pie__V1__WorkerDown *down;
    uint64_t epoch;
} wrk_step;

struct wrk_exec {
    wrk_exec_opts o;
    pthread_t th;
    pthread_mutex_t mu; /* guards the queue and the flags below */
    pthread_cond_t cv;
    wrk_step *q; /* ring of q_cap; grows only when the controller exceeds its credits */
    size_t q_cap, q_head, q_len;
    bool stop, reset_pending;
    /* A thread is running a step or freeing the slots: the executor thread, or the submitting
     * thread running a step inline (wrk_exec_submit). The fields below belong to whoever set
     * it; the mutex hand-off orders their accesses. */
    bool running;

    /* the runner only (see `running`) */
    uint8_t *kv_live;  /* [kv_pages] 1 = allocated by a SlotBatch */
    uint8_t *emb_live; /* [embed_slots] */
    bool *mask_buf;    /* [kv_page_size] */
    /* per step: pointers into these stay valid until the step's results are emitted */
    wrk_buf results, result_ptrs; /* Pie__V1__BatchResult, * */
    wrk_buf items, item_ptrs;     /* Pie__V1__ItemResult, * */
    wrk_buf dists;                /* Pie__V1__Distribution */
    wrk_buf dist_ids, dist_probs; /* uint32_t, float */
    wrk_buf batch_msgs;           /* char[PIE_STATUS_MSG_MAX] per batch */
    wrk_buf owned;                /* char *: failure messages of items, freed after the step */
    size_t n_owned;
    size_t items_used, dists_used, k_used; /* cursors into items / dists / dist_ids */
    /* per batch */
    wrk_buf map;                          /* uint32_t: batch item index of each backend item */
    wrk_buf emb_slots, emb_toks, emb_pos; /* uint32_t: compacted embed_text lists */
    wrk_buf fwd;                          /* eng_forward_item */
    wrk_buf copies;                       /* eng_copy_item */
    wrk_buf dist_items;                   /* eng_dist_item */
    wrk_buf dfr;                          /* uint8_t: items deferred (deferral) */

    /* deferral: the step's footprint of deferred items, whether this step defers, how many */
    wrk_dep dep;
    bool step_defers;
    uint32_t step_deferred;
    atomic_bool defer_on; /* wrk_exec_set_defer */

    /* counters, read by any thread */
    atomic_uint_least64_t n_batches, n_items, n_forward_tokens, busy_us, n_deferred;
    atomic_uint kv_live_count;

    pie_histogram *h_exec[WRK_KINDS];
    pie_counter *c_batches, *c_batch_failures, *c_item_failures;
    pie_counter *c_deferred[WRK_KINDS]; /* by kind (slots never: index 0 unused) */
    pie_histogram *h_deferred;          /* deferred items per step, with deferral on */
};

/* One batch being run: where its result and item results go. */
typedef struct wrk_batch {
    Pie__V1__BatchResult *res;
    char *msg;                  /* [PIE_STATUS_MSG_MAX] the batch's own message */
    Pie__V1__ItemResult *items; /* [n_items], initialised OK */
    Pie__V1__ItemResult **item_ptrs;
    size_t n_items, n_bad, n_deferred;
    int kind; /* kind_index */
} wrk_batch;

static void batch_fail(wrk_exec *x, wrk_batch *b, pie_code code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void batch_fail(wrk_exec *x, wrk_batch *b, pie_code code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(b->msg, PIE_STATUS_MSG_MAX, fmt, ap);
    va_end(ap);
    b->res->code = (uint32_t)code;
    b->res->message = b->msg;
    b->res->n_items = 0;
    b->res->items = NULL;
    pie_counter_add(x->c_batch_failures, 1);
}

static void item_fail(wrk_exec *x, wrk_batch *b, size_t i, pie_code code, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static void item_fail(wrk_exec *x, wrk_batch *b, size_t i, pie_code code, const char *fmt, ...) {
    char buf[PIE_STATUS_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    char *copy = strdup(buf);
    b->items[i].code = (uint32_t)code;
    if (copy != NULL) { /* room in `owned` was reserved for every item of the step */
        ((char **)x->owned.p)[x->n_owned++] = copy;
        b->items[i].message = copy;
    } else {
        b->items[i].message = "out of memory for the message";
    }
    b->n_bad++;
    pie_counter_add(x->c_item_failures, 1);
}

/* Item i is deferred: not run, offered again by the controller (ItemResult.deferred). Its code
 * is UNAVAILABLE so that a peer ignoring `deferred` fails it rather than take it for done;
 * non-zero, it also drops out of the compacted lists the backend gets. */
static void item_defer(wrk_exec *x, wrk_batch *b, size_t i) {
    b->items[i].code = PIE_UNAVAILABLE;
    b->items[i].message = "deferred";
    b->items[i].deferred = true;
    b->n_deferred++;
    x->step_deferred++;
    pie_counter_add(x->c_deferred[b->kind], 1);
}

/* Items go out when some failed or were deferred or the kind returns data (and the batch did
 * not fail). */
static void batch_finish(wrk_batch *b, bool returns_data) {
    if (b->res->code != 0) return;
    if (b->n_bad > 0 || b->n_deferred > 0 || returns_data) {
        b->res->n_items = b->n_items;
        b->res->items = b->item_ptrs;
    }
}

/* The backend numbered the items it was given; when the worker dropped some first, name the
 * batch's item instead: "<kind>: item <j>: ..." becomes "<kind>: item <map[j]>: ...". */
static void remap_item(char *msg, const uint32_t *map, uint32_t n) {
    char *p = strstr(msg, ": item ");
    if (p == NULL) return;
    char *num = p + 7, *end;
    errno = 0;
    unsigned long j = strtoul(num, &end, 10);
    if (end == num || *end != ':' || errno != 0 || j >= n) return;
    char rest[PIE_STATUS_MSG_MAX];
    snprintf(rest, sizeof rest, "%s", end);
    size_t head = (size_t)(num - msg);
    snprintf(num, PIE_STATUS_MSG_MAX - head, "%u%s", map[j], rest);
}

/* Fails the batch with the backend's status, naming the batch's own item numbers. */
static void backend_fail(wrk_exec *x, wrk_batch *b, pie_status *st, const uint32_t *map,
                         uint32_t n) {
    if (b->n_bad > 0 || b->n_deferred > 0) remap_item(st->msg, map, n);
    batch_fail(x, b, st->code, "%s", st->msg);
}

/* Whether slot is unusable (outside a pool of n, or not live); says why in why[64]. */
static inline bool slot_bad(const uint8_t *live, uint32_t n, uint32_t slot, char *why) {
    if (slot >= n) {
        snprintf(why, 64, "is out of range [0, %u)", n);
        return true;
    }
    if (!live[slot]) {
        snprintf(why, 64, "is not allocated");
        return true;
    }
    return false;
}

/* top_k of a next_dist item after defaults, as asked. */
static uint32_t dist_k_asked(const wrk_exec *x, const Pie__V1__NextDistItem *it) {
    return it->top_k ? it->top_k : x->o.lim.default_top_k;
}

/* The k it gets: 0 when the asked k is outside [1, max_top_k] (the item fails), else at most
 * the vocabulary. */
static uint32_t dist_k(const wrk_exec *x, const Pie__V1__NextDistItem *it) {
    uint32_t k = dist_k_asked(x, it);
    if (k > x->o.lim.max_top_k) return 0;
    return k < x->o.lim.vocab_size ? k : x->o.lim.vocab_size;
}

/* Fails item i when a shared check (pie_check.h) did; returns whether it passed. */
static bool item_checked(wrk_exec *x, wrk_batch *b, size_t i, pie_code c, const pie_status *st) {
    if (c != PIE_OK) item_fail(x, b, i, st->code, "%s", st->msg);
    return c == PIE_OK;
}

/* ---- deferral (wrk_exec.h; the footprint and its rule: mem/wrk_dep.h) -------------------- */

/* Whether this step defers and something in it was deferred already: only then can an item
 * depend on a deferred one. */
static bool may_depend(const wrk_exec *x) { return x->step_defers && !wrk_dep_empty(&x->dep); }

/* One slot's access, for the kinds whose items touch one slot each way. */
static wrk_dep_access access_one(const uint32_t *kv_read, const uint32_t *kv_write,
                                 const uint32_t *emb_read, const uint32_t *emb_write) {
    return (wrk_dep_access){.kv_read = kv_read,
                            .n_kv_read = kv_read != NULL,
                            .kv_write = kv_write,
                            .n_kv_write = kv_write != NULL,
                            .emb_read = emb_read,
                            .n_emb_read = emb_read != NULL,
                            .emb_write = emb_write,
                            .n_emb_write = emb_write != NULL};
}

/* A forward item reads its pages and its inputs, writes its outputs and, when it appends, the
 * pages its inputs land in (the last ones). */
static wrk_dep_access forward_access(const eng_forward_item *it, uint32_t page_size) {
    wrk_dep_access a = {.kv_read = it->kv_pages,
                        .n_kv_read = it->n_kv_pages,
                        .emb_read = it->in_slots,
                        .n_emb_read = it->n_in,
                        .emb_write = it->out_slots,
                        .n_emb_write = it->n_out};
    if (it->append_kv && it->n_kv_pages > 0 && page_size > 0) {
        uint64_t seq = (uint64_t)(it->n_kv_pages - 1) * page_size + it->kv_last_page_len;
        uint64_t from = seq > it->n_in ? seq - it->n_in : 0;
        uint32_t first = (uint32_t)(from / page_size);
        if (first < it->n_kv_pages) {
            a.kv_write = it->kv_pages + first;
            a.n_kv_write = it->n_kv_pages - first;
        }
    }
    return a;
}

/* A call is deferred whole: spreads the flags d[0, n) over the calls of `calls` (their items
 * in order; absent, or not adding up to n: each item is a call). */
static void defer_whole_calls(uint8_t *d, size_t n, const uint32_t *calls, size_t n_calls) {
    uint64_t sum = 0;
    for (size_t c = 0; c < n_calls; c++) sum += calls[c];
    if (n_calls == 0 || sum != n) return;
    for (size_t c = 0, at = 0; c < n_calls; at += calls[c++]) {
        bool any = false;
        for (size_t k = at; k < at + calls[c]; k++) any = any || d[k];
        if (any) memset(d + at, 1, calls[c]);
    }
}

/* ---- the kinds ----------------------------------------------------------------------------- */

/* Frees first, then allocations; any bad id fails the batch and changes nothing. Every
 * allocated slot is cleared (pie.v1.SlotBatch: a new KV slot has zeroed K/V and an all-visible
 * mask, a new embedding slot a zeroed state): a reused slot never shows its previous owner's
 * data, whoever that was (another instance, or anyone before a link loss). */
static void run_slots(wrk_exec *x, wrk_batch *b, const Pie__V1__SlotBatch *s) {
    const wrk_exec_limits *lim = &x->o.lim;
    if (s->n_alloc_kv_owners != 0 && s->n_alloc_kv_owners != s->n_alloc_kv_slots) {
        batch_fail(x, b, PIE_INVALID_ARGUMENT,
                   "slots: alloc_kv_owners has %zu entries and alloc_kv_slots %zu; they must be "
                   "equal",
                   s->n_alloc_kv_owners, s->n_alloc_kv_slots);
        return;
    }
    size_t fk = 0, fe = 0, ak = 0, ae = 0;
    uint32_t v;
    for (; fk < s->n_free_kv_slots; fk++) {
        v = s->free_kv_slots[fk];
        if (v >= lim->kv_pages || !x->kv_live[v]) {
            batch_fail(x, b, PIE_INVALID_ARGUMENT, "slots: free_kv_slots[%zu] = %u %s", fk, v,
                       v >= lim->kv_pages ? "is out of range" : "is not allocated");
            goto undo;
        }
        x->kv_live[v] = 0;
    }
    for (; fe < s->n_free_embed_slots; fe++) {
        v = s->free_embed_slots[fe];
        if (v >= lim->embed_slots || !x->emb_live[v]) {
            batch_fail(x, b, PIE_INVALID_ARGUMENT, "slots: free_embed_slots[%zu] = %u %s", fe, v,
                       v >= lim->embed_slots ? "is out of range" : "is not allocated");
            goto undo;
        }
        x->emb_live[v] = 0;
    }
    for (; ak < s->n_alloc_kv_slots; ak++) {
        v = s->alloc_kv_slots[ak];
        if (v >= lim->kv_pages || x->kv_live[v]) {
            batch_fail(x, b, PIE_INVALID_ARGUMENT, "slots: alloc_kv_slots[%zu] = %u %s", ak, v,
                       v >= lim->kv_pages ? "is out of range" : "is already allocated");
            goto undo;
        }
        x->kv_live[v] = 1;
    }
    for (; ae < s->n_alloc_embed_slots; ae++) {
        v = s->alloc_embed_slots[ae];
        if (v >= lim->embed_slots || x->emb_live[v]) {
            batch_fail(x, b, PIE_INVALID_ARGUMENT, "slots: alloc_embed_slots[%zu] = %u %s", ae, v,
                       v >= lim->embed_slots ? "is out of range" : "is already allocated");
            goto undo;
        }
        x->emb_live[v] = 1;
    }
    pie_status st;
    /* first: a page freed and allocated again in this batch ends cleared */
    if (fk > 0 && x->o.backend.pages_freed)
        x->o.backend.pages_freed(x->o.backend.ctx, s->free_kv_slots, (uint32_t)fk);
    if (x->o.backend.clear_pages(x->o.backend.ctx, s->alloc_kv_slots, (uint32_t)ak, &st) !=
            PIE_OK ||
        x->o.backend.clear_embeds(x->o.backend.ctx, s->alloc_embed_slots, (uint32_t)ae, &st) !=
            PIE_OK) {
        batch_fail(x, b, PIE_INTERNAL, "slots: clearing the allocated slots: %s", st.msg);
        /* Fail closed: the frees stay applied and the allocations are undone, so no later
         * batch can read what the slots held. */
        atomic_fetch_sub(&x->kv_live_count, (unsigned)fk);
        fk = fe = 0;
        goto undo;
    }
    if (ak >= fk)
        atomic_fetch_add(&x->kv_live_count, (unsigned)(ak - fk));
    else
        atomic_fetch_sub(&x->kv_live_count, (unsigned)(fk - ak));
    atomic_fetch_add(&x->n_items, s->n_alloc_kv_slots + s->n_free_kv_slots +
                                      s->n_alloc_embed_slots + s->n_free_embed_slots);
    if (ak > 0 && x->o.after_slots) x->o.after_slots(x->o.mem_user, atomic_load(&x->kv_live_count));
    return;
undo: /* reverse order, so a slot freed and reallocated in this batch ends as it began */
    while (ae > 0) x->emb_live[s->alloc_embed_slots[--ae]] = 0;
    while (ak > 0) x->kv_live[s->alloc_kv_slots[--ak]] = 0;
    while (fe > 0) x->emb_live[s->free_embed_slots[--fe]] = 1;
    while (fk > 0) x->kv_live[s->free_kv_slots[--fk]] = 1;
}

static void run_embed_text(wrk_exec *x, wrk_batch *b, const Pie__V1__EmbedTextBatch *e) {
    const wrk_exec_limits *lim = &x->o.lim;
    size_t n = e->n_embed_slots;
    if (e->n_token_ids != n || e->n_positions != n) {
        batch_fail(x, b, PIE_INVALID_ARGUMENT,
                   "embed_text: embed_slots, token_ids and positions have %zu, %zu and %zu "
                   "entries; they must be equal",
                   n, e->n_token_ids, e->n_positions);
        return;
    }
    char why[64];
    pie_status st;
    for (size_t i = 0; i < n; i++) {
        const pie_check_at at = PIE_AT_ITEM("embed_text", i);
        if (slot_bad(x->emb_live, lim->embed_slots, e->embed_slots[i], why)) {
            item_fail(x, b, i, PIE_INVALID_ARGUMENT, "embed_text: item %zu: embed slot %u %s", i,
                      e->embed_slots[i], why);
            continue;
        }
        pie_code c = pie_check_lt(at, "token", e->token_ids[i], lim->vocab_size, &st);
        if (c == PIE_OK)
            c = pie_check_lt(at, "position", e->positions[i], lim->max_context_tokens, &st);
        item_checked(x, b, i, c, &st);
    }
    if (may_depend(x)) { /* writing a slot a deferred item reads or writes: its call waits */
        uint8_t *d = x->dfr.p;
        for (size_t i = 0; i < n; i++) {
            wrk_dep_access a = access_one(NULL, NULL, NULL, &e->embed_slots[i]);
            d[i] = wrk_dep_hits(&x->dep, &a);
        }
        defer_whole_calls(d, n, e->call_items, e->n_call_items);
        for (size_t i = 0; i < n; i++) {
            if (!d[i] || b->items[i].code != 0) continue;
            wrk_dep_access a = access_one(NULL, NULL, NULL, &e->embed_slots[i]);
            wrk_dep_add(&x->dep, &a);
            item_defer(x, b, i);
        }
    }
    const uint32_t *slots = e->embed_slots, *toks = e->token_ids, *pos = e->positions;
    uint32_t m = (uint32_t)n, *map = x->map.p;
    if (b->n_bad > 0 || b->n_deferred > 0) { /* compact the good entries (room: run_batch) */
        uint32_t *cs = x->emb_slots.p, *ct = x->emb_toks.p, *cp = x->emb_pos.p;
        m = 0;
        for (size_t i = 0; i < n; i++) {
            if (b->items[i].code != 0) continue;
            cs[m] = e->embed_slots[i];
            ct[m] = e->token_ids[i];
            cp[m] = e->positions[i];
            map[m++] = (uint32_t)i;
        }
        slots = cs, toks = ct, pos = cp;
    }
    if (m > 0 && x->o.backend.embed_text(x->o.backend.ctx, slots, toks, pos, m, &st) != PIE_OK) {
        backend_fail(x, b, &st, map, m);
        return;
    }
    atomic_fetch_add(&x->n_items, n - b->n_deferred);
    batch_finish(b, false);
}

/* Checks one forward item's counts and slots; false (and the item failed) when bad. */
static bool forward_item_ok(wrk_exec *x, wrk_batch *b, size_t i, const Pie__V1__ForwardItem *it) {
    const wrk_exec_limits *lim = &x->o.lim;
    char why[64];
    const pie_check_fwd f = {.in = "input_embed_slots",
                             .out = "output_embed_slots",
                             .pages = "kv_slots",
                             .last = "kv_last_page_len",
                             .n_in = it->n_input_embed_slots,
                             .n_out = it->n_output_embed_slots,
                             .n_pages = it->n_kv_slots,
                             .last_len = it->kv_last_page_len};
    pie_status st; /* inputs per batch: bounded by the engine (max_batch_tokens) */
    if (!item_checked(
            x, b, i,
            pie_check_forward(PIE_AT_ITEM("forward", i), &f, lim->kv_page_size, UINT64_MAX, &st),
            &st))
        return false;
    for (size_t j = 0; j < it->n_kv_slots; j++)
        if (slot_bad(x->kv_live, lim->kv_pages, it->kv_slots[j], why)) {
            item_fail(x, b, i, PIE_INVALID_ARGUMENT, "forward: item %zu: kv_slots[%zu] = %u %s", i,
                      j, it->kv_slots[j], why);
            return false;
        }
    for (size_t j = 0; j < it->n_input_embed_slots; j++)
        if (slot_bad(x->emb_live, lim->embed_slots, it->input_embed_slots[j], why)) {
            item_fail(x, b, i, PIE_INVALID_ARGUMENT,
                      "forward: item %zu: input_embed_slots[%zu] = %u %s", i, j,
                      it->input_embed_slots[j], why);
            return false;
        }
    for (size_t j = 0; j < it->n_output_embed_slots; j++)
        if (slot_bad(x->emb_live, lim->embed_slots, it->output_embed_slots[j], why)) {
            item_fail(x, b, i, PIE_INVALID_ARGUMENT,
                      "forward: item %zu: output_embed_slots[%zu] = %u %s", i, j,
                      it->output_embed_slots[j], why);
            return false;
        }
    return true;
}

static void run_forward(wrk_exec *x, wrk_batch *b, const Pie__V1__ForwardBatch *f) {
    /* A present mask with no runs is passed on as such (the engine refuses it) rather than
     * read as "absent = causal". */
    static const uint32_t no_runs[1] = {0};
    eng_forward_item *items = x->fwd.p;
    uint32_t *map = x->map.p, m = 0;
    uint64_t tokens = 0;
    for (size_t i = 0; i < f->n_items; i++) {
        const Pie__V1__ForwardItem *it = f->items[i];
        if (!forward_item_ok(x, b, i, it)) continue;
        const Pie__V1__AttentionMask *mask = it->mask;
        items[m] = (eng_forward_item){
            .kv_pages = it->kv_slots,
            .n_kv_pages = (uint32_t)it->n_kv_slots,
            .kv_last_page_len = it->kv_last_page_len,
            .append_kv = it->append_kv != 0,
            .in_slots = it->input_embed_slots,
            .n_in = (uint32_t)it->n_input_embed_slots,
            .out_slots = it->output_embed_slots,
            .n_out = (uint32_t)it->n_output_embed_slots,
            .mask_runs = mask == NULL   ? NULL
                         : mask->n_runs ? mask->runs
                                        : no_runs,
            .n_mask_runs = mask == NULL ? 0 : (uint32_t)mask->n_runs,
        };
        tokens += it->n_input_embed_slots;
        map[m++] = (uint32_t)i;
    }
    pie_status st;
    int64_t t0 = rpc_now_ns();
    uint32_t kept = m;
    if (x->step_defers && m > 0) {
        uint8_t *d = x->dfr.p;
        if (x->o.backend.forward_plan(x->o.backend.ctx, items, m, d, &st) != PIE_OK) {
            backend_fail(x, b, &st, map, m);
            return;
        }
        kept = 0;
        for (uint32_t k = 0; k < m; k++) { /* what the scheduler deferred, and its dependents */
            wrk_dep_access a = forward_access(&items[k], x->o.lim.kv_page_size);
            if (d[k] || wrk_dep_hits(&x->dep, &a)) {
                d[k] = 1;
                wrk_dep_add(&x->dep, &a);
                item_defer(x, b, map[k]);
                tokens -= items[k].n_in;
                continue;
            }
            map[kept++] = map[k]; /* the batch items of what runs, for error messages */
        }
        if (x->o.backend.forward_skip(x->o.backend.ctx, items, m, d, &st) != PIE_OK) {
            backend_fail(x, b, &st, map, kept);
            return;
        }
    } else if (m > 0 && x->o.backend.forward(x->o.backend.ctx, items, m, &st) != PIE_OK) {
        backend_fail(x, b, &st, map, m);
        return;
    }
    if (kept > 0 && x->o.after_forward)
        x->o.after_forward(x->o.mem_user, tokens, (uint64_t)(rpc_now_ns() - t0),
                           atomic_load(&x->kv_live_count));
    atomic_fetch_add(&x->n_items, f->n_items - b->n_deferred);
    atomic_fetch_add(&x->n_forward_tokens, tokens);
    batch_finish(b, false);
}

/* One backend call per page, so a failure belongs to its item. */
static void run_mask_page(wrk_exec *x, wrk_batch *b, const Pie__V1__MaskPageBatch *mb) {
    const wrk_exec_limits *lim = &x->o.lim;
    char why[64];
    for (size_t i = 0; i < mb->n_items; i++) {
        const Pie__V1__MaskPageItem *it = mb->items[i];
        if (slot_bad(x->kv_live, lim->kv_pages, it->kv_slot, why)) {
            item_fail(x, b, i, PIE_INVALID_ARGUMENT, "mask_page: item %zu: kv slot %u %s", i,
                      it->kv_slot, why);
            continue;
        }
        pie_status st;
        if (!item_checked(x, b, i,
                          pie_check_page_len(PIE_AT_ITEM("mask_page", i), "masked", it->n_masked,
                                             lim->kv_page_size, &st),
                          &st))
            continue;
        wrk_dep_access a = access_one(NULL, &it->kv_slot, NULL, NULL);
        if (may_depend(x) && wrk_dep_hits(&x->dep, &a)) { /* masks a page a deferred item uses */
            wrk_dep_add(&x->dep, &a);
            item_defer(x, b, i);
            continue;
        }
        for (uint32_t j = 0; j < lim->kv_page_size; j++) x->mask_buf[j] = it->masked[j] != 0;
        if (x->o.backend.mask_page(x->o.backend.ctx, it->kv_slot, x->mask_buf, &st) != PIE_OK)
            item_fail(x, b, i, st.code, "mask_page: item %zu: %s", i, st.msg);
    }
    atomic_fetch_add(&x->n_items, mb->n_items - b->n_deferred);
    batch_finish(b, false);
}

static void run_copy_page(wrk_exec *x, wrk_batch *b, const Pie__V1__CopyPageBatch *cb) {
    const wrk_exec_limits *lim = &x->o.lim;
    eng_copy_item *copies = x->copies.p;
    uint32_t *map = x->map.p, m = 0;
    char why[64];
    pie_status st;
    for (size_t i = 0; i < cb->n_items; i++) {
        const Pie__V1__CopyPageItem *it = cb->items[i];
        if (slot_bad(x->kv_live, lim->kv_pages, it->src_kv_slot, why))
            item_fail(x, b, i, PIE_INVALID_ARGUMENT, "copy_page: item %zu: src_kv_slot %u %s", i,
                      it->src_kv_slot, why);
        else if (slot_bad(x->kv_live, lim->kv_pages, it->dst_kv_slot, why))
            item_fail(x, b, i, PIE_INVALID_ARGUMENT, "copy_page: item %zu: dst_kv_slot %u %s", i,
                      it->dst_kv_slot, why);
        else if (item_checked(x, b, i,
                              pie_check_copy(PIE_AT_ITEM("copy_page", i), it->src_kv_slot,
                                             it->dst_kv_slot, it->src_offset, it->dst_offset,
                                             it->token_count, lim->kv_page_size, &st),
                              &st)) {
            wrk_dep_access a = access_one(&it->src_kv_slot, &it->dst_kv_slot, NULL, NULL);
            if (may_depend(x) && wrk_dep_hits(&x->dep, &a)) {
                wrk_dep_add(&x->dep, &a);
                item_defer(x, b, i);
                continue;
            }
            copies[m] = (eng_copy_item){.src = it->src_kv_slot,
                                        .dst = it->dst_kv_slot,
                                        .src_off = it->src_offset,
                                        .dst_off = it->dst_offset,
                                        .count = it->token_count};
            map[m++] = (uint32_t)i;
        }
    }
    if (m > 0 && x->o.backend.copy_pages(x->o.backend.ctx, copies, m, &st) != PIE_OK) {
        backend_fail(x, b, &st, map, m);
        return;
    }
    atomic_fetch_add(&x->n_items, cb->n_items - b->n_deferred);
    batch_finish(b, false);
}

static void run_next_dist(wrk_exec *x, wrk_batch *b, const Pie__V1__NextDistBatch *nb) {
    const wrk_exec_limits *lim = &x->o.lim;
    eng_dist_item *items = x->dist_items.p;
    uint32_t *map = x->map.p, m = 0;
    uint32_t *ids = (uint32_t *)x->dist_ids.p + x->k_used;
    float *probs = (float *)x->dist_probs.p + x->k_used;
    size_t k_used = 0;
    char why[64];
    pie_status st;
    uint8_t *dfr = x->dfr.p;
    bool depend = may_depend(x);
    if (depend) { /* reading a slot a deferred item writes: its call waits */
        for (size_t i = 0; i < nb->n_items; i++) {
            wrk_dep_access a = access_one(NULL, NULL, &nb->items[i]->embed_slot, NULL);
            dfr[i] = wrk_dep_hits(&x->dep, &a);
        }
        defer_whole_calls(dfr, nb->n_items, nb->call_items, nb->n_call_items);
    }
    for (size_t i = 0; i < nb->n_items; i++) {
        const Pie__V1__NextDistItem *it = nb->items[i];
        const pie_check_at at = PIE_AT_ITEM("next_dist", i);
        uint32_t k = dist_k(x, it);
        float t = it->temperature == 0.0f ? 1.0f : it->temperature;
        if (slot_bad(x->emb_live, lim->embed_slots, it->embed_slot, why)) {
            item_fail(x, b, i, PIE_INVALID_ARGUMENT, "next_dist: item %zu: embed slot %u %s", i,
                      it->embed_slot, why);
            continue;
        }
        if (depend && dfr[i]) {
            wrk_dep_access a = access_one(NULL, NULL, &it->embed_slot, NULL);
            wrk_dep_add(&x->dep, &a);
            item_defer(x, b, i);
            continue;
        }
        pie_code c = pie_check_range(at, "top_k", dist_k_asked(x, it), 1, lim->max_top_k, &st);
        if (c == PIE_OK) c = pie_check_temperature(at, t, false, &st);
        if (item_checked(x, b, i, c, &st)) {
            items[m] = (eng_dist_item){.slot = it->embed_slot,
                                       .top_k = k,
                                       .temperature = t,
                                       .ids = ids + k_used,
                                       .probs = probs + k_used};
            k_used += k;
            map[m++] = (uint32_t)i;
        }
    }
    if (m > 0 && x->o.backend.next_dist(x->o.backend.ctx, items, m, &st) != PIE_OK) {
        backend_fail(x, b, &st, map, m);
        return;
    }
    Pie__V1__Distribution *dists = (Pie__V1__Distribution *)x->dists.p + x->dists_used;
    for (uint32_t j = 0; j < m; j++) {
        Pie__V1__Distribution *d = &dists[j];
        pie__v1__distribution__init(d);
        d->n_token_ids = d->n_probs = items[j].top_k;
        d->token_ids = items[j].ids;
        d->probs = items[j].probs;
        b->items[map[j]].distribution = d;
    }
    x->dists_used += m;
    x->k_used += k_used;
    atomic_fetch_add(&x->n_items, nb->n_items - b->n_deferred);
    batch_finish(b, true);
}

/* ---- steps ----------------------------------------------------------------------------------- */

/* Items of a batch as ItemResults count them (0 for kinds without items). */
static size_t batch_items(const Pie__V1__Batch *b) {
    switch (b->kind_case) {
    case PIE__V1__BATCH__KIND_EMBED_TEXT: return b->embed_text->n_embed_slots;
    case PIE__V1__BATCH__KIND_FORWARD: return b->forward->n_items;
    case PIE__V1__BATCH__KIND_MASK_PAGE: return b->mask_page->n_items;
    case PIE__V1__BATCH__KIND_COPY_PAGE: return b->copy_page->n_items;
    case PIE__V1__BATCH__KIND_NEXT_DIST: return b->next_dist->n_items;
    default: return 0;
    }
}

/* Reserves everything the step's results need, and the largest batch's scratch. */
static bool reserve_step(wrk_exec *x, const Pie__V1__WorkerDown *down) {
    size_t nb = down->n_batches, n_items = 0, n_dists = 0, n_k = 0, widest = 0;
    for (size_t i = 0; i < nb; i++) {
        const Pie__V1__Batch *b = down->batches[i];
        size_t n = batch_items(b);
        n_items += n;
        if (n > widest) widest = n;
        if (b->kind_case == PIE__V1__BATCH__KIND_NEXT_DIST) {
            n_dists += n;
            for (size_t j = 0; j < n; j++) n_k += dist_k(x, b->next_dist->items[j]);
        }
    }
    return buf_reserve(&x->results, nb, sizeof(Pie__V1__BatchResult)) &&
           buf_reserve(&x->result_ptrs, nb, sizeof(Pie__V1__BatchResult *)) &&
           buf_reserve(&x->batch_msgs, nb, PIE_STATUS_MSG_MAX) &&
           buf_reserve(&x->items, n_items, sizeof(Pie__V1__ItemResult)) &&
           buf_reserve(&x->item_ptrs, n_items, sizeof(Pie__V1__ItemResult *)) &&
           buf_reserve(&x->owned, n_items, sizeof(char *)) &&
           buf_reserve(&x->dists, n_dists, sizeof(Pie__V1__Distribution)) &&
           buf_reserve(&x->dist_ids, n_k, sizeof(uint32_t)) &&
           buf_reserve(&x->dist_probs, n_k, sizeof(float)) &&
           buf_reserve(&x->map, widest, sizeof(uint32_t)) &&
           buf_reserve(&x->emb_slots, widest, sizeof(uint32_t)) &&
           buf_reserve(&x->emb_toks, widest, sizeof(uint32_t)) &&
           buf_reserve(&x->emb_pos, widest, sizeof(uint32_t)) &&
           buf_reserve(&x->fwd, widest, sizeof(eng_forward_item)) &&
           buf_reserve(&x->copies, widest, sizeof(eng_copy_item)) &&
           buf_reserve(&x->dist_items, widest, sizeof(eng_dist_item)) &&
           buf_reserve(&x->dfr, widest, 1);
}

static int kind_index(Pie__V1__Batch__KindCase k) {
    switch (k) {
    case PIE__V1__BATCH__KIND_SLOTS: return 0;
    case PIE__V1__BATCH__KIND_EMBED_TEXT: return 1;
    case PIE__V1__BATCH__KIND_FORWARD: return 2;
    case PIE__V1__BATCH__KIND_MASK_PAGE: return 3;
    case PIE__V1__BATCH__KIND_COPY_PAGE: return 4;
    case PIE__V1__BATCH__KIND_NEXT_DIST: return 5;
    default: return -1;
    }
}

/* Runs batch i of the step into results[i]. */
static void run_batch(wrk_exec *x, const Pie__V1__Batch *batch, size_t i) {
    Pie__V1__BatchResult *res = (Pie__V1__BatchResult *)x->results.p + i;
    pie__v1__batch_result__init(res);
    res->batch_id = batch->batch_id;
    wrk_batch b = {
        .res = res,
        .msg = (char *)x->batch_msgs.p + i * PIE_STATUS_MSG_MAX,
        .items = (Pie__V1__ItemResult *)x->items.p + x->items_used,
        .item_ptrs = (Pie__V1__ItemResult **)x->item_ptrs.p + x->items_used,
        .n_items = batch_items(batch),
    };
    for (size_t j = 0; j < b.n_items; j++) {
        pie__v1__item_result__init(&b.items[j]);
        b.item_ptrs[j] = &b.items[j];
    }
    x->items_used += b.n_items;
    int64_t t0 = rpc_now_ns();
    int kind = kind_index(batch->kind_case);
    b.kind = kind > 0 ? kind : 0;
    switch (batch->kind_case) {
    case PIE__V1__BATCH__KIND_SLOTS: run_slots(x, &b, batch->slots); break;
    case PIE__V1__BATCH__KIND_EMBED_TEXT: run_embed_text(x, &b, batch->embed_text); break;
    case PIE__V1__BATCH__KIND_FORWARD: run_forward(x, &b, batch->forward); break;
    case PIE__V1__BATCH__KIND_MASK_PAGE: run_mask_page(x, &b, batch->mask_page); break;
    case PIE__V1__BATCH__KIND_COPY_PAGE: run_copy_page(x, &b, batch->copy_page); break;
    case PIE__V1__BATCH__KIND_NEXT_DIST: run_next_dist(x, &b, batch->next_dist); break;
    default:
        batch_fail(x, &b, PIE_UNIMPLEMENTED,
                   "batch %llu: no kind this worker knows (slots, embed_text, forward, "
                   "mask_page, copy_page, next_dist)",
                   (unsigned long long)batch->batch_id);
    }
    int64_t dt_ns = rpc_now_ns() - t0;
    res->exec_us = (uint64_t)(dt_ns / 1000);
    atomic_fetch_add(&x->n_batches, 1);
    atomic_fetch_add(&x->busy_us, res->exec_us);
    pie_counter_add(x->c_batches, 1);
    if (kind >= 0) pie_histogram_observe(x->h_exec[kind], (double)dt_ns * 1e-9);
}

/* Out of memory for a step's results: every batch fails alone, in order; the last message
 * carries the credit. */
static void fail_step(wrk_exec *x, const wrk_step *s) {
    size_t nb = s->down->n_batches;
    pie_log_error("wrk.exec.oom", "batches=%zu", nb);
    for (size_t i = 0; i < nb; i++) {
        Pie__V1__BatchResult res = PIE__V1__BATCH_RESULT__INIT, *ptr = &res;
        res.batch_id = s->down->batches[i]->batch_id;
        res.code = PIE_RESOURCE_EXHAUSTED;
        res.message = "worker: out of memory for the results of this step";
        Pie__V1__WorkerUp up = PIE__V1__WORKER_UP__INIT;
        up.n_results = 1;
        up.results = &ptr;
        up.credits = i + 1 == nb ? 1 : 0;
        x->o.emit(x->o.user, s->epoch, &up);
    }
}

/* A tensor-parallel hook said the group failed: the process leaves (wrk_exec_group.failed
 * does not return). */
static void group_check(wrk_exec *x, pie_code rc, const pie_status *st) {
    if (rc != PIE_OK) x->o.group.failed(x->o.group.g, st);
}

static void run_step(wrk_exec *x, wrk_step *s) {
    Pie__V1__WorkerDown *down = s->down;
    size_t nb = down->n_batches;
    pie_status gst;
    if (nb > 0 && x->o.group.step) group_check(x, x->o.group.step(x->o.group.g, down, &gst), &gst);
    if (nb > 0 && !reserve_step(x, down)) {
        /* In a tensor-parallel group a rank that skips a step's engine calls would pair its
         * next collectives with the others' wrong ones: the group fails instead. */
        if (x->o.group.failed) {
            pie_status_set(&gst, PIE_RESOURCE_EXHAUSTED,
                           "out of memory for the results of a step of %zu batches", nb);
            x->o.group.failed(x->o.group.g, &gst);
        }
        fail_step(x, s);
    } else if (nb > 0) {
        x->items_used = x->dists_used = x->k_used = 0;
        /* one mode for the whole step: the controller agreed before it sent it, or not */
        x->step_defers = x->o.may_defer && atomic_load(&x->defer_on);
        x->step_deferred = 0;
        if (x->step_defers) wrk_dep_clear(&x->dep);
        Pie__V1__BatchResult **ptrs = x->result_ptrs.p;
        for (size_t i = 0; i < nb; i++) {
            run_batch(x, down->batches[i], i);
            ptrs[i] = (Pie__V1__BatchResult *)x->results.p + i;
        }
        if (x->step_defers) {
            atomic_fetch_add(&x->n_deferred, x->step_deferred);
            pie_histogram_observe(x->h_deferred, x->step_deferred);
        }
        if (x->o.group.check) group_check(x, x->o.group.check(x->o.group.g, &gst), &gst);
        Pie__V1__WorkerUp up = PIE__V1__WORKER_UP__INIT;
        up.n_results = nb;
        up.results = ptrs;
        up.credits = 1;
        x->o.emit(x->o.user, s->epoch, &up);
        for (size_t i = 0; i < x->n_owned; i++) free(((char **)x->owned.p)[i]);
        x->n_owned = 0;
    }
    if (down->drain && x->o.drain) x->o.drain(x->o.user, s->epoch, down->drain);
    rpc_msg_free(&down->base);
}

static void free_all_slots(wrk_exec *x) {
    pie_status gst;
    if (x->o.group.reset) group_check(x, x->o.group.reset(x->o.group.g, &gst), &gst);
    memset(x->kv_live, 0, x->o.lim.kv_pages);
    memset(x->emb_live, 0, x->o.lim.embed_slots);
    atomic_store(&x->kv_live_count, 0);
}

static void *exec_main(void *arg) {
    wrk_exec *x = arg;
    (void)pthread_setname_np(pthread_self(), "wrk-exec"); /* cosmetic */
    pthread_mutex_lock(&x->mu);
    for (;;) {
        while (!x->stop && (x->running || (!x->reset_pending && x->q_len == 0)))
            pthread_cond_wait(&x->cv, &x->mu);
        if (x->stop) break;
        x->running = true;
        if (x->reset_pending) {
            x->reset_pending = false;
            pthread_mutex_unlock(&x->mu);
            free_all_slots(x);
        } else {
            wrk_step s = x->q[x->q_head];
            x->q_head = (x->q_head + 1) % x->q_cap;
            x->q_len--;
            pthread_mutex_unlock(&x->mu);
            run_step(x, &s);
        }
        pthread_mutex_lock(&x->mu);
        x->running = false;
        pthread_cond_broadcast(&x->cv); /* a stop waiting for the step */
    }
    pthread_mutex_unlock(&x->mu);
    return NULL;
}

/* Frees every queued step. Caller holds mu. */
static void drop_queue(wrk_exec *x) {
    for (; x->q_len > 0; x->q_len--) {
        rpc_msg_free(&x->q[x->q_head].down->base);
        x->q_head = (x->q_head + 1) % x->q_cap;
    }
    x->q_head = 0;
}

/* ---- public ------------------------------------------------------------------------------------
 */

static void exec_free(wrk_exec *x) {
    free(x->q);
    free(x->kv_live);
    free(x->emb_live);
    free(x->mask_buf);
    wrk_buf *bufs[] = {&x->results, &x->result_ptrs, &x->items,      &x->item_ptrs,
                       &x->dists,   &x->dist_ids,    &x->dist_probs, &x->batch_msgs,
                       &x->owned,   &x->map,         &x->emb_slots,  &x->emb_toks,
                       &x->emb_pos, &x->fwd,         &x->copies,     &x->dist_items};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) buf_free(bufs[i]);
    buf_free(&x->dfr);
    wrk_dep_free(&x->dep);
    free(x);
}

wrk_exec *wrk_exec_start(const wrk_exec_opts *opts, pie_status *st) {
    wrk_exec *x = calloc(1, sizeof *x);
    if (x == NULL) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "executor: out of memory");
        return NULL;
    }
    x->o = *opts;
    const wrk_exec_limits *lim = &x->o.lim;
    x->q_cap = 8;
    x->q = calloc(x->q_cap, sizeof *x->q);
    x->kv_live = calloc(lim->kv_pages ? lim->kv_pages : 1, 1);
    x->emb_live = calloc(lim->embed_slots ? lim->embed_slots : 1, 1);
    x->mask_buf = calloc(lim->kv_page_size ? lim->kv_page_size : 1, sizeof(bool));
    if (!x->q || !x->kv_live || !x->emb_live || !x->mask_buf) {
        exec_free(x);
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                       "executor: out of memory for %u kv and %u embedding slot flags",
                       lim->kv_pages, lim->embed_slots);
        return NULL;
    }
    if (opts->may_defer) {
        if (!opts->backend.forward_plan || !opts->backend.forward_skip) {
            exec_free(x);
            pie_status_set(st, PIE_INVALID_ARGUMENT,
                           "executor: deferral needs a backend that plans forwards (%s does not)",
                           opts->backend.name ? opts->backend.name : "this one");
            return NULL;
        }
        if (wrk_dep_init(&x->dep, lim->kv_pages, lim->embed_slots, st) != PIE_OK) {
            exec_free(x);
            return NULL;
        }
    }
    pie_metrics *m = opts->metrics;
    if (m != NULL) {
        double bounds[16];
        pie_metrics_exponential_bounds(1e-5, 2.5, 16, bounds);
        for (int k = 0; k < WRK_KINDS; k++) {
            pie_metric_label l = {"kind", wrk_kind_names[k]};
            x->h_exec[k] = pie_metrics_histogram(m, "pie_worker_batch_seconds",
                                                 "Execution time of one batch, by kind.", bounds,
                                                 16, &l, 1, st);
        }
        x->c_batches = pie_metrics_counter(m, "pie_worker_batches_total",
                                           "Batches executed (all kinds).", NULL, 0, st);
        x->c_batch_failures = pie_metrics_counter(m, "pie_worker_batch_failures_total",
                                                  "Batches that failed as a whole.", NULL, 0, st);
        x->c_item_failures = pie_metrics_counter(m, "pie_worker_item_failures_total",
                                                 "Items that failed alone.", NULL, 0, st);
        for (int k = 1; k < WRK_KINDS; k++) { /* a slot batch is never deferred */
            pie_metric_label l = {"kind", wrk_kind_names[k]};
            x->c_deferred[k] = pie_metrics_counter(
                m, "pie_worker_deferred_items_total",
                "Items answered deferred (not run; the controller offers them again): forward "
                "items offload's scheduler deferred and the items depending on them.",
                &l, 1, st);
        }
        double dbounds[12];
        pie_metrics_exponential_bounds(1, 2, 12, dbounds); /* 1 .. 2048 items */
        x->h_deferred = pie_metrics_histogram(m, "pie_worker_deferred_items_per_step",
                                              "Items deferred per step, steps run with deferral "
                                              "on.",
                                              dbounds, 12, NULL, 0, st);
    }
    if (pthread_mutex_init(&x->mu, NULL) != 0) {
        exec_free(x);
        pie_status_set(st, PIE_INTERNAL, "executor: pthread_mutex_init failed");
        return NULL;
    }
    if (pthread_cond_init(&x->cv, NULL) != 0) {
        pthread_mutex_destroy(&x->mu);
        exec_free(x);
        pie_status_set(st, PIE_INTERNAL, "executor: pthread_cond_init failed");
        return NULL;
    }
    int rc = pthread_create(&x->th, NULL, exec_main, x);
    if (rc != 0) {
        pthread_cond_destroy(&x->cv);
        pthread_mutex_destroy(&x->mu);
        exec_free(x);
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "executor: pthread_create: %s", strerror(rc));
        return NULL;
    }
    return x;
}

void wrk_exec_submit(wrk_exec *x, Pie__V1__WorkerDown *down, uint64_t epoch) {
    pthread_mutex_lock(&x->mu);
    if (x->stop) {
        pthread_mutex_unlock(&x->mu);
        rpc_msg_free(&down->base);
        return;
    }
    if (!x->running && !x->reset_pending && x->q_len == 0) {
        /* The executor is idle: run the step on this (the link's) thread. Handing it over
         * would cost a wake-up of the executor thread per step (tens of µs on a loaded 2-core
         * machine), on the critical path of every decode step. Order is kept: the link thread
         * is the only submitter, and the next step cannot arrive while it runs this one. */
        x->running = true;
        pthread_mutex_unlock(&x->mu);
        wrk_step s = {down, epoch};
        run_step(x, &s);
        pthread_mutex_lock(&x->mu);
        x->running = false;
        /* Wake the executor only when it has work (a reset came in meanwhile) or a stop waits:
         * an unconditional broadcast woke the idle executor thread once per decode step for
         * nothing (a futex wake and a context switch on the step's critical path). */
        if (x->reset_pending || x->q_len > 0 || x->stop) pthread_cond_broadcast(&x->cv);
        pthread_mutex_unlock(&x->mu);
        return;
    }
    if (x->q_len == x->q_cap) { /* only when the controller sends beyond its credits */
        size_t cap = x->q_cap * 2;
        wrk_step *q = calloc(cap, sizeof *q);
        if (q == NULL) {
            pthread_mutex_unlock(&x->mu);
            pie_log_error("wrk.exec.queue_full", "dropped a step of %zu batches: out of memory",
                          down->n_batches);
            rpc_msg_free(&down->base);
            return;
        }
        for (size_t i = 0; i < x->q_len; i++) q[i] = x->q[(x->q_head + i) % x->q_cap];
        free(x->q);
        x->q = q;
        x->q_cap = cap;
        x->q_head = 0;
    }
    x->q[(x->q_head + x->q_len) % x->q_cap] = (wrk_step){down, epoch};
    x->q_len++;
    pthread_cond_signal(&x->cv);
    pthread_mutex_unlock(&x->mu);
}

void wrk_exec_reset(wrk_exec *x) {
    pthread_mutex_lock(&x->mu);
    drop_queue(x);
    x->reset_pending = true;
    pthread_cond_signal(&x->cv);
    pthread_mutex_unlock(&x->mu);
}

void wrk_exec_reset_now(wrk_exec *x) {
    pthread_mutex_lock(&x->mu);
    x->running = true; /* the slots are ours until they are free */
    pthread_mutex_unlock(&x->mu);
    free_all_slots(x);
    pthread_mutex_lock(&x->mu);
    x->running = false;
    pthread_cond_broadcast(&x->cv);
    pthread_mutex_unlock(&x->mu);
}

void wrk_exec_stats(wrk_exec *x, Pie__V1__WorkerStats *out) {
    out->batches = atomic_load(&x->n_batches);
    out->items = atomic_load(&x->n_items);
    out->forward_tokens = atomic_load(&x->n_forward_tokens);
    out->busy_us = atomic_load(&x->busy_us);
    out->kv_pages_on_device = atomic_load(&x->kv_live_count);
    out->deferred_items = atomic_load(&x->n_deferred);
    out->kv_pages_on_host = 0;
}

void wrk_exec_set_defer(wrk_exec *x, bool on) { atomic_store(&x->defer_on, on && x->o.may_defer); }

bool wrk_exec_defers(wrk_exec *x) { return atomic_load(&x->defer_on); }

void wrk_exec_stop(wrk_exec *x) {
    if (x == NULL) return;
    pthread_mutex_lock(&x->mu);
    x->stop = true;
    drop_queue(x);
    pthread_cond_broadcast(&x->cv);
    while (x->running) pthread_cond_wait(&x->cv, &x->mu); /* a step run inline by a submitter */
    pthread_mutex_unlock(&x->mu);
    int rc = pthread_join(x->th, NULL);
    if (rc != 0) pie_log_error("wrk.exec.stop", "pthread_join: %s", strerror(rc));
    pthread_cond_destroy(&x->cv);
    pthread_mutex_destroy(&x->mu);
    exec_free(x);
}
