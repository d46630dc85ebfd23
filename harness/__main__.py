"""`python -m harness <verb> ...`: Hydra would read the verb as an override, so it is taken here."""

import os
import signal
import sys

if __name__ == "__main__":
    try:
        if sys.argv[1:2] and sys.argv[1] in ("run", "sweep", "plan"):
            # before the CLI's own imports (Hydra, pandas, matplotlib: a second): the points' parent
            # imports and warms up meanwhile
            from harness.launch import zygote

            zygote.start_early(sys.argv[2:])
        from harness.cli.main import entry

        code = entry(sys.argv[1:])
        sys.stdout.flush()
    except BrokenPipeError:  # its reader went away (`| head`): no traceback, as a Unix tool ends on SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the exit's own flush would fail again)
        code = 128 + signal.SIGPIPE
    except KeyboardInterrupt:  # Ctrl-C outside the points' runs (composing, reporting): what is written stays
        print("harness: interrupted by SIGINT; the files written so far are kept", file=sys.stderr)
        code = 128 + signal.SIGINT
    sys.exit(code)
