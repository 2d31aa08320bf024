/* tok_ref_check.c — the C side of the tokenizer check against tiktoken (tests/tok/README.md).
 *
 *   tok_ref_check classes OUT
 *       Writes which of the Unicode classes the published regexes use PCRE2 puts every code
 *       point in: \p{L}, \p{N}, \p{M}, \p{Lu}, \p{Ll}, \p{Lt}, \p{Lm}, \p{Lo}, as runs
 *       "FIRST LAST BITS" (hex code points; bit i = class i in that order), after a line
 *       "# unicode VERSION" (PCRE2's Unicode tables). tiktoken_ref.js compares them with Node's.
 *       (\s is not among them: tok_regex.c spells it out, so it does not depend on the tables.)
 *
 *   tok_ref_check check ENCODING TOKENIZER_JSON CASES
 *       Loads TOKENIZER_JSON with pie_tok, checks the published encodings everyone knows for
 *       ENCODING (gpt2, cl100k_base, o200k_base), then encodes every text of CASES (written by
 *       tiktoken_ref.js: "LABEL ALLOW HEX IDS...") and expects exactly tiktoken's ids, and
 *       decoding them to give the text back. Prints each mismatch (the first 10 in full: the
 *       text, both id lists, the first differing token's bytes on each side) and a summary.
 *
 * Exit status: 0 when everything matched, 1 on a mismatch, 2 on bad usage or unreadable input. */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pie_file.h"
#include "pie_utf8.h"
#include "tok.h"
#include "tok_int.h"

#define MAX_REPORTED 10

/* ---- classes ---------------------------------------------------------------------------- */

static size_t put_utf8(uint8_t *p, uint32_t cp) {
    if (cp < 0x80) {
        p[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        p[0] = (uint8_t)(0xC0 | cp >> 6);
        p[1] = (uint8_t)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        p[0] = (uint8_t)(0xE0 | cp >> 12);
        p[1] = (uint8_t)(0x80 | (cp >> 6 & 0x3F));
        p[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    p[0] = (uint8_t)(0xF0 | cp >> 18);
    p[1] = (uint8_t)(0x80 | (cp >> 12 & 0x3F));
    p[2] = (uint8_t)(0x80 | (cp >> 6 & 0x3F));
    p[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

static uint32_t get_utf8(const uint8_t *p, size_t *used) {
    size_t k = pie_utf8_next(p, 4, NULL);
    *used = k;
    if (k == 1) return p[0];
    if (k == 2) return (uint32_t)(p[0] & 0x1F) << 6 | (p[1] & 0x3F);
    if (k == 3) return (uint32_t)(p[0] & 0x0F) << 12 | (uint32_t)(p[1] & 0x3F) << 6 | (p[2] & 0x3F);
    return (uint32_t)(p[0] & 0x07) << 18 | (uint32_t)(p[1] & 0x3F) << 12 |
           (uint32_t)(p[2] & 0x3F) << 6 | (p[3] & 0x3F);
}

/* Sets bit in bits[cp] for every code point the pattern (one class, repeated) matches in text,
 * which holds every code point but the surrogates, in order. */
static int mark_class(const char *pattern, const uint8_t *text, size_t len, uint8_t *bits,
                      int bit) {
    int err = 0;
    size_t err_off = 0;
    pcre2_code *re = tok_regex_compile(pattern, strlen(pattern), false, &err, &err_off);
    if (re == NULL) {
        fprintf(stderr, "tok_ref_check: %s does not compile (PCRE2 error %d at %zu)\n", pattern,
                err, err_off);
        return -1;
    }
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    if (md == NULL) {
        pcre2_code_free(re);
        fprintf(stderr, "tok_ref_check: out of memory\n");
        return -1;
    }
    int rc = 0;
    for (size_t pos = 0; pos < len;) {
        int m = pcre2_match(re, text, len, pos, 0, md, NULL);
        if (m == PCRE2_ERROR_NOMATCH) break;
        if (m < 0) {
            fprintf(stderr, "tok_ref_check: %s: PCRE2 match error %d at %zu\n", pattern, m, pos);
            rc = -1;
            break;
        }
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t used = 1;
        for (size_t i = ov[0]; i < ov[1]; i += used)
            bits[get_utf8(text + i, &used)] |= (uint8_t)(1u << bit);
        pos = ov[1] > ov[0] ? ov[1] : ov[0] + 1;
    }
    pcre2_match_data_free(md);
    pcre2_code_free(re);
    return rc;
}

static int write_classes(const char *out_path) {
    static const char *const classes[] = {"\\p{L}+",  "\\p{N}+",  "\\p{M}+",  "\\p{Lu}+",
                                          "\\p{Ll}+", "\\p{Lt}+", "\\p{Lm}+", "\\p{Lo}+"};
    const uint32_t n_cp = 0x110000;
    uint8_t *text = malloc((size_t)n_cp * 4);
    uint8_t *bits = calloc(n_cp, sizeof *bits);
    FILE *f = NULL;
    int rc = 2;
    if (text == NULL || bits == NULL) {
        fprintf(stderr, "tok_ref_check: out of memory\n");
        goto done;
    }
    size_t len = 0;
    for (uint32_t cp = 0; cp < n_cp; cp++)
        if (cp < 0xD800 || cp > 0xDFFF) len += put_utf8(text + len, cp);
    for (int i = 0; i < (int)(sizeof classes / sizeof classes[0]); i++)
        if (mark_class(classes[i], text, len, bits, i) != 0) goto done;

    f = fopen(out_path, "w");
    if (f == NULL) {
        perror(out_path);
        goto done;
    }
    char version[64] = "?";
    if (pcre2_config(PCRE2_CONFIG_UNICODE_VERSION, version) < 0) strcpy(version, "?");
    fprintf(f, "# unicode %s\n", version);
    for (uint32_t cp = 0; cp < n_cp;) {
        uint32_t end = cp;
        while (end + 1 < n_cp && bits[end + 1] == bits[cp]) end++;
        fprintf(f, "%" PRIX32 " %" PRIX32 " %u\n", cp, end, (unsigned)bits[cp]);
        cp = end + 1;
    }
    if (ferror(f)) {
        perror(out_path);
        goto done;
    }
    rc = 0;
done:
    if (f != NULL && fclose(f) != 0 && rc == 0) {
        perror(out_path);
        rc = 2;
    }
    free(text);
    free(bits);
    return rc;
}

/* ---- check ------------------------------------------------------------------------------ */

/* Prints text (raw bytes) with everything but printable ASCII escaped. */
static void print_text(const uint8_t *p, size_t n) {
    fputc('"', stdout);
    for (size_t i = 0; i < n;) {
        size_t k = pie_utf8_next(p + i, n - i, NULL);
        if (k == 1 && p[i] >= 0x20 && p[i] < 0x7F && p[i] != '"' && p[i] != '\\') {
            fputc(p[i], stdout);
        } else if (k == 1) {
            printf("\\x%02X", p[i]);
        } else if (k > 1) {
            size_t used;
            printf("\\u{%" PRIX32 "}", get_utf8(p + i, &used));
        } else {
            printf("\\x%02X", p[i]);
            k = 1;
        }
        i += k;
    }
    fputc('"', stdout);
}

static void print_ids(const char *who, const uint32_t *ids, size_t n) {
    printf("  %-9s (%zu):", who, n);
    for (size_t i = 0; i < n; i++) printf(" %" PRIu32, ids[i]);
    printf("\n");
}

static void print_token(const tok *t, const char *who, const uint32_t *ids, size_t n, size_t i) {
    printf("  %-9s id[%zu] = ", who, i);
    if (i >= n) {
        printf("(none)\n");
        return;
    }
    size_t len;
    const uint8_t *p = tok_token_bytes(t, ids[i], &len);
    printf("%" PRIu32 " ", ids[i]);
    if (p == NULL)
        printf("(no such token)");
    else
        print_text(p, len);
    printf("\n");
}

typedef struct known_vector {
    const char *encoding, *text;
    bool allow_special;
    uint32_t ids[8];
    size_t n;
} known_vector;

/* Encodings of the published tokenizers that their documentation and every port quote. Llama 3
 * has cl100k_base's first 100,256 ids and its regex ("Hello world!" is 9906 1917 0 there too). */
static const known_vector KNOWN[] = {
    {"gpt2", "Hello world", false, {15496, 995}, 2},
    {"gpt2", "Hello, world!", false, {15496, 11, 995, 0}, 4},
    {"gpt2",
     " Hello<|endoftext|>The quick brown fox",
     true,
     {18435, 50256, 464, 2068, 7586, 21831},
     6},
    {"cl100k_base", "Hello world!", false, {9906, 1917, 0}, 3},
    {"cl100k_base", "hello world", false, {15339, 1917}, 2},
    {"cl100k_base", "<|endoftext|>", true, {100257}, 1},
    {"o200k_base", "hello world", false, {24912, 2375}, 2},
    {"o200k_base", "<|endoftext|>", true, {199999}, 1},
};

/* Vocabulary sizes: one past the largest id, special tokens included. */
static const struct {
    const char *encoding;
    uint32_t n_ids;
} KNOWN_SIZES[] = {{"gpt2", 50257}, {"cl100k_base", 100277}, {"o200k_base", 200019}};

static int check_known(const tok *t, const char *encoding) {
    int failures = 0, checked = 0;
    for (size_t i = 0; i < sizeof KNOWN_SIZES / sizeof KNOWN_SIZES[0]; i++) {
        if (strcmp(KNOWN_SIZES[i].encoding, encoding) != 0) continue;
        checked++;
        if (tok_vocab_size(t) != KNOWN_SIZES[i].n_ids) {
            printf("tok_ref_check: %s: vocab size %" PRIu32 ", the published one is %" PRIu32 "\n",
                   encoding, tok_vocab_size(t), KNOWN_SIZES[i].n_ids);
            failures++;
        }
    }
    for (size_t i = 0; i < sizeof KNOWN / sizeof KNOWN[0]; i++) {
        const known_vector *k = &KNOWN[i];
        if (strcmp(k->encoding, encoding) != 0) continue;
        checked++;
        uint32_t *ids = NULL;
        size_t n = 0;
        pie_status st;
        if (tok_encode(t, k->text, strlen(k->text), k->allow_special, &ids, &n, &st) != PIE_OK) {
            printf("tok_ref_check: %s: encode \"%s\": %s\n", encoding, k->text, st.msg);
            failures++;
            continue;
        }
        if (n != k->n || memcmp(ids, k->ids, n * sizeof *ids) != 0) {
            printf("tok_ref_check: %s: \"%s\" is not its published encoding\n", encoding, k->text);
            print_ids("pie_tok", ids, n);
            print_ids("published", k->ids, k->n);
            failures++;
        }
        free(ids);
    }
    if (checked == 0) printf("tok_ref_check: %s: no published encodings known\n", encoding);
    return failures;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* One case: the fields of a CASES line, decoded. */
typedef struct ref_case {
    char label[64];
    bool allow_special;
    uint8_t *text;
    size_t text_len;
    uint32_t *ids;
    size_t n_ids;
} ref_case;

static void case_free(ref_case *c) {
    free(c->text);
    free(c->ids);
}

/* Parses line[0..n) into c; 0 on success, -1 (and a message) on a malformed line. */
static int parse_case(const char *line, size_t n, size_t line_no, ref_case *c) {
    memset(c, 0, sizeof *c);
    const char *p = line, *end = line + n;
    const char *sp = memchr(p, ' ', (size_t)(end - p));
    if (sp == NULL || sp - p >= (ptrdiff_t)sizeof c->label) goto bad;
    memcpy(c->label, p, (size_t)(sp - p));
    p = sp + 1;
    if (end - p < 2 || (p[0] != '0' && p[0] != '1') || p[1] != ' ') goto bad;
    c->allow_special = p[0] == '1';
    p += 2;
    sp = memchr(p, ' ', (size_t)(end - p));
    const char *hex_end = sp ? sp : end;
    if ((hex_end - p) % 2 != 0) goto bad;
    c->text_len = (size_t)(hex_end - p) / 2;
    c->text = malloc(c->text_len + 1);
    c->ids = malloc(((size_t)(end - p) / 2 + 1) * sizeof *c->ids);
    if (c->text == NULL || c->ids == NULL) goto bad;
    for (size_t i = 0; i < c->text_len; i++) {
        int hi = hexval(p[2 * i]), lo = hexval(p[2 * i + 1]);
        if (hi < 0 || lo < 0) goto bad;
        c->text[i] = (uint8_t)(hi << 4 | lo);
    }
    c->text[c->text_len] = 0;
    p = hex_end;
    while (p < end) {
        if (*p == ' ') {
            p++;
            continue;
        }
        uint64_t v = 0;
        const char *start = p;
        while (p < end && *p >= '0' && *p <= '9' && v <= UINT32_MAX)
            v = v * 10 + (uint64_t)(*p++ - '0');
        if (p == start || v > UINT32_MAX || (p < end && *p != ' ')) goto bad;
        c->ids[c->n_ids++] = (uint32_t)v;
    }
    return 0;
bad:
    fprintf(stderr, "tok_ref_check: cases line %zu is malformed\n", line_no);
    case_free(c);
    return -1;
}

/* Encodes and decodes one case; 0 when pie_tok agrees with tiktoken, 1 otherwise (reported in
 * full while *reported < MAX_REPORTED). */
static int check_case(const tok *t, const ref_case *c, int *reported) {
    uint32_t *ids = NULL;
    size_t n = 0;
    pie_status st;
    bool full = *reported < MAX_REPORTED;
    if (tok_encode(t, (const char *)c->text, c->text_len, c->allow_special, &ids, &n, &st) !=
        PIE_OK) {
        printf("MISMATCH %s: encode failed: %s\n", c->label, st.msg);
        ++*reported;
        return 1;
    }
    int bad = 0;
    if (n != c->n_ids || (n > 0 && memcmp(ids, c->ids, n * sizeof *ids) != 0)) {
        bad = 1;
        size_t first = 0;
        while (first < n && first < c->n_ids && ids[first] == c->ids[first]) first++;
        printf("MISMATCH %s (special tokens %s): first difference at id %zu\n", c->label,
               c->allow_special ? "allowed" : "not allowed", first);
        if (full) {
            printf("  text      ");
            print_text(c->text, c->text_len);
            printf("\n");
            print_ids("pie_tok", ids, n);
            print_ids("tiktoken", c->ids, c->n_ids);
            print_token(t, "pie_tok", ids, n, first);
            print_token(t, "tiktoken", c->ids, c->n_ids, first);
        }
    }
    char *out = NULL;
    size_t out_len = 0;
    if (tok_decode(t, ids, n, &out, &out_len, &st) != PIE_OK) {
        printf("ROUND TRIP %s: decode failed: %s\n", c->label, st.msg);
        bad = 1;
    } else if (out_len != c->text_len || memcmp(out, c->text, out_len) != 0) {
        printf("ROUND TRIP %s: decoding pie_tok's ids does not give the text back\n", c->label);
        bad = 1;
    }
    free(out);
    free(ids);
    if (bad) ++*reported;
    return bad;
}

static int check(const char *encoding, const char *json_path, const char *cases_path) {
    pie_status st;
    tok *t = NULL;
    if (tok_load(json_path, &t, &st) != PIE_OK) {
        printf("tok_ref_check: %s\n", st.msg);
        return 1;
    }
    size_t len = 0;
    char *cases = NULL;
    if (pie_file_read(cases_path, "cases file", SIZE_MAX, &cases, &len, &st) != PIE_OK) {
        fprintf(stderr, "tok_ref_check: %s\n", st.msg);
        tok_free(t);
        return 2;
    }
    int failures = check_known(t, encoding), reported = 0;
    size_t n_cases = 0, n_failed = 0, n_ids = 0, line_no = 0;
    int rc = 0;
    for (char *p = cases; p < cases + len;) {
        char *nl = memchr(p, '\n', (size_t)(cases + len - p));
        size_t n = nl ? (size_t)(nl - p) : (size_t)(cases + len - p);
        line_no++;
        if (n > 0) {
            ref_case c;
            if (parse_case(p, n, line_no, &c) != 0) {
                rc = 2;
                break;
            }
            n_cases++;
            n_ids += c.n_ids;
            n_failed += (size_t)check_case(t, &c, &reported);
            case_free(&c);
        }
        p += n + 1;
    }
    printf("tok_ref_check: %s: %zu texts (%zu tiktoken ids): %zu differ from tiktoken; "
           "published encodings: %d wrong\n",
           encoding, n_cases, n_ids, n_failed, failures);
    if (rc == 0 && (n_failed > 0 || failures > 0 || n_cases == 0)) rc = 1;
    free(cases);
    tok_free(t);
    return rc;
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "classes") == 0) return write_classes(argv[2]);
    if (argc == 5 && strcmp(argv[1], "check") == 0) return check(argv[2], argv[3], argv[4]);
    fprintf(stderr, "usage: tok_ref_check classes OUT\n"
                    "       tok_ref_check check ENCODING TOKENIZER_JSON CASES\n");
    return 2;
}
