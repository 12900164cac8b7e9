-- The catalog's schema. Generations are a history, not a cache: a
-- (server key, catalog hash) pair is written once, with its tools.

CREATE SCHEMA IF NOT EXISTS catalog;

CREATE TABLE catalog.generations (
    server_key   text        NOT NULL,
    catalog_hash text        NOT NULL,
    tenant       text        NOT NULL,
    server_id    text        NOT NULL,
    transport    text        NOT NULL,
    tool_count   integer     NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (server_key, catalog_hash)
);

CREATE TABLE catalog.generation_tools (
    server_key        text    NOT NULL,
    catalog_hash      text    NOT NULL,
    position          integer NOT NULL,
    name              text    NOT NULL,
    description       text    NOT NULL,
    input_schema_json text    NOT NULL,
    PRIMARY KEY (server_key, catalog_hash, position),
    FOREIGN KEY (server_key, catalog_hash) REFERENCES catalog.generations (server_key, catalog_hash)
);

CREATE TABLE catalog.sessions (
    tenant      text        NOT NULL,
    session_id  text        NOT NULL,
    prepared_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, session_id)
);

-- A session's pins, in configured-server order.
CREATE TABLE catalog.pins (
    tenant       text    NOT NULL,
    session_id   text    NOT NULL,
    position     integer NOT NULL,
    server_id    text    NOT NULL,
    server_key   text    NOT NULL,
    catalog_hash text    NOT NULL,
    transport    text    NOT NULL,
    source       text    NOT NULL CHECK (source IN ('pinned', 'connected')),
    PRIMARY KEY (tenant, session_id, server_id),
    FOREIGN KEY (tenant, session_id) REFERENCES catalog.sessions (tenant, session_id) ON DELETE CASCADE,
    FOREIGN KEY (server_key, catalog_hash) REFERENCES catalog.generations (server_key, catalog_hash)
);

-- Versioned payloads; readers treat a missing field as unknown. Payloads hold
-- timings, counts, transports and tool names: never arguments, results or secrets.
CREATE TABLE catalog.events (
    id              bigserial   PRIMARY KEY,
    occurred_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    kind            text        NOT NULL,
    tenant          text        NOT NULL,
    session_id      text,
    server_id       text,
    payload_version integer     NOT NULL DEFAULT 1,
    payload         jsonb       NOT NULL
);

CREATE INDEX events_occurred_at ON catalog.events (occurred_at);
CREATE INDEX events_kind_occurred_at ON catalog.events (kind, occurred_at);
