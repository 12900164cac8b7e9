//! A chaos run's history: every operation's invocation and its completion,
//! one JSON object per line, so a failing run can be checked again (and
//! cut down) without running it again.
//!
//! An operation is invoked once and completes at most once: `ok` (it took
//! effect: a report acked, a turn answered), `fail` (it certainly did not),
//! or `info` (unknown: the caller gave up or lost the connection, so it may
//! have taken effect, then or later). The oracle orders events by `mono_us`,
//! the harness's own monotonic clock; `wall_ms` is for people.

use serde::{Deserialize, Serialize};

/// One line of the history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// The operation: its invocation and completion share the number.
    pub op: u64,
    pub kind: Kind,
    /// Microseconds since the run began, on the harness's monotonic clock.
    pub mono_us: u64,
    /// Milliseconds since the Unix epoch, on the wall clock.
    pub wall_ms: u64,
    #[serde(flatten)]
    pub body: Body,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    Invoke,
    Ok,
    Fail,
    Info,
}

/// What the operation was.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "f", rename_all = "snake_case")]
pub enum Body {
    /// An agent process's Startup: `run_id` becomes the agent's current run.
    /// A `reclaim` is sent by the live process told another run took its
    /// agent (a late Startup of a process that never held it).
    Startup {
        agent: String,
        run_id: String,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        reclaim: bool,
    },
    /// A report of run `run_id`; `tools` as a chat sees them (`server__tool`).
    Push {
        agent: String,
        run_id: String,
        version: u64,
        complete: bool,
        tools: Vec<String>,
    },
    /// A first turn for `agent`; its completion carries the answer.
    Turn {
        agent: String,
        chat: String,
        #[serde(default)]
        via: Via,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        answer: Option<Answer>,
    },
    /// A later turn of a chat whose first turn was asked: never held.
    FollowUp {
        agent: String,
        chat: String,
        #[serde(default)]
        via: Via,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        answer: Option<Answer>,
    },
    /// A fault: invoked when it starts, `ok` when it is healed.
    Fault { fault: String, target: String },
    /// The store's state of `agent` read once the run is over (`ok` only).
    Final {
        agent: String,
        run_id: String,
        version: u64,
    },
}

/// What a first turn was answered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Answer {
    pub decision: Decision,
    /// The agent's current run as the store saw it.
    pub run_id: String,
    /// The run and version of the snapshot the tools come from.
    pub snapshot_run_id: String,
    pub snapshot_version: u64,
    pub tools: Vec<String>,
    pub waited_ms: u64,
    /// The answer says the store could not be read (it failed open).
    #[serde(default)]
    pub store_unavailable: bool,
}

/// Which of the gate's APIs a chat backend asked.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Via {
    #[default]
    Http,
    Nats,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    Ready,
    /// Discovery was not complete when the wait ended (its deadline).
    Pending,
    /// Withheld: the snapshot is another process's.
    Stale,
    /// The agent has never reported.
    Unknown,
    /// A later turn's answer: the chat's context as of now, without a wait.
    NotFirstTurn,
}

impl Body {
    /// A turn's answer, once it came.
    pub fn answer(&self) -> Option<&Answer> {
        match self {
            Body::Turn { answer, .. } | Body::FollowUp { answer, .. } => answer.as_ref(),
            _ => None,
        }
    }

    pub fn agent(&self) -> Option<&str> {
        match self {
            Body::Startup { agent, .. }
            | Body::Push { agent, .. }
            | Body::Turn { agent, .. }
            | Body::FollowUp { agent, .. }
            | Body::Final { agent, .. } => Some(agent),
            Body::Fault { .. } => None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("history line {line}: {reason}")]
pub struct HistoryError {
    pub line: usize,
    pub reason: String,
}

/// The events of a JSON-lines history (blank lines skipped).
pub fn parse(text: &str) -> Result<Vec<Event>, HistoryError> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(i, line)| {
            serde_json::from_str(line).map_err(|error| HistoryError {
                line: i + 1,
                reason: error.to_string(),
            })
        })
        .collect()
}

/// `event` as one line of a history (no newline).
pub fn line(event: &Event) -> String {
    serde_json::to_string(event).expect("an event serializes")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_round_trip_and_a_bad_line_is_named() {
        let events = vec![
            Event {
                op: 1,
                kind: Kind::Invoke,
                mono_us: 10,
                wall_ms: 1_700_000_000_000,
                body: Body::Push {
                    agent: "a".into(),
                    run_id: "r".into(),
                    version: 1,
                    complete: true,
                    tools: vec!["s__t".into()],
                },
            },
            Event {
                op: 2,
                kind: Kind::Ok,
                mono_us: 20,
                wall_ms: 1_700_000_000_001,
                body: Body::Turn {
                    agent: "a".into(),
                    chat: "c".into(),
                    via: Via::Nats,
                    answer: Some(Answer {
                        decision: Decision::Ready,
                        run_id: "r".into(),
                        snapshot_run_id: "r".into(),
                        snapshot_version: 1,
                        tools: vec!["s__t".into()],
                        waited_ms: 0,
                        store_unavailable: false,
                    }),
                },
            },
        ];
        let text: String = events.iter().map(|e| line(e) + "\n").collect();
        assert!(
            text.lines().next().unwrap().contains(r#""f":"push""#),
            "{text}"
        );
        assert_eq!(parse(&text).unwrap(), events);
        let error = parse(&format!("{text}\n{{\"op\": 3}}\n")).unwrap_err();
        assert_eq!(error.line, 4, "{error}");
    }
}
