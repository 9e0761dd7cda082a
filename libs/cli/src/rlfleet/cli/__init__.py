"""rlfleet.cli."""
