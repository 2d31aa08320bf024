/* pie_check.c — see pie_check.h. Every message goes through fail(), which writes the prefix. */
#include "pie_check.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>

/* PIE_INVALID_ARGUMENT "<at>: <fmt...>". */
static pie_code fail(pie_check_at at, pie_status *st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static pie_code fail(pie_check_at at, pie_status *st, const char *fmt, ...) {
    char what[PIE_STATUS_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    if (at.item < 0) return pie_status_set(st, PIE_INVALID_ARGUMENT, "%s: %s", at.fn, what);
    return pie_status_set(st, PIE_INVALID_ARGUMENT, "%s: item %lld: %s", at.fn, (long long)at.item,
                          what);
}

pie_code pie_check_range(pie_check_at at, const char *field, uint64_t v, uint64_t lo, uint64_t hi,
                         pie_status *st) {
    if (v < lo || v > hi)
        return fail(at, st, "%s %llu is out of range [%llu, %llu]", field, (unsigned long long)v,
                    (unsigned long long)lo, (unsigned long long)hi);
    return PIE_OK;
}

pie_code pie_check_lt(pie_check_at at, const char *field, uint64_t v, uint64_t limit,
                      pie_status *st) {
    if (v >= limit)
        return fail(at, st, "%s %llu is out of range [0, %llu)", field, (unsigned long long)v,
                    (unsigned long long)limit);
    return PIE_OK;
}

pie_code pie_check_below(pie_check_at at, const char *field, const uint32_t *v, size_t n,
                         uint32_t limit, pie_status *st) {
    for (size_t i = 0; i < n; i++)
        if (v[i] >= limit)
            return fail(at, st, "%s[%zu] = %u is out of range [0, %u)", field, i, v[i], limit);
    return PIE_OK;
}

pie_code pie_check_count(pie_check_at at, const char *field, uint64_t n, uint64_t max,
                         pie_status *st) {
    if (n == 0) return fail(at, st, "%s is empty", field);
    if (n > max)
        return fail(at, st, "%s has %llu entries, more than the %llu allowed", field,
                    (unsigned long long)n, (unsigned long long)max);
    return PIE_OK;
}

pie_code pie_check_name(pie_check_at at, const char *field, size_t len, pie_status *st) {
    if (len == 0) return fail(at, st, "%s is empty", field);
    if (len > PIE_MAX_NAME_BYTES)
        return fail(at, st, "%s is %zu bytes, more than %u", field, len, PIE_MAX_NAME_BYTES);
    return PIE_OK;
}

pie_code pie_check_forward(pie_check_at at, const pie_check_fwd *f, uint32_t page_size,
                           uint64_t max_in, pie_status *st) {
    if (pie_check_count(at, f->in, f->n_in, max_in, st) != PIE_OK) return st->code;
    if (f->n_pages == 0 && f->last_len != 0)
        return fail(at, st, "%s %u must be 0 when %s is empty", f->last, f->last_len, f->pages);
    if (f->n_pages > 0 && pie_check_range(at, f->last, f->last_len, 1, page_size, st) != PIE_OK)
        return st->code;
    if (f->n_out > f->n_in)
        return fail(at, st, "%s has %llu entries, more than the %llu of %s", f->out,
                    (unsigned long long)f->n_out, (unsigned long long)f->n_in, f->in);
    return PIE_OK;
}

pie_code pie_check_mask(pie_check_at at, const uint32_t *runs, uint64_t n_runs, uint32_t ctx,
                        uint32_t n_rows, pie_status *st) {
    uint64_t cur = 0;
    for (uint32_t i = 0; i < n_rows; i++) {
        uint64_t len = (uint64_t)ctx + i + 1, covered = 0;
        bool visible = true, last_visible = true;
        while (covered < len) {
            if (cur == n_runs)
                return fail(at, st, "mask runs end in row %u (%llu of its %llu tokens covered)", i,
                            (unsigned long long)covered, (unsigned long long)len);
            uint32_t r = runs[cur];
            if (covered + r > len)
                return fail(at, st,
                            "mask run %llu (length %u) crosses the end of row %u (%llu "
                            "tokens)",
                            (unsigned long long)cur, r, i, (unsigned long long)len);
            covered += r;
            last_visible = visible;
            visible = !visible;
            cur++;
        }
        if (!last_visible)
            return fail(at, st, "mask row %u hides its own token (the last of its %llu)", i,
                        (unsigned long long)len);
    }
    if (cur != n_runs)
        return fail(at, st, "mask has %llu runs left over after row %u",
                    (unsigned long long)(n_runs - cur), n_rows ? n_rows - 1 : 0);
    return PIE_OK;
}

pie_code pie_check_page_len(pie_check_at at, const char *field, uint64_t n, uint32_t page_size,
                            pie_status *st) {
    if (n != page_size)
        return fail(at, st, "%s has %llu entries, must have kv_page_size %u", field,
                    (unsigned long long)n, page_size);
    return PIE_OK;
}

pie_code pie_check_copy(pie_check_at at, uint32_t src, uint32_t dst, uint32_t src_offset,
                        uint32_t dst_offset, uint32_t token_count, uint32_t page_size,
                        pie_status *st) {
    uint64_t n = token_count, s = src_offset, d = dst_offset;
    if (pie_check_range(at, "token_count", n, 1, page_size, st) != PIE_OK) return st->code;
    if (s + n > page_size)
        return fail(at, st, "src_offset %u + token_count %u exceeds kv_page_size %u", src_offset,
                    token_count, page_size);
    if (d + n > page_size)
        return fail(at, st, "dst_offset %u + token_count %u exceeds kv_page_size %u", dst_offset,
                    token_count, page_size);
    if (src == dst && s < d + n && d < s + n)
        return fail(at, st,
                    "source [%llu, %llu) and destination [%llu, %llu) overlap in kv page %u",
                    (unsigned long long)s, (unsigned long long)(s + n), (unsigned long long)d,
                    (unsigned long long)(d + n), src);
    return PIE_OK;
}

pie_code pie_check_temperature(pie_check_at at, float t, bool zero_ok, pie_status *st) {
    if (!isfinite(t) || t < 0 || (t == 0 && !zero_ok))
        return fail(at, st, "temperature %g is not a finite number %s", (double)t,
                    zero_ok ? ">= 0" : "> 0");
    return PIE_OK;
}
