"""A backup's bytes: the part pipeline (``pipeline``), frame tables and checksums, how a
stream becomes objects and parts (``planning``), a stream's files (``streams``) and
incremental chains (``chains``)."""
