"""Records files that several processes add to: write-once parts, merged on read, compacted.

A records file `<name>.jsonl` that several processes write (`cbs.results.files`) is never
appended to: each write is a write-once part `<name>.d/<part>.jsonl`, and readers merge the
parts (`read_merged`): the first record per key, in name (write) order, so no writer can lose
another's records on any file system. `<name>.jsonl` is the parts' export (`export_parts`); an
older directory's file is copied into its first part (`LEGACY_PART`).

On an object store a `PartCache` fetches only the parts new since its last read, and a write
that brings `FANOUT` parts of one level together compacts them into one of the next level
(`compact`), deleting the parts it read once their copy exists; a reader that finds a listed
part gone lists again. docs/scaling.md gives the costs. Local parts are never compacted.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from cbs.results import paths, records
from cbs.results.paths import PathLike

__all__ = [
    "FANOUT", "LEGACY_PART", "PartCache", "add_records", "compact", "export_parts", "part_level",
    "part_name", "part_paths", "parts_dir", "read_merged", "write_part",
]

FANOUT = 16  # parts of one level that a write compacts into one of the next (object stores)
LEGACY_PART = "0-before-parts.jsonl"  # what the file held before parts (sorts first; kept)
_COMPACTED = "~c"  # a compacted part: `<time>-~c<level>-<digest>.jsonl` (no key holds "~")
_ATTEMPTS = 20  # listings a read makes while compactions delete the parts it listed


def parts_dir(path: PathLike) -> str:
    """The directory of the parts of `path` (`trials.jsonl` -> `trials.d`)."""
    return os.fspath(path).removesuffix(".jsonl") + ".d"


def _digest(*texts: str) -> str:
    """A digest of `texts` and the writer (host, process, clock), so no two writes share it."""
    writer = f"{socket.gethostname()}:{os.getpid()}:{time.monotonic_ns()}"
    return hashlib.sha1("\n".join([*texts, writer]).encode()).hexdigest()[:10]


def part_name(keys: Sequence[str]) -> str:
    """A new part's file name: the time in ns (name order is write order), the first of
    `keys`, a digest of all keys and the writer."""
    return f"{time.time_ns():020d}-{keys[0]}-{_digest(*keys)}.jsonl"


def part_level(name: str) -> int:
    """How many compactions the records of part `name` went through (0: as written)."""
    tag = os.path.basename(name)[21:].split("-", 1)[0]
    return int(tag[2:]) if tag.startswith(_COMPACTED) and tag[2:].isdigit() else 0


def write_part(path: PathLike, name: str, records_: Iterable[Mapping[str, Any]]) -> str:
    """Writes `records_` as the part `name` of file `path`; returns its path."""
    data = "".join(json.dumps({k: records.plain_value(v) for k, v in r.items()}) + "\n"
                   for r in records_)
    folder = parts_dir(path)
    listed = part_paths(path)
    paths.makedirs(folder)
    if not listed:  # every writer that saw no part copies the file: same bytes, same name
        raw = paths.read_bytes(path) or b""
        if kept := raw[:raw.rfind(b"\n") + 1]:
            records.write_atomic(paths.join(folder, LEGACY_PART), kept)
    target = paths.join(folder, name)
    records.write_atomic(target, data)
    if not paths.is_remote(path):
        return target
    # each level this writer knows of that holds FANOUT parts, lowest first (a compaction may
    # fill the next level)
    listed = [p for p in [*listed, target] if os.path.basename(p) != LEGACY_PART]
    level = 0
    while any(part_level(p) >= level for p in listed):
        same = [p for p in listed if part_level(p) == level]
        if len(same) >= FANOUT and (new := compact(path, same)) is not None:
            listed = [p for p in listed if p not in same] + [new]
        level += 1
    return target


def compact(path: PathLike, names: Sequence[str]) -> str | None:
    """Copies the parts `names` (paths) of records file `path` into one new part, a level above
    the highest and named after the first (it sorts where they did), then deletes those it
    read; returns its path (None when none was left to read)."""
    found = paths.read_many(names)
    read = sorted((os.fspath(n) for n in names if os.fspath(n) in found),
                  key=os.path.basename)
    if not read:
        return None
    data = b"".join(raw[:raw.rfind(b"\n") + 1] for raw in (found[n] for n in read))
    level = 1 + max(part_level(n) for n in read)
    first = os.path.basename(read[0])[:20]
    target = paths.join(parts_dir(path),
                        f"{first}-{_COMPACTED}{level}-{_digest(*read)}.jsonl")
    records.write_atomic(target, data)
    for name in read:
        paths.remove(name)
    return target


def part_paths(path: PathLike) -> list[str]:
    """The parts of records file `path`: `LEGACY_PART` first, then in name order."""
    return _sorted_parts(path, paths.listdir(parts_dir(path)))


def _sorted_parts(path: PathLike, names: Iterable[str]) -> list[str]:
    names = sorted((n for n in names if n.endswith(".jsonl")),
                   key=lambda n: (n != LEGACY_PART, n))
    return [paths.join(parts_dir(path), n) for n in names]


class PartCache:
    """The parts read, by path and object version (remote only): a read fetches only new ones."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[str, bytes]] = {}

    def fetch(self, listed: Mapping[str, str | None]) -> dict[str, bytes]:
        """{path: bytes} of the parts in `listed` ({path: version}) that exist, fetching only
        uncached ones; drops parts of the same folder no longer listed."""
        out = {p: raw for p, (v, raw) in self._held.items() if listed.get(p) == v}
        got = paths.read_many([p for p in listed if p not in out])
        for p, raw in got.items():
            version = listed[p]
            if version is not None:
                self._held[p] = (version, raw)
        folders = {os.path.dirname(p) for p in listed}
        for p in [p for p in self._held if os.path.dirname(p) in folders and p not in listed]:
            del self._held[p]
        return out | got


def _read_parts(path: PathLike, cache: PartCache | None) -> list[tuple[str, bytes]]:
    """(path, bytes) of every part of `path` in name order, listing again when a listed part
    was compacted away before its read."""
    cache = cache or PartCache()
    for _ in range(_ATTEMPTS):
        versions = paths.listdir_versions(parts_dir(path))
        listed = _sorted_parts(path, versions)
        got = cache.fetch({p: versions[os.path.basename(p)] for p in listed})
        if all(p in got for p in listed):
            return [(p, got[p]) for p in listed]
    raise OSError(f"{parts_dir(path)}: the parts changed under every one of {_ATTEMPTS} "
                  "reads (compacted meanwhile); read again")


def read_merged(path: PathLike, keys: Sequence[str], *, required: Sequence[str] = (),
                cache: PartCache | None = None) -> list[dict[str, Any]]:
    """The records of file `path` (its parts', else the file's) holding `keys` and `required`,
    the first per value of `keys`. `cache`: the parts read before."""
    return [r for _, r in _merged_lines(path, keys, (*keys, *required), cache)]


def _merged_lines(path: PathLike, keys: Sequence[str], need: Sequence[str],
                  cache: PartCache | None = None) -> list[tuple[bytes, dict[str, Any]]]:
    """(line, record) of `read_merged`, each line as stored."""
    sources = _read_parts(path, cache) or [(os.fspath(path), paths.read_bytes(path) or b"")]
    first: dict[str, tuple[bytes, dict[str, Any]]] = {}
    for name, raw in sources:
        for line, record in records.lines_in(raw, name, need):
            first.setdefault(json.dumps([record[x] for x in keys]), (line, record))
    return list(first.values())


def export_parts(path: PathLike, keys: Sequence[str], *,
                 cache: PartCache | None = None) -> bool:
    """Rewrites file `path` as its parts' lines (the first per `keys`) if that changes it;
    returns whether it wrote."""
    if not part_paths(path):
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", records.CorruptRecordWarning)  # reported when read
        data = b"".join(line + b"\n" for line, _ in _merged_lines(path, keys, keys, cache))
    if data == paths.read_bytes(path):
        return False
    records.write_atomic(path, data)
    return True


def add_records(path: PathLike, keys: Sequence[str],
                records_: Sequence[Mapping[str, Any]]) -> str:
    """Adds `records_` (each holding `keys`) to records file `path` as one part; returns its
    path. Exports locally (on an object store the command exports once at its end)."""
    first = "_".join(str(records_[0][k]) for k in keys)
    safe = "".join(c if c.isascii() and (c.isalnum() or c in ".-") else "_" for c in first)
    part = write_part(path, part_name([safe.strip("_") or "record"]), records_)
    if not paths.is_remote(path):
        export_parts(path, keys)
    return part
