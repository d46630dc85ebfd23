"""`python -m harness <verb> ...`: Hydra would read the verb as an override, so it is taken here."""

import sys

if __name__ == "__main__":
    if sys.argv[1:2] and sys.argv[1] in ("run", "sweep", "plan"):
        # before the CLI's own imports (Hydra, pandas, matplotlib: a second): the points' parent
        # imports and warms up meanwhile
        from harness.launch import zygote

        zygote.start_early(sys.argv[2:])
    from harness.cli.main import entry

    sys.exit(entry(sys.argv[1:]))
