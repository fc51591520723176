"""The distributed tests reuse the loopback HTTP server of tests/remote."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "remote"))
