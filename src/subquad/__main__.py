"""``python -m subquad``: the ``subquad`` command, for where the script is not on the path."""

import sys

from subquad.cli import main

if __name__ == "__main__":
    sys.exit(main())
