//! `approvald doctor` and CLI progress.
