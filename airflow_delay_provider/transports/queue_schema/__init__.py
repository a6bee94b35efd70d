"""The SQL-table queues' versioned migrations (numbered SQL files, applied by stores.migrations)."""
