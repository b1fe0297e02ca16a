"""Hostile names reaching a terminal or a log: a checkpoint's keys, file names and metadata strings
holding escape sequences (clear screen, window title, OSC 8 links), carriage returns and newlines
(a forged ``OK`` line), bidi overrides, NUL or megabytes of text. The CLI (in a subprocess, its raw
bytes read), its log records and the library's errors show them escaped (``\\x1b``, ``\\n``,
``\\u202e``) and cut short with their length said (``lightning_distckpt/core/shown.py``); ``--json``
keeps every name exact."""

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import subprocess
import sys

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.core.shown import quoted, shown
from terminal import run_on_terminal

# Clear screen, set the window title, an OSC 8 link, a carriage return and a newline forging an
# "OK" line, a bidi override, NUL and the one-byte CSI of C1.
HOSTILE = "\x1b[2J\x1b]0;pwned\x07\x1b]8;;https://evil.example/\x1b\\link\x1b]8;;\x1b\\\rOK fake\n\u202eKO\x00\x9b"
FILE_SAFE = HOSTILE.replace("/", "|").replace("\x00", "")  # a file name holds neither
ESCAPED = "\\x1b[2J\\x1b]0;pwned\\x07"  # how the start of HOSTILE is shown
LONG = "L" * 5000
RAW = re.compile(rb"[\x00-\x08\x0b-\x1f\x7f]|\xc2[\x80-\x9f]|\xe2\x80[\xa8-\xae]|\xe2\x81[\xa6-\xa9]")


def cli(*args, env=None):
    """``python -m lightning_distckpt ARGS``: exit status, stdout and stderr, raw bytes."""
    r = subprocess.run([sys.executable, "-m", "lightning_distckpt", *map(str, args)], capture_output=True, timeout=120,
                       env=None if env is None else {**os.environ, **env})
    return r.returncode, r.stdout, r.stderr


def in_process(*args):
    """The same command through ``main()`` (no interpreter start): for the JSON checks."""
    from lightning_distckpt.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


def assert_shown_safely(*streams):
    """No control character, escape sequence or bidi control in the bytes; no line forged."""
    for data in streams:
        assert not RAW.search(data), data
        lines = data.decode().split("\n")
        assert not any(line.startswith(("OK fake", "\u202e")) for line in lines), data


def _rewrite_metadata(ck, change):
    """Change metadata.json and keep the commit marker's checksum of it consistent."""
    meta = json.loads((ck / "metadata.json").read_text())
    change(meta)
    raw = json.dumps(meta).encode()
    (ck / "metadata.json").write_bytes(raw)
    marker = json.loads((ck / "COMMITTED").read_text())
    marker["metadata_sha256"] = hashlib.sha256(raw).hexdigest()
    (ck / "COMMITTED").write_text(json.dumps(marker))


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """A committed checkpoint whose tensor, object and common-state keys, versions and a file in
    ``data/`` are hostile, with a 5000-character key."""
    ck = tmp_path_factory.mktemp("terminal") / "ck"
    ldc.save({"t": ldc.ShardedTensor.from_rank_offsets("w" + HOSTILE, torch.ones(3)),
              "o": ldc.ShardedObject("obj" + HOSTILE, {"v": 1}, (1,), (0,)),
              "long": ldc.ShardedTensor.from_rank_offsets(LONG, torch.ones(2)),
              "c" + HOSTILE: 5}, ck)
    _rewrite_metadata(ck, lambda m: m.update(library_version="9" + HOSTILE, torch_version=HOSTILE))
    (ck / "data" / ("f" + FILE_SAFE)).write_text("planted")
    return ck


def _committed(path):
    """A committed checkpoint at ``path``: saved elsewhere, then renamed (a save refuses a backslash
    in its path; anyone's directory name may hold one)."""
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.ones(2))}, path.parent / "made")
    os.rename(path.parent / "made", path)


def test_shown_escapes_what_a_terminal_acts_on_and_keeps_ordinary_text():
    for ordinary in ["layer.0.weight", "größe/日本語 a\\b 'q' \"x\" 100%", "model.layers.{0}.mlp", ""]:
        assert shown(ordinary) == ordinary and quoted(ordinary) == repr(ordinary)
    assert shown(HOSTILE) == repr(HOSTILE)[1:-1].replace("\\\\", "\\")  # repr's escapes, no quotes
    assert shown("a\u2028b\ufeffc\U000e0041\ud800") == "a\\u2028b\\ufeffc\\U000e0041\\ud800"
    assert shown(LONG) == "L" * 150 + "..." + "L" * 40 + " (5000 characters)" and shown(LONG, None) == LONG
    assert quoted(LONG).startswith("'LLL") and "(5000 characters)'" in quoted(LONG)


def test_inspect_shows_hostile_keys_versions_and_files_escaped_and_json_exact(hostile):
    rc, out, err = cli("inspect", hostile)
    assert rc == 0, err
    assert_shown_safely(out, err)
    text = out.decode()
    assert f"w{ESCAPED}" in text and f"obj{ESCAPED}" in text and f"lightning_distckpt 9{ESCAPED}" in text
    assert "\\u202eKO\\x00\\x9b" in text and "foreign      data/f\\x1b[2J" in text
    assert "(5000 characters)" in text and LONG not in text
    assert max(map(len, text.splitlines())) < 400  # the long key no longer widens the table to 5000
    # --json: every name exactly as stored
    rc, out, _ = in_process("inspect", hostile, "--json")
    summary = json.loads(out)
    assert rc == 0 and {t["key"] for t in summary["tensors"]} == {"w" + HOSTILE, LONG}
    assert [o["key"] for o in summary["objects"]] == ["obj" + HOSTILE]
    assert summary["library_version"] == "9" + HOSTILE and summary["foreign"] == [f"data/f{FILE_SAFE}: a regular file"]


def test_validate_names_each_key_and_warning_escaped_and_its_status_line_is_not_forged(hostile):
    rc, out, err = cli("validate", "-v", hostile)
    assert rc == 0, err
    assert_shown_safely(out, err)
    assert f"checked w{ESCAPED}" in err.decode() and "(5000 characters)" in err.decode()
    lines = out.decode().splitlines()
    assert lines[-1].startswith("OK: ") and sum(line.startswith("OK") for line in lines) == 1
    assert any(line.startswith("WARNING  data/f\\x1b[2J") for line in lines), lines
    rc, out, _ = in_process("validate", hostile, "--json")
    assert rc == 0 and json.loads(out)["warnings"][0].startswith("data/f" + FILE_SAFE)


def test_an_error_naming_checkpoints_in_a_directory_is_one_escaped_line(tmp_path):
    _committed(tmp_path / ("ck" + FILE_SAFE))
    rc, out, err = cli("inspect", tmp_path)
    assert rc == 2 and out == b""
    assert_shown_safely(err)
    assert err.count(b"\n") == 1 and f"holding checkpoints (newest first: ck{ESCAPED}" in err.decode()


def test_a_load_of_a_missing_checkpoint_names_the_ones_beside_it_escaped(tmp_path):
    _committed(tmp_path / ("ck" + FILE_SAFE))
    with pytest.raises(ldc.CheckpointNotFoundError) as e:
        ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(2))}, tmp_path / "missing")
    assert f"newest first: ck{ESCAPED}" in str(e.value) and "\x1b" not in str(e.value)


def test_clean_lists_a_hostile_staging_directory_escaped(tmp_path):
    (tmp_path / (".distckpt-staging-ck" + FILE_SAFE)).mkdir()
    rc, out, err = cli("clean", "--dry-run", "--older-than", "0", tmp_path)
    assert rc == 0, err
    assert_shown_safely(out, err)
    assert f"would remove {tmp_path}/.distckpt-staging-ck{ESCAPED}" in out.decode()


def test_inspect_of_a_torch_file_and_a_dcp_directory_escapes_their_names(tmp_path):
    import torch.distributed.checkpoint as dcp

    torch.save({"t" + HOSTILE: torch.ones(2), "entry" + HOSTILE: 3}, tmp_path / "m.pt")
    dcp.save({"d" + HOSTILE: torch.ones(2)}, checkpoint_id=str(tmp_path / "dcp"))
    for path, names in [("m.pt", ["t", "entry"]), ("dcp", ["d"])]:
        rc, out, err = cli("inspect", tmp_path / path)
        assert rc == 0, err
        assert_shown_safely(out, err)
        assert all(f"{n}{ESCAPED}" in out.decode() for n in names), out


def test_a_warning_record_naming_a_hostile_directory_is_escaped(tmp_path):
    """A commit killed before its rename, in a staging directory whose name (the older form:
    ``.NAME.distckpt-staging-ID``) is anyone's: the command finishes it and logs a WARNING naming it."""
    planted = tmp_path / (".ck.distckpt-staging-" + FILE_SAFE)
    _committed(planted)
    rc, out, err = cli("inspect", tmp_path / "ck")
    assert rc == 0, err
    assert_shown_safely(out, err)
    assert "WARNING lightning_distckpt" in err.decode() and f"staging-{ESCAPED}" in err.decode()


def test_a_missing_keys_error_cuts_a_long_checkpoint_key_and_escapes_a_hostile_one(hostile):
    template = {"x": ldc.ShardedTensor.from_rank_offsets("w" + HOSTILE[:-1], torch.zeros(3))}
    with pytest.raises(ldc.MissingKeysError) as e:
        ldc.load(template, hostile, strict="raise_all")
    message = str(e.value)
    assert "(5000 characters)" in message and LONG not in message and len(message) < 2000
    assert not RAW.search(message.encode()) and "Did you mean: 'w\\x1b[2J" in message


def test_a_malformed_entry_under_a_huge_key_is_named_cut_short(tmp_path):
    """metadata.json naming a tensor by 100000 characters, with a dtype no reader knows: the error
    names the field by the key's start and end and its length, not by the whole key."""
    ck = tmp_path / "ck"
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.ones(2))}, ck)
    huge = "K" * 100_000 + HOSTILE

    def add(meta):
        meta["tensors"][huge] = dict(meta["tensors"]["w"], dtype="nope")

    _rewrite_metadata(ck, add)
    with pytest.raises(ldc.FormatError) as e:
        ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(2))}, ck)
    message = str(e.value)
    assert f"({len(huge)} characters)" in message and len(message) < 2000 and not RAW.search(message.encode())


def test_a_file_name_that_is_no_utf8_is_shown_not_a_traceback(tmp_path):
    """A name of bytes that are no UTF-8 reads as lone surrogates, which a UTF-8 terminal's strict
    encoder refuses: the command printed a traceback instead of its summary."""
    ck = tmp_path / "ck"
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.ones(2))}, ck)
    with open(os.path.join(os.fsencode(ck), b"data", b"bad\xff\x1b[2J"), "w") as f:
        f.write("planted")
    rc, out, err = cli("inspect", ck, env={"PYTHONIOENCODING": "utf-8:strict"})
    assert rc == 0 and err == b"", err
    assert_shown_safely(out)
    assert "foreign      data/bad\\udcff\\x1b[2J: a regular file" in out.decode()


def _on_a_terminal(*args):
    """``python -m lightning_distckpt ARGS`` with stderr on a pseudo-terminal (a progress bar is
    drawn): exit status, stdout, and every byte the terminal received."""
    return run_on_terminal([sys.executable, "-m", "lightning_distckpt", *args])


def test_above_a_progress_bar_names_and_records_are_escaped(tmp_path, hostile):
    """``validate -v`` on a terminal: the bar is drawn, the WARNING of a finished interrupted commit
    (whose staging directory's name is anyone's) and each key checked go above it, escaped. The
    bar's own control characters are allowed; the checkpoint's are not."""
    import shutil

    shutil.copytree(hostile, tmp_path / (".ck.distckpt-staging-" + FILE_SAFE))
    rc, out, term = _on_a_terminal("validate", "-v", tmp_path / "ck")
    assert rc == 0, (out, term)
    assert_shown_safely(out)
    for raw in (b"\x1b[2J", b"\x1b]0;", b"\x1b]8;", b"\x07", b"\xe2\x80\xae", b"OK fake"):
        assert raw not in term.replace(b"\\rOK fake", b""), (raw, term)
    text = term.decode()
    assert f"checked w{ESCAPED}" in text and "WARNING lightning_distckpt" in text and f"staging-{ESCAPED}" in text
    assert "100%" in text  # the bar was drawn


def test_a_log_records_percent_r_argument_is_its_own_repr_not_the_repr_of_its_escaped_text():
    """``%r`` of a hostile name shows ``repr(name)`` (already escaped by Python), not the repr of the
    escaped text with every backslash doubled; ``%s`` shows it escaped; a long one is cut either way."""
    from lightning_distckpt.cli.output import ShownFormatter

    def formatted(msg, *args):
        return ShownFormatter("%(message)s").format(logging.LogRecord("t", logging.INFO, __file__, 1, msg, args, None))

    assert formatted("key %r", "a\nb\x1b[2J") == "key 'a\\nb\\x1b[2J'"
    assert formatted("key %s", "a\nb\x1b[2J") == "key a\\nb\\x1b[2J"
    assert formatted("keys %r", ["a\nb"]) == "keys ['a\\nb']"
    cut = formatted("key %r", LONG * 2)
    assert cut.startswith("key 'LLL") and "(10000 characters)'" in cut and len(cut) < 5000
    assert formatted("%d of %s", 3, "x\ry") == "3 of x\\ry"


UNDER_LIGHTNING = """
import sys, torch, lightning
import lightning_distckpt as ldc
ldc.lightning.DistCheckpointIO()  # what a Trainer / Fabric run has: our records go to Lightning's handler
ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(4))}, sys.argv[1])
"""


def test_a_hostile_path_in_a_record_printed_under_lightning_is_escaped(tmp_path):
    """Under a Trainer our INFO line ("save PATH: ... in ... s") goes to Lightning's handler on the
    terminal: the path a user or a directory listing supplied arrives there escaped."""
    target = tmp_path / ("ck" + FILE_SAFE.replace("\\", ""))  # a save refuses a backslash in its path
    r = subprocess.run([sys.executable, "-c", UNDER_LIGHTNING, str(target)], capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_shown_safely(b"", r.stderr)
    assert f"ck{ESCAPED}".encode() in r.stderr and b"save " in r.stderr, r.stderr[-2000:]
