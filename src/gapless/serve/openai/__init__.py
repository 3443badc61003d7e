"""The OpenAI-compatible HTTP API over the request scheduler: request models (params), the app
(routes, streaming), the extra routes (tokenize, detokenize, Prometheus metrics) and the server."""
