"""Each array's zarr.json is checked against metadata.json before anything is read through it
(``storage/array_metadata.check_metadata``): in both layouts (inside the OCDBT database and as
plain files), with direct reads on and off, for tensor shards and pack arrays, a changed field is a
FormatError naming the key on ``load`` and a problem naming it in ``validate``, never wrong values.
The zarr.json forms of older writers (formats 1-4) still load."""

import hashlib
import json
import os
import shutil

import pytest
import tensorstore as ts
import torch

import lightning_distckpt as ldc
from lightning_distckpt import validate
from lightning_distckpt.storage.layout import COMMIT_MARKER, METADATA_FILE, rank_dir
from lightning_distckpt.storage.tensorstore_io import TensorStoreIO
from lightning_distckpt.storage.ts_context import child_context
from lightning_distckpt.reading.checkpoint import OpenedCheckpoint
from dist_utils import run_distributed

G = torch.Generator().manual_seed(0)
W = torch.randn(300, 64, generator=G)  # 75 KiB: its own array, 5 chunks of 60 rows
B, N = torch.randn(10, generator=G), torch.randn(6, generator=G)  # packed: p/float32 holds b at 0, n at 10
OPTIONS = dict(chunk_bytes=16384, pack_max_bytes=4096)


def state(w=W, b=B, n=N):
    return {k: ldc.ShardedTensor.from_rank_offsets(k, v.clone()) for k, v in (("w", w), ("b", b), ("n", n))}


def template():
    return state(torch.zeros_like(W), torch.zeros_like(B), torch.zeros_like(N))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("zarr_json")
    for layout in ("ocdbt", "zarr"):
        ldc.save(state(), root / layout, storage=ldc.StorageOptions(layout=layout, **OPTIONS))
    return root


def edit_zarr_json(ck, array_path, edit, writer=0):
    """Replace the zarr.json of ``array_path`` in ``writer``'s store by ``edit(metadata)`` (bytes or
    a JSON value), in either layout: inside the OCDBT database through tensorstore's kvstore."""
    store = rank_dir(str(ck), writer)
    key = f"{array_path}/zarr.json"
    ocdbt = os.path.exists(os.path.join(store, "manifest.ocdbt"))
    if ocdbt:
        kv = ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "file", "path": store + "/"}}).result()
        meta = json.loads(bytes(kv.read(key).result().value))
    else:
        meta = json.load(open(os.path.join(store, key)))
    new = edit(meta)
    raw = new if isinstance(new, bytes) else json.dumps(new).encode()
    if ocdbt:
        kv.write(key, raw).result()
    else:
        with open(os.path.join(store, key), "wb") as f:
            f.write(raw)


def _set(path, value):
    def edit(m):
        node = m
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value
        return m
    return edit


def _grow_dims(m):
    m["shape"].append(1)
    m["chunk_grid"]["configuration"]["chunk_shape"].append(1)
    return m


def _flatten(m):
    m["shape"] = [m["shape"][0] * m["shape"][1]]
    m["chunk_grid"]["configuration"]["chunk_shape"] = [m["chunk_grid"]["configuration"]["chunk_shape"][0] * 64]
    return m


def _append_codec(m):
    m["codecs"].append({"name": "gzip", "configuration": {"level": 1}})
    return m


TENSOR_EDITS = {  # name -> (edit of w's zarr.json, the field the error names)
    "shape digit": (_set(["shape", 0], 100), "shape"),
    "shape larger": (_set(["shape", 0], 900), "shape"),
    "trailing shape": (_set(["shape", 1], 32), "shape"),
    "shape as floats": (_set(["shape"], [300.0, 64.0]), "shape"),
    "one more dimension": (_grow_dims, "shape"),
    "one dimension fewer": (_flatten, "shape"),
    "data_type int32": (_set(["data_type"], "int32"), "data_type"),
    "data_type float64": (_set(["data_type"], "float64"), "data_type"),
    "chunk rows": (_set(["chunk_grid", "configuration", "chunk_shape", 0], 30), "crc32c is malformed"),
    "chunk rows beyond the shape": (_set(["chunk_grid", "configuration", "chunk_shape", 0], 600), "chunk_grid"),
    "chunk columns": (_set(["chunk_grid", "configuration", "chunk_shape", 1], 32), "chunk_grid"),
    "chunk grid name": (_set(["chunk_grid", "name"], "rectangular"), "chunk_grid"),
    "big endian": (_set(["codecs", 0, "configuration", "endian"], "big"), "codecs"),
    "another codec": (_append_codec, "codecs"),
    "transposed": (_set(["codecs"], [{"name": "transpose", "configuration": {"order": [1, 0]}},
                                     {"name": "bytes", "configuration": {"endian": "little"}}]), "codecs"),
    "fill_value": (_set(["fill_value"], 1.5), "fill_value"),
    "chunk_key_encoding": (_set(["chunk_key_encoding"], {"name": "v2", "configuration": {"separator": "."}}),
                           "chunk_key_encoding"),
    "zarr_format": (_set(["zarr_format"], 2), "zarr_format"),
    "an unknown field": (_set(["storage_transformers"], []), "storage_transformers"),
    "another attribute": (_set(["attributes", "other"], 1), "attributes"),
}
PACK_EDITS = {  # of p/float32, which holds b (elements 0-9) and n (10-15)
    "shape too short": (_set(["shape", 0], 12), "shape"),
    "one more dimension": (_grow_dims, "shape"),
    "data_type int32": (_set(["data_type"], "int32"), "data_type"),
    "chunk rows beyond the shape": (_set(["chunk_grid", "configuration", "chunk_shape", 0], 17), "chunk_grid"),
    "big endian": (_set(["codecs", 0, "configuration", "endian"], "big"), "codecs"),
    "no checksums": (lambda m: {**m, "codecs": m["codecs"][:1]}, "checksums"),
    "fill_value": (_set(["fill_value"], 0), "fill_value"),
}


def _damaged(saved, tmp_path, layout, array_path, edit):
    ck = tmp_path / "ck"
    shutil.copytree(saved / layout, ck)
    edit_zarr_json(ck, array_path, edit)
    return ck


def _assert_refused(ck, names, field):
    with pytest.raises(ldc.FormatError, match="zarr.json") as e:
        ldc.load(template(), ck)
    assert all(repr(k) in str(e.value) for k in names) and field in str(e.value), str(e.value)
    report = validate(str(ck))  # each key read through the array is named
    assert not report.ok and all(any(repr(k) in p and field in p for p in report.problems) for k in names), \
        report.problems


@pytest.mark.parametrize("direct", ["1", "0"])
@pytest.mark.parametrize("layout", ["ocdbt", "zarr"])
@pytest.mark.parametrize("name", sorted(TENSOR_EDITS))
def test_a_changed_field_of_a_shard_s_zarr_json_is_refused(saved, tmp_path, monkeypatch, layout, direct, name):
    monkeypatch.setenv("LIGHTNING_DISTCKPT_DIRECT_READS", direct)
    edit, field = TENSOR_EDITS[name]
    _assert_refused(_damaged(saved, tmp_path, layout, "t/w/0", edit), ["w"], field)


@pytest.mark.parametrize("direct", ["1", "0"])
@pytest.mark.parametrize("layout", ["ocdbt", "zarr"])
@pytest.mark.parametrize("name", sorted(PACK_EDITS))
def test_a_changed_field_of_a_pack_s_zarr_json_is_refused(saved, tmp_path, monkeypatch, layout, direct, name):
    monkeypatch.setenv("LIGHTNING_DISTCKPT_DIRECT_READS", direct)
    edit, field = PACK_EDITS[name]
    _assert_refused(_damaged(saved, tmp_path, layout, "p/float32", edit), ["b", "n"], field)


@pytest.mark.parametrize("layout", ["ocdbt", "zarr"])
def test_undamaged_checkpoints_load_exactly_and_validate(saved, layout):
    out = ldc.load(template(), saved / layout)
    assert all(torch.equal(out[k], v) for k, v in (("w", W), ("b", B), ("n", N)))
    assert validate(str(saved / layout)).ok


def test_a_pack_opened_for_one_shard_must_hold_the_next(saved, tmp_path):
    """A pack cut to hold b only: opening it for b passes, then n (past its end) is refused by name."""
    grid = {"name": "regular", "configuration": {"chunk_shape": [10]}}
    ck = _damaged(saved, tmp_path, "ocdbt", "p/float32", lambda m: {**m, "shape": [10], "chunk_grid": grid})
    opened = OpenedCheckpoint.open(str(ck))
    tio = TensorStoreIO(opened.path, opened.options, opened.index)
    assert tio.open_array(0, "b", 0).shape == (10,)
    with pytest.raises(ldc.FormatError, match=r"'n'.*holds 10 elements, fewer than the 16"):
        tio.open_array(0, "n", 0)


def _rewrite_metadata(ck, change, marker_fields=None):
    """Change metadata.json and keep the commit marker's checksum of it consistent (or, with
    ``marker_fields``, keep only those marker fields, as a format 1-2 marker)."""
    meta_path, marker_path = os.path.join(ck, METADATA_FILE), os.path.join(ck, COMMIT_MARKER)
    meta = json.load(open(meta_path))
    change(meta)
    raw = json.dumps(meta).encode()
    open(meta_path, "wb").write(raw)
    marker = json.load(open(marker_path))
    marker["metadata_sha256"] = hashlib.sha256(raw).hexdigest()
    if marker_fields is not None:
        marker = {k: marker[k] for k in marker_fields}
    json.dump(marker, open(marker_path, "w"))


def _save_as_format(path, version, layout, monkeypatch):
    """A checkpoint whose arrays' zarr.json are as format ``version`` wrote them: formats 1-2 plain
    bytes, no checksums (format 1 packed nothing); formats 3-4 the crc32c codec on every array."""
    with monkeypatch.context() as mp:
        mp.setattr(TensorStoreIO, "own_checksums", lambda self, arr, chunk_bytes=None: False)
        mp.setattr(TensorStoreIO, "token", property(lambda self: None))  # no save token before format 7
        if version <= 2:
            create = TensorStoreIO.create_spec

            def plain(self, *args, **kwargs):
                spec = create(self, *args, **kwargs)
                spec["metadata"]["codecs"] = [c for c in spec["metadata"]["codecs"] if c["name"] != "crc32c"]
                return spec
            mp.setattr(TensorStoreIO, "create_spec", plain)
        options = {**OPTIONS, "pack_max_bytes": 0} if version == 1 else OPTIONS
        ldc.save(state(), path, storage=ldc.StorageOptions(layout=layout, **options))
    _rewrite_metadata(str(path), lambda m: m.update(format_version=version),
                      ("bytes", "world_size") if version <= 2 else None)


@pytest.mark.parametrize("layout", ["ocdbt", "zarr"])
@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_older_formats_zarr_json_forms_still_load(tmp_path, monkeypatch, version, layout):
    _save_as_format(tmp_path / "old", version, layout, monkeypatch)
    store = rank_dir(str(tmp_path / "old"), 0)
    if layout == "zarr":  # the form that format wrote
        codecs = json.load(open(os.path.join(store, "t", "w", "0", "zarr.json")))["codecs"]
        assert [c["name"] for c in codecs] == (["bytes"] if version <= 2 else ["bytes", "crc32c"])
    for direct in ("1", "0"):
        monkeypatch.setenv("LIGHTNING_DISTCKPT_DIRECT_READS", direct)
        out = ldc.load(template(), tmp_path / "old")
        assert all(torch.equal(out[k], v) for k, v in (("w", W), ("b", B), ("n", N)))
    assert validate(str(tmp_path / "old")).ok
    # and the check holds for them too
    edit_zarr_json(tmp_path / "old", "t/w/0", _set(["shape", 0], 100))
    with pytest.raises(ldc.FormatError, match=r"'w' shard 0 .*zarr.json field 'shape'"):
        ldc.load(template(), tmp_path / "old")


def _save_even(rank, world, path):
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", W.chunk(world)[rank].clone(), (0, rank, world))}, path,
             storage=ldc.StorageOptions(**OPTIONS))


def test_an_even_split_s_shards_are_checked_by_their_chunk(tmp_path):
    """Format 4's even entries: the shard of rank i is chunk i of the split."""
    run_distributed(_save_even, 2, str(tmp_path / "ck"))
    assert "even" in json.load(open(tmp_path / "ck" / METADATA_FILE))["tensors"]["w"]
    whole = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros_like(W))}
    assert torch.equal(ldc.load(whole, tmp_path / "ck")["w"], W)
    edit_zarr_json(tmp_path / "ck", "t/w/1", _set(["shape", 0], 15), writer=1)
    with pytest.raises(ldc.FormatError, match=r"'w' shard 1 \(written by rank 1\).*'shape' is \[15, 64\], "
                                              r"not \[150, 64\]"):
        ldc.load(whole, tmp_path / "ck")


def test_two_records_of_one_stored_array_are_refused(tmp_path):
    """A hostile index placing one stored array at two places of a tensor (the second would read
    the first's rows as its own) is refused when the array is opened. (Its store holds the bytes it
    claims: those of a tensor the index no longer lists.)"""
    ck = tmp_path / "ck"
    ldc.save({k: ldc.ShardedTensor.from_rank_offsets(k, W.clone()) for k in ("w", "x")}, ck,
             storage=ldc.StorageOptions(**OPTIONS))

    def two(meta):
        del meta["tensors"]["x"]
        meta["tensors"]["w"]["global_shape"] = [300, 128]
        meta["tensors"]["w"]["shards"].append({**meta["tensors"]["w"]["shards"][0], "offset": [0, 64]})
    _rewrite_metadata(str(ck), two)
    with pytest.raises(ldc.FormatError, match=r"two shards of 'w' stored as shard 0 of rank 0"):
        ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(300, 128))}, ck)


@pytest.fixture(scope="module")
def s3_endpoint():
    pytest.importorskip("boto3")
    moto_server = pytest.importorskip("moto.server")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()  # returns once the socket listens
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.mark.parametrize("array_path,names,edit,field", [
    ("t/w/0", ["w"], _set(["shape", 0], 100), "shape"),
    ("p/float32", ["b", "n"], _set(["data_type"], "int32"), "data_type"),
])
def test_s3_checkpoints_check_their_zarr_json_too(s3_endpoint, monkeypatch, array_path, names, edit, field):
    import uuid

    import boto3
    from lightning_distckpt.storage.s3_url import context_spec, kvstore_spec

    for name, value in (("AWS_ENDPOINT_URL", s3_endpoint), ("AWS_ACCESS_KEY_ID", "testing"),
                        ("AWS_SECRET_ACCESS_KEY", "testing"), ("AWS_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    url, options = f"s3://{bucket}/ck", ldc.StorageOptions(**OPTIONS)
    ldc.save(state(), url, storage=options)
    version = json.loads(client.get_object(Bucket=bucket, Key="ck/COMMITTED")["Body"].read())["version"]
    base = kvstore_spec(f"{url}/{version}/data/rank_00000", options)
    kv = ts.KvStore.open({"driver": "ocdbt", "base": base}, context=child_context(context_spec(options))).result()
    meta = json.loads(bytes(kv.read(f"{array_path}/zarr.json").result().value))
    kv.write(f"{array_path}/zarr.json", json.dumps(edit(meta)).encode()).result()
    with pytest.raises(ldc.FormatError, match="zarr.json") as e:
        ldc.load(template(), url)
    assert all(repr(k) in str(e.value) for k in names) and field in str(e.value), str(e.value)
