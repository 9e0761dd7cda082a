"""rlfleet.envkit."""
