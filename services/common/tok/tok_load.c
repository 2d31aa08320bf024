/* tok_load.c — reading a Hugging Face tokenizer.json into a struct tok.
 *
 * Owns: the JSON schema this tokenizer accepts (model BPE with vocab and merges in both forms,
 * ignore_merges, unk_token; added_tokens; normalizer null or NFC; pre_tokenizer Split /
 * ByteLevel / Sequence of them; decoder ByteLevel), building the lookup tables of tok_int.h,
 * compiling the pre-tokenizer regexes (tok_regex.c), and the byte-level mapping.
 * Does not own: what the tables are used for (tok_encode.c, tok_decode.c).
 *
 * Every error names the file (or the name given to tok_load_json), the JSON field and what was
 * wrong with it, e.g. "tok: /m/tokenizer.json: model.merges[17] "a bc": "abc" is not in
 * model.vocab". */
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>

#include "pie_utf8.h"
#include "tok_int.h"

/* The pre-tokenizer regex of GPT-2, built into HF's ByteLevel pre-tokenizer (use_regex). */
static const char TOK_GPT2_PATTERN[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

/* Most pre-tokenizer steps accepted (real tokenizers have one or two). */
#define TOK_MAX_STEPS 64

/* Largest id accepted in a tokenizer.json: ids index arrays, so an absurd one is an error. */
#define TOK_MAX_ID (1u << 28)

uint32_t tok_byte_to_cp(uint8_t b) {
    if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174) return b;
    if (b <= 32) return 256u + b;
    if (b <= 160) return 256u + 33u + (uint32_t)(b - 127);
    return 256u + 67u; /* 173 */
}

int tok_cp_to_byte(uint32_t cp) {
    if (cp < 256) {
        uint8_t b = (uint8_t)cp;
        return tok_byte_to_cp(b) == cp ? (int)b : -1;
    }
    if (cp > 256 + 67) return -1;
    uint32_t k = cp - 256;
    if (k <= 32) return (int)k;
    if (k <= 66) return (int)(k - 33 + 127);
    return 173;
}

/* Decodes one code point of valid UTF-8 (jansson strings are valid UTF-8). */
static uint32_t utf8_next(const uint8_t *p, size_t n, size_t *used) {
    uint32_t cp;
    size_t k = pie_utf8_next(p, n, &cp);
    if (k == 0) { /* cannot happen for jansson strings; treat the byte as Latin-1 */
        *used = 1;
        return p[0];
    }
    *used = k;
    return cp;
}

/* ---- the builder: the tok under construction plus where errors go ---- */

typedef struct tok_builder {
    tok *t;
    const char *name;
    pie_status *st;
    size_t bytes_cap;
} tok_builder;

static pie_code oom(tok_builder *b, const char *what) {
    return pie_status_set(b->st, PIE_RESOURCE_EXHAUSTED, "tok: %s: out of memory while loading %s",
                          b->name, what);
}

/* Appends n bytes to t->bytes; *off is where they start. */
static pie_code bytes_append(tok_builder *b, const uint8_t *p, size_t n, uint32_t *off) {
    tok *t = b->t;
    if (t->bytes_len + n >= UINT32_MAX)
        return pie_status_set(b->st, PIE_INVALID_ARGUMENT,
                              "tok: %s: token bytes exceed 4 GiB in total", b->name);
    if (t->bytes_len + n > b->bytes_cap) {
        size_t cap = b->bytes_cap ? b->bytes_cap : 4096;
        while (cap < t->bytes_len + n) cap *= 2;
        uint8_t *nb = realloc(t->bytes, cap);
        if (nb == NULL) return oom(b, "token bytes");
        t->bytes = nb;
        b->bytes_cap = cap;
    }
    if (n > 0) memcpy(t->bytes + t->bytes_len, p, n);
    *off = (uint32_t)t->bytes_len;
    t->bytes_len += n;
    return PIE_OK;
}

/* Appends the raw bytes of a byte-level token string: each mapped code point becomes its byte;
 * a code point outside the mapping keeps its UTF-8 bytes. */
static pie_code bytes_append_bytelevel(tok_builder *b, const char *s, size_t n, uint32_t *off,
                                       uint32_t *len) {
    uint8_t buf[256] = {0};
    uint8_t *out = n <= sizeof buf ? buf : malloc(n);
    if (out == NULL) return oom(b, "token bytes");
    size_t k = 0;
    const uint8_t *p = (const uint8_t *)s;
    for (size_t i = 0; i < n;) {
        size_t used;
        uint32_t cp = utf8_next(p + i, n - i, &used);
        int byte = tok_cp_to_byte(cp);
        if (byte >= 0) {
            out[k++] = (uint8_t)byte;
        } else {
            memcpy(out + k, p + i, used);
            k += used;
        }
        i += used;
    }
    pie_code rc = bytes_append(b, out, k, off);
    *len = (uint32_t)k;
    if (out != buf) free(out);
    return rc;
}

static uint64_t pow2_at_least(uint64_t n) {
    uint64_t c = 16;
    while (c < n) c *= 2;
    return c;
}

/* ---- model ---- */

/* Reads an id field: a JSON integer in [0, TOK_MAX_ID). */
static pie_code read_id(tok_builder *b, const json_t *v, const char *field, const char *key,
                        uint32_t *id) {
    if (!json_is_integer(v) || json_integer_value(v) < 0 ||
        json_integer_value(v) >= (json_int_t)TOK_MAX_ID)
        return pie_status_set(b->st, PIE_INVALID_ARGUMENT,
                              "tok: %s: %s%s%.60s%s: id must be an integer in 0..%u", b->name,
                              field, key ? "[\"" : "", key ? key : "", key ? "\"]" : "",
                              TOK_MAX_ID - 1);
    *id = (uint32_t)json_integer_value(v);
    return PIE_OK;
}

/* The largest id used by model.vocab and added_tokens, for sizing entries. */
static pie_code scan_ids(tok_builder *b, const json_t *vocab, const json_t *added,
                         uint32_t *n_ids) {
    uint32_t max1 = 0;
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)vocab, key, v) {
        uint32_t id = 0; /* -O3 cannot see that read_id sets it on PIE_OK */
        pie_code rc = read_id(b, v, "model.vocab", key, &id);
        if (rc != PIE_OK) return rc;
        if (id + 1 > max1) max1 = id + 1;
    }
    size_t i;
    json_t *a;
    json_array_foreach((json_t *)added, i, a) {
        char field[64];
        snprintf(field, sizeof field, "added_tokens[%zu].id", i);
        if (!json_is_object(a))
            return pie_status_set(b->st, PIE_INVALID_ARGUMENT,
                                  "tok: %s: added_tokens[%zu]: expected an object", b->name, i);
        uint32_t id = 0;
        pie_code rc = read_id(b, json_object_get(a, "id"), field, NULL, &id);
        if (rc != PIE_OK) return rc;
        if (id + 1 > max1) max1 = id + 1;
    }
    *n_ids = max1;
    return PIE_OK;
}

static void vocab_insert(tok *t, uint32_t id) {
    const tok_entry *e = &t->entries[id];
    uint64_t h = tok_hash(t->bytes + e->vocab_off, e->vocab_len);
    for (uint64_t i = h & t->vocab_mask;; i = (i + 1) & t->vocab_mask) {
        tok_vocab_slot *s = &t->vocab[i];
        if (s->id1 == 0) {
            s->id1 = id + 1;
            s->hash = (uint32_t)h;
            return;
        }
        const tok_entry *o = &t->entries[s->id1 - 1];
        if (s->hash == (uint32_t)h && o->vocab_len == e->vocab_len &&
            memcmp(t->bytes + o->vocab_off, t->bytes + e->vocab_off, e->vocab_len) == 0) {
            /* Two vocab strings with the same bytes (a code point outside the byte-level
             * mapping spelling a byte): the lower id wins, whatever the file's key order. */
            if (id + 1 < s->id1) s->id1 = id + 1;
            return;
        }
    }
}

static pie_code load_vocab(tok_builder *b, const json_t *vocab) {
    tok *t = b->t;
    const char *key;
    json_t *v;
    size_t n_vocab = json_object_size(vocab);
    json_object_foreach((json_t *)vocab, key, v) {
        uint32_t id = (uint32_t)json_integer_value(v); /* checked by scan_ids */
        tok_entry *e = &t->entries[id];
        if (e->flags & TOK_F_VOCAB)
            return pie_status_set(b->st, PIE_INVALID_ARGUMENT,
                                  "tok: %s: model.vocab[\"%.60s\"]: id %" PRIu32
                                  " is already used by another vocab entry",
                                  b->name, key, id);
        size_t klen = strlen(key);
        if (klen == 0)
            return pie_status_set(b->st, PIE_INVALID_ARGUMENT,
                                  "tok: %s: model.vocab: the empty string is not a token (id %" PRIu32 ")",
                                  b->name, id);
        pie_code rc = bytes_append_bytelevel(b, key, klen, &e->vocab_off, &e->vocab_len);
        if (rc != PIE_OK) return rc;
        e->off = e->vocab_off;
        e->len = e->vocab_len;
        e->flags |= TOK_F_VOCAB;
    }
    t->vocab_mask = pow2_at_least(2 * (uint64_t)n_vocab + 1) - 1;
    t->vocab = calloc(t->vocab_mask + 1, sizeof *t->vocab);
    if (t->vocab == NULL) return oom(b, "model.vocab");
    for (uint32_t id = 0; id < t->n_ids; id++)
        if (t->entries[id].flags & TOK_F_VOCAB) vocab_insert(t, id);
    for (int c = 0; c < 256; c++) {
        uint8_t byte = (uint8_t)c;
        t->byte_id[c] = tok_vocab_find(t, &byte, 1);
    }
    return PIE_OK;
}

/* Looks up one side of a merge (a byte-level string) in the vocab. */
static pie_code merge_side(tok_builder *b, size_t i, const char *text, const char *s, size_t n,
                           uint32_t *id) {
    tok *t = b->t;
    size_t mark = t->bytes_len;
    uint32_t off, len;
    pie_code rc = bytes_append_bytelevel(b, s, n, &off, &len);
    if (rc != PIE_OK) return rc;
    *id = tok_vocab_find(t, t->bytes + off, len);
    t->bytes_len = mark; /* scratch only */
    if (*id == TOK_NO_ID)
        return pie_status_set(b->st, PIE_INVALID_ARGUMENT,
                              "tok: %s: model.merges[%zu] %.80s: \"%.*s\" is not in model.vocab",
                              b->name, i, text, (int)(n > 60 ? 60 : n), s);
    return PIE_OK;
}

static pie_code load_merges(tok_builder *b, const json_t *merges) {
    tok *t = b->t;
    size_t n = json_array_size(merges);
    if (n >= UINT32_MAX / 2)
        return pie_status_set(b->st, PIE_INVALID_ARGUMENT, "tok: %s: model.merges: %zu merges is too many",
                              b->name, n);
    t->merge_mask = pow2_at_least(2 * (uint64_t)n + 1) - 1;
    t->merges = malloc((t->merge_mask + 1) * sizeof *t->merges);
    if (t->merges == NULL) return oom(b, "model.merges");
    for (uint64_t i = 0; i <= t->merge_mask; i++) t->merges[i].key = UINT64_MAX;

    size_t i;
    json_t *m;
    json_array_foreach((json_t *)merges, i, m) {
        const char *ls = NULL, *rs = NULL;
        size_t ln = 0, rn = 0;
        char text[96];
        if (json_is_string(m)) {
            const char *s = json_string_value(m);
            size_t sn = json_string_length(m);
            const char *sp = memchr(s, ' ', sn);
            if (sp != NULL && sp != s && sp + 1 != s + sn && memchr(sp + 1, ' ', (size_t)(s + sn - sp - 1)) == NULL) {
                ls = s;
                ln = (size_t)(sp - s);
                rs = sp + 1;
                rn = (size_t)(s + sn - rs);
            }
            snprintf(text, sizeof text, "\"%.60s\"", s);
        } else if (json_is_array(m) && json_array_size(m) == 2 &&
                   json_is_string(json_array_get(m, 0)) && json_is_string(json_array_get(m, 1))) {
            ls = json_string_value(json_array_get(m, 0));
            ln = json_string_length(json_array_get(m, 0));
            rs = json_string_value(json_array_get(m, 1));
            rn = json_string_length(json_array_get(m, 1));
            snprintf(text, sizeof text, "[\"%.30s\", \"%.30s\"]", ls, rs);
            if (ln == 0 || rn == 0) ls = NULL;
        } else {
            snprintf(text, sizeof text, "(a JSON %s)",
                     json_is_array(m) ? "array" : json_is_object(m) ? "object" : "scalar");
        }
        if (ls == NULL)
            return pie_status_set(b->st, PIE_INVALID_ARGUMENT,
                                  "tok: %s: model.merges[%zu] %s: expected \"a b\" or [\"a\", \"b\"] "
                                  "with two non-empty tokens",
                                  b->name, i, text);
        uint32_t left, right;
        pie_code rc = merge_side(b, i, text, ls, ln, &left);
        if (rc == PIE_OK) rc = merge_side(b, i, text, rs, rn, &right);
        if (rc != PIE_OK) return rc;

        /* The merged token: the bytes of left then right. */
        const tok_entry *le = &t->entries[left], *re = &t->entries[right];
        size_t cn = (size_t)le->vocab_len + re->vocab_len;
        uint8_t stack[256];
        uint8_t *cat = cn <= sizeof stack ? stack : malloc(cn);
        if (cat == NULL) return oom(b, "model.merges");
        memcpy(cat, t->bytes + le->vocab_off, le->vocab_len);
        memcpy(cat + le->vocab_len, t->bytes + re->vocab_off, re->vocab_len);
        uint32_t merged = tok_vocab_find(t, cat, cn);
        if (cat != stack) free(cat);
        if (merged == TOK_NO_ID)
            return pie_status_set(b->st, PIE_INVALID_ARGUMENT,
                                  "tok: %s: model.merges[%zu] %s: \"%.*s%.*s\" is not in model.vocab",
                                  b->name, i, text, (int)(ln > 40 ? 40 : ln), ls,
                                  (int)(rn > 40 ? 40 : rn), rs);

        uint64_t key = (uint64_t)left << 32 | right;
        for (uint64_t k = tok_pair_hash(key) & t->merge_mask;; k = (k + 1) & t->merge_mask) {
            tok_merge_slot *s = &t->merges[k];
            if (s->key == key) break; /* a repeated merge keeps its first (best) rank */
            if (s->key == UINT64_MAX) {
                s->key = key;
                s->rank = (uint32_t)i;
                s->id = merged;
                t->n_merges++;
                break;
            }
        }
    }
    return PIE_OK;
}

/* Whether an optional model field is off: absent, null, false or the empty string. */
static bool is_unset(const json_t *v) {
    return v == NULL || json_is_null(v) || json_is_false(v) ||
           (json_is_string(v) && json_string_length(v) == 0);
}

static pie_code load_model(tok_builder *b, const json_t *model) {
    tok *t = b->t;
    const json_t *type = json_object_get(model, "type");
    if (type != NULL && !(json_is_string(type) && strcmp(json_string_value(type), "BPE") == 0))
        return pie_status_set(b->st, PIE_UNIMPLEMENTED,
                              "tok: %s: model.type \"%.40s\" is not supported (only BPE)", b->name,
                              json_is_string(type) ? json_string_value(type) : "(not a string)");
    static const char *const unsupported[] = {"dropout", "continuing_subword_prefix",
                                              "end_of_word_suffix", "byte_fallback"};
    for (size_t i = 0; i < sizeof unsupported / sizeof unsupported[0]; i++)
        if (!is_unset(json_object_get(model, unsupported[i])))
            return pie_status_set(b->st, PIE_UNIMPLEMENTED,
                                  "tok: %s: model.%s is set; only null/false is supported", b->name,
                                  unsupported[i]);

    const json_t *im = json_object_get(model, "ignore_merges");
    if (im != NULL && !json_is_boolean(im))
        return pie_status_set(b->st, PIE_INVALID_ARGUMENT,
                              "tok: %s: model.ignore_merges: expected true or false", b->name);
    t->ignore_merges = json_is_true(im);

    pie_code rc = load_vocab(b, json_object_get(model, "vocab"));
    if (rc != PIE_OK) return rc;

    t->unk_id = TOK_NO_ID;
    const json_t *unk = json_object_get(model, "unk_token");
    if (unk != NULL && !json_is_null(unk)) {
        if (!json_is_string(unk))
            return pie_status_set(b->st, PIE_INVALID_ARGUMENT,
                                  "tok: %s: model.unk_token: expected a string or null", b->name);
        uint32_t off, len;
        size_t mark = t->bytes_len;
        rc = bytes_append_bytelevel(b, json_string_value(unk), json_string_length(unk), &off, &len);
        if (rc != PIE_OK) return rc;
        t->unk_id = tok_vocab_find(t, t->bytes + off, len);
        t->bytes_len = mark;
        if (t->unk_id == TOK_NO_ID)
            return pie_status_set(b->st, PIE_INVALID_ARGUMENT,
                                  "tok: %s: model.unk_token \"%.60s\" is not in model.vocab", b->name,
                                  json_string_value(unk));
    }

    const json_t *merges = json_object_get(model, "merges");
    if (merges == NULL) merges = json_array(); /* a vocab-only BPE; json_array() never shared */
    else json_incref((json_t *)merges);
    if (merges == NULL) return oom(b, "model.merges");
    if (!json_is_array(merges)) {
        json_decref((json_t *)merges);
        return pie_status_set(b->st, PIE_INVALID_ARGUMENT,
                              "tok: %s: model.merges: expected an array", b->name);
    }
    rc = load_merges(b, merges);
    json_decref((json_t *)merges);
    return rc;
}

/* ---- added tokens ---- */

static pie_code trie_add(tok_builder *b, size_t *cap, int32_t added_idx) {
    tok *t = b->t;
    const tok_added *a = &t->added[added_idx];
    int32_t node = 0;
    for (uint32_t i = 0; i < a->len; i++) {
        uint8_t c = t->bytes[a->off + i];
        int32_t child = t->trie[node].first_child;
        while (child >= 0 && t->trie[child].byte != c) child = t->trie[child].next_sibling;
        if (child < 0) {
            if (t->n_trie == *cap) {
                size_t ncap = *cap * 2;
                tok_trie_node *nt = realloc(t->trie, ncap * sizeof *nt);
                if (nt == NULL) return oom(b, "added_tokens");
                t->trie = nt;
                *cap = ncap;
            }
            if (t->n_trie >= INT32_MAX)
                return pie_status_set(b->st, PIE_INVALID_ARGUMENT,
                                      "tok: %s: added_tokens: contents too long in total", b->name);
            child = (int32_t)t->n_trie++;
            t->trie[child] = (tok_trie_node){.first_child = -1,
                                             .next_sibling = t->trie[node].first_child,
                                             .added = -1,
                                             .byte = c};
            t->trie[node].first_child = child;
        }
        node = child;
    }
    if (t->trie[node].added < 0) t->trie[node].added = added_idx; /* first one wins */
    return PIE_OK;
}

static pie_code read_flag(tok_builder *b, const json_t *a, size_t i, const char *key, bool *out) {
    const json_t *v = json_object_get(a, key);
    if (v != NULL && !json_is_boolean(v))
        return pie_status_set(b->st, PIE_INVALID_ARGUMENT,
                              "tok: %s: added_tokens[%zu].%s: expected true or false", b->name, i,
                              key);
    *out = json_is_true(v);
    return PIE_OK;
}

static pie_code load_added(tok_builder *b, const json_t *added) {
    tok *t = b->t;
    size_t n = json_array_size(added);
    size_t trie_cap = 64;
    t->trie = malloc(trie_cap * sizeof *t->trie);
    if (t->trie == NULL) return oom(b, "added_tokens");
    t->trie[0] = (tok_trie_node){.first_child = -1, .next_sibling = -1, .added = -1};
    t->n_trie = 1;
    if (n == 0) return PIE_OK;
    t->added = calloc(n, sizeof *t->added);
    if (t->added == NULL) return oom(b, "added_tokens");

    size_t i;
    json_t *a;
    json_array_foreach((json_t *)added, i, a) {
        tok_added *ad = &t->added[i];
        ad->id = (uint32_t)json_integer_value(json_object_get(a, "id")); /* checked by scan_ids */
        const json_t *content = json_object_get(a, "content");
        if (!json_is_string(content) || json_string_length(content) == 0)
            return pie_status_set(b->st, PIE_INVALID_ARGUMENT,
                                  "tok: %s: added_tokens[%zu].content: expected a non-empty string",
                                  b->name, i);
        pie_code rc = PIE_OK;
        if (rc == PIE_OK) rc = read_flag(b, a, i, "special", &ad->special);
        if (rc == PIE_OK) rc = read_flag(b, a, i, "lstrip", &ad->lstrip);
        if (rc == PIE_OK) rc = read_flag(b, a, i, "rstrip", &ad->rstrip);
        if (rc == PIE_OK) rc = read_flag(b, a, i, "single_word", &ad->single_word);
        if (rc == PIE_OK)
            rc = bytes_append(b, (const uint8_t *)json_string_value(content),
                              json_string_length(content), &ad->off);
        if (rc != PIE_OK) return rc;
        ad->len = (uint32_t)json_string_length(content);

        tok_entry *e = &t->entries[ad->id];
        if (e->flags & TOK_F_ADDED)
            return pie_status_set(b->st, PIE_INVALID_ARGUMENT,
                                  "tok: %s: added_tokens[%zu] \"%.60s\": id %" PRIu32
                                  " is already used by another added token",
                                  b->name, i, json_string_value(content), ad->id);
        /* Decoding an added token gives its content, as HF's added vocabulary does. */
        e->off = ad->off;
        e->len = ad->len;
        e->flags |= TOK_F_ADDED | (ad->special ? TOK_F_SPECIAL : 0);
        t->n_added = i + 1;
        rc = trie_add(b, &trie_cap, (int32_t)i);
        if (rc != PIE_OK) return rc;
        t->added_first[t->bytes[ad->off]] = true;
    }
    return PIE_OK;
}

/* ---- normalizer, pre-tokenizer, decoder ---- */

static const char *type_of(const json_t *v) {
    const json_t *type = json_object_get(v, "type");
    return json_is_string(type) ? json_string_value(type) : NULL;
}

static pie_code load_normalizer(tok_builder *b, const json_t *n) {
    if (n == NULL || json_is_null(n)) return PIE_OK;
    const char *type = type_of(n);
    /* NFC is accepted and not applied: text is taken as already NFC (see README). */
    if (type != NULL && strcmp(type, "NFC") == 0) return PIE_OK;
    if (type != NULL && strcmp(type, "Sequence") == 0) {
        const json_t *list = json_object_get(n, "normalizers");
        size_t i;
        json_t *item;
        json_array_foreach((json_t *)list, i, item) {
            pie_code rc = load_normalizer(b, item);
            if (rc != PIE_OK) return rc;
        }
        return PIE_OK;
    }
    return pie_status_set(b->st, PIE_UNIMPLEMENTED,
                          "tok: %s: normalizer type \"%.40s\" is not supported (only null or NFC)",
                          b->name, type ? type : "(missing)");
}

static pie_code compile_regex(tok_builder *b, const char *field, const char *pattern, size_t n,
                              bool literal, pcre2_code **out) {
    int err = 0;
    size_t erroff = 0;
    pcre2_code *re = tok_regex_compile(pattern, n, literal, &err, &erroff);
    if (re == NULL) {
        if (err == PCRE2_ERROR_NOMEMORY) return oom(b, field);
        PCRE2_UCHAR msg[160];
        if (pcre2_get_error_message(err, msg, sizeof msg) < 0) strcpy((char *)msg, "?");
        return pie_status_set(b->st, PIE_INVALID_ARGUMENT,
                              "tok: %s: %s: the regex does not compile: %s at offset %zu", b->name,
                              field, (const char *)msg, erroff);
    }
    *out = re;
    return PIE_OK;
}

static pie_code add_step(tok_builder *b, const tok_step *s) {
    tok *t = b->t;
    if (t->n_steps == TOK_MAX_STEPS) { /* encoding recurses once per step */
        if (s->re) pcre2_code_free(s->re);
        return pie_status_set(b->st, PIE_INVALID_ARGUMENT,
                              "tok: %s: pre_tokenizer: more than %d steps", b->name, TOK_MAX_STEPS);
    }
    tok_step *ns = realloc(t->steps, (t->n_steps + 1) * sizeof *ns);
    if (ns == NULL) {
        if (s->re) pcre2_code_free(s->re);
        return oom(b, "pre_tokenizer");
    }
    t->steps = ns;
    t->steps[t->n_steps++] = *s;
    return PIE_OK;
}

static pie_code load_split(tok_builder *b, const char *field, const json_t *p) {
    char f[160];
    tok_step s = {.kind = TOK_STEP_SPLIT};
    const json_t *pattern = json_object_get(p, "pattern");
    const json_t *rx = json_object_get(pattern, "Regex");
    const json_t *lit = json_object_get(pattern, "String");
    const json_t *src = json_is_string(rx) ? rx : lit;
    if (!json_is_string(src))
        return pie_status_set(b->st, PIE_INVALID_ARGUMENT,
                              "tok: %s: %s.pattern: expected {\"Regex\": \"...\"} or {\"String\": \"...\"}",
                              b->name, field);
    if (json_string_length(src) == 0)
        return pie_status_set(b->st, PIE_INVALID_ARGUMENT, "tok: %s: %s.pattern: empty pattern",
                              b->name, field);

    static const struct { const char *name; tok_split_behavior b; } behaviors[] = {
        {"Isolated", TOK_SPLIT_ISOLATED},
        {"Removed", TOK_SPLIT_REMOVED},
        {"MergedWithPrevious", TOK_SPLIT_MERGED_WITH_PREVIOUS},
        {"MergedWithNext", TOK_SPLIT_MERGED_WITH_NEXT},
        {"Contiguous", TOK_SPLIT_CONTIGUOUS},
    };
    const json_t *beh = json_object_get(p, "behavior");
    size_t k = 0, nb = sizeof behaviors / sizeof behaviors[0];
    for (; k < nb; k++)
        if (json_is_string(beh) && strcmp(json_string_value(beh), behaviors[k].name) == 0) break;
    if (k == nb)
        return pie_status_set(b->st, PIE_INVALID_ARGUMENT,
                              "tok: %s: %s.behavior \"%.40s\": expected Isolated, Removed, "
                              "MergedWithPrevious, MergedWithNext or Contiguous",
                              b->name, field, json_is_string(beh) ? json_string_value(beh) : "(missing)");
    s.behavior = behaviors[k].b;
    const json_t *inv = json_object_get(p, "invert");
    if (inv != NULL && !json_is_boolean(inv))
        return pie_status_set(b->st, PIE_INVALID_ARGUMENT,
                              "tok: %s: %s.invert: expected true or false", b->name, field);
    s.invert = json_is_true(inv);
    snprintf(f, sizeof f, "%s.pattern", field);
    pie_code rc = compile_regex(b, f, json_string_value(src), json_string_length(src), src == lit, &s.re);
    if (rc != PIE_OK) return rc;
    return add_step(b, &s);
}

static pie_code load_bytelevel(tok_builder *b, const char *field, const json_t *p) {
    tok_step s = {.kind = TOK_STEP_BYTELEVEL};
    const json_t *aps = json_object_get(p, "add_prefix_space");
    const json_t *ur = json_object_get(p, "use_regex");
    if ((aps != NULL && !json_is_boolean(aps)) || (ur != NULL && !json_is_boolean(ur)))
        return pie_status_set(b->st, PIE_INVALID_ARGUMENT,
                              "tok: %s: %s: add_prefix_space and use_regex must be true or false",
                              b->name, field);
    s.add_prefix_space = json_is_true(aps);
    if (ur == NULL || json_is_true(ur)) { /* HF's default is true */
        pie_code rc = compile_regex(b, field, TOK_GPT2_PATTERN, sizeof TOK_GPT2_PATTERN - 1, false,
                                    &s.re);
        if (rc != PIE_OK) return rc;
    }
    if (!s.add_prefix_space && s.re == NULL) return PIE_OK; /* only maps bytes: nothing to run */
    return add_step(b, &s);
}

static pie_code load_pretokenizer(tok_builder *b, const char *field, const json_t *p, int depth) {
    if (p == NULL || json_is_null(p)) return PIE_OK;
    if (!json_is_object(p))
        return pie_status_set(b->st, PIE_INVALID_ARGUMENT, "tok: %s: %s: expected an object or null",
                              b->name, field);
    if (depth > 8)
        return pie_status_set(b->st, PIE_INVALID_ARGUMENT, "tok: %s: %s: Sequences nested too deep",
                              b->name, field);
    const char *type = type_of(p);
    if (type != NULL && strcmp(type, "Sequence") == 0) {
        const json_t *list = json_object_get(p, "pretokenizers");
        if (!json_is_array(list))
            return pie_status_set(b->st, PIE_INVALID_ARGUMENT,
                                  "tok: %s: %s.pretokenizers: expected an array", b->name, field);
        size_t i;
        json_t *item;
        json_array_foreach((json_t *)list, i, item) {
            char f[160];
            snprintf(f, sizeof f, "%s.pretokenizers[%zu]", field, i);
            pie_code rc = load_pretokenizer(b, f, item, depth + 1);
            if (rc != PIE_OK) return rc;
        }
        return PIE_OK;
    }
    if (type != NULL && strcmp(type, "Split") == 0) return load_split(b, field, p);
    if (type != NULL && strcmp(type, "ByteLevel") == 0) return load_bytelevel(b, field, p);
    return pie_status_set(b->st, PIE_UNIMPLEMENTED,
                          "tok: %s: %s type \"%.40s\" is not supported (only Split, ByteLevel, Sequence)",
                          b->name, field, type ? type : "(missing)");
}

static pie_code load_decoder(tok_builder *b, const json_t *d) {
    const char *type = json_is_object(d) ? type_of(d) : NULL;
    if (type != NULL && strcmp(type, "ByteLevel") == 0) return PIE_OK;
    return pie_status_set(b->st, PIE_UNIMPLEMENTED,
                          "tok: %s: decoder type \"%.40s\" is not supported (only ByteLevel)", b->name,
                          type ? type : d == NULL || json_is_null(d) ? "(null)" : "(missing)");
}

/* ---- entry points ---- */

static pie_code tok_from_json(const json_t *root, const char *name, tok **out, pie_status *st) {
    tok_builder b = {.name = name, .st = st};
    *out = NULL;
    if (!json_is_object(root))
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "tok: %s: the top level is not a JSON object",
                              name);
    const json_t *model = json_object_get(root, "model");
    if (!json_is_object(model))
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "tok: %s: \"model\" is missing or not an object",
                              name);
    const json_t *vocab = json_object_get(model, "vocab");
    if (!json_is_object(vocab))
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "tok: %s: model.vocab is missing or not an object", name);
    if (json_object_size(vocab) == 0)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "tok: %s: model.vocab is empty", name);
    const json_t *added = json_object_get(root, "added_tokens");
    if (added != NULL && !json_is_null(added) && !json_is_array(added))
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "tok: %s: added_tokens: expected an array",
                              name);

    b.t = calloc(1, sizeof *b.t);
    if (b.t == NULL) return oom(&b, "the tokenizer");
    uint32_t n_ids = 0;
    pie_code rc = scan_ids(&b, vocab, added, &n_ids);
    if (rc != PIE_OK) goto fail;
    b.t->n_ids = n_ids;
    b.t->entries = calloc(n_ids, sizeof *b.t->entries);
    if (b.t->entries == NULL) {
        rc = oom(&b, "token table");
        goto fail;
    }
    rc = load_model(&b, model);
    if (rc != PIE_OK) goto fail;
    rc = load_added(&b, added);
    if (rc != PIE_OK) goto fail;
    rc = load_normalizer(&b, json_object_get(root, "normalizer"));
    if (rc != PIE_OK) goto fail;
    rc = load_pretokenizer(&b, "pre_tokenizer", json_object_get(root, "pre_tokenizer"), 0);
    if (rc != PIE_OK) goto fail;
    rc = load_decoder(&b, json_object_get(root, "decoder"));
    if (rc != PIE_OK) goto fail;
    *out = b.t;
    return PIE_OK;
fail:
    tok_free(b.t);
    return rc;
}

static pie_code json_failed(const char *name, const json_error_t *err, pie_status *st) {
    if (json_error_code(err) == json_error_cannot_open_file)
        return pie_status_set(st, PIE_NOT_FOUND, "tok: %s: cannot open: %s", name, err->text);
    if (json_error_code(err) == json_error_out_of_memory)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "tok: %s: out of memory reading JSON", name);
    return pie_status_set(st, PIE_INVALID_ARGUMENT, "tok: %s: not valid JSON: line %d column %d: %s",
                          name, err->line, err->column, err->text);
}

pie_code tok_load(const char *path, tok **out, pie_status *st) {
    json_error_t err;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &err);
    if (root == NULL) return json_failed(path, &err, st);
    pie_code rc = tok_from_json(root, path, out, st);
    json_decref(root);
    if (rc == PIE_OK) pie_status_ok(st);
    return rc;
}

pie_code tok_load_json(const char *json, size_t len, const char *name, tok **out, pie_status *st) {
    json_error_t err;
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &err);
    if (root == NULL) return json_failed(name, &err, st);
    pie_code rc = tok_from_json(root, name, out, st);
    json_decref(root);
    if (rc == PIE_OK) pie_status_ok(st);
    return rc;
}

void tok_free(tok *t) {
    if (t == NULL) return;
    for (size_t i = 0; i < t->n_steps; i++)
        if (t->steps[i].re) pcre2_code_free(t->steps[i].re);
    free(t->steps);
    free(t->entries);
    free(t->bytes);
    free(t->vocab);
    free(t->merges);
    free(t->added);
    free(t->trie);
    free(t);
}

uint32_t tok_vocab_size(const tok *t) { return t->n_ids; }

const uint8_t *tok_token_bytes(const tok *t, uint32_t id, size_t *len) {
    if (id >= t->n_ids || t->entries[id].flags == 0) {
        *len = 0;
        return NULL;
    }
    *len = t->entries[id].len;
    return t->bytes + t->entries[id].off;
}

int64_t tok_special_id(const tok *t, const char *content) {
    int32_t node = 0;
    for (const char *c = content; *c != '\0' && node >= 0; c++) {
        int32_t child = t->trie[node].first_child;
        while (child >= 0 && t->trie[child].byte != (uint8_t)*c) child = t->trie[child].next_sibling;
        node = child;
    }
    if (node <= 0 || t->trie[node].added < 0) return -1;
    return t->added[t->trie[node].added].id;
}

bool tok_is_special(const tok *t, uint32_t id) {
    return id < t->n_ids && (t->entries[id].flags & TOK_F_SPECIAL) != 0;
}
