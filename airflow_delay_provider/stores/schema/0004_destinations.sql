-- Every destination the store has taken messages for or provisioned, and whether it is paused:
-- the backlog controls refuse names not here, and claims skip paused destinations' messages.
CREATE TABLE IF NOT EXISTS {dests} (
    destination VARCHAR(255) NOT NULL PRIMARY KEY,
    registered_at_us BIGINT NOT NULL,
    paused_at_us BIGINT
);
INSERT INTO {dests} (destination, registered_at_us)
    SELECT destination, 0 FROM {messages}
    UNION SELECT destination, 0 FROM {policies}
    UNION SELECT destination, 0 FROM {delays};
