/* test_rpc_tls.c — TLS in the RPC layer (issue 15, item 8): a server with a certificate speaks
 * only TLS, a client verifies it against the CA it is given, and mutual TLS refuses clients
 * without a certificate from the client CA.
 *
 * The certificates are made for each run (tests/support/pie_testcerts.h). */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pie_testcerts.h"
#include "test_rpc_util.h"

static char dir[64];
static char *ca, *other_ca, *cert, *key, *ccert, *ckey;

static char *need(const char *name) {
    char *s = pie_test_certs_read(dir, name);
    cr_assert(s, "cannot read %s/%s", dir, name);
    return s;
}

static void setup(void) {
    cr_assert(pie_test_certs_make(dir, sizeof dir), "cannot make the test certificates");
    ca = need("ca.pem");
    other_ca = need("other.pem");
    cert = need("srv.pem");
    key = need("srv.key");
    ccert = need("cli.pem");
    ckey = need("cli.key");
}

static void teardown(void) {
    free(ca);
    free(other_ca);
    free(cert);
    free(key);
    free(ccert);
    free(ckey);
    pie_test_certs_remove(dir);
    TLEAK_CHECK();
}

TestSuite(rpc_tls, .init = setup, .fini = teardown, .timeout = 60);

/* Unary "hello" on 127.0.0.1:port with these channel options: the status (echo checked). */
static pie_code hello(int port, const rpc_channel_opts *co, pie_status *st) {
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", port);
    rpc_channel *ch = rpc_channel_create(target, co, st);
    cr_assert(ch, "%s", st->msg);
    tmsg req = tmsg_of("hello");
    ProtobufCMessage *resp = NULL;
    rpc_call_opts o = {.timeout_ms = 5000};
    pie_code rc = rpc_unary(ch, "/test.Echo/Unary", &req.base, TMSG_DESC, &resp, &o, st);
    if (rc == PIE_OK) cr_expect_str_eq(tmsg_text(resp), "hello");
    rpc_msg_free(resp);
    rpc_channel_destroy(ch);
    return rc;
}

Test(rpc_tls, a_tls_server_answers_clients_that_trust_its_ca_and_no_one_else) {
    pie_status st;
    rpc_server_opts so = {.tls_cert_pem = cert, .tls_key_pem = key};
    tsrv *t = tsrv_start(&so, &st);
    cr_assert(t, "%s", st.msg);
    rpc_channel_opts good = {.tls_ca_pem = ca};
    cr_expect_eq(hello(t->port, &good, &st), PIE_OK, "%s", st.msg);
    rpc_channel_opts wrong = {.tls_ca_pem = other_ca};
    cr_expect_eq(hello(t->port, &wrong, &st), PIE_UNAVAILABLE, "a CA that signed nothing: %s",
                 st.msg);
    cr_expect_eq(hello(t->port, NULL, &st), PIE_UNAVAILABLE, "plaintext to a TLS server: %s",
                 st.msg);
    rpc_health_status hs;
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", t->port);
    rpc_channel *ch = rpc_channel_create(target, &good, &st);
    cr_assert(ch);
    cr_expect_eq(rpc_health_check(ch, "", 5000, &hs, &st), PIE_OK, "health over TLS: %s", st.msg);
    cr_expect_eq(hs, RPC_HEALTH_SERVING);
    rpc_channel_destroy(ch);
    tsrv_stop(t, 1000);
}

Test(rpc_tls, mutual_tls_refuses_clients_without_a_certificate_of_the_client_ca) {
    pie_status st;
    rpc_server_opts so = {.tls_cert_pem = cert, .tls_key_pem = key, .tls_client_ca_pem = ca};
    tsrv *t = tsrv_start(&so, &st);
    cr_assert(t, "%s", st.msg);
    rpc_channel_opts with = {.tls_ca_pem = ca, .tls_cert_pem = ccert, .tls_key_pem = ckey};
    cr_expect_eq(hello(t->port, &with, &st), PIE_OK, "%s", st.msg);
    rpc_channel_opts without = {.tls_ca_pem = ca};
    cr_expect_eq(hello(t->port, &without, &st), PIE_UNAVAILABLE, "no client certificate: %s",
                 st.msg);
    tsrv_stop(t, 1000);
}

Test(rpc_tls, bad_tls_options_are_refused_clearly) {
    pie_status st;
    rpc_server_opts half = {.addr = "127.0.0.1:0", .tls_cert_pem = cert};
    cr_expect_null(rpc_server_create(&half, &st));
    cr_expect(strstr(st.msg, "certificate and its key"), "%s", st.msg);
    rpc_server_opts junk = {.addr = "127.0.0.1:0", .tls_cert_pem = "junk", .tls_key_pem = "junk"};
    rpc_server *srv = rpc_server_create(&junk, &st);
    cr_assert(srv, "%s", st.msg);
    cr_expect_neq(rpc_server_start(srv, &st), PIE_OK, "a server with junk PEM started");
    rpc_server_destroy(srv);
}
