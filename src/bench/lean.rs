//! A minimal unary gRPC client straight on `h2`, for the load generator.
//!
//! tonic's `Channel` puts a tower `Buffer` task between the caller and the connection,
//! and hyper's HTTP/2 client adds a dispatch channel and a body-pipe task per call, so
//! one unary call wakes three or four tasks on the client side. The bench client shares
//! the two cores with the node it measures, so that overhead is taken from the node
//! (the Redis side of the bench talks RESP straight over its socket). Here a worker polls
//! its own HTTP/2 connection in its own task and writes the one-frame request body
//! itself: one task per connection, as on the Redis side. The wire traffic is ordinary
//! gRPC (HEADERS, one DATA frame with the length-prefixed message, trailers read back
//! and `grpc-status` checked), so the node does the same work as for any client.

use std::future::poll_fn;

use anyhow::{bail, Context};
use bytes::{BufMut, Bytes, BytesMut};
use tokio::net::TcpStream;

/// One HTTP/2 connection's request side.
pub struct LeanClient {
    send: h2::client::SendRequest<Bytes>,
    authority: String,
    buf: BytesMut,
}

/// The connection half: poll it (in the caller's task) for the calls to progress.
pub type LeanConnection = h2::client::Connection<TcpStream, Bytes>;

impl LeanClient {
    /// Connect to `addr` (host:port) with TCP_NODELAY, as tonic's channel does.
    pub async fn connect(addr: &str) -> anyhow::Result<(Self, LeanConnection)> {
        let tcp = TcpStream::connect(addr)
            .await
            .with_context(|| format!("connecting to {addr}"))?;
        tcp.set_nodelay(true)?;
        let (send, connection) = h2::client::handshake(tcp).await?;
        Ok((
            Self {
                send,
                authority: addr.to_string(),
                buf: BytesMut::with_capacity(4096),
            },
            connection,
        ))
    }

    /// One unary call of `path` (e.g. `/ringlimit.v1.RateLimiter/Check`).
    pub async fn unary<Q: prost::Message, A: prost::Message + Default>(
        &mut self,
        path: &str,
        request: &Q,
    ) -> anyhow::Result<A> {
        poll_fn(|cx| self.send.poll_ready(cx)).await?;
        let head = http::Request::post(format!("http://{}{path}", self.authority))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())?;
        let (response, mut body_out) = self.send.send_request(head, false)?;
        let len = request.encoded_len();
        self.buf.reserve(5 + len);
        self.buf.put_u8(0);
        self.buf.put_u32(u32::try_from(len)?);
        request.encode(&mut self.buf)?;
        body_out.send_data(self.buf.split().freeze(), true)?;

        let (head, mut body) = response.await?.into_parts();
        if head.status != http::StatusCode::OK {
            bail!("HTTP status {}", head.status);
        }
        // A trailers-only answer (an error) carries grpc-status in the headers.
        check_status(&head.headers)?;
        let mut data = BytesMut::new();
        while let Some(chunk) = body.data().await {
            let chunk = chunk?;
            body.flow_control().release_capacity(chunk.len())?;
            data.extend_from_slice(&chunk);
        }
        match body.trailers().await? {
            Some(trailers) => check_status(&trailers)?,
            None if head.headers.contains_key("grpc-status") => {}
            None => bail!("no grpc-status"),
        }
        if data.len() < 5 || data[0] != 0 {
            bail!("malformed gRPC message ({} bytes)", data.len());
        }
        let len = u32::from_be_bytes([data[1], data[2], data[3], data[4]]) as usize;
        if data.len() != 5 + len {
            bail!("gRPC message of {len} bytes in a body of {}", data.len());
        }
        Ok(A::decode(&data[5..])?)
    }
}

fn check_status(headers: &http::HeaderMap) -> anyhow::Result<()> {
    match headers.get("grpc-status") {
        None => Ok(()),
        Some(code) if code == "0" => Ok(()),
        Some(code) => bail!("grpc-status {:?}: {:?}", code, headers.get("grpc-message")),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ringlimit::clock::ManualClock;
    use ringlimit::node::NodeConfig;
    use ringlimit::proto::{CheckBatchRequest, CheckBatchResponse, CheckRequest, CheckResponse};
    use tokio_util::sync::CancellationToken;

    use super::LeanClient;

    /// 2026-01-01T00:00:00Z: a fixed time, so the default rule's window does not roll.
    const T0: u64 = 1_767_225_600_000;

    fn check(key: &str) -> CheckRequest {
        CheckRequest {
            key: key.into(),
            route: "GET /x".into(),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn speaks_grpc_to_a_real_node() {
        let clock = Arc::new(ManualClock::new(T0));
        let node = ringlimit::node::start_with_clock(
            NodeConfig::for_test(),
            clock,
            CancellationToken::new(),
        )
        .await
        .expect("node starts");
        let (mut c, connection) = LeanClient::connect(&node.grpc_addr.to_string())
            .await
            .unwrap();
        tokio::spawn(connection);
        for i in 1..=3u64 {
            let a: CheckResponse = c
                .unary("/ringlimit.v1.RateLimiter/Check", &check("lean"))
                .await
                .unwrap();
            assert!(a.allowed);
            assert_eq!(a.remaining, 100 - i);
        }
        let batch = CheckBatchRequest {
            checks: vec![check("lean"), check("other")],
        };
        let b: CheckBatchResponse = c
            .unary("/ringlimit.v1.RateLimiter/CheckBatch", &batch)
            .await
            .unwrap();
        assert_eq!(b.results.len(), 2);
        assert_eq!(b.results[0].remaining, 96);
        // A refused request comes back as an error (grpc-status in trailers-only headers).
        let refused = c
            .unary::<_, CheckResponse>("/ringlimit.v1.RateLimiter/Check", &check(""))
            .await
            .unwrap_err()
            .to_string();
        assert!(refused.contains("grpc-status"), "{refused}");
        // tonic's health check, the floor `--protocol health` measures: the node serves.
        let health: tonic_health::pb::HealthCheckResponse = c
            .unary(
                "/grpc.health.v1.Health/Check",
                &tonic_health::pb::HealthCheckRequest::default(),
            )
            .await
            .unwrap();
        assert_eq!(
            health.status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32
        );
        node.shutdown().await;
    }

    #[tokio::test]
    async fn speaks_envoy_rls_to_a_real_node() {
        use ringlimit::proto::envoy::extensions::common::ratelimit::v3::{
            rate_limit_descriptor::Entry, RateLimitDescriptor,
        };
        use ringlimit::proto::envoy::service::ratelimit::v3::{
            RateLimitRequest, RateLimitResponse,
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bench.yaml");
        std::fs::write(
            &path,
            "domain: bench\ndescriptors:\n  - key: client_id\n    rate_limit: {unit: minute, requests_per_unit: 2}\n",
        )
        .unwrap();
        let config = NodeConfig {
            envoy_path: Some(path),
            ..NodeConfig::for_test()
        };
        let clock = Arc::new(ManualClock::new(T0));
        let node = ringlimit::node::start_with_clock(config, clock, CancellationToken::new())
            .await
            .expect("node starts");
        let (mut c, connection) = LeanClient::connect(&node.grpc_addr.to_string())
            .await
            .unwrap();
        tokio::spawn(connection);
        let request = RateLimitRequest {
            domain: "bench".into(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: "client_id".into(),
                    value: "k".into(),
                }],
                ..Default::default()
            }],
            hits_addend: 1,
        };
        let path = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
        let mut codes = Vec::new();
        for _ in 0..3 {
            let a: RateLimitResponse = c.unary(path, &request).await.unwrap();
            codes.push(a.overall_code);
        }
        assert_eq!(codes, [1, 1, 2], "OK, OK, OVER_LIMIT");
        node.shutdown().await;
    }
}
