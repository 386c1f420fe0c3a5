"""Lambda handlers: thin edges that parse the event, call the core and return plain data."""
