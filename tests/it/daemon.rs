//! The real `approvald` binary as a child process, for crash tests: it is
//! started against the in-process sandbox, killed with SIGKILL (or at a
//! named fault point, where it kills itself), and started again on the
//! same port and SQLite file.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use approvald::sandbox::{self, SandboxConfig, SandboxHandle};
use base64::Engine as _;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::harness::{TOKEN, WAIT};

pub struct Daemon {
    pub base: String,
    pub sandbox: SandboxHandle,
    pub http: reqwest::Client,
    _dir: tempfile::TempDir,
    config: PathBuf,
    child: Option<Child>,
    _pg: Option<crate::harness::PgDb>,
    stderr: Arc<Mutex<String>>,
    /// Says when the reader has all of a dead process's stderr: its exit
    /// can be seen before its last lines are read.
    stderr_read: Option<std::sync::mpsc::Receiver<()>>,
    shutdown: CancellationToken,
    pub kills: usize,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.shutdown.cancel();
    }
}

impl Daemon {
    /// Starts the sandbox and writes a config; `extra` is appended TOML.
    pub async fn new(extra: &str) -> Self {
        let shutdown = CancellationToken::new();
        let effect_secret =
            format!("whsec_{}", base64::engine::general_purpose::STANDARD.encode(rand::random::<[u8; 24]>()));
        let sandbox = sandbox::start(
            TcpListener::bind("127.0.0.1:0").await.expect("bind"),
            SandboxConfig { effect_secret: Some(effect_secret.clone()), ..SandboxConfig::default() },
            shutdown.clone(),
        )
        .await
        .expect("sandbox");
        // The port must stay the same across restarts: callbacks go to it.
        let port =
            std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
        let dir = tempfile::tempdir().expect("tempdir");
        let (store_url, pg) = crate::harness::store_url(&dir.path().join("approvald.db")).await;
        let config = dir.path().join("approvald.toml");
        std::fs::write(
            &config,
            format!(
                r#"
[server]
listen = "127.0.0.1:{port}"
public_url = "http://127.0.0.1:{port}"
[store]
url = "{store_url}"
max_connections = 4
[api]
tokens = ["{TOKEN}"]
[pushary]
base_url = "{base}"
api_key = "{key}"
webhook_secrets = ["{whsec}"]
timeout_secs = 3
[worker]
retry_initial_ms = 20
retry_max_secs = 1
lease_secs = 10
[reconciler]
interval_secs = 1
poll_after_secs = 2
{log}
[effects.orders]
url = "{effect}"
secret = "{effect_secret}"
timeout_secs = 3
{extra}
"#,
                base = sandbox.base_url(),
                key = sandbox.api_key(),
                whsec = sandbox.webhook_secret(),
                effect = sandbox.effect_url(),
                // A test may bring its own [log] table.
                log = if extra.contains("[log]") { "" } else { "[log]\nfilter = \"warn\"" },
            ),
        )
        .expect("write config");
        Daemon {
            base: format!("http://127.0.0.1:{port}"),
            sandbox,
            http: approvald::http::client_builder().build().expect("client"),
            _dir: dir,
            config,
            child: None,
            _pg: pg,
            stderr: Arc::new(Mutex::new(String::new())),
            stderr_read: None,
            shutdown,
            kills: 0,
        }
    }

    /// Starts the binary (optionally armed with a fault point) and waits until it is ready.
    pub async fn start(&mut self, fault: Option<&str>) {
        assert!(self.child.is_none(), "already running");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_approvald"));
        cmd.args(["serve", "--config"]).arg(&self.config).stdout(Stdio::null()).stderr(Stdio::piped());
        cmd.env_remove("APPROVALD_FAULT");
        if let Some(f) = fault {
            cmd.env("APPROVALD_FAULT", f);
        }
        let mut child = cmd.spawn().expect("approvald starts");
        let stderr = child.stderr.take().expect("stderr");
        let sink = Arc::clone(&self.stderr);
        let (read, stderr_read) = std::sync::mpsc::channel();
        self.stderr_read = Some(stderr_read);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut s = sink.lock().expect("lock");
                s.push_str(&line);
                s.push('\n');
            }
            let _ = read.send(());
        });
        self.child = Some(child);
        let start = Instant::now();
        loop {
            let ready = self.http.get(format!("{}/readyz", self.base)).send().await;
            if ready.is_ok_and(|r| r.status().is_success()) {
                return;
            }
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                panic!("approvald exited at start ({status}):\n{}", self.stderr());
            }
            assert!(start.elapsed() < WAIT, "approvald never became ready:\n{}", self.stderr());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().expect("lock").clone()
    }

    /// SIGKILL now.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().expect("SIGKILL");
            c.wait().expect("reaped");
            self.kills += 1;
        }
    }

    /// Waits (bounded) for the process to die at its fault point.
    pub async fn wait_for_fault(&mut self, point: &str) {
        let start = Instant::now();
        loop {
            let exited = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
            if let Some(status) = exited {
                self.child = None;
                self.kills += 1;
                // Its last line (the fault point's) may still be in the pipe.
                if let Some(read) = self.stderr_read.take() {
                    let _ = read.recv_timeout(WAIT);
                }
                let log = self.stderr();
                assert!(
                    log.contains(&format!("APPROVALD_FAULT_REACHED {point}")),
                    "approvald exited ({status}) without reaching {point}:\n{log}"
                );
                use std::os::unix::process::ExitStatusExt;
                assert_eq!(status.signal(), Some(9), "it must die by SIGKILL");
                return;
            }
            assert!(start.elapsed() < WAIT, "fault point {point} never reached:\n{}", self.stderr());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn enqueue(&self, body: &Value) -> String {
        let r = self
            .http
            .post(format!("{}/v1/operations", self.base))
            .bearer_auth(TOKEN)
            .json(body)
            .send()
            .await
            .expect("enqueue");
        assert!(r.status().is_success(), "enqueue: {}", r.status());
        r.json::<Value>().await.expect("json")["id"].as_str().expect("id").to_string()
    }

    pub async fn get(&self, id: &str) -> Option<Value> {
        let r = self
            .http
            .get(format!("{}/v1/operations/{id}", self.base))
            .bearer_auth(TOKEN)
            .send()
            .await
            .ok()?;
        r.json().await.ok()
    }

    pub async fn wait_op(&self, id: &str, what: &str, cond: impl Fn(&Value) -> bool) -> Value {
        let start = Instant::now();
        loop {
            if let Some(op) = self.get(id).await {
                if cond(&op) {
                    return op;
                }
                assert!(start.elapsed() < WAIT, "{id}: {what} never happened: {op:#}\n{}", self.stderr());
            }
            assert!(start.elapsed() < WAIT, "{id}: {what} never happened (no answer)\n{}", self.stderr());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The store URL the daemon uses (a SQLite file or a PostgreSQL database).
    pub fn store_url(&self) -> String {
        match &self._pg {
            Some(pg) => pg.url.clone(),
            None => format!("sqlite://{}", self._dir.path().join("approvald.db").display()),
        }
    }

    /// Starts one more `approvald serve` on `port` with the same config and
    /// store (a replica), with extra environment overrides.
    // The child is handed to the caller, who kills and waits on it.
    #[allow(clippy::zombie_processes)]
    pub async fn spawn_replica(&self, port: u16, env: &[(&str, String)]) -> Child {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_approvald"));
        cmd.args(["serve", "--config"]).arg(&self.config).stdout(Stdio::null()).stderr(Stdio::null());
        cmd.env_remove("APPROVALD_FAULT")
            .env("APPROVALD_SERVER__LISTEN", format!("127.0.0.1:{port}"))
            .env("APPROVALD_SERVER__PUBLIC_URL", format!("http://127.0.0.1:{port}"));
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("replica starts");
        let start = Instant::now();
        loop {
            let ready = self.http.get(format!("http://127.0.0.1:{port}/readyz")).send().await;
            if ready.is_ok_and(|r| r.status().is_success()) {
                return child;
            }
            if start.elapsed() > WAIT {
                let _ = child.kill();
                let _ = child.wait();
                panic!("replica on {port} never became ready");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Runs `approvald` with the same config for a CLI command.
    pub fn cli(&self, args: &[&str]) -> std::process::Output {
        Command::new(env!("CARGO_BIN_EXE_approvald"))
            .args(args)
            .arg("--config")
            .arg(&self.config)
            .env_remove("APPROVALD_FAULT")
            .output()
            .expect("cli runs")
    }
}
