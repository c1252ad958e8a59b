"""``python -m deltamq.cli``: the same as the ``deltamq`` console script."""

import sys

from deltamq.cli import main

sys.exit(main())
