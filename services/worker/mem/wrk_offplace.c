/* wrk_offplace.c — see wrk_offplace.h. */
#include "wrk_offplace.h"

#include <stdlib.h>
#include <string.h>

pie_code wrk_offplace_init(wrk_offplace *p, uint32_t n_pages, uint32_t device_pages,
                           uint32_t page_size, uint32_t max_items, pie_status *st) {
    memset(p, 0, sizeof *p);
    p->n_pages = n_pages;
    p->device_pages = device_pages;
    p->page_size = page_size;
    p->max_items = max_items;
    size_t np = n_pages ? n_pages : 1, ni = max_items ? max_items : 1;
    p->loc = calloc(np, 1);
    p->written = calloc(np, 1);
    p->mark = calloc(np, 1);
    p->reqs = calloc(ni, sizeof *p->reqs);
    p->req_item = calloc(ni, sizeof *p->req_item);
    p->req_host = calloc(ni, 1);
    p->waited = calloc(np, sizeof *p->waited);
    if (!p->loc || !p->written || !p->mark || !p->reqs || !p->req_item || !p->req_host ||
        !p->waited) {
        wrk_offplace_free(p);
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "offload: out of memory for the page tables of %u pages", n_pages);
    }
    return PIE_OK;
}

void wrk_offplace_free(wrk_offplace *p) {
    free(p->loc);
    free(p->written);
    free(p->mark);
    free(p->reqs);
    free(p->req_item);
    free(p->req_host);
    free(p->waited);
    memset(p, 0, sizeof *p);
}

void wrk_offplace_set_defer(wrk_offplace *p, bool on) { p->defer = on; }

bool wrk_offplace_eligible(const wrk_offplace_item *it) {
    return it->append && it->n_in == 1 && it->n_pages > 0 && !it->device_only;
}

/* The device's room for the decodes in p->reqs, in KV tokens: its pages minus those written
 * there and not theirs. */
static uint64_t offplace_room(const wrk_offplace *p, const wrk_offplace_item *items,
                              uint32_t n_req) {
    uint64_t on_dev = p->stats.pages_on_device, theirs = 0;
    for (uint32_t r = 0; r < n_req; r++) {
        const wrk_offplace_item *it = &items[p->req_item[r]];
        for (uint32_t j = 0; j < it->n_pages; j++)
            theirs += p->written[it->pages[j]] && !p->loc[it->pages[j]];
    }
    uint64_t others = on_dev > theirs ? on_dev - theirs : 0;
    uint64_t room = p->device_pages > others ? p->device_pages - others : 0;
    return room * p->page_size;
}

/* A page a device item reads keeps every item reading it on the device (to a fixed point). */
static void offplace_settle(wrk_offplace *p, const wrk_offplace_item *items, uint32_t n,
                            uint8_t *item_host) {
    for (bool changed = true; changed;) {
        changed = false;
        for (uint32_t i = 0; i < n; i++)
            if (item_host[i] == WRK_OFF_DEVICE)
                for (uint32_t j = 0; j < items[i].n_pages; j++) p->mark[items[i].pages[j]] = 1;
        for (uint32_t i = 0; i < n; i++) {
            if (item_host[i] != WRK_OFF_HOST) continue;
            for (uint32_t j = 0; j < items[i].n_pages; j++)
                if (p->mark[items[i].pages[j]]) {
                    item_host[i] = WRK_OFF_DEVICE;
                    changed = true;
                    break;
                }
        }
    }
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t j = 0; j < items[i].n_pages; j++) p->mark[items[i].pages[j]] = 0;
}

void wrk_offplace_decide(wrk_offplace *p, const wrk_off_costs *costs,
                         const wrk_offplace_item *items, uint32_t n,
                         bool (*pick)(void *user, uint32_t item), void *user, uint8_t *item_host,
                         wrk_off_choice *choice) {
    wrk_off_choice ch = {0};
    /* the candidates and what the rest of the step costs */
    uint32_t n_req = 0, dev_tokens = 0, dev_items = 0;
    uint64_t dev_kv = 0;
    for (uint32_t i = 0; i < n; i++) {
        const wrk_offplace_item *it = &items[i];
        item_host[i] = 0;
        uint32_t kv = it->ctx + it->n_in;
        if (!wrk_offplace_eligible(it)) {
            dev_tokens += it->n_in;
            dev_kv += (uint64_t)kv * it->n_in;
            dev_items++;
            continue;
        }
        bool all_host = true;
        for (uint32_t j = 0; j < it->n_pages && all_host; j++) all_host = p->loc[it->pages[j]] != 0;
        p->reqs[n_req] =
            (wrk_off_req){.kv = kv, .on_host = all_host, .waited = p->waited[it->pages[0]]};
        p->req_item[n_req++] = i;
    }
    if (pick) {
        for (uint32_t r = 0; r < n_req; r++) p->req_host[r] = pick(user, p->req_item[r]) ? 1 : 0;
    } else if (n_req) {
        wrk_off_batch b = {.dev_tokens = dev_tokens,
                           .dev_kv = dev_kv,
                           .reqs = p->reqs,
                           .n_reqs = n_req,
                           .device_kv_budget = offplace_room(p, items, n_req),
                           .dev_items = dev_items,
                           .defer_ok = p->defer};
        wrk_off_decide(costs, &b, p->req_host, &ch);
        if (ch.forced) p->stats.forced_steps++;
        p->stats.gain_steps++;
        double gain = ch.gain_kv / p->page_size; /* INFINITY: a free host, everything pays */
        p->stats.gain_pages += gain < p->n_pages ? (uint64_t)gain : p->n_pages;
    }
    for (uint32_t r = 0; r < n_req; r++) item_host[p->req_item[r]] = p->req_host[r];
    offplace_settle(p, items, n, item_host);
    /* the deferral counts: one more step for the deferred, reset for the rest */
    p->stats.last_deferred = 0;
    for (uint32_t r = 0; r < n_req; r++) {
        uint32_t i = p->req_item[r];
        uint16_t *w = &p->waited[items[i].pages[0]];
        if (item_host[i] == WRK_OFF_DEFER) {
            if (*w < UINT16_MAX) (*w)++;
            p->stats.last_deferred++;
        } else {
            *w = 0;
        }
    }
    p->stats.deferred += p->stats.last_deferred;
    if (choice) *choice = ch;
}

void wrk_offplace_skip(wrk_offplace *p, const wrk_offplace_item *items, uint32_t n,
                       uint8_t *item_host, const uint8_t *skip) {
    for (uint32_t i = 0; i < n; i++) {
        if (!skip[i] || item_host[i] == WRK_OFF_DEFER) continue;
        item_host[i] = WRK_OFF_DEFER;
        if (!wrk_offplace_eligible(&items[i])) continue;
        uint16_t *w = &p->waited[items[i].pages[0]];
        if (*w < UINT16_MAX) (*w)++;
    }
}

uint32_t wrk_offplace_apply(wrk_offplace *p, const wrk_offplace_item *items, uint32_t n,
                            const uint8_t *item_host,
                            void (*move)(void *user, uint32_t page, uint8_t to), void *user) {
    uint32_t hosted = 0;
    wrk_offplace_stats *s = &p->stats;
    for (uint32_t i = 0; i < n; i++) {
        if (item_host[i] == WRK_OFF_DEFER) continue;
        uint8_t to = item_host[i] ? 1 : 0;
        hosted += to;
        for (uint32_t j = 0; j < items[i].n_pages; j++) {
            uint32_t pg = items[i].pages[j];
            if (p->loc[pg] == to) continue;
            if (p->written[pg]) {
                if (move) move(user, pg, to);
                if (to) s->pages_to_host++, s->pages_on_host++, s->pages_on_device--;
                else s->pages_to_device++, s->pages_on_host--, s->pages_on_device++;
            }
            p->loc[pg] = to;
        }
    }
    for (uint32_t i = 0; i < n; i++)
        if (items[i].append && item_host[i] != WRK_OFF_DEFER)
            for (uint32_t j = 0; j < items[i].n_pages; j++) wrk_offplace_copied(p, items[i].pages[j]);
    return hosted;
}

void wrk_offplace_evicted(wrk_offplace *p, uint32_t page) {
    if (page >= p->n_pages || p->loc[page]) return;
    p->loc[page] = 1;
    if (!p->written[page]) return;
    p->stats.pages_on_device--, p->stats.pages_on_host++, p->stats.pages_to_host++;
}

void wrk_offplace_copied(wrk_offplace *p, uint32_t dst) {
    if (p->written[dst]) return;
    if (p->loc[dst]) p->stats.pages_on_host++;
    else p->stats.pages_on_device++;
    p->written[dst] = 1;
}

void wrk_offplace_freed(wrk_offplace *p, const uint32_t *pages, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        uint32_t pg = pages[i];
        if (pg >= p->n_pages) continue;
        p->waited[pg] = 0;
        if (!p->written[pg]) continue;
        if (p->loc[pg]) p->stats.pages_on_host--;
        else p->stats.pages_on_device--;
        p->written[pg] = 0;
    }
}

void wrk_offplace_cleared(wrk_offplace *p, const uint32_t *pages, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        uint32_t pg = pages[i];
        p->waited[pg] = 0;
        if (p->written[pg] && p->loc[pg]) p->stats.pages_on_host--;
        if (p->written[pg] && !p->loc[pg]) p->stats.pages_on_device--;
        p->loc[pg] = 0;
        p->written[pg] = 0;
    }
}
