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
        // flushes, no graceful shutdown. Sent by the kill(2) syscall, so the
        // process dies at this point: spawning kill(1) took milliseconds in
        // which the other threads went on working past the crash point
        // (a worker consumed the permit of a callback "killed" before its
        // ack). abort is the fallback if the signal cannot be sent.
        let _ = rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
        std::process::abort();
    }
}

#[cfg(not(any(debug_assertions, feature = "fault-injection")))]
#[inline(always)]
pub fn point(_name: &str) {}
