/* eng_cpu_swap.c — the cpu engine under the swap policy (issue 13): its KV layers live in a
 * wrk_tier (services/worker/mem/wrk_tier.h: a "device" and a "host" region of layer buffers
 * and the copy engine moving layers between them), and the handlers reach a layer through it.
 *
 * Owns: opening the tier from eng_opts, pointing kv[l].base at layer l's buffer of the moment
 * (acquire before a forward touches the layer, hold/resume around handlers that touch every
 * layer), carrying rank 0's slot count to the other ranks of a tensor-parallel group with
 * every forward, and eng.h's eng_swap_* functions. Without the policy (e->tier NULL) every helper
 * here does nothing and kv[l] points at the layer's own region for good.
 * Does not own: the FIFO decisions, the mapping table, the copy threads (wrk_tier.c). */

#include "eng.h"
#include "eng_check.h"
#include "eng_cpu_impl.h"
#include "eng_tier.h"
#include "wrk_coll.h"
#include "wrk_tier.h"

pie_code eng_swap_open(eng *e, const eng_opts *o, size_t layer_bytes, pie_status *st) {
    wrk_tier_config tc = eng_tier_config(o, e->info.n_layers, layer_bytes);
    pie_code rc = wrk_tier_open(&tc, &e->tier, st);
    if (rc != PIE_OK) return rc;
    e->info.swap_min_slots = tc.min_slots;
    return PIE_OK;
}

void eng_swap_close(eng *e) {
    wrk_tier_close(e->tier);
    e->tier = NULL;
}

pie_code eng_kv_acquire(eng *e, uint32_t l, pie_status *st) {
    if (!e->tier) return PIE_OK;
    void *base = NULL;
    pie_code rc = wrk_tier_acquire(e->tier, l, &base, st);
    if (rc == PIE_OK) e->kv[l].base = base;
    return rc;
}

/* The tier moves only the page range written so far: raise it to the pages these write. */
static void eng_kv_touch(eng *e, uint32_t pages) {
    wrk_tier_touch(e->tier, (size_t)pages * e->info.kv_page_layer_bytes);
}

void eng_kv_touch_forward(eng *e, const eng_forward_item *items, uint32_t n) {
    if (e->tier) eng_kv_touch(e, eng_check_kv_top_forward(items, n));
}

void eng_kv_touch_copies(eng *e, const eng_copy_item *items, uint32_t n) {
    if (e->tier) eng_kv_touch(e, eng_check_kv_top_copies(items, n));
}

pie_code eng_swap_share_slots(eng *e, pie_status *st) {
    if (!e->tier || !e->coll) return PIE_OK;
    uint32_t slots = 0;
    if (e->shard.rank == 0) {
        wrk_tier_stats s;
        wrk_tier_get_stats(e->tier, &s);
        slots = s.slots;
    }
    pie_code rc = wrk_coll_bcast(e->coll, 0, &slots, sizeof slots, st);
    if (rc != PIE_OK) return rc;
    if (e->shard.rank != 0) (void)wrk_tier_set_slots(e->tier, slots); /* rank 0's: in range */
    return PIE_OK;
}

void eng_kv_release(eng *e, uint32_t l) {
    if (e->tier) wrk_tier_release(e->tier, l);
}

void eng_kv_hold(eng *e) {
    if (!e->tier) return;
    wrk_tier_hold(e->tier);
    for (uint32_t l = 0; l < e->info.n_layers; l++) e->kv[l].base = wrk_tier_where(e->tier, l);
}

void eng_kv_resume(eng *e) {
    if (e->tier) wrk_tier_resume(e->tier);
}

pie_code eng_swap_set_slots(eng *e, uint32_t slots, uint32_t *applied, pie_status *st) {
    return eng_tier_set_slots(e->tier, slots, applied, st);
}

void eng_swap_get_stats(eng *e, eng_swap_stats *out) { eng_tier_stats(e->tier, out); }

void eng_swap_quiesce(eng *e) {
    if (e->tier) wrk_tier_quiesce(e->tier);
}
