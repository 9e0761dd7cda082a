"""rlfleet.session."""
