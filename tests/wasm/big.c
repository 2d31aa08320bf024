/* big.c — fixture for the cold-load benchmark: ~200 KB inferlets. big.wasm is linked with
 * --strip-debug, so its ~200 KB are all code and data (formatted I/O with floats, scanf, sorting,
 * time formatting, and 390 small generated functions); big_dwarf.wasm (-DBIG_WITH_DWARF, 10
 * of them) keeps the DWARF sections that clang + wasi-libc emit by default, so ~200 KB of which
 * most is debug info, like the printf-level modules of docs and notes. Prints one line that
 * depends on all of it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define F(n)                                                                                      \
    __attribute__((noinline)) static double f##n(double x, int k) {                               \
        double acc = x;                                                                           \
        for (int i = 0; i < k; i++) {                                                             \
            switch ((i * (n + 7)) % 5) {                                                          \
            case 0: acc = acc * (1.0 + 1.0 / (n + 1 + i)) - (double)(i % (n + 3)); break;         \
            case 1: acc = acc / (2.0 + (double)((n * i) % 11)) + (double)(n % 13); break;         \
            case 2: acc += (double)((unsigned)(acc * 1000.0) % (unsigned)(n + 17)); break;        \
            case 3: acc -= (double)(((long long)acc ^ (n * 2654435761u)) & 1023) / 1024.0; break; \
            default: acc = acc * 0.5 + (double)k; break;                                          \
            }                                                                                     \
        }                                                                                         \
        return acc;                                                                               \
    }
#define F10(n) F(n##0) F(n##1) F(n##2) F(n##3) F(n##4) F(n##5) F(n##6) F(n##7) F(n##8) F(n##9)
#define C(n)   s += f##n(s, k);
#define C10(n) C(n##0) C(n##1) C(n##2) C(n##3) C(n##4) C(n##5) C(n##6) C(n##7) C(n##8) C(n##9)
F10(1)
#ifndef BIG_WITH_DWARF
F10(2)
F10(3) F10(4) F10(5) F10(6) F10(7) F10(8) F10(9) F10(10) F10(11) F10(12) F10(13) F10(14) F10(15)
    F10(16) F10(17) F10(18) F10(19) F10(20) F10(21) F10(22) F10(23) F10(24) F10(25) F10(26) F10(27)
        F10(28) F10(29) F10(30) F10(31) F10(32) F10(33) F10(34) F10(35) F10(36) F10(37) F10(38)
            F10(39)
#endif

                static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int k = argc > 1 ? atoi(argv[1]) : 3;
    double s = 1.0;
    C10(1)
#ifndef BIG_WITH_DWARF
    C10(2)
    C10(3) C10(4) C10(5) C10(6) C10(7) C10(8) C10(9) C10(10) C10(11) C10(12) C10(13) C10(14) C10(15)
        C10(16) C10(17) C10(18) C10(19) C10(20) C10(21) C10(22) C10(23) C10(24) C10(25) C10(26)
            C10(27) C10(28) C10(29) C10(30) C10(31) C10(32) C10(33) C10(34) C10(35) C10(36) C10(37)
                C10(38) C10(39)
#endif
                    double v[64];
    for (int i = 0; i < 64; i++) v[i] = strtod("3.25e-1", NULL) * (i * 37 % 64);
    qsort(v, 64, sizeof v[0], cmp);
    char buf[128];
    time_t t = 86400 * 365;
    strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", gmtime(&t));
    int a = 0;
    float f = 0;
    sscanf("12 3.5", "%d %f", &a, &f);
    printf("%s %g %e %.3f %d %f %lx\n", buf, s, v[63], v[1], a, f, (unsigned long)strlen(buf));
    return 0;
}
