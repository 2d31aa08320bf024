/* pie_testcerts.c — see pie_testcerts.h. */
#include "pie_testcerts.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static bool sh(const char *dir, const char *cmd) {
    char full[2048];
    snprintf(full, sizeof full, "cd '%s' && (%s) >/dev/null 2>&1", dir, cmd);
    if (system(full) == 0) return true;
    fprintf(stderr, "pie_testcerts: failed: %s\n", cmd);
    return false;
}

bool pie_test_certs_make(char *dir, size_t cap) {
    snprintf(dir, cap, "/tmp/pie-certs-XXXXXX");
    if (mkdtemp(dir) == NULL) return false;
    return sh(dir, "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=pie-test-ca "
                   "-keyout ca.key -out ca.pem") &&
           sh(dir, "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=other-ca "
                   "-keyout other.key -out other.pem") &&
           sh(dir, "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > san.ext && "
                   "openssl req -newkey rsa:2048 -nodes -subj /CN=localhost -keyout srv.key "
                   "-out srv.csr && openssl x509 -req -in srv.csr -CA ca.pem -CAkey ca.key "
                   "-CAcreateserial -days 2 -extfile san.ext -out srv.pem") &&
           sh(dir, "openssl req -newkey rsa:2048 -nodes -subj /CN=pie-client -keyout cli.key "
                   "-out cli.csr && openssl x509 -req -in cli.csr -CA ca.pem -CAkey ca.key "
                   "-CAcreateserial -days 2 -out cli.pem");
}

void pie_test_certs_path(const char *dir, const char *name, char *out, size_t cap) {
    snprintf(out, cap, "%s/%s", dir, name);
}

char *pie_test_certs_read(const char *dir, const char *name) {
    char path[256];
    pie_test_certs_path(dir, name, path, sizeof path);
    FILE *f = fopen(path, "r");
    if (f == NULL) return NULL;
    char *buf = malloc(16384);
    size_t n = buf ? fread(buf, 1, 16383, f) : 0;
    fclose(f);
    if (buf) buf[n] = '\0';
    return buf;
}

void pie_test_certs_remove(const char *dir) {
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "pie_testcerts: could not remove %s\n", dir);
}
