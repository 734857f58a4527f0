"""How the router reaches workers: native msgpack connections, or stock vLLM over HTTP."""
