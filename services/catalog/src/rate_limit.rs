//! The `/mcp` endpoint's per-key request rate limit: a token bucket per
//! tenant key (`governor`'s keyed GCRA limiter: `per_second` requests a
//! second, `burst` at once). A refused request learns when to retry.
//!
//! Per-key state stays bounded: keys are only ever added by authenticated
//! requests, and every [`PRUNE_EVERY`] checks the keys whose bucket is full
//! again (indistinguishable from a new key) are dropped and the map shrunk.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::middleware::NoOpMiddleware;
use governor::state::keyed::DefaultKeyedStateStore;
use governor::{Quota, RateLimiter};

/// Per-key request rate limit: a token bucket.
#[derive(Debug, Clone, Copy)]
pub struct RateLimit {
    pub per_second: f64,
    pub burst: u32,
}

/// Checks between two prunes of the keys not limited any more.
const PRUNE_EVERY: u64 = 1024;

type Buckets<C> =
    RateLimiter<String, DefaultKeyedStateStore<String>, C, NoOpMiddleware<<C as Clock>::Instant>>;

/// Token buckets by tenant key id.
pub(crate) struct Limiter<C: Clock = DefaultClock> {
    buckets: Option<Buckets<C>>,
    clock: C,
    checks: AtomicU64,
}

impl Limiter {
    pub fn new(limit: Option<RateLimit>) -> Self {
        Self::with_clock(limit, DefaultClock::default())
    }
}

impl<C: Clock + Clone> Limiter<C> {
    fn with_clock(limit: Option<RateLimit>, clock: C) -> Self {
        Self {
            buckets: limit
                .map(|limit| RateLimiter::dashmap_with_clock(quota(limit), clock.clone())),
            clock,
            checks: AtomicU64::new(0),
        }
    }

    /// Takes one request from the key's bucket; when it is empty, how long
    /// until it holds one again.
    pub fn admit(&self, key_id: &str) -> Result<(), Duration> {
        let Some(buckets) = &self.buckets else {
            return Ok(());
        };
        if self.checks.fetch_add(1, Ordering::Relaxed) % PRUNE_EVERY == PRUNE_EVERY - 1 {
            buckets.retain_recent();
            buckets.shrink_to_fit();
        }
        buckets
            .check_key(&key_id.to_owned())
            .map_err(|refused| refused.wait_time_from(self.clock.now()))
    }

    /// Keys with state now.
    #[cfg(test)]
    fn keys(&self) -> usize {
        self.buckets.as_ref().map_or(0, |b| b.len())
    }
}

/// `Retry-After` for a wait: whole seconds, at least one.
pub(crate) fn retry_after_seconds(wait: Duration) -> u64 {
    (wait.as_secs() + u64::from(wait.subsec_nanos() > 0)).max(1)
}

/// One request every `1 / per_second` seconds, `burst` at once.
fn quota(limit: RateLimit) -> Quota {
    let burst = NonZeroU32::new(limit.burst.max(1)).expect("at least 1");
    // A rate so high that its period rounds to zero is as good as no limit.
    let period = Duration::from_secs_f64(1.0 / limit.per_second).max(Duration::from_nanos(1));
    Quota::with_period(period)
        .expect("a period of at least 1 ns")
        .allow_burst(burst)
}

#[cfg(test)]
mod tests {
    use governor::clock::FakeRelativeClock;

    use super::*;

    fn limiter(per_second: f64, burst: u32) -> (Limiter<FakeRelativeClock>, FakeRelativeClock) {
        let clock = FakeRelativeClock::default();
        let limit = RateLimit { per_second, burst };
        (Limiter::with_clock(Some(limit), clock.clone()), clock)
    }

    #[test]
    fn a_key_gets_its_burst_then_its_rate_and_another_key_its_own() {
        // The default: 20 a second, 40 at once.
        let (limiter, clock) = limiter(20.0, 40);
        for n in 0..40 {
            assert_eq!(limiter.admit("a"), Ok(()), "request {n} of the burst");
        }
        let wait = limiter.admit("a").unwrap_err();
        assert_eq!(wait, Duration::from_millis(50), "one token every 50 ms");
        assert_eq!(retry_after_seconds(wait), 1);
        assert_eq!(limiter.admit("b"), Ok(()), "another key has its own bucket");
        clock.advance(Duration::from_millis(50));
        assert_eq!(limiter.admit("a"), Ok(()));
        assert!(limiter.admit("a").is_err(), "one token, one request");
        clock.advance(Duration::from_secs(2));
        for _ in 0..40 {
            assert_eq!(
                limiter.admit("a"),
                Ok(()),
                "refilled to the burst, no further"
            );
        }
        assert!(limiter.admit("a").is_err());
    }

    #[test]
    fn a_slow_rate_says_when_to_retry_in_whole_seconds() {
        let (limiter, _clock) = limiter(0.01, 2);
        assert!(limiter.admit("k").is_ok() && limiter.admit("k").is_ok());
        let wait = limiter.admit("k").unwrap_err();
        assert_eq!(wait, Duration::from_secs(100));
        assert_eq!(retry_after_seconds(wait), 100);
        assert_eq!(retry_after_seconds(Duration::from_millis(100_001)), 101);
        assert_eq!(retry_after_seconds(Duration::ZERO), 1);
    }

    #[test]
    fn no_limit_admits_everything() {
        let limiter = Limiter::with_clock(None, FakeRelativeClock::default());
        assert!((0..10_000).all(|_| limiter.admit("k").is_ok()));
    }

    #[test]
    fn keys_whose_bucket_refilled_are_dropped() {
        let (limiter, clock) = limiter(20.0, 40);
        for key in 0..500 {
            limiter.admit(&format!("key-{key}")).unwrap();
        }
        assert_eq!(limiter.keys(), 500);
        // Long enough for every bucket to be full again.
        clock.advance(Duration::from_secs(3));
        for _ in 0..PRUNE_EVERY {
            let _ = limiter.admit("busy");
        }
        assert!(
            limiter.keys() <= 1,
            "only the busy key keeps state: {}",
            limiter.keys()
        );
    }
}
