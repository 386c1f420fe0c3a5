"""Engine adapters: everything the agent knows of one database engine, backup and restore
(``engines.base`` defines the interface; one module per engine implements it)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardvault.contracts.models import Engine
    from shardvault_agent.config import AgentConfig
    from shardvault_agent.engines.base import EngineAdapter

# Imported on first use: an agent loads only its own engine's module (and its client library).
# Keyed by the engines' names (``Engine`` is a StrEnum: its members look them up), so that a
# module of this package imports no models: the mapped screen's helper loads only its
# engine's screen (``shardvault_agent.backup.mappedscreen``).
ADAPTERS = {
    "sqlite": "shardvault_agent.engines.sqlite.adapter:SqliteAdapter",
    "postgres": "shardvault_agent.engines.postgres.adapter:PostgresAdapter",
    "mariadb": "shardvault_agent.engines.mariadb.adapter:MariadbAdapter",
    "rocksdb": "shardvault_agent.engines.rocksdb:RocksdbAdapter",
    "hooks": "shardvault_agent.engines.hooks:HooksAdapter",
}


def adapter_class(engine: Engine) -> type[EngineAdapter]:
    module, _, name = ADAPTERS[engine].partition(":")
    return getattr(importlib.import_module(module), name)


def adapter_for(config: AgentConfig) -> EngineAdapter:
    return adapter_class(config.engine)(config)
