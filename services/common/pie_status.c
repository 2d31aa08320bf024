/* pie_status.c — see pie_status.h. */
#include "pie_status.h"

#include <stdarg.h>
#include <stdio.h>

pie_code pie_status_set(pie_status *st, pie_code code, const char *fmt, ...) {
    if (st == NULL) return code;
    st->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(st->msg, sizeof st->msg, fmt, ap);
    va_end(ap);
    return code;
}

void pie_status_ok(pie_status *st) {
    if (st == NULL) return;
    st->code = PIE_OK;
    st->msg[0] = '\0';
}

const char *pie_code_name(int code) {
    static const char *const names[] = {
        "OK",          "CANCELLED",          "UNKNOWN",        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED", "NOT_FOUND",     "ALREADY_EXISTS", "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
        "UNIMPLEMENTED", "INTERNAL",         "UNAVAILABLE",    "DATA_LOSS",
        "UNAUTHENTICATED",
    };
    if (code < 0 || code >= (int)(sizeof names / sizeof names[0])) return "UNKNOWN_CODE";
    return names[code];
}
