//! How much of a run SQLite's one writer was taken, read from the daemon's
//! own `/metrics` before and after it. SQLite admits one writer, so when
//! this share is near all of the run, the rate is the writer's: its time
//! per write and per commit, not the CPU or the HTTP stack, bounds it.

/// The writer's counters at one scrape.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WriterSample {
    writing_secs: f64,
    committing_secs: f64,
    writes: f64,
    commits: f64,
}

impl WriterSample {
    /// The daemon's writer counters now; None on PostgreSQL (no such
    /// series) or if the scrape fails (the row is then left out).
    pub async fn read(base: &str) -> Option<Self> {
        let http = crate::http::client_builder().build().ok()?;
        let text = http.get(format!("{base}/metrics")).send().await.ok()?.text().await.ok()?;
        parse(&text)
    }

    /// "writing W% / committing C% of the run; N writes `per`, M per
    /// commit", from `self` to `end`, over `elapsed_secs` and `units`.
    pub fn share(&self, end: &Self, elapsed_secs: f64, units: f64, per: &str) -> String {
        let pct = |a: f64, b: f64| (b - a) / elapsed_secs.max(1e-9) * 100.0;
        let writes = end.writes - self.writes;
        format!(
            "writing {:.0}% / committing {:.0}% of the run; {:.1} writes {per}, {:.0} per commit; {:.0} µs per write",
            pct(self.writing_secs, end.writing_secs),
            pct(self.committing_secs, end.committing_secs),
            writes / units.max(1e-9),
            writes / (end.commits - self.commits).max(1.0),
            (end.writing_secs - self.writing_secs) * 1e6 / writes.max(1.0),
        )
    }
}

fn parse(text: &str) -> Option<WriterSample> {
    let value = |series: &str| {
        text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse::<f64>().ok())
    };
    Some(WriterSample {
        writing_secs: value("approvald_sqlite_writer_busy_seconds_total{phase=\"writing\"}")?,
        committing_secs: value("approvald_sqlite_writer_busy_seconds_total{phase=\"committing\"}")?,
        writes: value("approvald_sqlite_writes_total")?,
        commits: value("approvald_sqlite_commits_total")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_writer_series_and_reports_its_share_of_a_run() {
        let at = |w: f64, c: f64, n: u64, k: u64| {
            format!(
                "# TYPE approvald_sqlite_writes_total counter\n\
                 approvald_sqlite_writer_busy_seconds_total{{phase=\"writing\"}} {w}\n\
                 approvald_sqlite_writer_busy_seconds_total{{phase=\"committing\"}} {c}\n\
                 approvald_sqlite_writes_total {n}\napprovald_sqlite_commits_total {k}\n"
            )
        };
        let start = parse(&at(1.0, 0.5, 100, 10)).expect("parsed");
        let end = parse(&at(8.5, 2.5, 5100, 110)).expect("parsed");
        // 10 s run, 1,000 approvals: 7.5 s writing, 2 s committing, 5,000 writes in 100 commits.
        assert_eq!(
            start.share(&end, 10.0, 1000.0, "per approval"),
            "writing 75% / committing 20% of the run; 5.0 writes per approval, 50 per commit; 1500 µs per write"
        );
        // PostgreSQL's scrape has the families but no series.
        assert_eq!(parse("# TYPE approvald_sqlite_writes_total counter\n"), None);
    }
}
