"""ringlimit's RESP face driven by redis-py, the stock Python Redis client.

Three real `ringlimit serve --resp-listen` processes share a cluster secret and a RESP
token file. redis-py connects with a password (AUTH), with RESP3 (HELLO 3 AUTH), and
pipelines; every CL.THROTTLE answer is redis-cell's five integers, decided by the key's
owner whichever node the client entered by.

A fourth node speaks the public face's TLS with client certificates (--tls-cert,
--tls-key, --tls-client-ca; certificates made with the openssl commands of
docs/security.md): redis-py connects with a rediss:// URL and a client certificate, and
without one, or in plaintext, gets no answer and charges nothing.

Run by .ci/redis-py.sh: python test_redis_py.py PATH_TO_RINGLIMIT_BINARY
Limits use a period of a week per unit (count 1, period 604800 s), so nothing refills
within a run.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.error
import urllib.request

import redis

BINARY = None
SECRET = "ringlimit-test-cluster-secret-not-for-production"
TOKEN = "redis-py-resp-token-0123456789"
WEEK = 604800


class Node:
    """One `ringlimit serve --resp-listen` process on loopback port 0."""

    def __init__(self, node_id, workdir, secret, token, seeds, extra=()):
        self.id = node_id
        self.log = open(os.path.join(workdir, node_id + ".log"), "w")
        args = [BINARY, "serve", "--node-id", node_id,
                "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
                "--gossip-listen", "127.0.0.1:0", "--peer-listen", "127.0.0.1:0",
                "--resp-listen", "127.0.0.1:0", "--resp-token-file", token,
                "--cluster-secret-file", secret] + list(extra)
        for seed in seeds:
            args += ["--seed", seed]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self.log,
                                     stdin=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()
        fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        if fields.get("resp", "-") == "-":
            self.stop()
            raise RuntimeError("%s: no ready line with resp=: %r" % (node_id, line))
        self.gossip = fields["gossip"]
        self.http = fields["http"]
        host, port = fields["resp"].rsplit(":", 1)
        self.host, self.port = host, int(port)

    def client(self, **kw):
        return redis.Redis(host=self.host, port=self.port, password=TOKEN,
                           socket_timeout=10, **kw)

    def ops(self, path):
        try:
            with urllib.request.urlopen("http://%s%s" % (self.http, path), timeout=5) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            return json.loads(e.read())

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def throttle(client, key, max_burst=59, count=1, period=WEEK, quantity=None):
    args = ["CL.THROTTLE", key, max_burst, count, period]
    if quantity is not None:
        args.append(quantity)
    return list(client.execute_command(*args))


class Cluster(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.TemporaryDirectory()
        secret = os.path.join(cls.dir.name, "cluster.secret")
        with open(secret, "w") as f:
            f.write(SECRET + "\n")
        token = os.path.join(cls.dir.name, "resp.token")
        with open(token, "w") as f:
            f.write(TOKEN + "\n")
        cls.nodes = []
        try:
            for node_id in ["a", "b", "c"]:
                seeds = [cls.nodes[0].gossip] if cls.nodes else []
                cls.nodes.append(Node(node_id, cls.dir.name, secret, token, seeds))
            deadline = time.monotonic() + 20
            while True:
                members = [n.ops("/readyz").get("members") for n in cls.nodes]
                if members == [3, 3, 3]:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("no convergence: members %s" % members)
                time.sleep(0.1)
        except Exception:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        for n in cls.nodes:
            n.stop()
        cls.dir.cleanup()

    def owner(self, key):
        """The node that owns a CL.THROTTLE key (its counter key is `len:key`)."""
        counter = "%d:%s" % (len(key.encode()), key)
        return self.nodes[0].ops("/v1/owner?key=" + urllib.request.quote(counter))["owner"]["node_id"]

    def test_ping_and_a_refused_call_before_auth(self):
        bare = redis.Redis(host=self.nodes[0].host, port=self.nodes[0].port, socket_timeout=5)
        with self.assertRaises(redis.AuthenticationError):
            throttle(bare, "py-noauth")
        with self.assertRaises(redis.AuthenticationError):
            redis.Redis(host=self.nodes[0].host, port=self.nodes[0].port,
                        password="wrong-token-wrong-token").ping()
        c = self.nodes[0].client()
        self.assertTrue(c.ping())
        # Nothing was charged by the refused call.
        self.assertEqual(throttle(c, "py-noauth", quantity=0), [0, 60, 60, -1, 0])

    def test_redis_cells_readme_numbers(self):
        c = self.nodes[1].client()
        self.assertEqual(throttle(c, "py-user123", 15, 30, 60), [0, 16, 15, -1, 2])

    def test_exact_count_through_two_entry_nodes(self):
        """100 calls alternating between b and c per key, limit 60: exactly 60 each."""
        b, c = self.nodes[1].client(), self.nodes[2].client()
        keys = ["py-exact-%d" % i for i in range(6)]
        owners = {self.owner(k) for k in keys}
        self.assertGreaterEqual(len(owners), 2, "keys spread over owners")
        for key in keys:
            answers = [throttle(b if i % 2 == 0 else c, key) for i in range(100)]
            admitted = [a for a in answers if a[0] == 0]
            self.assertEqual(len(admitted), 60, key)
            self.assertEqual([a[2] for a in admitted], list(range(59, -1, -1)))
            for a in answers[60:]:
                self.assertEqual(a[:3], [1, 60, 0])
                self.assertGreater(a[3], 0)

    def test_a_pipeline_is_answered_in_order(self):
        c = self.nodes[0].client()
        pipe = c.pipeline(transaction=False)
        for _ in range(500):
            pipe.execute_command("CL.THROTTLE", "py-pipe", 99, 1, WEEK)
        pipe.ping()
        answers = pipe.execute()
        self.assertIs(answers[-1], True)
        limited = [a[0] for a in answers[:-1]]
        self.assertEqual(limited, [0] * 100 + [1] * 400)

    def test_resp3_hello_and_errors(self):
        c = self.nodes[2].client(protocol=3)
        self.assertEqual(throttle(c, "py-resp3", 4, 1, WEEK, 2), [0, 5, 3, -1, 2 * WEEK])
        with self.assertRaises(redis.ResponseError) as e:
            throttle(c, "py-resp3", -1, 1, WEEK)
        self.assertIn("max_burst", str(e.exception))
        with self.assertRaises(redis.ResponseError) as e:
            c.execute_command("GET", "x")
        self.assertIn("unknown command", str(e.exception))
        # Nothing charged by the refusals.
        self.assertEqual(throttle(c, "py-resp3", 4, 1, WEEK, 0)[2], 3)


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


# What redis-py raises when the server refuses the handshake or closes the connection
# (ConnectionError), or answers plaintext with a TLS alert, which is not RESP
# (InvalidResponse): never a reply.
REFUSED = (redis.ConnectionError, redis.exceptions.InvalidResponse)


class MutualTls(unittest.TestCase):
    """One node whose public faces demand a client certificate of the apps' CA."""

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.TemporaryDirectory()
        d = cls.dir.name
        make_ca(d, "public-ca")
        make_leaf(d, "public-ca", "node", "DNS:localhost,IP:127.0.0.1")
        make_ca(d, "apps-ca")
        make_leaf(d, "apps-ca", "app-1", "DNS:app-1")
        make_ca(d, "stranger-ca")
        make_leaf(d, "stranger-ca", "stranger", "DNS:app-1")
        cls.workdir = d
        secret = os.path.join(d, "cluster.secret")
        with open(secret, "w") as f:
            f.write(SECRET + "\n")
        token = os.path.join(d, "resp.token")
        with open(token, "w") as f:
            f.write(TOKEN + "\n")
        cls.node = Node("tls", d, secret, token, [], extra=[
            "--tls-cert", os.path.join(d, "node.pem"), "--tls-key", os.path.join(d, "node.key"),
            "--tls-client-ca", os.path.join(d, "apps-ca.pem")])

    @classmethod
    def tearDownClass(cls):
        cls.node.stop()
        cls.dir.cleanup()

    def path(self, name):
        return os.path.join(self.workdir, name)

    def url(self):
        return "rediss://%s:%d" % (self.node.host, self.node.port)

    def client(self, cert="app-1"):
        kw = {}
        if cert:
            kw = dict(ssl_certfile=self.path(cert + ".pem"), ssl_keyfile=self.path(cert + ".key"))
        return redis.Redis.from_url(self.url(), password=TOKEN, socket_timeout=10,
                                    ssl_ca_certs=self.path("public-ca.pem"), **kw)

    def test_rediss_with_a_client_certificate(self):
        c = self.client()
        self.assertTrue(c.ping())
        self.assertEqual(throttle(c, "py-tls", 15, 30, 60), [0, 16, 15, -1, 2])
        pipe = c.pipeline(transaction=False)
        for _ in range(20):
            pipe.execute_command("CL.THROTTLE", "py-tls-pipe", 9, 1, WEEK)
        self.assertEqual([a[0] for a in pipe.execute()], [0] * 10 + [1] * 10)

    def test_no_certificate_another_ca_or_plaintext_get_no_reply_and_charge_nothing(self):
        for refused in [self.client(cert=None), self.client(cert="stranger"),
                        redis.Redis(host=self.node.host, port=self.node.port, password=TOKEN,
                                    socket_timeout=10)]:
            with self.assertRaises(REFUSED):
                throttle(refused, "py-tls-refused")
        self.assertEqual(throttle(self.client(), "py-tls-refused", quantity=0),
                         [0, 60, 60, -1, 0])


if __name__ == "__main__":
    BINARY = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
