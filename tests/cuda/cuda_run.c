/* cuda_run.c — pie-cuda-run: the cuda backend on one prompt, for comparisons from Python
 * (tests/cuda/compare_transformers.py). Not a test by itself.
 *
 * Usage: pie-cuda-run --model DIR --tokens ID,ID,... [--greedy N] [--no-graphs]
 * Prefills the prompt (positions 0..P-1, one forward, appending K/V), then greedy-decodes N
 * tokens (argmax through next_dist top_k 1, one forward per token). Prints one JSON object:
 *   {"device": "...", "logits": [vocab floats of the last prompt position], "greedy": [N ids]}
 * Exit status 0 on success, 2 for usage errors, 1 when the engine fails (message on stderr;
 * "backend cuda: no CUDA device" where there is none). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "eng_cuda.h"

#define PAGE 16

static int fail(const char *what, const pie_status *st) {
    fprintf(stderr, "pie-cuda-run: %s: %s\n", what, st->msg);
    return 1;
}

static uint32_t parse_tokens(const char *s, uint32_t **out) {
    uint32_t n = 1;
    for (const char *p = s; *p; p++) n += *p == ',';
    uint32_t *t = malloc(sizeof *t * n);
    if (!t) return 0;
    char *end;
    for (uint32_t i = 0; i < n; i++) {
        t[i] = (uint32_t)strtoul(s, &end, 10);
        if (end == s) {
            free(t);
            return 0;
        }
        s = *end == ',' ? end + 1 : end;
    }
    *out = t;
    return n;
}

int main(int argc, char **argv) {
    const char *model = NULL, *toks = NULL;
    uint32_t greedy = 0;
    bool graphs = true;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--model") && i + 1 < argc)
            model = argv[++i];
        else if (!strcmp(argv[i], "--tokens") && i + 1 < argc)
            toks = argv[++i];
        else if (!strcmp(argv[i], "--greedy") && i + 1 < argc)
            greedy = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--no-graphs"))
            graphs = false;
        else
            model = NULL, i = argc;
    }
    uint32_t *prompt = NULL, P = toks ? parse_tokens(toks, &prompt) : 0;
    if (!model || P == 0 || greedy > 4096) {
        fprintf(stderr, "usage: pie-cuda-run --model DIR --tokens ID,ID,... [--greedy N <= 4096] "
                        "[--no-graphs]\n");
        free(prompt);
        return 2;
    }
    uint32_t total = P + greedy, pages_n = (total + PAGE - 1) / PAGE;
    eng_opts o = {.model_dir = model,
                  .backend = ENG_BACKEND_CUDA,
                  .kv_page_size = PAGE,
                  .kv_pages = pages_n,
                  .embed_slots = P + 2,
                  .max_batch_tokens = P};
    pie_status st;
    eng_cuda *e = NULL;
    int rc = 1;
    uint32_t *slots = malloc(sizeof *slots * P), *pos = malloc(sizeof *pos * P),
             *pages = malloc(sizeof *pages * pages_n), *gen = malloc(sizeof *gen * (greedy + 1));
    float *logits = NULL;
    if (!slots || !pos || !pages || !gen) goto done;
    if (eng_cuda_open(&o, &e, &st) != PIE_OK) {
        rc = fail("open", &st);
        goto done;
    }
    eng_cuda_set_graphs(e, graphs);
    const eng_info *in = eng_cuda_get_info(e);
    logits = malloc(sizeof *logits * in->vocab_size);
    if (!logits) goto done;
    for (uint32_t i = 0; i < P; i++) slots[i] = i, pos[i] = i;
    for (uint32_t j = 0; j < pages_n; j++) pages[j] = j;
    uint32_t out = P, in_slot = P + 1;
    if (eng_cuda_embed_text(e, slots, prompt, pos, P, &st) != PIE_OK) {
        rc = fail("embed", &st);
        goto done;
    }
    eng_forward_item it = {.kv_pages = pages,
                           .n_kv_pages = (P + PAGE - 1) / PAGE,
                           .kv_last_page_len = (P - 1) % PAGE + 1,
                           .append_kv = true,
                           .in_slots = slots,
                           .n_in = P,
                           .out_slots = &out,
                           .n_out = 1};
    if (eng_cuda_forward(e, &it, 1, &st) != PIE_OK ||
        eng_cuda_logits(e, out, logits, &st) != PIE_OK) {
        rc = fail("prefill", &st);
        goto done;
    }
    for (uint32_t s = 0; s < greedy; s++) {
        float p;
        eng_dist_item d = {out, 1, 1.0f, &gen[s], &p};
        if (eng_cuda_next_dist(e, &d, 1, &st) != PIE_OK) {
            rc = fail("next_dist", &st);
            goto done;
        }
        if (s + 1 == greedy) break;
        uint32_t at = P + s, n = at + 1;
        if (eng_cuda_embed_text(e, &in_slot, &gen[s], &at, 1, &st) != PIE_OK) {
            rc = fail("embed", &st);
            goto done;
        }
        eng_forward_item dec = {.kv_pages = pages,
                                .n_kv_pages = (n + PAGE - 1) / PAGE,
                                .kv_last_page_len = (n - 1) % PAGE + 1,
                                .append_kv = true,
                                .in_slots = &in_slot,
                                .n_in = 1,
                                .out_slots = &out,
                                .n_out = 1};
        if (eng_cuda_forward(e, &dec, 1, &st) != PIE_OK) {
            rc = fail("decode", &st);
            goto done;
        }
    }
    printf("{\"device\": \"%s\", \"logits\": [", eng_cuda_device_name(e));
    for (uint32_t v = 0; v < in->vocab_size; v++)
        printf("%s%.9g", v ? ", " : "", (double)logits[v]);
    printf("], \"greedy\": [");
    for (uint32_t s = 0; s < greedy; s++) printf("%s%u", s ? ", " : "", gen[s]);
    printf("]}\n");
    rc = 0;
done:
    eng_cuda_close(e);
    free(prompt), free(slots), free(pos), free(pages), free(gen), free(logits);
    return rc;
}
