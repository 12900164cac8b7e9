-- Agents, their discovery snapshot, and the snapshot's resources.
-- snapshot-store is the only writer of this schema.

CREATE TABLE snapshot.agents (
    agent_id      uuid PRIMARY KEY,
    tenant        text NOT NULL,
    workspace     text NOT NULL,
    name          text NOT NULL,
    -- SHA-256 of the agent token; the token itself is never stored.
    token_sha256  bytea NOT NULL UNIQUE CHECK (octet_length(token_sha256) = 32),
    -- Run id of the process that last sent Startup; '' for legacy agents.
    agent_run_id  text NOT NULL DEFAULT '' CHECK (octet_length(agent_run_id) <= 64),
    agent_version text NOT NULL DEFAULT '',
    created_at    timestamptz NOT NULL DEFAULT now(),
    startup_at    timestamptz,
    UNIQUE (tenant, workspace, name)
);

-- One snapshot per agent: the last accepted push.
CREATE TABLE snapshot.snapshots (
    agent_id       uuid PRIMARY KEY REFERENCES snapshot.agents (agent_id) ON DELETE CASCADE,
    agent_run_id   text NOT NULL CHECK (octet_length(agent_run_id) <= 64),
    version        bigint NOT NULL,
    phase          text NOT NULL CHECK (phase IN ('unspecified', 'pending', 'complete')),
    hash           text NOT NULL,
    -- ContextConfig, protobuf-encoded.
    context_config bytea NOT NULL,
    received_at    timestamptz NOT NULL
);

-- One row per source of the snapshot; replaced with it.
CREATE TABLE snapshot.resources (
    agent_id  uuid NOT NULL REFERENCES snapshot.agents (agent_id) ON DELETE CASCADE,
    source    text NOT NULL CHECK (octet_length(source) <= 1024),
    position  integer NOT NULL,
    kind      smallint NOT NULL,
    status    smallint NOT NULL,
    error     text NOT NULL DEFAULT '',
    warning   text NOT NULL DEFAULT '',
    -- The resource body (ContextResource with only its body set), protobuf-encoded.
    body      bytea NOT NULL,
    PRIMARY KEY (agent_id, source)
);
