//! `/metrics` of the real binaries, freshly started and before any traffic:
//! every series the README's metrics table documents for the service is
//! there with a `# HELP` line, every series has one, `ctxsync_build_info`
//! names the service and its version; and agent-ingest with a metrics
//! address serves `/metrics` there and no longer on its API port.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::Duration;

use testkit::{NatsServer, Process, TestDatabase};

const DEADLINE: Duration = Duration::from_secs(60);

/// The README's metrics table: service → documented series (full names).
fn documented() -> BTreeMap<String, BTreeSet<String>> {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md"))
        .expect("README.md");
    let table = readme
        .split("Metrics (all prefixed `ctxsync_`)")
        .nth(1)
        .expect("the README's metrics table");
    let mut rows = BTreeMap::new();
    for line in table.lines().skip_while(|l| !l.starts_with('|')) {
        let Some(row) = line.strip_prefix('|') else {
            break;
        };
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        if cells.len() < 2 || cells[0] == "service" || cells[0].starts_with("---") {
            continue;
        }
        let names = cells[1]
            .split('`')
            .skip(1)
            .step_by(2)
            .map(|name| format!("ctxsync_{name}"))
            .collect();
        rows.insert(cells[0].to_owned(), names);
    }
    assert!(rows.contains_key("every one"), "a row for every service");
    rows
}

async fn scrape(http: &reqwest::Client, addr: SocketAddr) -> (reqwest::StatusCode, String) {
    let response = http
        .get(format!("http://{addr}/metrics"))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .expect("the listener answers");
    (response.status(), response.text().await.unwrap())
}

/// Series names with a sample line (histogram suffixes taken off).
fn sampled(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let name = l.split(['{', ' ']).next().unwrap();
            ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(name)
                .to_owned()
        })
        .collect()
}

fn with_comment(text: &str, comment: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix(comment))
        .map(|rest| rest.split(' ').next().unwrap().to_owned())
        .collect()
}

fn check_fresh_metrics(service: &str, text: &str, documented: &BTreeMap<String, BTreeSet<String>>) {
    let help = with_comment(text, "# HELP ");
    let types = with_comment(text, "# TYPE ");
    let sampled = sampled(text);
    for name in documented["every one"].iter().chain(&documented[service]) {
        // Per subject served; agent-ingest answers no NATS request (the README says so).
        if service == "agent-ingest"
            && matches!(
                name.as_str(),
                "ctxsync_rpc_expired_total" | "ctxsync_rpc_reply_refused_total"
            )
        {
            continue;
        }
        assert!(
            help.contains(name),
            "{service}: no # HELP for {name}:\n{text}"
        );
        assert!(
            sampled.contains(name),
            "{service}: no sample of {name} at start:\n{text}"
        );
    }
    for name in &types {
        assert!(help.contains(name), "{service}: {name} has no # HELP");
    }
    for name in sampled.iter().filter(|n| n.starts_with("ctxsync_")) {
        assert!(
            documented["every one"].contains(name) || documented[service].contains(name),
            "{service} exports {name}, which the README's table does not list for it"
        );
    }
    let build_info = text
        .lines()
        .find(|l| {
            l.starts_with("ctxsync_build_info{") && l.contains(&format!("service=\"{service}\""))
        })
        .unwrap_or_else(|| panic!("{service}: no ctxsync_build_info:\n{text}"));
    assert!(
        build_info.contains(&format!("version=\"{}\"", env!("CARGO_PKG_VERSION"))),
        "{build_info}"
    );
    assert!(build_info.ends_with(" 1"), "{build_info}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fresh_services_export_every_documented_series_with_help() {
    testkit::init_logs();
    let documented = documented();
    let nats = NatsServer::start();
    let db = TestDatabase::create().await;
    let prefix = testkit::unique_prefix();
    let config_dir = tempfile::tempdir().unwrap();
    let catalog_config = config_dir.path().join("catalog.yaml");
    std::fs::write(&catalog_config, "tenants: []\n").unwrap();
    let base = |http_addr: SocketAddr| {
        vec![
            ("NATS_URL", nats.url()),
            ("CTXSYNC_SUBJECT_PREFIX", prefix.clone()),
            ("CTXSYNC_HTTP_ADDR", http_addr.to_string()),
        ]
    };
    let mut processes = Vec::new();
    for service in ["snapshot-store", "agent-ingest", "chat-gate", "catalog"] {
        let addr = testkit::free_addr();
        let mut env = base(addr);
        if ["snapshot-store", "catalog"].contains(&service) {
            env.push(("DATABASE_URL", db.url().to_owned()));
        }
        if service == "catalog" {
            env.push((
                "CTXSYNC_CATALOG_CONFIG",
                catalog_config.display().to_string(),
            ));
            env.push(("CTXSYNC_CATALOG_WARMUP", "false".into()));
        }
        processes.push((service, addr, Process::spawn(service, service, &env)));
    }
    let http = reqwest::Client::new();
    for (service, addr, process) in &mut processes {
        process.wait_ready(DEADLINE).await;
        let (status, text) = scrape(&http, *addr).await;
        assert!(status.is_success(), "{service}: {status}");
        check_fresh_metrics(service, &text, &documented);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_ingest_serves_metrics_on_its_metrics_address_only() {
    testkit::init_logs();
    let nats = NatsServer::start();
    let (api, metrics) = (testkit::free_addr(), testkit::free_addr());
    let mut ingest = Process::spawn(
        "agent-ingest",
        "agent-ingest",
        &[
            ("NATS_URL", nats.url()),
            ("CTXSYNC_SUBJECT_PREFIX", testkit::unique_prefix()),
            ("CTXSYNC_HTTP_ADDR", api.to_string()),
            ("CTXSYNC_METRICS_ADDR", metrics.to_string()),
        ],
    );
    ingest.wait_ready(DEADLINE).await;
    let http = reqwest::Client::new();

    let (status, text) = scrape(&http, metrics).await;
    assert!(status.is_success(), "{status}");
    check_fresh_metrics("agent-ingest", &text, &documented());

    let (status, _) = scrape(&http, api).await;
    assert_eq!(
        status,
        reqwest::StatusCode::NOT_FOUND,
        "/metrics on the API port"
    );
    // The API port keeps health and readiness; the metrics port serves only metrics.
    for (addr, path, expected) in [
        (api, "healthz", reqwest::StatusCode::OK),
        (api, "readyz", reqwest::StatusCode::OK),
        (metrics, "healthz", reqwest::StatusCode::NOT_FOUND),
        (
            metrics,
            "api/v1/agent/startup",
            reqwest::StatusCode::NOT_FOUND,
        ),
    ] {
        let status = http
            .get(format!("http://{addr}/{path}"))
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .unwrap()
            .status();
        assert_eq!(status, expected, "GET {addr}/{path}");
    }
}
