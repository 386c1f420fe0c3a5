"""MariaDB: the adapter (``adapter``: backup through mariabackup into the agent's state
directory; restore by mariabackup --prepare), the server it starts and stops (``server``) and
a restored copy's checks (``checks``)."""
