"""rlfleet.trainer."""
