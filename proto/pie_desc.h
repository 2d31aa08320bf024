/* pie_desc.h — the wire contracts as a serialized google.protobuf.FileDescriptorSet.
 *
 * pie.v1, grpc.health.v1 and grpc.reflection.v1alpha with their imports and source info, as
 * `protoc --include_imports --include_source_info` writes it (build/proto/pie.desc), compiled in
 * by proto/embed.cmake. Served by gRPC server reflection (services/common/rpc/rpc_reflect.h). */
#ifndef PIE_DESC_H
#define PIE_DESC_H

#include <stddef.h>

extern const unsigned char pie_proto_descriptor_set[];
extern const size_t pie_proto_descriptor_set_len;

#endif
