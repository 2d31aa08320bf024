/* test_tok.c — the byte-level BPE tokenizer (services/common/tok): exact encodings of a small
 * hand-made vocabulary in the Llama 3 and GPT-2 styles, decoding, streaming detokenization,
 * hostile input, the exact text of every load error, the translation of \s in the pre-tokenizer
 * regexes, and agreement with the encoder of tools/tinymodel/bpe_train.py (which makes the test
 * models' tokenizers) on the committed corpus. The check against an independent implementation
 * on published vocabularies is tests/tok (tiktoken).
 *
 * The fixture: ids 0..255 are the byte tokens in GPT-2's order (B('a') is the id of byte 'a'),
 * then one token per merge below (ids 256..274), then "xyz" (275, reachable by no merge: only
 * ignore_merges produces it), then the added tokens (276..281). */
#include <criterion/criterion.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pie_proc.h"
#include "tok.h"
#include "tok_int.h"

/* ---- the byte-level alphabet, written out independently of tok_load.c ---------------------- */

static bool printable(int b) { return (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174; }

/* Id of byte b: printable bytes first in byte order, then the others in byte order. */
static uint32_t B(int b) {
    uint32_t id = 0;
    for (int c = 0; c < 256; c++)
        if (printable(c)) {
            if (c == b) return id;
            id++;
        }
    for (int c = 0; c < 256; c++)
        if (!printable(c)) {
            if (c == b) return id;
            id++;
        }
    return UINT32_MAX;
}

/* The code point byte b is written as in tokenizer.json. */
static uint32_t byte_cp(int b) {
    if (printable(b)) return (uint32_t)b;
    uint32_t n = 0;
    for (int c = 0; c < b; c++)
        if (!printable(c)) n++;
    return 256 + n;
}

/* Raw bytes -> the byte-level string of tokenizer.json (UTF-8); static buffer per call site. */
static char *bl(const char *raw, size_t n, char *out) {
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t cp = byte_cp((unsigned char)raw[i]);
        if (cp < 0x80) {
            out[k++] = (char)cp;
        } else {
            out[k++] = (char)(0xC0 | (cp >> 6));
            out[k++] = (char)(0x80 | (cp & 0x3F));
        }
    }
    out[k] = '\0';
    return out;
}

/* ---- the fixture ------------------------------------------------------------------------- */

/* Merges in rank order, as raw bytes; merge i makes token 256 + i. */
static const char *const MERGES[][2] = {
    {" ", "t"},           /* 256 " t" */
    {"h", "e"},           /* 257 "he" */
    {" t", "he"},         /* 258 " the" */
    {"l", "l"},           /* 259 "ll" */
    {"e", "ll"},          /* 260 "ell" */
    {"H", "ell"},         /* 261 "Hell" */
    {"Hell", "o"},        /* 262 "Hello" */
    {"1", "2"},           /* 263 "12" */
    {"12", "3"},          /* 264 "123" */
    {" ", "w"},           /* 265 " w" */
    {"o", "r"},           /* 266 "or" */
    {" w", "or"},         /* 267 " wor" */
    {"l", "d"},           /* 268 "ld" */
    {" wor", "ld"},       /* 269 " world" */
    {"'", "s"},           /* 270 "'s" */
    {" ", " "},           /* 271 "  " */
    {"  ", "  "},         /* 272 "    " */
    {"\xF0", "\x9F"},     /* 273: the first half of U+1F600 (and of most emoji) */
    {"\x98", "\x80"},     /* 274: the second half of U+1F600 */
};
#define N_MERGES (sizeof MERGES / sizeof MERGES[0])

enum {
    T_THE = 258, T_LL = 259, T_HELLO = 262, T_12 = 263, T_123 = 264, T_WORLD = 269, T_S = 270, T_SP2 = 271,
    T_SP4 = 272, T_EMOJI_A = 273, T_EMOJI_B = 274, T_XYZ = 275,
    T_BOT = 276, T_EOT = 277, T_TOOL = 278, T_X = 279, T_XX = 280, T_MASK = 281,
};

static const char LLAMA3_PATTERN[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}|"
    " ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

static json_t *added_token(uint32_t id, const char *content, bool special, bool strip) {
    return json_pack("{s:i, s:s, s:b, s:b, s:b, s:b, s:b}", "id", (json_int_t)id, "content",
                     content, "single_word", 0, "lstrip", strip, "rstrip", strip, "normalized", 0,
                     "special", special);
}

typedef enum { LLAMA3, GPT2 } fx_style;

/* The fixture as a JSON object; merges as ["a","b"] pairs (pairs) or "a b" strings. */
static json_t *fixture(fx_style s, bool pairs) {
    char buf[64], buf2[64];
    json_t *vocab = json_object();
    for (int b = 0; b < 256; b++) {
        char c = (char)b;
        json_object_set_new(vocab, bl(&c, 1, buf), json_integer(B(b)));
    }
    json_t *merges = json_array();
    for (size_t i = 0; i < N_MERGES; i++) {
        const char *l = MERGES[i][0], *r = MERGES[i][1];
        char cat[16];
        snprintf(cat, sizeof cat, "%s%s", l, r);
        json_object_set_new(vocab, bl(cat, strlen(cat), buf), json_integer(256 + (json_int_t)i));
        bl(l, strlen(l), buf);
        bl(r, strlen(r), buf2);
        if (pairs) {
            json_array_append_new(merges, json_pack("[s, s]", buf, buf2));
        } else {
            char m[140];
            snprintf(m, sizeof m, "%s %s", buf, buf2);
            json_array_append_new(merges, json_string(m));
        }
    }
    json_object_set_new(vocab, "xyz", json_integer(T_XYZ));

    json_t *model = json_pack("{s:s, s:n, s:n, s:o, s:o}", "type", "BPE", "dropout", "unk_token",
                              "vocab", vocab, "merges", merges);
    if (s == LLAMA3) json_object_set_new(model, "ignore_merges", json_true());

    json_t *added = json_pack("[o, o, o, o, o, o]", added_token(T_BOT, "<|begin_of_text|>", true, false),
                              added_token(T_EOT, "<|eot_id|>", true, false),
                              added_token(T_TOOL, "<tool>", false, false),
                              added_token(T_X, "<|x|>", true, false),
                              added_token(T_XX, "<|x|>x", true, false),
                              added_token(T_MASK, "<mask>", true, true));
    json_t *pre;
    if (s == LLAMA3)
        pre = json_pack("{s:s, s:[{s:s, s:{s:s}, s:s, s:b}, {s:s, s:b, s:b, s:b}]}", "type",
                        "Sequence", "pretokenizers", "type", "Split", "pattern", "Regex",
                        LLAMA3_PATTERN, "behavior", "Isolated", "invert", 0, "type", "ByteLevel",
                        "add_prefix_space", 0, "trim_offsets", 1, "use_regex", 0);
    else
        pre = json_pack("{s:s, s:b, s:b, s:b}", "type", "ByteLevel", "add_prefix_space", 0,
                        "trim_offsets", 1, "use_regex", 1);
    return json_pack("{s:s, s:o, s:n, s:o, s:{s:s}, s:o}", "version", "1.0", "added_tokens", added,
                     "normalizer", "pre_tokenizer", pre, "decoder", "type", "ByteLevel", "model",
                     model);
}

static json_t *model_of_fixture(json_t *j) { return json_object_get(j, "model"); }

/* Loads j (and takes it) as "fixture.json"; fails the test on error. */
static tok *load_fixture(json_t *j) {
    cr_assert_not_null(j, "fixture JSON could not be built");
    char *text = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    pie_status st;
    tok *t = NULL;
    pie_code rc = tok_load_json(text, strlen(text), "fixture.json", &t, &st);
    free(text);
    cr_assert_eq(rc, PIE_OK, "tok_load_json: %s", st.msg);
    return t;
}

/* Loads j and expects an error with this code and exact message. */
static void expect_load_error(json_t *j, pie_code code, const char *msg) {
    cr_assert_not_null(j, "fixture JSON could not be built");
    char *text = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    pie_status st;
    tok *t = (tok *)1;
    pie_code rc = tok_load_json(text, strlen(text), "bad.json", &t, &st);
    free(text);
    cr_assert_eq(rc, code, "expected %s, got %s: %s", pie_code_name(code), pie_code_name(rc), st.msg);
    cr_assert_null(t);
    cr_assert_str_eq(st.msg, msg);
}

static void expect_ids(tok *t, const char *text, size_t len, bool allow_special,
                       const uint32_t *want, size_t n_want) {
    uint32_t *ids;
    size_t n;
    pie_status st;
    cr_assert_eq(tok_encode(t, text, len, allow_special, &ids, &n, &st), PIE_OK, "encode: %s", st.msg);
    char got[1024] = "", exp[1024] = "";
    for (size_t i = 0; i < n && strlen(got) < 1000; i++)
        snprintf(got + strlen(got), sizeof got - strlen(got), " %u", ids[i]);
    for (size_t i = 0; i < n_want; i++)
        snprintf(exp + strlen(exp), sizeof exp - strlen(exp), " %u", want[i]);
    cr_assert_str_eq(got, exp, "encoding of \"%.*s\": got [%s ], want [%s ]", (int)len, text, got, exp);
    free(ids);
}

#define EXPECT(t, text, allow, ...)                                                              \
    do {                                                                                         \
        const uint32_t want_[] = {__VA_ARGS__};                                                  \
        expect_ids((t), (text), sizeof(text) - 1, (allow), want_, sizeof want_ / sizeof want_[0]); \
    } while (0)

/* encode -> decode gives back the same bytes. */
static void expect_round_trip(tok *t, const char *text, size_t len) {
    uint32_t *ids;
    size_t n;
    pie_status st;
    cr_assert_eq(tok_encode(t, text, len, true, &ids, &n, &st), PIE_OK, "encode: %s", st.msg);
    char *out;
    size_t out_len;
    cr_assert_eq(tok_decode(t, ids, n, &out, &out_len, &st), PIE_OK, "decode: %s", st.msg);
    cr_assert_eq(out_len, len, "round trip of %zu bytes gave %zu", len, out_len);
    cr_assert(memcmp(out, text, len) == 0, "round trip changed the bytes of \"%.40s\"", text);
    free(out);
    free(ids);
}

/* ---- encoding: exact splits --------------------------------------------------------------- */

Test(tok, llama3_known_splits) {
    tok *t = load_fixture(fixture(LLAMA3, true));
    EXPECT(t, "Hello world", false, T_HELLO, T_WORLD);
    EXPECT(t, "Hello the world", false, T_HELLO, T_THE, T_WORLD);
    EXPECT(t, " there", false, T_THE, B('r'), B('e'));
    EXPECT(t, "Hello, world!", false, T_HELLO, B(','), T_WORLD, B('!'));
    tok_free(t);
}

Test(tok, digits_split_in_threes_in_llama3_and_not_in_gpt2) {
    tok *t = load_fixture(fixture(LLAMA3, true));
    EXPECT(t, "12345", false, T_123, B('4'), B('5'));     /* "123" "45" */
    EXPECT(t, "4123", false, B('4'), T_12, B('3'));       /* "412" "3" */
    EXPECT(t, "1234567", false, T_123, B('4'), B('5'), B('6'), B('7')); /* "123" "456" "7" */
    tok_free(t);
    t = load_fixture(fixture(GPT2, false));
    EXPECT(t, "4123", false, B('4'), T_123);              /* one piece "4123" */
    tok_free(t);
}

Test(tok, contractions) {
    tok *t = load_fixture(fixture(LLAMA3, true));
    EXPECT(t, "it's", false, B('i'), B('t'), T_S);
    EXPECT(t, "IT'S", false, B('I'), B('T'), B('\''), B('S')); /* "'S" is one piece (caseless) */
    EXPECT(t, "we'll", false, B('w'), B('e'), B('\''), T_LL);    /* "we" "'ll" */
    tok_free(t);
}

Test(tok, whitespace_runs) {
    tok *t = load_fixture(fixture(LLAMA3, true));
    /* "a" "  " " b": a run of spaces leaves its last space to the next word */
    EXPECT(t, "a   b", false, B('a'), T_SP2, B(' '), B('b'));
    EXPECT(t, "a     b", false, B('a'), T_SP4, B(' '), B('b'));
    /* "a" " \n\n" "b" */
    EXPECT(t, "a \n\nb", false, B('a'), B(' '), B('\n'), B('\n'), B('b'));
    /* trailing spaces are one piece */
    EXPECT(t, "a    ", false, B('a'), T_SP4);
    EXPECT(t, "\t \t", false, B('\t'), B(' '), B('\t'));
    tok_free(t);
}

Test(tok, gpt2_bytelevel_regex_path) {
    tok *t = load_fixture(fixture(GPT2, false));
    /* HF's own example: "Hello" " there" "      " " dear" */
    EXPECT(t, "Hello there       dear", false, T_HELLO, T_THE, B('r'), B('e'), T_SP4, T_SP2, B(' '),
           B('d'), B('e'), B('a'), B('r'));
    /* contractions are case-sensitive in GPT-2: "'S" is punctuation then a letter */
    EXPECT(t, "it's", false, B('i'), B('t'), T_S);
    EXPECT(t, "Hello world", false, T_HELLO, T_WORLD);
    tok_free(t);
}

Test(tok, gpt2_add_prefix_space) {
    json_t *j = fixture(GPT2, false);
    json_object_set_new(json_object_get(j, "pre_tokenizer"), "add_prefix_space", json_true());
    tok *t = load_fixture(j);
    EXPECT(t, "Hello", false, B(' '), T_HELLO);
    EXPECT(t, " Hello", false, B(' '), T_HELLO);
    /* every segment between added tokens gets its own prefix space */
    EXPECT(t, "world<|eot_id|>world", true, T_WORLD, T_EOT, T_WORLD);
    tok_free(t);
}

Test(tok, qwen2_style_nfc_and_single_digits) {
    /* Qwen2: NFC normalizer (accepted, not applied), the Llama-3-like regex with \p{N} single
     * digits, ByteLevel without regex, string merges, no ignore_merges. */
    json_t *j = fixture(LLAMA3, false);
    json_object_del(model_of_fixture(j), "ignore_merges");
    json_object_set_new(j, "normalizer", json_pack("{s:s}", "type", "NFC"));
    json_t *split = json_array_get(json_object_get(json_object_get(j, "pre_tokenizer"), "pretokenizers"), 0);
    json_object_set_new(json_object_get(split, "pattern"), "Regex",
                        json_string("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}|"
                                    " ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"));
    tok *t = load_fixture(j);
    EXPECT(t, "12345", false, B('1'), B('2'), B('3'), B('4'), B('5'));
    EXPECT(t, "Hello world", false, T_HELLO, T_WORLD);
    EXPECT(t, "xyz", false, B('x'), B('y'), B('z'));   /* no ignore_merges */
    tok_free(t);
}

Test(tok, both_merge_forms_give_the_same_ids) {
    const char *texts[] = {"Hello world, the 12345 worlds!", "  Hello   the\n\nworld's", "\xF0\x9F\x98\x80"};
    tok *a = load_fixture(fixture(LLAMA3, true));
    tok *b = load_fixture(fixture(LLAMA3, false));
    for (size_t k = 0; k < sizeof texts / sizeof texts[0]; k++) {
        uint32_t *ia, *ib;
        size_t na, nb;
        pie_status st;
        cr_assert_eq(tok_encode(a, texts[k], strlen(texts[k]), true, &ia, &na, &st), PIE_OK);
        cr_assert_eq(tok_encode(b, texts[k], strlen(texts[k]), true, &ib, &nb, &st), PIE_OK);
        cr_assert_eq(na, nb, "\"%s\": %zu ids with pair merges, %zu with string merges", texts[k], na, nb);
        cr_assert(memcmp(ia, ib, na * sizeof *ia) == 0, "\"%s\": different ids", texts[k]);
        free(ia);
        free(ib);
    }
    EXPECT(b, "\xF0\x9F\x98\x80", false, T_EMOJI_A, T_EMOJI_B);
    tok_free(a);
    tok_free(b);
}

Test(tok, ignore_merges_emits_a_whole_vocab_piece) {
    tok *t = load_fixture(fixture(LLAMA3, true));
    EXPECT(t, "xyz", false, T_XYZ);                       /* no merge makes "xyz" */
    EXPECT(t, "xyz xyz", false, T_XYZ, B(' '), B('x'), B('y'), B('z')); /* " xyz" is not in the vocab */
    tok_free(t);
    json_t *j = fixture(LLAMA3, true);
    json_object_set_new(json_object_get(j, "model"), "ignore_merges", json_false());
    t = load_fixture(j);
    EXPECT(t, "xyz", false, B('x'), B('y'), B('z'));
    tok_free(t);
}

/* ---- added tokens ------------------------------------------------------------------------- */

Test(tok, special_tokens_are_matched_before_pretokenization_only_when_allowed) {
    tok *t = load_fixture(fixture(LLAMA3, true));
    EXPECT(t, "<|begin_of_text|>Hello<|eot_id|> world", true, T_BOT, T_HELLO, T_EOT, T_WORLD);
    /* not allowed: plain text, "<|" "eot" "_id" "|>" */
    EXPECT(t, "<|eot_id|>", false, B('<'), B('|'), B('e'), B('o'), B('t'), B('_'), B('i'), B('d'),
           B('|'), B('>'));
    /* a non-special added token is matched either way */
    EXPECT(t, "Hello<tool>", false, T_HELLO, T_TOOL);
    EXPECT(t, "Hello<tool>", true, T_HELLO, T_TOOL);
    /* longest match: "<|x|>x" beats "<|x|>" */
    EXPECT(t, "<|x|>xo", true, T_XX, B('o'));
    EXPECT(t, "<|x|>o", true, T_X, B('o'));
    /* an incomplete special at the end is text */
    EXPECT(t, "a<|eot_i", true, B('a'), B('<'), B('|'), B('e'), B('o'), B('t'), B('_'), B('i'));
    /* lstrip and rstrip swallow the spaces around "<mask>" */
    EXPECT(t, "a  <mask>  b", true, B('a'), T_MASK, B('b'));
    tok_free(t);
}

Test(tok, vocab_queries) {
    tok *t = load_fixture(fixture(LLAMA3, true));
    cr_assert_eq(tok_vocab_size(t), T_MASK + 1);
    size_t len;
    const uint8_t *p = tok_token_bytes(t, T_WORLD, &len);
    cr_assert(len == 6 && memcmp(p, " world", 6) == 0);
    p = tok_token_bytes(t, B(0xFF), &len);
    cr_assert(len == 1 && p[0] == 0xFF);
    p = tok_token_bytes(t, T_EMOJI_A, &len);
    cr_assert(len == 2 && p[0] == 0xF0 && p[1] == 0x9F);
    p = tok_token_bytes(t, T_EOT, &len);
    cr_assert(len == 10 && memcmp(p, "<|eot_id|>", 10) == 0);
    cr_assert_null(tok_token_bytes(t, T_MASK + 1, &len));
    cr_assert_eq(len, 0);
    cr_assert_eq(tok_special_id(t, "<|begin_of_text|>"), T_BOT);
    cr_assert_eq(tok_special_id(t, "<tool>"), T_TOOL);
    cr_assert_eq(tok_special_id(t, "<|begin_of_text"), -1);
    cr_assert_eq(tok_special_id(t, ""), -1);
    cr_assert_eq(tok_special_id(t, "Hello"), -1);
    cr_assert(tok_is_special(t, T_EOT));
    cr_assert(!tok_is_special(t, T_TOOL));
    cr_assert(!tok_is_special(t, T_HELLO));
    cr_assert(!tok_is_special(t, 1u << 30));
    tok_free(t);
}

/* ---- round trips -------------------------------------------------------------------------- */

Test(tok, round_trip_multilingual_emoji_and_whitespace) {
    static const char *const texts[] = {
        "Hello world! The quick brown fox jumps over the lazy dog.",
        "Größere Änderungen, déjà vu, ¿Dónde está la estación?",
        "城市里的早晨 東京の一日 Утро в деревне صباح في المدينة",
        "😀 👨‍👩‍👧‍👦 🇩🇪🇫🇷 👍🏽 ❤️ ∑ xᵢ² ≥ 0",
        "  \t\n\n   leading and trailing   \r\n\t  ",
        "12345 3.14159 2024-03-17T09:41:07Z +49 30 1234567",
        "<|begin_of_text|>system<|eot_id|><tool> <mask> done",
    };
    for (int s = 0; s < 2; s++) {
        tok *t = load_fixture(fixture(s == 0 ? LLAMA3 : GPT2, s == 0));
        for (size_t k = 0; k < sizeof texts / sizeof texts[0]; k++) {
            if (strstr(texts[k], "<mask>")) continue; /* lstrip/rstrip drop spaces by design */
            expect_round_trip(t, texts[k], strlen(texts[k]));
        }
        tok_free(t);
    }
}

Test(tok, empty_text_encodes_to_nothing) {
    tok *t = load_fixture(fixture(LLAMA3, true));
    uint32_t *ids = (uint32_t *)1;
    size_t n = 7;
    pie_status st;
    cr_assert_eq(tok_encode(t, "", 0, true, &ids, &n, &st), PIE_OK);
    cr_assert_null(ids);
    cr_assert_eq(n, 0);
    char *out;
    size_t len;
    cr_assert_eq(tok_decode(t, NULL, 0, &out, &len, &st), PIE_OK);
    cr_assert_eq(len, 0);
    cr_assert_str_eq(out, "");
    free(out);
    tok_free(t);
}

/* ---- hostile input ------------------------------------------------------------------------ */

Test(tok, invalid_utf8_is_encoded_byte_by_byte_and_round_trips) {
    tok *t = load_fixture(fixture(LLAMA3, true));
    /* an invalid byte is a pre-token of its own: "a" "\xFF" " b" */
    EXPECT(t, "a\xFF b", false, B('a'), B(0xFF), B(' '), B('b'));
    /* a truncated emoji at the end is still encoded (and merged) through byte tokens */
    EXPECT(t, "a\xF0\x9F\x98", false, B('a'), T_EMOJI_A, B(0x98));
    /* a lone continuation byte, an overlong, a surrogate */
    EXPECT(t, "\x80\xC0\xAF\xED\xA0\x80", false, B(0x80), B(0xC0), B(0xAF), B(0xED), B(0xA0), B(0x80));
    static const char bad[] = "ok \xC3( \xE2\x82 \xF4\x90\x80\x80 end\xFE\xFF";
    expect_round_trip(t, bad, sizeof bad - 1);
    tok_free(t);
}

/* A deterministic pseudo-random byte (xorshift). */
static uint32_t rnd(uint32_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 17;
    *s ^= *s << 5;
    return *s;
}

Test(tok, one_megabyte_inputs_round_trip) {
    const size_t n = 1u << 20;
    char *buf = malloc(n);
    cr_assert_not_null(buf);
    for (int s = 0; s < 2; s++) {
        tok *t = load_fixture(fixture(s == 0 ? LLAMA3 : GPT2, s == 0));
        memset(buf, 'a', n); /* one pre-token of 1 MB */
        expect_round_trip(t, buf, n);
        memset(buf, ' ', n); /* one whitespace run */
        expect_round_trip(t, buf, n);
        memset(buf, '7', n);
        expect_round_trip(t, buf, n);
        uint32_t seed = 12345;
        for (size_t i = 0; i < n; i++) buf[i] = (char)(rnd(&seed) & 0xFF); /* random bytes */
        expect_round_trip(t, buf, n);
        static const char text[] = "Hello the world, <|eot_id|> Größe 城市 😀 12345\n";
        for (size_t i = 0; i < n; i++) buf[i] = text[i % (sizeof text - 1)];
        expect_round_trip(t, buf, n);
        tok_free(t);
    }
    free(buf);
}

Test(tok, out_of_range_and_missing_ids_are_errors) {
    json_t *j = fixture(LLAMA3, true);
    json_array_append_new(json_object_get(j, "added_tokens"), added_token(300, "<|far|>", true, false));
    tok *t = load_fixture(j);
    cr_assert_eq(tok_vocab_size(t), 301);
    pie_status st;
    char *out = (char *)1;
    size_t len;
    const uint32_t ids[] = {T_HELLO, 301};
    cr_assert_eq(tok_decode(t, ids, 2, &out, &len, &st), PIE_OUT_OF_RANGE);
    cr_assert_str_eq(st.msg, "tok: decode: id 301 at position 1 is out of range (vocab size 301)");
    cr_assert_null(out);
    const uint32_t gap[] = {290};
    cr_assert_eq(tok_decode(t, gap, 1, &out, &len, &st), PIE_OUT_OF_RANGE);
    cr_assert_str_eq(st.msg, "tok: decode: id 290 at position 0 has no token (a gap in the vocab)");
    size_t n;
    cr_assert_null(tok_token_bytes(t, 290, &n));
    const uint32_t huge[] = {UINT32_MAX};
    cr_assert_eq(tok_decode(t, huge, 1, &out, &len, &st), PIE_OUT_OF_RANGE);
    cr_assert_str_eq(st.msg, "tok: decode: id 4294967295 at position 0 is out of range (vocab size 301)");

    tok_stream *s;
    cr_assert_eq(tok_stream_new(t, &s, &st), PIE_OK);
    const char *text;
    cr_assert_eq(tok_stream_push(s, huge, 1, &text, &len, &st), PIE_OUT_OF_RANGE);
    cr_assert_str_eq(st.msg, "tok: stream: id 4294967295 at position 0 is out of range (vocab size 301)");
    tok_stream_free(s);
    tok_free(t);
}

Test(tok, a_byte_without_a_token_is_an_encode_error) {
    json_t *j = fixture(LLAMA3, true);
    char key[8];
    char c = 'q';
    json_object_del(json_object_get(json_object_get(j, "model"), "vocab"), bl(&c, 1, key));
    tok *t = load_fixture(j);
    uint32_t *ids;
    size_t n;
    pie_status st;
    cr_assert_eq(tok_encode(t, "abq", 3, false, &ids, &n, &st), PIE_INVALID_ARGUMENT);
    cr_assert_str_eq(st.msg, "tok: encode: byte 0x71 at offset 2 has no token in model.vocab and "
                             "model.unk_token is not set");
    cr_assert_null(ids);
    tok_free(t);
}

/* ---- streaming ---------------------------------------------------------------------------- */

static void push(tok_stream *s, const uint32_t *ids, size_t n, const char *want, size_t want_len) {
    const char *text;
    size_t len;
    pie_status st;
    cr_assert_eq(tok_stream_push(s, ids, n, &text, &len, &st), PIE_OK, "push: %s", st.msg);
    cr_assert_eq(len, want_len, "push handed out %zu bytes, want %zu", len, want_len);
    cr_assert(memcmp(text, want, len) == 0);
    cr_assert_eq(text[len], '\0');
}

static void finish(tok_stream *s, const char *want) {
    const char *text;
    size_t len;
    pie_status st;
    cr_assert_eq(tok_stream_finish(s, &text, &len, &st), PIE_OK);
    cr_assert_str_eq(text, want);
    cr_assert_eq(len, strlen(want));
}

Test(tok, stream_holds_back_an_emoji_split_across_tokens) {
    tok *t = load_fixture(fixture(LLAMA3, true));
    tok_stream *s;
    pie_status st;
    cr_assert_eq(tok_stream_new(t, &s, &st), PIE_OK);
    const uint32_t hello[] = {T_HELLO}, a[] = {T_EMOJI_A}, b[] = {T_EMOJI_B};
    push(s, hello, 1, "Hello", 5);
    push(s, a, 1, "", 0);                       /* F0 9F: held back */
    push(s, b, 1, "\xF0\x9F\x98\x80", 4);       /* 98 80: the whole emoji */
    /* byte by byte */
    const uint32_t b1[] = {B(0xF0)}, b2[] = {B(0x9F)}, b3[] = {B(0x98)}, b4[] = {B(0x80)};
    push(s, b1, 1, "", 0);
    push(s, b2, 1, "", 0);
    push(s, b3, 1, "", 0);
    push(s, b4, 1, "\xF0\x9F\x98\x80", 4);
    finish(s, "");
    tok_stream_free(s);
    tok_free(t);
}

Test(tok, stream_replaces_invalid_bytes_and_flushes_on_finish) {
    tok *t = load_fixture(fixture(LLAMA3, true));
    tok_stream *s;
    pie_status st;
    cr_assert_eq(tok_stream_new(t, &s, &st), PIE_OK);
    const uint32_t ff[] = {B(0xFF), B('a')};
    push(s, ff, 2, "\xEF\xBF\xBD" "a", 4);
    const uint32_t broken[] = {B(0xE2), B('(')}; /* a lead byte, then not a continuation */
    push(s, broken, 2, "\xEF\xBF\xBD(", 4);
    const uint32_t surrogate[] = {B(0xED), B(0xA0), B(0x80)}; /* ED A0: never valid */
    push(s, surrogate, 3, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD", 9);
    const uint32_t half[] = {T_HELLO, T_EMOJI_A};
    push(s, half, 2, "Hello", 5);
    finish(s, "\xEF\xBF\xBD");                   /* the held-back F0 9F */
    /* the stream is reusable after finish */
    const uint32_t again[] = {T_WORLD};
    push(s, again, 1, " world", 6);
    finish(s, "");
    tok_stream_free(s);
    tok_free(t);
}

/* Whether p[0..n) is valid UTF-8 (written out here, independently of the library). */
static bool valid_utf8(const unsigned char *p, size_t n) {
    for (size_t i = 0; i < n;) {
        unsigned c = p[i];
        size_t k = c < 0x80 ? 1 : c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3
                 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
        if (k == 0 || i + k > n) return false;
        uint32_t cp = k == 1 ? c : k == 2 ? c & 0x1F : k == 3 ? c & 0x0F : c & 0x07;
        for (size_t j = 1; j < k; j++) {
            if ((p[i + j] & 0xC0) != 0x80) return false;
            cp = cp << 6 | (p[i + j] & 0x3F);
        }
        if ((k == 2 && cp < 0x80) || (k == 3 && cp < 0x800) || (k == 4 && cp < 0x10000) ||
            cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            return false;
        i += k;
    }
    return true;
}

Test(tok, stream_never_emits_broken_utf8_and_reproduces_valid_text) {
    tok *t = load_fixture(fixture(GPT2, false));
    static const char text[] = "Größe 城市 😀👨‍👩‍👧 Утро ∑ صباح 12345 Hello the world";
    uint32_t *ids;
    size_t n;
    pie_status st;
    cr_assert_eq(tok_encode(t, text, sizeof text - 1, true, &ids, &n, &st), PIE_OK);
    tok_stream *s;
    cr_assert_eq(tok_stream_new(t, &s, &st), PIE_OK);
    char got[256] = "";
    for (size_t i = 0; i < n; i++) {
        const char *piece;
        size_t len;
        cr_assert_eq(tok_stream_push(s, ids + i, 1, &piece, &len, &st), PIE_OK);
        cr_assert(valid_utf8((const unsigned char *)piece, len), "id %zu handed out broken UTF-8", i);
        strncat(got, piece, sizeof got - strlen(got) - 1);
    }
    finish(s, "");
    cr_assert_str_eq(got, text);
    free(ids);

    /* random ids: every piece handed out is valid UTF-8 */
    uint32_t seed = 99;
    for (int round = 0; round < 2000; round++) {
        uint32_t id = rnd(&seed) % (T_EMOJI_B + 1);
        const char *piece;
        size_t len;
        cr_assert_eq(tok_stream_push(s, &id, 1, &piece, &len, &st), PIE_OK);
        cr_assert(valid_utf8((const unsigned char *)piece, len), "round %d: broken UTF-8", round);
    }
    const char *piece;
    size_t len;
    cr_assert_eq(tok_stream_finish(s, &piece, &len, &st), PIE_OK);
    cr_assert(valid_utf8((const unsigned char *)piece, len));
    tok_stream_free(s);
    tok_free(t);
}

/* ---- Split behaviors ---------------------------------------------------------------------- */

/* A fixture whose pre-tokenizer is Split("-", behavior) alone, with ignore_merges and the
 * expected pieces in the vocab, so every piece is exactly one id. */
static tok *split_fixture(const char *behavior, bool invert) {
    json_t *j = fixture(LLAMA3, true);
    json_t *vocab = json_object_get(json_object_get(j, "model"), "vocab");
    static const char *const pieces[] = {"the", "final", "countdown", "the-", "final-", "-final",
                                         "-countdown", "--"};
    for (size_t i = 0; i < sizeof pieces / sizeof pieces[0]; i++)
        json_object_set_new(vocab, pieces[i], json_integer(400 + (json_int_t)i));
    json_object_set_new(j, "pre_tokenizer",
                        json_pack("{s:s, s:{s:s}, s:s, s:b}", "type", "Split", "pattern", "String",
                                  "-", "behavior", behavior, "invert", invert));
    return load_fixture(j);
}

Test(tok, split_behaviors) {
    enum { THE = 400, FINAL, COUNTDOWN, THE_, FINAL_, _FINAL, _COUNTDOWN, DASHES };
    const uint32_t D = B('-');
    tok *t = split_fixture("Isolated", false);
    EXPECT(t, "the-final--countdown", false, THE, D, FINAL, D, D, COUNTDOWN);
    tok_free(t);
    t = split_fixture("Removed", false);
    EXPECT(t, "the-final--countdown", false, THE, FINAL, COUNTDOWN);
    tok_free(t);
    t = split_fixture("MergedWithPrevious", false);
    EXPECT(t, "the-final--countdown", false, THE_, FINAL_, D, COUNTDOWN);
    tok_free(t);
    t = split_fixture("MergedWithNext", false);
    EXPECT(t, "the-final--countdown", false, THE, _FINAL, D, _COUNTDOWN);
    tok_free(t);
    t = split_fixture("Contiguous", false);
    EXPECT(t, "the-final--countdown", false, THE, D, FINAL, DASHES, COUNTDOWN);
    tok_free(t);
    t = split_fixture("Removed", true); /* invert: the non-matches are removed */
    EXPECT(t, "the-final--countdown", false, D, D, D);
    tok_free(t);
}

/* ---- load errors: the exact message for each ---------------------------------------------- */

Test(tok, load_error_missing_file) {
    pie_status st;
    tok *t;
    cr_assert_eq(tok_load("/nonexistent/dir/tokenizer.json", &t, &st), PIE_NOT_FOUND);
    cr_assert_str_eq(st.msg, "tok: /nonexistent/dir/tokenizer.json: cannot open: unable to open "
                             "/nonexistent/dir/tokenizer.json: No such file or directory");
}

Test(tok, load_from_a_file) {
    pie_status st;
    char *dir = pie_proc_tmpdir(&st);
    cr_assert_not_null(dir, "%s", st.msg);
    json_t *j = fixture(LLAMA3, true);
    char *text = json_dumps(j, 0);
    json_decref(j);
    char *path = pie_proc_write_file(dir, "tokenizer.json", text, &st);
    free(text);
    cr_assert_not_null(path, "%s", st.msg);
    tok *t;
    cr_assert_eq(tok_load(path, &t, &st), PIE_OK, "%s", st.msg);
    EXPECT(t, "Hello world", false, T_HELLO, T_WORLD);
    tok_free(t);

    char *bad = pie_proc_write_file(dir, "bad.json", "{\"model\": {\n  \"vocab\": [}", &st);
    cr_assert_not_null(bad, "%s", st.msg);
    cr_assert_eq(tok_load(bad, &t, &st), PIE_INVALID_ARGUMENT);
    char want[512];
    snprintf(want, sizeof want, "tok: %s: not valid JSON: line 2 column 13: unexpected token near '}'", bad);
    cr_assert_str_eq(st.msg, want);
    free(path);
    free(bad);
    pie_proc_rmdir(dir);
    free(dir);
}

Test(tok, load_errors_in_the_json_structure) {
    expect_load_error(json_array(), PIE_INVALID_ARGUMENT, "tok: bad.json: the top level is not a JSON object");
    expect_load_error(json_object(), PIE_INVALID_ARGUMENT, "tok: bad.json: \"model\" is missing or not an object");
    json_t *j = fixture(LLAMA3, true);
    json_object_del(model_of_fixture(j), "vocab");
    expect_load_error(j, PIE_INVALID_ARGUMENT, "tok: bad.json: model.vocab is missing or not an object");
    j = fixture(LLAMA3, true);
    json_object_set_new(model_of_fixture(j), "vocab", json_object());
    expect_load_error(j, PIE_INVALID_ARGUMENT, "tok: bad.json: model.vocab is empty");
    j = fixture(LLAMA3, true);
    json_object_set_new(j, "added_tokens", json_string("none"));
    expect_load_error(j, PIE_INVALID_ARGUMENT, "tok: bad.json: added_tokens: expected an array");
}

Test(tok, load_errors_in_the_model) {
    json_t *j = fixture(LLAMA3, true);
    json_object_set_new(model_of_fixture(j), "type", json_string("WordPiece"));
    expect_load_error(j, PIE_UNIMPLEMENTED, "tok: bad.json: model.type \"WordPiece\" is not supported (only BPE)");

    j = fixture(LLAMA3, true);
    json_object_set_new(json_object_get(model_of_fixture(j), "vocab"), "abc", json_integer(-4));
    expect_load_error(j, PIE_INVALID_ARGUMENT, "tok: bad.json: model.vocab[\"abc\"]: id must be an integer in 0..268435455");

    j = fixture(LLAMA3, true);
    json_object_set_new(json_object_get(model_of_fixture(j), "vocab"), "abc", json_string("7"));
    expect_load_error(j, PIE_INVALID_ARGUMENT, "tok: bad.json: model.vocab[\"abc\"]: id must be an integer in 0..268435455");

    j = fixture(LLAMA3, true);
    json_object_set_new(json_object_get(model_of_fixture(j), "vocab"), "abc", json_integer(T_XYZ));
    expect_load_error(j, PIE_INVALID_ARGUMENT, "tok: bad.json: model.vocab[\"abc\"]: id 275 is already used by another vocab entry");

    j = fixture(LLAMA3, true);
    json_object_set_new(model_of_fixture(j), "byte_fallback", json_true());
    expect_load_error(j, PIE_UNIMPLEMENTED, "tok: bad.json: model.byte_fallback is set; only null/false is supported");

    j = fixture(LLAMA3, true);
    json_object_set_new(model_of_fixture(j), "unk_token", json_string("<unk>"));
    expect_load_error(j, PIE_INVALID_ARGUMENT, "tok: bad.json: model.unk_token \"<unk>\" is not in model.vocab");

    j = fixture(LLAMA3, true);
    json_object_set_new(model_of_fixture(j), "ignore_merges", json_string("yes"));
    expect_load_error(j, PIE_INVALID_ARGUMENT, "tok: bad.json: model.ignore_merges: expected true or false");
}

Test(tok, load_errors_in_merges) {
    json_t *j = fixture(LLAMA3, false);
    json_array_set_new(json_object_get(model_of_fixture(j), "merges"), 0, json_string("a b c"));
    expect_load_error(j, PIE_INVALID_ARGUMENT, "tok: bad.json: model.merges[0] \"a b c\": expected \"a b\" or [\"a\", \"b\"] with two non-empty tokens");

    j = fixture(LLAMA3, true);
    json_array_set_new(json_object_get(model_of_fixture(j), "merges"), 2, json_integer(5));
    expect_load_error(j, PIE_INVALID_ARGUMENT, "tok: bad.json: model.merges[2] (a JSON scalar): expected \"a b\" or [\"a\", \"b\"] with two non-empty tokens");

    j = fixture(LLAMA3, true);
    json_array_set_new(json_object_get(model_of_fixture(j), "merges"), 1, json_pack("[s, s]", "h", "qq"));
    expect_load_error(j, PIE_INVALID_ARGUMENT, "tok: bad.json: model.merges[1] [\"h\", \"qq\"]: \"qq\" is not in model.vocab");

    j = fixture(LLAMA3, false);
    json_array_set_new(json_object_get(model_of_fixture(j), "merges"), 1, json_string("a b"));
    expect_load_error(j, PIE_INVALID_ARGUMENT, "tok: bad.json: model.merges[1] \"a b\": \"ab\" is not in model.vocab");

    j = fixture(LLAMA3, true);
    json_object_set_new(model_of_fixture(j), "merges", json_object());
    expect_load_error(j, PIE_INVALID_ARGUMENT, "tok: bad.json: model.merges: expected an array");
}

Test(tok, load_errors_in_added_tokens) {
    json_t *j = fixture(LLAMA3, true);
    json_object_del(json_array_get(json_object_get(j, "added_tokens"), 1), "content");
    expect_load_error(j, PIE_INVALID_ARGUMENT, "tok: bad.json: added_tokens[1].content: expected a non-empty string");

    j = fixture(LLAMA3, true);
    json_object_set_new(json_array_get(json_object_get(j, "added_tokens"), 0), "id", json_string("x"));
    expect_load_error(j, PIE_INVALID_ARGUMENT, "tok: bad.json: added_tokens[0].id: id must be an integer in 0..268435455");

    j = fixture(LLAMA3, true);
    json_object_set_new(json_array_get(json_object_get(j, "added_tokens"), 2), "id", json_integer(T_BOT));
    expect_load_error(j, PIE_INVALID_ARGUMENT, "tok: bad.json: added_tokens[2] \"<tool>\": id 276 is already used by another added token");

    j = fixture(LLAMA3, true);
    json_object_set_new(json_array_get(json_object_get(j, "added_tokens"), 3), "special", json_string("true"));
    expect_load_error(j, PIE_INVALID_ARGUMENT, "tok: bad.json: added_tokens[3].special: expected true or false");
}

Test(tok, load_errors_in_normalizer_pretokenizer_decoder) {
    json_t *j = fixture(LLAMA3, true);
    json_object_set_new(j, "normalizer", json_pack("{s:s}", "type", "Lowercase"));
    expect_load_error(j, PIE_UNIMPLEMENTED, "tok: bad.json: normalizer type \"Lowercase\" is not supported (only null or NFC)");

    j = fixture(LLAMA3, true);
    json_object_set_new(j, "pre_tokenizer", json_pack("{s:s}", "type", "Metaspace"));
    expect_load_error(j, PIE_UNIMPLEMENTED, "tok: bad.json: pre_tokenizer type \"Metaspace\" is not supported (only Split, ByteLevel, Sequence)");

    j = fixture(LLAMA3, true);
    json_t *split = json_array_get(json_object_get(json_object_get(j, "pre_tokenizer"), "pretokenizers"), 0);
    json_object_set_new(json_object_get(split, "pattern"), "Regex", json_string("(\\p{L}+"));
    expect_load_error(j, PIE_INVALID_ARGUMENT, "tok: bad.json: pre_tokenizer.pretokenizers[0].pattern: the regex does not compile: missing closing parenthesis at offset 7");

    j = fixture(LLAMA3, true);
    split = json_array_get(json_object_get(json_object_get(j, "pre_tokenizer"), "pretokenizers"), 0);
    json_object_set_new(split, "behavior", json_string("Sideways"));
    expect_load_error(j, PIE_INVALID_ARGUMENT, "tok: bad.json: pre_tokenizer.pretokenizers[0].behavior \"Sideways\": expected Isolated, Removed, MergedWithPrevious, MergedWithNext or Contiguous");

    j = fixture(LLAMA3, true);
    split = json_array_get(json_object_get(json_object_get(j, "pre_tokenizer"), "pretokenizers"), 0);
    json_object_set_new(split, "pattern", json_string("\\s+"));
    expect_load_error(j, PIE_INVALID_ARGUMENT, "tok: bad.json: pre_tokenizer.pretokenizers[0].pattern: expected {\"Regex\": \"...\"} or {\"String\": \"...\"}");

    j = fixture(LLAMA3, true);
    json_object_set_new(j, "decoder", json_null());
    expect_load_error(j, PIE_UNIMPLEMENTED, "tok: bad.json: decoder type \"(null)\" is not supported (only ByteLevel)");

    j = fixture(LLAMA3, true);
    json_object_set_new(j, "decoder", json_pack("{s:s}", "type", "WordPiece"));
    expect_load_error(j, PIE_UNIMPLEMENTED, "tok: bad.json: decoder type \"WordPiece\" is not supported (only ByteLevel)");
}

Test(tok, load_error_for_json_that_is_not_json) {
    pie_status st;
    tok *t;
    const char text[] = "{\"model\": 1,";
    cr_assert_eq(tok_load_json(text, sizeof text - 1, "x.json", &t, &st), PIE_INVALID_ARGUMENT);
    cr_assert_str_eq(st.msg, "tok: x.json: not valid JSON: line 1 column 12: string or '}' expected near end of file");
}

/* ---- \s is Unicode's White_Space ------------------------------------------------------------ */

static void expect_translation(const char *pattern, const char *want) {
    size_t n = 0;
    char *got = tok_regex_translate(pattern, strlen(pattern), &n);
    cr_assert_not_null(got);
    cr_assert_eq(n, strlen(got));
    cr_assert_str_eq(got, want, "translation of %s", pattern);
    free(got);
}

#define WS                                                                                       \
    "\\t-\\r\\x20\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}" \
    "\\x{3000}"

Test(tok, regex_translation_spells_out_white_space_only_where_it_is_a_class_escape) {
    expect_translation("\\s+(?!\\S)", "[" WS "]+(?![^" WS "])");
    expect_translation(" ?[^\\s\\p{L}\\p{N}]+", " ?[^" WS "\\p{L}\\p{N}]+");
    expect_translation("[\\S]", "[\\S]");                      /* no class-member spelling: kept */
    expect_translation("\\\\s", "\\\\s");                      /* an escaped backslash, then "s" */
    expect_translation("\\Q\\s[\\E\\s", "\\Q\\s[\\E[" WS "]"); /* quoted text is literal */
    expect_translation("[]\\s]", "[]" WS "]"); /* "]" first in a class is a member */
    expect_translation("[^]\\s]\\s", "[^]" WS "][" WS "]");
    expect_translation("[[:alpha:]\\s]x", "[[:alpha:]" WS "]x");
    expect_translation("[\\s-x]", "[" WS "\\-x]"); /* "-" after \s is a member, not a range */
    expect_translation("(?#[\\s)\\s", "(?#[\\s)[" WS "]"); /* a comment is copied as it is */
    expect_translation("\\cX\\s\\p{Zs}\\x{20}", "\\cX[" WS "]\\p{Zs}\\x{20}");
    expect_translation("", "");
}

/* Whether the compiled pattern matches all of the UTF-8 text s. */
static bool matches_whole(const char *pattern, const char *s) {
    int err;
    size_t off;
    pcre2_code *re = tok_regex_compile(pattern, strlen(pattern), false, &err, &off);
    cr_assert_not_null(re, "%s does not compile", pattern);
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    cr_assert_not_null(md);
    int rc = pcre2_match(re, (PCRE2_SPTR)s, strlen(s), 0, PCRE2_ANCHORED, md, NULL);
    bool whole = rc > 0 && pcre2_get_ovector_pointer(md)[1] == strlen(s);
    pcre2_match_data_free(md);
    pcre2_code_free(re);
    return whole;
}

Test(tok, white_space_is_unicodes_without_u180e) {
    static const char *const spaces[] = {"\t",           "\n",           "\v",
                                         "\f",           "\r",           " ",
                                         "\xC2\x85",     "\xC2\xA0",     "\xE1\x9A\x80",
                                         "\xE2\x80\x80", "\xE2\x80\x8A", "\xE2\x80\xA8",
                                         "\xE2\x80\xA9", "\xE2\x80\xAF", "\xE2\x81\x9F",
                                         "\xE3\x80\x80"};
    for (size_t i = 0; i < sizeof spaces / sizeof spaces[0]; i++) {
        cr_assert(matches_whole("\\s", spaces[i]), "space %zu is not \\s", i);
        cr_assert(!matches_whole("\\S", spaces[i]), "space %zu is \\S", i);
        cr_assert(!matches_whole("[^\\s]", spaces[i]), "space %zu is [^\\s]", i);
        cr_assert(matches_whole("[\\s-x]", spaces[i]), "space %zu is not [\\s-x]", i);
    }
    /* U+180E (PCRE2 counts it as \s), U+200B, U+FEFF, U+2060: not White_Space */
    static const char *const others[] = {"\xE1\xA0\x8E", "\xE2\x80\x8B", "\xEF\xBB\xBF",
                                         "\xE2\x81\xA0", "x"};
    for (size_t i = 0; i < sizeof others / sizeof others[0]; i++) {
        cr_assert(!matches_whole("\\s", others[i]), "non-space %zu is \\s", i);
        cr_assert(matches_whole("\\S", others[i]), "non-space %zu is not \\S", i);
        cr_assert(matches_whole("[^\\s\\p{L}\\p{N}]", others[i]) == (others[i][0] != 'x'));
        cr_assert(matches_whole("[\\s-x]", others[i]) == (others[i][0] == 'x'));
    }
    cr_assert(matches_whole("[\\s-x]", "-"));
}

Test(tok, u180e_does_not_split_like_a_space) {
    /* A Split on \s+ that removes the matches: U+180E stays in the piece (as in HF tokenizers
     * and tiktoken), so "a\u180Eb" keeps all its bytes. */
    json_t *j = fixture(LLAMA3, true);
    json_t *split =
        json_array_get(json_object_get(json_object_get(j, "pre_tokenizer"), "pretokenizers"), 0);
    json_object_set_new(json_object_get(split, "pattern"), "Regex", json_string("\\s+"));
    json_object_set_new(split, "behavior", json_string("Removed"));
    tok *t = load_fixture(j);
    EXPECT(t, "a\u180Eb", false, B('a'), B(0xE1), B(0xA0), B(0x8E), B('b'));
    EXPECT(t, "a\u3000b", false, B('a'), B('b')); /* U+3000 is a space */
    tok_free(t);
}

/* ---- threads ------------------------------------------------------------------------------ */

typedef struct enc_job {
    const tok *t;
    const char *text;
    uint32_t *ids;
    size_t n;
    pie_code rc;
} enc_job;

static void *encode_job(void *arg) {
    enc_job *job = arg;
    pie_status st;
    for (int i = 0; i < 50; i++) {
        free(job->ids);
        job->rc = tok_encode(job->t, job->text, strlen(job->text), true, &job->ids, &job->n, &st);
        if (job->rc != PIE_OK) break;
    }
    return NULL;
}

Test(tok, concurrent_encodes_of_one_tok_agree) {
    tok *t = load_fixture(fixture(LLAMA3, true));
    const char *text = "Hello the world 12345 <|eot_id|> Größe 城市 😀 it's   done\n";
    enc_job jobs[4] = {{.t = t, .text = text}, {.t = t, .text = text}, {.t = t, .text = text},
                       {.t = t, .text = text}};
    pthread_t th[4];
    for (int i = 0; i < 4; i++) cr_assert_eq(pthread_create(&th[i], NULL, encode_job, &jobs[i]), 0);
    for (int i = 0; i < 4; i++) cr_assert_eq(pthread_join(th[i], NULL), 0);
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(jobs[i].rc, PIE_OK);
        cr_assert_eq(jobs[i].n, jobs[0].n);
        cr_assert(memcmp(jobs[i].ids, jobs[0].ids, jobs[0].n * sizeof(uint32_t)) == 0);
    }
    for (int i = 0; i < 4; i++) free(jobs[i].ids);
    tok_free(t);
}

/* ---- consistency with tools/tinymodel/bpe_train.py ---------------------------------------- */

/* bpe_train.py makes the tokenizers of the test models and has a slow encoder of its own (with
 * its own copy of the regexes): the ids it gives its tokenizers must be pie_tok's. This is not
 * the independent reference: that is tiktoken, in tests/tok (published vocabularies, their
 * well-known encodings, a varied corpus and random strings). */

static char *read_all(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "cannot open %s", path);
    cr_assert_eq(fseek(f, 0, SEEK_END), 0);
    long n = ftell(f);
    cr_assert(n >= 0);
    cr_assert_eq(fseek(f, 0, SEEK_SET), 0);
    char *buf = malloc((size_t)n + 1);
    cr_assert_not_null(buf);
    cr_assert_eq(fread(buf, 1, (size_t)n, f), (size_t)n);
    buf[n] = '\0';
    fclose(f);
    *len = (size_t)n;
    return buf;
}

/* Trains a tokenizer on the corpus with bpe_train.py, encodes a text with bpe_train.py's own
 * encoder, and expects tok_encode to give exactly the same ids. */
static void cross_check(const char *style, int vocab_size) {
    pie_status st;
    char *dir = pie_proc_tmpdir(&st);
    cr_assert_not_null(dir, "%s", st.msg);
    /* the corpus plus text that exercises special tokens and unusual whitespace */
    static const char extra[] = "<|begin_of_text|>Hi<|eot_id|>  \t x\r\n\r\n y  <|end_of_text|>\n"
                                "IT'S WE'LL 1234567 ___ --> ...\n";
    size_t corpus_len;
    char *corpus = read_all(PIE_SOURCE_DIR "/tools/tinymodel/corpus.txt", &corpus_len);
    char *input = malloc(corpus_len + sizeof extra);
    cr_assert_not_null(input);
    memcpy(input, extra, sizeof extra - 1);
    memcpy(input + sizeof extra - 1, corpus, corpus_len + 1);
    char *input_path = pie_proc_write_file(dir, "input.txt", input, &st);
    cr_assert_not_null(input_path, "%s", st.msg);
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "/usr/bin/python3 %s/tools/tinymodel/bpe_train.py --corpus %s/tools/tinymodel/corpus.txt "
             "--vocab-size %d --style %s --out %s/tokenizer.json --encode %s --ids-out %s/ids.txt",
             PIE_SOURCE_DIR, PIE_SOURCE_DIR, vocab_size, style, dir, input_path, dir);
    cr_assert_eq(system(cmd), 0, "failed: %s", cmd);

    char path[1024];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    tok *t;
    cr_assert_eq(tok_load(path, &t, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(tok_vocab_size(t), (uint32_t)vocab_size);
    cr_assert_eq(tok_special_id(t, "<|begin_of_text|>"), vocab_size - 5);
    cr_assert_eq(tok_special_id(t, "<|end_header_id|>"), vocab_size - 1);

    uint32_t *ids;
    size_t n;
    cr_assert_eq(tok_encode(t, input, strlen(input), true, &ids, &n, &st), PIE_OK, "%s", st.msg);
    snprintf(path, sizeof path, "%s/ids.txt", dir);
    size_t ref_len;
    char *ref = read_all(path, &ref_len);
    size_t i = 0;
    char *p = ref;
    for (; *p != '\n' && *p != '\0'; i++) {
        char *end;
        unsigned long v = strtoul(p, &end, 10);
        cr_assert(end != p, "bad ids file at id %zu", i);
        cr_assert(i < n, "C encoding has %zu ids, bpe_train.py more", n);
        cr_assert_eq(ids[i], (uint32_t)v, "%s/%d: id %zu differs: C %u, bpe_train.py %lu", style,
                     vocab_size, i, ids[i], v);
        p = end;
        while (*p == ' ') p++;
    }
    cr_assert_eq(i, n, "C encoding has %zu ids, bpe_train.py %zu", n, i);
    expect_round_trip(t, input, strlen(input));

    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    remove(path);
    snprintf(path, sizeof path, "%s/ids.txt", dir);
    remove(path);
    free(ref);
    free(ids);
    tok_free(t);
    free(input_path);
    free(input);
    free(corpus);
    pie_proc_rmdir(dir);
    free(dir);
}

Test(tok, agrees_with_bpe_train_py_llama3_style, .timeout = 120) { cross_check("llama3", 512); }
Test(tok, agrees_with_bpe_train_py_gpt2_style, .timeout = 120) { cross_check("gpt2", 512); }
Test(tok, agrees_with_bpe_train_py_large_vocab, .timeout = 120) { cross_check("llama3", 4096); }
