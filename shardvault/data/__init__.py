"""A backup's bytes: the part pipeline (``pipeline``), frame tables and checksums, how a
stream becomes objects and parts (``planning``), extents and streams, incremental chains, and
reading a backup back from the store (``readback``, ``materialize``)."""
