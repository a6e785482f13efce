"""Shared benchmark pieces: prompt encoding, per-request statistics, the HF baselines, plots."""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from minivllm.engine.api import LLMEngine, OutputAccumulator
from minivllm.sampling.params import SamplingParams
from minivllm.text.tokenizer_utils import load_chat_template_prompt


@dataclass
class RunResult:
    """One benchmark run: a mode at a concurrency level."""

    mode: str
    concurrency: int
    num_requests: int
    generated_tokens: int
    wall_s: float
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    decode_tokens_per_s: float | None = None
    kv_blocks_used: int | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s else 0.0


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def p90(xs: list[float]) -> float | None:
    if not xs:
        return None
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]


def progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def chat_prompt_ids(tokenizer, prompts: list[str], system: str | None = None) -> list[list[int]]:
    def messages(p: str) -> list[dict[str, str]]:
        head = [{"role": "system", "content": system}] if system else []
        return head + [{"role": "user", "content": p}]

    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        gen = torch.Generator().manual_seed(0)
        return [torch.randint(3, 30000, (32 + 4 * i,), generator=gen).tolist() for i, _ in enumerate(prompts)]
    return [load_chat_template_prompt(tokenizer, messages(p)) for p in prompts]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_engine(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, mode: str, concurrency: int
) -> RunResult:
    """Submit all prompts at once and step until done (continuous batching)."""
    decode_time, decode_tokens, peak_blocks = 0.0, 0, 0
    pending: dict[str, object] = {}

    def on_event(e) -> None:
        nonlocal decode_time, decode_tokens
        kind = type(e).__name__
        if kind == "StepScheduled":
            pending["prefill"] = bool(e.prefill)
        elif kind == "StepFinished" and not pending.get("prefill", True):
            decode_time += e.duration_ms / 1e3
            decode_tokens += e.num_generated

    unsubscribe = engine.bus.subscribe(on_event)
    ids = [f"{mode}-{concurrency}-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    start = time.perf_counter()
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, prompt_token_ids=p, params=params)
    finished, whole = {}, OutputAccumulator()
    while engine.has_work():
        for out in map(whole.add, engine.step()):
            if out.finished:
                finished[out.request_id] = out
        peak_blocks = max(peak_blocks, engine.block_manager.num_blocks - engine.block_manager.num_free_blocks)
    wall = time.perf_counter() - start
    unsubscribe()
    result = RunResult(
        mode,
        concurrency,
        len(prompts),
        sum(o.num_generated_tokens for o in finished.values()),
        wall,
        decode_tokens_per_s=decode_tokens / decode_time if decode_time else None,
        kv_blocks_used=peak_blocks,
    )
    for out in finished.values():
        m, n = out.metrics, out.num_generated_tokens
        result.ttft_s.append(m.ttft)
        if n > 1:
            result.tpot_s.append((m.finished_time - m.first_token_time) / (n - 1))
    return result


def combine_runs(mode: str, concurrency: int, runs: list[RunResult]) -> RunResult:
    """One-request-at-a-time runs summed into one result (decode rate from the median TPOT)."""
    blocks = [r.kv_blocks_used for r in runs if r.kv_blocks_used is not None]
    tpot = [t for r in runs for t in r.tpot_s]
    return RunResult(
        mode,
        concurrency,
        len(runs),
        sum(r.generated_tokens for r in runs),
        sum(r.wall_s for r in runs),
        ttft_s=[t for r in runs for t in r.ttft_s],
        tpot_s=tpot,
        decode_tokens_per_s=1 / median(tpot) if tpot else None,
        kv_blocks_used=max(blocks) if blocks else None,
    )


def run_engine_sequential(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, concurrency: int
) -> RunResult:
    runs = [run_engine(engine, [p], params, "seq", concurrency) for p in prompts]
    return combine_runs("mini-vllm one at a time", concurrency, runs)


class StepClock:
    """A transformers StoppingCriteria that never stops; it records when each token is produced."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def hf_generate(model, tokenizer, prompts: list[list[int]], max_tokens: int, mode: str, concurrency: int) -> RunResult:
    """HF `generate`, greedy, exactly max_tokens new tokens per prompt, one static (left-padded) batch."""
    from transformers import StoppingCriteriaList

    pad = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    clock = StepClock()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=pad,
            stopping_criteria=StoppingCriteriaList([clock]),
        )
    wall = time.perf_counter() - start
    ttft = clock.times[0] - start
    tpot = (clock.times[-1] - clock.times[0]) / max(len(clock.times) - 1, 1)
    return RunResult(
        mode,
        concurrency,
        len(prompts),
        len(prompts) * max_tokens,
        wall,
        ttft_s=[ttft] * len(prompts),
        tpot_s=[tpot] * len(prompts),
        decode_tokens_per_s=len(prompts) / tpot if tpot else None,
    )


def hf_sequential(model, tokenizer, prompts: list[list[int]], max_tokens: int, concurrency: int) -> RunResult:
    runs = [hf_generate(model, tokenizer, [p], max_tokens, "seq", concurrency) for p in prompts]
    return combine_runs("HF generate sequential", concurrency, runs)


def load_hf_oracle(loaded):
    """The transformers model on the same weights, for the baseline (None for random shapes)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    source = loaded.source
    if source.endswith(".gguf"):
        path = Path(source)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=loaded.dtype)
    elif source.startswith("random"):
        return None
    else:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=loaded.dtype)
    return model.eval()


def precision_label(engine) -> str:
    """'float32', or the weights' precision ('int4 g32') for table titles and mode names."""
    info = engine.info()
    return info.dtype if info.quantization in ("none", info.dtype) else info.quantization.split(" (")[0]


def fmt(x: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"
