"""An external client in CI: GuideLLM (its own venv, `make setup-guidellm`: it pins its own torch)
benchmarks a real `minivllm serve` on the embedded model, chat and text completions, at 1 and 4
concurrent streams, and every request must succeed with all its tokens (a 400 on any field GuideLLM
sends fails the test). `make compat` runs the long version."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from test_openai_client import API_KEY, _start_server

pytestmark = pytest.mark.slow  # a server, a subprocess or the real model in every test

REPO = Path(__file__).resolve().parents[1]
GUIDELLM = REPO / ".venv-guidellm" / "bin" / "guidellm"
STREAMS = (1, 4)
REQUESTS_PER_LEVEL = 4
PROMPT_TOKENS, OUTPUT_TOKENS = 128, 16


@pytest.fixture(scope="module")
def guidellm() -> Path:
    if not GUIDELLM.exists():  # CI must run this test: a missing venv is a failure, never a skip
        pytest.fail(f"{GUIDELLM} is missing: run `make setup-guidellm` (`make test` does)")
    return GUIDELLM


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from _start_server(tmp_path_factory)


@pytest.fixture(scope="module")
def processor(tmp_path_factory) -> Path:
    """The embedded model's tokenizer as a directory: GuideLLM sizes its synthetic prompts with it."""
    from minivllm.loader.gguf_cache import load_tokenizer
    from minivllm.loader.gguf_loader import embedded_model_path

    directory = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer(embedded_model_path()).save_pretrained(str(directory))
    return directory


def run_guidellm(guidellm: Path, base: str, processor: Path, out_dir: Path, request_format: str) -> dict:
    report = out_dir / "guidellm.json"
    cmd = [
        str(guidellm),
        "run",
        "--backend",
        f"kind=openai_http,target={base},api_key={API_KEY},request_format={request_format}",
        "--profile",
        "kind=concurrent",
        "--override",
        "profile.streams",
        ",".join(map(str, STREAMS)),
        "--constraint",
        f"kind=max_requests,count={REQUESTS_PER_LEVEL}",
        "--constraint",
        "kind=max_duration,seconds=240",
        "--data",
        f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
        "--tokenizer",
        f"kind=huggingface_auto,model={processor}",
        "--output",
        f"kind=json,path={report}",
        "--disable-console",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=out_dir, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"guidellm failed ({proc.returncode}): {proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return json.loads(report.read_text())


def failures(request_list: list[dict]) -> list[str]:
    """What GuideLLM recorded about failed requests: the server's answer (status and error body)."""
    return [str(r.get("info", {}).get("error") or r.get("output") or r)[:500] for r in request_list]


@pytest.mark.parametrize("request_format", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_concurrent_streams_all_succeed(guidellm, server, processor, tmp_path, request_format):
    report = run_guidellm(guidellm, server["base"], processor, tmp_path, request_format)
    benchmarks = report["benchmarks"]
    assert sorted(b["config"]["strategy"]["streams"] for b in benchmarks) == sorted(STREAMS)
    for b in benchmarks:
        streams, requests = b["config"]["strategy"]["streams"], b["requests"]
        assert not requests["errored"], f"{streams} streams: errored requests: {failures(requests['errored'])}"
        assert not requests["incomplete"], f"{streams} streams: incomplete: {failures(requests['incomplete'])}"
        assert b["metrics"]["request_totals"] == {
            "successful": REQUESTS_PER_LEVEL,
            "errored": 0,
            "incomplete": 0,
            "total": REQUESTS_PER_LEVEL,
        }
        for r in requests["successful"]:
            assert json.loads(r["request_args"])["body"]["stream"] is True
            assert r["output_tokens"] == OUTPUT_TOKENS, "ignore_eos and the token limit must hold"
            assert r["output"], "a streamed answer with no text"
