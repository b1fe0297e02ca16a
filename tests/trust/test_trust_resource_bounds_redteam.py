"""Hostile files that make a reader allocate, parse, hash or map far more than they are worth: each is
refused with a FormatError naming the file before it costs more than a small multiple of its bytes,
and never crashes or hangs the process.

* JSON (storage/json_bounds.py): the parse estimate is an upper bound of what ``json.loads`` takes
  (tracemalloc) for keys that are all new, one character outside the BMP (the whole text decoded 4
  bytes a character), escapes, and with an ``object_pairs_hook``; a ``metadata.json`` padded with new
  keys is refused before parsing; the share of memory is per local process (``LOCAL_WORLD_SIZE``).
* ``zarr.json``: padded with ``[],`` (22 bytes a byte once parsed), as a file (zarr layout) and as an
  OCDBT value, is refused before it is read whole (a cap from the array's chunk count).
* safetensors: the CRC map in ``__metadata__`` of empty lists is refused before parsing; a file cut
  short while open is a FormatError, not SIGBUS (it is read with ``pread``, never memory-mapped); a
  file with bytes past its tensors is refused as safetensors' own reader refuses it.
* pickles (storage/pickle_scan.py): a dict key of 1-tuples nested 200,000 deep (a torch file, a
  checkpoint's ``common.pt``, a DCP ``.metadata``) crashed the process with SIGSEGV in ``hash``; a key
  of shared tuples 40 deep hashed 2**40 items; DCP ``.metadata`` fields of shared lists 40 deep were
  ``repr``-ed whole into the error message; chunk lists shared by many tensors were walked once per
  tensor; declared lengths past a short pickle's end allocate nothing (found sound); a ShardedObject
  value in an OCDBT store past the common-state cap is refused unread.
* an export's ``config.json`` nested 100,000 deep was a RecursionError leaking out of planning.

Each hostile read runs in a subprocess under an address-space limit that reports its peak resident
memory growth (``ru_maxrss``); a hang guard of 120 s (never reached when the check works) turns a
hang into a failure.
"""

import hashlib
import io
import json
import os
import pickle
import resource
import shutil
import struct
import subprocess
import sys
import tracemalloc

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import CheckpointingError, FormatError

GROWTH_MB = 150  # the most a hostile read of a few MB may add to the process's peak
HANG_S = 120
_LIMIT_AS = 6 << 30

_RUNNER = r"""
import json, os, resource, sys
import torch, tensorstore, safetensors, omegaconf, torch.distributed.checkpoint  # imported before measuring
import lightning_distckpt as ldc
from lightning_distckpt.reading.formats.files import SafetensorsFile
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
reports = []
for op, arg in zip(sys.argv[1::2], sys.argv[2::2]):
    out = {"error": None, "message": ""}
    try:
        if op == "load":
            ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(4096))}, arg)
        elif op == "plain":
            ldc.load_plain_tensors(arg)
        elif op == "common":
            ldc.load_common_state_dict(arg)
        elif op == "metadata":
            ldc.load_tensors_metadata(arg)
        elif op == "cut":  # a safetensors file cut short after it was opened, before its tensor is read
            f = SafetensorsFile(arg)
            os.truncate(arg, 200)
            float(f.read(f.names()[0], ()).sum())  # every byte of it used, as a load copies it
    except BaseException as e:
        out["error"], out["message"] = type(e).__name__, str(e)[:3000]
    out["growth_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base  # the peak so far
    reports.append(out)
print(json.dumps(reports))
"""


def _limited():
    resource.setrlimit(resource.RLIMIT_AS, (_LIMIT_AS, _LIMIT_AS))


def _reads(*cases):
    """Each ``(op, path)`` of ``cases`` in turn in one fresh process: their reports, each with the
    process's peak growth so far (a crash or a hang fails the test)."""
    argv = [str(x) for case in cases for x in case]
    try:
        res = subprocess.run([sys.executable, "-c", _RUNNER] + argv, capture_output=True, text=True, timeout=HANG_S,
                             preexec_fn=_limited)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{argv}: no answer within {HANG_S} s (a hang)")
    assert res.returncode == 0, f"{argv}: the process died (code {res.returncode}): {res.stderr[-2000:]}"
    return json.loads(res.stdout.strip().splitlines()[-1])


def _refused(op, path, *needles, more=()):
    """``op`` on ``path`` (and the cases ``more``, alike) is a FormatError naming ``needles``, in bounded memory."""
    outs = _reads((op, path), *more)
    for out in outs:
        assert out["error"] == "FormatError", out
        assert all(n in out["message"] for n in needles), out["message"]
        assert out["growth_mb"] < GROWTH_MB, out
    return outs[0]


def _save(path, layout="ocdbt"):
    sd = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(4096.0)), "step": 3}
    ldc.save(sd, str(path), storage=ldc.StorageOptions(layout=layout, pack_max_bytes=0))
    return path


def _consistent(ck, name, raw, field):
    """``raw`` as the checkpoint's ``name``, the commit marker's ``field`` hash of it recomputed."""
    (ck / name).write_bytes(raw)
    marker = json.loads((ck / "COMMITTED").read_text())
    marker[field] = hashlib.sha256(raw).hexdigest()
    (ck / "COMMITTED").write_text(json.dumps(marker))


# -- JSON: the estimate is an upper bound ------------------------------------------------------------

def _shapes():
    n = 20_000
    return {
        "new keys, one an object": "[" + ",".join('{"%x":0}' % i for i in range(n)) + "]",
        "new keys, lists": "[" + ",".join('{"%x":[]}' % i for i in range(n)) + "]",
        "one big object": "{" + ",".join('"%x":[0]' % i for i in range(n)) + "}",
        "new long keys": "[" + ",".join('{"%s":1e5}' % ("k" * 12 + "%08x" % i) for i in range(n)) + "]",
        "keys with escapes": "[" + ",".join('{"%x\\n":0}' % i for i in range(n)) + "]",
        "nested pairs": "[" + ",".join('{"a":{"b":0}}' for _ in range(n)) + "]",
        "one astral character": json.dumps({"pad": "a" * (2 << 20) + "\U0001F600"}, ensure_ascii=False),
        "escaped astral": "[" + ",".join('"\\ud83d\\ude00"' for _ in range(n)) + "]",
        "empty lists": "[" + ",".join("[]" for _ in range(n)) + "]",
        "ours": json.dumps({"tensors": {f"layer.{i}.w": {"dtype": "bfloat16", "global_shape": [8192, 8192], "shards": [
            {"offset": [r * 1024, 0], "shape": [1024, 8192], "flat": None, "writer": r, "index": 0}
            for r in range(8)]} for i in range(300)}}),
    }


@pytest.mark.parametrize("hook", [False, True], ids=["plain", "pairs_hook"])
@pytest.mark.parametrize("name", list(_shapes()))
def test_the_parse_estimate_bounds_what_json_takes(name, hook):
    """What the scan estimates before parsing is at least what ``json.loads`` takes at its peak: the old
    estimate was about half for texts of new keys (26 bytes a byte estimated 12) and 0 for one string
    holding one character past U+FFFF (8 bytes a byte)."""
    from lightning_distckpt.storage.layout import _json_shape

    raw = _shapes()[name].encode()
    shape = _json_shape(raw)
    estimate = shape.parse_bytes(hook) if hook else shape.parse_bytes()
    tracemalloc.start()
    try:
        parsed = json.loads(raw, object_pairs_hook=dict if hook else None)  # dict(pairs): as parse_json's hook
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    del parsed
    assert estimate >= peak, (name, estimate / len(raw), peak / len(raw))


def test_a_metadata_json_padded_with_new_keys_is_refused_before_parsing(tmp_path):
    """12 MB of ``{"k1":{"a":0}},{"k2":{"a":0}},...`` under a field parse into ~30 bytes a byte (360 MB;
    30 GB under the 1 GiB cap): refused before parsing, naming the estimate (the old estimate said 13x,
    under its ratio of 16, and parsed it)."""
    ck = _save(tmp_path / "ck")
    meta = (ck / "metadata.json").read_bytes()
    pad = b'"pad": [' + b",".join(b'{"%x":{"a":0}}' % i for i in range(700_000)) + b"], "
    _consistent(ck, "metadata.json", meta.replace(b"{", b"{" + pad, 1), "metadata_sha256")
    _refused("metadata", ck, "metadata.json", "parsing it would take about", "refused before parsing")


def test_a_wide_text_counts_against_each_local_process_share_of_memory(monkeypatch):
    """One character past U+FFFF makes json decode the whole text (and its string) at 4 bytes a
    character: 10 MB takes 80 MB. The estimate says so, and the memory check shares what is available
    among the processes of the node (``LOCAL_WORLD_SIZE``: every local rank parses the index at once)."""
    from lightning_distckpt.storage.layout import _json_shape, parse_json

    raw = json.dumps({"format": "x", "pad": "a" * (10 << 20) + "\U0001F600"}, ensure_ascii=False).encode()
    assert _json_shape(raw).parse_bytes() >= 8 * len(raw)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(1 << 40))
    with pytest.raises(FormatError, match=r"metadata\.json: parsing it would take about \d+ MiB of memory .*more "
                                          r"than the \d+ MiB available shared by the \d+ processes of this node "
                                          r"\(LOCAL_WORLD_SIZE\)"):
        parse_json(raw, "metadata.json")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert parse_json(raw, "metadata.json")["format"] == "x"


# -- zarr.json ----------------------------------------------------------------------------------------

_PAD = b'"pad":[' + b"[]," * (4 << 20) + b'0],'  # 12 MB: ~270 MB once parsed


def test_a_padded_zarr_json_file_is_refused_before_it_is_read_whole(tmp_path):
    ck = _save(tmp_path / "ck", layout="zarr")
    path = ck / "data" / "rank_00000" / "t" / "w" / "0" / "zarr.json"
    path.write_bytes(path.read_bytes().replace(b'{"attributes":{', b'{"attributes":{' + _PAD * 2, 1))
    _refused("load", ck, "'w' shard 0", "its zarr.json holds more than the", "refused before reading it whole",
             more=[("plain", ck)])


def test_a_padded_zarr_json_in_an_ocdbt_store_is_read_only_to_its_cap(tmp_path):
    """Inside an OCDBT database a value may be any range of a data file: the reader reads the byte past
    the array's cap first, and nothing more of a value that holds it."""
    import tensorstore as ts

    ck = _save(tmp_path / "ck")
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{ck}/data/rank_00000/"}).result()
    raw = kv.read("t/w/0/zarr.json").result().value
    kv.write("t/w/0/zarr.json", raw.replace(b'{"attributes":{', b'{"attributes":{' + _PAD, 1)).result()
    del kv
    _refused("load", ck, "'w' shard 0", "its zarr.json holds more than the", "refused before reading it whole")
    r = subprocess.run([sys.executable, "-m", "lightning_distckpt", "validate", str(ck)], capture_output=True,
                       text=True, timeout=HANG_S)
    assert r.returncode == 1 and "its zarr.json holds more than the" in r.stdout + r.stderr, r.stdout + r.stderr


def test_a_real_zarr_json_of_many_chunks_is_within_its_cap(tmp_path):
    """The cap grows with the chunks an array has (one CRC each): 1,000 chunks (CRCs past the 4 KiB) load."""
    w = torch.arange(1000 * 256, dtype=torch.float32).reshape(1000, 256)  # rows of 1 KiB: a chunk each
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", w)}, str(tmp_path / "ck"),
             storage=ldc.StorageOptions(layout="zarr", chunk_bytes=1024, pack_max_bytes=0))
    zarr = json.loads((tmp_path / "ck" / "data" / "rank_00000" / "t" / "w" / "0" / "zarr.json").read_text())
    assert len(zarr["attributes"]["lightning_distckpt"]["crc32c"]) == 1000
    assert torch.equal(ldc.load_plain_tensors(str(tmp_path / "ck"))["w"], w)


# -- safetensors ----------------------------------------------------------------------------------------

def _safetensors(path, tensors, metadata=None, tail=b""):
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    if tail:
        with open(path, "ab") as f:
            f.write(tail)
    return path


def test_a_crc_map_of_empty_lists_is_refused_before_parsing(tmp_path):
    from lightning_distckpt.storage.safetensors_crcs import CRC_KEY

    crcs = "[" + "[]," * (4 << 20) + "0]"  # 12 MB of JSON inside the header's __metadata__ string
    path = _safetensors(tmp_path / "m.safetensors", {"w": torch.ones(4)}, {CRC_KEY: crcs})
    _refused("plain", path, str(path), f"malformed {CRC_KEY}")


def test_a_safetensors_file_cut_short_while_open_is_a_format_error_not_sigbus(tmp_path):
    """safe_open memory-maps the file: cut short by another process (a copy being replaced), the read
    of a mapped page past the end killed the reader with SIGBUS. Read with pread: a FormatError."""
    path = _safetensors(tmp_path / "m.safetensors", {"w": torch.arange(1 << 16, dtype=torch.float32)})
    _refused("cut", path, str(path), "'w'", "cut short")


def test_safetensors_slices_read_only_their_rows_and_match(tmp_path, monkeypatch):
    import lightning_distckpt.reading.formats.files as files
    from lightning_distckpt.reading.formats.files import SafetensorsFile

    tensors = {"a": torch.randn(37, 5), "b": torch.arange(10), "c": torch.tensor(2.5), "e": torch.empty(0, 3),
               "f": torch.randn(3, 4).to(torch.bfloat16), "g": torch.tensor([True, False, True])}
    f = SafetensorsFile(str(_safetensors(tmp_path / "m.safetensors", tensors)))
    monkeypatch.setattr(files, "_READ_BYTES", 40)  # a few rows per read
    for name, t in tensors.items():
        assert torch.equal(f.read(name, ()), t)
    for src in [(slice(3, 30), slice(1, 4)), (slice(0, 37, 3), slice(None)), (slice(5, 5), slice(0, 2))]:
        assert torch.equal(f.read("a", src), tensors["a"][src])


def test_a_safetensors_file_with_bytes_past_its_tensors_is_refused(tmp_path):
    path = _safetensors(tmp_path / "m.safetensors", {"w": torch.ones(4)}, tail=b"\0" * 16)
    with pytest.raises(FormatError, match="trailing bytes|not fully covered"):  # as safetensors' own reader
        ldc.load_plain_tensors(str(path))


# -- pickles ----------------------------------------------------------------------------------------------

_DEEP_KEY = b"\x80\x02}" + b")" + b"\x85" * 200_000 + b"K\x01s."  # {((((),),),...): 1}, 200,000 deep
_LAUGHING_KEY = b"\x80\x02}K\x01K\x02\x86q\x00" + b"h\x00\x86q\x00" * 40 + b"K\x01s."  # x = (x, x), 40 times


def _torch_file_with_pickle(path, raw):
    """A torch.save archive whose ``data.pkl`` is ``raw`` (its records consistent: CRCs and headers)."""
    buf = io.BytesIO()
    torch.save({}, buf)
    reader = torch._C.PyTorchFileReader(io.BytesIO(buf.getvalue()))
    writer = torch._C.PyTorchFileWriter(str(path))
    for name in reader.get_all_records():
        data = raw if name == "data.pkl" else reader.get_record(name)
        writer.write_record(name, data, len(data))
    writer.write_end_of_file()
    return path


def test_pickles_whose_dict_key_would_hash_without_bound_are_refused(tmp_path):
    """Loading a dict hashes its keys, and Python hashes a tuple recursing in C: 200,000 nested 1-tuples
    (200 KB) crashed the process with SIGSEGV, shared tuples 40 deep (1 KB) hashed 2**40 items (hours).
    A torch file, its pre-1.6 form and a checkpoint's common.pt are each refused before unpickling."""
    deep = _torch_file_with_pickle(tmp_path / "deep.pt", _DEEP_KEY)
    laughing = _torch_file_with_pickle(tmp_path / "laughing.pt", _LAUGHING_KEY)
    buf = io.BytesIO()
    torch.save({}, buf, _use_new_zipfile_serialization=False)
    f = io.BytesIO(buf.getvalue())
    for _ in range(3):  # magic number, protocol, system info
        pickle.load(f)
    legacy = tmp_path / "legacy.pt"
    legacy.write_bytes(buf.getvalue()[:f.tell()] + _DEEP_KEY + pickle.dumps([], protocol=2))
    ck = _save(tmp_path / "ck")
    _consistent(ck, "common.pt", deep.read_bytes(), "common_sha256")
    outs = _reads(("plain", deep), ("plain", laughing), ("plain", legacy), ("common", ck))
    for out, name in zip(outs, (str(deep), str(laughing), str(legacy), "common.pt")):
        assert out["error"] == "FormatError" and name in out["message"], out
        assert "a tuple nested" in out["message"] and "refused before unpickling" in out["message"], out
        assert out["growth_mb"] < GROWTH_MB, out


def _dcp(tmp_path, name="dcp"):
    import torch.distributed.checkpoint as dcp

    path = tmp_path / name
    dcp.save({"w": torch.arange(4.0), "v": torch.ones(2, 2)}, checkpoint_id=str(path), no_dist=True)
    return path


def test_a_dcp_metadata_whose_dict_key_would_hash_without_bound_is_refused(tmp_path):
    deep, laughing = _dcp(tmp_path, "deep"), _dcp(tmp_path, "laughing")
    (deep / ".metadata").write_bytes(_DEEP_KEY)
    (laughing / ".metadata").write_bytes(_LAUGHING_KEY)
    _refused("plain", deep, ".metadata", "a dict key or set item nested", more=[("plain", laughing)])


def _laughs(depth):
    x = [1, 1]
    for _ in range(depth - 1):
        x = [x, x]
    return x


def test_dcp_metadata_fields_of_shared_lists_are_refused_in_bounded_memory(tmp_path):
    """A tensor's size as shared lists 40 deep (1 KB): the message refusing it wrote 2**40 items (memory
    until the process died). Refused before unpickling now; what a message shows of a value a pickle
    built is bounded in depth and width."""
    path = _dcp(tmp_path)
    meta = pickle.loads((path / ".metadata").read_bytes())
    meta.state_dict_metadata["w"].size = _laughs(40)
    (path / ".metadata").write_bytes(pickle.dumps(meta))
    assert (path / ".metadata").stat().st_size < 4096
    out = _refused("plain", path, ".metadata", "'w' size must be a sequence of non-negative ints, got [[[[")
    assert len(out["message"]) < 1000
    from lightning_distckpt.reading.formats.dcp_metadata import shown_value

    shown = shown_value({"size": _laughs(40), "record": meta.state_dict_metadata["w"]})
    assert "[[[" in shown and len(shown) <= 210, shown


def test_dcp_chunk_lists_shared_by_many_tensors_are_refused(tmp_path):
    """One list of 200 empty chunks named by 200 tensors (10 kB) is walked once per tensor: 40,000 chunks
    (1,000 x 1,000: 40 kB, 10 s; 100 MB of such a file: days). Each chunk a tensor names takes at least
    2 bytes of the file."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

    path = _dcp(tmp_path)
    meta = pickle.loads((path / ".metadata").read_bytes())
    w = meta.state_dict_metadata["w"]
    shared = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([0]))] * 200
    for i in range(200):
        meta.state_dict_metadata[f"e{i}"] = TensorStorageMetadata(properties=w.properties, size=torch.Size([4]),
                                                                  chunks=shared)
    (path / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(FormatError, match=r"\.metadata: its tensors name \d+ chunks or more, more than its \d+ "
                                          r"bytes hold \(chunk lists shared between tensors\)"):
        ldc.load_plain_tensors(str(path))


_LENGTHS = {"BINUNICODE": b"X\xff\xff\xff\xff", "BINBYTES8": b"\x8e" + struct.pack("<Q", 1 << 62),
            "LONG4": b"\x8b\xff\xff\xff\x7f", "FRAME": b"\x95" + struct.pack("<Q", 1 << 62)}


def test_declared_lengths_past_a_short_pickle_allocate_nothing(tmp_path):
    """A length field claiming up to 2**62 bytes in a pickle of a few (BINUNICODE, BINBYTES8, LONG4, FRAME):
    a FormatError, the reads bounded by the bytes present, in a torch file, a legacy torch file and a DCP
    .metadata (found sound: torch and Python read such fields from in-memory buffers)."""
    buf = io.BytesIO()
    torch.save({}, buf, _use_new_zipfile_serialization=False)
    f = io.BytesIO(buf.getvalue())
    for _ in range(3):
        pickle.load(f)
    cases = []
    for name, opcode in _LENGTHS.items():
        raw = b"\x80\x04" + opcode + b"abc"
        legacy = tmp_path / f"{name}_legacy.pt"
        legacy.write_bytes(buf.getvalue()[:f.tell()] + raw)
        dcp_dir = _dcp(tmp_path, f"{name}_dcp")
        (dcp_dir / ".metadata").write_bytes(raw)
        zipped = _torch_file_with_pickle(tmp_path / f"{name}.pt", raw)
        cases += [("plain", zipped), ("plain", legacy), ("plain", dcp_dir)]
    for case, out in zip(cases, _reads(*cases)):
        assert out["error"] in ("FormatError", "UnsafeContentError"), (case, out)
        assert out["growth_mb"] < GROWTH_MB, (case, out)


def test_real_pickles_with_tuples_and_shared_values_still_load(tmp_path):
    """Tuple keys, nested tuples, a dict shared by two keys and tied weights load as saved."""
    shared = {"lr": 0.1, "betas": (0.9, (0.99, 0.999))}
    w = torch.arange(6.0)
    path = tmp_path / "ok.pt"
    torch.save({"w": w, "tied": w, "groups": [shared, shared], "by_pair": {(1, (2, 3)): "x"}}, path)
    got = ldc.load_plain_tensors(str(path))
    assert torch.equal(got["w"], w) and torch.equal(got["tied"], w)
    path = _dcp(tmp_path, "real_dcp")
    got = ldc.load_plain_tensors(str(path))
    assert torch.equal(got["w"], torch.arange(4.0)) and torch.equal(got["v"], torch.ones(2, 2))


# -- an export's config ------------------------------------------------------------------------------

def test_an_export_config_nested_too_deep_is_an_argument_error(tmp_path):
    from lightning_distckpt.export import to_safetensors

    ck = _save(tmp_path / "ck")
    config = tmp_path / "config.json"
    config.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointingError, match="config .*not a JSON object"):
        to_safetensors(str(ck), str(tmp_path / "out"), config=str(config))
    assert not os.path.exists(tmp_path / "out" / "config.json")
    shutil.rmtree(tmp_path / "out", ignore_errors=True)


# -- a ShardedObject in an OCDBT store ---------------------------------------------------------------

def test_an_ocdbt_object_past_the_cap_is_refused_unread(tmp_path, monkeypatch):
    """A ShardedObject's value inside an OCDBT database was read whole whatever its size (an OCDBT value
    may name any range of a sparse data file); as a file (zarr layout) it was capped. Now the same cap,
    read the byte past it first."""
    sd = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(4.0)),
          "o": ldc.ShardedObject("o", {"blob": b"x" * (4 << 20)}, (1,), (0,))}
    ldc.save(sd, str(tmp_path / "ck"))
    template = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(4)),
                "o": ldc.ShardedObject("o", None, (1,), (0,))}
    monkeypatch.setenv("LIGHTNING_DISTCKPT_MAX_COMMON_BYTES", str(1 << 20))
    with pytest.raises(FormatError, match=r"object 'o' #0 \(written by rank 0\) holds more than the 1048576 bytes .*"
                                          r"refused before reading it .*LIGHTNING_DISTCKPT_MAX_COMMON_BYTES"):
        ldc.load(template, str(tmp_path / "ck"))
    monkeypatch.delenv("LIGHTNING_DISTCKPT_MAX_COMMON_BYTES")
    assert len(ldc.load(template, str(tmp_path / "ck"))["o"]["blob"]) == 4 << 20
