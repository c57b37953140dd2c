"""The one exception type afdtool reports to the user (no traceback)."""


class AfdError(RuntimeError):
    """A user-facing failure: __main__ prints `afdtool: error: <msg>` and exits 1."""
