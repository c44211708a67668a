//! Named fault points for the crash harness. Built with the
//! `fault-injection` feature, the process aborts (as SIGKILL would leave it)
//! when it reaches the point named by `APPROVALD_FAULT`; release builds
//! compile every point to nothing.

#[cfg(feature = "fault-injection")]
pub fn point(name: &str) {
    if std::env::var("APPROVALD_FAULT").is_ok_and(|f| f == name) {
        eprintln!("approvald: fault point `{name}` reached; aborting");
        std::process::abort();
    }
}

#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub fn point(_name: &str) {}
