//! Latency percentiles, the progress line, and the final table.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(Debug, Default, Clone)]
pub struct Latencies(Vec<Duration>);

impl Latencies {
    pub fn push(&mut self, d: Duration) {
        self.0.push(d);
    }
    pub fn extend(&mut self, v: Vec<Duration>) {
        self.0.extend(v);
    }
    pub fn len(&self) -> usize {
        self.0.len()
    }
    /// The `q` quantile (0..=1) in milliseconds, nearest rank.
    pub fn ms(&self, q: f64) -> f64 {
        if self.0.is_empty() {
            return f64::NAN;
        }
        let mut v = self.0.clone();
        v.sort_unstable();
        let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
        v[rank].as_secs_f64() * 1000.0
    }
}

/// Prints `label: N done (R/s)` to stderr once a second until `done`.
pub fn progress(label: &str, count: Arc<AtomicU64>, done: Arc<AtomicBool>) -> tokio::task::JoinHandle<()> {
    let label = label.to_string();
    tokio::spawn(async move {
        let start = Instant::now();
        while !done.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(250)).await;
            let n = count.load(Ordering::Relaxed);
            let secs = start.elapsed().as_secs_f64();
            eprint!("\r{label}: {n} in {secs:.0} s ({:.0}/s)      ", n as f64 / secs.max(0.001));
        }
        eprintln!();
    })
}

/// One row of the result table.
pub struct Row {
    pub engine: &'static str,
    pub figure: String,
    pub value: String,
    pub baseline: String,
    pub ratio: String,
    pub target: String,
    pub met: Option<bool>,
}

pub fn print_table(rows: &[Row]) {
    let header = ["store", "figure", "measured", "baseline (same run)", "ratio", "target", "met"];
    let cells: Vec<[String; 7]> = rows
        .iter()
        .map(|r| {
            [
                r.engine.to_string(),
                r.figure.clone(),
                r.value.clone(),
                r.baseline.clone(),
                r.ratio.clone(),
                r.target.clone(),
                match r.met {
                    Some(true) => "yes".into(),
                    Some(false) => "NO".into(),
                    None => "-".into(),
                },
            ]
        })
        .collect();
    let mut widths = header.map(str::len);
    for c in &cells {
        for (w, v) in widths.iter_mut().zip(c) {
            *w = (*w).max(v.chars().count());
        }
    }
    let line = |c: &[String]| {
        let parts: Vec<String> =
            c.iter().zip(widths).map(|(v, w)| format!("{v}{}", " ".repeat(w - v.chars().count()))).collect();
        println!("| {} |", parts.join(" | "));
    };
    line(&header.map(String::from));
    println!("|{}|", widths.iter().map(|w| "-".repeat(w + 2)).collect::<Vec<_>>().join("|"));
    for c in &cells {
        line(c);
    }
}
