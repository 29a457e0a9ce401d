//! Attack test: a node at its file-descriptor limit (issue 10, point 7).
//!
//! Its own test target because it lowers the process's RLIMIT_NOFILE: any test running
//! beside it in the same process would fail to open files meanwhile.

mod common;

use std::time::Duration;

use common::{check, metric_sum, start};
use ringlimit::node::NodeConfig;
use rlimit::Resource;
use tokio::net::TcpSocket;

const GUARD: Duration = Duration::from_secs(30);
const ERRORS: &str = "ringlimit_accept_errors_total";

fn highest_open_fd() -> u64 {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u64>().ok())
        .max()
        .unwrap()
}

/// Closes: "at the file-descriptor limit the accept loop spins a full core". With no
/// descriptor left, connections wait in the listen queue and every accept fails with
/// EMFILE: the loop backs off (at least 10 ms between attempts, so at most ~100
/// failures a second, where a spinning loop makes hundreds of thousands), and serves
/// the queued connections once descriptors are free again.
#[tokio::test]
async fn at_the_fd_limit_the_accept_loop_backs_off_and_recovers() {
    let node = start(NodeConfig::for_test()).await;
    // Sockets made now, connected once no descriptor is left (connect needs none).
    let sockets: Vec<TcpSocket> = (0..4).map(|_| TcpSocket::new_v4().unwrap()).collect();

    let (soft, hard) = rlimit::getrlimit(Resource::NOFILE).unwrap();
    rlimit::setrlimit(Resource::NOFILE, highest_open_fd() + 1, hard).unwrap();
    // Fill the holes below the limit: afterwards no descriptor can be had at all.
    let mut filler = Vec::new();
    while let Ok(f) = std::fs::File::open("/dev/null") {
        filler.push(f);
    }
    let before = metric_sum(ERRORS);
    let mut pending = Vec::new();
    for s in sockets {
        pending.push(tokio::spawn(s.connect(node.grpc_addr)));
    }
    // Wait until the accept loop has met the limit.
    tokio::time::timeout(GUARD, async {
        while metric_sum(ERRORS) <= before {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("accept failed at the fd limit");

    let window = Duration::from_secs(1);
    let start_count = metric_sum(ERRORS);
    tokio::time::sleep(window).await;
    let failures = metric_sum(ERRORS) - start_count;
    // Free descriptors before asserting, so a failure does not starve the harness.
    drop(filler);
    rlimit::setrlimit(Resource::NOFILE, soft, hard).unwrap();
    assert!(
        failures <= 300.0,
        "{failures} accept failures in {window:?}: the loop spins"
    );

    // Recovered: queued connections are taken, a new client is served.
    for p in pending {
        p.await.unwrap().expect("queued connection completes");
    }
    let mut c = tokio::time::timeout(GUARD, common::client(&node))
        .await
        .expect("a client connects after the limit is lifted");
    let a = c.check(check("k", "/x", None)).await.unwrap().into_inner();
    assert!(a.allowed);
    node.shutdown().await;
}
