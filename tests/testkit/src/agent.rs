//! A fake workspace agent: Startup and pushes over HTTP to agent-ingest with
//! a real agent token (registered through the store), recording per request
//! what was sent and what was answered, so a test can compare what was
//! acknowledged with what Postgres holds ([`stored_agents`]).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ctxsync_proto::Message;
use ctxsync_proto::v1::mcp_discovery::Phase;
use ctxsync_proto::v1::{
    PushContextStateRequest, PushContextStateResponse, StartupDropReason, StartupRequest,
    StartupResponse,
};
use sqlx::{PgPool, Row};

use crate::store::StoreClient;

/// What agent-ingest answered one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// 2xx, and the store applied it.
    Accepted,
    /// 2xx, and the store dropped it (the drop reason's name).
    Dropped(String),
    /// 4xx, with the body.
    ClientError(u16, String),
    /// 5xx, with the body.
    ServerError(u16, String),
    /// No HTTP answer at all.
    Transport(String),
}

impl Answer {
    pub fn is_accepted(&self) -> bool {
        matches!(self, Self::Accepted)
    }

    /// Short label for tallies.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Accepted => "accepted",
            Self::Dropped(_) => "dropped",
            Self::ClientError(..) => "4xx",
            Self::ServerError(..) => "5xx",
            Self::Transport(_) => "transport",
        }
    }
}

/// Which endpoint a request went to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Startup,
    Push,
}

/// One request and its answer.
#[derive(Debug, Clone)]
pub struct Sent {
    pub kind: Kind,
    pub run_id: String,
    /// The push's version (0 for a startup).
    pub version: u64,
    pub initial: bool,
    pub phase: Phase,
    /// The trace id it carried in `traceparent` (the services log it).
    pub trace_id: String,
    pub started: Instant,
    pub elapsed: Duration,
    pub answer: Answer,
}

/// One agent's client of agent-ingest. Not `Clone`: one history per agent.
pub struct FakeAgent {
    http: reqwest::Client,
    ingest: String,
    token: String,
    agent_id: String,
    run_id: String,
    history: Vec<Sent>,
}

fn random_hex(bytes: usize) -> String {
    let mut out = String::with_capacity(bytes * 2);
    while out.len() < bytes * 2 {
        out.push_str(&uuid::Uuid::new_v4().simple().to_string());
    }
    out.truncate(bytes * 2);
    out
}

impl FakeAgent {
    /// Registers agent `name` through `store` with a fresh token and a fresh
    /// run id; talks to agent-ingest at `ingest_url` (`http://host:port`).
    pub async fn register(store: &StoreClient, ingest_url: &str, name: &str) -> Self {
        let token = format!("fake-agent-{}", random_hex(16));
        let agent_id = store.register(name, &token).await;
        Self::with_token(ingest_url, &agent_id, &token)
    }

    /// A client of an agent registered elsewhere (e.g. a second process of it).
    pub fn with_token(ingest_url: &str, agent_id: &str, token: &str) -> Self {
        ctxsync_tls::install_default_provider();
        Self {
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()
                .expect("http client"),
            ingest: ingest_url.trim_end_matches('/').to_owned(),
            token: token.to_owned(),
            agent_id: agent_id.to_owned(),
            run_id: uuid::Uuid::new_v4().to_string(),
            history: Vec::new(),
        }
    }

    pub fn agent_id(&self) -> &str {
        &self.agent_id
    }

    pub fn token(&self) -> &str {
        &self.token
    }

    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// Acts as another process of the same agent from now on.
    pub fn set_run_id(&mut self, run_id: &str) {
        self.run_id = run_id.to_owned();
    }

    /// Every request so far, in order.
    pub fn history(&self) -> &[Sent] {
        &self.history
    }

    pub fn into_history(self) -> Vec<Sent> {
        self.history
    }

    /// The Startup of the current run id.
    pub async fn startup(&mut self) -> &Sent {
        self.startup_request(false).await
    }

    /// The Startup of a live process taking its agent back from a run that
    /// replaced it (told so by a `STALE_RUN` or `SUPERSEDED_RUN` drop).
    pub async fn reclaim(&mut self) -> &Sent {
        self.startup_request(true).await
    }

    async fn startup_request(&mut self, reclaim: bool) -> &Sent {
        let request = StartupRequest {
            agent_run_id: self.run_id.clone(),
            agent_version: "fake-agent".into(),
            reclaim,
        };
        let (trace_id, started, result) = self.post("/api/v1/agent/startup", &request).await;
        let answer = result.map_or_else(
            |answer| answer,
            |body| match StartupResponse::decode(body.as_slice()) {
                Ok(response) if response.drop_reason() == StartupDropReason::Unspecified => {
                    Answer::Accepted
                }
                Ok(response) => Answer::Dropped(response.drop_reason().as_str_name().to_owned()),
                Err(error) => Answer::Transport(format!("undecodable startup answer: {error}")),
            },
        );
        let run_id = self.run_id.clone();
        self.record(
            Kind::Startup,
            run_id,
            (0, false, Phase::Unspecified),
            trace_id,
            started,
            answer,
        )
    }

    /// Pushes `push` as it is (its run id included).
    pub async fn push(&mut self, push: &PushContextStateRequest) -> &Sent {
        let (trace_id, started, result) = self.post("/api/v1/agent/context-state", push).await;
        let answer = result.map_or_else(
            |answer| answer,
            |body| match PushContextStateResponse::decode(body.as_slice()) {
                Ok(response) if response.accepted => Answer::Accepted,
                Ok(response) => Answer::Dropped(response.drop_reason().as_str_name().to_owned()),
                Err(error) => Answer::Transport(format!("undecodable push answer: {error}")),
            },
        );
        let phase = push
            .mcp_discovery
            .as_ref()
            .and_then(|d| Phase::try_from(d.phase).ok())
            .unwrap_or(Phase::Unspecified);
        // The push may name another run than the client's own.
        self.record(
            Kind::Push,
            push.agent_run_id.clone(),
            (push.version, push.initial, phase),
            trace_id,
            started,
            answer,
        )
    }

    fn record(
        &mut self,
        kind: Kind,
        run_id: String,
        (version, initial, phase): (u64, bool, Phase),
        trace_id: String,
        started: Instant,
        answer: Answer,
    ) -> &Sent {
        self.history.push(Sent {
            kind,
            run_id,
            version,
            initial,
            phase,
            trace_id,
            started,
            elapsed: started.elapsed(),
            answer,
        });
        self.history.last().expect("just pushed")
    }

    /// One protobuf POST with a fresh trace: the 2xx body, or the answer it was.
    async fn post(
        &self,
        path: &str,
        message: &impl Message,
    ) -> (String, Instant, Result<Vec<u8>, Answer>) {
        let trace_id = random_hex(16);
        let traceparent = format!("00-{trace_id}-{}-01", random_hex(8));
        let started = Instant::now();
        let sent = self
            .http
            .post(format!("{}{path}", self.ingest))
            .header(reqwest::header::CONTENT_TYPE, "application/x-protobuf")
            .header(reqwest::header::ACCEPT, "application/x-protobuf")
            .header("traceparent", traceparent)
            .bearer_auth(&self.token)
            .body(message.encode_to_vec())
            .send()
            .await;
        let result = match sent {
            Err(error) => Err(Answer::Transport(error.to_string())),
            Ok(response) => {
                let status = response.status();
                match response.bytes().await {
                    Err(error) => Err(Answer::Transport(error.to_string())),
                    Ok(body) if status.is_success() => Ok(body.to_vec()),
                    Ok(body) => {
                        let text = String::from_utf8_lossy(&body).into_owned();
                        if status.is_client_error() {
                            Err(Answer::ClientError(status.as_u16(), text))
                        } else {
                            Err(Answer::ServerError(status.as_u16(), text))
                        }
                    }
                }
            }
        };
        (trace_id, started, result)
    }
}

/// An agent's row and snapshot as Postgres holds them (schema `snapshot`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredAgent {
    pub revision: i64,
    pub agent_run_id: String,
    pub snapshot: Option<StoredSnapshot>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredSnapshot {
    pub agent_run_id: String,
    pub version: i64,
    /// `unspecified`, `pending` or `complete`.
    pub phase: String,
    /// The `warning` of each of its resources, in order (tests use it to tag
    /// which push wrote them).
    pub resource_warnings: Vec<String>,
}

/// The stored state of `agent_ids` (unknown ids are left out), read directly
/// from Postgres.
pub async fn stored_agents(
    pool: &PgPool,
    agent_ids: &[String],
) -> Result<HashMap<String, StoredAgent>, sqlx::Error> {
    let ids: Vec<uuid::Uuid> = agent_ids
        .iter()
        .filter_map(|id| uuid::Uuid::parse_str(id).ok())
        .collect();
    let rows = sqlx::query(
        "SELECT a.agent_id, a.revision, a.agent_run_id,
                s.agent_run_id AS snapshot_run_id, s.version, s.phase,
                COALESCE((SELECT array_agg(r.warning ORDER BY r.position)
                          FROM snapshot.resources r WHERE r.agent_id = a.agent_id),
                         '{}') AS warnings
         FROM snapshot.agents a LEFT JOIN snapshot.snapshots s USING (agent_id)
         WHERE a.agent_id = ANY($1)",
    )
    .bind(&ids)
    .fetch_all(pool)
    .await?;
    let mut stored = HashMap::with_capacity(rows.len());
    for row in rows {
        let agent_id: uuid::Uuid = row.try_get("agent_id")?;
        let version: Option<i64> = row.try_get("version")?;
        let snapshot = match version {
            Some(version) => Some(StoredSnapshot {
                agent_run_id: row.try_get("snapshot_run_id")?,
                version,
                phase: row.try_get("phase")?,
                resource_warnings: row.try_get("warnings")?,
            }),
            None => None,
        };
        stored.insert(
            agent_id.to_string(),
            StoredAgent {
                revision: row.try_get("revision")?,
                agent_run_id: row.try_get("agent_run_id")?,
                snapshot,
            },
        );
    }
    Ok(stored)
}
