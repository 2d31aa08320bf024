"""gRPC server reflection (services/common/rpc/rpc_reflect.c), used the way grpcurl uses it: a
client that has no .proto files lists a real service's services, fetches the file defining a
symbol with its imports, rebuilds the descriptors from them alone and finds every method and
message the build's own descriptor set has. Both grpc.reflection.v1alpha and v1 are served."""
import os
import unittest

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

import pie_cluster

DESC = os.path.join(pie_cluster.BIN_DIR, "..", "proto", "pie.desc")
PATHS = ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
         "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo")


def build_pool(files):
    """A descriptor pool from serialized FileDescriptorProtos in any order (imports first)."""
    protos = {p.name: p for p in (descriptor_pb2.FileDescriptorProto.FromString(b) for b in files)}
    pool, added = descriptor_pool.DescriptorPool(), set()

    def add(name):
        if name in added:
            return
        for dep in protos[name].dependency:
            add(dep)
        pool.Add(protos[name])
        added.add(name)

    for name in protos:
        add(name)
    return pool


class Reflection(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(DESC, "rb") as f:
            cls.reference = descriptor_pb2.FileDescriptorSet.FromString(f.read())
        # The reflection messages, from the build's descriptor set (no generated Python).
        pool = build_pool([f.SerializeToString() for f in cls.reference.file])
        factory = message_factory.MessageFactory(pool)
        cls.Req = factory.GetPrototype(
            pool.FindMessageTypeByName("grpc.reflection.v1alpha.ServerReflectionRequest"))
        cls.Resp = factory.GetPrototype(
            pool.FindMessageTypeByName("grpc.reflection.v1alpha.ServerReflectionResponse"))
        cls.controller = pie_cluster.Service("controller")
        cls.channel = grpc.insecure_channel(cls.controller.addr)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        assert cls.controller.stop() == 0

    def ask(self, path=PATHS[0], **request):
        call = self.channel.stream_stream(path, request_serializer=self.Req.SerializeToString,
                                          response_deserializer=self.Resp.FromString)
        return list(call(iter([self.Req(host="h", **request)]), timeout=10))[0]

    def test_lists_the_services_the_server_serves(self):
        for path in PATHS:
            resp = self.ask(path, list_services="")
            names = {s.name for s in resp.list_services_response.service}
            self.assertIn("pie.v1.Controller", names, path)
            self.assertIn("grpc.health.v1.Health", names, path)
            self.assertIn("grpc.reflection.v1alpha.ServerReflection", names, path)
            self.assertNotIn("pie.v1.Lifecycle", names, "a controller does not serve it")
            self.assertEqual(resp.valid_host, "h")
            self.assertEqual(resp.original_request.list_services, "")

    def test_a_client_without_protos_rebuilds_the_service_from_reflection(self):
        resp = self.ask(file_containing_symbol="pie.v1.Controller")
        files = resp.file_descriptor_response.file_descriptor_proto
        pool = build_pool(files)
        svc = pool.FindServiceByName("pie.v1.Controller")
        ref = build_pool([f.SerializeToString() for f in self.reference.file])
        want = ref.FindServiceByName("pie.v1.Controller")
        self.assertEqual([m.name for m in svc.methods], [m.name for m in want.methods])
        for m in svc.methods:  # every request and response type resolved, fields and all
            wm = want.methods_by_name[m.name]
            self.assertEqual([f.name for f in m.input_type.fields],
                             [f.name for f in wm.input_type.fields], m.name)
            self.assertEqual(m.output_type.full_name, wm.output_type.full_name)

    def test_symbols_of_every_kind_and_files_by_name(self):
        for symbol, file in (("pie.v1.Controller.Session", "pie/v1/controller.proto"),
                             ("pie.v1.ModelInfo", "pie/v1/common.proto"),
                             ("pie.v1.Lifecycle", "pie/v1/lifecycle.proto"),
                             ("grpc.health.v1.HealthCheckResponse.ServingStatus",
                              "grpc/health/v1/health.proto")):
            resp = self.ask(file_containing_symbol=symbol)
            first = descriptor_pb2.FileDescriptorProto.FromString(
                resp.file_descriptor_response.file_descriptor_proto[0])
            self.assertEqual(first.name, file, symbol)
        resp = self.ask(PATHS[1], file_by_filename="pie/v1/lifecycle.proto")
        names = [descriptor_pb2.FileDescriptorProto.FromString(b).name
                 for b in resp.file_descriptor_response.file_descriptor_proto]
        self.assertEqual(names[0], "pie/v1/lifecycle.proto")
        self.assertIn("pie/v1/common.proto", names, "imports come along")
        self.assertEqual(len(names), len(set(names)), "each file once")

    def test_unknown_names_are_not_found(self):
        for request in ({"file_containing_symbol": "pie.v1.Nope"},
                        {"file_by_filename": "nope.proto"},
                        {"all_extension_numbers_of_type": "pie.v1.ModelInfo"}):
            resp = self.ask(**request)
            self.assertEqual(resp.error_response.error_code, grpc.StatusCode.NOT_FOUND.value[0],
                             request)


if __name__ == "__main__":
    unittest.main()
