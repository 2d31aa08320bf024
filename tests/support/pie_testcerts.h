/* pie_testcerts.h — throwaway TLS certificates for the tests of TLS (made with the openssl
 * command line, which tools/setup.sh installs).
 *
 * pie_test_certs_make writes into a fresh directory under /tmp:
 *   ca.pem, ca.key       a CA
 *   srv.pem, srv.key     a certificate for 127.0.0.1 and localhost signed by it (servers)
 *   cli.pem, cli.key     a certificate signed by it (mutual TLS clients)
 *   other.pem            an unrelated CA that signed nothing here
 * pie_test_certs_read returns a file's text (malloc'd); pie_test_certs_remove deletes the
 * directory. */
#ifndef PIE_TESTCERTS_H
#define PIE_TESTCERTS_H

#include <stdbool.h>
#include <stddef.h>

/* dir (at least 64 bytes) gets the directory. false (and a message on stderr) on failure. */
bool pie_test_certs_make(char *dir, size_t cap);
char *pie_test_certs_read(const char *dir, const char *name);
/* "<dir>/<name>" into out. */
void pie_test_certs_path(const char *dir, const char *name, char *out, size_t cap);
void pie_test_certs_remove(const char *dir);

#endif
