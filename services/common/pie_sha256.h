/* pie_sha256.h — SHA-256 as lowercase hex: the content id of programs (lifecycle), the wasm
 * cache key, and the tokenizer hash a worker advertises.
 *
 * Owns: the one SHA-256 of the services, over OpenSSL's EVP (libcrypto, which libgrpc-dev
 * already brings). Does not own what the hashes identify. */
#ifndef PIE_SHA256_H
#define PIE_SHA256_H

#include <stdbool.h>
#include <stddef.h>

#include "pie_status.h"

/* Lowercase hex SHA-256 of len bytes into hex[65] (NUL-terminated). PIE_INTERNAL only if
 * OpenSSL fails (hex is then ""). */
pie_code pie_sha256_hex(const void *data, size_t len, char hex[65], pie_status *st);

/* Whether s is a SHA-256 as these hex strings are written: exactly 64 lowercase hex digits.
 * NULL is not. */
bool pie_sha256_is_hex(const char *s);

#endif
