"""scripts/make_random_gguf.py's files: a named shape's Llama GGUF with random F16 weights and the embedded
tokenizer, which the loader reads as that shape, and whose quantization needs llama.cpp's own tool."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine_utils import assert_all_blocks_free, make_engine, run
from minivllm.bench import random_gguf
from minivllm.bench.llamacpp import ENV_DIR
from minivllm.loader import load_model
from minivllm.loader.gguf_loader import load_gguf_tokenizer
from minivllm.sampling.params import SamplingParams

pytestmark = pytest.mark.slow  # a server, a subprocess or the real model in every test

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "make_random_gguf.py"),
            "tiny",
            "--quant",
            "F16",
            "--cache",
            str(tmp_path_factory.mktemp("models")),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    path = Path(out.stdout.strip())  # stdout holds only the path: the Makefile passes it to --model
    assert path.is_file() and path.name == "random-tiny-F16.gguf"
    return path


def test_the_file_loads_as_its_named_shape_with_the_embedded_tokenizer(tiny_file, embedded_path):
    from gguf import GGUFReader

    shape = random_gguf.SHAPES["tiny"]
    loaded = load_model(str(tiny_file))
    cfg = loaded.config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (
        shape.hidden,
        shape.intermediate,
        shape.layers,
    )
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (shape.heads, shape.kv_heads)
    assert cfg.tie_word_embeddings == shape.tied_embeddings
    embedded = load_gguf_tokenizer(embedded_path)  # the tokenizer alone: no second model to build
    text = "The quick brown fox, in a chat."
    assert loaded.tokenizer.encode(text) == embedded.encode(text)
    assert loaded.tokenizer.chat_template == embedded.chat_template
    tensors = {t.name: t for t in GGUFReader(str(tiny_file)).tensors}
    q = np.asarray(tensors["blk.0.attn_q.weight"].data, dtype=np.float32)
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == "F16"
    assert abs(q.std() - random_gguf.WEIGHT_STD) < 0.002 and abs(q.mean()) < 0.002
    assert np.all(np.asarray(tensors["blk.1.ffn_norm.weight"].data) == 1.0)


def test_a_shape_that_does_not_exist_is_a_usage_error_naming_the_shapes(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_random_gguf.py"), "llama-9b", "--cache", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "tinyllama-1.1b" in out.stderr and not list(tmp_path.iterdir())


def test_quantizing_without_llama_cpp_says_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "no-build"))
    (tmp_path / "random-tiny-F16.gguf").write_bytes(b"")  # the F16 file exists: only the tool is missing
    with pytest.raises(FileNotFoundError, match="build_llamacpp.sh"):
        random_gguf.quantized("tiny", "Q4_K_M", tmp_path)


def test_a_qwen2_shape_writes_a_qwen2_file_with_its_biases(tmp_path):
    """A Qwen2-shaped file says `qwen2` and carries random Q/K/V biases (llama.cpp requires them), which the
    loader reads into the fused QKV bias."""
    shape = random_gguf.SHAPES["tiny-qwen2"]
    path = random_gguf.write_random_gguf("tiny-qwen2", tmp_path / "random-tiny-qwen2-F16.gguf")
    loaded = load_model(str(path))
    cfg = loaded.config
    assert (cfg.family, cfg.qkv_bias, cfg.tie_word_embeddings) == ("qwen2", True, True)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads) == (shape.hidden, shape.layers, 2)
    bias = loaded.model.layers[1].self_attn.qkv_bias.detach()
    assert bias.shape == (shape.hidden + 2 * cfg.num_key_value_heads * cfg.head_dim,)
    assert abs(bias.std().item() - random_gguf.WEIGHT_STD) < 0.006 and bias.abs().max() < 0.2


@pytest.mark.parametrize("name, family", [("tiny-gemma2", "gemma2"), ("tiny-qwen3moe", "qwen3_moe")])
def test_gemma2_and_moe_shapes_are_files_of_their_family_that_generate(name, family, tmp_path):
    """Gemma 2 (post-norms, soft-capping, a sliding window) and Qwen3-MoE (Q/K norms, a router kept in F32, stacked
    experts) shapes: the loader reads each file as its family with the shape's pieces, and the engine generates."""
    from gguf import GGUFReader

    shape = random_gguf.SHAPES[name]
    path = random_gguf.write_random_gguf(name, tmp_path / f"random-{name}-F16.gguf")
    loaded = load_model(str(path))
    cfg = loaded.config
    assert (cfg.family, cfg.head_dim, cfg.num_hidden_layers) == (family, shape.head_dim, shape.layers)
    assert cfg.tie_word_embeddings == shape.tied_embeddings
    types = {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}
    if shape.softcaps:
        assert (cfg.attn_softcap, cfg.final_softcap, cfg.sliding_window) == (*shape.softcaps, shape.sliding_window)
        assert types["blk.1.post_ffw_norm.weight"] == "F32"
    if shape.experts:
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == shape.experts
        assert (types["blk.0.ffn_gate_inp.weight"], types["blk.0.ffn_up_exps.weight"]) == ("F32", "F16")
    engine = make_engine(loaded)
    engine.add_request("r", prompt_token_ids=[5, 6, 7, 8], params=SamplingParams(temperature=0, max_tokens=6))
    done = run(engine)
    assert len(done["r"].outputs[0].token_ids) == 6
    assert_all_blocks_free(engine)
