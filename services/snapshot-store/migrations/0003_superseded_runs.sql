-- Runs an agent has moved away from. A startup naming one of them is late or
-- replayed (its process was replaced after it sent it) and is dropped, so it
-- can never take the agent back from the process running now. Only a reclaim
-- (sent by a live process that was told its run was superseded) removes a run
-- from here. Bounded per agent by the store (oldest pruned first).
CREATE TABLE snapshot.superseded_runs (
    agent_id      uuid NOT NULL REFERENCES snapshot.agents (agent_id) ON DELETE CASCADE,
    agent_run_id  text NOT NULL CHECK (octet_length(agent_run_id) BETWEEN 1 AND 64),
    superseded_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (agent_id, agent_run_id)
);
