/* piectl.h — what the files of piectl share: options, dialling, a unary call. */
#ifndef PIECTL_H
#define PIECTL_H

#include <stdint.h>

#include "rpc.h"

#define PIECTL_MAX_ADDRS 32

typedef struct piectl_opts {
    const char *addrs[PIECTL_MAX_ADDRS];
    int n_addrs;
    const char *service; /* health: service name ("" = overall) */
    const char *token;   /* --token or PIE_TOKEN */
    char *tls_ca_pem;    /* --tls-ca FILE or PIE_TLS_CA: TLS to the services (NULL: plaintext) */
    int64_t timeout_ms;  /* per call */
    int64_t wait_ms;     /* health: keep retrying until SERVING or this much time passed */
} piectl_opts;

int64_t piectl_now_ms(void);
rpc_channel *piectl_dial(const piectl_opts *o, const char *addr, pie_status *st);
/* One unary call to --addr (or default_addr); prints the error and returns 1 on failure. */
int piectl_unary(const piectl_opts *o, const char *default_addr, const char *path,
                 const ProtobufCMessage *req, const ProtobufCMessageDescriptor *rd,
                 ProtobufCMessage **resp);
/* The lifecycle commands (piectl_lc.c): the exit status, or -1 if cmd is not one of them. */
int piectl_lc_command(const piectl_opts *o, const char *cmd, int argc, char **argv);

#endif
