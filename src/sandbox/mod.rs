//! The Pushary sandbox: an in-process simulator of the Pushary server API,
//! served over real HTTP.
//!
//! It is both a product feature (`approvald dev` serves it, and a developer
//! answers decisions on its page as the phone would) and the peer that
//! integration tests drive. It follows `PUSHARY_PROTOCOL.md` and the published
//! Python SDK: the same paths, field names, status codes and callback
//! signature, so that pointing approvald at the real service is only a change
//! of base URL and keys.
//!
//! Alongside the API it serves an example effect target that verifies
//! Standard Webhooks deliveries and executes at most once per idempotency key,
//! and `/sandbox/api/` routes for inspection and fault injection.

mod api;
mod callbacks;
mod control;
mod effect;
mod error;
mod page;
mod permits;
mod state;
mod validate;
mod views;

#[cfg(test)]
mod tests;

use std::fmt;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::Context as _;
use axum::Router;
use axum::extract::DefaultBodyLimit;
use base64::Engine as _;
use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tower_http::trace::TraceLayer;

pub use effect::EffectDeliveryView;
pub use permits::ReceiptView;
pub use views::{CallbackState, CallbackView, DecisionView, PermitView};

use state::State;

/// Request bodies above this are refused with 413; Pushary payloads are small.
const BODY_LIMIT: usize = 64 * 1024;

/// The server caps every blocking wait (create with `wait`, `GET ?wait=N`)
/// here, as the real service does; the SDK's 65 s socket timeout relies on it.
const MAX_WAIT: Duration = Duration::from_secs(55);

/// How the sandbox behaves. `Default` gives fresh random credentials.
#[derive(Clone)]
pub struct SandboxConfig {
    /// The full key clients send as `Authorization: Bearer <key>`; form `pk_<id>.<secret>`.
    pub api_key: String,
    /// The initial secret for `X-Pushary-Signature` on callbacks.
    pub webhook_secret: String,
    /// A `whsec_` secret the example effect target verifies deliveries with;
    /// `None` accepts unsigned deliveries and marks them unverified.
    pub effect_secret: Option<String>,
    /// An approved decision must be consumed within this long after it was
    /// answered, else the consume is refused as `expired`.
    pub permit_ttl: Duration,
    /// Recipients (`externalId`) starting with this have no device.
    pub unreachable_prefix: String,
    /// Base for `decisionPageUrl`, `pollUrl` and enrollment links; defaults to
    /// `http://{bound address}`.
    pub public_url: Option<String>,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        Self {
            api_key: format!("pk_sandbox.{}", random_hex(16)),
            webhook_secret: new_webhook_secret(),
            effect_secret: None,
            permit_ttl: Duration::from_secs(600),
            unreachable_prefix: "unreachable".to_string(),
            public_url: None,
        }
    }
}

// Written by hand so that logging a config never prints its secrets.
impl fmt::Debug for SandboxConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SandboxConfig")
            .field("api_key", &"***")
            .field("webhook_secret", &"***")
            .field("effect_secret", &self.effect_secret.as_ref().map(|_| "***"))
            .field("permit_ttl", &self.permit_ttl)
            .field("unreachable_prefix", &self.unreachable_prefix)
            .field("public_url", &self.public_url)
            .finish()
    }
}

/// Whether answering a decision sends its callback.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallbackMode {
    /// Deliver the signed callback (with retries), as Pushary does.
    #[default]
    Send,
    /// Record the answer but never send the callback: a lost callback, which
    /// the receiver can only discover by polling.
    Drop,
}

/// A permit refusal, by its wire name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Refusal {
    NotAuthorized,
    ActionMismatch,
    Expired,
    AlreadyConsumed,
}

impl Refusal {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NotAuthorized => "not_authorized",
            Self::ActionMismatch => "action_mismatch",
            Self::Expired => "expired",
            Self::AlreadyConsumed => "already_consumed",
        }
    }
}

/// Everything the handlers share.
pub(crate) struct Shared {
    addr: SocketAddr,
    api_key: String,
    /// Decoded key of `SandboxConfig::effect_secret`.
    effect_key: Option<Vec<u8>>,
    permit_ttl: Duration,
    unreachable_prefix: String,
    public_url: String,
    state: Mutex<State>,
    /// Bumped after every state change, so waiters (long-polls, `wait_for`)
    /// re-check their condition instead of polling on a timer.
    changed: watch::Sender<u64>,
    http: reqwest::Client,
    /// Callbacks being sent now, at most `callbacks::IN_FLIGHT`.
    callback_slots: tokio::sync::Semaphore,
    /// Callbacks waiting for one of those slots.
    callbacks_queued: std::sync::atomic::AtomicUsize,
    shutdown: CancellationToken,
    /// Injected faults of the Pushary API itself (not of decisions).
    faults: Mutex<ApiFaults>,
}

/// Faults a test injects into the Pushary API to exercise retries.
#[derive(Debug, Default)]
pub(crate) struct ApiFaults {
    /// The next `count` authenticated API calls answer `status` and change nothing.
    fail_status: u16,
    fail_count: usize,
    /// The next consume is carried out, but its response is held back this
    /// long: a lost response, from the client's point of view.
    consume_delay: Option<Duration>,
}

impl Shared {
    /// Takes one injected API failure, if any is left.
    pub(crate) fn take_api_failure(&self) -> Option<u16> {
        let mut f = self.faults.lock().unwrap_or_else(|p| p.into_inner());
        (f.fail_count > 0).then(|| {
            f.fail_count -= 1;
            f.fail_status
        })
    }

    pub(crate) fn take_consume_delay(&self) -> Option<Duration> {
        self.faults.lock().unwrap_or_else(|p| p.into_inner()).consume_delay.take()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain data behind; serving it
        // is better than taking the whole sandbox down with a poison error.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Runs `f` on the state and wakes every waiter afterwards.
    fn mutate<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        let out = f(&mut self.lock());
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
        out
    }

    /// Waits until `ready` holds, `max` has passed, or the sandbox shuts down.
    /// `ready` returns `Err(wake)` when the condition may also turn true by the
    /// clock alone (a decision expiring) at `wake`, with no state change.
    async fn wait_until(
        &self,
        max: Duration,
        mut ready: impl FnMut(&State, DateTime<Utc>) -> Result<(), Option<DateTime<Utc>>>,
    ) -> bool {
        let deadline = Instant::now() + max;
        loop {
            // Subscribing before the check means a change made between the
            // check and the await still wakes us.
            let mut rx = self.changed.subscribe();
            let now = Utc::now();
            let wake = match ready(&self.lock(), now) {
                Ok(()) => return true,
                Err(wake) => wake,
            };
            let until = deadline.min(instant_at(wake, now));
            tokio::select! {
                changed = rx.changed() => {
                    if changed.is_err() {
                        return false;
                    }
                }
                () = tokio::time::sleep_until(until) => {
                    if Instant::now() >= deadline {
                        return ready(&self.lock(), Utc::now()).is_ok();
                    }
                }
                () = self.shutdown.cancelled() => return false,
            }
        }
    }
}

/// A running sandbox. Cheap to clone; every clone sees the same state.
#[derive(Clone)]
pub struct SandboxHandle {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
}

/// Serves the sandbox on `listener` until `shutdown` is cancelled. Returns as
/// soon as the server task is running; the listener is already bound, so
/// connections made from then on are accepted.
pub async fn start(
    listener: tokio::net::TcpListener,
    config: SandboxConfig,
    shutdown: CancellationToken,
) -> anyhow::Result<SandboxHandle> {
    if config.api_key.is_empty() || !config.api_key.contains('.') {
        anyhow::bail!("the sandbox api key must have the form pk_<id>.<secret>");
    }
    if config.webhook_secret.is_empty() {
        anyhow::bail!("the sandbox webhook secret must not be empty");
    }
    let effect_key = match &config.effect_secret {
        Some(secret) => Some(
            crate::webhooks::decode_secret(secret)
                .map_err(|e| anyhow::anyhow!("invalid sandbox effect secret: {e}"))?,
        ),
        None => None,
    };
    let addr = listener.local_addr().context("reading the sandbox listener address")?;
    let public_url = config
        .public_url
        .clone()
        .unwrap_or_else(|| format!("http://{addr}"))
        .trim_end_matches('/')
        .to_string();
    let http = crate::http::client_builder()
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(10))
        .build()
        .context("building the sandbox callback client")?;
    let shared = Arc::new(Shared {
        addr,
        api_key: config.api_key,
        effect_key,
        permit_ttl: config.permit_ttl,
        unreachable_prefix: config.unreachable_prefix,
        public_url,
        state: Mutex::new(State::new(config.webhook_secret)),
        changed: watch::channel(0).0,
        http,
        callback_slots: tokio::sync::Semaphore::new(callbacks::IN_FLIGHT),
        callbacks_queued: std::sync::atomic::AtomicUsize::new(0),
        shutdown: shutdown.clone(),
        faults: Mutex::new(ApiFaults::default()),
    });

    let app = Router::new()
        .nest("/api/v1/server", api::router(shared.clone()))
        .nest("/sandbox/api", control::router())
        .merge(effect::router())
        .merge(page::router())
        .with_state(shared.clone())
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(TraceLayer::new_for_http());

    tokio::spawn(async move {
        let served = axum::serve(listener, app).with_graceful_shutdown(shutdown.cancelled_owned()).await;
        if let Err(error) = served {
            tracing::error!(%error, "the sandbox server stopped");
        }
    });
    tracing::info!(%addr, "Pushary sandbox listening");
    Ok(SandboxHandle { addr, shared })
}

impl SandboxHandle {
    pub(crate) fn from_shared(shared: Arc<Shared>) -> Self {
        Self { addr: shared.addr, shared }
    }

    /// The Pushary base URL to configure a client with.
    pub fn base_url(&self) -> String {
        format!("http://{}/api/v1/server", self.addr)
    }

    /// The page where a developer answers decisions.
    pub fn page_url(&self) -> String {
        format!("http://{}/", self.addr)
    }

    /// The example effect target.
    pub fn effect_url(&self) -> String {
        format!("http://{}/sandbox/effect", self.addr)
    }

    pub fn api_key(&self) -> String {
        self.shared.api_key.clone()
    }

    /// The secret callbacks are signed with right now.
    pub fn webhook_secret(&self) -> String {
        self.shared.lock().webhook_secret.clone()
    }

    /// Every decision, oldest first.
    pub fn decisions(&self) -> Vec<DecisionView> {
        self.shared.lock().decision_views(Utc::now())
    }

    pub fn decision(&self, id: &str) -> Option<DecisionView> {
        self.shared.lock().decision_view(id, Utc::now())
    }

    /// How many `POST /authorizations/consume` calls named this decision.
    pub fn consume_calls(&self, decision_id: &str) -> usize {
        self.shared.lock().consume_calls(decision_id)
    }

    /// Decisions created and receipts recorded so far; cheap at any size.
    pub fn counts(&self) -> (usize, usize) {
        let s = self.shared.lock();
        (s.decisions.len(), s.receipts_recorded)
    }

    pub fn receipts(&self, permit_id: &str) -> Option<ReceiptView> {
        self.shared.lock().receipt_view(permit_id)
    }

    /// Callbacks waiting to be sent behind the `callbacks::IN_FLIGHT`
    /// being sent.
    pub fn callbacks_queued(&self) -> usize {
        self.shared.callbacks_queued.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Answers as the phone would, then sends (or loses) the callback.
    pub async fn answer(
        &self,
        decision_id: &str,
        answer: &str,
        callback: CallbackMode,
    ) -> Result<(), String> {
        answer_decision(&self.shared, decision_id, answer, "sandbox", callback)
            .map(|_| ())
            .map_err(|e| e.message())
    }

    /// Forces the next consume naming this decision to be refused (`None`
    /// clears it). Used once, then normal checks resume.
    pub fn set_consume_refusal(&self, decision_id: &str, refusal: Option<Refusal>) {
        self.shared.mutate(|s| s.set_forced_refusal(decision_id, refusal));
    }

    /// What the example effect target received, oldest first.
    pub fn effect_deliveries(&self) -> Vec<EffectDeliveryView> {
        self.shared.lock().effect.deliveries.clone()
    }

    /// How many times the example effect executed for this key (0 or 1 unless
    /// at-most-once is broken somewhere).
    pub fn effect_executions(&self, idempotency_key: &str) -> usize {
        self.shared.lock().effect.executions(idempotency_key)
    }

    /// The next `count` Pushary API calls (any route, after the key check)
    /// answer `status` without doing anything: an outage or overload.
    pub fn fail_next_api_calls(&self, status: u16, count: usize) {
        let mut f = self.shared.faults.lock().unwrap_or_else(|p| p.into_inner());
        f.fail_status = status;
        f.fail_count = count;
    }

    /// The next consume happens, but its response is held back for `delay`,
    /// so a client with a shorter timeout sees a lost response.
    pub fn delay_next_consume_response(&self, delay: Duration) {
        self.shared.faults.lock().unwrap_or_else(|p| p.into_inner()).consume_delay = Some(delay);
    }

    /// Each delivery to the example effect target takes this long.
    pub fn set_effect_work(&self, work: Duration) {
        self.shared.mutate(|s| s.effect.work = work);
    }

    /// The next `count` deliveries are answered with `status` and not executed.
    pub fn set_effect_response(&self, status: u16, count: usize) {
        self.shared.mutate(|s| s.effect.set_override(status, count));
    }

    /// Waits until `condition` holds or `timeout` passes; true if it held.
    /// Re-checked on every state change and when a decision expires, not on a timer.
    pub async fn wait_for<F: Fn(&SandboxHandle) -> bool>(&self, timeout: Duration, condition: F) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let mut rx = self.shared.changed.subscribe();
            if condition(self) {
                return true;
            }
            // An expiry changes a decision's status with no event, so wake for
            // the next one too.
            let now = Utc::now();
            let next_expiry = self.shared.lock().next_expiry(now);
            let until = deadline.min(instant_at(next_expiry, now));
            tokio::select! {
                changed = rx.changed() => {
                    if changed.is_err() {
                        return condition(self);
                    }
                }
                () = tokio::time::sleep_until(until) => {
                    if Instant::now() >= deadline {
                        return condition(self);
                    }
                }
            }
        }
    }
}

/// Records an answer and starts (or drops) its callback. Shared by the API,
/// the page, the control routes and the handle.
fn answer_decision(
    shared: &Arc<Shared>,
    id: &str,
    answer: &str,
    via: &str,
    mode: CallbackMode,
) -> Result<serde_json::Value, error::ApiError> {
    let now = Utc::now();
    let (response, job) = shared.mutate(|s| s.answer(id, answer, via, mode, now))?;
    if let Some(job) = job {
        callbacks::spawn(shared.clone(), job);
    }
    Ok(response)
}

/// The monotonic instant of wall time `at` (seen at `now`), a millisecond
/// late so a waiter never wakes just before the moment it waits for; far in
/// the future for `None`.
fn instant_at(at: Option<DateTime<Utc>>, now: DateTime<Utc>) -> Instant {
    const FAR: Duration = Duration::from_secs(24 * 3600);
    let remaining = at.map_or(FAR, |at| (at - now).to_std().unwrap_or(Duration::ZERO));
    Instant::now() + remaining.min(FAR) + Duration::from_millis(1)
}

/// Pushary's timestamp format: ISO 8601, UTC, milliseconds, `Z`.
fn iso(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

fn new_webhook_secret() -> String {
    let secret: [u8; 24] = rand::random();
    format!("whsec_{}", base64::engine::general_purpose::STANDARD.encode(secret))
}

fn random_hex(bytes: usize) -> String {
    let raw: Vec<u8> = (0..bytes).map(|_| rand::random::<u8>()).collect();
    hex::encode(raw)
}
