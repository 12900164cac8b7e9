use sqlx::{Connection, Executor, PgConnection};

const DEFAULT_ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// A Postgres database created for one test and dropped with the handle.
pub struct TestDatabase {
    admin_url: String,
    name: String,
    url: String,
}

fn admin_url() -> String {
    std::env::var("CTXSYNC_TEST_DATABASE_URL").unwrap_or_else(|_| DEFAULT_ADMIN_URL.to_owned())
}

impl TestDatabase {
    /// Creates an empty database (migrations are the service's to apply).
    pub async fn create() -> Self {
        ctxsync_tls::install_default_provider();
        let admin_url = admin_url();
        let mut admin = PgConnection::connect(&admin_url)
            .await
            .unwrap_or_else(|error| {
                panic!(
                    "cannot connect to Postgres at {admin_url} ({error}): start Postgres \
                 (Debian: apt-get install postgresql) or set CTXSYNC_TEST_DATABASE_URL \
                 to a superuser URL"
                )
            });
        let name = format!("ctxsync_test_{}", uuid::Uuid::new_v4().simple());
        admin
            .execute(sqlx::AssertSqlSafe(format!(r#"CREATE DATABASE "{name}""#)))
            .await
            .unwrap_or_else(|error| panic!("cannot create test database {name}: {error}"));
        let _ = admin.close().await;
        let url = ctxsync_stack::deps::with_database(&admin_url, &name);
        Self {
            admin_url,
            name,
            url,
        }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let admin_url = self.admin_url.clone();
        let name = self.name.clone();
        // Drop runs inside the test's runtime: use a thread with its own.
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("tokio runtime");
            runtime.block_on(async move {
                if let Ok(mut admin) = PgConnection::connect(&admin_url).await {
                    let _ = admin
                        .execute(sqlx::AssertSqlSafe(format!(
                            r#"DROP DATABASE IF EXISTS "{name}" WITH (FORCE)"#
                        )))
                        .await;
                    let _ = admin.close().await;
                }
            });
        });
        let _ = dropped.join();
    }
}
