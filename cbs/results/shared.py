"""Records files that several processes add to: write-once parts, merged on read, compacted.

A records file `<name>.jsonl` that several processes write (`cbs.results.files`) is never
appended to: each write is a write-once part `<name>.d/<part>.jsonl` (`write_part`), written
whole in one atomic write, and readers merge the parts (`read_merged`): the first record per
key, in name order (a part's name starts with its time: write order). No writer can lose
another's records on any file system. `<name>.jsonl` is then an export of the parts
(`export_parts`); a directory from before parts has the file only, read as before, and its
first part is preceded by a copy of it (`LEGACY_PART`).

On an object store every request is a round trip. Writing a part is one listing and one
upload; reading is one listing and one fetch per part, all together, and a `PartCache`
fetches only the parts new since its last read. A write that brings `FANOUT` parts of one
level together compacts them (`compact`) into one part of the next level, then deletes those
parts by name: a record is copied once per level, so n writes cost O(n) requests and a
listing stays one page. Nothing written meanwhile is lost: only parts read are deleted, once
their copy exists; a reader that finds a listed part gone lists again, and a record seen
twice counts once. Local parts are never compacted (cheap to list; committed folders keep
their files).
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
LEGACY_PART = "0-before-parts.jsonl"  # the records a file held when its first part came
#                                      (its name sorts before any `part_name`; never compacted)
_COMPACTED = "~c"  # a compacted part: `<time>-~c<level>-<digest>.jsonl` (no key holds "~")
_ATTEMPTS = 20  # listings a read makes while compactions delete the parts it listed


def parts_dir(path: PathLike) -> str:
    """The directory of the write-once parts of records file `path` (`trials.jsonl` ->
    `trials.d`)."""
    return os.fspath(path).removesuffix(".jsonl") + ".d"


def _digest(*texts: str) -> str:
    """A digest of `texts` and the writer (host, process, clock), so no two writes share it."""
    writer = f"{socket.gethostname()}:{os.getpid()}:{time.monotonic_ns()}"
    return hashlib.sha1("\n".join([*texts, writer]).encode()).hexdigest()[:10]


def part_name(keys: Sequence[str]) -> str:
    """A new part's file name for the records of `keys` (trial ids, unit names): the time
    (ns since the epoch, so name order is write order and the first record of a trial written
    twice wins), the first key, and a digest of all keys and the writer (host, process), so
    no two writes share a part."""
    return f"{time.time_ns():020d}-{keys[0]}-{_digest(*keys)}.jsonl"


def part_level(name: str) -> int:
    """How many compactions the records of part `name` (a file name) went through: 0 for a
    part as written, L for a part `compact` wrote from parts of level L − 1."""
    tag = os.path.basename(name)[21:].split("-", 1)[0]
    return int(tag[2:]) if tag.startswith(_COMPACTED) and tag[2:].isdigit() else 0


def write_part(path: PathLike, name: str, records_: Iterable[Mapping[str, Any]]) -> str:
    """Writes `records_` as the write-once part `name` of records file `path` in one atomic
    write (all or none; `cbs.results.records.write_atomic`) and returns the part's path. No
    other writer touches it, so concurrent writers on any file system lose nothing.

    The first part written beside a file of an older version is preceded by a copy of that
    file's whole lines (`LEGACY_PART`): once parts exist, only they are read. On an object
    store, a write that brings `FANOUT` parts of one level together compacts them (`compact`).
    """
    data = "".join(json.dumps({k: records.plain_value(v) for k, v in r.items()}) + "\n"
                   for r in records_)
    folder = parts_dir(path)
    listed = part_paths(path)
    if not listed:
        raw = paths.read_bytes(path) or b""
        if kept := raw[:raw.rfind(b"\n") + 1]:  # every writer that saw no part copies it:
            paths.makedirs(folder)              # the same bytes under the same name
            records.write_atomic(paths.join(folder, LEGACY_PART), kept)
    target = paths.join(folder, name)
    paths.makedirs(folder)
    records.write_atomic(target, data)
    if paths.is_remote(path):
        _compact_levels(path, [*listed, target])
    return target


def _compact_levels(path: PathLike, listed: Sequence[str]) -> None:
    """Compacts each level of `listed` (the parts of `path` a writer knows of) that holds
    `FANOUT` parts, lowest first (a compaction may fill the next level)."""
    listed = [p for p in listed if os.path.basename(p) != LEGACY_PART]
    level = 0
    while any(part_level(p) >= level for p in listed):
        same = [p for p in listed if part_level(p) == level]
        if len(same) >= FANOUT and (new := compact(path, same)) is not None:
            listed = [p for p in listed if p not in same] + [new]
        level += 1


def compact(path: PathLike, names: Sequence[str]) -> str | None:
    """Copies the parts `names` of records file `path` (their paths) into one new part, then
    deletes them; returns its path (None when none of them was left to read).

    The new part holds their whole lines, concatenated in name order, and is named after the
    first of them (so it sorts where its records did) at one level above the highest. Only
    the parts read are deleted, and only once their copy is written: a part written meanwhile
    is not among `names` and stays, one that another compaction deleted first is skipped, and
    a reader between the two steps sees each record twice and counts it once (`read_merged`).
    """
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
    """The parts of records file `path`: the older file's copy first, then in name order
    (temporary files left out)."""
    return _sorted_parts(path, paths.listdir(parts_dir(path)))


def _sorted_parts(path: PathLike, names: Iterable[str]) -> list[str]:
    names = sorted((n for n in names if n.endswith(".jsonl")),
                   key=lambda n: (n != LEGACY_PART, n))
    return [paths.join(parts_dir(path), n) for n in names]


class PartCache:
    """The parts already read, by path and version (an object's generation, which a rewrite
    changes), so that reading a records file again fetches only its new parts. Object stores
    only: a local part is read again each time (cheap, and a damaged one is seen at once)."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[str, bytes]] = {}

    def fetch(self, listed: Mapping[str, str | None]) -> dict[str, bytes]:
        """{path: bytes} of the parts in `listed` ({path: version}) that exist; the cached
        ones are not fetched again. Parts of the same folder no longer listed are dropped."""
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
    """(path, bytes) of every part of `path` in name order, as one listing holds them: a part
    deleted between a listing and its read (compacted) is looked for in a new listing."""
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
    """The records of records file `path`: those of its parts when it has any (the file is
    then an export, never read), else those of the file (written by an older version), the
    first record per value of `keys` only (a record written twice counts once). Each file
    is read as by `cbs.results.records.read_records`, with `keys` and `required` required: a
    corrupt line is skipped with a warning naming its file and line, and what it recorded
    counts as not done. `cache`: the parts read before (`PartCache`), fetched only if new."""
    return [r for _, r in _merged_lines(path, keys, (*keys, *required), cache)]


def _merged_lines(path: PathLike, keys: Sequence[str], need: Sequence[str],
                  cache: PartCache | None = None) -> list[tuple[bytes, dict[str, Any]]]:
    """(line, record) of `read_merged`, each line as stored."""
    sources = _read_parts(path, cache) or [(os.fspath(path), paths.read_bytes(path) or b"")]
    seen: set[str] = set()
    out = []
    for name, raw in sources:
        for line, record in records.lines_in(raw, name, need):
            if (k := json.dumps([record[x] for x in keys])) not in seen:
                seen.add(k)
                out.append((line, record))
    return out


def export_parts(path: PathLike, keys: Sequence[str], *,
                 cache: PartCache | None = None) -> bool:
    """Rewrites file `path` as the export of its parts: their records' lines as stored, the
    first per value of `keys`, the older file's copy first, so a file that gained nothing
    keeps its bytes (and is not written). Returns whether it wrote. Readers use the parts
    (`read_merged`): an export that misses a part written meanwhile loses nothing."""
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
    """Adds `records_` (each holding `keys`) to records file `path`, which other processes may
    also write: one write-once part (`write_part`, named after the first record's keys).
    Locally `path` is then rewritten as the export of every part (`export_parts`), so it
    reads as before after every call; on an object store, where that would fetch every part
    for every record, the command exports once when it has added its records. Read them back
    with `read_merged(path, keys)`. Returns the part's path."""
    first = "_".join(str(records_[0][k]) for k in keys)
    safe = "".join(c if c.isascii() and (c.isalnum() or c in ".-") else "_" for c in first)
    part = write_part(path, part_name([safe.strip("_") or "record"]), records_)
    if not paths.is_remote(path):
        export_parts(path, keys)
    return part
