-- Messages paused by a filter (`pause_messages`) wait in a partition of their own, `tier` -1 (tables.HELD): the
-- claims, the sweeps' and event leases and the move never read it, so a million held messages cost them nothing,
-- and a resume puts each row back in the partition its due time says. Every other read (browse, counts, story)
-- and change (cancel, reschedule, edit, purge) names the partitioned table and sees them. On SQLite the value of
-- `tier` alone holds a message; this version says the store knows it.
-- Only a new, empty partition: PostgreSQL locks the messages table for the moment it takes to attach it.
/* postgresql */ CREATE TABLE {held} PARTITION OF {messages} FOR VALUES IN (-1);
/* postgresql */ ALTER TABLE {held} ADD PRIMARY KEY (id), ADD UNIQUE (message_id);
/* postgresql */ ALTER TABLE {held} ALTER COLUMN body SET STATISTICS 0, ALTER COLUMN headers SET STATISTICS 0, ALTER COLUMN message_id SET STATISTICS 0, ALTER COLUMN stored_at_us SET STATISTICS 0, ALTER COLUMN failures SET STATISTICS 0, ALTER COLUMN id SET STATISTICS 30, ALTER COLUMN due_at_us SET STATISTICS 30, ALTER COLUMN destination SET STATISTICS 30, ALTER COLUMN claim_id SET STATISTICS 30, ALTER COLUMN tier SET STATISTICS 0;
