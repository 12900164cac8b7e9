//! Postgres schema `catalog`: generations (a history of each server's
//! catalogs, each written once with its tools, prompts and resources),
//! sessions and their pins, and events.
//!
//! Migrations are tracked in `catalog._sqlx_migrations`, apart from the other
//! services' migration tables in the same database.

use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::Mutex;

use catalog_core::Transport;
use catalog_core::tools::{Catalog, Prompt, Resource, Tool};
use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::{PgConnection, PgPool, Row, SqlSafeStr};

pub use catalog_core::events::{NewEvent, PAYLOAD_VERSION, kinds};
use catalog_core::naming::NameRule;
pub use catalog_core::pins::{NewPin, PinSource, StoredPin};

pub fn migrator() -> Migrator {
    let mut migrator = Migrator::with_migrations(vec![
        Migration::new(
            1,
            Cow::Borrowed("catalog schema"),
            MigrationType::Simple,
            include_str!("../migrations/0001_catalog.sql").into_sql_str(),
            false,
        ),
        Migration::new(
            2,
            Cow::Borrowed("prompts and resources"),
            MigrationType::Simple,
            include_str!("../migrations/0002_prompts_resources.sql").into_sql_str(),
            false,
        ),
        Migration::new(
            3,
            Cow::Borrowed("a pin's naming rule"),
            MigrationType::Simple,
            include_str!("../migrations/0003_pin_naming.sql").into_sql_str(),
            false,
        ),
    ]);
    migrator.create_schema("catalog");
    migrator.dangerous_set_table_name("catalog._sqlx_migrations");
    migrator
}

pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    migrator().run(pool).await
}

/// A written event.
#[derive(Debug, Clone)]
pub struct StoredEvent {
    pub id: i64,
    pub occurred_at: DateTime<Utc>,
    pub event: NewEvent,
}

impl StoredEvent {
    pub fn to_proto(&self) -> ctxsync_proto::v1::CatalogEvent {
        ctxsync_proto::v1::CatalogEvent {
            id: self.id,
            kind: self.event.kind.to_owned(),
            tenant: self.event.tenant.clone(),
            session_id: self.event.session_id.clone().unwrap_or_default(),
            server_id: self.event.server_id.clone().unwrap_or_default(),
            payload_version: PAYLOAD_VERSION as u32,
            payload_json: self.event.payload.to_string(),
            occurred_at: Some(self.occurred_at.into()),
        }
    }
}

/// Inserts `events` in order, in one statement, each stamped with the
/// time of its insert.
pub async fn insert_events(
    conn: &mut PgConnection,
    events: Vec<NewEvent>,
) -> Result<Vec<StoredEvent>, sqlx::Error> {
    let occurred = vec![None; events.len()];
    insert_events_at(conn, events, &occurred).await
}

/// [`insert_events`], each event stamped with its own time where it has
/// one (an event queued before its write keeps when it happened).
pub async fn insert_events_at(
    conn: &mut PgConnection,
    events: Vec<NewEvent>,
    occurred: &[Option<DateTime<Utc>>],
) -> Result<Vec<StoredEvent>, sqlx::Error> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let columns = EventColumns::of(&events);
    let rows = columns
        .bind(sqlx::query(
            "INSERT INTO catalog.events
             (kind, tenant, session_id, server_id, payload_version, payload, occurred_at)
         SELECT e.kind, e.tenant, e.session_id, e.server_id, $6, e.payload,
                COALESCE(e.occurred_at, clock_timestamp())
         FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::jsonb[],
                     $7::timestamptz[])
              WITH ORDINALITY AS e(kind, tenant, session_id, server_id, payload, occurred_at, ord)
         ORDER BY e.ord
         RETURNING id, occurred_at",
        ))
        .bind(occurred)
        .fetch_all(&mut *conn)
        .await?;
    let written = rows
        .iter()
        .map(|r| Ok((r.try_get("id")?, r.try_get("occurred_at")?)))
        .collect::<Result<_, sqlx::Error>>()?;
    Ok(stored(events, written))
}

/// Events as the columns an `UNNEST` insert binds.
struct EventColumns<'a> {
    kinds: Vec<&'a str>,
    tenants: Vec<&'a str>,
    sessions: Vec<Option<&'a str>>,
    servers: Vec<Option<&'a str>>,
    payloads: Vec<Value>,
}

/// An `UNNEST` insert's query.
type Insert<'q> = sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>;

impl<'a> EventColumns<'a> {
    /// Binds the next six parameters: the five columns, then the payloads'
    /// version.
    fn bind<'q>(&'q self, query: Insert<'q>) -> Insert<'q> {
        query
            .bind(&self.kinds)
            .bind(&self.tenants)
            .bind(&self.sessions)
            .bind(&self.servers)
            .bind(&self.payloads)
            .bind(PAYLOAD_VERSION)
    }

    fn of(events: &'a [NewEvent]) -> Self {
        Self {
            kinds: events.iter().map(|e| e.kind).collect(),
            tenants: events.iter().map(|e| e.tenant.as_str()).collect(),
            sessions: events.iter().map(|e| e.session_id.as_deref()).collect(),
            servers: events.iter().map(|e| e.server_id.as_deref()).collect(),
            payloads: events.iter().map(|e| e.payload.clone()).collect(),
        }
    }
}

/// `events` with the ids and times their insert returned (in id order,
/// which is the insert's order).
fn stored(events: Vec<NewEvent>, mut written: Vec<(i64, DateTime<Utc>)>) -> Vec<StoredEvent> {
    written.sort_by_key(|(id, _)| *id);
    events
        .into_iter()
        .zip(written)
        .map(|(event, (id, occurred_at))| StoredEvent {
            id,
            occurred_at,
            event,
        })
        .collect()
}

/// A generation to write if the history lacks it.
#[derive(Debug, Clone)]
pub struct GenerationRef<'a> {
    /// The server key.
    pub key: &'a str,
    pub tenant: &'a str,
    pub server_id: &'a str,
    pub transport: Transport,
    pub catalog: &'a Catalog,
}

/// Writes a generation once: the row with `ON CONFLICT DO NOTHING`, and if
/// this call created it, its tools, prompts and resources (one statement
/// each). Returns whether it was new.
pub async fn write_generation(
    conn: &mut PgConnection,
    generation: &GenerationRef<'_>,
) -> Result<bool, sqlx::Error> {
    let inserted = sqlx::query(
        "INSERT INTO catalog.generations (server_key, catalog_hash, tenant, server_id, transport, tool_count)
         VALUES ($1, $2, $3, $4, $5, $6)
         ON CONFLICT (server_key, catalog_hash) DO NOTHING",
    )
    .bind(generation.key)
    .bind(&generation.catalog.hash)
    .bind(generation.tenant)
    .bind(generation.server_id)
    .bind(generation.transport.as_str())
    .bind(generation.catalog.tools.len() as i32)
    .execute(&mut *conn)
    .await?
    .rows_affected()
        == 1;
    if inserted && !generation.catalog.tools.is_empty() {
        let tools = &generation.catalog.tools;
        let names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
        let descriptions: Vec<&str> = tools.iter().map(|t| t.description.as_str()).collect();
        let schemas: Vec<&str> = tools.iter().map(|t| t.input_schema_json.as_str()).collect();
        sqlx::query(
            "INSERT INTO catalog.generation_tools
                 (server_key, catalog_hash, position, name, description, input_schema_json)
             SELECT $1, $2, (t.ord - 1)::integer, t.name, t.description, t.schema
             FROM UNNEST($3::text[], $4::text[], $5::text[])
                  WITH ORDINALITY AS t(name, description, schema, ord)",
        )
        .bind(generation.key)
        .bind(&generation.catalog.hash)
        .bind(&names)
        .bind(&descriptions)
        .bind(&schemas)
        .execute(&mut *conn)
        .await?;
    }
    if !inserted {
        return Ok(false);
    }
    let catalog = generation.catalog;
    let prompts = catalog
        .prompts
        .iter()
        .map(|p| (p.name.as_str(), p.declaration_json.as_str()));
    write_declarations(conn, generation, "generation_prompts", "name", prompts).await?;
    let resources = catalog
        .resources
        .iter()
        .map(|r| (r.uri.as_str(), r.declaration_json.as_str()));
    write_declarations(conn, generation, "generation_resources", "uri", resources).await?;
    Ok(true)
}

/// A generation's prompts or resources (`table`, keyed by `key_column`), in order.
async fn write_declarations<'a>(
    conn: &mut PgConnection,
    generation: &GenerationRef<'_>,
    table: &'static str,
    key_column: &'static str,
    items: impl Iterator<Item = (&'a str, &'a str)>,
) -> Result<(), sqlx::Error> {
    let (keys, declarations): (Vec<&str>, Vec<&str>) = items.unzip();
    if keys.is_empty() {
        return Ok(());
    }
    // Both names are this module's constants, never input.
    let statement = format!(
        "INSERT INTO catalog.{table} (server_key, catalog_hash, position, {key_column}, declaration_json)
         SELECT $1, $2, (d.ord - 1)::integer, d.key, d.declaration
         FROM UNNEST($3::text[], $4::text[]) WITH ORDINALITY AS d(key, declaration, ord)"
    );
    sqlx::query(sqlx::AssertSqlSafe(statement))
        .bind(generation.key)
        .bind(&generation.catalog.hash)
        .bind(&keys)
        .bind(&declarations)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Generations this process knows are in the history, so a preparation
/// skips even the no-op insert. Filled only after a commit.
#[derive(Debug, Default)]
pub struct WrittenGenerations(Mutex<HashSet<(String, String)>>);

impl WrittenGenerations {
    pub fn contains(&self, key: &str, hash: &str) -> bool {
        self.0
            .lock()
            .expect("generations lock")
            .contains(&(key.to_owned(), hash.to_owned()))
    }

    pub fn insert(&self, key: String, hash: String) {
        self.0.lock().expect("generations lock").insert((key, hash));
    }
}

/// Creates the session with its pins (in order) and its events (in order,
/// each stamped with the time of its insert) in ONE statement; `None`, and
/// nothing written, if the session exists (prepared before, or by a
/// concurrent request). One statement is atomic on its own: without
/// generations to write first, a preparation needs no `BEGIN`/`COMMIT`
/// round trips around it.
pub async fn insert_prepared(
    conn: &mut PgConnection,
    tenant: &str,
    session_id: &str,
    pins: &[NewPin<'_>],
    events: Vec<NewEvent>,
) -> Result<Option<Vec<StoredEvent>>, sqlx::Error> {
    let servers: Vec<&str> = pins.iter().map(|p| p.server_id).collect();
    let keys: Vec<&str> = pins.iter().map(|p| p.key).collect();
    let hashes: Vec<&str> = pins.iter().map(|p| p.catalog.hash.as_str()).collect();
    let transports: Vec<&str> = pins.iter().map(|p| p.transport.as_str()).collect();
    let sources: Vec<&str> = pins.iter().map(|p| p.source.as_str()).collect();
    let namings: Vec<String> = pins.iter().map(|p| p.naming.to_json()).collect();
    let columns = EventColumns::of(&events);
    // The pins' and events' inserts see no session row of their own
    // statement; they run only if the session's insert did. The foreign
    // keys are checked at the statement's end, with the session there.
    let query = sqlx::query(
        "WITH session AS (
             INSERT INTO catalog.sessions (tenant, session_id) VALUES ($1, $2)
             ON CONFLICT (tenant, session_id) DO NOTHING
             RETURNING 1
         ), pins AS (
             INSERT INTO catalog.pins
                 (tenant, session_id, position, server_id, server_key, catalog_hash, transport, source, naming_json)
             SELECT $1, $2, (p.ord - 1)::integer, p.server_id, p.server_key, p.catalog_hash, p.transport, p.source, p.naming_json
             FROM UNNEST($3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[])
                  WITH ORDINALITY AS p(server_id, server_key, catalog_hash, transport, source, naming_json, ord)
             WHERE EXISTS (SELECT 1 FROM session)
             ORDER BY p.ord
         ), events AS (
             INSERT INTO catalog.events
                 (kind, tenant, session_id, server_id, payload_version, payload, occurred_at)
             SELECT e.kind, e.tenant, e.session_id, e.server_id, $14, e.payload, clock_timestamp()
             FROM UNNEST($9::text[], $10::text[], $11::text[], $12::text[], $13::jsonb[])
                  WITH ORDINALITY AS e(kind, tenant, session_id, server_id, payload, ord)
             WHERE EXISTS (SELECT 1 FROM session)
             ORDER BY e.ord
             RETURNING id, occurred_at
         )
         SELECT created.n AS created, events.id, events.occurred_at
         FROM (SELECT count(*) AS n FROM session) AS created
         LEFT JOIN events ON true",
    )
    .bind(tenant)
    .bind(session_id)
    .bind(&servers)
    .bind(&keys)
    .bind(&hashes)
    .bind(&transports)
    .bind(&sources)
    .bind(&namings);
    let rows = columns.bind(query).fetch_all(&mut *conn).await?;
    let created = match rows.first() {
        Some(row) => row.try_get::<i64, _>("created")? == 1,
        None => false,
    };
    if !created {
        return Ok(None);
    }
    let mut written = Vec::with_capacity(events.len());
    for row in &rows {
        if let Some(id) = row.try_get::<Option<i64>, _>("id")? {
            written.push((id, row.try_get("occurred_at")?));
        }
    }
    Ok(Some(stored(events, written)))
}

/// The session's pins in configured order; `None` if the session was never prepared.
pub async fn load_pins(
    pool: &PgPool,
    tenant: &str,
    session_id: &str,
) -> Result<Option<Vec<StoredPin>>, sqlx::Error> {
    let exists =
        sqlx::query("SELECT 1 FROM catalog.sessions WHERE tenant = $1 AND session_id = $2")
            .bind(tenant)
            .bind(session_id)
            .fetch_optional(pool)
            .await?
            .is_some();
    if !exists {
        return Ok(None);
    }
    let rows = sqlx::query(
        "SELECT p.server_id, p.server_key, p.catalog_hash, p.transport, p.source, p.naming_json,
                t.name, t.description, t.input_schema_json
         FROM catalog.pins p
         LEFT JOIN catalog.generation_tools t
           ON t.server_key = p.server_key AND t.catalog_hash = p.catalog_hash
         WHERE p.tenant = $1 AND p.session_id = $2
         ORDER BY p.position, t.position",
    )
    .bind(tenant)
    .bind(session_id)
    .fetch_all(pool)
    .await?;
    let mut pins: Vec<StoredPin> = Vec::new();
    for row in rows {
        let server_id: String = row.try_get("server_id")?;
        if pins.last().is_none_or(|p| p.server_id != server_id) {
            let naming: Option<String> = row.try_get("naming_json")?;
            pins.push(StoredPin {
                naming: NameRule::from_json(naming.as_deref(), &server_id),
                server_id,
                server_key: row.try_get("server_key")?,
                transport: row.try_get("transport")?,
                source: PinSource::parse(row.try_get::<&str, _>("source")?),
                catalog: Catalog {
                    tools: Vec::new(),
                    prompts: Vec::new(),
                    resources: Vec::new(),
                    hash: row.try_get("catalog_hash")?,
                },
            });
        }
        let name: Option<String> = row.try_get("name")?;
        if let (Some(name), Some(pin)) = (name, pins.last_mut()) {
            pin.catalog.tools.push(Tool {
                name,
                description: row.try_get("description")?,
                input_schema_json: row.try_get("input_schema_json")?,
            });
        }
    }
    load_declarations(pool, tenant, session_id, &mut pins).await?;
    Ok(Some(pins))
}

/// The pinned generations' prompts and resources, into `pins`.
async fn load_declarations(
    pool: &PgPool,
    tenant: &str,
    session_id: &str,
    pins: &mut [StoredPin],
) -> Result<(), sqlx::Error> {
    let rows = sqlx::query(
        "SELECT p.server_id, 'prompt' AS kind, d.name AS key, d.declaration_json, d.position
         FROM catalog.pins p
         JOIN catalog.generation_prompts d
           ON d.server_key = p.server_key AND d.catalog_hash = p.catalog_hash
         WHERE p.tenant = $1 AND p.session_id = $2
         UNION ALL
         SELECT p.server_id, 'resource', d.uri, d.declaration_json, d.position
         FROM catalog.pins p
         JOIN catalog.generation_resources d
           ON d.server_key = p.server_key AND d.catalog_hash = p.catalog_hash
         WHERE p.tenant = $1 AND p.session_id = $2
         ORDER BY 1, 2, 5",
    )
    .bind(tenant)
    .bind(session_id)
    .fetch_all(pool)
    .await?;
    for row in rows {
        let server_id: &str = row.try_get("server_id")?;
        let Some(pin) = pins.iter_mut().find(|p| p.server_id == server_id) else {
            continue;
        };
        let key: String = row.try_get("key")?;
        let declaration_json: String = row.try_get("declaration_json")?;
        if row.try_get::<&str, _>("kind")? == "prompt" {
            pin.catalog
                .prompts
                .push(Prompt::declared(key, declaration_json));
        } else {
            pin.catalog
                .resources
                .push(Resource::declared(key, declaration_json));
        }
    }
    Ok(())
}
