"""``python -m kvstore.cli``: the console script without an installed entry point."""

import sys

from kvstore.cli.main import main

sys.exit(main())
