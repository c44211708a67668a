//! Counters and latency histograms, rendered in Prometheus' text format at
//! `/metrics`. The state of the store (inbox depth, operations by state) is
//! read at scrape time instead of being counted, so it is right on every
//! replica and after restarts.
//!
//! Labels are small closed sets (a call name, an error code, an outcome
//! class), never ids or tenant names, so the series stay few and say
//! nothing about who uses the service.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::Duration;

/// Every metric family: name, type, help. Rendering follows this order.
const FAMILIES: &[(&str, &str, &str)] = &[
    (
        "approvald_callbacks_accepted_total",
        "counter",
        "Pushary callbacks acknowledged, by result (stored, duplicate).",
    ),
    (
        "approvald_callbacks_rejected_total",
        "counter",
        "Pushary callbacks refused, by reason (the error code answered).",
    ),
    (
        "approvald_inbox_depth",
        "gauge",
        "Inbox entries by state (new: waiting to be applied; orphaned: no operation matched).",
    ),
    (
        "approvald_inbox_oldest_new_age_seconds",
        "gauge",
        "Age of the oldest inbox entry not yet applied (0 when none).",
    ),
    ("approvald_operations", "gauge", "Operations in the store by state (archived ones are not counted)."),
    (
        "approvald_pushary_request_duration_seconds",
        "histogram",
        "Pushary API calls by call name, whatever their outcome.",
    ),
    (
        "approvald_pushary_errors_total",
        "counter",
        "Pushary API calls that failed, by call name and kind (transport, status, decode).",
    ),
    (
        "approvald_delivery_duration_seconds",
        "histogram",
        "Outcome deliveries to effect targets, by outcome class.",
    ),
    (
        "approvald_deliveries_total",
        "counter",
        "Outcome delivery attempts by outcome class (2xx, 4xx, 5xx, transport).",
    ),
    ("approvald_reconciler_sweeps_total", "counter", "Reconciler sweeps run."),
    ("approvald_reconciler_swept_total", "counter", "What reconciler sweeps did, by kind."),
    ("approvald_resumes_total", "counter", "Answers applied to operations, by the state they led to."),
    (
        "approvald_sqlite_writer_busy_seconds_total",
        "counter",
        "SQLite only: time its one writer was taken, by phase (writing: a writer running its statements; \
         committing: a group commit flushing). Their rate near 1 means the node writes as fast as it can.",
    ),
    ("approvald_sqlite_writes_total", "counter", "SQLite only: writes run on the one writer."),
    ("approvald_sqlite_commits_total", "counter", "SQLite only: group commits (each holds many writes)."),
];

const BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

#[derive(Debug, Default, Clone)]
struct Histogram {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

/// One process's counters. Cheap to update (one short lock).
#[derive(Debug, Default)]
pub struct Metrics {
    counters: Mutex<BTreeMap<(&'static str, String), u64>>,
    histograms: Mutex<BTreeMap<(&'static str, String), Histogram>>,
}

/// What the store holds right now, read for a scrape.
#[derive(Debug, Default)]
pub struct StoreGauges {
    pub operations_by_state: Vec<(String, i64)>,
    pub inbox_by_state: Vec<(String, i64)>,
    pub oldest_new_age: Duration,
    /// SQLite's writer since start; None on PostgreSQL.
    pub sqlite_writer: Option<crate::store::WriterBusy>,
}

// Built on every count, which is on every callback's and step's path: one
// allocation, and characters escaped only where there are any.
fn labels(pairs: &[(&str, &str)]) -> String {
    let mut out = String::with_capacity(pairs.iter().map(|(k, v)| k.len() + v.len() + 4).sum());
    for (i, (k, v)) in pairs.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(k);
        out.push_str("=\"");
        for c in v.chars() {
            match c {
                '\\' => out.push_str("\\\\"),
                '"' => out.push_str("\\\""),
                '\n' => out.push_str("\\n"),
                c => out.push(c),
            }
        }
        out.push('"');
    }
    out
}

impl Metrics {
    pub fn inc(&self, name: &'static str, pairs: &[(&str, &str)]) {
        self.add(name, pairs, 1);
    }

    pub fn add(&self, name: &'static str, pairs: &[(&str, &str)], n: u64) {
        let mut c = self.counters.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        *c.entry((name, labels(pairs))).or_default() += n;
    }

    pub fn observe(&self, name: &'static str, pairs: &[(&str, &str)], took: Duration) {
        let secs = took.as_secs_f64();
        let mut h = self.histograms.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let e = h
            .entry((name, labels(pairs)))
            .or_insert_with(|| Histogram { counts: vec![0; BUCKETS.len()], ..Histogram::default() });
        for (slot, bound) in e.counts.iter_mut().zip(BUCKETS) {
            if secs <= *bound {
                *slot += 1;
            }
        }
        e.sum += secs;
        e.count += 1;
    }

    /// A counter's value, for tests and the operator page.
    pub fn counter(&self, name: &str, pairs: &[(&str, &str)]) -> u64 {
        let wanted = labels(pairs);
        let c = self.counters.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        c.iter().find(|((n, l), _)| *n == name && *l == wanted).map_or(0, |(_, v)| *v)
    }

    /// The text exposition format, version 0.0.4.
    pub fn render(&self, store: &StoreGauges) -> String {
        let counters = self.counters.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        let histograms = self.histograms.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        let mut out = String::new();
        for (name, kind, help) in FAMILIES {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            let series = |l: &str| if l.is_empty() { String::new() } else { format!("{{{l}}}") };
            match *name {
                "approvald_operations" => {
                    for (state, n) in &store.operations_by_state {
                        let _ = writeln!(out, "{name}{} {n}", series(&labels(&[("state", state)])));
                    }
                }
                "approvald_inbox_depth" => {
                    for (state, n) in &store.inbox_by_state {
                        let _ = writeln!(out, "{name}{} {n}", series(&labels(&[("state", state)])));
                    }
                }
                "approvald_inbox_oldest_new_age_seconds" => {
                    let _ = writeln!(out, "{name} {:.3}", store.oldest_new_age.as_secs_f64());
                }
                // Read from the store at scrape time, like the gauges; none on PostgreSQL.
                _ if name.starts_with("approvald_sqlite_") => {
                    let Some(w) = &store.sqlite_writer else { continue };
                    let _ = match *name {
                        "approvald_sqlite_writes_total" => writeln!(out, "{name} {}", w.writes),
                        "approvald_sqlite_commits_total" => writeln!(out, "{name} {}", w.commits),
                        _ => writeln!(
                            out,
                            "{name}{{phase=\"writing\"}} {:.6}\n{name}{{phase=\"committing\"}} {:.6}",
                            w.writing.as_secs_f64(),
                            w.committing.as_secs_f64()
                        ),
                    };
                }
                _ if *kind == "histogram" => {
                    for ((_, l), h) in histograms.iter().filter(|((n, _), _)| n == name) {
                        let sep = if l.is_empty() { "" } else { "," };
                        for (bound, n) in BUCKETS.iter().zip(&h.counts) {
                            let _ = writeln!(out, "{name}_bucket{{{l}{sep}le=\"{bound}\"}} {n}");
                        }
                        let _ = writeln!(out, "{name}_bucket{{{l}{sep}le=\"+Inf\"}} {}", h.count);
                        let _ = writeln!(out, "{name}_sum{} {}", series(l), h.sum);
                        let _ = writeln!(out, "{name}_count{} {}", series(l), h.count);
                    }
                }
                _ => {
                    for ((_, l), v) in counters.iter().filter(|((n, _), _)| n == name) {
                        let _ = writeln!(out, "{name}{} {v}", series(l));
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped_as_the_text_format_requires() {
        assert_eq!(labels(&[]), "");
        assert_eq!(labels(&[("a", "plain")]), "a=\"plain\"");
        assert_eq!(labels(&[("a", "x\\y"), ("b", "q\"r\ns")]), "a=\"x\\\\y\",b=\"q\\\"r\\ns\"");
    }

    #[test]
    fn renders_counters_histograms_and_gauges_in_text_format() {
        let m = Metrics::default();
        m.inc("approvald_callbacks_rejected_total", &[("reason", "bad \"sig\"")]);
        m.add("approvald_callbacks_accepted_total", &[("result", "stored")], 3);
        m.observe(
            "approvald_pushary_request_duration_seconds",
            &[("call", "consume")],
            Duration::from_millis(3),
        );
        let gauges = StoreGauges {
            operations_by_state: vec![("pending".into(), 2)],
            inbox_by_state: vec![("new".into(), 1)],
            oldest_new_age: Duration::from_millis(1500),
            sqlite_writer: Some(crate::store::WriterBusy {
                writing: Duration::from_micros(1_250_000),
                committing: Duration::from_micros(500),
                writes: 7,
                commits: 2,
            }),
        };
        let text = m.render(&gauges);
        assert!(
            text.contains("approvald_sqlite_writer_busy_seconds_total{phase=\"writing\"} 1.250000\n"),
            "{text}"
        );
        assert!(text.contains("approvald_sqlite_writer_busy_seconds_total{phase=\"committing\"} 0.000500\n"));
        assert!(text.contains("approvald_sqlite_writes_total 7\n"));
        assert!(text.contains("approvald_sqlite_commits_total 2\n"));
        // PostgreSQL has no such writer: the families are announced, with no series.
        let pg = m.render(&StoreGauges::default());
        assert!(!pg.lines().any(|l| l.starts_with("approvald_sqlite_")), "{pg}");
        assert!(pg.contains("# TYPE approvald_sqlite_writes_total counter\n"), "{pg}");
        assert!(
            text.contains("approvald_callbacks_rejected_total{reason=\"bad \\\"sig\\\"\"} 1\n"),
            "{text}"
        );
        assert!(text.contains("approvald_callbacks_accepted_total{result=\"stored\"} 3\n"));
        assert!(text.contains(
            "approvald_pushary_request_duration_seconds_bucket{call=\"consume\",le=\"0.0025\"} 0\n"
        ));
        assert!(text.contains(
            "approvald_pushary_request_duration_seconds_bucket{call=\"consume\",le=\"0.005\"} 1\n"
        ));
        assert!(text.contains("approvald_pushary_request_duration_seconds_count{call=\"consume\"} 1\n"));
        assert!(text.contains("approvald_operations{state=\"pending\"} 2\n"));
        assert!(text.contains("approvald_inbox_oldest_new_age_seconds 1.500\n"));
        assert_eq!(m.counter("approvald_callbacks_accepted_total", &[("result", "stored")]), 3);
        // Every family is announced once, even with no samples yet.
        for (name, kind, _) in FAMILIES {
            assert_eq!(text.matches(&format!("# TYPE {name} {kind}\n")).count(), 1, "{name}");
        }
    }
}
