-- `_later` in partitions by due hour (tables.RING_HOURS): under steady churn with delays up to a day, the move of
-- each message due within the minute deleted a row somewhere in all of `_later`, so its vacuum passes and the full
-- page images of its first changes after a checkpoint covered more pages each hour (12.9 s to 60.4 s a pass in an
-- hour-long soak). Now the messages due in one hour share a partition: the move empties the current hour's, the
-- store truncates it once its hour has passed, and the messages due further ahead than the partitions reach wait
-- in `_far`, from which the store moves them into their hour's partition as it comes within reach
-- (stores/tiers.py).
-- The existing `_later` becomes `_far` in place: no row is copied, and the move sends its rows to their hours'
-- partitions after the migration. Writers wait while this runs (PostgreSQL reads `_far` once to check that every
-- row belongs there).
/* postgresql */ ALTER TABLE {messages} DETACH PARTITION {later};
/* postgresql */ ALTER TABLE {later} RENAME TO {far_name};
/* postgresql */ CREATE TABLE {later} PARTITION OF {messages}
    FOR VALUES IN (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27)
    PARTITION BY LIST (tier);
/* postgresql */ ALTER TABLE {later} ATTACH PARTITION {far} FOR VALUES IN (1);
-- The hours' partitions: tier 2 + the due hour modulo 26. Each is truncated when its hour is past, and vacuumed
-- only at 100,000 + 20% of its rows dead (by the store's upkeep, and by autovacuum where it is on), which keeps
-- the dead entries the move passes over few without a pass every few thousand rows.
/* postgresql */ DO $$
DECLARE
    hour_table TEXT;
BEGIN
    FOR n IN 0..25 LOOP
        hour_table := concat_ws('.', quote_ident({schema_literal}), quote_ident({table_literal} || '_hour' || lpad(n::text, 2, '0')));
        -- Concatenated, not format(): the driver would take its placeholders for parameters.
        EXECUTE 'CREATE TABLE ' || hour_table || ' PARTITION OF {later} FOR VALUES IN (' || (n + 2) || ') WITH ('
                       'autovacuum_vacuum_threshold = 100000, autovacuum_vacuum_scale_factor = 0.2, '
                       'autovacuum_analyze_threshold = 1000, autovacuum_analyze_scale_factor = 0.02, '
                       'autovacuum_vacuum_insert_threshold = 100000, autovacuum_vacuum_insert_scale_factor = 0.1)';
        EXECUTE 'ALTER TABLE ' || hour_table || ' ADD PRIMARY KEY (id), ADD UNIQUE (message_id)';
        EXECUTE 'ALTER TABLE ' || hour_table || ' ALTER COLUMN body SET STATISTICS 0, ALTER COLUMN headers SET STATISTICS 0, '
                       'ALTER COLUMN message_id SET STATISTICS 0, ALTER COLUMN stored_at_us SET STATISTICS 0, '
                       'ALTER COLUMN failures SET STATISTICS 0, ALTER COLUMN id SET STATISTICS 30, '
                       'ALTER COLUMN due_at_us SET STATISTICS 30, ALTER COLUMN destination SET STATISTICS 30, '
                       'ALTER COLUMN claim_id SET STATISTICS 30, ALTER COLUMN tier SET STATISTICS 0';
    END LOOP;
END $$;
