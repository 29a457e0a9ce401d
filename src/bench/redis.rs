//! The reference design on the same machine: a `redis-server` on a free loopback port
//! running the design reference's sliding-window-counter Lua script, spoken to with a
//! minimal RESP client (commands out, replies in, pipelining by writing several
//! commands before reading).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// The design reference's script (`bench/sliding_window.lua`).
pub const SCRIPT: &str = include_str!("../../bench/sliding_window.lua");

/// A RESP reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// `+OK`
    Simple(String),
    /// `-ERR …`
    Error(String),
    /// `:1`
    Integer(i64),
    /// `$n …` (None for a null bulk string)
    Bulk(Option<Vec<u8>>),
    /// `*n …`
    Array(Vec<Reply>),
}

/// One connection to Redis.
pub struct Conn {
    reader: BufReader<tokio::net::tcp::OwnedReadHalf>,
    writer: tokio::net::tcp::OwnedWriteHalf,
    out: Vec<u8>,
}

impl Conn {
    /// Connect to `addr`.
    pub async fn connect(addr: &str) -> anyhow::Result<Self> {
        let stream = TcpStream::connect(addr)
            .await
            .with_context(|| format!("connecting to redis at {addr}"))?;
        stream.set_nodelay(true)?;
        let (r, w) = stream.into_split();
        Ok(Self {
            reader: BufReader::new(r),
            writer: w,
            out: Vec::with_capacity(4096),
        })
    }

    /// Queue one command (sent by [`Conn::flush`]).
    pub fn push(&mut self, args: &[&[u8]]) {
        self.out
            .extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
        for arg in args {
            self.out
                .extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
            self.out.extend_from_slice(arg);
            self.out.extend_from_slice(b"\r\n");
        }
    }

    /// Send every queued command.
    pub async fn flush(&mut self) -> anyhow::Result<()> {
        self.writer.write_all(&self.out).await?;
        self.out.clear();
        Ok(())
    }

    /// Send one command and read its reply.
    pub async fn call(&mut self, args: &[&[u8]]) -> anyhow::Result<Reply> {
        self.push(args);
        self.flush().await?;
        self.read().await
    }

    /// Read one reply.
    pub async fn read(&mut self) -> anyhow::Result<Reply> {
        Box::pin(self.read_inner()).await
    }

    async fn read_inner(&mut self) -> anyhow::Result<Reply> {
        let mut line = Vec::new();
        self.reader.read_until(b'\n', &mut line).await?;
        if line.len() < 3 {
            bail!("connection closed by redis");
        }
        let body = std::str::from_utf8(&line[1..line.len() - 2])?.to_string();
        Ok(match line[0] {
            b'+' => Reply::Simple(body),
            b'-' => Reply::Error(body),
            b':' => Reply::Integer(body.parse()?),
            b'$' => {
                let len: i64 = body.parse()?;
                if len < 0 {
                    Reply::Bulk(None)
                } else {
                    let mut data = vec![0; len as usize + 2];
                    tokio::io::AsyncReadExt::read_exact(&mut self.reader, &mut data).await?;
                    data.truncate(len as usize);
                    Reply::Bulk(Some(data))
                }
            }
            b'*' => {
                let len: i64 = body.parse()?;
                let mut items = Vec::with_capacity(len.max(0) as usize);
                for _ in 0..len.max(0) {
                    items.push(Box::pin(self.read_inner()).await?);
                }
                Reply::Array(items)
            }
            other => bail!("unexpected RESP type byte {other:#x}"),
        })
    }
}

/// A `redis-server` child process, killed on drop.
pub struct Server {
    child: Child,
    /// `127.0.0.1:port`
    pub addr: String,
}

impl Server {
    /// The server's process id (its CPU time is measured like a node's).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Path of `redis-server`, installing Debian's package if it is missing.
fn redis_server_binary() -> anyhow::Result<String> {
    let found = |name: &str| {
        Command::new("sh")
            .args(["-c", &format!("command -v {name}")])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    if let Some(path) = found("redis-server") {
        return Ok(path);
    }
    eprintln!("redis-server not found: installing Debian's redis-server (apt-get)");
    let status = Command::new("sh")
        .args([
            "-c",
            "(apt-get update -qq || true) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server",
        ])
        .status()
        .context("running apt-get")?;
    if !status.success() {
        bail!("could not install redis-server (apt-get failed); install it and retry");
    }
    found("redis-server").context("redis-server still not on PATH after installing")
}

/// Start `redis-server` on a free loopback port, with persistence off.
pub async fn start() -> anyhow::Result<Server> {
    let binary = redis_server_binary()?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let child = Command::new(&binary)
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "yes",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {binary}"))?;
    let server = Server {
        child,
        addr: format!("127.0.0.1:{port}"),
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(mut conn) = Conn::connect(&server.addr).await {
            if conn.call(&[b"PING"]).await.is_ok() {
                return Ok(server);
            }
        }
        if Instant::now() > deadline {
            bail!("redis-server did not answer PING within 10 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `SCRIPT LOAD` the reference script; returns its SHA.
pub async fn load_script(addr: &str) -> anyhow::Result<String> {
    let mut conn = Conn::connect(addr).await?;
    match conn.call(&[b"SCRIPT", b"LOAD", SCRIPT.as_bytes()]).await? {
        Reply::Bulk(Some(sha)) => Ok(String::from_utf8(sha)?),
        other => bail!("SCRIPT LOAD answered {other:?}"),
    }
}

/// `redis-server --version`, for the results file.
pub fn version() -> String {
    redis_server_binary()
        .ok()
        .and_then(|b| Command::new(b).arg("--version").output().ok())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

/// `INFO memory` → `used_memory` in bytes.
pub async fn used_memory(addr: &str) -> anyhow::Result<u64> {
    let mut conn = Conn::connect(addr).await?;
    let Reply::Bulk(Some(info)) = conn.call(&[b"INFO", b"memory"]).await? else {
        bail!("INFO memory gave no bulk string");
    };
    String::from_utf8_lossy(&info)
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .context("no used_memory in INFO")?
        .trim()
        .parse()
        .context("used_memory not a number")
}

/// Queue one EVALSHA of the reference script for `key` at wall time `now_ms`.
pub fn push_check(
    conn: &mut Conn,
    sha: &str,
    key: &str,
    route: &str,
    limit: u64,
    window_ms: u64,
    now_ms: u64,
) {
    let idx = now_ms / window_ms;
    let elapsed = now_ms % window_ms;
    // The {client} hash tag, as in the design reference's data model.
    let current = format!("rl:{{{key}}}:{route}:{idx}");
    let previous = format!("rl:{{{key}}}:{route}:{}", idx.saturating_sub(1));
    conn.push(&[
        b"EVALSHA",
        sha.as_bytes(),
        b"2",
        current.as_bytes(),
        previous.as_bytes(),
        limit.to_string().as_bytes(),
        window_ms.to_string().as_bytes(),
        elapsed.to_string().as_bytes(),
    ]);
}

/// Whether a script reply admitted the request (`{1, …}`); errors are `Err`.
pub fn admitted(reply: &Reply) -> Result<bool, String> {
    match reply {
        Reply::Array(items) => Ok(matches!(items.first(), Some(Reply::Integer(1)))),
        Reply::Error(e) => Err(e.clone()),
        other => Err(format!("unexpected reply {other:?}")),
    }
}
