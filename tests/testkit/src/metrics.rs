//! Reads a service's `/metrics` (Prometheus text) so a test can wait on a
//! gauge or count a counter.

use std::net::SocketAddr;
use std::time::Duration;

/// One scrape of `/metrics`.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    text: String,
}

impl Metrics {
    /// Scrapes `http://addr/metrics`.
    pub async fn scrape(http: &reqwest::Client, addr: SocketAddr) -> Result<Self, String> {
        let response = http
            .get(format!("http://{addr}/metrics"))
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .map_err(|e| format!("GET /metrics on {addr}: {e}"))?;
        if !response.status().is_success() {
            return Err(format!("GET /metrics on {addr}: {}", response.status()));
        }
        let text = response
            .text()
            .await
            .map_err(|e| format!("GET /metrics on {addr}: {e}"))?;
        Ok(Self { text })
    }

    pub fn from_text(text: impl Into<String>) -> Self {
        Self { text: text.into() }
    }

    /// The sum of the samples of `name` whose labels include every
    /// `key="value"` of `labels` (0 when there are none).
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.text
            .lines()
            .filter(|line| !line.starts_with('#'))
            .filter_map(|line| {
                let (series, value) = line.rsplit_once(' ')?;
                let (metric, label_text) = match series.split_once('{') {
                    Some((metric, rest)) => (metric, rest.trim_end_matches('}')),
                    None => (series, ""),
                };
                if metric != name {
                    return None;
                }
                let matches = labels
                    .iter()
                    .all(|(k, v)| label_text.split(',').any(|l| l == format!("{k}=\"{v}\"")));
                matches.then(|| value.parse::<f64>().ok()).flatten()
            })
            // Not .sum(): an empty f64 sum is -0.
            .fold(0.0, |total, value| total + value)
    }

    pub fn text(&self) -> &str {
        &self.text
    }
}

#[cfg(test)]
mod tests {
    use super::Metrics;

    #[test]
    fn sums_matching_series() {
        let metrics = Metrics::from_text(
            "# TYPE x counter\nx{outcome=\"accepted\"} 3\nx{outcome=\"dropped\",reason=\"A\"} 2\nx_total 9\ny 1\n",
        );
        assert_eq!(metrics.sum("x", &[]), 5.0);
        assert_eq!(metrics.sum("x", &[("outcome", "accepted")]), 3.0);
        assert_eq!(metrics.sum("x", &[("reason", "B")]), 0.0);
        assert_eq!(metrics.sum("y", &[]), 1.0);
    }
}
