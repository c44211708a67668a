//! Pure domain logic: no I/O, unit-tested exhaustively.

pub mod answer;
pub mod callback;
pub mod json;
pub mod keys;
pub mod operation;
pub mod state;
