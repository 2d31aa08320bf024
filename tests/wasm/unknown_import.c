/* unknown_import.c — fixture: imports functions no host provides (pie.no_such_function,
 * env.mystery); loading it must fail and name both. */
__attribute__((import_module("pie"), import_name("no_such_function"))) int no_such_function(int);
__attribute__((import_module("env"), import_name("mystery"))) void mystery(void);

int main(void) {
    mystery();
    return no_such_function(1);
}
