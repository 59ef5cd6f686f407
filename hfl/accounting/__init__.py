"""Resource accounting: what a client-round costs (memory, FLOPs, bytes) and what clients may spend.

Import from the modules themselves (`amounts`, `cost`, `memory`, `accountant`, `budgets`): the package
imports nothing, so that the config can read `amounts` without torch and without `budgets`, which
reads the config.
"""
