-- The counts per ten minutes of due time instead of per hour: the backlog's histogram adds whole slots
-- from the counts and counts the rows of the slot each limit falls in, so a smaller slot is fewer rows to
-- count (an hour of a 10,000,000-message day took more than a second). The counts start again from the
-- rows, with writes held as when they were first made.
/* postgresql */ LOCK TABLE {messages} IN SHARE ROW EXCLUSIVE MODE;
/* postgresql */ ALTER TABLE {counts} RENAME COLUMN hour TO slot;
/* postgresql */ CREATE OR REPLACE FUNCTION {count_fn}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO {counts} (destination, slot, n)
            SELECT destination, div(due_at_us, 600000000), count(*) FROM new_rows GROUP BY 1, 2;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO {counts} (destination, slot, n)
            SELECT destination, div(due_at_us, 600000000), -count(*) FROM old_rows GROUP BY 1, 2;
    ELSIF TG_OP = 'UPDATE' THEN
        INSERT INTO {counts} (destination, slot, n)
            SELECT destination, slot, sum(n) FROM (
                SELECT destination, div(due_at_us, 600000000) AS slot, 1 AS n FROM new_rows
                UNION ALL SELECT destination, div(due_at_us, 600000000), -1 FROM old_rows) AS changed
            GROUP BY 1, 2 HAVING sum(n) <> 0;
    ELSE
        DELETE FROM {counts};
    END IF;
    RETURN NULL;
END
$$;
/* postgresql */ DELETE FROM {counts};
/* postgresql */ INSERT INTO {counts} (destination, slot, n)
    SELECT destination, div(due_at_us, 600000000), count(*) FROM {messages} GROUP BY 1, 2;
