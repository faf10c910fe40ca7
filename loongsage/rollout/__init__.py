"""Talking to inference servers: protocol builders, the HTTP client, and the engine launcher."""
