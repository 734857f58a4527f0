"""The simulated engine: the same stage contract and data dependencies as vLLM, a latency
model and fault injection, plus a double of vLLM's OpenAI HTTP server. It lets every test, demo and
benchmark run without a GPU."""
