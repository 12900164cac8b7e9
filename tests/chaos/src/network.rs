//! Network faults with the kernel's own tools, inside a network namespace
//! the run makes for itself: every process of the run (NATS, Postgres, the
//! services, the harness) talks over that namespace's loopback, so a fault
//! on one link there touches nothing else on the machine.
//!
//! A link is named by the server port at one end: every packet to or from
//! that port. nftables drops a share of its packets at random (loss, which
//! TCP turns into retransmission delays), or all of them (a blackhole:
//! connections stay open and silent, as behind a failed switch, rather
//! than being reset); an HTB class the link's packets are steered into
//! slows it to a few hundred kbit/s (a congested link). This kernel has no
//! `sch_netem` (`CONFIG_NET_SCH_NETEM` is not set), so a fixed added delay
//! is not among the faults.

use std::process::{Command, ExitStatus};

use anyhow::{Context as _, bail};

/// Set inside the namespace: its name.
pub const NAMESPACE_ENV: &str = "CTXSYNC_CHAOS_NETNS";

/// The run is inside a namespace of its own.
pub fn inside_namespace() -> bool {
    std::env::var_os(NAMESPACE_ENV).is_some()
}

/// Runs this program again, with the same arguments, inside a new network
/// namespace (deleted afterwards, whatever happened), and returns its exit
/// status. Needs root, `ip`, `tc` and `nft`.
pub fn run_again_in_namespace() -> anyhow::Result<ExitStatus> {
    for (tool, version) in [("ip", "-V"), ("tc", "-V"), ("nft", "-v")] {
        if Command::new(tool)
            .arg(version)
            .output()
            .map_or(true, |o| !o.status.success())
        {
            bail!(
                "network faults need `{tool}` (Debian: iproute2, nftables) and root; run tests/setup.sh or pass --no-network-faults"
            );
        }
    }
    let namespace = format!("ctxsync-chaos-{}", std::process::id());
    run("ip", &["netns", "add", &namespace])?;
    let result = (|| {
        run("ip", &["-n", &namespace, "link", "set", "lo", "up"])?;
        let me = std::env::current_exe().context("cannot find this program")?;
        let status = Command::new("ip")
            .args(["netns", "exec", &namespace])
            .arg(me)
            .args(std::env::args_os().skip(1))
            .env(NAMESPACE_ENV, &namespace)
            .status()
            .context("cannot run inside the namespace")?;
        anyhow::Ok(status)
    })();
    let deleted = run("ip", &["netns", "delete", &namespace]);
    let status = result?;
    deleted?;
    Ok(status)
}

/// One link: the packets to and from a server port on the loopback.
#[derive(Debug, Clone)]
pub struct Link {
    pub name: String,
    pub port: u16,
}

const TABLE: &str = "ctxsync_chaos";

/// The link's packets go through `rule` (an nftables statement).
fn on_link(link: &Link, rule: &[&str]) -> anyhow::Result<()> {
    run("nft", &["add", "table", "inet", TABLE])?;
    run(
        "nft",
        &[
            "add",
            "chain",
            "inet",
            TABLE,
            "output",
            "{ type filter hook output priority 0 ; policy accept ; }",
        ],
    )?;
    let port = link.port.to_string();
    for end in ["dport", "sport"] {
        let mut args = vec!["add", "rule", "inet", TABLE, "output", "tcp", end, &port];
        args.extend_from_slice(rule);
        run("nft", &args)?;
    }
    Ok(())
}

/// Drops `percent` of the link's packets at random, until [`heal`].
pub fn lossy(link: &Link, percent: u32) -> anyhow::Result<()> {
    let percent = percent.to_string();
    on_link(
        link,
        &["numgen", "random", "mod", "100", "<", &percent, "drop"],
    )
}

/// Drops every packet of the link, until [`heal`].
pub fn blackhole(link: &Link) -> anyhow::Result<()> {
    on_link(link, &["drop"])
}

/// Slows the link to `kbit` kbit/s, until [`heal`]: its packets are given
/// the priority of a slow HTB class, which HTB sorts them into by that
/// priority alone (no classifier needed); everything else is in a class
/// far faster than loopback traffic here.
pub fn slow(link: &Link, kbit: u32) -> anyhow::Result<()> {
    run(
        "tc",
        &[
            "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "1", "r2q",
            "1000",
        ],
    )?;
    run(
        "tc",
        &[
            "class", "add", "dev", "lo", "parent", "1:", "classid", "1:1", "htb", "rate", "20gbit",
        ],
    )?;
    let rate = format!("{kbit}kbit");
    run(
        "tc",
        &[
            "class", "add", "dev", "lo", "parent", "1:", "classid", "1:10", "htb", "rate", &rate,
            "ceil", &rate, "quantum", "1514",
        ],
    )?;
    on_link(link, &["meta", "priority", "set", "1:10"])
}

/// Removes every network fault (those that are not there are no error).
pub fn heal() -> anyhow::Result<()> {
    let tc = Command::new("tc")
        .args(["qdisc", "del", "dev", "lo", "root"])
        .output()?;
    let nft = Command::new("nft")
        .args(["delete", "table", "inet", TABLE])
        .output()?;
    // What is left must be nothing: a fault that outlived its healing
    // would be blamed on the system.
    let left = Command::new("tc")
        .args(["qdisc", "show", "dev", "lo"])
        .output()?;
    let left = String::from_utf8_lossy(&left.stdout);
    if left.contains("htb") {
        bail!(
            "tc left a fault on lo: {left} ({})",
            String::from_utf8_lossy(&tc.stderr)
        );
    }
    let tables = Command::new("nft").args(["list", "tables"]).output()?;
    if String::from_utf8_lossy(&tables.stdout).contains(TABLE) {
        bail!(
            "nft left table {TABLE}: {}",
            String::from_utf8_lossy(&nft.stderr)
        );
    }
    Ok(())
}

fn run(program: &str, args: &[&str]) -> anyhow::Result<()> {
    let output = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("cannot run {program}"))?;
    if !output.status.success() {
        bail!(
            "{program} {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}
