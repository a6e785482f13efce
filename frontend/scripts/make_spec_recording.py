"""Records a small speculative-decoding session for the dashboard's tests: k=3 drafts from a second,
differently seeded tiny random model (so some are rejected), giving verify steps with accepted and
rejected drafts, rolled-back tail blocks (BlocksFreed with `table`), drafted tokens and the spec
metrics counters.
Usage (from the repository root):
    .venv/bin/python frontend/scripts/make_spec_recording.py frontend/src/__fixtures__/spec_session.jsonl
The engine's own final snapshot is the footer, and OUT's `.snapshots.jsonl` sibling holds its snapshot
after every step: folding the events up to each one's `seq` must give it exactly."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import msgspec

from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.events.recording import Recorder
from minivllm.loader import load_model
from minivllm.sampling.params import SamplingParams
from minivllm.spec_decode.config import SpeculativeConfig

SPEC = {"method": "draft_model", "model": "random:tiny", "num_speculative_tokens": 3, "disable_by_batch_size": None}


def prompts() -> list[list[int]]:
    """Repeated phrases (drafts often right) and one random prompt (drafts often wrong)."""
    rng = random.Random(7)
    out = []
    for length in (3, 5, 8):
        phrase = [rng.randrange(3, 5000) for _ in range(length)]
        out.append(phrase * 4 + phrase[:2])
    out.append([rng.randrange(3, 5000) for _ in range(20)])
    return out


def record(out: Path) -> Path:
    target = load_model("random:tiny", dtype="float32", device="cpu", seed=0)
    draft = load_model("random:tiny", dtype="float32", device="cpu", seed=1)  # disagrees with the target often
    engine = LLMEngine(
        target,
        EngineConfig(num_blocks=24, block_size=4, max_num_batched_tokens=40, metrics_interval_s=0.0),
        speculative=SpeculativeConfig.parse(SPEC),
        draft=draft,
    )
    recorder = Recorder(out)
    engine.subscribe(recorder, on_snapshot=recorder.begin)
    for i, ids in enumerate(prompts()):
        engine.add_request(
            f"r{i}", prompt_token_ids=ids, params=SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        )
    # sampled: rejection sampling keeps some drafts and resamples at the first rejected one
    engine.add_request(
        "s",
        prompt_token_ids=prompts()[0],
        params=SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True),
    )
    snapshots = []
    while engine.has_work():
        engine.step()
        snapshots.append(engine.snapshot())
    recorder.close(engine.snapshot())
    out.with_suffix(".snapshots.jsonl").write_bytes(b"".join(msgspec.json.encode(s) + b"\n" for s in snapshots))
    return out


if __name__ == "__main__":
    print(record(Path(sys.argv[1])))
