"""`serve_probe.py` (the probed `specserve serve` of docs/bench/issue20-heap-retention-s31) with glibc's
default heap behaviour when ARM=default: the command-line boundary's `retain_heaps` becomes a no-op, so
one tree serves both arms of a side-by-side run.

    ARM=default PROBE=probe.jsonl python serve_arm.py serve --port 8716 ...
"""

import os
import runpy
from pathlib import Path

import specserve.api.settings as settings

if os.environ.get("ARM") == "default":
    settings.retain_heaps = lambda: False
probe = Path(__file__).resolve().parents[1] / "issue20-heap-retention-s31" / "serve_probe.py"
runpy.run_path(str(probe), run_name="__main__")
