#!/usr/bin/env python3
"""Plant each mutant of MUTANTS in production code and see whether the simulator catches it.

Run on demand, never in CI (each mutant is a release build and N seeds):

    python3 tests/sim/mutants.py [--seeds 200] [--only NAME,...] [--test TEST] [--scratch DIR]

Each mutant is applied in a scratch worktree of HEAD (its own target directory, so the
checkout you work in is untouched), the simulator's seeds test runs, and one line per
mutant says whether a seed found a violation, which seed first, and the property. The
table of results lives in tests/sim/mutants.md.
"""
import argparse
import os
import re
import subprocess
import sys
import time

# name, file, text to find (exactly once), replacement, what the bug is.
MUTANTS = [
    ("failover-never", "src/cluster/flight.rs",
     "if self.failover == FailOver::Off || failure == Failure::Refused {",
     "if true || self.failover == FailOver::Off || failure == Failure::Refused {",
     "an unreachable owner's checks never go to the successor's replica"),
    ("failover-refused-owner", "src/cluster/flight.rs",
     "if self.failover == FailOver::Off || failure == Failure::Refused {",
     "if self.failover == FailOver::Off {",
     "an owner that refused (alive) still gets a second decider at its successor"),
    ("in-doubt-never", "src/cluster/flight.rs",
     "Failure::TimedOut => Doubt::InDoubt,",
     "Failure::TimedOut => Doubt::Owed,",
     "a timed-out forward is not marked in doubt (the replica owes its admissions too)"),
    ("in-doubt-always", "src/cluster/flight.rs",
     "Failure::Unreachable | Failure::Refused => Doubt::Owed,",
     "Failure::Unreachable | Failure::Refused => Doubt::InDoubt,",
     "every fail-over is marked in doubt (an unreachable owner is owed nothing)"),
    ("replica-answer-not-degraded", "src/cluster/flight.rs",
     "let mut answer = policy::remote_answer(item, remote, successor);\n                answer.degraded = true;",
     "let answer = policy::remote_answer(item, remote, successor);",
     "a successor's answer is not flagged degraded"),
    ("deny-cache-shadow", "src/cluster/flight.rs",
     ".filter(|_| !item.rule.shadow && !item.uncached)",
     ".filter(|_| !item.uncached)",
     "a shadow rule's denial is cached (its checks stop reaching the owner)"),
    ("restoring-owner-answers", "src/cluster/flight.rs",
     "!restored && items.into_iter().any(|failover| !failover)",
     "false && items.into_iter().any(|failover| !failover)",
     "a restarted owner answers as owner before its restore"),
    ("late-batch-decided", "src/cluster/policy.rs",
     "deadline_ms != 0 && now > deadline_ms",
     "deadline_ms != 0 && now > deadline_ms + 60_000",
     "a forwarded batch past its deadline is decided (the entry already fell back)"),
    ("replica-batch-order", "src/cluster/replica_batches.rs",
     "Some(held) if *held >= (generation, number) => false,",
     "Some(held) if *held > (u64::MAX, u64::MAX) => false,",
     "a successor holds a replication batch older than one it holds (a delayed batch replaces newer replicas)"),
    ("fence-no-majority", "src/membership/quorum.rs",
     "_ => return Err(Fenced::NoMajority),",
     "_ => {}",
     "a node decides fenced keys without hearing a majority (a cut-off owner keeps deciding)"),
    ("fence-owner-ignored", "src/membership/quorum.rs",
     "Some(owner) if owner != self.me => Err(Fenced::OwnerAlive(owner.to_string())),",
     "Some(owner) if false && owner != self.me => Err(Fenced::OwnerAlive(owner.to_string())),",
     "a successor decides a fenced key while its owner is still heard (two deciders at a cut)"),
    ("fence-recheck-never", "src/cluster/policy.rs",
     "if !answer.decision.allowed || fence_check(item, fence, now).is_ok() {",
     "if true || !answer.decision.allowed || fence_check(item, fence, now).is_ok() {",
     "an admission decided after the fence was lost stands"),
    ("handback-added", "src/shard/store.rs",
     "let standing = if join || self.slots[i].has(MOVED) {",
     "let standing = if self.slots[i].has(MOVED) {",
     "a promoted key handed back is added to the state it came from, not joined"),
    ("fixed-window-off-by-one", "src/algorithms/fixed_window.rs",
     "u128::from(state.count) + u128::from(cost.get()) <= u128::from(self.limit)",
     "u128::from(state.count) + u128::from(cost.get()) <= u128::from(self.limit) + 1",
     "a fixed window admits one past its limit"),
    ("refund-dropped", "src/shard/core.rs",
     "self.store.refund(counter, refund.at, refund.charge.cost);",
     "let _ = (counter, refund.at);",
     "a refund of a denied check's admitted sibling is dropped"),
    ("replica-owed-ignored", "src/shard/replication.rs",
     "let owed = item.target != super::Target::Replica(super::Doubt::InDoubt);",
     "let owed = false;",
     "a fail-over on a replica owes nothing for the interval the owner may have admitted"),
    ("deny-cache-past-retry", "src/cluster/deny_cache.rs",
     "self.map.insert(key, denial);",
     "self.map.insert(key, Denial { until: denial.until + 5_000, ..denial });",
     "a cached denial outlives its retry-after (false denies)"),


    ("restore-no-settle", "src/cluster/replication/restore.rs",
     "if !self.restarted {\n            return self.finish(true);",
     "if true {\n            return self.finish(true);",
     "a restore is done as soon as its members answered, even when one knew an earlier incarnation"),

    ("view-change-no-take-back", "src/cluster/replication/memory.rs",
     "if !gone.is_empty() {",
     "if false && !gone.is_empty() {",
     "keys handed to members that left are not taken back"),

    ("lease-uncharged", "src/shard/budget.rs",
     "let (decision, churn, _) = store.check(counter, now, units);",
     "let (decision, churn) = (store.peek(counter, now), Churn::default());",
     "a budget lease is granted without charging its units on the owner's counter"),
    ("lease-spend-past-left", "src/shard/budget/entry.rs",
     ".filter(|&i| f.leases[i].left >= ask.cost)",
     ".filter(|&i| f.leases[i].left > 0)",
     "an entry spends from a lease with fewer units left than the check costs"),
    ("lease-past-window-end", "src/algorithms/leasing.rs",
     "Some(by_ttl.min(end))",
     "Some(by_ttl)",
     "a fixed window's lease outlives its window (its units are spent in the next one)"),
    ("handoff-never", "src/cluster/handoff.rs",
     "let hand_over = (share_from_me > 0.0)",
     "let hand_over = (share_from_me > 1.0)",
     "the handoff watcher never hands keys over when the ring moves them away"),
]


def run(cmd, cwd, env=None, timeout=None):
    return subprocess.run(cmd, cwd=cwd, env=env, timeout=timeout, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--only", default="")
    ap.add_argument("--scratch", default="/tmp/ringlimit-mutants")
    ap.add_argument("--test", default="seeds",
                    help="the simulator test to run (default: seeds; e.g. a profile's own test)")
    args = ap.parse_args()
    repo = run(["git", "rev-parse", "--show-toplevel"], os.getcwd()).stdout.strip()
    tree = os.path.join(args.scratch, "tree")
    if not os.path.isdir(tree):
        os.makedirs(args.scratch, exist_ok=True)
        r = run(["git", "worktree", "add", "--detach", tree, "HEAD"], repo)
        if r.returncode:
            sys.exit(r.stdout)
    else:
        run(["git", "checkout", "--detach", run(["git", "rev-parse", "HEAD"], repo).stdout.strip()], tree)
    # Incremental release builds: only the mutated crate's changed parts are rebuilt
    # (dependencies are never incremental, so a target directory copied from a release
    # build of the same lock file is reused as it is).
    env = dict(os.environ, CARGO_TARGET_DIR=os.path.join(args.scratch, "target"),
               CARGO_INCREMENTAL="1", RINGLIMIT_SIM_SEEDS=str(args.seeds))
    only = set(filter(None, args.only.split(",")))
    for name, path, find, replace, what in MUTANTS:
        if only and name not in only:
            continue
        run(["git", "checkout", "--", "."], tree)
        full = os.path.join(tree, path)
        text = open(full).read()
        if text.count(find) != 1:
            print(f"{name}: STALE (the text to mutate occurs {text.count(find)} times in {path})")
            continue
        open(full, "w").write(text.replace(find, replace))
        started = time.time()
        build = run(["cargo", "test", "--release", "--test", "sim", "--no-run"], tree, env)
        if build.returncode:
            print(f"{name}: BUILD FAILED\n{build.stdout[-2000:]}")
            continue
        test = run(["cargo", "test", "--release", "--test", "sim", "--", args.test, "--exact",
                    "--nocapture"], tree, env)
        took = time.time() - started
        failed = re.findall(r"sim seed=(\d+) FAILED|seed (\d+): ", test.stdout)
        failed = [a or b for a, b in failed]
        props = re.findall(r"^\s*(S[0-9A-Za-z_-]+|FENCE)[: ]", test.stdout, re.M)
        if failed:
            print(f"{name}: CAUGHT by {len(failed)} of {args.seeds} seeds, first seed {failed[0]}, "
                  f"properties {sorted(set(props))[:4]} ({took:.0f} s) -- {what}")
        elif test.returncode:
            print(f"{name}: CAUGHT (test failed without a failing seed: a panic) ({took:.0f} s) -- {what}\n"
                  + "\n".join(test.stdout.splitlines()[-8:]))
        else:
            print(f"{name}: MISSED by {args.seeds} seeds ({took:.0f} s) -- {what}")
        sys.stdout.flush()
    run(["git", "checkout", "--", "."], tree)


if __name__ == "__main__":
    main()
