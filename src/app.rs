//! `Application`: everything approvald runs, built from a config on a
//! pre-bound listener (tests bind port 0), stopped by one token.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::api::{self, AppState};
use crate::config::Config;
use crate::pushary::PusharyClient;
use crate::store::Store;
use crate::worker::{EffectTarget, Engine, EngineSettings, TenantRuntime};

/// What one process does; replicas can split the work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    /// API, receiver, workers and reconciler.
    All,
    /// The operations API (enqueue, inspect, cancel, resolve, inbox).
    Api,
    /// The Pushary callback receiver only: verify, store, acknowledge.
    Receiver,
    /// Resume workers and the reconciler; serves only /healthz and /readyz.
    Worker,
}

pub struct Application {
    listener: TcpListener,
    state: AppState,
    engine: Arc<Engine>,
    role: Role,
}

impl Application {
    /// Connects and migrates the store and wires the engine. Nothing runs
    /// until `run_until`.
    pub async fn build(config: Config, listener: TcpListener) -> anyhow::Result<Self> {
        let store = open_store(&config).await?;
        Self::with_store(config, listener, store, EngineSettings::from_config)
    }

    /// Like `build`, with engine settings adjusted (tests shorten timings).
    pub async fn build_with(
        config: Config,
        listener: TcpListener,
        adjust: impl FnOnce(&mut EngineSettings),
    ) -> anyhow::Result<Self> {
        let store = open_store(&config).await?;
        Self::with_store(config, listener, store, |c| {
            let mut s = EngineSettings::from_config(c);
            adjust(&mut s);
            s
        })
    }

    fn with_store(
        config: Config,
        listener: TcpListener,
        store: Store,
        settings: impl FnOnce(&Config) -> EngineSettings,
    ) -> anyhow::Result<Self> {
        let metrics = Arc::new(crate::metrics::Metrics::default());
        let mut tenants = HashMap::new();
        let mut tokens = Vec::new();
        let mut webhook_secrets = HashMap::new();
        for t in config.tenants() {
            let pushary =
                PusharyClient::new(&config.pushary.base_url, t.api_key.clone(), config.pushary_timeout())
                    .map_err(|e| anyhow::anyhow!("tenant {}: pushary client: {e}", t.name))?
                    .with_metrics(Arc::clone(&metrics));
            let mut effects = HashMap::new();
            for (name, e) in &t.effects {
                let secret = e.secret.as_ref().context("effect secret validated at load")?;
                let key = crate::webhooks::decode_secret(secret.expose())
                    .map_err(|p| anyhow::anyhow!("{}: {name}: {p}", t.name))?;
                let mut keys = vec![(key, None)];
                if let (Some(prev), Some(until)) = (&e.previous_secret, &e.previous_secret_until) {
                    let prev = crate::webhooks::decode_secret(prev.expose())
                        .map_err(|p| anyhow::anyhow!("{}: {name}: {p}", t.name))?;
                    let until = chrono::DateTime::parse_from_rfc3339(until)?.timestamp_millis();
                    keys.push((prev, Some(until)));
                }
                effects.insert(
                    name.clone(),
                    EffectTarget {
                        url: e.url.clone(),
                        keys,
                        timeout: Duration::from_secs(e.timeout_secs),
                        redeliver_safe: e.redeliver_safe,
                    },
                );
            }
            if t.webhook_secrets.is_empty() {
                tracing::warn!(tenant = %t.name, "no webhook secrets configured: every callback will be rejected");
            }
            if t.tokens.is_empty() {
                tracing::warn!(tenant = %t.name, "no api tokens configured: the operations API refuses it");
            }
            tokens.extend(t.tokens.iter().map(|tok| (tok.clone(), t.name.clone())));
            webhook_secrets.insert(t.name.clone(), t.webhook_secrets.clone());
            tenants.insert(t.name.clone(), TenantRuntime { pushary, effects });
        }
        let engine = Arc::new(
            Engine::new(store, tenants, settings(&config), Arc::new(Notify::new())).with_metrics(metrics),
        );
        let wake = Arc::clone(&engine);
        let applier: crate::store::AnswerSaves = Arc::clone(&engine) as _;
        let inbox = crate::store::InboxWriter::start(
            engine.store().clone(),
            move |threads, answers, applied| wake.stored(threads, answers, applied),
            Some(applier),
        );
        let state = AppState::new(api::Shared {
            inbox,
            callback_slots: Arc::new(tokio::sync::Semaphore::new(config.server.max_concurrent_callbacks)),
            secret_cache: Arc::default(),
            tokens: Arc::new(tokens),
            webhook_secrets: Arc::new(webhook_secrets),
            config: Arc::new(config),
            engine: Arc::clone(&engine),
        });
        Ok(Self { listener, state, engine, role: Role::All })
    }

    /// Restricts this process to one role.
    pub fn with_role(mut self, role: Role) -> Self {
        self.role = role;
        self
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("a bound listener has an address")
    }

    pub fn engine(&self) -> Arc<Engine> {
        Arc::clone(&self.engine)
    }

    /// Serves the API and receiver and runs the workers and reconciler
    /// until `shutdown` is cancelled, then drains and closes the store.
    pub async fn run_until(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let workers = if matches!(self.role, Role::All | Role::Worker) {
            self.engine.spawn(shutdown.clone())
        } else {
            Vec::new()
        };
        let router = api::router(self.state, self.role);
        tracing::info!(addr = %self.listener.local_addr()?, role = ?self.role, "approvald listening");
        axum::serve(self.listener, router).with_graceful_shutdown(shutdown.clone().cancelled_owned()).await?;
        shutdown.cancel();
        for w in workers {
            let _ = w.await;
        }
        self.engine.store().close().await;
        tracing::info!("approvald stopped");
        Ok(())
    }
}

async fn open_store(config: &Config) -> anyhow::Result<Store> {
    let store = Store::connect(&config.store).await.context("opening the store")?;
    store.migrate().await.context("migrating the store")?;
    // SQLite serves one node: leases found at start belong to a process
    // that died. On PostgreSQL other replicas hold live leases; stale ones
    // simply expire.
    if !store.is_postgres() {
        let stale = store.release_all_leases().await?;
        if stale > 0 {
            tracing::info!(leases = stale, "released thread leases left by a previous process");
        }
    }
    Ok(store)
}

/// A token cancelled by SIGINT or SIGTERM.
pub fn shutdown_on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        {
            let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .expect("installing a SIGTERM handler");
            tokio::select! { _ = ctrl_c => {}, _ = term.recv() => {} }
        }
        #[cfg(not(unix))]
        let _ = ctrl_c.await;
        tracing::info!("shutting down");
        t.cancel();
    });
    token
}

/// Logs go to stderr, pretty or JSON, filtered by config (or RUST_LOG).
pub fn init_logging(format: &str, filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(filter));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = if format == "json" { builder.json().try_init() } else { builder.try_init() };
}
