-- The messages, ordered by due time, and each destination's delivery policy.
-- Placeholders in braces are identifiers and types the runner fills in (checked names, quoted).
CREATE TABLE IF NOT EXISTS {messages} (
    id {id_type} NOT NULL PRIMARY KEY,
    message_id VARCHAR(200) NOT NULL UNIQUE,
    destination VARCHAR(255) NOT NULL,
    body {bytes_type} NOT NULL,
    headers TEXT NOT NULL,
    due_at_us BIGINT NOT NULL,
    stored_at_us BIGINT NOT NULL,
    failures INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS {ix_due} ON {messages} (due_at_us, id);
CREATE TABLE IF NOT EXISTS {policies} (
    destination VARCHAR(255) NOT NULL PRIMARY KEY,
    policy TEXT NOT NULL
);
