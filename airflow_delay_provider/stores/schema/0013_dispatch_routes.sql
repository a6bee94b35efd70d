-- Where the store's messages go once due: each transport, its connection and its error queue, recorded by
-- provisioning and by every dispatcher as it starts (stores/routes.py). The page finds the error queues' dead
-- letters from here, without a setting of its own. Only a new table: pumps keep running while this is applied.
CREATE TABLE IF NOT EXISTS {routes} (
    transport VARCHAR(16) NOT NULL,
    conn_id VARCHAR(250) NOT NULL,
    error_queue VARCHAR(255) NOT NULL,
    scope TEXT NOT NULL,
    seen_at_us BIGINT NOT NULL,
    PRIMARY KEY (transport, conn_id, error_queue)
);
