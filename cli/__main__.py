"""`python -m tidegate.cli`: the `tidegate` command without its console script."""

import sys

from tidegate.cli import main

sys.exit(main())
