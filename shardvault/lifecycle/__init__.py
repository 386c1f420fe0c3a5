"""A backup's life after it is verified: promotion into the vault (``promote``), how long it
is kept and in which class (``lifetimes``), which backups expire (``retention``), their
expiry (``expire``), the sweep of what no backup owns (``sweep``) and what it all costs
(``costs``)."""
