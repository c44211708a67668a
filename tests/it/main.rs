//! approvald's integration tests: one binary, real SQLite files, real HTTP
//! on 127.0.0.1 both ways (approvald, the Pushary sandbox, the effect target).

mod callbacks;
mod cli;
mod crash;
mod daemon;
mod enqueue;
mod faults;
mod harness;
mod outcomes;
mod reconciler;
mod soak;
mod vectors;
