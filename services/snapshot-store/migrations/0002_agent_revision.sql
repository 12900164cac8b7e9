-- The agent's commit counter: every accepted startup or push raises it by one
-- under the row lock, so a state (read or carried by an event) says how new it
-- is, and a watcher can keep the newer of two without a read.
ALTER TABLE snapshot.agents ADD COLUMN revision bigint NOT NULL DEFAULT 0;
