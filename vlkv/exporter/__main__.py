"""``python -m vlkv.exporter`` = ``build-engine``."""

from vlkv.exporter.cli import main

raise SystemExit(main())
