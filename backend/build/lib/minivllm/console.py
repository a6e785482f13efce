"""The one way the engine talks to the person starting it: "[minivllm] ..." lines on stderr (model
load, kernel choice, compilation), kept off stdout so that command output stays clean."""

from __future__ import annotations

import sys


def progress(msg: str) -> None:
    print(f"[minivllm] {msg}", file=sys.stderr, flush=True)
