//! The checks that need no network: the configuration, the store and its
//! migrations, the public URL and the API tokens.

use super::*;

pub(super) fn config_failure(e: &ConfigError, file: Option<&Path>) -> Check {
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
pub(super) fn required_fix(key: &str) -> String {
    let var = env_var(key);
    match key {
        "pushary.api_key" => format!(
            "set `pushary.api_key` (or {var}, or `pushary.api_key_file`) to the Pushary server key, \
             pk_<id>.<secret>; or configure [tenants.<name>]"
        ),
        _ => format!("set `{key}` (or {var}, or `{key}_file`)"),
    }
}

pub(super) fn config_loaded(config: &Config) -> Check {
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
pub(super) fn env_note(var: &str) -> String {
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

pub(super) async fn check_store(
    config: &Config,
    config_file: Option<&Path>,
    checks: &mut Vec<Check>,
) -> Option<Store> {
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
    if let Some(check) = check_temp_privilege(&store).await {
        checks.push(check);
    }
    Some(store)
}

/// PostgreSQL: approvald's saves and thread takes are temporary functions
/// each connection makes (docs/decisions.md §19, §20), which needs the
/// `TEMPORARY` privilege on the database; without it every save fails.
async fn check_temp_privilege(store: &Store) -> Option<Check> {
    const NAME: &str = "store privileges";
    match store.pg_temp_privilege().await {
        Ok(None) => None,
        Ok(Some((true, db, role))) => Some(Check::ok(
            NAME,
            format!("role {role} may make the temporary functions approvald runs in database {db}"),
        )),
        Ok(Some((false, db, role))) => Some(Check::new(
            NAME,
            Status::Fail,
            format!(
                "role {role} lacks the TEMPORARY privilege on database {db}: every save would fail \
                 (approvald runs its saves through a temporary function on each connection)"
            ),
            Some(format!(
                "as the database's owner or a superuser, run `GRANT TEMPORARY ON DATABASE \"{db}\" TO \"{role}\"`"
            )),
        )),
        Err(e) => Some(Check::new(
            NAME,
            Status::Fail,
            format!("cannot read the role's privileges: {e}"),
            Some("check that approvald's role may connect and query its database".into()),
        )),
    }
}

/// One direct connection first: the pool retries a refused connection
/// until its timeout and then reports only that it timed out, where this
/// gives the server's or the network's own reason.
pub(super) async fn postgres_connects(url: &str, shown: &str, fix_url: &str) -> Option<Check> {
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

pub(super) fn migrate_command(config_file: Option<&Path>) -> String {
    match config_file {
        Some(p) => format!("approvald migrate --config {}", p.display()),
        None => "approvald migrate".to_string(),
    }
}

/// Returns whether the schema is current.
pub(super) async fn check_migrations(
    store: &Store,
    config_file: Option<&Path>,
    checks: &mut Vec<Check>,
) -> bool {
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

// ---- config keys ------------------------------------------------------------------------------------

/// The config keys of a tenant's Pushary credentials.
pub(super) fn api_key_key(tenant: &str) -> String {
    if tenant == DEFAULT_TENANT {
        "pushary.api_key".into()
    } else {
        format!("tenants.{tenant}.pushary_api_key")
    }
}

pub(super) fn secrets_key(tenant: &str) -> String {
    if tenant == DEFAULT_TENANT {
        "pushary.webhook_secrets".into()
    } else {
        format!("tenants.{tenant}.webhook_secrets")
    }
}

pub(super) fn tokens_key(tenant: &str) -> String {
    if tenant == DEFAULT_TENANT { "api.tokens".into() } else { format!("tenants.{tenant}.tokens") }
}

pub(super) fn worst(a: Status, b: Status) -> Status {
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
pub(super) fn is_local(host: &url::Host<&str>) -> bool {
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

pub(super) fn check_public_url(config: &Config) -> Check {
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

pub(super) fn check_tokens(config: &Config) -> Check {
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
