/* probe.c — pie-engine-probe: drives the engine (services/worker/engine/eng.h) from a JSON
 * script on stdin and prints the results as one JSON document.
 *
 * Owns: the script format and its translation into eng_* calls, exactly as PROTOCOL.md in this
 * folder says (the PyTorch reference test, tests/python/test_forward_reference.py, relies on
 * it). A malformed operation gives that operation an error result (INVALID_ARGUMENT) and the
 * script goes on; a malformed script (not JSON, no "ops" list) is a usage error (exit 2).
 * Does not own: any semantics of the operations (the engine checks its inputs). */
#include <errno.h>
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "eng.h"
#include "tok.h"

/* ---- reading JSON fields ------------------------------------------------------------------- */

/* Field readers: `key` of op, required. Messages start with `where` ("forward: items[2]: ").
 * get_u32s: a list of uint32, *out malloc'ed (NULL when empty). */
static pie_code get_u32s(const char *where, const json_t *op, const char *key, uint32_t **out,
                         uint32_t *n, pie_status *st) {
    *out = NULL;
    *n = 0;
    const json_t *a = json_object_get(op, key);
    if (!json_is_array(a))
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "%s%s: expected a list of integers", where,
                              key);
    size_t len = json_array_size(a);
    if (len > UINT32_MAX)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "%s%s: too long", where, key);
    if (len == 0) return PIE_OK;
    uint32_t *v = malloc(len * sizeof *v);
    if (!v) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "%s%s: out of memory", where, key);
    for (size_t i = 0; i < len; i++) {
        const json_t *x = json_array_get(a, i);
        if (!json_is_integer(x) || json_integer_value(x) < 0 ||
            json_integer_value(x) > (json_int_t)UINT32_MAX) {
            free(v);
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "%s%s[%zu]: expected an integer in [0, 2^32)", where, key, i);
        }
        v[i] = (uint32_t)json_integer_value(x);
    }
    *out = v;
    *n = (uint32_t)len;
    return PIE_OK;
}

static pie_code get_u32(const char *where, const json_t *op, const char *key, uint32_t *out,
                        pie_status *st) {
    const json_t *x = json_object_get(op, key);
    if (!json_is_integer(x) || json_integer_value(x) < 0 ||
        json_integer_value(x) > (json_int_t)UINT32_MAX)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "%s%s: expected an integer in [0, 2^32)",
                              where, key);
    *out = (uint32_t)json_integer_value(x);
    return PIE_OK;
}

static pie_code get_bool(const char *where, const json_t *op, const char *key, bool *out,
                         pie_status *st) {
    const json_t *x = json_object_get(op, key);
    if (!json_is_boolean(x))
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "%s%s: expected true or false", where, key);
    *out = json_is_true(x);
    return PIE_OK;
}

static pie_code get_float(const char *where, const json_t *op, const char *key, float *out,
                          pie_status *st) {
    const json_t *x = json_object_get(op, key);
    if (!json_is_number(x))
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "%s%s: expected a number", where, key);
    *out = (float)json_number_value(x);
    return PIE_OK;
}

static const json_t *get_list(const char *where, const json_t *op, const char *key,
                              pie_status *st) {
    const json_t *a = json_object_get(op, key);
    if (!json_is_array(a))
        (void)pie_status_set(st, PIE_INVALID_ARGUMENT, "%s%s: expected a list", where, key);
    return json_is_array(a) ? a : NULL;
}

/* ---- building results ---------------------------------------------------------------------- */

/* Appends `v` to list a; false when out of memory. json_array_append_new takes v either way. */
static bool push(json_t *a, json_t *v) { return v && json_array_append_new(a, v) == 0; }

static bool put(json_t *o, const char *key, json_t *v) {
    return v && json_object_set_new(o, key, v) == 0;
}

static pie_code oom(pie_status *st) {
    return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory building the result");
}

/* ---- operations ---------------------------------------------------------------------------- */

static pie_code op_embed(eng *e, const json_t *op, json_t *res, pie_status *st) {
    (void)res;
    uint32_t *slots = NULL, *tokens = NULL, *positions = NULL, ns = 0, nt = 0, np = 0;
    pie_code rc = get_u32s("embed: ", op, "slots", &slots, &ns, st);
    if (rc == PIE_OK) rc = get_u32s("embed: ", op, "tokens", &tokens, &nt, st);
    if (rc == PIE_OK) rc = get_u32s("embed: ", op, "positions", &positions, &np, st);
    if (rc == PIE_OK && (ns != nt || ns != np))
        rc = pie_status_set(st, PIE_INVALID_ARGUMENT,
                            "embed: slots, tokens and positions have %u, %u and %u entries", ns, nt,
                            np);
    if (rc == PIE_OK) rc = eng_embed_text(e, slots, tokens, positions, ns, st);
    free(slots);
    free(tokens);
    free(positions);
    return rc;
}

/* The arrays of one forward item, owned by the probe. */
typedef struct probe_item {
    uint32_t *pages, *in, *out, *runs;
} probe_item;

static pie_code parse_item(const json_t *j, eng_forward_item *it, probe_item *own, size_t i,
                           pie_status *st) {
    char where[48];
    snprintf(where, sizeof where, "forward: items[%zu]: ", i);
    if (!json_is_object(j))
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "%sexpected an object", where);
    uint32_t n_pages = 0, n_in = 0, n_out = 0, n_runs = 0;
    pie_code rc = get_u32s(where, j, "kv_pages", &own->pages, &n_pages, st);
    if (rc == PIE_OK) rc = get_u32(where, j, "kv_last_page_len", &it->kv_last_page_len, st);
    if (rc == PIE_OK) rc = get_bool(where, j, "append_kv", &it->append_kv, st);
    if (rc == PIE_OK) rc = get_u32s(where, j, "in_slots", &own->in, &n_in, st);
    if (rc == PIE_OK) rc = get_u32s(where, j, "out_slots", &own->out, &n_out, st);
    const json_t *runs = json_object_get(j, "mask_runs");
    if (rc == PIE_OK && runs && !json_is_null(runs)) {
        rc = get_u32s(where, j, "mask_runs", &own->runs, &n_runs, st);
        /* present but empty: a mask with no runs (the engine refuses it), not "causal" */
        static const uint32_t no_runs[1] = {0};
        it->mask_runs = own->runs ? own->runs : no_runs;
    }
    if (rc != PIE_OK) return rc;
    it->kv_pages = own->pages;
    it->n_kv_pages = n_pages;
    it->in_slots = own->in;
    it->n_in = n_in;
    it->out_slots = own->out;
    it->n_out = n_out;
    it->n_mask_runs = n_runs;
    return PIE_OK;
}

static pie_code op_forward(eng *e, const json_t *op, json_t *res, pie_status *st) {
    (void)res;
    const json_t *list = get_list("forward: ", op, "items", st);
    if (!list) return st->code;
    size_t n = json_array_size(list);
    eng_forward_item *items = calloc(n ? n : 1, sizeof *items);
    probe_item *own = calloc(n ? n : 1, sizeof *own);
    pie_code rc = PIE_OK;
    if (!items || !own) rc = pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "forward: out of memory");
    for (size_t i = 0; rc == PIE_OK && i < n; i++)
        rc = parse_item(json_array_get(list, i), &items[i], &own[i], i, st);
    if (rc == PIE_OK) rc = eng_forward(e, items, (uint32_t)n, st);
    for (size_t i = 0; own && i < n; i++) {
        free(own[i].pages);
        free(own[i].in);
        free(own[i].out);
        free(own[i].runs);
    }
    free(own);
    free(items);
    return rc;
}

static pie_code op_mask_page(eng *e, const json_t *op, json_t *res, pie_status *st) {
    (void)res;
    uint32_t page = 0, ps = eng_get_info(e)->kv_page_size;
    pie_code rc = get_u32("mask_page: ", op, "page", &page, st);
    if (rc != PIE_OK) return rc;
    const json_t *m = get_list("mask_page: ", op, "masked", st);
    if (!m) return st->code;
    if (json_array_size(m) != ps)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "mask_page: masked has %zu entries, expected kv_page_size %u",
                              json_array_size(m), ps);
    bool *masked = malloc(ps * sizeof *masked);
    if (!masked) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "mask_page: out of memory");
    for (uint32_t i = 0; i < ps && rc == PIE_OK; i++) {
        const json_t *b = json_array_get(m, i);
        if (!json_is_boolean(b))
            rc = pie_status_set(st, PIE_INVALID_ARGUMENT,
                                "mask_page: masked[%u]: expected true or false", i);
        else
            masked[i] = json_is_true(b);
    }
    if (rc == PIE_OK) rc = eng_mask_page(e, page, masked, st);
    free(masked);
    return rc;
}

static pie_code op_copy_pages(eng *e, const json_t *op, json_t *res, pie_status *st) {
    (void)res;
    const json_t *list = get_list("copy_pages: ", op, "items", st);
    if (!list) return st->code;
    size_t n = json_array_size(list);
    eng_copy_item *items = calloc(n ? n : 1, sizeof *items);
    if (!items) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "copy_pages: out of memory");
    pie_code rc = PIE_OK;
    for (size_t i = 0; rc == PIE_OK && i < n; i++) {
        const json_t *j = json_array_get(list, i);
        eng_copy_item *c = &items[i];
        char where[48];
        snprintf(where, sizeof where, "copy_pages: items[%zu]: ", i);
        rc = get_u32(where, j, "src", &c->src, st);
        if (rc == PIE_OK) rc = get_u32(where, j, "dst", &c->dst, st);
        if (rc == PIE_OK) rc = get_u32(where, j, "src_off", &c->src_off, st);
        if (rc == PIE_OK) rc = get_u32(where, j, "dst_off", &c->dst_off, st);
        if (rc == PIE_OK) rc = get_u32(where, j, "count", &c->count, st);
    }
    if (rc == PIE_OK) rc = eng_copy_pages(e, items, (uint32_t)n, st);
    free(items);
    return rc;
}

static pie_code op_logits(eng *e, const json_t *op, json_t *res, pie_status *st) {
    uint32_t slot = 0, vocab = eng_get_info(e)->vocab_size;
    pie_code rc = get_u32("logits: ", op, "slot", &slot, st);
    if (rc != PIE_OK) return rc;
    float *lg = malloc(vocab * sizeof *lg);
    if (!lg) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "logits: out of memory");
    rc = eng_logits(e, slot, lg, st);
    json_t *a = rc == PIE_OK ? json_array() : NULL;
    if (rc == PIE_OK && !put(res, "logits", a)) rc = oom(st);
    for (uint32_t i = 0; rc == PIE_OK && i < vocab; i++)
        if (!push(a, json_real(lg[i])))
            rc = pie_status_set(st, PIE_INTERNAL, "logits: logit %u is %g (not finite)", i,
                                (double)lg[i]);
    free(lg);
    return rc;
}

static pie_code op_next_dist(eng *e, const json_t *op, json_t *res, pie_status *st) {
    eng_dist_item it = {0};
    pie_code rc = get_u32("next_dist: ", op, "slot", &it.slot, st);
    if (rc == PIE_OK) rc = get_u32("next_dist: ", op, "top_k", &it.top_k, st);
    if (rc == PIE_OK) rc = get_float("next_dist: ", op, "temperature", &it.temperature, st);
    if (rc != PIE_OK) return rc;
    uint32_t k = it.top_k <= eng_get_info(e)->vocab_size ? it.top_k : 0;
    it.ids = malloc((k ? k : 1) * sizeof *it.ids);
    it.probs = malloc((k ? k : 1) * sizeof *it.probs);
    if (!it.ids || !it.probs)
        rc = pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "next_dist: out of memory");
    if (rc == PIE_OK) rc = eng_next_dist(e, &it, 1, st);
    json_t *ids = rc == PIE_OK ? json_array() : NULL;
    json_t *probs = rc == PIE_OK ? json_array() : NULL;
    if (rc == PIE_OK && !put(res, "ids", ids)) {
        json_decref(probs);
        rc = oom(st);
    }
    if (rc == PIE_OK && !put(res, "probs", probs)) rc = oom(st);
    for (uint32_t i = 0; rc == PIE_OK && i < k; i++)
        if (!push(ids, json_integer(it.ids[i])) || !push(probs, json_real(it.probs[i])))
            rc = oom(st);
    free(it.ids);
    free(it.probs);
    return rc;
}

/* Prefill of tokens (positions 0..P-1) appending into pages, then argmax decode steps. */
static pie_code greedy_run(eng *e, const uint32_t *tokens, uint32_t P, uint32_t steps,
                           const uint32_t *pages, uint32_t n_pages, uint32_t base, float *lg,
                           uint32_t *slots, uint32_t *pos, json_t *out, pie_status *st) {
    const eng_info *in = eng_get_info(e);
    uint32_t ps = in->kv_page_size;
    for (uint32_t i = 0; i < P; i++) {
        slots[i] = base + i;
        pos[i] = i;
    }
    pie_code rc = eng_embed_text(e, slots, tokens, pos, P, st);
    uint32_t total = P, out_slot = base + P - 1;
    for (uint32_t step = 0; rc == PIE_OK; step++) {
        uint32_t need = (total + ps - 1) / ps;
        if (need > n_pages)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "greedy: %u tokens need %u pages, %u given", total, need,
                                  n_pages);
        eng_forward_item it = {.kv_pages = pages,
                               .n_kv_pages = need,
                               .kv_last_page_len = (total - 1) % ps + 1,
                               .append_kv = true,
                               .in_slots = slots, /* prefill: all P; decode: the first */
                               .n_in = step == 0 ? P : 1,
                               .out_slots = &out_slot,
                               .n_out = 1};
        rc = eng_forward(e, &it, 1, st);
        if (rc == PIE_OK) rc = eng_logits(e, out_slot, lg, st);
        if (rc != PIE_OK) break;
        uint32_t best = 0;
        for (uint32_t v = 1; v < in->vocab_size; v++)
            if (lg[v] > lg[best]) best = v;
        if (!push(out, json_integer(best))) return oom(st);
        if (step + 1 == steps) break;
        /* the next input goes into the first slot of the range, at the next position */
        rc = eng_embed_text(e, &slots[0], &best, &total, 1, st);
        total++;
    }
    return rc;
}

static pie_code op_greedy(eng *e, const json_t *op, json_t *res, pie_status *st) {
    uint32_t *tokens = NULL, *pages = NULL, P = 0, n_pages = 0, steps = 0, base = 0;
    uint32_t *slots = NULL, *pos = NULL;
    float *lg = NULL;
    pie_code rc = get_u32s("greedy: ", op, "tokens", &tokens, &P, st);
    if (rc == PIE_OK) rc = get_u32("greedy: ", op, "steps", &steps, st);
    if (rc == PIE_OK) rc = get_u32s("greedy: ", op, "pages", &pages, &n_pages, st);
    if (rc == PIE_OK) rc = get_u32("greedy: ", op, "slot_base", &base, st);
    if (rc == PIE_OK && (P == 0 || steps == 0))
        rc = pie_status_set(st, PIE_INVALID_ARGUMENT,
                            "greedy: tokens has %u entries and steps is %u (both must be >= 1)", P,
                            steps);
    if (rc == PIE_OK && (uint64_t)base + P > eng_get_info(e)->embed_slots)
        rc = pie_status_set(st, PIE_INVALID_ARGUMENT, "greedy: slots %u..%u exceed embed_slots %u",
                            base, base + P - 1, eng_get_info(e)->embed_slots);
    json_t *out = json_array();
    if (rc == PIE_OK && !put(res, "tokens", out))
        rc = oom(st);
    else if (rc != PIE_OK)
        json_decref(out);
    if (rc == PIE_OK) {
        lg = malloc(eng_get_info(e)->vocab_size * sizeof *lg);
        slots = malloc(P * sizeof *slots);
        pos = malloc(P * sizeof *pos);
        if (!lg || !slots || !pos)
            rc = pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "greedy: out of memory");
    }
    if (rc == PIE_OK)
        rc = greedy_run(e, tokens, P, steps, pages, n_pages, base, lg, slots, pos, out, st);
    free(tokens);
    free(pages);
    free(slots);
    free(pos);
    free(lg);
    return rc;
}

/* Encodes `text` with the tokenizer.json at `tokenizer` (loaded for this op: the engine does not
 * own a tokenizer); `allow_special` (optional, default false) as tok_encode's. */
static pie_code op_tokenize(eng *e, const json_t *op, json_t *res, pie_status *st) {
    (void)e;
    const char *path = json_string_value(json_object_get(op, "tokenizer"));
    const json_t *text = json_object_get(op, "text");
    bool allow_special = false;
    if (!path || !json_is_string(text))
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "tokenize: \"tokenizer\" (a path) and \"text\" must be strings");
    if (json_object_get(op, "allow_special")) {
        pie_code rc = get_bool("tokenize: ", op, "allow_special", &allow_special, st);
        if (rc != PIE_OK) return rc;
    }
    tok *t = NULL;
    uint32_t *ids = NULL;
    size_t n = 0;
    pie_code rc = tok_load(path, &t, st);
    if (rc == PIE_OK)
        rc = tok_encode(t, json_string_value(text), json_string_length(text), allow_special, &ids,
                        &n, st);
    json_t *a = rc == PIE_OK ? json_array() : NULL;
    if (rc == PIE_OK && !put(res, "ids", a)) rc = oom(st);
    for (size_t i = 0; rc == PIE_OK && i < n; i++)
        if (!push(a, json_integer(ids[i]))) rc = oom(st);
    free(ids);
    tok_free(t);
    return rc;
}

typedef pie_code (*op_fn)(eng *e, const json_t *op, json_t *res, pie_status *st);

static const struct {
    const char *name;
    op_fn fn;
} OPS[] = {
    {"embed", op_embed},           {"forward", op_forward}, {"mask_page", op_mask_page},
    {"copy_pages", op_copy_pages}, {"logits", op_logits},   {"next_dist", op_next_dist},
    {"greedy", op_greedy},         {"tokenize", op_tokenize},
};

/* One operation's result object: the op's fields, or {"error", "code"}. NULL: out of memory. */
static json_t *run_op(eng *e, const json_t *op, size_t index) {
    pie_status st = {0};
    json_t *res = json_object();
    if (!res) return NULL;
    const char *name = json_string_value(json_object_get(op, "op"));
    pie_code rc = PIE_INVALID_ARGUMENT;
    if (!json_is_object(op) || !name) {
        (void)pie_status_set(&st, rc, "ops[%zu]: expected an object with a string \"op\"", index);
    } else {
        size_t i = 0;
        while (i < sizeof OPS / sizeof OPS[0] && strcmp(OPS[i].name, name) != 0) i++;
        if (i == sizeof OPS / sizeof OPS[0])
            (void)pie_status_set(&st, rc, "ops[%zu]: unknown op \"%s\"", index, name);
        else
            rc = OPS[i].fn(e, op, res, &st);
    }
    if (rc == PIE_OK) return res;
    json_object_clear(res);
    if (!put(res, "error", json_string(st.msg)) || !put(res, "code", json_integer(rc))) {
        json_decref(res);
        return NULL;
    }
    return res;
}

static json_t *info_json(const eng_info *in) {
    json_t *o = json_object();
    bool ok = o && put(o, "architecture", json_string(in->architecture)) &&
              put(o, "dtype", json_string(in->dtype)) &&
              put(o, "vocab_size", json_integer(in->vocab_size)) &&
              put(o, "hidden_size", json_integer(in->hidden_size)) &&
              put(o, "intermediate_size", json_integer(in->intermediate_size)) &&
              put(o, "n_layers", json_integer(in->n_layers)) &&
              put(o, "n_heads", json_integer(in->n_heads)) &&
              put(o, "n_kv_heads", json_integer(in->n_kv_heads)) &&
              put(o, "head_dim", json_integer(in->head_dim)) &&
              put(o, "max_position", json_integer(in->max_position)) &&
              put(o, "bos_token_id", json_integer(in->bos_token_id)) &&
              put(o, "eos_token_id", json_integer(in->eos_token_id)) &&
              put(o, "kv_page_size", json_integer(in->kv_page_size)) &&
              put(o, "kv_pages", json_integer(in->kv_pages)) &&
              put(o, "embed_slots", json_integer(in->embed_slots)) &&
              put(o, "max_batch_tokens", json_integer(in->max_batch_tokens)) &&
              put(o, "weight_bytes", json_integer((json_int_t)in->weight_bytes)) &&
              put(o, "kv_pool_bytes", json_integer((json_int_t)in->kv_pool_bytes)) &&
              put(o, "embed_pool_bytes", json_integer((json_int_t)in->embed_pool_bytes)) &&
              put(o, "scratch_bytes", json_integer((json_int_t)in->scratch_bytes)) &&
              put(o, "kv_dtype", json_string(in->kv_dtype));
    if (!ok) {
        json_decref(o);
        return NULL;
    }
    return o;
}

/* ---- main ---------------------------------------------------------------------------------- */

static int usage(const char *msg) {
    fprintf(stderr,
            "pie-engine-probe: %s\n"
            "usage: pie-engine-probe --model DIR [--page-size 16] [--pages 256] [--slots 1024]\n"
            "                        [--threads N] [--max-batch-tokens 4096] [--kv-dtype f32|bf16]\n"
            "                        < script.json\n",
            msg);
    return 2;
}

static bool parse_uint(const char *s, uint32_t *out) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end || s[0] == '-' || v > UINT32_MAX) return false;
    *out = (uint32_t)v;
    return true;
}

int main(int argc, char **argv) {
    eng_opts o = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        uint32_t v = 0;
        if (i + 1 >= argc) return usage("every option takes a value");
        const char *val = argv[++i];
        if (strcmp(a, "--model") == 0) {
            o.model_dir = val;
            continue;
        }
        if (strcmp(a, "--kv-dtype") == 0) {
            if (strcmp(val, "f32") != 0 && strcmp(val, "bf16") != 0)
                return usage("--kv-dtype is f32 or bf16");
            o.kv_dtype = strcmp(val, "bf16") == 0 ? ENG_KV_BF16 : ENG_KV_F32;
            continue;
        }
        if (!parse_uint(val, &v)) return usage("option values must be unsigned integers");
        if (strcmp(a, "--page-size") == 0)
            o.kv_page_size = v;
        else if (strcmp(a, "--pages") == 0)
            o.kv_pages = v;
        else if (strcmp(a, "--slots") == 0)
            o.embed_slots = v;
        else if (strcmp(a, "--threads") == 0 && v <= 4096)
            o.n_threads = (int)v;
        else if (strcmp(a, "--max-batch-tokens") == 0)
            o.max_batch_tokens = v;
        else
            return usage("unknown option");
    }
    if (!o.model_dir) return usage("--model is required");

    json_error_t jerr;
    json_t *script = json_loadf(stdin, 0, &jerr);
    if (!script) {
        fprintf(stderr, "pie-engine-probe: stdin: line %d: %s\n", jerr.line, jerr.text);
        return 2;
    }
    const json_t *ops = json_object_get(script, "ops");
    if (!json_is_array(ops)) {
        json_decref(script);
        return usage("the script must be an object with a list \"ops\"");
    }

    pie_status st = {0};
    eng *e = NULL;
    if (eng_open(&o, &e, &st) != PIE_OK) {
        fprintf(stderr, "pie-engine-probe: %s\n", st.msg);
        json_decref(script);
        return 1;
    }
    int status = 1;
    json_t *doc = json_object(), *results = NULL;
    /* put() hands its value to doc or frees it, so nothing leaks when one fails */
    if (!put(doc, "info", info_json(eng_get_info(e))) ||
        !put(doc, "results", results = json_array()))
        goto done;
    for (size_t i = 0; i < json_array_size(ops); i++)
        if (!push(results, run_op(e, json_array_get(ops, i), i))) goto done;
    if (json_dumpf(doc, stdout, JSON_COMPACT | JSON_REAL_PRECISION(9)) != 0 ||
        fputc('\n', stdout) == EOF || fflush(stdout) != 0)
        goto done;
    status = 0;
done:
    if (status != 0) fprintf(stderr, "pie-engine-probe: out of memory or cannot write stdout\n");
    json_decref(doc);
    json_decref(script);
    eng_close(e);
    return status;
}
