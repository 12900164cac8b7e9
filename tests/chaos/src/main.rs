//! `chaos run --minutes M --seed S`: the deployed shape under a seeded
//! workload and fault schedule, its history judged by the oracle;
//! `chaos check <history.jsonl>`: the oracle over a recorded history. Both
//! exit 1 when the oracle finds an anomaly. A run with network faults runs
//! itself again inside a network namespace of its own.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "chaos", about = "ctxsync's chaos history and its oracle")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Runs the deployed shape under faults, writes the history, judges it.
    Run {
        #[arg(long, default_value_t = 3.0)]
        minutes: f64,
        /// The fault schedule's and the workload's seed (printed: replay a failure with it).
        #[arg(long)]
        seed: Option<u64>,
        /// Where the history is written.
        #[arg(long, default_value = "chaos-history.jsonl")]
        history: PathBuf,
        #[arg(long, default_value_t = 6)]
        agents: usize,
        #[arg(long, default_value_t = 4)]
        chats: usize,
        /// Leave out loss, slow links and blackholes (they need root, `ip`,
        /// `tc` and `nft`: the run makes a network namespace of its own).
        #[arg(long)]
        no_network_faults: bool,
        /// Leave out clock skew (it needs libfaketime: Debian's faketime).
        #[arg(long)]
        no_clock_skew: bool,
    },
    /// Checks a recorded history (JSON lines) against the promise.
    Check {
        history: PathBuf,
        /// How long an acked report may take to reach every gate's view.
        #[arg(long, default_value = "1s", value_parser = humantime_ms)]
        view_lag: Duration,
        /// How long after discovery completes a waiting turn may take.
        #[arg(long, default_value = "1s", value_parser = humantime_ms)]
        wake: Duration,
        /// How long after a fault heals the bounds above stay stretched.
        #[arg(long, default_value = "10s", value_parser = humantime_ms)]
        fault_recovery: Duration,
        /// How late after its invocation a request may still take effect.
        #[arg(long, default_value = "5s", value_parser = humantime_ms)]
        request_budget: Duration,
        /// How soon a live agent process takes back its agent after a late
        /// Startup of another run landed.
        #[arg(long, default_value = "3s", value_parser = humantime_ms)]
        reclaim: Duration,
        /// Also plant anomalies in the history and check each is caught.
        #[arg(long)]
        plant: bool,
    },
}

fn libfaketime() -> anyhow::Result<PathBuf> {
    faults::libfaketime().ok_or_else(|| {
        anyhow::anyhow!(
            "clock skew needs libfaketime (Debian: apt-get install faketime, or run tests/setup.sh); pass --no-clock-skew to leave it out"
        )
    })
}

/// `250ms` or `3s`.
fn humantime_ms(text: &str) -> Result<Duration, String> {
    let (number, unit) = text
        .find(|c: char| !c.is_ascii_digit())
        .map_or((text, "ms"), |at| text.split_at(at));
    let number: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration such as 250ms or 3s"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(number)),
        "s" => Ok(Duration::from_secs(number)),
        _ => Err(format!("{text:?}: the unit is ms or s")),
    }
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(clean) if clean => ExitCode::SUCCESS,
        Ok(_) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::from(2)
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<bool> {
    let (history, bounds, plant) = match cli.command {
        Command::Run {
            minutes,
            seed,
            history,
            agents,
            chats,
            no_network_faults,
            no_clock_skew,
        } => {
            if !no_network_faults && !chaos::network::inside_namespace() {
                // Everything runs inside: the faults touch only this run.
                let status = chaos::network::run_again_in_namespace()?;
                return match status.code() {
                    Some(0) => Ok(true),
                    Some(1) => Ok(false),
                    _ => anyhow::bail!("the run inside its network namespace ended with {status}"),
                };
            }
            let faketime = if no_clock_skew {
                None
            } else {
                Some(libfaketime()?)
            };
            let seed = seed.unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(7, |d| d.as_secs())
            });
            println!(
                "chaos: seed {seed}, {minutes} min, history {}",
                history.display()
            );
            let options = chaos::run::Options {
                duration: Duration::from_secs_f64(minutes * 60.0),
                seed,
                history: history.clone(),
                agents,
                chats,
                pending_timeout: Duration::from_secs(5),
                network_faults: !no_network_faults,
                faketime,
            };
            let (verdict, events) = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?
                .block_on(chaos::run::run(options))?;
            // The oracle must catch anomalies planted in this very history.
            let planted = chaos::run::planted(&events, chaos::oracle::Bounds::default());
            let caught = planted.iter().filter(|(_, caught)| *caught).count();
            println!(
                "CHAOS-SUMMARY seed={seed} minutes={minutes} {verdict} planted_anomalies_caught={caught}/{}",
                planted.len()
            );
            for (kind, caught) in &planted {
                if !caught {
                    println!("the oracle missed a planted {kind:?}");
                }
            }
            return Ok(verdict.anomalies.is_empty()
                && caught == planted.len()
                && planted.len() == 5);
        }
        Command::Check {
            history,
            view_lag,
            wake,
            fault_recovery,
            request_budget,
            reclaim,
            plant,
        } => (
            history,
            chaos::oracle::Bounds {
                view_lag,
                wake,
                fault_recovery,
                request_budget,
                reclaim,
            },
            plant,
        ),
    };
    let text = std::fs::read_to_string(&history)
        .with_context(|| format!("cannot read the history {}", history.display()))?;
    let events = chaos::history::parse(&text)?;
    let verdict = chaos::oracle::check(&events, bounds);
    println!("CHAOS-CHECK {verdict}");
    let mut clean = verdict.anomalies.is_empty();
    if plant {
        for (kind, caught) in chaos::run::planted(&events, bounds) {
            println!(
                "planted {kind:?}: {}",
                if caught { "caught" } else { "MISSED" }
            );
            clean &= caught;
        }
    }
    Ok(clean)
}
