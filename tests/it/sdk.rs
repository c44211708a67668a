//! The published Python SDK `pushary` (PyPI, 2.4.1 and 2.1.1) as the referee
//! in both directions:
//!
//! - the SDK, unchanged, runs its conformance suite (`tests/sdk/`) against the
//!   sandbox;
//! - approvald's Rust client, and approvald itself, send exactly the requests
//!   the SDK sends for the same inputs (a capture server records both);
//! - the Rust client reads odd responses the way the SDK does;
//! - approvald refuses exactly the API keys the SDK's constructor refuses.
//!
//! Each SDK version gets a venv under `target/tmp/sdk-venvs/<version>`, made
//! with `python3 -m venv` and `pip install pushary==<version>` on first use
//! and reused after. Without python3, venv or pip (or PyPI) these tests fail,
//! saying why; they never pass silently.

use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use approvald::pushary::{PusharyClient, PusharyError};
use approvald::sandbox::{self, CallbackMode, SandboxConfig, SandboxHandle};
use approvald::secret::Secret;
use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::{OnceCell, watch};
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::harness::{Options, TOKEN, TestApp, WAIT};

const SDK_VERSIONS: [&str; 2] = ["2.4.1", "2.1.1"];
/// Making a venv and installing the SDK (once per version; reused after).
const SETUP_TIMEOUT: Duration = Duration::from_secs(240);
/// One run of a Python script; the conformance suite takes about 10 s.
const PYTHON_TIMEOUT: Duration = Duration::from_secs(90);
const API_PREFIX: &str = "/api/v1/server";

// ---------------------------------------------------------------------------
// Python: bounded child processes and one venv per SDK version.

struct Ran {
    /// `None` when the process was killed at its timeout.
    status: Option<ExitStatus>,
    stdout: String,
    stderr: String,
}

impl Ran {
    fn ok(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }

    fn describe(&self) -> String {
        let status = match self.status {
            Some(s) => s.to_string(),
            None => "killed at its timeout".to_string(),
        };
        format!("{status}\n--- stdout ---\n{}\n--- stderr ---\n{}", self.stdout, self.stderr)
    }
}

/// Runs `cmd` to completion or until `timeout`, whichever comes first (then
/// kills it). Blocking: call it from `spawn_blocking`.
fn run_bounded(mut cmd: Command, stdin: Option<Vec<u8>>, timeout: Duration) -> Result<Ran, String> {
    cmd.stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let program = format!("{:?}", cmd.get_program());
    let mut child = cmd.spawn().map_err(|e| format!("cannot start {program}: {e}"))?;
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        std::thread::spawn(move || {
            let _ = pipe.write_all(&input);
        });
    }
    let read_all = |pipe: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut out = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut out);
            }
            String::from_utf8_lossy(&out).into_owned()
        })
    };
    let stdout = read_all(child.stdout.take().map(|p| Box::new(p) as Box<dyn std::io::Read + Send>));
    let stderr = read_all(child.stderr.take().map(|p| Box::new(p) as Box<dyn std::io::Read + Send>));
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|e| format!("waiting for {program}: {e}"))? {
            break Some(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Ok(Ran { status, stdout: stdout.join().unwrap_or_default(), stderr: stderr.join().unwrap_or_default() })
}

fn python_command(python: &Path) -> Command {
    let mut cmd = Command::new(python);
    for var in ["PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV"] {
        cmd.env_remove(var);
    }
    cmd.env("PYTHONDONTWRITEBYTECODE", "1").env("PYTHONUNBUFFERED", "1").env("PYTHONIOENCODING", "utf-8");
    cmd
}

/// Whether `python` imports `pushary` at exactly `version`.
fn has_sdk(python: &Path, version: &str) -> bool {
    if !python.exists() {
        return false;
    }
    let mut cmd = python_command(python);
    cmd.args(["-c", "import sys, pushary; sys.exit(pushary.__version__ != sys.argv[1])", version]);
    run_bounded(cmd, None, Duration::from_secs(30)).is_ok_and(|r| r.ok())
}

fn venv_python(dir: &Path) -> PathBuf {
    dir.join("bin").join("python")
}

/// The venv for `version`, made (or repaired) if needed. A fresh venv is
/// built beside the final one and renamed into place, so concurrent test
/// processes never see a half-made venv.
fn ensure_venv(version: &str) -> Result<PathBuf, String> {
    let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("sdk-venvs");
    let dir = root.join(version);
    if has_sdk(&venv_python(&dir), version) {
        return Ok(venv_python(&dir));
    }
    let host = std::env::var("APPROVALD_TEST_PYTHON").unwrap_or_else(|_| "python3".to_string());
    std::fs::create_dir_all(&root).map_err(|e| format!("cannot create {}: {e}", root.display()))?;
    let staging = root.join(format!(".{version}-{}-{:x}", std::process::id(), rand::random::<u32>()));

    let mut venv = Command::new(&host);
    venv.arg("-m").arg("venv").arg(&staging);
    let made = run_bounded(venv, None, SETUP_TIMEOUT).map_err(|e| {
        format!(
            "{e}\nThe SDK tests need python3 (≥ 3.9) with venv and pip (Debian: apt-get install python3-venv)"
        )
    })?;
    if !made.ok() {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(format!("`{host} -m venv` failed: {}", made.describe()));
    }
    let mut pip = python_command(&venv_python(&staging));
    pip.args(["-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--quiet"])
        .arg(format!("pushary=={version}"));
    let installed = run_bounded(pip, None, SETUP_TIMEOUT)?;
    if !installed.ok() || !has_sdk(&venv_python(&staging), version) {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(format!(
            "pip could not install pushary=={version} (PyPI is needed): {}",
            installed.describe()
        ));
    }
    // Another process may have finished first; either venv will do.
    if has_sdk(&venv_python(&dir), version) {
        let _ = std::fs::remove_dir_all(&staging);
        return Ok(venv_python(&dir));
    }
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(e) = std::fs::rename(&staging, &dir) {
        let _ = std::fs::remove_dir_all(&staging);
        if !has_sdk(&venv_python(&dir), version) {
            return Err(format!("cannot move the venv into {}: {e}", dir.display()));
        }
    }
    if has_sdk(&venv_python(&dir), version) {
        Ok(venv_python(&dir))
    } else {
        Err(format!("the venv in {} does not import pushary {version}", dir.display()))
    }
}

static VENVS: [OnceCell<PathBuf>; 2] = [OnceCell::const_new(), OnceCell::const_new()];

/// The Python of the venv holding `pushary==version`. Panics, saying what is
/// missing, when it cannot be had.
async fn sdk_python(version: &'static str) -> PathBuf {
    let slot = SDK_VERSIONS.iter().position(|v| *v == version).expect("a version the tests know");
    VENVS[slot]
        .get_or_init(|| async move {
            match tokio::task::spawn_blocking(move || ensure_venv(version)).await {
                Ok(Ok(python)) => python,
                Ok(Err(why)) => panic!("no venv with pushary=={version}: {why}"),
                Err(e) => panic!("the venv task for pushary=={version} failed: {e}"),
            }
        })
        .await
        .clone()
}

fn sdk_script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join("sdk").join(name)
}

/// Runs `tests/sdk/golden.py` under SDK `version` with `input` on stdin and
/// returns its per-call results.
async fn run_golden(version: &'static str, input: Value) -> Vec<Value> {
    let python = sdk_python(version).await;
    let mut cmd = python_command(&python);
    cmd.arg(sdk_script("golden.py"));
    let stdin = serde_json::to_vec(&input).expect("json");
    let ran = tokio::task::spawn_blocking(move || run_bounded(cmd, Some(stdin), PYTHON_TIMEOUT))
        .await
        .expect("python task")
        .unwrap_or_else(|e| panic!("pushary {version}: golden.py did not run: {e}"));
    assert!(ran.ok(), "pushary {version}: golden.py failed: {}", ran.describe());
    match serde_json::from_str(&ran.stdout) {
        Ok(Value::Array(results)) => results,
        _ => panic!("pushary {version}: golden.py printed no result list: {}", ran.describe()),
    }
}

// ---------------------------------------------------------------------------
// 1. The SDK's conformance suite against the sandbox.

async fn start_sandbox(shutdown: &CancellationToken) -> SandboxHandle {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the sandbox");
    sandbox::start(listener, SandboxConfig::default(), shutdown.clone()).await.expect("the sandbox starts")
}

/// Runs `tests/sdk/conformance.py` under SDK `version` against a sandbox of
/// its own (the suite rotates the webhook secret). `Err` carries the output.
async fn run_conformance(version: &'static str) -> Result<String, String> {
    let python = sdk_python(version).await;
    let shutdown = CancellationToken::new();
    let _stop = shutdown.clone().drop_guard();
    let sandbox = start_sandbox(&shutdown).await;
    let mut cmd = python_command(&python);
    cmd.arg(sdk_script("conformance.py"))
        .env("PUSHARY_BASE_URL", sandbox.base_url())
        .env("PUSHARY_API_KEY", sandbox.api_key())
        .env("SANDBOX_CONTROL_URL", format!("http://{}/sandbox/api", sandbox.addr))
        .env("EXPECT_SDK_VERSION", version);
    let ran = tokio::task::spawn_blocking(move || run_bounded(cmd, None, PYTHON_TIMEOUT))
        .await
        .map_err(|e| format!("pushary {version}: the suite's task failed: {e}"))?
        .map_err(|e| format!("pushary {version}: the suite did not run: {e}"))?;
    // unittest reports on stderr and ends with "OK" only when all passed.
    let passed = ran.ok() && ran.stderr.lines().any(|l| l.starts_with("OK")) && ran.stderr.contains("Ran ");
    if passed {
        Ok(ran.stderr)
    } else {
        Err(format!("pushary {version}: the SDK conformance suite failed: {}", ran.describe()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sdk_conformance_suite_passes_against_the_sandbox() {
    let runs = SDK_VERSIONS.map(|v| tokio::spawn(run_conformance(v)));
    let mut failures = Vec::new();
    for (version, run) in SDK_VERSIONS.iter().zip(runs) {
        match run.await {
            Ok(Ok(report)) => {
                let summary = report.lines().filter(|l| l.starts_with("Ran ")).collect::<Vec<_>>().join("");
                eprintln!("pushary {version}: {summary}, OK");
            }
            Ok(Err(failure)) => failures.push(failure),
            Err(panicked) => failures.push(format!("pushary {version}: {panicked}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

// ---------------------------------------------------------------------------
// A capture server: records every request and answers plausible JSON.

#[derive(Clone, Debug, PartialEq)]
struct Captured {
    method: String,
    /// Raw, as sent: percent-encoding and query included.
    path: String,
    authorization: Option<String>,
    content_type: Option<String>,
    /// `None` for an empty body; a body that is not JSON is kept as a string.
    body: Option<Value>,
}

struct CaptureState {
    seen: Mutex<Vec<Captured>>,
    count: watch::Sender<usize>,
    next_id: AtomicUsize,
    /// When set, every request is answered with these instead (in order).
    scripted: Mutex<Vec<(u16, Vec<u8>)>>,
}

struct Capture {
    base_url: String,
    state: Arc<CaptureState>,
    _stop: DropGuard,
}

impl Capture {
    async fn start() -> Capture {
        let state = Arc::new(CaptureState {
            seen: Mutex::new(Vec::new()),
            count: watch::channel(0).0,
            next_id: AtomicUsize::new(0),
            scripted: Mutex::new(Vec::new()),
        });
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the capture server");
        let addr = listener.local_addr().expect("addr");
        let app = Router::new().fallback(capture).with_state(state.clone());
        let stop = CancellationToken::new();
        let serve = axum::serve(listener, app).with_graceful_shutdown(stop.clone().cancelled_owned());
        tokio::spawn(async move {
            let _ = serve.await;
        });
        Capture { base_url: format!("http://{addr}{API_PREFIX}"), state, _stop: stop.drop_guard() }
    }

    fn take(&self) -> Vec<Captured> {
        std::mem::take(&mut *self.state.seen.lock().expect("lock"))
    }

    fn script(&self, responses: Vec<(u16, Vec<u8>)>) {
        *self.state.scripted.lock().expect("lock") = responses;
    }

    /// Waits (bounded) until `n` requests have arrived in all.
    async fn wait_for(&self, n: usize) -> Vec<Captured> {
        let mut rx = self.state.count.subscribe();
        let arrived = tokio::time::timeout(WAIT, rx.wait_for(|c| *c >= n)).await;
        let seen = self.state.seen.lock().expect("lock").clone();
        assert!(arrived.is_ok(), "only {} of {n} requests reached the capture server: {seen:#?}", seen.len());
        seen
    }
}

async fn capture(State(state): State<Arc<CaptureState>>, request: Request) -> Response {
    let method = request.method().clone();
    let path =
        request.uri().path_and_query().map_or_else(|| request.uri().path().to_string(), |p| p.to_string());
    let read_header = |headers: &HeaderMap, name: header::HeaderName| {
        headers.get(name).map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    };
    let authorization = read_header(request.headers(), header::AUTHORIZATION);
    let content_type = read_header(request.headers(), header::CONTENT_TYPE);
    let bytes = axum::body::to_bytes(request.into_body(), 1 << 20).await.unwrap_or_default();
    let body = (!bytes.is_empty()).then(|| {
        serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()))
    });
    let scripted = {
        let mut scripted = state.scripted.lock().expect("lock");
        (!scripted.is_empty()).then(|| scripted.remove(0))
    };
    let response = match scripted {
        Some((status, raw)) => (
            StatusCode::from_u16(status).expect("a valid status"),
            [(header::CONTENT_TYPE, "application/json")],
            raw,
        )
            .into_response(),
        None => plausible(&state, &method, &path, body.as_ref()).into_response(),
    };
    state.seen.lock().expect("lock").push(Captured {
        method: method.to_string(),
        path,
        authorization,
        content_type,
        body,
    });
    state.count.send_modify(|c| *c += 1);
    response
}

/// Ids with `/`, spaces and non-ASCII, so every path segment is exercised.
fn golden_decision_id(n: usize) -> String {
    format!("dec/gold en ü-{n}")
}

fn golden_permit_id(n: usize) -> String {
    format!("pmt/gold en ß-{n}")
}

/// What Pushary would answer, roughly; plus a field no client knows.
fn plausible(
    state: &CaptureState,
    method: &Method,
    path: &str,
    body: Option<&Value>,
) -> (StatusCode, axum::Json<Value>) {
    let route = path.strip_prefix(API_PREFIX).unwrap_or(path);
    let route = route.split('?').next().unwrap_or(route);
    let n = state.next_id.fetch_add(1, Ordering::Relaxed);
    let field = |k: &str| body.and_then(|b| b.get(k)).cloned().unwrap_or(Value::Null);
    let decision = |status: &str| {
        json!({"decisionId": "dec_x", "status": status, "answered": status == "answered",
               "value": if status == "answered" { json!("yes") } else { Value::Null }, "type": "confirm",
               "question": "q", "options": null, "externalId": null, "createdAt": "2026-11-29T09:00:00.000Z",
               "answeredAt": null, "expiresAt": "2026-11-29T10:00:00.000Z", "futureField": {"x": 1}})
    };
    let answer = match (method.as_str(), route) {
        ("POST", "/decisions") => json!({
            "decisionId": golden_decision_id(n), "status": "pending", "type": field("type"),
            "question": field("question"), "decisionPageUrl": "https://example.invalid/d",
            "pollUrl": "https://example.invalid/p", "expiresInSeconds": field("expiresInSeconds"),
            "answered": false, "value": null, "reachable": true, "reachableChannels": ["push"],
            "deviceCount": 1, "futureField": true,
        }),
        ("POST", "/authorizations/consume") => json!({
            "permitId": golden_permit_id(n), "authority": "human", "expiresAt": "2026-11-29T10:00:00.000Z",
            "futureField": 1,
        }),
        ("GET" | "POST", "/webhook-secret") => json!({"secret": "whsec_capture"}),
        ("POST", r) if r.starts_with("/authorizations/") && r.ends_with("/receipt") => {
            json!({"outcome": field("outcome"), "duplicate": false})
        }
        ("GET", r) if r.starts_with("/decisions/") => decision("pending"),
        ("POST", r) if r.starts_with("/decisions/") => decision("answered"),
        ("DELETE", r) if r.starts_with("/decisions/") => {
            json!({"decisionId": "dec_x", "cancelled": true, "status": "cancelled"})
        }
        _ => return (StatusCode::NOT_FOUND, axum::Json(json!({"error": "not found"}))),
    };
    (StatusCode::OK, axum::Json(answer))
}

fn rust_client(base_url: &str, key: &str) -> PusharyClient {
    PusharyClient::new(base_url, Secret::new(key), Duration::from_secs(10)).expect("a valid client")
}

/// Asserts that two captured request lists are equal, one request at a time.
fn assert_same_requests(what: &str, ours: &[Captured], sdk: &[Captured]) {
    for (i, (a, b)) in ours.iter().zip(sdk).enumerate() {
        assert_eq!(a, b, "{what}: request {i} differs (left: approvald, right: the SDK)");
    }
    assert_eq!(ours.len(), sdk.len(), "{what}: approvald sent {ours:#?}\nthe SDK sent {sdk:#?}");
}

// ---------------------------------------------------------------------------
// 2. Golden: the Rust client's requests equal the SDK's.

/// ASCII, as every issued key is: for a non-ASCII key the SDK (urllib) sends
/// the header in Latin-1 while reqwest sends UTF-8, so they would differ.
const GOLDEN_KEY: &str = "pk_golden.s3cret-KEY~1";

/// Ids that need percent-encoding, and one that needs none.
const ODD_IDS: [&str; 6] =
    ["dec_01HZX4-._~", "a/b c?d", "dec/ü ñ#%&=+", "../webhook-secret", "emoji😀", "sp ace;,"];

/// Calls as `golden.py` reads them; `payload`/`body` is what the Rust client
/// is given for the same call (golden.py ignores them).
fn golden_calls() -> Vec<Value> {
    let mut calls = vec![
        json!({"op": "create", "question": "Refund 40 € on order 1234?",
               "kwargs": {"type": "confirm", "external_id": "user-ü 1", "callback_url": "https://a.example/cb?x=1",
                          "agent_name": "Billing", "context": "thread=t-42", "tool_name": "refund",
                          "tool_target": "order-1234", "actor": "agent-7", "environment": "prod",
                          "parameters": {"amount": 40, "rate": 0.5, "currency": "EUR", "express": false},
                          "presentation": {"title": "Refund"}, "expires_in_seconds": 600, "wait": false,
                          "idempotency_key": "k-1", "require_reachable": true},
               "payload": {"question": "Refund 40 € on order 1234?", "type": "confirm", "externalId": "user-ü 1",
                           "callbackUrl": "https://a.example/cb?x=1", "agentName": "Billing",
                           "context": "thread=t-42", "toolName": "refund", "toolTarget": "order-1234",
                           "actor": "agent-7", "environment": "prod",
                           "parameters": {"amount": 40, "rate": 0.5, "currency": "EUR", "express": false},
                           "presentation": {"title": "Refund"}, "expiresInSeconds": 600, "wait": false,
                           "idempotencyKey": "k-1", "requireReachable": true}}),
        json!({"op": "create", "question": "Which?", "kwargs": {"type": "select", "options": ["A", "B ü"]},
               "payload": {"question": "Which?", "type": "select", "options": ["A", "B ü"]}}),
        json!({"op": "webhook_secret"}),
        json!({"op": "rotate_webhook_secret"}),
    ];
    for id in ODD_IDS {
        calls.push(json!({"op": "get", "id": id}));
        calls.push(json!({"op": "get", "id": id, "wait": 30}));
        calls.push(json!({"op": "cancel", "id": id}));
        calls.push(json!({"op": "answer", "id": id, "answer": "Überweisung"}));
        calls.push(json!({"op": "receipt", "permit_id": id, "outcome": "succeeded", "summary": "done ✓"}));
        calls.push(json!({"op": "receipt", "permit_id": id, "outcome": "failed"}));
        calls.push(json!({"op": "consume", "authorization_id": id, "tool_name": "refund",
                          "kwargs": {"tool_target": "order/1234", "actor": "agent 7", "environment": "prod",
                                     "parameters": {"amount": 40, "note": "ü"}, "external_id": "user-1"},
                          "body": {"authorizationId": id, "toolName": "refund", "toolTarget": "order/1234",
                                   "actor": "agent 7", "environment": "prod",
                                   "parameters": {"amount": 40, "note": "ü"}, "externalId": "user-1"}}));
        calls.push(json!({"op": "consume", "authorization_id": id, "tool_name": "refund",
                          "body": {"authorizationId": id, "toolName": "refund"}}));
    }
    calls.push(json!({"op": "get", "id": "dec_1", "wait": 0}));
    calls.push(json!({"op": "get", "id": "dec_1", "wait": 55}));
    calls
}

async fn rust_call(client: &PusharyClient, call: &Value) -> Result<(), PusharyError> {
    let s = |k: &str| call[k].as_str().unwrap_or_default().to_string();
    match call["op"].as_str().expect("op") {
        "create" => client.create_decision(&call["payload"]).await.map(drop),
        "get" => {
            let wait = call["wait"].as_u64().map(|w| u32::try_from(w).expect("small"));
            client.get_decision(&s("id"), wait).await.map(drop)
        }
        "cancel" => client.cancel_decision(&s("id")).await.map(drop),
        "answer" => client.answer_decision(&s("id"), &s("answer")).await.map(drop),
        "receipt" => {
            client.record_receipt(&s("permit_id"), &s("outcome"), call["summary"].as_str()).await.map(drop)
        }
        "consume" => client.consume(&call["body"]).await.map(drop),
        "webhook_secret" => client.webhook_secret().await.map(drop),
        "rotate_webhook_secret" => client.rotate_webhook_secret().await.map(drop),
        other => panic!("unknown op {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rust_client_sends_what_the_sdk_sends() {
    let calls = golden_calls();
    let ours = Capture::start().await;
    let client = rust_client(&ours.base_url, GOLDEN_KEY);
    for call in &calls {
        rust_call(&client, call).await.unwrap_or_else(|e| panic!("{call}: {e}"));
    }
    let ours = ours.take();
    assert_eq!(ours.len(), calls.len());
    // Spot checks that do not depend on the SDK.
    assert_eq!(ours[4].path, "/api/v1/server/decisions/dec_01HZX4-._~");
    assert_eq!(ours[4 + 8].path, "/api/v1/server/decisions/a%2Fb%20c%3Fd");
    assert_eq!(ours[4 + 8 + 1].path, "/api/v1/server/decisions/a%2Fb%20c%3Fd?wait=30");

    for version in SDK_VERSIONS {
        let sdk = Capture::start().await;
        let results =
            run_golden(version, json!({"base_url": sdk.base_url, "api_key": GOLDEN_KEY, "calls": calls}))
                .await;
        assert!(results.iter().all(|r| r.get("ok").is_some()), "pushary {version}: {results:#?}");
        assert_same_requests(&format!("pushary {version}"), &ours, &sdk.take());
    }
}

// ---------------------------------------------------------------------------
// 3. Golden: what approvald sends for an operation equals what the SDK sends
// for the same inputs (create, consume, receipt; poll and cancel), and the
// sandbox accepts it.

/// The SDK keyword arguments for `decisions.create` equivalent to an enqueue
/// body, as approvald is configured; `captured` supplies the two values
/// approvald derives (the idempotency key and the lifetime in seconds).
fn sdk_create_call(enqueue: &Value, callback_url: &str, require_reachable: bool, captured: &Value) -> Value {
    let mut kwargs = serde_json::Map::new();
    kwargs.insert("type".into(), enqueue.get("type").cloned().unwrap_or_else(|| json!("confirm")));
    kwargs.insert("external_id".into(), enqueue["externalId"].clone());
    kwargs.insert("callback_url".into(), json!(callback_url));
    for (ours, sdk) in [
        ("options", "options"),
        ("agentName", "agent_name"),
        ("context", "context"),
        ("placeholder", "placeholder"),
        ("toolName", "tool_name"),
        ("toolTarget", "tool_target"),
        ("actor", "actor"),
        ("environment", "environment"),
        ("parameters", "parameters"),
        ("presentation", "presentation"),
    ] {
        if let Some(v) = enqueue.get(ours) {
            kwargs.insert(sdk.into(), v.clone());
        }
    }
    kwargs.insert("expires_in_seconds".into(), captured["expiresInSeconds"].clone());
    kwargs.insert("idempotency_key".into(), captured["idempotencyKey"].clone());
    kwargs.insert("wait".into(), json!(false));
    if require_reachable {
        kwargs.insert("require_reachable".into(), json!(true));
    }
    json!({"op": "create", "question": enqueue["question"], "kwargs": kwargs})
}

/// The SDK's `consume_authorization` for the subject an enqueue body states.
fn sdk_consume_call(enqueue: &Value, authorization_id: &str) -> Value {
    let mut kwargs = serde_json::Map::new();
    for (ours, sdk) in [
        ("toolTarget", "tool_target"),
        ("actor", "actor"),
        ("environment", "environment"),
        ("parameters", "parameters"),
        ("externalId", "external_id"),
    ] {
        if let Some(v) = enqueue.get(ours) {
            kwargs.insert(sdk.into(), v.clone());
        }
    }
    json!({"op": "consume", "authorization_id": authorization_id, "tool_name": enqueue["toolName"], "kwargs": kwargs})
}

fn assert_derived_fields(create: &Value, expires_in: u64) {
    let key = create["idempotencyKey"].as_str().expect("approvald sends an idempotency key");
    assert!(
        key.len() == 40 && key.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()),
        "{key}"
    );
    let lifetime = create["expiresInSeconds"].as_u64().expect("a whole number of seconds");
    assert!(
        (expires_in - 2..=expires_in).contains(&lifetime),
        "expiresInSeconds {lifetime}, asked {expires_in}"
    );
}

/// The sandbox accepts approvald's create payload, and the consume body
/// approvald restates for it once approved.
async fn assert_sandbox_accepts(create: &Value, consume: Option<&Value>) {
    let shutdown = CancellationToken::new();
    let _stop = shutdown.clone().drop_guard();
    let sandbox = start_sandbox(&shutdown).await;
    let client = rust_client(&sandbox.base_url(), &sandbox.api_key());
    let created =
        client.create_decision(create).await.expect("the sandbox accepts approvald's create payload");
    let Some(consume) = consume else { return };
    sandbox.answer(&created.decision_id, "yes", CallbackMode::Drop).await.expect("answered");
    let mut body = consume.clone();
    body["authorizationId"] = json!(created.decision_id);
    let permit = client.consume(&body).await.expect("the sandbox accepts approvald's consume body");
    client.record_receipt(&permit.permit_id, "succeeded", Some("ok")).await.expect("receipt accepted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approvald_sends_what_the_sdk_sends_for_an_approved_operation() {
    let capture = Capture::start().await;
    let app = TestApp::spawn_with(Options {
        pushary_base_url: Some(capture.base_url.clone()),
        ..Options::default()
    })
    .await;
    let enqueue = json!({
        "operationKey": "golden-1", "threadId": "thread-golden", "interruptId": "interrupt-1",
        "checkpointId": "cp-1", "effect": "orders", "externalId": "user-ü 1",
        "question": "Refund 40 € on order 1234?", "toolName": "refund", "toolTarget": "order/1234",
        "actor": "agent 7", "environment": "prod",
        "parameters": {"amount": 40, "rate": 0.5, "currency": "EUR", "express": false},
        "context": "thread=t-42", "agentName": "Billing", "presentation": {"title": "Refund"},
        "revision": "rev-3", "expiresInSeconds": 600,
    });
    let op = app.enqueue_ok(&enqueue).await;
    let decision = app.decision_of(&op).await;
    assert_eq!(decision, golden_decision_id(0));
    let (body, signature) = app.signed_callback(&decision, "yes");
    assert_eq!(app.post_callback(&body, Some(&signature)).await.0, 200);
    let done = app.wait_op(&op, "the receipt recorded", |o| o["receipt"] == "recorded").await;
    assert_eq!(done["state"], "succeeded", "{done:#}");
    let permit = done["permitId"].as_str().expect("permit id").to_string();
    assert_eq!(permit, golden_permit_id(1));

    let ours = capture.wait_for(3).await;
    let routes: Vec<_> = ours.iter().map(|c| (c.method.as_str(), c.path.as_str())).collect();
    assert_eq!(
        routes,
        [
            ("POST", "/api/v1/server/decisions"),
            ("POST", "/api/v1/server/authorizations/consume"),
            ("POST", "/api/v1/server/authorizations/pmt%2Fgold%20en%20%C3%9F-1/receipt"),
        ]
    );
    let create = ours[0].body.clone().expect("a create body");
    assert_derived_fields(&create, 600);
    let receipt = ours[2].body.clone().expect("a receipt body");
    assert_eq!(receipt["outcome"], "succeeded");

    let callback_url = format!("{}/v1/callbacks/pushary", app.base);
    let calls = [
        sdk_create_call(&enqueue, &callback_url, false, &create),
        sdk_consume_call(&enqueue, &decision),
        json!({"op": "receipt", "permit_id": permit, "outcome": "succeeded", "summary": receipt["summary"]}),
    ];
    // approvald's key is the configured one; the SDK run is given the same.
    let key = ours[0].authorization.clone().expect("authorization");
    assert!(key.starts_with("Bearer pk_sandbox."), "{key}");
    for version in SDK_VERSIONS {
        let sdk = run_golden_with_key(version, &calls, key.trim_start_matches("Bearer ")).await;
        assert_same_requests(&format!("pushary {version}, approved operation"), &ours, &sdk);
    }
    assert_sandbox_accepts(&create, ours[1].body.as_ref()).await;
}

async fn run_golden_with_key(version: &'static str, calls: &[Value], key: &str) -> Vec<Captured> {
    let sdk = Capture::start().await;
    let results =
        run_golden(version, json!({"base_url": sdk.base_url, "api_key": key, "calls": calls})).await;
    assert!(results.iter().all(|r| r.get("ok").is_some()), "pushary {version}: {results:#?}");
    sdk.take()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approvald_sends_what_the_sdk_sends_for_data_decisions_polls_and_cancels() {
    let capture = Capture::start().await;
    let app = TestApp::spawn_with(Options {
        pushary_base_url: Some(capture.base_url.clone()),
        require_reachable: true,
        poll_after_secs: Some(0),
        ..Options::default()
    })
    .await;
    let select = json!({
        "operationKey": "golden-select", "threadId": "thread-select", "interruptId": "i-1", "effect": "orders",
        "externalId": "user-2", "question": "Which shipping?", "type": "select",
        "options": ["Standard", "Express ü"], "expiresInSeconds": 300,
    });
    let input = json!({
        "operationKey": "golden-input", "threadId": "thread-input", "interruptId": "i-2", "effect": "orders",
        "externalId": "user-3", "question": "Why the refund?", "type": "input", "placeholder": "Reason",
        "expiresInSeconds": 900,
    });
    let select_op = app.enqueue_ok(&select).await;
    let select_decision = app.decision_of(&select_op).await;
    let input_op = app.enqueue_ok(&input).await;
    let input_decision = app.decision_of(&input_op).await;
    let mut ours = capture.wait_for(2).await;
    assert_eq!(ours.len(), 2, "{ours:#?}");

    // The reconciler polls both (GET without wait) ...
    let sweep = app.engine.reconcile_once().await.expect("sweep");
    assert_eq!(sweep.polled, 2, "{sweep:?}");
    // ... and a cancel through the API cancels at Pushary (DELETE).
    let cancelled = app
        .http
        .delete(format!("{}/v1/operations/{select_op}", app.base))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("cancel request");
    assert!(cancelled.status().is_success(), "{}", cancelled.status());
    app.wait_state(&select_op, &["cancelled"]).await;
    let seen = capture.wait_for(5).await;
    // A poll may be repeated by the background sweep; a repeat is the same request.
    let mut rest: Vec<Captured> = Vec::new();
    for c in seen.into_iter().skip(2) {
        if !rest.contains(&c) {
            rest.push(c);
        }
    }
    ours.extend(rest);

    let creates: Vec<Value> = ours[..2].iter().map(|c| c.body.clone().expect("a create body")).collect();
    assert_derived_fields(&creates[0], 300);
    assert_derived_fields(&creates[1], 900);
    let callback_url = format!("{}/v1/callbacks/pushary", app.base);
    let mut calls = vec![
        sdk_create_call(&select, &callback_url, true, &creates[0]),
        sdk_create_call(&input, &callback_url, true, &creates[1]),
    ];
    for c in &ours[2..] {
        let call = match (
            c.method.as_str(),
            c.path.ends_with(&approvald::pushary::client::encode_segment(&select_decision)),
        ) {
            ("GET", true) => json!({"op": "get", "id": select_decision}),
            ("GET", false) => json!({"op": "get", "id": input_decision}),
            ("DELETE", true) => json!({"op": "cancel", "id": select_decision}),
            _ => panic!("approvald sent an unexpected request: {c:#?}"),
        };
        calls.push(call);
    }
    assert_eq!(calls.len(), 5, "two creates, two polls and one cancel: {ours:#?}");
    let key = ours[0].authorization.clone().expect("authorization");
    for version in SDK_VERSIONS {
        let sdk = run_golden_with_key(version, &calls, key.trim_start_matches("Bearer ")).await;
        assert_same_requests(&format!("pushary {version}, select/input/poll/cancel"), &ours, &sdk);
    }
    for create in &creates {
        assert_sandbox_accepts(create, None).await;
    }
}

// ---------------------------------------------------------------------------
// 4. Odd responses: the Rust client reads them as the SDK does.

/// Responses to script, each with what the Rust client must make of it.
fn odd_responses() -> Vec<(u16, Vec<u8>)> {
    [
        (200, r#"{"decisionId":"dec_x","cancelled":true,"status":"cancelled","brandNew":{"x":[1]}}"#),
        (200, r#"{"decisionId":"dec_x"}"#),
        (200, ""),
        (204, ""),
        (200, "OK, cancelled"),
        (200, r#"["not", "an", "object"]"#),
        (409, r#"{"error":"Nope","message":"m","refusal":"expired"}"#),
        (400, r#"{"message":"only a message"}"#),
        (400, r#"{"error":{"code":7},"message":"a message beside an object error"}"#),
        (502, "<html><body>Bad Gateway</body></html>"),
        (503, ""),
        (422, r#"["a","list"]"#),
    ]
    .into_iter()
    .map(|(s, b)| (s, b.as_bytes().to_vec()))
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rust_client_reads_odd_responses_as_the_sdk_does() {
    let server = Capture::start().await;
    let client = rust_client(&server.base_url, GOLDEN_KEY);
    let responses = odd_responses();

    // Through `cancel`, whose response is returned as read, the Rust client
    // and the SDK must agree on every body and every error.
    server.script(responses.clone());
    let mut ours = Vec::new();
    for _ in &responses {
        ours.push(match client.cancel_decision("dec_x").await {
            Ok(v) => json!({"ok": v}),
            Err(PusharyError::Status { status, message, body, .. }) => {
                json!({"error": message, "status": status, "body": body})
            }
            Err(other) => panic!("a transport or decode error for a scripted response: {other}"),
        });
    }
    let calls: Vec<Value> = responses.iter().map(|_| json!({"op": "cancel", "id": "dec_x"})).collect();
    for version in SDK_VERSIONS {
        server.script(responses.clone());
        let sdk =
            run_golden(version, json!({"base_url": server.base_url, "api_key": GOLDEN_KEY, "calls": calls}))
                .await;
        for (i, (a, b)) in ours.iter().zip(&sdk).enumerate() {
            assert_eq!(
                a,
                b,
                "pushary {version}: response {i} {:?} read differently",
                String::from_utf8_lossy(&responses[i].1)
            );
        }
    }
    assert_eq!(ours[0]["ok"]["brandNew"], json!({"x": [1]}));
    assert_eq!(ours[2]["ok"], json!({}));
    assert_eq!(ours[5]["ok"], json!({"data": ["not", "an", "object"]}));
    assert_eq!(ours[6]["error"], "Nope");
    assert_eq!(ours[9], json!({"error": "HTTP 502", "status": 502, "body": {}}));

    // Typed calls: unknown fields are ignored, missing optional ones tolerated,
    // and what cannot be acted on is a decode error (never a default).
    server.script(vec![
        (200, br#"{"decisionId":"d1","futureField":{"a":1}}"#.to_vec()),
        (200, br#"{"status":"answered","value":"yes","futureField":1}"#.to_vec()),
        (200, br#"{"permitId":"p1","somethingNew":true}"#.to_vec()),
        (200, br#"{"secret":"whsec_x","rotatedAt":"now"}"#.to_vec()),
        (200, Vec::new()),
        (200, b"{}".to_vec()),
        (200, Vec::new()),
        (200, b"[]".to_vec()),
        (409, br#"{"error":"authorization already consumed","refusal":"already_consumed"}"#.to_vec()),
        (502, b"Bad Gateway".to_vec()),
    ]);
    let created = client.create_decision(&json!({"question": "q"})).await.expect("extra fields ignored");
    assert_eq!((created.decision_id.as_str(), created.status), ("d1", None));
    let polled = client.get_decision("d1", None).await.expect("missing optional fields tolerated");
    assert_eq!(
        (polled.decision_id, polled.status.as_str(), polled.value.as_deref()),
        (None, "answered", Some("yes"))
    );
    assert_eq!(polled.answered_at, None);
    assert_eq!(client.consume(&json!({"authorizationId": "d1"})).await.expect("permit").permit_id, "p1");
    assert_eq!(client.rotate_webhook_secret().await.expect("secret").expose(), "whsec_x");
    assert!(matches!(client.create_decision(&json!({"question": "q"})).await, Err(PusharyError::Decode(_))));
    assert!(matches!(client.get_decision("d1", Some(5)).await, Err(PusharyError::Decode(_))));
    assert!(matches!(client.consume(&json!({"authorizationId": "d1"})).await, Err(PusharyError::Decode(_))));
    assert!(matches!(client.webhook_secret().await, Err(PusharyError::Decode(_))));
    let refused = client.consume(&json!({"authorizationId": "d1"})).await.expect_err("refused");
    assert_eq!(
        (refused.status(), refused.refusal(), refused.is_retryable()),
        (Some(409), Some("already_consumed"), false)
    );
    let outage = client.record_receipt("p1", "succeeded", None).await.expect_err("502");
    assert!(outage.is_retryable(), "{outage}");
    assert_eq!(outage.to_string(), "pushary answered 502: HTTP 502");
}

// ---------------------------------------------------------------------------
// 5. API keys: approvald refuses what the SDK's constructor refuses.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approvald_refuses_the_api_keys_the_sdk_refuses() {
    let agreed = [
        "",
        ".",
        "pk_live",
        "no-dot-at-all",
        "pk_live.secret",
        "pk_a.b.c",
        "pk.",
        ".sk",
        "sk_test.123",
        "PK_UPPER.CASE",
        "pk_x.y-z_~!$",
    ];
    // approvald is stricter here, on purpose: the SDK's constructor accepts
    // whitespace and control characters, which no issued key contains (a
    // newline would break the Authorization header at the first request).
    // Non-ASCII keys too: the SDK sends the header as Latin-1, approvald's
    // client as UTF-8, so the bytes would differ; issued keys are ASCII.
    let stricter =
        ["   ", " pk_a.b", "pk_a.b ", "pk_a. b", "pk_a.b\n", "pk_a\t.b", "\u{a0}pk_a.b", "pk_ü.sëcret"];
    for version in SDK_VERSIONS {
        let calls: Vec<Value> =
            agreed.iter().chain(&stricter).map(|k| json!({"op": "construct", "key": k})).collect();
        let results =
            run_golden(version, json!({"base_url": "http://127.0.0.1:9/api/v1/server", "calls": calls}))
                .await;
        for (key, result) in agreed.iter().chain(&stricter).zip(&results) {
            let sdk_raises = result["raises"].as_bool().expect("raises");
            let refused = approvald::config::validate_api_key(key);
            let client_refuses =
                PusharyClient::new("http://127.0.0.1:9", Secret::new(*key), Duration::from_secs(1)).is_err();
            assert_eq!(client_refuses, refused.is_err(), "the client and the config disagree on {key:?}");
            // Whatever the SDK refuses, approvald refuses.
            if sdk_raises {
                assert!(
                    refused.is_err(),
                    "pushary {version} refuses {key:?} ({}) but approvald accepts it",
                    result["error"]
                );
            }
            if agreed.contains(key) {
                assert_eq!(
                    refused.is_err(),
                    sdk_raises,
                    "pushary {version} and approvald disagree on {key:?}: {refused:?}"
                );
            } else if key.trim().is_empty() {
                assert!(sdk_raises && refused.is_err(), "{key:?}: {result}");
            } else {
                assert!(
                    !sdk_raises && refused.is_err(),
                    "the known difference changed for {key:?}: sdk {result}, approvald {refused:?}"
                );
            }
        }
        assert_eq!(results.len(), agreed.len() + stricter.len());
    }
}
