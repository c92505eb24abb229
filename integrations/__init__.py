"""flatpool.integrations: layers that apply flatpool to sharded-training frameworks.

The repository folder ``integrations/`` installs as ``flatpool.integrations`` (one top-level
import package, ``flatpool``).
"""
