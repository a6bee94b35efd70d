-- The provisioned queues, and the messages of every queue in one table, in queue order.
-- Placeholders in braces are identifiers and types the runner fills in (checked names, quoted).
-- Tables made before versioning are adopted by this migration: every statement leaves what exists.
CREATE TABLE IF NOT EXISTS {queues} (
    name VARCHAR(255) NOT NULL PRIMARY KEY,
    created_at_us BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS {messages} (
    seq {id_type} NOT NULL PRIMARY KEY,
    queue VARCHAR(255) NOT NULL,
    message_id VARCHAR(200) NOT NULL,
    body {bytes_type} NOT NULL,
    headers TEXT NOT NULL,
    due_at_us BIGINT,
    enqueued_at_us BIGINT NOT NULL,
    visible_at_us BIGINT NOT NULL,
    receive_count INTEGER NOT NULL DEFAULT 0
);
-- A receive walks a queue's messages in queue order. Tables of earlier releases had an index led by the
-- visibility time instead, which made a receive read and sort every visible message: it is replaced.
CREATE INDEX IF NOT EXISTS {ix_order} ON {messages} (queue, seq);
DROP INDEX IF EXISTS {ix_visible};
