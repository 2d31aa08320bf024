/* krn_simd.c — the run-time choice of SIMD path for every CPU kernel.
 *
 * Owns: probing the CPU once (__builtin_cpu_supports), the PIE_KRN_SIMD override
 * (scalar|avx2|avx512, read once), krn_cpu_simd_name and krn_cpu_set_simd (tests force each
 * path on one machine).
 * Does not own: the kernels themselves; each kernel file switches on krn_simd_level(). */
#include "krn_cpu_impl.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Global on purpose: the dispatch choice is a property of the process, made once from the CPU
 * and the environment (pthread_once) and changed only by krn_cpu_set_simd, which tests call
 * between kernel calls. Atomic so that a change never races with a kernel reading it. */
static pthread_once_t g_simd_once = PTHREAD_ONCE_INIT;
static atomic_int g_simd_best;  /* what the CPU supports */
static atomic_int g_simd_level; /* what kernels use */

static krn_simd probe_cpu(void) {
#if KRN_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") &&
        __builtin_cpu_supports("fma"))
        return KRN_SIMD_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        return KRN_SIMD_AVX2;
#endif
    return KRN_SIMD_SCALAR;
}

static int parse_level(const char *s, krn_simd *out) {
    if (strcmp(s, "scalar") == 0)
        *out = KRN_SIMD_SCALAR;
    else if (strcmp(s, "avx2") == 0)
        *out = KRN_SIMD_AVX2;
    else if (strcmp(s, "avx512") == 0)
        *out = KRN_SIMD_AVX512;
    else
        return -1;
    return 0;
}

static void simd_init(void) {
    krn_simd best = probe_cpu();
    atomic_store(&g_simd_best, (int)best);
    krn_simd level = best;
    const char *env = getenv("PIE_KRN_SIMD");
    if (env && *env) {
        krn_simd want;
        if (parse_level(env, &want) != 0)
            fprintf(stderr,
                    "krn_cpu: PIE_KRN_SIMD=%s is not one of scalar, avx2, avx512; using %s\n", env,
                    best == KRN_SIMD_AVX512 ? "avx512"
                    : best == KRN_SIMD_AVX2 ? "avx2"
                                            : "scalar");
        else if (want > best)
            fprintf(
                stderr,
                "krn_cpu: PIE_KRN_SIMD=%s is not supported by this CPU; using the best it has\n",
                env);
        else
            level = want;
    }
    atomic_store(&g_simd_level, (int)level);
}

krn_simd krn_simd_level(void) {
    pthread_once(&g_simd_once, simd_init);
    return (krn_simd)atomic_load_explicit(&g_simd_level, memory_order_relaxed);
}

const char *krn_cpu_simd_name(void) {
    switch (krn_simd_level()) {
    case KRN_SIMD_AVX512: return "avx512";
    case KRN_SIMD_AVX2: return "avx2";
    default: return "scalar";
    }
}

int krn_cpu_set_simd(const char *name) {
    pthread_once(&g_simd_once, simd_init);
    krn_simd want;
    if (!name || parse_level(name, &want) != 0 || (int)want > atomic_load(&g_simd_best)) return -1;
    atomic_store(&g_simd_level, (int)want);
    return 0;
}
