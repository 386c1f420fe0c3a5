"""SQLite: the adapter (``adapter``: an online-backup snapshot of each database file) and a
restored database's checks (``checks``)."""
