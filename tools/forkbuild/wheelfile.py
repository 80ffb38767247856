"""Repack a base wheel as the fork wheel.

Every member of the base wheel is copied byte for byte except:
  - files the patch series changed, added or deleted;
  - `vllm/_version.py`, stamped with the fork version;
  - the `.dist-info` directory: renamed to `vllm-<version>.dist-info`, METADATA
    gets the fork's Name and Version (Requires-Dist stays the base's), WHEEL
    gets the tag the file name carries, RECORD is regenerated.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import re
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from . import BuildError

DIST_NAME = "vllm"
VERSION_FILE = "vllm/_version.py"
GENERATOR = "vllm-fork-build (tools/forkbuild)"


@dataclass
class Overrides:
    """What differs from the base wheel: new contents by path, and deleted paths."""

    contents: dict[str, bytes] = field(default_factory=dict)
    deleted: set[str] = field(default_factory=set)


def dist_info_dir(zf: zipfile.ZipFile) -> str:
    names = {n.split("/", 1)[0] for n in zf.namelist() if n.split("/", 1)[0].endswith(".dist-info")}
    if len(names) != 1:
        raise BuildError(f"{zf.filename}: expected one .dist-info directory, found {sorted(names)}")
    return names.pop()


def read_metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(f"{dist_info_dir(zf)}/METADATA").decode()


def stamp_version_file(text: str, version: str) -> str:
    release = version.split("+", 1)[0]
    local = version.split("+", 1)[1] if "+" in version else ""
    parts = [int(p) for p in release.split(".")] + ([local] if local else [])
    new, count = re.subn(
        r"^__version__ = version = .*$", f"__version__ = version = {version!r}", text, flags=re.M
    )
    new, count_tuple = re.subn(
        r"^__version_tuple__ = version_tuple = .*$",
        f"__version_tuple__ = version_tuple = {tuple(parts)!r}",
        new,
        flags=re.M,
    )
    if count != 1 or count_tuple != 1:
        raise BuildError(f"{VERSION_FILE}: cannot find the version assignments to stamp")
    return new


def rewrite_metadata(text: str, version: str) -> str:
    head, sep, body = text.partition("\n\n")
    head = re.sub(r"^Name: .*$", f"Name: {DIST_NAME}", head, count=1, flags=re.M)
    head = re.sub(r"^Version: .*$", f"Version: {version}", head, count=1, flags=re.M)
    return head + sep + body


def rewrite_wheel_file(text: str, tag: str) -> str:
    lines = [line for line in text.splitlines() if not line.startswith(("Tag:", "Generator:"))]
    lines.insert(1, f"Generator: {GENERATOR}")
    # One Tag line: the one the file name carries (the CPU base's WHEEL disagrees with its name).
    return "\n".join(lines).rstrip("\n") + f"\nTag: {tag}\n\n"


def _record_row(path: str, data: bytes) -> tuple[str, str, str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return (path, f"sha256={digest}", str(len(data)))


def _record_text(rows: list[tuple[str, str, str]]) -> str:
    """RECORD is CSV: upstream ships file names with commas in them (tuned-config JSONs)."""
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerows(rows)
    return buffer.getvalue()


class _Progress:
    """Prints every 10% of the uncompressed bytes written (big .so files dominate)."""

    def __init__(self, total_bytes: int, label: str) -> None:
        self.total, self.label, self.done, self.next_pct = total_bytes, label, 0, 10
        self.start = time.monotonic()

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        pct = 100 * self.done // max(self.total, 1)
        if pct >= self.next_pct:
            elapsed = time.monotonic() - self.start
            print(f"{self.label}: {pct:3d}% of {self.total / 1e6:.0f} MB ({elapsed:.0f} s)",
                  file=sys.stderr, flush=True)
            self.next_pct = pct - pct % 10 + 10


def repack(base_wheel: Path, overrides: Overrides, version: str, tag: str, out_dir: Path) -> Path:
    """Write `vllm-<version>-<tag>.whl` into `out_dir`; return its path."""
    out_name = f"{DIST_NAME}-{version}-{tag}.whl"
    out_path = out_dir / out_name
    partial = out_dir / f".{out_name}.partial"
    new_info = f"{DIST_NAME}-{version}.dist-info"
    out_dir.mkdir(parents=True, exist_ok=True)

    with zipfile.ZipFile(base_wheel) as src:
        old_info = dist_info_dir(src)
        members = [i for i in src.infolist() if not i.is_dir()]
        progress = _Progress(sum(i.file_size for i in members), "repack")
        records: list[tuple[str, str, str]] = []
        seen: set[str] = set()
        try:
            with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_DEFLATED) as dst:
                def put(name: str, data: bytes, like: zipfile.ZipInfo | None) -> None:
                    info = zipfile.ZipInfo(name, date_time=like.date_time if like else (1980, 1, 1, 0, 0, 0))
                    info.external_attr = like.external_attr if like else 0o644 << 16
                    info.compress_type = zipfile.ZIP_DEFLATED
                    dst.writestr(info, data)
                    records.append(_record_row(name, data))
                    seen.add(name)

                for info in members:
                    name = info.filename
                    if name.startswith(f"{old_info}/"):
                        leaf = name[len(old_info) + 1:]
                        if leaf == "RECORD":
                            continue
                        data = src.read(info)
                        if leaf == "METADATA":
                            data = rewrite_metadata(data.decode(), version).encode()
                        elif leaf == "WHEEL":
                            data = rewrite_wheel_file(data.decode(), tag).encode()
                        put(f"{new_info}/{leaf}", data, info)
                    elif name in overrides.deleted:
                        pass
                    elif name == VERSION_FILE:
                        put(name, stamp_version_file(src.read(info).decode(), version).encode(), info)
                    elif name in overrides.contents:
                        put(name, overrides.contents[name], info)
                    else:
                        put(name, src.read(info), info)
                    progress.advance(info.file_size)
                for name in sorted(set(overrides.contents) - seen):  # files the series adds
                    put(name, overrides.contents[name], None)
                record_name = f"{new_info}/RECORD"
                body = _record_text(records + [(record_name, "", "")])
                info = zipfile.ZipInfo(record_name, date_time=(1980, 1, 1, 0, 0, 0))
                info.external_attr = 0o644 << 16
                dst.writestr(info, body, compress_type=zipfile.ZIP_DEFLATED)
            partial.replace(out_path)
        finally:
            partial.unlink(missing_ok=True)
    return out_path
