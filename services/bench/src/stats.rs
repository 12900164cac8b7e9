//! Percentiles of latency samples.

use std::time::Duration;

/// A latency distribution, in microseconds.
#[derive(Debug, Clone, Default)]
pub struct Latency {
    pub samples: usize,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    pub mean_us: f64,
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

impl Latency {
    pub fn of(mut values: Vec<Duration>) -> Self {
        values.sort();
        let total: Duration = values.iter().sum();
        Self {
            samples: values.len(),
            p50_us: micros(percentile(&values, 0.50)),
            p99_us: micros(percentile(&values, 0.99)),
            max_us: micros(values.last().copied().unwrap_or_default()),
            mean_us: if values.is_empty() {
                0.0
            } else {
                micros(total) / values.len() as f64
            },
        }
    }
}

/// `a / b`, or 0 when `b` is 0 (a section that did not run).
pub fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { 0.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let values: Vec<Duration> = (1..=100).map(Duration::from_micros).collect();
        let latency = Latency::of(values);
        assert_eq!(latency.samples, 100);
        assert_eq!(latency.p50_us, 50.0);
        assert_eq!(latency.p99_us, 99.0);
        assert_eq!(latency.max_us, 100.0);
        assert_eq!(latency.mean_us, 50.5);
        let one = Latency::of(vec![Duration::from_micros(7)]);
        assert_eq!((one.p50_us, one.p99_us), (7.0, 7.0));
        assert_eq!(Latency::of(Vec::new()).samples, 0);
    }
}
