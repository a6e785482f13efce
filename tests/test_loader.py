"""Model loading: every load path and every kind of bad input gets a specific, helpful result."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from engine_utils import make_engine, run
from minivllm.engine.request_validation import RequestRejectedError
from minivllm.loader import (
    CorruptCheckpointError,
    ModelNotFoundError,
    UnsupportedModelError,
    gguf_loader,
    load_model,
    random_shapes,
)
from minivllm.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tiny_models import make_tiny_llama

    directory = tmp_path_factory.mktemp("tiny-hf")
    hf = make_tiny_llama(directory, seed=3, kv_heads=2, vocab=256, layers=2)
    return directory, hf


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def our_logits(loaded, ids):
    engine = make_engine(loaded, num_blocks=8, block_size=16)
    from minivllm.core.step_work import SeqWork

    hidden: list[torch.Tensor] = []
    engine.runner.execute([], [SeqWork(ids, 0, list(range(-(-len(ids) // 16))))], hidden_states_out=hidden)
    with torch.inference_mode():
        return loaded.model.compute_logits(hidden[-1])


IDS = [1, 5, 9, 200, 17, 3, 3, 80, 41, 255, 0, 7]


# ---- the load paths ----------------------------------------------------------------------------------


def test_local_hf_directory(tiny_dir):
    directory, hf = tiny_dir
    loaded = load_model(str(directory), dtype="float32", device="cpu")
    assert loaded.config.num_key_value_heads == 2 and loaded.config.vocab_size == 256
    assert loaded.source == str(directory) and loaded.name == directory.name
    assert loaded.tokenizer is None  # a weights-only directory serves token ids
    q, k, v = (
        hf.model.layers[1].self_attn.q_proj.weight,
        hf.model.layers[1].self_attn.k_proj.weight,
        hf.model.layers[1].self_attn.v_proj.weight,
    )
    assert torch.equal(loaded.model.layers[1].self_attn.qkv_proj.weight, torch.cat([q, k, v]))
    torch.testing.assert_close(our_logits(loaded, IDS), hf_logits(hf, IDS), atol=1e-4, rtol=0)


def make_fake_hub_cache(cache: Path, repo_id: str, source: Path) -> Path:
    """The layout huggingface_hub writes: blobs named by hash, snapshots/<commit>/<file> symlinks, refs/main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for f in source.iterdir():
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)
    return snapshot


@pytest.fixture
def fake_hf_home(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    home = tmp_path / "hf-home"
    cache = home / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    return cache


def test_hub_id_resolved_from_the_local_cache(tiny_dir, fake_hf_home):
    directory, hf = tiny_dir
    snapshot = make_fake_hub_cache(fake_hf_home, "someorg/tiny-llama", directory)
    loaded = load_model("someorg/tiny-llama", dtype="float32", device="cpu")
    assert loaded.name == "someorg/tiny-llama"
    assert Path(loaded.source).resolve() == snapshot.resolve()
    torch.testing.assert_close(our_logits(loaded, IDS), hf_logits(hf, IDS), atol=1e-4, rtol=0)


def test_hub_id_not_cached_says_how_to_get_it(fake_hf_home):
    with pytest.raises(ModelNotFoundError) as info:
        load_model("someorg/not-downloaded", device="cpu")
    message = str(info.value)
    assert "someorg/not-downloaded" in message and "cache" in message
    command = re.search(r"`([^`]*download[^`]*)`", message)
    assert command and "someorg/not-downloaded" in command.group(1), message
    # the suggested tool is the one the installed huggingface_hub provides
    tool = command.group(1).split()[0]
    assert (Path(sys.executable).parent / tool).exists() or shutil.which(tool), f"{tool!r} is not installed"
    assert "--model" in message  # ... or how to use a local directory instead


def test_missing_path_names_what_was_tried(tmp_path):
    missing = tmp_path / "models" / "nothing" / "here"
    with pytest.raises(ModelNotFoundError) as info:
        load_model(str(missing), device="cpu")
    message = str(info.value)
    assert str(missing) in message
    assert "hub id" in message and "random:" in message


def test_directory_without_config(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(str(tmp_path), device="cpu")


def test_random_shapes_are_seeded():
    cfg = random_shapes.random_config("tiny")
    a = random_shapes.random_tensors(cfg, 7, torch.float32)
    b = random_shapes.random_tensors(cfg, 7, torch.float32)
    c = random_shapes.random_tensors(cfg, 8, torch.float32)
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], c["model.layers.0.self_attn.q_proj.weight"])
    with pytest.raises(ValueError, match="tinyllama-1.1b"):
        random_shapes.random_config("huge")


@pytest.mark.parametrize("shape", ["qwen3-1.7b", "gemma-2-2b", "gemma-3-1b"])
def test_family_random_shapes_name_every_tensor_with_its_shape(shape):
    """A family's random shape draws every tensor its HF model has (Gemma's four norms a layer, Q/K norms),
    each with a shape (no weights drawn: these are billions of parameters)."""
    from minivllm.loader.weights import hf_tensor_names

    cfg = random_shapes.random_config(shape)
    shapes = random_shapes._hf_shapes(cfg)
    names = hf_tensor_names(cfg)
    drawn = sum(torch.Size(shapes(name)).numel() for name in names)
    assert drawn == cfg.num_parameters
    if shape.startswith("gemma"):
        assert "model.layers.3.post_feedforward_layernorm.weight" in names and cfg.hidden_act == "gelu_tanh"


def test_random_model_loads_the_same_weights_for_the_same_seed(tiny_model):
    again = load_model("random:tiny", dtype="float32", device="cpu", seed=0)
    assert again.name == "random:tiny"
    mine, theirs = again.model.state_dict(), tiny_model.model.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


# ---- bad checkpoints -------------------------------------------------------------------------------


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_non_llama_architecture(tmp_path, tiny_dir):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100).save_pretrained(tmp_path / "gpt2")
    (tmp_path / "gpt2" / "model.safetensors").write_bytes((tiny_dir[0] / "model.safetensors").read_bytes())
    with pytest.raises(UnsupportedModelError) as info:
        load_model(str(tmp_path / "gpt2"), device="cpu")
    assert "gpt2" in str(info.value).lower() and "llama" in str(info.value).lower()

    qwen2_moe = copy_dir(tiny_dir[0], tmp_path / "qwen2_moe")  # shared experts: not this decoder's MoE block
    config = json.loads((qwen2_moe / "config.json").read_text())
    config.update(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"])
    (qwen2_moe / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="qwen2_moe"):
        load_model(str(qwen2_moe), device="cpu")


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "truncated-header"])
def test_corrupt_safetensors(tmp_path, tiny_dir, damage):
    broken = copy_dir(tiny_dir[0], tmp_path / damage)
    weights = broken / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(
        {
            "truncated": data[: len(data) * 2 // 3],
            "garbage": b"\x93NUMPY not a safetensors file" * 50,
            "empty": b"",
            "truncated-header": data[:20],
        }[damage]
    )
    with pytest.raises(CorruptCheckpointError, match="model.safetensors"):
        load_model(str(broken), device="cpu")


def test_checkpoint_missing_a_tensor_or_with_a_wrong_shape(tmp_path, tiny_dir):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tiny_dir[0] / "model.safetensors"))
    missing = copy_dir(tiny_dir[0], tmp_path / "missing")
    save_file({k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k}, str(missing / "model.safetensors"))
    with pytest.raises(CorruptCheckpointError, match="up_proj"):
        load_model(str(missing), device="cpu")
    wrong = copy_dir(tiny_dir[0], tmp_path / "wrong")
    tensors["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 32)
    save_file(tensors, str(wrong / "model.safetensors"))
    with pytest.raises(CorruptCheckpointError, match="o_proj"):
        load_model(str(wrong), device="cpu")


def test_invalid_config_json(tmp_path, tiny_dir):
    broken = copy_dir(tiny_dir[0], tmp_path / "badconfig")
    (broken / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    with pytest.raises(CorruptCheckpointError, match="config.json"):
        load_model(str(broken), device="cpu")


def test_truncated_gguf(tmp_path):
    source = gguf_loader.embedded_model_path()
    broken = tmp_path / "broken.gguf"
    with source.open("rb") as f:
        broken.write_bytes(f.read(1 << 20))
    with pytest.raises(CorruptCheckpointError, match="broken.gguf"):
        load_model(str(broken), device="cpu")


# ---- dtypes, devices, lengths -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_dtypes(tiny_dir, dtype):
    directory, hf = tiny_dir
    loaded = load_model(str(directory), dtype=dtype, device="cpu")
    torch_dtype = getattr(torch, dtype)
    assert loaded.dtype == torch_dtype
    assert all(p.dtype == torch_dtype for p in loaded.model.parameters())
    engine = make_engine(loaded, num_blocks=8)
    assert engine.kv_cache.k[0].dtype == torch_dtype
    logits = our_logits(loaded, IDS)
    assert logits.dtype == torch.float32  # logits are handed to the sampler in fp32
    ref = hf_logits(hf, IDS)
    assert (logits - ref).abs().max().item() < 0.05 * ref.abs().max().item()
    engine.add_request("r", prompt_token_ids=IDS, params=SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(run(engine)["r"].outputs[0].token_ids) == 5


def test_bad_dtype_and_device():
    with pytest.raises(ValueError, match="dtype"):
        load_model("random:tiny", dtype="int8", device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            load_model("random:tiny", device="cuda")


def test_prompt_longer_than_max_model_len_gives_both_numbers(tiny_dir):
    loaded = load_model(str(tiny_dir[0]), device="cpu", max_model_len=64)
    engine = make_engine(loaded, num_blocks=16, max_model_len=64)
    with pytest.raises(RequestRejectedError) as info:
        engine.add_request("long", prompt_token_ids=list(range(100)), params=SamplingParams(max_tokens=1))
    assert "100" in str(info.value) and "64" in str(info.value)
    with pytest.raises(ValueError, match="512"):  # beyond what the model supports
        make_engine(loaded, max_model_len=1024)
