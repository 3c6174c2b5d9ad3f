"""inference/corpus.py: which installed Python becomes training data, and which is left out."""

from email.message import Message

import numpy as np

from inference.corpus import (
    MAX_FILE_BYTES,
    build_corpus,
    drop_reason,
    licence_of,
    minhash,
    normalized_lines,
    similarity,
    spdx_permissive,
)
from inference.train import split_of

CODE = "".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n\n\n" for i in range(12))


def metadata(**fields) -> Message:
    meta = Message()
    for key, value in fields.items():
        for v in value if isinstance(value, list) else [value]:
            meta[key.replace("_", "-")] = v
    return meta


def test_spdx_expressions():
    assert spdx_permissive("MIT") and spdx_permissive("BSD-3-Clause AND 0BSD AND MIT")
    assert spdx_permissive("Apache-2.0 WITH LLVM-exception")  # an exception only adds rights
    assert spdx_permissive("GPL-2.0-only OR MIT")  # the MIT choice is open
    assert not spdx_permissive("MIT AND GPL-2.0-only") and not spdx_permissive("LGPL-3.0-only")
    assert not spdx_permissive("MPL-2.0 AND MIT") and not spdx_permissive("LicenseRef-Proprietary")


def test_licence_from_expression_classifiers_or_free_text():
    assert licence_of(metadata(License_Expression="BSD-3-Clause")) == ("BSD-3-Clause", True)
    classified = metadata(
        Classifier=["License :: OSI Approved :: MIT License", "Programming Language :: Python"]
    )
    assert licence_of(classified) == ("MIT License", True)
    dual = metadata(Classifier=["License :: OSI Approved :: MIT License", "License :: OSI Approved :: GNU General Public License v3 (GPLv3)"])  # fmt: skip
    assert licence_of(dual)[1] is False  # every classifier must be permissive
    assert licence_of(metadata(License="Apache 2.0 License"))[1] is True
    assert licence_of(metadata(License="Mozilla Public License 2.0"))[1] is False
    assert licence_of(metadata()) == ("unknown", False)  # nothing said: left out


def test_single_file_checks():
    assert drop_reason("pkg/_vendor/six.py", CODE.encode())[0] == "vendored"
    assert drop_reason("pkg/big.py", b"x = 1\n" * (MAX_FILE_BYTES // 6 + 1))[0] == "over size cap"
    assert drop_reason("pkg/__init__.py", b"from .a import b\n")[0] == "nearly empty"
    assert drop_reason("pkg/latin.py", CODE.encode() + "# caf\xe9\n".encode("latin-1"))[0] == "not UTF-8"
    assert drop_reason("pkg/wide.py", CODE.encode() + b"x = '" + b"a" * 1200 + b"'\n")[0] == "generated"
    table = (
        "decoding_table = (\n"
        + "".join(f"    '\\x{i:02x}'  # 0x{i:02X} -> LATIN CHARACTER NUMBER {i}\n" for i in range(256))
        + ")\n"
    )
    assert drop_reason("encodings/cp999.py", table.encode())[0] == "generated"
    assert drop_reason("pkg/code.py", CODE.encode()) == ("", CODE)


def test_minhash_estimates_line_set_similarity():
    base = normalized_lines(CODE)
    edited = normalized_lines(CODE.replace("return x * 3 + 9", "return x * 3 + 10"))
    other = normalized_lines("".join(f"class C{i}:\n    y = '{i}'\n" for i in range(20)))
    assert similarity(minhash(base), minhash(base)) == 1.0
    assert similarity(minhash(base), minhash(edited)) >= 0.8  # one line of 25 changed
    assert similarity(minhash(base), minhash(other)) < 0.2
    assert minhash({"a = 1", "b = 2"}) is None  # too few lines to judge
    assert minhash(base).dtype == np.uint64 and minhash(base).shape == (64,)


def test_build_corpus_dedups_splits_and_fingerprints(tmp_path):
    lib = tmp_path / "lib"
    (lib / "pkg").mkdir(parents=True)
    (lib / "a.py").write_text(CODE)
    (lib / "pkg" / "copy_of_a.py").write_text(CODE.replace("\n", "   \n"))  # trailing spaces only
    (lib / "pkg" / "near_a.py").write_text(CODE.replace("return x * 3 + 9", "return x * 3 + 10"))
    distinct = "".join(f"class Thing{i}:\n    size = {i}\n\n" for i in range(12))
    (lib / "b.py").write_text(distinct)
    (lib / "held.py").write_text(CODE.replace("f1(", "g1("))
    (lib / "site-packages").mkdir()
    (lib / "site-packages" / "ignored.py").write_text(distinct + "z = 1\n")

    corpus = build_corpus(str(lib), packages=False, workers=1)
    assert [key for key, _, _ in corpus.files] == ["a.py", "b.py"]
    assert corpus.dropped == {"exact duplicate": 1, "near duplicate": 2}
    assert corpus.split == {"a.py": split_of("a.py"), "b.py": split_of("b.py")}
    assert corpus.packages[0].name == "python-stdlib" and corpus.packages[0].files == 2
    again = build_corpus(str(lib), packages=False, workers=2)
    assert again.fingerprint == corpus.fingerprint and len(corpus.fingerprint) == 64

    # a training file that nearly duplicates a held-out one (a file kept out elsewhere) is dropped too
    (lib / "b.py").unlink()
    held = build_corpus(str(lib), packages=False, held_out=[minhash(normalized_lines(CODE))], workers=1)
    assert all(split_of(key) == "test" for key, _, _ in held.files)
    assert held.dropped["near duplicate of a held-out file"] >= (split_of("a.py") != "test")
