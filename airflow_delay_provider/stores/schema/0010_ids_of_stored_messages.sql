-- Every stored message's id in the ids table, remembered at least until the message is due (stores/dedup.py): on
-- PostgreSQL the messages are in partitions whose unique indexes see their own rows only, and the ids table is
-- what refuses an id still stored, whatever partition holds it. Before, a message stored longer than the
-- de-duplication window (or with the window at 0) had no row there, and a re-send of its id was stored a second
-- time in another partition. Writers wait while this runs.
/* postgresql */ LOCK TABLE {messages} IN SHARE ROW EXCLUSIVE MODE;
INSERT INTO {ids} AS i (message_id, seen_at_us)
    SELECT message_id, due_at_us - 1 FROM {messages} WHERE true
    ON CONFLICT (message_id) DO UPDATE SET seen_at_us =
        CASE WHEN excluded.seen_at_us > i.seen_at_us THEN excluded.seen_at_us ELSE i.seen_at_us END;
