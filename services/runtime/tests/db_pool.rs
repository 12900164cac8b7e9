//! The services' Postgres pool (`ctxsync_runtime::db::connect`) on a real
//! database: a connection is pinged before use only after sitting idle past
//! `PING_IF_IDLE_FOR`, so one Postgres closed meanwhile is replaced unseen,
//! and one used moments ago costs no extra round trip.

use std::time::{Duration, Instant};

use ctxsync_runtime::config::DatabaseArgs;
use ctxsync_runtime::db::{PING_IF_IDLE_FOR, connect};
use sqlx::{Connection, PgConnection, PgPool};
use testkit::TestDatabase;

async fn backend_pid(pool: &PgPool) -> Result<i32, sqlx::Error> {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(pool)
        .await
}

/// Ends the backend `pid` from another connection and waits until Postgres
/// no longer lists it: its socket is closed by then.
async fn terminate(url: &str, pid: i32) {
    let mut admin = PgConnection::connect(url).await.unwrap();
    let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&mut admin)
        .await
        .unwrap();
    assert!(ended, "backend {pid} was not terminated");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let listed: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)")
                .bind(pid)
                .fetch_one(&mut admin)
                .await
                .unwrap();
        if !listed {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "backend {pid} still listed after 10 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = admin.close().await;
}

/// A pool of one connection (each query takes the same one while it lives),
/// back in the pool after a first query (sqlx pinged it on its release), and
/// that connection's backend, ended by Postgres: what the next query meets.
struct DeadIdleConnection {
    database: TestDatabase,
    pool: PgPool,
    backend: i32,
    /// When the connection went back to the pool.
    released: Instant,
}

async fn dead_idle_connection() -> DeadIdleConnection {
    let database = TestDatabase::create().await;
    let pool = connect(&DatabaseArgs {
        database_url: database.url().to_owned(),
        db_max_connections: 1,
    })
    .await
    .unwrap();
    let backend = backend_pid(&pool).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while pool.num_idle() < 1 {
        assert!(
            Instant::now() < deadline,
            "the connection never returned to the pool"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let released = Instant::now();
    terminate(database.url(), backend).await;
    DeadIdleConnection {
        database,
        pool,
        backend,
        released,
    }
}

#[tokio::test]
async fn a_connection_closed_by_postgres_while_idle_is_replaced_before_it_is_used() {
    let DeadIdleConnection {
        database: _database,
        pool,
        backend: first,
        ..
    } = dead_idle_connection().await;
    // The condition under test: the connection has sat idle past the bound.
    tokio::time::sleep(PING_IF_IDLE_FOR + Duration::from_millis(200)).await;

    let second = backend_pid(&pool)
        .await
        .expect("the dead connection is found by its ping and replaced");
    assert_ne!(second, first, "the query ran on a new connection");
}

#[tokio::test]
async fn a_connection_used_moments_ago_is_handed_out_without_a_ping() {
    let DeadIdleConnection {
        database: _database,
        pool,
        backend: first,
        released,
    } = dead_idle_connection().await;

    // Without a ping, the query itself meets the closed connection: that is
    // how the skipped round trip shows (a ping would have replaced it).
    let unpinged = backend_pid(&pool).await;
    assert!(
        released.elapsed() < PING_IF_IDLE_FOR,
        "the check took longer than the bound, so it proves nothing: {:?}",
        released.elapsed()
    );
    assert!(
        unpinged.is_err(),
        "a connection idle for less than the bound was pinged before use"
    );
    // The broken connection is not returned: the next query gets a new one.
    let second = backend_pid(&pool).await.expect("a fresh connection");
    assert_ne!(second, first);
}
