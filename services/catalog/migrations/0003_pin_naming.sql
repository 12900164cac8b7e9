-- A pin keeps the naming rule it was made with (JSON: prefix, aliases), so
-- a session's tool and prompt names never change when the configuration
-- does. NULL: a pin made before rules existed, named `server_id__name`.
ALTER TABLE catalog.pins ADD COLUMN naming_json text;
