"""Data readers, the prepared Parquet format and `prepare` (no Spark, no TF)."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import pickle
import pickletools

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkcnn.data import cifar, idx, parquet_io, prepare as prepare_mod, synthetic
from sparkcnn.data.parquet_io import read_meta, read_parquet_input, read_split_numpy, write_split
from sparkcnn.data.prepare import prepare
from sparkcnn.errors import BadInput

RNG = np.random.default_rng(7)


def rand_images(n, h=28, w=28, c=1):
    return RNG.integers(0, 256, size=(n, h, w, c), dtype=np.uint8)


def rand_labels(n, k=10):
    return RNG.integers(0, k, size=n).astype(np.int32)


def tree_digest(root) -> dict:
    """{relative path: sha256} of every file under `root`."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def write_idx_dir(d, n_train=20, n_test=10, gz=True, labels=None):
    os.makedirs(d, exist_ok=True)
    data = {}
    for split, n in (("train", n_train), ("test", n_test)):
        images_stem, labels_stem = idx.SPLIT_FILES[split]
        x, y = rand_images(n), rand_labels(n) if labels is None else labels
        sfx = ".gz" if gz else ""
        synthetic.write_idx(os.path.join(d, images_stem + sfx), x, gz=gz)
        synthetic.write_idx(os.path.join(d, labels_stem + sfx), y, gz=gz)
        data[split] = (x, y)
    return data


def write_cifar_dir(d, kind, n_batches=2, n=7):
    os.makedirs(d, exist_ok=True)
    data = {"train": ([], []), "test": ([], [])}
    sfx = ".bin" if kind == "bin" else ""
    writer = synthetic.write_cifar_bin if kind == "bin" else synthetic.write_cifar_py
    names = [f"data_batch_{i}{sfx}" for i in range(1, n_batches + 1)] + [f"test_batch{sfx}"]
    for name in names:
        x, y = rand_images(n, 32, 32, 3), rand_labels(n)
        writer(os.path.join(d, name), x, y)
        split = "test" if name.startswith("test") else "train"
        data[split][0].append(x)
        data[split][1].append(y)
    return {s: (np.concatenate(a), np.concatenate(b)) for s, (a, b) in data.items()}


# --------------------------------------------------------------- round trips

@pytest.mark.parametrize("gz", [True, False])
def test_idx_round_trip(tmp_path, gz):
    data = write_idx_dir(tmp_path, gz=gz)
    for split, (x, y) in data.items():
        images, labels = idx.read_idx_split(str(tmp_path), split)
        assert images.dtype == np.uint8 and images.shape == (len(x), 28, 28, 1)
        assert labels.dtype == np.int32
        np.testing.assert_array_equal(images, x)
        np.testing.assert_array_equal(labels, y)


def test_idx_header_is_the_published_layout(tmp_path):
    path = synthetic.write_idx(str(tmp_path / "i"), np.zeros((3, 4, 5), np.uint8))
    raw = open(path, "rb").read()
    assert raw[:16] == bytes.fromhex("00000803" "00000003" "00000004" "00000005")
    assert len(raw) == 16 + 60
    gz = synthetic.write_idx(str(tmp_path / "l.gz"), np.array([1, 2], np.uint8), gz=True)
    assert gzip.decompress(open(gz, "rb").read()) == bytes.fromhex("00000801" "00000002" "0102")


def test_cifar_bin_round_trip_and_layout(tmp_path):
    data = write_cifar_dir(tmp_path, "bin")
    for split, (x, y) in data.items():
        images, labels, classes = cifar.read_cifar_split(str(tmp_path), "bin", split)
        np.testing.assert_array_equal(images, x)
        np.testing.assert_array_equal(labels, y)
        assert classes == cifar.CIFAR10_CLASSES
    # Byte layout: label byte, then the R plane, G plane, B plane.
    img = np.zeros((1, 32, 32, 3), np.uint8)
    img[..., 0], img[..., 1], img[..., 2] = 1, 2, 3
    raw = open(synthetic.write_cifar_bin(str(tmp_path / "one.bin"), img, [9]), "rb").read()
    assert raw == b"\x09" + b"\x01" * 1024 + b"\x02" * 1024 + b"\x03" * 1024


def test_cifar_bin_meta_txt_and_nested_folder(tmp_path):
    nested = tmp_path / "cifar-10-batches-bin"
    write_cifar_dir(nested, "bin", n_batches=1)
    names = [f"class {i}" for i in range(10)]
    (nested / "batches.meta.txt").write_text("\n".join(names) + "\n\n")
    _, _, classes = cifar.read_cifar_split(str(tmp_path), "bin", "train")
    assert classes == tuple(names)


@pytest.mark.parametrize("py2", [True, False])
def test_cifar_py_round_trip(tmp_path, py2):
    os.makedirs(tmp_path / "cifar-10-batches-py")
    d = tmp_path / "cifar-10-batches-py"
    x, y = rand_images(5, 32, 32, 3), rand_labels(5)
    synthetic.write_cifar_py(str(d / "data_batch_1"), x, y, py2=py2)
    synthetic.write_cifar_py(str(d / "test_batch"), x[:2], y[:2], py2=py2)
    images, labels, _ = cifar.read_cifar_split(str(tmp_path), "py", "train")
    np.testing.assert_array_equal(images, x)
    np.testing.assert_array_equal(labels, y)


def test_cifar_py_file_is_like_the_original(tmp_path):
    path = synthetic.write_cifar_py(str(tmp_path / "b"), rand_images(3, 32, 32, 3), [1, 2, 3])
    raw = open(path, "rb").read()
    ops = {op.name for op, _, _ in pickletools.genops(raw)}
    assert raw[:2] == b"\x80\x02" and "SHORT_BINSTRING" in ops and "BINUNICODE" not in ops
    assert b"numpy.core.multiarray\n_reconstruct" in raw
    # The loader snippet published with CIFAR-10 reads it.
    with open(path, "rb") as f:
        batch = pickle.load(f, encoding="bytes")
    assert set(batch) == {b"batch_label", b"labels", b"data", b"filenames"}
    assert batch[b"data"].shape == (3, 3072) and batch[b"labels"] == [1, 2, 3]


def test_cifar_py_meta_class_names(tmp_path):
    write_cifar_dir(tmp_path, "py", n_batches=1)
    with open(tmp_path / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [f"n{i}".encode() for i in range(10)]}, f, protocol=2)
    assert cifar.read_classes(str(tmp_path), "py") == tuple(f"n{i}" for i in range(10))


def test_parquet_split_round_trip_multi_file(tmp_path):
    x, y = rand_images(25, 5, 4, 3), rand_labels(25, 3)
    paths = write_split(str(tmp_path / "train"), x, y, ["a", "b", "c"], rows_per_file=10)
    assert [os.path.basename(p) for p in paths] == [f"part-0000{i}.parquet" for i in range(3)]
    meta = read_meta(str(tmp_path / "train"))
    assert meta == parquet_io.DatasetMeta(5, 4, 3, ("a", "b", "c"), 25)
    images, labels = read_split_numpy(str(tmp_path / "train"))
    assert images.dtype == np.uint8 and labels.dtype == np.int32
    np.testing.assert_array_equal(images, x)
    np.testing.assert_array_equal(labels, y)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 12), h=st.integers(1, 6), w=st.integers(1, 6),
       c=st.sampled_from([1, 3]), per_file=st.integers(1, 5))
def test_parquet_round_trip_property(tmp_path_factory, n, h, w, c, per_file):
    d = str(tmp_path_factory.mktemp("p"))
    x, y = rand_images(n, h, w, c), rand_labels(n, 4)
    write_split(d, x, y, "abcd", rows_per_file=per_file)
    images, labels = read_split_numpy(d)
    np.testing.assert_array_equal(images, x)
    np.testing.assert_array_equal(labels, y)


@pytest.mark.parametrize("kind", ["binary", "fixed", "list", "large_list"])
def test_parquet_input_image_encodings(tmp_path, kind):
    x, y = rand_images(6, 3, 2, 1), np.arange(6) % 3
    rows = [r.tobytes() for r in x]
    col = {"binary": lambda: pa.array(rows, pa.binary()),
           "fixed": lambda: pa.array(rows, pa.binary(6)),
           "list": lambda: pa.array([list(r) for r in rows], pa.list_(pa.uint8())),
           "large_list": lambda: pa.array([list(r) for r in rows], pa.large_list(pa.uint8())),
           }[kind]()
    # Two row groups, so the columns arrive as several (sliced) chunks.
    pq.write_table(pa.table({"image": col, "label": pa.array(y, pa.int64())}),
                   tmp_path / "in.parquet", row_group_size=4)
    images, labels, classes = read_parquet_input(str(tmp_path), height=3, width=2, channels=1)
    np.testing.assert_array_equal(images, x)
    np.testing.assert_array_equal(labels, y)
    assert classes is None


def test_make_fake_fashion_is_learnable(tmp_path):
    synthetic.make_fake_fashion(str(tmp_path), 300, 100, seed=1)
    xtr, ytr = idx.read_idx_split(str(tmp_path), "train")
    xte, yte = idx.read_idx_split(str(tmp_path), "test")
    assert xtr.shape == (300, 28, 28, 1) and np.bincount(ytr).tolist() == [30] * 10
    centroids = np.stack([xtr[ytr == k].mean(0).ravel() for k in range(10)])
    dist = ((xte.reshape(100, -1)[:, None, :] - centroids[None]) ** 2).sum(-1)
    assert (dist.argmin(1) == yte).mean() > 0.9


# ------------------------------------------------------------------ prepare

def check_prepared(out, shape, classes, rows):
    for split, n in rows.items():
        files = sorted(os.listdir(os.path.join(out, split)))
        assert files and all(f.startswith("part-") and f.endswith(".parquet") for f in files)
        schema = pq.read_schema(os.path.join(out, split, files[0]))
        assert schema.field("image").type == pa.binary()
        assert schema.field("label").type == pa.int32()
        md = {k.decode(): v.decode() for k, v in schema.metadata.items()}
        assert [int(md[f"sparkcnn.{k}"]) for k in ("height", "width", "channels")] == list(shape)
        assert json.loads(md["sparkcnn.classes"]) == list(classes)
        assert read_meta(os.path.join(out, split)).num_rows == n


def test_prepare_idx(tmp_path):
    data = write_idx_dir(tmp_path / "src")
    summary = prepare("idx", tmp_path / "src", tmp_path / "out")
    check_prepared(tmp_path / "out", (28, 28, 1), idx.FASHION_MNIST_CLASSES, {"train": 20, "test": 10})
    assert summary["splits"]["train"]["rows"] == 20 and summary["height"] == 28
    images, labels = read_split_numpy(str(tmp_path / "out" / "test"))
    np.testing.assert_array_equal(images, data["test"][0])
    np.testing.assert_array_equal(labels, data["test"][1])
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]  # no temp dirs left


@pytest.mark.parametrize("fmt,kind", [("cifar10-bin", "bin"), ("cifar10-py", "py")])
def test_prepare_cifar(tmp_path, fmt, kind):
    data = write_cifar_dir(tmp_path / "src", kind)
    prepare(fmt, tmp_path / "src", tmp_path / "out")
    check_prepared(tmp_path / "out", (32, 32, 3), cifar.CIFAR10_CLASSES, {"train": 14, "test": 7})
    images, labels = read_split_numpy(str(tmp_path / "out" / "train"))
    np.testing.assert_array_equal(images, data["train"][0])
    np.testing.assert_array_equal(labels, data["train"][1])


def test_prepare_parquet_splits_and_reprepare(tmp_path):
    for split, n in (("train", 9), ("test", 4)):
        os.makedirs(tmp_path / "src" / split)
        x = rand_images(n, 2, 3, 1)
        pq.write_table(pa.table({"image": pa.array([r.tobytes() for r in x]),
                                 "label": pa.array(np.arange(n) % 4, pa.int16())}),
                       tmp_path / "src" / split / "a.parquet")
    s = prepare("parquet", tmp_path / "src", tmp_path / "out", height=2, width=3, channels=1)
    assert s["classes"] == ["0", "1", "2", "3"]
    check_prepared(tmp_path / "out", (2, 3, 1), "0123", {"train": 9, "test": 4})
    # A prepared dataset is valid Parquet input: metadata supplies the shape.
    prepare("parquet", tmp_path / "out", tmp_path / "again")
    assert tree_digest(tmp_path / "again").keys() == tree_digest(tmp_path / "out").keys()


def test_prepare_replaces_earlier_dataset(tmp_path):
    write_idx_dir(tmp_path / "src", n_train=5, n_test=5)
    prepare("idx", tmp_path / "src", tmp_path / "out")
    write_idx_dir(tmp_path / "src", n_train=8, n_test=5)
    prepare("idx", tmp_path / "src", tmp_path / "out")
    assert read_meta(str(tmp_path / "out" / "train")).num_rows == 8
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]


# --------------------------------------------------------------- bad inputs

def test_bad_idx_magic(tmp_path):
    p = synthetic.write_idx(str(tmp_path / "x"), np.zeros(3, np.uint8))
    with pytest.raises(BadInput, match=r"x: bad IDX magic 0x00000801, expected 0x00000803"):
        idx.read_idx_images(p)


def test_bad_idx_truncated(tmp_path):
    p = synthetic.write_idx(str(tmp_path / "x"), np.zeros((2, 4, 4), np.uint8))
    open(p, "r+b").truncate(16 + 31)
    with pytest.raises(BadInput, match=r"x: IDX data truncated: 47 bytes, header dims \(2, 4, 4\) need 48"):
        idx.read_idx_images(p)


def test_bad_idx_truncated_gzip(tmp_path):
    p = synthetic.write_idx(str(tmp_path / "x.gz"), np.zeros((2, 4, 4), np.uint8), gz=True)
    open(p, "r+b").truncate(os.path.getsize(p) - 5)
    with pytest.raises(BadInput, match=r"x\.gz: corrupt or truncated gzip data"):
        idx.read_idx_images(p)


def test_bad_idx_trailing_bytes(tmp_path):
    p = synthetic.write_idx(str(tmp_path / "x"), np.zeros(4, np.uint8))
    with open(p, "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(BadInput, match=r"x: 2 trailing bytes after IDX data"):
        idx.read_idx_labels(p)


def test_bad_idx_label_out_of_range(tmp_path):
    write_idx_dir(tmp_path, labels=np.array([0, 3, 10, 1, 2] * 4, np.uint8))
    with pytest.raises(BadInput, match=r"train-labels-idx1-ubyte\.gz: label 10 at record 2 "
                                       r"out of range \[0, 10\)"):
        prepare("idx", tmp_path, tmp_path / "out")


def test_bad_idx_count_mismatch(tmp_path):
    write_idx_dir(tmp_path)
    synthetic.write_idx(str(tmp_path / "t10k-labels-idx1-ubyte.gz"), rand_labels(9), gz=True)
    with pytest.raises(BadInput, match=r"10 images but .*t10k-labels-idx1-ubyte\.gz has 9 labels"):
        idx.read_idx_split(str(tmp_path), "test")


def test_bad_cifar_bin_length(tmp_path):
    write_cifar_dir(tmp_path, "bin", n_batches=1)
    with open(tmp_path / "data_batch_1.bin", "ab") as f:
        f.write(b"\1" * 100)
    with pytest.raises(BadInput, match=r"data_batch_1\.bin: length 21611 bytes is not a multiple "
                                       r"of the 3073-byte"):
        prepare("cifar10-bin", tmp_path, tmp_path / "out")


def test_bad_cifar_bin_label(tmp_path):
    x = rand_images(3, 32, 32, 3)
    p = synthetic.write_cifar_bin(str(tmp_path / "test_batch.bin"), x, [0, 1, 2])
    raw = bytearray(open(p, "rb").read())
    raw[2 * 3073] = 200
    open(p, "wb").write(bytes(raw))
    with pytest.raises(BadInput, match=r"test_batch\.bin: label 200 at record 2 out of range"):
        cifar.read_cifar_bin_file(p)


def test_bad_cifar_batch_missing(tmp_path):
    write_cifar_dir(tmp_path, "bin", n_batches=3)
    os.remove(tmp_path / "data_batch_2.bin")
    with pytest.raises(BadInput, match=r"data_batch_2\.bin is missing \(found batches \[1, 3\]\)"):
        cifar.read_cifar_split(str(tmp_path), "bin", "train")


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_bad_cifar_pickle_refused_without_running(tmp_path):
    marker = tmp_path / "pwned"
    write_cifar_dir(tmp_path, "py", n_batches=1)
    with open(tmp_path / "data_batch_1", "wb") as f:
        pickle.dump({b"data": _Evil(marker), b"labels": [0]}, f, protocol=2)
    with pytest.raises(BadInput, match=r"data_batch_1: refused to unpickle global "
                                       r"(posix|nt|os)\.system"):
        prepare("cifar10-py", tmp_path, tmp_path / "out")
    assert not marker.exists()
    with open(tmp_path / "test_batch", "wb") as f:
        f.write(b"\x80\x02cbuiltins\neval\nX\x04\x00\x00\x001+1\x85R.")
    with pytest.raises(BadInput, match=r"test_batch: refused to unpickle global builtins\.eval"):
        cifar.read_cifar_py_file(str(tmp_path / "test_batch"))
    assert not os.path.exists(tmp_path / "out")


def test_bad_cifar_pickle_wrong_content(tmp_path):
    with open(tmp_path / "b", "wb") as f:
        pickle.dump({b"data": np.zeros((2, 3072), np.float32), b"labels": [0, 1]}, f, protocol=2)
    with pytest.raises(BadInput, match=r"b: b'data' must be a uint8 N×3072 array, got float32"):
        cifar.read_cifar_py_file(str(tmp_path / "b"))


def _user_parquet(path, **cols):
    pq.write_table(pa.table(cols), path)
    return str(path)


def test_bad_parquet_missing_column(tmp_path):
    p = _user_parquet(tmp_path / "u.parquet", image=pa.array([b"\0" * 4]))
    with pytest.raises(BadInput, match=r"u\.parquet: missing column 'label'"):
        prepare("parquet", p, tmp_path / "out", height=2, width=2, channels=1)


def test_bad_parquet_dtype(tmp_path):
    p = _user_parquet(tmp_path / "u.parquet", image=pa.array([b"\0" * 4]), label=pa.array([1.0]))
    with pytest.raises(BadInput, match=r"u\.parquet: column 'label' has type double, "
                                       r"expected an integer type"):
        read_parquet_input(p, height=2, width=2, channels=1)
    p = _user_parquet(tmp_path / "v.parquet", image=pa.array(["abcd"]), label=pa.array([1]))
    with pytest.raises(BadInput, match=r"v\.parquet: column 'image' has type string, "
                                       r"expected binary or list<uint8>"):
        read_parquet_input(p, height=2, width=2, channels=1)


def test_bad_parquet_row_length(tmp_path):
    p = _user_parquet(tmp_path / "u.parquet", image=pa.array([b"\0" * 4, b"\0" * 4, b"\0" * 3]),
                      label=pa.array([0, 1, 1]))
    with pytest.raises(BadInput, match=r"u\.parquet: row 2: column 'image' has 3 bytes, expected 4"):
        read_parquet_input(p, height=2, width=2, channels=1)


def test_bad_parquet_shape_unknown_or_contradicted(tmp_path):
    p = _user_parquet(tmp_path / "u.parquet", image=pa.array([b"\0" * 4]), label=pa.array([0]))
    with pytest.raises(BadInput, match=r"image height/width unknown"):
        read_parquet_input(p, channels=1)
    write_split(str(tmp_path / "ds"), rand_images(2, 2, 2, 1), rand_labels(2, 2), "ab")
    with pytest.raises(BadInput, match=r"metadata sparkcnn.height=2 contradicts height=4"):
        read_parquet_input(str(tmp_path / "ds"), height=4)


def test_bad_empty_dataset(tmp_path):
    write_idx_dir(tmp_path, n_train=0)
    with pytest.raises(BadInput, match=r"empty dataset: split 'train' has no records"):
        prepare("idx", tmp_path, tmp_path / "out")


def test_bad_missing_source(tmp_path):
    with pytest.raises(BadInput, match=r"nope: source directory not found \(expected "
                                       r"train-images-idx3-ubyte\[\.gz\]"):
        prepare("idx", tmp_path / "nope", tmp_path / "out")
    with pytest.raises(BadInput, match=r"no train-images-idx3-ubyte or train-images-idx3-ubyte\.gz"):
        prepare("idx", tmp_path, tmp_path / "out")
    with pytest.raises(BadInput, match=r"no data_batch_1 … data_batch_5 found"):
        prepare("cifar10-py", tmp_path, tmp_path / "out")


def test_bad_unwritable_output(tmp_path):
    write_idx_dir(tmp_path / "src")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(BadInput, match=r"afile.ds: output directory is not writable"):
        prepare("idx", tmp_path / "src", tmp_path / "afile" / "ds")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores modes")
def test_bad_unwritable_output_mode(tmp_path):
    write_idx_dir(tmp_path / "src")
    os.mkdir(tmp_path / "ro", 0o500)
    try:
        with pytest.raises(BadInput, match=r"ro.ds: output directory is not writable"):
            prepare("idx", tmp_path / "src", tmp_path / "ro" / "ds")
    finally:
        os.chmod(tmp_path / "ro", 0o700)


def test_bad_output_not_a_dataset(tmp_path):
    write_idx_dir(tmp_path / "src")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("keep me")
    with pytest.raises(BadInput, match=r"home: refusing to replace a directory that is not a prepared"):
        prepare("idx", tmp_path / "src", tmp_path / "home")
    assert (tmp_path / "home" / "notes.txt").read_text() == "keep me"


def test_failed_prepare_leaves_earlier_dataset_intact(tmp_path, monkeypatch):
    write_idx_dir(tmp_path / "src")
    prepare("idx", tmp_path / "src", tmp_path / "out")
    before = tree_digest(tmp_path / "out")
    # 1. Bad source data: fails before anything is written.
    write_idx_dir(tmp_path / "src", labels=np.full(20, 11, np.uint8))
    with pytest.raises(BadInput, match=r"label 11 at record 0 out of range"):
        prepare("idx", tmp_path / "src", tmp_path / "out")
    assert tree_digest(tmp_path / "out") == before
    # 2. Failure half-way through writing the new dataset.
    write_idx_dir(tmp_path / "src")
    real_write = parquet_io.write_split

    def write_then_fail(out_dir, *a, **k):
        real_write(out_dir, *a, **k)
        if out_dir.endswith("test"):
            raise OSError(28, "No space left on device")
    monkeypatch.setattr(parquet_io, "write_split", write_then_fail)
    with pytest.raises(OSError, match="No space left"):
        prepare("idx", tmp_path / "src", tmp_path / "out")
    monkeypatch.undo()
    assert tree_digest(tmp_path / "out") == before
    # 3. The final rename fails: the old dataset is moved back.
    real_rename = os.rename

    def rename(src, dst):
        if ".tmp-" in os.fspath(src):
            raise OSError(18, "Invalid cross-device link")
        real_rename(src, dst)
    monkeypatch.setattr(prepare_mod.os, "rename", rename)
    with pytest.raises(OSError, match="cross-device"):
        prepare("idx", tmp_path / "src", tmp_path / "out")
    monkeypatch.undo()
    assert tree_digest(tmp_path / "out") == before
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]


FASHION_MNIST = "/usr/share/datasets/fashion-mnist"  # Debian package dataset-fashion-mnist


@pytest.mark.skipif(not os.path.isdir(FASHION_MNIST), reason="dataset-fashion-mnist not installed")
def test_real_fashion_mnist_if_installed():
    images, labels = idx.read_idx_split(FASHION_MNIST, "test")
    assert images.shape == (10000, 28, 28, 1)
    assert np.bincount(labels).tolist() == [1000] * 10


def test_write_split_empty_keeps_schema(tmp_path):
    write_split(str(tmp_path), np.zeros((0, 2, 2, 1), np.uint8), np.zeros(0, np.int32), "ab")
    assert read_meta(str(tmp_path)) == parquet_io.DatasetMeta(2, 2, 1, ("a", "b"), 0)
    images, labels = read_split_numpy(str(tmp_path))
    assert images.shape == (0, 2, 2, 1) and labels.shape == (0,)


def test_check_labels_names_file_record_and_label():
    from sparkcnn.data.labels import check_labels

    out = check_labels("x.bin", np.array([0, 9, 3], np.int64), 10)
    assert out.dtype == np.int32 and out.tolist() == [0, 9, 3]
    with pytest.raises(BadInput, match=r"^x\.bin: label -1 at record 1 out of range \[0, 10\)$"):
        check_labels("x.bin", np.array([2, -1, 12]), 10)
    with pytest.raises(BadInput, match=r"^src \(split 'test'\): label 3 at record 0 out of range \[0, 3\)$"):
        check_labels("src (split 'test')", np.array([3], np.uint8), 3)
