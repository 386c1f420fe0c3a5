"""The stack's parts, one construct per concern: storage, tables, notifications, functions,
the backup workflow and the agents' access. Each takes what it uses as keyword arguments and
exposes what others need as attributes; the stack wires them together and makes the grants.
"""
