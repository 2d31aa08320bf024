/* hello.c — fixture: writes to stdout and stderr, reads args and environment, calls the test
 * host function pie.test_add, and exits with the code given as its second argument. */
#include <stdio.h>
#include <stdlib.h>

__attribute__((import_module("pie"), import_name("test_add"))) int pie_test_add(int a, int b);

int main(int argc, char **argv) {
    printf("hello, %s!\n", argc > 1 ? argv[1] : "world");
    printf("argc=%d", argc);
    for (int i = 0; i < argc; i++) printf(" [%s]", argv[i]);
    printf("\n40+2=%d\n", pie_test_add(40, 2));
    const char *g = getenv("PIE_GREETING");
    printf("env=%s\n", g ? g : "(unset)");
    fprintf(stderr, "to stderr\n");
    return argc > 2 ? atoi(argv[2]) : 0;
}
