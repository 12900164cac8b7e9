//! Postgres pool setup with a startup error that names DATABASE_URL, and
//! the one way a Postgres error becomes text ([`describe`]): the SQLSTATE
//! code and the server's message, never the server's internals (sqlx's
//! `Display` appends the server's source line, `at line 768`).

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use sqlx::{Connection, PgConnection, PgPool};

use crate::config::DatabaseArgs;

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("invalid DATABASE_URL {url:?}: {reason}")]
    InvalidUrl { url: String, reason: String },
    #[error("cannot connect to Postgres at {url} (DATABASE_URL): {reason}")]
    Connect { url: String, reason: String },
    #[error("cannot apply database migrations: {}", describe_migrate(.0))]
    Migrate(#[from] sqlx::migrate::MigrateError),
}

/// An error of sqlx as operators see it: for an error the server returned,
/// its message and SQLSTATE code only (no source file, line or routine of
/// the server); for anything else, sqlx's own text.
pub fn describe(error: &sqlx::Error) -> String {
    match error {
        sqlx::Error::Database(db) => match db.code() {
            Some(code) => format!("{} (SQLSTATE {code})", db.message()),
            None => db.message().to_owned(),
        },
        other => other.to_string(),
    }
}

/// [`describe`] for a migration error.
pub fn describe_migrate(error: &sqlx::migrate::MigrateError) -> String {
    use sqlx::migrate::MigrateError;
    match error {
        MigrateError::Execute(e) => format!("while executing migrations: {}", describe(e)),
        MigrateError::ExecuteMigration(e, version) => {
            format!("while executing migration {version}: {}", describe(e))
        }
        other => other.to_string(),
    }
}

/// DATABASE_URL as it may be shown: no userinfo, no query (`?password=`).
pub fn redact_url(url: &str) -> String {
    let redacted = crate::nats::redact_url(url);
    match redacted.split_once('?') {
        Some((base, _)) => format!("{base}?[redacted]"),
        None => redacted,
    }
}

/// Refuses a DATABASE_URL that is not a Postgres URL before sqlx tries it
/// (sqlx would speak the Postgres protocol to whatever answers).
pub fn check_url(url: &str) -> Result<(), DbError> {
    let invalid = |reason: String| DbError::InvalidUrl {
        url: redact_url(url),
        reason,
    };
    match url.split_once("://") {
        Some(("postgres" | "postgresql", _)) => Ok(()),
        Some((scheme, _)) => Err(invalid(format!(
            "expected a postgres:// or postgresql:// URL, not {scheme}://"
        ))),
        None => Err(invalid(
            "expected a postgres:// or postgresql:// URL".to_owned(),
        )),
    }
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

/// A pooled connection idle longer than this is pinged before it is handed
/// out; one used more recently is not (see [`pool_options`]).
pub const PING_IF_IDLE_FOR: Duration = Duration::from_secs(1);

/// Every pool of ours: sqlx pings a connection when it is returned to the
/// pool, and by default again when it is next taken. The second ping is a
/// round trip before every transaction (a push, a gate's read, a catalog
/// preparation) that tells nothing new about a connection the first one
/// checked moments ago, so it is made only for a connection that sat idle
/// past [`PING_IF_IDLE_FOR`] (Postgres may have restarted since). A failed
/// ping discards the connection and the pool takes or opens another.
pub fn pool_options() -> PgPoolOptions {
    PgPoolOptions::new()
        .test_before_acquire(false)
        .before_acquire(|connection, meta| {
            Box::pin(async move {
                if meta.idle_for > PING_IF_IDLE_FOR {
                    connection.ping().await?;
                }
                Ok(true)
            })
        })
}

pub async fn connect(args: &DatabaseArgs) -> Result<PgPool, DbError> {
    ctxsync_tls::install_default_provider();
    check_url(&args.database_url)?;
    let connect_error = |e: sqlx::Error| DbError::Connect {
        url: redact_url(&args.database_url),
        reason: describe(&e),
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
    pool_options()
        .max_connections(args.db_max_connections)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(options)
        .await
        .map_err(connect_error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_postgres_urls_are_accepted_and_the_refusal_hides_credentials() {
        for url in [
            "postgres://u@h/db",
            "postgresql://u:p@h:5432/db?sslmode=disable",
        ] {
            check_url(url).unwrap();
        }
        for (url, scheme) in [
            ("mysql://root:hunter2-pw@db:3306/app", "mysql://"),
            ("http://user:hunter2-pw@db/?password=hunter2-pw", "http://"),
        ] {
            let message = check_url(url).unwrap_err().to_string();
            assert!(message.starts_with("invalid DATABASE_URL "), "{message}");
            assert!(message.contains("expected a postgres:// or postgresql:// URL"));
            assert!(message.contains(&format!("not {scheme}")), "{message}");
            assert!(!message.contains("hunter2"), "{message}");
        }
        let message = check_url("db.internal:5432").unwrap_err().to_string();
        assert!(message.contains("DATABASE_URL"), "{message}");
    }
}
