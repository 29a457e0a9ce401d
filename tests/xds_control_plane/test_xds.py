"""An xDS control plane written in Python against a ringlimit node (`serve --envoy-xds`).

The control plane is the Aggregated Discovery Service from Envoy's generated stubs (PyPI
xds-protos: envoy.service.discovery.v3, google.rpc.Status); it serves envoyproxy/ratelimit's
RateLimitConfig resources, state of the world, as Envoy Gateway does. xds-protos does not
ship ratelimit.config.ratelimit.v3 (that proto lives in envoyproxy/ratelimit, not in
data-plane-api), so its stubs are generated at test time by grpcio-tools from ringlimit's
trimmed copy (proto/ratelimit/), whose field numbers are envoyproxy/ratelimit's.

The node is the real binary; every limit is checked through its Envoy RLS face with
xds-protos's RateLimitService client, and its answers to the control plane (ACK, NACK with
error_detail, resubscription) are read by the control plane itself.

Run by .ci/xds-control-plane.sh: python test_xds.py PATH_TO_RINGLIMIT_BINARY
Windows: the node runs `--envoy-algorithm sliding_window_log` with week-long limits, which
have no window boundary a run could straddle.
"""

import itertools
import os
import queue
import subprocess
import sys
import tempfile
import threading
import unittest
import urllib.request
from concurrent import futures

import grpc
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from google.protobuf import any_pb2
from grpc_tools import protoc

BINARY = None
PROTO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "proto")
TYPE_URL = "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig"
OK = rls_pb2.RateLimitResponse.OK
OVER = rls_pb2.RateLimitResponse.OVER_LIMIT
PATIENCE = 20  # seconds any one step may take before the test fails

conf = None  # ratelimit.config.ratelimit.v3, generated in main()


def generate_stubs(out):
    """rls_conf_pb2 from proto/ratelimit/config/ratelimit/v3/rls_conf.proto, into `out`."""
    status = protoc.main([
        "grpc_tools.protoc",
        "-I" + PROTO_DIR,
        "--python_out=" + out,
        "ratelimit/config/ratelimit/v3/rls_conf.proto",
    ])
    if status != 0:
        raise RuntimeError("protoc failed: %d" % status)
    sys.path.insert(0, out)
    global conf
    from ratelimit.config.ratelimit.v3 import rls_conf_pb2
    conf = rls_conf_pb2


def rate_limit_config(name, requests, unit=None):
    """A domain `xds-test` limiting each `api` value to `requests` per `unit` (default week)."""
    return conf.RateLimitConfig(
        name=name,
        domain="xds-test",
        descriptors=[conf.RateLimitDescriptor(
            key="api",
            rate_limit=conf.RateLimitPolicy(
                unit=conf.WEEK if unit is None else unit, requests_per_unit=requests))])


class ControlPlane(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    """Serves the current set on every stream (again when it changes); records requests."""

    def __init__(self):
        self.cond = threading.Condition()
        self.current = None  # (version, [Any])
        self.generation = 0
        self.cuts = 0
        self.nonces = itertools.count(1)
        self.sent = {}  # nonce -> version
        self.requests = queue.Queue()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def push(self, version, configs):
        resources = []
        for c in configs:
            packed = any_pb2.Any()
            packed.Pack(c)
            resources.append(packed)
        with self.cond:
            self.current = (version, resources)
            self.generation += 1
            self.cond.notify_all()

    def cut_streams(self):
        """Ends every open stream with UNAVAILABLE, as a control plane restarting would."""
        with self.cond:
            self.cuts += 1
            self.cond.notify_all()

    def StreamAggregatedResources(self, request_iterator, context):
        def read():
            try:
                for r in request_iterator:
                    self.requests.put(r)
            except grpc.RpcError:
                pass
        threading.Thread(target=read, daemon=True).start()
        sent = 0
        with self.cond:
            cuts = self.cuts
        while context.is_active():
            with self.cond:
                # The timeout only re-checks that the stream is still open.
                self.cond.wait_for(
                    lambda: self.generation != sent or self.cuts != cuts, timeout=0.5)
                if self.cuts != cuts:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "control plane restarting")
                if self.current is None or self.generation == sent:
                    continue
                sent = self.generation
                version, resources = self.current
                nonce = "nonce-%d" % next(self.nonces)
                self.sent[nonce] = version
            yield discovery_pb2.DiscoveryResponse(
                version_info=version, resources=resources, type_url=TYPE_URL, nonce=nonce)

    def answer_to(self, version):
        """The node's ACK or NACK of the response that carried `version`."""
        while True:
            try:
                r = self.requests.get(timeout=PATIENCE)
            except queue.Empty:
                raise AssertionError("the node did not answer version %s" % version)
            with self.cond:
                answered = self.sent.get(r.response_nonce)
            if answered == version:
                return r

    def subscription(self):
        """The next request that opens a stream (no nonce)."""
        while True:
            r = self.requests.get(timeout=PATIENCE)
            if not r.response_nonce:
                return r


class Node:
    """The ringlimit binary on loopback port 0, subscribed to `control_plane`."""

    def __init__(self, port):
        self.dir = tempfile.TemporaryDirectory()
        self.log = open(os.path.join(self.dir.name, "node.log"), "w")
        self.proc = subprocess.Popen(
            [BINARY, "serve", "--node-id", "xds-py-node",
             "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
             "--gossip-listen", "127.0.0.1:0", "--peer-listen", "127.0.0.1:0",
             "--envoy-algorithm", "sliding_window_log",
             "--envoy-xds", "127.0.0.1:%d" % port],
            stdout=subprocess.PIPE, stderr=self.log, stdin=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()
        fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        if "grpc" not in fields:
            self.stop()
            raise RuntimeError("no ready line: %r (log: %s)" % (line, self.log_text()))
        self.http = fields["http"]
        self.channel = grpc.insecure_channel(fields["grpc"])
        self.rls = rls_pb2_grpc.RateLimitServiceStub(self.channel)

    def log_text(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-3000:]

    def admitted(self, value, n):
        """How many of `n` requests for api=`value` in domain xds-test were OK."""
        d = ratelimit_pb2.RateLimitDescriptor(
            entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key="api", value=value)])
        codes = [self.rls.ShouldRateLimit(
            rls_pb2.RateLimitRequest(domain="xds-test", descriptors=[d]), timeout=5).overall_code
            for _ in range(n)]
        return codes.count(OK)

    def metric(self, series):
        with urllib.request.urlopen("http://%s/metrics" % self.http, timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(series + " "):
                    return float(line.split()[-1])
        return 0.0

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        self.dir.cleanup()


class XdsTest(unittest.TestCase):
    def setUp(self):
        self.cp = ControlPlane()
        self.node = Node(self.cp.port)

    def tearDown(self):
        self.node.channel.close()
        self.node.stop()
        self.cp.server.stop(None)

    def test_apply_nack_keep_then_apply_and_resubscribe(self):
        try:
            self.apply_nack_keep_then_apply_and_resubscribe()
        except Exception:
            print("node log (last lines):\n" + self.node.log_text(), file=sys.stderr)
            raise

    def apply_nack_keep_then_apply_and_resubscribe(self):
        cp, node = self.cp, self.node
        first = cp.subscription()
        self.assertEqual(first.type_url, TYPE_URL)
        self.assertEqual((first.version_info, first.response_nonce), ("", ""))
        self.assertEqual((first.node.id, first.node.cluster), ("xds-py-node", "ringlimit"))

        # A good set: ACKed (after it is enforced), and enforced.
        cp.push("1", [rate_limit_config("xds-test", 3)])
        ack = cp.answer_to("1")
        self.assertEqual(ack.version_info, "1")
        self.assertFalse(ack.HasField("error_detail"))
        self.assertEqual(node.admitted("a", 5), 3)

        # A bad set: MONTH is refused as in a YAML file. NACKed with the reason, and the
        # version still held; the old limits stay enforced.
        cp.push("2", [rate_limit_config("xds-test", 10, unit=conf.MONTH)])
        nack = cp.answer_to("2")
        self.assertTrue(nack.HasField("error_detail"), nack)
        self.assertEqual(nack.version_info, "1")
        self.assertEqual(nack.error_detail.code, 3)  # INVALID_ARGUMENT
        message = nack.error_detail.message
        print("NACK error_detail: " + message)
        for part in ('version "2"', 'resources[0] (name "xds-test")',
                     "descriptors[0].rate_limit.unit", "at most 7 days"):
            self.assertIn(part, message)
        self.assertEqual(node.admitted("b", 5), 3, "version 1 still enforced")

        # The next good set is applied.
        cp.push("3", [rate_limit_config("xds-test", 5)])
        ack = cp.answer_to("3")
        self.assertFalse(ack.HasField("error_detail"))
        self.assertEqual(node.admitted("c", 7), 5)

        # The stream cut: the node subscribes again naming version 3, is sent version 3
        # again, ACKs it, and enforces it all along.
        cp.cut_streams()
        again = cp.subscription()
        self.assertEqual(again.version_info, "3")
        self.assertEqual(node.admitted("d", 7), 5)
        self.assertFalse(cp.answer_to("3").HasField("error_detail"))

        self.assertGreaterEqual(
            node.metric('ringlimit_envoy_xds_updates_total{result="accepted"}'), 3)
        self.assertEqual(node.metric('ringlimit_envoy_xds_updates_total{result="rejected"}'), 1)
        self.assertEqual(node.metric("ringlimit_envoy_xds_connected"), 1)
        self.assertGreaterEqual(node.metric("ringlimit_envoy_xds_stream_failures_total"), 1)


def main():
    global BINARY
    if len(sys.argv) != 2:
        sys.exit("usage: test_xds.py PATH_TO_RINGLIMIT_BINARY")
    BINARY = os.path.abspath(sys.argv[1])
    with tempfile.TemporaryDirectory() as stubs:
        generate_stubs(stubs)
        suite = unittest.defaultTestLoader.loadTestsFromTestCase(XdsTest)
        result = unittest.TextTestRunner(verbosity=2).run(suite)
    failed = len(result.failures) + len(result.errors)
    print("xds control plane: %d passed, %d failed" % (result.testsRun - failed, failed))
    sys.exit(1 if failed or not result.testsRun else 0)


if __name__ == "__main__":
    main()
