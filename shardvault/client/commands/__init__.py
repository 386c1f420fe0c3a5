"""The ``shardvault`` subcommands, one module each: its parser (``add_parser``) and what it
runs. ``shardvault.client.cli`` puts them together."""
