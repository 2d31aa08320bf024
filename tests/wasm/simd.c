/* simd.c — fixture: uses wasm SIMD (-msimd128), which wasm2c 1.0.32 cannot translate; loading it
 * must fail with a clear reason, not crash or hang. */
#include <stdio.h>
#include <stdlib.h>
#include <wasm_simd128.h>

int main(int argc, char **argv) {
    v128_t a = wasm_i32x4_make(argc, atoi(argv[0]), 3, 4);
    for (int i = 0; i < argc * 100; i++) a = wasm_i32x4_mul(a, a);
    printf("%d\n", wasm_i32x4_extract_lane(a, 1));
    return 0;
}
