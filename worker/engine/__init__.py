"""The engine: scheduling, batching through a backend, prefix reuse and output; no sockets."""
