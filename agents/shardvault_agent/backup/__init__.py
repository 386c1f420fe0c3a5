"""A backup on a node: its commands (``commands``), what they keep between them (``state``,
``captures``), the incremental's scan against its parent's block map (``scan``, ``blockmap``,
``mappedscreen``), and how hard it may read the source (``limits``, ``throttle``, ``hostcpu``,
``sourceguard``)."""
