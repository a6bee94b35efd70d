-- A store churns like a queue: every message is inserted once and deleted once. Autovacuum (where it is on)
-- is told to visit the messages and ids tables after a few percent of their rows changed, not a fifth.
-- Statistics are gathered for the columns the claims filter and sort on only, from fewer rows (30 buckets):
-- an ANALYZE after a bulk load of millions then takes a fraction of the time, beside running pumps.
-- Only table and column options change: no rows are rewritten and pumps keep running while this is applied.
/* postgresql */ ALTER TABLE {messages} SET (autovacuum_vacuum_threshold = 10000, autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_threshold = 1000, autovacuum_analyze_scale_factor = 0.02, autovacuum_vacuum_insert_threshold = 100000, autovacuum_vacuum_insert_scale_factor = 0.1);
/* postgresql */ ALTER TABLE {messages} ALTER COLUMN body SET STATISTICS 0, ALTER COLUMN headers SET STATISTICS 0, ALTER COLUMN message_id SET STATISTICS 0, ALTER COLUMN stored_at_us SET STATISTICS 0, ALTER COLUMN failures SET STATISTICS 0, ALTER COLUMN id SET STATISTICS 30, ALTER COLUMN due_at_us SET STATISTICS 30, ALTER COLUMN destination SET STATISTICS 30, ALTER COLUMN claim_id SET STATISTICS 30;
/* postgresql */ ALTER TABLE {ids} SET (autovacuum_vacuum_threshold = 10000, autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_threshold = 1000, autovacuum_analyze_scale_factor = 0.02, autovacuum_vacuum_insert_threshold = 100000, autovacuum_vacuum_insert_scale_factor = 0.1);
