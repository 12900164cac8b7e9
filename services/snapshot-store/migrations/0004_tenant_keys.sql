-- The credentials of chat backends: one tenant each. Only the SHA-256 of a
-- key is kept (the key is shown once, by the CLI that created it); a revoked
-- key stays listed, with the time it stopped working.
CREATE TABLE snapshot.tenant_keys (
    key_id     text PRIMARY KEY CHECK (key_id ~ '^tk_[0-9a-f]{16}$'),
    tenant     text NOT NULL CHECK (tenant ~ '^[A-Za-z0-9_-]{1,64}$'),
    label      text NOT NULL DEFAULT '' CHECK (octet_length(label) <= 256),
    key_sha256 bytea NOT NULL UNIQUE CHECK (octet_length(key_sha256) = 32),
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    revoked_at timestamptz
);

CREATE INDEX tenant_keys_by_tenant ON snapshot.tenant_keys (tenant, created_at);
