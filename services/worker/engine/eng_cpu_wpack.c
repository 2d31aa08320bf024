/* eng_cpu_wpack.c — the cpu engine's bf16 linear weights packed once at open.
 *
 * Owns: whether to pack (PIE_KRN_PREPACK=0|1, read at each open; by default on exactly where
 * the kernels would otherwise re-pack W on every call: bf16 weights, the avx512 path, AMX not
 * active), the region holding the packed weights, rebinding this rank's q/k/v/o, gate/up/down
 * and lm_head (and the embedding when it is tied to lm_head: the gather reads the packed form,
 * no second copy) to it, dropping the mapped originals' pages so the resident size does not
 * double, and the dtype each linear call passes (eng_cpu_wt).
 * Does not own: the packed layout and the kernels that read it (kernels/cpu/krn_panel.c,
 * krn_wpack_bf16), the shard's views and copied slices (eng_cpu_tp.c).
 *
 * Why: without AMX, bf16 layers with 4-256 rows of x run on packed panels, and packing W (a
 * 16 × 16 transpose of (k, k + 1) pairs per 512 weights) was ~13% of a b=32 decode step on
 * the Xeon (bench/results/engine.md, issue 17). Packed once, the same micro-kernel reads the
 * pairs directly, with the same bits. With AMX nothing is packed by default: AMX reads the
 * packed panels too (krn_amx.c) and PIE_KRN_PREPACK=1 makes b=1 decode 26% cheaper and prefill
 * 4-20% faster, but b=32 decode 3-8% dearer in CPU per step than the tiles on row-major W
 * (bench/results/engine.md, "AMX on packed weights"). */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "eng_cpu_impl.h"

/* 1: pack, 0: not (the environment first, then the default). */
static int eng_wpack_wanted(void) {
    const char *env = getenv("PIE_KRN_PREPACK");
    if (env && env[0] == '0') return 0;
    if (env && env[0] == '1') return 1;
    return !krn_cpu_amx_active() && strcmp(krn_cpu_simd_name(), "avx512") == 0;
}

/* The linear weights of this rank: 7 per layer, then lm_head. */
static int eng_wpack_list(eng *e, mdl_tensor **ts) {
    int n = 0;
    for (uint32_t l = 0; l < e->info.n_layers; l++) {
        mdl_layer *L = &e->own_layers[l];
        mdl_tensor *w[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (size_t i = 0; i < sizeof w / sizeof w[0]; i++) ts[n++] = w[i];
    }
    ts[n++] = &e->lm_head;
    return n;
}

/* Drops the pages wholly inside [data, data + bytes) when they belong to one of the model's
 * file mappings (read-only: a later read faults them in again from the file). Copies the
 * loader made of misaligned tensors (heap memory) are left alone. */
static void eng_wpack_drop(const mdl_model *m, const void *data, size_t bytes) {
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t a = (uintptr_t)data, b = a + bytes;
    for (int i = 0; i < m->n_maps; i++) {
        uintptr_t m0 = (uintptr_t)m->maps[i], m1 = m0 + m->map_lens[i];
        if (a < m0 || b > m1) continue;
        uintptr_t s = (a + page - 1) / page * page, t = b / page * page;
        if (t > s) (void)madvise((void *)s, t - s, MADV_DONTNEED);
        return;
    }
}

static double eng_wpack_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

pie_code eng_wpack_open(eng *e, pie_status *st) {
    uint32_t L = e->info.n_layers;
    if (!eng_wpack_wanted() || e->lm_head.dtype != MDL_BF16) return PIE_OK; /* f32/f16 model */
    if (!e->own_layers) { /* tp_size 1: the model's own tensors, rebound in a copy */
        e->own_layers = calloc(L ? L : 1, sizeof *e->own_layers);
        if (!e->own_layers)
            return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "eng_open: out of memory");
        if (L) memcpy(e->own_layers, e->layers, L * sizeof *e->own_layers);
        e->layers = e->own_layers;
    }
    mdl_tensor **ts = calloc((size_t)L * 7 + 1, sizeof *ts);
    if (!ts) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "eng_open: out of memory");
    int n = eng_wpack_list(e, ts);
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        if (ts[i]->dtype != MDL_BF16) { /* the packed form is bf16's only */
            free(ts);
            return PIE_OK;
        }
        total += krn_wpack_bytes((int)ts[i]->rows, (int)ts[i]->cols);
    }
    pie_code rc = eng_cpu_map(&e->wpack, total, "the packed weights", st);
    if (rc != PIE_OK) {
        free(ts);
        return rc;
    }
    bool tied = e->embed.data == e->lm_head.data && e->embed.rows == e->lm_head.rows &&
                e->embed.cols == e->lm_head.cols;
    double t0 = eng_wpack_now_ms();
    char *dst = e->wpack.p;
    for (int i = 0; i < n; i++) { /* one at a time, its original dropped at once: no peak */
        mdl_tensor *t = ts[i];
        size_t bytes = krn_wpack_bytes((int)t->rows, (int)t->cols);
        krn_wpack_bf16(e->pool, t->data, (int)t->rows, (int)t->cols, dst);
        eng_wpack_drop(e->m, t->data, (size_t)t->rows * t->cols * 2);
        t->data = dst;
        dst += bytes;
    }
    if (tied) e->embed = e->lm_head;
    eng_cpu_unmap(&e->slices); /* tp: the copied column slices of wo/w_down, all packed now */
    e->info.pack_ms = eng_wpack_now_ms() - t0;
    e->info.packed_weight_bytes = total;
    free(ts);
    return PIE_OK;
}

krn_dtype eng_cpu_wt(const eng *e, const mdl_tensor *t) {
    const char *p = t->data, *base = e->wpack.p;
    if (base && p >= base && p < base + e->wpack.bytes) return KRN_BF16_PANEL;
    return (krn_dtype)t->dtype;
}
