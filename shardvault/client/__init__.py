"""The ``shardvault`` command: its parser and output (``cli``, ``cli_drills``) over plain
functions (``operations``), against AWS or the local stack."""
