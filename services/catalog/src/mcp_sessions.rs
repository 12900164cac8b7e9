//! The MCP endpoint's sessions: rmcp's in-process session manager, with
//! what a tenant's session needs besides
//! (design note: the catalog as an MCP server).
//!
//! * **Owned from creation.** A session is registered with the caller of the
//!   request that creates it (`initialize`), before its id is answered to
//!   anyone; [`McpSessions::owner`] is what the key check compares with.
//! * **Bounded.** A request that may create a session first takes a
//!   [`Reservation`] under the key's and the tenant's bounds; the session
//!   created keeps it until it ends (DELETE, idle expiry, shutdown,
//!   revocation), a request that creates none gives it back.
//! * **Revocation ends it.** Each session follows its key
//!   ([`TenantKeys::until_revoked`]) and is closed the moment the key is
//!   revoked; its streams end with it (`ended`).
//! * **Restorable.** With a [`StoredSessions`] bucket, a session another
//!   replica started is restored here under a reservation like a created
//!   one (`restore_session`); an end on purpose forgets it there too, a
//!   shutdown does not.
//! * **Idle ends it.** A session nobody asked anything for
//!   [`SessionLimits::idle`], with no request in flight, is closed. The
//!   endpoint marks each request of a session ([`Activity::begin`]),
//!   whoever answers it: rmcp's session worker or the endpoint itself
//!   (`endpoint::direct`), which the worker's own idle clock would not see.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::time::Instant;

use ctxsync_runtime::tenant_keys::{Caller, TenantKeys};
use futures::Stream;
use rmcp::model::{ClientJsonRpcMessage, ServerJsonRpcMessage};
use rmcp::transport::streamable_http_server::session::local::{
    LocalSessionManager, LocalSessionManagerError,
};
use rmcp::transport::streamable_http_server::session::{
    RestoreOutcome, ServerSseMessage, SessionId, SessionManager,
};
use tokio_util::sync::CancellationToken;

use crate::mcp_store::StoredSessions;

/// The MCP session id, put into the `initialize` request's extensions (the
/// client's and a restore's replay alike): the catalog session is named
/// after it, so a restore on another replica finds the same pins.
#[derive(Debug, Clone)]
pub(crate) struct McpSessionId(pub SessionId);

/// How many MCP sessions a key and a tenant may hold, and their idle expiry
/// (the defaults are the catalog's flags': `Settings::default().mcp_sessions`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionLimits {
    pub per_key: usize,
    pub per_tenant: usize,
    pub idle: Duration,
}

/// Which bound refused a new session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Full {
    Key(usize),
    Tenant(usize),
}

impl Full {
    /// The refusal's metric label.
    pub fn reason(self) -> &'static str {
        match self {
            Self::Key(_) => "sessions_per_key",
            Self::Tenant(_) => "sessions_per_tenant",
        }
    }

    /// The bound's setting, as `HttpError.limit` names it (chat-gate's 429s do the same).
    pub fn limit(self) -> &'static str {
        match self {
            Self::Key(_) => "CTXSYNC_CATALOG_MCP_MAX_SESSIONS_PER_KEY",
            Self::Tenant(_) => "CTXSYNC_CATALOG_MCP_MAX_SESSIONS_PER_TENANT",
        }
    }

    pub fn message(self) -> String {
        match self {
            Self::Key(max) => format!(
                "this tenant key already holds its maximum of {max} open MCP sessions; end one (DELETE) or wait for one to expire"
            ),
            Self::Tenant(max) => format!(
                "this tenant already holds its maximum of {max} open MCP sessions; end one (DELETE) or wait for one to expire"
            ),
        }
    }
}

/// A session's owner, and the signal of its end.
#[derive(Debug, Clone)]
pub(crate) struct Owner {
    pub caller: Caller,
    /// Cancelled when the session ends: its streams end with it.
    pub ended: CancellationToken,
    /// When it was last asked something, and what it is asked now.
    pub activity: Arc<Activity>,
}

/// A session's requests, for its idle expiry.
#[derive(Debug)]
pub(crate) struct Activity {
    last: Mutex<Instant>,
    in_flight: AtomicUsize,
}

impl Activity {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            last: Mutex::new(Instant::now()),
            in_flight: AtomicUsize::new(0),
        })
    }

    fn touch(&self) {
        *self.last.lock().expect("activity lock") = Instant::now();
    }

    /// A request of the session, in flight until the guard drops.
    pub fn begin(self: &Arc<Self>) -> Busy {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        self.touch();
        Busy(self.clone())
    }

    /// Whether nothing is in flight and nothing was asked for `idle`.
    fn idle_for(&self, idle: Duration) -> bool {
        self.in_flight.load(Ordering::SeqCst) == 0
            && self.last.lock().expect("activity lock").elapsed() >= idle
    }
}

/// A request in flight of a session (see [`Activity::begin`]).
#[derive(Debug)]
pub(crate) struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.touch();
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

#[derive(Default)]
struct Registry {
    sessions: HashMap<SessionId, Owner>,
    /// Sessions and reservations held, by key id and by tenant.
    per_key: HashMap<String, usize>,
    per_tenant: HashMap<String, usize>,
}

impl Registry {
    fn release(&mut self, caller: &Caller) {
        for (map, id) in [
            (&mut self.per_key, &caller.key_id),
            (&mut self.per_tenant, &caller.tenant),
        ] {
            if let Some(count) = map.get_mut(id) {
                *count -= 1;
                if *count == 0 {
                    map.remove(id);
                }
            }
        }
    }
}

/// A place for one session under its key's and tenant's bounds, taken
/// before the request that may create it; given back at its drop unless a
/// session took it.
pub(crate) struct Reservation {
    sessions: Arc<McpSessions>,
    caller: Caller,
    /// The key itself, to check it again after a gap in the revocation events.
    key: String,
    taken: bool,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.taken {
            self.sessions.registry().release(&self.caller);
        }
    }
}

tokio::task_local! {
    /// The reservation of the request being served, for `create_session`
    /// (which rmcp calls within that request, with no argument).
    static CREATING: Mutex<Option<Reservation>>;
}

/// The reservation of the request creating or restoring a session.
fn admitted() -> Result<Reservation, McpSessionsError> {
    CREATING
        .try_with(|slot| slot.lock().expect("reservation lock").take())
        .ok()
        .flatten()
        .ok_or(McpSessionsError::NotAdmitted)
}

/// Serves `request` with `reservation` available to the session it creates.
pub(crate) async fn creating<F: Future>(reservation: Reservation, request: F) -> F::Output {
    CREATING.scope(Mutex::new(Some(reservation)), request).await
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum McpSessionsError {
    #[error(transparent)]
    Local(#[from] LocalSessionManagerError),
    #[error("a session is created only by a request admitted under the session bounds")]
    NotAdmitted,
}

/// The endpoint's session manager.
pub(crate) struct McpSessions {
    inner: LocalSessionManager,
    keys: TenantKeys,
    limits: SessionLimits,
    registry: Mutex<Registry>,
    /// This manager, for the tasks that follow a session's key.
    me: Weak<McpSessions>,
    /// Where sessions are kept for other replicas (`None`: this one only).
    stored: Option<Arc<StoredSessions>>,
    /// Cancelled at shutdown: sessions closed then stay stored.
    stopping: CancellationToken,
}

impl McpSessions {
    pub fn new(
        keys: TenantKeys,
        limits: SessionLimits,
        store: Option<impl FnOnce(crate::mcp_store::Owners) -> StoredSessions>,
        stopping: CancellationToken,
    ) -> Arc<Self> {
        let mut inner = LocalSessionManager::default();
        // Idle sessions are closed here (`expire_idle`): the worker would not
        // see the calls the endpoint answers itself.
        inner.session_config.keep_alive = None;
        let sessions = Arc::new_cyclic(|me| Self {
            inner,
            keys,
            limits,
            registry: Mutex::default(),
            me: me.clone(),
            stored: store.map(|store| {
                let me = me.clone();
                Arc::new(store(Box::new(move |id: &str| {
                    me.upgrade()?.owner(id).map(|owner| owner.caller)
                })))
            }),
            stopping,
        });
        tokio::spawn(expire_idle(Arc::downgrade(&sessions)));
        sessions
    }

    /// The bucket sessions are kept in for other replicas, if any.
    pub fn stored(&self) -> Option<Arc<StoredSessions>> {
        self.stored.clone()
    }

    /// The owner of a session another replica stored.
    pub async fn stored_owner(&self, id: &str) -> Option<Caller> {
        self.stored.as_ref()?.owner_of(id).await
    }

    fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.registry.lock().expect("mcp sessions lock")
    }

    /// A place for a session of `caller`, or the bound that refuses it.
    pub fn reserve(self: &Arc<Self>, caller: &Caller, key: &str) -> Result<Reservation, Full> {
        let mut registry = self.registry();
        let by_key = registry.per_key.get(&caller.key_id).copied().unwrap_or(0);
        if by_key >= self.limits.per_key {
            return Err(Full::Key(self.limits.per_key));
        }
        let by_tenant = registry
            .per_tenant
            .get(&caller.tenant)
            .copied()
            .unwrap_or(0);
        if by_tenant >= self.limits.per_tenant {
            return Err(Full::Tenant(self.limits.per_tenant));
        }
        *registry.per_key.entry(caller.key_id.clone()).or_default() += 1;
        *registry
            .per_tenant
            .entry(caller.tenant.clone())
            .or_default() += 1;
        Ok(Reservation {
            sessions: self.clone(),
            caller: caller.clone(),
            key: key.to_owned(),
            taken: false,
        })
    }

    /// The owner of a live session.
    pub fn owner(&self, id: &str) -> Option<Owner> {
        self.registry().sessions.get(id).cloned()
    }

    /// Sessions open now (all tenants).
    pub fn open(&self) -> usize {
        self.registry().sessions.len()
    }

    /// Registers session `id` under `reservation` and follows its key.
    fn register(&self, id: &SessionId, mut reservation: Reservation) {
        reservation.taken = true;
        let owner = Owner {
            caller: reservation.caller.clone(),
            ended: CancellationToken::new(),
            activity: Activity::new(),
        };
        self.registry().sessions.insert(id.clone(), owner.clone());
        let key = std::mem::take(&mut reservation.key);
        let Some(sessions) = self.me.upgrade() else {
            return;
        };
        let id = id.clone();
        tokio::spawn(async move {
            let keys = sessions.keys.clone();
            let revoked = keys.until_revoked(&owner.caller, &key);
            tokio::pin!(revoked);
            // Subscribed to the revocations first, then the key checked once:
            // a revocation between the request's check and now is not missed.
            let early = futures::poll!(&mut revoked).is_ready()
                || keys
                    .authenticate(Some(&format!("Bearer {key}")))
                    .await
                    .is_err_and(|e| e == ctxsync_runtime::tenant_keys::AuthError::Unknown);
            if !early {
                tokio::select! {
                    () = &mut revoked => {}
                    () = owner.ended.cancelled() => return,
                }
            }
            metrics::counter!("ctxsync_catalog_mcp_sessions_revoked_total").increment(1);
            tracing::info!(
                tenant = %owner.caller.tenant, key_id = %owner.caller.key_id, mcp_session = %id,
                "mcp session ended: its tenant key was revoked"
            );
            if let Err(error) = sessions.close_session(&id).await {
                tracing::warn!(%error, mcp_session = %id, "cannot close a revoked key's mcp session");
            }
        });
    }

    /// Forgets session `id`: its place is given back and its streams end.
    fn forget(&self, id: &SessionId) {
        let mut registry = self.registry();
        if let Some(owner) = registry.sessions.remove(id) {
            registry.release(&owner.caller);
            owner.ended.cancel();
        }
    }
}

/// Closes the sessions idle for the idle bound, a few times per bound,
/// until the manager goes or stops.
async fn expire_idle(sessions: Weak<McpSessions>) {
    let Some((idle, stopping)) = sessions
        .upgrade()
        .map(|s| (s.limits.idle, s.stopping.clone()))
    else {
        return;
    };
    let every = (idle / 4).clamp(Duration::from_millis(50), Duration::from_secs(30));
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stopping.cancelled() => return,
            _ = ticks.tick() => {}
        }
        let Some(sessions) = sessions.upgrade() else {
            return;
        };
        let expired: Vec<SessionId> = sessions
            .registry()
            .sessions
            .iter()
            .filter(|(_, owner)| owner.activity.idle_for(idle))
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            metrics::counter!("ctxsync_catalog_mcp_sessions_idle_total").increment(1);
            tracing::info!(mcp_session = %id, idle_s = idle.as_secs_f64(), "mcp session ended: idle");
            if let Err(error) = sessions.close_session(&id).await {
                tracing::warn!(%error, mcp_session = %id, "cannot close an idle mcp session");
            }
        }
    }
}

impl SessionManager for McpSessions {
    type Error = McpSessionsError;
    type Transport = <LocalSessionManager as SessionManager>::Transport;

    async fn create_session(&self) -> Result<(SessionId, Self::Transport), Self::Error> {
        let reservation = admitted()?;
        let (id, transport) = self.inner.create_session().await?;
        self.register(&id, reservation);
        Ok((id, transport))
    }

    /// A session another replica started, under the request's reservation.
    async fn restore_session(
        &self,
        id: SessionId,
    ) -> Result<RestoreOutcome<Self::Transport>, Self::Error> {
        let reservation = admitted()?;
        let outcome = self.inner.restore_session(id.clone()).await?;
        if matches!(outcome, RestoreOutcome::Restored(_)) {
            metrics::counter!("ctxsync_catalog_mcp_sessions_restored_total").increment(1);
            self.register(&id, reservation);
        }
        Ok(outcome)
    }

    async fn initialize_session(
        &self,
        id: &SessionId,
        mut message: ClientJsonRpcMessage,
    ) -> Result<ServerJsonRpcMessage, Self::Error> {
        message.insert_extension(McpSessionId(id.clone()));
        Ok(self.inner.initialize_session(id, message).await?)
    }

    async fn has_session(&self, id: &SessionId) -> Result<bool, Self::Error> {
        Ok(self.inner.has_session(id).await?)
    }

    /// Every end of a session comes here: DELETE, the worker's end (idle
    /// expiry, shutdown) and a revocation.
    async fn close_session(&self, id: &SessionId) -> Result<(), Self::Error> {
        self.forget(id);
        if let Some(stored) = &self.stored
            && !self.stopping.is_cancelled()
        {
            stored.forget(id).await;
        }
        Ok(self.inner.close_session(id).await?)
    }

    async fn create_stream(
        &self,
        id: &SessionId,
        message: ClientJsonRpcMessage,
    ) -> Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error> {
        Ok(self.inner.create_stream(id, message).await?)
    }

    async fn accept_message(
        &self,
        id: &SessionId,
        message: ClientJsonRpcMessage,
    ) -> Result<(), Self::Error> {
        Ok(self.inner.accept_message(id, message).await?)
    }

    async fn create_standalone_stream(
        &self,
        id: &SessionId,
    ) -> Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error> {
        Ok(self.inner.create_standalone_stream(id).await?)
    }

    async fn resume(
        &self,
        id: &SessionId,
        last_event_id: String,
    ) -> Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error> {
        Ok(self.inner.resume(id, last_event_id).await?)
    }
}
