"""Gubernator's V1 API driven by a client ringlimit did not write.

The stubs are generated at test time by grpcio-tools (protoc in a wheel) from the vendored
proto/gubernator/gubernator.proto, so a field number or an enum value ringlimit's own
(prost) build got wrong would show up here as wrong numbers. The cluster is three real
`ringlimit serve --gubernator` processes sharing a cluster secret, joined by seeds.

Run by .ci/gubernator-client.sh: python test_gubernator.py PATH_TO_RINGLIMIT_BINARY
Windows: TOKEN_BUCKET items use a duration of 7 days (ringlimit's fixed windows are aligned
to multiples of the duration since the Unix epoch, so a boundary falls once a week) and
LEAKY_BUCKET items leak one hit per hours, so nothing refills within a run.
"""

import os
import subprocess
import sys
import tempfile
import time
import unittest

import grpc
from grpc_tools import protoc

BINARY = None
PROTO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "proto")
WEEK_MS = 7 * 24 * 3600 * 1000
SECRET = "ringlimit-test-cluster-secret-not-for-production"

pb = None
pb_grpc = None


def generate_stubs(out):
    """gubernator_pb2 and gubernator_pb2_grpc from the vendored proto, into `out`."""
    status = protoc.main([
        "grpc_tools.protoc",
        "-I" + os.path.join(PROTO_DIR, "gubernator"),
        "--python_out=" + out,
        "--grpc_python_out=" + out,
        "gubernator.proto",
    ])
    if status != 0:
        raise RuntimeError("protoc failed: %d" % status)
    sys.path.insert(0, out)
    global pb, pb_grpc
    import gubernator_pb2
    import gubernator_pb2_grpc
    pb, pb_grpc = gubernator_pb2, gubernator_pb2_grpc


class Node:
    """One `ringlimit serve --gubernator` process on loopback port 0."""

    def __init__(self, node_id, workdir, secret, seeds):
        self.id = node_id
        self.log = open(os.path.join(workdir, node_id + ".log"), "w")
        args = [BINARY, "serve", "--node-id", node_id, "--gubernator",
                "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                "--gossip-listen", "127.0.0.1:0", "--peer-listen", "127.0.0.1:0",
                "--cluster-secret-file", secret]
        for seed in seeds:
            args += ["--seed", seed]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self.log,
                                     stdin=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()
        fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        if "grpc" not in fields:
            self.stop()
            raise RuntimeError("%s: no ready line: %r (log: %s)" % (node_id, line, self.log_text()))
        self.grpc = fields["grpc"]
        self.gossip = fields["gossip"]
        self.channel = grpc.insecure_channel(self.grpc)
        self.v1 = pb_grpc.V1Stub(self.channel)

    def log_text(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-2000:]

    def get(self, *items):
        return list(self.v1.GetRateLimits(pb.GetRateLimitsReq(requests=list(items)), timeout=5).responses)

    def one(self, item):
        (answer,) = self.get(item)
        return answer

    def stop(self):
        if hasattr(self, "channel"):
            self.channel.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def item(key, hits=1, limit=5, duration=WEEK_MS, algorithm=None, behavior=0, burst=0,
         name="py"):
    return pb.RateLimitReq(name=name, unique_key=key, hits=hits, limit=limit, duration=duration,
                           algorithm=pb.TOKEN_BUCKET if algorithm is None else algorithm,
                           behavior=behavior, burst=burst)


class Cluster(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.TemporaryDirectory()
        generate_stubs(cls.dir.name)
        secret = os.path.join(cls.dir.name, "cluster.secret")
        with open(secret, "w") as f:
            f.write(SECRET + "\n")
        cls.nodes = []
        try:
            for node_id in ["a", "b", "c"]:
                seeds = [cls.nodes[0].gossip] if cls.nodes else []
                cls.nodes.append(Node(node_id, cls.dir.name, secret, seeds))
            # Until every node sees three members (HealthCheck's peer count).
            deadline = time.monotonic() + 20
            while True:
                counts = [n.v1.HealthCheck(pb.HealthCheckReq(), timeout=5).peer_count
                          for n in cls.nodes]
                if counts == [3, 3, 3]:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("no convergence: peer counts %s" % counts)
                time.sleep(0.1)
        except Exception:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        for n in cls.nodes:
            n.stop()
        cls.dir.cleanup()

    def owned_elsewhere(self, prefix, entry=0, **kw):
        """A key whose owner is not nodes[entry] (found with hits 0: nothing charged)."""
        for i in range(200):
            key = "%s-%d" % (prefix, i)
            owner = self.nodes[entry].one(item(key, hits=0, **kw)).metadata["owner"]
            if owner != self.nodes[entry].id:
                return key, owner
        self.fail("no key owned elsewhere")

    def numbers(self, r):
        self.assertEqual(r.error, "", r)
        return (r.status, r.remaining)

    def test_health_check_reports_healthy_with_the_peer_count(self):
        for n in self.nodes:
            h = n.v1.HealthCheck(pb.HealthCheckReq(), timeout=5)
            self.assertEqual((h.status, h.peer_count), ("healthy", 3))

    def test_token_bucket_sequence_through_a_node_that_does_not_own_the_key(self):
        key, owner = self.owned_elsewhere("tb")
        a = self.nodes[0]
        now = int(time.time() * 1000)
        first = a.one(item(key, hits=2))
        self.assertEqual(self.numbers(first), (pb.UNDER_LIMIT, 3))
        self.assertEqual(first.limit, 5)
        self.assertEqual(first.metadata["owner"], owner)
        # Aligned to the duration: the end of this week-long window.
        self.assertEqual(first.reset_time % WEEK_MS, 0)
        self.assertTrue(now < first.reset_time <= now + WEEK_MS + 1000)
        # More than what is left: OVER_LIMIT, nothing charged, the 3 still usable.
        self.assertEqual(self.numbers(a.one(item(key, hits=4))), (pb.OVER_LIMIT, 3))
        self.assertEqual(self.numbers(a.one(item(key, hits=3))), (pb.UNDER_LIMIT, 0))
        self.assertEqual(self.numbers(a.one(item(key, hits=1))), (pb.OVER_LIMIT, 0))
        # hits 0 reports through any node; the owner's numbers.
        for n in self.nodes:
            r = n.one(item(key, hits=0))
            self.assertEqual(self.numbers(r), (pb.OVER_LIMIT, 0))
            self.assertEqual(r.metadata["owner"], owner)

    def test_inline_limits_are_one_counter_whichever_node_is_asked(self):
        key, owner = self.owned_elsewhere("inline")
        answers = [self.nodes[i % 3].one(item(key, hits=1, limit=4)) for i in range(6)]
        self.assertEqual([self.numbers(r) for r in answers], [
            (pb.UNDER_LIMIT, 3), (pb.UNDER_LIMIT, 2), (pb.UNDER_LIMIT, 1), (pb.UNDER_LIMIT, 0),
            (pb.OVER_LIMIT, 0), (pb.OVER_LIMIT, 0)])
        self.assertEqual({r.metadata["owner"] for r in answers}, {owner})
        # The same unique_key under another name is another counter.
        other = self.nodes[1].one(item(key, hits=1, limit=4, name="py-other"))
        self.assertEqual(self.numbers(other), (pb.UNDER_LIMIT, 3))

    def test_leaky_bucket_sequence_with_burst(self):
        # 1 hit per 6 hours leaks back: nothing refills during the run.
        lb = dict(limit=4, duration=24 * 3600 * 1000, algorithm=pb.LEAKY_BUCKET)
        key, owner = self.owned_elsewhere("lb", entry=1, **lb)
        b = self.nodes[1]
        now = int(time.time() * 1000)
        r = b.one(item(key, hits=3, **lb))
        self.assertEqual(self.numbers(r), (pb.UNDER_LIMIT, 1))
        self.assertEqual(r.metadata["owner"], owner)
        # Full again after 3 leaks of 6 h.
        self.assertTrue(abs(r.reset_time - (now + 3 * 6 * 3600 * 1000)) < 5000, r.reset_time - now)
        self.assertEqual(self.numbers(b.one(item(key, hits=2, **lb))), (pb.OVER_LIMIT, 1))
        self.assertEqual(self.numbers(b.one(item(key, hits=1, **lb))), (pb.UNDER_LIMIT, 0))
        self.assertEqual(self.numbers(b.one(item(key, hits=1, **lb))), (pb.OVER_LIMIT, 0))
        # A burst above the limit: 10 at once, then nothing.
        burst = dict(lb, burst=10)
        key2, _ = self.owned_elsewhere("lb-burst", entry=1, **burst)
        self.assertEqual(self.numbers(b.one(item(key2, hits=10, **burst))), (pb.UNDER_LIMIT, 0))
        self.assertEqual(self.numbers(b.one(item(key2, hits=1, **burst))), (pb.OVER_LIMIT, 0))

    def test_reset_remaining_through_one_node_is_seen_through_another(self):
        key, _ = self.owned_elsewhere("reset")
        a, b, c = self.nodes
        self.assertEqual(self.numbers(a.one(item(key, hits=5))), (pb.UNDER_LIMIT, 0))
        self.assertEqual(self.numbers(b.one(item(key, hits=1))), (pb.OVER_LIMIT, 0))
        r = c.one(item(key, hits=1, behavior=pb.RESET_REMAINING))
        self.assertEqual(self.numbers(r), (pb.UNDER_LIMIT, 5))
        self.assertEqual(self.numbers(b.one(item(key, hits=1))), (pb.UNDER_LIMIT, 4))
        # Leaky bucket: reset, then the hits are taken.
        lb = dict(limit=3, duration=24 * 3600 * 1000, algorithm=pb.LEAKY_BUCKET)
        self.assertEqual(self.numbers(a.one(item(key + "-lb", hits=3, **lb))), (pb.UNDER_LIMIT, 0))
        r = b.one(item(key + "-lb", hits=1, behavior=pb.RESET_REMAINING, **lb))
        self.assertEqual(self.numbers(r), (pb.UNDER_LIMIT, 2))

    def test_drain_over_limit_empties_the_counter(self):
        key, _ = self.owned_elsewhere("drain")
        a = self.nodes[0]
        self.assertEqual(self.numbers(a.one(item(key, hits=3))), (pb.UNDER_LIMIT, 2))
        r = a.one(item(key, hits=3, behavior=pb.DRAIN_OVER_LIMIT))
        self.assertEqual(self.numbers(r), (pb.OVER_LIMIT, 0))
        self.assertEqual(self.numbers(a.one(item(key, hits=1))), (pb.OVER_LIMIT, 0))
        # Without it, the same over-limit request leaves the remainder.
        key2, _ = self.owned_elsewhere("nodrain")
        a.one(item(key2, hits=3))
        self.assertEqual(self.numbers(a.one(item(key2, hits=3))), (pb.OVER_LIMIT, 2))

    def test_negative_hits_give_back(self):
        key, _ = self.owned_elsewhere("neg")
        a = self.nodes[0]
        self.assertEqual(self.numbers(a.one(item(key, hits=5))), (pb.UNDER_LIMIT, 0))
        self.assertEqual(self.numbers(a.one(item(key, hits=-2))), (pb.UNDER_LIMIT, 2))
        self.assertEqual(self.numbers(a.one(item(key, hits=2))), (pb.UNDER_LIMIT, 0))

    def test_one_bad_item_does_not_fail_the_batch(self):
        good = item("batch-good", hits=1, limit=2)
        answers = self.nodes[2].get(
            good,
            item("", hits=1),
            item("batch-bad", duration=0),
            item("batch-bad", limit=-3),
            item("batch-bad", behavior=pb.DURATION_IS_GREGORIAN, duration=4),
            item("batch-bad", algorithm=9),
            good)
        errors = [r.error.split(":")[0] for r in answers]
        self.assertEqual(errors, ["", "unique_key", "duration", "limit", "duration", "algorithm", ""])
        self.assertEqual((answers[0].remaining, answers[6].remaining), (1, 0))
        self.assertTrue(answers[0].metadata["owner"])
        self.assertEqual(dict(answers[1].metadata), {})
        with self.assertRaises(grpc.RpcError) as caught:
            self.nodes[0].get(*([good] * 1001))
        self.assertEqual(caught.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)

    def test_global_and_no_batching_are_accepted_and_answers_stay_exact(self):
        key, _ = self.owned_elsewhere("global")
        flags = pb.GLOBAL | pb.NO_BATCHING
        answers = [self.nodes[i].one(item(key, hits=1, limit=2, behavior=flags)) for i in range(3)]
        self.assertEqual([self.numbers(r) for r in answers],
                         [(pb.UNDER_LIMIT, 1), (pb.UNDER_LIMIT, 0), (pb.OVER_LIMIT, 0)])


if __name__ == "__main__":
    BINARY = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
