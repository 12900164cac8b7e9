//! Events: written to `catalog.events`, then published on
//! `<prefix>.events.catalog.<kind>`; and which generations this process
//! knows are written.

use ctxsync_proto::subjects::Subjects;
use prost::Message;
use sqlx::{PgConnection, PgPool};

use crate::store::{self, GenerationRef, NewEvent, StoredEvent, WrittenGenerations};

/// Stores and publishes events; remembers the generations written.
pub(crate) struct Events {
    pool: PgPool,
    nats: async_nats::Client,
    subjects: Subjects,
    written: WrittenGenerations,
}

impl Events {
    pub fn new(pool: PgPool, nats: async_nats::Client, subjects: Subjects) -> Self {
        Self {
            pool,
            nats,
            subjects,
            written: WrittenGenerations::default(),
        }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Publishes committed events; a failure is logged (the events are
    /// stored either way).
    pub async fn publish(&self, events: &[StoredEvent]) {
        for event in events {
            let subject = self.subjects.catalog_event(event.event.kind);
            let payload = event.to_proto().encode_to_vec();
            if let Err(error) = self.nats.publish(subject, payload.into()).await {
                tracing::warn!(%error, kind = event.event.kind, "cannot publish a catalog event");
            }
        }
    }

    /// Stores `events` in one statement outside any transaction, then
    /// publishes them.
    pub async fn record(&self, events: Vec<NewEvent>) -> Result<(), sqlx::Error> {
        let mut conn = self.pool.acquire().await?;
        let written = store::insert_events(&mut conn, events).await?;
        self.publish(&written).await;
        Ok(())
    }

    /// Writes `generation` (in the caller's transaction) unless this process
    /// knows it is written.
    pub async fn write_generation(
        &self,
        conn: &mut PgConnection,
        generation: &GenerationRef<'_>,
    ) -> Result<(), sqlx::Error> {
        if self
            .written
            .contains(generation.key, &generation.catalog.hash)
        {
            return Ok(());
        }
        store::write_generation(conn, generation).await.map(|_| ())
    }

    /// The transaction that wrote (or found) the generation committed.
    pub fn generation_committed(&self, key: &str, hash: &str) {
        self.written.insert(key.to_owned(), hash.to_owned());
    }
}
