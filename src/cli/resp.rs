//! The RESP face's flags of `serve` (docs/redis-clients.md): off unless --resp-listen.

use std::net::SocketAddr;
use std::path::PathBuf;

use ringlimit::node::resp_listener::RespConfig;
use ringlimit::server::resp::RespLimits;

/// Redis clients' `CL.THROTTLE` on a listener of its own.
#[derive(clap::Args)]
pub struct RespArgs {
    /// Serve the RESP face (redis-cell's CL.THROTTLE for Redis clients) on this
    /// address. Each call carries its own limit, so any caller that reaches the port
    /// chooses its own: only for trusted callers (docs/redis-clients.md). Off by default.
    #[arg(long, env = "RINGLIMIT_RESP_LISTEN")]
    resp_listen: Option<SocketAddr>,
    /// File holding the password Redis clients must send with AUTH (first line, at
    /// least 16 visible characters); until then only AUTH, HELLO and QUIT are served.
    #[arg(long, env = "RINGLIMIT_RESP_TOKEN_FILE", requires = "resp_listen")]
    resp_token_file: Option<PathBuf>,
    /// Most open RESP connections; one more is told "max number of clients reached".
    #[arg(long, default_value_t = RespLimits::default().max_connections)]
    resp_max_connections: usize,
    /// Most pipelined commands of one connection decided at once.
    #[arg(long, default_value_t = RespLimits::default().max_pipeline)]
    resp_max_pipeline: usize,
    /// A RESP connection idle this long (seconds) is closed.
    #[arg(long, default_value_t = RespLimits::default().idle_timeout.as_secs())]
    resp_idle_timeout_s: u64,
}

impl RespArgs {
    /// The face's settings, or `None` without --resp-listen.
    pub fn config(&self) -> anyhow::Result<Option<RespConfig>> {
        let Some(listen) = self.resp_listen else {
            return Ok(None);
        };
        let mut config = RespConfig::on(listen);
        if let Some(path) = &self.resp_token_file {
            config = config.with_token_file(path).map_err(anyhow::Error::msg)?;
        }
        config.limits.max_connections = self.resp_max_connections;
        config.limits.max_pipeline = self.resp_max_pipeline;
        config.limits.idle_timeout = std::time::Duration::from_secs(self.resp_idle_timeout_s);
        Ok(Some(config))
    }
}
