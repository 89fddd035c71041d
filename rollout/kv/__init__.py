"""KV memory: the pool of slots (pool.py), the slot table of running sequences (slot_table.py),
the prefix cache (prefix_cache.py: the radix tree of radix_cache.py, or none), and their one
owner, the KV manager (manager.py). docs/architecture.md gives the ownership invariants."""
