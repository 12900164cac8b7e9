//! Percentiles of latency samples, and means of the services' histograms.

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

/// Histogram `name`'s sum (seconds) and count in a `/metrics` text, added
/// up over every series of it: a deployed text holds each process's.
fn counted(text: &str, name: &str) -> Option<(f64, f64)> {
    let total = |series: String| {
        text.lines()
            .filter_map(|line| {
                let rest = line.strip_prefix(series.as_str())?;
                // `name_sum 1.5` or `name_sum{label="x"} 1.5`, not `name_sum_other`.
                if !(rest.starts_with(' ') || rest.starts_with('{')) {
                    return None;
                }
                line.rsplit(' ').next()?.parse::<f64>().ok()
            })
            .reduce(|sum, value| sum + value)
    };
    Some((
        total(format!("{name}_sum"))?,
        total(format!("{name}_count"))?,
    ))
}

/// Histogram `name`'s mean, in microseconds, over what it counted between
/// the two `/metrics` texts; `None` if it counted nothing.
pub fn mean_between(before: &Option<String>, after: &Option<String>, name: &str) -> Option<f64> {
    let (sum0, n0) = counted(before.as_deref()?, name)?;
    let (sum1, n1) = counted(after.as_deref()?, name)?;
    (n1 > n0).then(|| (sum1 - sum0) / (n1 - n0) * 1_000_000.0)
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

    #[test]
    fn a_histograms_mean_adds_up_every_process_and_counts_only_what_came_between() {
        // Two gate replicas' texts, one after the other, as a deployed scrape
        // joins them; a longer name with the same start is not counted.
        let before = Some(
            "w_seconds_sum 0.001\nw_seconds_count 1\nw_seconds_sum_other 9\n\
             w_seconds_sum{replica=\"b\"} 0\nw_seconds_count{replica=\"b\"} 0\n"
                .to_owned(),
        );
        let after = Some(
            "w_seconds_sum 0.002\nw_seconds_count 2\nw_seconds_sum_other 99\n\
             w_seconds_sum{replica=\"b\"} 0.003\nw_seconds_count{replica=\"b\"} 2\n"
                .to_owned(),
        );
        // (0.005 - 0.001) s over (4 - 1) = 1333.3 µs.
        let mean = mean_between(&before, &after, "w_seconds").expect("counted");
        assert!((mean - 4000.0 / 3.0).abs() < 1e-6, "mean {mean}");
        assert_eq!(mean_between(&before, &before, "w_seconds"), None);
        assert_eq!(mean_between(&before, &after, "absent_seconds"), None);
        assert_eq!(mean_between(&None, &after, "w_seconds"), None);
    }
}
