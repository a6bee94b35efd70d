-- The de-duplication window's accepted ids, the throttle buckets every pump shares, and queue-level delays.
CREATE TABLE IF NOT EXISTS {ids} (
    message_id VARCHAR(200) NOT NULL PRIMARY KEY,
    seen_at_us BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS {ix_ids} ON {ids} (seen_at_us);
CREATE TABLE IF NOT EXISTS {throttle} (
    destination VARCHAR(255) NOT NULL PRIMARY KEY,
    tokens DOUBLE PRECISION NOT NULL,
    updated_us BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS {delays} (
    destination VARCHAR(255) NOT NULL PRIMARY KEY,
    queue_delay_seconds INTEGER NOT NULL
);
