"""``python -m vlkv.serve --model M ...``: the same as ``vlkv serve``."""

import sys

from vlkv.serve.cli import main

sys.exit(main())
