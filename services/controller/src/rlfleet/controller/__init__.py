"""rlfleet controller: the run's control as a service."""
