"""Facts of the deployed stack that code on both sides of it relies on, kept in one place:
the state machines' per-node Maps and the watch's schedule. ``tests/infra`` holds the
synthesized template equal to them."""

# The per-node Distributed Maps' MaxConcurrency (statemachines/*.asl.json): at most this many
# nodes run a step at once (``shardvault.workflow.fanout``).
NODE_MAP_CONCURRENCY = 1000
# The watch's period: an EventBridge rule runs it this often (``shardvault.assurance.watch``).
WATCH_MINUTES = 15
