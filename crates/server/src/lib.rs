//! Quince's local server: the routes the tools people already use speak — OpenAI's
//! `/v1/models`, `/v1/chat/completions` and `/v1/completions`, and Anthropic's `/v1/messages` —
//! answered by the loaded model through the same command surface as the app
//! ([`chat::Chat::complete`]): requests decode together in the engine's batch, resume from the
//! prompt cache, and wait in line (with a timeout) when there is no room.
//!
//! Every request needs the key: `Authorization: Bearer KEY`, or `x-api-key: KEY`. The server
//! listens on loopback unless [`ServeOptions::allow_lan`] is set. Errors take each API's own
//! shape (`{"error": {"message", "type", "code"}}` for OpenAI's routes).

#![deny(missing_docs)]

mod anthropic;
mod content;
mod error;
mod openai;
mod run;
mod tools;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use chat::Chat;
use tokio::sync::oneshot;

pub use error::ApiError;

/// The port `quince serve` and the app listen on by default.
pub const DEFAULT_PORT: u16 = 8741;
/// The largest request body accepted by default (images travel inside it).
pub const DEFAULT_MAX_BODY_BYTES: usize = 64 << 20;
/// How long a request waits for room by default before it gets a 503.
pub const DEFAULT_QUEUE_TIMEOUT: Duration = Duration::from_secs(120);

/// How the server listens.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// The address to listen on (default loopback).
    pub host: IpAddr,
    /// The port (0: any free one).
    pub port: u16,
    /// The key every request must carry.
    pub api_key: String,
    /// Whether an address other than loopback may be used.
    pub allow_lan: bool,
    /// The largest request body, bytes.
    pub max_body_bytes: usize,
    /// How long a request may wait for room before it is refused with 503.
    pub queue_timeout: Duration,
}

impl ServeOptions {
    /// Loopback, [`DEFAULT_PORT`], and `api_key`.
    pub fn new(api_key: impl Into<String>) -> ServeOptions {
        ServeOptions {
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: DEFAULT_PORT,
            api_key: api_key.into(),
            allow_lan: false,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            queue_timeout: DEFAULT_QUEUE_TIMEOUT,
        }
    }
}

/// Why the server did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The options do not make sense.
    #[error("{0}")]
    Invalid(String),
    /// The address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
}

/// A new random key: `qk-` and 32 hex digits.
pub fn new_api_key() -> String {
    let mut bytes = [0u8; 16];
    // The OS's generator; should it fail, the clock and the process id still make a key no
    // other process guesses by chance (the key guards a loopback port by default).
    if getrandom::fill(&mut bytes).is_err() {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let seed = now ^ (u128::from(std::process::id()) << 64);
        bytes = seed.to_le_bytes();
    }
    format!("qk-{}", bytes.iter().map(|b| format!("{b:02x}")).collect::<String>())
}

/// What every handler shares.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) chat: Chat,
    key: String,
    pub(crate) queue_timeout: Duration,
}

pub(crate) type AppState = State<Arc<Shared>>;

/// A running server; [`Server::stop`] ends it.
#[derive(Debug)]
pub struct Server {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    /// Binds the address and serves `chat`'s loaded model until [`Server::stop`].
    pub async fn start(chat: Chat, options: ServeOptions) -> Result<Server, StartError> {
        if options.api_key.trim().is_empty() {
            return Err(StartError::Invalid("the server needs an API key".into()));
        }
        if !options.host.is_loopback() && !options.allow_lan {
            return Err(StartError::Invalid(format!(
                "{} is reachable from other machines: pass --allow-lan to listen there",
                options.host
            )));
        }
        let addr = SocketAddr::new(options.host, options.port);
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| StartError::Bind { addr, source })?;
        let addr = listener.local_addr().map_err(|source| StartError::Bind { addr, source })?;
        let shared =
            Arc::new(Shared { chat, key: options.api_key, queue_timeout: options.queue_timeout });
        let app = router(shared, options.max_body_bytes);
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let serve = axum::serve(listener, app).with_graceful_shutdown(async move {
                let _ = stopped.await;
            });
            if let Err(e) = serve.await {
                tracing::error!("the local server stopped: {e}");
            }
        });
        tracing::info!(%addr, "local server listening");
        Ok(Server { addr, stop: Some(stop), task })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The base URL clients are given: `http://HOST:PORT/v1`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Stops accepting requests, lets the ones in flight end, and returns when it has stopped.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.task).await;
    }

    /// Waits until the server stops (it stops only through [`Server::stop`] or an error).
    pub async fn wait(mut self) {
        let _ = (&mut self.task).await;
    }
}

fn router(shared: Arc<Shared>, max_body_bytes: usize) -> Router {
    Router::new()
        .route("/v1/models", get(openai::models))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/messages", post(anthropic::messages))
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(shared.clone(), authorize))
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(shared)
}

/// Whether a path is one of Anthropic's (its errors take Anthropic's shape).
fn anthropic_path(path: &str) -> bool {
    path.starts_with("/v1/messages")
}

/// Refuses requests without the key.
async fn authorize(State(shared): AppState, request: Request, next: Next) -> Response {
    let headers = request.headers();
    let bearer = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let x_api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok()).map(str::trim);
    if bearer == Some(shared.key.as_str()) || x_api_key == Some(shared.key.as_str()) {
        return next.run(request).await;
    }
    let error = ApiError::unauthorized(if bearer.is_none() && x_api_key.is_none() {
        "no API key: send it as `Authorization: Bearer KEY` (or `x-api-key: KEY`)"
    } else {
        "the API key is not this server's"
    });
    if anthropic_path(request.uri().path()) { error.anthropic() } else { error.into_response() }
}

async fn not_found(request: Request) -> Response {
    let error = ApiError::not_found(format!(
        "no route {} {}: this server answers /v1/models, /v1/chat/completions, \
         /v1/completions and /v1/messages",
        request.method(),
        request.uri().path()
    ));
    if anthropic_path(request.uri().path()) { error.anthropic() } else { error.into_response() }
}
