/* numeric.c — fixture: integer bit operations (clz, ctz, popcount, rotations, 64-bit division)
 * on edge values, printed one line per value. The test compares tier 0 (tcc, whose missing
 * builtins lc_wasm supplies) and tier 1 (cc) with the same computation done natively. */
#include <stdint.h>
#include <stdio.h>

static volatile uint64_t vals[] = {1,
                                   2,
                                   3,
                                   0x80000000u,
                                   0xffffffffu,
                                   0x100000000ull,
                                   0x8000000000000000ull,
                                   0x0123456789abcdefull,
                                   0xfedcba9876543210ull,
                                   0};

int main(void) {
    for (unsigned i = 0; i < sizeof vals / sizeof vals[0]; i++) {
        uint64_t v = vals[i];
        uint32_t w = (uint32_t)v, r = (uint32_t)(i * 5 + 1);
        printf("%016llx %d %d %d %d %d %d %08x %016llx %lld %lld\n", (unsigned long long)v,
               w ? __builtin_clz(w) : 32, w ? __builtin_ctz(w) : 32, __builtin_popcount(w),
               v ? __builtin_clzll(v) : 64, v ? __builtin_ctzll(v) : 64, __builtin_popcountll(v),
               (w << (r & 31)) | (w >> ((32 - r) & 31)),
               (unsigned long long)((v >> (r & 63)) | (v << ((64 - r) & 63))),
               (long long)((int64_t)v / (int64_t)(r | 3)), (long long)((int64_t)v % 7));
    }
    return 0;
}
