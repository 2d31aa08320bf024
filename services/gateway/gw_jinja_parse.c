/* gw_jinja_parse.c — the chat-template interpreter's front end: template source → syntax tree.
 *
 * Owns: the whitespace preprocessing (@huggingface/jinja's: one trailing newline dropped,
 * lstrip_blocks, trim_blocks, the transformers `{% generation %}` tag removed), the tokenizer,
 * the recursive-descent parser (precedence as @huggingface/jinja's parser.ts), the nesting caps
 * that keep hostile templates from overflowing the C stack, gw_jinja_parse and gw_jinja_free.
 * Does not own: evaluation (gw_jinja.c), filter and test tables (gw_jinja_builtins.c).
 * Every source byte carries its line through preprocessing, so errors name the original line. */
#include "gw_jinja_int.h"

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GJ_MAX_HEIGHT 200 /* syntax-tree height; evaluation recursion follows it */

/* ---- preprocessing: text with the original line of each byte --------------------------------- */

typedef struct gj_src {
    char *p;
    int *line;
    size_t n, cap;
} gj_src;

typedef struct gj_parser {
    char *err;
    size_t err_len;
    bool failed;
    int depth; /* nesting of blocks, parentheses and unary operators now being parsed */
    struct gj_tok *t;
    size_t n_tok, cap_tok, cur;
    int last_line;
} gj_parser;

static void gj_perr(gj_parser *p, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void gj_perr(gj_parser *p, int line, const char *fmt, ...) {
    if (p->failed) return;
    p->failed = true;
    if (!p->err || p->err_len == 0) return;
    int k = snprintf(p->err, p->err_len, "chat template line %d: ", line);
    if (k < 0 || (size_t)k >= p->err_len) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->err + k, p->err_len - (size_t)k, fmt, ap);
    va_end(ap);
}

static int gj_src_put(gj_parser *p, gj_src *s, char c, int line) {
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 256;
        char *np = realloc(s->p, cap);
        if (!np) goto oom;
        s->p = np;
        int *nl = realloc(s->line, cap * sizeof *nl);
        if (!nl) goto oom;
        s->line = nl;
        s->cap = cap;
    }
    s->p[s->n] = c;
    s->line[s->n++] = line;
    return 0;
oom:
    gj_perr(p, line, "out of memory");
    return -1;
}

static void gj_src_free(gj_src *s) {
    free(s->p);
    free(s->line);
    *s = (gj_src){0};
}

/* JavaScript's multiline `^`: the start, or after \n, \r, U+2028, U+2029. */
static bool gj_line_start(const gj_src *s, size_t i) {
    if (i == 0) return true;
    char c = s->p[i - 1];
    if (c == '\n' || c == '\r') return true;
    return i >= 3 && (unsigned char)s->p[i - 3] == 0xE2 && (unsigned char)s->p[i - 2] == 0x80 &&
           ((unsigned char)c == 0xA8 || (unsigned char)c == 0xA9);
}

/* /^[ \t]*({[#%-])/gm → "$1" */
static int gj_pre_lstrip(gj_parser *p, const gj_src *in, gj_src *out) {
    for (size_t i = 0; i < in->n;) {
        if (gj_line_start(in, i)) {
            size_t j = i;
            while (j < in->n && (in->p[j] == ' ' || in->p[j] == '\t')) j++;
            if (j + 1 < in->n && in->p[j] == '{' &&
                (in->p[j + 1] == '#' || in->p[j + 1] == '%' || in->p[j + 1] == '-'))
                i = j;
        }
        if (gj_src_put(p, out, in->p[i], in->line[i]) != 0) return -1;
        i++;
    }
    return 0;
}

/* /([#%-]})\n/g → "$1" */
static int gj_pre_trim(gj_parser *p, const gj_src *in, gj_src *out) {
    for (size_t i = 0; i < in->n; i++) {
        char c = in->p[i];
        if (gj_src_put(p, out, c, in->line[i]) != 0) return -1;
        if ((c == '#' || c == '%' || c == '-') && i + 2 < in->n && in->p[i + 1] == '}' &&
            in->p[i + 2] == '\n') {
            if (gj_src_put(p, out, '}', in->line[i + 1]) != 0) return -1;
            i += 2;
        }
    }
    return 0;
}

static size_t gj_skip_space(const char *s, size_t n, size_t i) {
    size_t w;
    while (i < n && gj_is_space_at(s, n, i, &w)) i += w;
    return i;
}

/* Length of s[0..n) without its trailing JavaScript white space (String.prototype.trimEnd). */
static size_t gj_rtrim_len(const char *s, size_t n) {
    while (n > 0) {
        size_t start = n - 1, w;
        while (start > 0 && n - start < 4 && ((unsigned char)s[start] & 0xC0) == 0x80) start--;
        if (!gj_is_space_at(s, n, start, &w) || start + w != n) break;
        n = start;
    }
    return n;
}

/* The `{% generation %}` / `{% endgeneration %}` tag at s[i] ("{%"), if it is one: sets *end past
 * "%}" and the two strip flags. */
static bool gj_generation_tag(const gj_src *s, size_t i, size_t *end, bool *lstrip, bool *rstrip) {
    size_t j = i + 2;
    *lstrip = j < s->n && s->p[j] == '-';
    if (*lstrip) j++;
    j = gj_skip_space(s->p, s->n, j);
    if (j + 3 <= s->n && memcmp(s->p + j, "end", 3) == 0) j += 3;
    if (j + 10 > s->n || memcmp(s->p + j, "generation", 10) != 0) return false;
    j = gj_skip_space(s->p, s->n, j + 10);
    *rstrip = j < s->n && s->p[j] == '-';
    if (*rstrip) j++;
    if (j + 2 > s->n || s->p[j] != '%' || s->p[j + 1] != '}') return false;
    *end = j + 2;
    return true;
}

/* /(\s*){%(-?)\s*(?:end)?generation\s*(-?)%}(\s*)/gs: the tag goes; the white space around it
 * goes too on a side marked with '-'. */
static int gj_pre_generation(gj_parser *p, const gj_src *in, gj_src *out) {
    size_t keep =
        0; /* out->n after the last tag: white space before it belongs to that tag's match */
    for (size_t i = 0; i < in->n;) {
        size_t end;
        bool ls, rs;
        if (in->p[i] == '{' && i + 1 < in->n && in->p[i + 1] == '%' &&
            gj_generation_tag(in, i, &end, &ls, &rs)) {
            if (ls) {
                size_t n = gj_rtrim_len(out->p ? out->p : "", out->n);
                out->n = n > keep ? n : keep;
            }
            size_t after = gj_skip_space(in->p, in->n, end);
            for (size_t j = end; !rs && j < after; j++)
                if (gj_src_put(p, out, in->p[j], in->line[j]) != 0) return -1;
            keep = out->n;
            i = after;
            continue;
        }
        if (gj_src_put(p, out, in->p[i], in->line[i]) != 0) return -1;
        i++;
    }
    return 0;
}

static int gj_preprocess(gj_parser *p, const char *src, size_t len, gj_src *out) {
    gj_src a = {0}, b = {0};
    int line = 1;
    for (size_t i = 0; i < len; i++) {
        if (gj_src_put(p, &a, src[i], line) != 0) goto fail;
        if (src[i] == '\n') line++;
    }
    p->last_line = line;
    if (a.n > 0 && a.p[a.n - 1] == '\n') a.n--;
    if (gj_pre_lstrip(p, &a, &b) != 0) goto fail;
    a.n = 0;
    if (gj_pre_trim(p, &b, &a) != 0) goto fail;
    if (gj_pre_generation(p, &a, out) != 0) goto fail;
    gj_src_free(&a);
    gj_src_free(&b);
    return 0;
fail:
    gj_src_free(&a);
    gj_src_free(&b);
    return -1;
}

/* ---- tokens ---------------------------------------------------------------------------------- */

typedef enum gj_tok_kind {
    GJ_T_TEXT,
    GJ_T_NUM,
    GJ_T_STR,
    GJ_T_IDENT,
    GJ_T_EQUALS,
    GJ_T_LPAREN,
    GJ_T_RPAREN,
    GJ_T_OPEN_STMT,
    GJ_T_CLOSE_STMT,
    GJ_T_OPEN_EXPR,
    GJ_T_CLOSE_EXPR,
    GJ_T_LBRACKET,
    GJ_T_RBRACKET,
    GJ_T_LBRACE,
    GJ_T_RBRACE,
    GJ_T_COMMA,
    GJ_T_DOT,
    GJ_T_COLON,
    GJ_T_PIPE,
    GJ_T_ADD,
    GJ_T_MUL,
    GJ_T_POW,
    GJ_T_CMP,
    GJ_T_UNARY,
    GJ_T_COMMENT,
    GJ_T_NONE,
} gj_tok_kind;

typedef struct gj_tok {
    gj_tok_kind kind;
    int line;
    char *s; /* owned, NUL-terminated */
    size_t n;
} gj_tok;

static const struct {
    const char *seq;
    gj_tok_kind kind;
} gj_symbols[] = {
    {"{%", GJ_T_OPEN_STMT},  {"%}", GJ_T_CLOSE_STMT}, {"{{", GJ_T_OPEN_EXPR},
    {"}}", GJ_T_CLOSE_EXPR}, {"(", GJ_T_LPAREN},      {")", GJ_T_RPAREN},
    {"{", GJ_T_LBRACE},      {"}", GJ_T_RBRACE},      {"[", GJ_T_LBRACKET},
    {"]", GJ_T_RBRACKET},    {",", GJ_T_COMMA},       {".", GJ_T_DOT},
    {":", GJ_T_COLON},       {"|", GJ_T_PIPE},        {"<=", GJ_T_CMP},
    {">=", GJ_T_CMP},        {"==", GJ_T_CMP},        {"!=", GJ_T_CMP},
    {"<", GJ_T_CMP},         {">", GJ_T_CMP},         {"+", GJ_T_ADD},
    {"-", GJ_T_ADD},         {"~", GJ_T_ADD},         {"**", GJ_T_POW},
    {"*", GJ_T_MUL},         {"//", GJ_T_MUL},        {"/", GJ_T_MUL},
    {"%", GJ_T_MUL},         {"=", GJ_T_EQUALS},
};

static gj_tok_kind gj_last_kind(const gj_parser *p) {
    return p->n_tok ? p->t[p->n_tok - 1].kind : GJ_T_NONE;
}

static int gj_tok_push(gj_parser *p, gj_tok_kind kind, const char *s, size_t n, int line) {
    if (p->n_tok == p->cap_tok) {
        size_t cap = p->cap_tok ? p->cap_tok * 2 : 64;
        gj_tok *nt = realloc(p->t, cap * sizeof *nt);
        if (!nt) goto oom;
        p->t = nt;
        p->cap_tok = cap;
    }
    char *copy = malloc(n + 1);
    if (!copy) goto oom;
    if (n) memcpy(copy, s, n);
    copy[n] = '\0';
    p->t[p->n_tok++] = (gj_tok){kind, line, copy, n};
    return 0;
oom:
    gj_perr(p, line, "out of memory");
    return -1;
}

static void gj_toks_free(gj_parser *p) {
    for (size_t i = 0; i < p->n_tok; i++) free(p->t[i].s);
    free(p->t);
    p->t = NULL;
    p->n_tok = p->cap_tok = 0;
}

/* `{%-`, `{{-`, `{#-`: the text token just before loses its trailing white space. */
static void gj_strip_last_text(gj_parser *p) {
    if (gj_last_kind(p) != GJ_T_TEXT) return;
    gj_tok *t = &p->t[p->n_tok - 1];
    t->n = gj_rtrim_len(t->s, t->n);
    t->s[t->n] = '\0';
    if (t->n == 0) free(p->t[--p->n_tok].s);
}

static bool gj_hex(const char *s, size_t n, unsigned *out) {
    unsigned v = 0;
    for (size_t i = 0; i < n; i++) {
        int c = (unsigned char)s[i];
        if (!isxdigit(c)) return false;
        v = v * 16 + (unsigned)(isdigit(c) ? c - '0' : tolower(c) - 'a' + 10);
    }
    *out = v;
    return true;
}

static int gj_put_byte(gj_parser *p, gj_buf *b, char c, int line) {
    if (b->n == b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 32;
        char *np = realloc(b->p, cap);
        if (!np) {
            gj_perr(p, line, "out of memory");
            return -1;
        }
        b->p = np;
        b->cap = cap;
    }
    b->p[b->n++] = c;
    return 0;
}

static int gj_put_utf8(gj_parser *p, gj_buf *b, unsigned cp, int line) {
    char u[3];
    size_t n;
    if (cp >= 0xD800 && cp <= 0xDFFF) cp = 0xFFFD; /* a lone UTF-16 surrogate has no UTF-8 form */
    if (cp < 0x80)
        u[0] = (char)cp, n = 1;
    else if (cp < 0x800)
        u[0] = (char)(0xC0 | cp >> 6), u[1] = (char)(0x80 | (cp & 0x3F)), n = 2;
    else
        u[0] = (char)(0xE0 | cp >> 12), u[1] = (char)(0x80 | ((cp >> 6) & 0x3F)),
        u[2] = (char)(0x80 | (cp & 0x3F)), n = 3;
    for (size_t i = 0; i < n; i++)
        if (gj_put_byte(p, b, u[i], line) != 0) return -1;
    return 0;
}

/* A string literal from s->p[*i] (just after the opening quote) to the closing quote. */
static int gj_lex_string(gj_parser *p, const gj_src *s, size_t *i, char quote) {
    gj_buf b = {0};
    size_t j = *i;
    int line = s->line[j - 1];
    while (j < s->n && s->p[j] != quote) {
        unsigned cp = (unsigned char)s->p[j];
        if (cp == '\\') {
            if (++j >= s->n) goto eof;
            char e = s->p[j++];
            size_t hn = e == 'x' ? 2 : e == 'u' ? 4 : 0;
            if (hn) {
                if (j + hn > s->n || !gj_hex(s->p + j, hn, &cp)) {
                    gj_perr(p, s->line[j - 1], "invalid escape sequence \\%c in a string", e);
                    goto fail;
                }
                j += hn;
            } else {
                const char *from = "ntrbfv'\"\\", *to = "\n\t\r\b\f\v'\"\\";
                const char *k = e ? strchr(from, e) : NULL;
                if (!k) {
                    gj_perr(p, s->line[j - 1], "unexpected escaped character '%c' in a string", e);
                    goto fail;
                }
                cp = (unsigned char)to[k - from];
            }
            if (gj_put_utf8(p, &b, cp, line) != 0) goto fail;
            continue;
        }
        if (gj_put_byte(p, &b, s->p[j], line) != 0) goto fail;
        if (++j >= s->n) goto eof;
    }
    if (j >= s->n) goto eof;
    *i = j + 1;
    int rc = gj_tok_push(p, GJ_T_STR, b.p ? b.p : "", b.n, line);
    free(b.p);
    return rc;
eof:
    gj_perr(p, line, "unterminated string literal");
fail:
    free(b.p);
    return -1;
}

static bool gj_word_char(char c) { return isalnum((unsigned char)c) || c == '_'; }

/* digits[.digits] from s->p[*i]; sign: "-", "+" or "". */
static int gj_lex_number(gj_parser *p, const gj_src *s, size_t *i, const char *sign,
                         bool allow_frac) {
    char num[96];
    size_t k = (size_t)snprintf(num, sizeof num, "%s", sign), j = *i;
    int line = s->line[j < s->n ? j : s->n - 1];
    while (j < s->n && isdigit((unsigned char)s->p[j])) {
        if (k + 2 >= sizeof num) goto long_;
        num[k++] = s->p[j++];
    }
    if (allow_frac && j + 1 < s->n && s->p[j] == '.' && isdigit((unsigned char)s->p[j + 1])) {
        num[k++] = s->p[j++];
        while (j < s->n && isdigit((unsigned char)s->p[j])) {
            if (k + 2 >= sizeof num) goto long_;
            num[k++] = s->p[j++];
        }
    }
    if (j >= s->n) {
        gj_perr(p, line, "unexpected end of template");
        return -1;
    }
    *i = j;
    return gj_tok_push(p, GJ_T_NUM, num, k, line);
long_:
    gj_perr(p, line, "number literal too long");
    return -1;
}

/* {# ... #} at s->p[*i]. */
static int gj_lex_comment(gj_parser *p, const gj_src *s, size_t *i) {
    size_t j = *i + 2;
    int line = s->line[*i];
    bool strip_before = j < s->n && s->p[j] == '-';
    if (strip_before) j++;
    size_t start = j;
    while (j + 1 >= s->n || s->p[j] != '#' || s->p[j + 1] != '}') {
        if (j + 2 >= s->n) {
            gj_perr(p, line, "unclosed comment");
            return -1;
        }
        j++;
    }
    bool strip_after = j > start && s->p[j - 1] == '-';
    if (strip_before) gj_strip_last_text(p);
    if (gj_tok_push(p, GJ_T_COMMENT, "", 0, line) != 0) return -1;
    j += 2;
    if (strip_after) j = gj_skip_space(s->p, s->n, j);
    *i = j;
    return 0;
}

static bool gj_at(const gj_src *s, size_t i, const char *seq) {
    size_t n = strlen(seq);
    return i + n <= s->n && memcmp(s->p + i, seq, n) == 0;
}

/* The helpers below return 0 when they consumed a token, 1 when the input is not theirs, -1 on
 * an error. */

/* Text outside tags, up to the next {% {{ {#; only right after the start or a closing tag. */
static int gj_lex_text(gj_parser *p, const gj_src *s, size_t *i) {
    gj_tok_kind last = gj_last_kind(p);
    if (!(last == GJ_T_NONE || last == GJ_T_CLOSE_STMT || last == GJ_T_CLOSE_EXPR ||
          last == GJ_T_COMMENT))
        return 1;
    size_t j = *i;
    while (j < s->n && !(s->p[j] == '{' && j + 1 < s->n &&
                         (s->p[j + 1] == '%' || s->p[j + 1] == '{' || s->p[j + 1] == '#')))
        j++;
    if (j == *i) return 1;
    int rc = gj_tok_push(p, GJ_T_TEXT, s->p + *i, j - *i, s->line[*i]);
    *i = j;
    return rc;
}

/* {%- {{- (strip the text before) and -%} -}} (skip the white space after). */
static int gj_lex_dash(gj_parser *p, const gj_src *s, size_t *i, int *curly) {
    int line = s->line[*i];
    if (gj_at(s, *i, "{%-") || gj_at(s, *i, "{{-")) {
        bool stmt = s->p[*i + 1] == '%';
        gj_strip_last_text(p);
        if (!stmt) *curly = 0;
        *i += 3;
        return gj_tok_push(p, stmt ? GJ_T_OPEN_STMT : GJ_T_OPEN_EXPR, stmt ? "{%" : "{{", 2, line);
    }
    if (gj_at(s, *i, "-%}") || gj_at(s, *i, "-}}")) {
        bool stmt = s->p[*i + 1] == '%';
        *i = gj_skip_space(s->p, s->n, *i + 3);
        return gj_tok_push(p, stmt ? GJ_T_CLOSE_STMT : GJ_T_CLOSE_EXPR, stmt ? "%}" : "}}", 2,
                           line);
    }
    return 1;
}

/* A sign that starts an operand (unary, or a negative number literal): not after a name, a
 * literal, ')' or ']', where it is the binary operator. */
static int gj_lex_sign(gj_parser *p, const gj_src *s, size_t *i) {
    char c = s->p[*i];
    gj_tok_kind last = gj_last_kind(p);
    if (c != '-' && c != '+') return 1;
    if (last == GJ_T_TEXT || last == GJ_T_NONE) {
        gj_perr(p, s->line[*i], "unexpected character '%c'", c);
        return -1;
    }
    if (last == GJ_T_IDENT || last == GJ_T_NUM || last == GJ_T_STR || last == GJ_T_RPAREN ||
        last == GJ_T_RBRACKET)
        return 1;
    char sign[2] = {c, 0};
    int line = s->line[*i];
    ++*i;
    if (*i < s->n && isdigit((unsigned char)s->p[*i])) return gj_lex_number(p, s, i, sign, true);
    return gj_tok_push(p, GJ_T_UNARY, sign, 1, line);
}

/* Punctuation and operators (gj_symbols, first match); "}}" inside a dict literal is two '}'. */
static int gj_lex_symbol(gj_parser *p, const gj_src *s, size_t *i, int *curly) {
    for (size_t k = 0; k < sizeof gj_symbols / sizeof gj_symbols[0]; k++) {
        gj_tok_kind kind = gj_symbols[k].kind;
        if ((kind == GJ_T_CLOSE_EXPR && *curly > 0) || !gj_at(s, *i, gj_symbols[k].seq)) continue;
        if (kind == GJ_T_OPEN_EXPR)
            *curly = 0;
        else if (kind == GJ_T_LBRACE)
            ++*curly;
        else if (kind == GJ_T_RBRACE)
            --*curly;
        int line = s->line[*i];
        *i += strlen(gj_symbols[k].seq);
        return gj_tok_push(p, kind, gj_symbols[k].seq, strlen(gj_symbols[k].seq), line);
    }
    return 1;
}

static int gj_lex_word(gj_parser *p, const gj_src *s, size_t *i) {
    size_t j = *i, k = j;
    if (!gj_word_char(s->p[j])) return 1;
    while (k < s->n && gj_word_char(s->p[k])) k++;
    if (k >= s->n) {
        gj_perr(p, s->line[j], "unexpected end of template after '%.*s'", (int)(k - j), s->p + j);
        return -1;
    }
    *i = k;
    return gj_tok_push(p, GJ_T_IDENT, s->p + j, k - j, s->line[j]);
}

/* One step of the tokenizer at s->p[*i]; @huggingface/jinja's lexer.ts, rule for rule. */
static int gj_lex_step(gj_parser *p, const gj_src *s, size_t *i, int *curly) {
    int rc = gj_lex_text(p, s, i);
    if (rc <= 0) return rc;
    if (gj_at(s, *i, "{#")) return gj_lex_comment(p, s, i);
    if (gj_at(s, *i, "{%-") || gj_at(s, *i, "{{-")) return gj_lex_dash(p, s, i, curly);
    int line = s->line[*i];
    *i = gj_skip_space(s->p, s->n, *i);
    if (*i >= s->n) {
        gj_perr(p, line, "unexpected end of template inside a tag");
        return -1;
    }
    if ((rc = gj_lex_dash(p, s, i, curly)) <= 0 || (rc = gj_lex_sign(p, s, i)) <= 0 ||
        (rc = gj_lex_symbol(p, s, i, curly)) <= 0)
        return rc;
    char c = s->p[*i];
    if (c == '\'' || c == '"') {
        ++*i;
        return gj_lex_string(p, s, i, c);
    }
    if (isdigit((unsigned char)c)) return gj_lex_number(p, s, i, "", gj_last_kind(p) != GJ_T_DOT);
    if ((rc = gj_lex_word(p, s, i)) <= 0) return rc;
    if ((unsigned char)c >= 0x80)
        gj_perr(p, s->line[*i], "unexpected character (byte 0x%02x) inside a tag",
                (unsigned char)c);
    else
        gj_perr(p, s->line[*i], "unexpected character '%c' inside a tag", c);
    return -1;
}

static int gj_tokenize(gj_parser *p, const gj_src *s) {
    int curly = 0;
    for (size_t i = 0; i < s->n;)
        if (gj_lex_step(p, s, &i, &curly) != 0) return -1;
    return 0;
}

/* ---- syntax tree helpers --------------------------------------------------------------------- */

static void gj_nodes_free(gj_nodes *l);

static void gj_node_free(gj_node *n) {
    if (!n) return;
    free(n->str);
    gj_node_free(n->a);
    gj_node_free(n->b);
    gj_node_free(n->c);
    gj_nodes_free(&n->items);
    gj_nodes_free(&n->body);
    gj_nodes_free(&n->alt);
    free(n);
}

static void gj_nodes_free(gj_nodes *l) {
    for (size_t i = 0; i < l->n; i++) gj_node_free(l->v[i]);
    free(l->v);
    *l = (gj_nodes){0};
}

static gj_node *gj_node_new(gj_parser *p, gj_node_kind kind, int line) {
    gj_node *n = calloc(1, sizeof *n);
    if (!n)
        gj_perr(p, line, "out of memory");
    else
        n->kind = kind, n->line = line, n->height = 1;
    return n;
}

/* Takes n (NULL: a slot left empty, as in a slice's omitted bound). */
static int gj_nodes_push(gj_parser *p, gj_nodes *l, gj_node *n, int line) {
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 4;
        gj_node **nv = realloc(l->v, cap * sizeof *nv);
        if (!nv) {
            gj_node_free(n);
            gj_perr(p, line, "out of memory");
            return -1;
        }
        l->v = nv;
        l->cap = cap;
    }
    l->v[l->n++] = n;
    return 0;
}

static int gj_height_of(const gj_nodes *l) {
    int h = 0;
    for (size_t i = 0; i < l->n; i++)
        if (l->v[i] && l->v[i]->height > h) h = l->v[i]->height;
    return h;
}

/* Sets n's height from its children; a tree taller than GJ_MAX_HEIGHT is an error (n is freed). */
static gj_node *gj_seal(gj_parser *p, gj_node *n) {
    int h = 0;
    const gj_node *kids[3] = {n->a, n->b, n->c};
    for (int k = 0; k < 3; k++)
        if (kids[k] && kids[k]->height > h) h = kids[k]->height;
    int hl[3] = {gj_height_of(&n->items), gj_height_of(&n->body), gj_height_of(&n->alt)};
    for (int k = 0; k < 3; k++)
        if (hl[k] > h) h = hl[k];
    n->height = h + 1;
    if (n->height > GJ_MAX_HEIGHT) {
        gj_perr(p, n->line, "template nested too deeply (more than %d levels)", GJ_MAX_HEIGHT);
        gj_node_free(n);
        return NULL;
    }
    return n;
}

/* ---- parser: token access -------------------------------------------------------------------- */

static const gj_tok *gj_peek(const gj_parser *p, size_t ahead) {
    return p->cur + ahead < p->n_tok ? &p->t[p->cur + ahead] : NULL;
}
static bool gj_is(const gj_parser *p, gj_tok_kind k) {
    const gj_tok *t = gj_peek(p, 0);
    return t && t->kind == k;
}
static bool gj_is_ident(const gj_parser *p, size_t ahead, const char *name) {
    const gj_tok *t = gj_peek(p, ahead);
    return t && t->kind == GJ_T_IDENT && strcmp(t->s, name) == 0;
}
static int gj_line(const gj_parser *p) {
    const gj_tok *t = gj_peek(p, 0);
    if (t) return t->line;
    return p->n_tok ? p->t[p->n_tok - 1].line : 1;
}
/* `{% name` with name one of the NULL-terminated names. */
static bool gj_is_stmt(const gj_parser *p, const char *const *names) {
    if (!gj_is(p, GJ_T_OPEN_STMT)) return false;
    for (; *names; names++)
        if (gj_is_ident(p, 1, *names)) return true;
    return false;
}

static const char *gj_tok_desc(gj_tok_kind k) {
    static const char *const d[] = {
        "text", "number",   "string",   "name", "'='",        "'('",  "')'",     "'{%'", "'%}'",
        "'{{'", "'}}'",     "'['",      "']'",  "'{'",        "'}'",  "','",     "'.'",  "':'",
        "'|'",  "operator", "operator", "'**'", "comparison", "sign", "comment", "end"};
    return d[k];
}

static int gj_expect(gj_parser *p, gj_tok_kind k, const char *what) {
    const gj_tok *t = gj_peek(p, 0);
    if (!t || t->kind != k) {
        gj_perr(p, gj_line(p), "expected %s %s, got %s", gj_tok_desc(k), what,
                t ? (t->kind == GJ_T_IDENT || t->kind == GJ_T_CMP ? t->s : gj_tok_desc(t->kind))
                  : "the end of the template");
        return -1;
    }
    p->cur++;
    return 0;
}

static int gj_enter(gj_parser *p) {
    if (++p->depth > GW_JINJA_MAX_NESTING) {
        gj_perr(p, gj_line(p), "template nested too deeply (more than %d levels)",
                GW_JINJA_MAX_NESTING);
        return -1;
    }
    return 0;
}

/* ---- parser: expressions --------------------------------------------------------------------- */

static gj_node *gj_expr(gj_parser *p);
static gj_node *gj_primary(gj_parser *p);
static gj_node *gj_unary(gj_parser *p);

static gj_node *gj_new2(gj_parser *p, gj_node_kind kind, int op, gj_node *a, gj_node *b, int line) {
    gj_node *n = gj_node_new(p, kind, line);
    if (!n) {
        gj_node_free(a);
        gj_node_free(b);
        return NULL;
    }
    n->op = op, n->a = a, n->b = b;
    return gj_seal(p, n);
}

/* expr (',' expr)* → the expr, or a GJ_E_TUPLE. primary_only: for-loop targets. */
static gj_node *gj_expr_seq(gj_parser *p, bool primary_only) {
    int line = gj_line(p);
    gj_node *first = primary_only ? gj_primary(p) : gj_expr(p);
    if (!first || !gj_is(p, GJ_T_COMMA)) return first;
    gj_node *t = gj_node_new(p, GJ_E_TUPLE, line);
    if (!t || gj_nodes_push(p, &t->items, first, line) != 0) goto fail;
    first = NULL;
    while (gj_is(p, GJ_T_COMMA)) {
        p->cur++;
        gj_node *e = primary_only ? gj_primary(p) : gj_expr(p);
        if (!e || gj_nodes_push(p, &t->items, e, line) != 0) goto fail;
    }
    return gj_seal(p, t);
fail:
    gj_node_free(first);
    gj_node_free(t);
    return NULL;
}

/* '(' args ')' into list; kw-args as GJ_E_KWARG; params: a macro's parameter list. */
static int gj_args(gj_parser *p, gj_nodes *list, bool params) {
    if (gj_expect(p, GJ_T_LPAREN, "to open the argument list") != 0) return -1;
    bool saw_kw = false;
    while (!gj_is(p, GJ_T_RPAREN)) {
        int line = gj_line(p);
        if (!gj_peek(p, 0)) return gj_expect(p, GJ_T_RPAREN, "to close the argument list");
        if (gj_is(p, GJ_T_POW) || (gj_is(p, GJ_T_MUL) && strcmp(gj_peek(p, 0)->s, "*") == 0)) {
            gj_perr(p, line, "argument unpacking (* and **) is not supported");
            return -1;
        }
        gj_node *e = gj_expr(p);
        if (!e) return -1;
        if (gj_is(p, GJ_T_EQUALS)) {
            p->cur++;
            if (e->kind != GJ_E_NAME) {
                gj_node_free(e);
                gj_perr(p, line, "expected a name before '=' in an argument list");
                return -1;
            }
            gj_node *v = gj_expr(p);
            if (!v) {
                gj_node_free(e);
                return -1;
            }
            e->kind = GJ_E_KWARG, e->a = v;
            if (!(e = gj_seal(p, e))) return -1;
            saw_kw = true;
        } else if (saw_kw) {
            gj_node_free(e);
            gj_perr(p, line,
                    params ? "a parameter without default follows one with a default"
                           : "positional argument after a keyword argument");
            return -1;
        } else if (params && e->kind != GJ_E_NAME) {
            gj_node_free(e);
            gj_perr(p, line, "expected a parameter name");
            return -1;
        }
        if (gj_nodes_push(p, list, e, line) != 0) return -1;
        if (gj_is(p, GJ_T_COMMA)) p->cur++;
    }
    p->cur++;
    return 0;
}

/* The inside of obj[...]: an index, or a slice start:stop:step. */
static gj_node *gj_subscript(gj_parser *p, gj_node *obj, int line) {
    gj_node *parts[3] = {NULL, NULL, NULL};
    size_t n = 0;
    bool slice = false;
    while (!gj_is(p, GJ_T_RBRACKET)) {
        if (!gj_peek(p, 0) || n == 3) {
            gj_perr(p, line, n == 3 ? "a slice takes at most 3 parts" : "unclosed '['");
            goto fail;
        }
        if (gj_is(p, GJ_T_COLON)) {
            n++, slice = true, p->cur++;
            continue;
        }
        if (!(parts[n++] = gj_expr(p))) goto fail;
        if (gj_is(p, GJ_T_COLON)) p->cur++, slice = true;
    }
    p->cur++;
    if (n == 0 || (!slice && n > 1)) {
        gj_perr(p, line, n ? "expected ']' after the subscript" : "empty subscript []");
        goto fail;
    }
    if (!slice) return gj_new2(p, GJ_E_INDEX, 0, obj, parts[0], line);
    gj_node *s = gj_node_new(p, GJ_E_SLICE, line);
    if (!s) goto fail;
    s->a = obj, obj = NULL;
    for (int k = 0; k < 3; k++) {
        gj_node *part = parts[k];
        parts[k] = NULL;
        if (gj_nodes_push(p, &s->items, part, line) != 0) {
            gj_node_free(s);
            goto fail;
        }
    }
    return gj_seal(p, s);
fail:
    gj_node_free(obj);
    for (int k = 0; k < 3; k++) gj_node_free(parts[k]);
    return NULL;
}

/* obj(.name | .0 | [subscript])* */
static gj_node *gj_member(gj_parser *p, gj_node *obj) {
    while (obj && (gj_is(p, GJ_T_DOT) || gj_is(p, GJ_T_LBRACKET))) {
        int line = gj_line(p);
        bool dot = gj_is(p, GJ_T_DOT);
        p->cur++;
        if (!dot) {
            obj = gj_subscript(p, obj, line);
            continue;
        }
        const gj_tok *t = gj_peek(p, 0);
        bool is_int =
            t && t->kind == GJ_T_NUM && !strchr(t->s, '.') && isdigit((unsigned char)t->s[0]);
        if (!t || (t->kind != GJ_T_IDENT && !is_int)) {
            gj_perr(p, line, "expected a name after '.'");
            gj_node_free(obj);
            return NULL;
        }
        gj_node *n = gj_node_new(p, GJ_E_ATTR, line);
        if (!n || !(n->str = strdup(t->s))) {
            if (n) gj_perr(p, line, "out of memory");
            gj_node_free(n);
            gj_node_free(obj);
            return NULL;
        }
        n->len = t->n, n->op = is_int, n->i = is_int ? strtoll(t->s, NULL, 10) : 0, n->a = obj;
        p->cur++;
        obj = gj_seal(p, n);
    }
    return obj;
}

/* callee(args) followed by members and further calls. */
static gj_node *gj_call(gj_parser *p, gj_node *callee) {
    while (callee && gj_is(p, GJ_T_LPAREN)) {
        int line = gj_line(p);
        gj_node *n = gj_node_new(p, GJ_E_CALL, line);
        if (!n) {
            gj_node_free(callee);
            return NULL;
        }
        n->a = callee;
        if (gj_args(p, &n->items, false) != 0) {
            gj_node_free(n);
            return NULL;
        }
        callee = gj_member(p, gj_seal(p, n));
    }
    return callee;
}

static gj_node *gj_literal_list(gj_parser *p, gj_node_kind kind, gj_tok_kind close, int line) {
    gj_node *n = gj_node_new(p, kind, line);
    if (!n) return NULL;
    while (!gj_is(p, close)) {
        if (!gj_peek(p, 0)) {
            gj_perr(p, line, "unclosed %s literal", kind == GJ_E_LIST ? "list" : "dict");
            goto fail;
        }
        int l2 = gj_line(p);
        gj_node *e = gj_expr(p);
        if (!e) goto fail;
        if (kind == GJ_E_DICT) {
            gj_node *v = NULL;
            if (gj_expect(p, GJ_T_COLON, "between a key and its value") != 0 || !(v = gj_expr(p))) {
                gj_node_free(e);
                goto fail;
            }
            if (!(e = gj_new2(p, GJ_E_PAIR, 0, e, v, l2))) goto fail;
        }
        if (gj_nodes_push(p, &n->items, e, l2) != 0) goto fail;
        if (gj_is(p, GJ_T_COMMA)) p->cur++;
    }
    p->cur++;
    return gj_seal(p, n);
fail:
    gj_node_free(n);
    return NULL;
}

static gj_node *gj_primary_number(gj_parser *p, const gj_tok *t) {
    bool is_float = strchr(t->s, '.') != NULL;
    gj_node *n = gj_node_new(p, is_float ? GJ_E_FLOAT : GJ_E_INT, t->line);
    if (!n) return NULL;
    errno = 0;
    if (is_float)
        n->f = strtod(t->s, NULL);
    else
        n->i = strtoll(t->s, NULL, 10);
    if (errno == ERANGE) {
        gj_perr(p, t->line, "number %s is out of range", t->s);
        gj_node_free(n);
        return NULL;
    }
    return n;
}

/* A string literal; adjacent literals join ("a" "b" is "ab"). */
static gj_node *gj_primary_string(gj_parser *p, const gj_tok *t) {
    gj_node *n = gj_node_new(p, GJ_E_STR, t->line);
    if (!n) return NULL;
    size_t len = t->n;
    for (size_t k = p->cur; k < p->n_tok && p->t[k].kind == GJ_T_STR; k++) len += p->t[k].n;
    if (!(n->str = malloc(len + 1))) {
        gj_perr(p, t->line, "out of memory");
        gj_node_free(n);
        return NULL;
    }
    memcpy(n->str, t->s, t->n);
    n->len = t->n;
    for (; gj_is(p, GJ_T_STR); p->cur++) {
        memcpy(n->str + n->len, p->t[p->cur].s, p->t[p->cur].n);
        n->len += p->t[p->cur].n;
    }
    n->str[n->len] = '\0';
    return n;
}

static gj_node *gj_primary(gj_parser *p) {
    const gj_tok *t = gj_peek(p, 0);
    if (!t) {
        gj_perr(p, gj_line(p), "unexpected end of template in an expression");
        return NULL;
    }
    p->cur++;
    switch (t->kind) {
    case GJ_T_NUM: return gj_primary_number(p, t);
    case GJ_T_STR: return gj_primary_string(p, t);
    case GJ_T_IDENT: {
        gj_node *n = gj_node_new(p, GJ_E_NAME, t->line);
        if (n && !(n->str = strdup(t->s))) {
            gj_perr(p, t->line, "out of memory");
            gj_node_free(n);
            return NULL;
        }
        if (n) n->len = t->n;
        return n;
    }
    case GJ_T_LPAREN: {
        gj_node *e = gj_expr_seq(p, false);
        if (e && gj_expect(p, GJ_T_RPAREN, "to close '('") != 0) {
            gj_node_free(e);
            return NULL;
        }
        return e;
    }
    case GJ_T_LBRACKET: return gj_literal_list(p, GJ_E_LIST, GJ_T_RBRACKET, t->line);
    case GJ_T_LBRACE: return gj_literal_list(p, GJ_E_DICT, GJ_T_RBRACE, t->line);
    default:
        gj_perr(p, t->line, "unexpected %s in an expression",
                t->kind == GJ_T_CMP || t->kind == GJ_T_MUL ? t->s : gj_tok_desc(t->kind));
        return NULL;
    }
}

static gj_node *gj_call_member(gj_parser *p) { return gj_call(p, gj_member(p, gj_primary(p))); }

static gj_node *gj_unary(gj_parser *p) {
    const gj_tok *t = gj_peek(p, 0);
    if (t && (t->kind == GJ_T_UNARY || t->kind == GJ_T_ADD) && (t->s[0] == '-' || t->s[0] == '+') &&
        !t->s[1]) {
        int op = t->s[0] == '-' ? GJ_OP_NEG : GJ_OP_POS, line = t->line;
        p->cur++;
        if (gj_enter(p) != 0) return NULL;
        gj_node *a = gj_unary(p);
        p->depth--;
        return a ? gj_new2(p, GJ_E_UNARY, op, a, NULL, line) : NULL;
    }
    return gj_call_member(p);
}

/* A filter's or test's name; name_out borrowed from the token. */
static const gj_tok *gj_name_after(gj_parser *p, const char *what) {
    const gj_tok *t = gj_peek(p, 0);
    if (!t || t->kind != GJ_T_IDENT) {
        gj_perr(p, gj_line(p), "expected a %s name", what);
        return NULL;
    }
    p->cur++;
    return t;
}

static gj_node *gj_filter_expr(gj_parser *p) {
    gj_node *e = gj_unary(p);
    while (e && gj_is(p, GJ_T_PIPE)) {
        p->cur++;
        const gj_tok *t = gj_name_after(p, "filter");
        gj_filter f = t ? gj_filter_lookup(t->s) : GJ_FI_UNKNOWN;
        if (t && f == GJ_FI_UNKNOWN) gj_perr(p, t->line, "unknown filter '%s'", t->s);
        gj_node *n = f != GJ_FI_UNKNOWN ? gj_node_new(p, GJ_E_FILTER, t->line) : NULL;
        if (n && !(n->str = strdup(t->s))) gj_perr(p, t->line, "out of memory");
        if (!n || !n->str ||
            (n->op = (int)f, n->a = e, e = NULL,
             gj_is(p, GJ_T_LPAREN) && gj_args(p, &n->items, false) != 0)) {
            gj_node_free(n);
            gj_node_free(e);
            return NULL;
        }
        e = gj_seal(p, n);
    }
    return e;
}

static gj_node *gj_test_expr(gj_parser *p) {
    gj_node *e = gj_filter_expr(p);
    while (e && gj_is_ident(p, 0, "is")) {
        p->cur++;
        bool negate = gj_is_ident(p, 0, "not");
        if (negate) p->cur++;
        const gj_tok *t = gj_name_after(p, "test");
        gj_test te = t ? gj_test_lookup(t->s) : GJ_TE_UNKNOWN;
        if (t && te == GJ_TE_UNKNOWN) gj_perr(p, t->line, "unknown test '%s'", t->s);
        gj_node *n = te != GJ_TE_UNKNOWN ? gj_node_new(p, GJ_E_TEST, t->line) : NULL;
        if (n && !(n->str = strdup(t->s))) gj_perr(p, t->line, "out of memory");
        if (!n || !n->str) {
            gj_node_free(n);
            gj_node_free(e);
            return NULL;
        }
        n->op = (int)te, n->i = negate, n->a = e;
        e = gj_seal(p, n);
    }
    return e;
}

typedef gj_node *(*gj_level_fn)(gj_parser *p);

/* One left-associative binary level: next (op next)*. */
static gj_node *gj_binary_level(gj_parser *p, gj_level_fn next, gj_tok_kind kind) {
    gj_node *e = next(p);
    while (e && gj_is(p, kind)) {
        const gj_tok *t = gj_peek(p, 0);
        static const struct {
            const char *s;
            gj_op op;
        } ops[] = {{"+", GJ_OP_ADD}, {"-", GJ_OP_SUB}, {"~", GJ_OP_CONCAT},
                   {"*", GJ_OP_MUL}, {"/", GJ_OP_DIV}, {"//", GJ_OP_FLOORDIV},
                   {"%", GJ_OP_MOD}, {"**", GJ_OP_POW}};
        int op = GJ_OP_NONE, line = t->line;
        for (size_t k = 0; k < sizeof ops / sizeof ops[0]; k++)
            if (strcmp(t->s, ops[k].s) == 0) op = ops[k].op;
        p->cur++;
        gj_node *r = next(p);
        e = r ? gj_new2(p, GJ_E_BINARY, op, e, r, line) : (gj_node_free(e), NULL);
    }
    return e;
}

static gj_node *gj_pow_expr(gj_parser *p) { return gj_binary_level(p, gj_test_expr, GJ_T_POW); }
static gj_node *gj_mul_expr(gj_parser *p) { return gj_binary_level(p, gj_pow_expr, GJ_T_MUL); }
static gj_node *gj_add_expr(gj_parser *p) { return gj_binary_level(p, gj_mul_expr, GJ_T_ADD); }

static gj_node *gj_compare_expr(gj_parser *p) {
    gj_node *e = gj_add_expr(p);
    while (e) {
        int op, line = gj_line(p);
        if (gj_is_ident(p, 0, "not") && gj_is_ident(p, 1, "in"))
            op = GJ_OP_NOT_IN, p->cur += 2;
        else if (gj_is_ident(p, 0, "in"))
            op = GJ_OP_IN, p->cur++;
        else if (gj_is(p, GJ_T_CMP)) {
            const char *s = p->t[p->cur++].s;
            op = !strcmp(s, "==")   ? GJ_OP_EQ
                 : !strcmp(s, "!=") ? GJ_OP_NE
                 : !strcmp(s, "<")  ? GJ_OP_LT
                 : !strcmp(s, ">")  ? GJ_OP_GT
                 : !strcmp(s, "<=") ? GJ_OP_LE
                                    : GJ_OP_GE;
        } else
            break;
        gj_node *r = gj_add_expr(p);
        e = r ? gj_new2(p, GJ_E_BINARY, op, e, r, line) : (gj_node_free(e), NULL);
    }
    return e;
}

static gj_node *gj_not_expr(gj_parser *p) {
    if (!gj_is_ident(p, 0, "not")) return gj_compare_expr(p);
    int line = gj_line(p);
    p->cur++;
    if (gj_enter(p) != 0) return NULL;
    gj_node *a = gj_not_expr(p);
    p->depth--;
    return a ? gj_new2(p, GJ_E_UNARY, GJ_OP_NOT, a, NULL, line) : NULL;
}

static gj_node *gj_logic_level(gj_parser *p, gj_level_fn next, const char *word, int op) {
    gj_node *e = next(p);
    while (e && gj_is_ident(p, 0, word)) {
        int line = gj_line(p);
        p->cur++;
        gj_node *r = next(p);
        e = r ? gj_new2(p, GJ_E_BINARY, op, e, r, line) : (gj_node_free(e), NULL);
    }
    return e;
}

static gj_node *gj_and_expr(gj_parser *p) {
    return gj_logic_level(p, gj_not_expr, "and", GJ_OP_AND);
}
static gj_node *gj_or_expr(gj_parser *p) { return gj_logic_level(p, gj_and_expr, "or", GJ_OP_OR); }

/* a if c else b (else chains); `a if c` alone is undefined when c is false. */
static gj_node *gj_if_expr(gj_parser *p) {
    gj_node *a = gj_or_expr(p);
    if (!a || !gj_is_ident(p, 0, "if")) return a;
    int line = gj_line(p);
    p->cur++;
    gj_node *c = gj_or_expr(p);
    if (!c) goto fail;
    if (!gj_is_ident(p, 0, "else")) return gj_new2(p, GJ_E_SELECT, 0, a, c, line);
    p->cur++;
    if (gj_enter(p) != 0) goto fail;
    gj_node *b = gj_if_expr(p);
    p->depth--;
    if (!b) goto fail;
    gj_node *n = gj_node_new(p, GJ_E_TERNARY, line);
    if (!n) {
        gj_node_free(b);
        goto fail;
    }
    n->a = a, n->b = c, n->c = b;
    return gj_seal(p, n);
fail:
    gj_node_free(a);
    gj_node_free(c);
    return NULL;
}

static gj_node *gj_expr(gj_parser *p) {
    if (gj_enter(p) != 0) return NULL;
    gj_node *e = gj_if_expr(p);
    p->depth--;
    return e;
}

/* ---- parser: statements ---------------------------------------------------------------------- */

static gj_node *gj_any(gj_parser *p);

/* Statements until `{% <one of ends>`; the block opened on line `line` by `tag`. */
static int gj_block(gj_parser *p, gj_nodes *body, const char *const *ends, const char *tag,
                    int line) {
    while (!gj_is_stmt(p, ends)) {
        if (!gj_peek(p, 0)) {
            gj_perr(p, line, "unclosed '%s' block (no {%% %s %%})", tag, ends[0]);
            return -1;
        }
        gj_node *s = gj_any(p);
        if (p->failed) return -1;
        if (s && gj_nodes_push(p, body, s, line) != 0) return -1;
    }
    return 0;
}

/* `{% word %}` that ends a block. */
static int gj_end_tag(gj_parser *p, const char *word) {
    int line = gj_line(p);
    if (gj_expect(p, GJ_T_OPEN_STMT, "") != 0) return -1;
    if (!gj_is_ident(p, 0, word)) {
        gj_perr(p, line, "expected {%% %s %%}", word);
        return -1;
    }
    p->cur++;
    return gj_expect(p, GJ_T_CLOSE_STMT, word);
}

static gj_node *gj_if_stmt(gj_parser *p, int line) {
    static const char *const ends[] = {"elif", "else", "endif", NULL};
    gj_node *n = gj_node_new(p, GJ_N_IF, line);
    if (!n || !(n->a = gj_expr(p)) || gj_expect(p, GJ_T_CLOSE_STMT, "after the if test") != 0)
        goto fail;
    if (gj_block(p, &n->body, ends, "if", line) != 0) goto fail;
    if (gj_is_ident(p, 1, "elif")) {
        int l2 = gj_line(p);
        p->cur += 2;
        if (gj_enter(p) != 0) goto fail;
        gj_node *e = gj_if_stmt(p, l2);
        p->depth--;
        if (!e || gj_nodes_push(p, &n->alt, e, l2) != 0) goto fail;
    } else if (gj_is_ident(p, 1, "else")) {
        static const char *const endif[] = {"endif", NULL};
        p->cur += 2;
        if (gj_expect(p, GJ_T_CLOSE_STMT, "after else") != 0 ||
            gj_block(p, &n->alt, endif, "if", line) != 0)
            goto fail;
    }
    return gj_seal(p, n);
fail:
    gj_node_free(n);
    return NULL;
}

static bool gj_assignable(const gj_node *t) {
    if (t->kind == GJ_E_NAME) return true;
    if (t->kind == GJ_E_ATTR) return t->a->kind == GJ_E_NAME && !t->op;
    if (t->kind != GJ_E_TUPLE) return false;
    for (size_t k = 0; k < t->items.n; k++)
        if (t->items.v[k]->kind != GJ_E_NAME) return false;
    return true;
}

static gj_node *gj_for_stmt(gj_parser *p, int line) {
    static const char *const ends[] = {"endfor", "else", NULL}, *const endfor[] = {"endfor", NULL};
    gj_node *n = gj_node_new(p, GJ_N_FOR, line);
    if (!n || !(n->a = gj_expr_seq(p, true))) goto fail;
    if (n->a->kind == GJ_E_ATTR || !gj_assignable(n->a)) {
        gj_perr(p, line, "a for loop's target must be a name or names separated by commas");
        goto fail;
    }
    if (!gj_is_ident(p, 0, "in")) {
        gj_perr(p, line, "expected 'in' after the for loop's target");
        goto fail;
    }
    p->cur++;
    if (!(n->b = gj_expr(p)) || gj_expect(p, GJ_T_CLOSE_STMT, "after the for loop's iterable") != 0)
        goto fail;
    if (n->b->kind == GJ_E_SELECT) { /* for x in xs if cond */
        gj_node *sel = n->b;
        n->b = sel->a, n->c = sel->b, sel->a = sel->b = NULL;
        gj_node_free(sel);
    }
    if (gj_block(p, &n->body, ends, "for", line) != 0) goto fail;
    if (gj_is_ident(p, 1, "else")) {
        p->cur += 2;
        if (gj_expect(p, GJ_T_CLOSE_STMT, "after else") != 0 ||
            gj_block(p, &n->alt, endfor, "for", line) != 0)
            goto fail;
    }
    if (gj_end_tag(p, "endfor") != 0) goto fail;
    return gj_seal(p, n);
fail:
    gj_node_free(n);
    return NULL;
}

static gj_node *gj_set_stmt(gj_parser *p, int line) {
    static const char *const endset[] = {"endset", NULL};
    gj_node *n = gj_node_new(p, GJ_N_SET, line);
    if (!n || !(n->a = gj_expr_seq(p, false))) goto fail;
    if (!gj_assignable(n->a)) {
        gj_perr(p, line, "can only set a name, names separated by commas, or name.attribute");
        goto fail;
    }
    if (gj_is(p, GJ_T_EQUALS)) {
        p->cur++;
        if (!(n->b = gj_expr_seq(p, false))) goto fail;
    } else {
        if (gj_expect(p, GJ_T_CLOSE_STMT, "or '=' after set's target") != 0) goto fail;
        if (gj_block(p, &n->body, endset, "set", line) != 0) goto fail;
        p->cur += 2;
    }
    if (gj_expect(p, GJ_T_CLOSE_STMT, "to end set") != 0) goto fail;
    return gj_seal(p, n);
fail:
    gj_node_free(n);
    return NULL;
}

static gj_node *gj_macro_stmt(gj_parser *p, int line) {
    static const char *const endmacro[] = {"endmacro", NULL};
    gj_node *n = gj_node_new(p, GJ_N_MACRO, line);
    const gj_tok *t = gj_peek(p, 0);
    if (!n) return NULL;
    if (!t || t->kind != GJ_T_IDENT) {
        gj_perr(p, line, "expected the macro's name");
        goto fail;
    }
    p->cur++;
    if (!(n->str = strdup(t->s))) {
        gj_perr(p, line, "out of memory");
        goto fail;
    }
    n->len = t->n;
    if (gj_args(p, &n->items, true) != 0 ||
        gj_expect(p, GJ_T_CLOSE_STMT, "after the macro's parameters") != 0)
        goto fail;
    if (gj_block(p, &n->body, endmacro, "macro", line) != 0 || gj_end_tag(p, "endmacro") != 0)
        goto fail;
    return gj_seal(p, n);
fail:
    gj_node_free(n);
    return NULL;
}

/* After `{%`: one statement. */
static gj_node *gj_statement(gj_parser *p) {
    const gj_tok *t = gj_peek(p, 0);
    int line = gj_line(p);
    if (!t || t->kind != GJ_T_IDENT) {
        gj_perr(p, line, "expected a tag name after {%%");
        return NULL;
    }
    p->cur++;
    if (gj_enter(p) != 0) return NULL;
    gj_node *n = NULL;
    if (!strcmp(t->s, "if")) {
        n = gj_if_stmt(p, line);
        if (n && gj_end_tag(p, "endif") != 0) gj_node_free(n), n = NULL;
    } else if (!strcmp(t->s, "for"))
        n = gj_for_stmt(p, line);
    else if (!strcmp(t->s, "set"))
        n = gj_set_stmt(p, line);
    else if (!strcmp(t->s, "macro"))
        n = gj_macro_stmt(p, line);
    else if (!strcmp(t->s, "break") || !strcmp(t->s, "continue")) {
        n = gj_node_new(p, t->s[0] == 'b' ? GJ_N_BREAK : GJ_N_CONTINUE, line);
        if (n && gj_expect(p, GJ_T_CLOSE_STMT, t->s) != 0) gj_node_free(n), n = NULL;
    } else if (!strncmp(t->s, "end", 3) || !strcmp(t->s, "else") || !strcmp(t->s, "elif")) {
        gj_perr(p, line, "unexpected tag '%s' (no block open for it)", t->s);
    } else {
        gj_perr(p, line, "unknown tag '%s'", t->s);
    }
    p->depth--;
    return n;
}

/* One statement of a body; NULL without an error for a comment. */
static gj_node *gj_any(gj_parser *p) {
    const gj_tok *t = gj_peek(p, 0);
    p->cur++;
    switch (t->kind) {
    case GJ_T_COMMENT: return NULL;
    case GJ_T_TEXT: {
        gj_node *n = gj_node_new(p, GJ_N_TEXT, t->line);
        if (n && !(n->str = malloc(t->n + 1))) {
            gj_perr(p, t->line, "out of memory");
            gj_node_free(n);
            return NULL;
        }
        if (n) memcpy(n->str, t->s, t->n + 1), n->len = t->n;
        return n;
    }
    case GJ_T_OPEN_STMT: return gj_statement(p);
    case GJ_T_OPEN_EXPR: {
        gj_node *n = gj_node_new(p, GJ_N_OUTPUT, t->line);
        if (!n || !(n->a = gj_expr(p)) || gj_expect(p, GJ_T_CLOSE_EXPR, "to close {{") != 0) {
            gj_node_free(n);
            return NULL;
        }
        return gj_seal(p, n);
    }
    default: gj_perr(p, t->line, "unexpected %s outside a tag", gj_tok_desc(t->kind)); return NULL;
    }
}

gw_jinja *gw_jinja_parse(const char *src, size_t len, char *err, size_t err_len) {
    gj_parser p = {.err = err, .err_len = err_len};
    gj_src s = {0};
    gw_jinja *t = calloc(1, sizeof *t);
    if (err && err_len) err[0] = '\0';
    if (!t) {
        gj_perr(&p, 1, "out of memory");
        return NULL;
    }
    if (!src && len) {
        gj_perr(&p, 1, "no template text");
        goto fail;
    }
    if (gj_preprocess(&p, src ? src : "", len, &s) != 0 || gj_tokenize(&p, &s) != 0) goto fail;
    while (p.cur < p.n_tok) {
        gj_node *n = gj_any(&p);
        if (p.failed) goto fail;
        if (n && gj_nodes_push(&p, &t->body, n, n->line) != 0) goto fail;
    }
    gj_toks_free(&p);
    gj_src_free(&s);
    return t;
fail:
    gj_toks_free(&p);
    gj_src_free(&s);
    gw_jinja_free(t);
    return NULL;
}

void gw_jinja_free(gw_jinja *t) {
    if (!t) return;
    gj_nodes_free(&t->body);
    free(t);
}
