/* test_pie_utf8.c — the one UTF-8 validator (services/common/pie_utf8.c): RFC 3629's edges. */
#include <criterion/criterion.h>

#include "pie_utf8.h"

static size_t next(const char *s, size_t n, uint32_t *cp) {
    return pie_utf8_next((const unsigned char *)s, n, cp);
}

Test(pie_utf8, decodes_each_length_at_its_bounds) {
    struct { const char *s; size_t len; uint32_t cp; } ok[] = {
        {"\x00", 1, 0},           {"\x7F", 1, 0x7F},          {"\xC2\x80", 2, 0x80},
        {"\xDF\xBF", 2, 0x7FF},   {"\xE0\xA0\x80", 3, 0x800}, {"\xED\x9F\xBF", 3, 0xD7FF},
        {"\xEE\x80\x80", 3, 0xE000}, {"\xEF\xBF\xBF", 3, 0xFFFF},
        {"\xF0\x90\x80\x80", 4, 0x10000}, {"\xF4\x8F\xBF\xBF", 4, 0x10FFFF},
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        uint32_t cp = 0xFFFFFFFF;
        cr_assert_eq(next(ok[i].s, ok[i].len, &cp), ok[i].len, "case %zu", i);
        cr_assert_eq(cp, ok[i].cp, "case %zu: U+%04X", i, cp);
    }
}

Test(pie_utf8, refuses_overlongs_surrogates_out_of_range_and_truncation) {
    const char *bad[] = {"\x80", "\xBF", "\xC0\xAF", "\xC1\xBF", "\xE0\x9F\xBF", "\xED\xA0\x80",
                         "\xED\xBF\xBF", "\xF0\x8F\xBF\xBF", "\xF4\x90\x80\x80", "\xF5\x80\x80\x80",
                         "\xF8\x88\x80\x80\x80", "\xFF", "\xC3\x28"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        cr_assert_eq(next(bad[i], strlen(bad[i]), NULL), 0, "case %zu", i);
    cr_assert_eq(next("\xE2\x82\xAC", 2, NULL), 0, "truncated by n");
    cr_assert_eq(next("", 0, NULL), 0, "empty");
}
