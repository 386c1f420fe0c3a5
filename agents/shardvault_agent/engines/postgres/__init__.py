"""PostgreSQL: the adapter (``adapter``: backup through a replication slot and
pg_backup_start/stop, the cut, the tail's WAL; restore), the server it starts and stops
(``server``), a restored copy's recovery (``restore``) and checks (``checks``), and the page
screen an incremental's scan uses (``pages``). Kept light: the scan's mapped-screen helper
imports ``pages`` alone."""
