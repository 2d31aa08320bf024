/* tok_regex.c — compiling pre-tokenizer patterns with PCRE2 so that they mean what they mean in
 * the published tokenizers' regex engines (Oniguruma in HF tokenizers, Rust's regex in tiktoken).
 *
 * Owns: the translation of `\s` and `\S` to Unicode's White_Space property, and the PCRE2 options
 * every pattern is compiled with. Does not own: where patterns come from (tok_load.c) or how
 * matches split text (tok_encode.c).
 *
 * Why: under PCRE2_UCP, PCRE2's `\s` is `\h`, `\v` and the Z categories together, and PCRE2 keeps
 * U+180E (MONGOLIAN VOWEL SEPARATOR) in `\h` although Unicode 6.3 took it out of White_Space. The
 * other engines follow White_Space, so "!\u180E" would be two pieces instead of one. Writing the
 * set out also makes `\s` independent of the PCRE2 version's tables (White_Space has not changed
 * since). The scanner knows escapes, \Q...\E, character classes and (?#...) comments; it does not
 * know (?x) comments (no published pattern uses extended mode). */
#include <stdlib.h>

#include "tok_int.h"

/* Unicode White_Space, as members of a character class. */
static const char TOK_WHITE_SPACE[] = "\\t-\\r\\x20\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}"
                                      "\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}";

typedef struct tok_strbuf {
    char *p;
    size_t n, cap;
    bool failed;
} tok_strbuf;

static void put(tok_strbuf *b, const char *s, size_t n) {
    if (b->failed) return;
    if (b->cap - b->n < n + 1) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap - b->n < n + 1) {
            if (cap > SIZE_MAX / 2) {
                b->failed = true;
                return;
            }
            cap *= 2;
        }
        char *p = realloc(b->p, cap);
        if (p == NULL) {
            b->failed = true;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
}

static void put_str(tok_strbuf *b, const char *s) { put(b, s, strlen(s)); }

/* Length of the escape sequence at p[0] == '\\' (at most n bytes): two bytes, except \Q...\E
 * (through the \E, or to the end) and \cX (three). Only what can hide a '[', ']' or '\\' from the
 * scanner matters: other escapes with arguments (\x{..}, \p{..}) carry none of those. */
static size_t escape_len(const char *p, size_t n) {
    if (n < 2) return n;
    if (p[1] == 'c') return n < 3 ? n : 3;
    if (p[1] != 'Q') return 2;
    for (size_t i = 2; i + 1 < n; i++)
        if (p[i] == '\\' && p[i + 1] == 'E') return i + 2;
    return n;
}

char *tok_regex_translate(const char *pattern, size_t n, size_t *out_len) {
    tok_strbuf b = {0};
    bool in_class = false;
    size_t i = 0;
    put(&b, "", 0); /* an empty pattern gives an empty string, not NULL */
    while (i < n) {
        char c = pattern[i];
        if (c == '\\') {
            size_t k = escape_len(pattern + i, n - i);
            if (k == 2 && pattern[i + 1] == 's') {
                put_str(&b, in_class ? "" : "[");
                put_str(&b, TOK_WHITE_SPACE);
                put_str(&b, in_class ? "" : "]");
                /* "[\s-x]": a "-" after a class escape is a member; after "\x{3000}" it would
                 * start a range. */
                if (in_class && i + 2 < n && pattern[i + 2] == '-') {
                    put_str(&b, "\\-");
                    k++;
                }
            } else if (k == 2 && pattern[i + 1] == 'S' && !in_class) {
                put_str(&b, "[^");
                put_str(&b, TOK_WHITE_SPACE);
                put_str(&b, "]");
            } else { /* \S inside a class has no class-member spelling: kept as PCRE2's */
                put(&b, pattern + i, k);
            }
            i += k;
            continue;
        }
        if (!in_class && c == '(' && i + 2 < n && pattern[i + 1] == '?' && pattern[i + 2] == '#') {
            const char *end = memchr(pattern + i, ')', n - i); /* a comment: copied as it is */
            size_t k = end ? (size_t)(end - (pattern + i)) + 1 : n - i;
            put(&b, pattern + i, k);
            i += k;
            continue;
        }
        if (!in_class && c == '[') {
            /* "[", an optional "^", and a "]" right after them is a member, not the end. */
            size_t k = 1;
            if (i + k < n && pattern[i + k] == '^') k++;
            if (i + k < n && pattern[i + k] == ']') k++;
            put(&b, pattern + i, k);
            i += k;
            in_class = true;
            continue;
        }
        if (in_class && c == '[' && i + 1 < n && pattern[i + 1] == ':') {
            const char *end = NULL; /* a POSIX class [:name:] */
            for (size_t j = i + 2; j + 1 < n && end == NULL; j++)
                if (pattern[j] == ':' && pattern[j + 1] == ']') end = pattern + j + 2;
            size_t k = end ? (size_t)(end - (pattern + i)) : 1;
            put(&b, pattern + i, k);
            i += k;
            continue;
        }
        if (in_class && c == ']') in_class = false;
        put(&b, &c, 1);
        i++;
    }
    if (b.failed) {
        free(b.p);
        return NULL;
    }
    *out_len = b.n;
    return b.p;
}

pcre2_code *tok_regex_compile(const char *pattern, size_t n, bool literal, int *err,
                              size_t *err_off) {
    /* PCRE2_LITERAL refuses PCRE2_UCP (a literal has no classes for it to change). */
    uint32_t opts = PCRE2_UTF | PCRE2_MATCH_INVALID_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
    PCRE2_SIZE off = 0;
    pcre2_code *re;
    if (literal) {
        re = pcre2_compile((PCRE2_SPTR)pattern, n, opts, err, &off, NULL);
    } else {
        size_t tn = 0;
        char *translated = tok_regex_translate(pattern, n, &tn);
        if (translated == NULL) {
            *err = PCRE2_ERROR_NOMEMORY;
            *err_off = 0;
            return NULL;
        }
        re = pcre2_compile((PCRE2_SPTR)translated, tn, opts, err, &off, NULL);
        free(translated);
        /* An error is reported at its offset in the pattern as written. (Were the original to
         * compile and only its translation to fail, the translation's error stands.) */
        if (re == NULL) {
            int orig_err;
            PCRE2_SIZE orig_off;
            pcre2_code *orig =
                pcre2_compile((PCRE2_SPTR)pattern, n, opts, &orig_err, &orig_off, NULL);
            if (orig != NULL) {
                pcre2_code_free(orig);
            } else {
                *err = orig_err;
                off = orig_off;
            }
        }
    }
    *err_off = off;
    if (re == NULL) return NULL;
    /* Without JIT (e.g. where executable memory is forbidden) the interpreter runs the same
     * pattern, only slower, so a JIT failure is not an error. */
    (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
    return re;
}
