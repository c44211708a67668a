//! The growth figure: end to end on a store holding a million finished
//! operations, against the run's own store without them.
//!
//! One run of a few thousand approvals lasts a few seconds, and the
//! machine's speed drifts over minutes by more than the 10% the target
//! allows: two runs before the fill and two after it measured the same
//! build at 79% and 124% (docs/performance.md, "Thirty-fifth session").
//! So the full store is a second database with a daemon of its own, and
//! the runs alternate between the two in the order E F F E E F F E, which
//! a drift steady over the runs cancels. Both stores are measured after
//! the fill's checkpoint, so both pay the full-page images a checkpoint
//! makes of the pages changed next (before, only the full store did).

use super::load::{self, EndToEnd};
use super::target::{Daemon, EffectLog, PgCounters};
use super::{CpuSplit, pg_per};
use crate::sandbox::SandboxHandle;

/// A store and the daemon serving it.
pub struct Side<'a> {
    pub daemon: &'a Daemon,
    pub url: &'a str,
}

/// One end-to-end run: its rate and latencies, the machine's CPU per
/// approval split as the bench splits it, and PostgreSQL's WAL and block
/// counters per approval (None on SQLite).
pub struct Run {
    pub result: EndToEnd,
    pub cpu: String,
    pub pg: Option<String>,
}

/// Each side's runs, in their order.
pub struct Measured {
    pub empty: Vec<Run>,
    pub full: Vec<Run>,
}

/// The order of the runs: each side's positions sum alike (1+4+5+8 and
/// 2+3+6+7), so a drift steady over the eight runs favours neither.
const ORDER: [bool; 8] = [false, true, true, false, false, true, true, false];

/// Approvals run on the full side before the fill: the fill copies a
/// finished operation of the store, and the daemon's connections then
/// have their statements prepared, as the empty side's long have.
const WARM_UP: usize = 200;

pub struct Runs<'a> {
    pub sandbox: &'a SandboxHandle,
    pub effects: &'a EffectLog,
    pub ops: usize,
    pub tag: &'a str,
    pub name: &'static str,
}

impl Runs<'_> {
    /// Fills `full` with `rows` finished operations, then alternates the
    /// end-to-end runs between `empty` and `full`.
    pub async fn measure(&self, empty: Side<'_>, full: Side<'_>, rows: u64) -> anyhow::Result<Measured> {
        let name = self.name;
        self.run(&full, WARM_UP, "gw", &format!("{name}: full store, warming up")).await?;
        load::fill(full.url, rows, &format!("{name}: filling")).await?;
        let mut m = Measured { empty: Vec::new(), full: Vec::new() };
        for (i, is_full) in ORDER.into_iter().enumerate() {
            let (side, runs, what) =
                if is_full { (&full, &mut m.full, "full") } else { (&empty, &mut m.empty, "empty") };
            let label = format!("{name}: end to end, {what} store ({}/{})", runs.len() + 1, ORDER.len() / 2);
            runs.push(self.run(side, self.ops, &format!("g{i}"), &label).await?);
        }
        Ok(m)
    }

    /// One end-to-end run on `side`: `count` operations opened, then
    /// answered at full speed.
    async fn run(&self, side: &Side<'_>, count: usize, tag: &str, label: &str) -> anyhow::Result<Run> {
        let tag = format!("{}{tag}", self.tag);
        let decisions =
            load::open_operations(&side.daemon.base, super::TOKEN, self.sandbox, count, &tag).await?;
        let counters = PgCounters::read(side.url).await;
        let split = CpuSplit::start(side.daemon);
        let result = load::answer_all(self.sandbox, self.effects, &decisions, None, label).await?;
        let (count, secs) = (result.count as f64, result.count as f64 / result.approvals_per_sec);
        let cpu = split.finish(side.daemon, count, secs);
        let pg = pg_per(counters, side.url, count).await;
        Ok(Run { result, cpu, pg })
    }
}

#[cfg(test)]
mod tests {
    use super::ORDER;

    // A drift steady over the runs favours neither side: each side has
    // half the runs, and their positions sum alike.
    #[test]
    fn the_order_balances_a_steady_drift() {
        let count = |full: bool| ORDER.iter().filter(|f| **f == full).count();
        let sum =
            |full: bool| ORDER.iter().enumerate().filter(|(_, f)| **f == full).map(|(i, _)| i).sum::<usize>();
        assert_eq!(count(true), count(false));
        assert_eq!(sum(true), sum(false));
    }
}
