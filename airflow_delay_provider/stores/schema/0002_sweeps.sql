-- Bulk sweeps: a row is marked with the sweep that leased it; the lease and outcome are in the sweeps table.
ALTER TABLE {messages} ADD COLUMN claim_id VARCHAR(64);
CREATE TABLE IF NOT EXISTS {sweeps} (
    claim_id VARCHAR(64) NOT NULL PRIMARY KEY,
    lease_until_us BIGINT NOT NULL,
    due_from_us BIGINT,
    due_before_us BIGINT NOT NULL,
    status VARCHAR(16) NOT NULL,
    started_at_us BIGINT NOT NULL,
    finished_at_us BIGINT,
    claimed BIGINT NOT NULL DEFAULT 0,
    taken_over BIGINT NOT NULL DEFAULT 0,
    summary TEXT
);
