"""Thin driver: ``python benchmarks/bench_serving.py [flags]`` is ``python -m srt.bench_serving [flags]``.

See ``srt/bench_serving.py`` (and docs/benchmarks.md) for the protocol and the flags.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from srt.bench_serving import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
