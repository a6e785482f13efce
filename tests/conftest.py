"""Shared fixtures. The embedded model is loaded once per test session (it takes ~15 s)."""

from __future__ import annotations

import os

import pytest
import torch

from minivllm.loader import gguf_loader

# Engines built through create_engine / LLM / the CLI compile their decode step by default; the
# suite runs them eagerly (a compile costs seconds per engine) except where a test asks for it
# (test_compiled_step.py, and the e2e suite, which serves compiled).
os.environ.setdefault("MINIVLLM_ENFORCE_EAGER", "1")

# Fixtures that read the embedded GGUF: a test using one is `slow` (`make test-fast` leaves it out).
REAL_MODEL_FIXTURES = {
    "embedded_path",
    "embedded_tokenizer",
    "embedded_model",
    "embedded_model_q4",
    "hf_embedded_model",
}


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "slow: loads the real model, builds kernels, compiles or runs a server (`make test-fast` runs the rest)",
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        if REAL_MODEL_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def embedded_path():
    return gguf_loader.embedded_model_path()


@pytest.fixture(scope="session")
def embedded_tokenizer(embedded_path):
    return gguf_loader.load_gguf_tokenizer(embedded_path)


@pytest.fixture(scope="session")
def embedded_model():
    """Our from-scratch model on the embedded weights dequantized to fp32 (LoadedModel): the
    precision HF's GGUF reader gives the oracle."""
    from minivllm.loader import load_model

    return load_model(None, dtype="float32", device="cpu", quantization="none")


@pytest.fixture(scope="session")
def embedded_model_q4():
    """The embedded model at its default precision: Q4_1 layers in 4 bits, the Q8_0 embedding in int8."""
    from minivllm.loader import load_model

    return load_model(None, dtype="float32", device="cpu", quantization="auto")


@pytest.fixture(scope="session")
def hf_embedded_model(embedded_path):
    """The transformers oracle on the same GGUF, fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(embedded_path.parent), gguf_file=embedded_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def tiny_model():
    """Seeded random weights of the `tiny` shape with the embedded tokenizer (LoadedModel): fast
    engine tests that still produce text."""
    from minivllm.loader import load_model

    return load_model("random:tiny", dtype="float32", device="cpu", seed=0)
