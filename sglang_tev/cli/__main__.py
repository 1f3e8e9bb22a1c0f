"""``python -m sglang_tev.cli``: the ``sglang-tev`` console script."""

import sys

from . import main

sys.exit(main())
