"""rlfleet.gateway."""
