"""Example engine workers for rayfree (used by the tests and `rayfree demo`)."""
