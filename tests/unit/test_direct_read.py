"""Direct chunk reads (storage/direct_read.py): whole chunks read from the data files into the
destinations, CRC-32C verified, give exactly what tensorstore's reads give, in every layout and
split, and refuse damage with an error naming the chunk and the file."""

import json
import os
import shutil
import threading

import pytest
import tensorstore as ts
import torch

import lightning_distckpt as ldc
from lightning_distckpt.storage.direct_read import ChunkLocation, ChunkTask, DirectReader, geometry, ocdbt_locations
from lightning_distckpt import validate
from lightning_distckpt.storage.layout import rank_dir
from lightning_distckpt.storage.tensorstore_io import TensorStoreIO

# 1015 rows of 10 float32 (40 bytes) in 4 KiB chunks: 10 chunks of 102 rows (as even as they go), the
# last one padded with 5 rows
W = torch.randn(1015, 10, generator=torch.Generator().manual_seed(0))
B = torch.randn(700, 33, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)


def _save(path, layout):
    sd = {"w": ldc.ShardedTensor.from_rank_offsets("w", W.clone()),
          "b": ldc.ShardedTensor.from_rank_offsets("b", B.clone())}
    ldc.save(sd, path, storage=ldc.StorageOptions(layout=layout, chunk_bytes=4096, pack_max_bytes=0))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each layout as saved now (chunk checksums in each array's zarr.json), and as formats 3-4
    saved it ("-codec": each chunk followed by its CRC-32C, the zarr ``crc32c`` codec)."""
    root = tmp_path_factory.mktemp("direct")
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        for codec in (False, True):
            if codec:
                mp.setattr(TensorStoreIO, "own_checksums", lambda self, arr, chunk_bytes=None: False)
            for layout in ("ocdbt", "zarr"):
                out[layout + ("-codec" if codec else "")] = str(root / (layout + ("-codec" if codec else "")))
                _save(out[layout + ("-codec" if codec else "")], layout)
    return out


def _w_geometry(ck):
    spec = {"driver": "ocdbt", "base": {"driver": "file", "path": rank_dir(ck, 0) + "/"}}
    metadata = json.loads(ts.KvStore.open(spec).result().read("t/w/0/zarr.json").result().value)
    return geometry(metadata)


def test_chunks_carry_their_checksums_in_zarr_json_or_after_each_chunk(saved):
    now, codec = _w_geometry(saved["ocdbt"]), _w_geometry(saved["ocdbt-codec"])
    assert now.crcs is not None and len(now.crcs) == 10 and not now.checksum and now.chunk_bytes == 102 * 40
    assert codec.crcs is None and codec.checksum and codec.chunk_bytes == 102 * 40 + 4


def _pieces():
    """Templates covering whole chunks, parts of chunks, padded edge chunks and column slices."""
    yield "whole", {"w": (W, (0, 0)), "b": (B, (0, 0))}
    yield "rows", {"w": (W[102:306], (102, 0)), "b": (B[5:699], (5, 0))}       # chunk-aligned / ragged
    yield "cols", {"w": (W[50:1005, 3:7], (50, 3)), "b": (B[:, 10:11], (0, 10))}
    yield "edge", {"w": (W[918:], (918, 0)), "b": (B[-1:], (699, 0))}         # the padded last chunk


@pytest.mark.parametrize("layout", ["ocdbt", "zarr", "ocdbt-codec", "zarr-codec"])
@pytest.mark.parametrize("direct", ["1", "0"])
def test_direct_reads_match_tensorstore_in_every_split(saved, layout, direct, monkeypatch):
    monkeypatch.setenv("LIGHTNING_DISTCKPT_DIRECT_READS", direct)
    for name, pieces in _pieces():
        sd = {k: ldc.ShardedTensor.from_offsets(k, torch.zeros_like(v), (W if k == "w" else B).shape, off)
              for k, (v, off) in pieces.items()}
        out = ldc.load(sd, saved[layout])
        for k, (v, _) in pieces.items():
            assert torch.equal(out[k], v), (name, k)


def test_the_ocdbt_index_lists_every_chunk_of_the_store(saved):
    locations = ocdbt_locations(rank_dir(saved["ocdbt"], 0))
    assert locations is not None
    w_chunks = sorted(k for k in locations if k.startswith("t/w/0/c/"))
    assert len(w_chunks) == 10  # ceil(1015 / 102)
    for loc in locations.values():
        assert os.path.getsize(loc.path) >= loc.offset + loc.length


def test_a_truncated_data_file_is_an_error_naming_it(saved, tmp_path):
    """(A load refuses a store smaller than metadata.json claims before reading; this is the read's
    own check, for a file cut after that check.)"""
    loc = ocdbt_locations(rank_dir(saved["ocdbt"], 0))["t/w/0/c/3/0"]
    cut = str(tmp_path / "cut")
    with open(loc.path, "rb") as f:
        open(cut, "wb").write(f.read()[:loc.offset + loc.length - 8])
    geo = _w_geometry(saved["ocdbt"])
    dest = torch.zeros(102, 10)
    task = ChunkTask("'w' chunk 3", ChunkLocation(cut, loc.offset, loc.length), geo, slice(0, 102),
                     (slice(0, 10),), dest, True, 3)
    nbytes, errors = DirectReader(2).run([task])
    assert nbytes == 0 and len(errors) == 1 and "truncated" in errors[0] and cut in errors[0], errors
    task = task._replace(loc=loc)  # the intact file: exact
    assert DirectReader(2).run([task]) == (dest.numel() * 4, []) and torch.equal(dest, W[306:408])


def test_a_deleted_chunk_file_is_missing_not_zeros(saved, tmp_path):
    ck = str(tmp_path / "ck")
    shutil.copytree(saved["zarr"], ck)
    os.remove(os.path.join(rank_dir(ck, 0), "t", "w", "0", "c", "2", "0"))
    # the store now holds fewer bytes than metadata.json claims, or (with padding to spare) the chunk is missing
    with pytest.raises(ldc.CheckpointingError, match="missing|lost data"):
        ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros_like(W))}, ck)


@pytest.mark.parametrize("layout", ["zarr", "zarr-codec"])
def test_a_flipped_byte_in_the_padding_of_an_edge_chunk_is_caught(saved, layout, tmp_path):
    """The padding of the last chunk is read into scratch and is part of the checksum."""
    ck = str(tmp_path / "ck")
    shutil.copytree(saved[layout], ck)
    path = os.path.join(rank_dir(ck, 0), "t", "w", "0", "c", "9", "0")
    data = bytearray(open(path, "rb").read())
    data[-10] ^= 1  # padding rows come last (before the 4-byte checksum with the codec)
    open(path, "wb").write(bytes(data))
    with pytest.raises(ldc.CheckpointingError, match="checksum mismatch"):
        ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros_like(W))}, ck)


def test_scratch_buffers_stay_within_their_budget(saved):
    """Chunks read in part (a column slice of every chunk) go through scratch buffers: with a
    budget of one chunk, four threads still deliver every chunk, one scratch buffer at a time."""
    locations = ocdbt_locations(rank_dir(saved["ocdbt"], 0))
    geo = _w_geometry(saved["ocdbt"])
    dest = torch.zeros(1015, 3)
    tasks = [ChunkTask(f"'w' chunk {c}", locations[f"t/w/0/c/{c}/0"], geo, slice(0, min(102, 1015 - c * 102)),
                       (slice(2, 5),), dest[c * 102:(c + 1) * 102], False, c) for c in range(10)]
    reader = DirectReader(4, scratch_bytes=geo.chunk_bytes)
    nbytes, errors = reader.run(tasks)
    assert errors == [] and nbytes == dest.numel() * 4 and torch.equal(dest, W[:, 2:5])
    assert reader.budget.peak == geo.chunk_bytes


def test_checksums_in_zarr_json_are_the_crc32c_codec_s_of_the_same_chunks(saved):
    """Format 5 records, per chunk, exactly the CRC-32C the zarr codec appended in formats 3-4."""
    crcs = _w_geometry(saved["ocdbt"]).crcs
    for c in range(10):
        path = os.path.join(rank_dir(saved["zarr-codec"], 0), "t", "w", "0", "c", str(c), "0")
        assert int.from_bytes(open(path, "rb").read()[-4:], "little") == crcs[c]


def _edit_zarr_json(ck, edit):
    path = os.path.join(rank_dir(ck, 0), "t", "w", "0", "zarr.json")
    meta = json.load(open(path))
    edit(meta)
    json.dump(meta, open(path, "w"))


@pytest.mark.parametrize("direct", ["1", "0"])
@pytest.mark.parametrize("edit,message", [
    (lambda m: m["attributes"].clear(), "stored without checksums"),
    (lambda m: m["attributes"]["lightning_distckpt"]["crc32c"].__setitem__(4, 7), "checksum mismatch.*zarr.json"),
    (lambda m: m["attributes"]["lightning_distckpt"].__setitem__("crc32c", "lots"), "malformed"),
    (lambda m: m["attributes"]["lightning_distckpt"]["crc32c"].pop(), "malformed"),
])
def test_changed_checksums_in_zarr_json_are_refused(saved, tmp_path, monkeypatch, direct, edit, message):
    monkeypatch.setenv("LIGHTNING_DISTCKPT_DIRECT_READS", direct)
    ck = str(tmp_path / "ck")
    shutil.copytree(saved["zarr"], ck)
    _edit_zarr_json(ck, edit)
    with pytest.raises(ldc.CheckpointingError, match=message):
        ldc.load({"w": ldc.ShardedTensor.from_offsets("w", torch.zeros(300, 10), (1015, 10), (400, 0))}, ck)
    assert not validate(ck).ok


@pytest.mark.parametrize("layout", ["ocdbt", "ocdbt-codec"])
def test_a_cast_on_load_reads_directly_and_rounds_as_torch_does(saved, layout):
    sd = {"w": ldc.ShardedTensor.from_offsets("w", torch.zeros(500, 4, dtype=torch.bfloat16), (1015, 10), (100, 3)),
          "b": ldc.ShardedTensor.from_rank_offsets("b", torch.zeros(700, 33, dtype=torch.float32))}
    out = ldc.load(sd, saved[layout])
    assert torch.equal(out["w"], W[100:600, 3:7].to(torch.bfloat16)) and torch.equal(out["b"], B.float())


EDGE = {"scalar": torch.tensor(3.5), "bool": torch.rand(1000, 7, generator=torch.Generator().manual_seed(2)) > 0.5,
        "empty": torch.zeros(0, 5), "no_columns": torch.zeros(5, 0), "i64": torch.arange(5000).view(100, 50),
        "u8": torch.arange(3000, dtype=torch.int32).to(torch.uint8)}


@pytest.mark.parametrize("layout", ["ocdbt", "zarr"])
@pytest.mark.parametrize("direct", ["1", "0"])
def test_every_shape_and_dtype_round_trips_with_checksums_in_zarr_json(tmp_path, monkeypatch, layout, direct):
    """0-d arrays (never read directly), empty ones (the codec), bool, integers; whole and in part."""
    monkeypatch.setenv("LIGHTNING_DISTCKPT_DIRECT_READS", direct)
    ck = str(tmp_path / "ck")
    ldc.save({k: ldc.ShardedTensor.from_rank_offsets(k, v.clone()) for k, v in EDGE.items()}, ck,
             storage=ldc.StorageOptions(layout=layout, chunk_bytes=4096, pack_max_bytes=0))
    out = ldc.load({k: ldc.ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in EDGE.items()}, ck)
    assert all(torch.equal(out[k], v) for k, v in EDGE.items())
    part = ldc.load({"bool": ldc.ShardedTensor.from_offsets("bool", torch.zeros(10, 7, dtype=torch.bool), (1000, 7),
                                                             (990, 0))}, ck)
    assert torch.equal(part["bool"], EDGE["bool"][990:]) and validate(ck).ok
    if layout == "zarr":  # the 0-d array's one chunk, damaged: caught on the path tensorstore reads
        path = os.path.join(rank_dir(ck, 0), "t", "scalar", "0", "c")
        data = bytearray(open(path, "rb").read())
        data[0] ^= 1
        open(path, "wb").write(bytes(data))
        with pytest.raises(ldc.CheckpointingError, match="checksum mismatch"):
            ldc.load({"scalar": ldc.ShardedTensor.from_rank_offsets("scalar", torch.zeros(()))}, ck)
        assert any("checksum mismatch" in p for p in validate(ck).problems)


def test_loads_leave_no_objects_behind(tmp_path):
    """tensorstore's Spec.to_json() leaks every nested list and dict it returns (about a dozen per
    array); readers take each array's metadata from the zarr.json they read instead."""
    import gc

    tensors = {f"t{i}": torch.randn(64, 8) for i in range(40)}
    ldc.save({k: ldc.ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}, str(tmp_path / "ck"),
             storage=ldc.StorageOptions(pack_max_bytes=0))

    def load_and_count():
        dest = {k: ldc.ShardedTensor.from_rank_offsets(k, torch.empty(64, 8)) for k in tensors}
        ldc.load(dest, str(tmp_path / "ck"))
        assert all(torch.equal(dest[k].data, v) for k, v in tensors.items())
        del dest
        gc.collect()
        return len(gc.get_objects())

    load_and_count()
    before = load_and_count()
    for _ in range(3):
        after = load_and_count()
    # About 8 per load remain (not per array); the leak left about 12 per array per load (2,070 here)
    assert after - before < 200, f"{after - before} objects left behind by 3 loads of 40 arrays"


def test_prefetch_asks_for_each_arrays_zarr_json_first_then_its_chunks_up_to_the_limit(saved, monkeypatch):
    """A cold load starts the device on what it is about to read whole (storage/chunk_reads.py:
    advise_willneed) before reading the arrays' metadata: their zarr.json first, then chunks, at
    most ``limit`` bytes of them. The ranges asked for are recorded instead of advised here."""
    from lightning_distckpt.storage import direct_read
    asked = []
    monkeypatch.setattr(direct_read, "advise_willneed", asked.extend)
    chunks = direct_read.DirectChunks(lambda w: rank_dir(saved["ocdbt"], w), "ocdbt", 2, lambda w, p: {})
    locations = ocdbt_locations(rank_dir(saved["ocdbt"], 0))
    chunk_bytes = locations["t/w/0/c/0/0"].length
    chunks.prefetch([(0, "t/w/0"), (0, "t/b/0")], limit=3 * chunk_bytes)
    assert asked[:2] == [locations["t/w/0/zarr.json"], locations["t/b/0/zarr.json"]]
    assert set(asked[2:]) <= {loc for key, loc in locations.items() if key.startswith("t/w/0/c/")}
    assert len(asked[2:]) == 3  # the limit: 3 chunks of 'w', none of 'b'


def test_loads_read_on_kept_threads_and_start_none_of_their_own(saved):
    """A load's chunk reads (and its readahead hints) run on threads kept between loads
    (storage/chunk_reads.py): the second and third loads start none, the reads still land exactly,
    and the kept threads are daemons with a stop() (Lightning's convention for threads a test leaves
    behind)."""
    started = []
    real_start = threading.Thread.start

    def counting_start(self):
        started.append(self.name)
        return real_start(self)

    def load_whole():
        sd = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros_like(W)),
              "b": ldc.ShardedTensor.from_rank_offsets("b", torch.zeros_like(B))}
        out = ldc.load(sd, saved["ocdbt"])
        assert torch.equal(out["w"], W) and torch.equal(out["b"], B)

    load_whole()  # the threads exist after a first load
    readers = [t for t in threading.enumerate() if t.name.startswith("ldc-direct-read")]
    assert readers and all(t.daemon and callable(getattr(t, "stop", None)) for t in readers)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(threading.Thread, "start", counting_start)
        load_whole()
        load_whole()
    assert not [n for n in started if n.startswith(("ldc-direct-read", "ldc-prefetch"))], started
    assert {t.ident for t in readers} <= {t.ident for t in threading.enumerate()}
