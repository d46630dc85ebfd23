"""`python -m harness <verb> ...`: Hydra would read the verb as an override, so it is taken here."""

import sys

from harness.cli.main import entry

if __name__ == "__main__":
    sys.exit(entry(sys.argv[1:]))
