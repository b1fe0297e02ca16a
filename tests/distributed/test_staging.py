"""What killed saves leave behind. A save process SIGKILLed after writing and before its commit leaves
a hidden staging directory; the next save to the same target warns about it; ``clean`` removes it
only once no process on this host writes into it and it has been idle long enough, and never
removes a committed checkpoint whose rename into place was interrupted."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.cli import main
from lightning_distckpt.storage.staging import OWNERS_DIR, new_staging_dir

# The real save path (plan, then this rank's writes) of a single-process save that stops before the
# commit, the way a job killed mid-save does; it holds until killed.
WRITER = """
import sys, torch, lightning_distckpt as ldc
from lightning_distckpt.comm import get_comm
from lightning_distckpt.saving.save import prepare_save, write_local
sd = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((4096,), 7.0)), "step": 99}
prep = prepare_save(sd, sys.argv[1], get_comm())
write_local(prep)
print(prep.staging, flush=True)
sys.stdin.read()
"""


def start_writer(target):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(target)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    staging = proc.stdout.readline().strip()
    assert staging, f"writer failed (exit {proc.poll()})"
    return proc, staging


def kill(proc):
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def good_state():
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(4096.0)), "step": 1}


def clean(capsys, *args):
    assert main(["clean", *map(str, args), "--json"]) == 0
    return {os.path.basename(a["path"]): a for a in json.loads(capsys.readouterr().out)}


def test_killed_save_is_removed_only_once_its_writer_is_gone_and_it_is_idle(tmp_path, capsys):
    target = tmp_path / "ck"
    ldc.save(good_state(), target)  # the previous good checkpoint
    proc, staging = start_writer(target)
    name = os.path.basename(staging)
    try:
        assert name.startswith(".distckpt-staging-") and os.path.isdir(os.path.join(staging, OWNERS_DIR))
        assert "ck" not in name.split("-")[2]  # the name base32-encoded ("mnvq"), never spelled out
        running = clean(capsys, tmp_path, "--older-than", "0")[name]
        assert running["action"] == "kept" and f"pid {proc.pid}" in running["reason"]
    finally:
        kill(proc)
    assert clean(capsys, tmp_path)[name]["action"] == "kept"  # default --older-than 600: too recent to judge
    assert "changed" in clean(capsys, tmp_path)[name]["reason"]
    dry = clean(capsys, tmp_path, "--older-than", "0", "--dry-run")[name]
    assert dry["action"] == "would remove" and dry["bytes"] > 4096 * 4 and os.path.isdir(staging)
    assert clean(capsys, tmp_path, "--older-than", "0")[name]["action"] == "removed"
    assert not os.path.exists(staging)
    assert clean(capsys, tmp_path, "--older-than", "0") == {}
    assert torch.equal(ldc.load_plain_tensors(target)["w"], torch.arange(4096.0))  # untouched
    assert ldc.load_common_state_dict(target)["step"] == 1


def test_next_save_warns_about_the_leftover_and_commits_no_owner_notes(tmp_path, caplog, capsys):
    target = tmp_path / "ck"
    proc, staging = start_writer(target)
    kill(proc)
    with caplog.at_level("WARNING", logger="lightning_distckpt"):
        ldc.save(good_state(), target)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert os.path.basename(staging) in warnings[0] and "never committed" in warnings[0]
    assert f"lightning_distckpt clean {tmp_path}" in warnings[0]
    assert os.path.isdir(staging), "a save must not delete what another save wrote"
    assert main(["inspect", str(target)]) == 0  # inspect points at the leftover too
    assert "leftovers    1 staging director(ies)" in capsys.readouterr().out
    assert OWNERS_DIR not in os.listdir(target)
    assert torch.equal(ldc.load_plain_tensors(target)["w"], torch.arange(4096.0))
    # a save to another checkpoint in the same folder is not about this leftover
    caplog.clear()
    with caplog.at_level("WARNING", logger="lightning_distckpt"):
        ldc.save(good_state(), tmp_path / "other")
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    # given one checkpoint, clean looks at that checkpoint's leftovers only
    assert clean(capsys, tmp_path / "other", "--older-than", "0") == {}
    assert clean(capsys, target, "--older-than", "0")[os.path.basename(staging)]["action"] == "removed"


def test_committed_checkpoint_whose_rename_was_interrupted_is_renamed_into_place(tmp_path, capsys):
    target = tmp_path / "ck"
    ldc.save(good_state(), target)
    stranded = new_staging_dir(str(target))
    os.rename(target, stranded)  # the state a crash between the commit's two renames leaves
    dry = clean(capsys, tmp_path, "--older-than", "0", "--dry-run")[os.path.basename(stranded)]
    assert dry["action"] == "would recover" and dry["committed"] and f"mv {stranded} {target}" in dry["reason"]
    assert os.path.isdir(stranded) and not os.path.exists(target)
    action = clean(capsys, tmp_path, "--older-than", "0")[os.path.basename(stranded)]
    assert action["action"] == "recovered" and action["committed"]
    assert not os.path.exists(stranded)
    assert torch.equal(ldc.load_plain_tensors(target)["w"], torch.arange(4096.0))


def test_clean_of_a_missing_directory_is_a_usage_error(tmp_path, capsys):
    assert main(["clean", str(tmp_path / "absent")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert main(["clean", str(tmp_path)]) == 0
    assert "no leftover staging directories" in capsys.readouterr().out


def test_loading_a_link_to_a_save_that_never_committed_names_the_good_checkpoints(tmp_path, capsys):
    """ModelCheckpoint(save_last="link") links last.ckpt to the newest checkpoint as soon as its save
    is issued; an async save that never finalized leaves the link dangling."""
    ldc.save(good_state(), tmp_path / "step=2.ckpt")
    os.symlink("step=4.ckpt", tmp_path / "last.ckpt")  # what Lightning's _link_checkpoint writes
    template = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(4096))}
    with pytest.raises(ldc.IncompleteCheckpointError) as err:
        ldc.load(template, tmp_path / "last.ckpt")
    msg = str(err.value)
    assert "a link to step=4.ckpt, which does not exist" in msg and "never committed" in msg
    assert f"committed checkpoints in {tmp_path}, newest first: step=2.ckpt" in msg
    assert main(["inspect", str(tmp_path / "last.ckpt")]) == 2
    assert "step=2.ckpt" in capsys.readouterr().err
    # a committed copy stranded by an interrupted rename is renamed into place by the load
    os.rename(tmp_path / "step=2.ckpt", new_staging_dir(str(tmp_path / "step=2.ckpt")))
    assert torch.equal(ldc.load(template, tmp_path / "step=2.ckpt")["w"], torch.arange(4096.0))


def test_next_save_does_not_count_what_is_not_ours_as_its_leftovers(tmp_path, caplog, capsys):
    """A user's directory left at a removal's aside name and a symbolic link at a staging name: the next save
    names them as not ours and left alone (clean leaves them too), and does not count them as staging directories
    of earlier saves for clean to remove (before: "2 staging directories of earlier saves ... Remove them with
    clean", which refuses both)."""
    from lightning_distckpt.storage.staging import removal_aside
    from user_files import tree_digest, users_dir

    target = tmp_path / "ck"
    mine = users_dir(removal_aside(str(target)))
    kept = tree_digest(mine)
    link = new_staging_dir(str(target))
    os.symlink(str(tmp_path / "elsewhere"), link)
    with caplog.at_level("WARNING", logger="lightning_distckpt"):
        ldc.save(good_state(), target)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    said = warnings[0]
    assert os.path.basename(mine) in said and os.path.basename(link) in said and "not ours" in said, said
    assert "never committed" not in said and "Remove them" not in said, said
    actions = clean(capsys, tmp_path, "--older-than", "0")
    assert {actions[os.path.basename(p)]["action"] for p in (mine, link)} == {"kept"}, actions
    assert tree_digest(mine) == kept and os.path.islink(link)
    assert torch.equal(ldc.load_plain_tensors(target)["w"], torch.arange(4096.0))
