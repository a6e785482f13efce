"""The RSS split (engine/memory_view.py): the smaps parser on synthetic text, the split's arithmetic,
page residency through pagemap, and the live split of the embedded model's engine."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from engine_utils import EventLog, make_engine
from minivllm.engine.memory_budget import process_rss_bytes
from minivllm.engine.memory_view import MemoryView, library_kind, split_mappings
from minivllm.engine.proc_maps import Mapping, parse_smaps, read_smaps, resident_bytes
from minivllm.events import types as ev
from minivllm.sampling.params import SamplingParams

MIB = 2**20
KIB = 1024
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")

SMAPS = """\
7f0000000000-7f0000004000 r-xp 00000000 fe:00 42                         /opt/torch/lib/libtorch_cpu.so
Size:                 16 kB
Rss:                  12 kB
Pss:                  12 kB
VmFlags: rd ex mr mw me
7f0000004000-7f0000005000 rw-p 00000000 00:00 0
Size:                  4 kB
Rss:                   4 kB
VmFlags: rd wr mr mw me ac
7f0000010000-7f0000012000 r--p 00001000 fe:00 43                         /home/u/My Cache/kernel.so (deleted)
Size:                  8 kB
Rss:                   0 kB
"""


def test_smaps_text_parses_into_mappings_with_their_resident_bytes():
    lib, anon, deleted = parse_smaps(SMAPS)
    assert lib == Mapping(0x7F0000000000, 0x7F0000004000, "r-xp", "/opt/torch/lib/libtorch_cpu.so", 12 * KIB)
    assert lib.executable and not anon.executable
    assert anon.path == "" and anon.rss == 4 * KIB
    assert deleted.path == "/home/u/My Cache/kernel.so (deleted)" and deleted.rss == 0
    assert parse_smaps("") == []


@pytest.mark.parametrize(
    "text, message",
    [("zzzz-7f r-xp 0 fe:00 1 /x.so\nRss: 4 kB\n", "mapping header"), ("1000-2000 r-xp 0 0 0\nRss: 4 MB\n", "Rss")],
)
def test_malformed_smaps_is_a_clear_error(text, message):
    with pytest.raises(ValueError, match=message):
        parse_smaps(text)


def test_shared_objects_are_told_apart_by_folder():
    code, torch_dir = ("/cache/minivllm/", "/tmp/torchinductor_u/"), "/venv/torch/"
    assert library_kind("/cache/minivllm/inductor/ab/c.so", code, torch_dir) == "compiled"
    assert library_kind("/venv/torch/lib/libtorch_cpu.so", code, torch_dir) == "torch"
    assert library_kind("/usr/lib/x86_64-linux-gnu/libc.so.6", code, torch_dir) == "libraries"
    for not_a_library in ("", "[heap]", "/models/smollm.gguf", "/usr/bin/python3.12"):
        assert library_kind(not_a_library, code, torch_dir) is None


def _m(path: str, rss_kib: int) -> Mapping:
    return Mapping(0, 4096, "r-xp", path, rss_kib * KIB)


def test_the_parts_sum_to_the_rss_and_other_is_what_is_left():
    mappings = [_m("/c/k.so", 10), _m("/t/libtorch.so", 300), _m("/usr/lib/libc.so.6", 40), _m("", 650)]
    split = split_mappings(mappings, weights=400 * KIB, kv_cache=100 * KIB, code_folders=("/c/",), torch_folder="/t/")
    assert (split.compiled, split.torch, split.libraries) == (10 * KIB, 300 * KIB, 40 * KIB)
    assert split.other == (1000 - 850) * KIB and not split.clamped
    parts = (split.weights, split.kv_cache, split.compiled, split.torch, split.libraries, split.other)
    assert sum(parts) == split.rss == 1000 * KIB


def test_named_parts_past_the_rss_clamp_other_to_zero_and_say_so():
    split = split_mappings([_m("", 100)], weights=150 * KIB, kv_cache=0, code_folders=(), torch_folder="/t/")
    assert split.other == 0 and split.clamped


@linux_only
def test_resident_bytes_counts_touched_pages_once():
    page = mmap.PAGESIZE
    region = mmap.mmap(-1, 16 * page)
    buf = torch.frombuffer(region, dtype=torch.uint8)
    start = buf.data_ptr()
    assert resident_bytes([(start, start + 16 * page)]) == 0
    for i in (0, 5, 6):
        buf[i * page] = 1
    assert resident_bytes([(start, start + 16 * page)]) == 3 * page
    # overlapping ranges and a range ending mid-page: each page once
    assert resident_bytes([(start, start + 6 * page + 1), (start + 4 * page, start + 7 * page)]) == 3 * page
    del buf
    region.close()


@linux_only
def test_live_split_of_the_embedded_engine(embedded_model_q4):
    loaded = embedded_model_q4
    engine = make_engine(loaded, num_blocks=64)
    prompt = list(range(1, 200))
    engine.add_request("r", prompt_token_ids=prompt, params=SamplingParams(max_tokens=8, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    split = engine.stats().memory
    assert split is not None and split.cost_ms > 0
    parts = (split.weights, split.kv_cache, split.compiled, split.torch, split.libraries, split.other)
    assert all(p is not None and p >= 0 for p in parts), split
    assert sum(parts) == split.rss and not split.clamped
    assert abs(split.rss - process_rss_bytes()) < 0.05 * split.rss, (split.rss, process_rss_bytes())
    # 4-bit linears and an int8 embedding: at least half a byte per parameter is held and resident
    assert split.weights >= loaded.config.num_parameters // 2, split.weights
    _, _, pool_bytes = engine.config.kv_pool(loaded.config, loaded.kv_auto_dtype)
    assert split.kv_reserved == pool_bytes == engine.kv_cache.num_bytes
    block_bytes = engine.config.bytes_per_block(loaded.config, engine.kv_cache.k[0].dtype)
    written = -(-(len(prompt) + 8) // engine.config.block_size)
    assert written * block_bytes <= split.kv_cache < pool_bytes, (split.kv_cache, written * block_bytes)
    assert split.torch > 10 * MIB and split.libraries > 0
    log = EventLog(engine)
    engine.emit_metrics_if_due(force=True)
    (sample,) = log.of(ev.MetricsSample)
    assert sample.memory == split  # the event stream carries the same split as stats()


@linux_only
def test_a_split_is_kept_for_the_interval_then_measured_again_off_the_callers_thread(embedded_model_q4):
    view = MemoryView(embedded_model_q4.model, None, interval_s=5.0)
    first = view.latest(100.0)  # the first one inline: there is nothing to show before it
    assert view.refresh is None and first.kv_reserved == 0 and first.kv_cache == 0
    assert view.latest(104.9) is first and view.refresh is None
    assert view.latest(105.0) is first  # the next one is under way; the caller does not wait for it
    refresh = view.refresh
    assert refresh is not None
    refresh.join(timeout=30)
    second = view.latest(105.1)
    assert second is not first and second.rss > 0 and view.refresh is refresh  # no second refresh started


def test_off_linux_only_the_rss_is_known(monkeypatch, embedded_model_q4):
    monkeypatch.setattr("minivllm.engine.memory_view.read_smaps", lambda: None)
    split = MemoryView(embedded_model_q4.model, None).measure()
    assert split.weights is None and split.other is None and split.torch is None
    assert read_smaps() is None or len(read_smaps()) > 10
