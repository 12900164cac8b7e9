//! The gate's decisions by short name: the `decision` and `outcome` labels of
//! chat-gate's metrics and the `outcome` of `GateTurnWaited` (what `ctxsync
//! latency` reports). JSON carries the proto name (`GATE_DECISION_READY`).

use crate::v1::GateDecision;

impl GateDecision {
    /// `GATE_DECISION_TIMED_OUT_PENDING` → `"timed_out_pending"`.
    pub fn label(self) -> &'static str {
        match self {
            Self::Unspecified => "unspecified",
            Self::Ready => "ready",
            Self::Legacy => "legacy",
            Self::NotFirstTurn => "not_first_turn",
            Self::TimedOutPending => "timed_out_pending",
            Self::TimedOutNoSnapshot => "timed_out_no_snapshot",
            Self::TimedOutStale => "timed_out_stale",
            Self::StoreUnavailable => "store_unavailable",
            Self::ShuttingDown => "shutting_down",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_label_is_the_proto_name_without_its_prefix_in_lowercase() {
        for value in 0..=8 {
            let decision = GateDecision::try_from(value).expect("a decision");
            let name = decision.as_str_name();
            let expected = name.strip_prefix("GATE_DECISION_").unwrap().to_lowercase();
            assert_eq!(decision.label(), expected, "{name}");
        }
        assert!(
            GateDecision::try_from(9).is_err(),
            "a decision without a label"
        );
    }
}
