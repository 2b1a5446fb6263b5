"""User-facing errors: one line, no traceback (the CLI prints `error: <message>` and exits 2)."""


class TreeflashError(ValueError):
    """Bad input or a broken/mismatched file; the message is a complete one-line explanation."""
