"""rlfleet.common."""
