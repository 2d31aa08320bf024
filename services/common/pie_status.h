/* pie_status.h — the one error type of Pie-C.
 *
 * Owns: status codes (1:1 with gRPC status codes, so an error crosses a service boundary
 * unchanged) and a message buffer the caller owns. Every fallible function either returns a
 * pie_code or fills a pie_status; messages name the input that was wrong and its value. */
#ifndef PIE_STATUS_H
#define PIE_STATUS_H

#include <stddef.h>

typedef enum pie_code {
    PIE_OK = 0,
    PIE_CANCELLED = 1,
    PIE_UNKNOWN = 2,
    PIE_INVALID_ARGUMENT = 3,
    PIE_DEADLINE_EXCEEDED = 4,
    PIE_NOT_FOUND = 5,
    PIE_ALREADY_EXISTS = 6,
    PIE_PERMISSION_DENIED = 7,
    PIE_RESOURCE_EXHAUSTED = 8,
    PIE_FAILED_PRECONDITION = 9,
    PIE_ABORTED = 10,
    PIE_OUT_OF_RANGE = 11,
    PIE_UNIMPLEMENTED = 12,
    PIE_INTERNAL = 13,
    PIE_UNAVAILABLE = 14,
    PIE_DATA_LOSS = 15,
    PIE_UNAUTHENTICATED = 16,
} pie_code;

#define PIE_STATUS_MSG_MAX 512

typedef struct pie_status {
    pie_code code;
    char msg[PIE_STATUS_MSG_MAX]; /* NUL-terminated, truncated if longer */
} pie_status;

/* Sets st (which may be NULL) to code and a printf-style message; returns code so callers can
 * write `return pie_status_set(st, PIE_INVALID_ARGUMENT, "...")`. */
pie_code pie_status_set(pie_status *st, pie_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Resets st to PIE_OK with an empty message. */
void pie_status_ok(pie_status *st);

/* "OK", "INVALID_ARGUMENT", ... ; "UNKNOWN_CODE" for values outside the enum. */
const char *pie_code_name(int code);

#endif
