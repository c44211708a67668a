//! The system under test: `approvald serve` as a child process (so its CPU
//! time and memory are its own), against the in-process Pushary sandbox
//! and a counting effect target, on a fresh SQLite file or PostgreSQL
//! database.

use std::collections::HashMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::Router;
use axum::extract::State;
use axum::routing::post;
use tokio::net::TcpListener;

/// Where the bench keeps its data: a SQLite file or a PostgreSQL database.
#[derive(Debug, Clone)]
pub enum Engine {
    Sqlite,
    Postgres { admin_url: String },
}

impl Engine {
    pub fn name(&self) -> &'static str {
        match self {
            Engine::Sqlite => "SQLite",
            Engine::Postgres { .. } => "PostgreSQL",
        }
    }
}

/// A database for one run; a PostgreSQL one is dropped with it.
pub struct Database {
    pub url: String,
    admin: Option<(String, String)>,
}

impl Database {
    pub async fn create(engine: &Engine, dir: &Path, name: &str) -> anyhow::Result<Self> {
        match engine {
            Engine::Sqlite => Ok(Self {
                url: format!("sqlite://{}", dir.join(format!("{name}.db")).display()),
                admin: None,
            }),
            Engine::Postgres { admin_url } => {
                use sqlx::Connection;
                let db = format!("approvald_bench_{name}_{:08x}", rand::random::<u32>());
                let mut c =
                    sqlx::PgConnection::connect(admin_url).await.context("connecting to PostgreSQL")?;
                sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}"))).execute(&mut c).await?;
                let base = admin_url.rsplit_once('/').map_or(admin_url.as_str(), |(b, _)| b);
                Ok(Self { url: format!("{base}/{db}"), admin: Some((admin_url.clone(), db)) })
            }
        }
    }

    pub async fn drop_now(self) {
        if let Some((admin, db)) = &self.admin {
            use sqlx::Connection;
            if let Ok(mut c) = sqlx::PgConnection::connect(admin).await {
                let _ =
                    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)")))
                        .execute(&mut c)
                        .await;
            }
        }
    }
}

/// When each effect delivery arrived, by decision id.
#[derive(Clone, Default)]
pub struct EffectLog(Arc<Mutex<HashMap<String, Instant>>>);

impl EffectLog {
    pub fn arrived(&self, decision_id: &str) -> Option<Instant> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).get(decision_id).copied()
    }
}

/// A minimal effect target: records the arrival and answers 200 at once.
pub async fn start_effect_target(
    shutdown: tokio_util::sync::CancellationToken,
) -> anyhow::Result<(String, EffectLog)> {
    async fn deliver(State(log): State<EffectLog>, body: axum::body::Bytes) -> &'static str {
        let at = Instant::now();
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body)
            && let Some(id) = v.get("decisionId").and_then(|d| d.as_str())
        {
            log.0.lock().unwrap_or_else(|p| p.into_inner()).entry(id.to_string()).or_insert(at);
        }
        "{}"
    }
    let log = EffectLog::default();
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/effect", listener.local_addr()?);
    let app = Router::new().route("/effect", post(deliver)).with_state(log.clone());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).with_graceful_shutdown(shutdown.cancelled_owned()).await;
    });
    Ok((url, log))
}

/// The running daemon.
pub struct Daemon {
    child: Child,
    pub base: String,
}

impl Daemon {
    /// Writes the config and starts `approvald serve`; returns once /readyz answers.
    pub async fn start(dir: &Path, toml: &str, port: u16) -> anyhow::Result<Self> {
        let config = dir.join(format!("approvald-{port}.toml"));
        std::fs::write(&config, toml)?;
        let exe = std::env::current_exe().context("locating the approvald binary")?;
        let child = Command::new(exe)
            .arg("serve")
            .arg("--config")
            .arg(&config)
            .stdin(Stdio::null())
            // APPROVALD_BENCH_LOG=FILE keeps the daemon's log (its level
            // from APPROVALD_LOG__FILTER) for profiling a run; the log is
            // written to stderr.
            .stdout(Stdio::null())
            .stderr(match std::env::var_os("APPROVALD_BENCH_LOG") {
                Some(path) => Stdio::from(std::fs::OpenOptions::new().create(true).append(true).open(path)?),
                None => Stdio::inherit(),
            })
            .spawn()
            .context("starting approvald serve")?;
        let base = format!("http://127.0.0.1:{port}");
        let mut daemon = Self { child, base };
        let http = crate::http::client_builder().build()?;
        let start = Instant::now();
        loop {
            if let Some(status) = daemon.child.try_wait()? {
                anyhow::bail!("approvald serve exited at start: {status}");
            }
            if http.get(format!("{}/readyz", daemon.base)).send().await.is_ok_and(|r| r.status().is_success())
            {
                return Ok(daemon);
            }
            if start.elapsed() > Duration::from_secs(30) {
                anyhow::bail!("approvald serve did not become ready within 30 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn stats(&self) -> ProcStats {
        ProcStats::read(self.child.id())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// CPU time, memory and wake-ups of a process, from /proc.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcStats {
    pub cpu_secs: f64,
    pub rss_kib: u64,
    pub peak_rss_kib: u64,
    /// Context switches of all its threads: each is a wake-up or a preemption.
    pub switches: u64,
}

impl ProcStats {
    pub fn read(pid: u32) -> Self {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // Fields after the command name, which is in parentheses and may hold spaces.
        let fields: Vec<&str> =
            stat.rsplit_once(')').map(|(_, r)| r.split_whitespace().collect()).unwrap_or_default();
        let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
        // utime and stime are fields 14 and 15 (1-based), i.e. 11 and 12 after the name;
        // Linux reports them in USER_HZ, 100 per second.
        let cpu_secs = (ticks(11) + ticks(12)) as f64 / 100.0;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let kib = |key: &str| {
            status
                .lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        let mut switches = 0;
        if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
            for t in tasks.flatten() {
                let s = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
                for l in s.lines() {
                    if l.starts_with("voluntary_ctxt_switches") || l.starts_with("nonvoluntary_ctxt_switches")
                    {
                        switches +=
                            l.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
                    }
                }
            }
        }
        Self { cpu_secs, rss_kib: kib("VmRSS:"), peak_rss_kib: kib("VmHWM:"), switches }
    }
}

/// CPU seconds the whole machine has spent busy (every core, every
/// process, the kernel), from /proc/stat: what is not idle or waiting on I/O.
pub fn machine_busy_secs() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let ticks: Vec<u64> = stat
        .lines()
        .next()
        .map(|l| l.split_whitespace().skip(1).filter_map(|v| v.parse().ok()).collect())
        .unwrap_or_default();
    // user nice system idle iowait irq softirq steal …, in USER_HZ (100/s).
    let busy: u64 =
        ticks.iter().take(8).enumerate().filter(|(i, _)| *i != 3 && *i != 4).map(|(_, t)| t).sum();
    busy as f64 / 100.0
}

/// A free loopback port, for a child process to bind.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// PostgreSQL's own counters around a run: the WAL it wrote (and how many
/// of its records were full-page images, written on a page's first change
/// after a checkpoint) and the blocks it read from outside its shared
/// buffers. They say what a slower run spent its time on.
#[derive(Debug, Clone, Copy)]
pub struct PgCounters {
    wal_bytes: f64,
    wal_fpi: f64,
    blks_read: f64,
    /// Checkpoints begun, timed or requested; None where the server keeps
    /// them in neither view below.
    checkpoints: Option<f64>,
}

impl PgCounters {
    /// None on SQLite, or when the server will not say (an older server).
    pub async fn read(url: &str) -> Option<Self> {
        use sqlx::Connection;
        if !url.starts_with("postgres") {
            return None;
        }
        // A backend publishes its counters when it goes idle, at most once
        // a second, so a read just after a run missed up to its last second
        // (a run of a few hundred approvals read as no WAL at all); waiting
        // that second out puts each run's own work on its side of the read.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let mut conn = sqlx::PgConnection::connect(url).await.ok()?;
        let (wal_bytes, wal_fpi, blks_read): (f64, f64, f64) = sqlx::query_as(
            "SELECT w.wal_bytes::float8, w.wal_fpi::float8, d.blks_read::float8 \
             FROM pg_stat_wal w, pg_stat_database d WHERE d.datname = current_database()",
        )
        .fetch_one(&mut conn)
        .await
        .ok()?;
        // PostgreSQL 17 moved the counts from `pg_stat_bgwriter`.
        let mut checkpoints = None;
        for q in [
            "SELECT (num_timed + num_requested)::float8 FROM pg_stat_checkpointer",
            "SELECT (checkpoints_timed + checkpoints_req)::float8 FROM pg_stat_bgwriter",
        ] {
            if let Ok(n) = sqlx::query_scalar::<_, f64>(q).fetch_one(&mut conn).await {
                checkpoints = Some(n);
                break;
            }
        }
        let _ = conn.close().await;
        Some(Self { wal_bytes, wal_fpi, blks_read, checkpoints })
    }

    /// Checkpoints begun since `self`, as text ("?" when not known).
    pub fn checkpoints_since(self, end: Self) -> String {
        match (self.checkpoints, end.checkpoints) {
            (Some(a), Some(b)) => format!("{:.0}", b - a),
            _ => "?".into(),
        }
    }

    /// "WAL bytes / full-page images / blocks read", per unit of work since `self`.
    pub fn per(self, end: Self, units: f64) -> String {
        let u = units.max(1.0);
        format!(
            "{:.0} B / {:.2} / {:.2}",
            (end.wal_bytes - self.wal_bytes) / u,
            (end.wal_fpi - self.wal_fpi) / u,
            (end.blks_read - self.blks_read) / u
        )
    }
}
