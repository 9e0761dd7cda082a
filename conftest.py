# Shared fixtures for every package's tests: real NATS and Redis on free ports.
pytest_plugins = ["rlfleet.common.testing"]
