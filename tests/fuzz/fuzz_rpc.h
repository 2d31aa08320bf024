/* fuzz_rpc.h — an in-process stand-in for the server half of services/common/rpc, so that a
 * harness drives a service's real method table (ctl_cluster_methods, lc_api_methods) call by
 * call, with the same decode and the same callback order as rpc_server.c, but no gRPC.
 *
 * Owns: fake rpc_call objects and the rpc_call_* functions handlers call (linked instead of
 * rpc_server.c: a harness that links this never pulls rpc_server.o out of libpie_rpc.a, so
 * every public function of rpc_server.c must be defined here too; a new one shows up as
 * "multiple definition of rpc_call_..." at link time); the driver below, which turns fuzz
 * records into on_call / on_message / on_half_close / on_cancel / on_done exactly as
 * rpc_server.c would: a request is unpacked with protobuf_c_message_unpack
 * and the method's request descriptor (rpc__unpack); an unparseable unary request finishes
 * INVALID_ARGUMENT without reaching the handler, an unparseable stream message cancels the call
 * INVALID_ARGUMENT; messages after the handler finished are dropped; on_cancel (once) and
 * on_done follow when the call is over.
 * Checks on the handler (a violation aborts: a finding): every message it sends is of the
 * method's response type and packs; a unary or client-streaming call is answered within 10 s of
 * its last request message (the driver waits for it, as a client would, before the next
 * record). */
#ifndef PIE_FUZZ_RPC_H
#define PIE_FUZZ_RPC_H

#include <stddef.h>
#include <stdint.h>

#include "rpc.h"

#define FZ_RPC_SLOTS 4 /* calls open at once */

typedef struct fz_rpc fz_rpc;

fz_rpc *fz_rpc_create(const rpc_method *methods, size_t n_methods);
/* Feeds one input: a sequence of records [op][len lo][len hi][len bytes] (a short last record
 * takes what is left). op & 7: 0 open a call of method payload[0] % n_methods in slot
 * (op >> 3) % FZ_RPC_SLOTS (unary / server-streaming: payload[1..] is the request), 1 a
 * message on the slot's stream, 2 half-close, 3 client cancel (deadline, lost connection),
 * 4..6 open as 0, 7 too unless fz_rpc_on_event set a handler (messages and half-closes after a
 * half-close are dropped: a gRPC client cannot send them). Then every call still open is cancelled
 * by its client. */
void fz_rpc_feed(fz_rpc *f, const uint8_t *data, size_t size);
/* Something the service does on its own between two records (a status change, a timer): with
 * a handler set, op 7 calls it with the record's payload instead of opening a call. */
typedef void (*fz_rpc_event_fn)(void *user, const uint8_t *payload, size_t n);
void fz_rpc_on_event(fz_rpc *f, fz_rpc_event_fn fn, void *user);
/* Frees f (fz_rpc_feed has ended every call; a handler thread may still hold a reference to
 * one, which it drops itself). */
void fz_rpc_destroy(fz_rpc *f);

#endif
