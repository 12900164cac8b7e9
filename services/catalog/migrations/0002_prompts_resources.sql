-- A generation's prompts and resources, written once with it like its
-- tools. Each declaration is kept whole, as the server listed it (JSON text),
-- so the catalog serves it back unchanged.

CREATE TABLE catalog.generation_prompts (
    server_key       text    NOT NULL,
    catalog_hash     text    NOT NULL,
    position         integer NOT NULL,
    name             text    NOT NULL,
    declaration_json text    NOT NULL,
    PRIMARY KEY (server_key, catalog_hash, position),
    FOREIGN KEY (server_key, catalog_hash) REFERENCES catalog.generations (server_key, catalog_hash)
);

CREATE TABLE catalog.generation_resources (
    server_key       text    NOT NULL,
    catalog_hash     text    NOT NULL,
    position         integer NOT NULL,
    uri              text    NOT NULL,
    declaration_json text    NOT NULL,
    PRIMARY KEY (server_key, catalog_hash, position),
    FOREIGN KEY (server_key, catalog_hash) REFERENCES catalog.generations (server_key, catalog_hash)
);
