"""Keep transformers from importing torch in the processes that only tokenize.

transformers' tokenizer and config modules import torch whenever it is installed (for helpers srt
never calls there). That costs about 190 MiB of resident memory in each process that loads a
tokenizer: the detokenizer and the HTTP server's main process, neither of which runs a tensor op.
``transformers_without_torch()`` hides torch while transformers is first imported; transformers then
records that torch is absent (it caches the answer) and never imports it. srt's own code may still
import torch afterwards. Only a process that srt owns from start to end uses it (never the
``Engine``, which lives in the user's process).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

ADVISORY = "TRANSFORMERS_NO_ADVISORY_WARNINGS"  # transformers' "PyTorch was not found" advice


@contextmanager
def transformers_without_torch() -> Iterator[bool]:
    """Import transformers' tokenizer and config classes with torch hidden; yields whether it did
    (not when torch or transformers is already imported: nothing is left to save)."""
    if "torch" in sys.modules or "transformers" in sys.modules:
        yield False
        return
    advisory = os.environ.get(ADVISORY)
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` fails; find_spec says absent
    os.environ[ADVISORY] = "1"
    try:
        from transformers import AutoConfig, AutoTokenizer  # noqa: F401 - the imports are the point

        yield True
    finally:
        if "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]
        if advisory is None:
            os.environ.pop(ADVISORY, None)
        else:
            os.environ[ADVISORY] = advisory
