//! Real gateways in front of a 3-node cluster's HTTP check face: nginx (`auth_request`,
//! deploy/nginx/ringlimit.conf) and Caddy (`forward_auth`, deploy/caddy/Caddyfile), the
//! files as shipped with only their addresses replaced, each binary from Debian's
//! packages (`.ci/deps`) run as a process of its own on loopback. Prints SKIPPED and
//! passes when a binary is missing (`.ci/run` installs both).
//!
//! One client (127.0.0.5) sends 100 requests, alternating between the two gateways,
//! which ask different entry nodes; at a limit of 60 exactly 60 reach the application,
//! and every other answer is a 429 with Retry-After and the RateLimit fields. Some of
//! the requests carry an X-Forwarded-For the client wrote itself: the gateways append
//! the address they saw, ringlimit reads right to left past its trusted proxy (the
//! gateways' 127.0.0.1), so the key stays the client's address.
//!
//! The same again through a check face speaking TLS with client certificates
//! (`--tls-cert`, `--tls-client-ca`): nginx with deploy/nginx/ringlimit-tls.conf
//! (`proxy_ssl_*`), Caddy with deploy/caddy/ringlimit-tls.caddy (`transport http { tls
//! ... }`), each presenting a gateway certificate of the nodes' client CA.

mod common;

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::tls::Ca;
use common::{http_raw_from, rules_file, start_cluster_with, HttpAnswer};
use ringlimit::node::config::CheckHttpConfig;
use ringlimit::server::forward_auth::{ForwardAuthConfig, IpNet, KeySource};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const RULES: &str = r#"
[[rule]]
name = "api"
route = "*"
algorithm = "fixed_window"
limit = 60
window = "1h"
"#;

/// The gateways' own loopback addresses (no other test binds them), and the client's.
const NGINX_IP: [u8; 4] = [127, 0, 0, 21];
const CADDY_IP: [u8; 4] = [127, 0, 0, 22];
/// The same for the test through a TLS check face, which runs beside the other.
const NGINX_TLS_IP: [u8; 4] = [127, 0, 0, 23];
const CADDY_TLS_IP: [u8; 4] = [127, 0, 0, 24];
const CLIENT_IP: [u8; 4] = [127, 0, 0, 5];

/// A gateway process, killed and reaped when dropped (also when a test fails).
struct Gateway {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Gateway {
    fn log(&self) -> String {
        format!(
            "{} log:\n{}",
            self.name,
            std::fs::read_to_string(&self.log).unwrap_or_default()
        )
    }
}

/// The binary `name` in PATH or the sbin directories (nginx lives in /usr/sbin).
fn binary(name: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    let found = path
        .split(':')
        .chain(["/usr/sbin", "/usr/local/sbin", "/sbin"])
        .map(|dir| Path::new(dir).join(name))
        .find(|p| p.is_file());
    found
}

/// A free port on `ip` (the address is this test's own, so nobody takes it between
/// the probe and the gateway's bind).
fn free_port(ip: [u8; 4]) -> u16 {
    std::net::TcpListener::bind((IpAddr::from(ip), 0))
        .expect("bind a probe")
        .local_addr()
        .unwrap()
        .port()
}

fn deploy_file(relative: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Replace `from` (which must be there) by `to`.
fn substitute(text: &str, from: &str, to: &str) -> String {
    assert!(
        text.contains(from),
        "the deploy file no longer has {from:?}"
    );
    text.replace(from, to)
}

/// nginx with deploy/nginx/ringlimit.conf, its auth upstream `check`, its app `app`;
/// with `tls`, asking the check face over mutual TLS with
/// deploy/nginx/ringlimit-tls.conf.
fn start_nginx(
    bin: &Path,
    dir: &Path,
    listen: SocketAddr,
    check: SocketAddr,
    app: SocketAddr,
    tls: Option<&GatewayTls>,
) -> Gateway {
    let mut server = substitute(
        &deploy_file("deploy/nginx/ringlimit.conf"),
        "listen 8080;",
        &format!("listen {listen};"),
    );
    if let Some(tls) = tls {
        let snippet = tls.paths(
            &deploy_file("deploy/nginx/ringlimit-tls.conf"),
            "/etc/nginx/ringlimit",
        );
        let snippet = substitute(
            &snippet,
            "proxy_ssl_name ringlimit.internal;",
            "proxy_ssl_name localhost;",
        );
        let included = dir.join("ringlimit-tls.conf");
        std::fs::write(&included, snippet).unwrap();
        server = substitute(
            &server,
            "proxy_pass http://ringlimit_check/v1/forward-auth?deny_status=403;",
            &format!(
                "proxy_pass https://ringlimit_check/v1/forward-auth?deny_status=403;\n        include {};",
                included.display()
            ),
        );
    }
    std::fs::write(dir.join("ringlimit.conf"), server).unwrap();
    let d = dir.display();
    // One process in the foreground, every path in the temp dir.
    let main = format!(
        "daemon off;\nmaster_process off;\nworker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/error.log info;\n\
         events {{ worker_connections 256; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n\
           fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n\
           upstream ringlimit_check {{ server {check}; keepalive 4; keepalive_timeout 4s; }}\n\
           upstream app {{ server {app}; }}\n  include {d}/ringlimit.conf;\n}}\n"
    );
    let conf = dir.join("nginx.conf");
    std::fs::write(&conf, main).unwrap();
    let log = dir.join("nginx.out");
    let out = std::fs::File::create(&log).unwrap();
    let child = Command::new(bin)
        .arg("-p")
        .arg(dir)
        .arg("-c")
        .arg(&conf)
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .expect("nginx starts");
    Gateway {
        name: "nginx",
        child,
        log: dir.join("error.log"),
    }
}

/// Caddy with deploy/caddy/Caddyfile, asking `check`, proxying to `app`; with `tls`,
/// asking the check face over mutual TLS with deploy/caddy/ringlimit-tls.caddy.
fn start_caddy(
    bin: &Path,
    dir: &Path,
    listen: SocketAddr,
    check: SocketAddr,
    app: SocketAddr,
    tls: Option<&GatewayTls>,
) -> Gateway {
    let mut file = deploy_file("deploy/caddy/Caddyfile");
    if let Some(tls) = tls {
        let snippet = tls.paths(
            &deploy_file("deploy/caddy/ringlimit-tls.caddy"),
            "/etc/caddy/ringlimit",
        );
        let snippet = substitute(
            &snippet,
            "tls_server_name ringlimit.internal",
            "tls_server_name localhost",
        );
        let imported = dir.join("ringlimit-tls.caddy");
        std::fs::write(&imported, snippet).unwrap();
        file = substitute(
            &file,
            "copy_headers RateLimit RateLimit-Policy",
            &format!(
                "copy_headers RateLimit RateLimit-Policy\n\t\timport {}",
                imported.display()
            ),
        );
    }
    file = substitute(
        &file,
        ":8081 {",
        &format!("http://:{} {{\n\tbind {}", listen.port(), listen.ip()),
    );
    file = substitute(
        &file,
        "forward_auth 127.0.0.1:7424",
        &format!("forward_auth {check}"),
    );
    file = substitute(
        &file,
        "reverse_proxy 127.0.0.1:8000",
        &format!("reverse_proxy {app}"),
    );
    let conf = dir.join("Caddyfile");
    std::fs::write(&conf, file).unwrap();
    let log = dir.join("caddy.log");
    let out = std::fs::File::create(&log).unwrap();
    let child = Command::new(bin)
        .args(["run", "--adapter", "caddyfile", "--config"])
        .arg(&conf)
        // Caddy keeps state under these; none of it outside the temp dir.
        .env("HOME", dir)
        .env("XDG_DATA_HOME", dir)
        .env("XDG_CONFIG_HOME", dir)
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .expect("caddy starts");
    Gateway {
        name: "caddy",
        child,
        log,
    }
}

/// The files a gateway needs to ask a mutual-TLS check face: the CA of the node's
/// certificate, and the gateway's own certificate of the node's client CA.
struct GatewayTls {
    dir: tempfile::TempDir,
}

impl GatewayTls {
    fn new(server_ca: &Ca, client_ca: &Ca) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = client_ca.leaf(&["gateway-1"]);
        for (name, text) in [
            ("public-ca.pem", server_ca.pem.as_str()),
            ("gateway-1.pem", cert.as_str()),
            ("gateway-1.key", key.as_str()),
        ] {
            std::fs::write(dir.path().join(name), text).unwrap();
        }
        GatewayTls { dir }
    }

    /// `text` with the deploy file's certificate directory `from` replaced by ours.
    fn paths(&self, text: &str, from: &str) -> String {
        substitute(text, from, &self.dir.path().display().to_string())
    }
}

/// Wait (at most 10 s) until `addr` accepts connections.
async fn wait_listening(gateway: &Gateway, addr: SocketAddr) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(addr).await.is_err() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} never listened on {addr}\n{}",
            gateway.name,
            gateway.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The application behind the gateways: answers every request `200 hello`.
async fn tiny_app() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = stream
                    .write_all(
                        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello",
                    )
                    .await;
            });
        }
    });
    addr
}

async fn get(gateway: SocketAddr, path: &str, spoof: Option<&str>) -> HttpAnswer {
    let mut request = format!("GET {path} HTTP/1.1\r\nHost: api.example\r\nConnection: close\r\n");
    if let Some(spoof) = spoof {
        request.push_str(&format!("X-Forwarded-For: {spoof}\r\n"));
    }
    request.push_str("\r\n");
    http_raw_from(IpAddr::from(CLIENT_IP), gateway, &request).await
}

#[tokio::test]
async fn nginx_and_caddy_enforce_one_exact_limit_across_a_cluster() {
    let (Some(nginx), Some(caddy)) = (binary("nginx"), binary("caddy")) else {
        println!("SKIPPED: nginx and caddy are both needed (.ci/deps installs them)");
        return;
    };
    let (_rules_dir, rules) = rules_file(RULES);
    let face = |config: &mut ringlimit::node::NodeConfig| {
        let mut face = CheckHttpConfig::on("127.0.0.1:0".parse().unwrap());
        face.forward_auth = ForwardAuthConfig {
            key: KeySource::ClientAddress,
            // The gateways reach the face from 127.0.0.1; the client is 127.0.0.5.
            trusted_proxies: vec![IpNet::parse("127.0.0.1").unwrap()],
        };
        config.check_http = Some(face);
        // Exact counts hold on the owner: on a loaded machine a forward that timed out
        // would fail over to a replica that may lag one interval (a documented loss).
        config.forward.timeout = std::time::Duration::from_secs(5);
    };
    let nodes = start_cluster_with(&["a", "b", "c"], Some(&rules), face).await;
    let app = tiny_app().await;
    let dir = tempfile::tempdir().unwrap();
    let (nginx_dir, caddy_dir) = (dir.path().join("nginx"), dir.path().join("caddy"));
    std::fs::create_dir_all(&nginx_dir).unwrap();
    std::fs::create_dir_all(&caddy_dir).unwrap();
    let nginx_addr = SocketAddr::from((NGINX_IP, free_port(NGINX_IP)));
    let caddy_addr = SocketAddr::from((CADDY_IP, free_port(CADDY_IP)));
    // Two gateways, two entry nodes: the key's owner decides for both.
    let check = |i: usize| nodes[i].check_http_addr.unwrap();
    let nginx = start_nginx(&nginx, &nginx_dir, nginx_addr, check(0), app, None);
    let caddy = start_caddy(&caddy, &caddy_dir, caddy_addr, check(1), app, None);
    wait_listening(&nginx, nginx_addr).await;
    wait_listening(&caddy, caddy_addr).await;
    hundred_requests_admit_sixty((nginx_addr, &nginx), (caddy_addr, &caddy)).await;
}

/// 100 requests from the client, alternating between the two gateways: exactly 60
/// reach the application, the others are 429s with Retry-After, the RateLimit fields
/// and the problem body, from both gateways.
async fn hundred_requests_admit_sixty(
    nginx: (SocketAddr, &Gateway),
    caddy: (SocketAddr, &Gateway),
) {
    let (nginx_addr, nginx) = nginx;
    let (caddy_addr, caddy) = caddy;
    let mut admitted = [0usize; 2];
    let mut denied = [0usize; 2];
    for i in 0..100 {
        let (gateway, which, g) = if i % 2 == 0 {
            (nginx_addr, nginx, 0)
        } else {
            (caddy_addr, caddy, 1)
        };
        // Path and query vary, and every fifth request claims another address.
        let path = format!("/v1/items/{i}?page={}", i % 7);
        let spoof = format!("198.51.100.{i}");
        let answer = get(gateway, &path, (i % 5 == 0).then_some(spoof.as_str())).await;
        let context = || {
            format!(
                "request {i} via {}: {answer:?}\n{}",
                which.name,
                which.log()
            )
        };
        match answer.status {
            200 => {
                assert_eq!(answer.body, "hello", "{}", context());
                let current = answer
                    .header("ratelimit")
                    .unwrap_or_else(|| panic!("{}", context()));
                assert!(current.starts_with("\"api\";r="), "{}", context());
                assert_eq!(
                    answer.header("ratelimit-policy"),
                    Some("\"api\";q=60;w=3600"),
                    "{}",
                    context()
                );
                admitted[g] += 1;
            }
            429 => {
                let retry: u64 = answer
                    .header("retry-after")
                    .unwrap_or_else(|| panic!("{}", context()))
                    .parse()
                    .unwrap();
                assert!(retry >= 1, "{}", context());
                assert_eq!(
                    answer.header("ratelimit-policy"),
                    Some("\"api\";q=60;w=3600"),
                    "{}",
                    context()
                );
                let current = answer
                    .header("ratelimit")
                    .unwrap_or_else(|| panic!("{}", context()));
                assert!(current.starts_with("\"api\";r=0;t="), "{}", context());
                assert_eq!(
                    answer.header("content-type"),
                    Some("application/problem+json"),
                    "{}",
                    context()
                );
                assert!(answer.body.contains("quota-exceeded"), "{}", context());
                denied[g] += 1;
            }
            _ => panic!("{}", context()),
        }
    }
    println!("admitted via nginx/caddy: {admitted:?}, denied: {denied:?}");
    assert_eq!(
        admitted[0] + admitted[1],
        60,
        "exactly the limit, across both gateways"
    );
    assert_eq!(denied[0] + denied[1], 40);
    assert!(
        denied[0] > 0 && denied[1] > 0,
        "both gateways answered denials"
    );
}

/// The same through a check face that speaks TLS and demands client certificates:
/// nginx with `proxy_ssl_*` and Caddy with `transport http { tls ... }`, each
/// presenting a gateway certificate of the nodes' client CA.
#[tokio::test]
async fn nginx_and_caddy_enforce_the_limit_through_a_mutual_tls_check_face() {
    let (Some(nginx), Some(caddy)) = (binary("nginx"), binary("caddy")) else {
        println!("SKIPPED: nginx and caddy are both needed (.ci/deps installs them)");
        return;
    };
    let (server_ca, client_ca) = (Ca::new(), Ca::new());
    let public = server_ca.public(Some(&client_ca));
    let (_rules_dir, rules) = rules_file(RULES);
    let face = |config: &mut ringlimit::node::NodeConfig| {
        let mut face = CheckHttpConfig::on("127.0.0.1:0".parse().unwrap());
        face.forward_auth = ForwardAuthConfig {
            key: KeySource::ClientAddress,
            trusted_proxies: vec![IpNet::parse("127.0.0.1").unwrap()],
        };
        config.check_http = Some(face);
        config.public_tls = Some(public.clone());
        config.forward.timeout = std::time::Duration::from_secs(5);
    };
    let nodes = start_cluster_with(&["a", "b", "c"], Some(&rules), face).await;
    let app = tiny_app().await;
    let tls = GatewayTls::new(&server_ca, &client_ca);
    let dir = tempfile::tempdir().unwrap();
    let (nginx_dir, caddy_dir) = (dir.path().join("nginx"), dir.path().join("caddy"));
    std::fs::create_dir_all(&nginx_dir).unwrap();
    std::fs::create_dir_all(&caddy_dir).unwrap();
    let nginx_addr = SocketAddr::from((NGINX_TLS_IP, free_port(NGINX_TLS_IP)));
    let caddy_addr = SocketAddr::from((CADDY_TLS_IP, free_port(CADDY_TLS_IP)));
    let check = |i: usize| nodes[i].check_http_addr.unwrap();
    let nginx = start_nginx(&nginx, &nginx_dir, nginx_addr, check(0), app, Some(&tls));
    let caddy = start_caddy(&caddy, &caddy_dir, caddy_addr, check(1), app, Some(&tls));
    wait_listening(&nginx, nginx_addr).await;
    wait_listening(&caddy, caddy_addr).await;
    hundred_requests_admit_sixty((nginx_addr, &nginx), (caddy_addr, &caddy)).await;
}
