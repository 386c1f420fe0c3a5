"""ShardVault node agent: registers its node, polls its inbox and runs backup commands.

The agent holds no S3 credentials: it reads the database's files and sends them to the store
through presigned URLs, each bound to the checksum of the bytes it may carry.
"""

from shardvault.versions import installed

__version__ = installed("shardvault-agent")  # registered with the node (agents/pyproject.toml)
