//! The fault-injection suite (issue 11): each case runs the real binaries
//! against a real nats-server and a real Postgres, injects one kind of fault,
//! asserts counts, and ends with one `FAULT-SUMMARY` line.
//!
//! `cargo test -p faults --test faults` runs it; the summary lines print
//! even for passing cases (and go to `$CTXSYNC_FAULT_SUMMARY_FILE` when set).

mod catalog_kill;
mod catalog_replicas;
mod clock_skew;
mod cluster_failover;
mod gate_shutdown;
mod nats_restart;
mod postgres_restart;
mod replicas;
mod slowloris;
mod stalled_store;
mod store_kill;
mod unknown_agents;
