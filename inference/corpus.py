"""The default model's training corpus: permissively licensed Python already installed on the machine.

    python -m inference.corpus [--no-packages] [--json]      # what this machine would give

Two sources, nothing downloaded:
- the running interpreter's standard library (.py files under its stdlib directory, PSF-2.0);
- the sources of the installed distributions (torch, transformers, scipy, ...): each distribution's
  files come from its RECORD, its licence from its metadata (License-Expression, the licence
  classifiers, or the License field). A distribution whose licence is not recognisably permissive
  (MIT, BSD, Apache-2.0, PSF, ISC, ...) is left out, with the reason recorded.

Each file is then kept or dropped, the first reason that applies being recorded:
vendored copies (a `_vendor`, `vendored`, `third_party`, ... folder: someone else's code under
someone else's licence), files over a size cap or nearly empty, files that are not UTF-8, generated
tables (a line over 1,000 characters, or mostly lines that start with a literal: codec and unicode
tables; generated code such as transformers' modular copies stays, the near-duplicate check thins it),
exact duplicates (after trailing whitespace) and near duplicates (MinHash of the set of stripped
lines, 64 hashes, 8 bands of 8; estimated Jaccard >= 0.8). The standard library comes first, so of a
file and its copy in a package the standard library's stays. A training or validation file that
nearly duplicates one of `held_out` (signatures of files kept out elsewhere: the old model's test
split) is dropped too, so the held-out figures stay honest.

Every file's split comes from a hash of its key, its path relative to its root (the stdlib directory
or the site-packages directory), as train.split_of does: the standard library's files keep the split
they had for the old model. The fingerprint is a SHA-256 over every kept file's key and bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import numpy as np

from inference.train import split_of, stdlib_files, stdlib_root

MAX_FILE_BYTES = 256 * 1024  # bigger files are nearly always generated (pydoc topics, unicode tables)
MIN_FILE_BYTES = 64  # empty __init__.py files and one-line re-exports teach nothing
MAX_LINE_CHARS = 1000
TABLE_MIN_BYTES = 8 * 1024
TABLE_DATA_LINE_SHARE = 0.5  # a file whose lines mostly start with a literal is a table
NEAR_DUP_JACCARD = 0.8
NUM_HASHES, BANDS = 64, 8  # 8 bands of 8 rows: pairs at Jaccard 0.8 share a band with p ~ 0.98
MIN_LINES_FOR_NEAR_DUP = 5  # fewer distinct lines: only exact duplicates are caught

VENDOR_DIRS = frozenset({"_vendor", "vendor", "vendored", "_vendored", "third_party", "_vendored_packages", "_extern", "extern"})  # fmt: skip
DATA_LINE = re.compile(r"""^\s*(?:[-+]?\d|0x|['"(\[{]\s*(?:\\x|\\u|\d|0x|['"]))""")

STDLIB_ORIGIN = "python-stdlib"
STDLIB_LICENCE = "PSF-2.0"

# SPDX ids and classifier / free-text names of permissive licences.
PERMISSIVE_SPDX = {
    "mit", "mit-0", "bsd-2-clause", "bsd-3-clause", "bsd-3-clause-clear", "0bsd", "apache-2.0", "isc",
    "psf-2.0", "python-2.0", "zlib", "unlicense", "cc0-1.0", "bsl-1.0", "hpnd", "mit-cmu", "x11",
    "ncsa", "upl-1.0", "wtfpl", "cnri-python", "tcl", "zpl-2.1", "zpl-2.0", "mit-open-group",
}  # fmt: skip
PERMISSIVE_WORDS = re.compile(
    r"\b(mit|bsd|apache|isc|psf|python software foundation|zlib|unlicense|public domain|cc0|"
    r"boost software|historical permission|hpnd|x11|0bsd)\b|permission is hereby granted",
    re.I,
)
COPYLEFT_WORDS = re.compile(r"\b(a?gpl|lgpl|gnu|mpl|mozilla|epl|eclipse|cddl|proprietary|commercial|sspl|eupl)\b", re.I)  # fmt: skip


@dataclass(frozen=True)
class Candidate:
    key: str  # path relative to its root: what the split hashes
    origin: str  # "python-stdlib" or a distribution's name
    path: str  # absolute path to read


@dataclass
class Examined:
    key: str
    origin: str
    reason: str = ""  # why it is dropped; "" while kept
    text: str = ""
    exact: bytes = b""
    signature: np.ndarray | None = None  # [NUM_HASHES] uint64, None for too few lines


@dataclass
class Package:
    name: str
    version: str
    licence: str
    permissive: bool
    files: int = 0  # kept .py files
    bytes: int = 0


@dataclass
class Corpus:
    files: list[tuple[str, str, str]]  # (key, origin, text), kept files in order
    split: dict[str, str]  # key -> train | validation | test
    packages: list[Package]
    dropped: Counter = field(default_factory=Counter)  # reason -> count
    fingerprint: str = ""
    seconds: float = 0.0
    truncated: bool = False  # the deadline came before every file was examined

    def texts(self, split: str) -> list[str]:
        return [text for key, _, text in self.files if self.split[key] == split]

    def keys(self, split: str) -> list[str]:
        return [key for key, _, _ in self.files if self.split[key] == split]

    def summary(self) -> dict:
        by_split = Counter(self.split[k] for k, _, _ in self.files)
        return {
            "fingerprint": self.fingerprint,
            "files": len(self.files),
            "bytes": sum(len(t.encode()) for _, _, t in self.files),
            "splits": dict(sorted(by_split.items())),
            "dropped": dict(self.dropped.most_common()),
            "truncated": self.truncated,
            "seconds": round(self.seconds, 1),
            "packages": [vars(p) for p in self.packages],
        }


# --- licences ------------------------------------------------------------------------------------------


def spdx_permissive(expression: str) -> bool:
    """An SPDX expression is permissive when every choice of its OR alternatives can be permissive:
    `MIT OR GPL-2.0` is (take MIT), `MIT AND GPL-2.0` is not."""
    for alternative in re.split(r"\s+OR\s+", expression, flags=re.I):
        alternative = re.sub(
            r"\s+WITH\s+[\w.+-]+", "", alternative, flags=re.I
        )  # an exception only adds rights
        ids = [
            i.strip().lower().removesuffix("+") for i in re.split(r"\s+AND\s+|[()]", alternative, flags=re.I)
        ]
        if all(i in PERMISSIVE_SPDX for i in ids if i):
            return True
    return False


def licence_of(meta: metadata.PackageMetadata) -> tuple[str, bool]:
    """(licence as the metadata names it, whether it is permissive) from License-Expression, else the
    licence classifiers (all must be permissive), else the first line of the License field."""
    expression = meta.get("License-Expression")
    if expression:
        return expression, spdx_permissive(expression)
    classifiers = [
        c.split(" :: ")[-1] for c in meta.get_all("Classifier") or [] if c.startswith("License ::")
    ]
    classifiers = [c for c in classifiers if c not in ("OSI Approved", "DFSG approved")]
    if classifiers:
        ok = all(PERMISSIVE_WORDS.search(c) and not COPYLEFT_WORDS.search(c) for c in classifiers)
        return "; ".join(classifiers), ok
    text = (meta.get("License") or "").strip()
    first = text.splitlines()[0][:100] if text else ""
    if not first or first.upper() == "UNKNOWN":
        return "unknown", False
    head = text[:2000]
    return first, bool(PERMISSIVE_WORDS.search(head)) and not COPYLEFT_WORDS.search(head)


# --- discovery ---------------------------------------------------------------------------------------


def discover(
    stdlib_dir: str = "", packages: bool = True, exclude_under: Iterable[Path] = ()
) -> tuple[list[Candidate], list[Package]]:
    """The standard library's .py files, then (sorted by distribution name) every installed
    distribution's .py files whose licence is permissive. `exclude_under`: folders to skip (the
    repository itself, when it is installed in development mode)."""
    root = stdlib_root(stdlib_dir)
    candidates = [Candidate(rel, STDLIB_ORIGIN, str(root / rel)) for rel in stdlib_files(root)]
    found = [Package(STDLIB_ORIGIN, sys.version.split()[0], STDLIB_LICENCE, True)]
    if not packages:
        return candidates, found
    excluded = [p.resolve() for p in exclude_under]
    seen: set[str] = set()
    for dist in sorted(metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        name = dist.metadata["Name"] or ""
        if not name or name.lower() in seen:  # the first on sys.path wins, as for imports
            continue
        seen.add(name.lower())
        licence, permissive = licence_of(dist.metadata)
        found.append(Package(name, dist.version, licence, permissive))
        if not permissive:
            continue
        for entry in dist.files or []:
            rel = entry.as_posix()
            if not rel.endswith(".py") or rel.startswith(".."):  # scripts installed in bin/
                continue
            path = Path(dist.locate_file(entry)).resolve()
            if any(path.is_relative_to(e) for e in excluded):
                continue
            candidates.append(Candidate(rel, name, str(path)))
    return candidates, found


# --- examination (one file, in a worker process) ----------------------------------------------------------


def normalized_lines(text: str) -> set[str]:
    return {s for line in text.splitlines() if (s := line.strip())}


_PERMUTATIONS = np.random.default_rng(20261129).integers(1, 2**63, size=(2, NUM_HASHES), dtype=np.uint64) | np.uint64(1)  # fmt: skip


def minhash(lines: set[str]) -> np.ndarray | None:
    """[NUM_HASHES] uint64 MinHash of a set of lines (None below MIN_LINES_FOR_NEAR_DUP lines): the
    minimum of (a * h + b) mod 2^64 over the lines' 64-bit BLAKE2 hashes h, for 64 odd pairs (a, b)."""
    if len(lines) < MIN_LINES_FOR_NEAR_DUP:
        return None
    hashes = np.array(
        [
            int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little")
            for s in sorted(lines)
        ],
        dtype=np.uint64,
    )
    a, b = _PERMUTATIONS
    with np.errstate(over="ignore"):
        return (a[:, None] * hashes[None, :] + b[:, None]).min(axis=1)  # [NUM_HASHES]


def similarity(x: np.ndarray, y: np.ndarray) -> float:
    """Estimated Jaccard similarity of two line sets: the share of equal MinHash values."""
    return float((x == y).mean())


def drop_reason(key: str, raw: bytes) -> tuple[str, str]:
    """(reason or "", text): the checks that look at one file alone."""
    if VENDOR_DIRS.intersection(key.split("/")[:-1]):
        return "vendored", ""
    if len(raw) > MAX_FILE_BYTES:
        return "over size cap", ""
    if len(raw) < MIN_FILE_BYTES:
        return "nearly empty", ""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8", ""
    lines = text.splitlines()
    if max(map(len, lines), default=0) > MAX_LINE_CHARS:
        return "generated", ""
    if len(raw) >= TABLE_MIN_BYTES:
        code_lines = [line for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if sum(bool(DATA_LINE.match(line)) for line in code_lines) > TABLE_DATA_LINE_SHARE * len(code_lines):
            return "generated", ""
    return "", text


def examine(candidate: Candidate) -> Examined:
    item = Examined(candidate.key, candidate.origin)
    try:
        raw = Path(candidate.path).read_bytes()
    except OSError:
        item.reason = "unreadable"
        return item
    item.reason, item.text = drop_reason(candidate.key, raw)
    if not item.reason:
        exact = "\n".join(line.rstrip() for line in item.text.splitlines()).strip()
        item.exact = hashlib.sha256(exact.encode()).digest()
        item.signature = minhash(normalized_lines(item.text))
    return item


# --- the whole corpus --------------------------------------------------------------------------------------


class NearDuplicates:
    """Signatures seen so far, indexed by band: is a new one within NEAR_DUP_JACCARD of any?"""

    def __init__(self):
        self.buckets: dict[tuple[int, bytes], list[np.ndarray]] = {}

    def bands(self, signature: np.ndarray) -> list[tuple[int, bytes]]:
        rows = NUM_HASHES // BANDS
        return [(i, signature[i * rows : (i + 1) * rows].tobytes()) for i in range(BANDS)]

    def match(self, signature: np.ndarray) -> bool:
        return any(
            similarity(signature, other) >= NEAR_DUP_JACCARD
            for band in self.bands(signature)
            for other in self.buckets.get(band, ())
        )

    def add(self, signature: np.ndarray) -> None:
        for band in self.bands(signature):
            self.buckets.setdefault(band, []).append(signature)


def build_corpus(
    stdlib_dir: str = "",
    packages: bool = True,
    held_out: Iterable[np.ndarray] = (),
    deadline: float | None = None,
    workers: int | None = None,
    exclude_under: Iterable[Path] = (),
) -> Corpus:
    """Discover, examine (in `workers` processes) and deduplicate; stop examining at `deadline`
    (time.time()), keeping what was examined by then, and say so."""
    start = time.time()
    candidates, packages_found = discover(stdlib_dir, packages, exclude_under)
    held = NearDuplicates()
    for signature in held_out:
        held.add(signature)
    seen_keys: set[str] = set()
    seen_exact: set[bytes] = set()
    near = NearDuplicates()
    kept: list[tuple[str, str, str]] = []
    dropped: Counter = Counter()
    truncated = False
    with multiprocessing.get_context("fork").Pool(workers or os.cpu_count()) as pool:
        # imap keeps the candidates' order, so which copy of a duplicate stays never depends on timing
        for item in pool.imap(examine, candidates, chunksize=16):
            if deadline is not None and time.time() > deadline:
                truncated = True
                pool.terminate()
                break
            reason = item.reason or _duplicate_reason(item, seen_keys, seen_exact, near, held)
            if reason:
                dropped[reason] += 1
                continue
            seen_keys.add(item.key)
            seen_exact.add(item.exact)
            if item.signature is not None:
                near.add(item.signature)
            kept.append((item.key, item.origin, item.text))
    counts = Counter(origin for _, origin, _ in kept)
    sizes = Counter()
    for _, origin, text in kept:
        sizes[origin] += len(text.encode())
    for package in packages_found:
        package.files, package.bytes = counts[package.name], sizes[package.name]
    return Corpus(
        files=kept,
        split={key: split_of(key) for key, _, _ in kept},
        packages=packages_found,
        dropped=dropped,
        fingerprint=fingerprint(kept),
        seconds=time.time() - start,
        truncated=truncated,
    )


def _duplicate_reason(
    item: Examined, keys: set[str], exact: set[bytes], near: NearDuplicates, held: NearDuplicates
) -> str:
    if item.key in keys:
        return "same path as an earlier file"
    if item.exact in exact:
        return "exact duplicate"
    if item.signature is None:
        return ""
    if split_of(item.key) != "test" and held.match(item.signature):
        return "near duplicate of a held-out file"
    if near.match(item.signature):
        return "near duplicate"
    return ""


def fingerprint(files: Iterable[tuple[str, str, str]]) -> str:
    digest = hashlib.sha256()
    for key, _, text in files:
        digest.update(key.encode() + b"\0" + text.encode() + b"\0")
    return digest.hexdigest()


def signatures_of(texts: Iterable[str]) -> list[np.ndarray]:
    return [s for t in texts if (s := minhash(normalized_lines(t))) is not None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inference.corpus", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--stdlib", default="", help="standard library directory (default: this interpreter's)"
    )
    parser.add_argument("--no-packages", action="store_true", help="the standard library only")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    corpus = build_corpus(args.stdlib, packages=not args.no_packages)
    summary = corpus.summary()
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(f"{summary['files']} files, {summary['bytes'] / 1e6:.1f} MB, splits {summary['splits']}, "
          f"fingerprint {summary['fingerprint'][:16]}, {summary['seconds']:.0f} s")  # fmt: skip
    print("dropped:", summary["dropped"])
    for p in corpus.packages:
        if p.files or not p.permissive:
            print(f"  {p.name} {p.version}: {p.licence[:60]!r} {'kept ' + str(p.files) + ' files' if p.permissive else 'left out'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
