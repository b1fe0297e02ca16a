"""Size bombs: a file that a reader reads whole (or hands to tensorstore, which does) larger than any
real one. A sparse file of 100 GB costs its maker no disk; read whole it takes all the memory there
is (or tensorstore aborts the process failing to allocate it). Every such file is refused before it
is read, with a FormatError naming the file, its size and the cap (``storage/paths.py``), and how to
raise the cap where a real checkpoint could reach it.

* ours: ``COMMITTED``, ``metadata.json`` (load, inspect, validate, the save's "is this ours" test,
  ``is_checkpoint_dir``), ``common.pt``, a rank store's ``manifest.ocdbt``, ``zarr.json``, chunk and
  object files; the same marker as an S3 object (moto's server on loopback), refused unfetched;
* another format's: a DCP ``.metadata``; a torch file whose deflated zip record inflates past the
  budget of its tensors (a zip bomb of ~1 MB);
* the JSON nesting check, whose arrays grew ~20 bytes a byte of the index, in bounded memory.

The 100 GB cases run in a subprocess under an address-space limit (tensorstore aborts the process
where it cannot allocate, and a reader without the cap would read until memory runs out); the
others use caps lowered through their environment variables, so a reader without the cap reads a
few MB and still fails the test.
"""

import json
import os
import resource
import subprocess
import sys
import tracemalloc
import zipfile

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.storage.layout import _max_depth, is_checkpoint_dir, is_our_committed_checkpoint

HUGE = 100 << 30  # sparse: no disk
METADATA_ENV = "LIGHTNING_DISTCKPT_MAX_METADATA_BYTES"
COMMON_ENV = "LIGHTNING_DISTCKPT_MAX_COMMON_BYTES"
_LIMIT_AS = 6 << 30  # the subprocesses' address space: torch and tensorstore start in ~1 GB of it


def _save(path, layout="zarr", obj=False):
    sd = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(4096.0).reshape(64, 64)),
          "b": ldc.ShardedTensor.from_rank_offsets("b", torch.ones(4)), "step": 3}
    if obj:
        sd["o"] = ldc.ShardedObject("o", {"a": 1}, (1,), (0,))
    ldc.save(sd, str(path), storage=ldc.StorageOptions(layout=layout))
    return str(path)


def _sparse(path, size=HUGE):
    with open(path, "r+b" if os.path.exists(path) else "wb") as f:
        f.truncate(size)


def _limited():
    resource.setrlimit(resource.RLIMIT_AS, (_LIMIT_AS, _LIMIT_AS))


def _run(argv, env=None):
    """A subprocess (the CLI or a script) under the address-space limit, with a timeout."""
    return subprocess.run([sys.executable] + argv, capture_output=True, text=True, timeout=120,
                          preexec_fn=_limited, env={**os.environ, **(env or {})})


# -- our format, the default caps, 100 GB sparse files -----------------------------------------

def test_cli_inspect_refuses_a_100_gb_metadata_json_before_reading_it(tmp_path):
    path = _save(tmp_path / "ck")
    _sparse(os.path.join(path, "metadata.json"))
    r = _run(["-m", "lightning_distckpt", "inspect", path])
    assert r.returncode == 2, r.stderr[-2000:]
    assert "metadata.json holds 107374182400 bytes, more than the 1073741824" in r.stderr
    assert METADATA_ENV in r.stderr  # how to raise it for a real one
    assert "Traceback" not in r.stderr


def test_cli_validate_reports_a_100_gb_ocdbt_manifest_as_damage(tmp_path):
    path = _save(tmp_path / "ck", layout="ocdbt")
    _sparse(os.path.join(path, "data", "rank_00000", "manifest.ocdbt"))
    r = _run(["-m", "lightning_distckpt", "validate", path])
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])  # damaged, said; not an abort of the process
    assert "manifest.ocdbt holds 107374182400 bytes, more than the 67108864" in r.stdout


_STORE_SCRIPT = """
import sys, lightning_distckpt as ldc, torch
for path, how in zip(sys.argv[1::2], sys.argv[2::2]):
    try:
        if how == "load":
            ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.empty(64, 64))}, path)
        else:
            ldc.load_plain_tensors(path)
        print("LOADED", flush=True)
    except ldc.FormatError as e:
        print("FormatError:", e, flush=True)
"""
# a store file, the reader, what the refusal says
_STORE_CASES = [
    ("data/rank_00000/p/float32/c/0", "load", "c/0 holds 107374182400 bytes, more than the"),
    ("data/rank_00000/p/float32/zarr.json", "plain", "zarr.json holds 107374182400 bytes, more than the 67108864"),
    ("data/rank_00000/o/o/0", "load", "o/0 holds 107374182400 bytes, more than the 4294967296"),
]


def test_store_files_tensorstore_reads_whole_are_refused_before_it_opens_them(tmp_path):
    argv = []
    for i, (rel, how, _) in enumerate(_STORE_CASES):  # one interpreter for all: each start costs seconds
        path = _save(tmp_path / f"ck{i}", obj=True)
        _sparse(os.path.join(path, rel))
        argv += [path, how]
    r = _run(["-c", _STORE_SCRIPT] + argv)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])  # tensorstore aborted the process before
    lines = r.stdout.splitlines()
    assert len(lines) == len(_STORE_CASES), r.stdout
    for line, (rel, _, said) in zip(lines, _STORE_CASES):
        assert line.startswith("FormatError:") and said in line, (rel, line)


# -- our format, caps lowered (a reader without them reads a few MB) ---------------------------

def test_a_large_commit_marker_is_refused_naming_it(tmp_path):
    path = _save(tmp_path / "ck")
    _sparse(os.path.join(path, "COMMITTED"), 2 << 20)
    with pytest.raises(ldc.FormatError, match=r"COMMITTED holds 2097152 bytes, more than the 1048576 a commit "
                                              r"marker may hold"):
        ldc.load_tensors_metadata(path)


def test_metadata_cap_refuses_every_reader_and_a_save_keeps_the_files(tmp_path, monkeypatch):
    path = _save(tmp_path / "ck")
    meta = os.path.join(path, "metadata.json")
    _sparse(meta, 1 << 20)
    monkeypatch.setenv(METADATA_ENV, "65536")
    refusal = r"metadata.json holds 1048576 bytes, more than the 65536 .*LIGHTNING_DISTCKPT_MAX_METADATA_BYTES"
    with pytest.raises(ldc.FormatError, match=refusal):
        ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.empty(64, 64))}, path)
    with pytest.raises(ldc.FormatError, match=refusal):
        ldc.validate(path)
    assert not is_our_committed_checkpoint(path)  # so a save does not replace it
    before = {n: os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)}
    with pytest.raises(ldc.CheckpointingError):
        ldc.save({"x": ldc.ShardedTensor.from_rank_offsets("x", torch.ones(3))}, path)
    assert {n: os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)} == before  # nothing lost


def test_is_checkpoint_dir_does_not_read_a_metadata_json_past_the_cap(tmp_path, monkeypatch):
    d = tmp_path / "folder"
    d.mkdir()
    (d / "metadata.json").write_bytes(json.dumps({"format": "lightning_distckpt"}).encode() + b" " * (1 << 20))
    assert is_checkpoint_dir(str(d))  # names our format
    monkeypatch.setenv(METADATA_ENV, "65536")
    assert not is_checkpoint_dir(str(d))  # past the cap: not read, so not taken for ours


def test_common_cap_refuses_common_pt_naming_it_and_the_variable(tmp_path, monkeypatch):
    path = _save(tmp_path / "ck")
    monkeypatch.setenv(COMMON_ENV, "64")
    with pytest.raises(ldc.FormatError, match=r"common.pt holds \d+ bytes, more than the 64 .*" + COMMON_ENV):
        ldc.load_common_state_dict(path)
    monkeypatch.setenv(COMMON_ENV, "1_000_000")  # raised: the real file loads
    assert ldc.load_common_state_dict(path)["step"] == 3


def test_a_save_past_the_common_cap_says_so_when_it_saves(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(COMMON_ENV, "64")
    with caplog.at_level("WARNING", logger="lightning_distckpt"):
        path = _save(tmp_path / "ck")
    assert any(COMMON_ENV in r.getMessage() and "ShardedTensors" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv(COMMON_ENV, "1_000_000")
    assert ldc.load_common_state_dict(path)["step"] == 3  # saved whole all the same


def test_a_malformed_cap_is_an_argument_error(tmp_path, monkeypatch):
    path = _save(tmp_path / "ck")
    monkeypatch.setenv(METADATA_ENV, "1GB")
    with pytest.raises(ldc.ArgumentError, match=METADATA_ENV):
        ldc.load_tensors_metadata(path)


# -- other formats ------------------------------------------------------------------------

def test_a_large_dcp_metadata_is_refused(tmp_path, monkeypatch):
    d = tmp_path / "dcp"
    d.mkdir()
    _sparse(str(d / ".metadata"), 1 << 20)
    (d / "__0_0.distcp").write_bytes(b"")
    monkeypatch.setenv(METADATA_ENV, "65536")
    with pytest.raises(ldc.FormatError, match=r"\.metadata holds 1048576 bytes, more than the 65536"):
        ldc.load_plain_tensors(str(d))


def test_a_zip_bomb_in_a_torch_file_is_refused_uninflated(tmp_path, monkeypatch):
    """A torch.save archive plus one deflated record of 1.1 GiB of zeros (~1 MB stored): past
    max(4 x the file, 1 GiB), refused from the sizes its zip directory declares, checksums on or off."""
    path = str(tmp_path / "bomb.pt")
    torch.save({"w": torch.arange(4.0)}, path)
    with zipfile.ZipFile(path, "a") as z:
        prefix = z.namelist()[0].split("/")[0]
        info = zipfile.ZipInfo(f"{prefix}/bomb")
        info.compress_type = zipfile.ZIP_DEFLATED
        info._compresslevel = 1
        with z.open(info, "w", force_zip64=True) as f:
            block = bytes(64 << 20)
            for _ in range(18):  # 1.125 GiB
                f.write(block)
    assert os.path.getsize(path) < 8 << 20
    for verify in ("1", "0"):
        monkeypatch.setenv("LIGHTNING_DISTCKPT_VERIFY", verify)
        with pytest.raises(ldc.FormatError, match=r"inflate to 1207959552 bytes, more than the 1073741824.*"
                                                  r"decompression bomb"):
            ldc.load_plain_tensors(path)


# -- S3 ----------------------------------------------------------------------------------

def test_a_large_s3_commit_marker_is_refused_unfetched(monkeypatch):
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        for name, value in (("AWS_ENDPOINT_URL", endpoint), ("AWS_ACCESS_KEY_ID", "testing"),
                            ("AWS_SECRET_ACCESS_KEY", "testing"), ("AWS_REGION", "us-east-1")):
            monkeypatch.setenv(name, value)
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing")
        s3.create_bucket(Bucket="size-caps")
        s3.put_object(Bucket="size-caps", Key="ck/COMMITTED", Body=b"{" * (2 << 20))
        with pytest.raises(ldc.FormatError, match=r"s3://size-caps/ck/COMMITTED holds more than the 1048576 bytes "
                                                  r"a commit marker may hold"):
            ldc.load_tensors_metadata("s3://size-caps/ck")
    finally:
        server.stop()


# -- the nesting check itself --------------------------------------------------------------

def test_the_nesting_check_scans_in_bounded_memory():
    raw = b"[]" * (24 << 20)  # 48 MiB of the densest nesting there is
    tracemalloc.start()
    try:
        assert _max_depth(raw) == 1
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * len(raw), peak  # the whole-text arrays took ~20 bytes a byte
    escaped = json.dumps(["\\\"[[", ["\\"], {"k": "]]\""}]).encode()
    assert _max_depth(escaped) == 2


# -- JSON that parses into far more memory than its size -----------------------------------------

def _consistent_metadata(path, raw):
    """``raw`` as the checkpoint's metadata.json, the marker's checksum of it recomputed (a consistent lie)."""
    import hashlib

    with open(os.path.join(path, "metadata.json"), "wb") as f:
        f.write(raw)
    with open(os.path.join(path, "COMMITTED")) as f:
        marker = json.load(f)
    marker["metadata_sha256"] = hashlib.sha256(raw).hexdigest()
    with open(os.path.join(path, "COMMITTED"), "w") as f:
        json.dump(marker, f)


@pytest.mark.parametrize("unit", [b"[],", b"{},", b"[[0]],"])
def test_a_metadata_json_of_empty_containers_is_refused_before_parsing(tmp_path, unit):
    """A few MB of ``[],[],...`` under a field parse into ~22-31 bytes a byte (a 1 GiB file under the cap:
    ~30 GB): refused before parsing, by load, inspect and validate alike, naming the estimate."""
    path = _save(tmp_path / "ck")
    with open(os.path.join(path, "metadata.json"), "rb") as f:
        meta = f.read()
    pad = b'"pad": [' + unit * ((6 << 20) // len(unit)) + b"0], "
    _consistent_metadata(path, meta.replace(b"{", b"{" + pad, 1))
    with pytest.raises(ldc.FormatError, match=r"metadata\.json: parsing it would take about \d+ MiB of memory, "
                                              r"\d+x its \d+ bytes .*refused before parsing"):
        ldc.load_tensors_metadata(path)
    for command in ("inspect", "validate"):
        r = _run(["-m", "lightning_distckpt", command, path])
        assert r.returncode in (1, 2) and "parsing it would take about" in r.stderr + r.stdout, r.stderr[-2000:]
        assert "Traceback" not in r.stderr


def test_a_large_index_of_the_shape_we_write_is_parsed():
    """The estimate keeps well under the ratio for what a save writes: a Megatron-like index of many
    shards (the same shape as a 4,096-rank one, 20 MB) parses."""
    from lightning_distckpt.storage.layout import PARSE_RATIO, _json_shape, parse_json

    entry = {"dtype": "bfloat16", "global_shape": [8192, 8192], "shards": [
        {"offsets": [r * 1024, 0], "shape": [1024, 8192], "writer": r, "index": 0, "replica": [0, r % 8],
         "crc32c": [123456789, 987654321]} for r in range(64)]}
    raw = json.dumps({"format": "lightning_distckpt", "tensors": {f"layer.{i}.w": entry for i in range(1200)}}).encode()
    shape = _json_shape(raw)
    assert shape.parse_bytes() < PARSE_RATIO // 2 * len(raw), (shape, len(raw))
    assert len(parse_json(raw, "metadata.json")["tensors"]) == 1200
