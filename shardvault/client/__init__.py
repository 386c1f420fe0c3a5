"""The ``shardvault`` command: ``cli`` puts together its subcommands (``commands``, one module
each), which print through ``output``, ``records`` and ``follow`` over plain functions
(``operations``), against AWS or the local stack."""
