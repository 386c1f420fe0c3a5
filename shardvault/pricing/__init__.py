"""What backups, restores and clusters cost: the one price table (``prices``), storage
classes (``storage_costs``) and the model over both (``costs``)."""
