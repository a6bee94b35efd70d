-- The hours' partitions of `_later` are emptied by the move and truncated once their hour is past
-- (stores/tiers.py); the store's own upkeep analyses them and vacuums the hours to come at 100,000 + 20% of their
-- rows dead, never the current hour's nor the hour past's. Autovacuum, where it is on, followed their options
-- instead: it vacuumed the current hour's partition every few minutes (a pass of 7 s over a million rows
-- whose dead entries the move and the look already start past), and a pass over the hour past's held the lock
-- its truncation needs for as long as it ran. So autovacuum leaves these partitions to the store; it still runs
-- on them to prevent transaction-id wraparound (nothing can turn that off), and each truncation gives a
-- partition a fresh frozen-xid horizon, daily. `_soon`, `_far`, the ids and the counts keep autovacuum: their
-- upkeep and autovacuum count the same dead rows, and whichever comes first resets what the other reads.
-- Only table options change: no rows are rewritten and pumps keep running while this is applied.
/* postgresql */ DO $$
DECLARE
    hour_table TEXT;
BEGIN
    FOR n IN 0..25 LOOP
        hour_table := concat_ws('.', quote_ident({schema_literal}), quote_ident({table_literal} || '_hour' || lpad(n::text, 2, '0')));
        EXECUTE 'ALTER TABLE ' || hour_table || ' SET (autovacuum_enabled = false, toast.autovacuum_enabled = false)';
    END LOOP;
END $$;
