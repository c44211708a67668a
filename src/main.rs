//! The `approvald` command line. Everything it runs lives in the library.

#![forbid(unsafe_code)]

use std::io::{IsTerminal as _, Write as _};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use approvald::app::{Application, init_logging, shutdown_on_signal};
use approvald::config::{Config, StoreConfig};
use approvald::doctor::redact_url;
use approvald::domain::state::State;
use approvald::store::{OperationFilter, Store};
use clap::{Args, Parser, Subcommand};

/// glibc's allocator was a sixth of approvald's CPU under load (`perf`:
/// `malloc`, `free` and their consolidation, for the many small buffers of
/// each request and row); mimalloc cut approvald's CPU per callback and
/// per approval by a sixth to a fifth (docs/decisions.md §26).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Durable human approvals for AI agents: opens Pushary decisions, receives
/// their signed callbacks into a durable inbox, and resumes each operation
/// exactly once (permit consumed before the effect, outcome delivered to
/// the application's effect target).
#[derive(Parser)]
#[command(name = "approvald", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the API, the callback receiver, the resume workers and the reconciler
    /// (or one of them, with --role, to scale them apart).
    Serve {
        #[command(flatten)]
        config: ConfigArg,
        /// What this process does: all, api, receiver or worker.
        #[arg(long, value_enum, default_value = "all", env = "APPROVALD_ROLE")]
        role: approvald::app::Role,
    },
    /// Run approvald on a local SQLite file with the built-in Pushary sandbox
    /// and an example effect target: the whole loop on one machine.
    Dev {
        /// Port for approvald's API and receiver.
        #[arg(long, default_value_t = 8080)]
        port: u16,
        /// Port for the Pushary sandbox and its page.
        #[arg(long, default_value_t = 8090)]
        sandbox_port: u16,
        /// SQLite file for the dev store.
        #[arg(long, default_value = "approvald-dev.db")]
        db: PathBuf,
    },
    /// Run only the Pushary sandbox (a local Pushary with its page and an
    /// example effect target), e.g. beside approvald replicas. Credentials
    /// come from APPROVALD_SANDBOX_API_KEY, APPROVALD_SANDBOX_WEBHOOK_SECRET and
    /// APPROVALD_SANDBOX_EFFECT_SECRET, or are generated and printed.
    Sandbox {
        /// Address to serve on.
        #[arg(long, default_value = "127.0.0.1:8090")]
        listen: std::net::SocketAddr,
        /// The URL browsers and clients use to reach it (links on the page).
        #[arg(long)]
        public_url: Option<String>,
    },
    /// Create or upgrade the store's schema (safe to run again).
    Migrate(ConfigArg),
    /// Check the configuration, the store and its migrations, Pushary (reachable,
    /// API key accepted), the webhook secrets and the public URL, and say
    /// exactly what to fix. Exits non-zero if any check fails.
    Doctor(ConfigArg),
    /// Inspect operations, and resolve the uncertain ones.
    #[command(subcommand)]
    Ops(OpsCommand),
    /// Inspect the callback inbox, including orphans.
    #[command(subcommand)]
    Inbox(InboxCommand),
    /// Manage secrets.
    #[command(subcommand)]
    Secret(SecretCommand),
    /// Measure ingest, end to end, idle and growth against the database's
    /// own commit rate, on SQLite and PostgreSQL (docs/performance.md).
    Bench(approvald::bench::Options),
}

#[derive(Subcommand)]
enum SecretCommand {
    /// Ask Pushary for a new webhook secret and store it; the previous ones
    /// keep verifying callbacks for --overlap-secs, on every replica.
    Rotate {
        #[command(flatten)]
        config: ConfigArg,
        /// The tenant whose secret to rotate.
        #[arg(long, default_value = "default")]
        tenant: String,
        /// How long the previous secrets are still accepted.
        #[arg(long, default_value_t = 3600)]
        overlap_secs: u64,
    },
}

#[derive(Args)]
struct ConfigArg {
    /// TOML config file; defaults and APPROVALD_* environment variables apply too.
    #[arg(long, short = 'c', env = "APPROVALD_CONFIG")]
    config: Option<PathBuf>,
}

#[derive(Args)]
struct StoreArg {
    #[command(flatten)]
    config: ConfigArg,
    /// Read this SQLite file directly instead of the configured store.
    #[arg(long)]
    db: Option<PathBuf>,
}

#[derive(Subcommand)]
enum OpsCommand {
    /// List operations, newest first.
    List {
        #[command(flatten)]
        store: StoreArg,
        /// Only operations in this state (e.g. pending, uncertain).
        #[arg(long)]
        state: Option<String>,
        /// Only operations of this thread.
        #[arg(long)]
        thread: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: i64,
    },
    /// Show one operation: state, outcome and its transition history.
    Show {
        #[command(flatten)]
        store: StoreArg,
        id: String,
    },
    /// Record how an `uncertain` operation really ended (after checking the
    /// effect by hand). The transition records who and why.
    Resolve {
        #[command(flatten)]
        store: StoreArg,
        id: String,
        /// `succeeded` or `failed`.
        #[arg(long)]
        outcome: String,
        /// Why: what you checked.
        #[arg(long)]
        note: String,
        /// Who is resolving (default: $USER).
        #[arg(long, env = "USER", default_value = "operator")]
        by: String,
    },
}

#[derive(Subcommand)]
enum InboxCommand {
    /// List inbox entries, newest first.
    List {
        #[command(flatten)]
        store: StoreArg,
        /// new, processed, ignored or orphaned.
        #[arg(long)]
        state: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: i64,
    },
    /// Show one entry, with the exact body that was received.
    Show {
        #[command(flatten)]
        store: StoreArg,
        id: i64,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("approvald: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Serve { config: c, role } => {
            let config = Config::load(c.config.as_deref())?;
            init_logging(&config.log.format, &config.log.filter);
            let listener = tokio::net::TcpListener::bind(config.listen_addr()?).await?;
            Application::build(config, listener).await?.with_role(role).run_until(shutdown_on_signal()).await
        }
        Command::Dev { port, sandbox_port, db } => {
            init_logging("pretty", "info");
            approvald::dev::run(approvald::dev::DevOptions { port, sandbox_port, db }).await
        }
        Command::Sandbox { listen, public_url } => {
            init_logging("pretty", "info");
            approvald::dev::run_sandbox(listen, public_url).await
        }
        Command::Migrate(c) => {
            let config = Config::load(c.config.as_deref())?;
            migrate(&config).await
        }
        Command::Doctor(c) => {
            let mut progress = Progress::new();
            let report = approvald::doctor::run(c.config.as_deref(), |step| {
                progress.status(&format!("doctor: {step}"))
            })
            .await;
            progress.clear();
            print!("{report}");
            if report.failed() {
                anyhow::bail!("doctor: {} check(s) failed", report.count(approvald::doctor::Status::Fail));
            }
            Ok(())
        }
        Command::Bench(options) => {
            // The growth fill's statements take seconds by design: sqlx's
            // slow-statement warnings would only break the progress line.
            init_logging("pretty", "warn,sqlx::query=error");
            approvald::bench::run(options).await
        }
        Command::Ops(cmd) => ops(cmd).await,
        Command::Inbox(cmd) => inbox(cmd).await,
        Command::Secret(SecretCommand::Rotate { config, tenant, overlap_secs }) => {
            let config = Config::load(config.config.as_deref())?;
            let mut progress = Progress::new();
            progress.line(&format!(
                "approvald: rotating the webhook secret of tenant `{tenant}`: store {}, then Pushary at {} \
                 (timeout {} s)",
                redact_url(&config.store.url),
                redact_url(&config.pushary.base_url),
                config.pushary.timeout_secs
            ));
            progress
                .status("rotating: opening and migrating the store, asking Pushary, storing the new secret");
            let started = Instant::now();
            let until = approvald::rotation::rotate_webhook_secret(
                &config,
                &tenant,
                std::time::Duration::from_secs(overlap_secs),
            )
            .await?;
            progress.line(&format!("approvald: rotated in {} ms", started.elapsed().as_millis()));
            println!(
                "rotated the webhook secret of tenant `{tenant}`; the new one is in approvald's store (not printed); \
                 previous secrets are accepted until {}",
                approvald::clock::rfc3339(until)
            );
            Ok(())
        }
    }
}

/// Status on stderr for CLI steps that can take a while; stdout carries
/// only the command's output. On a terminal, `status` rewrites one line in
/// place and it is erased when the step ends (or the command does); when
/// stderr is not a terminal, `status` prints nothing, so scripts and logs
/// see only the `line`s, which are always printed.
struct Progress {
    tty: bool,
    shown: bool,
}

impl Progress {
    fn new() -> Self {
        Self { tty: std::io::stderr().is_terminal(), shown: false }
    }

    /// A transient status line: "what is happening now".
    fn status(&mut self, msg: &str) {
        if self.tty {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[2K{}…", clip(msg, 100));
            let _ = err.flush();
            self.shown = true;
        }
    }

    /// A line kept in the output, terminal or not.
    fn line(&mut self, msg: &str) {
        self.clear();
        eprintln!("{msg}");
    }

    fn clear(&mut self) {
        if self.shown {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[2K");
            let _ = err.flush();
            self.shown = false;
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.clear();
    }
}

/// `approvald migrate`: applies each pending migration in turn and reports
/// it with its time on stderr; stdout gets the final version only.
async fn migrate(config: &Config) -> anyhow::Result<()> {
    let mut progress = Progress::new();
    progress.status(&format!("opening the store {}", redact_url(&config.store.url)));
    let store = Store::connect(&config.store).await?;
    let (applied, latest) = store.migration_status().await?;
    let pending: Vec<(i64, &str)> =
        store.known_migrations().into_iter().filter(|(v, _)| applied.is_none_or(|a| *v > a)).collect();
    if pending.is_empty() {
        progress.line(&format!(
            "approvald: {} is at version {}; nothing to apply",
            redact_url(&config.store.url),
            applied.unwrap_or(0)
        ));
    } else {
        progress.line(&format!(
            "approvald: {} is at version {}; applying {} migration(s) up to {latest}",
            redact_url(&config.store.url),
            applied.unwrap_or(0),
            pending.len()
        ));
    }
    let total = Instant::now();
    for (version, description) in &pending {
        progress.status(&format!("applying migration {version} ({description})"));
        let started = Instant::now();
        store.migrate_to(*version).await?;
        progress.line(&format!(
            "approvald: migration {version} ({description}) done in {} ms",
            started.elapsed().as_millis()
        ));
    }
    // Anything a concurrent `migrate` left, and the checks sqlx makes on
    // the applied ones (a no-op when all is done).
    store.migrate().await?;
    let (applied, _) = store.migration_status().await?;
    if !pending.is_empty() {
        progress.line(&format!("approvald: migrated in {} ms", total.elapsed().as_millis()));
    }
    store.close().await;
    println!("schema is at version {}", applied.unwrap_or(0));
    Ok(())
}

async fn open_store(arg: &StoreArg, progress: &mut Progress) -> anyhow::Result<Store> {
    let store_config = match &arg.db {
        Some(path) => {
            if !path.exists() {
                anyhow::bail!("--db: {} does not exist", path.display());
            }
            StoreConfig::with_defaults(format!("sqlite://{}", path.display()), 1)
        }
        None => Config::load(arg.config.config.as_deref())?.store,
    };
    progress.status(&format!("opening the store {}", redact_url(&store_config.url)));
    Ok(Store::connect(&store_config).await?)
}

async fn ops(cmd: OpsCommand) -> anyhow::Result<()> {
    let mut progress = Progress::new();
    match cmd {
        OpsCommand::List { store, state, thread, limit } => {
            let state =
                state.map(|s| s.parse::<State>()).transpose().map_err(|e| anyhow::anyhow!("--state: {e}"))?;
            if !(1..=10_000).contains(&limit) {
                anyhow::bail!("--limit: must be between 1 and 10000");
            }
            let store = open_store(&store, &mut progress).await?;
            progress.status("reading operations");
            let ops = store
                .list_operations(&OperationFilter { tenant: None, state, thread_id: thread, limit })
                .await?;
            progress.clear();
            println!("{:<30} {:<12} {:<20} {:<20} {:<24}", "ID", "STATE", "THREAD", "KEY", "UPDATED");
            for op in &ops {
                println!(
                    "{:<30} {:<12} {:<20} {:<20} {:<24}",
                    op.id,
                    op.state.as_str(),
                    clip(&op.thread_id, 20),
                    clip(&op.operation_key, 20),
                    approvald::clock::rfc3339(op.updated_at)
                );
            }
            println!("{} operation(s)", ops.len());
            if ops.len() as i64 == limit {
                eprintln!("approvald: showing the newest {limit}; there may be more (--limit)");
            }
            Ok(())
        }
        OpsCommand::Show { store, id } => {
            let store = open_store(&store, &mut progress).await?;
            progress.status(&format!("reading operation {id}"));
            let found = store.get_operation(None, &id).await?;
            progress.clear();
            let Some(op) = found else {
                let (_, document) = store
                    .archived_operation(None, &id)
                    .await?
                    .ok_or_else(|| anyhow::anyhow!("no operation `{id}`"))?;
                let document: serde_json::Value = serde_json::from_str(&document)?;
                println!("archived operation (retention.archive_after_secs):");
                println!("{}", serde_json::to_string_pretty(&document)?);
                return Ok(());
            };
            let ts = approvald::clock::rfc3339;
            println!("operation   {}", op.id);
            println!("state       {}", op.state);
            println!("key         {}", op.operation_key);
            println!("thread      {}  interrupt {}", op.thread_id, op.interrupt_id);
            println!("question    {} ({})", op.spec.question, op.decision_type);
            println!("recipient   {}", op.spec.external_id);
            println!("effect      {}", op.effect);
            println!("decision    {}", op.decision_id.as_deref().unwrap_or("-"));
            println!("answer      {}", op.answer.as_deref().unwrap_or("-"));
            println!("permit      {}", op.permit_id.as_deref().unwrap_or("-"));
            println!(
                "outcome     {}  delivery {}  receipt {}",
                op.outcome_status.as_deref().unwrap_or("-"),
                op.delivery.as_deref().unwrap_or("-"),
                op.receipt.as_deref().unwrap_or("-")
            );
            println!("deadline    {}", ts(op.deadline));
            if let Some(e) = &op.last_error {
                println!("last error  {e}");
            }
            println!("\nhistory");
            for t in store.transitions(&op.id).await? {
                println!(
                    "  {}  {:>11} → {:<11} {}  ({})",
                    ts(t.at),
                    t.from.as_deref().unwrap_or("-"),
                    t.to,
                    t.cause,
                    t.actor
                );
            }
            let deliveries = store.deliveries(&op.id).await?;
            if !deliveries.is_empty() {
                println!("\ndeliveries");
                for d in deliveries {
                    println!(
                        "  #{} {}  {}  {}",
                        d.attempt,
                        ts(d.started_at),
                        d.status_code.map_or_else(|| "-".to_string(), |c| c.to_string()),
                        d.error.unwrap_or_default()
                    );
                }
            }
            Ok(())
        }
        OpsCommand::Resolve { store, id, outcome, note, by } => {
            let store = open_store(&store, &mut progress).await?;
            progress.status(&format!("resolving {id}"));
            let op =
                approvald::worker::resolve(&store, None, &id, &outcome, &note, &by).await.map_err(|e| {
                    use approvald::worker::ResolveError as R;
                    match e {
                        R::BadOutcome => anyhow::anyhow!("--outcome: {e}"),
                        R::NoNote => anyhow::anyhow!("--note: {e}"),
                        other => anyhow::anyhow!("{other}"),
                    }
                })?;
            progress.clear();
            println!("{} is now {} (resolved by {by})", op.id, op.state);
            Ok(())
        }
    }
}

async fn inbox(cmd: InboxCommand) -> anyhow::Result<()> {
    let ts = approvald::clock::rfc3339;
    let mut progress = Progress::new();
    match cmd {
        InboxCommand::List { store, state, limit } => {
            if state.as_deref().is_some_and(|s| !matches!(s, "new" | "processed" | "ignored" | "orphaned")) {
                anyhow::bail!("--state: must be new, processed, ignored or orphaned");
            }
            if !(1..=10_000).contains(&limit) {
                anyhow::bail!("--limit: must be between 1 and 10000");
            }
            let store = open_store(&store, &mut progress).await?;
            progress.status("reading the inbox");
            let entries = store.list_inbox(state.as_deref(), limit).await?;
            progress.clear();
            println!(
                "{:>6} {:<10} {:<30} {:<9} {:>4} {:<24} {:<30}",
                "ID", "STATE", "CORRELATION", "SOURCE", "DUPS", "RECEIVED", "OPERATION"
            );
            for e in &entries {
                println!(
                    "{:>6} {:<10} {:<30} {:<9} {:>4} {:<24} {:<30}",
                    e.id,
                    e.state,
                    clip(&e.correlation_id, 30),
                    e.source,
                    e.duplicates,
                    ts(e.received_at),
                    e.operation_id.as_deref().unwrap_or("-")
                );
            }
            println!("{} entr{}", entries.len(), if entries.len() == 1 { "y" } else { "ies" });
            if entries.len() as i64 == limit {
                eprintln!("approvald: showing the newest {limit}; there may be more (--limit)");
            }
            Ok(())
        }
        InboxCommand::Show { store, id } => {
            let store = open_store(&store, &mut progress).await?;
            progress.status(&format!("reading inbox entry {id}"));
            let (e, body) =
                store.inbox_entry(id).await?.ok_or_else(|| anyhow::anyhow!("no inbox entry {id}"))?;
            progress.clear();
            println!("entry       {}", e.id);
            println!("state       {}", e.state);
            println!("correlation {}", e.correlation_id);
            println!("answer      {}", e.answer);
            println!("source      {}  duplicates {}", e.source, e.duplicates);
            println!("received    {}", ts(e.received_at));
            println!("operation   {}", e.operation_id.as_deref().unwrap_or("-"));
            println!("note        {}", e.note.as_deref().unwrap_or("-"));
            println!("body        {}", String::from_utf8_lossy(&body));
            Ok(())
        }
    }
}

fn clip(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        format!("{}…", s.chars().take(n - 1).collect::<String>())
    }
}
