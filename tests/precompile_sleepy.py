"""A module that takes a minute to import: tests/test_precompile.py's hung-worker case."""

import time

time.sleep(60)
