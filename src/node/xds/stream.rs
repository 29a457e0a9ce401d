//! One aggregated discovery stream to the control plane, in the session's terms: open it
//! with a subscription, send ACKs and NACKs, read responses. The tonic half of the xDS
//! adapter (`wire` is the message half); what to send is decided elsewhere.

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

use super::wire::{self, Identity};
use super::XdsError;
use crate::config::xds::{XdsRequest, XdsResponse};
use crate::proto::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use crate::proto::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};

/// Where and as whom a node subscribes.
#[derive(Debug, Clone)]
pub struct XdsTarget {
    /// The control plane (plaintext HTTP/2).
    pub endpoint: Endpoint,
    /// `DiscoveryRequest.node`.
    pub identity: Identity,
    /// Largest response accepted, in bytes.
    pub max_message_bytes: usize,
}

/// An open stream.
pub struct XdsStream {
    requests: mpsc::Sender<DiscoveryRequest>,
    responses: tonic::Streaming<DiscoveryResponse>,
    identity: Identity,
}

/// A connection to the control plane, not yet subscribed.
pub struct XdsConnection {
    client: AggregatedDiscoveryServiceClient<Channel>,
    identity: Identity,
}

impl XdsConnection {
    /// Connects (TCP and the HTTP/2 preface; bounded by the endpoint's connect timeout).
    pub async fn connect(target: &XdsTarget) -> Result<Self, XdsError> {
        let channel = target
            .endpoint
            .connect()
            .await
            .map_err(|e| XdsError::Connect(causes(&e)))?;
        Ok(Self {
            client: AggregatedDiscoveryServiceClient::new(channel)
                .max_decoding_message_size(target.max_message_bytes),
            identity: target.identity.clone(),
        })
    }

    /// Opens the stream with `first`. The subscription is queued before the call
    /// starts: a control plane may send its response headers only with its first
    /// response, which it sends only once it has read the subscription.
    pub async fn subscribe(mut self, first: &XdsRequest) -> Result<XdsStream, XdsError> {
        // Room for an ACK or NACK per response: the session sends one, then reads again.
        let (requests, queued) = mpsc::channel(4);
        requests
            .try_send(wire::request(first, &self.identity))
            .expect("an empty channel has room");
        let responses = self
            .client
            .stream_aggregated_resources(ReceiverStream::new(queued))
            .await
            .map_err(XdsError::Refused)?
            .into_inner();
        Ok(XdsStream {
            requests,
            responses,
            identity: self.identity,
        })
    }
}

impl XdsStream {
    /// Sends an ACK or NACK.
    pub async fn send(&self, request: &XdsRequest) -> Result<(), XdsError> {
        self.requests
            .send(wire::request(request, &self.identity))
            .await
            .map_err(|_| XdsError::Closed)
    }

    /// The next response; an error when the stream ends or breaks.
    pub async fn recv(&mut self) -> Result<XdsResponse, XdsError> {
        match self.responses.message().await {
            Ok(Some(response)) => Ok(wire::response(response)),
            Ok(None) => Err(XdsError::Closed),
            Err(status) => Err(XdsError::Broken(status)),
        }
    }
}

/// An error with its causes (tonic's transport error alone says only "transport error").
fn causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    let mut last = text.clone();
    while let Some(cause) = source {
        // hyper and tonic wrap some causes in a layer saying the same thing.
        let said = cause.to_string();
        if said != last {
            text.push_str(": ");
            text.push_str(&said);
        }
        last = said;
        source = cause.source();
    }
    text
}
