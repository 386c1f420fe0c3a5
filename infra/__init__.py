"""The ShardVault CDK app: one stack composed of small constructs (see ``infra/stack.py``).

Infrastructure code never imports the runtime packages (``shardvault``, ``functions``); it
only packages them into the Lambda code asset.
"""
