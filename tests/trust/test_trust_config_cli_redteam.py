"""The configuration and the command line, red-teamed: what a probe found.

Configuration (``lightning/config.py``):

* A ``DistCheckpointConfig`` built in Python took any value: ``allow_shape_mismatch="no"`` (a true
  string) loaded tensors of another shape padded and truncated, ``async_save="false"`` saved in the
  background, ``max_staging_bytes=float("nan")`` or ``1.5`` passed, ``storage={...}`` or ``None``
  stayed a dict or None (an AttributeError at the first save), ``safe_globals="io.BytesIO"`` was
  imported letter by letter, ``tiers={}`` wrote node-local checkpoints into a directory named
  ``???`` (omegaconf's MISSING) and ``tiers={"bogus": 1}`` was a raw TypeError. Each is a
  ConfigError naming the field now, as the same value in a YAML file always was; a mapping for
  ``storage`` is built into StorageOptions as one for ``tiers`` is.
* ``StrategyConfig(tensor_parallel_size=1.5)`` passed and ``"2"`` was a raw TypeError;
  ``DistCheckpointStrategy(tensor_parallel_size=2.7)`` ran with 2 (``int()``), ``True`` with 1,
  ``"x"`` / ``None`` were a raw ValueError / TypeError: a ConfigError / ArgumentTypeError now.
* ``from_config(cfg, config=...)`` / ``from_config(cfg, tensor_parallel_size=...)`` (a setting
  given in the config and as an argument) was a raw TypeError: an ArgumentError naming it now.
* ``StorageOptions(s3_endpoint=5)`` was an AttributeError.
* A config path that is a directory, a FIFO or a device "does not exist": said as what it is now.
* A YAML "billion laughs" (aliases nesting aliases) is bounded by omegaconf only from 2.4 on and
  not with ``OMEGACONF_MAX_YAML_EXPANDED_NODES=none`` (a 10,000-node expansion took 30 s; the
  library allows omegaconf 2.3): the library bounds alias expansion and file size itself now.

Command line (``cli/``, ``convert.py``, ``export/``):

* A result holding a character stdout's encoding lacks (a key in Japanese, ``PYTHONIOENCODING=ascii``,
  a Latin-1 terminal) was a UnicodeEncodeError traceback with exit status 1, which ``validate``
  documents as "damaged": escaped now (``\\u65e5``), exit status 0.
* ``validate`` of a damaged checkpoint whose reader had gone (``| head``) exited 0: the broken pipe
  was "success". Its verdict (1) stands now; ``clean``'s too.
* ``inspect --json`` printed ``NaN`` for a NaN in ``metadata.json``'s storage section (Python's
  json reads it): no JSON parser but Python's accepts that. Non-finite numbers are ``null`` now.
* Any exception that was no library error ended with exit status 1 ("damaged"); now an OSError is
  one line with exit status 2 and anything else (a bug) prints its traceback with exit status 3.
* SIGTERM (a scheduler's preemption) killed ``convert`` where it stood, leaving its staging
  directory or temporary file; a Ctrl-C in a DCP / Megatron export was reported as a failed write
  ("KeyboardInterrupt:", exit status 2), and one while a torch file was imported (``convert F.pt
  DIR``) left the staging directory. SIGTERM now unwinds as Ctrl-C does (exit status 143, 130 for
  Ctrl-C), and what the command wrote is removed.
* ``convert CK -`` wrote a file named ``-`` (no stdout output exists): refused now.
* ``convert --to safetensors --config DIR`` said "IsADirectoryError: [Errno 21] Is a directory: 3"
  (and leaked the descriptor); ``clean FILE`` said "no such directory".

Looked at and sound: ``!!python/object`` tags (refused by the safe loader), deep nesting, duplicate
keys, unknown keys in every section (``tiers:`` included), YAML's ``yes``/``on`` booleans, NaN /
inf / 1e30 for sizes in YAML, paths that are empty, hold NUL, start with ``-`` (``--`` works), a
FIFO / device / link loop as input or output, outputs that are the input, inside it or hold it,
every numeric option's range, and hostile names in text and ``--json`` output.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.cli.main import main
from lightning_distckpt.core.errors import ArgumentError, ArgumentTypeError, ConfigError
from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy, FabricDistCheckpointStrategy
from lightning_distckpt.lightning.config import (DistCheckpointConfig, StrategyConfig, load_checkpoint_config,
                                                 load_strategy_config)
from lightning_distckpt.storage.tensorstore_io import StorageOptions

WEIGHT = torch.arange(12, dtype=torch.float32).reshape(3, 4)


def _save(path, key="w"):
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets(key, WEIGHT.clone()), "step": 1}, str(path))
    return str(path)


@pytest.fixture
def ck(tmp_path):
    return _save(tmp_path / "ck")


def _cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


# -- configuration --------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,named", [
    (dict(allow_shape_mismatch="no"), "allow_shape_mismatch"),
    (dict(async_save="false"), "async_save"),
    (dict(balance_writes="no"), "balance_writes"),
    (dict(validate_access_integrity=0), "validate_access_integrity"),
    (dict(max_staging_bytes=float("nan")), "max_staging_bytes"),
    (dict(max_staging_bytes=1.5), "max_staging_bytes"),
    (dict(max_staging_bytes="100"), "max_staging_bytes"),
    (dict(max_staging_bytes=True), "max_staging_bytes"),
    (dict(safe_globals="io.BytesIO"), "safe_globals must be a list"),  # was imported letter by letter
    (dict(safe_globals=5), "safe_globals must be a list"),
    (dict(storage=None), "storage"),
    (dict(storage={"layout": "zarr", "layot": "zarr"}), "layot"),
    (dict(storage={"s3_endpoint": 5}), "s3_endpoint"),
    (dict(tiers="/x"), "tiers"),
    (dict(tiers={}), "local_dir"),
    (dict(tiers={"local_every_n_steps": 5}), "local_dir"),
    (dict(tiers={"local_dir": "/x", "bogus": 1}), "bogus"),
])
def test_a_config_built_in_python_checks_its_fields_as_yaml_does(kwargs, named):
    with pytest.raises(ConfigError, match=named):
        DistCheckpointConfig(**kwargs)


def test_a_config_built_in_python_with_good_values_and_sections_as_mappings():
    cfg = DistCheckpointConfig(storage={"layout": "zarr", "chunk_bytes": 4096}, tiers={"local_dir": "/x"},
                               safe_globals=("io.BytesIO",), max_staging_bytes=1 << 20, async_save=True)
    assert cfg.storage == StorageOptions(layout="zarr", chunk_bytes=4096) and cfg.tier_options.local_dir == "/x"
    assert DistCheckpointIO(config=cfg).config.storage.layout == "zarr"
    assert load_checkpoint_config({"allow_shape_mismatch": "no"}).allow_shape_mismatch is False  # YAML's words


def test_storage_options_s3_fields_must_be_text():
    for name in ("s3_endpoint", "s3_region", "s3_credentials"):
        with pytest.raises(ConfigError, match=name):
            StorageOptions(**{name: 5})


@pytest.mark.parametrize("tp", [1.5, "2", True, None, 2.7])
def test_tensor_parallel_size_must_be_an_int(tp):
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        StrategyConfig(tensor_parallel_size=tp)
    for strategy in (DistCheckpointStrategy, FabricDistCheckpointStrategy):
        with pytest.raises(ArgumentTypeError, match="tensor_parallel_size"):
            strategy(tensor_parallel_size=tp)
    assert StrategyConfig(checkpoint={"async_save": True}).checkpoint.async_save is True  # a mapping is built


def test_a_setting_given_both_in_the_config_and_as_an_argument_is_named():
    with pytest.raises(ArgumentError, match="config"):
        DistCheckpointIO.from_config({"async_save": True}, config={"async_save": False})
    for strategy in (DistCheckpointStrategy, FabricDistCheckpointStrategy):
        for key, value in (("tensor_parallel_size", 1), ("checkpoint", {"async_save": True})):
            with pytest.raises(ArgumentError, match=key):
                strategy.from_config({"tensor_parallel_size": 2}, **{key: value})


def test_a_config_path_that_is_no_file_is_named_as_what_it_is(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    for path, said in ((tmp_path, "is a directory"), (tmp_path / "fifo", "not a regular file"),
                       ("/dev/null", "not a regular file")):
        for load in (load_checkpoint_config, load_strategy_config):
            with pytest.raises(ConfigError, match=said):
                load(str(path))


def _laughs(levels: int) -> str:
    """``safe_globals`` as 10**levels copies of ten names, from a document of a few hundred bytes."""
    text = "_a0: &a0 [" + ", ".join(["io.BytesIO"] * 10) + "]\n"
    text += "".join(f"_a{i + 1}: &a{i + 1} [" + ", ".join([f"*a{i}"] * 10) + "]\n" for i in range(levels))
    return text + f"safe_globals: *a{levels}\n"


def test_yaml_aliases_and_size_are_bounded_whatever_omegaconf_allows(tmp_path, monkeypatch):
    monkeypatch.setenv("OMEGACONF_MAX_YAML_EXPANDED_NODES", "none")  # omegaconf 2.4's own bound lifted
    for levels in (2, 8):  # 1,111 nodes, and 1,111,111,111 (never built)
        bomb = tmp_path / f"laughs{levels}.yaml"
        bomb.write_text(_laughs(levels))
        with pytest.raises(ConfigError, match=f"{bomb}.*billion laughs"):
            load_checkpoint_config(str(bomb))
    big = tmp_path / "big.yaml"
    big.write_text("async_save: true\n" + "#" * (2 << 20) + "\n")
    with pytest.raises(ConfigError, match="larger than"):
        load_checkpoint_config(str(big))
    ok = tmp_path / "ok.yaml"  # an anchor reused a few times is fine
    ok.write_text("storage: &s {layout: zarr}\nsafe_globals: &g [io.BytesIO]\ntiers: {local_dir: /x}\n")
    assert load_checkpoint_config(str(ok)).storage.layout == "zarr"


def test_yaml_that_would_build_objects_is_refused(tmp_path):
    """Sound: the safe loader knows no Python tags."""
    for text in ("strict: !!python/object/apply:os.system ['echo pwned']\n",
                 "loader: !!python/name:os.system\n"):
        path = tmp_path / "tag.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match="constructor"):
            load_checkpoint_config(str(path))


# -- command line ---------------------------------------------------------------------------------
def test_a_result_stdout_cannot_encode_is_escaped_not_a_traceback(tmp_path):
    path = _save(tmp_path / "ck_日本", key="wé日本")
    for encoding in ("ascii", "latin-1"):
        raw = io.BytesIO()
        stdout = io.TextIOWrapper(raw, encoding=encoding, errors="strict", write_through=True)
        err = io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(err):
            code = main(["inspect", path])
        text = raw.getvalue().decode(encoding)
        assert code == 0, err.getvalue()
        assert "ck_\\u65e5\\u672c" in text, text
        assert ("w\\xe9\\u65e5" if encoding == "ascii" else "wé\\u65e5") in text, text


def _closed_pipe_stdout():
    """A stdout whose reader is gone (``| head`` that has exited): writes fail with EPIPE (line
    buffered, as the subprocess's was found to write: its print raised)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    return os.fdopen(write_end, "w", buffering=1)


@pytest.mark.parametrize("as_json", [False, True])
def test_validate_keeps_its_verdict_when_its_reader_is_gone(ck, as_json):
    data = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(ck, "data")) for f in fs]
    victim = max(data, key=os.path.getsize)
    os.truncate(victim, os.path.getsize(victim) // 2)
    stdout = _closed_pipe_stdout()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
            code = main(["validate", ck, *(["--json"] if as_json else [])])
    finally:
        with contextlib.suppress(OSError):
            stdout.close()
    assert code == 1  # damaged, whoever reads the report


def test_inspect_json_is_strict_json_when_metadata_holds_nan(ck):
    import hashlib

    meta_path, marker_path = os.path.join(ck, "metadata.json"), os.path.join(ck, "COMMITTED")
    with open(meta_path) as f:
        meta = json.load(f)
    meta["storage"]["note"] = float("nan")  # Python's json reads and writes NaN; no other parser does
    raw = json.dumps(meta).encode()
    with open(meta_path, "wb") as f:
        f.write(raw)
    with open(marker_path) as f:
        marker = json.load(f)
    marker["metadata_sha256"] = hashlib.sha256(raw).hexdigest()
    with open(marker_path, "w") as f:
        json.dump(marker, f)

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    code, out, err = _cli("inspect", ck, "--json")
    assert code == 0, err
    summary = json.loads(out, parse_constant=refuse)
    assert summary["storage"]["note"] is None and summary["tensors"][0]["key"] == "w"


def test_an_unexpected_error_is_not_exit_status_1(ck, monkeypatch):
    """1 says "damaged" (a script may throw the checkpoint away). The failures are injected: the
    library turns every real one it knows into its own errors."""
    import lightning_distckpt.cli.inspect as inspect_mod

    def fails(exc):
        def summarize(*args, **kwargs):
            raise exc
        return summarize

    monkeypatch.setattr(inspect_mod, "summarize", fails(PermissionError(13, "Permission denied", ck)))
    code, out, err = _cli("inspect", ck)
    assert code == 2 and "PermissionError" in err and "Traceback" not in err and len(err.splitlines()) == 1, err
    monkeypatch.setattr(inspect_mod, "summarize", fails(ZeroDivisionError("a bug")))
    code, out, err = _cli("inspect", ck)
    assert code == 3 and "Traceback" in err and "internal error" in err and "ZeroDivisionError: a bug" in err


def test_convert_to_dash_is_refused_not_a_file_named_dash(ck, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for argv in (["convert", ck, "-"], ["convert", "-", "out"], ["convert", ck, "-", "--to", "safetensors"]):
        code, out, err = _cli(*argv)
        assert code == 2 and "stdin / stdout" in err, err
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_clean_of_a_file_and_an_export_config_that_is_a_directory_say_what_they_are(ck, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    code, _, err = _cli("clean", tmp_path / "notes.txt")
    assert code == 2 and "not a directory" in err, err
    code, _, err = _cli("convert", ck, tmp_path / "hf", "--to", "safetensors", "--config", tmp_path)
    assert code == 2 and "not a regular file" in err and "IsADirectoryError" not in err, err


def test_ctrl_c_in_a_dcp_export_is_an_interrupt_not_a_failed_write(ck, tmp_path, monkeypatch):
    """Ctrl-C arrives in the main thread: raised at its first fsync, inside dcp.save."""
    real = os.fsync
    calls = []

    def interrupted(fd):
        if threading.current_thread() is threading.main_thread():
            calls.append(fd)
            if len(calls) == 1:
                raise KeyboardInterrupt
        return real(fd)

    monkeypatch.setattr(os, "fsync", interrupted)
    for to in ("dcp", "megatron"):
        calls.clear()
        code, _, err = _cli("convert", ck, tmp_path / to, "--to", to, "-q")
        assert calls and code == 130 and "KeyboardInterrupt" not in err, (to, code, err)
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no staging directory left


# Runs converts in one process, each sent SIGTERM by itself at its first fsync (in whichever thread
# makes it: the signal is handled in the main thread, as a scheduler's is); prints each exit status.
TERMINATED = """
import json, os, signal, sys
from lightning_distckpt.cli.main import main
real, calls = os.fsync, [0]
def fsync(fd):
    calls[0] += 1
    if calls[0] == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    return real(fd)
os.fsync = fsync
for argv in json.loads(sys.argv[1]):
    calls[0] = 0
    print(json.dumps([argv, main(argv + ["-q"]), calls[0]]), flush=True)
"""


def test_sigterm_during_convert_removes_what_it_wrote(ck, tmp_path):
    plain, export = str(tmp_path / "plain.pt"), str(tmp_path / "export.pt")
    torch.save({"state_dict": {"w": WEIGHT}}, plain)  # saved as DistCheckpointIO saves a Lightning checkpoint
    ldc.export.to_torch_file(ck, export)  # an export: imported by the converter's own save
    runs = [["convert", ck, str(tmp_path / "o.pt")], ["convert", ck, str(tmp_path / "o_ck"), "--to", "distckpt"],
            ["convert", plain, str(tmp_path / "o_plain")], ["convert", export, str(tmp_path / "o_export")],
            ["convert", ck, str(tmp_path / "o_dcp"), "--to", "dcp"]]
    before = sorted(os.listdir(tmp_path))
    r = subprocess.run([sys.executable, "-c", TERMINATED, json.dumps(runs)], capture_output=True, text=True,
                       timeout=300)
    results = [json.loads(line) for line in r.stdout.splitlines()]
    assert r.returncode == 0 and len(results) == len(runs), (r.returncode, r.stdout, r.stderr[-3000:])
    for argv, code, fsyncs in results:
        assert code == 143 and fsyncs >= 1, (argv, code)
    assert sorted(os.listdir(tmp_path)) == before  # no output, no staging directory, no temporary file
