"""Engine adapters: everything the agent knows of one database engine, backup and restore
(``engines.base`` defines the interface; one module per engine implements it)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from shardvault.models import Engine

if TYPE_CHECKING:
    from shardvault_agent.config import AgentConfig
    from shardvault_agent.engines.base import EngineAdapter

# Imported on first use: an agent loads only its own engine's module (and its client library).
ADAPTERS = {
    Engine.SQLITE: "shardvault_agent.engines.sqlite:SqliteAdapter",
    Engine.POSTGRES: "shardvault_agent.engines.postgres:PostgresAdapter",
    Engine.MARIADB: "shardvault_agent.engines.mariadb:MariadbAdapter",
    Engine.ROCKSDB: "shardvault_agent.engines.rocksdb:RocksdbAdapter",
    Engine.HOOKS: "shardvault_agent.engines.hooks:HooksAdapter",
}


def adapter_class(engine: Engine) -> type[EngineAdapter]:
    module, _, name = ADAPTERS[engine].partition(":")
    return getattr(importlib.import_module(module), name)


def adapter_for(config: AgentConfig) -> EngineAdapter:
    return adapter_class(config.engine)(config)
