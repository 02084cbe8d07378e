"""The model worker: what every rank runs (its model shards, attention backend, KV storage, views
and execution paths) and the plain-data step it executes."""
