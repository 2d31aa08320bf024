/* host_calls.c — fixture for host calls. argv[1] selects:
 *   calls N  call pie.test_add N times (benchmark of the wasm → host round trip)
 *   park     block in pie.test_park until the host releases it, then print "unparked"
 *   fail     call pie.test_fail, which ends the instance from the host side */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

__attribute__((import_module("pie"), import_name("test_add"))) int pie_test_add(int a, int b);
__attribute__((import_module("pie"), import_name("test_park"))) void pie_test_park(void);
__attribute__((import_module("pie"), import_name("test_fail"))) void pie_test_fail(int code);

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "";
    if (strcmp(mode, "calls") == 0) {
        long n = argc > 2 ? atol(argv[2]) : 1000;
        int acc = 0;
        for (long i = 0; i < n; i++) acc = pie_test_add(acc, (int)i);
        printf("acc=%d\n", acc);
    } else if (strcmp(mode, "park") == 0) {
        pie_test_park();
        printf("unparked\n");
    } else if (strcmp(mode, "fail") == 0) {
        pie_test_fail(17);
        printf("not reached\n");
    } else {
        fprintf(stderr, "unknown mode %s\n", mode);
        return 2;
    }
    return 0;
}
