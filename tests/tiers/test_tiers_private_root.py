"""The node-local root must be private to this user (``tiers/private_root.py``): the default lives in
``/dev/shm``, which every user of a node can write, and a root another user made or can write would let
them plant a committed step that recovery restores, or read the job's weights.

What a missing root needs is made with mode 0700; a root (or a directory above it, or a link on the way)
that another user owns or can write is refused with ``ArgumentError`` on every rank, before
anything is written into it or read from it. Ownership by another user is made with ``chown``, so
those cases need root (CI runs as root); the mode cases run for anyone.
"""

import os
import stat

import pytest

from dist_utils import run_distributed
from lightning_distckpt import ArgumentError
from lightning_distckpt.tiers import LocalTier
from lightning_distckpt.tiers.private_root import ensure_private_root, unsafe_reason
from tier_helpers import check_loaded, options, state

pytestmark = pytest.mark.tiers

OTHER_UID = 54321  # a user id no one on the test machine has
needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                                reason="making a directory another user's needs chown (root)")


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def _tree(path):
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def test_missing_components_are_made_private(tmp_path):
    os.chmod(tmp_path, 0o700)
    root = tmp_path / "a" / "b" / "node0"
    old = os.umask(0o000)  # the most permissive umask: makedirs would make 0777 directories
    try:
        ensure_private_root(str(root))
    finally:
        os.umask(old)
    assert [_mode(p) for p in (tmp_path / "a", tmp_path / "a" / "b", root)] == [0o700] * 3
    assert unsafe_reason(str(root)) is None


def test_an_existing_root_of_ours_is_kept_as_it_is(tmp_path):
    root = tmp_path / "root"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)  # readable by others is the user's choice; writable is not
    ensure_private_root(str(root))
    assert _mode(root) == 0o755


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o703])
def test_a_root_others_can_write_is_refused(tmp_path, mode):
    root = tmp_path / "root"
    root.mkdir()
    os.chmod(root, mode)
    with pytest.raises(ArgumentError, match=f"others can write it \\(mode {mode:o}\\)") as e:
        ensure_private_root(str(root))
    assert str(root) in str(e.value) and "chmod go-w" in str(e.value)


def test_a_directory_above_others_can_write_needs_the_sticky_bit(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # anyone could rename our root away and put theirs in its place
    with pytest.raises(ArgumentError, match="above it can be written by others .*no sticky bit"):
        ensure_private_root(str(shared / "ckpt" / "node0"))
    os.chmod(shared, 0o1777)  # as /tmp and /dev/shm: no one renames what is not theirs
    ensure_private_root(str(shared / "ckpt" / "node0"))
    assert _mode(shared / "ckpt") == 0o700


def test_a_root_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(ArgumentError, match="not a directory"):
        ensure_private_root(str(tmp_path / "f"))


def test_a_link_of_ours_to_a_private_directory_is_followed(tmp_path):
    target = tmp_path / "nvme"
    target.mkdir(mode=0o700)
    os.symlink(target, tmp_path / "ckpt")
    ensure_private_root(str(tmp_path / "ckpt"))
    os.chmod(target, 0o777)
    with pytest.raises(ArgumentError, match=f"the link leads to {target}"):
        ensure_private_root(str(tmp_path / "ckpt"))


def test_a_dangling_link_or_a_component_that_is_a_file_is_an_argument_error(tmp_path):
    os.symlink(tmp_path / "gone", tmp_path / "ckpt")
    with pytest.raises(ArgumentError, match="cannot be made or examined"):
        ensure_private_root(str(tmp_path / "ckpt"))
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(ArgumentError, match="cannot be made or examined"):
        ensure_private_root(str(tmp_path / "f" / "node0"))


@needs_root
def test_a_root_another_user_made_is_refused(tmp_path):
    """The attack: another user made /dev/shm/ckpt before the job (mode 0700, theirs), so every file
    of ours would be theirs to read and replace."""
    root = tmp_path / "ckpt"
    root.mkdir(mode=0o700)
    os.chown(root, OTHER_UID, OTHER_UID)
    with pytest.raises(ArgumentError, match=f"owned by uid {OTHER_UID}, not by this user"):
        ensure_private_root(str(root))


@needs_root
def test_a_directory_above_owned_by_another_user_is_refused(tmp_path):
    parent = tmp_path / "ckpt"
    parent.mkdir(mode=0o755)
    os.chown(parent, OTHER_UID, OTHER_UID)  # its owner can rename node0 away and plant theirs
    node = parent / "node0"
    node.mkdir(mode=0o700)
    with pytest.raises(ArgumentError, match=f"{parent} above it is owned by uid {OTHER_UID}"):
        ensure_private_root(str(node))


@needs_root
def test_a_link_another_user_owns_is_refused(tmp_path):
    """A link in a sticky directory is its owner's to replace, whatever it points at now."""
    target = tmp_path / "mine"
    target.mkdir(mode=0o700)
    link = tmp_path / "ckpt"
    os.symlink(target, link)
    os.lchown(link, OTHER_UID, OTHER_UID)
    with pytest.raises(ArgumentError, match=f"the link {link} on its path is owned by uid {OTHER_UID}"):
        ensure_private_root(str(link))


def _planted(rank, world, tmp):
    """A tier over the nodes' roots; node1's (ranks 2 and 3) can be written by anyone."""
    try:
        LocalTier(options(tmp))
    except ArgumentError as e:
        return ("refused", str(e))
    return ("used", None)


def test_a_hostile_root_on_one_node_is_refused_on_every_rank(tmp_path):
    tmp = str(tmp_path)
    # a good first run makes both nodes' roots and a committed step 10 in each
    run_distributed(_save_step, 4, tmp, 10)
    hostile = os.path.join(tmp, "node1")
    os.chmod(hostile, 0o777)
    before = _tree(hostile)
    results = run_distributed(_planted, 4, tmp)
    assert {r[0] for r in results} == {"refused"} and len({r[1] for r in results}) == 1
    assert f"{hostile} is not private: others can write it (mode 777)" in results[0][1]
    assert "rank 2" in results[0][1] and "rank 3" in results[0][1]
    assert _tree(hostile) == before  # nothing read into a recovery, nothing written or removed
    os.chmod(hostile, 0o700)  # the user fixes the mode: recovery goes on from step 10
    assert run_distributed(_recover, 4, tmp) == [10] * 4


def _save_step(rank, world, tmp, step):
    tier = LocalTier(options(tmp))
    tier.save(state(rank, world, step), step)
    tier.close()


def _recover(rank, world, tmp):
    tier = LocalTier(options(tmp))
    point = tier.recoverable()
    out = tier.load(state(rank, world, 0, template=True), point)
    check_loaded(out, rank, world, point.step)
    tier.close()
    return point.step
