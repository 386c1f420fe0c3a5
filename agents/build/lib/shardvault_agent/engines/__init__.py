"""Engine adapters: how to flush, checkpoint, stop and release one database engine's shards."""

from shardvault.models import Engine
from shardvault_agent.config import AgentConfig
from shardvault_agent.engines.base import EngineAdapter


def adapter_for(config: AgentConfig) -> EngineAdapter:
    if config.engine == Engine.SQLITE:
        from shardvault_agent.engines.sqlite import SqliteAdapter

        return SqliteAdapter(config)
    from shardvault_agent.engines.postgres import PostgresAdapter

    return PostgresAdapter(config)
