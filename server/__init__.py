"""The OpenAI-compatible HTTP server (`jaxspec serve`, issue 5). Not implemented yet."""
