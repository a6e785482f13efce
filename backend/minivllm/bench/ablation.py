"""`minivllm bench ablation`: one workload, run with each optimisation switched off in turn (and
speculative decoding switched on), side by side with everything on: what each one is worth here.

Every configuration runs in a fresh process of its own (`python -m minivllm.bench.ablation <spec>`):
in one process the peak RSS only ever grows (the fp32 row's 0.5 GiB of weights would stay in every
later row's number) and freed memory is kept by the allocator, so a per-row RSS would mislead. The
child reports its own high-water mark (VmHWM: per process image, reset at exec) and its resident set
after loading and after the run; it loads the model itself (the rows differ in how they load it).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from minivllm.bench.common import chat_prompt_ids, fmt, greedy, progress
from minivllm.bench.machine import machine_line
from minivllm.bench.prompts import CHAT_PROMPTS, SYSTEM_PROMPT_WORDS
from minivllm.bench.report import plot_paired_bars
from minivllm.bench.rss import high_water_rss_bytes

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
CHILD_TIMEOUT_S = 1800


@dataclass(frozen=True)
class Ablation:
    """One row: how its engine differs from the all-on one."""

    name: str
    engine: dict = field(default_factory=dict)  # EngineConfig changes
    quantization: str = "auto"
    enforce_eager: bool = False
    speculative: dict | None = None


CONFIGS = (
    Ablation("all on"),
    Ablation("no KV cache", {"recompute_kv": True}),
    Ablation("static batching", {"static_batching": True}),
    Ablation("no chunked prefill", {"enable_chunked_prefill": False}),
    Ablation("no prefix caching", {"enable_prefix_caching": False}),
    Ablation("fp32 weights", quantization="none"),
    Ablation("eager step", enforce_eager=True),
    Ablation("+ n-gram speculation", speculative=NGRAM),
)


@dataclass(frozen=True)
class Workload:
    """All requests submitted at once; they share a system prompt (so prefix caching has work), ask
    for two lengths (so static batching waits on its longest) and exceed max_num_seqs (so batches
    turn over)."""

    num_prompts: int
    max_tokens: int
    system_tokens: int
    max_num_seqs: int

    @classmethod
    def from_args(cls, args) -> Workload:
        quick = args.quick
        n = args.num_prompts or (4 if quick else 16)
        return cls(n, args.max_tokens or (8 if quick else 64), 32 if quick else 192, max(1, n // 2))

    def lengths(self) -> list[int]:
        return [self.max_tokens if i % 2 == 0 else max(1, self.max_tokens // 2) for i in range(self.num_prompts)]

    def prompts(self, tokenizer) -> list[list[int]]:
        system = SYSTEM_PROMPT_WORDS
        while len(tokenizer.encode(system)) < self.system_tokens:
            system += SYSTEM_PROMPT_WORDS
        questions = (CHAT_PROMPTS * (self.num_prompts // len(CHAT_PROMPTS) + 1))[: self.num_prompts]
        return chat_prompt_ids(tokenizer, questions, system=system)


# ---- the parent: one child per row, then the table, the plot, the JSON -----------------------------


def bench_ablation(args) -> int:
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    workload = Workload.from_args(args)
    rounds = 1 if args.quick else args.rounds
    runs: dict[str, list[dict]] = {a.name: [] for a in CONFIGS}
    for round_ in range(rounds):  # rows alternate within each round: drift on a busy machine hits them all
        for i, ablation in enumerate(CONFIGS, 1):
            progress(
                f"round {round_ + 1}/{rounds}, {i}/{len(CONFIGS)} {ablation.name}: {workload.num_prompts} requests"
            )
            runs[ablation.name].append(run_child(ablation, workload, args))
    rows = [medians(name, found) for name, found in runs.items()]
    add_ratios(rows)
    machine = machine_line()
    title = (
        f"ablation: {workload.num_prompts} requests x {workload.max_tokens}/{workload.max_tokens // 2} tokens, "
        f"median of {rounds} round(s)"
    )
    report = {"workload": asdict(workload), "machine": machine, "rows": rows}
    (out_dir / "ablation.json").write_text(json.dumps(report, indent=2))
    plot = plot_rows(rows, out_dir / "ablation.png", f"{title}, shared {workload.system_tokens}-token system prompt")
    table = sys.stderr if args.json else sys.stdout  # --json: stdout carries the JSON alone
    print_table(rows, title, table)
    print(machine, file=table)
    print(f"plot: {plot}", file=table)
    if args.json:
        print(json.dumps(report))
    return 0


def run_child(ablation: Ablation, workload: Workload, args) -> dict:
    spec = {
        "ablation": asdict(ablation),
        "workload": asdict(workload),
        "model": args.model,
        "threads": args.threads,
        "device": args.device,
    }
    cmd = [sys.executable, "-m", "minivllm.bench.ablation", json.dumps(spec)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"ablation row {ablation.name!r} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def medians(name: str, runs: list[dict]) -> dict:
    """Each number's median over the rounds."""
    return {"config": name, "rounds": len(runs)} | {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def add_ratios(rows: list[dict]) -> None:
    base = rows[0]
    for r in rows:
        for key in ("tokens_per_s", "decode_tokens_per_s", "ttft_median_s", "itl_p99_s", "peak_rss_bytes"):
            r[f"ratio_{key}"] = r[key] / base[key] if base[key] else None


HEADER = (
    f"{'configuration':<22} {'tok/s':>8} {'x':>6} {'decode tok/s':>12} {'x':>6} {'TTFT med':>9} {'x':>6} "
    f"{'ITL p99':>9} {'x':>6} {'peak RSS':>9} {'RSS delta':>10}"
)


def print_table(rows: list[dict], title: str, file) -> None:
    print(f"\n== {title} (x: ratio to all on) ==", file=file)
    print(HEADER, file=file)
    print("-" * len(HEADER), file=file)
    base_rss = rows[0]["peak_rss_bytes"]
    for r in rows:
        print(
            f"{r['config']:<22} {r['tokens_per_s']:>8.1f} {fmt(r['ratio_tokens_per_s'], 1, 2):>6} "
            f"{r['decode_tokens_per_s']:>12.1f} {fmt(r['ratio_decode_tokens_per_s'], 1, 2):>6} "
            f"{r['ttft_median_s'] * 1e3:>7.0f}ms {fmt(r['ratio_ttft_median_s'], 1, 2):>6} "
            f"{r['itl_p99_s'] * 1e3:>7.1f}ms {fmt(r['ratio_itl_p99_s'], 1, 2):>6} "
            f"{r['peak_rss_bytes'] / 2**20:>6.0f}MiB {(r['peak_rss_bytes'] - base_rss) / 2**20:>+7.0f}MiB",
            file=file,
        )


def plot_rows(rows: list[dict], path: Path, title: str) -> Path:
    series = tuple((f"{r['config']} ({r['ratio_tokens_per_s']:.2f}x)", [r["tokens_per_s"]]) for r in rows)
    return plot_paired_bars(
        [rows[0]["num_requests"]], series, path, title, ylabel="generated tokens/s (higher is better)"
    )


# ---- the child: one engine, one run --------------------------------------------------------------


def measure(engine, workload: Workload) -> dict:
    """Submit every request at once and step until done, timing each step and each request's tokens.
    Decode tok/s: the tokens of steps in which no request got its first token, over those steps'
    time. ITL: the gaps between one request's consecutive token emissions (a verify step's several
    tokens are one emission)."""
    prompts = workload.prompts(engine.tokenizer)
    start = time.perf_counter()
    for i, (ids, n) in enumerate(zip(prompts, workload.lengths())):
        engine.add_request(f"ablation-{i}", prompt_token_ids=ids, params=greedy(n))
    counts: dict[str, int] = {}
    last: dict[str, float] = {}
    ttft, gaps, decode_s, decode_tokens = [], [], 0.0, 0
    while engine.has_work():
        step_start = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        new_tokens, first = 0, False
        for out in outputs:
            got = len(out.outputs[0].token_ids) if out.outputs else 0
            if not got:
                continue
            new_tokens += got
            if out.request_id in last:
                gaps.append(now - last[out.request_id])
            else:
                first = True
                ttft.append(now - start)
            last[out.request_id] = now
            counts[out.request_id] = counts.get(out.request_id, 0) + got
        if not first:
            decode_s += now - step_start
            decode_tokens += new_tokens
    wall = time.perf_counter() - start
    generated = sum(counts.values())
    return {
        "num_requests": len(prompts),
        "generated_tokens": generated,
        "wall_s": wall,
        "tokens_per_s": generated / wall,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s else 0.0,
        "ttft_median_s": statistics.median(ttft),
        "itl_p99_s": percentile(gaps, 99),
    }


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def run_row(spec: dict) -> dict:
    from minivllm.engine.api import EngineConfig
    from minivllm.engine.factory import create_engine

    ablation, workload = Ablation(**spec["ablation"]), Workload(**spec["workload"])
    config = EngineConfig(max_num_seqs=workload.max_num_seqs, **ablation.engine)
    engine = create_engine(
        spec["model"],
        config,
        device=spec["device"],
        quantization=ablation.quantization,
        threads=spec["threads"],
        speculative_config=ablation.speculative,
        enforce_eager=ablation.enforce_eager,
    )
    loaded_rss = resident_bytes()
    # warm-up on a prompt the workload does not share (a shared one would fill the prefix cache)
    engine.add_request("warm-up", prompt_token_ids=engine.encode("Hello"), params=greedy(4))
    while engine.has_work():
        engine.step()
    result = measure(engine, workload)
    return result | {
        "rss_after_load_bytes": loaded_rss,
        "rss_after_run_bytes": resident_bytes(),
        "peak_rss_bytes": high_water_rss_bytes(os.getpid()),
    }


if __name__ == "__main__":
    print(json.dumps(run_row(json.loads(sys.argv[1]))))
