"""``python -m moestream.stream_generate``: ``moestream generate`` under its reference-system name, same flags."""

import sys

from .cli import generate_main

if __name__ == "__main__":
    sys.exit(generate_main())
