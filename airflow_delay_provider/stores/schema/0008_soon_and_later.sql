-- The messages table in two partitions by `tier` (tables.SOON_US): `_soon`, the messages due within minutes,
-- where every send of a near message, every claim and every vacuum of delivered rows works; and `_later`, the
-- messages due further ahead, from which the store moves them into `_soon` shortly before they are due
-- (stores/tiers.py). Under steady churn a single table spread the free space of delivered rows over all its
-- pages, so each claim and each vacuum pass touched more distinct pages as the hours went by.
-- Queries name the partitioned table and see both partitions; claims read both due indexes in order.
-- The existing table becomes `_soon` in place: no row is copied. Writers wait while this runs (the table is
-- locked, and PostgreSQL reads it once to check that every row belongs in `_soon`).
ALTER TABLE {messages} ADD COLUMN tier SMALLINT NOT NULL DEFAULT 0;
/* postgresql */ ALTER TABLE {messages} RENAME TO {soon_name};
/* postgresql */ ALTER INDEX {ix_due_q} RENAME TO {ix_soon_due};
/* postgresql */ ALTER INDEX {ix_leased_q} RENAME TO {ix_soon_leased};
/* postgresql */ DROP TRIGGER delay_counts_insert ON {soon};
/* postgresql */ DROP TRIGGER delay_counts_delete ON {soon};
/* postgresql */ DROP TRIGGER delay_counts_update ON {soon};
/* postgresql */ DROP TRIGGER delay_counts_truncate ON {soon};
/* postgresql */ CREATE TABLE {messages} (
    id BIGINT NOT NULL DEFAULT nextval('{id_seq}'),
    message_id VARCHAR(200) NOT NULL,
    destination VARCHAR(255) NOT NULL,
    body BYTEA NOT NULL,
    headers TEXT NOT NULL,
    due_at_us BIGINT NOT NULL,
    stored_at_us BIGINT NOT NULL,
    failures INTEGER NOT NULL DEFAULT 0,
    claim_id VARCHAR(64),
    tier SMALLINT NOT NULL DEFAULT 0
) PARTITION BY LIST (tier);
/* postgresql */ ALTER TABLE {messages} ALTER COLUMN body SET STATISTICS 0, ALTER COLUMN headers SET STATISTICS 0, ALTER COLUMN message_id SET STATISTICS 0, ALTER COLUMN stored_at_us SET STATISTICS 0, ALTER COLUMN failures SET STATISTICS 0, ALTER COLUMN id SET STATISTICS 30, ALTER COLUMN due_at_us SET STATISTICS 30, ALTER COLUMN destination SET STATISTICS 30, ALTER COLUMN claim_id SET STATISTICS 30, ALTER COLUMN tier SET STATISTICS 0;
/* postgresql */ ALTER TABLE {messages} ATTACH PARTITION {soon} FOR VALUES IN (0);
/* postgresql */ CREATE INDEX {ix_due} ON ONLY {messages} (due_at_us, id);
/* postgresql */ ALTER INDEX {ix_due_q} ATTACH PARTITION {ix_soon_due_q};
/* postgresql */ CREATE INDEX {ix_leased} ON ONLY {messages} (claim_id) WHERE claim_id IS NOT NULL;
/* postgresql */ ALTER INDEX {ix_leased_q} ATTACH PARTITION {ix_soon_leased_q};
-- `_later` gets the partitioned table's indexes; its own unique keys as `_soon` has them.
/* postgresql */ CREATE TABLE {later} PARTITION OF {messages} FOR VALUES IN (1) WITH (autovacuum_vacuum_threshold = 10000, autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_threshold = 1000, autovacuum_analyze_scale_factor = 0.02, autovacuum_vacuum_insert_threshold = 100000, autovacuum_vacuum_insert_scale_factor = 0.1);
/* postgresql */ ALTER TABLE {later} ADD PRIMARY KEY (id), ADD UNIQUE (message_id);
/* postgresql */ ALTER TABLE {later} ALTER COLUMN body SET STATISTICS 0, ALTER COLUMN headers SET STATISTICS 0, ALTER COLUMN message_id SET STATISTICS 0, ALTER COLUMN stored_at_us SET STATISTICS 0, ALTER COLUMN failures SET STATISTICS 0, ALTER COLUMN id SET STATISTICS 30, ALTER COLUMN due_at_us SET STATISTICS 30, ALTER COLUMN destination SET STATISTICS 30, ALTER COLUMN claim_id SET STATISTICS 30, ALTER COLUMN tier SET STATISTICS 0;
/* postgresql */ ALTER TABLE {soon} ALTER COLUMN tier SET STATISTICS 0;
-- The backlog counts follow every statement on the partitioned table (moves between the partitions add up to 0).
/* postgresql */ CREATE TRIGGER delay_counts_insert AFTER INSERT ON {messages}
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION {count_fn}();
/* postgresql */ CREATE TRIGGER delay_counts_delete AFTER DELETE ON {messages}
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION {count_fn}();
/* postgresql */ CREATE TRIGGER delay_counts_update AFTER UPDATE ON {messages}
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION {count_fn}();
/* postgresql */ CREATE TRIGGER delay_counts_truncate AFTER TRUNCATE ON {messages}
    FOR EACH STATEMENT EXECUTE FUNCTION {count_fn}();
