-- The delivery history (core/history.py): what became of each message a pump settled or a cancel removed, written
-- in the transaction that settles it. On PostgreSQL one row per batch, destination, outcome and failure, with the
-- messages in arrays, compressed with lz4 where the server has it, and partitioned by the day (UTC) of
-- `handed_at_us`: the store's upkeep attaches the days to come and drops those past the retention
-- (stores/history.py); the default partition takes the rows of a day that has no partition. On SQLite one row per
-- message. Only new tables: pumps keep running while this is applied.
/* postgresql */ CREATE TABLE IF NOT EXISTS {history} (
    handed_at_us BIGINT NOT NULL,
    destination VARCHAR(255) NOT NULL,
    outcome VARCHAR(16) NOT NULL,
    detail TEXT,
    seq BIGSERIAL NOT NULL,
    n INTEGER NOT NULL,
    message_ids TEXT[] NOT NULL,
    due_at_us BIGINT[] NOT NULL,
    attempts INTEGER[] NOT NULL,
    stored_at_us BIGINT[] NOT NULL
) PARTITION BY RANGE (handed_at_us);
/* postgresql */ DO $$
BEGIN
    -- lz4 costs the pump about half of the default compression's time (pglz) on arrays of ids.
    IF EXISTS (SELECT 1 FROM pg_settings WHERE name = 'default_toast_compression' AND 'lz4' = ANY(enumvals)) THEN
        EXECUTE 'ALTER TABLE {history} ALTER message_ids SET COMPRESSION lz4, ALTER due_at_us SET COMPRESSION lz4, '
                'ALTER attempts SET COMPRESSION lz4, ALTER stored_at_us SET COMPRESSION lz4';
    END IF;
END $$;
/* postgresql */ CREATE TABLE IF NOT EXISTS {history_default} PARTITION OF {history} DEFAULT;
/* sqlite */ CREATE TABLE IF NOT EXISTS {history} (
    handed_at_us BIGINT NOT NULL,
    destination VARCHAR(255) NOT NULL,
    outcome VARCHAR(16) NOT NULL,
    detail TEXT,
    message_id VARCHAR(200) NOT NULL,
    due_at_us BIGINT NOT NULL,
    attempts INTEGER NOT NULL,
    stored_at_us BIGINT
);
CREATE INDEX IF NOT EXISTS {ix_hat} ON {history} (handed_at_us);
CREATE INDEX IF NOT EXISTS {ix_hdest} ON {history} (destination, handed_at_us);
/* sqlite */ CREATE INDEX IF NOT EXISTS {ix_hist} ON {history} (message_id);
