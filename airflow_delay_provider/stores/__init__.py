"""The SQL delayed-message store (SQLite, PostgreSQL): `sql.SqlDelayedMessageStore` and its parts."""
