"""Cross-language check of the wire contract: Python grpcio stubs generated from proto/ call
health and one method of each of the three real services (started on loopback)."""
import time
import unittest

import grpc

import health_pb2
import health_pb2_grpc
from pie.v1 import controller_pb2, controller_pb2_grpc, lifecycle_pb2, lifecycle_pb2_grpc
from pie.v1 import worker_pb2, worker_pb2_grpc

import pie_cluster

TOKEN = "s3cret-token"
AUTH = (("authorization", "Bearer " + TOKEN),)


def wait_for(pred, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class ServicesFromPython(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cluster = pie_cluster.Cluster(token=TOKEN)
        cls.channels = {s.name: grpc.insecure_channel(s.addr) for s in cls.cluster.services()}

    @classmethod
    def tearDownClass(cls):
        for ch in cls.channels.values():
            ch.close()
        codes = cls.cluster.stop()
        assert codes == {"lifecycle": 0, "worker": 0, "controller": 0}, codes

    def test_health_serving_on_all_three(self):
        for name, service in (("controller", "pie.v1.Controller"), ("worker", "pie.v1.Worker"),
                              ("lifecycle", "pie.v1.Lifecycle")):
            stub = health_pb2_grpc.HealthStub(self.channels[name])
            for svc in ("", service):
                resp = stub.Check(health_pb2.HealthCheckRequest(service=svc), timeout=5)
                self.assertEqual(resp.status, health_pb2.HealthCheckResponse.SERVING, (name, svc))

    def test_health_unknown_service_is_not_found(self):
        stub = health_pb2_grpc.HealthStub(self.channels["controller"])
        with self.assertRaises(grpc.RpcError) as cm:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.NOT_FOUND)

    def test_controller_cluster_status_lists_worker_and_replica(self):
        stub = controller_pb2_grpc.ControllerStub(self.channels["controller"])

        def linked():
            r = stub.ClusterStatus(controller_pb2.ClusterStatusRequest(), metadata=AUTH, timeout=5)
            return r if len(r.workers) == 1 and len(r.replicas) == 1 else None

        r = wait_for(linked, what="worker and replica to link")
        self.assertTrue(r.version.startswith("pie-c/"))
        self.assertEqual(r.workers[0].model, "tiny")
        self.assertEqual(r.workers[0].capacity.kv_pages_max, 1024)
        self.assertEqual(r.workers[0].tp_size, 1)
        self.assertEqual([m.info.name for m in r.models], ["tiny"])

    def test_lifecycle_list_models_reports_the_workers_model(self):
        stub = lifecycle_pb2_grpc.LifecycleStub(self.channels["lifecycle"])

        def models():
            r = stub.ListModels(lifecycle_pb2.ListModelsRequest(), metadata=AUTH, timeout=5)
            return r.models or None

        models = wait_for(models, what="ListModels to report the model")
        self.assertEqual([m.name for m in models], ["tiny"])
        self.assertEqual(models[0].kv_page_size, 16)

    def test_worker_info(self):
        stub = worker_pb2_grpc.WorkerStub(self.channels["worker"])
        r = stub.Info(worker_pb2.InfoRequest(), metadata=AUTH, timeout=5)
        self.assertEqual(r.rank, 0)
        self.assertEqual(r.tp_size, 1)
        self.assertEqual(r.state, worker_pb2.LOAD_STATE_READY)
        self.assertEqual(r.model.name, "tiny")

    def test_missing_or_wrong_token_is_unauthenticated(self):
        stub = controller_pb2_grpc.ControllerStub(self.channels["controller"])
        for md in ((), (("authorization", "Bearer wrong"),)):
            with self.assertRaises(grpc.RpcError) as cm:
                stub.ClusterStatus(controller_pb2.ClusterStatusRequest(), metadata=md, timeout=5)
            self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAUTHENTICATED)

    def test_unimplemented_method_answers_at_once(self):
        # A method no service defines (every Lifecycle method is implemented now).
        call = self.channels["lifecycle"].unary_unary(
            "/pie.v1.Lifecycle/NoSuchMethod",
            request_serializer=lifecycle_pb2.ListProgramsRequest.SerializeToString,
            response_deserializer=lifecycle_pb2.ListProgramsResponse.FromString)
        with self.assertRaises(grpc.RpcError) as cm:
            call(lifecycle_pb2.ListProgramsRequest(), metadata=AUTH, timeout=5)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.UNIMPLEMENTED)


if __name__ == "__main__":
    unittest.main()
