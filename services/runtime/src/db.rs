//! Postgres pool setup with a startup error that names DATABASE_URL.

use std::time::Duration;

use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgConnection, PgPool};

use crate::DatabaseArgs;

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("cannot connect to Postgres at {url} (DATABASE_URL): {reason}")]
    Connect { url: String, reason: String },
    #[error("cannot apply database migrations: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
}

pub async fn connect(args: &DatabaseArgs) -> Result<PgPool, DbError> {
    // One direct connection first: a pool reports only "timed out", this
    // reports why (refused, unknown database, authentication failed).
    let probe = tokio::time::timeout(
        Duration::from_secs(5),
        PgConnection::connect(&args.database_url),
    )
    .await
    .unwrap_or_else(|_| Err(sqlx::Error::PoolTimedOut))
    .map_err(|e| DbError::Connect {
        url: crate::nats::redact_url(&args.database_url),
        reason: e.to_string(),
    })?;
    let _ = probe.close().await;
    PgPoolOptions::new()
        .max_connections(args.db_max_connections)
        .acquire_timeout(Duration::from_secs(5))
        .connect(&args.database_url)
        .await
        .map_err(|e| DbError::Connect {
            url: crate::nats::redact_url(&args.database_url),
            reason: e.to_string(),
        })
}
