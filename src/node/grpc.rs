//! The gRPC listener's bounds: what one client can make a node hold.
//!
//! - [`incoming`]: the accept loop. A semaphore caps open connections (one more is
//!   closed at once and counted); an accept error that is about the process, not one
//!   connection (EMFILE, ENFILE, ENOBUFS, ENOMEM), backs off 10..=100 ms instead of
//!   spinning a core, and is logged at most every 5 s.
//! - [`Conn`]: an accepted connection holding its slot until dropped, closed if it has
//!   not sent the HTTP/2 preface within the handshake timeout. On a TLS listener the
//!   TLS handshake has the same deadline ([`with_handshake_timeout`]), and the
//!   server's TLS is built once, from PEM files, by [`server_tls`] (peer face) and
//!   [`public_server_tls`] (public face).
//! - [`StatusMappingLayer`]: the two answers tonic gives before a codec runs, mapped to
//!   what a gateway should read: an over-size message `RESOURCE_EXHAUSTED` (tonic says
//!   `OUT_OF_RANGE`), and a body that fails to decode in a service without our codec
//!   (health, reflection) `INVALID_ARGUMENT` (tonic-prost says `INTERNAL`).
//! - [`raise_fd_limit`]: the soft RLIMIT_NOFILE raised to the hard limit at start.
//!
//! The HTTP/2 settings themselves (streams, windows, keepalive, frame and header sizes)
//! are tonic's, set from [`GrpcLimits`] by [`limited`] for both gRPC faces.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tonic::transport::server::{Connected, TcpConnectInfo};
use tonic::{Code, Status};

use super::config::{GrpcLimits, MAX_MESSAGE_BYTES};

/// Length of the HTTP/2 client connection preface (RFC 9113 3.4).
const PREFACE_LEN: usize = 24;
/// Shortest and longest pause after an accept error about the process.
const BACKOFF_MIN: Duration = Duration::from_millis(10);
const BACKOFF_MAX: Duration = Duration::from_millis(100);
/// At most one log line per this interval for accept errors and refused connections.
const LOG_EVERY: Duration = Duration::from_secs(5);

/// How long to pause after `error` from `accept`, given the previous pause (`None`
/// after a success): `None` retries at once. Errors about one connection (it was reset
/// or aborted before we took it) say nothing about the next one; anything else (out of
/// file descriptors, buffers, memory) will fail again at once, so wait, doubling from
/// 10 ms to at most 100 ms.
pub fn accept_backoff(error: &io::Error, previous: Option<Duration>) -> Option<Duration> {
    use io::ErrorKind::{ConnectionAborted, ConnectionReset, Interrupted};
    if matches!(
        error.kind(),
        ConnectionAborted | ConnectionReset | Interrupted
    ) {
        return None;
    }
    Some(previous.map_or(BACKOFF_MIN, |p| (p * 2).clamp(BACKOFF_MIN, BACKOFF_MAX)))
}

/// Accepted connections, at most `limits.max_connections` open at once. Never yields
/// an error: accept errors are handled here (tonic's own loop retries them at once).
pub fn incoming(
    listener: TcpListener,
    limits: &GrpcLimits,
) -> impl Stream<Item = Result<Conn, io::Error>> + Send + 'static {
    incoming_sharing(listener, limits, connection_slots(limits))
}

/// A face's connection slots: `limits.max_connections` of them, for
/// [`incoming_sharing`].
pub fn connection_slots(limits: &GrpcLimits) -> Arc<Semaphore> {
    Arc::new(Semaphore::new(limits.max_connections))
}

/// [`incoming`] taking its connections' slots from `slots`: a face served on several
/// listeners (one per worker thread, `node::workers`) holds at most that many
/// connections over all of them, wherever the kernel sends each one.
pub fn incoming_sharing(
    listener: TcpListener,
    limits: &GrpcLimits,
    slots: Arc<Semaphore>,
) -> impl Stream<Item = Result<Conn, io::Error>> + Send + 'static {
    let acceptor = Acceptor {
        listener,
        slots,
        max_connections: limits.max_connections,
        handshake_timeout: limits.handshake_timeout,
        backoff: None,
        errors: RateLimitedLog::default(),
        refusals: RateLimitedLog::default(),
        accept_errors: metrics::counter!("ringlimit_accept_errors_total"),
        refused: metrics::counter!("ringlimit_connections_refused_total"),
    };
    futures_util::stream::unfold(acceptor, |mut acceptor| async move {
        let conn = acceptor.next().await;
        Some((Ok(conn), acceptor))
    })
}

struct Acceptor {
    listener: TcpListener,
    slots: Arc<Semaphore>,
    max_connections: usize,
    handshake_timeout: Duration,
    backoff: Option<Duration>,
    errors: RateLimitedLog,
    refusals: RateLimitedLog,
    accept_errors: metrics::Counter,
    refused: metrics::Counter,
}

impl Acceptor {
    async fn next(&mut self) -> Conn {
        loop {
            let (stream, peer) = match self.listener.accept().await {
                Ok(accepted) => accepted,
                Err(error) => {
                    self.accept_errors.increment(1);
                    self.backoff = accept_backoff(&error, self.backoff);
                    if let Some(suppressed) = self.errors.due() {
                        tracing::warn!(%error, suppressed, backoff_ms = self.backoff.map_or(0, |b| b.as_millis() as u64), "gRPC accept failed");
                    }
                    if let Some(pause) = self.backoff {
                        tokio::time::sleep(pause).await;
                    }
                    continue;
                }
            };
            self.backoff = None;
            let Ok(slot) = self.slots.clone().try_acquire_owned() else {
                // Dropping the socket closes it: the client sees the connection end
                // before any byte, and tries another node or later.
                self.refused.increment(1);
                if let Some(suppressed) = self.refusals.due() {
                    tracing::warn!(%peer, suppressed, max_connections = self.max_connections, "connection cap reached: closing new connection");
                }
                continue;
            };
            // Without TCP_NODELAY Nagle's algorithm meets delayed ACKs and small
            // answers wait ~40 ms.
            if let Err(error) = stream.set_nodelay(true) {
                tracing::debug!(%peer, %error, "cannot set TCP_NODELAY");
            }
            return Conn::new(stream, slot, self.handshake_timeout);
        }
    }
}

/// Logs at most once per [`LOG_EVERY`], saying how many events it kept quiet about.
#[derive(Default)]
struct RateLimitedLog {
    last: Option<Instant>,
    suppressed: u64,
}

impl RateLimitedLog {
    /// `Some(events suppressed since the last line)` if a line is due now.
    fn due(&mut self) -> Option<u64> {
        let now = Instant::now();
        if self
            .last
            .is_some_and(|last| now.duration_since(last) < LOG_EVERY)
        {
            self.suppressed += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.suppressed))
    }
}

/// An accepted TCP connection. It holds one of the listener's connection slots until
/// hyper drops it, and fails its reads with `TimedOut` if the HTTP/2 preface has not
/// arrived within the handshake timeout (after it, HTTP/2 keepalive watches the peer).
pub struct Conn {
    stream: TcpStream,
    handshake: Option<Pin<Box<Sleep>>>,
    preface_left: usize,
    _slot: OwnedSemaphorePermit,
}

impl Conn {
    fn new(stream: TcpStream, slot: OwnedSemaphorePermit, handshake_timeout: Duration) -> Self {
        metrics::gauge!("ringlimit_grpc_connections").increment(1.0);
        Self {
            stream,
            handshake: Some(Box::pin(tokio::time::sleep(handshake_timeout))),
            preface_left: PREFACE_LEN,
            _slot: slot,
        }
    }
}

impl Conn {
    /// The first byte the client sent, left in place for whoever serves the connection
    /// (`None`: it closed before sending any). The peer face tells a framed connection
    /// from an HTTP/2 one by it.
    pub async fn peek_first(&self) -> io::Result<Option<u8>> {
        let mut first = [0u8; 1];
        let n = self.stream.peek(&mut first).await?;
        Ok((n == 1).then_some(first[0]))
    }

    /// This connection without the HTTP/2 preface's deadline: one served as frames,
    /// whose handshake (shorter than the preface without a cluster key) has a deadline
    /// of its own.
    pub fn without_preface_deadline(mut self) -> Self {
        self.handshake = None;
        self
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        metrics::gauge!("ringlimit_grpc_connections").decrement(1.0);
    }
}

impl Connected for Conn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.stream).poll_read(cx, buf);
        let Some(deadline) = this.handshake.as_mut() else {
            return polled;
        };
        match polled {
            Poll::Ready(Ok(())) => {
                let read = buf.filled().len() - before;
                this.preface_left = this.preface_left.saturating_sub(read);
                if this.preface_left == 0 {
                    this.handshake = None;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => match deadline.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no HTTP/2 preface within the handshake timeout",
                ))),
                Poll::Pending => Poll::Pending,
            },
            other => other,
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// A gRPC server builder with the HTTP/2 limits of `limits`: the public and the peer
/// face's (and the bench's floor server when it adds our limits to a bare server).
pub fn limited(limits: &GrpcLimits) -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .max_concurrent_streams(limits.max_concurrent_streams)
        .timeout(limits.request_timeout)
        .http2_keepalive_interval(Some(limits.keepalive_interval))
        .http2_keepalive_timeout(Some(limits.keepalive_timeout))
        .max_connection_age(limits.max_connection_age)
        .max_connection_age_grace(limits.max_connection_age_grace)
        .max_frame_size(limits.max_frame_size)
        .http2_max_header_list_size(limits.max_header_list_size)
        .initial_stream_window_size(limits.initial_stream_window)
        .initial_connection_window_size(limits.initial_connection_window)
}

/// Raise the soft RLIMIT_NOFILE to the hard limit, so the connection cap, not the
/// default soft limit (often 1024), is what bounds connections. Returns the soft limit
/// now in force; failing to raise it is logged and not fatal.
pub fn raise_fd_limit() -> Option<u64> {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(soft) => {
            tracing::info!(nofile = soft, "file descriptor limit");
            Some(soft)
        }
        Err(error) => {
            tracing::warn!(%error, "cannot raise the file descriptor limit");
            None
        }
    }
}

/// Maps the answers tonic gives before a codec runs (see the module doc). Applied to
/// every service of the public server; a response without `grpc-status` in its headers
/// (every normal answer) costs one header lookup.
#[derive(Debug, Clone, Copy, Default)]
pub struct StatusMappingLayer;

impl<S> tower_layer::Layer<S> for StatusMappingLayer {
    type Service = StatusMapping<S>;

    fn layer(&self, inner: S) -> Self::Service {
        StatusMapping { inner }
    }
}

/// The service of [`StatusMappingLayer`].
#[derive(Debug, Clone)]
pub struct StatusMapping<S> {
    inner: S,
}

type Remap<R, E> = fn(Result<http::Response<R>, E>) -> Result<http::Response<R>, E>;

impl<S, B, R> tonic::codegen::Service<http::Request<B>> for StatusMapping<S>
where
    S: tonic::codegen::Service<http::Request<B>, Response = http::Response<R>>,
{
    type Response = http::Response<R>;
    type Error = S::Error;
    type Future = futures_util::future::Map<S::Future, Remap<R, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        use futures_util::FutureExt;
        self.inner
            .call(request)
            .map(remap_response as Remap<R, S::Error>)
    }
}

fn remap_response<R, E>(response: Result<http::Response<R>, E>) -> Result<http::Response<R>, E> {
    let mut response = response?;
    // Only a trailers-only answer (an error before any message) has grpc-status here.
    if !response.headers().contains_key(Status::GRPC_STATUS) {
        return Ok(response);
    }
    let Some(status) = Status::from_header_map(response.headers()) else {
        return Ok(response);
    };
    if let Some(mapped) = map_status(status.code(), status.message()) {
        let headers = response.headers_mut();
        headers.remove(Status::GRPC_STATUS);
        headers.remove(Status::GRPC_MESSAGE);
        headers.remove(Status::GRPC_STATUS_DETAILS);
        if mapped.add_header(headers).is_ok() {
            response.extensions_mut().insert(mapped);
        }
    }
    Ok(response)
}

/// The status a caller should see instead of (`code`, `message`), if any: tonic's
/// length-prefix check (`OUT_OF_RANGE`, "decoded message length too large") becomes
/// `RESOURCE_EXHAUSTED` naming the limit; tonic-prost's decode failure (`INTERNAL`,
/// "failed to decode Protobuf message") becomes `INVALID_ARGUMENT`.
pub fn map_status(code: Code, message: &str) -> Option<Status> {
    match code {
        Code::OutOfRange if message.contains("message length too large") => {
            Some(Status::resource_exhausted(format!(
                "request message larger than the limit of {MAX_MESSAGE_BYTES} bytes ({message})"
            )))
        }
        Code::Internal if message.starts_with("failed to decode Protobuf message") => Some(
            Status::invalid_argument(format!("invalid protobuf: {message}")),
        ),
        _ => None,
    }
}

/// A server TLS configuration presenting `cert_pem`/`key_pem` and, with `client_ca_pem`,
/// requiring of every connection a client certificate that CA signed (no certificate,
/// no handshake). The handshake deadline is set where it is served
/// ([`with_handshake_timeout`]).
fn server_tls_config(
    cert_pem: &[u8],
    key_pem: &[u8],
    client_ca_pem: Option<&[u8]>,
) -> tonic::transport::ServerTlsConfig {
    use tonic::transport::{Certificate, Identity};
    let config =
        tonic::transport::ServerTlsConfig::new().identity(Identity::from_pem(cert_pem, key_pem));
    match client_ca_pem {
        Some(ca) => config.client_ca_root(Certificate::from_pem(ca)),
        None => config,
    }
}

/// `tls` with the listener's handshake timeout: a TLS handshake not finished within it
/// fails and frees the connection's slot. [`Conn`]'s own deadline counts raw bytes, so
/// under TLS it is met by the first 24 bytes of a ClientHello; this one is what stops a
/// client that sends part of a handshake and then nothing.
pub fn with_handshake_timeout(
    tls: tonic::transport::ServerTlsConfig,
    limits: &GrpcLimits,
) -> tonic::transport::ServerTlsConfig {
    tls.timeout(limits.handshake_timeout)
}

/// The peer listener's TLS: this node's certificate, and a client certificate signed by
/// the cluster CA required of every connection (no certificate, no handshake).
pub fn server_tls(tls: &crate::node::config::PeerTls) -> tonic::transport::ServerTlsConfig {
    server_tls_config(&tls.cert_pem, &tls.key_pem, Some(&tls.ca_pem))
}

/// The public listener's TLS: this node's certificate for gateways, and with
/// `--tls-client-ca` a client certificate of that CA required of every connection.
pub fn public_server_tls(
    tls: &crate::node::config::PublicTls,
) -> tonic::transport::ServerTlsConfig {
    server_tls_config(&tls.cert_pem, &tls.key_pem, tls.client_ca_pem.as_deref())
}

/// The peer client's TLS: trust only the cluster CA, expect the cluster's peer name,
/// present this node's certificate.
pub fn client_tls(tls: &crate::node::config::PeerTls) -> tonic::transport::ClientTlsConfig {
    use tonic::transport::{Certificate, Identity};
    tonic::transport::ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&tls.ca_pem))
        .identity(Identity::from_pem(&tls.cert_pem, &tls.key_pem))
        .domain_name(tls.server_name.clone())
}

/// Build both sides once, so a bad certificate, key or CA stops the node at start with
/// a message instead of failing every peer call later.
pub fn check_tls(tls: &crate::node::config::PeerTls) -> Result<(), String> {
    tonic::transport::Server::builder()
        .tls_config(server_tls(tls))
        .map_err(|e| format!("peer TLS (server side): {}", error_chain(&e)))?;
    tonic::transport::Endpoint::from_static("https://127.0.0.1:1")
        .tls_config(client_tls(tls))
        .map_err(|e| format!("peer TLS (client side): {}", error_chain(&e)))?;
    Ok(())
}

/// Build the public face's TLS once at start: a certificate that does not parse, a key
/// that is not the certificate's, or a client CA file without a usable certificate
/// stops the node with a message naming the flags.
pub fn check_public_tls(tls: &crate::node::config::PublicTls) -> Result<(), String> {
    // The usual mix-ups, named before rustls gives its shorter reasons.
    let has = |pem: &[u8], label: &[u8]| pem.windows(label.len()).any(|w| w == label);
    if !has(&tls.cert_pem, b"-----BEGIN CERTIFICATE-----") {
        return Err("public TLS: the --tls-cert file holds no CERTIFICATE block".into());
    }
    if !has(&tls.key_pem, b"PRIVATE KEY-----") {
        return Err("public TLS: the --tls-key file holds no PRIVATE KEY block".into());
    }
    if let Some(ca) = &tls.client_ca_pem {
        if !has(ca, b"-----BEGIN CERTIFICATE-----") {
            return Err("public TLS: the --tls-client-ca file holds no CERTIFICATE block".into());
        }
    }
    tonic::transport::Server::builder()
        .tls_config(public_server_tls(tls))
        .map(drop)
        .map_err(|e| {
            let reason = error_chain(&e);
            if reason.contains("KeyMismatch") {
                return "public TLS: the --tls-key file is not the private key of the --tls-cert certificate".to_string();
            }
            format!(
                "public TLS (--tls-cert, --tls-key{}): {}",
                if tls.client_ca_pem.is_some() {
                    ", --tls-client-ca"
                } else {
                    ""
                },
                reason
            )
        })
}

/// An error and its sources, `: `-separated: tonic's transport error says only
/// "transport error", its source says what rustls refused.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(code: i32) -> io::Error {
        io::Error::from_raw_os_error(code)
    }

    #[test]
    fn fd_exhaustion_backs_off_doubling_up_to_100_ms() {
        let emfile = os(24);
        let first = accept_backoff(&emfile, None);
        assert_eq!(first, Some(Duration::from_millis(10)));
        let mut pause = first;
        for _ in 0..10 {
            pause = accept_backoff(&emfile, pause);
        }
        assert_eq!(pause, Some(Duration::from_millis(100)));
        // ENFILE, ENOBUFS, ENOMEM: the same.
        for code in [23, 105, 12] {
            assert_eq!(accept_backoff(&os(code), None), Some(BACKOFF_MIN));
        }
    }

    #[test]
    fn an_error_about_one_connection_retries_at_once() {
        for kind in [
            io::ErrorKind::ConnectionAborted,
            io::ErrorKind::ConnectionReset,
            io::ErrorKind::Interrupted,
        ] {
            assert_eq!(
                accept_backoff(&io::Error::from(kind), Some(BACKOFF_MAX)),
                None
            );
        }
    }

    #[test]
    fn tonics_size_and_decode_errors_are_mapped_and_nothing_else() {
        let size = map_status(
            Code::OutOfRange,
            "Error, decoded message length too large: found 5000000 bytes, the limit is: 4194304 bytes",
        )
        .unwrap();
        assert_eq!(size.code(), Code::ResourceExhausted);
        assert!(size.message().contains("4194304"), "{}", size.message());
        let decode = map_status(
            Code::Internal,
            "failed to decode Protobuf message: invalid wire type",
        )
        .unwrap();
        assert_eq!(decode.code(), Code::InvalidArgument);
        assert!(map_status(Code::Internal, "shard panicked").is_none());
        assert!(map_status(Code::OutOfRange, "window id too far").is_none());
        assert!(map_status(Code::InvalidArgument, "key: empty").is_none());
    }

    #[test]
    fn the_log_speaks_once_per_interval_and_counts_the_rest() {
        let mut log = RateLimitedLog::default();
        assert_eq!(log.due(), Some(0));
        assert_eq!(log.due(), None);
        assert_eq!(log.due(), None);
        log.last = Some(Instant::now() - LOG_EVERY);
        assert_eq!(log.due(), Some(2));
    }
}
