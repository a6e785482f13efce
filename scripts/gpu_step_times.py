"""Where a decode step's time goes on a GPU (run by scripts/gpu_check.sh): the captured graph's
replay alone (device events), the runner's whole call (inputs copied in, replay, LM head), and the
engine's whole step (scheduling, sampling, outputs), each with graphs and eagerly, at 1, 8 and 32
sequences. Medians of many runs; prints one table. The graphs here hold the compiled layers
(MINIVLLM_CUDA_COMPILE=1 unless set otherwise), so the runner's call is also timed compiled
without graphs."""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from minivllm.bench.common import run_engine
from minivllm.core.step_work import SeqWork
from minivllm.engine.config import EngineConfig
from minivllm.engine.factory import create_engine
from minivllm.sampling.params import SamplingParams

CONTEXT = 200  # tokens already cached per sequence


def median_ms(fn, repeats: int = 100) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def replay_ms(graph, repeats: int = 100) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def main(model: str, dtype: str, quantization: str) -> None:
    os.environ.setdefault("MINIVLLM_CUDA_COMPILE", "1")
    engine = create_engine(
        model,
        EngineConfig(max_num_seqs=32, max_model_len=2048),
        dtype=dtype,
        device="cuda",
        quantization=quantization,
        enforce_eager=False,
    )
    runner, graphs, model = engine.runner, engine.runner.graphs, engine.loaded.model
    compiled = model.compiled
    width = CONTEXT // engine.config.block_size + 1
    print(f"\n== {model.config.name} ({dtype}, {quantization}): ms per decode step at {CONTEXT} cached tokens ==")
    print(f"graphs: {model.compilation()}")
    print(
        f"{'rows':>5} {'graph replay':>13} {'runner graphs':>14} {'runner compiled':>16} {'runner eager':>13} "
        f"{'engine step graphs':>19} {'engine step eager':>18}"
    )
    for rows in (1, 8, 32):
        works = [SeqWork([5 + i], CONTEXT, list(range(1 + i * width, 1 + (i + 1) * width))) for i in range(rows)]
        bucket = next(w for w in graphs.width_sizes if w >= width)
        replay = replay_ms(graphs.graphs[rows, bucket].replay.graph)
        with_graphs = median_ms(lambda: runner.execute(works, []))
        step_graphs = engine_step_ms(engine, rows)
        runner.graphs = None
        with_compiled = median_ms(lambda: runner.execute(works, [])) if compiled is not None else float("nan")
        model.compiled = None
        eager = median_ms(lambda: runner.execute(works, []))
        step_eager = engine_step_ms(engine, rows)
        runner.graphs, model.compiled = graphs, compiled
        print(
            f"{rows:>5} {replay:>10.3f} ms {with_graphs:>11.3f} ms {with_compiled:>13.3f} ms {eager:>10.3f} ms "
            f"{step_graphs:>16.3f} ms {step_eager:>15.3f} ms"
        )


def engine_step_ms(engine, rows: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    result = run_engine(engine, [[5, 17, 300, 400, 9] * 8 for _ in range(rows)], params, "profile", rows)
    return rows / result.decode_tokens_per_s * 1e3


if __name__ == "__main__":
    main(*(sys.argv[1:] + ["random:smollm2-135m", "float32", "none"][len(sys.argv) - 1 :]))
