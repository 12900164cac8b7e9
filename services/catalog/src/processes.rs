//! The bounds on the server processes a replica runs for sessions: in all
//! and per tenant, so that one tenant at its bound never takes another's
//! places. A process holds its [`Place`] while it runs (a shared process
//! holds one for all its sessions).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// A running process's places under the bounds, given back at its drop.
#[derive(Debug)]
pub(crate) struct Place {
    _total: Option<OwnedSemaphorePermit>,
    _tenant: Option<OwnedSemaphorePermit>,
}

/// Why a process cannot start now: the answer's message names the bound.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Refusal {
    #[error(
        "this catalog replica already runs its maximum of {0} server processes (--max-server-processes); retry when a session ends"
    )]
    Total(usize),
    #[error(
        "this tenant already runs its maximum of {0} server processes on this catalog replica (--max-server-processes-per-tenant); retry when one of its sessions ends"
    )]
    Tenant(usize),
}

impl Refusal {
    fn label(&self) -> &'static str {
        match self {
            Self::Total(_) => "total",
            Self::Tenant(_) => "tenant",
        }
    }
}

/// The bounds (`None`: not bounded).
pub(crate) struct ProcessBound {
    total: Option<(usize, Arc<Semaphore>)>,
    per_tenant: Option<usize>,
    tenants: Mutex<HashMap<String, Arc<Semaphore>>>,
}

impl ProcessBound {
    pub fn new(total: Option<usize>, per_tenant: Option<usize>) -> Self {
        Self {
            total: total.map(|max| (max, Arc::new(Semaphore::new(max)))),
            per_tenant,
            tenants: Mutex::default(),
        }
    }

    /// Places taken now under the replica's bound (under the tenants' when
    /// there is none).
    pub fn in_use(&self) -> usize {
        match &self.total {
            Some((max, permits)) => max - permits.available_permits(),
            None => self.per_tenant.map_or(0, |max| {
                let tenants = self.tenants.lock().expect("process bound lock");
                tenants.values().map(|p| max - p.available_permits()).sum()
            }),
        }
    }

    /// Places taken now by `tenant`'s processes (0 without a tenant bound).
    pub fn in_use_by(&self, tenant: &str) -> usize {
        let Some(max) = self.per_tenant else {
            return 0;
        };
        let tenants = self.tenants.lock().expect("process bound lock");
        tenants
            .get(tenant)
            .map_or(0, |p| max - p.available_permits())
    }

    /// A process's places for `tenant`, or which bound refuses it. The
    /// tenant's bound is checked first: a tenant at its own bound takes no
    /// place of the replica's.
    pub fn take(&self, tenant: &str) -> Result<Place, Refusal> {
        let result = self.try_take(tenant);
        if let Err(refusal) = &result {
            metrics::counter!("ctxsync_catalog_process_limit_refusals_total", "bound" => refusal.label())
                .increment(1);
        }
        result
    }

    fn try_take(&self, tenant: &str) -> Result<Place, Refusal> {
        let tenant_place = match self.per_tenant {
            None => None,
            Some(max) => {
                let permits = self
                    .tenants
                    .lock()
                    .expect("process bound lock")
                    .entry(tenant.to_owned())
                    .or_insert_with(|| Arc::new(Semaphore::new(max)))
                    .clone();
                Some(
                    permits
                        .try_acquire_owned()
                        .map_err(|_| Refusal::Tenant(max))?,
                )
            }
        };
        let total_place = match &self.total {
            None => None,
            Some((max, permits)) => Some(
                permits
                    .clone()
                    .try_acquire_owned()
                    .map_err(|_| Refusal::Total(*max))?,
            ),
        };
        Ok(Place {
            _total: total_place,
            _tenant: tenant_place,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_at_its_bound_leaves_the_others_their_places() {
        let bound = ProcessBound::new(Some(3), Some(2));
        let a1 = bound.take("a").unwrap();
        let _a2 = bound.take("a").unwrap();
        assert_eq!(bound.take("a").unwrap_err(), Refusal::Tenant(2));
        assert_eq!(bound.in_use(), 2, "the refused take holds nothing");
        let _b1 = bound.take("b").unwrap();
        assert_eq!(bound.take("b").unwrap_err(), Refusal::Total(3));
        assert_eq!(
            bound.in_use_by("b"),
            1,
            "a refusal by the total gives the tenant's place back"
        );
        drop(a1);
        let _b2 = bound.take("b").unwrap();
        assert_eq!((bound.in_use_by("a"), bound.in_use_by("b")), (1, 2));
        let unbounded = ProcessBound::new(None, None);
        let held: Vec<Place> = (0..100).map(|_| unbounded.take("a").unwrap()).collect();
        assert_eq!(held.len(), 100);
    }
}
