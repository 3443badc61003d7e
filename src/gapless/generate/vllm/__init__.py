"""vLLM behind the stepped-generator surface: the engine and its weight transports."""
