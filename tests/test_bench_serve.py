"""`minivllm bench serve`: a tiny run end to end (a real server subprocess, then the engine in-process)
prints the side-by-side table and writes its JSON and plot; the numbers' structure is checked, not
their speed."""

from __future__ import annotations

import argparse
import json

import pytest
from test_cli import cli

from minivllm.bench.serve import bench_prompts, model_options
from minivllm.engine_args import add_model_args

pytestmark = pytest.mark.slow  # a server, a subprocess or the real model in every test


def test_bench_serve_tiny_run_prints_both_sides_and_writes_json_and_plot(tmp_path):
    proc = cli(
        "bench",
        "serve",
        "--model",
        "random:tiny",
        "--concurrency",
        "1",
        "2",
        "--rounds",
        "1",
        "--max-tokens",
        "4",
        "--prompt-tokens",
        "16",
        "--output-dir",
        str(tmp_path),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[bench] round 1/1, 2 concurrent" in proc.stderr  # progress
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("conc"))
    assert "API tok/s" in lines[header] and "engine step med" in lines[header]
    rows = [line.split() for line in lines[header + 2 : header + 4]]
    assert [r[0] for r in rows] == ["1", "2"]
    assert any(line.startswith("machine: CPU capability") for line in lines)
    report = json.loads((tmp_path / "serve.json").read_text())
    assert [level["concurrency"] for level in report["levels"]] == [1, 2]
    for level in report["levels"]:
        assert level["api_tokens_per_s"] > 0 and level["local_tokens_per_s"] > 0 and level["step_ms"] > 0
        assert level["server_tpot_ms"] > 0  # the usage chunk's timings came through
        assert level["throughput_ratio"] == level["api_tokens_per_s"] / level["local_tokens_per_s"]
    for concurrency, (run,) in report["rounds"].items():  # every request generated all its tokens on both sides
        assert run["api"]["generated_tokens"] == run["in_process"]["generated_tokens"] == int(concurrency) * 4
        assert len(run["api"]["ttft_s"]) == int(concurrency)
    assert (tmp_path / "serve.png").stat().st_size > 0


def test_model_options_forwards_only_what_differs_from_the_defaults():
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    args = parser.parse_args(["--model", "random:tiny", "--enforce-eager", "--max-num-seqs", "8"])
    assert model_options(args) == ["--model", "random:tiny", "--enforce-eager", "--max-num-seqs", "8"]
    assert model_options(parser.parse_args([])) == []


def test_bench_prompts_have_the_length_asked_and_no_shared_start(tiny_model):
    prompts = bench_prompts(tiny_model.tokenizer, 3, 40, "r0")
    assert [len(p) for p in prompts] == [40, 40, 40]
    assert len({tuple(p[:8]) for p in prompts}) == 3
