/* test_gw_jinja.c — the chat-template interpreter (services/gateway/gw_jinja.h): exact output for
 * each construct, the errors a template can cause (with their messages), the caps that end
 * hostile templates, and rendering one parsed template from many threads.
 * The byte-for-byte comparison with @huggingface/jinja on real templates is tests/jinja. */
#include "gw_jinja.h"

#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_OUT ((size_t)1 << 20)

/* Renders src with the JSON context ctx_json; NULL on error, the message in err. */
static char *render_n(const char *src, const char *ctx_json, size_t max_out, char *err,
                      size_t err_len) {
    json_error_t je;
    json_t *ctx = ctx_json ? json_loads(ctx_json, 0, &je) : NULL;
    if (ctx_json) cr_assert_not_null(ctx, "bad test context %s: %s", ctx_json, je.text);
    char *out = NULL;
    gw_jinja *t = gw_jinja_parse(src, strlen(src), err, err_len);
    if (t) {
        size_t n = 0;
        out = gw_jinja_render(t, ctx, max_out, &n, err, err_len);
        if (out)
            cr_assert_eq(n, strlen(out), "out_len %zu for a %zu-byte rendering", n, strlen(out));
    }
    gw_jinja_free(t);
    json_decref(ctx);
    return out;
}

static void expect(const char *src, const char *ctx, const char *want) {
    char err[512] = "";
    char *out = render_n(src, ctx, MAX_OUT, err, sizeof err);
    cr_assert_not_null(out, "template %s failed: %s", src, err);
    cr_assert_str_eq(out, want, "template %s\n  rendered [%s]\n  expected [%s]", src, out, want);
    free(out);
}

/* Expects parse or render to fail with a message containing `part`. */
static void expect_error(const char *src, const char *ctx, const char *part) {
    char err[512] = "";
    char *out = render_n(src, ctx, MAX_OUT, err, sizeof err);
    cr_assert_null(out, "template %.200s rendered [%.200s], expected an error", src,
                   out ? out : "");
    cr_assert(strstr(err, part), "template %.200s: error [%s] does not contain [%s]", src, err,
              part);
}

/* ---- text, output, whitespace ---------------------------------------------------------------- */

Test(gw_jinja, text_without_tags_passes_through_unchanged) {
    expect("Hello, {world}!", NULL, "Hello, {world}!");
}

Test(gw_jinja, one_trailing_newline_of_the_template_is_dropped) { expect("a\n\n", NULL, "a\n"); }

Test(gw_jinja, expression_writes_its_value) {
    expect("{{ name }}:{{ 3 }}:{{ 2.5 }}:{{ 2.0 }}:{{ true }}:{{ none }}:{{ missing }}",
           "{\"name\": \"x\"}", "x:3:2.5:2.0:true::");
}

Test(gw_jinja, containers_write_as_json) {
    expect("{{ [1, 'a', none] }} {{ {'k': 1} }}", NULL, "[1, \"a\", null] {\"k\": 1}");
}

Test(gw_jinja, dash_strips_whitespace_on_its_side) {
    expect("a  \n  {{- 'b' -}}  \n  c", NULL, "abc");
    expect("a  {%- if true %} b {% endif -%}  c", NULL, "a b c");
}

Test(gw_jinja, block_tags_trim_their_newline_and_leading_indent) {
    expect("<\n  {% if true %}\n  x\n  {% endif %}\n>", NULL, "<\n  x\n>");
}

Test(gw_jinja, expression_tags_keep_surrounding_whitespace) {
    expect("  {{ 'x' }}\n", NULL, "  x");
}

Test(gw_jinja, comments_render_nothing) { expect("a{# note #}b{#- strip -#}   c", NULL, "abc"); }

Test(gw_jinja, generation_tag_is_removed) {
    expect("a{% generation %}b{% endgeneration %}c", NULL, "abc");
}

/* ---- literals and operators ------------------------------------------------------------------ */

Test(gw_jinja, string_literals_understand_escapes_and_join_when_adjacent) {
    expect("{{ 'a\\nb\\t\\'q\\'\\\\' }}|{{ \"x\" 'y' }}|{{ '\\u00e9\\x41' }}", NULL,
           "a\nb\t'q'\\|xy|\xc3\xa9"
           "A");
}

Test(gw_jinja, arithmetic_follows_python) {
    expect("{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 / 2 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 1 + 2 * 3 }} {{ "
           "0.1 + 0.2 }} {{ -(3) }}",
           NULL, "3 -4 3.5 2 1024 7 0.30000000000000004 -3");
}

Test(gw_jinja, string_concatenation_with_plus_and_tilde) {
    expect("{{ 'a' + 'b' }} {{ 'n' ~ 1 ~ none ~ missing }} {{ 'x' + 2 }}", NULL, "ab n1 x2");
}

Test(gw_jinja, comparisons_and_membership) {
    expect("{{ 1 < 2 }} {{ 'b' > 'a' }} {{ 1 == 1.0 }} {{ 'a' != 'a' }} {{ 'x' in 'xyz' }} {{ 2 in "
           "[1, 2] }} "
           "{{ 'k' in {'k': 1} }} {{ 'q' not in ['a'] }} {{ 'a' in missing }}",
           NULL, "true true true false true true true true false");
}

Test(gw_jinja, and_or_return_an_operand_and_not_negates) {
    expect("{{ 0 or 'b' }} {{ 'a' and 'b' }} {{ '' and 'b' }}|{{ not [] }} {{ not not 1 }}", NULL,
           "b b |true true");
}

Test(gw_jinja, inline_if_with_and_without_else) {
    expect("{{ 'y' if 1 else 'n' }}{{ 'z' if 0 }}{{ 'a' if 0 else 'b' if 1 else 'c' }}", NULL,
           "yb");
}

Test(gw_jinja, true_false_none_in_either_case) {
    expect("{{ True }} {{ False }} {{ None is none }}", NULL, "true false true");
}

/* ---- access ---------------------------------------------------------------------------------- */

Test(gw_jinja, attribute_and_subscript_read_the_same_key) {
    expect("{{ m.role }} {{ m['role'] }} {{ m.missing is defined }} {{ xs[0] }} {{ xs[-1] }} {{ "
           "xs[9] is defined }} {{ xs.1 }}",
           "{\"m\": {\"role\": \"user\"}, \"xs\": [1, 2, 3]}", "user user false 1 3 false 2");
}

Test(gw_jinja, slices_of_lists_and_strings_follow_python) {
    expect("{{ xs[1:] }} {{ xs[:-1] }} {{ xs[::-1] }} {{ xs[::2] }} {{ 'h\xc3\xa9llo'[1:3] }} {{ "
           "'abc'[::-1] }} {{ 'h\xc3\xa9llo'[1] }}",
           "{\"xs\": [1, 2, 3, 4]}",
           "[2, 3, 4] [1, 2, 3] [4, 3, 2, 1] [1, 3] \xc3\xa9l cba \xc3\xa9");
}

Test(gw_jinja, reading_an_attribute_of_undefined_is_an_error) {
    expect_error("{{ missing.role }}", NULL,
                 "line 1: cannot read attribute 'role' of an undefined value");
    expect_error("{{ x['a'] }}", "{\"x\": null}", "cannot read an item of none");
}

/* ---- statements ------------------------------------------------------------------------------ */

Test(gw_jinja, if_elif_else_picks_the_first_true_branch) {
    const char *t = "{% if n == 1 %}one{% elif n == 2 %}two{% else %}many{% endif %}";
    expect(t, "{\"n\": 1}", "one");
    expect(t, "{\"n\": 2}", "two");
    expect(t, "{\"n\": 3}", "many");
}

Test(gw_jinja, for_loop_exposes_the_loop_variable) {
    expect("{% for x in xs %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 "
           "}}{{ loop.first }}{{ loop.last }}"
           "{{ loop.length }}{% if loop.previtem is defined %}<{{ loop.previtem }}{% endif %};{% "
           "endfor %}",
           "{\"xs\": [\"a\", \"b\"]}", "1021truefalse2;2110falsetrue2<a;");
}

Test(gw_jinja, for_loop_filter_counts_only_kept_items_and_else_runs_when_empty) {
    expect("{% for x in xs if x > 1 %}{{ x }}/{{ loop.length }} {% else %}none{% endfor %}",
           "{\"xs\": [1, 2, 3]}", "2/2 3/2 ");
    expect("{% for x in xs %}{{ x }}{% else %}none{% endfor %}", "{\"xs\": []}", "none");
}

Test(gw_jinja, for_loop_over_a_string_visits_characters_and_over_undefined_nothing) {
    expect("{% for c in 'h\xc3\xa9' %}[{{ c }}]{% endfor %}{% for c in missing %}x{% else %}-{% "
           "endfor %}",
           NULL, "[h][\xc3\xa9]-");
    expect_error("{% for c in 5 %}{% endfor %}", NULL, "cannot loop over an integer");
}

Test(gw_jinja, for_loop_unpacks_dict_items_in_insertion_order) {
    expect("{% for k, v in d.items() %}{{ k }}={{ v }},{% endfor %}{% for k in d %}{{ k }}{% "
           "endfor %}",
           "{\"d\": {\"z\": 1, \"a\": 2, \"m\": 3}}", "z=1,a=2,m=3,zam");
}

Test(gw_jinja, break_and_continue_leave_the_loop_or_the_iteration) {
    expect("{% for i in range(10) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 4 %}{% "
           "break %}{% endif %}{{ i }}{% endfor %}",
           NULL, "023");
}

Test(gw_jinja, set_inside_a_loop_does_not_leak_but_namespace_attributes_do) {
    expect("{% set x = 0 %}{% set ns = namespace(n=0, seen=false) %}{% for i in [1, 2] %}{% set x "
           "= i %}"
           "{% set ns.n = ns.n + i %}{% set ns.seen = true %}{% endfor %}{{ x }} {{ ns.n }} {{ "
           "ns.seen }}",
           NULL, "0 3 true");
}

Test(gw_jinja, setting_an_attribute_of_a_dict_is_an_error) {
    expect_error("{% set d = {} %}{% set d.x = 1 %}", NULL, "cannot set attribute 'x' of a dict");
}

Test(gw_jinja, block_set_captures_rendered_text) {
    expect("{% set s %}a{{ 1 + 1 }}b{% endset %}[{{ s }}]", NULL, "[a2b]");
}

Test(gw_jinja, set_unpacks_a_list_into_names) {
    expect("{% set a, b = [1, 'x'] %}{{ a }}{{ b }}", NULL, "1x");
}

Test(gw_jinja, macro_takes_positional_keyword_and_default_arguments) {
    expect("{% macro m(a, b='B', c='C') %}{{ a }}{{ b }}{{ c }}{% endmacro %}{{ m(1) }} {{ m(1, 2) "
           "}} {{ m(1, c=3) }}",
           NULL, "1BC 12C 1B3");
    expect_error("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", NULL,
                 "macro 'm' takes at most 1 arguments");
}

/* ---- filters --------------------------------------------------------------------------------- */

Test(gw_jinja, text_filters) {
    expect(
        "[{{ '  a b \\n' | trim }}] {{ 'aB' | upper }} {{ 'aB' | lower }} {{ 'hello world' | title "
        "}} {{ 'hello' | capitalize }} "
        "{{ 'aaa' | replace('a', 'b', 2) }} {{ 'x' | safe }} {{ 5 | string }}{{ none | string }}",
        NULL, "[a b] AB ab Hello World Hello bba x 5None");
}

Test(gw_jinja, sequence_filters) {
    expect("{{ xs | length }} {{ xs | count }} {{ 'h\xc3\xa9' | length }} {{ xs | first }} {{ xs | "
           "last }} {{ xs | join('-') }} "
           "{{ xs | reverse | list }} {{ d | length }} {{ d | items | list }}",
           "{\"xs\": [1, 2, 3], \"d\": {\"a\": 1}}", "3 3 2 1 3 1-2-3 [3, 2, 1] 1 [[\"a\", 1]]");
}

Test(gw_jinja, sort_dictsort_and_unique_order_like_python) {
    expect("{{ [3, 1, 2] | sort }} {{ ['b', 'A', 'c'] | sort(reverse=true) }} "
           "{{ xs | sort(attribute='n') | map(attribute='n') | list }} {{ {'b': 1, 'a': 2} | "
           "dictsort }} "
           "{{ {'b': 1, 'a': 2} | dictsort(by='value', reverse=true) }} {{ ['a', 'A', 'b', 'a'] | "
           "unique | list }}",
           "{\"xs\": [{\"n\": 2}, {\"n\": 1}]}",
           "[1, 2, 3] [\"c\", \"b\", \"A\"] [1, 2] [[\"a\", 2], [\"b\", 1]] [[\"a\", 2], [\"b\", "
           "1]] [\"a\", \"b\"]");
    expect_error("{{ [1, 'a'] | sort }}", NULL, "cannot order an integer and a string");
}

Test(gw_jinja, map_applies_a_filter_by_name) {
    expect("{{ [' a', 'b '] | map('trim') | join(',') }} {{ [{'k': 1}] | map('tojson') | list }}",
           NULL, "a,b [\"{\\\"k\\\": 1}\"]");
    expect_error("{{ [1] | map('nope') | list }}", NULL, "unknown filter 'nope'");
}

Test(gw_jinja, default_filter_replaces_undefined_or_with_true_any_false_value) {
    expect("{{ missing | default('d') }} {{ '' | default('e') }}|{{ '' | default('e', true) }} {{ "
           "missing | d('x') }}",
           NULL, "d |e x");
}

Test(gw_jinja, number_filters) {
    expect("{{ '42' | int + 1 }} {{ 'x' | int }} {{ 'x' | int(7) }} {{ 3.9 | int }} {{ '2.5' | "
           "float }} {{ -3 | abs }}",
           NULL, "43 0 7 3 2.5 3");
}

Test(gw_jinja, selectattr_rejectattr_and_map_pick_by_attribute) {
    const char *ctx = "{\"ms\": [{\"role\": \"user\", \"c\": \"a\"}, {\"role\": \"bot\", \"c\": "
                      "\"b\"}, {\"role\": \"user\", \"c\": \"c\"}]}";
    expect("{{ ms | selectattr('role', 'equalto', 'user') | map(attribute='c') | join }} "
           "{{ ms | rejectattr('role', 'equalto', 'user') | map(attribute='c') | join }} "
           "{{ ms | selectattr('c') | list | length }} {{ ms | map(attribute='x', default='-') | "
           "join }} "
           "{{ [1, 2, 3, 4] | select('odd') | list }} {{ ['a', 'b'] | reject('equalto', 'a') | "
           "list }}",
           ctx, "ac b 3 --- [1, 3] [\"b\"]");
}

Test(gw_jinja, tojson_keeps_key_order_and_escapes_like_json_dumps) {
    expect(
        "{{ d | tojson }}",
        "{\"d\": {\"z\": \"q\\\"\\\\\\n\\u0001\", \"a\": [true, null, 1.5, 2], \"\\u00e9\": {}}}",
        "{\"z\": \"q\\\"\\\\\\n\\u0001\", \"a\": [true, null, 1.5, 2], \"\xc3\xa9\": {}}");
}

Test(gw_jinja, tojson_indents_nested_containers) {
    expect("{{ d | tojson(indent=2) }}", "{\"d\": {\"a\": [1], \"b\": {}, \"c\": []}}",
           "{\n  \"a\": [\n    1\n  ],\n  \"b\": {},\n  \"c\": []\n}");
}

Test(gw_jinja, tojson_options) {
    expect("{{ d | tojson(sort_keys=true, separators=(',', ':')) }} {{ '\xc3\xa9' | "
           "tojson(ensure_ascii=true) }}",
           "{\"d\": {\"b\": 1, \"a\": 2}}", "{\"a\":2,\"b\":1} \"\\u00e9\"");
}

Test(gw_jinja, indent_filter_skips_first_and_blank_lines_by_default) {
    expect("{{ 'a\\nb\\n\\nc' | indent(2) }}|{{ 'a\\nb' | indent(1, true) }}", NULL,
           "a\n  b\n\n  c| a\n b");
}

Test(gw_jinja, tests_classify_values) {
    expect("{{ 1 is number }}{{ 'a' is string }}{{ {} is mapping }}{{ [] is iterable }}{{ x is "
           "defined }}{{ x is undefined }}"
           "{{ none is none }}{{ 1 is not none }}{{ 3 is odd }}{{ 2 is even }}{{ true is boolean "
           "}}{{ 1 is integer }}",
           NULL, "truetruetruetruefalsetruetruetruetruetruetruetrue");
}

/* ---- methods and functions ------------------------------------------------------------------- */

Test(gw_jinja, string_methods_follow_python) {
    expect("[{{ ' a '.strip() }}][{{ 'xxaxx'.strip('x') }}][{{ ' a '.lstrip() }}][{{ ' a "
           "'.rstrip() }}] {{ 'a,b,,c'.split(',') }} "
           "{{ ' a  b '.split() }} {{ 'a b c'.split(' ', 1) }} {{ 'abc'.startswith('ab') }} {{ "
           "'abc'.endswith(('x', 'c')) }} "
           "{{ 'aXa'.replace('a', 'b') }} {{ 'Ab'.upper() }}{{ 'Ab'.lower() }} {{ '-'.join(['a', "
           "'b']) }}",
           NULL,
           "[a][a][a ][ a] [\"a\", \"b\", \"\", \"c\"] [\"a\", \"b\"] [\"a\", \"b c\"] true true "
           "bXb ABab a-b");
}

Test(gw_jinja, string_format_fills_positional_and_named_fields) {
    expect("{{ '{} + {} = {sum} {{x}}'.format(1, 2, sum=3) }} {{ '{1}{0}'.format('a', 'b') }}",
           NULL, "1 + 2 = 3 {x} ba");
    expect_error("{{ '{:>5}'.format(1) }}", NULL, "only {}, {N} and {name} fields");
    expect_error("{{ '{} {}'.format(1) }}", NULL, "no argument for field {}");
}

Test(gw_jinja, dict_methods) {
    expect("{{ d.get('a') }} {{ d.get('z', 'dflt') }} {{ d.get('z') is none }} {{ d.keys() | list "
           "}} {{ d.values() | list }} "
           "{{ d.items() | list }}",
           "{\"d\": {\"a\": 1, \"b\": 2}}",
           "1 dflt true [\"a\", \"b\"] [1, 2] [[\"a\", 1], [\"b\", 2]]");
}

Test(gw_jinja, range_counts_like_python) {
    expect("{{ range(3) | list }} {{ range(1, 6, 2) | list }} {{ range(3, 0, -1) | list }} {{ "
           "range(0) | list }}",
           NULL, "[0, 1, 2] [1, 3, 5] [3, 2, 1] []");
}

Test(gw_jinja, raise_exception_fails_with_exactly_its_message) {
    expect_error("a{{ raise_exception('Roles must alternate!') }}", NULL, "Roles must alternate!");
    char err[128];
    char *out = render_n("{{ raise_exception('exact') }}", NULL, MAX_OUT, err, sizeof err);
    cr_assert_null(out);
    cr_assert_str_eq(err, "exact");
}

Test(gw_jinja, strftime_now_formats_the_current_time) {
    char err[128];
    char *out = render_n("{{ strftime_now('%Y') }}", NULL, MAX_OUT, err, sizeof err);
    cr_assert_not_null(out, "%s", err);
    cr_assert_eq(strlen(out), 4, "year [%s]", out);
    free(out);
}

/* ---- parse errors ---------------------------------------------------------------------------- */

Test(gw_jinja, unknown_tag_is_a_parse_error_naming_tag_and_line) {
    expect_error("line1\nline2\n{% include 'x' %}", NULL,
                 "chat template line 3: unknown tag 'include'");
}

Test(gw_jinja, unclosed_block_is_a_parse_error) {
    expect_error("{% for x in xs %}\n{{ x }}", NULL, "line 1: unclosed 'for' block");
    expect_error("{% if x %}a{% else %}b", NULL, "unclosed 'if' block");
    expect_error("{{ x ", NULL, "chat template line 1");
    expect_error("{{ 'abc }}", NULL, "unterminated string");
    expect_error("{# never closed", NULL, "unclosed comment");
}

Test(gw_jinja, stray_end_tag_is_a_parse_error) {
    expect_error("{% endif %}", NULL, "unexpected tag 'endif'");
}

Test(gw_jinja, loop_and_set_targets_must_be_names) {
    expect_error("{% for a, 1 in xs %}{% endfor %}", NULL, "a for loop's target must be a name");
    expect_error("{% for a.b in xs %}{% endfor %}", NULL,
                 "expected 'in' after the for loop's target");
    expect_error("{% set 'a' = 1 %}", NULL, "can only set a name");
}

Test(gw_jinja, unknown_filter_is_a_parse_error_even_in_an_untaken_branch) {
    expect_error("{% if false %}{{ x | wordcount }}{% endif %}", NULL,
                 "line 1: unknown filter 'wordcount'");
}

Test(gw_jinja, unknown_test_and_unknown_method_are_errors) {
    expect_error("{{ x is divisibleby }}", NULL, "unknown test 'divisibleby'");
    expect_error("{{ 'a'.zfill(3) }}", NULL, "unknown string method 'zfill'");
}

Test(gw_jinja, calling_something_that_is_not_a_function_is_an_error) {
    expect_error("{{ nothing(1) }}", NULL, "'nothing' is undefined, not a function");
}

/* ---- caps on hostile templates --------------------------------------------------------------- */

Test(gw_jinja, output_over_max_out_is_an_error) {
    char err[256];
    char *out =
        render_n("{% for i in range(100) %}0123456789{% endfor %}", NULL, 999, err, sizeof err);
    cr_assert_null(out);
    cr_assert(strstr(err, "output longer than the limit of 999 bytes"), "%s", err);
    out = render_n("{% for i in range(100) %}0123456789{% endfor %}", NULL, 1000, err, sizeof err);
    cr_assert_not_null(out, "exactly max_out bytes must fit: %s", err);
    free(out);
}

Test(gw_jinja, loop_iteration_cap_ends_nested_loops) {
    expect_error("{% for i in range(1000) %}{% for j in range(1000) %}{% for k in range(10) %}{% "
                 "endfor %}{% endfor %}{% endfor %}",
                 NULL, "more than 1000000 loop iterations");
    expect_error("{{ range(100000000) | length }}", NULL, "range() longer than");
}

Test(gw_jinja, growing_values_hit_the_live_memory_cap) {
    expect_error("{% set ns = namespace(x=[1]) %}{% for i in range(40) %}{% set ns.x = ns.x + ns.x "
                 "%}{% endfor %}",
                 NULL, "template values need more than");
    expect_error("{% set ns = namespace(s='0123456789abcdef') %}{% for i in range(40) %}{% set "
                 "ns.s = ns.s ~ ns.s %}{% endfor %}",
                 NULL, "longer than the limit"); /* a string never outgrows max_out */
}

Test(gw_jinja, deeply_nested_values_are_refused) {
    expect_error("{% set ns = namespace(x=[]) %}{% for i in range(100000) %}{% set ns.x = [ns.x] "
                 "%}{% endfor %}{{ ns.x | tojson }}",
                 NULL, "nested more than");
}

Test(gw_jinja, work_cap_ends_a_template_that_scans_big_strings_in_a_loop) {
    expect_error("{% set ns = namespace(s='01234567') %}{% for i in range(13) %}{% set ns.s = ns.s "
                 "~ ns.s %}{% endfor %}"
                 "{% for i in range(100000) %}{% if 'zz' in ns.s %}{% endif %}{% endfor %}",
                 NULL, "more than 200000000 steps of work");
}

Test(gw_jinja, a_namespace_cannot_hold_a_namespace_so_values_never_form_cycles) {
    expect_error("{% set ns = namespace(x=1) %}{% set ns.x = ns %}", NULL,
                 "cannot hold a namespace");
    expect_error("{% set ns = namespace(x=1) %}{% set ns.x = [1, {'a': ns}] %}", NULL,
                 "cannot hold a namespace");
    expect("{% set inner = namespace(v=2) %}{% set outer = namespace(i=inner) %}{{ outer.i.v }}",
           NULL, "2");
}

Test(gw_jinja, recursive_macro_is_stopped) {
    expect_error("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", NULL,
                 "macro calls nested more than");
}

/* A template of `count` copies of open, then inner, then `count` copies of close. */
static char *nested(const char *open, const char *inner, const char *close, size_t count) {
    size_t lo = strlen(open), li = strlen(inner), lc = strlen(close);
    char *s = malloc(count * (lo + lc) + li + 1), *p = s;
    cr_assert_not_null(s);
    for (size_t i = 0; i < count; i++, p += lo) memcpy(p, open, lo);
    memcpy(p, inner, li), p += li;
    for (size_t i = 0; i < count; i++, p += lc) memcpy(p, close, lc);
    *p = '\0';
    return s;
}

Test(gw_jinja, ten_thousand_nested_levels_fail_cleanly) {
    struct {
        const char *open, *inner, *close;
    } shapes[] = {
        {"{% if true %}", "x", "{% endif %}"},
        {"{% for i in [1] %}", "x", "{% endfor %}"},
        {"{{ ", "1", " }}"},
        {"(", "1", ")"},
        {"[", "1", "]"},
        {"not ", "1", ""},
        {"- ", "1", ""},
        {"1 + ", "1", ""},
        {"x | trim | ", "upper", ""},
        {"a.", "b", ""},
        {"{% if false %}{% elif false %}", "", ""},
    };
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        char *body = nested(shapes[k].open, shapes[k].inner, shapes[k].close, 10000);
        bool is_expr = shapes[k].open[0] != '{';
        size_t n = strlen(body) + 16;
        char *src = malloc(n);
        cr_assert_not_null(src);
        snprintf(src, n, is_expr ? "{{ %s }}" : "%s", body);
        char err[256] = "";
        gw_jinja *t = gw_jinja_parse(src, strlen(src), err, sizeof err);
        cr_assert_null(t, "shape %zu: a 10,000-level template parsed", k);
        cr_assert(strncmp(err, "chat template line 1: ", 22) == 0, "shape %zu: error [%s]", k, err);
        free(src);
        free(body);
    }
}

Test(gw_jinja, moderate_nesting_still_parses) {
    char *src = nested("{% if true %}", "ok", "{% endif %}", 40);
    expect(src, NULL, "ok");
    free(src);
    src = nested("(", "1", ")", 40);
    char *wrapped = malloc(strlen(src) + 8);
    cr_assert_not_null(wrapped);
    sprintf(wrapped, "{{ %s }}", src);
    expect(wrapped, NULL, "1");
    free(wrapped);
    free(src);
}

/* Every prefix of a real template, and every single-byte corruption of a short one, must parse or
 * fail cleanly; what parses must render or fail cleanly (ASan checks the rest). */
Test(gw_jinja, truncated_and_corrupted_templates_fail_cleanly) {
    FILE *f = fopen(PIE_SOURCE_DIR "/tests/jinja/templates/llama3.1.jinja", "rb");
    cr_assert_not_null(f);
    char *src = malloc(16384);
    cr_assert_not_null(src);
    size_t n = fread(src, 1, 16383, f);
    fclose(f);
    json_t *ctx = json_loads("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
                             "\"add_generation_prompt\": true}",
                             0, NULL);
    cr_assert_not_null(ctx);
    for (size_t len = 0; len <= n; len += 7) {
        char err[256];
        gw_jinja *t = gw_jinja_parse(src, len, err, sizeof err);
        if (!t) continue;
        size_t out_len;
        free(gw_jinja_render(t, ctx, MAX_OUT, &out_len, err, sizeof err));
        gw_jinja_free(t);
    }
    const char *small = "{% for m in messages %}{{ m.role | upper ~ ':' + m['content'][1:] }}{% if "
                        "loop.last %}!{% endif %}{% endfor %}";
    size_t sn = strlen(small);
    char buf[256];
    const char repl[] = "{}%#-'\"|.[]()\\ x0";
    for (size_t i = 0; i < sn; i++) {
        for (size_t r = 0; r < sizeof repl - 1; r++) {
            memcpy(buf, small, sn);
            buf[i] = repl[r];
            char err[256];
            gw_jinja *t = gw_jinja_parse(buf, sn, err, sizeof err);
            if (!t) continue;
            size_t out_len;
            free(gw_jinja_render(t, ctx, MAX_OUT, &out_len, err, sizeof err));
            gw_jinja_free(t);
        }
    }
    json_decref(ctx);
    free(src);
}

Test(gw_jinja, null_context_and_null_template_are_handled) {
    char err[128];
    size_t n;
    cr_assert_null(gw_jinja_render(NULL, NULL, MAX_OUT, &n, err, sizeof err));
    gw_jinja *t = gw_jinja_parse("", 0, err, sizeof err);
    cr_assert_not_null(t);
    char *out = gw_jinja_render(t, NULL, MAX_OUT, &n, err, sizeof err);
    cr_assert_not_null(out);
    cr_assert_eq(n, 0);
    free(out);
    json_t *arr = json_array();
    cr_assert_null(gw_jinja_render(t, arr, MAX_OUT, &n, err, sizeof err));
    cr_assert(strstr(err, "must be a JSON object"), "%s", err);
    json_decref(arr);
    gw_jinja_free(t);
    gw_jinja_free(NULL);
}

/* ---- threads --------------------------------------------------------------------------------- */

typedef struct render_job {
    const gw_jinja *t;
    json_t *ctx;
    char *out;
} render_job;

static void *render_thread(void *arg) {
    render_job *j = arg;
    char err[256];
    size_t n;
    for (int i = 0; i < 200; i++) {
        free(j->out);
        j->out = gw_jinja_render(j->t, j->ctx, MAX_OUT, &n, err, sizeof err);
        if (!j->out) break;
    }
    return NULL;
}

Test(gw_jinja, one_parsed_template_renders_from_many_threads_at_once) {
    const char *src =
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "<{{ m.role }}>{{ m.content | trim }}{% endfor %}{{ ns.n }}{{ tools | tojson }}";
    char err[256];
    gw_jinja *t = gw_jinja_parse(src, strlen(src), err, sizeof err);
    cr_assert_not_null(t, "%s", err);
    enum { N = 8 };
    render_job jobs[N];
    pthread_t th[N];
    for (int i = 0; i < N; i++) {
        char ctx[256];
        snprintf(ctx, sizeof ctx,
                 "{\"messages\": [{\"role\": \"u%d\", \"content\": \" c%d \"}], \"tools\": [%d]}",
                 i, i, i);
        jobs[i] = (render_job){t, json_loads(ctx, 0, NULL), NULL};
        cr_assert_not_null(jobs[i].ctx);
    }
    for (int i = 0; i < N; i++)
        cr_assert_eq(pthread_create(&th[i], NULL, render_thread, &jobs[i]), 0);
    for (int i = 0; i < N; i++) cr_assert_eq(pthread_join(th[i], NULL), 0);
    for (int i = 0; i < N; i++) {
        char want[64];
        snprintf(want, sizeof want, "<u%d>c%d1[%d]", i, i, i);
        cr_assert_not_null(jobs[i].out, "thread %d failed", i);
        cr_assert_str_eq(jobs[i].out, want);
        free(jobs[i].out);
        json_decref(jobs[i].ctx);
    }
    gw_jinja_free(t);
}
