//! The chaos run's record and its judge: [`history`] is what a run writes,
//! one JSON line per invocation and completion of every operation (reports,
//! Startups, first turns, faults, the final state); [`oracle`] decides from
//! that file alone whether each answer could have come from a correct
//! system, within stated bounds, and whether every acked report was kept.
//! The oracle is proven able to fail by its own tests, fed histories with
//! planted anomalies. See README.md for what is built and what is not yet.

pub mod history;
pub mod network;
pub mod oracle;
pub mod run;
