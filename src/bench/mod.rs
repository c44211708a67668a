//! `approvald bench`: ingest, end to end, idle and growth, on SQLite and
//! PostgreSQL, each figure beside the database's own single-row commit
//! rate measured in the same run, interleaved with it. The disks here swing
//! many-fold between runs, so only the ratios compare across runs.

mod ceiling;
mod growth;
mod load;
mod raw_http;
mod report;
mod store_ceiling;
mod target;
mod writer;

use std::time::{Duration, Instant};

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use report::{Latencies, Row, print_table};
use target::{Daemon, Database, Engine, PgCounters, ProcStats, machine_busy_secs};

/// What to run, and how long.
#[derive(Debug, Clone, clap::Args)]
pub struct Options {
    /// Which stores to measure: sqlite, postgres or both.
    #[arg(long, default_value = "both")]
    pub store: String,
    /// A PostgreSQL server URL the bench may create databases on.
    #[arg(
        long,
        env = "APPROVALD_BENCH_PG_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    pub pg_url: String,
    /// Concurrent ingest clients (and baseline connections on PostgreSQL).
    #[arg(long, default_value_t = 64)]
    pub clients: usize,
    /// Seconds per ingest and baseline run.
    #[arg(long, default_value_t = 10.0)]
    pub secs: f64,
    /// Operations per end-to-end run.
    #[arg(long, default_value_t = 5000)]
    pub ops: usize,
    /// Seconds approvald is left idle.
    #[arg(long, default_value_t = 60.0)]
    pub idle_secs: f64,
    /// Finished operations (and inbox rows) put in the tables for the growth run; 0 skips it.
    #[arg(long, default_value_t = 1_000_000)]
    pub growth_rows: u64,
    /// Seconds of half-speed ingest watching memory; 0 skips it.
    #[arg(long, default_value_t = 0.0)]
    pub memory_secs: f64,
    /// Also the callback-to-delivery latency at these fractions of the
    /// end-to-end speed, as divisors (`--slower 4,16`: a quarter and a
    /// sixteenth), after the half-speed run: how the latency falls with
    /// the load, down to the single approval after idle.
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(3..=1000))]
    pub slower: Vec<u32>,
    /// A short run of everything (a smoke test, not a measurement).
    #[arg(long)]
    pub quick: bool,
}

const TOKEN: &str = "bench-token-0123456789";

pub async fn run(mut o: Options) -> anyhow::Result<()> {
    if o.quick {
        (o.secs, o.ops, o.idle_secs, o.growth_rows) = (2.0, 300, 3.0, o.growth_rows.min(20_000));
    }
    let mut engines = Vec::new();
    if matches!(o.store.as_str(), "sqlite" | "both") {
        engines.push(Engine::Sqlite);
    }
    if matches!(o.store.as_str(), "postgres" | "both") {
        use sqlx::Connection;
        match sqlx::PgConnection::connect(&o.pg_url).await {
            Ok(c) => {
                let _ = c.close().await;
                engines.push(Engine::Postgres { admin_url: o.pg_url.clone() });
            }
            Err(e) if o.store == "both" => {
                eprintln!("SKIPPED PostgreSQL: cannot connect to --pg-url ({e}); measuring SQLite only");
            }
            Err(e) => return Err(e).context("connecting to --pg-url"),
        }
    }
    anyhow::ensure!(!engines.is_empty(), "--store must be sqlite, postgres or both");
    let sync = std::env::var("APPROVALD_STORE__SQLITE_SYNCHRONOUS").unwrap_or_else(|_| "full".into());
    eprintln!(
        "approvald bench: {} clients, {} s per run, {} operations per end-to-end run; SQLite synchronous={sync}, \
         PostgreSQL as configured on the server (fsync and synchronous_commit are its own settings)",
        o.clients, o.secs, o.ops
    );
    let mut rows = Vec::new();
    for engine in engines {
        rows.extend(run_engine(&engine, &o).await.with_context(|| format!("bench on {}", engine.name()))?);
    }
    println!();
    print_table(&rows);
    Ok(())
}

fn fmt_rate(r: f64) -> String {
    format!("{r:.0}/s")
}

async fn run_engine(engine: &Engine, o: &Options) -> anyhow::Result<Vec<Row>> {
    let name = engine.name();
    let dir = tempfile::tempdir()?;
    let db = Database::create(engine, dir.path(), "run").await?;
    let shutdown = CancellationToken::new();
    let result = measure(engine, o, &db, dir.path(), &shutdown).await;
    shutdown.cancel();
    db.drop_now().await;
    eprintln!("{name}: done");
    result
}

async fn measure(
    engine: &Engine,
    o: &Options,
    db: &Database,
    dir: &std::path::Path,
    shutdown: &CancellationToken,
) -> anyhow::Result<Vec<Row>> {
    let name = engine.name();
    let pg = matches!(engine, Engine::Postgres { .. });
    let sandbox = crate::sandbox::start(
        tokio::net::TcpListener::bind("127.0.0.1:0").await?,
        crate::sandbox::SandboxConfig::default(),
        shutdown.clone(),
    )
    .await?;
    let (effect_url, effects) = target::start_effect_target(shutdown.clone()).await?;
    let port = target::free_port()?;
    let effect_secret = "whsec_YmVuY2gtZWZmZWN0LXNlY3JldC0wMTIzNDU2Nzg5";
    // A daemon's config: the growth run starts a second one on a store of
    // its own.
    let config = |port: u16, url: &str| {
        format!(
            r#"
        [server]
        listen = "127.0.0.1:{port}"
        public_url = "http://127.0.0.1:{port}"
        max_concurrent_callbacks = 4096
        [store]
        url = "{url}"
        max_connections = {conns}
        [api]
        tokens = ["{TOKEN}"]
        [pushary]
        base_url = "{base}"
        api_key = "{key}"
        webhook_secrets = ["{whsec}"]
        [worker]
        concurrency = 64
        [log]
        filter = "warn"
        [effects.bench]
        url = "{effect_url}"
        secret = "{effect_secret}"
        "#,
            conns = if pg { 32 } else { 8 },
            base = sandbox.base_url(),
            key = sandbox.api_key(),
            whsec = sandbox.webhook_secret(),
        )
    };
    let daemon = Daemon::start(dir, &config(port, &db.url), port).await?;
    let secret = sandbox.webhook_secret();
    let mut rows = Vec::new();
    let baseline = |label: &'static str| {
        let url = db.url.clone();
        let (clients, secs) = (o.clients, o.secs);
        async move {
            let busy = machine_busy_secs();
            let b = load::baseline(&url, clients, secs).await?;
            // The machine's CPU (the database, its client, the kernel) per
            // commit: what one durable write costs, the floor under the
            // end-to-end figure's CPU per approval.
            let cpu_ms = (machine_busy_secs() - busy) * 1000.0 / (b * secs).max(1.0);
            eprintln!(
                "{name}: baseline {label}: {b:.0} single-row commits/s, {cpu_ms:.3} ms of machine CPU each"
            );
            anyhow::Ok((b, cpu_ms))
        }
    };
    let row = |figure: &str,
               value: String,
               baseline: Option<f64>,
               ratio: Option<f64>,
               target: &str,
               met: Option<bool>| Row {
        engine: name,
        figure: figure.to_string(),
        value,
        baseline: baseline.map_or("-".into(), fmt_rate),
        ratio: ratio.map_or("-".into(), |r| format!("{r:.2}×")),
        target: target.to_string(),
        met,
    };

    // Ingest, between two baselines.
    let (b1, _) = baseline("1").await?;
    let ingest_counters = PgCounters::read(&db.url).await;
    let before = daemon.stats();
    let split = CpuSplit::start(&daemon);
    let writer_at = writer::WriterSample::read(&daemon.base).await;
    let full =
        load::ingest(&daemon.base, &secret, o.clients, o.secs, None, &format!("{name}: ingest")).await?;
    let ingest_split = split.finish(&daemon, full.latency.len() as f64 / 1000.0, o.secs);
    let thousands = full.latency.len() as f64 / 1000.0;
    let ingest_writer = writer_share(writer_at, &daemon.base, o.secs, thousands, "per 1000 callbacks").await;
    let after = daemon.stats();
    let ingest_pg = pg_ingest_counters(ingest_counters, &db.url, thousands).await;
    // The most any receiver could acknowledge here, between the same two
    // baselines: the ingest target is out of reach where this is below it.
    let roof = {
        let ceiling = ceiling::Ceiling::start()?;
        load::ingest(&ceiling.base, &secret, o.clients, o.secs, None, &format!("{name}: ingest ceiling"))
            .await?
    };
    // SQLite alone, storing callbacks as the inbox does, from the inbox as
    // the ingest run left it halfway: in batches of half the clients, the
    // most a writer that is never idle can gather (a client waits for its
    // acknowledgement, so those in the batch being committed cannot be in
    // the next: two batches in a row hold at most all the clients), and in
    // batches of all of them, which only a writer waiting for every client
    // gets.
    let store_roof = if pg {
        None
    } else {
        let fill = full.latency.len() as u64 / 2;
        let mut at = Vec::new();
        for batch in [(o.clients / 2).max(1), o.clients] {
            eprintln!("{name}: store ceiling, batches of {batch}");
            at.push((batch, store_ceiling::sqlite_inbox(dir, fill, batch, o.secs).await?));
        }
        Some(at)
    };
    let (b2, _) = baseline("2").await?;
    let b12 = (b1 + b2) / 2.0;
    let ratio = full.acked_per_sec / b12;
    let need = if pg { 1.5 } else { 5.0 };
    rows.push(row(
        &format!("ingest, {} clients (acked callbacks)", o.clients),
        fmt_rate(full.acked_per_sec),
        Some(b12),
        Some(ratio),
        &format!("≥ {need}× baseline"),
        Some(ratio >= need),
    ));
    rows.push(row(
        CEILING_ROW,
        format!(
            "{} (ingest is {:.0}% of it)",
            fmt_rate(roof.acked_per_sec),
            full.acked_per_sec / roof.acked_per_sec.max(1e-9) * 100.0
        ),
        Some(b12),
        Some(roof.acked_per_sec / b12),
        &format!("{need}× baseline within reach"),
        Some(roof.acked_per_sec / b12 >= need),
    ));
    if let Some(at) = store_roof {
        let value = at
            .iter()
            .map(|(batch, rate)| format!("{} in batches of {batch} ({:.2}×)", fmt_rate(*rate), rate / b12))
            .collect::<Vec<_>>()
            .join("; ");
        let best = at.first().map_or(0.0, |(_, rate)| rate / b12);
        rows.push(row(
            STORE_CEILING_ROW,
            format!(
                "{value}; ingest is {:.0}% of the first",
                full.acked_per_sec / (best * b12).max(1e-9) * 100.0
            ),
            Some(b12),
            Some(best),
            &format!("{need}× baseline within reach"),
            Some(best >= need),
        ));
    }
    rows.push(row(
        "ingest ack latency p50 / p99 / p99.9, full speed",
        format!(
            "{:.1} / {:.1} / {:.1} ms",
            full.latency.ms(0.5),
            full.latency.ms(0.99),
            full.latency.ms(0.999)
        ),
        None,
        None,
        "-",
        None,
    ));
    let cpu = after.cpu_secs - before.cpu_secs;
    rows.push(row(
        "ingest CPU seconds (approvald) / per 1000 callbacks",
        format!("{cpu:.1} s / {:.2} s", cpu / (full.latency.len().max(1) as f64 / 1000.0)),
        None,
        None,
        "-",
        None,
    ));
    rows.push(row(
        "ingest CPU ms per 1000 callbacks: approvald / load side / rest (database, kernel); machine busy",
        ingest_split,
        None,
        None,
        "-",
        None,
    ));
    if let Some(share) = ingest_writer {
        rows.push(row(WRITER_INGEST_ROW, share, None, None, "-", None));
    }
    rows.push(row(
        "peak RSS during ingest",
        format!("{:.1} MiB", after.peak_rss_kib as f64 / 1024.0),
        None,
        None,
        "≤ 64 MiB",
        Some(after.peak_rss_kib <= 64 * 1024),
    ));
    if full.errors > 0 {
        eprintln!("{name}: {} ingest requests failed (not acknowledged)", full.errors);
    }
    let half_rate = full.acked_per_sec / 2.0;
    let half_counters = PgCounters::read(&db.url).await;
    let half = load::ingest(
        &daemon.base,
        &secret,
        o.clients,
        o.secs,
        Some(half_rate),
        &format!("{name}: ingest at half speed"),
    )
    .await?;
    let p99 = half.latency.ms(0.99);
    rows.push(row(
        &format!("ingest ack latency p50 / p99 at half speed ({half_rate:.0}/s)"),
        format!("{:.1} / {p99:.1} ms", half.latency.ms(0.5)),
        None,
        None,
        "p99 ≤ 25 ms",
        Some(p99 <= 25.0),
    ));
    let half_pg = pg_ingest_counters(half_counters, &db.url, half.latency.len() as f64 / 1000.0).await;
    if let (Some(full_pg), Some(half_pg)) = (ingest_pg, half_pg) {
        rows.push(row(INGEST_WAL_ROW, format!("{full_pg} → {half_pg}"), None, None, "-", None));
    }

    // End to end at full speed, then at half of it.
    let e2e_tag = format!("e2e{:06x}", rand::random::<u32>() >> 8);
    eprintln!("{name}: opening {} operations", o.ops);
    let decisions = load::open_operations(&daemon.base, TOKEN, &sandbox, o.ops, &e2e_tag).await?;
    let counters = PgCounters::read(&db.url).await;
    let split = CpuSplit::start(&daemon);
    let writer_at = writer::WriterSample::read(&daemon.base).await;
    let e2e = load::answer_all(&sandbox, &effects, &decisions, None, &format!("{name}: end to end")).await?;
    let e2e_secs = e2e.count as f64 / e2e.approvals_per_sec;
    let e2e_split = split.finish(&daemon, e2e.count as f64, e2e_secs);
    let e2e_writer = writer_share(writer_at, &daemon.base, e2e_secs, e2e.count as f64, "per approval").await;
    let e2e_pg = pg_per(counters, &db.url, e2e.count as f64).await;
    let (b3, commit_cpu_ms) = baseline("3").await?;
    let b23 = (b2 + b3) / 2.0;
    let need = if pg { 2000.0 } else { 1000.0 };
    rows.push(row(
        &format!("end to end, {} approvals (callback → consume → delivery → receipt)", e2e.count),
        fmt_rate(e2e.approvals_per_sec),
        Some(b23),
        Some(e2e.approvals_per_sec / b23),
        &format!("≥ {need:.0}/s"),
        Some(e2e.approvals_per_sec >= need),
    ));
    rows.push(row(
        "end to end CPU ms per approval: approvald / load side / rest (database, kernel); machine busy",
        e2e_split,
        None,
        None,
        "-",
        None,
    ));
    if let Some(per) = e2e_pg {
        rows.push(row(WAL_ROW, per, None, None, "-", None));
    }
    if let Some(share) = e2e_writer {
        rows.push(row(WRITER_E2E_ROW, share, None, None, "-", None));
    }
    rows.push(row(
        "baseline: machine CPU ms per single-row commit (database, its client, kernel)",
        format!("{commit_cpu_ms:.3} ms"),
        None,
        None,
        "-",
        None,
    ));
    let half_rate = e2e.approvals_per_sec / 2.0;
    let n = (o.ops / 2).max(1);
    let decisions = load::open_operations(&daemon.base, TOKEN, &sandbox, n, &format!("{e2e_tag}h")).await?;
    let split = CpuSplit::start(&daemon);
    let slow = load::answer_all(
        &sandbox,
        &effects,
        &decisions,
        Some(half_rate),
        &format!("{name}: end to end at half speed"),
    )
    .await?;
    let (p50, p99) = (slow.latency.ms(0.5), slow.latency.ms(0.99));
    rows.push(row(
        &format!("callback-to-delivery p50 / p99 at half speed ({half_rate:.0}/s)"),
        format!("{p50:.1} / {p99:.1} ms"),
        None,
        None,
        if pg { "p50 ≤ 5, p99 ≤ 50 ms" } else { "-" },
        pg.then_some(p50 <= 5.0 && p99 <= 50.0),
    ));
    rows.push(row(
        "end to end CPU ms per approval at half speed (as above); machine busy",
        split.finish(&daemon, slow.count as f64, slow.count as f64 / slow.approvals_per_sec),
        None,
        None,
        "-",
        None,
    ));

    for &d in &o.slower {
        let rate = e2e.approvals_per_sec / f64::from(d);
        let decisions =
            load::open_operations(&daemon.base, TOKEN, &sandbox, n, &format!("{e2e_tag}s{d}")).await?;
        let split = CpuSplit::start(&daemon);
        let run = load::answer_all(
            &sandbox,
            &effects,
            &decisions,
            Some(rate),
            &format!("{name}: end to end at 1/{d} speed"),
        )
        .await?;
        rows.push(row(
            &format!(
                "callback-to-delivery p50 / p99 at 1/{d} speed ({rate:.0}/s); CPU ms per approval (as above), machine busy"
            ),
            format!(
                "{:.1} / {:.1} ms; {}",
                run.latency.ms(0.5),
                run.latency.ms(0.99),
                split.finish(&daemon, run.count as f64, run.count as f64 / run.approvals_per_sec)
            ),
            None,
            None,
            "-",
            None,
        ));
    }

    // Idle: nothing to do.
    wait_quiet(&sandbox).await;
    let before = daemon.stats();
    let t = Instant::now();
    eprintln!("{name}: idle for {} s", o.idle_secs);
    tokio::time::sleep(Duration::from_secs_f64(o.idle_secs)).await;
    let after = daemon.stats();
    let secs = t.elapsed().as_secs_f64();
    let share = (after.cpu_secs - before.cpu_secs) / secs;
    rows.push(row(
        &format!("idle {secs:.0} s: CPU share of one core / wake-ups per s"),
        format!("{:.2}% / {:.1}", share * 100.0, (after.switches - before.switches) as f64 / secs),
        None,
        None,
        "≤ 0.5%",
        Some(share <= 0.005),
    ));
    let (mut pickup, mut commits) = (Latencies::default(), Latencies::default());
    for i in 0..20 {
        let d = load::open_operations(&daemon.base, TOKEN, &sandbox, 1, &format!("{e2e_tag}p{i}")).await?;
        let r =
            load::answer_all(&sandbox, &effects, &d, None, &format!("{name}: single callback {i}")).await?;
        pickup.extend(vec![Duration::from_secs_f64(r.latency.ms(0.5) / 1000.0)]);
        // Interleaved, so they see the disk and the machine as it is.
        commits.extend(load::commit_latencies(&db.url, 3, Duration::from_millis(50)).await?);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    rows.push(row(
        "single new callback after idle: callback-to-delivery p50 / max (20)",
        format!("{:.1} / {:.1} ms", pickup.ms(0.5), pickup.ms(1.0)),
        None,
        None,
        "p50 ≤ 5 ms",
        Some(pickup.ms(0.5) <= 5.0),
    ));
    // The approval waits for two durable commits in turn (the callback
    // with the answer and the consume in flight, decisions §36 and §38;
    // the permit with the delivery in flight), each a guarantee's, besides
    // its two HTTP calls: two lone commits are its floor on this machine
    // as it is.
    let commit = commits.ms(0.5);
    rows.push(row(
        "beside it: a lone durable single-row commit (one client, 50 ms apart) p50 / p99 (60); two of them",
        format!("{commit:.2} / {:.2} ms; {:.1} ms", commits.ms(0.99), 2.0 * commit),
        None,
        None,
        "-",
        None,
    ));

    // Growth: the same end-to-end run with a full store, a second store
    // with a daemon of its own, the runs alternating (growth.rs).
    if o.growth_rows > 0 {
        let full_db = Database::create(engine, dir, "full").await?;
        let full_port = target::free_port()?;
        let measured = async {
            let full = Daemon::start(dir, &config(full_port, &full_db.url), full_port).await?;
            let runs = growth::Runs { sandbox: &sandbox, effects: &effects, ops: o.ops, tag: &e2e_tag, name };
            let empty = growth::Side { daemon: &daemon, url: &db.url };
            runs.measure(empty, growth::Side { daemon: &full, url: &full_db.url }, o.growth_rows).await
        }
        .await;
        full_db.drop_now().await;
        let m = measured?;
        let (b4, _) = baseline("4").await?;
        let list = |runs: &[growth::Run]| {
            runs.iter().map(|r| fmt_rate(r.result.approvals_per_sec)).collect::<Vec<_>>().join(", ")
        };
        let (before, after) = (combined_rate(&m.empty), combined_rate(&m.full));
        let rel = after / before;
        rows.push(row(
            &format!(
                "end to end with {} finished rows (vs a store without them, alternating; {} runs each, combined)",
                o.growth_rows,
                m.full.len()
            ),
            format!(
                "{} ({:.0}% of {}; runs {} against {})",
                fmt_rate(after),
                rel * 100.0,
                fmt_rate(before),
                list(&m.full),
                list(&m.empty),
            ),
            Some((b3 + b4) / 2.0),
            Some(after / ((b3 + b4) / 2.0)),
            "≥ 90% of empty",
            Some(rel >= 0.9),
        ));
        rows.push(row(
            "end to end CPU ms per approval (as above): empty → full store (the first run of each)",
            format!("{} → {}", m.empty[0].cpu, m.full[0].cpu),
            None,
            None,
            "-",
            None,
        ));
        if let (Some(e), Some(g)) = (&m.empty[0].pg, &m.full[0].pg) {
            rows.push(row(
                &format!("{WAL_ROW}: empty → full store (the first run of each)"),
                format!("{e} → {g}"),
                None,
                None,
                "-",
                None,
            ));
        }
    }

    // Memory over a long half-speed ingest.
    if o.memory_secs > 0.0 {
        let start = daemon.stats();
        let rate = full.acked_per_sec / 2.0;
        let step = 30.0f64.min(o.memory_secs);
        let mut samples = vec![start.rss_kib];
        let t = Instant::now();
        while t.elapsed().as_secs_f64() < o.memory_secs {
            load::ingest(&daemon.base, &secret, o.clients, step, Some(rate), &format!("{name}: memory run"))
                .await?;
            samples.push(daemon.stats().rss_kib);
        }
        let mib = |k: u64| k as f64 / 1024.0;
        let (first, last) = (samples[1.min(samples.len() - 1)], *samples.last().unwrap_or(&0));
        let peak = daemon.stats().peak_rss_kib;
        rows.push(row(
            &format!("RSS over {:.0} s of half-speed ingest: after first step → end (peak)", o.memory_secs),
            format!("{:.1} → {:.1} MiB ({:.1})", mib(first), mib(last), mib(peak)),
            None,
            None,
            "no growth",
            Some(last <= first + first / 10),
        ));
    }
    drop(daemon);
    Ok(rows)
}

/// The ingest ceiling's row label; its "met" says whether the ingest target
/// was within the machine's reach in this run at all.
const CEILING_ROW: &str =
    "ingest ceiling: a no-op HTTP receiver (axum, own runtime; reads the body, answers 200), same clients";

/// The store ceiling's row label (SQLite): its ratio and "met" are those of
/// the batches a busy writer gets (half the clients): whether SQLite itself
/// could store callbacks at the ingest target's rate in this run.
const STORE_CEILING_ROW: &str = "ingest store ceiling: SQLite alone storing the inbox's rows (approvald's schema, \
     random decision ids; one writer, no HTTP), a commit per batch of half the clients, then of all";

/// PostgreSQL's counters per approval, the figure's row label.
const INGEST_WAL_ROW: &str = "ingest per 1000 callbacks: WAL bytes / full-page images / blocks read; checkpoints begun during it (PostgreSQL): full → half speed";
const WAL_ROW: &str = "end to end per approval: WAL bytes / full-page images / blocks read (PostgreSQL)";

/// SQLite's one writer, the figures' row labels: what bounds SQLite's
/// rates when its share of the run is near all of it.
const WRITER_INGEST_ROW: &str = "ingest: SQLite's one writer taken (writers running / commits flushing)";
const WRITER_E2E_ROW: &str = "end to end: SQLite's one writer taken (writers running / commits flushing)";

/// SQLite's writer over a run that began at `start` (per callback or per
/// approval); None on PostgreSQL.
async fn writer_share(
    start: Option<writer::WriterSample>,
    base: &str,
    elapsed_secs: f64,
    units: f64,
    per: &str,
) -> Option<String> {
    Some(start?.share(&writer::WriterSample::read(base).await?, elapsed_secs, units, per))
}

/// `pg_per` for an ingest run, with the checkpoints begun during it: a
/// checkpoint makes every page's first change after it a full-page image
/// in the WAL, and with random decision ids that is most of the inbox
/// index's pages.
async fn pg_ingest_counters(start: Option<PgCounters>, url: &str, thousands: f64) -> Option<String> {
    let start = start?;
    let end = PgCounters::read(url).await?;
    Some(format!("{}; {}", start.per(end, thousands), start.checkpoints_since(end)))
}

/// PostgreSQL's counters per unit of work since `start`; None on SQLite.
async fn pg_per(start: Option<PgCounters>, url: &str, units: f64) -> Option<String> {
    Some(start?.per(PgCounters::read(url).await?, units))
}

/// Waits until every callback the sandbox sent has been acknowledged, so
/// the idle measurement starts with nothing in flight.
async fn wait_quiet(sandbox: &crate::sandbox::SandboxHandle) {
    let mut last = sandbox.counts();
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = sandbox.counts();
        if now == last {
            return;
        }
        last = now;
    }
}

/// Where the machine's time went during a run, per item: what bounds the
/// rate when the two cores are busy (docs/performance.md). The load side is
/// this process (the load generator, the sandbox, the effect target); the
/// rest is the database's processes and the kernel (on SQLite the database
/// runs inside approvald, so the rest is near zero).
struct CpuSplit {
    ours: f64,
    load_side: f64,
    machine: f64,
}

impl CpuSplit {
    fn start(daemon: &Daemon) -> Self {
        Self {
            ours: daemon.stats().cpu_secs,
            load_side: ProcStats::read(std::process::id()).cpu_secs,
            machine: machine_busy_secs(),
        }
    }

    /// "approvald / load side / rest; machine busy", in CPU ms per unit of
    /// work (`units` of them were done: approvals, or thousands of callbacks).
    fn finish(self, daemon: &Daemon, units: f64, elapsed_secs: f64) -> String {
        let end = Self::start(daemon);
        let scale = |a: f64, b: f64| (b - a) * 1000.0 / units.max(1e-9);
        let (ours, load_side, machine) = (
            scale(self.ours, end.ours),
            scale(self.load_side, end.load_side),
            scale(self.machine, end.machine),
        );
        let busy = (end.machine - self.machine) / elapsed_secs.max(1e-9) / cores() * 100.0;
        format!("{ours:.2} / {load_side:.2} / {:.2}; {busy:.0}%", (machine - ours - load_side).max(0.0))
    }
}

/// The rate of `runs` taken together: all their approvals over all their time.
fn combined_rate(runs: &[growth::Run]) -> f64 {
    let count: f64 = runs.iter().map(|r| r.result.count as f64).sum();
    let secs: f64 = runs.iter().map(|r| r.result.count as f64 / r.result.approvals_per_sec).sum();
    count / secs
}

/// The machine's cores, for its busy share.
fn cores() -> f64 {
    std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64)
}
