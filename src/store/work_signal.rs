//! Telling other replicas that work was committed: PostgreSQL
//! `LISTEN`/`NOTIFY` on `WORK_CHANNEL`.
//!
//! Sent after the commit, from a statement of its own: a `NOTIFY` inside
//! a transaction takes a database-wide lock held through its commit,
//! which would serialize every committing writer behind one flush at a
//! time. Signals arriving while one is pending become one `NOTIFY`, so
//! none is lost and a burst costs one.
//!
//! A process whose own workers run takes what it stores itself (the
//! receiver offers the thread to them, the API wakes them), so its
//! `NOTIFY` only calls in other replicas for what it cannot take. It goes
//! out `GAP` after the signal, with every signal of the gap in it. Each
//! `NOTIFY` wakes a backend to send it and every listener to hear it, this
//! process's own among them, and at half of full speed a `NOTIFY` per
//! approval cost a fifth of the machine's CPU per approval
//! (docs/decisions.md §32). A process without workers (the `api` and
//! `receiver` roles) relies on other replicas for all of its work, so its
//! `NOTIFY` goes out at once.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::time::Duration;

use sqlx::PgPool;

/// The channel the signals are sent on.
pub const WORK_CHANNEL: &str = "approvald_work";

/// How long a process with workers of its own holds a signal before its
/// `NOTIFY`: the most another replica is told late, and the least time
/// between two of its `NOTIFY`s.
pub(super) const GAP: Duration = Duration::from_millis(10);

#[derive(Debug)]
pub(super) struct WorkSignal {
    /// A signal not yet sent.
    again: AtomicBool,
    /// A task is sending (or holding) the signals.
    running: AtomicBool,
    /// This process's own workers take what it commits.
    workers_here: AtomicBool,
    /// The `NOTIFY` payload: names this process, so its own listener can
    /// pass over its own signals (`Store::instance`).
    pub(super) instance: String,
}

impl WorkSignal {
    pub(super) fn new() -> Arc<Self> {
        Arc::new(Self {
            again: false.into(),
            running: false.into(),
            workers_here: false.into(),
            instance: format!("{}-{:08x}", std::process::id(), rand::random::<u32>()),
        })
    }

    pub(super) fn workers_here(&self) {
        self.workers_here.store(true, SeqCst);
    }

    /// Notes a signal, and starts the task that sends it unless one runs.
    pub(super) fn signal(self: &Arc<Self>, pool: &PgPool) {
        self.again.store(true, SeqCst);
        if self.running.swap(true, SeqCst) {
            return;
        }
        let (pool, signal) = (pool.clone(), Arc::clone(self));
        tokio::spawn(async move { signal.send(&pool).await });
    }

    async fn send(&self, pool: &PgPool) {
        loop {
            if self.workers_here.load(SeqCst) {
                tokio::time::sleep(GAP).await;
            }
            if self.again.swap(false, SeqCst) {
                if pool.is_closed() {
                    // Shutting down: the replicas' polls find the work.
                    continue;
                }
                let sent = sqlx::query("SELECT pg_notify($1, $2)")
                    .bind(WORK_CHANNEL)
                    .bind(&self.instance)
                    .execute(pool)
                    .await;
                if let Err(e) = sent {
                    // Workers still find the work on their safety-net poll.
                    tracing::warn!(error = %e, "cannot NOTIFY other replicas of new work");
                }
                continue;
            }
            self.running.store(false, SeqCst);
            // A signal that came after the last swap and saw `running` set.
            if !self.again.load(SeqCst) || self.running.swap(true, SeqCst) {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sqlx::postgres::PgListener;
    use std::time::Instant;

    async fn pool() -> Option<PgPool> {
        let Some(url) = std::env::var("APPROVALD_TEST_PG_URL").ok().filter(|u| !u.is_empty()) else {
            use std::io::Write as _;
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED work_signal tests on PostgreSQL: APPROVALD_TEST_PG_URL is not set (.ci/run sets it)"
            );
            return None;
        };
        Some(PgPool::connect(&url).await.expect("connects"))
    }

    /// The `NOTIFY`s of `signal` heard until `quiet` passes without one,
    /// each with the time it came, after `burst` signals at once.
    async fn heard(signal: &Arc<WorkSignal>, pool: &PgPool, burst: usize, quiet: Duration) -> Vec<Duration> {
        let mut listener = PgListener::connect_with(pool).await.expect("listens");
        listener.listen(WORK_CHANNEL).await.expect("listens");
        let start = Instant::now();
        for _ in 0..burst {
            signal.signal(pool);
        }
        let mut at = Vec::new();
        // Bounded: the first must come; the rest are counted until quiet.
        let first = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                let n = listener.recv().await.expect("hears");
                if n.payload() == signal.instance {
                    return;
                }
            }
        })
        .await;
        assert!(first.is_ok(), "no NOTIFY within 10 s of {burst} signals");
        at.push(start.elapsed());
        while let Ok(n) = tokio::time::timeout(quiet, listener.recv()).await {
            if n.expect("hears").payload() == signal.instance {
                at.push(start.elapsed());
            }
        }
        at
    }

    #[tokio::test]
    async fn a_burst_of_signals_is_one_notify_after_the_gap_when_workers_are_here() {
        let Some(pool) = pool().await else { return };
        let signal = WorkSignal::new();
        signal.workers_here();
        let at = heard(&signal, &pool, 50, Duration::from_millis(300)).await;
        assert_eq!(at.len(), 1, "a burst is one NOTIFY: {at:?}");
        assert!(at[0] >= GAP, "held for the gap first: {at:?}");
        // The task ended; the next signal starts another.
        let again = heard(&signal, &pool, 1, Duration::from_millis(300)).await;
        assert_eq!(again.len(), 1, "{again:?}");
    }

    #[tokio::test]
    async fn without_workers_here_a_signal_is_sent_at_once_and_none_is_lost() {
        let Some(pool) = pool().await else { return };
        let signal = WorkSignal::new();
        let at = heard(&signal, &pool, 1, Duration::from_millis(300)).await;
        assert_eq!(at.len(), 1, "{at:?}");
        // Signals that come while a NOTIFY is in flight are one more, not none.
        let at = heard(&signal, &pool, 200, Duration::from_millis(300)).await;
        assert!((1..=2).contains(&at.len()), "a burst is one NOTIFY and at most one more: {at:?}");
    }
}
