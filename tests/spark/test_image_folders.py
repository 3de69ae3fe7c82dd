"""Folders of images: ``sparkcnn prepare --format images``, training on a folder read once, and the
folders and files refused (exit 2, one line naming them, nothing written)."""

import json
import os
import struct
import zlib

import numpy as np
import pyarrow.parquet as pq
import pytest

from sparkcnn import config
from sparkcnn.cli import main
from sparkcnn.data.parquet_io import read_split_numpy
from sparkcnn.errors import BadInput

pytestmark = pytest.mark.spark

CLASSES = ("cat", "dog", "frog")


def _write_folder(root, n_per_class=4, shape=(8, 6, 3), seed=0, suffix=".png"):
    """``root/<class>/<i>.png`` of random pixels; returns {relative path: pixels}."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = {}
    for c in CLASSES:
        os.makedirs(os.path.join(root, c), exist_ok=True)
        for i in range(n_per_class):
            img = rng.integers(0, 256, shape, dtype=np.uint8)
            rel = os.path.join(c, f"{i:03d}{suffix}")
            Image.fromarray(img.squeeze(-1) if shape[-1] == 1 else img).save(os.path.join(root, rel))
            pixels[rel] = img
    return pixels


def _huge_png_header(path, width=30000, height=30000):
    """A PNG whose header says ``width`` x ``height`` (900 M pixels) and whose data is a stub: Pillow
    reads the header alone when it opens it, as it would the real 1 MB file."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    with open(path, "wb") as fh:
        fh.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                 + chunk(b"IEND", b""))


def _prepare(capsys, *args):
    rc = main(["prepare", "--format", "images", "--no-progress", *args])
    out, err = capsys.readouterr()
    return rc, out, err.strip().splitlines()


def test_prepare_images_writes_splits_and_channel_stats(spark, tmp_path, capsys):
    train = _write_folder(str(tmp_path / "src" / "train"), seed=1)
    test = _write_folder(str(tmp_path / "src" / "test"), n_per_class=2, seed=2)
    out = str(tmp_path / "prepared")
    rc, stdout, err = _prepare(capsys, "--source", str(tmp_path / "src"), "--out", out)
    assert rc == 0, err
    summary = json.loads(stdout)
    assert summary["classes"] == list(CLASSES)
    assert {s: v["rows"] for s, v in summary["splits"].items()} == {"train": 12, "test": 6}
    for split, pixels in (("train", train), ("test", test)):
        x, y = read_split_numpy(os.path.join(out, split))
        order = sorted(pixels)  # class folder, then file name
        np.testing.assert_array_equal(x, np.stack([pixels[p] for p in order]))
        assert y.tolist() == [CLASSES.index(p.split(os.sep)[0]) for p in order]
    x = np.stack([train[p] for p in sorted(train)]).reshape(-1, 3) / 255.0
    meta = pq.read_schema(os.path.join(out, "train", "part-00000.parquet")).metadata
    np.testing.assert_allclose(json.loads(meta[b"sparkcnn.mean"]), x.mean(axis=0), atol=1e-6)
    np.testing.assert_allclose(json.loads(meta[b"sparkcnn.std"]), x.std(axis=0), atol=1e-6)
    sidecar = json.load(open(os.path.join(out, "sparkcnn.json")))
    assert sidecar["splits"]["train"]["mean"] == json.loads(meta[b"sparkcnn.mean"])


def test_prepare_images_bad_folders_exit_2_and_keep_the_earlier_dataset(spark, tmp_path, capsys):
    out = str(tmp_path / "prepared")
    _write_folder(str(tmp_path / "good"), n_per_class=1)
    assert _prepare(capsys, "--source", str(tmp_path / "good"), "--out", out)[0] == 0
    before = sorted(os.listdir(os.path.join(out, "train")))

    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "a.png").write_bytes((tmp_path / "good" / "cat" / "000.png").read_bytes())
    empty = tmp_path / "empty"
    for c in CLASSES:
        (empty / c).mkdir(parents=True)
    (empty / "cat" / "notes.txt").write_text("no image here")
    huge = tmp_path / "huge"
    _write_folder(str(huge), n_per_class=1)
    _huge_png_header(str(huge / "dog" / "zz-huge.png"))
    big = tmp_path / "big"  # over a limit given on the command line, under Pillow's own
    _write_folder(str(big), n_per_class=1, shape=(40, 40, 3))
    cases = {
        "flat": ([str(flat)], rf"{flat}: 1 image\(s\) but no class sub-folders"),
        "empty classes": ([str(empty)], rf"{empty}: no images found .* in its 3 sub-folder"),
        "over Pillow's limit": ([str(huge)], r"zz-huge\.png: image has more than data\.max_image_pixels"),
        "over the given limit": ([str(big), "--max-image-pixels", "1000"],
                                 r"000\.png: image is 40x40 = 1600 pixels, over data\.max_image_pixels=1000"),
    }
    import re

    for case, (args, pattern) in cases.items():
        rc, _, err = _prepare(capsys, "--source", *args, "--out", out)
        assert rc == 2 and len(err) == 1, (case, err)
        assert re.search(pattern, err[0]), (case, err)
        assert sorted(os.listdir(os.path.join(out, "train"))) == before, case
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def _dcfg(**kw):
    return config.load(None, [f"data.{k}={v}" for k, v in kw.items()]).data


def test_training_frame_reads_the_folder_once(spark, tmp_path):
    """The placement reads the rows the check query decoded: with the files gone by then, the
    blocks still hold every image."""
    import shutil

    from sparkcnn.data.frames import images_from_arrow
    from sparkcnn.data.source import release, training_frames

    root = tmp_path / "imgs"
    train = _write_folder(str(root / "train"), n_per_class=5, seed=3)
    _write_folder(str(root / "test"), n_per_class=2, seed=4)
    tr, te = training_frames(spark, _dcfg(), str(root))
    assert (tr.kind, tr.shape, tr.classes, tr.num_rows, te.num_rows) == ("binary", (8, 6, 3), CLASSES, 15, 6)
    shutil.rmtree(root)
    got = tr.df.toArrow()
    x = images_from_arrow(got.column("image"), tr.shape, kind="binary")
    np.testing.assert_array_equal(x, np.stack([train[p] for p in sorted(train)]))
    release(tr)
    release(te)
    assert not tr.cache.is_cached


def test_training_refuses_bad_folders_in_one_line(spark, tmp_path, capsys):
    import shutil

    from sparkcnn.data.source import frame

    flat = tmp_path / "flat"
    _write_folder(str(flat / "x"), n_per_class=1)
    for p in (flat / "x").rglob("*.png"):
        p.rename(flat / f"{p.parent.name}-{p.name}")
    with pytest.raises(BadInput, match=rf"{flat}: 3 image\(s\) outside its class sub-folders"):
        frame(spark, _dcfg(), str(flat))  # x/'s class folders are empty now: the images are loose
    shutil.rmtree(flat / "x")
    with pytest.raises(BadInput, match=rf"{flat}: 3 image\(s\) but no class sub-folders \(e\.g\. cat-000"):
        frame(spark, _dcfg(), str(flat))
    big = tmp_path / "big"
    _write_folder(str(big), n_per_class=2, shape=(10, 10, 1))
    with pytest.raises(BadInput, match=r"cat/000\.png: image is 10x10 = 100 pixels, over data\.max_image_pixels=99"):
        frame(spark, _dcfg(max_image_pixels=99), str(big))
    _huge_png_header(str(big / "dog" / "001.png"))
    with pytest.raises(BadInput, match=r"dog/001\.png: image has more than data\.max_image_pixels"):
        frame(spark, _dcfg(), str(big))

    empty = tmp_path / "empty"
    (empty / "cat").mkdir(parents=True)
    runs = tmp_path / "runs"
    rc = main(["train", "--no-progress", "--set", f"data.path={empty}", "--set", f"run.out_dir={runs}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [f"sparkcnn train: error: {empty}: no images found (.png, .jpg, .jpeg) "
                               "in its 1 sub-folder(s)"]
    assert not runs.exists()
