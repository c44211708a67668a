//! `approvald dev`: approvald on the embedded SQLite store, wired to the
//! built-in Pushary sandbox and its example effect target, so the whole
//! loop runs on one machine with no account.

use std::path::PathBuf;

use anyhow::Context as _;
use base64::Engine as _;
use tokio::net::TcpListener;

use crate::app::{Application, shutdown_on_signal};
use crate::config::Config;
use crate::sandbox::{self, SandboxConfig};

/// The dev API token: fixed so the README's commands work as printed. The
/// dev servers bind to 127.0.0.1 only.
pub const DEV_TOKEN: &str = "approvald-dev-token";

#[derive(Debug, Clone)]
pub struct DevOptions {
    pub port: u16,
    pub sandbox_port: u16,
    pub db: PathBuf,
}

fn toml_str(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

pub async fn run(opts: DevOptions) -> anyhow::Result<()> {
    let shutdown = shutdown_on_signal();
    let effect_secret =
        format!("whsec_{}", base64::engine::general_purpose::STANDARD.encode(rand::random::<[u8; 24]>()));
    let sandbox_listener = TcpListener::bind(("127.0.0.1", opts.sandbox_port))
        .await
        .with_context(|| format!("binding the sandbox to 127.0.0.1:{}", opts.sandbox_port))?;
    let sb = sandbox::start(
        sandbox_listener,
        SandboxConfig { effect_secret: Some(effect_secret.clone()), ..SandboxConfig::default() },
        shutdown.clone(),
    )
    .await?;
    let listener = TcpListener::bind(("127.0.0.1", opts.port))
        .await
        .with_context(|| format!("binding approvald to 127.0.0.1:{}", opts.port))?;
    let addr = listener.local_addr()?;
    let db = opts.db.to_string_lossy().to_string();
    let config = Config::from_toml(&format!(
        "[server]\nlisten = {listen}\npublic_url = {public}\n\
         [store]\nurl = {store}\n\
         [api]\ntokens = [{token}]\n\
         [pushary]\nbase_url = {base}\napi_key = {key}\nwebhook_secrets = [{whsec}]\n\
         [reconciler]\ninterval_secs = 2\npoll_after_secs = 30\n\
         [effects.example]\nurl = {effect}\nsecret = {esec}\n",
        listen = toml_str(&addr.to_string()),
        public = toml_str(&format!("http://{addr}")),
        store = toml_str(&format!("sqlite://{db}")),
        token = toml_str(DEV_TOKEN),
        base = toml_str(&sb.base_url()),
        key = toml_str(&sb.api_key()),
        whsec = toml_str(&sb.webhook_secret()),
        effect = toml_str(&sb.effect_url()),
        esec = toml_str(&effect_secret),
    ))?;
    let app = Application::build(config, listener).await?;
    println!("{}", banner(&addr.to_string(), &sb.page_url(), &db));
    app.run_until(shutdown).await
}

/// `approvald sandbox`: the sandbox alone, until Ctrl-C or SIGTERM.
pub async fn run_sandbox(listen: std::net::SocketAddr, public_url: Option<String>) -> anyhow::Result<()> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let mut config = SandboxConfig { public_url, ..SandboxConfig::default() };
    let mut generated = Vec::new();
    match env("APPROVALD_SANDBOX_API_KEY") {
        Some(k) => config.api_key = k,
        None => generated.push(("api key", config.api_key.clone())),
    }
    match env("APPROVALD_SANDBOX_WEBHOOK_SECRET") {
        Some(s) => config.webhook_secret = s,
        None => generated.push(("webhook secret", config.webhook_secret.clone())),
    }
    config.effect_secret = env("APPROVALD_SANDBOX_EFFECT_SECRET");
    let shutdown = shutdown_on_signal();
    let listener =
        TcpListener::bind(listen).await.with_context(|| format!("binding the sandbox to {listen}"))?;
    let sb = sandbox::start(listener, config, shutdown.clone()).await?;
    println!("Pushary sandbox: page {}  API {}", sb.page_url(), sb.base_url());
    // Generated credentials are a dev sandbox's own, printed so they can be used.
    for (what, value) in generated {
        println!("  generated {what}: {value}");
    }
    shutdown.cancelled().await;
    Ok(())
}

fn banner(addr: &str, page: &str, db: &str) -> String {
    format!(
        r#"
approvald dev is running.
  approvald API and receiver  http://{addr}
  Pushary sandbox (the phone) {page}
  store                       sqlite://{db}

1. Enqueue an approval:

   curl -sS -X POST http://{addr}/v1/operations \
     -H 'Authorization: Bearer {DEV_TOKEN}' -H 'Content-Type: application/json' \
     -d '{{"operationKey":"demo-1","threadId":"thread-1","interruptId":"interrupt-1","effect":"example","externalId":"dev-user","question":"Refund 40 EUR on order 1234?","toolName":"refund","toolTarget":"order-1234","parameters":{{"amount":40,"currency":"EUR"}}}}'

2. Open {page} and press Approve (or Deny).

3. Watch it complete:

   approvald ops list --db {db}
   curl -sS http://{addr}/v1/operations/<id> -H 'Authorization: Bearer {DEV_TOKEN}'

The sandbox page also lists what the example effect target received.
Stop with Ctrl-C.
"#
    )
}
