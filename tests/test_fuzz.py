"""examples/fuzz.py: its corpus is deterministic and covers every mutation, and a few thousand fuzzed
inputs go through the Loader and the Preprocessor on the CPU with nothing untyped, crashed, hung,
lost or duplicated."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("skimage")  # the photographs the corpus is made from (the "bench" extra)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fuzz.py"


@pytest.fixture(scope="module")
def fuzz():
    spec = importlib.util.spec_from_file_location("headrace_example_fuzz", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


def test_corpus_is_deterministic(fuzz, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    manifest_a = fuzz.write_corpus(a, seed=5, count=120, sides=(32, 96))
    manifest_b = fuzz.write_corpus(b, seed=5, count=120, sides=(32, 96))
    assert manifest_a == manifest_b
    for entry in manifest_a:
        name = fuzz.file_name(entry["index"], entry["ext"])
        assert (a / name).read_bytes() == (b / name).read_bytes()
    # An input depends on the seed and its index alone, not on how many were made with it.
    alone = fuzz.make_input(5, 77, (32, 96))
    assert alone.data == (a / fuzz.file_name(77, alone.ext)).read_bytes()
    assert fuzz.make_input(6, 77, (32, 96)).data != alone.data


def test_corpus_covers_every_mutation(fuzz):
    from PIL import Image

    items = [fuzz.make_input(0, i, (32, 96)) for i in range(500)]
    kinds = Counter(item.kind for item in items)
    assert set(kinds) == set(fuzz.KINDS), f"missing: {set(fuzz.KINDS) - set(kinds)}"
    assert {item.ext for item in items} == {"jpg", "png", "webp"}
    details = " ".join(item.detail for item in items)
    for made in ("444", "420", "progressive", "lossless", "png L", "png RGB"):
        assert made in details
    for item in items:
        assert "untouched" not in item.detail or item.kind == "control", item.detail
        if item.kind == "empty":
            assert item.data == b""
    # The claimed sizes are what a header parser reads: each claim parses to the size it says.
    claims = [item for item in items if item.kind.startswith("claim_")]
    assert {item.ext for item in claims} == {"jpg", "png", "webp"}
    saved, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None  # read the header only, never decode
    try:
        for item in claims:
            with Image.open(io.BytesIO(item.data)) as image:
                assert item.detail.endswith(f"claims {image.width}x{image.height}"), item.detail
    finally:
        Image.MAX_IMAGE_PIXELS = saved


@pytest.mark.parametrize("pipeline", ["training", "validation"])
def test_fuzz_cpu(fuzz, tmp_path, pipeline):
    """1,000 inputs a pipeline through both paths, in 2 worker subprocesses a path (about 25 s each).

    A worker holding more than 4 GiB is killed and counted: decode memory is bounded by
    ``Decode(max_batch_bytes=1 GiB)`` and claimed sizes by ``max_pixels``, whatever the files say.
    To name the inputs behind a failure, run the same command with ``--isolate 256``.
    """
    out = tmp_path / "fuzz.json"
    argv = ["--count", "1000", "--slice", "500", "--seed", "0", "--sides", "32,128", "--device", "cpu",
            "--pipeline", pipeline, "--rss-limit", "4", "--timeout", "120"]
    status = fuzz.main([*argv, "--isolate", "0", "--quiet", "--json", str(out)])
    result = json.loads(out.read_text())
    for path, total in result["paths"].items():
        summary = (f"{path}: untyped {[u['type'] for u in total['untyped']]}, "
                   f"epochs ended by {[a['type'] for a in total['aborted']]}, crashes {len(total['crashes'])}, "
                   f"hangs {len(total['hangs'])}, over 4 GiB {len(total['memory'])}, lost {total['lost']}, "
                   f"duplicated {total['duplicated'][:10]}, wrong {total['problems'][:3]} "
                   f"(to name the inputs: python examples/fuzz.py {' '.join(argv)} --isolate 256)")
        assert total["inputs"] == 1000, summary
        assert total["untyped"] == [], summary
        assert total["aborted"] == [], summary
        assert total["crashes"] == [] and total["hangs"] == [] and total["memory"] == [], summary
        assert total["lost"] == 0 and total["duplicated"] == [], summary
        assert total["problems"] == [], summary
        assert total["delivered"] + total["skipped"] == total["inputs"], summary
        # The untouched controls are all delivered; the empty files and text files all refused.
        controls = {m["index"] for m in result["manifest"] if m["kind"] == "control"}
        delivered = {int(i) for i, v in total["verdicts"].items() if v == "delivered"}
        assert controls <= delivered, f"{path}: controls refused: {sorted(controls - delivered)[:10]}"
        junk = {m["index"] for m in result["manifest"] if m["kind"] in ("empty", "text")}
        assert not junk & delivered, f"{path}: delivered empty/text inputs {sorted(junk & delivered)[:10]}"
    assert status == 0
