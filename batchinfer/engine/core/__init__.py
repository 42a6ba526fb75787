"""The scheduling core: the scheduler policy, the paged KV block manager, sequences and their checks."""
