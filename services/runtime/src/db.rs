//! Postgres pool setup with a startup error that names DATABASE_URL.

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use sqlx::{Connection, PgConnection, PgPool};

use crate::DatabaseArgs;

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("cannot connect to Postgres at {url} (DATABASE_URL): {reason}")]
    Connect { url: String, reason: String },
    #[error("cannot apply database migrations: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
}

/// TLS as libpq reads the URL: `sslmode` (disable, prefer (the default),
/// require, verify-ca, verify-full) and `sslrootcert` are applied by sqlx
/// (rustls on ring); as in libpq, `require` with an `sslrootcert` verifies
/// the server's certificate against it (verify-ca). The root certificate
/// file is read here first, so that a bad path is a clear startup error.
fn tls_options(url: &str, options: PgConnectOptions) -> Result<PgConnectOptions, String> {
    let Ok(parsed) = url::Url::parse(url) else {
        return Ok(options);
    };
    let Some(root) = parsed
        .query_pairs()
        .find(|(key, _)| key == "sslrootcert")
        .map(|(_, value)| value.into_owned())
    else {
        return Ok(options);
    };
    ctxsync_tls::load_certs(&ctxsync_tls::PemFile::new(
        "sslrootcert of DATABASE_URL",
        &root,
    ))
    .map_err(|e| e.to_string())?;
    Ok(match options.get_ssl_mode() {
        PgSslMode::Require => options.ssl_mode(PgSslMode::VerifyCa),
        _ => options,
    })
}

/// A transaction left open this long is ended by Postgres: a replica that
/// stalls (SIGSTOP, a paused VM) inside a transaction holds its row locks
/// only this long, not until it resumes. Every transaction of ours is
/// milliseconds long.
pub const IDLE_IN_TRANSACTION_TIMEOUT: &str = "15s";

pub async fn connect(args: &DatabaseArgs) -> Result<PgPool, DbError> {
    ctxsync_tls::install_default_provider();
    let connect_error = |e: sqlx::Error| DbError::Connect {
        url: crate::nats::redact_url(&args.database_url),
        reason: e.to_string(),
    };
    let options = tls_options(
        &args.database_url,
        args.database_url
            .parse::<PgConnectOptions>()
            .map_err(connect_error)?,
    )
    .map_err(|reason| DbError::Connect {
        url: crate::nats::redact_url(&args.database_url),
        reason,
    })?
    .options([(
        "idle_in_transaction_session_timeout",
        IDLE_IN_TRANSACTION_TIMEOUT,
    )]);
    // One direct connection first: a pool reports only "timed out", this
    // reports why (refused, unknown database, authentication failed).
    let probe = tokio::time::timeout(Duration::from_secs(5), PgConnection::connect_with(&options))
        .await
        .unwrap_or_else(|_| Err(sqlx::Error::PoolTimedOut))
        .map_err(connect_error)?;
    let _ = probe.close().await;
    PgPoolOptions::new()
        .max_connections(args.db_max_connections)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(options)
        .await
        .map_err(|e| DbError::Connect {
            url: crate::nats::redact_url(&args.database_url),
            reason: e.to_string(),
        })
}
