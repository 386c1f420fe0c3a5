"""What a deployment is told: the control plane's settings from the environment
(``settings``) and the policy file of clusters, schedules and vault (``policy``)."""
