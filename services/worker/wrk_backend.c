/* wrk_backend.c — see wrk_backend.h. */
#include "wrk_backend.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "pie_log.h"
#include "wrk_nulldev.h"

#ifdef PIE_WITH_CUDA
#include "eng_cuda.h"
#endif

/* ---- the engine ------------------------------------------------------------------------------ */

static pie_code engine_embed_text(void *ctx, const uint32_t *slots, const uint32_t *tokens,
                                  const uint32_t *positions, uint32_t n, pie_status *st) {
    return eng_embed_text(ctx, slots, tokens, positions, n, st);
}

static pie_code engine_forward(void *ctx, const eng_forward_item *items, uint32_t n,
                               pie_status *st) {
    return eng_forward(ctx, items, n, st);
}

static pie_code engine_forward_plan(void *ctx, const eng_forward_item *items, uint32_t n,
                                    uint8_t *defer, pie_status *st) {
    return eng_forward_plan(ctx, items, n, defer, st);
}

static pie_code engine_forward_skip(void *ctx, const eng_forward_item *items, uint32_t n,
                                    const uint8_t *skip, pie_status *st) {
    return eng_forward_skip(ctx, items, n, skip, st);
}

static pie_code engine_mask_page(void *ctx, uint32_t page, const bool *masked, pie_status *st) {
    return eng_mask_page(ctx, page, masked, st);
}

static pie_code engine_copy_pages(void *ctx, const eng_copy_item *items, uint32_t n,
                                  pie_status *st) {
    return eng_copy_pages(ctx, items, n, st);
}

static pie_code engine_next_dist(void *ctx, eng_dist_item *items, uint32_t n, pie_status *st) {
    return eng_next_dist(ctx, items, n, st);
}

static pie_code engine_clear_pages(void *ctx, const uint32_t *pages, uint32_t n, pie_status *st) {
    return eng_clear_pages(ctx, pages, n, st);
}

static void engine_pages_freed(void *ctx, const uint32_t *pages, uint32_t n) {
    eng_pages_freed(ctx, pages, n);
}

static pie_code engine_clear_embeds(void *ctx, const uint32_t *slots, uint32_t n, pie_status *st) {
    return eng_clear_embeds(ctx, slots, n, st);
}

static void engine_swap_get_stats(void *ctx, eng_swap_stats *out) { eng_swap_get_stats(ctx, out); }

static void engine_offload_get_stats(void *ctx, eng_offload_stats *out) {
    eng_offload_get_stats(ctx, out);
}

static pie_code engine_swap_set_slots(void *ctx, uint32_t slots, uint32_t *applied,
                                      pie_status *st) {
    return eng_swap_set_slots(ctx, slots, applied, st);
}

void wrk_backend_engine(wrk_backend *b, eng *e) {
    *b = (wrk_backend){
        .name = "cpu",
        .ctx = e,
        .embed_text = engine_embed_text,
        .forward = engine_forward,
        .forward_plan = engine_forward_plan,
        .forward_skip = engine_forward_skip,
        .mask_page = engine_mask_page,
        .copy_pages = engine_copy_pages,
        .next_dist = engine_next_dist,
        .clear_pages = engine_clear_pages,
        .clear_embeds = engine_clear_embeds,
        .pages_freed = engine_pages_freed,
        .swap_get_stats = engine_swap_get_stats,
        .swap_set_slots = engine_swap_set_slots,
        .offload_get_stats = engine_offload_get_stats,
    };
}

/* ---- null: well-formed results, no work ------------------------------------------------------ */

static pie_code null_embed_text(void *ctx, const uint32_t *slots, const uint32_t *tokens,
                                const uint32_t *positions, uint32_t n, pie_status *st) {
    (void)ctx, (void)slots, (void)tokens, (void)positions, (void)n, (void)st;
    return PIE_OK;
}

static void sleep_us(uint64_t us) {
    struct timespec ts = {.tv_sec = (time_t)(us / 1000000), .tv_nsec = (long)(us % 1000000) * 1000};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
}

static pie_code null_forward(void *ctx, const eng_forward_item *items, uint32_t n, pie_status *st) {
    wrk_nulldev *dev = ctx;
    if (dev == NULL) return PIE_OK;
    uint32_t page = wrk_nulldev_config_of(dev)->page_size;
    if (!wrk_nulldev_config_of(dev)->offload_device_pages) { /* token counts are all it needs */
        uint64_t tokens = 0, kv_tokens = 0;
        for (uint32_t i = 0; i < n; i++) {
            tokens += items[i].n_in;
            if (items[i].n_kv_pages)
                kv_tokens +=
                    (uint64_t)(items[i].n_kv_pages - 1) * page + items[i].kv_last_page_len;
        }
        wrk_nulldev_batch b = wrk_nulldev_forward(dev, tokens, kv_tokens);
        if (b.time_s > 0) sleep_us((uint64_t)(b.time_s * 1e6 + 0.5));
        return PIE_OK;
    }
    wrk_offplace_item *its = wrk_nulldev_items(dev, n);
    if (its == NULL)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "forward: %u items are more than the emulated device's batch", n);
    for (uint32_t i = 0; i < n; i++) { /* the emulated device sees pages and token counts */
        const eng_forward_item *it = &items[i];
        uint32_t held =
            it->n_kv_pages ? (it->n_kv_pages - 1) * page + it->kv_last_page_len : 0;
        uint32_t ctx_tokens = !it->append_kv ? held : held > it->n_in ? held - it->n_in : 0;
        its[i] = (wrk_offplace_item){.pages = it->kv_pages,
                                     .n_pages = it->n_kv_pages,
                                     .ctx = ctx_tokens,
                                     .n_in = it->n_in,
                                     .append = it->append_kv};
    }
    wrk_nulldev_batch b;
    pie_code rc = wrk_nulldev_forward_items(dev, its, n, &b, st);
    if (rc != PIE_OK) return rc;
    if (b.time_s > 0) sleep_us((uint64_t)(b.time_s * 1e6 + 0.5));
    return PIE_OK;
}

static pie_code null_mask_page(void *ctx, uint32_t page, const bool *masked, pie_status *st) {
    (void)ctx, (void)page, (void)masked, (void)st;
    return PIE_OK;
}

static pie_code null_copy_pages(void *ctx, const eng_copy_item *items, uint32_t n, pie_status *st) {
    (void)st;
    for (uint32_t i = 0; ctx && i < n; i++) wrk_nulldev_copied(ctx, items[i].dst);
    return PIE_OK;
}

/* Token i gets (k - i) / (k (k + 1)): strictly descending, summing to 1/2 (the probabilities of
 * a full softmax are not renormalised over the k kept, so a sum below 1 is well-formed). */
static pie_code null_next_dist(void *ctx, eng_dist_item *items, uint32_t n, pie_status *st) {
    (void)ctx, (void)st;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t k = items[i].top_k;
        float norm = (float)k * (float)(k + 1);
        for (uint32_t j = 0; j < k; j++) {
            items[i].ids[j] = j;
            items[i].probs[j] = (float)(k - j) / norm;
        }
    }
    return PIE_OK;
}

static pie_code null_clear(void *ctx, const uint32_t *ids, uint32_t n, pie_status *st) {
    (void)ctx, (void)ids, (void)n, (void)st;
    return PIE_OK;
}

/* offload's bookkeeping: a freed page no longer counts against the device's room */
static void null_pages_freed(void *ctx, const uint32_t *pages, uint32_t n) {
    if (ctx) wrk_nulldev_freed(ctx, pages, n);
}

/* offload's bookkeeping: a cleared page is empty and on the device */
static pie_code null_clear_pages(void *ctx, const uint32_t *ids, uint32_t n, pie_status *st) {
    (void)st;
    if (ctx) wrk_nulldev_cleared(ctx, ids, n);
    return PIE_OK;
}

void wrk_backend_null(wrk_backend *b, wrk_nulldev *dev) {
    *b = (wrk_backend){
        .name = "null",
        .ctx = dev,
        .embed_text = null_embed_text,
        .forward = null_forward,
        .mask_page = null_mask_page,
        .copy_pages = null_copy_pages,
        .next_dist = null_next_dist,
        .clear_pages = null_clear_pages,
        .clear_embeds = null_clear,
        .pages_freed = null_pages_freed,
    };
}

/* ---- cuda: the engine's cuda backend ----------------------------------------------------------
 */

#ifdef PIE_WITH_CUDA
static pie_code cuda_embed_text(void *ctx, const uint32_t *slots, const uint32_t *tokens,
                                const uint32_t *positions, uint32_t n, pie_status *st) {
    return eng_cuda_embed_text(ctx, slots, tokens, positions, n, st);
}

static pie_code cuda_forward(void *ctx, const eng_forward_item *items, uint32_t n, pie_status *st) {
    return eng_cuda_forward(ctx, items, n, st);
}

static pie_code cuda_mask_page(void *ctx, uint32_t page, const bool *masked, pie_status *st) {
    return eng_cuda_mask_page(ctx, page, masked, st);
}

static pie_code cuda_copy_pages(void *ctx, const eng_copy_item *items, uint32_t n, pie_status *st) {
    return eng_cuda_copy_pages(ctx, items, n, st);
}

static pie_code cuda_next_dist(void *ctx, eng_dist_item *items, uint32_t n, pie_status *st) {
    return eng_cuda_next_dist(ctx, items, n, st);
}

static pie_code cuda_clear_pages(void *ctx, const uint32_t *pages, uint32_t n, pie_status *st) {
    return eng_cuda_clear_pages(ctx, pages, n, st);
}

static pie_code cuda_clear_embeds(void *ctx, const uint32_t *slots, uint32_t n, pie_status *st) {
    return eng_cuda_clear_embeds(ctx, slots, n, st);
}

static void cuda_close(void *ctx) { eng_cuda_close(ctx); }

static void cuda_pages_freed(void *ctx, const uint32_t *pages, uint32_t n) {
    eng_cuda_pages_freed(ctx, pages, n);
}

static void cuda_swap_get_stats(void *ctx, eng_swap_stats *out) {
    eng_cuda_swap_get_stats(ctx, out);
}

static pie_code cuda_swap_set_slots(void *ctx, uint32_t slots, uint32_t *applied,
                                    pie_status *st) {
    return eng_cuda_swap_set_slots(ctx, slots, applied, st);
}

static void cuda_offload_get_stats(void *ctx, eng_offload_stats *out) {
    eng_cuda_offload_get_stats(ctx, out);
}

/* The engine's device-fault hook (eng_cuda_on_fault): runs once, in the handler that met the
 * fault, whose batch then fails with the same message. The process cannot use the GPU again:
 * leave the cluster (SIGTERM: main's orderly stop) and exit 1 (main, wrk_backend_fault). */
static void cuda_fault(const char *why, void *arg) {
    (void)arg;
    pie_log_error("wrk.device_fault",
                  "backend=cuda error=\"%s\" action=\"the CUDA context is lost: leaving the "
                  "cluster, exit 1\"",
                  why);
    if (kill(getpid(), SIGTERM) != 0)
        pie_log_error("wrk.device_fault", "kill: %s", strerror(errno));
}

bool wrk_backend_fault(char *why, size_t cap) { return eng_cuda_fault(why, cap); }

pie_code wrk_backend_open_cuda(wrk_backend *b, const eng_opts *opts, const eng_info **info,
                               char *device, size_t device_len, pie_status *st) {
    eng_cuda *e = NULL;
    eng_cuda_on_fault(cuda_fault, NULL);
    pie_code rc = eng_cuda_open(opts, &e, st);
    if (rc != PIE_OK) {
        /* eng_open's prefix names the function; the worker's log names the backend */
        const char *prefix = "eng_open: ";
        if (strncmp(st->msg, prefix, strlen(prefix)) == 0) {
            char msg[PIE_STATUS_MSG_MAX];
            snprintf(msg, sizeof msg, "%s", st->msg + strlen(prefix));
            pie_status_set(st, rc, "%s", msg);
        }
        return rc;
    }
    *b = (wrk_backend){
        .name = "cuda",
        .ctx = e,
        .embed_text = cuda_embed_text,
        .forward = cuda_forward,
        .mask_page = cuda_mask_page,
        .copy_pages = cuda_copy_pages,
        .next_dist = cuda_next_dist,
        .clear_pages = cuda_clear_pages,
        .clear_embeds = cuda_clear_embeds,
        .pages_freed = cuda_pages_freed,
        .close = cuda_close,
        .swap_get_stats = cuda_swap_get_stats,
        .swap_set_slots = cuda_swap_set_slots,
        .offload_get_stats = cuda_offload_get_stats,
    };
    *info = eng_cuda_get_info(e);
    snprintf(device, device_len, "cuda: %s", eng_cuda_device_name(e));
    return PIE_OK;
}
#else
pie_code wrk_backend_open_cuda(wrk_backend *b, const eng_opts *opts, const eng_info **info,
                               char *device, size_t device_len, pie_status *st) {
    (void)b, (void)opts, (void)info, (void)device, (void)device_len;
    return pie_status_set(st, PIE_UNIMPLEMENTED,
                          "backend cuda: not built into this worker (nvcc was not found at build "
                          "time)");
}

bool wrk_backend_fault(char *why, size_t cap) {
    (void)why, (void)cap;
    return false;
}
#endif

void wrk_backend_release(wrk_backend *b) {
    if (b->close && b->ctx) b->close(b->ctx);
    memset(b, 0, sizeof *b);
}
