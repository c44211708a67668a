//! The durable store: operations, their transitions, the callback inbox,
//! delivery attempts and per-thread leases. SQLite (WAL) for one node.
//!
//! Every write to an operation is a compare-and-set on its `version`, in
//! the same transaction as its transition rows (and the inbox row it
//! consumes), so two workers can never both move one operation.

#[macro_use]
mod db;
mod inbox_apply;
mod inbox_sqlite;
mod inbox_writer;
mod insights;
mod rows;
mod save;
mod sqlite_group;
mod work_signal;

#[cfg(test)]
pub(crate) use db::test_support;
pub use db::{BatchInsert, Store, ThreadWork};
pub use inbox_writer::{AnswerSaves, InboxWriter, MAX_BATCH, OwnedInboxEntry};
pub use insights::{Activity, OperatorFilter};
pub use rows::{DeliveryRecord, InboxEntry, Operation, PusharyCall, Transition};
pub use save::{AnswerSave, Applied, FirstSave, FirstSaves, LeaseWith, TakeLease};
pub use sqlite_group::WriterBusy;
pub use work_signal::WORK_CHANNEL;

#[derive(Clone, Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store unavailable: {0}")]
    Unavailable(String),
    #[error("store data is corrupt: {0}")]
    Corrupt(String),
    #[error("migration failed: {0}")]
    Migrate(String),
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        match e {
            sqlx::Error::ColumnDecode { .. } | sqlx::Error::Decode(_) | sqlx::Error::ColumnNotFound(_) => {
                StoreError::Corrupt(e.to_string())
            }
            other => StoreError::Unavailable(other.to_string()),
        }
    }
}

/// Result of inserting an operation under its (tenant, key).
#[derive(Debug)]
pub enum Inserted {
    Created,
    Existing(Box<Operation>),
    /// The key belongs to an operation already archived: its fingerprint
    /// and archived document.
    Archived {
        fingerprint: String,
        document: String,
    },
}

/// Result of committing a callback to the inbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InboxInsert {
    Stored(i64),
    Duplicate(i64),
    /// A callback for an operation that has been archived: a replay.
    Archived,
}

/// A verified answer about to enter the inbox.
#[derive(Debug, Clone)]
pub struct NewInboxEntry<'a> {
    pub tenant: &'a str,
    pub correlation_id: &'a str,
    pub answer: &'a str,
    pub answered_at: Option<&'a str>,
    pub body: &'a [u8],
    pub source: &'a str,
    pub received_at: i64,
}

/// Filter for listing operations.
#[derive(Debug, Clone, Default)]
pub struct OperationFilter {
    pub tenant: Option<String>,
    pub state: Option<crate::domain::state::State>,
    pub thread_id: Option<String>,
    pub limit: i64,
}
