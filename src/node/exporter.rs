//! The node's metrics: the Prometheus recorder every subsystem records into, and a
//! `# HELP` line for each metric, grouped by the subsystem that records it.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// The process-wide Prometheus recorder. `metrics` has one global recorder, so nodes
/// started in one test process share it.
pub fn metrics_handle() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let builder = PrometheusBuilder::new()
            .set_buckets_for_metric(
                metrics_exporter_prometheus::Matcher::Suffix("_duration_seconds".into()),
                &[
                    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05,
                    0.1, 0.25, 1.0,
                ],
            )
            .expect("non-empty buckets")
            .set_buckets_for_metric(
                metrics_exporter_prometheus::Matcher::Full(
                    "ringlimit_replication_lag_seconds".into(),
                ),
                &[0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5],
            )
            .expect("non-empty buckets");
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        // Fails only if another recorder is installed (an embedding program's): then
        // our handle renders nothing, which is that program's choice.
        let _ = metrics::set_global_recorder(recorder);
        describe_metrics();
        metrics::gauge!(
            "ringlimit_build_info",
            "version" => env!("CARGO_PKG_VERSION"),
        )
        .set(1.0);
        handle
    })
}

/// A `# HELP` line for every metric (docs/reference/metrics.md lists them, generated from these calls):
/// a dashboard author should not need the source to read `/metrics`.
fn describe_metrics() {
    describe_checks();
    describe_forwarding();
    describe_shards();
    describe_ownership();
    describe_replication();
    describe_reservations();
    describe_budget_leases();
    describe_security();
    describe_connections();
    describe_rules();
    describe_http_check();
    describe_resp();
}

/// Successor replicas (docs/ownership.md, "Successor replicas").
fn describe_replication() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_gauge!(
        "ringlimit_replicas",
        "Replicas this shard holds for keys whose successor this node is."
    );
    describe_counter!(
        "ringlimit_replication_states_total",
        "Key states sent to their successors."
    );
    describe_counter!(
        "ringlimit_replication_batches_total",
        "Replicate calls that delivered a batch of key states."
    );
    describe_counter!(
        "ringlimit_replication_bytes_total",
        "Bytes of the Replicate calls sent (protobuf, before HTTP/2 framing)."
    );
    describe_counter!(
        "ringlimit_replication_failed_total",
        "Key states whose Replicate call failed: stale replicas until a later round delivers them (sent again every round)."
    );
    describe_histogram!(
        "ringlimit_replication_lag_seconds",
        "Per state sent: from the key's first change since its last replication to the acknowledged send."
    );
    describe_counter!(
        "ringlimit_replication_resync_keys_total",
        "Keys marked for a full send because their successor changed (a join, a leave, a death)."
    );
    describe_counter!(
        "ringlimit_replica_promotions_total",
        "Replicas promoted into live keys: this node became the key's owner and continued its count."
    );
    describe_counter!(
        "ringlimit_failover_decisions_total",
        "Checks decided here on a replica because the key's owner could not be reached."
    );
    describe_counter!(
        "ringlimit_failover_deltas_total",
        "Fail-over admissions pushed to their owner (result=delivered) or lost (result=lost)."
    );
    describe_counter!(
        "ringlimit_restores_total",
        "Restores of this node's keys from their successors at start (result=done or incomplete)."
    );
    describe_snapshots();
}

/// Counter snapshots in --data-dir (docs/ownership.md, "Counter snapshots").
fn describe_snapshots() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        "ringlimit_snapshot_writes_total",
        "Counter snapshots written to --data-dir (result=written or failed: a failed one leaves the last snapshot in place)."
    );
    describe_gauge!(
        "ringlimit_snapshot_states",
        "States in the last snapshot written (section=live: keys this node decides for; replica: replicas kept for other owners)."
    );
    describe_gauge!(
        "ringlimit_snapshot_bytes",
        "Size of the last snapshot written, in bytes."
    );
    describe_histogram!(
        "ringlimit_snapshot_write_seconds",
        "Time to take and write one snapshot (copy each shard, encode, write, fsync, rename)."
    );
    describe_counter!(
        "ringlimit_snapshot_loads_total",
        "Snapshot loads at start (result=loaded, absent: no file, refused: see ringlimit_snapshot_refused_total)."
    );
    describe_counter!(
        "ringlimit_snapshot_refused_total",
        "Snapshots refused whole at start, nothing of them loaded (reason=magic, version, truncated, checksum, malformed, foreign: another node's or cluster's, unreadable: not a regular file or too large)."
    );
}

/// Reservations and concurrency leases (docs/reservations.md).
fn describe_reservations() {
    use metrics::{describe_counter, describe_gauge};
    describe_counter!(
        "ringlimit_reservations_total",
        "Reserve calls decided on this node as owner (outcome=reserved, denied, or full: the shard's table)."
    );
    describe_counter!(
        "ringlimit_commits_total",
        "Commits applied (result=committed), applied to a counter whose owner changed (moved), or refused."
    );
    describe_counter!(
        "ringlimit_reservations_expired_total",
        "Reservations whose TTL ended uncommitted: committed at their amount."
    );
    describe_gauge!(
        "ringlimit_reservations_open",
        "Reservations this shard holds, not yet committed or expired."
    );
    describe_counter!(
        "ringlimit_leases_total",
        "Acquire calls decided on this node (outcome=granted, denied, or full: the shard's table)."
    );
    describe_counter!(
        "ringlimit_leases_expired_total",
        "Concurrency leases released by their TTL (never released by their holder)."
    );
    describe_gauge!(
        "ringlimit_leases_held",
        "Concurrency leases this shard holds."
    );
}

/// Budget leases of hot counters (docs/leases.md).
fn describe_budget_leases() {
    use metrics::describe_counter;
    describe_counter!(
        "ringlimit_budget_leases_total",
        "Budget leases, as owner: event=granted (a holder's first of the counter), renewed (it still held one), refused (no lease: algorithm, window end, floor, full table), returned (a holder gave unused units back), expired (a record forgotten TTL + 2 s after its lease ended without a return: spent in full, or its holder died or was cut off and its unused units stay charged)."
    );
    describe_counter!(
        "ringlimit_budget_lease_units_returned_total",
        "Units holders gave back to this owner's counters from budget leases they did not spend."
    );
    describe_counter!(
        "ringlimit_checks_from_lease_total",
        "Checks this node decided from a budget lease it held, without a hop to the key's owner."
    );
    describe_counter!(
        "ringlimit_budget_lease_units_lost_total",
        "Unused units of ended budget leases this node could not give back (owner gone, restarted or unreachable): an under-admission, never an over-admission."
    );
}

/// Checks and their answers, on every front end.
fn describe_checks() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_gauge!(
        "ringlimit_build_info",
        "Always 1; the version label names the running build."
    );
    describe_counter!(
        "ringlimit_checks_total",
        "Decisions made here, by verdict, algorithm and rule (at most 256 rule series per shard, then rule=\"other\")."
    );
    describe_histogram!(
        "ringlimit_check_duration_seconds",
        "Time to handle one check request."
    );
    describe_counter!(
        "ringlimit_degraded_total",
        "Answers given without the owner, by reason (fail_over: the successor decided on its replica; fail_open; fail_closed; fenced: a fenced rule's key this node may not decide now, denied)."
    );
    describe_gauge!(
        "ringlimit_fence_majority",
        "1 while this node hears a majority of the cluster and may decide fenced rules' keys, else 0 (their checks here are denied, degraded)."
    );
    describe_counter!(
        "ringlimit_deny_cache_hits_total",
        "Denials answered from the local deny cache, without a hop."
    );
    describe_histogram!(
        "ringlimit_envoy_rls_duration_seconds",
        "Time to answer one Envoy ShouldRateLimit call."
    );
    describe_histogram!(
        "ringlimit_gubernator_duration_seconds",
        "Time to answer one Gubernator GetRateLimits call (serve --gubernator)."
    );
    describe_counter!(
        "ringlimit_shadow_denials_total",
        "Checks a rule in shadow mode would have denied (they were allowed), by rule."
    );
    describe_counter!(
        "ringlimit_refused_total",
        "Requests refused before anything was charged, by reason (invalid_argument, overloaded, unavailable) and field."
    );
}

/// Checks forwarded to their owner over the peer link.
fn describe_forwarding() {
    use metrics::{describe_counter, describe_histogram};
    describe_counter!(
        "ringlimit_forwarded_total",
        "Checks forwarded to their owner."
    );
    describe_counter!(
        "ringlimit_forward_errors_total",
        "Forwards that failed or timed out."
    );
    describe_histogram!(
        "ringlimit_forward_batch_size",
        "Checks per forwarded batch."
    );
    describe_counter!(
        "ringlimit_forward_streams_opened_total",
        "Forward streams opened to peers (one per peer, renewed every 15 s; more means streams broke)."
    );
    describe_counter!(
        "ringlimit_forwarded_not_owner_total",
        "Forwarded checks decided here although this node's ring names another owner."
    );
    describe_counter!(
        "ringlimit_forwarded_stale_total",
        "Forwarded checks refused because their batch arrived after its deadline."
    );
}

/// The shard actors and the keys they hold.
fn describe_shards() {
    use metrics::{describe_counter, describe_gauge};
    describe_gauge!("ringlimit_keys", "Keys held, per shard.");
    describe_gauge!(
        "ringlimit_state_bytes",
        "Bytes of per-key state kept beside the key table (sliding logs), per shard; bounded by --max-state-bytes."
    );
    describe_gauge!(
        "ringlimit_shard_queue_depth",
        "Commands waiting in a shard's inbox."
    );
    describe_counter!("ringlimit_evictions_total", "Keys dropped at the key cap (their counts were lost), by shard and kind (live, denied). Alert on any increase.");
    describe_counter!(
        "ringlimit_expired_keys_total",
        "Idle keys dropped because their state was back to fresh (harmless)."
    );
}

/// Ownership moves: restarts, resets and the state handed over.
fn describe_ownership() {
    use metrics::describe_counter;
    describe_counter!(
        "ringlimit_ownership_resets_total",
        "Keys restarted from empty because their owner died or restarted."
    );
    describe_counter!(
        "ringlimit_member_restarts_total",
        "A peer came back with a new generation under the same id."
    );
    describe_counter!(
        "ringlimit_handoff_pushed_total",
        "Key states pushed to new owners on ownership moves."
    );
    describe_counter!(
        "ringlimit_handoff_installed_total",
        "Handed-over key states installed here."
    );
    describe_counter!(
        "ringlimit_handoff_failed_total",
        "Handoff pushes that failed."
    );
    describe_counter!(
        "ringlimit_handoff_deltas_total",
        "Admissions on handed-over keys pushed on to their new owners."
    );
    describe_counter!(
        "ringlimit_handoff_refused_total",
        "Handed-over states refused as implausible, by reason."
    );
}

/// The cluster key at work: refused peer calls and gossip datagrams.
fn describe_security() {
    use metrics::describe_counter;
    describe_counter!(
        "ringlimit_peer_auth_refused_total",
        "Peer calls refused UNAUTHENTICATED, by reason. Alert on any increase."
    );
    describe_counter!(
        "ringlimit_peer_frames_closed_total",
        "Framed peer connections ended other than by their sender, by reason: bad_magic, too_large, malformed (a frame that is not a call) and unauthenticated never come from a member of the same build; idle and io also do (a quiet link, a crashed or cut-off node)."
    );
    describe_counter!(
        "ringlimit_gossip_rejected_total",
        "Gossip datagrams dropped before chitchat saw them, by reason."
    );
    describe_counter!(
        "ringlimit_gossip_oversize_total",
        "Gossip envelopes too large to tag."
    );
    describe_counter!(
        "ringlimit_gossip_codec_failures_total",
        "Authentic gossip datagrams lost because the loopback codec failed (then reopened)."
    );
}

/// The gRPC listeners' connections.
fn describe_connections() {
    use metrics::{describe_counter, describe_gauge};
    describe_gauge!("ringlimit_grpc_connections", "Open gRPC connections.");
    describe_counter!(
        "ringlimit_connections_refused_total",
        "Connections closed at once because --max-connections were open."
    );
    describe_counter!(
        "ringlimit_accept_errors_total",
        "Failed accepts on a gRPC listener (e.g. at the file descriptor limit)."
    );
    describe_counter!(
        "ringlimit_ops_connections_closed_total",
        "Ops HTTP connections the node closed, by reason (evicted: the oldest idle one, for a new connection at the cap; refused: at the cap with every connection busy; header_timeout: no request head in time)."
    );
}

/// Rules and Envoy configuration: reloads, versions, drift between members.
fn describe_rules() {
    use metrics::{describe_counter, describe_gauge};
    describe_counter!(
        "ringlimit_envoy_config_reloads_total",
        "Reloads of the Envoy (envoyproxy/ratelimit) configuration from --envoy-config files or --envoy-xds, by result (ok: a new set enforced; error: refused, the current one kept)."
    );
    describe_counter!(
        "ringlimit_envoy_xds_updates_total",
        "RateLimitConfig sets received from the --envoy-xds control plane, by result (accepted: ACKed; rejected: NACKed, nothing applied)."
    );
    describe_gauge!(
        "ringlimit_envoy_xds_connected",
        "1 while this node is connected to its --envoy-xds control plane, else 0 (the last accepted set is still enforced)."
    );
    describe_counter!(
        "ringlimit_envoy_xds_stream_failures_total",
        "Attempts to reach the --envoy-xds control plane that failed, and streams to it that ended; each is followed by a reconnection with backoff."
    );
    describe_counter!(
        "ringlimit_rules_reloads_total",
        "Rule file reloads, by result (ok, error)."
    );
    describe_gauge!("ringlimit_rules_version", "Version of the rules this node enforces (cluster mode: the cluster's version; file mode: reloads since start).");
    describe_gauge!("ringlimit_rules_drift_nodes", "Members whose rules differ from this node's (different files, or mixed file and cluster sources).");
    describe_gauge!("ringlimit_envoy_config_drift_nodes", "Members whose Envoy domains differ from this node's (different --envoy-config files, --envoy-xds sets or --envoy-algorithm, or those flags on some nodes only).");
    describe_counter!(
        "ringlimit_rules_changes_total",
        "Rule sets swapped in, by origin (api, peer, file)."
    );
    describe_counter!(
        "ringlimit_rules_pull_failures_total",
        "Failed attempts to copy newer rules from a peer (retried every 500 ms)."
    );
    describe_counter!(
        "ringlimit_rules_persist_failures_total",
        "Rule sets copied from a peer that could not be written to --data-dir."
    );
}

/// The RESP face (`--resp-listen`, docs/redis-clients.md).
fn describe_resp() {
    use metrics::describe_counter;
    describe_counter!(
        "ringlimit_resp_connections_refused_total",
        "RESP connections closed at once because --resp-max-connections were open."
    );
    describe_counter!(
        "ringlimit_resp_protocol_errors_total",
        "RESP connections closed for bytes that are not RESP (or beyond its bounds)."
    );
}

/// The HTTP check face (`--check-http-listen`, docs/http-gateways.md).
fn describe_http_check() {
    use metrics::{describe_counter, describe_histogram};
    describe_histogram!(
        "ringlimit_http_check_duration_seconds",
        "Time to decide one POST /v1/check on the HTTP check face."
    );
    describe_histogram!(
        "ringlimit_forward_auth_duration_seconds",
        "Time to decide one gateway forward-auth subrequest on the HTTP check face."
    );
    describe_counter!(
        "ringlimit_http_check_connections_closed_total",
        "Connections the HTTP check face closed, by reason (evicted at the connection cap, header_timeout, head_too_large, refused)."
    );
}
