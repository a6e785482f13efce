"""External-client compatibility (`make compat`, the long version of tests/test_guidellm.py): GuideLLM,
from its own venv, benchmarks a real `minivllm serve` on the embedded model with streamed chat
requests at 1, 8 and 32 concurrent streams and prints its summary. Exits 1 when any request errored
or was left incomplete.

    python scripts/compat.py [--streams 1 8 32] [--requests 64] [--out bench-results/compat]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from minivllm.bench.serve import start_server, stop_server, wait_healthy
from minivllm.loader.gguf_cache import load_tokenizer
from minivllm.loader.gguf_loader import embedded_model_path

REPO = Path(__file__).resolve().parents[1]
GUIDELLM = REPO / ".venv-guidellm" / "bin" / "guidellm"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def guidellm_command(base: str, processor: Path, report: Path, args: argparse.Namespace) -> list[str]:
    return [
        str(GUIDELLM),
        "run",
        "--backend",
        f"kind=openai_http,target={base},request_format={args.request_format}",
        "--profile",
        "kind=concurrent",
        "--override",
        "profile.streams",
        ",".join(map(str, args.streams)),
        "--constraint",
        f"kind=max_requests,count={args.requests}",
        "--constraint",
        f"kind=max_duration,seconds={args.max_seconds}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
        "--tokenizer",
        f"kind=huggingface_auto,model={processor}",
        "--output",
        f"kind=json,path={report}",
        "--disable-progress",
    ]


def failed_counts(report: Path) -> dict[int, dict]:
    """Per stream count, GuideLLM's request totals where any request errored or was left incomplete."""
    benchmarks = json.loads(report.read_text())["benchmarks"]
    totals = {b["config"]["strategy"]["streams"]: b["metrics"]["request_totals"] for b in benchmarks}
    return {streams: t for streams, t in totals.items() if t["errored"] or t["incomplete"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=64, help="requests per stream count")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--max-seconds", type=int, default=600, help="a bound per stream count")
    parser.add_argument(
        "--request-format", default="/v1/chat/completions", choices=["/v1/chat/completions", "/v1/completions"]
    )
    parser.add_argument("--out", default="bench-results/compat")
    args = parser.parse_args()
    if not GUIDELLM.exists():
        print(f"{GUIDELLM} is missing: run `make setup-guidellm`", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    processor = out / "tokenizer"
    load_tokenizer(embedded_model_path()).save_pretrained(str(processor))
    proc, base = start_server([], out / "server.log")
    try:
        wait_healthy(proc, base, out / "server.log")
        report = out / "guidellm.json"
        run = subprocess.run(guidellm_command(base, processor, report, args), cwd=out, env={**os.environ, **OFFLINE})
    finally:
        stop_server(proc)
    if run.returncode != 0:
        print(f"guidellm exited with {run.returncode}", file=sys.stderr)
        return 1
    failed = failed_counts(report)
    for streams, totals in failed.items():
        print(
            f"{streams} streams: {totals['errored']} errored, {totals['incomplete']} incomplete "
            f"(server log: {out / 'server.log'})",
            file=sys.stderr,
        )
    print(f"GuideLLM report: {report}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
