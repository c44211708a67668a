//! Starts approvald and the sandbox on port 0 and offers bounded waits.

use std::sync::Arc;
use std::time::{Duration, Instant};

use approvald::Application;
use approvald::config::Config;
use approvald::sandbox::{self, CallbackMode, SandboxConfig, SandboxHandle};
use approvald::store::Store;
use approvald::worker::{Engine, EngineSettings};
use base64::Engine as _;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub const TOKEN: &str = "test-token-0123456789";

/// The engine a test runs on; set per test by `both_engines!`.
#[derive(Clone, Debug)]
pub enum Backend {
    Sqlite,
    /// The server's admin URL; each test gets its own database.
    Postgres(String),
}

tokio::task_local! {
    pub static BACKEND: Backend;
}

pub fn backend() -> Backend {
    BACKEND.try_with(Clone::clone).unwrap_or(Backend::Sqlite)
}

impl Backend {
    /// PostgreSQL from `APPROVALD_TEST_PG_URL`; without it, says loudly
    /// (on the real stderr, past libtest's capture) that the test was skipped.
    pub fn postgres(test: &str) -> Option<Backend> {
        match std::env::var("APPROVALD_TEST_PG_URL") {
            Ok(url) if !url.is_empty() => Some(Backend::Postgres(url)),
            _ => {
                use std::io::Write as _;
                let _ = writeln!(
                    std::io::stderr(),
                    "SKIPPED {test} on PostgreSQL: APPROVALD_TEST_PG_URL is not set (.ci/run sets it)"
                );
                None
            }
        }
    }
}

/// A fresh PostgreSQL database, dropped (with its connections) at the end.
pub struct PgDb {
    pub url: String,
    admin: String,
    name: String,
}

impl PgDb {
    pub async fn create(admin: &str) -> PgDb {
        use sqlx::Connection as _;
        let name = format!("approvald_test_{:016x}", rand::random::<u64>());
        let mut conn = sqlx::PgConnection::connect(admin).await.expect("connect to the PostgreSQL admin URL");
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut conn)
            .await
            .expect("create the test database");
        let base = admin.rsplit_once('/').map_or(admin, |(b, _)| b);
        PgDb { url: format!("{base}/{name}"), admin: admin.to_string(), name }
    }
}

impl Drop for PgDb {
    fn drop(&mut self) {
        let (admin, name) = (self.admin.clone(), self.name.clone());
        // Drop runs outside any runtime we may block; use a thread of our own.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            rt.block_on(async {
                use sqlx::Connection as _;
                if let Ok(mut conn) = sqlx::PgConnection::connect(&admin).await {
                    let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                        "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                    )))
                    .execute(&mut conn)
                    .await;
                }
            });
        })
        .join();
    }
}

/// The store URL for a test on the current backend, and the database guard.
pub async fn store_url(sqlite_path: &std::path::Path) -> (String, Option<PgDb>) {
    match backend() {
        Backend::Sqlite => (format!("sqlite://{}", sqlite_path.display()), None),
        Backend::Postgres(admin) => {
            let db = PgDb::create(&admin).await;
            (db.url.clone(), Some(db))
        }
    }
}
pub const WAIT: Duration = Duration::from_secs(15);

/// Held by the tests that load the machine (soak, replicas), so that on two
/// cores no two of them compete; light tests still run beside them.
pub static HEAVY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[derive(Clone, Default)]
pub struct Options {
    pub require_reachable: bool,
    pub poll_after_secs: Option<u64>,
    /// No background workers: the test drives the engine step by step.
    pub manual: bool,
    pub extra_toml: String,
    pub store_busy_ms: Option<u64>,
    /// Sign deliveries with this secret instead of the sandbox effect target's.
    pub effect_secret_override: Option<String>,
    /// Extra keys for the `[server]` table.
    pub server_toml: String,
    pub pushary_timeout_secs: Option<u64>,
    /// Point approvald at this Pushary instead of the sandbox.
    pub pushary_base_url: Option<String>,
    pub orphan_after_secs: Option<u64>,
    /// Archive finished operations this long after their last change.
    pub archive_after_ms: Option<i64>,
    /// The workers' safety-net poll (200 ms unless set): set long, work is
    /// found only by the wake-ups that name it.
    pub idle_poll: Option<Duration>,
}

pub struct TestApp {
    pub base: String,
    pub sandbox: SandboxHandle,
    pub engine: Arc<Engine>,
    pub http: reqwest::Client,
    pub webhook_secret: String,
    shutdown: CancellationToken,
    _dir: tempfile::TempDir,
    _pg: Option<PgDb>,
}

impl Drop for TestApp {
    fn drop(&mut self) {
        self.shutdown.cancel();
        // `pg` drops after this, and forces its connections closed.
    }
}

impl TestApp {
    pub async fn spawn() -> Self {
        Self::spawn_with(Options::default()).await
    }

    pub async fn spawn_with(opts: Options) -> Self {
        let shutdown = CancellationToken::new();
        let effect_secret =
            format!("whsec_{}", base64::engine::general_purpose::STANDARD.encode(rand::random::<[u8; 24]>()));
        let sb_listener = TcpListener::bind("127.0.0.1:0").await.expect("bind sandbox");
        let sandbox = sandbox::start(
            sb_listener,
            SandboxConfig { effect_secret: Some(effect_secret.clone()), ..SandboxConfig::default() },
            shutdown.clone(),
        )
        .await
        .expect("sandbox starts");
        let dir = tempfile::tempdir().expect("tempdir");
        let (store_url, pg) = store_url(&dir.path().join("approvald.db")).await;
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind approvald");
        let addr = listener.local_addr().expect("addr");
        let toml = format!(
            r#"
            [server]
            listen = "{addr}"
            public_url = "http://{addr}"
            {server_extra}
            [store]
            url = "{store_url}"
            max_connections = 4
            busy_timeout_ms = {busy}
            [api]
            tokens = ["{TOKEN}"]
            [pushary]
            base_url = "{base}"
            api_key = "{key}"
            webhook_secrets = ["{whsec}"]
            require_reachable = {rr}
            timeout_secs = {ptimeout}
            [worker]
            retry_initial_ms = 20
            retry_max_secs = 1
            [reconciler]
            interval_secs = 1
            poll_after_secs = {poll}
            orphan_after_secs = {orphan}
            [effects.orders]
            url = "{effect}"
            secret = "{signing_secret}"
            timeout_secs = 5
            {extra}
            "#,
            base = opts.pushary_base_url.clone().unwrap_or_else(|| sandbox.base_url()),
            ptimeout = opts.pushary_timeout_secs.unwrap_or(5),
            key = sandbox.api_key(),
            whsec = sandbox.webhook_secret(),
            rr = opts.require_reachable,
            poll = opts.poll_after_secs.unwrap_or(3600),
            busy = opts.store_busy_ms.unwrap_or(5000),
            server_extra = opts.server_toml,
            orphan = opts.orphan_after_secs.unwrap_or(3600),
            effect = sandbox.effect_url(),
            signing_secret = opts.effect_secret_override.clone().unwrap_or_else(|| effect_secret.clone()),
            extra = opts.extra_toml.replace("__EFFECT_SECRET__", &effect_secret).replace(
                "__ACME__",
                &format!(
                    "[tenants.acme]\ntokens = [\"acme-token-0123456789\"]\npushary_api_key = \"{}\"\n\
                     webhook_secrets = [\"{}\", \"whsec_acme_only\"]\n\
                     [tenants.acme.effects.acme-orders]\nurl = \"{}\"\nsecret = \"{}\"\n",
                    sandbox.api_key(),
                    sandbox.webhook_secret(),
                    sandbox.effect_url(),
                    effect_secret
                )
            ),
        );
        let config = Config::from_toml(&toml).expect("test config is valid");
        let manual = opts.manual;
        let archive_after_ms = opts.archive_after_ms;
        let idle_poll = opts.idle_poll.unwrap_or(Duration::from_millis(200));
        let app = Application::build_with(config, listener, |s: &mut EngineSettings| {
            s.idle_poll = idle_poll;
            // The reconciler is driven by tests through reconcile_once.
            s.reconcile_every = Duration::from_secs(3600);
            if manual {
                s.concurrency = 0;
            }
            s.archive_after_ms = archive_after_ms;
        })
        .await
        .expect("approvald builds");
        let engine = app.engine();
        tokio::spawn(app.run_until(shutdown.clone()));
        let http = approvald::http::client_builder().build().expect("client");
        TestApp {
            base: format!("http://{addr}"),
            webhook_secret: sandbox.webhook_secret(),
            sandbox,
            engine,
            http,
            shutdown,
            _dir: dir,
            _pg: pg,
        }
    }

    pub fn db_path(&self) -> std::path::PathBuf {
        self._dir.path().join("approvald.db")
    }

    pub fn store_url(&self) -> String {
        match &self._pg {
            Some(pg) => pg.url.clone(),
            None => format!("sqlite://{}", self.db_path().display()),
        }
    }

    pub fn store(&self) -> &Store {
        self.engine.store()
    }

    pub async fn enqueue(&self, body: &Value) -> (u16, Value) {
        let resp = self
            .http
            .post(format!("{}/v1/operations", self.base))
            .bearer_auth(TOKEN)
            .json(body)
            .send()
            .await
            .expect("enqueue request");
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    /// Enqueues `body` and returns the new operation's id.
    pub async fn enqueue_ok(&self, body: &Value) -> String {
        let (status, v) = self.enqueue(body).await;
        assert_eq!(status, 201, "enqueue failed: {v}");
        v["id"].as_str().expect("id").to_string()
    }

    pub async fn get(&self, id: &str) -> Value {
        let (status, op) = self.get_status(id).await;
        assert_eq!(status, 200, "{op}");
        op
    }

    /// `GET /v1/operations/{id}`: the status and the JSON body, whatever they are.
    pub async fn get_status(&self, id: &str) -> (u16, Value) {
        let resp = self
            .http
            .get(format!("{}/v1/operations/{id}", self.base))
            .bearer_auth(TOKEN)
            .send()
            .await
            .expect("get request");
        let status = resp.status().as_u16();
        (status, resp.json().await.expect("json"))
    }

    /// Waits (bounded) until the operation is in one of `states`.
    pub async fn wait_state(&self, id: &str, states: &[&str]) -> Value {
        let start = Instant::now();
        loop {
            let op = self.get(id).await;
            if states.contains(&op["state"].as_str().unwrap_or("")) {
                return op;
            }
            assert!(start.elapsed() < WAIT, "operation {id} never reached {states:?}; it is {op:#}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until the operation is pending and returns its decision id.
    pub async fn decision_of(&self, id: &str) -> String {
        let op = self.wait_state(id, &["pending"]).await;
        op["decisionId"].as_str().expect("decision id").to_string()
    }

    /// Waits (bounded) until `cond` holds on the operation.
    pub async fn wait_op(&self, id: &str, what: &str, cond: impl Fn(&Value) -> bool) -> Value {
        let start = Instant::now();
        loop {
            let op = self.get(id).await;
            if cond(&op) {
                return op;
            }
            assert!(start.elapsed() < WAIT, "operation {id}: {what} never happened; it is {op:#}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn answer(&self, decision: &str, answer: &str) {
        self.sandbox.answer(decision, answer, CallbackMode::Send).await.expect("sandbox answers");
    }

    pub async fn post_callback(&self, body: &[u8], signature: Option<&str>) -> (u16, Value) {
        let mut req = self
            .http
            .post(format!("{}/v1/callbacks/pushary", self.base))
            .header("content-type", "application/json")
            .body(body.to_vec());
        if let Some(s) = signature {
            req = req.header("X-Pushary-Signature", s);
        }
        let resp = req.send().await.expect("callback request");
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    /// A callback body as Pushary sends it, and its valid signature.
    pub fn signed_callback(&self, decision: &str, answer: &str) -> (Vec<u8>, String) {
        let body = serde_json::to_vec(&json!({"correlationId": decision, "answer": answer, "value": answer,
            "answeredAt": "2026-11-29T09:00:00.000Z"}))
        .expect("json");
        let sig = approvald::pushary::signature::sign(&self.webhook_secret, &body);
        (body, sig)
    }

    /// Deliveries the example effect target received for an operation.
    pub fn deliveries_for(&self, op_id: &str) -> Vec<Value> {
        self.sandbox
            .effect_deliveries()
            .into_iter()
            .filter(|d| d.body["operationId"] == op_id)
            .map(|d| d.body)
            .collect()
    }

    /// Waits until the effect target has received `n` deliveries for the operation.
    pub async fn wait_deliveries(&self, op_id: &str, n: usize) -> Vec<Value> {
        let start = Instant::now();
        loop {
            let d = self.deliveries_for(op_id);
            if d.len() >= n {
                return d;
            }
            assert!(start.elapsed() < WAIT, "{op_id}: {n} deliveries never arrived; got {d:#?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Sends approvald's own stored `POST /decisions` payload for `op_id` to
    /// the sandbox first, as if Pushary had created the decision before
    /// approvald heard back; returns the decision id.
    pub async fn create_decision_first(&self, op_id: &str) -> String {
        let op = self.store().get_operation(None, op_id).await.expect("store").expect("op");
        let created: Value = self
            .http
            .post(format!("{}/decisions", self.sandbox.base_url()))
            .bearer_auth(self.sandbox.api_key())
            .json(&op.decision_request)
            .send()
            .await
            .expect("create")
            .json()
            .await
            .expect("json");
        created["decisionId"].as_str().expect("decision id").to_string()
    }

    /// Runs the engine by hand until no thread has work (manual mode).
    pub async fn drain(&self) {
        for _ in 0..1000 {
            if !self.engine.try_execute_task().await.expect("store works") {
                return;
            }
        }
        panic!("the queue never drained");
    }

    pub async fn inbox_len(&self) -> usize {
        self.store().list_inbox(None, 1000).await.expect("inbox").len()
    }
}

/// A valid confirm enqueue body; `n` makes keys unique.
pub fn confirm(n: &str) -> Value {
    json!({
        "operationKey": format!("op-{n}"),
        "threadId": format!("thread-{n}"),
        "interruptId": format!("interrupt-{n}"),
        "checkpointId": "cp-1",
        "effect": "orders",
        "externalId": "user-1",
        "question": "Refund 40 EUR on order 1234?",
        "toolName": "refund",
        "toolTarget": "order-1234",
        "actor": "agent-7",
        "environment": "test",
        "parameters": {"amount": 40, "currency": "EUR", "express": false},
        "revision": "rev-3",
    })
}

/// Waits (bounded) until no operation is still in flight and nothing is due.
pub async fn wait_settled(store: &Store, limit: Duration, context: impl Fn() -> String) {
    let start = Instant::now();
    loop {
        let states = store.count_by_state().await.expect("counts");
        let busy: i64 = states
            .iter()
            .filter(|(s, _)| {
                matches!(s.as_str(), "enqueued" | "pending" | "answered" | "permitted" | "delivering")
            })
            .map(|(_, n)| n)
            .sum();
        let due = store.next_due_at().await.expect("due");
        if busy == 0 && due.is_none() {
            return;
        }
        assert!(start.elapsed() < limit, "never settled: {states:?} due {due:?}\n{}", context());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
