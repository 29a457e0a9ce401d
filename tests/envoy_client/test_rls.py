"""Envoy's own generated client (PyPI xds-protos) against a ringlimit node.

The node is the real binary, started with an envoyproxy/ratelimit YAML file; the client is
`envoy.service.ratelimit.v3.rls_pb2_grpc` as Envoy's data-plane-api generates it, so a
field number or a type ringlimit got wrong shows up here. The stock grpcio-reflection
client (v1alpha) lists the services.

Run by .ci/envoy-client.sh: python test_rls.py PATH_TO_RINGLIMIT_BINARY
Windows: counted limits use `unit: week` (a fixed window boundary falls once a week) or a
token bucket (no refill within a test run), so a run never straddles a window.
"""

import os
import subprocess
import sys
import tempfile
import unittest

import grpc
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from envoy.type.v3 import ratelimit_unit_pb2
from google.protobuf import descriptor_pool, wrappers_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

BINARY = None
OK = rls_pb2.RateLimitResponse.OK
OVER = rls_pb2.RateLimitResponse.OVER_LIMIT
WEEK = rls_pb2.RateLimitResponse.RateLimit.WEEK

CONFIG = """
domain: gateway
descriptors:
  # a value-less key: one counter per runtime value
  - key: remote_address
    rate_limit:
      unit: week
      requests_per_unit: 3
      name: per_ip
  # an exact value beats the value-less key; 0 blocks
  - key: remote_address
    value: 10.6.6.6
    rate_limit:
      unit: week
      requests_per_unit: 0
  # a wildcard, every match its own counter
  - key: path
    value: /v1/*
    rate_limit:
      unit: week
      requests_per_unit: 2
  # a wildcard sharing one counter
  - key: path
    value: /shared/*
    share_threshold: true
    rate_limit:
      unit: week
      requests_per_unit: 2
  - key: internal
    rate_limit:
      unlimited: true
  # nesting: the limit applies at depth 2 only
  - key: tenant
    value: acme
    descriptors:
      - key: user
        rate_limit:
          unit: week
          requests_per_unit: 2
          name: acme_user
      - key: plan
        value: gold
        rate_limit:
          unit: week
          requests_per_unit: 50
          replaces:
            - name: acme_user
  - key: dark
    rate_limit:
      unit: week
      requests_per_unit: 1
    shadow_mode: true
  - key: tokens
    detailed_metric: true
    rate_limit:
      unit: day
      requests_per_unit: 1000
      algorithm: token_bucket
"""


def entries(*pairs):
    return [ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in pairs]


def descriptor(*pairs, hits=None, limit=None):
    d = ratelimit_pb2.RateLimitDescriptor(entries=entries(*pairs))
    if hits is not None:
        d.hits_addend.CopyFrom(wrappers_pb2.UInt64Value(value=hits))
    if limit is not None:
        d.limit.CopyFrom(limit)
    return d


class Node:
    """The ringlimit binary on loopback port 0, read from its ready line."""

    def __init__(self, config_text):
        self.dir = tempfile.TemporaryDirectory()
        path = os.path.join(self.dir.name, "gateway.yaml")
        with open(path, "w") as f:
            f.write(config_text)
        self.log = open(os.path.join(self.dir.name, "node.log"), "w")
        self.proc = subprocess.Popen(
            [BINARY, "serve", "--node-id", "py-node",
             "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
             "--gossip-listen", "127.0.0.1:0", "--peer-listen", "127.0.0.1:0",
             "--envoy-config", path, "--envoy-headers"],
            stdout=subprocess.PIPE, stderr=self.log, stdin=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()
        fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        if "grpc" not in fields:
            self.stop()
            raise RuntimeError("no ready line: %r (log: %s)" % (line, self.log_text()))
        self.channel = grpc.insecure_channel(fields["grpc"])
        self.rls = rls_pb2_grpc.RateLimitServiceStub(self.channel)

    def log_text(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-2000:]

    def ask(self, *descriptors, domain="gateway", hits=0):
        return self.rls.ShouldRateLimit(
            rls_pb2.RateLimitRequest(domain=domain, descriptors=list(descriptors), hits_addend=hits),
            timeout=5)

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


class RateLimitServiceTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.node = Node(CONFIG)

    @classmethod
    def tearDownClass(cls):
        cls.node.channel.close()
        cls.node.stop()

    def codes(self, n, *descriptors, **kw):
        return [self.node.ask(*descriptors, **kw).overall_code for _ in range(n)]

    def test_a_value_less_key_counts_each_value_and_reports_the_limit(self):
        r = self.node.ask(descriptor(("remote_address", "10.0.0.1")))
        self.assertEqual(r.overall_code, OK)
        self.assertEqual(len(r.statuses), 1)
        s = r.statuses[0]
        self.assertEqual((s.code, s.current_limit.requests_per_unit), (OK, 3))
        self.assertEqual((s.current_limit.unit, s.current_limit.name), (WEEK, "per_ip"))
        self.assertEqual(s.limit_remaining, 2)
        self.assertEqual(s.duration_until_reset.nanos, 0, "whole seconds")
        self.assertTrue(0 < s.duration_until_reset.seconds <= 7 * 86400)
        self.assertEqual(self.codes(3, descriptor(("remote_address", "10.0.0.1"))), [OK, OK, OVER])
        self.assertEqual(self.node.ask(descriptor(("remote_address", "10.0.0.2"))).overall_code, OK)

    def test_an_exact_value_beats_the_key_and_zero_blocks(self):
        r = self.node.ask(descriptor(("remote_address", "10.6.6.6")))
        self.assertEqual(r.overall_code, OVER)
        self.assertEqual(r.statuses[0].current_limit.requests_per_unit, 0)

    def test_wildcards_count_each_value_unless_share_threshold(self):
        self.assertEqual(self.codes(3, descriptor(("path", "/v1/a"))), [OK, OK, OVER])
        self.assertEqual(self.codes(2, descriptor(("path", "/v1/b"))), [OK, OK])
        self.assertEqual(self.node.ask(descriptor(("path", "/shared/a"))).overall_code, OK)
        self.assertEqual(self.node.ask(descriptor(("path", "/shared/b"))).overall_code, OK)
        self.assertEqual(self.node.ask(descriptor(("path", "/shared/c"))).overall_code, OVER)

    def test_unmatched_and_unlimited_are_ok_and_never_counted(self):
        for _ in range(5):
            r = self.node.ask(descriptor(("nobody", "x")), descriptor(("internal", "y")))
            self.assertEqual(r.overall_code, OK)
            self.assertFalse(r.statuses[0].HasField("current_limit"))
            self.assertEqual(r.statuses[1].limit_remaining, 2 ** 32 - 1)

    def test_the_limit_applies_only_at_the_configured_depth(self):
        shallow = self.node.ask(descriptor(("tenant", "acme")))
        self.assertFalse(shallow.statuses[0].HasField("current_limit"))
        deeper = self.node.ask(descriptor(("tenant", "acme"), ("user", "u"), ("x", "y")))
        self.assertFalse(deeper.statuses[0].HasField("current_limit"))
        self.assertEqual(self.codes(3, descriptor(("tenant", "acme"), ("user", "u1"))), [OK, OK, OVER])

    def test_replaces_drops_the_named_limit_of_that_request(self):
        user = descriptor(("tenant", "acme"), ("user", "u2"))
        gold = descriptor(("tenant", "acme"), ("plan", "gold"))
        r = self.node.ask(user, gold)
        self.assertFalse(r.statuses[0].HasField("current_limit"), "acme_user replaced")
        self.assertEqual(r.statuses[1].current_limit.requests_per_unit, 50)
        self.assertEqual(self.codes(3, user, gold), [OK, OK, OK])
        self.assertEqual(self.codes(3, user), [OK, OK, OVER], "acme_user itself untouched")

    def test_hits_addend_default_override_zero_and_large(self):
        tokens = lambda hits=None: descriptor(("tokens", "team-a"), hits=hits)
        self.assertEqual(self.node.ask(tokens()).statuses[0].limit_remaining, 999)
        self.assertEqual(self.node.ask(tokens(), hits=100).statuses[0].limit_remaining, 899)
        self.assertEqual(self.node.ask(tokens(hits=200), hits=5).statuses[0].limit_remaining, 699)
        for _ in range(3):
            s = self.node.ask(tokens(hits=0)).statuses[0]
            self.assertEqual((s.code, s.limit_remaining), (OK, 699), "0: report, do not count")
        self.assertEqual(self.node.ask(tokens(hits=2 ** 40)).overall_code, OVER, "large is valid")
        self.assertEqual(self.node.ask(tokens(hits=0)).statuses[0].limit_remaining, 699)

    def test_a_limit_override_replaces_the_configured_limit(self):
        override = ratelimit_pb2.RateLimitDescriptor.RateLimitOverride(
            requests_per_unit=1, unit=ratelimit_unit_pb2.HOUR)
        d = descriptor(("remote_address", "10.9.9.9"), limit=override)
        s = self.node.ask(d).statuses[0]
        self.assertEqual((s.current_limit.requests_per_unit, s.limit_remaining), (1, 0))
        self.assertEqual(s.current_limit.unit, rls_pb2.RateLimitResponse.RateLimit.HOUR)
        self.assertEqual(self.node.ask(descriptor(("remote_address", "10.9.9.9"))).statuses[0].limit_remaining, 2,
                         "the configured limit's counter is a different one")
        # As the reference: an override limits a descriptor no configured limit matches.
        free = descriptor(("unconfigured", "x"), limit=override)
        self.assertEqual([self.node.ask(free).overall_code for _ in range(2)], [OK, OVER])
        self.assertFalse(self.node.ask(descriptor(("unconfigured", "x"))).statuses[0].HasField("current_limit"))

    def test_all_must_allow_and_the_ones_that_allowed_are_refunded(self):
        ip = descriptor(("remote_address", "10.1.1.1"))
        path = descriptor(("path", "/v1/refund"))
        self.assertEqual(self.codes(4, ip, path), [OK, OK, OVER, OVER])
        r = self.node.ask(ip)
        self.assertEqual(r.statuses[0].limit_remaining, 0, "3 - 2 admitted - this one: denials refunded")

    def test_shadow_mode_reports_but_allows(self):
        self.assertEqual(self.codes(4, descriptor(("dark", "d"))), [OK] * 4)

    def test_headers_for_envoy_to_add(self):
        d = descriptor(("remote_address", "10.2.2.2"))
        self.codes(3, d)
        r = self.node.ask(d)
        headers = {h.key: h.value for h in r.response_headers_to_add}
        self.assertEqual(r.overall_code, OVER)
        self.assertIn("retry-after", headers)
        self.assertEqual(headers["ratelimit-policy"], '"per_ip";q=3;w=604800')
        self.assertTrue(headers["ratelimit"].startswith('"per_ip";r=0;t='), headers)

    def test_bad_input_is_invalid_argument_naming_the_field(self):
        cases = [
            (dict(domain=""), "domain"),
            (dict(descriptors=[]), "descriptors"),
            (dict(descriptors=[ratelimit_pb2.RateLimitDescriptor(entries=entries(("k", "")))]),
             "descriptors[0].entries[0].value"),
            (dict(descriptors=[descriptor(("k", "v"), limit=ratelimit_pb2.RateLimitDescriptor.RateLimitOverride(
                requests_per_unit=1, unit=ratelimit_unit_pb2.YEAR))]), "descriptors[0].limit.unit"),
        ]
        for fields, field in cases:
            request = rls_pb2.RateLimitRequest(domain="gateway", descriptors=[descriptor(("k", "v"))])
            for name, value in fields.items():
                if name == "descriptors":
                    del request.descriptors[:]
                    request.descriptors.extend(value)
                else:
                    setattr(request, name, value)
            with self.assertRaises(grpc.RpcError) as caught:
                self.node.rls.ShouldRateLimit(request, timeout=5)
            self.assertEqual(caught.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            self.assertTrue(caught.exception.details().startswith(field + ": "), caught.exception.details())

    def test_the_stock_v1alpha_reflection_client_lists_and_resolves_the_services(self):
        db = ProtoReflectionDescriptorDatabase(self.node.channel)
        services = set(db.get_services())
        self.assertIn("envoy.service.ratelimit.v3.RateLimitService", services)
        self.assertIn("ringlimit.v1.RateLimiter", services)
        self.assertFalse(any("peer" in s for s in services), services)
        pool = descriptor_pool.DescriptorPool(db)
        method = pool.FindServiceByName("envoy.service.ratelimit.v3.RateLimitService").methods_by_name["ShouldRateLimit"]
        self.assertEqual(method.output_type.full_name, "envoy.service.ratelimit.v3.RateLimitResponse")
        desc = pool.FindMessageTypeByName("envoy.extensions.common.ratelimit.v3.RateLimitDescriptor")
        self.assertEqual(desc.fields_by_name["hits_addend"].number, 3)


class ConfigErrorTest(unittest.TestCase):
    def test_an_unknown_key_refuses_the_start_naming_key_and_line(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "bad.yaml")
            with open(path, "w") as f:
                f.write("domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: second\n      requests_per_unit: 1\n      burst: 3\n")
            p = subprocess.run([BINARY, "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                                "--gossip-listen", "127.0.0.1:0", "--peer-listen", "127.0.0.1:0",
                                "--envoy-config", path], capture_output=True, text=True, timeout=30)
            self.assertNotEqual(p.returncode, 0)
            self.assertIn("unknown field `burst`", p.stderr)
            self.assertIn("line 7", p.stderr)


if __name__ == "__main__":
    BINARY = os.path.abspath(sys.argv.pop(1))
    result = unittest.main(exit=False, verbosity=2).result
    failed = len(result.failures) + len(result.errors)
    print("envoy client: %d passed, %d failed" % (result.testsRun - failed, failed))
    sys.exit(1 if failed or not result.testsRun else 0)
