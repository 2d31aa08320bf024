/* test_wrk_kvslots.c — the device page table of offload on the cuda backend (issue 13,
 * mem/wrk_kvslots.h) over a fake device: one value per page stands for its KV, the "device" is
 * an array of slots and the home an array of pages, so every rule (a page with a slot has its
 * data there, else at home; pinned pages are never evicted; only pages holding KV are copied)
 * is checked against a reference of what each page must hold. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "pie_testutil.h"
#include "wrk_kvslots.h"

TestSuite(wrk_kvslots, .fini = pie_test_leak_check);

#define NP 64u
#define NS 8u

typedef struct fake {
    uint64_t dev[NS], home[NP], ref[NP];
    uint8_t written[NP];
    uint32_t fetches, spills, zeros, evictions;
    uint32_t fail_fetch; /* page whose fetch fails (NP: none) */
    uint32_t last_evicted;
} fake;

static pie_code f_fetch(void *u, uint32_t page, uint32_t slot, pie_status *st) {
    fake *f = u;
    if (page == f->fail_fetch) return pie_status_set(st, PIE_INTERNAL, "fetch of %u failed", page);
    f->dev[slot] = f->home[page];
    f->fetches++;
    return PIE_OK;
}

static pie_code f_spill(void *u, uint32_t page, uint32_t slot, pie_status *st) {
    (void)st;
    fake *f = u;
    f->home[page] = f->dev[slot];
    f->spills++;
    return PIE_OK;
}

static pie_code f_zero(void *u, uint32_t page, uint32_t slot, pie_status *st) {
    (void)st, (void)page;
    fake *f = u;
    f->dev[slot] = 0;
    f->zeros++;
    return PIE_OK;
}

static void f_evicted(void *u, uint32_t page) {
    fake *f = u;
    cr_assert(f->written[page], "page %u was evicted with a callback but holds no KV", page);
    f->evictions++;
    f->last_evicted = page;
}

static void open_fake(wrk_kvslots *s, fake *f, uint32_t slots) {
    memset(f, 0, sizeof *f);
    f->fail_fetch = NP;
    wrk_kvslots_ops ops = {
        .fetch = f_fetch, .spill = f_spill, .zero = f_zero, .evicted = f_evicted, .user = f};
    pie_status st = {0};
    cr_assert_eq(wrk_kvslots_init(s, NP, slots, f->written, &ops, &st), PIE_OK, "%s", st.msg);
}

/* What a page holding KV reads as now, wherever it is. */
static uint64_t f_read(const wrk_kvslots *s, const fake *f, uint32_t page) {
    uint32_t k = wrk_kvslots_slot(s, page);
    return k == WRK_KVSLOT_NONE ? f->home[page] : f->dev[k];
}

static void check_all(const wrk_kvslots *s, const fake *f, int round) {
    uint32_t resident = 0;
    for (uint32_t p = 0; p < NP; p++) {
        uint32_t k = wrk_kvslots_slot(s, p);
        if (k != WRK_KVSLOT_NONE) {
            resident++;
            cr_assert_eq(s->page_of[k], p, "round %d: slot %u maps back to %u, not %u", round, k,
                         s->page_of[k], p);
        }
        if (f->written[p])
            cr_assert_eq(f_read(s, f, p), f->ref[p], "round %d: page %u reads %llu, wrote %llu",
                         round, p, (unsigned long long)f_read(s, f, p),
                         (unsigned long long)f->ref[p]);
    }
    cr_assert_eq(resident, s->stats.resident);
    cr_assert_eq(resident + s->n_free, NS);
}

Test(wrk_kvslots, data_follows_each_page_through_pins_spills_evictions_and_frees) {
    wrk_kvslots s;
    fake f;
    open_fake(&s, &f, NS);
    srand(7);
    uint64_t next = 1;
    for (int round = 0; round < 20000; round++) {
        int op = rand() % 10;
        pie_status st = {0};
        if (op < 6) { /* a step: up to NS pages attend on the device, some append */
            wrk_kvslots_begin_step(&s);
            uint32_t n = 1 + (uint32_t)rand() % NS, pages[NS];
            for (uint32_t i = 0; i < n; i++) {
                pages[i] = (uint32_t)rand() % NP;
                uint32_t k;
                cr_assert_eq(wrk_kvslots_pin(&s, pages[i], &k, &st), PIE_OK, "round %d: %s", round,
                             st.msg);
                cr_assert_eq(wrk_kvslots_slot(&s, pages[i]), k);
            }
            for (uint32_t i = 0; i < n; i++) /* every page pinned this step is still here */
                cr_assert_neq(wrk_kvslots_slot(&s, pages[i]), WRK_KVSLOT_NONE,
                              "round %d: a page pinned this step was evicted", round);
            for (uint32_t i = 0; i < n; i++)
                if (rand() % 2) {
                    f.dev[wrk_kvslots_slot(&s, pages[i])] = f.ref[pages[i]] = next++;
                    f.written[pages[i]] = 1;
                }
        } else if (op < 8) { /* a host item: the page goes home and is written there */
            uint32_t p = (uint32_t)rand() % NP;
            cr_assert_eq(wrk_kvslots_unload(&s, p, &st), PIE_OK);
            cr_assert_eq(wrk_kvslots_slot(&s, p), WRK_KVSLOT_NONE);
            f.home[p] = f.ref[p] = next++;
            f.written[p] = 1;
        } else { /* freed or cleared: its KV is never read again */
            uint32_t p = (uint32_t)rand() % NP;
            wrk_kvslots_forget(&s, p);
            f.written[p] = 0;
            f.home[p] = 0;
        }
        check_all(&s, &f, round);
    }
    cr_assert_gt(f.evictions, 100, "the workload evicts (%u)", f.evictions);
    cr_assert_gt(f.zeros, 100);
    cr_assert_eq(s.stats.evicted, f.evictions);
    cr_assert_eq(s.stats.spilled, f.spills);
    cr_assert_eq(s.stats.fetched, f.fetches);
    wrk_kvslots_forget(&s, NP + 5); /* past the table: ignored */
    wrk_kvslots_free(&s);
}

Test(wrk_kvslots, a_step_pinning_more_pages_than_slots_is_refused_and_keeps_its_pins) {
    wrk_kvslots s;
    fake f;
    open_fake(&s, &f, 2);
    pie_status st = {0};
    uint32_t k;
    wrk_kvslots_begin_step(&s);
    for (uint32_t p = 0; p < 2; p++) {
        cr_assert_eq(wrk_kvslots_pin(&s, p, &k, &st), PIE_OK);
        cr_assert_eq(k, 1 - p, "the last slot first: page ids and slots part");
        f.dev[k] = f.ref[p] = 100 + p;
        f.written[p] = 1;
    }
    cr_assert_eq(wrk_kvslots_pin(&s, 5, &k, &st), PIE_RESOURCE_EXHAUSTED);
    cr_assert(strstr(st.msg, "more than the device's 2 KV pages"), "%s", st.msg);
    cr_assert_eq(wrk_kvslots_slot(&s, 5), WRK_KVSLOT_NONE);
    cr_assert_eq(f.evictions, 0);
    /* the next step may evict them: the least recently pinned by the clock, spilled home */
    wrk_kvslots_begin_step(&s);
    cr_assert_eq(wrk_kvslots_pin(&s, 5, &k, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(f.evictions, 1);
    cr_assert_eq(f.spills, 1);
    cr_assert_eq(wrk_kvslots_slot(&s, f.last_evicted), WRK_KVSLOT_NONE);
    cr_assert_eq(f.home[f.last_evicted], f.ref[f.last_evicted]);
    cr_assert_eq(f.zeros, 3, "pages holding no KV are zeroed, not fetched");
    cr_assert_eq(f.fetches, 0);
    wrk_kvslots_free(&s);
}

Test(wrk_kvslots, a_victim_holding_no_kv_is_neither_spilled_nor_reported) {
    wrk_kvslots s;
    fake f;
    open_fake(&s, &f, 1);
    pie_status st = {0};
    uint32_t k;
    wrk_kvslots_begin_step(&s);
    cr_assert_eq(wrk_kvslots_pin(&s, 3, &k, &st), PIE_OK); /* read, never written */
    wrk_kvslots_begin_step(&s);
    cr_assert_eq(wrk_kvslots_pin(&s, 4, &k, &st), PIE_OK);
    cr_assert_eq(f.spills, 0);
    cr_assert_eq(f.evictions, 0);
    cr_assert_eq(wrk_kvslots_slot(&s, 3), WRK_KVSLOT_NONE);
    cr_assert_eq(wrk_kvslots_slot(&s, 4), k);
    wrk_kvslots_free(&s);
}

Test(wrk_kvslots, a_failed_fetch_leaves_the_page_home_and_its_slot_free) {
    wrk_kvslots s;
    fake f;
    open_fake(&s, &f, 2);
    pie_status st = {0};
    uint32_t k;
    f.written[9] = 1;
    f.home[9] = f.ref[9] = 42;
    f.fail_fetch = 9;
    wrk_kvslots_begin_step(&s);
    cr_assert_eq(wrk_kvslots_pin(&s, 9, &k, &st), PIE_INTERNAL);
    cr_assert(strstr(st.msg, "fetch of 9 failed"), "%s", st.msg);
    cr_assert_eq(wrk_kvslots_slot(&s, 9), WRK_KVSLOT_NONE);
    cr_assert_eq(s.n_free, 2);
    cr_assert_eq(s.stats.resident, 0);
    f.fail_fetch = NP;
    cr_assert_eq(wrk_kvslots_pin(&s, 9, &k, &st), PIE_OK);
    cr_assert_eq(f.dev[k], 42);
    wrk_kvslots_free(&s);
}

Test(wrk_kvslots, no_slots_or_no_pages_is_refused) {
    wrk_kvslots s;
    uint8_t w[1] = {0};
    wrk_kvslots_ops ops = {.fetch = f_fetch, .spill = f_spill, .zero = f_zero};
    pie_status st = {0};
    cr_assert_eq(wrk_kvslots_init(&s, 4, 0, w, &ops, &st), PIE_INVALID_ARGUMENT);
    cr_assert(strstr(st.msg, "4 pages over 0 device slots"), "%s", st.msg);
    cr_assert_eq(wrk_kvslots_init(&s, 0, 4, w, &ops, &st), PIE_INVALID_ARGUMENT);
}

/* ---- the engine's protocol: placement + slots over random sequences -------------------------- */

#define PS   4u /* tokens a page */
#define MAXP 4u /* pages a sequence */
#define NSEQ 6u

typedef struct proto {
    uint64_t dev[NS][PS], home[NP][PS], ref[NP][PS];
    wrk_offplace place;
    wrk_kvslots s;
    uint32_t evictions;
    /* sequences: their pages and lengths; page ids handed out from a free list */
    uint32_t pages[NSEQ][MAXP], n_pages[NSEQ], len[NSEQ];
    bool live[NSEQ];
    uint32_t free_ids[NP], n_free;
} proto;

static pie_code p_fetch(void *u, uint32_t page, uint32_t slot, pie_status *st) {
    (void)st;
    proto *p = u;
    memcpy(p->dev[slot], p->home[page], sizeof p->dev[slot]);
    return PIE_OK;
}

static pie_code p_spill(void *u, uint32_t page, uint32_t slot, pie_status *st) {
    (void)st;
    proto *p = u;
    memcpy(p->home[page], p->dev[slot], sizeof p->home[page]);
    return PIE_OK;
}

static pie_code p_zero(void *u, uint32_t page, uint32_t slot, pie_status *st) {
    (void)st, (void)page;
    proto *p = u;
    memset(p->dev[slot], 0, sizeof p->dev[slot]);
    return PIE_OK;
}

static void p_evicted(void *u, uint32_t page) {
    proto *p = u;
    p->evictions++;
    wrk_offplace_evicted(&p->place, page);
}

/* Token t of a page as the side that holds it reads it. */
static uint64_t *p_at(proto *p, uint32_t page, uint32_t t) {
    uint32_t k = wrk_kvslots_slot(&p->s, page);
    return k == WRK_KVSLOT_NONE ? &p->home[page][t] : &p->dev[k][t];
}

static void p_clear(proto *p, uint32_t page) { /* eng_cuda_clear_pages under offload */
    wrk_kvslots_forget(&p->s, page);
    memset(p->home[page], 0, sizeof p->home[page]);
    memset(p->ref[page], 0, sizeof p->ref[page]);
    wrk_offplace_cleared(&p->place, &page, 1);
}

static uint32_t p_alloc(proto *p) {
    uint32_t page = p->free_ids[--p->n_free];
    p_clear(p, page); /* the worker clears every page it hands out */
    return page;
}

static void p_release(proto *p, uint32_t q) { /* a sequence ends: its pages are freed */
    wrk_offplace_freed(&p->place, p->pages[q], p->n_pages[q]);
    for (uint32_t j = 0; j < p->n_pages[q]; j++) {
        wrk_kvslots_forget(&p->s, p->pages[q][j]);
        p->free_ids[p->n_free++] = p->pages[q][j];
    }
    p->live[q] = false;
}

static bool p_pick(void *user, uint32_t item) {
    (void)user, (void)item;
    return rand() % 2;
}

/* One forward step over the live sequences that rand() picks: each appends 1 token (a decode,
 * which the pick may send to the host) or several (a prefill, on the device). Returns false when
 * the step was refused for needing more slots than there are (then nothing ran). */
static bool p_step(proto *p, uint64_t *next, int round) {
    wrk_offplace_item it[NSEQ];
    uint32_t seq[NSEQ], n = 0, need = 0;
    for (uint32_t q = 0; q < NSEQ; q++) {
        if (!p->live[q] || rand() % 2) continue;
        uint32_t add = p->len[q] == 0 || rand() % 4 == 0 ? 1 + (uint32_t)rand() % PS : 1;
        if (p->len[q] + add > MAXP * PS) continue; /* full: it ends below */
        while (p->n_pages[q] * PS < p->len[q] + add) p->pages[q][p->n_pages[q]++] = p_alloc(p);
        it[n] = (wrk_offplace_item){.pages = p->pages[q],
                                    .n_pages = p->n_pages[q],
                                    .ctx = p->len[q],
                                    .n_in = add,
                                    .append = true};
        seq[n++] = q;
    }
    if (n == 0) return true;
    uint8_t host[NSEQ];
    wrk_offplace_decide(&p->place, NULL, it, n, p_pick, NULL, host, NULL);
    for (uint32_t i = 0; i < n; i++) need += host[i] == WRK_OFF_DEVICE ? it[i].n_pages : 0;
    uint32_t hosted;
    pie_status st = {0};
    pie_code rc = wrk_kvslots_place(&p->s, &p->place, it, n, host, &hosted, &st);
    if (rc != PIE_OK) {
        cr_assert_eq(rc, PIE_RESOURCE_EXHAUSTED, "round %d: %s", round, st.msg);
        cr_assert_gt(need, NS, "round %d: refused with %u device pages needed", round, need);
        return false;
    }
    for (uint32_t i = 0; i < n; i++) {
        uint32_t q = seq[i];
        for (uint32_t j = 0; j < it[i].n_pages; j++) { /* every page where its item attends */
            bool on_dev = wrk_kvslots_slot(&p->s, it[i].pages[j]) != WRK_KVSLOT_NONE;
            cr_assert_eq(on_dev, host[i] == WRK_OFF_DEVICE, "round %d: item %u page %u", round, i,
                         it[i].pages[j]);
        }
        for (uint32_t t = 0; t < p->len[q]; t++) /* the context reads what was written */
            cr_assert_eq(*p_at(p, p->pages[q][t / PS], t % PS), p->ref[p->pages[q][t / PS]][t % PS],
                         "round %d: sequence %u token %u", round, q, t);
        for (uint32_t t = p->len[q]; t < p->len[q] + it[i].n_in; t++)
            *p_at(p, p->pages[q][t / PS], t % PS) = p->ref[p->pages[q][t / PS]][t % PS] = (*next)++;
        p->len[q] += it[i].n_in;
    }
    return true;
}

/* A fork (eng_cuda_copy_pages under offload): a new sequence whose pages copy another's. */
static void p_fork(proto *p, uint32_t from, uint32_t to) {
    p->n_pages[to] = p->n_pages[from];
    p->len[to] = p->len[from];
    p->live[to] = true;
    for (uint32_t j = 0; j < p->n_pages[from]; j++) {
        uint32_t src = p->pages[from][j], dst = p->pages[to][j] = p_alloc(p);
        pie_status st = {0};
        wrk_kvslots_begin_step(&p->s); /* as the engine: each copy a step of its own */
        cr_assert_eq(wrk_kvslots_copy_dst(&p->s, &p->place, dst, &st), PIE_OK, "%s", st.msg);
        for (uint32_t t = 0; t < PS; t++) {
            uint64_t v = *p_at(p, src, t);
            *p_at(p, dst, t) = v;
            p->ref[dst][t] = p->ref[src][t];
        }
        wrk_offplace_copied(&p->place, dst);
        cr_assert_eq(wrk_offplace_on_host(&p->place, dst),
                     wrk_kvslots_slot(&p->s, dst) == WRK_KVSLOT_NONE,
                     "a copied page is counted where its data is");
    }
}

Test(wrk_kvslots, the_engines_protocol_keeps_every_sequence_readable_where_it_attends) {
    proto *p = calloc(1, sizeof *p);
    cr_assert_not_null(p);
    pie_status st = {0};
    cr_assert_eq(wrk_offplace_init(&p->place, NP, NS, PS, NSEQ, &st), PIE_OK, "%s", st.msg);
    wrk_kvslots_ops ops = {
        .fetch = p_fetch, .spill = p_spill, .zero = p_zero, .evicted = p_evicted, .user = p};
    cr_assert_eq(wrk_kvslots_init(&p->s, NP, NS, p->place.written, &ops, &st), PIE_OK);
    for (uint32_t i = 0; i < NP; i++) p->free_ids[p->n_free++] = NP - 1 - i;
    srand(11);
    uint64_t next = 1;
    uint32_t refused = 0, forks = 0;
    for (int round = 0; round < 20000; round++) {
        for (uint32_t q = 0; q < NSEQ; q++) /* new sequences; full ones end */
            if (p->live[q] && p->len[q] + PS > MAXP * PS) p_release(p, q);
        for (uint32_t q = 0; q < NSEQ; q++) {
            if (p->live[q] || rand() % 3) continue;
            uint32_t from = (uint32_t)rand() % NSEQ;
            if (p->live[from] && p->len[from] > 0 && rand() % 2) {
                p_fork(p, from, q);
                forks++;
            } else {
                p->live[q] = true, p->len[q] = 0, p->n_pages[q] = 0;
            }
        }
        refused += !p_step(p, &next, round);
        /* the placement's counts match the slots: a written page on the device has a slot */
        uint32_t on_dev = 0;
        for (uint32_t pg = 0; pg < NP; pg++)
            if (p->place.written[pg] && !wrk_offplace_on_host(&p->place, pg)) {
                on_dev++;
                cr_assert_neq(wrk_kvslots_slot(&p->s, pg), WRK_KVSLOT_NONE,
                              "round %d: page %u counts on the device without a slot", round, pg);
            }
        cr_assert_eq(on_dev, p->place.stats.pages_on_device, "round %d", round);
    }
    cr_assert_gt(p->evictions, 100, "%u evictions", p->evictions);
    cr_assert_gt(forks, 100);
    cr_assert_gt(p->place.stats.pages_to_host, 100);
    cr_assert_gt(p->place.stats.pages_to_device, 100);
    cr_assert_gt(refused, 0, "no step needed more slots than there are");
    cr_assert_lt(refused, 20000 / 4, "%u steps refused", refused);
    wrk_kvslots_free(&p->s);
    wrk_offplace_free(&p->place);
    free(p);
}
