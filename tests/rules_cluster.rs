//! Rules as cluster state (issue 11): a change made through one node's ops port is
//! enforced by every node within 2 s, survives a restart from the data dir, is
//! conditional with `If-Match`, refuses bad bodies without changing anything, and two
//! nodes following different rule files report drift.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{client, eventually, http, key_owned_by, member_config, rules_file, start};
use ringlimit::config::rules::RulesSource;
use ringlimit::node::{NodeConfig, RunningNode};
use ringlimit::proto::CheckRequest;
use ringlimit::server::ops::AdminToken;

const TOKEN: &str = "test-admin-token-0123456789";
const ROUTE: &str = "POST /v1/charges";

fn bearer() -> String {
    format!("Bearer {TOKEN}")
}

fn cluster_config(id: &str, seeds: &[String], data_dir: &Path) -> NodeConfig {
    NodeConfig {
        data_dir: Some(data_dir.to_path_buf()),
        admin_token: Some(AdminToken::new(TOKEN).unwrap()),
        ..member_config(id, seeds, None)
    }
}

async fn three_nodes(dirs: &[tempfile::TempDir; 3]) -> Vec<RunningNode> {
    three_nodes_named(dirs, ["n1", "n2", "n3"]).await
}

async fn three_nodes_named(dirs: &[tempfile::TempDir; 3], ids: [&str; 3]) -> Vec<RunningNode> {
    let mut nodes: Vec<RunningNode> = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let seeds: Vec<String> = nodes
            .first()
            .map(|n| n.gossip_addr.to_string())
            .into_iter()
            .collect();
        nodes.push(start(cluster_config(id, &seeds, dirs[i].path())).await);
    }
    common::wait_converged(&nodes, 3).await;
    nodes
}

/// Three node ids for which the second coordinates rules writes: a write sent to the
/// first is forwarded to it, and the third (neither) learns it only from gossip and a
/// pull.
fn ids_coordinated_by_the_second() -> [String; 3] {
    (0..)
        .map(|i| [format!("a{i}"), format!("b{i}"), format!("c{i}")])
        .find(|ids| {
            let ring = ringlimit::ring::Ring::new(
                ids.iter().map(String::as_str),
                ringlimit::ring::Ring::DEFAULT_VNODES,
            );
            let coordinator = ring.owner_of_hash(ringlimit::ring::Ring::key_hash(
                ringlimit::cluster::rules::COORDINATOR_KEY,
            ));
            coordinator == Some(ids[1].as_str())
        })
        .unwrap()
}

/// Starts `first`, then `second(<first's gossip address>)` joining it, and waits until
/// both rings agree; also the instant the second started.
async fn two_nodes(
    first: NodeConfig,
    second: impl FnOnce(&[String]) -> NodeConfig,
) -> (Vec<RunningNode>, Instant) {
    let a = start(first).await;
    let started = Instant::now();
    let b = start(second(&[a.gossip_addr.to_string()])).await;
    let nodes = vec![a, b];
    common::wait_converged(&nodes, 2).await;
    (nodes, started)
}

/// Waits (at most 3 s) until `holds` is true of every node, and prints how long after
/// `since` it took; fails naming `what` otherwise.
async fn on_every_node(
    nodes: &[RunningNode],
    holds: impl Fn(&RunningNode) -> bool,
    what: &str,
    since: Instant,
) {
    assert!(
        eventually(Duration::from_secs(3), || nodes.iter().all(&holds)).await,
        "{what}: not within 3 s"
    );
    eprintln!("{what} {} ms later", since.elapsed().as_millis());
}

/// `GET /v1/cluster` on `node`, and its entry for member `id`.
async fn cluster_status_of(node: &RunningNode, id: &str) -> (serde_json::Value, serde_json::Value) {
    let status = http(ops(node), "GET", "/v1/cluster", &[], "").await.json();
    let member = status["members"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["node_id"] == id)
        .unwrap_or_else(|| panic!("{id} not in {status}"))
        .clone();
    (status, member)
}

fn ops(node: &RunningNode) -> SocketAddr {
    node.http_addr.expect("ops port")
}

/// The limit `node` answers for a free-tier charge by `key`.
async fn limit_on(node: &RunningNode, key: &str) -> (u64, String) {
    let answer = client(node)
        .await
        .check(CheckRequest {
            key: key.into(),
            route: ROUTE.into(),
            cost: Some(1),
            tier: Some("free".into()),
            descriptors: Vec::new(),
        })
        .await
        .expect("check answers")
        .into_inner();
    let decider = answer.decider.map(|d| d.node_id).unwrap_or_default();
    assert_eq!(
        decider, *node.decider.node_id,
        "the key was chosen to be decided by the node asked"
    );
    (answer.limit, answer.rule)
}

#[tokio::test]
async fn a_limit_put_on_node_1_is_enforced_by_node_3_within_2_s_and_kept_across_its_restart() {
    // Ids chosen so that node 2 coordinates rules writes: node 1 forwards the write
    // to it, and node 3 (neither) learns it only from gossip and a pull.
    let ids = ids_coordinated_by_the_second();
    let names = [ids[0].as_str(), ids[1].as_str(), ids[2].as_str()];
    let dirs = [(); 3].map(|_| tempfile::tempdir().unwrap());
    let mut nodes = three_nodes_named(&dirs, names).await;
    assert_eq!(
        ringlimit::cluster::rules::coordinator(&nodes[0].view())
            .unwrap()
            .node_id,
        names[1]
    );
    let key = key_owned_by(names[2], &names, "cust_");
    assert_eq!(
        limit_on(&nodes[2], &key).await,
        (100, "default".to_string())
    );
    assert_eq!(
        nodes[2].cluster_rules.current().version,
        0,
        "built-in rules"
    );

    let body = r#"{"route_pattern": "POST /v1/charges", "algorithm": "sliding_window_counter", "limit": 7, "window_s": 60, "burst": null}"#;
    let started = Instant::now();
    let put = http(
        ops(&nodes[0]),
        "PUT",
        "/v1/limits/free",
        &[("Authorization", &bearer())],
        body,
    )
    .await;
    assert_eq!(put.status, 200, "{}", put.body);
    let answer = put.json();
    assert_eq!(answer["version"], 1);
    assert_eq!(answer["rule"], "free-POST-v1-charges");
    assert_eq!(answer["coordinator"], names[1]);
    assert_eq!(put.header("etag"), Some("\"1\""));
    assert_eq!(
        nodes[0].cluster_rules.current().version,
        1,
        "the receiving node enforces the coordinator's answer at once"
    );

    // Node 3 decides with the new limit within 2 s.
    let deadline = started + Duration::from_secs(2);
    let elapsed = loop {
        if limit_on(&nodes[2], &key).await.0 == 7 {
            break started.elapsed();
        }
        assert!(
            Instant::now() < deadline,
            "node 3 still decides with the old limit after 2 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    eprintln!(
        "PUT on node 1 (coordinator node 2) → node 3 decides with limit 7 after {} ms",
        elapsed.as_millis()
    );
    let digest = nodes[0].cluster_rules.current().rules.digest();
    assert!(
        eventually(Duration::from_secs(2), || nodes.iter().all(|n| n
            .cluster_rules
            .current()
            .stamp()
            == nodes[0].cluster_rules.current().stamp()))
        .await,
        "every node holds version 1"
    );
    let via_api = http(ops(&nodes[2]), "GET", "/v1/limits/free", &[], "")
        .await
        .json();
    assert_eq!(via_api["version"], 1);
    assert_eq!(via_api["rules"][0]["limit"], 7);
    assert_eq!(via_api["rules"][0]["route_pattern"], ROUTE);

    // Node 3 restarted alone (no seeds: it cannot copy from anyone) starts from its copy.
    let n3 = nodes.pop().unwrap();
    n3.shutdown().await;
    let restarted = start(cluster_config(names[2], &[], dirs[2].path())).await;
    let current = restarted.cluster_rules.current();
    assert_eq!(current.version, 1);
    assert_eq!(current.rules.digest(), digest);
    assert_eq!(limit_on(&restarted, &key).await.0, 7);
    restarted.shutdown().await;

    // While node 3 is down the cluster moves on (other algorithms' fields by name); node 3
    // restarted with its seed starts from its copy (version 1) and catches up.
    let shaper = r#"{"route_pattern": "GET /v1/search", "algorithm": "leaky_bucket", "mode": "shaper", "queue_depth": 3, "limit": 20, "window": "1s", "on_unavailable": "closed", "per": "route"}"#;
    let put = http(
        ops(&nodes[0]),
        "PUT",
        "/v1/limits/free",
        &[("Authorization", &bearer())],
        shaper,
    )
    .await;
    assert_eq!(put.status, 200, "{}", put.body);
    assert_eq!(put.json()["version"], 2);
    let seeds = vec![nodes[0].gossip_addr.to_string()];
    let back = start(cluster_config(names[2], &seeds, dirs[2].path())).await;
    assert!(
        back.cluster_rules.current().version >= 1,
        "starts from its copy"
    );
    assert!(
        eventually(Duration::from_secs(3), || back
            .cluster_rules
            .current()
            .version
            == 2)
        .await,
        "the restarted node catches up"
    );
    let rule = back
        .rules
        .load()
        .get("free-GET-v1-search")
        .cloned()
        .expect("the shaper rule");
    assert_eq!(
        rule.spec,
        ringlimit::config::AlgorithmSpec::LeakyBucket {
            limit: std::num::NonZeroU64::new(20).unwrap(),
            period: Duration::from_secs(1),
            mode: ringlimit::config::LeakyMode::Shaper { queue_depth: 3 },
        }
    );
    assert_eq!(rule.on_unavailable, ringlimit::config::FailMode::Closed);
    assert_eq!(rule.per, ringlimit::config::rules::CountPer::Route);
    back.shutdown().await;
    for n in nodes {
        n.shutdown().await;
    }
}

#[tokio::test]
async fn a_stale_if_match_gets_412_and_a_bad_body_gets_400_naming_the_field_and_nothing_changes() {
    let dirs = [(); 3].map(|_| tempfile::tempdir().unwrap());
    let nodes = three_nodes(&dirs).await;
    let addr = ops(&nodes[0]);
    let auth = bearer();
    let good = r#"{"route_pattern": "POST /v1/charges", "limit": 5, "window_s": 60}"#;
    let put = http(
        addr,
        "PUT",
        "/v1/limits/free",
        &[("Authorization", &auth), ("If-Match", "\"0\"")],
        good,
    )
    .await;
    assert_eq!(put.status, 200, "{}", put.body);
    assert!(
        eventually(Duration::from_secs(2), || nodes.iter().all(|n| n
            .cluster_rules
            .current()
            .version
            == 1))
        .await
    );
    let before: Vec<_> = nodes
        .iter()
        .map(|n| n.cluster_rules.current().stamp())
        .collect();

    // A writer that read version 0 and writes after version 1 exists: refused.
    let stale = http(
        addr,
        "PUT",
        "/v1/limits/free",
        &[("Authorization", &auth), ("If-Match", "\"0\"")],
        good,
    )
    .await;
    assert_eq!(stale.status, 412, "{}", stale.body);
    assert!(
        stale.json()["error"]
            .as_str()
            .unwrap()
            .contains("current version is 1"),
        "{}",
        stale.body
    );
    let stale_doc = http(
        ops(&nodes[1]),
        "PUT",
        "/v1/rules",
        &[("Authorization", &auth), ("If-Match", "0")],
        "[default]\nlimit = 1\nwindow = \"1s\"\n",
    )
    .await;
    assert_eq!(stale_doc.status, 412, "{}", stale_doc.body);

    // Bad bodies: the messages of `ringlimit rules check`, naming rule and field.
    for (path, body, content_type, names) in [
        (
            "/v1/limits/free",
            r#"{"route_pattern": "POST /v1/charges", "limit": 0, "window_s": 60}"#,
            "application/json",
            "field \"limit\": must be an integer >= 1 (got 0)",
        ),
        (
            "/v1/limits/free",
            r#"{"route_pattern": "POST /v1/charges", "limit": 5, "window_s": 0}"#,
            "application/json",
            "field \"window_s\"",
        ),
        (
            "/v1/limits/free",
            r#"{"route_pattern": "POST /v1/charges", "limit": 5, "window_s": 60, "algorithm": "magic"}"#,
            "application/json",
            "field \"algorithm\"",
        ),
        (
            "/v1/limits/free",
            r#"{"route_pattern": "POST /v1/charges", "limt": 5}"#,
            "application/json",
            "unknown field `limt`",
        ),
        (
            "/v1/rules",
            "[[rule]]\nname = \"x\"\ntier = \"free\"\nlimit = 5\nwindow = \"10q\"\n",
            "application/toml",
            "rule \"x\": field \"window\"",
        ),
        ("/v1/rules", "", "application/toml", "defines no rules"),
        (
            "/v1/rules",
            r#"{"rule": [{"name": "x", "tier": "free", "limit": -1, "window": "1s"}]}"#,
            "application/json",
            "rule \"x\": field \"limit\"",
        ),
    ] {
        let answer = http(
            addr,
            "PUT",
            path,
            &[("Authorization", &auth), ("Content-Type", content_type)],
            body,
        )
        .await;
        assert_eq!(answer.status, 400, "{path} {body}: {}", answer.body);
        let message = answer.json()["error"].as_str().unwrap().to_string();
        assert!(message.contains(names), "{path} {body}: {message}");
    }
    // Without the token, with a wrong one: refused before anything is read.
    let anonymous = http(addr, "PUT", "/v1/limits/free", &[], good).await;
    assert_eq!(anonymous.status, 401);
    let wrong = http(
        addr,
        "PUT",
        "/v1/limits/free",
        &[("Authorization", "Bearer not-the-token-at-all")],
        good,
    )
    .await;
    assert_eq!(wrong.status, 401);

    // Nothing changed anywhere, even after gossip had time to carry a change.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let after: Vec<_> = nodes
        .iter()
        .map(|n| n.cluster_rules.current().stamp())
        .collect();
    assert_eq!(before, after);
    assert_eq!(
        nodes[2]
            .rules
            .load()
            .get("free-POST-v1-charges")
            .unwrap()
            .spec
            .limit()
            .get(),
        5
    );

    // DELETE removes the rule (and a second DELETE finds nothing).
    let path = "/v1/limits/free?route_pattern=POST+%2Fv1%2Fcharges";
    let deleted = http(addr, "DELETE", path, &[("Authorization", &auth)], "").await;
    assert_eq!(deleted.status, 200, "{}", deleted.body);
    assert_eq!(deleted.json()["version"], 2);
    let again = http(addr, "DELETE", path, &[("Authorization", &auth)], "").await;
    assert_eq!(again.status, 404, "{}", again.body);
    assert!(
        eventually(Duration::from_secs(2), || nodes[2]
            .rules
            .load()
            .get("free-POST-v1-charges")
            .is_none())
        .await
    );
    for n in nodes {
        n.shutdown().await;
    }
}

#[tokio::test]
async fn a_node_without_an_admin_token_refuses_every_write() {
    let node = start(NodeConfig::for_test()).await;
    let answer = http(
        ops(&node),
        "PUT",
        "/v1/rules",
        &[("Authorization", "Bearer anything-at-all-here")],
        "[default]\nlimit = 1\nwindow = \"1s\"\n",
    )
    .await;
    assert_eq!(answer.status, 403, "{}", answer.body);
    assert_eq!(node.cluster_rules.current().version, 0);
    node.shutdown().await;
}

/// Two writers, two nodes, the same moment. Writes are ordered by the rules coordinator
/// (the ring owner of `ringlimit/rules`), so without `If-Match` both are applied one after
/// the other and every node ends at the later one; with the same `If-Match` exactly one
/// wins and the other gets 412 (no lost update).
#[tokio::test]
async fn two_writers_racing_on_two_nodes_are_ordered_by_the_coordinator() {
    let dirs = [(); 3].map(|_| tempfile::tempdir().unwrap());
    let nodes = three_nodes(&dirs).await;
    let coordinator = ringlimit::cluster::rules::coordinator(&nodes[0].view())
        .unwrap()
        .node_id
        .clone();
    // The two writers use the two nodes that are not the coordinator, so both writes
    // travel over the peer face.
    let writers: Vec<&RunningNode> = nodes
        .iter()
        .filter(|n| *n.decider.node_id != *coordinator)
        .collect();
    assert_eq!(writers.len(), 2);
    let auth = bearer();
    let doc = |limit: u32| {
        format!("[[rule]]\nname = \"race\"\ntier = \"free\"\nlimit = {limit}\nwindow = \"1m\"\n")
    };

    // Without If-Match: both applied, in some order.
    let (a, b) = (doc(11), doc(22));
    let headers = [("Authorization", auth.as_str())];
    let (ra, rb) = tokio::join!(
        http(ops(writers[0]), "PUT", "/v1/rules", &headers, &a),
        http(ops(writers[1]), "PUT", "/v1/rules", &headers, &b),
    );
    assert_eq!(
        (ra.status, rb.status),
        (200, 200),
        "{} / {}",
        ra.body,
        rb.body
    );
    assert_eq!(ra.json()["coordinator"], coordinator.as_str());
    let mut versions = [
        ra.json()["version"].as_u64().unwrap(),
        rb.json()["version"].as_u64().unwrap(),
    ];
    versions.sort();
    assert_eq!(
        versions,
        [1, 2],
        "one after the other, never both version 1"
    );
    let last = if ra.json()["version"] == 2 { 11 } else { 22 };
    assert!(
        eventually(Duration::from_secs(2), || nodes.iter().all(|n| {
            let current = n.cluster_rules.current();
            current.version == 2 && current.rules.get("race").unwrap().spec.limit().get() == last
        }))
        .await,
        "every node enforces the later write: {:?}",
        nodes
            .iter()
            .map(|n| n.cluster_rules.current().stamp())
            .collect::<Vec<_>>()
    );

    // With the same If-Match: one 200, one 412.
    let (c, d) = (doc(33), doc(44));
    let conditional = [("Authorization", auth.as_str()), ("If-Match", "\"2\"")];
    let (rc, rd) = tokio::join!(
        http(ops(writers[0]), "PUT", "/v1/rules", &conditional, &c),
        http(ops(writers[1]), "PUT", "/v1/rules", &conditional, &d),
    );
    let mut statuses = [rc.status, rd.status];
    statuses.sort();
    assert_eq!(statuses, [200, 412], "{} / {}", rc.body, rd.body);
    let won = if rc.status == 200 { 33 } else { 44 };
    assert!(
        eventually(Duration::from_secs(2), || nodes.iter().all(|n| {
            let current = n.cluster_rules.current();
            current.version == 3 && current.rules.get("race").unwrap().spec.limit().get() == won
        }))
        .await
    );
    for n in nodes {
        n.shutdown().await;
    }
}

#[tokio::test]
async fn nodes_following_different_rule_files_report_drift_and_refuse_writes() {
    let (_da, file_a) = rules_file("[default]\nlimit = 5\nwindow = \"1m\"\n");
    let (_db, file_b) = rules_file("[default]\nlimit = 100\nwindow = \"1m\"\n");
    let mut config_a = member_config("fa", &[], Some(&file_a));
    config_a.admin_token = Some(AdminToken::new(TOKEN).unwrap());
    let (nodes, started) =
        two_nodes(config_a, |seeds| member_config("fb", seeds, Some(&file_b))).await;
    let a = &nodes[0];
    assert_eq!(a.cluster_rules.source(), RulesSource::File);
    on_every_node(
        &nodes,
        |n| !n.cluster_rules.drift().is_empty(),
        "drift reported after the second node started:",
        started,
    )
    .await;
    assert_eq!(a.cluster_rules.drift()[0].0, "fb");
    let (status, fb) = cluster_status_of(a, "fb").await;
    assert_eq!(status["rules_drift"], true);
    assert_eq!(fb["rules_drift"], true);
    assert_eq!(fb["rules_source"], "file");
    assert!(common::metric_sum("ringlimit_rules_drift_nodes") >= 1.0);
    // The peer face's status (what `ringlimit cluster status` prints) flags it too.
    let mut peer = ringlimit::proto::peer::peer_client::PeerClient::new(
        ringlimit::cluster::link::Signed::new(
            tonic::transport::Endpoint::from_shared(format!("http://{}", a.peer_addr))
                .unwrap()
                .connect()
                .await
                .unwrap(),
            NodeConfig::for_test().cluster_key,
            "test".into(),
        ),
    );
    let peer_status = peer
        .status(ringlimit::proto::peer::StatusRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(
        peer_status.rules.starts_with("file 1 "),
        "{}",
        peer_status.rules
    );
    assert!(peer_status
        .members
        .iter()
        .any(|m| m.node_id == "fb" && m.rules_drift));
    // File mode: the API is read-only, even with the token.
    let put = http(
        ops(a),
        "PUT",
        "/v1/rules",
        &[("Authorization", &bearer())],
        "[default]\nlimit = 1\nwindow = \"1s\"\n",
    )
    .await;
    assert_eq!(put.status, 409, "{}", put.body);

    // The same file on both: drift resolved.
    let rewritten = Instant::now();
    std::fs::write(&file_b, "[default]\nlimit = 5\nwindow = \"1m\"\n").unwrap();
    on_every_node(
        &nodes,
        |n| n.cluster_rules.drift().is_empty(),
        "drift resolved after the file was rewritten:",
        rewritten,
    )
    .await;
    for n in nodes {
        n.shutdown().await;
    }
}

const ENVOY_A: &str =
    "domain: gw\ndescriptors:\n  - key: ip\n    rate_limit: {unit: minute, requests_per_unit: 5}\n";

/// A node of its own cluster-mode rules, following the Envoy file `envoy`.
fn envoy_file_config(id: &str, seeds: &[String], envoy: &Path) -> NodeConfig {
    NodeConfig {
        envoy_path: Some(envoy.to_path_buf()),
        ..member_config(id, seeds, None)
    }
}

#[tokio::test]
async fn nodes_following_different_envoy_files_report_drift_until_the_files_agree() {
    let dir = tempfile::tempdir().unwrap();
    let (file_a, file_b) = (dir.path().join("a.yaml"), dir.path().join("b.yaml"));
    std::fs::write(&file_a, ENVOY_A).unwrap();
    std::fs::write(&file_b, ENVOY_A.replace("5}", "100}")).unwrap();
    let (nodes, started) = two_nodes(envoy_file_config("ea", &[], &file_a), |seeds| {
        envoy_file_config("eb", seeds, &file_b)
    })
    .await;
    let (a, b) = (&nodes[0], &nodes[1]);
    on_every_node(
        &nodes,
        |n| !n.cluster_rules.envoy_drift().is_empty(),
        "envoy drift reported after the second node started:",
        started,
    )
    .await;
    assert_eq!(a.cluster_rules.envoy_drift()[0].0, "eb");
    assert!(
        a.cluster_rules.drift().is_empty(),
        "the TOML rules agree: only the Envoy files differ"
    );
    let (status, eb) = cluster_status_of(a, "eb").await;
    assert_eq!(status["envoy_drift"], true);
    assert_eq!(status["rules_drift"], false);
    assert_eq!(eb["envoy_drift"], true);
    assert!(
        eb["envoy_config"].as_str().unwrap().starts_with("file 1 "),
        "{eb}"
    );
    assert!(common::metric_sum("ringlimit_envoy_config_drift_nodes") >= 1.0);
    // The peer face's status, what `ringlimit cluster status` prints as DRIFT.
    let secret = dir.path().join("cluster.secret");
    std::fs::write(&secret, ringlimit::node::config::TEST_CLUSTER_SECRET).unwrap();
    let (code, out, err) = cli(vec![
        "cluster".into(),
        "status".into(),
        "--addr".into(),
        a.peer_addr.to_string(),
        "--cluster-secret-file".into(),
        secret.display().to_string(),
    ])
    .await;
    assert_eq!(code, 0, "{err}");
    let eb_line = out
        .lines()
        .find(|l| l.starts_with("eb "))
        .unwrap_or_default();
    assert!(eb_line.contains("DRIFT"), "{out}");
    assert!(
        out.contains("envoy config drift: eb enforces different Envoy domains than ea"),
        "{out}"
    );

    // The same domains on both (another layout and a comment: the digest is of what is
    // parsed), picked up by the hot reload: drift resolved.
    let resolving = Instant::now();
    std::fs::write(
        &file_b,
        "# the same limit as a.yaml\ndomain: gw\ndescriptors:\n- key: ip\n  rate_limit:\n    requests_per_unit: 5\n    unit: minute\n",
    )
    .unwrap();
    on_every_node(
        &nodes,
        |n| n.cluster_rules.envoy_drift().is_empty(),
        "envoy drift resolved after the file was rewritten:",
        resolving,
    )
    .await;
    assert!(
        matches!(b.cluster_rules.envoy_advert(), ringlimit::config::rules::EnvoyAdvert::File(s) if s.version == 2),
        "{:?}",
        b.cluster_rules.envoy_advert()
    );
    for n in nodes {
        n.shutdown().await;
    }
}

/// One `ShouldRateLimit` for `(ip, <ip>)` in domain `gw` on `node`: its code, and the
/// limit and remaining of its one descriptor (`None` when no limit applies).
async fn envoy_ask(node: &RunningNode, ip: &str) -> (i32, Option<(u32, u32)>) {
    use ringlimit::proto::envoy::extensions::common::ratelimit::v3::{
        rate_limit_descriptor::Entry, RateLimitDescriptor,
    };
    use ringlimit::proto::envoy::service::ratelimit::v3::{
        rate_limit_service_client::RateLimitServiceClient, RateLimitRequest,
    };
    let mut client = RateLimitServiceClient::connect(format!("http://{}", node.grpc_addr))
        .await
        .unwrap();
    let answer = client
        .should_rate_limit(RateLimitRequest {
            domain: "gw".into(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: "ip".into(),
                    value: ip.into(),
                }],
                ..Default::default()
            }],
            hits_addend: 0,
        })
        .await
        .expect("ShouldRateLimit answers")
        .into_inner();
    let status = &answer.statuses[0];
    let limit = status
        .current_limit
        .as_ref()
        .map(|l| (l.requests_per_unit, status.limit_remaining));
    (answer.overall_code, limit)
}

/// `PUT /v1/rules/envoy` on `node` with `If-Match: "<if_match>"`.
async fn put_envoy(node: &RunningNode, if_match: u64, body: &str) -> common::HttpAnswer {
    let if_match = format!("\"{if_match}\"");
    http(
        ops(node),
        "PUT",
        "/v1/rules/envoy",
        &[("Authorization", &bearer()), ("If-Match", &if_match)],
        body,
    )
    .await
}

/// An `[envoy]` section of one domain `gw`: 3 per hour per `ip`, token bucket (whole
/// tokens refill every 20 minutes, so counts in a test are exact).
const ENVOY_SECTION: &str = r##"{"domains": ["# gateway limits\ndomain: gw\ndescriptors:\n  - key: ip\n    rate_limit: {unit: hour, requests_per_unit: 3, algorithm: token_bucket}\n"]}"##;

#[tokio::test]
async fn an_envoy_domain_put_on_node_1_is_enforced_by_node_3_and_kept_across_its_restart() {
    use ringlimit::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
    let (ok, over) = (Code::Ok as i32, Code::OverLimit as i32);
    let ids = ids_coordinated_by_the_second();
    let names = [ids[0].as_str(), ids[1].as_str(), ids[2].as_str()];
    let dirs = [(); 3].map(|_| tempfile::tempdir().unwrap());
    let mut nodes = three_nodes_named(&dirs, names).await;
    assert_eq!(
        envoy_ask(&nodes[2], "1.2.3.4").await,
        (ok, None),
        "no domain yet"
    );

    // A bad section: 400 naming the domain, the key and the line; nothing changes.
    let bad = ENVOY_SECTION.replace("rate_limit:", "rate_limt:");
    let put = put_envoy(&nodes[0], 0, &bad).await;
    assert_eq!(put.status, 400, "{}", put.body);
    let message = put.json()["error"].as_str().unwrap().to_string();
    for part in [
        "envoy.domains[0] (domain \"gw\")",
        "unknown field `rate_limt`",
        "line 5",
    ] {
        assert!(message.contains(part), "{part:?} not in {message}");
    }
    assert_eq!(
        nodes[1].cluster_rules.current().version,
        0,
        "nothing changed"
    );

    let started = Instant::now();
    let put = put_envoy(&nodes[0], 0, ENVOY_SECTION).await;
    assert_eq!(put.status, 200, "{}", put.body);
    assert_eq!(put.json()["version"], 1);
    assert_eq!(put.json()["coordinator"], names[1]);
    // Node 3 learns it from gossip and a pull, and its RLS answers with the limit.
    let deadline = started + Duration::from_secs(2);
    let elapsed = loop {
        if nodes[2].cluster_rules.current().version == 1 {
            break started.elapsed();
        }
        assert!(
            Instant::now() < deadline,
            "node 3 has not copied version 1 after 2 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    assert_eq!(envoy_ask(&nodes[2], "1.2.3.4").await, (ok, Some((3, 2))));
    eprintln!(
        "PUT /v1/rules/envoy on node 1 (coordinator node 2) → node 3 enforces it after {} ms (RLS answered after {} ms)",
        elapsed.as_millis(),
        started.elapsed().as_millis()
    );
    on_every_node(
        &nodes,
        |n| n.cluster_rules.current().version == 1,
        "every node holds version 1:",
        started,
    )
    .await;
    // The same counter whichever node is asked.
    assert_eq!(envoy_ask(&nodes[0], "1.2.3.4").await, (ok, Some((3, 1))));
    let rules = http(ops(&nodes[2]), "GET", "/v1/rules", &[], "").await;
    assert!(rules.body.contains("[envoy]"), "{}", rules.body);
    assert!(
        rules.body.contains("# gateway limits"),
        "the YAML as written: {}",
        rules.body
    );

    // A stale If-Match: 412, nothing changes.
    let put = put_envoy(&nodes[2], 0, "null").await;
    assert_eq!(put.status, 412, "{}", put.body);

    // An unrelated TOML change keeps the Envoy limit's counter (as a TOML rule's).
    let changed = Instant::now();
    let put = http(
        ops(&nodes[0]),
        "PUT",
        "/v1/limits/free",
        &[("Authorization", &bearer())],
        r#"{"route_pattern": "POST /v1/charges", "limit": 7, "window_s": 60}"#,
    )
    .await;
    assert_eq!(put.status, 200, "{}", put.body);
    on_every_node(
        &nodes,
        |n| n.cluster_rules.current().version == 2,
        "every node holds version 2 (a tier rule changed):",
        changed,
    )
    .await;
    assert_eq!(envoy_ask(&nodes[2], "1.2.3.4").await, (ok, Some((3, 0))));
    assert_eq!(envoy_ask(&nodes[1], "1.2.3.4").await.0, over);

    // Node 3 restarted alone (no seeds) serves the domain from its data dir.
    let n3 = nodes.pop().unwrap();
    n3.shutdown().await;
    let restarted = start(cluster_config(names[2], &[], dirs[2].path())).await;
    assert_eq!(restarted.cluster_rules.current().version, 2);
    assert_eq!(envoy_ask(&restarted, "5.6.7.8").await, (ok, Some((3, 2))));
    restarted.shutdown().await;
    // Removing the section removes the domain.
    let put = put_envoy(&nodes[0], 2, "null").await;
    assert_eq!(put.status, 200, "{}", put.body);
    assert_eq!(envoy_ask(&nodes[0], "1.2.3.4").await, (ok, None));
    for n in nodes {
        n.shutdown().await;
    }
}

#[tokio::test]
async fn the_ops_port_answers_health_readiness_and_owners_without_charging() {
    let dirs = [(); 3].map(|_| tempfile::tempdir().unwrap());
    let nodes = three_nodes(&dirs).await;
    let addr = ops(&nodes[1]);
    assert_eq!(http(addr, "GET", "/healthz", &[], "").await.status, 200);
    // Ready once it has asked the members it sees for replicas of its keys (a fresh
    // member finds none): a moment after the rings converge.
    let mut ready = http(addr, "GET", "/readyz", &[], "").await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while ready.status != 200 && std::time::Instant::now() < deadline {
        assert!(ready.body.contains("restoring"), "{}", ready.body);
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        ready = http(addr, "GET", "/readyz", &[], "").await;
    }
    assert_eq!(ready.status, 200, "{}", ready.body);
    let key = key_owned_by("n3", &["n1", "n2", "n3"], "who_");
    let owner = http(addr, "GET", &format!("/v1/owner?key={key}"), &[], "").await;
    assert_eq!(owner.status, 200, "{}", owner.body);
    assert_eq!(owner.json()["owner"]["node_id"], "n3");
    let keys_before = nodes[2].shards.keys().await.unwrap();
    assert_eq!(keys_before, 0, "asking charges nothing");
    assert_eq!(http(addr, "GET", "/v1/owner", &[], "").await.status, 400);
    let cluster = http(addr, "GET", "/v1/cluster", &[], "").await.json();
    assert_eq!(cluster["members"].as_array().unwrap().len(), 3);
    assert_eq!(cluster["rules"]["source"], "cluster");
    assert_eq!(cluster["rules_drift"], false);
    let rules = http(addr, "GET", "/v1/rules", &[], "").await;
    assert_eq!(rules.status, 200);
    assert_eq!(rules.header("etag"), Some("\"0\""));
    assert!(rules.body.contains("[default]"), "{}", rules.body);
    // A check on every node, so the hot-path metrics exist too.
    for n in &nodes {
        let _ = client(n)
            .await
            .check(common::check("m", "GET /m", None))
            .await;
    }
    let metrics = http(addr, "GET", "/metrics", &[], "").await;
    assert!(
        metrics.body.contains("ringlimit_rules_version"),
        "{}",
        metrics.body
    );
    assert!(
        metrics.body.contains("ringlimit_build_info{version=\""),
        "{}",
        metrics.body
    );
    // Decisions are counted per rule (a bounded label).
    assert!(
        metrics.body.contains(
            "ringlimit_checks_total{verdict=\"allowed\",algorithm=\"sliding_window_counter\",rule=\"default\"}"
        ),
        "{}",
        metrics.body
    );
    // Every metric says what it is.
    for line in metrics.body.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let name = rest.split(' ').next().unwrap();
            assert!(
                metrics.body.contains(&format!("# HELP {name} ")),
                "{name} has no # HELP line"
            );
        }
    }

    // A node with seeds that sees no one is alive but not ready.
    let lonely = start(member_config("alone", &["127.0.0.1:9".to_string()], None)).await;
    assert_eq!(
        http(ops(&lonely), "GET", "/readyz", &[], "").await.status,
        503
    );
    assert_eq!(
        http(ops(&lonely), "GET", "/healthz", &[], "").await.status,
        200
    );
    lonely.shutdown().await;
    for n in nodes {
        n.shutdown().await;
    }
}

#[tokio::test]
async fn a_seed_file_seeds_an_empty_cluster_at_version_1() {
    let (_d, seed) = rules_file("[default]\nlimit = 9\nwindow = \"1m\"\n");
    let dir = tempfile::tempdir().unwrap();
    let config = NodeConfig {
        rules_seed: Some(seed.clone()),
        data_dir: Some(dir.path().to_path_buf()),
        ..NodeConfig::for_test()
    };
    let node = start(config.clone()).await;
    assert_eq!(node.cluster_rules.current().version, 1);
    assert_eq!(node.rules.load().default_rule().spec.limit().get(), 9);
    node.shutdown().await;
    // Restarted with another seed: the stored copy wins (the seed is for an empty cluster).
    std::fs::write(&seed, "[default]\nlimit = 1\nwindow = \"1m\"\n").unwrap();
    let node = start(config).await;
    assert_eq!(node.rules.load().default_rule().spec.limit().get(), 9);
    node.shutdown().await;
}

/// Runs the `ringlimit` binary with `args`; (exit code, stdout, stderr).
async fn cli(args: Vec<String>) -> (i32, String, String) {
    tokio::task::spawn_blocking(move || {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_ringlimit"))
            .args(&args)
            .output()
            .expect("the binary runs");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn the_cli_gets_puts_and_diffs_rules_and_names_owners() {
    let dirs = [(); 3].map(|_| tempfile::tempdir().unwrap());
    let nodes = three_nodes(&dirs).await;
    let addr = ops(&nodes[0]).to_string();
    let token_dir = tempfile::tempdir().unwrap();
    let token = token_dir.path().join("admin.token");
    std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
    let (_d, file) =
        rules_file("[[rule]]\nname = \"free\"\ntier = \"free\"\nlimit = 4\nwindow = \"1m\"\n");
    let s = |p: &Path| p.display().to_string();

    let (code, out, err) = cli(vec![
        "rules".into(),
        "diff".into(),
        s(&file),
        "--addr".into(),
        addr.clone(),
    ])
    .await;
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("+ rule \"free\""), "{out}");

    // `rules put <what> … --if-match V`.
    let put_with = |what: &[String], if_match: &str| {
        let mut args: Vec<String> = vec!["rules".into(), "put".into()];
        args.extend_from_slice(what);
        args.extend([
            "--addr".into(),
            addr.clone(),
            "--admin-token-file".into(),
            s(&token),
            "--if-match".into(),
            if_match.into(),
        ]);
        args
    };
    let put = |if_match: &str| put_with(&[s(&file)], if_match);
    let (code, out, err) = cli(put("0")).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("accepted: version 1 digest "), "{out}");
    let (code, _, err) = cli(put("0")).await;
    assert_eq!(code, 1);
    assert!(err.contains("412"), "{err}");

    let (code, out, _) = cli(vec![
        "rules".into(),
        "diff".into(),
        s(&file),
        "--addr".into(),
        addr.clone(),
    ])
    .await;
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("matches the cluster's rules (version 1)"),
        "{out}"
    );

    // Another node answers `get` with the copied version.
    assert!(
        eventually(Duration::from_secs(2), || nodes[2]
            .cluster_rules
            .current()
            .version
            == 1)
        .await
    );
    let (code, out, _) = cli(vec![
        "rules".into(),
        "get".into(),
        "--addr".into(),
        ops(&nodes[2]).to_string(),
    ])
    .await;
    assert_eq!(code, 0);
    assert!(out.starts_with("# rules version 1, digest "), "{out}");
    assert!(out.contains("limit = 4"), "{out}");

    // A bad file is refused locally, with the rule check's message, and nothing is sent.
    let (_b, bad) =
        rules_file("[[rule]]\nname = \"free\"\ntier = \"free\"\nlimit = 0\nwindow = \"1m\"\n");
    let (code, _, err) = cli(vec![
        "rules".into(),
        "put".into(),
        s(&bad),
        "--addr".into(),
        addr.clone(),
        "--admin-token-file".into(),
        s(&token),
    ])
    .await;
    assert_eq!(code, 1);
    assert!(err.contains("rule \"free\": field \"limit\""), "{err}");
    assert_eq!(nodes[0].cluster_rules.current().version, 1);

    // `--envoy DIR`: the [envoy] section alone, from a directory of YAML files (checked
    // locally with the --envoy-config parser); the TOML rules stay as they are.
    let envoy_dir = tempfile::tempdir().unwrap();
    std::fs::write(envoy_dir.path().join("gw.yaml"), ENVOY_A).unwrap();
    let put_envoy = |if_match: &str| put_with(&["--envoy".into(), s(envoy_dir.path())], if_match);
    let (code, out, err) = cli(put_envoy("1")).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("accepted: version 2 digest "), "{out}");
    let current = nodes[0].cluster_rules.current();
    assert_eq!(current.rules.envoy().domains().collect::<Vec<_>>(), ["gw"]);
    assert!(current.rules.get("free").is_some(), "the TOML rule is kept");
    let (code, out, _) = cli(vec![
        "rules".into(),
        "diff".into(),
        s(&file),
        "--addr".into(),
        addr.clone(),
    ])
    .await;
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("- envoy domain \"gw\""), "{out}");
    std::fs::write(
        envoy_dir.path().join("gw.yaml"),
        ENVOY_A.replace("unit: minute", "unit: month"),
    )
    .unwrap();
    let (code, _, err) = cli(put_envoy("2")).await;
    assert_eq!(code, 1);
    assert!(
        err.contains("gw.yaml") && err.contains("at most 7 days"),
        "{err}"
    );
    assert_eq!(nodes[0].cluster_rules.current().version, 2, "nothing sent");

    // A whole rule file without an [envoy] section would remove the cluster's Envoy
    // domains: refused unless --drop-envoy, and nothing is sent.
    let (code, _, err) = cli(put("2")).await;
    assert_eq!(code, 1);
    assert!(
        err.contains("[envoy] section (1 domains)") && err.contains("--drop-envoy"),
        "{err}"
    );
    assert_eq!(nodes[0].cluster_rules.current().version, 2, "nothing sent");

    // --dry-run: which rule and which decider, from the ops port; nothing charged.
    let dry_key = key_owned_by("n3", &["n1", "n2", "n3"], "dry_");
    let (code, out, err) = cli(vec![
        "check".into(),
        "--dry-run".into(),
        "--ops-addr".into(),
        addr.clone(),
        "--key".into(),
        dry_key.clone(),
        "--route".into(),
        ROUTE.into(),
        "--tier".into(),
        "free".into(),
    ])
    .await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("rule=free (matched at level tier)"), "{out}");
    assert!(out.contains("limit=4"), "{out}");
    assert!(out.contains("decided by n3"), "{out}");
    for n in &nodes {
        assert_eq!(
            n.shards.keys().await.unwrap(),
            0,
            "a dry run charges nothing"
        );
    }
    // Exit codes: 0 allowed, 1 denied (a second descriptor exhausted), 2 refused.
    let grpc = nodes[0].grpc_addr.to_string();
    let check_args = |extra: &[&str]| {
        let mut v: Vec<String> = vec![
            "check".into(),
            "--addr".into(),
            grpc.clone(),
            "--route".into(),
            ROUTE.into(),
            "--tier".into(),
            "free".into(),
        ];
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let (code, _, _) = cli(check_args(&["--key", "ip_1", "--cost", "4"])).await;
    assert_eq!(code, 0);
    let (code, out, _) = cli(check_args(&[
        "--key",
        "cust_1",
        "--descriptor",
        "ip_1",
        "--json",
    ]))
    .await;
    assert_eq!(code, 1, "ip_1 is exhausted: {out}");
    let answer: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(answer["allowed"], false);
    assert_eq!(answer["descriptors"].as_array().unwrap().len(), 2);
    assert!(
        answer["sequence"].is_string(),
        "64-bit ids as strings: {out}"
    );
    assert!(answer["decider"]["generation"].is_string(), "{out}");
    let (code, _, _) = cli(check_args(&["--key", "cust_1", "--cost", "0"])).await;
    assert_eq!(code, 2);

    let key = key_owned_by("n2", &["n1", "n2", "n3"], "own_");
    let (code, out, _) = cli(vec![
        "owner".into(),
        "--key".into(),
        key.clone(),
        "--addr".into(),
        addr.clone(),
    ])
    .await;
    assert_eq!(code, 0);
    assert!(out.starts_with(&format!("{key} is owned by n2@")), "{out}");

    // With --drop-envoy the same file goes through and the domains are gone.
    let mut drop = put("2");
    drop.push("--drop-envoy".into());
    let (code, out, err) = cli(drop).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("accepted: version 3 digest "), "{out}");
    assert_eq!(
        nodes[0]
            .cluster_rules
            .current()
            .rules
            .envoy()
            .domains()
            .count(),
        0
    );
    for n in nodes {
        n.shutdown().await;
    }
}

/// A real `ringlimit serve` process with the cluster-mode flags (and the old name of
/// the ops flag); killed and reaped on drop.
struct ServeProcess(std::process::Child);

impl Drop for ServeProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Spawns `serve` with `args` and returns it with the ops address from its ready line.
async fn serve_process(args: Vec<String>) -> (ServeProcess, SocketAddr) {
    tokio::task::spawn_blocking(move || {
        use std::io::BufRead;
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_ringlimit"))
            .arg("serve")
            .args(&args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("serve starts");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if line.starts_with("ringlimit ready ") {
                    let _ = tx.send(line);
                }
            }
        });
        let process = ServeProcess(child);
        let line = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("a ready line within 20 s");
        let http = line
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix("http="))
            .expect("the ready line names the ops port")
            .parse()
            .unwrap();
        (process, http)
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn a_killed_node_process_restarts_from_the_rules_in_its_data_dir() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let token = dir.path().join("admin.token");
    std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
    let seed = dir.path().join("seed.toml");
    std::fs::write(&seed, "[default]\nlimit = 9\nwindow = \"1m\"\n").unwrap();
    let s = |p: &Path| p.display().to_string();
    let args: Vec<String> = [
        "--node-id",
        "proc-1",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--gossip-listen",
        "127.0.0.1:0",
        "--peer-listen",
        "127.0.0.1:0",
    ]
    .iter()
    .map(|a| a.to_string())
    .chain([
        "--rules-seed".into(),
        s(&seed),
        "--data-dir".into(),
        s(&data),
        "--admin-token-file".into(),
        s(&token),
    ])
    .collect();

    let (node, addr) = serve_process(args.clone()).await;
    assert_eq!(http(addr, "GET", "/readyz", &[], "").await.status, 200);
    let rules = http(addr, "GET", "/v1/rules", &[], "").await;
    assert_eq!(rules.header("etag"), Some("\"1\""), "the seed is version 1");
    let put = http(
        addr,
        "PUT",
        "/v1/limits/free",
        &[("Authorization", &bearer())],
        r#"{"route_pattern": "POST /v1/charges", "limit": 3, "window_s": 60}"#,
    )
    .await;
    assert_eq!(put.status, 200, "{}", put.body);
    assert_eq!(put.json()["version"], 2);
    drop(node); // SIGKILL: nothing is flushed on the way out

    let (_node, addr) = serve_process(args).await;
    let rules = http(addr, "GET", "/v1/rules", &[], "").await;
    assert_eq!(rules.header("etag"), Some("\"2\""), "{}", rules.body);
    let free = http(addr, "GET", "/v1/limits/free", &[], "").await.json();
    assert_eq!(free["rules"][0]["limit"], 3);
}

#[tokio::test]
async fn dev_cluster_runs_one_process_per_node_each_with_its_own_metrics() {
    use std::io::BufRead;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_ringlimit"))
        .args(["dev-cluster", "--nodes", "2", "--base-port", "0"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let _ = tx.send(line);
        }
    });
    let process = ServeProcess(child); // killed on drop if the test fails
    let mut nodes: Vec<(String, SocketAddr, u32)> = Vec::new(); // (grpc, ops, pid)
    while nodes.len() < 2 {
        let line = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("a node line");
        let field = |name: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(name))
                .map(str::to_string)
        };
        if let (Some(grpc), Some(ops), Some(pid)) =
            (field("grpc="), field("ops=http://"), field("pid="))
        {
            nodes.push((
                grpc,
                ops.trim_end_matches('/').parse().unwrap(),
                pid.parse().unwrap(),
            ));
        }
    }
    assert_ne!(nodes[0].2, nodes[1].2, "one process per node");
    // If the test fails, the node processes must not outlive it (SIGKILLing dev-cluster
    // leaves its children running).
    struct KillOnDrop(Vec<u32>);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            for pid in &self.0 {
                let _ = std::process::Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .stderr(std::process::Stdio::null())
                    .status();
            }
        }
    }
    let mut children = KillOnDrop(nodes.iter().map(|n| n.2).collect());
    let mut members = 0;
    for _ in 0..200 {
        members = http(nodes[0].1, "GET", "/v1/cluster", &[], "").await.json()["members"]
            .as_array()
            .unwrap()
            .len();
        if members == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(members, 2, "the two nodes found each other");

    let mut c = ringlimit::proto::rate_limiter_client::RateLimiterClient::connect(format!(
        "http://{}",
        nodes[0].0
    ))
    .await
    .unwrap();
    let answer = c
        .check(common::check("dev", "GET /x", None))
        .await
        .unwrap()
        .into_inner();
    let decider = answer.decider.unwrap().node_id;
    // Only the decider counted the decision: each node's registry is its own.
    let series = "ringlimit_checks_total{verdict=\"allowed\",algorithm=\"sliding_window_counter\",rule=\"default\"} 1";
    for (i, (_, ops, _)) in nodes.iter().enumerate() {
        let body = http(*ops, "GET", "/metrics", &[], "").await.body;
        assert_eq!(
            body.contains(series),
            decider == format!("node-{}", i + 1),
            "node-{} (decider {decider})",
            i + 1
        );
    }

    // SIGTERM: every node leaves and dev-cluster exits cleanly.
    let mut process = process;
    let status = std::process::Command::new("kill")
        .args(["-TERM", &process.0.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(30);
    let exit = loop {
        if let Some(exit) = process.0.try_wait().unwrap() {
            break exit;
        }
        assert!(Instant::now() < deadline, "dev-cluster did not stop");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // dev-cluster has reaped its nodes: their pids are no longer ours to signal.
    children.0.clear();
    assert!(exit.success(), "{exit:?}");
    for (_, _, pid) in &nodes {
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists()
                || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .is_ok_and(|s| s.contains(") Z ")),
            "node pid {pid} still running"
        );
    }
}
