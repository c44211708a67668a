//! Configuration: commented defaults embedded in the binary, then a TOML
//! file, then `APPROVALD_…` environment variables; validated once at start
//! with errors that name the key.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::Figment;
use figment::providers::{Env, Format, Toml};
use serde::Deserialize;

use crate::secret::Secret;

pub const DEFAULT_TOML: &str = include_str!("../config/default.toml");

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config: {0}")]
    Load(String),
    #[error("config: `{key}`: {problem}")]
    Invalid { key: String, problem: String },
}

/// A TOML syntax error quotes the offending line, which may hold a secret
/// (`api_key = "…`); keep where and what, drop the quoted source.
fn without_source_lines(message: &str) -> String {
    message
        .lines()
        .filter(|l| {
            let t = l.trim_start().trim_start_matches(|c: char| c.is_ascii_digit()).trim_start();
            !t.is_empty() && !t.starts_with('|')
        })
        .collect::<Vec<_>>()
        .join(": ")
}

fn invalid(key: impl Into<String>, problem: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { key: key.into(), problem: problem.into() }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub server: ServerConfig,
    pub store: StoreConfig,
    pub api: ApiConfig,
    pub pushary: PusharyConfig,
    pub operations: OperationsConfig,
    pub worker: WorkerConfig,
    pub reconciler: ReconcilerConfig,
    pub retention: RetentionConfig,
    pub operator: OperatorConfig,
    pub log: LogConfig,
    #[serde(default)]
    pub effects: BTreeMap<String, EffectConfig>,
    /// Named tenants, each with its own Pushary account, tokens and effect
    /// targets. The top-level `[api]`/`[pushary]`/`[effects]` settings form
    /// the tenant `default` when `pushary.api_key` is set.
    #[serde(default)]
    pub tenants: BTreeMap<String, TenantConfig>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    #[serde(default, deserialize_with = "one_or_many")]
    pub tokens: Vec<Secret>,
    pub tokens_file: Option<PathBuf>,
    pub pushary_api_key: Option<Secret>,
    pub pushary_api_key_file: Option<PathBuf>,
    #[serde(default, deserialize_with = "one_or_many")]
    pub webhook_secrets: Vec<Secret>,
    pub webhook_secrets_file: Option<PathBuf>,
    #[serde(default)]
    pub effects: BTreeMap<String, EffectConfig>,
}

/// One tenant, resolved from config: everything is its own.
#[derive(Debug, Clone)]
pub struct Tenant {
    pub name: String,
    pub tokens: Vec<Secret>,
    pub api_key: Secret,
    pub webhook_secrets: Vec<Secret>,
    pub effects: BTreeMap<String, EffectConfig>,
}

/// The tenant of the top-level settings.
pub const DEFAULT_TENANT: &str = "default";

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    pub listen: String,
    pub public_url: String,
    pub max_callback_bytes: usize,
    pub max_request_bytes: usize,
    pub max_header_bytes: usize,
    pub request_timeout_secs: u64,
    pub max_concurrent_callbacks: usize,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    pub url: String,
    pub sqlite_synchronous: String,
    pub max_connections: u32,
    pub busy_timeout_ms: u64,
    pub sqlite_cache_kib: u32,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiConfig {
    #[serde(default, deserialize_with = "one_or_many")]
    pub tokens: Vec<Secret>,
    pub tokens_file: Option<PathBuf>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PusharyConfig {
    pub base_url: String,
    pub api_key: Option<Secret>,
    pub api_key_file: Option<PathBuf>,
    #[serde(default, deserialize_with = "one_or_many")]
    pub webhook_secrets: Vec<Secret>,
    pub webhook_secrets_file: Option<PathBuf>,
    pub require_reachable: bool,
    pub timeout_secs: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OperationsConfig {
    pub default_expires_in_secs: u64,
    pub max_expires_in_secs: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    pub concurrency: usize,
    pub lease_secs: u64,
    pub idle_poll_secs: u64,
    pub retry_initial_ms: u64,
    pub retry_max_secs: u64,
    pub rejection_delivery_window_secs: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReconcilerConfig {
    pub interval_secs: u64,
    pub poll_after_secs: u64,
    pub orphan_after_secs: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetentionConfig {
    pub archive_after_secs: u64,
}

/// Who may use the operator page (`/operator`): one token, for people.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OperatorConfig {
    pub token: Option<Secret>,
    pub token_file: Option<PathBuf>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    pub format: String,
    pub filter: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EffectConfig {
    pub url: String,
    pub secret: Option<Secret>,
    pub secret_file: Option<PathBuf>,
    #[serde(default = "default_effect_timeout")]
    pub timeout_secs: u64,
    #[serde(default)]
    pub redeliver_safe: bool,
    /// During a rotation: the previous signing secret, also used until
    /// `previous_secret_until` (RFC 3339), so receivers can switch over.
    pub previous_secret: Option<Secret>,
    pub previous_secret_file: Option<PathBuf>,
    pub previous_secret_until: Option<String>,
}

fn default_effect_timeout() -> u64 {
    10
}

/// Environment variables hold one string; accept that as a one-element list.
fn one_or_many<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<Secret>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(Secret),
        Many(Vec<Secret>),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::One(s) if s.is_empty() => Vec::new(),
        OneOrMany::One(s) => vec![s],
        OneOrMany::Many(v) => v,
    })
}

impl StoreConfig {
    /// `url` with config/default.toml's `[store]` settings and a pool of
    /// `max_connections`: for the commands and benches that open a store
    /// without a config file, so they open it as the daemon would.
    pub fn with_defaults(url: String, max_connections: u32) -> Self {
        #[derive(Deserialize)]
        struct Defaults {
            store: StoreConfig,
        }
        let defaults: Defaults =
            Figment::from(Toml::string(DEFAULT_TOML)).extract().expect("config/default.toml is valid");
        Self { url, max_connections, ..defaults.store }
    }
}

impl Config {
    /// Loads defaults, then `file` (if any), then the environment.
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        let mut figment = Figment::from(Toml::string(DEFAULT_TOML));
        if let Some(path) = file {
            if !path.exists() {
                return Err(ConfigError::Load(format!("file {} does not exist", path.display())));
            }
            figment = figment.merge(Toml::file(path));
        }
        // Only APPROVALD_<SECTION>__<KEY>: other APPROVALD_* variables
        // (APPROVALD_CONFIG, test switches) are not configuration keys.
        figment =
            figment.merge(Env::prefixed("APPROVALD_").filter(|k| k.as_str().contains("__")).split("__"));
        Self::from_figment(figment)
    }

    /// Defaults plus a TOML string: what tests and `approvald dev` build on.
    pub fn from_toml(overrides: &str) -> Result<Self, ConfigError> {
        Self::from_figment(Figment::from(Toml::string(DEFAULT_TOML)).merge(Toml::string(overrides)))
    }

    fn from_figment(figment: Figment) -> Result<Self, ConfigError> {
        // figment's error names the key path but never the value, so no secret leaks.
        let mut config: Config = figment.extract().map_err(|e| {
            let key = e.path.join(".");
            let kind = without_source_lines(&e.kind.to_string());
            if key.is_empty() { ConfigError::Load(kind) } else { invalid(key, kind) }
        })?;
        config.resolve_secret_files()?;
        config.validate()?;
        Ok(config)
    }

    fn resolve_secret_files(&mut self) -> Result<(), ConfigError> {
        if let Some(path) = &self.api.tokens_file {
            self.api.tokens.extend(read_lines("api.tokens_file", path)?);
        }
        if let Some(path) = &self.operator.token_file {
            self.operator.token = read_lines("operator.token_file", path)?.into_iter().next();
        }
        if let Some(path) = &self.pushary.api_key_file {
            self.pushary.api_key = read_lines("pushary.api_key_file", path)?.into_iter().next();
        }
        if let Some(path) = &self.pushary.webhook_secrets_file {
            self.pushary.webhook_secrets.extend(read_lines("pushary.webhook_secrets_file", path)?);
        }
        for (name, effect) in &mut self.effects {
            if let Some(path) = &effect.secret_file {
                effect.secret = read_lines(&format!("effects.{name}.secret_file"), path)?.into_iter().next();
            }
            if let Some(path) = &effect.previous_secret_file {
                effect.previous_secret =
                    read_lines(&format!("effects.{name}.previous_secret_file"), path)?.into_iter().next();
            }
        }
        for (t, tenant) in &mut self.tenants {
            if let Some(path) = &tenant.tokens_file {
                tenant.tokens.extend(read_lines(&format!("tenants.{t}.tokens_file"), path)?);
            }
            if let Some(path) = &tenant.pushary_api_key_file {
                tenant.pushary_api_key =
                    read_lines(&format!("tenants.{t}.pushary_api_key_file"), path)?.into_iter().next();
            }
            if let Some(path) = &tenant.webhook_secrets_file {
                tenant
                    .webhook_secrets
                    .extend(read_lines(&format!("tenants.{t}.webhook_secrets_file"), path)?);
            }
            for (name, effect) in &mut tenant.effects {
                if let Some(path) = &effect.secret_file {
                    effect.secret = read_lines(&format!("tenants.{t}.effects.{name}.secret_file"), path)?
                        .into_iter()
                        .next();
                }
                if let Some(path) = &effect.previous_secret_file {
                    effect.previous_secret =
                        read_lines(&format!("tenants.{t}.effects.{name}.previous_secret_file"), path)?
                            .into_iter()
                            .next();
                }
            }
        }
        Ok(())
    }

    fn validate(&self) -> Result<(), ConfigError> {
        self.listen_addr()?;
        let public = url::Url::parse(&self.server.public_url)
            .map_err(|e| invalid("server.public_url", format!("not a URL: {e}")))?;
        if !matches!(public.scheme(), "http" | "https") {
            return Err(invalid("server.public_url", "must be an http or https URL"));
        }
        if self.operator.token.as_ref().is_some_and(|t| t.expose().len() < 16) {
            return Err(invalid(
                "operator.token",
                "must be at least 16 characters (or unset to turn the page off)",
            ));
        }
        if self.server.max_callback_bytes < 1024 {
            return Err(invalid("server.max_callback_bytes", "must be at least 1024"));
        }
        if self.server.max_header_bytes < 1024 {
            return Err(invalid("server.max_header_bytes", "must be at least 1024"));
        }
        if self.server.request_timeout_secs == 0 {
            return Err(invalid("server.request_timeout_secs", "must be at least 1"));
        }
        if self.server.max_concurrent_callbacks == 0 {
            return Err(invalid("server.max_concurrent_callbacks", "must be at least 1"));
        }
        if self.server.max_request_bytes < 1024 {
            return Err(invalid("server.max_request_bytes", "must be at least 1024"));
        }
        if !(self.store.url.starts_with("sqlite:") || self.store.url.starts_with("postgres")) {
            return Err(invalid("store.url", "must start with sqlite:// or postgres://"));
        }
        if !matches!(self.store.sqlite_synchronous.as_str(), "full" | "normal" | "extra") {
            return Err(invalid("store.sqlite_synchronous", "must be \"full\", \"extra\" or \"normal\""));
        }
        if self.store.max_connections == 0 {
            return Err(invalid("store.max_connections", "must be at least 1"));
        }
        if self.store.sqlite_cache_kib < 64 {
            return Err(invalid("store.sqlite_cache_kib", "must be at least 64"));
        }
        for (i, t) in self.api.tokens.iter().enumerate() {
            if t.expose().len() < 16 {
                return Err(invalid(format!("api.tokens[{i}]"), "must be at least 16 characters"));
            }
        }
        let base = url::Url::parse(&self.pushary.base_url)
            .map_err(|e| invalid("pushary.base_url", format!("not a URL: {e}")))?;
        if !matches!(base.scheme(), "http" | "https") {
            return Err(invalid("pushary.base_url", "must be an http or https URL"));
        }
        match &self.pushary.api_key {
            None if self.tenants.is_empty() => {
                return Err(invalid(
                    "pushary.api_key",
                    "is required (or pushary.api_key_file, or [tenants.*])",
                ));
            }
            None => {}
            Some(k) => validate_api_key(k.expose()).map_err(|p| invalid("pushary.api_key", p))?,
        }
        for (t, tenant) in &self.tenants {
            crate::domain::operation::validate_name(t)
                .map_err(|p| invalid(format!("tenants.{t}"), format!("bad tenant name: {p}")))?;
            if t == DEFAULT_TENANT {
                return Err(invalid(format!("tenants.{t}"), "`default` is the top-level settings' tenant"));
            }
            match &tenant.pushary_api_key {
                None => return Err(invalid(format!("tenants.{t}.pushary_api_key"), "is required")),
                Some(k) => validate_api_key(k.expose())
                    .map_err(|p| invalid(format!("tenants.{t}.pushary_api_key"), p))?,
            }
            for (i, tok) in tenant.tokens.iter().enumerate() {
                if tok.expose().len() < 16 {
                    return Err(invalid(
                        format!("tenants.{t}.tokens[{i}]"),
                        "must be at least 16 characters",
                    ));
                }
            }
            for (name, effect) in &tenant.effects {
                validate_effect(&format!("tenants.{t}.effects.{name}"), name, effect)?;
            }
        }
        let mut seen = std::collections::HashSet::new();
        for t in self.tenants() {
            for tok in &t.tokens {
                if !seen.insert(tok.expose().to_string()) {
                    return Err(invalid(
                        format!("tenants.{}.tokens", t.name),
                        "a token may belong to one tenant only",
                    ));
                }
            }
        }
        for (i, s) in self.pushary.webhook_secrets.iter().enumerate() {
            if s.is_empty() {
                return Err(invalid(format!("pushary.webhook_secrets[{i}]"), "must not be empty"));
            }
        }
        if self.pushary.timeout_secs == 0 {
            return Err(invalid("pushary.timeout_secs", "must be at least 1"));
        }
        let ops = &self.operations;
        if ops.max_expires_in_secs == 0 {
            return Err(invalid("operations.max_expires_in_secs", "must be at least 1"));
        }
        if ops.default_expires_in_secs == 0 || ops.default_expires_in_secs > ops.max_expires_in_secs {
            return Err(invalid(
                "operations.default_expires_in_secs",
                "must be between 1 and operations.max_expires_in_secs",
            ));
        }
        let w = &self.worker;
        if w.concurrency == 0 {
            return Err(invalid("worker.concurrency", "must be at least 1"));
        }
        if w.idle_poll_secs == 0 {
            return Err(invalid("worker.idle_poll_secs", "must be at least 1"));
        }
        if w.lease_secs < 2 {
            return Err(invalid("worker.lease_secs", "must be at least 2"));
        }
        if w.retry_initial_ms == 0 || w.retry_max_secs == 0 {
            return Err(invalid("worker.retry_initial_ms", "retry delays must be positive"));
        }
        // A lease must outlive the longest call made while holding it.
        let longest_call =
            self.effects.values().map(|e| e.timeout_secs).chain([self.pushary.timeout_secs]).max();
        if longest_call.is_some_and(|t| w.lease_secs <= t) {
            return Err(invalid(
                "worker.lease_secs",
                "must be longer than pushary.timeout_secs and every effects.*.timeout_secs",
            ));
        }
        if self.reconciler.interval_secs == 0 {
            return Err(invalid("reconciler.interval_secs", "must be at least 1"));
        }
        if !matches!(self.log.format.as_str(), "pretty" | "json") {
            return Err(invalid("log.format", "must be \"pretty\" or \"json\""));
        }
        for (name, effect) in &self.effects {
            validate_effect(&format!("effects.{name}"), name, effect)?;
        }
        Ok(())
    }

    /// Every tenant: `default` from the top-level settings (when it has an
    /// API key), then the named ones.
    pub fn tenants(&self) -> Vec<Tenant> {
        let mut out = Vec::new();
        if let Some(key) = &self.pushary.api_key {
            out.push(Tenant {
                name: DEFAULT_TENANT.into(),
                tokens: self.api.tokens.clone(),
                api_key: key.clone(),
                webhook_secrets: self.pushary.webhook_secrets.clone(),
                effects: self.effects.clone(),
            });
        }
        for (name, t) in &self.tenants {
            if let Some(key) = &t.pushary_api_key {
                out.push(Tenant {
                    name: name.clone(),
                    tokens: t.tokens.clone(),
                    api_key: key.clone(),
                    webhook_secrets: t.webhook_secrets.clone(),
                    effects: t.effects.clone(),
                });
            }
        }
        out
    }

    /// Where Pushary sends a tenant's callbacks.
    pub fn callback_url_for(&self, tenant: &str) -> String {
        if tenant == DEFAULT_TENANT {
            self.callback_url()
        } else {
            format!("{}/{tenant}", self.callback_url())
        }
    }

    pub fn listen_addr(&self) -> Result<SocketAddr, ConfigError> {
        self.server
            .listen
            .parse()
            .map_err(|_| invalid("server.listen", "must be an address like 127.0.0.1:8080"))
    }

    pub fn callback_url(&self) -> String {
        format!("{}/v1/callbacks/pushary", self.server.public_url.trim_end_matches('/'))
    }

    pub fn pushary_timeout(&self) -> Duration {
        Duration::from_secs(self.pushary.timeout_secs)
    }
}

fn validate_effect(key: &str, name: &str, effect: &EffectConfig) -> Result<(), ConfigError> {
    crate::domain::operation::validate_name(name)
        .map_err(|p| invalid(key, format!("bad target name: {p}")))?;
    let u =
        url::Url::parse(&effect.url).map_err(|e| invalid(format!("{key}.url"), format!("not a URL: {e}")))?;
    if !matches!(u.scheme(), "http" | "https") {
        return Err(invalid(format!("{key}.url"), "must be an http or https URL"));
    }
    match &effect.secret {
        None => return Err(invalid(format!("{key}.secret"), "is required")),
        Some(s) => {
            crate::webhooks::decode_secret(s.expose()).map_err(|p| invalid(format!("{key}.secret"), p))?
        }
    };
    if effect.timeout_secs == 0 {
        return Err(invalid(format!("{key}.timeout_secs"), "must be at least 1"));
    }
    if let Some(s) = &effect.previous_secret {
        crate::webhooks::decode_secret(s.expose())
            .map_err(|p| invalid(format!("{key}.previous_secret"), p))?;
        match &effect.previous_secret_until {
            None => {
                return Err(invalid(
                    format!("{key}.previous_secret_until"),
                    "is required with previous_secret",
                ));
            }
            Some(t) => {
                chrono::DateTime::parse_from_rfc3339(t).map_err(|_| {
                    invalid(format!("{key}.previous_secret_until"), "must be an RFC 3339 time")
                })?;
            }
        }
    }
    Ok(())
}

/// The SDK refuses a key without a `.` before any request; so do we.
pub fn validate_api_key(key: &str) -> Result<(), String> {
    if key.trim().is_empty() {
        return Err("must not be empty".into());
    }
    if !key.contains('.') {
        return Err("must have the form pk_<id>.<secret> (no `.` found)".into());
    }
    // Issued keys are printable ASCII; anything else would be sent as
    // different bytes by different HTTP stacks (the SDK uses Latin-1).
    if !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("must be printable ASCII without spaces".into());
    }
    Ok(())
}

fn read_lines(key: &str, path: &Path) -> Result<Vec<Secret>, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| invalid(key, format!("cannot read {}: {e}", path.display())))?;
    Ok(text.lines().map(str::trim).filter(|l| !l.is_empty()).map(Secret::new).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: &str = r#"
        [pushary]
        api_key = "pk_test.abc"
    "#;

    #[test]
    fn a_toml_syntax_error_says_where_without_quoting_the_line() {
        let err = Config::from_toml("[pushary]\napi_key = \"pk_x.topsecretvalue\n").expect_err("broken");
        let text = err.to_string();
        assert!(!text.contains("topsecretvalue"), "{text}");
        assert!(text.contains("line 2"), "{text}");
    }

    #[test]
    fn defaults_plus_a_key_are_valid() {
        let c = Config::from_toml(MIN).expect("valid");
        assert_eq!(c.server.max_callback_bytes, 65536);
        assert_eq!(c.callback_url(), "http://127.0.0.1:8080/v1/callbacks/pushary");
    }

    #[test]
    fn errors_name_the_key() {
        let e = Config::from_toml("[pushary]\napi_key = \"nodot\"").unwrap_err().to_string();
        assert!(e.contains("pushary.api_key"), "{e}");
        assert!(!e.contains("nodot"), "the secret must not be echoed: {e}");
        let e = Config::from_toml(&format!("{MIN}\n[worker]\nconcurrency = 0")).unwrap_err().to_string();
        assert!(e.contains("worker.concurrency"), "{e}");
        let e = Config::from_toml(&format!("{MIN}\n[store]\nsqlite_cache_kib = 10")).unwrap_err().to_string();
        assert!(e.contains("store.sqlite_cache_kib"), "{e}");
        let e = Config::from_toml(&format!("{MIN}\n[server]\nlisten = \"nope\"")).unwrap_err().to_string();
        assert!(e.contains("server.listen"), "{e}");
        let e = Config::from_toml(&format!("{MIN}\n[worker]\nconcurency = 3")).unwrap_err().to_string();
        assert!(e.contains("concurency"), "{e}");
        let e = Config::from_toml(&format!("{MIN}\n[effects.x]\nurl = \"http://a\"\nsecret = \"bad\""))
            .unwrap_err()
            .to_string();
        assert!(e.contains("effects.x.secret") && !e.contains("\"bad\""), "{e}");
        let e = Config::from_toml("").unwrap_err().to_string();
        assert!(e.contains("pushary.api_key"), "{e}");
    }

    #[test]
    fn a_store_opened_without_a_config_file_has_the_default_settings() {
        let store = StoreConfig::with_defaults("sqlite://x.db".into(), 1);
        let defaults = Config::from_toml(MIN).expect("valid").store;
        assert_eq!(store.url, "sqlite://x.db");
        assert_eq!(store.max_connections, 1);
        assert_eq!(store.sqlite_cache_kib, defaults.sqlite_cache_kib);
        assert_eq!(store.sqlite_synchronous, defaults.sqlite_synchronous);
        assert_eq!(store.busy_timeout_ms, defaults.busy_timeout_ms);
    }

    #[test]
    fn api_key_needs_a_dot() {
        assert!(validate_api_key("pk_abc.def").is_ok());
        assert!(validate_api_key("pk_abcdef").is_err());
        assert!(validate_api_key("").is_err());
    }
}
