/* pie_sha256.c — see pie_sha256.h. */
#include "pie_sha256.h"

#include <openssl/evp.h>

pie_code pie_sha256_hex(const void *data, size_t len, char hex[65], pie_status *st) {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int md_len = 0;
    hex[0] = '\0';
    if (EVP_Digest(data, len, md, &md_len, EVP_sha256(), NULL) != 1 || md_len != 32)
        return pie_status_set(st, PIE_INTERNAL, "sha256: OpenSSL EVP_Digest failed");
    static const char digits[] = "0123456789abcdef";
    for (unsigned i = 0; i < 32; i++) {
        hex[2 * i] = digits[md[i] >> 4];
        hex[2 * i + 1] = digits[md[i] & 15];
    }
    hex[64] = '\0';
    return PIE_OK;
}

bool pie_sha256_is_hex(const char *s) {
    if (s == NULL) return false;
    for (int i = 0; i < 64; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f'))) return false;
    return s[64] == '\0';
}
