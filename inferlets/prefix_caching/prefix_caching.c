/* prefix_caching.c — reuses the KV of a shared prompt prefix across instances.
 *
 * The prefix (e.g. a long system prompt) is looked up as a persistent export named after a hash
 * of its text. On a miss the instance fills it and exports its pages; on a hit it imports
 * them instead of recomputing. Either way it then fills the prompt and generates. The imported
 * pages are read-only: the SDK copies the partial last page before appending to it.
 *
 * Arguments: --prefix TEXT, --prompt TEXT, --max-tokens N (default 32), --name NAME (export
 * name; default "prefix-cache/<fnv-1a 64 of the prefix>"), --no-cache (fill everything, touch
 * no export), --unexport (remove the export and exit), --ignore-eos.
 * Output: a message "hit", "miss" or "off", then the completion (greedy) as a message. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pie.h"

static uint64_t fnv1a64(const char *s) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
    return h;
}

/* The prefix's tokens exactly as ctx_fill would put them: BOS (if the model has one), text. */
static uint32_t *prefix_tokens(const pie_model *m, const char *prefix, size_t *n) {
    size_t nt;
    uint32_t *t = pie_encode(m, prefix, strlen(prefix), true, &nt);
    bool bos = m->info.has_bos_token && (nt == 0 || t[0] != m->info.bos_token_id);
    uint32_t *all = pie_xmalloc((nt + 1) * sizeof *all);
    if (bos) all[0] = m->info.bos_token_id;
    memcpy(all + bos, t, nt * sizeof *t);
    free(t);
    *n = nt + bos;
    return all;
}

/* Fills the prefix into c from the cache or computes and publishes it; returns "hit"/"miss". */
static const char *load_prefix(pie_ctx *c, const char *name, const char *prefix) {
    size_t n;
    uint32_t *toks = prefix_tokens(c->model, prefix, &n);
    int32_t rc = ctx_import_try(c, name, toks, n);
    free(toks);
    if (rc == 0) return "hit";
    if (rc != PIE_ABI_E_NOT_FOUND) pie_fatal("import \"%s\": %s", name, pie_error());
    ctx_fill(c, prefix);
    rc = ctx_export_try(c, name, true);
    /* Another instance may have published the same prefix meanwhile: ours is just as good. */
    if (rc < 0 && rc != PIE_ABI_E_ALREADY_EXISTS) pie_fatal("export \"%s\": %s", name, pie_error());
    return "miss";
}

int main(int argc, char **argv) {
    const char *prefix = pie_arg_str(argc, argv, "prefix", "You are a helpful assistant.");
    const char *prompt = pie_arg_str(argc, argv, "prompt", " Hello");
    char default_name[64];
    snprintf(default_name, sizeof default_name, "prefix-cache/%016llx",
             (unsigned long long)fnv1a64(prefix));
    const char *name = pie_arg_str(argc, argv, "name", default_name);
    pie_stop stop = {
        .max_tokens = (uint32_t)pie_arg_int(argc, argv, "max-tokens", 32),
        .ignore_model_stop_tokens = pie_arg_flag(argc, argv, "ignore-eos"),
    };

    pie_ctx *c = ctx_new(NULL);
    if (pie_arg_flag(argc, argv, "unexport")) {
        ctx_unexport(c, name);
        pie_queue_sync(c->queue, "unexport");
        pie_send_string("unexported");
        ctx_free(c);
        return 0;
    }
    const char *how = "off";
    if (pie_arg_flag(argc, argv, "no-cache")) ctx_fill(c, prefix);
    else how = load_prefix(c, name, prefix);
    pie_send_string(how);

    ctx_fill(c, prompt);
    pie_sampler s = pie_sampler_greedy();
    pie_output out = {0};
    ctx_generate(c, &s, &stop, &out);
    pie_send_bytes(out.text.data, out.text.len);
    pie_output_free(&out);
    ctx_free(c);
    return 0;
}
