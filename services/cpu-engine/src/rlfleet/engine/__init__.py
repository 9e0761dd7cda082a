"""rlfleet.engine."""
