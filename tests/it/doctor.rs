//! `approvald doctor` and CLI progress, run as the real binary against the
//! Pushary sandbox (in this process, on a loopback port) and real stores.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use approvald::sandbox::{self, SandboxConfig, SandboxHandle};
use approvald::store::Store;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

const TOKEN: &str = "doctor-token-0123456789abcdef";

struct Sandbox {
    handle: SandboxHandle,
    shutdown: CancellationToken,
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

async fn sandbox() -> Sandbox {
    let shutdown = CancellationToken::new();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind sandbox");
    let handle =
        sandbox::start(listener, SandboxConfig::default(), shutdown.clone()).await.expect("sandbox starts");
    Sandbox { handle, shutdown }
}

/// A loopback port nothing listens on.
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Run {
    fn all(&self) -> String {
        format!("{}\n{}", self.stdout, self.stderr)
    }

    /// The report line of check `name`: `<status>  <name>  <finding>`, with
    /// its `fix:` line appended when there is one.
    fn check(&self, name: &str) -> (String, String) {
        let lines: Vec<&str> = self.stdout.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let mut words = line.split_whitespace();
            let status = words.next().unwrap_or_default();
            if !matches!(status, "ok" | "WARN" | "FAIL" | "skip") {
                continue;
            }
            let rest = line[status.len()..].trim_start();
            if rest.starts_with(name) && rest[name.len()..].starts_with("  ") {
                let fix = lines
                    .get(i + 1)
                    .map(|l| l.trim_start())
                    .filter(|l| l.starts_with("fix: "))
                    .unwrap_or_default();
                return (status.to_string(), format!("{}\n{fix}", rest[name.len()..].trim()));
            }
        }
        panic!("no check `{name}` in the report:\n{}", self.all());
    }

    /// Every check line's status and name.
    fn statuses(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for line in self.stdout.lines() {
            let Some(status) = line.split_whitespace().next() else { continue };
            if matches!(status, "ok" | "WARN" | "FAIL" | "skip") {
                let name = line[status.len()..].trim_start().split("  ").next().unwrap_or_default();
                out.push((status.to_string(), name.trim().to_string()));
            }
        }
        out
    }

    fn assert_no_secret(&self, secrets: &[&str]) {
        let all = self.all();
        for s in secrets {
            assert!(!all.contains(s), "a secret leaked into the output:\n{all}");
        }
    }
}

/// Runs the binary with only the given APPROVALD_* configuration (none is
/// inherited from the test's environment), off the async runtime so the
/// in-process sandbox keeps serving.
async fn approvald(args: &[&str], env: &[(&str, &str)]) -> Run {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let env: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let out: Output = tokio::task::spawn_blocking(move || {
        let mut c = Command::new(env!("CARGO_BIN_EXE_approvald"));
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("APPROVALD_") {
                c.env_remove(k);
            }
        }
        c.args(&args).envs(env).output().expect("runs")
    })
    .await
    .expect("joins");
    Run {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

struct Setup {
    base_url: String,
    api_key: String,
    webhook_secrets: Vec<String>,
    store_url: String,
    public_url: String,
    timeout_secs: u64,
    extra: String,
}

impl Setup {
    fn healthy(sb: &SandboxHandle, store_url: &str) -> Self {
        Setup {
            base_url: sb.base_url(),
            api_key: sb.api_key(),
            webhook_secrets: vec![sb.webhook_secret()],
            store_url: store_url.to_string(),
            public_url: "http://127.0.0.1:8080".into(),
            timeout_secs: 5,
            extra: String::new(),
        }
    }

    fn write(&self, dir: &Path) -> PathBuf {
        let secrets: Vec<String> = self.webhook_secrets.iter().map(|s| toml_str(s)).collect();
        let api_key = if self.api_key.is_empty() {
            String::new()
        } else {
            format!("api_key = {}", toml_str(&self.api_key))
        };
        let text = format!(
            "[server]\npublic_url = {}\n[store]\nurl = {}\n[api]\ntokens = [{}]\n\
             [pushary]\nbase_url = {}\n{api_key}\nwebhook_secrets = [{}]\ntimeout_secs = {}\n{}\n",
            toml_str(&self.public_url),
            toml_str(&self.store_url),
            toml_str(TOKEN),
            toml_str(&self.base_url),
            secrets.join(", "),
            self.timeout_secs,
            self.extra,
        );
        let path = dir.join("approvald.toml");
        std::fs::write(&path, text).expect("write config");
        path
    }
}

fn toml_str(s: &str) -> String {
    serde_json::to_string(s).expect("a JSON string is a TOML basic string")
}

async fn doctor(config: &Path) -> Run {
    approvald(&["doctor", "--config", &config.display().to_string()], &[]).await
}

async fn migrate(config: &Path) -> Run {
    let run = approvald(&["migrate", "--config", &config.display().to_string()], &[]).await;
    assert_eq!(run.code, Some(0), "migrate failed:\n{}", run.all());
    run
}

both_engines! {
    /// (a) A healthy setup: every check ok, exit 0; `migrate` reports each
    /// migration with its time on stderr and keeps stdout to the version.
    async fn a_healthy_setup_passes_every_check() {
        let sb = sandbox().await;
        let dir = tempfile::tempdir().expect("tempdir");
        let (store_url, _pg) = crate::harness::store_url(&dir.path().join("approvald.db")).await;
        let setup = Setup::healthy(&sb.handle, &store_url);
        let config = setup.write(dir.path());

        let first = migrate(&config).await;
        let latest: i64 = first
            .stdout
            .trim()
            .strip_prefix("schema is at version ")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("stdout is only the version:\n{}", first.stdout));
        assert!(latest >= 5, "{}", first.stdout);
        assert!(first.stderr.contains("is at version 0; applying"), "{}", first.stderr);
        let done: Vec<&str> = first.stderr.lines().filter(|l| l.contains(" done in ")).collect();
        assert_eq!(done.len(), usize::try_from(latest).expect("small"), "one line per migration:\n{}", first.stderr);
        assert!(done[0].contains("migration 1 (init) done in ") && done[0].ends_with(" ms"), "{}", first.stderr);
        assert!(done[done.len() - 1].contains(&format!("migration {latest} (")), "{}", first.stderr);
        let again = migrate(&config).await;
        assert!(again.stderr.contains("nothing to apply"), "{}", again.stderr);
        assert!(!again.stderr.contains("done in"), "{}", again.stderr);

        let run = doctor(&config).await;
        assert_eq!(run.code, Some(0), "doctor failed on a healthy setup:\n{}", run.all());
        let statuses = run.statuses();
        let names: Vec<&str> = statuses.iter().map(|(_, n)| n.as_str()).collect();
        for expected in [
            "config",
            "store",
            "migrations",
            "pushary (default)",
            "webhook secret (default)",
            "public_url",
            "api tokens",
        ] {
            assert!(names.contains(&expected), "no `{expected}` check:\n{}", run.stdout);
        }
        for (status, name) in &statuses {
            assert_eq!(status, "ok", "{name} is not ok:\n{}", run.stdout);
        }
        assert!(run.check("pushary (default)").1.contains("API key accepted"), "{}", run.stdout);
        assert!(run.check("webhook secret (default)").1.contains("current secret"), "{}", run.stdout);
        assert!(run.check("migrations").1.contains(&format!("version {latest}")), "{}", run.stdout);
        assert!(run.stdout.contains("0 failed"), "{}", run.stdout);
        run.assert_no_secret(&[&sb.handle.api_key(), &sb.handle.webhook_secret(), TOKEN]);

        // Read-only commands keep stderr quiet when it is not a terminal.
        let list = approvald(&["ops", "list", "--config", &config.display().to_string()], &[]).await;
        assert_eq!(list.code, Some(0), "{}", list.all());
        assert!(list.stdout.starts_with("ID "), "{}", list.stdout);
        assert_eq!(list.stderr, "", "no progress output off a terminal");

        // After a rotation the configured secret is retiring and the new one
        // is in the store: still healthy, and the report counts them.
        let old = sb.handle.webhook_secret();
        let rotate = approvald(&["secret", "rotate", "--config", &config.display().to_string()], &[]).await;
        assert_eq!(rotate.code, Some(0), "{}", rotate.all());
        assert!(rotate.stderr.contains("rotating the webhook secret of tenant `default`"), "{}", rotate.stderr);
        assert!(rotate.stderr.contains("approvald: rotated in "), "{}", rotate.stderr);
        let new = sb.handle.webhook_secret();
        assert_ne!(old, new);
        rotate.assert_no_secret(&[&old, &new, &sb.handle.api_key()]);
        let run = doctor(&config).await;
        assert_eq!(run.code, Some(0), "{}", run.all());
        let (status, text) = run.check("webhook secret (default)");
        assert_eq!(status, "ok", "{}", run.stdout);
        assert!(text.contains(&format!("Pushary's current secret ({}) is accepted", approvald::doctor::fingerprint(&new))), "{text}");
        assert!(text.contains("2 valid (1 current, 1 retiring, the last until "), "{text}");
        run.assert_no_secret(&[&old, &new, &sb.handle.api_key(), TOKEN]);
    }
}

/// (b) Without an API key the config does not load: the report names the
/// key and its environment variable, and says the rest was skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_api_key_is_named_and_the_rest_skipped() {
    let sb = sandbox().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut setup = Setup::healthy(&sb.handle, &format!("sqlite://{}", dir.path().join("x.db").display()));
    setup.api_key = String::new();
    let config = setup.write(dir.path());
    let run = doctor(&config).await;
    assert_ne!(run.code, Some(0), "{}", run.all());
    let (status, text) = run.check("config");
    assert_eq!(status, "FAIL", "{}", run.stdout);
    assert!(text.contains("`pushary.api_key`"), "{text}");
    assert!(text.contains("fix: set `pushary.api_key` (or APPROVALD_PUSHARY__API_KEY"), "{text}");
    let (status, text) = run.check("other checks");
    assert_eq!(status, "skip", "{}", run.stdout);
    assert!(text.contains("did not load"), "{text}");
    assert!(run.stderr.contains("doctor: 1 check(s) failed"), "{}", run.stderr);
    run.assert_no_secret(&[&sb.handle.webhook_secret(), TOKEN]);
    assert!(!dir.path().join("x.db").exists(), "doctor must not create the store");
}

both_engines! {
    /// (c) A store behind this binary's schema (or no SQLite file at all)
    /// is a failure whose fix is `approvald migrate`.
    async fn an_unmigrated_store_says_run_migrate() {
        let sb = sandbox().await;
        let dir = tempfile::tempdir().expect("tempdir");
        let (store_url, _pg) = crate::harness::store_url(&dir.path().join("approvald.db")).await;
        let config = Setup::healthy(&sb.handle, &store_url).write(dir.path());
        let config_text = std::fs::read_to_string(&config).expect("read");
        let store_config = approvald::Config::from_toml(&config_text).expect("valid").store;
        let store = Store::connect(&store_config).await.expect("connect");
        store.migrate_to(3).await.expect("migrate to 3");
        store.close().await;

        let run = doctor(&config).await;
        assert_ne!(run.code, Some(0), "{}", run.all());
        let (status, text) = run.check("migrations");
        assert_eq!(status, "FAIL", "{}", run.stdout);
        assert!(text.contains("schema at version 3, this binary needs"), "{text}");
        assert!(text.contains("pending: 4 "), "{text}");
        assert!(text.contains(&format!("fix: run `approvald migrate --config {}`", config.display())), "{text}");
        assert_eq!(run.check("store").0, "ok", "{}", run.stdout);
        // Pushary and the configured secret are still checked.
        assert_eq!(run.check("pushary (default)").0, "ok", "{}", run.stdout);

        if matches!(crate::harness::backend(), crate::harness::Backend::Sqlite) {
            let missing = dir.path().join("missing.db");
            let config =
                Setup::healthy(&sb.handle, &format!("sqlite://{}", missing.display())).write(dir.path());
            let run = doctor(&config).await;
            assert_ne!(run.code, Some(0), "{}", run.all());
            let (status, text) = run.check("store");
            assert_eq!(status, "FAIL", "{}", run.stdout);
            assert!(text.contains("no SQLite file at"), "{text}");
            assert!(text.contains("fix: run `approvald migrate"), "{text}");
            assert_eq!(run.check("migrations").0, "skip", "{}", run.stdout);
            assert!(!missing.exists(), "doctor must not create the store");
        }
    }
}

async fn migrated_sqlite(sb: &SandboxHandle, dir: &Path) -> Setup {
    let setup = Setup::healthy(sb, &format!("sqlite://{}", dir.join("approvald.db").display()));
    migrate(&setup.write(dir)).await;
    setup
}

/// (d) A Pushary that does not answer is reported as unreachable, with the
/// base URL to check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_pushary_is_reported() {
    let sb = sandbox().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut setup = migrated_sqlite(&sb.handle, dir.path()).await;
    let port = closed_port();
    setup.base_url = format!("http://127.0.0.1:{port}/api/v1/server");
    let run = doctor(&setup.write(dir.path())).await;
    assert_ne!(run.code, Some(0), "{}", run.all());
    let (status, text) = run.check("pushary (default)");
    assert_eq!(status, "FAIL", "{}", run.stdout);
    assert!(text.contains(&format!("127.0.0.1:{port}/api/v1/server: unreachable")), "{text}");
    assert!(text.contains("fix: check `pushary.base_url` (or APPROVALD_PUSHARY__BASE_URL"), "{text}");
    assert!(!text.contains("bad API key"), "{text}");
    // The rest of the report still ran.
    assert_eq!(run.check("migrations").0, "ok", "{}", run.stdout);
    assert!(run.check("webhook secret (default)").1.contains("not compared"), "{}", run.stdout);
    run.assert_no_secret(&[&setup.api_key, &sb.handle.webhook_secret(), TOKEN]);
}

/// (e) A malformed webhook secret is named by its key, never shown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_webhook_secret_is_named() {
    let sb = sandbox().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut setup = migrated_sqlite(&sb.handle, dir.path()).await;
    // A pasted trailing newline: Pushary signs with the secret alone.
    let pasted = format!("{}\n", sb.handle.webhook_secret());
    setup.webhook_secrets = vec![pasted];
    let run = doctor(&setup.write(dir.path())).await;
    assert_ne!(run.code, Some(0), "{}", run.all());
    let (status, text) = run.check("webhook secret (default)");
    assert_eq!(status, "FAIL", "{}", run.stdout);
    assert!(text.contains("`pushary.webhook_secrets[0]` contains whitespace"), "{text}");
    assert!(
        text.contains("fix: set `pushary.webhook_secrets` (or APPROVALD_PUSHARY__WEBHOOK_SECRETS"),
        "{text}"
    );
    assert!(text.contains("is the one Pushary signs callbacks with now"), "{text}");
    run.assert_no_secret(&[&sb.handle.webhook_secret(), &setup.api_key, TOKEN]);

    // A tenant's: its own key; here the API key pasted in the secret's place.
    let mut setup = Setup::healthy(&sb.handle, &setup.store_url);
    setup.extra = format!(
        "[tenants.acme]\ntokens = [\"acme-token-0123456789\"]\npushary_api_key = {key}\nwebhook_secrets = [{key}]\n",
        key = toml_str(&sb.handle.api_key())
    );
    let run = doctor(&setup.write(dir.path())).await;
    assert_ne!(run.code, Some(0), "{}", run.all());
    assert_eq!(run.check("webhook secret (default)").0, "ok", "{}", run.stdout);
    let (status, text) = run.check("webhook secret (acme)");
    assert_eq!(status, "FAIL", "{}", run.stdout);
    assert!(text.contains("`tenants.acme.webhook_secrets[0]` is a Pushary API key"), "{text}");
    assert!(text.contains("APPROVALD_TENANTS__ACME__WEBHOOK_SECRETS"), "{text}");
    run.assert_no_secret(&[&sb.handle.webhook_secret(), &sb.handle.api_key(), "acme-token-0123456789"]);
}

/// (f) A key Pushary refuses is a bad key (not "unreachable").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_api_key_is_a_bad_key() {
    let sb = sandbox().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut setup = migrated_sqlite(&sb.handle, dir.path()).await;
    setup.api_key = "pk_sandbox.wrong-key-0123456789".into();
    let run = doctor(&setup.write(dir.path())).await;
    assert_ne!(run.code, Some(0), "{}", run.all());
    let (status, text) = run.check("pushary (default)");
    assert_eq!(status, "FAIL", "{}", run.stdout);
    assert!(text.contains("bad API key: Pushary answered 401"), "{text}");
    assert!(text.contains("fix: set `pushary.api_key` (or APPROVALD_PUSHARY__API_KEY"), "{text}");
    assert!(!text.contains("unreachable"), "{text}");
    run.assert_no_secret(&["wrong-key-0123456789", &sb.handle.webhook_secret(), TOKEN]);
}

/// Passwords in store URLs are redacted, in the report and in progress lines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_passwords_are_never_shown() {
    use approvald::doctor::redact_url;
    assert_eq!(redact_url("postgres://app:hunter2@db:5432/x"), "postgres://app:***@db:5432/x");
    assert_eq!(
        redact_url("postgres://db/x?user=app&password=hunter2&sslmode=require"),
        "postgres://db/x?user=app&password=***&sslmode=require"
    );
    assert_eq!(redact_url("sqlite:///var/lib/approvald.db"), "sqlite:///var/lib/approvald.db");
    assert!(!redact_url("postgres://app:hunter2@[::1").contains("hunter2"));

    let sb = sandbox().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let port = closed_port();
    let mut setup = Setup::healthy(&sb.handle, "");
    setup.store_url = format!("postgres://doctor:pw-do-not-print-7f3a@127.0.0.1:{port}/approvald");
    let run = doctor(&setup.write(dir.path())).await;
    assert_ne!(run.code, Some(0), "{}", run.all());
    let (status, text) = run.check("store");
    assert_eq!(status, "FAIL", "{}", run.stdout);
    assert!(
        text.contains(&format!("postgres://doctor:***@127.0.0.1:{port}/approvald: cannot connect")),
        "{text}"
    );
    assert!(text.contains("fix: set `store.url` (or APPROVALD_STORE__URL"), "{text}");
    run.assert_no_secret(&["pw-do-not-print-7f3a", &sb.handle.api_key(), &sb.handle.webhook_secret()]);
}

/// A loopback public_url with a remote Pushary: Pushary could not call back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loopback_public_url_with_a_remote_pushary_is_a_warning() {
    let sb = sandbox().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut setup = migrated_sqlite(&sb.handle, dir.path()).await;
    // TEST-NET-1 (RFC 5737): not local, and nothing answers there.
    setup.base_url = "http://192.0.2.1:9/api/v1/server".into();
    setup.timeout_secs = 1;
    let run = doctor(&setup.write(dir.path())).await;
    let (status, text) = run.check("public_url");
    assert_eq!(status, "WARN", "{}", run.stdout);
    assert!(text.contains("Pushary (192.0.2.1) is not local"), "{text}");
    assert!(text.contains("fix: set `server.public_url` (or APPROVALD_SERVER__PUBLIC_URL"), "{text}");
    let (status, text) = run.check("pushary (default)");
    assert_eq!(status, "FAIL", "{}", run.stdout);
    assert!(text.contains("unreachable"), "{text}");
}

/// On PostgreSQL a role without the TEMPORARY privilege on its database
/// could not run a single save (they are temporary functions, decisions
/// §19): doctor fails it and says the GRANT to run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_role_without_temporary_is_named_with_its_grant() {
    use sqlx::Connection as _;
    let test = "doctor::a_postgres_role_without_temporary_is_named_with_its_grant";
    let Some(crate::harness::Backend::Postgres(admin)) = crate::harness::Backend::postgres(test) else {
        return;
    };
    let db = crate::harness::PgDb::create(&admin).await;
    let role = format!("approvald_notemp_{:08x}", rand::random::<u32>());
    let name = db.url.rsplit_once('/').map(|(_, n)| n.to_string()).expect("a database name");
    let mut conn = sqlx::PgConnection::connect(&admin).await.expect("connects");
    for sql in
        [format!("CREATE ROLE {role} LOGIN"), format!("REVOKE TEMPORARY ON DATABASE {name} FROM PUBLIC")]
    {
        sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&mut conn).await.expect("sets the role up");
    }
    let sb = sandbox().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let url = db.url.replacen("postgres@", &format!("{role}@"), 1);
    assert_ne!(url, db.url, "the test URL names its user: {}", db.url);
    let run = doctor(&Setup::healthy(&sb.handle, &url).write(dir.path())).await;
    let (status, text) = run.check("store privileges");
    let granted = {
        sqlx::query(sqlx::AssertSqlSafe(format!("GRANT TEMPORARY ON DATABASE {name} TO {role}")))
            .execute(&mut conn)
            .await
            .expect("grants");
        doctor(&Setup::healthy(&sb.handle, &url).write(dir.path())).await
    };
    drop(db);
    let _ = sqlx::query(sqlx::AssertSqlSafe(format!("DROP ROLE IF EXISTS {role}"))).execute(&mut conn).await;
    assert_eq!(status, "FAIL", "{}", run.stdout);
    assert!(
        text.contains(&format!("role {role} lacks the TEMPORARY privilege on database {name}")),
        "{text}"
    );
    assert!(text.contains(&format!("GRANT TEMPORARY ON DATABASE \"{name}\" TO \"{role}\"")), "{text}");
    assert_ne!(run.code, Some(0), "{}", run.all());
    assert_eq!(granted.check("store privileges").0, "ok", "{}", granted.stdout);
}
