//! The operator page (in a real headless Chromium), metrics, resume logs
//! and health.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::daemon::Daemon;
use crate::harness::{Options, TestApp, WAIT, confirm};

const OPERATOR_TOKEN: &str = "operator-token-for-tests-0123";

fn operator_options() -> Options {
    Options { extra_toml: format!("[operator]\ntoken = \"{OPERATOR_TOKEN}\"\n"), ..Options::default() }
}

/// The value of one series in a Prometheus text exposition, if present.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')).and_then(|v| v.parse().ok())
    })
}

async fn scrape(app: &TestApp) -> String {
    let resp = app.http.get(format!("{}/metrics", app.base)).send().await.expect("metrics");
    assert_eq!(resp.status(), 200);
    let ct = resp.headers()["content-type"].to_str().expect("ascii").to_string();
    assert!(ct.starts_with("text/plain; version=0.0.4"), "{ct}");
    resp.text().await.expect("text")
}

both_engines! {
async fn metrics_count_callbacks_pushary_calls_deliveries_sweeps_and_the_store() {
    let app = TestApp::spawn().await;
    let id = app.enqueue_ok(&confirm("metrics")).await;
    let decision = app.decision_of(&id).await;
    app.answer(&decision, "yes").await;
    app.wait_state(&id, &["succeeded"]).await;
    app.wait_op(&id, "receipt recorded", |o| o["receipt"] == "recorded").await;
    // One forged callback, and one for a decision nobody asked for.
    let (status, _) = app.post_callback(br#"{"correlationId":"x"}"#, Some("t=1,v1=00")).await;
    assert_eq!(status, 401);
    let (body, sig) = app.signed_callback("dec_nobody_asked", "yes");
    assert_eq!(app.post_callback(&body, Some(&sig)).await.0, 200);
    app.engine.reconcile_once().await.expect("sweep");

    let text = scrape(&app).await;
    let at_least = |series: &str, n: f64| {
        let v = sample(&text, series).unwrap_or_else(|| panic!("no {series} in:\n{text}"));
        assert!(v >= n, "{series} = {v}, expected at least {n}\n{text}");
    };
    at_least("approvald_callbacks_accepted_total{result=\"stored\"}", 2.0);
    at_least("approvald_callbacks_rejected_total{reason=\"unauthorized\"}", 1.0);
    at_least("approvald_pushary_request_duration_seconds_count{call=\"create_decision\"}", 1.0);
    at_least("approvald_pushary_request_duration_seconds_count{call=\"consume\"}", 1.0);
    at_least("approvald_pushary_request_duration_seconds_count{call=\"record_receipt\"}", 1.0);
    at_least("approvald_deliveries_total{outcome=\"2xx\"}", 1.0);
    at_least("approvald_delivery_duration_seconds_count{outcome=\"2xx\"}", 1.0);
    at_least("approvald_reconciler_sweeps_total", 1.0);
    at_least("approvald_resumes_total{state=\"answered\"}", 1.0);
    assert_eq!(sample(&text, "approvald_operations{state=\"succeeded\"}"), Some(1.0), "{text}");
    // The unmatched callback waits in the inbox.
    assert_eq!(sample(&text, "approvald_inbox_depth{state=\"new\"}"), Some(1.0), "{text}");
    let age = sample(&text, "approvald_inbox_oldest_new_age_seconds").expect("age");
    assert!((0.0..60.0).contains(&age), "{age}");
    // SQLite's one writer: its time, its writes and its commits; PostgreSQL has no such writer.
    let writes = sample(&text, "approvald_sqlite_writes_total");
    if app.engine.store().is_postgres() {
        assert_eq!(writes, None, "{text}");
    } else {
        // The enqueue, the open, two callbacks stored, the answer and the steps after it.
        at_least("approvald_sqlite_writes_total", 6.0);
        at_least("approvald_sqlite_commits_total", 1.0);
        let commits = sample(&text, "approvald_sqlite_commits_total").expect("commits");
        assert!(commits <= writes.expect("writes"), "{text}");
        let writing = sample(&text, "approvald_sqlite_writer_busy_seconds_total{phase=\"writing\"}");
        assert!(writing.is_some_and(|s| s > 0.0), "{text}");
        let committing = sample(&text, "approvald_sqlite_writer_busy_seconds_total{phase=\"committing\"}");
        assert!(committing.is_some_and(|s| s > 0.0), "{text}");
    }

    // Pushary failing shows as errors by call.
    app.sandbox.fail_next_api_calls(503, 1);
    let other = app.enqueue_ok(&confirm("metrics-2")).await;
    app.decision_of(&other).await;
    let text = scrape(&app).await;
    assert!(
        sample(&text, "approvald_pushary_errors_total{call=\"create_decision\",kind=\"status\"}").is_some_and(|v| v >= 1.0),
        "{text}"
    );
}
}

both_engines! {
async fn every_pushary_call_and_delivery_attempt_of_an_approval_is_recorded_with_its_step() {
    let app = TestApp::spawn().await;
    let id = app.enqueue_ok(&confirm("recorded-calls")).await;
    let decision = app.decision_of(&id).await;
    app.answer(&decision, "yes").await;
    app.wait_op(&id, "receipt recorded", |o| o["receipt"] == "recorded").await;
    // Each is written by the save of the step that made it (the open, the
    // consume, the receipt, the delivery's outcome), none by a write of its own.
    let calls = app.store().pushary_calls(&id).await.expect("store");
    let names: Vec<&str> = calls.iter().map(|c| c.call.as_str()).collect();
    assert_eq!(names, ["create_decision", "consume", "record_receipt"], "{calls:#?}");
    // A call that succeeded is recorded without an error.
    assert!(calls.iter().all(|c| c.error.is_none() && c.status_code.is_none()), "{calls:#?}");
    let deliveries = app.store().deliveries(&id).await.expect("store");
    assert_eq!(deliveries.len(), 1, "{deliveries:#?}");
    assert!(deliveries[0].status_code.is_some_and(|s| (200..300).contains(&s)), "{deliveries:#?}");
}
}

both_engines! {
async fn readiness_says_when_the_store_is_behind_or_gone() {
    let app = TestApp::spawn().await;
    let get = |path: &'static str| {
        let (http, base) = (app.http.clone(), app.base.clone());
        async move {
            let r = http.get(format!("{base}{path}")).send().await.expect(path);
            (r.status().as_u16(), r.json::<Value>().await.expect("json"))
        }
    };
    assert_eq!(get("/healthz").await, (200, json!({"status": "ok"})));
    let (status, body) = get("/readyz").await;
    assert_eq!((status, body["status"].as_str()), (200, Some("ready")), "{body}");
    let schema = body["schema"].as_i64().expect("schema");

    // A newer binary on an older schema: not ready, and it says what to run.
    let store = app.store();
    let deleted = match store.pg_pool() {
        Some(pg) => sqlx::query("DELETE FROM approvald_migrations WHERE version = $1")
            .bind(schema)
            .execute(pg)
            .await
            .map(|r| r.rows_affected()),
        None => {
            let pool = sqlx::SqlitePool::connect(&app.store_url()).await.expect("sqlite");
            sqlx::query("DELETE FROM approvald_migrations WHERE version = $1")
                .bind(schema)
                .execute(&pool)
                .await
                .map(|r| r.rows_affected())
        }
    };
    assert_eq!(deleted.expect("delete"), 1);
    let (status, body) = get("/readyz").await;
    assert_eq!((status, body["code"].as_str()), (503, Some("migrations_pending")), "{body}");
    assert!(body["detail"].as_str().unwrap_or("").contains("approvald migrate"), "{body}");
    assert_eq!(get("/healthz").await.0, 200, "the process is still up");

    // The store gone: not ready, for that reason.
    store.close().await;
    let (status, body) = get("/readyz").await;
    assert_eq!((status, body["code"].as_str()), (503, Some("store_unavailable")), "{body}");
    assert_eq!(get("/healthz").await.0, 200);
}
}

both_engines! {
async fn every_log_line_of_a_resume_names_the_operation_thread_and_decision() {
    let mut d = Daemon::new("[log]\nformat = \"json\"\nfilter = \"approvald=debug\"\n").await;
    d.start(None).await;
    let id = d.enqueue(&confirm("logged")).await;
    let op = d.wait_op(&id, "pending", |o| o["state"] == "pending").await;
    let decision = op["decisionId"].as_str().expect("decision").to_string();
    let thread = op["threadId"].as_str().expect("thread").to_string();
    let before = d.stderr().lines().count();
    d.sandbox.answer(&decision, "yes", approvald::sandbox::CallbackMode::Send).await.expect("answer");
    d.wait_op(&id, "settled", |o| o["state"] == "succeeded" && o["receipt"] == "recorded").await;

    let log = d.stderr();
    let mut resume_lines = 0;
    for line in log.lines().skip(before) {
        let Ok(v) = serde_json::from_str::<Value>(line) else { panic!("not a JSON log line: {line}") };
        let target = v["target"].as_str().unwrap_or("");
        // The resume: the worker's steps and deliveries (the reconciler's
        // sweeps and the receiver are not part of it).
        if !target.starts_with("approvald::worker") || target.ends_with("reconciler") {
            continue;
        }
        resume_lines += 1;
        let find = |key: &str| -> Option<String> {
            std::iter::once(&v["fields"])
                .chain(std::iter::once(&v["span"]))
                .chain(v["spans"].as_array().into_iter().flatten())
                .find_map(|o| o[key].as_str().map(str::to_string))
        };
        assert_eq!(find("operation_id").as_deref(), Some(id.as_str()), "{line}");
        assert_eq!(find("thread_id").as_deref(), Some(thread.as_str()), "{line}");
        assert_eq!(find("correlation_id").as_deref(), Some(decision.as_str()), "{line}");
    }
    assert!(resume_lines >= 2, "the resume logged {resume_lines} lines:\n{log}");
}
}

/// A WebDriver session on a chromedriver we start, spoken to over HTTP.
struct Browser {
    driver: std::process::Child,
    http: reqwest::Client,
    session: String,
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

impl Browser {
    async fn start() -> Option<Self> {
        let driver_bin = ["chromedriver", "/usr/bin/chromedriver"].into_iter().find(|b| {
            std::process::Command::new(b).arg("--version").output().is_ok_and(|o| o.status.success())
        });
        let Some(driver_bin) = driver_bin else {
            assert!(
                std::env::var_os("APPROVALD_TEST_BROWSER").is_none(),
                "APPROVALD_TEST_BROWSER is set but chromedriver is not installed (apt-get install chromium chromium-driver)"
            );
            eprintln!(
                "SKIPPED: the browser test needs chromium and chromium-driver (apt-get install chromium chromium-driver)"
            );
            return None;
        };
        let port =
            std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
        let driver = std::process::Command::new(driver_bin)
            .arg(format!("--port={port}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("chromedriver starts");
        let http = approvald::http::client_builder().build().expect("client");
        let base = format!("http://127.0.0.1:{port}");
        let start = Instant::now();
        loop {
            let ready = http.get(format!("{base}/status")).send().await;
            if let Ok(r) = ready
                && r.json::<Value>().await.is_ok_and(|v| v["value"]["ready"] == true)
            {
                break;
            }
            assert!(start.elapsed() < WAIT, "chromedriver never became ready");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let caps = json!({"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": {
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,1100"]
        }}}});
        let created: Value = http
            .post(format!("{base}/session"))
            .json(&caps)
            .send()
            .await
            .expect("session")
            .json()
            .await
            .expect("json");
        let session =
            created["value"]["sessionId"].as_str().unwrap_or_else(|| panic!("no session: {created}"));
        Some(Self { driver, http, session: format!("{base}/session/{session}") })
    }

    async fn cmd(&self, method: reqwest::Method, path: &str, body: Value) -> Value {
        let mut req = self.http.request(method, format!("{}{path}", self.session));
        if !body.is_null() {
            req = req.json(&body);
        }
        let r = req.send().await.expect(path);
        let v: Value = r.json().await.expect("json");
        assert!(v["value"].get("error").is_none(), "{path}: {v}");
        v["value"].clone()
    }

    async fn go(&self, url: &str) {
        self.cmd(reqwest::Method::POST, "/url", json!({"url": url})).await;
    }

    async fn source(&self) -> String {
        self.cmd(reqwest::Method::GET, "/source", Value::Null).await.as_str().unwrap_or("").to_string()
    }

    async fn url(&self) -> String {
        self.cmd(reqwest::Method::GET, "/url", Value::Null).await.as_str().unwrap_or("").to_string()
    }

    async fn find(&self, css: &str) -> String {
        let v =
            self.cmd(reqwest::Method::POST, "/element", json!({"using": "css selector", "value": css})).await;
        v.as_object().and_then(|o| o.values().next()).and_then(Value::as_str).expect("element id").to_string()
    }

    async fn type_into(&self, css: &str, text: &str) {
        let el = self.find(css).await;
        self.cmd(reqwest::Method::POST, &format!("/element/{el}/value"), json!({"text": text})).await;
    }

    async fn click(&self, css: &str) {
        let el = self.find(css).await;
        self.cmd(reqwest::Method::POST, &format!("/element/{el}/click"), json!({})).await;
    }

    async fn screenshot(&self, name: &str) -> std::path::PathBuf {
        use base64::Engine as _;
        let png = self.cmd(reqwest::Method::GET, "/screenshot", Value::Null).await;
        let bytes =
            base64::engine::general_purpose::STANDARD.decode(png.as_str().expect("base64")).expect("png");
        assert!(bytes.starts_with(b"\x89PNG"), "a PNG");
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/test-artifacts");
        std::fs::create_dir_all(&dir).expect("artifact dir");
        let path = dir.join(name);
        std::fs::write(&path, bytes).expect("write screenshot");
        path
    }

    /// Waits until the page's source satisfies `cond`.
    async fn wait_source(&self, what: &str, cond: impl Fn(&str) -> bool) -> String {
        let start = Instant::now();
        loop {
            let s = self.source().await;
            if cond(&s) {
                return s;
            }
            assert!(start.elapsed() < WAIT, "page never showed {what}:\n{s}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_signs_in_sees_real_data_and_resolves_an_uncertain_operation_in_chromium() {
    let app = TestApp::spawn_with(operator_options()).await;
    // Real data: one succeeded, one pending, one denied, one uncertain, and
    // an orphan-to-be in the inbox.
    let done = app.enqueue_ok(&confirm("browser-done")).await;
    let d = app.decision_of(&done).await;
    app.answer(&d, "yes").await;
    let pending = app.enqueue_ok(&confirm("browser-pending")).await;
    app.decision_of(&pending).await;
    let denied = app.enqueue_ok(&confirm("browser-denied")).await;
    let d = app.decision_of(&denied).await;
    app.answer(&d, "no").await;
    app.wait_state(&done, &["succeeded"]).await;
    app.wait_state(&denied, &["denied"]).await;
    app.sandbox.set_effect_response(503, 10_000);
    let mut body = confirm("browser-uncertain");
    body["expiresInSeconds"] = json!(2);
    let uncertain = app.enqueue_ok(&body).await;
    let d = app.decision_of(&uncertain).await;
    app.answer(&d, "yes").await;
    app.wait_state(&uncertain, &["uncertain"]).await;
    app.sandbox.set_effect_response(200, 0);
    let (cb, sig) = app.signed_callback("dec_unknown_to_anyone", "yes");
    assert_eq!(app.post_callback(&cb, Some(&sig)).await.0, 200);

    let Some(browser) = Browser::start().await else { return };
    // Unsigned: the page asks for the token.
    browser.go(&format!("{}/operator", app.base)).await;
    assert!(browser.url().await.ends_with("/operator/login"), "{}", browser.url().await);
    browser.type_into("input[name=token]", "not-the-token").await;
    browser.click("form button").await;
    browser.wait_source("the refusal", |s| s.contains("That is not the operator token.")).await;
    browser.type_into("input[name=token]", OPERATOR_TOKEN).await;
    browser.click("form button").await;
    let page = browser.wait_source("the overview", |s| s.contains("Needs you: 1 uncertain")).await;
    for text in [uncertain.as_str(), "inbox waiting", "Last 60 minutes", "<svg id=\"chart\""] {
        assert!(page.contains(text), "overview lacks {text}:\n{page}");
    }
    assert!(!page.contains(OPERATOR_TOKEN), "the token is never echoed");
    let shot = browser.screenshot("operator-overview.png").await;

    // Filters: by state, and by thread.
    browser.go(&format!("{}/operator/operations?state=denied", app.base)).await;
    let page = browser.source().await;
    assert!(page.contains(&denied) && !page.contains(&done) && !page.contains(&pending), "{page}");
    browser.go(&format!("{}/operator/operations?older_than=soon", app.base)).await;
    assert!(browser.source().await.contains("must look like 90s, 15m, 2h or 3d"));

    // The inbox, with the callback nobody asked for.
    browser.go(&format!("{}/operator/inbox?state=new", app.base)).await;
    assert!(browser.source().await.contains("dec_unknown_to_anyone"));

    // The uncertain operation's timeline, then its resolution.
    browser.go(&format!("{}/operator/operations/{uncertain}", app.base)).await;
    let page = browser.source().await;
    for text in [
        "Timeline",
        "delivery attempt 1",
        "answered 503",
        "inbox entry",
        "<code>create_decision</code>",
        "<code>consume</code>",
        "Resolve",
    ] {
        assert!(page.contains(text), "timeline lacks {text}:\n{page}");
    }
    browser.type_into("form.resolve input[name=note]", "checked the order system: it shipped").await;
    browser.type_into("form.resolve input[name=by]", "alice").await;
    browser.click("form.resolve button").await;
    let page = browser.wait_source("the resolution", |s| s.contains("id=\"flash\"")).await;
    assert!(page.contains("operator:alice (operator page)"), "{page}");
    let op = app.wait_state(&uncertain, &["succeeded"]).await;
    assert_eq!(op["state"], "succeeded", "{op:#}");
    browser.screenshot("operator-resolved.png").await;
    eprintln!("screenshots: {}", shot.parent().expect("dir").display());
}

#[tokio::test]
async fn the_operator_page_is_off_without_a_token_and_closed_without_a_session() {
    let app = TestApp::spawn().await;
    let r = app.http.get(format!("{}/operator", app.base)).send().await.expect("get");
    assert_eq!(r.status(), 404, "no token configured: no page");

    let app = TestApp::spawn_with(operator_options()).await;
    let no_redirect = approvald::http::client_builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client");
    for path in ["/operator", "/operator/operations", "/operator/inbox", "/operator/operations/op_x"] {
        let r = no_redirect.get(format!("{}{path}", app.base)).send().await.expect("get");
        assert_eq!(r.status(), 303, "{path}");
        assert_eq!(r.headers()["location"], "/operator/login", "{path}");
    }
    // A forged cookie, and an API token, are not a session.
    let r = no_redirect
        .get(format!("{}/operator", app.base))
        .header("cookie", format!("approvald_operator={}.{}", approvald::clock::now_ms(), "00".repeat(32)))
        .send()
        .await
        .expect("get");
    assert_eq!(r.status(), 303);
    let r = no_redirect
        .get(format!("{}/operator", app.base))
        .bearer_auth(crate::harness::TOKEN)
        .send()
        .await
        .expect("get");
    assert_eq!(r.status(), 303, "an API token does not open the operator page");
    // A resolve posted from another site is refused and changes nothing.
    let r = no_redirect
        .post(format!("{}/operator/operations/op_x/resolve", app.base))
        .bearer_auth(OPERATOR_TOKEN)
        .header("origin", "https://evil.example")
        .header("content-type", "application/x-www-form-urlencoded")
        .body("outcome=succeeded&note=x&by=mallory")
        .send()
        .await
        .expect("post");
    assert_eq!(r.status(), 403);
    // Sign-in sets an HttpOnly, SameSite=Strict cookie that opens the page.
    let r = no_redirect
        .post(format!("{}/operator/login", app.base))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(format!("token={OPERATOR_TOKEN}"))
        .send()
        .await
        .expect("login");
    assert_eq!(r.status(), 303);
    let cookie = r.headers()["set-cookie"].to_str().expect("ascii").to_string();
    assert!(cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"), "{cookie}");
    assert!(!cookie.contains(OPERATOR_TOKEN), "the cookie is not the token: {cookie}");
    let session = cookie.split(';').next().expect("pair").to_string();
    let r = no_redirect
        .get(format!("{}/operator", app.base))
        .header("cookie", session)
        .send()
        .await
        .expect("get");
    assert_eq!(r.status(), 200);
    assert!(r.text().await.expect("text").contains("Nothing is waiting for an operator."));
}
