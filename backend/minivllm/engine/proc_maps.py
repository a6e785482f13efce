"""This process's memory map as Linux shows it: /proc/self/smaps (each mapping's resident bytes)
and /proc/self/pagemap (which pages of an address range are resident). Elsewhere: None."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SMAPS = Path("/proc/self/smaps")
PAGEMAP = Path("/proc/self/pagemap")
PRESENT = 1 << 63  # pagemap entry bit: the page is in RAM (what RSS counts)


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    perms: str  # "r-xp"
    path: str  # "" for anonymous memory; "[heap]", "[stack]" ... for the kernel's named ones
    rss: int  # bytes resident

    @property
    def executable(self) -> bool:
        return "x" in self.perms


def parse_smaps(text: str) -> list[Mapping]:
    """The mappings of an smaps text: a header line per mapping ("start-end perms offset dev inode
    [path]") followed by "Key: value kB" lines, of which only Rss is kept."""
    mappings: list[Mapping] = []
    header: list[str] | None = None
    rss = 0
    for line in text.splitlines():
        first = line.split(maxsplit=1)[0] if line.strip() else ""
        if not first:
            continue
        if first.endswith(":"):
            if first == "Rss:" and header is not None:
                rss = _kib(line)
            continue
        if header is not None:
            mappings.append(_mapping(header, rss))
        header, rss = line.split(maxsplit=5), 0
    if header is not None:
        mappings.append(_mapping(header, rss))
    return mappings


def _mapping(header: list[str], rss: int) -> Mapping:
    try:
        start, end = (int(x, 16) for x in header[0].split("-"))
        return Mapping(start, end, header[1], header[5].strip() if len(header) > 5 else "", rss)
    except (ValueError, IndexError) as exc:
        raise ValueError(f"not an smaps mapping header: {' '.join(header)!r}") from exc


def _kib(line: str) -> int:
    parts = line.split()
    if len(parts) != 3 or parts[2] != "kB":
        raise ValueError(f"not an smaps 'Rss: N kB' line: {line!r}")
    return int(parts[1]) * 1024


def read_smaps() -> list[Mapping] | None:
    """This process's mappings (None off Linux or where /proc cannot be read)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return parse_smaps(SMAPS.read_text())
    except OSError:
        return None


def resident_bytes(ranges: Iterable[tuple[int, int]]) -> int | None:
    """Bytes of the pages touching the `(start, end)` address ranges that are resident, each page
    counted once however many ranges touch it (None where pagemap cannot be read)."""
    page = os.sysconf("SC_PAGE_SIZE")
    spans = _merged((start // page, -(-end // page)) for start, end in ranges if end > start)
    try:
        with PAGEMAP.open("rb", buffering=0) as f:
            resident = 0
            for first, last in spans:
                f.seek(first * 8)
                entries = f.read((last - first) * 8)
                resident += int(np.count_nonzero(np.frombuffer(entries, dtype="<u8") & np.uint64(PRESENT)))
            return resident * page
    except OSError:
        return None


def _merged(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for first, last in sorted(spans):
        if out and first <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], last))
        else:
            out.append((first, last))
    return out
