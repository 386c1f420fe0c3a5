"""ShardVault node agent: registers its node, polls its inbox and runs backup commands.

The agent holds no S3 credentials: it reads the database's files and sends them to the store
through presigned URLs, each bound to the checksum of the bytes it may carry.
"""

from shardvault.versions import installed

__version__ = installed("shardvault-agent")  # registered with the node (agents/pyproject.toml)

# The agent protocol this agent speaks, registered with its node: a control plane that needs a
# newer one refuses backups and restores by name (shardvault.contracts.models.AGENT_PROTOCOL says
# what each number added).
PROTOCOL = 7
