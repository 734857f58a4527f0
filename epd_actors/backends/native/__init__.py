"""The native backend: msgpack frames over one multiplexed connection per worker process."""
