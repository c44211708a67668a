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

mod local;
mod pushary;
mod redact;

pub use local::env_var;
use local::*;
pub use pushary::fingerprint;
use pushary::*;
pub use redact::redact_url;
use redact::*;

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
