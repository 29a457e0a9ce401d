"""TLS on the public face, driven by the stock Python gRPC client (grpcio, BoringSSL).

Certificates are made with the openssl commands docs/security.md gives (a CA, a server
certificate for localhost and 127.0.0.1, client certificates of a client CA and of a
stranger CA). Stubs for ringlimit.v1 are generated at test time by grpcio-tools from
proto/ringlimit.proto. Two `ringlimit serve` processes: one with --tls-cert/--tls-key,
one that also requires client certificates (--tls-client-ca).

Run by .ci/tls-client.sh: python test_tls.py PATH_TO_RINGLIMIT_BINARY
"""

import os
import subprocess
import sys
import tempfile
import unittest

import grpc
from grpc_tools import protoc

BINARY = None
PROTO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "proto")
# An empty grpc.health.v1.HealthCheckRequest, and SERVING (field 1 = 1) in the answer.
HEALTH = "/grpc.health.v1.Health/Check"
SERVING = b"\x08\x01"

pb = None
pb_grpc = None


def generate_stubs(out):
    """ringlimit_pb2 and ringlimit_pb2_grpc from proto/ringlimit.proto, into `out`."""
    status = protoc.main([
        "grpc_tools.protoc", "-I" + PROTO_DIR, "--python_out=" + out,
        "--grpc_python_out=" + out, "ringlimit.proto",
    ])
    if status != 0:
        raise RuntimeError("protoc failed: %d" % status)
    sys.path.insert(0, out)
    global pb, pb_grpc
    import ringlimit_pb2
    import ringlimit_pb2_grpc
    pb, pb_grpc = ringlimit_pb2, ringlimit_pb2_grpc


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(d, name):
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-days", "2", "-subj", "/CN=" + name, "-keyout", name + ".key", "-out",
            name + ".pem", cwd=d)


def make_leaf(d, ca, name, san):
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-subj", "/CN=" + name, "-keyout", name + ".key", "-out", name + ".csr", cwd=d)
    ext = os.path.join(d, name + ".ext")
    with open(ext, "w") as f:
        f.write("subjectAltName=" + san + "\n")
    openssl("x509", "-req", "-in", name + ".csr", "-CA", ca + ".pem", "-CAkey", ca + ".key",
            "-days", "2", "-extfile", ext, "-out", name + ".pem", cwd=d)


def read(d, name):
    with open(os.path.join(d, name), "rb") as f:
        return f.read()


class Node:
    """One `ringlimit serve` process on loopback port 0 with `tls_args`."""

    def __init__(self, node_id, workdir, tls_args):
        self.log = open(os.path.join(workdir, node_id + ".log"), "w")
        args = [BINARY, "serve", "--node-id", node_id,
                "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
                "--gossip-listen", "127.0.0.1:0", "--peer-listen", "127.0.0.1:0"] + tls_args
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self.log,
                                     stdin=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()
        fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        if "grpc" not in fields:
            self.stop()
            raise RuntimeError("%s: no ready line: %r" % (node_id, line))
        self.grpc = fields["grpc"]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class PublicTls(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.TemporaryDirectory()
        d = cls.dir.name
        generate_stubs(d)
        make_ca(d, "server-ca")
        make_leaf(d, "server-ca", "node", "DNS:localhost,IP:127.0.0.1")
        make_ca(d, "client-ca")
        make_leaf(d, "client-ca", "gateway", "DNS:gateway")
        make_ca(d, "stranger-ca")
        make_leaf(d, "stranger-ca", "stranger", "DNS:gateway")
        server = ["--tls-cert", os.path.join(d, "node.pem"),
                  "--tls-key", os.path.join(d, "node.key")]
        cls.nodes = []
        try:
            cls.tls = Node("tls", d, server)
            cls.nodes.append(cls.tls)
            cls.mtls = Node("mtls", d, server + ["--tls-client-ca",
                                                 os.path.join(d, "client-ca.pem")])
            cls.nodes.append(cls.mtls)
        except Exception:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        for n in cls.nodes:
            n.stop()
        cls.dir.cleanup()

    def channel(self, node, client=None, ca="server-ca"):
        d = self.dir.name
        key = read(d, client + ".key") if client else None
        cert = read(d, client + ".pem") if client else None
        creds = grpc.ssl_channel_credentials(root_certificates=read(d, ca + ".pem"),
                                             private_key=key, certificate_chain=cert)
        return grpc.secure_channel(node.grpc, creds)

    def check(self, channel, key):
        with channel:
            answer = pb_grpc.RateLimiterStub(channel).Check(
                pb.CheckRequest(key=key, route="GET /x"), timeout=5)
            health = channel.unary_unary(HEALTH)(b"", timeout=5)
        self.assertTrue(answer.allowed, answer)
        self.assertEqual(health, SERVING)

    def refused(self, channel):
        with channel:
            with self.assertRaises(grpc.RpcError) as caught:
                pb_grpc.RateLimiterStub(channel).Check(
                    pb.CheckRequest(key="refused", route="GET /x"), timeout=5)
        self.assertEqual(caught.exception.code(), grpc.StatusCode.UNAVAILABLE,
                         caught.exception)

    def test_tls_without_a_client_certificate_is_answered(self):
        self.check(self.channel(self.tls), "py-tls")

    def test_plaintext_to_a_tls_listener_is_refused(self):
        self.refused(grpc.insecure_channel(self.tls.grpc))

    def test_a_node_the_client_does_not_trust_is_refused(self):
        self.refused(self.channel(self.tls, ca="stranger-ca"))

    def test_mutual_tls_answers_a_certificate_of_the_client_ca(self):
        self.check(self.channel(self.mtls, client="gateway"), "py-mtls")

    def test_mutual_tls_refuses_a_client_without_a_certificate(self):
        self.refused(self.channel(self.mtls))

    def test_mutual_tls_refuses_a_certificate_of_another_ca(self):
        self.refused(self.channel(self.mtls, client="stranger"))


if __name__ == "__main__":
    BINARY = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
