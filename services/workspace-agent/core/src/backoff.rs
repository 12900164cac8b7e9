//! Capped exponential backoff with jitter, from `backon`.
//!
//! The wait before retry `n` (1-based) is a random point in the upper half of
//! `initial * 2^(n-1)`, that product capped at `max`; a server's
//! `Retry-After` (itself capped at `max`) is a floor. `backon`'s jitter adds
//! up to 100% to its delay, so it is built from half the bounds: its
//! delays `[d, 2d)` with `d = min(initial * 2^(n-1), max) / 2`. It computes
//! in f32 seconds, so `d` can be off by nanoseconds; the cap is exact.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};

/// The bounds of the waits between retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(200),
            max: Duration::from_secs(10),
        }
    }
}

impl Backoff {
    /// The waits of one run of failures, retry 1 first. `seed` fixes the
    /// jitter (tests); `None` draws it at random, so agents that failed
    /// together do not retry together.
    pub fn delays(&self, seed: Option<u64>) -> Delays {
        let mut builder = ExponentialBuilder::new()
            .with_jitter()
            .with_factor(2.0)
            .with_min_delay(self.initial.min(self.max) / 2)
            .with_max_delay(self.max / 2)
            .without_max_times();
        if let Some(seed) = seed {
            builder = builder.with_jitter_seed(seed);
        }
        Delays {
            inner: builder.build(),
            max: self.max,
        }
    }

    /// The wait before retry number `attempt` (1-based), as the module docs
    /// say; never below `retry_after` capped at `max`.
    pub fn delay(&self, attempt: u32, retry_after: Option<Duration>) -> Duration {
        self.delay_seeded(attempt, retry_after, None)
    }

    /// [`Backoff::delay`] with the jitter of `seed` (see [`Backoff::delays`]).
    pub fn delay_seeded(
        &self,
        attempt: u32,
        retry_after: Option<Duration>,
        seed: Option<u64>,
    ) -> Duration {
        let mut delays = self.delays(seed);
        for _ in 1..attempt.max(1) {
            delays.next_delay(None);
        }
        delays.next_delay(retry_after)
    }
}

/// The waits of one run of failures (see [`Backoff::delays`]).
#[derive(Debug)]
pub struct Delays {
    inner: ExponentialBackoff,
    max: Duration,
}

impl Delays {
    /// The wait before the next retry; never below `retry_after` capped at `max`.
    pub fn next_delay(&mut self, retry_after: Option<Duration>) -> Duration {
        // `backon` computes in f32 seconds: its cap can be off by nanoseconds.
        let delay = self.inner.next().unwrap_or(self.max).min(self.max);
        match retry_after {
            Some(after) => delay.max(after.min(self.max)),
            None => delay,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_is_capped_and_jittered() {
        let b = Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(1),
        };
        for attempt in 1..=30 {
            let d = b.delay(attempt, None);
            let exp = Duration::from_millis(100)
                .saturating_mul(1 << (attempt - 1).min(20))
                .min(Duration::from_secs(1));
            assert!(d >= exp / 2 && d <= exp, "attempt {attempt}: {d:?}");
        }
        let samples: std::collections::BTreeSet<Duration> =
            (0..20).map(|_| b.delay(5, None)).collect();
        assert!(samples.len() > 1, "jitter varies the delay");
        assert!(b.delay(1, Some(Duration::from_millis(700))) >= Duration::from_millis(700));
        assert!(b.delay(1, Some(Duration::from_secs(60))) <= Duration::from_secs(1));
    }

    #[test]
    fn one_run_of_delays_keeps_the_same_bounds_for_the_default_and_odd_values() {
        for b in [
            Backoff::default(),
            Backoff {
                initial: Duration::from_millis(50),
                max: Duration::from_millis(500),
            },
            Backoff {
                initial: Duration::from_millis(700),
                max: Duration::from_millis(2100),
            },
            // A first wait above the cap is capped too.
            Backoff {
                initial: Duration::from_secs(5),
                max: Duration::from_secs(1),
            },
        ] {
            // Seeded: deterministic (an unlucky draw of zero jitter could
            // show backon's nanoseconds of f32 rounding below the floor).
            for seed in 0..8 {
                let mut delays = b.delays(Some(seed));
                for attempt in 1..=40u32 {
                    let d = delays.next_delay(None);
                    let exp = b
                        .initial
                        .saturating_mul(1 << (attempt - 1).min(20))
                        .min(b.max);
                    assert!(d >= exp / 2 && d <= exp, "{b:?} attempt {attempt}: {d:?}");
                }
            }
        }
    }

    #[test]
    fn a_seed_fixes_the_jitter() {
        let b = Backoff::default();
        let run = |seed| {
            let mut delays = b.delays(Some(seed));
            (0..10).map(|_| delays.next_delay(None)).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn zero_bounds_never_wait() {
        let b = Backoff {
            initial: Duration::ZERO,
            max: Duration::ZERO,
        };
        let mut delays = b.delays(None);
        assert!((0..5).all(|_| delays.next_delay(Some(Duration::from_secs(1))).is_zero()));
    }
}
