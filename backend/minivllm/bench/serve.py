"""`minivllm bench serve`: what the OpenAI API costs on top of the engine. A real `minivllm serve`
subprocess is driven with N concurrent streamed /v1/completions requests (token-id prompts, greedy,
ignore_eos: every request generates all its tokens); the same prompts then run in-process on an
engine with the same settings. Per concurrency level it prints API vs in-process tokens/s and the
median inter-token latency through the API vs the in-process engine's median decode step, medians
over rounds (the sides alternate: this machine is noisy)."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from minivllm.bench.common import RunResult, greedy, median, precision_label, progress, run_engine
from minivllm.bench.machine import machine_line
from minivllm.bench.prompts import SYSTEM_PROMPT_WORDS
from minivllm.bench.report import plot_paired_bars

DEFAULT_PROMPT_TOKENS = 128
SERVER_START_TIMEOUT_S = 600  # the first start compiles the decode step (minutes on 2 busy cores)
REQUEST_TIMEOUT_S = 600


@dataclass
class ApiRun:
    """One level's requests through the API: per request its TTFT, and the gaps between its SSE
    chunks (one chunk per engine step that produced text)."""

    concurrency: int
    generated_tokens: int
    wall_s: float
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    server_tpot_s: list[float] = field(default_factory=list)  # per request: decode time per token, as the server saw it

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s else 0.0


@dataclass
class LevelRound:
    """One round at one level: both sides."""

    api: ApiRun
    local: RunResult
    step_s: list[float]  # the in-process engine's decode steps (no prefill in them)


@dataclass
class LevelSummary:
    concurrency: int
    api_tokens_per_s: float
    local_tokens_per_s: float
    api_itl_ms: float | None
    server_tpot_ms: float | None
    step_ms: float | None
    api_ttft_ms: float | None
    local_ttft_ms: float | None

    @property
    def throughput_ratio(self) -> float:
        return self.api_tokens_per_s / self.local_tokens_per_s if self.local_tokens_per_s else float("nan")

    @property
    def itl_ratio(self) -> float | None:
        return self.api_itl_ms / self.step_ms if self.api_itl_ms and self.step_ms else None


# ---- the server ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_options(args: argparse.Namespace) -> list[str]:
    """The model and engine options the user gave (those off their defaults), as `serve` takes them."""
    from minivllm.engine_args import add_model_args

    parser = argparse.ArgumentParser(add_help=False)
    add_model_args(parser)
    argv: list[str] = []
    for action in parser._actions:
        value = getattr(args, action.dest, action.default)
        if value == action.default or value is None:
            continue
        flag = next(o for o in action.option_strings if o.startswith("--"))
        argv += [flag] if action.nargs == 0 else [flag, str(value)]
    return argv


def start_server(options: list[str], log_path: Path) -> tuple[subprocess.Popen, str]:
    """`minivllm serve [options]` on a free loopback port, its output to `log_path`; (process, base URL)."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "minivllm.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--recordings-dir",
        str(log_path.parent / "recordings"),
        *options,
    ]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc: subprocess.Popen, base: str, log_path: Path, timeout_s: float = SERVER_START_TIMEOUT_S) -> str:
    """Wait for /health to answer 200; returns the served model's name."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}): {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server was not ready within {timeout_s:.0f} s; its log: {log_path}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


# ---- the client ---------------------------------------------------------------------------------


async def drive_api(base: str, model: str, prompts: list[list[int]], new_tokens: int) -> ApiRun:
    """All prompts at once, one streamed request each; raises on any failed request."""
    import httpx

    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(base_url=base, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        start = time.perf_counter()
        streams = await asyncio.gather(*(_one_stream(client, model, p, new_tokens) for p in prompts))
        wall = time.perf_counter() - start
    run = ApiRun(len(prompts), sum(tokens for tokens, _, _ in streams), wall)
    for _, times, server_tpot in streams:
        run.ttft_s.append(times[0] - start)
        run.itl_s += [b - a for a, b in zip(times, times[1:])]
        run.server_tpot_s += [server_tpot] if server_tpot else []
    return run


async def _one_stream(client, model: str, prompt: list[int], new_tokens: int) -> tuple[int, list[float], float | None]:
    """(tokens generated, arrival time of each chunk that carried text, the server's own decode time
    per token: from the usage chunk's `timings`)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    times, tokens, server_tpot = [], 0, None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"/v1/completions answered {response.status_code}: {(await response.aread())[:500]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the stream failed: {chunk['error']}")
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
                rate = (chunk.get("timings") or {}).get("tokens_per_s")
                server_tpot = 1 / rate if rate else None
    if tokens != new_tokens or not times:
        raise RuntimeError(f"a request generated {tokens} tokens, expected {new_tokens}")
    return tokens, times, server_tpot


# ---- in-process ---------------------------------------------------------------------------------


def run_in_process(
    engine, prompts: list[list[int]], new_tokens: int, concurrency: int
) -> tuple[RunResult, list[float]]:
    """`run_engine` (the engine stepped directly, as LLM.generate does), and its decode steps' durations."""
    steps: list[float] = []
    last_prefill = [True]

    def on_event(e) -> None:
        kind = type(e).__name__
        if kind == "StepScheduled":
            last_prefill[0] = bool(e.prefill)
        elif kind == "StepFinished" and not last_prefill[0]:
            steps.append(e.duration_ms / 1e3)

    unsubscribe = engine.bus.subscribe(on_event)
    try:
        result = run_engine(engine, prompts, greedy(new_tokens), "in-process", concurrency)
    finally:
        unsubscribe()
    return result, steps


# ---- the workload -------------------------------------------------------------------------------


def bench_prompts(tokenizer, count: int, length: int, salt: str) -> list[list[int]]:
    """`count` prompts of exactly `length` tokens, each with its own start (no shared cached prefix)."""
    filler = tokenizer.encode(SYSTEM_PROMPT_WORDS * (1 + length // 16)) if tokenizer is not None else []
    prompts = []
    for i in range(count):
        head = tokenizer.encode(f"Request {salt}-{i}: ") if tokenizer is not None else [3 + i, 5 + len(salt)]
        body = filler or list(range(100, 100 + length))
        prompts.append((head + body * (1 + length // max(len(body), 1)))[:length])
    return prompts


def bench_serve(engine, args: argparse.Namespace) -> int:
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    levels = [min(c, 4) for c in args.concurrency] if args.quick else list(args.concurrency)
    rounds = 1 if args.quick else args.rounds
    prompt_tokens = args.prompt_tokens or DEFAULT_PROMPT_TOKENS
    new_tokens = min(args.max_tokens, 16) if args.quick else args.max_tokens
    log_path = out_dir / "serve-bench-server.log"
    progress(f"starting minivllm serve (log: {log_path})")
    proc, base = start_server(model_options(args), log_path)
    try:
        model = wait_healthy(proc, base, log_path)
        progress(f"server ready at {base}; warm-up")
        warm = bench_prompts(engine.tokenizer, 2, prompt_tokens, "warm")
        asyncio.run(drive_api(base, model, warm, 4))
        run_in_process(engine, warm, 4, 2)
        by_level: dict[int, list[LevelRound]] = {level: [] for level in levels}
        for r in range(rounds):
            for level in levels:
                prompts = bench_prompts(engine.tokenizer, level, prompt_tokens, f"r{r}c{level}")
                progress(f"round {r + 1}/{rounds}, {level} concurrent: API, then in-process")
                api = asyncio.run(drive_api(base, model, prompts, new_tokens))
                local, steps = run_in_process(engine, prompts, new_tokens, level)
                by_level[level].append(LevelRound(api, local, steps))
    finally:
        stop_server(proc)
    summaries = [summarize(level, runs) for level, runs in by_level.items()]
    title = (
        f"API overhead: {engine.loaded.name}, {precision_label(engine)}, {prompt_tokens}-token prompts x "
        f"{new_tokens} new tokens (greedy, ignore_eos), medians of {rounds} round(s)"
    )
    print_serve_table(summaries, title)
    machine = machine_line()
    print(machine)
    save_serve_json(summaries, by_level, out_dir / "serve.json", {"title": title, "machine": machine})
    print(f"plot: {plot_serve(summaries, out_dir / 'serve.png', title)}")
    return 0


def summarize(level: int, runs: list[LevelRound]) -> LevelSummary:
    """Medians over rounds of each round's figure (tokens/s; the median ITL, step and TTFT)."""

    def ms(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return median(present) * 1e3 if present else None

    return LevelSummary(
        level,
        median([r.api.tokens_per_s for r in runs]),
        median([r.local.tokens_per_s for r in runs]),
        ms([median(r.api.itl_s) for r in runs]),
        ms([median(r.api.server_tpot_s) for r in runs]),
        ms([median(r.step_s) for r in runs]),
        ms([median(r.api.ttft_s) for r in runs]),
        ms([median(r.local.ttft_s) for r in runs]),
    )


HEADER = (
    f"{'conc':>4} {'API tok/s':>10} {'in-proc tok/s':>13} {'ratio':>6} {'API ITL med':>11} "
    f"{'server TPOT':>11} {'engine step med':>15} {'ratio':>6} {'API TTFT med':>12} {'in-proc TTFT med':>16}"
)


def _ms(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}ms"


def print_serve_table(summaries: list[LevelSummary], title: str) -> None:
    print(f"\n== {title} ==")
    print(HEADER)
    print("-" * len(HEADER))
    for s in summaries:
        itl_ratio = "-" if s.itl_ratio is None else f"{s.itl_ratio:.2f}x"
        print(
            f"{s.concurrency:>4} {s.api_tokens_per_s:>10.1f} {s.local_tokens_per_s:>13.1f} "
            f"{s.throughput_ratio:>5.2f}x {_ms(s.api_itl_ms):>11} {_ms(s.server_tpot_ms):>11} {_ms(s.step_ms):>15} "
            f"{itl_ratio:>6} "
            f"{_ms(s.api_ttft_ms, 1):>12} {_ms(s.local_ttft_ms, 1):>16}"
        )
    print(
        "ratio: API tok/s / in-process tok/s (target >= 0.9); API median inter-token latency / the in-process "
        "engine's median decode step (target <= 1.1 at 1 stream). server TPOT: the served requests' decode time "
        "per token as the server's engine measured it during the API run (API ITL well above it: the hand-off "
        "and SSE path; the server's TPOT itself above the in-process step: serving slowed the engine's steps)"
    )


def save_serve_json(
    summaries: list[LevelSummary], by_level: dict[int, list[LevelRound]], path: Path, extra: dict
) -> None:
    levels = [asdict(s) | {"throughput_ratio": s.throughput_ratio, "itl_ratio": s.itl_ratio} for s in summaries]
    raw = {
        str(level): [
            {
                "api": asdict(r.api) | {"tokens_per_s": r.api.tokens_per_s},
                "in_process": asdict(r.local) | {"tokens_per_s": r.local.tokens_per_s},
                "step_s": r.step_s,
            }
            for r in runs
        ]
        for level, runs in by_level.items()
    }
    path.write_text(json.dumps({**extra, "levels": levels, "rounds": raw}, indent=2))


def plot_serve(summaries: list[LevelSummary], path: Path, title: str) -> Path:
    levels = [s.concurrency for s in summaries]
    series = (
        ("through the API (minivllm serve)", [s.api_tokens_per_s for s in summaries]),
        ("in-process (engine stepped directly)", [s.local_tokens_per_s for s in summaries]),
    )

    def label_ratios(ax, xs, offset) -> None:
        for x, s in zip(xs, summaries):
            text = f"{s.throughput_ratio:.2f}x" + (f"\nITL {s.itl_ratio:.2f}x step" if s.itl_ratio else "")
            ax.annotate(text, (x, max(s.api_tokens_per_s, s.local_tokens_per_s)), ha="center", va="bottom", fontsize=8)

    return plot_paired_bars(levels, series, path, title, label_ratios, ylabel="generated tokens/s (median)")
