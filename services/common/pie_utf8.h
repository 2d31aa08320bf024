/* pie_utf8.h — UTF-8 validation, the one definition every part of Pie-C uses.
 *
 * Owns: deciding whether bytes start with a well-formed UTF-8 sequence (RFC 3629: no overlong
 * forms, no surrogates, nothing above U+10FFFF, no truncated sequence) and decoding it. Used by
 * the tokenizer (byte-level pieces), the config loader (YAML holds only UTF-8) and the gateway
 * (JSON strings). */
#ifndef PIE_UTF8_H
#define PIE_UTF8_H

#include <stddef.h>
#include <stdint.h>

/* Length in bytes (1..4) of the well-formed UTF-8 sequence at s[0..n), with its code point in
 * *cp (cp may be NULL); 0 when s does not start with one (n == 0 included). */
size_t pie_utf8_next(const unsigned char *s, size_t n, uint32_t *cp);

#endif
