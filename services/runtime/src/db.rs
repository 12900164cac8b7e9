//! Postgres pool setup with a startup error that names DATABASE_URL.

use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use crate::DatabaseArgs;

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("cannot connect to Postgres at {url} (DATABASE_URL): {reason}")]
    Connect { url: String, reason: String },
    #[error("cannot apply database migrations: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
}

pub async fn connect(args: &DatabaseArgs) -> Result<PgPool, DbError> {
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
