/* rpc_reflect.h — gRPC server reflection, so grpcurl and other tools need no .proto files.
 *
 * Owns: an index of a serialized FileDescriptorSet (each file's bytes, its name and imports,
 * and the fully qualified symbols it defines: packages' messages, nested messages, enums,
 * services and their methods) and the bidi method ServerReflectionInfo of
 * grpc.reflection.v1alpha.ServerReflection and of grpc.reflection.v1 (same messages on the
 * wire): list_services, file_by_filename and file_containing_symbol answer with the file and
 * every file it imports, transitively; extensions get NOT_FOUND (the contracts define none).
 * Does not own: the descriptor set (proto/pie_desc.h compiles it in), which services a server
 * serves (the caller names them). */
#ifndef RPC_REFLECT_H
#define RPC_REFLECT_H

#include <stddef.h>
#include <stdint.h>

#include "pie_status.h"
#include "rpc.h"

typedef struct rpc_reflect rpc_reflect;

/* Indexes set[0..len) (borrowed: it must outlive the index) and remembers the names of the
 * services to list (copied). INVALID_ARGUMENT when the bytes are not a FileDescriptorSet. */
rpc_reflect *rpc_reflect_create(const uint8_t *set, size_t len, const char *const *services,
                                size_t n_services, pie_status *st);
void rpc_reflect_destroy(rpc_reflect *r);

/* The two method entries (v1alpha and v1) to add to a server; out[2]. r must outlive the
 * server. */
void rpc_reflect_methods(rpc_reflect *r, rpc_method out[2]);

/* The file that defines symbol (e.g. "pie.v1.Lifecycle", "pie.v1.Lifecycle.Run",
 * "pie.v1.RunRequest"), or NULL. For tests and tools. */
const char *rpc_reflect_file_of(const rpc_reflect *r, const char *symbol);

#endif
