"""Weights moved onto transparent huge pages after loading (loader/huge_pages.py): same values, every
view follows, nothing left on the old storage, and the engine's tokens are unchanged."""

from __future__ import annotations

import gc

import pytest
import torch

from engine_utils import make_engine, run
from minivllm.loader import huge_pages, load_model
from minivllm.loader.install_quantized import weight_tensors
from minivllm.loader.weights import NO_HUGE_PAGES_ENV
from minivllm.quant.policy import QuantConfig
from minivllm.sampling.params import SamplingParams

needs_thp = pytest.mark.skipif(
    huge_pages.thp_mode() not in ("always", "madvise"), reason="this kernel offers no transparent huge pages to ask for"
)


def _mapping_of(address: int) -> dict[str, int]:
    """The /proc/self/smaps fields (kB) of the mapping holding `address`."""
    fields: dict[str, int] = {}
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = start <= address < end
        elif inside and line.split()[-1] == "kB":
            fields[head.rstrip(":")] = int(line.split()[1])
    return fields


def _weights():
    base = torch.randn(300, 512)
    parameter = torch.nn.Parameter(torch.randn(64, 96))
    codes = torch.randint(-127, 128, (1000, 700), dtype=torch.int8)
    return {
        "base": base,
        "view": base[10:20, 100:],
        "transposed": base.t(),
        "parameter": parameter,
        "codes": codes,
        "half": torch.randn(5, 7).half(),
    }


@needs_thp
def test_every_view_of_a_moved_storage_follows_it_with_its_values():
    tensors = _weights()
    before = {name: t.detach().clone() for name, t in tensors.items()}
    strides = {name: t.stride() for name, t in tensors.items()}
    old_pointers = {t.untyped_storage().data_ptr() for t in tensors.values()}
    sizes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors.values()}
    moved = huge_pages.move_to_huge_pages([tensors["base"], tensors["parameter"], tensors["codes"], tensors["half"]])
    assert moved >= sum(sizes.values())
    for name, t in tensors.items():
        assert torch.equal(t.detach(), before[name]) and t.stride() == strides[name], name
        assert t.untyped_storage().data_ptr() not in old_pointers, f"{name} left on its old storage"
    assert tensors["view"].data_ptr() == tensors["base"][10, 100].data_ptr()  # still a view of base
    assert isinstance(tensors["parameter"], torch.nn.Parameter) and tensors["parameter"].requires_grad
    assert len({t.untyped_storage().data_ptr() for t in tensors.values()}) == 1  # one mapping
    tensors["base"][0, 0] = 7.0  # writable, and the views see it
    assert tensors["transposed"][0, 0] == 7.0


@needs_thp
def test_the_moved_weights_sit_on_huge_pages():
    codes = torch.randint(-127, 128, (4096, 2048), dtype=torch.int8)  # 8 MiB: four huge pages
    assert huge_pages.move_to_huge_pages([codes]) >= codes.numel()
    gc.collect()
    assert codes.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert _mapping_of(codes.data_ptr()).get("AnonHugePages", 0) >= 4 * 2048, _mapping_of(codes.data_ptr())


def test_nothing_moves_where_linux_offers_no_huge_pages(monkeypatch):
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never")
    t = torch.randn(100, 100)
    pointer = t.data_ptr()
    assert huge_pages.move_to_huge_pages([t]) == 0 and t.data_ptr() == pointer


def test_thp_mode_reads_the_bracketed_choice(monkeypatch, tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "THP_SETTING", setting)
    assert huge_pages.thp_mode() == "madvise"
    monkeypatch.setattr(huge_pages, "THP_SETTING", tmp_path / "missing")
    assert huge_pages.thp_mode() is None


@needs_thp
def test_a_loaded_model_runs_from_huge_pages_with_the_same_tokens(monkeypatch):
    def generate(loaded):
        engine = make_engine(loaded)
        for i in range(3):
            engine.add_request(
                f"r{i}", prompt_token_ids=[5 + i, 17, 42, 9], params=SamplingParams(max_tokens=12, temperature=0.0)
            )
        return {k: v.outputs[0].token_ids for k, v in run(engine).items()}

    quant = QuantConfig("int4", kernel="int8x2")
    moved = load_model("random:tiny", quantization=quant, max_model_len=256)
    monkeypatch.setenv(NO_HUGE_PAGES_ENV, "1")
    kept = load_model("random:tiny", quantization=quant, max_model_len=256)
    assert moved.quant.huge_page_bytes >= moved.quant.weight_bytes and kept.quant.huge_page_bytes == 0
    assert len({t.untyped_storage().data_ptr() for t in weight_tensors(moved.model)}) == 1
    assert len({t.untyped_storage().data_ptr() for t in weight_tensors(kept.model)}) > 1
    assert generate(moved) == generate(kept)
