"""Errors users can act on, and the exit codes the CLI documents."""

import signal

EXIT_OK = 0  # every point produced a row (OOM rows count)
EXIT_ROW_ERROR = 1  # some row is an error (exception, killed, timeout)
EXIT_USAGE = 2  # usage or config error: nothing was run


class ConfigError(ValueError):
    """A bad config value, named by its dotted key."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


class Interrupted(BaseException):
    """Raised in the main thread by SIGINT or SIGTERM (cli.interrupt; a BaseException: nothing on the
    way catches it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum
