//! The shell around one peer's [`Batcher`] and [`Session`]: a batcher task per peer fed
//! by a bounded channel, a driver task per stream (a framed connection, or an HTTP/2
//! `ForwardStream`) writing its calls and reading its answers, a task per unary call. They only move events between channels, sockets and timers and the
//! two state machines, and hand answers to callers' reply channels: a batch on a stream
//! costs no task and no channel of its own.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use tokio::sync::{mpsc, oneshot, Notify};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::cluster::Remote;
use crate::proto::peer::peer_client::PeerClient;
use crate::proto::peer::{
    ForwardAnswer, ForwardCall, ForwardItem, ForwardRequest, ForwardResponse,
};

use super::batcher::{Batcher, Next, Queued};
use super::frames::{self, FrameReader};
use super::session::{Delivery, Failed, Route, Session};
use super::{wire, ForwardConfig, ForwardError, Signed};

/// Where a forwarded check's caller waits for its answer.
pub(super) type ReplyTx = oneshot::Sender<Result<Remote, ForwardError>>;

/// Per check of a batch: the rule this node matched (the owner matches the same one, so
/// its answer naming it costs no copy) and the caller's reply.
pub(super) type Reply = (Arc<str>, ReplyTx);

/// A check queued for a peer.
pub(super) struct Pending {
    pub(super) item: ForwardItem,
    pub(super) rule: Arc<str>,
    /// When the caller stops waiting for this check.
    pub(super) deadline: Instant,
    pub(super) reply: ReplyTx,
}

impl Queued for Pending {
    fn deadline(&self) -> Instant {
        self.deadline
    }

    fn gave_up(&self) -> bool {
        self.reply.is_closed()
    }
}

/// Batches queued for one stream's request body. At most `max_in_flight` are out, so
/// only an unlimited setting (0) can fill it; a batch that finds it full fails over.
const STREAM_FRAMES: usize = 64;

/// One peer's session and the request body of its current stream.
struct Wired {
    session: Session<Reply>,
    /// The sender of the current stream's request body, with the stream's number.
    /// Dropping it ends the body: the peer answers what it holds and ends its side.
    frames: Option<(u64, mpsc::Sender<ForwardCall>)>,
}

/// Where and how a link dials its framed connections.
pub(super) struct Dial {
    /// The peer's peer address.
    pub(super) addr: SocketAddr,
    /// This node's source address for it, if pinned.
    pub(super) local_ip: Option<std::net::IpAddr>,
    /// Signs each connection's hello.
    pub(super) signer: Signed,
    /// Largest answer frame read.
    pub(super) max_frame: usize,
}

/// The shared side of one link: its session behind a lock, and what its tasks need.
pub(super) struct Streams {
    client: PeerClient<Signed>,
    /// How to dial framed connections (`None`: the link has TLS, so streams are HTTP/2).
    dial: Option<Dial>,
    peer: Arc<str>,
    state: Mutex<Wired>,
    /// A slot came free (an answer, a failure, a deadline): wakes a waiting batcher.
    freed: Notify,
    /// How long a stream may take to open, and how long a retired link's driver still
    /// waits for answers: the forward deadline, after which no caller waits.
    patience: Duration,
    /// The node's shutdown: ends every driver at once.
    cancel: CancellationToken,
    /// Cancelled when the link's batcher ends (the link was replaced): no batch will be
    /// sent any more, and the drivers end once what they carry is answered or due.
    retired: CancellationToken,
    /// Where the drivers and unary calls run, so the node's shutdown waits for them.
    tracker: TaskTracker,
    opened: metrics::Counter,
}

impl Streams {
    /// The shared side of a link to `peer` over `client`.
    pub(super) fn new(
        (client, dial): (PeerClient<Signed>, Option<Dial>),
        peer: Arc<str>,
        config: &ForwardConfig,
        cancel: CancellationToken,
        tracker: TaskTracker,
    ) -> Self {
        let dial = dial.filter(|_| config.frames && config.tls.is_none());
        let session = Session::new(peer.clone(), config.stream_max_age, !config.stream)
            .with_frames(dial.is_some());
        Self {
            client,
            dial,
            peer,
            state: Mutex::new(Wired {
                session,
                frames: None,
            }),
            freed: Notify::new(),
            patience: config.timeout,
            cancel,
            retired: CancellationToken::new(),
            tracker,
            opened: metrics::counter!("ringlimit_forward_streams_opened_total"),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Wired> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Send a batch (its request and its callers), due at `deadline`.
    fn send(self: &Arc<Self>, request: ForwardRequest, replies: Vec<Reply>, deadline: Instant) {
        let now = Instant::now();
        let mut wired = self.lock();
        let expired = wired.session.expire(now);
        let unsent = match wired.session.send(now, replies, deadline) {
            Route::Unary { call } => {
                let unary = send_unary(self.clone(), call, request, deadline);
                self.tracker
                    .spawn(tracing::Instrument::in_current_span(unary));
                None
            }
            route @ Route::Stream { .. } => self.put_frame(&mut wired, route, request, now),
        };
        drop(wired);
        let freed = expired.is_some() || unsent.is_some();
        fail(expired);
        if let Some((replies, error)) = unsent {
            fail_batch(replies, &error);
        }
        if freed {
            self.freed.notify_one();
        }
    }

    /// Put a batch's frame on its stream's request body (opening the stream first if
    /// the session says so). A driver can end between two batches; nothing was sent
    /// on its stream then, so the batch goes on a fresh one. What could not be sent
    /// comes back with why.
    fn put_frame(
        self: &Arc<Self>,
        wired: &mut Wired,
        mut route: Route,
        request: ForwardRequest,
        now: Instant,
    ) -> Option<(Vec<Reply>, ForwardError)> {
        let Route::Stream { call, .. } = route else {
            unreachable!("only stream routes carry frames")
        };
        let mut frame = ForwardCall {
            call,
            request: Some(request),
        };
        for _ in 0..2 {
            let Route::Stream { stream, open, .. } = route else {
                break;
            };
            if open {
                self.open(wired, stream);
            }
            let sent = match &wired.frames {
                Some((id, frames)) if *id == stream => frames.try_send(frame),
                _ => Err(mpsc::error::TrySendError::Closed(frame)),
            };
            match sent {
                Ok(()) => return None,
                Err(mpsc::error::TrySendError::Full(_)) => {
                    let error = ForwardError::Overloaded(self.peer.to_string());
                    return wired.session.unsent(call).map(|r| (r, error));
                }
                Err(mpsc::error::TrySendError::Closed(back)) => {
                    frame = back;
                    wired.frames = None;
                    route = wired.session.reroute(call, now)?;
                }
            }
        }
        let error =
            ForwardError::Unreachable(self.peer.to_string(), "forward stream closed".into());
        wired.session.unsent(call).map(|r| (r, error))
    }

    /// Open stream `id`: a new request body, and a driver reading its answers. The
    /// previous body's sender is dropped here, so that stream ends once answered.
    fn open(self: &Arc<Self>, wired: &mut Wired, id: u64) {
        let (frames, body) = mpsc::channel(STREAM_FRAMES);
        wired.frames = Some((id, frames));
        self.opened.increment(1);
        let framed = wired.session.is_framed();
        self.tracker
            .spawn(tracing::Instrument::in_current_span(drive(
                self.clone(),
                id,
                body,
                framed,
            )));
    }

    /// Batch `call` was answered (or its call failed).
    fn answered(&self, call: u64, result: Result<ForwardResponse, ForwardError>) {
        let delivery = self.lock().session.answer(call, result);
        if let Some(delivery) = delivery {
            deliver(delivery, &self.peer);
            self.freed.notify_one();
        }
    }

    /// Apply a transition that fails batches, under the lock; fail them outside it.
    fn failing(&self, transition: impl FnOnce(&mut Wired) -> Option<Failed<Reply>>) {
        let failed = transition(&mut self.lock());
        if failed.is_some() {
            fail(failed);
            self.freed.notify_one();
        }
    }

    /// Stream `id` ended: fail its batches; drop its body if it was the current one.
    fn closed(&self, id: u64, why: &str) {
        self.failing(|w| {
            if w.frames.as_ref().is_some_and(|(f, _)| *f == id) {
                w.frames = None;
            }
            w.session.close(id, why)
        });
    }

    fn in_flight(&self) -> usize {
        self.lock().session.in_flight()
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.lock().session.next_deadline()
    }
}

/// Fail every batch of `failed` with its error.
fn fail(failed: Option<Failed<Reply>>) {
    if let Some(Failed { error, batches }) = failed {
        for replies in batches {
            fail_batch(replies, &error);
        }
    }
}

fn fail_batch(replies: Vec<Reply>, error: &ForwardError) {
    for (_, reply) in replies {
        let _ = reply.send(Err(error.clone()));
    }
}

/// Hand a batch's answer (or its failure) to its callers.
fn deliver(delivery: Delivery<Reply, ForwardResponse>, peer: &Arc<str>) {
    match delivery {
        Delivery::Answer { replies, answer } => {
            let decider = wire::decider(&answer, peer);
            for (outcome, (rule, reply)) in answer.outcomes.into_iter().zip(replies) {
                let _ = reply.send(Ok(wire::remote(outcome, &decider, rule)));
            }
        }
        Delivery::Fail { replies, error } => fail_batch(replies, &error),
    }
}

/// Open stream `id` (a framed connection when `framed`, else a `ForwardStream`) with
/// `body` as its calls and hand each answer to its batch until the stream ends, the
/// link goes or the node stops; then fail what is still waiting on it.
async fn drive(streams: Arc<Streams>, id: u64, body: mpsc::Receiver<ForwardCall>, framed: bool) {
    if framed {
        return drive_framed(streams, id, body).await;
    }
    let read = async {
        let mut client = streams.client.clone();
        // An owner that accepted the connection but never answers the stream's headers
        // (paused, or the connection at its stream limit) must not keep the session
        // current: every batch on it would wait for its deadline.
        let opened = tokio::time::timeout(
            streams.patience,
            client.forward_stream(tokio_stream::wrappers::ReceiverStream::new(body)),
        )
        .await;
        let Ok(opened) = opened else {
            return "the forward stream did not open in time".to_string();
        };
        let mut answers = match opened {
            Ok(response) => response.into_inner(),
            Err(status) if status.code() == tonic::Code::Unimplemented => {
                tracing::info!(peer = %streams.peer, "peer does not stream forwards (an older build): using unary calls");
                streams.failing(|w| w.session.not_streamed(id, status.message()));
                return status.message().to_string();
            }
            Err(status) => return status.message().to_string(),
        };
        loop {
            match answers.message().await {
                Ok(Some(answer)) => {
                    let (call, result) = wire::stream_answer(answer, &streams.peer);
                    streams.answered(call, result);
                }
                Ok(None) => return "forward stream ended".to_string(),
                Err(status) => return status.message().to_string(),
            }
        }
    };
    finish(&streams, id, read).await;
}

/// Run a stream's driver `read` until it ends (why), the node stops (every batch
/// fails) or the link was replaced and its patience ran out; then close the stream.
async fn finish(streams: &Streams, id: u64, read: impl std::future::Future<Output = String>) {
    let retired = async {
        streams.retired.cancelled().await;
        tokio::time::sleep(streams.patience).await;
    };
    let why = tokio::select! {
        why = read => why,
        _ = streams.cancel.cancelled() => {
            streams.failing(|w| w.session.shutdown());
            return;
        }
        _ = retired => "link replaced".to_string(),
    };
    streams.closed(id, &why);
}

/// How a framed connection's opening went.
enum Opened {
    /// Welcomed: calls may go.
    Welcomed(tokio::net::TcpStream, BytesMut),
    /// It did not open (why): the stream closes like any broken one.
    Failed(String),
    /// The peer closed it at the magic without a welcome: it does not speak frames.
    NotFramed(String),
}

/// Dial `dial`, send the magic and the hello, and read the welcome, all within
/// `patience`.
async fn open_framed(dial: &Dial, patience: Duration) -> Opened {
    let connect = async {
        let socket = match dial.addr {
            SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
            SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
        }?;
        if let Some(ip) = dial.local_ip {
            socket.bind(SocketAddr::new(ip, 0))?;
        }
        let stream = socket.connect(dial.addr).await?;
        stream.set_nodelay(true)?;
        Ok::<_, std::io::Error>(stream)
    };
    let handshake = async {
        let mut stream = match connect.await {
            Ok(stream) => stream,
            Err(error) => return Opened::Failed(format!("framed connection: {error}")),
        };
        let mut out = BytesMut::with_capacity(256);
        out.extend_from_slice(frames::MAGIC);
        let proof = dial.signer.proof(frames::FRAMES_PATH).unwrap_or_default();
        frames::put_raw_frame(proof.as_bytes(), &mut out);
        if let Err(error) = stream.write_all(&out).await {
            return Opened::Failed(format!("framed connection: {error}"));
        }
        let reader = FrameReader::new(dial.max_frame);
        let mut buf = BytesMut::with_capacity(8192);
        let welcome = loop {
            match reader.next(&mut buf) {
                Ok(Some(frame)) => break frames::decode::<ForwardAnswer>(frame).ok(),
                Ok(None) => {}
                Err(_) => break None,
            }
            match stream.read_buf(&mut buf).await {
                Ok(0) | Err(_) => break None,
                Ok(_) => {}
            }
        };
        match welcome {
            Some(w) if w.code == 0 => Opened::Welcomed(stream, buf),
            Some(w) => Opened::Failed(format!(
                "framed connection refused ({:?}): {}",
                tonic::Code::from(w.code as i32),
                w.message
            )),
            // An older build's HTTP/2 server closes a connection whose preface is not
            // HTTP/2's, with no welcome.
            None => Opened::NotFramed("the peer closed the framed connection unwelcomed".into()),
        }
    };
    tokio::time::timeout(patience, handshake)
        .await
        .unwrap_or_else(|_| Opened::Failed("the framed connection did not open in time".into()))
}

/// Drive a framed connection: open it, then write each call of `body` as a frame (the
/// calls ready together in one write) and hand each answer frame to its batch, until
/// the body ends (the stream was replaced) and every answer is in, or the connection
/// breaks.
async fn drive_framed(streams: Arc<Streams>, id: u64, mut body: mpsc::Receiver<ForwardCall>) {
    let run = async {
        let dial = streams.dial.as_ref().expect("framed streams have a dial");
        let (stream, mut buf) = match open_framed(dial, streams.patience).await {
            Opened::Welcomed(stream, buf) => (stream, buf),
            Opened::Failed(why) => return why,
            Opened::NotFramed(why) => {
                tracing::info!(peer = %streams.peer, "peer does not speak framed forwards (an older build): using HTTP/2 streams");
                streams.failing(|w| w.session.not_framed(id, &why));
                return why;
            }
        };
        let (mut rd, mut wr) = stream.into_split();
        let write = async {
            let mut out = BytesMut::with_capacity(8192);
            while let Some(call) = body.recv().await {
                out.clear();
                frames::put_frame(&call, &mut out);
                while let Ok(call) = body.try_recv() {
                    frames::put_frame(&call, &mut out);
                }
                wr.write_all(&out).await?;
            }
            // The stream was replaced: the owner answers what it holds, then ends.
            wr.shutdown().await
        };
        let reader = FrameReader::new(dial.max_frame);
        let read = async {
            loop {
                let frame = match reader.next(&mut buf) {
                    Ok(Some(frame)) => frame,
                    Ok(None) => match rd.read_buf(&mut buf).await {
                        Ok(0) => return "forward connection ended".to_string(),
                        Ok(_) => continue,
                        Err(error) => return error.to_string(),
                    },
                    Err(error) => return error.to_string(),
                };
                match frames::decode::<ForwardAnswer>(frame) {
                    Ok(answer) => {
                        let (call, result) = wire::stream_answer(answer, &streams.peer);
                        streams.answered(call, result);
                    }
                    Err(error) => return error.to_string(),
                }
            }
        };
        tokio::pin!(read);
        tokio::select! {
            why = &mut read => why,
            written = write => match written {
                // Replaced: the owner answers what it holds and closes. An owner that
                // does neither (paused) is given up once no caller can still be
                // waiting, so the connection never outlives its last deadline.
                Ok(()) => tokio::time::timeout(streams.patience, read)
                    .await
                    .unwrap_or_else(|_| "replaced, and unanswered past the deadline".into()),
                Err(error) => error.to_string(),
            },
        }
    };
    finish(&streams, id, run).await;
}

/// A batch as one unary `Forward` call (a peer without the stream, `--forward-unary`).
async fn send_unary(streams: Arc<Streams>, call: u64, request: ForwardRequest, deadline: Instant) {
    let mut client = streams.client.clone();
    let result = match tokio::time::timeout_at(deadline, client.forward(request)).await {
        Ok(Ok(response)) => Ok(response.into_inner()),
        Ok(Err(status)) => Err(super::calls::call_error(&streams.peer, Some(&status))),
        Err(_) => Err(ForwardError::Timeout(streams.peer.to_string())),
    };
    streams.answered(call, result);
}

/// Retires a link's [`Streams`] when its batcher ends, however it ends: the current
/// stream's request body closes (the owner answers what it holds, then ends its side).
struct Retire(Arc<Streams>);

impl Drop for Retire {
    fn drop(&mut self) {
        let mut wired = self.0.lock();
        wired.session.retire();
        wired.frames = None;
        drop(wired);
        self.0.retired.cancel();
    }
}

/// Coalesce queued checks for one peer into batches, as its [`Batcher`] says, sent on
/// the peer's stream (or as `Forward` calls to a peer without it).
pub(super) async fn batcher(
    mut rx: mpsc::Receiver<Pending>,
    streams: Arc<Streams>,
    config: ForwardConfig,
    cancel: CancellationToken,
) {
    let _retire = Retire(streams.clone());
    let sizes = metrics::histogram!("ringlimit_forward_batch_size");
    let mut batcher = Batcher::new(config.max_batch, config.max_in_flight, config.flush_delay);
    loop {
        while batcher.room() > 0 {
            match rx.try_recv() {
                Ok(pending) => batcher.queue().push(pending),
                Err(_) => break,
            }
        }
        let room = batcher.room();
        match batcher.next(Instant::now(), streams.in_flight()) {
            Next::Idle => tokio::select! {
                _ = cancel.cancelled() => return,
                received = rx.recv_many(batcher.queue(), room) => if received == 0 { return },
            },
            // A batch the peer never answers gives its slot back at its deadline.
            Next::WaitSlot => {
                let due = streams.next_deadline();
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = streams.freed.notified() => {}
                    _ = sleep_until_some(due) => {
                        streams.failing(|w| w.session.expire(Instant::now()));
                    }
                }
            }
            Next::FlushAt(until) => tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep_until(until) => {}
                received = rx.recv_many(batcher.queue(), room) => if received == 0 {
                    // The link is going: send what is queued now.
                    send_batch(&mut batcher, &streams, &sizes);
                },
            },
            Next::Send => send_batch(&mut batcher, &streams, &sizes),
        }
    }
}

/// Cut the queued checks into a batch and send it.
fn send_batch(batcher: &mut Batcher<Pending>, streams: &Arc<Streams>, sizes: &metrics::Histogram) {
    let Some((deadline, batch)) = batcher.take() else {
        return;
    };
    sizes.record(batch.len() as f64);
    let mut items = Vec::with_capacity(batch.len());
    let mut replies = Vec::with_capacity(batch.len());
    for p in batch {
        items.push(p.item);
        replies.push((p.rule, p.reply));
    }
    let request = wire::forward_request(items, deadline_ms(deadline));
    streams.send(request, replies, deadline);
}

/// `deadline` as wall-clock milliseconds, the clock the owner checks it against.
fn deadline_ms(deadline: Instant) -> u64 {
    let left = deadline.saturating_duration_since(Instant::now());
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| (d + left).as_millis() as u64)
}

/// Sleep until `due`, or forever without one.
async fn sleep_until_some(due: Option<Instant>) {
    match due {
        Some(due) => tokio::time::sleep_until(due).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
    use tonic::{Request, Response, Status};

    use std::sync::atomic::Ordering;

    use super::*;
    use crate::cluster::link::PeerPool;
    use crate::cluster::policy::testkit;
    use crate::membership::Member;
    use crate::proto::peer::peer_server::{Peer, PeerServer};
    use crate::proto::peer::{
        ForwardAnswer, ForwardOutcome, InstallRequest, InstallResponse, RefundRequest,
        RefundResponse, RulesRequest, RulesResponse, StatusRequest, StatusResponse,
        WriteRulesRequest, WriteRulesResponse,
    };

    /// A peer that answers every item admitted, counting how it was asked; `streams`
    /// false plays an older build without `ForwardStream`.
    #[derive(Clone, Default)]
    struct FakePeer {
        streams: bool,
        /// Take stream calls and never answer them (a paused owner).
        silent: bool,
        /// Never answer a stream's headers (an owner paused after accepting).
        hang_open: bool,
        unary_calls: Arc<AtomicUsize>,
        streams_opened: Arc<AtomicUsize>,
        streams_ended: Arc<AtomicUsize>,
        stream_calls: Arc<AtomicUsize>,
    }

    fn answer(request: &ForwardRequest) -> ForwardResponse {
        ForwardResponse {
            node_id: "owner".into(),
            generation: 1,
            outcomes: request
                .items
                .iter()
                .map(|_| ForwardOutcome {
                    allowed: true,
                    limit: 100,
                    remaining: 99,
                    rule: "default".into(),
                    algorithm: "token_bucket".into(),
                    ..Default::default()
                })
                .collect(),
        }
    }

    #[tonic::async_trait]
    impl Peer for FakePeer {
        async fn forward(
            &self,
            request: Request<ForwardRequest>,
        ) -> Result<Response<ForwardResponse>, Status> {
            self.unary_calls.fetch_add(1, Ordering::SeqCst);
            Ok(Response::new(answer(request.get_ref())))
        }

        type ForwardStreamStream = ReceiverStream<Result<ForwardAnswer, Status>>;

        async fn forward_stream(
            &self,
            request: Request<tonic::Streaming<ForwardCall>>,
        ) -> Result<Response<Self::ForwardStreamStream>, Status> {
            if !self.streams {
                return Err(Status::unimplemented("not in this build"));
            }
            self.streams_opened.fetch_add(1, Ordering::SeqCst);
            if self.hang_open {
                std::future::pending::<()>().await;
            }
            let mut calls = request.into_inner();
            let (tx, rx) = mpsc::channel(4);
            let me = self.clone();
            tokio::spawn(async move {
                while let Ok(Some(call)) = calls.message().await {
                    me.stream_calls.fetch_add(1, Ordering::SeqCst);
                    if me.silent {
                        continue;
                    }
                    let response = call.request.as_ref().map(answer);
                    let sent = tx.send(Ok(ForwardAnswer {
                        call: call.call,
                        response,
                        code: 0,
                        message: String::new(),
                    }));
                    if sent.await.is_err() {
                        break;
                    }
                }
                me.streams_ended.fetch_add(1, Ordering::SeqCst);
            });
            Ok(Response::new(ReceiverStream::new(rx)))
        }

        async fn refund(
            &self,
            _: Request<RefundRequest>,
        ) -> Result<Response<RefundResponse>, Status> {
            Err(Status::unimplemented(""))
        }

        async fn install(
            &self,
            _: Request<InstallRequest>,
        ) -> Result<Response<InstallResponse>, Status> {
            Err(Status::unimplemented(""))
        }

        async fn status(
            &self,
            _: Request<StatusRequest>,
        ) -> Result<Response<StatusResponse>, Status> {
            Err(Status::unimplemented(""))
        }

        async fn rules(&self, _: Request<RulesRequest>) -> Result<Response<RulesResponse>, Status> {
            Err(Status::unimplemented(""))
        }

        async fn write_rules(
            &self,
            _: Request<WriteRulesRequest>,
        ) -> Result<Response<WriteRulesResponse>, Status> {
            Err(Status::unimplemented(""))
        }

        async fn counters(
            &self,
            _: Request<crate::proto::peer::CountersRequest>,
        ) -> Result<Response<crate::proto::peer::CountersResponse>, Status> {
            Err(Status::unimplemented(""))
        }

        async fn replicate(
            &self,
            _: Request<InstallRequest>,
        ) -> Result<Response<InstallResponse>, Status> {
            Err(Status::unimplemented(""))
        }

        async fn restore(
            &self,
            _: Request<crate::proto::peer::RestoreRequest>,
        ) -> Result<Response<crate::proto::peer::RestoreResponse>, Status> {
            Err(Status::unimplemented(""))
        }

        async fn reserve(
            &self,
            _: Request<crate::proto::peer::PeerReserveRequest>,
        ) -> Result<Response<crate::proto::peer::PeerReserveResponse>, Status> {
            Err(Status::unimplemented(""))
        }

        async fn commit(
            &self,
            _: Request<crate::proto::peer::PeerCommitRequest>,
        ) -> Result<Response<crate::proto::peer::PeerCommitResponse>, Status> {
            Err(Status::unimplemented(""))
        }

        async fn lease(
            &self,
            _: Request<crate::proto::peer::PeerLeaseRequest>,
        ) -> Result<Response<crate::proto::peer::PeerLeaseResponse>, Status> {
            Err(Status::unimplemented(""))
        }

        async fn return_lease(
            &self,
            _: Request<crate::proto::peer::PeerReturnLeaseRequest>,
        ) -> Result<Response<crate::proto::peer::PeerReturnLeaseResponse>, Status> {
            Err(Status::unimplemented(""))
        }
    }

    /// Serve `peer` on a loopback port; the member to forward to it.
    async fn serve(peer: FakePeer) -> Member {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(PeerServer::new(peer))
                .serve_with_incoming(TcpListenerStream::new(listener)),
        );
        testkit::member("owner", port)
    }

    /// A pool forwarding on HTTP/2 streams (these fakes serve no frames).
    fn pool(config: ForwardConfig) -> PeerPool {
        framed_pool(ForwardConfig {
            frames: false,
            ..config
        })
    }

    /// A pool forwarding as `config` says, frames included.
    fn framed_pool(config: ForwardConfig) -> PeerPool {
        PeerPool::new(
            "entry".into(),
            ForwardConfig {
                // Generous: a loaded test machine must not turn these into timeouts.
                timeout: Duration::from_secs(5),
                ..config
            },
            TaskTracker::new(),
            CancellationToken::new(),
        )
    }

    /// A pool whose forwards give up after 100 ms, for owners that never answer.
    fn impatient_pool() -> PeerPool {
        PeerPool::new(
            "entry".into(),
            ForwardConfig {
                timeout: Duration::from_millis(100),
                frames: false,
                ..ForwardConfig::default()
            },
            TaskTracker::new(),
            CancellationToken::new(),
        )
    }

    #[tokio::test]
    async fn a_batch_the_owner_never_answers_frees_its_slot_at_its_deadline() {
        let peer = FakePeer {
            streams: true,
            silent: true,
            ..FakePeer::default()
        };
        let owner = serve(peer.clone()).await;
        // One batch in flight at a time (the default): a batch that kept its slot
        // would hold every later one back.
        let pool = impatient_pool();
        let item = testkit::item("k", "GET /x", 1);
        for _ in 0..3 {
            let answer = pool.forward(&owner, &item).await;
            assert!(
                matches!(answer, Err(ForwardError::Timeout(_))),
                "{answer:?}"
            );
        }
        // Each batch reached the owner: none waited behind an unanswered one.
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while peer.stream_calls.load(Ordering::SeqCst) < 3 && std::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(peer.stream_calls.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_stream_that_never_opens_is_given_up_at_the_forward_deadline() {
        let peer = FakePeer {
            streams: true,
            hang_open: true,
            ..FakePeer::default()
        };
        let owner = serve(peer.clone()).await;
        let pool = impatient_pool();
        let item = testkit::item("k", "GET /x", 1);
        let first = pool.forward(&owner, &item).await;
        assert!(matches!(first, Err(ForwardError::Timeout(_))), "{first:?}");
        // Once the open is given up, the next batch tries a new stream instead of
        // queueing on the dead one for the stream's whole age (15 s).
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while peer.streams_opened.load(Ordering::SeqCst) < 2 && std::time::Instant::now() < until {
            let _ = pool.forward(&owner, &item).await;
        }
        assert!(peer.streams_opened.load(Ordering::SeqCst) >= 2);
    }

    #[tokio::test]
    async fn an_older_peer_without_the_stream_gets_unary_forwards_after_one_failed_batch() {
        let peer = FakePeer::default();
        let owner = serve(peer.clone()).await;
        let pool = pool(ForwardConfig::default());
        let item = testkit::item("k", "GET /x", 1);
        let first = pool.forward(&owner, &item).await;
        assert!(
            matches!(first, Err(ForwardError::Unreachable(..))),
            "the batch that finds out falls back: {first:?}"
        );
        for _ in 0..3 {
            let answer = pool.forward(&owner, &item).await.expect("a unary forward");
            assert!(answer.decision.allowed);
            assert_eq!(answer.decider.node_id.as_ref(), "owner");
        }
        assert_eq!(peer.unary_calls.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn batches_travel_on_one_stream_which_is_renewed_by_age_without_losing_a_batch() {
        let peer = FakePeer {
            streams: true,
            ..FakePeer::default()
        };
        let owner = serve(peer.clone()).await;
        let pool = pool(ForwardConfig {
            stream_max_age: Duration::from_millis(20),
            ..ForwardConfig::default()
        });
        let item = testkit::item("k", "GET /x", 1);
        let started = std::time::Instant::now();
        let mut answered = 0;
        while started.elapsed() < Duration::from_millis(300) {
            let answer = pool
                .forward(&owner, &item)
                .await
                .expect("every batch answered");
            assert_eq!(answer.decision.remaining, 99);
            answered += 1;
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert_eq!(peer.unary_calls.load(Ordering::SeqCst), 0, "no unary call");
        assert_eq!(peer.stream_calls.load(Ordering::SeqCst), answered);
        let opened = peer.streams_opened.load(Ordering::SeqCst);
        assert!(opened >= 2, "300 ms of 20 ms streams opened only {opened}");
        // Every replaced stream ends (its sender let go): none is left open but the
        // current one.
        let ended = || peer.streams_ended.load(Ordering::SeqCst);
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while ended() + 1 < opened && std::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(ended() + 1, opened, "replaced streams were closed");
    }

    /// Serve frames on a loopback port the way an owner does, answering every item
    /// admitted: the member to forward to it, the hellos it got, the calls it answered.
    async fn serve_frames_fake() -> (Member, Arc<Mutex<Vec<String>>>, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let hellos = Arc::new(Mutex::new(Vec::new()));
        let calls = Arc::new(AtomicUsize::new(0));
        let (seen, answered) = (hellos.clone(), calls.clone());
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let (seen, answered) = (seen.clone(), answered.clone());
                tokio::spawn(async move {
                    let mut buf = BytesMut::new();
                    while buf.len() < frames::MAGIC.len() {
                        if socket.read_buf(&mut buf).await.unwrap_or(0) == 0 {
                            return;
                        }
                    }
                    assert_eq!(frames::take_magic(&mut buf), Some(true));
                    let reader = FrameReader::new(1 << 20);
                    let mut welcomed = false;
                    loop {
                        while let Some(frame) = reader.next(&mut buf).unwrap() {
                            let mut out = BytesMut::new();
                            if !welcomed {
                                welcomed = true;
                                seen.lock()
                                    .unwrap()
                                    .push(String::from_utf8(frame.to_vec()).unwrap());
                                frames::put_frame(&ForwardAnswer::default(), &mut out);
                            } else {
                                let call: ForwardCall = frames::decode(frame).unwrap();
                                answered.fetch_add(1, Ordering::SeqCst);
                                let response = call.request.as_ref().map(answer);
                                let reply = ForwardAnswer {
                                    call: call.call,
                                    response,
                                    code: 0,
                                    message: String::new(),
                                };
                                frames::put_frame(&reply, &mut out);
                            }
                            if socket.write_all(&out).await.is_err() {
                                return;
                            }
                        }
                        if socket.read_buf(&mut buf).await.unwrap_or(0) == 0 {
                            return;
                        }
                    }
                });
            }
        });
        (testkit::member("owner", port), hellos, calls)
    }

    #[tokio::test]
    async fn batches_travel_as_frames_to_a_peer_that_speaks_them() {
        let (owner, hellos, calls) = serve_frames_fake().await;
        let pool = framed_pool(ForwardConfig::default());
        let item = testkit::item("k", "GET /x", 1);
        for _ in 0..3 {
            let answer = pool.forward(&owner, &item).await.expect("a framed answer");
            assert!(answer.decision.allowed);
            assert_eq!(answer.decider.node_id.as_ref(), "owner");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 3);
        // One connection, opened with a hello (empty: this pool has no cluster key).
        assert_eq!(*hellos.lock().unwrap(), vec![String::new()]);
    }

    #[tokio::test]
    async fn an_older_peer_without_frames_gets_http2_streams_after_one_failed_batch() {
        let peer = FakePeer {
            streams: true,
            ..FakePeer::default()
        };
        let owner = serve(peer.clone()).await;
        let pool = framed_pool(ForwardConfig::default());
        let item = testkit::item("k", "GET /x", 1);
        let first = pool.forward(&owner, &item).await;
        assert!(
            matches!(first, Err(ForwardError::Unreachable(..))),
            "the batch that finds out falls back: {first:?}"
        );
        for _ in 0..3 {
            let answer = pool
                .forward(&owner, &item)
                .await
                .expect("an HTTP/2 stream answer");
            assert!(answer.decision.allowed);
        }
        assert_eq!(peer.stream_calls.load(Ordering::SeqCst), 3);
        assert_eq!(peer.unary_calls.load(Ordering::SeqCst), 0);
    }

    /// A framed owner for the answer-matching tests: it welcomes each connection, reads
    /// calls, and answers each item with its own cost as `remaining` and `window_id`
    /// (so a caller can tell its answer from another's). On its first connection it
    /// reads one call and closes without answering; on later ones it first sends an
    /// answer for call 0 (a call of the dead connection), then holds the calls until two
    /// have come and answers them in reverse order.
    async fn serve_frames_shuffling() -> Member {
        fn costed(call: &ForwardCall) -> ForwardAnswer {
            let items = call.request.as_ref().map_or(&[][..], |r| &r.items[..]);
            ForwardAnswer {
                call: call.call,
                response: Some(ForwardResponse {
                    node_id: "owner".into(),
                    generation: 1,
                    outcomes: items
                        .iter()
                        .map(|item| ForwardOutcome {
                            allowed: false,
                            limit: 100,
                            remaining: item.cost,
                            window_id: Some(item.cost),
                            retry_after_ms: 500,
                            same_rule: true,
                            ..Default::default()
                        })
                        .collect(),
                }),
                code: 0,
                message: String::new(),
            }
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            let mut first = true;
            while let Ok((mut socket, _)) = listener.accept().await {
                let dead = std::mem::replace(&mut first, false);
                tokio::spawn(async move {
                    let reader = FrameReader::new(1 << 20);
                    let mut buf = BytesMut::new();
                    let mut frames_in = Vec::new();
                    let (mut magic, mut welcomed) = (false, false);
                    let mut held: Vec<ForwardCall> = Vec::new();
                    loop {
                        if socket.read_buf(&mut buf).await.unwrap_or(0) == 0 {
                            return;
                        }
                        if !magic {
                            match frames::take_magic(&mut buf) {
                                Some(true) => magic = true,
                                None => continue,
                                Some(false) => panic!("not the frames magic"),
                            }
                        }
                        while let Some(frame) = reader.next(&mut buf).unwrap() {
                            frames_in.push(frame);
                        }
                        let mut out = BytesMut::new();
                        for frame in frames_in.drain(..) {
                            if !welcomed {
                                welcomed = true;
                                frames::put_frame(&ForwardAnswer::default(), &mut out);
                                if !dead {
                                    // An answer to a call of the connection that died.
                                    let stale = ForwardCall {
                                        call: 0,
                                        request: Some(ForwardRequest {
                                            items: vec![ForwardItem {
                                                cost: 77,
                                                ..ForwardItem::default()
                                            }],
                                            ..ForwardRequest::default()
                                        }),
                                    };
                                    frames::put_frame(&costed(&stale), &mut out);
                                }
                                continue;
                            }
                            let call: ForwardCall = frames::decode(frame).unwrap();
                            if dead {
                                return; // closed with the call unanswered
                            }
                            held.push(call);
                            if held.len() == 2 {
                                for call in held.drain(..).rev() {
                                    frames::put_frame(&costed(&call), &mut out);
                                }
                            }
                        }
                        if !out.is_empty() && socket.write_all(&out).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        testkit::member("owner", port)
    }

    #[tokio::test]
    async fn each_caller_gets_its_own_answer_across_a_reconnect_and_answers_out_of_order() {
        let owner = serve_frames_shuffling().await;
        // One check per batch, two batches out at once: the owner's reversed answers
        // must each reach the batch they name.
        let pool = framed_pool(ForwardConfig {
            max_batch: 1,
            max_in_flight: 2,
            ..ForwardConfig::default()
        });
        // The first connection dies with its call unanswered: that caller fails, and
        // nothing it carried is answered later to anyone.
        let lost = pool.forward(&owner, &testkit::item("k", "GET /x", 5)).await;
        assert!(
            matches!(lost, Err(ForwardError::Unreachable(..))),
            "{lost:?}"
        );
        // The next connection opens with an answer to that dead call's number, then
        // answers two calls in reverse order.
        let a = testkit::item("k", "GET /x", 1);
        let b = testkit::item("k", "GET /x", 2);
        let (first, second) = tokio::join!(pool.forward(&owner, &a), pool.forward(&owner, &b));
        let (first, second) = (first.expect("answered"), second.expect("answered"));
        assert_eq!(
            (first.decision.remaining, first.decision.window_id),
            (1, Some(1)),
            "the cost-1 check got its own answer"
        );
        assert_eq!(
            (second.decision.remaining, second.decision.window_id),
            (2, Some(2)),
            "the cost-2 check got its own answer"
        );
    }
}
