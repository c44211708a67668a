//! `approvald doctor`: checks a configuration end to end (config, store,
//! migrations, Pushary, webhook secrets, public URL, API tokens) and says
//! exactly what to fix. The checks return a [`Report`]; the command line
//! only prints it.
//!
//! Nothing here changes anything: the store is opened and read (a missing
//! SQLite file is reported, not created), and Pushary is asked
//! `GET /webhook-secret`, an authenticated read without side effects that
//! also tells which secret Pushary signs callbacks with now. Secret values
//! are never part of the report: at most a fingerprint (the first 4 hex
//! digits of their SHA-256), and every finding is scrubbed of every secret
//! the configuration holds before it is returned.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::config::{Config, ConfigError, DEFAULT_TENANT, Tenant};
use crate::pushary::{PusharyClient, PusharyError};
use crate::secret::Secret;
use crate::store::Store;

/// The outcome of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    Warn,
    Fail,
    /// Not run, because something it needs failed first (said in the finding).
    Skip,
}

impl Status {
    pub fn label(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Warn => "WARN",
            Status::Fail => "FAIL",
            Status::Skip => "skip",
        }
    }
}

/// One check: what it looked at, what it found, and for a warning or a
/// failure what exactly to change.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: String,
    pub status: Status,
    /// One line.
    pub finding: String,
    /// Names the config key and its environment variable, or the command to run.
    pub fix: Option<String>,
}

impl Check {
    fn new(name: impl Into<String>, status: Status, finding: impl Into<String>, fix: Option<String>) -> Self {
        Self { name: name.into(), status, finding: finding.into(), fix }
    }

    fn ok(name: impl Into<String>, finding: impl Into<String>) -> Self {
        Self::new(name, Status::Ok, finding, None)
    }

    fn skip(name: impl Into<String>, why: impl Into<String>) -> Self {
        Self::new(name, Status::Skip, why, None)
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The `--config` file, if one was given.
    pub config_file: Option<PathBuf>,
    pub checks: Vec<Check>,
}

impl Report {
    /// Any check failed: approvald would not work as configured.
    pub fn failed(&self) -> bool {
        self.checks.iter().any(|c| c.status == Status::Fail)
    }

    pub fn count(&self, status: Status) -> usize {
        self.checks.iter().filter(|c| c.status == status).count()
    }

    pub fn check(&self, name: &str) -> Option<&Check> {
        self.checks.iter().find(|c| c.name == name)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let source = match &self.config_file {
            Some(p) => format!("defaults, then {}, then APPROVALD_* environment variables", p.display()),
            None => "defaults, then APPROVALD_* environment variables (no --config file)".to_string(),
        };
        writeln!(f, "approvald doctor: configuration from {source}")?;
        writeln!(f)?;
        let width = self.checks.iter().map(|c| c.name.chars().count()).max().unwrap_or(0);
        for c in &self.checks {
            writeln!(f, "{:<4}  {:<width$}  {}", c.status.label(), c.name, c.finding)?;
            if let Some(fix) = &c.fix {
                writeln!(f, "{:<4}  {:<width$}  fix: {fix}", "", "")?;
            }
        }
        writeln!(f)?;
        let (failed, warned) = (self.count(Status::Fail), self.count(Status::Warn));
        let verdict = if failed > 0 {
            "not ready: fix the failures above"
        } else if warned > 0 {
            "ready, with warnings"
        } else {
            "ready"
        };
        writeln!(
            f,
            "{} ok, {warned} warning(s), {failed} failed, {} skipped: {verdict}",
            self.count(Status::Ok),
            self.count(Status::Skip)
        )
    }
}

/// Loads the configuration as every command does (defaults, `config_file`,
/// then `APPROVALD_*`), then runs every check. `on_step` is told what is
/// being checked, for a progress line.
pub async fn run(config_file: Option<&Path>, mut on_step: impl FnMut(&str)) -> Report {
    on_step("loading the configuration");
    let mut report = Report { config_file: config_file.map(Path::to_path_buf), checks: Vec::new() };
    let config = match Config::load(config_file) {
        Ok(c) => c,
        Err(e) => {
            report.checks.push(config_failure(&e, config_file));
            report.checks.push(Check::skip(
                "other checks",
                "skipped (store, migrations, Pushary, webhook secret, public_url): the configuration did not load",
            ));
            return report;
        }
    };
    report.checks.push(config_loaded(&config));
    let (checks, mut secrets) = check_config(&config, config_file, &mut on_step).await;
    report.checks.extend(checks);
    secrets.extend(config_secrets(&config));
    scrub(&mut report.checks, &secrets);
    report
}

/// Every check after loading, for a configuration already loaded; returns
/// them and the secrets learnt on the way (to scrub them from the output).
async fn check_config(
    config: &Config,
    config_file: Option<&Path>,
    on_step: &mut impl FnMut(&str),
) -> (Vec<Check>, Vec<String>) {
    let mut checks = Vec::new();
    let mut learnt = Vec::new();

    on_step("opening the store");
    let store = check_store(config, config_file, &mut checks).await;
    let migrated = match &store {
        Some(store) => {
            on_step("reading the schema version");
            check_migrations(store, config_file, &mut checks).await
        }
        None => {
            checks.push(Check::skip("migrations", "skipped: the store could not be opened"));
            false
        }
    };

    for tenant in config.tenants() {
        on_step(&format!("asking Pushary for tenant `{}`", tenant.name));
        let (check, current) = check_pushary(config, &tenant).await;
        checks.push(check);
        if let Some(current) = &current {
            learnt.push(current.expose().to_string());
        }
        on_step(&format!("checking the webhook secrets of tenant `{}`", tenant.name));
        let stored = match (&store, migrated) {
            (Some(store), true) => Some(store.webhook_secrets(&tenant.name).await),
            _ => None,
        };
        if let Some(Ok(rows)) = &stored {
            learnt.extend(rows.iter().map(|(s, _)| s.clone()));
        }
        checks.push(check_webhook_secrets(&tenant, stored, current.as_ref()));
    }
    checks.push(check_public_url(config));
    checks.push(check_tokens(config));
    if let Some(store) = store {
        store.close().await;
    }
    (checks, learnt)
}

// ---- config --------------------------------------------------------------------------------------

fn config_failure(e: &ConfigError, file: Option<&Path>) -> Check {
    let file_hint = match file {
        Some(p) => format!("in {}", p.display()),
        None => "in the --config file".to_string(),
    };
    match e {
        ConfigError::Invalid { key, problem } => {
            // figment names the key path; an unknown key is reported on its table.
            let var = env_var(key);
            let set_in_env = std::env::var_os(&var).is_some();
            let fix = if problem.starts_with("is required") {
                required_fix(key)
            } else if problem.starts_with("unknown field") {
                if set_in_env {
                    format!("unset {var}: approvald has no key `{key}`")
                } else {
                    format!("rename or remove `{key}` {file_hint} (a typo?): approvald has no such key")
                }
            } else if set_in_env {
                format!("fix {var} (it is set in the environment and overrides `{key}` {file_hint})")
            } else {
                format!("fix `{key}` {file_hint} (or set {var})")
            };
            Check::new("config", Status::Fail, format!("`{key}`: {problem}"), Some(fix))
        }
        ConfigError::Load(message) => {
            // A TOML parse error quotes the offending line, which may hold a
            // secret: keep only its first line (where) and last (what).
            let lines: Vec<&str> = message.lines().filter(|l| !l.trim().is_empty()).collect();
            let mut first = lines.first().copied().unwrap_or_default().to_string();
            if let Some(last) = lines.last().filter(|_| lines.len() > 1)
                && !last.starts_with(|c: char| c.is_whitespace() || c.is_ascii_digit() || c == '|')
            {
                first = format!("{first}: {last}");
            }
            let fix = if message.contains("does not exist") {
                "give an existing file with --config (or APPROVALD_CONFIG)".to_string()
            } else {
                format!("fix the configuration {file_hint} at the place named")
            };
            Check::new("config", Status::Fail, format!("does not load: {first}"), Some(fix))
        }
    }
}

/// The fix for a missing required key.
fn required_fix(key: &str) -> String {
    let var = env_var(key);
    match key {
        "pushary.api_key" => format!(
            "set `pushary.api_key` (or {var}, or `pushary.api_key_file`) to the Pushary server key, \
             pk_<id>.<secret>; or configure [tenants.<name>]"
        ),
        _ => format!("set `{key}` (or {var}, or `{key}_file`)"),
    }
}

fn config_loaded(config: &Config) -> Check {
    let tenants: Vec<String> = config.tenants().into_iter().map(|t| t.name).collect();
    let mut overrides: Vec<String> = std::env::vars_os()
        .filter_map(|(k, _)| k.into_string().ok())
        .filter(|k| k.starts_with("APPROVALD_") && k.contains("__"))
        .collect();
    overrides.sort();
    let env = if overrides.is_empty() {
        String::new()
    } else {
        format!("; environment overrides: {}", overrides.join(", "))
    };
    Check::ok("config", format!("loaded and valid; tenants: {}{env}", tenants.join(", ")))
}

/// Said after a fix when the variable is what sets the value now.
fn env_note(var: &str) -> String {
    if std::env::var_os(var).is_some() {
        format!(" ({var} is set in this environment and overrides the file)")
    } else {
        String::new()
    }
}

/// The environment variable that sets `key`: `pushary.api_key` →
/// `APPROVALD_PUSHARY__API_KEY` (list indexes dropped).
pub fn env_var(key: &str) -> String {
    let path: Vec<String> = key
        .split('.')
        .map(|part| part.split('[').next().unwrap_or(part).to_ascii_uppercase().replace('-', "_"))
        .collect();
    format!("APPROVALD_{}", path.join("__"))
}

// ---- store and migrations ------------------------------------------------------------------------

/// How long opening the store may take before it counts as unreachable.
const STORE_TIMEOUT: Duration = Duration::from_secs(20);

async fn check_store(config: &Config, config_file: Option<&Path>, checks: &mut Vec<Check>) -> Option<Store> {
    let url = &config.store.url;
    let shown = redact_url(url);
    let fix_url = format!(
        "set `store.url` (or {}) to the store approvald uses{}",
        env_var("store.url"),
        env_note(&env_var("store.url"))
    );
    let postgres = url.starts_with("postgres");
    let mut notes = Vec::new();
    if !postgres {
        use std::str::FromStr as _;
        let options = match sqlx::sqlite::SqliteConnectOptions::from_str(url) {
            Ok(o) => o,
            Err(e) => {
                checks.push(Check::new(
                    "store",
                    Status::Fail,
                    format!("{shown}: not a SQLite URL: {e}"),
                    Some(fix_url),
                ));
                return None;
            }
        };
        let path = options.get_filename().to_path_buf();
        if url.contains(":memory:") || url.contains("mode=memory") {
            notes.push((
                "in memory: everything is lost when approvald stops".to_string(),
                format!(
                    "set `store.url` (or {}) to a file, sqlite:///path/approvald.db",
                    env_var("store.url")
                ),
            ));
        } else if !path.exists() {
            checks.push(Check::new(
                "store",
                Status::Fail,
                format!("{shown}: no SQLite file at {} (not created by doctor)", path.display()),
                Some(format!("run `{}` to create it, or {fix_url}", migrate_command(config_file))),
            ));
            return None;
        }
        if config.store.sqlite_synchronous == "normal" {
            notes.push((
                "sqlite_synchronous = \"normal\": the last commits can be lost on power loss".to_string(),
                format!(
                    "set `store.sqlite_synchronous` (or {}) to \"full\"",
                    env_var("store.sqlite_synchronous")
                ),
            ));
        }
    }
    if postgres && let Some(check) = postgres_connects(url, &shown, &fix_url).await {
        checks.push(check);
        return None;
    }
    // A small pool: doctor only reads.
    let mut store_config = config.store.clone();
    store_config.max_connections = store_config.max_connections.min(2);
    let connected = tokio::time::timeout(STORE_TIMEOUT, Store::connect(&store_config)).await;
    let store = match connected {
        Ok(Ok(store)) => store,
        Ok(Err(e)) => {
            checks.push(Check::new(
                "store",
                Status::Fail,
                format!("{shown}: cannot connect: {e}"),
                Some(fix_url),
            ));
            return None;
        }
        Err(_) => {
            checks.push(Check::new(
                "store",
                Status::Fail,
                format!("{shown}: no connection within {} s", STORE_TIMEOUT.as_secs()),
                Some(fix_url),
            ));
            return None;
        }
    };
    let started = Instant::now();
    if let Err(e) = store.ping().await {
        checks.push(Check::new(
            "store",
            Status::Fail,
            format!("{shown}: connected, but a query failed: {e}"),
            Some(fix_url),
        ));
        store.close().await;
        return None;
    }
    let engine = if postgres { "PostgreSQL" } else { "SQLite" };
    let mut finding =
        format!("{shown}: {engine}, connected, answers queries ({} ms)", started.elapsed().as_millis());
    let status = if notes.is_empty() { Status::Ok } else { Status::Warn };
    for (note, _) in &notes {
        finding.push_str("; ");
        finding.push_str(note);
    }
    let fix =
        (!notes.is_empty()).then(|| notes.iter().map(|(_, f)| f.as_str()).collect::<Vec<_>>().join("; "));
    checks.push(Check::new("store", status, finding, fix));
    Some(store)
}

/// One direct connection first: the pool retries a refused connection
/// until its timeout and then reports only that it timed out, where this
/// gives the server's or the network's own reason.
async fn postgres_connects(url: &str, shown: &str, fix_url: &str) -> Option<Check> {
    use sqlx::Connection as _;
    use std::str::FromStr as _;
    let fail = |finding: String| Some(Check::new("store", Status::Fail, finding, Some(fix_url.to_string())));
    let options = match sqlx::postgres::PgConnectOptions::from_str(url) {
        Ok(o) => o,
        Err(e) => return fail(format!("{shown}: not a PostgreSQL URL: {e}")),
    };
    match tokio::time::timeout(STORE_TIMEOUT, sqlx::PgConnection::connect_with(&options)).await {
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
            None
        }
        Ok(Err(e)) => fail(format!("{shown}: cannot connect: {e}")),
        Err(_) => fail(format!("{shown}: no connection within {} s", STORE_TIMEOUT.as_secs())),
    }
}

fn migrate_command(config_file: Option<&Path>) -> String {
    match config_file {
        Some(p) => format!("approvald migrate --config {}", p.display()),
        None => "approvald migrate".to_string(),
    }
}

/// Returns whether the schema is current.
async fn check_migrations(store: &Store, config_file: Option<&Path>, checks: &mut Vec<Check>) -> bool {
    let migrate = migrate_command(config_file);
    let (applied, latest) = match store.migration_status().await {
        Ok(s) => s,
        Err(e) => {
            checks.push(Check::new(
                "migrations",
                Status::Fail,
                format!("cannot read the schema version: {e}"),
                Some(format!("run `{migrate}`")),
            ));
            return false;
        }
    };
    let pending = |from: i64| {
        store
            .known_migrations()
            .into_iter()
            .filter(|(v, _)| *v > from)
            .map(|(v, d)| format!("{v} {d}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let check = match applied {
        Some(a) if a == latest => {
            Check::ok("migrations", format!("schema at version {a}, the latest this binary knows"))
        }
        Some(a) if a > latest => Check::new(
            "migrations",
            Status::Fail,
            format!("schema at version {a}, newer than this binary knows ({latest}): an older approvald"),
            Some("run the approvald release that migrated this store (or a newer one)".into()),
        ),
        Some(a) => Check::new(
            "migrations",
            Status::Fail,
            format!("schema at version {a}, this binary needs {latest} (pending: {})", pending(a)),
            Some(format!("run `{migrate}`")),
        ),
        None => Check::new(
            "migrations",
            Status::Fail,
            format!("no schema: no migration applied; this binary needs version {latest}"),
            Some(format!("run `{migrate}`")),
        ),
    };
    let current = check.status == Status::Ok;
    checks.push(check);
    current
}

// ---- Pushary ---------------------------------------------------------------------------------------

/// The config keys of a tenant's Pushary credentials.
fn api_key_key(tenant: &str) -> String {
    if tenant == DEFAULT_TENANT {
        "pushary.api_key".into()
    } else {
        format!("tenants.{tenant}.pushary_api_key")
    }
}

fn secrets_key(tenant: &str) -> String {
    if tenant == DEFAULT_TENANT {
        "pushary.webhook_secrets".into()
    } else {
        format!("tenants.{tenant}.webhook_secrets")
    }
}

fn tokens_key(tenant: &str) -> String {
    if tenant == DEFAULT_TENANT { "api.tokens".into() } else { format!("tenants.{tenant}.tokens") }
}

/// `GET /webhook-secret` with the tenant's key: authenticated, cheap and
/// without side effects. Returns the check and Pushary's current secret.
async fn check_pushary(config: &Config, tenant: &Tenant) -> (Check, Option<Secret>) {
    let name = format!("pushary ({})", tenant.name);
    let base = redact_url(&config.pushary.base_url);
    let key = api_key_key(&tenant.name);
    let key_fix = format!(
        "set `{key}` (or {}, or `{key}_file`) to this account's server key, pk_<id>.<secret>{}",
        env_var(&key),
        env_note(&env_var(&key))
    );
    let base_fix = format!(
        "check `pushary.base_url` (or {}; the real service is https://pushary.com/api/v1/server) \
         and that this host can reach it (proxy, firewall){}",
        env_var("pushary.base_url"),
        env_note(&env_var("pushary.base_url"))
    );
    let timeout = config.pushary_timeout();
    let client = match PusharyClient::new(&config.pushary.base_url, tenant.api_key.clone(), timeout) {
        Ok(c) => c,
        Err(e) => {
            return (
                Check::new(name, Status::Fail, format!("cannot build a client: {e}"), Some(key_fix)),
                None,
            );
        }
    };
    let started = Instant::now();
    let result = client.webhook_secret().await;
    let ms = started.elapsed().as_millis();
    match result {
        Ok(secret) => {
            let plain_http = url::Url::parse(&config.pushary.base_url)
                .is_ok_and(|u| u.scheme() == "http" && !u.host().is_some_and(|h| is_local(&h)));
            let finding = format!("{base}: reachable, API key accepted (GET /webhook-secret, {ms} ms)");
            let check = if plain_http {
                Check::new(
                    name,
                    Status::Warn,
                    format!("{finding}; but plain http to a remote host sends the API key in clear"),
                    Some(format!("use an https `pushary.base_url` (or {})", env_var("pushary.base_url"))),
                )
            } else {
                Check::ok(name, finding)
            };
            (check, Some(secret))
        }
        Err(PusharyError::Transport(e)) => (
            Check::new(
                name,
                Status::Fail,
                format!("{base}: unreachable ({e}; timeout {} s)", timeout.as_secs()),
                Some(base_fix),
            ),
            None,
        ),
        Err(PusharyError::Status { status: status @ (401 | 403), message, .. }) => (
            Check::new(
                name,
                Status::Fail,
                format!("{base}: bad API key: Pushary answered {status} ({})", clip(&message, 120)),
                Some(key_fix),
            ),
            None,
        ),
        Err(PusharyError::Status { status: 404, .. }) => (
            Check::new(
                name,
                Status::Fail,
                format!("{base}: answered 404 for /webhook-secret: not Pushary's server API"),
                Some(base_fix),
            ),
            None,
        ),
        Err(PusharyError::Status { status, message, .. }) => {
            let what =
                if status >= 500 || status == 429 { "Pushary is failing right now" } else { "refused" };
            (
                Check::new(
                    name,
                    Status::Fail,
                    format!("{base}: {what}: HTTP {status} ({})", clip(&message, 120)),
                    Some(if status >= 500 || status == 429 {
                        "try again later; if it persists, check Pushary's status".to_string()
                    } else {
                        base_fix
                    }),
                ),
                None,
            )
        }
        Err(PusharyError::Decode(e)) => (
            Check::new(
                name,
                Status::Fail,
                format!("{base}: answered 2xx but not as Pushary does ({e})"),
                Some(base_fix),
            ),
            None,
        ),
    }
}

// ---- webhook secrets -------------------------------------------------------------------------------

/// First 4 hex digits of the SHA-256: enough to tell secrets apart, nothing
/// about their value.
pub fn fingerprint(secret: &str) -> String {
    format!("sha256:{}", &hex::encode(Sha256::digest(secret.as_bytes()))[..4])
}

/// Pushary's webhook secret is used as is (its UTF-8 bytes) as the HMAC key,
/// and the protocol gives it no other format. What can be told locally:
/// whitespace or control characters (a pasted newline or quote) or an API
/// key in its place can never match; a value without the `whsec_` prefix
/// every Pushary-issued secret seen so far has is suspicious only.
fn secret_shape(value: &str, api_key: &str) -> Option<(Status, &'static str)> {
    if value.chars().any(|c| c.is_whitespace() || c.is_control()) {
        Some((Status::Fail, "contains whitespace or control characters, so it can never match"))
    } else if value == api_key || value.starts_with("pk_") {
        Some((Status::Fail, "is a Pushary API key, not the webhook secret"))
    } else if !value.starts_with("whsec_") {
        Some((Status::Warn, "does not start with `whsec_` as Pushary's webhook secrets do"))
    } else {
        None
    }
}

/// A row of `webhook_secrets`: the secret and when it stops verifying.
type StoredSecret = (String, Option<i64>);

fn check_webhook_secrets(
    tenant: &Tenant,
    stored: Option<Result<Vec<StoredSecret>, crate::store::StoreError>>,
    pushary_current: Option<&Secret>,
) -> Check {
    let name = format!("webhook secret ({})", tenant.name);
    let key = secrets_key(&tenant.name);
    let var = env_var(&key);
    let set_fix = format!(
        "set `{key}` (or {var}, or `{key}_file`) to the exact secret Pushary's GET /webhook-secret returns \
         for this API key{}",
        env_note(&var)
    );
    let mut status = Status::Ok;
    let mut findings = Vec::new();
    let mut fix = None;
    for (i, s) in tenant.webhook_secrets.iter().enumerate() {
        if let Some((st, problem)) = secret_shape(s.expose(), tenant.api_key.expose()) {
            findings.push(format!("`{key}[{i}]` {problem}"));
            if st == Status::Fail || status == Status::Ok {
                fix = Some(set_fix.clone());
            }
            status = worst(status, st);
        }
    }

    // What the receiver accepts now, as `api::callbacks` computes it: the
    // configured secrets less those a rotation retired, plus those rotated
    // in through the store and still within their window.
    let now = crate::clock::now_ms();
    let open = |until: &Option<i64>| until.is_none_or(|u| u > now);
    let (rows, store_note) = match stored {
        Some(Ok(rows)) => (rows, None),
        Some(Err(e)) => (Vec::new(), Some(format!("rotated secrets unreadable ({e})"))),
        None => (
            Vec::new(),
            Some("rotated secrets in the store not checked (store not open or not migrated)".to_string()),
        ),
    };
    let mut accepted: Vec<&str> = tenant
        .webhook_secrets
        .iter()
        .map(Secret::expose)
        .filter(|c| !rows.iter().any(|(s, until)| s == c && !open(until)))
        .collect();
    let retired_configured = tenant.webhook_secrets.len() - accepted.len();
    let valid_rotated: Vec<&str> = rows.iter().filter(|(_, u)| open(u)).map(|(s, _)| s.as_str()).collect();
    for s in &valid_rotated {
        if !accepted.contains(s) {
            accepted.push(s);
        }
    }
    let mut summary = format!("{} configured", tenant.webhook_secrets.len());
    match &store_note {
        None => {
            let current = rows.iter().filter(|(_, u)| u.is_none()).count();
            let retiring: Vec<i64> = rows.iter().filter_map(|(_, u)| u.filter(|u| *u > now)).collect();
            let expired = rows.len() - current - retiring.len();
            summary.push_str(&format!(
                "; in the store (`approvald secret rotate`): {} valid ({current} current, {} retiring{}), \
                 {expired} expired",
                valid_rotated.len(),
                retiring.len(),
                retiring
                    .iter()
                    .max()
                    .map(|u| format!(", the last until {}", crate::clock::rfc3339(*u)))
                    .unwrap_or_default()
            ));
        }
        Some(note) => summary.push_str(&format!("; {note}")),
    }
    if retired_configured > 0 {
        summary.push_str(&format!(", {retired_configured} configured one(s) retired by a rotation"));
    }
    let prints: Vec<String> = accepted.iter().map(|s| fingerprint(s)).collect();

    if accepted.is_empty() {
        findings.push("no webhook secret: every callback would be rejected (401)".into());
        status = Status::Fail;
        fix = Some(set_fix.clone());
    } else if let Some(current) = pushary_current {
        if accepted.contains(&current.expose()) {
            findings
                .push(format!("Pushary's current secret ({}) is accepted", fingerprint(current.expose())));
        } else {
            findings.push(format!(
                "none of the accepted secrets ({}) is the one Pushary signs callbacks with now ({}): \
                 every callback would be rejected",
                prints.join(", "),
                fingerprint(current.expose())
            ));
            status = Status::Fail;
            fix = Some(format!(
                "{set_fix}, or run `approvald secret rotate --tenant {}` to get and store a new one",
                tenant.name
            ));
        }
    } else {
        findings.push(format!(
            "accepted: {}; not compared with Pushary's (it did not answer)",
            prints.join(", ")
        ));
    }
    findings.push(summary);
    Check::new(name, status, findings.join("; "), fix)
}

fn worst(a: Status, b: Status) -> Status {
    let rank = |s| match s {
        Status::Ok | Status::Skip => 0,
        Status::Warn => 1,
        Status::Fail => 2,
    };
    if rank(b) > rank(a) { b } else { a }
}

// ---- public_url and tokens -------------------------------------------------------------------------

/// Loopback, unspecified, private or link-local: not reachable from a
/// service on the internet.
fn is_local(host: &url::Host<&str>) -> bool {
    match host {
        url::Host::Domain(d) => {
            let d = d.to_ascii_lowercase();
            d == "localhost" || d.ends_with(".localhost")
        }
        url::Host::Ipv4(ip) => {
            ip.is_loopback() || ip.is_unspecified() || ip.is_private() || ip.is_link_local()
        }
        url::Host::Ipv6(ip) => {
            ip.is_loopback()
                || ip.is_unspecified()
                || (ip.segments()[0] & 0xfe00) == 0xfc00
                || (ip.segments()[0] & 0xffc0) == 0xfe80
        }
    }
}

fn check_public_url(config: &Config) -> Check {
    let name = "public_url";
    let var = env_var("server.public_url");
    let shown = redact_url(&config.server.public_url);
    let public = match url::Url::parse(&config.server.public_url) {
        Ok(u) if matches!(u.scheme(), "http" | "https") && u.host().is_some() => u,
        _ => {
            return Check::new(
                name,
                Status::Fail,
                format!("server.public_url `{shown}` is not an absolute http(s) URL"),
                Some(format!("set `server.public_url` (or {var}) to e.g. https://approvals.example.com")),
            );
        }
    };
    if public.query().is_some() || public.fragment().is_some() {
        return Check::new(
            name,
            Status::Fail,
            format!(
                "server.public_url `{shown}` has a query or fragment; callbacks go to <public_url>/v1/callbacks/pushary"
            ),
            Some(format!("set `server.public_url` (or {var}) to the origin (and path prefix) only")),
        );
    }
    let callback = redact_url(&config.callback_url());
    if public.host().is_some_and(|h| match h {
        url::Host::Ipv4(ip) => ip.is_unspecified(),
        url::Host::Ipv6(ip) => ip.is_unspecified(),
        url::Host::Domain(_) => false,
    }) {
        return Check::new(
            name,
            Status::Warn,
            format!(
                "callbacks go to {callback}: an unspecified address (a bind address), which nothing can reach"
            ),
            Some(format!(
                "set `server.public_url` (or {var}) to the address at which Pushary reaches approvald{}",
                env_note(&var)
            )),
        );
    }
    let public_local = public.host().is_some_and(|h| is_local(&h));
    let base = url::Url::parse(&config.pushary.base_url).ok();
    let base_local = base.as_ref().and_then(url::Url::host).is_some_and(|h| is_local(&h));
    let tenants = if config.tenants.is_empty() { "" } else { " (…/pushary/<tenant> for named tenants)" };
    if public_local && !base_local {
        let pushary_host = base.as_ref().and_then(|b| b.host_str().map(str::to_string)).unwrap_or_default();
        return Check::new(
            name,
            Status::Warn,
            format!(
                "callbacks go to {callback}{tenants}: a local address, but Pushary ({pushary_host}) is not local \
                 and could not reach it"
            ),
            Some(format!(
                "set `server.public_url` (or {var}) to the https address at which Pushary reaches approvald{}",
                env_note(&var)
            )),
        );
    }
    if public.scheme() == "http" && !public_local {
        return Check::new(
            name,
            Status::Warn,
            format!("callbacks go to {callback}{tenants} over plain http"),
            Some(format!(
                "serve approvald behind https and set `server.public_url` (or {var}) to that address"
            )),
        );
    }
    Check::ok(name, format!("callbacks go to {callback}{tenants}"))
}

fn check_tokens(config: &Config) -> Check {
    let missing: Vec<String> =
        config.tenants().into_iter().filter(|t| t.tokens.is_empty()).map(|t| tokens_key(&t.name)).collect();
    match missing.first() {
        None => Check::ok("api tokens", "every tenant has an operations API token"),
        Some(first) => Check::new(
            "api tokens",
            Status::Warn,
            format!("no token in {}: the operations API refuses every request for it", missing.join(", ")),
            Some(format!("set `{first}` (or {}, or `{first}_file`), at least 16 characters", env_var(first))),
        ),
    }
}

// ---- secrets out of the output ---------------------------------------------------------------------

/// `url` with any password (user info or a `password`-like query
/// parameter) replaced by `***`. An unparseable URL is not shown at all.
pub fn redact_url(raw: &str) -> String {
    let Ok(mut u) = url::Url::parse(raw) else {
        return match raw.split_once(':') {
            Some((scheme, _)) if !scheme.is_empty() && scheme.chars().all(|c| c.is_ascii_alphanumeric()) => {
                format!("{scheme}:… (unparseable, not shown)")
            }
            _ => "(unparseable URL, not shown)".to_string(),
        };
    };
    if u.password().is_some() {
        let _ = u.set_password(Some("***"));
    }
    if u.query().is_some() {
        let sensitive = |k: &str| {
            let k = k.to_ascii_lowercase();
            ["password", "passwd", "secret", "token", "key"].iter().any(|s| k.contains(s))
        };
        let pairs: Vec<(String, String)> = u
            .query_pairs()
            .map(|(k, v)| {
                let v = if sensitive(&k) { "***".to_string() } else { v.into_owned() };
                (k.into_owned(), v)
            })
            .collect();
        u.query_pairs_mut().clear().extend_pairs(pairs);
    }
    u.to_string()
}

/// Every secret the configuration holds.
fn config_secrets(config: &Config) -> Vec<String> {
    let mut out = Vec::new();
    for t in config.tenants() {
        out.push(t.api_key.expose().to_string());
        out.extend(t.tokens.iter().map(|s| s.expose().to_string()));
        out.extend(t.webhook_secrets.iter().map(|s| s.expose().to_string()));
        for e in t.effects.values() {
            out.extend(e.secret.iter().chain(&e.previous_secret).map(|s| s.expose().to_string()));
        }
    }
    out.extend(config.operator.token.iter().map(|s| s.expose().to_string()));
    for raw in [&config.store.url, &config.pushary.base_url, &config.server.public_url] {
        if let Ok(u) = url::Url::parse(raw)
            && let Some(p) = u.password()
        {
            out.push(p.to_string());
            if let Ok(decoded) = urlencoding_decode(p) {
                out.push(decoded);
            }
        }
    }
    out
}

fn urlencoding_decode(s: &str) -> Result<String, std::string::FromUtf8Error> {
    let mut bytes = Vec::with_capacity(s.len());
    let raw = s.as_bytes();
    let mut i = 0;
    while i < raw.len() {
        if raw[i] == b'%'
            && let Some(hex) = raw.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok())
            && let Ok(b) = u8::from_str_radix(hex, 16)
        {
            bytes.push(b);
            i += 3;
            continue;
        }
        bytes.push(raw[i]);
        i += 1;
    }
    String::from_utf8(bytes)
}

/// Replaces every secret (and its trimmed form) in the findings by `***`.
/// Values shorter than 4 characters are left: they would mangle ordinary
/// words and say nothing.
fn scrub(checks: &mut [Check], secrets: &[String]) {
    let mut values: Vec<&str> =
        secrets.iter().flat_map(|s| [s.as_str(), s.trim()]).filter(|s| s.chars().count() >= 4).collect();
    // Longest first, so a secret containing another is replaced whole.
    values.sort_by_key(|s| std::cmp::Reverse(s.len()));
    values.dedup();
    for c in checks {
        for text in std::iter::once(&mut c.finding).chain(c.fix.as_mut()) {
            for v in &values {
                if text.contains(v) {
                    *text = text.replace(v, "***");
                }
            }
        }
    }
}

fn clip(s: &str, n: usize) -> String {
    let s = s.replace(['\n', '\r'], " ");
    if s.chars().count() <= n { s } else { format!("{}…", s.chars().take(n - 1).collect::<String>()) }
}
