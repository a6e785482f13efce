"""The GGUF conversion cache: a cached load must give exactly what converting the file gives, a changed
file must never be served from an old entry, and a damaged or unwritable cache only costs speed."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

from minivllm.loader import gguf_cache
from minivllm.model.config import LlamaConfig


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(folder))
    return folder


def write_gguf(path, tensors: dict[str, np.ndarray]):
    writer = GGUFWriter(str(path), "llama")
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def reader_tensors(path):
    return {
        t.name: (t.tensor_type.name, [int(s) for s in t.shape], np.asarray(t.data).tobytes())
        for t in GGUFReader(str(path)).tensors
    }


def record_tensors(path):
    return {r.name: (r.kind, r.shape, r.values().tobytes()) for r in gguf_cache.tensor_records(path)}


def test_tensor_table_round_trip(cache, tmp_path):
    path = write_gguf(
        tmp_path / "m.gguf",
        {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.linspace(-1, 1, 64, dtype=np.float16)},
    )
    first = record_tensors(path)  # read through the gguf reader, table stored
    assert (gguf_cache.entry_dir(path) / gguf_cache.TENSOR_TABLE).is_file()
    second = record_tensors(path)  # from the stored table and a memory map
    assert first == second == reader_tensors(path)


def test_a_changed_file_gets_a_new_entry(cache, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", {"a": np.zeros((2, 32), dtype=np.float32)})
    before, old_entry = record_tensors(path), gguf_cache.entry_dir(path)
    write_gguf(path, {"a": np.ones((2, 32), dtype=np.float32), "c": np.ones(32, dtype=np.float32)})
    assert gguf_cache.entry_dir(path) != old_entry
    after = record_tensors(path)
    assert after == reader_tensors(path) and after != before


def test_a_damaged_table_is_read_again(cache, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", {"a": np.arange(32, dtype=np.float32)})
    expected = record_tensors(path)
    table = gguf_cache.entry_dir(path) / gguf_cache.TENSOR_TABLE
    table.write_text('[{"name": "a", "ki')
    assert record_tensors(path) == expected
    assert table.read_text().startswith("[{") and "offset" in table.read_text()  # replaced


def test_a_table_past_the_end_of_the_file_is_an_error(cache, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", {"a": np.arange(64, dtype=np.float32)})
    record_tensors(path)
    table = gguf_cache.entry_dir(path) / gguf_cache.TENSOR_TABLE
    table.write_text(table.read_text().replace('"bytes": 256', '"bytes": 99999'))
    with pytest.raises(ValueError, match="shorter than its tensor table"):
        gguf_cache.tensor_records(path)


def test_an_unwritable_cache_still_loads(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(blocker))
    path = write_gguf(tmp_path / "m.gguf", {"a": np.arange(32, dtype=np.float32)})
    assert record_tensors(path) == reader_tensors(path)
    assert "cannot cache" in caplog.text


def test_cached_config_and_tokenizer_equal_a_fresh_conversion(cache, embedded_path):
    """The embedded model's config and tokenizer, converted (and stored), then read back from the cache."""
    from transformers import AutoConfig, AutoTokenizer

    fresh_config = LlamaConfig.from_hf(
        AutoConfig.from_pretrained(str(embedded_path.parent), gguf_file=embedded_path.name), "smol"
    )
    fresh_tokenizer = AutoTokenizer.from_pretrained(str(embedded_path.parent), gguf_file=embedded_path.name)
    assert gguf_cache.load_config(embedded_path, "smol") == fresh_config  # converted and stored
    gguf_cache.load_tokenizer(embedded_path)
    entry = gguf_cache.entry_dir(embedded_path)
    assert (entry / gguf_cache.LLAMA_CONFIG).is_file() and (entry / "tokenizer" / "tokenizer.json").is_file()
    config, tokenizer = gguf_cache.load_config(embedded_path, "other"), gguf_cache.load_tokenizer(embedded_path)

    assert config == dataclasses.replace(fresh_config, name="other")
    texts = [
        "Hello, wörld!  \n\t  indented",
        "The capital of France is Paris.",
        "<|im_start|>user\nhi<|im_end|>",
        "数学 123 ∑ emoji 🙂",
        "",
    ]
    for text in texts:
        assert tokenizer.encode(text) == fresh_tokenizer.encode(text)
    ids = fresh_tokenizer.encode(texts[3])
    assert tokenizer.decode(ids) == fresh_tokenizer.decode(ids)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    assert tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    ) == fresh_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "all_special_ids"):
        assert getattr(tokenizer, attr) == getattr(fresh_tokenizer, attr), attr
    assert len(tokenizer) == len(fresh_tokenizer)


@pytest.mark.parametrize("damage", ["{not json", '{"vocab_size": 3}', '["a list"]'])
def test_a_damaged_cached_config_is_derived_again(cache, embedded_path, damage, caplog):
    expected = gguf_cache.load_config(embedded_path, "smol")
    file = gguf_cache.entry_dir(embedded_path) / gguf_cache.LLAMA_CONFIG
    file.write_text(damage)
    assert gguf_cache.load_config(embedded_path, "smol") == expected
    assert gguf_cache.load_config(embedded_path, "smol") == expected  # and stored whole again
    assert dataclasses.replace(LlamaConfig.from_json_dict(json.loads(file.read_text())), name="smol") == expected
