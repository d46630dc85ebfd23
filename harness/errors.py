"""Errors users can act on, and the exit codes the CLI documents."""

EXIT_OK = 0  # every point produced a row (OOM rows count)
EXIT_ROW_ERROR = 1  # some row is an error (exception, killed, timeout)
EXIT_USAGE = 2  # usage or config error: nothing was run


class ConfigError(ValueError):
    """A bad config value, named by its dotted key."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message
