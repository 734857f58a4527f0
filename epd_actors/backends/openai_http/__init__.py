"""The OpenAI HTTP backend: stock `vllm serve` instances reached over HTTP/1.1 with SSE."""
