"""The one price table (``prices``) and what keeping bytes in a storage class costs
(``storage_costs``): pure facts the cost model (``shardvault.lifecycle.costs``) and the
planners read."""
