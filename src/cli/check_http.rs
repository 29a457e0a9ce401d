//! The flags of the HTTP check face (`serve --check-http-listen`), off unless that
//! flag is given: docs/http-gateways.md.

use std::net::SocketAddr;

use ringlimit::node::config::CheckHttpConfig;
use ringlimit::server::forward_auth::{ForwardAuthConfig, IpNet, KeySource};

/// JSON checks (`POST /v1/check`) and gateways' forward-auth (`/v1/forward-auth`) over
/// HTTP/1.1, on a listener of its own (never the ops port).
#[derive(clap::Args)]
pub struct CheckHttpArgs {
    /// Serve the HTTP check face on this address (default: not served).
    #[arg(long, env = "RINGLIMIT_CHECK_HTTP_LISTEN")]
    check_http_listen: Option<SocketAddr>,
    /// Forward-auth: take the client key from this request header (an API key the
    /// gateway passes on); a request without it is answered 401. Default: the client's
    /// address (see --check-http-trusted-proxy).
    #[arg(
        long,
        env = "RINGLIMIT_CHECK_HTTP_KEY_HEADER",
        requires = "check_http_listen"
    )]
    check_http_key_header: Option<String>,
    /// Forward-auth: a proxy (address or CIDR network) whose X-Forwarded-For and
    /// X-Real-IP are believed; repeat for several. A client reaching the face from
    /// anywhere else is keyed by its own address, whatever headers it sends.
    #[arg(
        long,
        env = "RINGLIMIT_CHECK_HTTP_TRUSTED_PROXIES",
        value_delimiter = ',',
        value_parser = IpNet::parse,
        requires = "check_http_listen"
    )]
    check_http_trusted_proxy: Vec<IpNet>,
    /// Most connections the HTTP check face holds at once.
    #[arg(long, default_value_t = 1024)]
    check_http_max_connections: usize,
}

impl CheckHttpArgs {
    /// The face's configuration, or `None` when it is not served.
    pub fn load(&self) -> anyhow::Result<Option<CheckHttpConfig>> {
        let Some(listen) = self.check_http_listen else {
            return Ok(None);
        };
        let key = match &self.check_http_key_header {
            Some(name) => KeySource::Header(
                http::HeaderName::try_from(name.as_str())
                    .map_err(|e| anyhow::anyhow!("--check-http-key-header {name:?}: {e}"))?,
            ),
            None => KeySource::ClientAddress,
        };
        let mut config = CheckHttpConfig::on(listen);
        config.forward_auth = ForwardAuthConfig {
            key,
            trusted_proxies: self.check_http_trusted_proxy.clone(),
        };
        config.max_connections = self.check_http_max_connections;
        Ok(Some(config))
    }
}
