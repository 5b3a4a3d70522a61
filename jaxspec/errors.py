"""User-facing errors.

A `JaxspecError` is a mistake the user can fix (bad path, unsupported architecture, corrupt
weights, invalid sampling parameter). The CLI prints it as one line and exits non-zero; the
server turns it into an OpenAI-style 400. Anything else is a bug and keeps its traceback.
"""


class JaxspecError(Exception):
    """An error caused by user input, with a message that says how to fix it."""
