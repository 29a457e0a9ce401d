//! The floor of `ringlimit bench --protocol floor`: a bare tonic server answering only
//! `grpc.health.v1`, started by the bench as a child process of this same binary (the
//! hidden `bench-floor-server` subcommand), so its tonic, hyper, h2 and tokio are the
//! node's to the patch version and its runtime is built by the same function
//! (`cli::runtime_with`: multi-thread, `--threads` workers or the usable cores;
//! current-thread for `--threads 1`).
//!
//! With no `--layers` it is the default `tonic::transport::Server::builder()`, the
//! health service and nothing else. Each layer adds one piece of the node's public face,
//! taken from the library rather than copied, so the bench can price them one at a time:
//!
//! - `limits`: the HTTP/2 and timeout settings of `node::grpc::limited` (the request
//!   timeout is a tower layer around every call; keepalive and maximum age are timers
//!   per connection).
//! - `timeout`: of those, the request timeout alone (`Server::builder().timeout(..)`).
//! - `incoming`: the node's accept loop, `node::grpc::incoming` (connection cap,
//!   handshake deadline on every read until the preface, a gauge per connection).
//! - `layers`: `StatusMappingLayer` and `HoldUntilSentLayer`, the two tower layers the
//!   public face puts around every service.
//! - `services`: reflection v1 and v1alpha beside health (more routes to match), with
//!   `max_decoding_message_size` as the node sets it.
//! - `logging`: the node's tracing subscriber (`RUST_LOG`, text format).
//! - `metrics`: the node's Prometheus recorder installed (what `metrics::` calls on the
//!   path, such as the connection gauge, then record into).

use std::num::NonZeroUsize;

use tokio::net::TcpListener;

use ringlimit::node::config::{GrpcLimits, MAX_MESSAGE_BYTES};
use ringlimit::node::grpc;
use ringlimit::server::answer_budget::HoldUntilSentLayer;

/// One piece of the node's public face added to the bare server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Layer {
    Limits,
    Timeout,
    Incoming,
    Layers,
    Services,
    Logging,
    Metrics,
}

impl Layer {
    /// Every layer, in the order the bench adds them one at a time.
    pub const EACH: [Layer; 7] = [
        Layer::Limits,
        Layer::Timeout,
        Layer::Incoming,
        Layer::Layers,
        Layer::Services,
        Layer::Logging,
        Layer::Metrics,
    ];

    /// All of them at once (`limits` includes `timeout`).
    pub const ALL: [Layer; 6] = [
        Layer::Limits,
        Layer::Incoming,
        Layer::Layers,
        Layer::Services,
        Layer::Logging,
        Layer::Metrics,
    ];

    /// The flag value.
    pub fn name(self) -> &'static str {
        match self {
            Layer::Limits => "limits",
            Layer::Timeout => "timeout",
            Layer::Incoming => "incoming",
            Layer::Layers => "layers",
            Layer::Services => "services",
            Layer::Logging => "logging",
            Layer::Metrics => "metrics",
        }
    }

    /// The bench's name for the bare server with this layer only.
    pub fn label(self) -> &'static str {
        match self {
            Layer::Limits => "bare+limits",
            Layer::Timeout => "bare+timeout",
            Layer::Incoming => "bare+incoming",
            Layer::Layers => "bare+layers",
            Layer::Services => "bare+services",
            Layer::Logging => "bare+logging",
            Layer::Metrics => "bare+metrics",
        }
    }
}

/// `ringlimit bench-floor-server` (hidden: started by `ringlimit bench --protocol floor`).
#[derive(Debug, clap::Args)]
pub struct FloorServerArgs {
    /// Worker threads of the runtime, as `serve --threads`.
    #[arg(long)]
    threads: Option<NonZeroUsize>,
    /// Pieces of the node's public face to add (comma-separated; none: the bare server).
    #[arg(long, value_enum, value_delimiter = ',')]
    layers: Vec<Layer>,
}

/// Serves health on 127.0.0.1:0 until killed; prints `floor ready grpc=ADDR` first.
pub fn run(args: FloorServerArgs) -> anyhow::Result<()> {
    let has = |layer| args.layers.contains(&layer);
    if has(Layer::Logging) {
        crate::cli::init_logging(crate::cli::LogFormat::Text);
    }
    crate::cli::runtime_with(args.threads.map(usize::from))?.block_on(async move {
        if has(Layer::Metrics) {
            ringlimit::node::metrics_handle();
        }
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        println!("floor ready grpc={}", listener.local_addr()?);
        let limits = GrpcLimits::default();
        let mut builder = if has(Layer::Limits) {
            grpc::limited(&limits)
        } else if has(Layer::Timeout) {
            tonic::transport::Server::builder().timeout(limits.request_timeout)
        } else {
            tonic::transport::Server::builder()
        };
        let (_reporter, health) = tonic_health::server::health_reporter();
        let max = MAX_MESSAGE_BYTES;
        let reflection = has(Layer::Services).then(|| {
            let reflect = || {
                tonic_reflection::server::Builder::configure()
                    .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            };
            let v1 = reflect().build_v1().expect("health's descriptors");
            let v1alpha = reflect().build_v1alpha().expect("health's descriptors");
            (
                v1.max_decoding_message_size(max),
                v1alpha.max_decoding_message_size(max),
            )
        });
        let (health, v1, v1alpha) = match reflection {
            Some((v1, v1alpha)) => (
                health.max_decoding_message_size(max),
                Some(v1),
                Some(v1alpha),
            ),
            None => (health, None, None),
        };
        // One expansion per combination: each changes the server's type.
        macro_rules! serve {
            ($builder:expr, $incoming:expr) => {
                $builder
                    .add_service(health)
                    .add_optional_service(v1)
                    .add_optional_service(v1alpha)
                    .serve_with_incoming($incoming)
                    .await
            };
        }
        let served = match (has(Layer::Layers), has(Layer::Incoming)) {
            (false, false) => serve!(builder, bare_incoming(listener)),
            (false, true) => serve!(builder, grpc::incoming(listener, &limits)),
            (true, false) => serve!(
                builder
                    .layer(grpc::StatusMappingLayer)
                    .layer(HoldUntilSentLayer),
                bare_incoming(listener)
            ),
            (true, true) => serve!(
                builder
                    .layer(grpc::StatusMappingLayer)
                    .layer(HoldUntilSentLayer),
                grpc::incoming(listener, &limits)
            ),
        };
        served.map_err(anyhow::Error::from)
    })
}

/// What the default `Server::builder().serve(addr)` accepts with: tonic's own loop,
/// TCP_NODELAY on (tonic's default), nothing else.
fn bare_incoming(listener: TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}
