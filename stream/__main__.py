"""``python -m headrace``: the same as the ``headrace`` command."""

import sys

from headrace.cli import main

sys.exit(main())
