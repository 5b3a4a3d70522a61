"""The OpenAI-compatible and SGLang-native HTTP server (`jaxspec serve`): schemas, scheduler, app."""
