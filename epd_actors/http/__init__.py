"""HTTP/1.1 pieces shared by every server and client in the package: request-body framing and
the small keep-alive HTTP client the OpenAI HTTP backend uses."""
