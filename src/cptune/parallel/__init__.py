"""Context parallelism: layout arithmetic, sharding, loss and backends."""
