"""What a backup needs on a node beside its commands (``shardvault_agent.commands``): the
captures kept between commands (``captures``), the incremental's scan against its parent's
block map (``scan``, ``blockmap``, ``mappedscreen``), and how hard it may read the source
(``throttle``, ``hostcpu``, ``sourceguard``)."""
