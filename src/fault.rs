//! Named fault points for the crash harness. In debug builds (which is
//! what `cargo test` runs) and with the `fault-injection` feature, the
//! process kills itself with SIGKILL when it reaches the point named by the
//! `APPROVALD_FAULT` environment variable. Release builds compile every
//! point to nothing.

#[cfg(any(debug_assertions, feature = "fault-injection"))]
pub fn point(name: &str) {
    if std::env::var("APPROVALD_FAULT").is_ok_and(|f| f == name) {
        eprintln!("APPROVALD_FAULT_REACHED {name}");
        // SIGKILL, as a crash or the OOM killer would: no destructors, no
        // flushes, no graceful shutdown. `kill` returns only once the signal
        // is delivered; abort is the fallback where there is no `kill`.
        let _ = std::process::Command::new("kill").args(["-KILL", &std::process::id().to_string()]).status();
        std::process::abort();
    }
}

#[cfg(not(any(debug_assertions, feature = "fault-injection")))]
#[inline(always)]
pub fn point(_name: &str) {}
