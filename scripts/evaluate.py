"""Measurement report (quality + speed, optionally kvpress side by side); see vlkv/eval/run.py."""

import sys

from vlkv.eval.run import main

if __name__ == "__main__":
    sys.exit(main())
