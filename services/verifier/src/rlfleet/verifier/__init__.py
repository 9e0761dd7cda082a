"""rlfleet.verifier."""
