//! Serving one framed peer connection (the format is `cluster::link::frames`): the
//! owner's side of the lean transport for forwarded batches.
//!
//! One task per connection: it reads the magic and the hello (within the handshake
//! timeout), checks the hello's proof as every peer call's header is checked, welcomes
//! or refuses, then reads calls and writes answers through the same [`ForwardAnswers`]
//! an HTTP/2 `ForwardStream` is served by, so a batch is bounded, refused, decided and
//! answered the same way whichever transport carried it.
//!
//! What bounds a connection: a length prefix beyond the node's peer message cap ends
//! it before any of the frame is buffered; a frame that is not a `ForwardCall` ends it
//! (nothing of it decided); a sender that completes no frame for the face's idle bound
//! (the HTTP/2 keepalive's interval plus its timeout: what a silent HTTP/2 peer gets),
//! or does not take an answer for as long, is cut off; at most [`STREAM_IN_FLIGHT`] calls
//! are decided at once, and a sender that reads no answers stops being read once the
//! socket's buffers fill. The connection holds one of the peer face's connection slots
//! from its accept to its end.
//!
//! [`STREAM_IN_FLIGHT`]: super::STREAM_IN_FLIGHT

use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use futures_util::{FutureExt, StreamExt};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::{ForwardAnswers, PeerService};
use crate::cluster::link::frames::{
    self, put_frame, take_magic, FrameError, FrameReader, FRAMES_PATH, MAX_HELLO,
};
use crate::proto::peer::{ForwardAnswer, ForwardCall};
use crate::server::peer_auth::PeerAuthLayer;

/// Answers written in one go at most (bytes): the answers ready together leave in one
/// write up to this size.
const WRITE_CHUNK: usize = 64 * 1024;

/// Why a framed connection ended before or instead of serving calls.
#[derive(Debug, thiserror::Error)]
pub enum FramesEnded {
    /// The bytes were not frames this node accepts.
    #[error("{0}")]
    Frame(#[from] FrameError),
    /// The hello's proof was refused (answered `UNAUTHENTICATED`).
    #[error("refused: {0}")]
    Refused(crate::keyring::CallRefused),
    /// The sender went quiet for too long (the handshake, a frame or an answer).
    #[error("no progress within {0:?}")]
    Idle(Duration),
    /// The socket failed or closed early.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The sender ended the connection (or the node stopped) and every call taken was
    /// answered.
    #[error("finished")]
    Finished,
}

impl FramesEnded {
    /// Why the node closed the connection, as `ringlimit_peer_frames_closed_total`
    /// labels it; `None` for a connection the sender ended once answered.
    pub fn reason(&self) -> Option<&'static str> {
        Some(match self {
            FramesEnded::Frame(FrameError::BadMagic) => "bad_magic",
            FramesEnded::Frame(FrameError::TooLarge { .. }) => "too_large",
            FramesEnded::Frame(FrameError::Malformed(_)) => "malformed",
            FramesEnded::Refused(_) => "unauthenticated",
            FramesEnded::Idle(_) => "idle",
            FramesEnded::Io(_) => "io",
            FramesEnded::Finished => return None,
        })
    }
}

/// The settings a framed connection is served with.
#[derive(Clone)]
pub struct FramesFace {
    /// The peer service deciding the batches.
    pub service: Arc<PeerService>,
    /// The proof check of the peer face (its key ring, replay guard and counters).
    pub auth: PeerAuthLayer,
    /// Largest frame accepted: the node's peer message cap.
    pub max_frame: usize,
    /// How long the magic and the hello may take to arrive.
    pub handshake: Duration,
    /// How long a connection may go without a whole frame in, or an answer taken out.
    /// Longer than a sender keeps sending on one connection (it opens a new one every
    /// 15 s), so only a connection no member would still send on is cut.
    pub idle: Duration,
}

/// Read into `buf` once, within `within`: `Ok(false)` at the end of the stream.
async fn fill<R: AsyncRead + Unpin>(
    io: &mut R,
    buf: &mut BytesMut,
    within: Duration,
) -> Result<bool, FramesEnded> {
    if buf.capacity() - buf.len() < 1024 {
        buf.reserve(4096);
    }
    match tokio::time::timeout(within, io.read_buf(buf)).await {
        Ok(Ok(0)) => Ok(false),
        Ok(Ok(_)) => Ok(true),
        Ok(Err(error)) => Err(error.into()),
        Err(_) => Err(FramesEnded::Idle(within)),
    }
}

/// The next whole frame of `io`, each read within `within`; `None` at a clean end.
async fn next_frame<R: AsyncRead + Unpin>(
    io: &mut R,
    buf: &mut BytesMut,
    reader: &FrameReader,
    within: Duration,
) -> Result<Option<bytes::Bytes>, FramesEnded> {
    loop {
        if let Some(frame) = reader.next(buf)? {
            return Ok(Some(frame));
        }
        if !fill(io, buf, within).await? {
            if buf.is_empty() {
                return Ok(None);
            }
            return Err(FramesEnded::Io(std::io::ErrorKind::UnexpectedEof.into()));
        }
    }
}

/// The magic and the hello, within the handshake timeout: the proof they carry (empty
/// without a cluster key).
async fn handshake<R: AsyncRead + Unpin>(
    io: &mut R,
    buf: &mut BytesMut,
    face: &FramesFace,
) -> Result<bytes::Bytes, FramesEnded> {
    let read = async {
        loop {
            match take_magic(buf) {
                Some(true) => break,
                Some(false) => return Err(FrameError::BadMagic.into()),
                None if !fill(io, buf, face.handshake).await? => {
                    return Err(FramesEnded::Io(std::io::ErrorKind::UnexpectedEof.into()))
                }
                None => {}
            }
        }
        next_frame(io, buf, &FrameReader::new(MAX_HELLO), face.handshake)
            .await?
            .ok_or_else(|| FramesEnded::Io(std::io::ErrorKind::UnexpectedEof.into()))
    };
    tokio::time::timeout(face.handshake, read)
        .await
        .map_err(|_| FramesEnded::Idle(face.handshake))?
}

/// The welcome: `code` 0, or the status a refused call would get.
fn welcome(code: tonic::Code, message: String) -> ForwardAnswer {
    ForwardAnswer {
        call: 0,
        response: None,
        code: code as u32,
        message,
    }
}

/// Serve one framed connection whose first bytes are [`frames::MAGIC`] until the sender
/// ends it, it breaks a bound, or the node stops; why it ended. A connection that ended
/// otherwise than by its sender's end of writing is counted in
/// `ringlimit_peer_frames_closed_total{reason}` ([`FramesEnded::reason`]). A member
/// of the same build never sends a bad magic, a frame too large or one that is not a
/// call, nor a refused proof: those are strangers, another cluster or a bug, worth an
/// alert rather than a debug line. `idle` and `io` also come from members (a link
/// quiet past the idle bound, a crashed or partitioned node).
pub async fn serve_frames<IO>(io: IO, face: FramesFace) -> FramesEnded
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let ended = serve_connection(io, face).await;
    if let Some(reason) = ended.reason() {
        metrics::counter!("ringlimit_peer_frames_closed_total", "reason" => reason).increment(1);
    }
    ended
}

async fn serve_connection<IO>(io: IO, face: FramesFace) -> FramesEnded
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let (mut rd, mut wr) = tokio::io::split(io);
    let mut buf = BytesMut::with_capacity(4096);
    let mut out = BytesMut::with_capacity(4096);
    let hello = match handshake(&mut rd, &mut buf, &face).await {
        Ok(hello) => hello,
        Err(ended) => return ended,
    };
    let proof = std::str::from_utf8(&hello).ok().filter(|p| !p.is_empty());
    if let Err(refused) = face.auth.admit(FRAMES_PATH, proof) {
        put_frame(
            &welcome(tonic::Code::Unauthenticated, refused.to_string()),
            &mut out,
        );
        let _ = tokio::time::timeout(face.handshake, wr.write_all(&out)).await;
        return FramesEnded::Refused(refused);
    }
    put_frame(&welcome(tonic::Code::Ok, String::new()), &mut out);
    if let Err(error) = wr.write_all(&out).await {
        return error.into();
    }

    // The calls as a stream for `ForwardAnswers`: its first error ends the reading
    // (the answers to calls already taken are still written), and is why the
    // connection ended once they are.
    let reader = FrameReader::new(face.max_frame);
    let idle = face.idle;
    let why: Arc<std::sync::Mutex<Option<FramesEnded>>> = Arc::default();
    let reading = why.clone();
    let calls = futures_util::stream::unfold(Some((rd, buf, reader)), move |state| {
        let reading = reading.clone();
        async move {
            let (mut rd, mut buf, reader) = state?;
            let next = match next_frame(&mut rd, &mut buf, &reader, idle).await {
                Ok(Some(frame)) => frames::decode::<ForwardCall>(frame).map_err(FramesEnded::from),
                Ok(None) => return None,
                Err(ended) => Err(ended),
            };
            match next {
                Ok(call) => Some((Ok(call), Some((rd, buf, reader)))),
                Err(ended) => {
                    let message = ended.to_string();
                    *reading.lock().unwrap_or_else(|e| e.into_inner()) = Some(ended);
                    Some((Err(message), None))
                }
            }
        }
    });
    let mut answers = ForwardAnswers::new(face.service.clone(), Box::pin(calls));
    while let Some(answer) = answers.next().await {
        out.clear();
        let Ok(answer) = answer else { break };
        put_frame(&answer, &mut out);
        // What else is ready leaves in the same write.
        while out.len() < WRITE_CHUNK {
            match answers.next().now_or_never() {
                Some(Some(Ok(answer))) => put_frame(&answer, &mut out),
                _ => break,
            }
        }
        match tokio::time::timeout(idle, wr.write_all(&out)).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => return error.into(),
            Err(_) => return FramesEnded::Idle(idle),
        }
    }
    let _ = wr.shutdown().await;
    let read_error = why.lock().unwrap_or_else(|e| e.into_inner()).take();
    read_error.unwrap_or(FramesEnded::Finished)
}
