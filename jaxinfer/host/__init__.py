"""The host tier: requests, KV block bookkeeping and scheduling. Pure Python + numpy; never imports jax."""
