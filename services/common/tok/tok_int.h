/* tok_int.h — the inside of a loaded tokenizer, shared by tok_load.c (builds it),
 * tok_encode.c (reads it to encode) and tok_decode.c (reads it to decode).
 *
 * Owns: the layout of struct tok, the byte-level byte<->code point mapping, the byte-string
 * hash, and the two lookup tables every encode uses (vocab bytes -> id, id pair -> merge). */
#ifndef PIE_TOK_INT_H
#define PIE_TOK_INT_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "tok.h"

#define TOK_NO_ID UINT32_MAX

/* Flags of a token id. */
enum {
    TOK_F_VOCAB = 1,   /* in model.vocab (reachable by BPE) */
    TOK_F_ADDED = 2,   /* in added_tokens */
    TOK_F_SPECIAL = 4, /* added token with "special": true */
};

typedef struct tok_entry {
    uint32_t off, len;             /* decode bytes in tok.bytes: added content, else vocab bytes */
    uint32_t vocab_off, vocab_len; /* model.vocab bytes in tok.bytes (TOK_F_VOCAB only) */
    uint8_t flags;
} tok_entry;

/* One added token, as matched before pre-tokenization. */
typedef struct tok_added {
    uint32_t id;
    uint32_t off, len; /* content in tok.bytes */
    bool special, lstrip, rstrip, single_word;
} tok_added;

/* A byte trie over added-token contents: nodes[0] is the root; children are a sibling list. */
typedef struct tok_trie_node {
    int32_t first_child, next_sibling;
    int32_t added; /* index into tok.added of the token ending here, or -1 */
    uint8_t byte;
} tok_trie_node;

typedef enum tok_split_behavior {
    TOK_SPLIT_ISOLATED,
    TOK_SPLIT_REMOVED,
    TOK_SPLIT_MERGED_WITH_PREVIOUS,
    TOK_SPLIT_MERGED_WITH_NEXT,
    TOK_SPLIT_CONTIGUOUS,
} tok_split_behavior;

typedef enum tok_step_kind { TOK_STEP_SPLIT, TOK_STEP_BYTELEVEL } tok_step_kind;

/* One pre-tokenizer step, applied in order to every piece. */
typedef struct tok_step {
    tok_step_kind kind;
    pcre2_code *re;              /* Split: its pattern; ByteLevel with use_regex: the GPT-2 one */
    tok_split_behavior behavior; /* Split only */
    bool invert;                 /* Split only */
    bool add_prefix_space;       /* ByteLevel only */
} tok_step;

/* Merge table slot: key = left id << 32 | right id; UINT64_MAX marks an empty slot. */
typedef struct tok_merge_slot {
    uint64_t key;
    uint32_t rank, id;
} tok_merge_slot;

/* Vocab table slot: id + 1 (0 = empty) and the low 32 bits of the hash of its bytes. */
typedef struct tok_vocab_slot {
    uint32_t id1, hash;
} tok_vocab_slot;

struct tok {
    uint32_t n_ids;      /* one past the largest id */
    tok_entry *entries;  /* [n_ids] */
    uint8_t *bytes;      /* all token bytes */
    size_t bytes_len;

    tok_vocab_slot *vocab; /* [vocab_mask + 1], model.vocab bytes -> id */
    uint64_t vocab_mask;
    tok_merge_slot *merges; /* [merge_mask + 1] */
    uint64_t merge_mask;
    uint32_t n_merges;

    uint32_t byte_id[256]; /* id of the one-byte token of each byte, TOK_NO_ID if none */
    uint32_t unk_id;       /* model.unk_token's id or TOK_NO_ID */
    bool ignore_merges;

    tok_step *steps;
    size_t n_steps;

    tok_added *added;
    size_t n_added;
    tok_trie_node *trie;
    size_t n_trie;
    bool added_first[256]; /* bytes that start some added token */
};

/* The byte-level mapping: byte b <-> code point tok_byte_to_cp(b). Printable Latin-1 bytes map
 * to themselves; the other 68 bytes map to U+0100..U+0143 in byte order. */
uint32_t tok_byte_to_cp(uint8_t b);
/* Inverse; -1 when cp is not in the mapping's image. */
int tok_cp_to_byte(uint32_t cp);

/* 64-bit hash of a byte string (not cryptographic; for the lookup tables). */
static inline uint64_t tok_hash(const uint8_t *p, size_t n) {
    const uint64_t k = 0x9E3779B97F4A7C15ull;
    uint64_t h = 0x243F6A8885A308D3ull ^ ((uint64_t)n * k);
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        h = (h ^ v) * k;
        h ^= h >> 31;
        p += 8;
        n -= 8;
    }
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++) v |= (uint64_t)p[i] << (8 * i);
    h = (h ^ v) * k;
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 32;
    return h;
}

static inline uint64_t tok_pair_hash(uint64_t key) {
    key *= 0x9E3779B97F4A7C15ull;
    return key ^ (key >> 32);
}

/* The id whose model.vocab bytes are p[0..n), or TOK_NO_ID. */
static inline uint32_t tok_vocab_find(const tok *t, const uint8_t *p, size_t n) {
    uint64_t h = tok_hash(p, n);
    for (uint64_t i = h & t->vocab_mask;; i = (i + 1) & t->vocab_mask) {
        const tok_vocab_slot *s = &t->vocab[i];
        if (s->id1 == 0) return TOK_NO_ID;
        if (s->hash == (uint32_t)h) {
            const tok_entry *e = &t->entries[s->id1 - 1];
            if (e->vocab_len == n && memcmp(t->bytes + e->vocab_off, p, n) == 0) return s->id1 - 1;
        }
    }
}

/* The merge of left then right, or NULL. */
static inline const tok_merge_slot *tok_merge_find(const tok *t, uint32_t left, uint32_t right) {
    uint64_t key = (uint64_t)left << 32 | right;
    for (uint64_t i = tok_pair_hash(key) & t->merge_mask;; i = (i + 1) & t->merge_mask) {
        const tok_merge_slot *s = &t->merges[i];
        if (s->key == key) return s;
        if (s->key == UINT64_MAX) return NULL;
    }
}

/* Compiles a pre-tokenizer pattern (a literal string when `literal`) with PCRE2_UTF,
 * PCRE2_MATCH_INVALID_UTF and, for a regex, PCRE2_UCP, after tok_regex_translate; JIT-compiled
 * where possible. NULL on error, with PCRE2's error code in *err and the offset in the pattern
 * as written in *err_off. (tok_regex.c) */
pcre2_code *tok_regex_compile(const char *pattern, size_t n, bool literal, int *err,
                              size_t *err_off);

/* The pattern with `\s` (and `\S` outside character classes) spelled as Unicode's White_Space
 * set, which PCRE2's `\s` is not (it adds U+180E); malloc'd and NUL-terminated, length in
 * *out_len; NULL when out of memory. (tok_regex.c) */
char *tok_regex_translate(const char *pattern, size_t n, size_t *out_len);


#endif
