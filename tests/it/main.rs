//! approvald's integration tests: one binary, real SQLite files, real HTTP
//! on 127.0.0.1 both ways (approvald, the Pushary sandbox, the effect target).

/// Defines a test twice: on SQLite, and on PostgreSQL when
/// `APPROVALD_TEST_PG_URL` is set (otherwise it says loudly it skipped).
macro_rules! both_engines {
    ($(#[$meta:meta])* async fn $name:ident() $body:block) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            $(#[$meta])*
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sqlite() {
                crate::harness::BACKEND.scope(crate::harness::Backend::Sqlite, async $body).await
            }

            $(#[$meta])*
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                let Some(backend) = crate::harness::Backend::postgres(module_path!())
                else {
                    return;
                };
                crate::harness::BACKEND.scope(backend, async $body).await
            }
        }
    };
}

mod callbacks;
mod cli;
mod crash;
mod daemon;
mod doctor;
mod enqueue;
mod faults;
mod harness;
mod hostile;
mod openapi;
mod operator_ui;
mod outcomes;
mod reconciler;
mod replicas;
mod retention;
mod rotation;
mod scaleout;
mod sdk;
mod soak;
mod tenants;
mod vectors;
mod wakeups;
mod workers;
