"""`minivllm bench llamacpp`: this engine's batched decode throughput next to llama.cpp's `llama-batched-bench`
on the same GGUF file, the same prompt length, the same number of new tokens and the same CPU thread count.

The llama.cpp binaries come from `scripts/build_llamacpp.sh` (run by `make bench-llamacpp`), which builds them
from the llama.cpp source vendored in the llama-cpp-python sdist into `<repo>/.cache/llamacpp/`.

What is compared, per concurrency level B:
  * llama.cpp: `llama-batched-bench -npp P -ntg G -npl B` (without `-pps`, so each of the B sequences gets its
    own prompt, processed in full, like our independent chat prompts), S_TG = B*G / time of the G decode steps,
    S_PP = B*P / time of the prompt batch. It runs the quantized GGUF weights with llama.cpp's kernels and
    does not sample (it feeds random tokens back).
  * mini-vllm: B chat prompts (P = their mean length) submitted at once, greedy, G new tokens each, prefix
    caching off (llama.cpp's prompts share nothing); decode tok/s = tokens sampled in decode steps / their
    time (sampling included), prompt tok/s = prompt tokens / time of the steps that ran prefill chunks.
Levels run alternately, ours then llama.cpp, so a slow spell of a noisy machine hits both sides; with
`--rounds N` each level alternates N times and the table shows each side's median and the spread of the
per-round ratios (one ~1 s run a side swung the one-sequence ratio from 1.14x to 1.65x between two runs).
"""

from __future__ import annotations

import os
import re
import shlex
import statistics
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from minivllm.arith import ceil_div
from minivllm.bench.rss import own_peak_rss_bytes, run_with_peak_rss, split_line
from minivllm.engine.memory_budget import process_rss_bytes

BENCH_BINARY = "llama-batched-bench"
ENV_DIR = "MINIVLLM_LLAMACPP_DIR"
BUILD_HINT = "run `make bench-llamacpp` (or `bash scripts/build_llamacpp.sh`) to build it"
COLUMNS = ("PP", "TG", "B", "N_KV", "T_PP", "S_PP", "T_TG", "S_TG", "T", "S")


class LlamaCppNotFoundError(FileNotFoundError):
    """llama.cpp's `llama-batched-bench` has not been built (or is not where we look)."""


def repo_root() -> Path:
    """The checkout this package lives in (backend/minivllm/bench/llamacpp.py -> the repository)."""
    return Path(__file__).resolve().parents[3]


def default_llamacpp_dir() -> Path:
    return repo_root() / ".cache" / "llamacpp"


def _candidates(base: Path) -> list[Path]:
    """Where a build may have put the binary: the layout of scripts/build_llamacpp.sh (build-<version>/bin,
    newest version first), a plain CMake build folder (bin/) or a folder holding the binary itself."""
    builds = sorted(
        base.glob(f"build-*/bin/{BENCH_BINARY}"), key=lambda p: _version_key(p.parent.parent.name), reverse=True
    )
    return builds + [base / "build" / "bin" / BENCH_BINARY, base / "bin" / BENCH_BINARY, base / BENCH_BINARY]


def _version_key(build_dir_name: str) -> tuple:
    return tuple(int(x) if x.isdigit() else 0 for x in re.split(r"[.\-]", build_dir_name.removeprefix("build-")))


def find_llamacpp_bench(environ: dict | None = None) -> Path:
    """The built `llama-batched-bench`: under $MINIVLLM_LLAMACPP_DIR when set, else <repo>/.cache/llamacpp."""
    environ = os.environ if environ is None else environ
    override = environ.get(ENV_DIR)
    base = Path(override).expanduser() if override else default_llamacpp_dir()
    for path in _candidates(base):
        if path.is_file() and os.access(path, os.X_OK):
            return path
    where = f"${ENV_DIR}={override}" if override else str(base)
    raise LlamaCppNotFoundError(
        f"llama.cpp's {BENCH_BINARY} was not found under {where} "
        f"(looked for build-*/bin/{BENCH_BINARY}, build/bin/, bin/ and the folder itself): {BUILD_HINT}, "
        f"or set {ENV_DIR} to a folder holding a llama.cpp build"
    )


# ---- running llama-batched-bench and parsing its table ---------------------------------------------------


@dataclass
class BatchedBenchRow:
    """One line of llama-batched-bench's table: B sequences, PP prompt tokens and TG new tokens each."""

    pp: int  # prompt tokens per sequence
    tg: int  # generated tokens per sequence
    b: int  # parallel sequences
    n_kv: int  # KV cells needed
    t_pp: float  # s, prompt processing
    s_pp: float  # prompt tokens/s
    t_tg: float  # s, text generation
    s_tg: float  # generated tokens/s (all sequences together)
    t: float  # s, total
    s: float  # tokens/s overall


@dataclass
class BatchedBenchResult:
    command: list[str]
    rows: list[BatchedBenchRow]
    settings: dict[str, str] = field(default_factory=dict)  # n_kv_max, n_batch, flash_attn, n_threads, ...
    output: str = ""
    peak_rss_bytes: int = 0  # the llama.cpp process's largest resident set

    def by_level(self) -> dict[int, BatchedBenchRow]:
        return {r.b: r for r in self.rows}

    def decode_tokens_per_s(self) -> dict[int, float]:
        return {r.b: r.s_tg for r in self.rows}

    def prompt_tokens_per_s(self) -> dict[int, float]:
        return {r.b: r.s_pp for r in self.rows}


_SETTINGS = re.compile(r"(\w+)\s*=\s*([^,\s]+)")


def parse_batched_bench_output(text: str) -> tuple[list[BatchedBenchRow], dict[str, str]]:
    """The markdown table llama-batched-bench prints (`|    PP |     TG |    B |   N_KV |   T_PP s | ...`) and the
    settings line above it (`main: n_kv_max = 8192, n_batch = 2048, ...`). Other log lines are ignored."""
    rows, settings = [], {}
    header: list[str] | None = None
    for line in text.splitlines():
        line = line.strip()
        if "n_kv_max" in line and "=" in line and not settings:
            settings = dict(_SETTINGS.findall(line.split(":", 1)[-1]))
            continue
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells and cells[0] == "PP":
            header = [c.split()[0] for c in cells]  # "T_PP s" -> "T_PP", "S_PP t/s" -> "S_PP"
            if tuple(header) != COLUMNS:
                raise ValueError(f"unexpected llama-batched-bench columns {header} (expected {list(COLUMNS)})")
            continue
        if header is None or not cells or not cells[0].isdigit():
            continue  # the ---|--- separator, or a table this parser does not know
        if len(cells) != len(COLUMNS):
            raise ValueError(f"cannot parse llama-batched-bench row: {line!r}")
        ints, floats = cells[:4], cells[4:]
        rows.append(BatchedBenchRow(*(int(c) for c in ints), *(float(c) for c in floats)))
    return rows, settings


def context_size(prompt_tokens: int, gen_tokens: int, parallel_levels: list[int]) -> int:
    """KV cells for the largest level, every sequence with its own prompt: B * (P + G), rounded up to 256."""
    need = max(parallel_levels) * (prompt_tokens + gen_tokens)
    return ceil_div(need, 256) * 256


def batched_bench_command(
    binary: Path | str,
    gguf_path: Path | str,
    prompt_tokens: int,
    gen_tokens: int,
    parallel_levels: list[int],
    threads: int,
) -> list[str]:
    return [
        str(binary),
        "-m",
        str(gguf_path),
        "-c",
        str(context_size(prompt_tokens, gen_tokens, parallel_levels)),
        "-b",
        "2048",
        "-ub",
        "512",
        "-npp",
        str(prompt_tokens),
        "-ntg",
        str(gen_tokens),
        "-npl",
        ",".join(str(b) for b in parallel_levels),
        "-t",
        str(threads),
        "-tb",
        str(threads),
    ]


def run_batched_bench(
    binary: Path | str,
    gguf_path: Path | str,
    prompt_tokens: int,
    gen_tokens: int,
    parallel_levels: list[int],
    threads: int,
    timeout_s: float | None = 1800,
) -> BatchedBenchResult:
    """Run llama-batched-bench once for these levels and parse its table (decode tok/s = S_TG, prompt tok/s = S_PP
    per level). No `-pps`: each parallel sequence processes its own prompt, like independent requests."""
    cmd = batched_bench_command(binary, gguf_path, prompt_tokens, gen_tokens, parallel_levels, threads)
    proc, peak_rss = run_with_peak_rss(cmd, timeout_s)
    output = proc.stdout + "\n" + proc.stderr  # the table goes to stdout, the logs to stderr: not interleaved
    tail = "\n".join(proc.stderr.splitlines()[-25:])
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited with {proc.returncode}:\n{tail}")
    rows, settings = parse_batched_bench_output(output)
    missing = sorted(set(parallel_levels) - {r.b for r in rows})
    if missing:
        raise RuntimeError(
            f"llama-batched-bench printed no row for {missing} parallel sequences (context too small?):\n{tail}"
        )
    return BatchedBenchResult(cmd, rows, settings, proc.stdout, peak_rss)


# ---- mini-vllm at the same levels -----------------------------------------------------------------------


@dataclass
class LevelComparison:
    level: int
    prompt_tokens: int  # per sequence (the mean chat prompt length at this level)
    gen_tokens: int
    ours_decode_tok_s: float | None
    ours_prompt_tok_s: float | None
    llamacpp_decode_tok_s: float
    llamacpp_prompt_tok_s: float
    llamacpp_command: str
    ours_rss_bytes: int = 0  # this process's resident set at the end of this level (what ps shows while serving)
    llamacpp_peak_rss_bytes: int = 0  # its resident set stays at its peak once loaded
    # the rates above are medians over rounds; these are each round's ratio (ours / theirs, one round after another)
    decode_ratios: tuple[float, ...] = ()
    prompt_ratios: tuple[float, ...] = ()

    @property
    def decode_ratio(self) -> float | None:
        return self.ours_decode_tok_s / self.llamacpp_decode_tok_s if self.ours_decode_tok_s else None

    @property
    def prompt_ratio(self) -> float | None:
        return self.ours_prompt_tok_s / self.llamacpp_prompt_tok_s if self.ours_prompt_tok_s else None


def run_ours(engine, prompts: list[list[int]], max_tokens: int, level: int):
    """`run_engine` plus the prompt-processing rate: prompt tokens over the time of the steps that ran prefill."""
    from minivllm.bench.common import greedy, run_engine

    prefill = {"tokens": 0, "time": 0.0}
    current: dict[str, int] = {}

    def on_event(e) -> None:
        kind = type(e).__name__
        if kind == "StepScheduled":
            current["prefill_tokens"] = sum(c.num_tokens for c in e.prefill)
        elif kind == "StepFinished" and current.get("prefill_tokens"):
            prefill["tokens"] += current["prefill_tokens"]
            prefill["time"] += e.duration_ms / 1e3

    unsubscribe = engine.bus.subscribe(on_event)
    try:
        result = run_engine(engine, prompts, greedy(max_tokens), "mini-vllm", level)
    finally:
        unsubscribe()
    prompt_rate = prefill["tokens"] / prefill["time"] if prefill["time"] else None
    return result, prompt_rate


def fixed_length(prompts: list[list[int]], n: int) -> list[list[int]]:
    """Each prompt repeated (or cut) to exactly n tokens: decode compared at a long context."""
    return [(p * (n // len(p) + 1))[:n] for p in prompts]


def _warn_if_pool_too_small(engine, levels: list[int], tokens_per_sequence: int) -> None:
    """llama.cpp's context is sized to each level; ours is the engine's pool. A level that does not fit would
    run in waves (or preempt), which is not the comparison the table claims: say so up front."""
    capacity = engine.kv_cache.num_blocks * engine.kv_cache.block_size
    for level in levels:
        if level * tokens_per_sequence > capacity:
            print(
                f"warning: {level} concurrent x {tokens_per_sequence} tokens need more KV than the pool's "
                f"{capacity} slots: mini-vllm will not hold them all at once (raise --kv-cache-memory)"
            )


def _median(values) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _ratios(ours, theirs) -> tuple[float, ...]:
    return tuple(a / b for a, b in zip(ours, theirs) if a and b)


def level_comparison(level: int, prompt_len: int, max_tokens: int, ours: list, theirs: list) -> LevelComparison:
    """One level's rounds (ours: (run_engine result, prompt rate) each; theirs: llama-batched-bench runs, in
    the same order) as medians and per-round ratios; the RSS figures are the last round's."""
    rows = [run.by_level()[level] for run in theirs]
    ours_decode = [result.decode_tokens_per_s for result, _ in ours]
    ours_prompt = [rate for _, rate in ours]
    return LevelComparison(
        level,
        prompt_len,
        max_tokens,
        _median(ours_decode),
        _median(ours_prompt),
        statistics.median(r.s_tg for r in rows),
        statistics.median(r.s_pp for r in rows),
        shlex.join(theirs[-1].command),
        process_rss_bytes(),
        theirs[-1].peak_rss_bytes,
        _ratios(ours_decode, [r.s_tg for r in rows]),
        _ratios(ours_prompt, [r.s_pp for r in rows]),
    )


def _weights_description(engine) -> str:
    """How mini-vllm holds the weights: the quantization mode, else the dtype."""
    dtype = str(engine.loaded.dtype).removeprefix("torch.")
    mode = engine.loaded.quant.mode
    return f"{mode}, dtype {dtype}" if mode != "none" else f"{dtype}, dequantized"


def cpu_busy_fraction(interval_s: float = 1.0) -> float | None:
    """How busy the machine's CPUs are over `interval_s` (from /proc/stat; None where there is none)."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        return fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields[:8])  # idle + iowait, total

    try:
        idle0, total0 = sample()
        time.sleep(interval_s)
        idle1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return 1 - (idle1 - idle0) / (total1 - total0) if total1 > total0 else None


def _warn_if_busy() -> None:
    """Both sides keep every thread busy; llama.cpp's spinning thread barriers in particular collapse (10x and
    worse) when another process holds one of those cores, so say so rather than print a misleading ratio."""
    busy = cpu_busy_fraction()
    if busy is not None and busy > 0.25:
        print(
            f"warning: the CPUs were {busy:.0%} busy before starting (another process?): both sides, llama.cpp "
            f"the most, will read slow and the ratios will not mean much"
        )


def bench_llamacpp(engine, args) -> int:
    import torch

    from minivllm.bench.common import chat_prompt_ids, greedy, progress, run_engine
    from minivllm.bench.machine import cpu_capability, machine_line
    from minivllm.bench.prompts import CHAT_PROMPTS

    binary = find_llamacpp_bench()  # LlamaCppNotFoundError (a FileNotFoundError): the CLI prints it, exit 2
    gguf = Path(engine.loaded.source)
    if gguf.suffix != ".gguf" or not gguf.is_file():
        raise ValueError(
            f"the llama.cpp comparison needs a GGUF model; {engine.loaded.name} was loaded from "
            f"{engine.loaded.source} (pass --model FILE.gguf, or omit --model for the embedded one)"
        )
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    quick = getattr(args, "quick", False)
    max_tokens = 16 if quick else args.max_tokens
    rounds = 1 if quick else getattr(args, "rounds", 1)
    levels = [min(c, 4) for c in args.concurrency] if quick else list(args.concurrency)
    levels = list(dict.fromkeys(levels))
    threads = torch.get_num_threads()
    prompts = chat_prompt_ids(engine.tokenizer, (CHAT_PROMPTS * (1 + max(levels) // len(CHAT_PROMPTS)))[: max(levels)])
    prompt_tokens = getattr(args, "prompt_tokens", None)
    if prompt_tokens:
        prompts = fixed_length(prompts, prompt_tokens)
    info = engine.info()
    print(f"{machine_line()}; llama.cpp gets the same thread count (-t/-tb {threads})")
    ours_weights = _weights_description(engine)
    print(f"model: {gguf}\n  mini-vllm weights: {ours_weights}; llama.cpp: the GGUF tensors as stored, its own kernels")
    print(f"llama.cpp: {binary}")
    print(f"KV cache: mini-vllm {info.kv_cache_dtype} (--kv-cache-dtype), llama.cpp f16 (its default)")
    _warn_if_busy()
    _warn_if_pool_too_small(engine, levels, max(len(p) for p in prompts) + max_tokens)

    original_prefix_caching = engine.config.enable_prefix_caching
    if original_prefix_caching:
        engine.reconfigure(enable_prefix_caching=False)  # llama.cpp's prompts share nothing: compute ours in full
    comparisons: list[LevelComparison] = []
    ours_runs, llama_runs = [], []
    try:
        progress("warm-up")
        run_engine(engine, prompts[:2], greedy(4), "warm-up", 2)
        for level in levels:
            batch = prompts[:level]
            prompt_len = max(1, round(statistics.mean(len(p) for p in batch)))
            ours, theirs = [], []
            for r in range(rounds):
                label = f"{level} concurrent" + (f", round {r + 1}/{rounds}" if rounds > 1 else "")
                progress(f"{label}: mini-vllm, {level} chat prompts (mean {prompt_len} tokens) x {max_tokens} tokens")
                ours.append(run_ours(engine, batch, max_tokens, level))
                command = batched_bench_command(binary, gguf, prompt_len, max_tokens, [level], threads)
                progress(f"{label}: {shlex.join(command)}")
                start = time.perf_counter()
                theirs.append(run_batched_bench(binary, gguf, prompt_len, max_tokens, [level], threads))
                progress(f"{label}: llama.cpp done in {time.perf_counter() - start:.1f}s")
            ours_runs.extend(result for result, _ in ours)
            llama_runs.extend(
                {
                    "level": level,
                    "round": r,
                    "command": run.command,
                    "settings": run.settings,
                    **asdict(run.by_level()[level]),
                }
                for r, run in enumerate(theirs)
            )
            comparisons.append(level_comparison(level, prompt_len, max_tokens, ours, theirs))
    finally:
        if original_prefix_caching:
            engine.reconfigure(enable_prefix_caching=True)

    title = (
        f"{engine.loaded.name}: mini-vllm ({ours_weights}) vs llama.cpp ({gguf.name}), "
        f"{max_tokens} new tokens per sequence, {threads} threads"
        + (f", medians of {rounds} alternating rounds" if rounds > 1 else "")
    )
    print_comparison(comparisons, title)
    print(memory_line(engine))
    print(split_line(engine.stats().memory))
    settings = llama_runs[0]["settings"] if llama_runs else {}
    extra = {
        "comparison": [
            asdict(c) | {"decode_ratio": c.decode_ratio, "prompt_ratio": c.prompt_ratio} for c in comparisons
        ],
        "llamacpp": llama_runs,
        "llamacpp_settings": settings,
        "cpu_capability": cpu_capability(),
        "threads": threads,
        "rounds": rounds,
        "dtype": info.dtype,
        "kv_cache_dtype": info.kv_cache_dtype,
        "weights": ours_weights,
        "gguf": str(gguf),
    }
    from minivllm.bench.report import save_json

    save_json(ours_runs, out_dir / "llamacpp.json", extra)
    print(f"results: {out_dir / 'llamacpp.json'}")
    print(f"plot: {plot_comparison(comparisons, out_dir / 'llamacpp.png', title)}")
    return 0


def format_comparison(comparisons: list[LevelComparison]) -> list[str]:
    from minivllm.bench.common import fmt

    spread = any(len(c.decode_ratios) > 1 for c in comparisons)  # several rounds: each ratio's range too

    def side(ours: str, theirs: str, ratio: str, ratios: str) -> list[str]:  # decode's or prompt's columns
        return [f"{ours:>22}", f"{theirs:>22}", f"{ratio:>6}"] + ([f"{ratios:>11}"] if spread else [])

    header = " | ".join(
        [
            f"{'level':>5}",
            *side("mini-vllm decode tok/s", "llama.cpp decode tok/s", "ratio", "per round"),
            *side("mini-vllm prompt tok/s", "llama.cpp prompt tok/s", "ratio", "per round"),
            f"{'RSS MiB (ours / llama.cpp peak)':>31}",
        ]
    )
    lines = [header, "-" * len(header)]
    for c in comparisons:
        lines.append(
            " | ".join(
                [
                    f"{c.level:>5}",
                    *side(
                        fmt(c.ours_decode_tok_s),
                        f"{c.llamacpp_decode_tok_s:.1f}",
                        f"{fmt(c.decode_ratio, digits=2)}x",
                        _range(c.decode_ratios),
                    ),
                    *side(
                        fmt(c.ours_prompt_tok_s),
                        f"{c.llamacpp_prompt_tok_s:.1f}",
                        f"{fmt(c.prompt_ratio, digits=2)}x",
                        _range(c.prompt_ratios),
                    ),
                    f"{_mib(c.ours_rss_bytes) + ' / ' + _mib(c.llamacpp_peak_rss_bytes):>31}",
                ]
            )
        )
    return lines


def _range(ratios: tuple[float, ...]) -> str:
    """The lowest and highest of a level's per-round ratios ("1.14-1.65x"); "-" without any."""
    return f"{min(ratios):.2f}-{max(ratios):.2f}x" if ratios else "-"


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f}" if n else "-"


def memory_line(engine) -> str:
    """What the RSS column holds: ours is this one process after each level, llama.cpp's the peak of a process
    per level whose KV context is sized to that level."""
    weights, pool = engine.loaded.quant.weight_bytes, engine.kv_cache.num_bytes
    return (
        f"RSS (what ps shows): mini-vllm is this one process, after each level (peak so far "
        f"{_mib(own_peak_rss_bytes())} MiB, start-up included): weights {_mib(weights)} MiB, KV pool "
        f"{_mib(pool)} MiB reserved (resident as its blocks are first written), the rest torch, the tokenizer "
        f"and code; llama.cpp is a new process a level "
        f"(its peak), its KV context sized to the level"
    )


def print_comparison(comparisons: list[LevelComparison], title: str) -> None:
    print(f"\n== {title} ==")
    print("(level = concurrent sequences; ratio = mini-vllm / llama.cpp, above 1 means mini-vllm is faster)")
    for line in format_comparison(comparisons):
        print(line)
    for c in comparisons:
        print(f"  {c.level} concurrent: {c.prompt_tokens} prompt tokens per sequence; llama.cpp: {c.llamacpp_command}")


def plot_comparison(comparisons: list[LevelComparison], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = list(range(len(comparisons)))
    width = 0.4
    panels = (
        (axes[0], "decode tokens/s (higher is better)", lambda c: (c.ours_decode_tok_s, c.llamacpp_decode_tok_s)),
        (axes[1], "prompt tokens/s (higher is better)", lambda c: (c.ours_prompt_tok_s, c.llamacpp_prompt_tok_s)),
    )
    for ax, label, values in panels:
        ours = [values(c)[0] or 0 for c in comparisons]
        theirs = [values(c)[1] or 0 for c in comparisons]
        ax.bar([x - width / 2 for x in xs], ours, width=width, label="mini-vllm")
        ax.bar([x + width / 2 for x in xs], theirs, width=width, label="llama.cpp")
        for x, a, b in zip(xs, ours, theirs):  # the ratio over each pair, as the table prints it
            if a and b:
                ax.annotate(f"{a / b:.2f}x", (x, max(a, b)), ha="center", va="bottom", fontsize=8)
        ax.margins(y=0.12)
        ax.set_xticks(xs, [f"{c.level} concurrent" for c in comparisons])
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(textwrap.fill(title, 120), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
