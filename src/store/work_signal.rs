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
//! out `GAP` after the signal (plus the `NOTIFY`'s own round trip, and
//! any wait for a connection), with every signal of the gap in it. Each
//! `NOTIFY` wakes a backend to send it and every listener to hear it, this
//! process's own among them: at half of full speed, about 0.8 of them per
//! approval cost about a tenth of the machine's CPU per approval
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
/// `NOTIFY` (which then takes its round trip), and the least time between
/// two of its `NOTIFY`s.
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

    /// How long a signal is held before its `NOTIFY`: `GAP` in a process
    /// that runs workers, none in one that does not.
    fn hold(&self) -> Option<Duration> {
        self.workers_here.load(SeqCst).then_some(GAP)
    }

    async fn send(&self, pool: &PgPool) {
        // A task dropped before it gives `running` back (its runtime shut
        // down mid-sleep) must not leave every later signal unsent.
        let mut owned = Owned { running: &self.running, armed: true };
        loop {
            if let Some(hold) = self.hold() {
                tokio::time::sleep(hold).await;
            }
            if self.again.swap(false, SeqCst) {
                let sent = sqlx::query("SELECT pg_notify($1, $2)")
                    .bind(WORK_CHANNEL)
                    .bind(&self.instance)
                    .execute(pool)
                    .await;
                match sent {
                    // Closed for shutdown: the replicas' polls find the work.
                    Ok(_) | Err(sqlx::Error::PoolClosed) => {}
                    // Workers still find the work on their safety-net poll.
                    Err(e) => tracing::warn!(error = %e, "cannot NOTIFY other replicas of new work"),
                }
                continue;
            }
            self.running.store(false, SeqCst);
            // A signal that came after the last swap and saw `running` set.
            if !self.again.load(SeqCst) || self.running.swap(true, SeqCst) {
                owned.armed = false;
                return;
            }
        }
    }
}

/// Gives `running` back if its task ends other than by returning.
struct Owned<'a> {
    running: &'a AtomicBool,
    armed: bool,
}

impl Drop for Owned<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.running.store(false, SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sqlx::postgres::PgListener;
    use std::time::Instant;

    #[test]
    fn a_signal_is_held_for_the_gap_only_where_workers_run() {
        let signal = WorkSignal::new();
        assert_eq!(signal.hold(), None, "no workers here: at once");
        signal.workers_here();
        assert_eq!(signal.hold(), Some(GAP));
    }

    async fn pool() -> Option<PgPool> {
        let url = crate::store::db::test_support::pg_test_url("work_signal tests")?;
        Some(PgPool::connect(&url).await.expect("connects"))
    }

    async fn listener(pool: &PgPool) -> PgListener {
        let mut l = PgListener::connect_with(pool).await.expect("listens");
        l.listen(WORK_CHANNEL).await.expect("listens");
        l
    }

    /// When each `NOTIFY` of `instance` was heard (since `start`), until
    /// `until`, heard as they come, in a task of its own. Others' on the
    /// same database are passed over; the deadline is fixed, so they
    /// cannot keep the test waiting.
    fn record(
        mut l: PgListener,
        instance: &str,
        start: Instant,
        until: Instant,
    ) -> tokio::task::JoinHandle<Vec<Duration>> {
        let instance = instance.to_owned();
        tokio::spawn(async move {
            let mut at = Vec::new();
            while let Ok(n) = tokio::time::timeout_at(until.into(), l.recv()).await {
                if n.expect("hears").payload() == instance {
                    at.push(start.elapsed());
                }
            }
            at
        })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_burst_of_signals_is_one_notify_after_the_gap_where_workers_run() {
        let Some(pool) = pool().await else { return };
        let l = listener(&pool).await;
        let signal = WorkSignal::new();
        signal.workers_here();
        let start = Instant::now();
        let heard = record(l, &signal.instance, start, start + Duration::from_secs(2));
        for _ in 0..50 {
            signal.signal(&pool);
        }
        let at = heard.await.expect("the listener's task ends");
        assert_eq!(at.len(), 1, "a burst is one NOTIFY: {at:?}");
        assert!(at[0] >= GAP, "held for the gap first: {at:?}");
    }

    /// Signals every millisecond for 80 ms, across the sender's sleeps
    /// and its `NOTIFY`s in flight: the last signal is in a `NOTIFY` heard
    /// after it, and where workers run, the signals share few.
    async fn spread(workers_here: bool) -> Option<(Vec<Duration>, Duration)> {
        let pool = pool().await?;
        let l = listener(&pool).await;
        let signal = WorkSignal::new();
        if workers_here {
            signal.workers_here();
        }
        let start = Instant::now();
        let heard = record(l, &signal.instance, start, start + Duration::from_millis(2080));
        while start.elapsed() < Duration::from_millis(80) {
            signal.signal(&pool);
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        signal.signal(&pool);
        let last = start.elapsed();
        let at = heard.await.expect("the listener's task ends");
        assert!(
            at.last().is_some_and(|t| *t > last),
            "the last signal was sent: last at {last:?}, heard {at:?}"
        );
        Some((at, last))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn signals_spread_over_time_are_all_sent_and_share_notifies_where_workers_run() {
        let Some((at, last)) = spread(true).await else { return };
        // At most one per gap while signalling, and the one after.
        let most = usize::try_from(last.as_millis() / GAP.as_millis()).unwrap_or(usize::MAX) + 2;
        assert!(at.len() <= most, "{} NOTIFYs for {last:?} of signals, at most {most}: {at:?}", at.len());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn signals_spread_over_time_are_all_sent_without_workers_here() {
        spread(false).await;
    }

    /// A sender dropped mid-sleep (its runtime shut down) gives its place
    /// back, so a signal later, on another runtime, is still sent.
    #[test]
    fn a_sender_dropped_with_its_runtime_does_not_silence_the_next_signal() {
        let runtime = || tokio::runtime::Builder::new_current_thread().enable_all().build().expect("builds");
        let signal = WorkSignal::new();
        signal.workers_here();
        let first = runtime();
        let Some(first_pool) = first.block_on(pool()) else { return };
        first.block_on(async {
            signal.signal(&first_pool);
            // The sender runs up to its sleep, then the runtime goes.
            tokio::task::yield_now().await;
        });
        drop(first);
        drop(first_pool);
        assert!(!signal.running.load(SeqCst), "the dropped sender gave its place back");
        runtime().block_on(async {
            let pool = pool().await.expect("connects again");
            let start = Instant::now();
            let heard =
                record(listener(&pool).await, &signal.instance, start, start + Duration::from_secs(2));
            signal.signal(&pool);
            let at = heard.await.expect("the listener's task ends");
            assert_eq!(at.len(), 1, "the next signal is sent: {at:?}");
        });
    }
}
