"""rlfleet.broker."""
