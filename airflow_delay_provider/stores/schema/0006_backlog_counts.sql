-- How many messages each destination has due in each hour: the backlog page and its histogram read these
-- instead of counting millions of rows. Triggers keep them whatever writes the messages table (sends,
-- claims, moves, sweeps, cancels, a TRUNCATE): each statement adds a row per destination and hour it
-- changed, never updating one in place, so concurrent pumps never wait on each other for it; the store's
-- upkeep sums the rows up. PostgreSQL only: a SQLite store is small enough to count.
-- The messages table is locked against writes while the counts start (pumps wait, for seconds at 10M).
/* postgresql */ LOCK TABLE {messages} IN SHARE ROW EXCLUSIVE MODE;
/* postgresql */ CREATE TABLE IF NOT EXISTS {counts} (
    id BIGSERIAL NOT NULL PRIMARY KEY,
    destination VARCHAR(255) NOT NULL,
    hour BIGINT NOT NULL,
    n BIGINT NOT NULL
);
/* postgresql */ CREATE OR REPLACE FUNCTION {count_fn}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO {counts} (destination, hour, n)
            SELECT destination, div(due_at_us, 3600000000), count(*) FROM new_rows GROUP BY 1, 2;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO {counts} (destination, hour, n)
            SELECT destination, div(due_at_us, 3600000000), -count(*) FROM old_rows GROUP BY 1, 2;
    ELSIF TG_OP = 'UPDATE' THEN
        INSERT INTO {counts} (destination, hour, n)
            SELECT destination, hour, sum(n) FROM (
                SELECT destination, div(due_at_us, 3600000000) AS hour, 1 AS n FROM new_rows
                UNION ALL SELECT destination, div(due_at_us, 3600000000), -1 FROM old_rows) AS changed
            GROUP BY 1, 2 HAVING sum(n) <> 0;
    ELSE
        DELETE FROM {counts};
    END IF;
    RETURN NULL;
END
$$;
/* postgresql */ CREATE TRIGGER delay_counts_insert AFTER INSERT ON {messages}
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION {count_fn}();
/* postgresql */ CREATE TRIGGER delay_counts_delete AFTER DELETE ON {messages}
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION {count_fn}();
/* postgresql */ CREATE TRIGGER delay_counts_update AFTER UPDATE ON {messages}
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION {count_fn}();
/* postgresql */ CREATE TRIGGER delay_counts_truncate AFTER TRUNCATE ON {messages}
    FOR EACH STATEMENT EXECUTE FUNCTION {count_fn}();
/* postgresql */ INSERT INTO {counts} (destination, hour, n)
    SELECT destination, div(due_at_us, 3600000000), count(*) FROM {messages} GROUP BY 1, 2;
-- Rows a bulk sweep has leased, for the backlog's in-flight counts (few at any time: a small index).
/* postgresql */ CREATE INDEX IF NOT EXISTS {ix_leased} ON {messages} (claim_id) WHERE claim_id IS NOT NULL;
