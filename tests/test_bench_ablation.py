"""The optimisations `minivllm bench ablation` turns off are real engine modes that keep greedy output
unchanged: no KV cache (recompute every step), static batching, no chunked prefill; and the
benchmark itself runs end to end with one row per configuration."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine_utils import assert_all_blocks_free, chat_ids, make_engine, run
from minivllm.engine.request_validation import RequestRejectedError
from minivllm.sampling.params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three primary colors.",
]
# different lengths, so that continuous batching would admit a waiting request while another still runs
PARAMS = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (6, 14, 10, 12)]


@pytest.fixture(scope="module")
def prompts(embedded_model):
    return [chat_ids(embedded_model.tokenizer, q) for q in QUESTIONS]


def generate(loaded, prompts, on_step=None, **config) -> tuple[list[list[int]], object]:
    engine = make_engine(loaded, **config)
    for i, (ids, params) in enumerate(zip(prompts, PARAMS)):
        engine.add_request(f"r{i}", prompt_token_ids=ids, params=params)
    outs = run(engine, on_step=on_step(engine) if on_step else None)
    assert_all_blocks_free(engine)
    return [outs[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))], engine


@pytest.fixture(scope="module")
def reference(embedded_model, prompts):
    return generate(embedded_model, prompts)[0]


def test_recompute_kv_gives_the_same_greedy_tokens_and_recomputes_every_step(embedded_model, prompts, reference):
    computed = []

    def watch(engine):
        schedule = engine.scheduler.schedule

        def recording():
            out = schedule()
            computed.extend((s.start, s.num_tokens, s.seq.num_tokens) for s in out.scheduled)
            return out

        engine.scheduler.schedule = recording
        return lambda number: None

    tokens, engine = generate(embedded_model, prompts, on_step=watch, recompute_kv=True)
    assert tokens == reference
    assert not engine.block_manager.enable_prefix_caching, "a prefix cache would keep KV across steps"
    # every chunk starts at position 0 and runs the whole context: nothing computed before is reused
    assert computed and all(start == 0 and n == total for start, n, total in computed)
    assert len(computed) == sum(p.max_tokens for p in PARAMS)


def admissions():
    """on_step hook: records, for every step, whether a request was admitted while the running batch
    had already produced tokens."""
    joined_a_decoding_batch: list[bool] = []

    def hook(engine):
        schedule = engine.scheduler.schedule

        def recording():
            decoding = any(s.num_output_tokens for r in engine.scheduler.running for s in r.seqs)
            out = schedule()
            joined_a_decoding_batch.append(bool(out.admitted) and decoding)
            return out

        engine.scheduler.schedule = recording
        return lambda number: None

    return hook, joined_a_decoding_batch


@pytest.mark.parametrize("static", [False, True], ids=["continuous", "static"])
def test_static_batching_admits_nobody_into_a_running_batch(embedded_model, prompts, reference, static):
    hook, joined = admissions()
    tokens, _ = generate(embedded_model, prompts, on_step=hook, max_num_seqs=2, static_batching=static)
    assert tokens == reference
    # the control (continuous batching) shows the check can fail: a request joins as soon as a slot frees
    assert any(joined) is not static, joined


def test_without_chunked_prefill_a_prompt_runs_whole(embedded_model, prompts, reference):
    chunks = []

    def watch(engine):
        schedule = engine.scheduler.schedule

        def recording():
            out = schedule()
            chunks.extend((s.start, s.num_tokens) for s in out.scheduled if s.start < s.seq.request.num_prompt_tokens)
            return out

        engine.scheduler.schedule = recording
        return lambda number: None

    budget = max(len(p) for p in prompts) + 16  # two prompts never fit one step together
    tokens, _ = generate(
        embedded_model,
        prompts,
        on_step=watch,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,  # a cache hit would start a prompt past 0
        max_num_batched_tokens=budget,
    )
    assert tokens == reference
    assert chunks == [(0, len(p)) for p in prompts], "a prompt was split across steps"
    engine = make_engine(embedded_model, enable_chunked_prefill=False, max_num_batched_tokens=budget)
    with pytest.raises(RequestRejectedError, match="chunked prefill off"):
        engine.add_request("long", prompt_token_ids=prompts[0], params=SamplingParams(max_tokens=budget))


def test_bench_ablation_quick_json_has_a_row_per_configuration(embedded_path, tmp_path):
    cmd = [sys.executable, "-m", "minivllm.cli", "bench", "ablation", "--quick", "--json"]
    cmd += ["--output-dir", str(tmp_path), "--num-prompts", "4", "--max-tokens", "8"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    rows = {r["config"]: r for r in report["rows"]}
    from minivllm.bench.ablation import CONFIGS, Workload

    assert list(rows) == [c.name for c in CONFIGS]
    lengths = Workload(**report["workload"]).lengths()
    assert len(lengths) == 4 and max(lengths) == 8
    for name, r in rows.items():
        assert r["tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0, name
        assert r["generated_tokens"] == sum(lengths), name
        assert r["ttft_median_s"] > 0 and r["itl_p99_s"] > 0 and r["peak_rss_bytes"] > 0, name
    assert rows["all on"]["ratio_tokens_per_s"] == 1.0
    assert report["machine"].startswith("machine: CPU capability")
    assert (tmp_path / "ablation.png").stat().st_size > 0
    assert "[bench]" in done.stderr  # progress lines go to stderr, the JSON alone to stdout


def test_the_ablation_endpoint_refuses_bad_sizes_and_in_process_servers(tmp_path):
    from litestar.testing import TestClient
    from test_server_support import tiny_app

    with TestClient(tiny_app(tmp_path)) as client:  # built in-process: no model spec to load again
        assert client.get("/api/ablation").json()["state"] == "unavailable"
        r = client.post("/api/ablation")
        assert r.status_code == 404 and "minivllm serve" in r.text, r.text
    with TestClient(tiny_app(tmp_path, enable_ablation=True)) as client:
        assert client.get("/api/ablation").json()["state"] == "idle"
        r = client.post("/api/ablation", json={"num_prompts": 0})
        assert r.status_code == 400 and "num_prompts must be between 1 and 8" in r.text, r.text
        r = client.post("/api/ablation", json={"max_tokens": 4096})
        assert r.status_code == 400 and "max_tokens" in r.text, r.text
        r = client.post("/api/ablation", json={"rounds": 3})
        assert r.status_code == 400, r.text
        assert client.get("/api/ablation").json()["state"] == "idle", "a refused start must not start a run"
