"""Engines for tests/test_ray_replicas.py, in a module Ray's workers import by name (the test puts
tests/ on their PYTHONPATH): the random `tiny` model, its steps slowed so that a request of a
thousand tokens is still running seconds after it starts, when the test kills its replica."""

from __future__ import annotations

import functools
import time

from minivllm.engine.api import EngineConfig
from minivllm.engine.factory import create_engine

BLOCK = 16
POOL_BLOCKS = 200
STEP_DELAY_S = 0.005


def slow_tiny_engine():
    config = EngineConfig(num_blocks=POOL_BLOCKS, block_size=BLOCK, max_num_seqs=8)
    engine = create_engine("random:tiny", config, quantization="none", threads=1, enforce_eager=True)
    step = engine.step

    @functools.wraps(step)
    def slowed():
        time.sleep(STEP_DELAY_S)
        return step()

    engine.step = slowed
    return engine
