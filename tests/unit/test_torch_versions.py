"""Behaviour that torch releases change under us. torch 2.14 checks every sparse tensor a weights-only
``torch.load`` rebuilt (before: only with ``torch.sparse.check_sparse_tensor_invariants`` on), from a list
its unpickler fills. Our size check replays a ``torch.save`` file's pickle with that unpickler on the meta
device (storage/zip_records.py) and left its meta sparse tensors in the list, so the thread's next
``torch.load`` failed on them. Here the invariants check is turned on: torch 2.13 then does what 2.14 does
(the whole suite also passes on 2.14.1)."""

import pickle
import warnings

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import FormatError, UnsafeContentError


def _sparse(kind: str) -> torch.Tensor:
    with warnings.catch_warnings():  # torch warns that its invariants check is off by default
        warnings.simplefilter("ignore")
        if kind == "sparse_coo":
            return torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([1.0, 2.0]), (4,))
        return torch.eye(3).to_sparse_csr()


@pytest.mark.parametrize("kind", ["sparse_coo", "sparse_csr"])
def test_a_sparse_tensor_is_refused_by_its_kind_when_torch_checks_sparse_tensors(tmp_path, kind):
    path = tmp_path / f"{kind}.pt"
    torch.save({"ok": torch.ones(2), "state_dict": {"w": _sparse(kind)}}, path)
    with torch.sparse.check_sparse_tensor_invariants(enable=True):
        with pytest.raises(FormatError) as refused:
            ldc.load_plain_tensors(path)
    message = str(refused.value)
    # before: "not a readable torch.save archive: NotImplementedError: Cannot copy out of meta tensor"
    assert f"tensor 'state_dict/w' is a {kind} tensor" in message and "meta tensor" not in message, message


class NeverAllowed:
    """A type no allow-list names (argparse.Namespace is on megatron-core's, which a test that imports it adds
    to torch's for the whole process)."""


def test_a_refused_file_leaves_nothing_for_the_next_torch_load_to_check(tmp_path):
    path, other = tmp_path / "refused.pt", tmp_path / "other.pt"
    # the replay rebuilds the sparse tensor, then stops at a type that is not allowed
    torch.save({"w": _sparse("sparse_coo"), "z": NeverAllowed()}, path)
    torch.save({"a": torch.ones(1)}, other)
    with torch.sparse.check_sparse_tensor_invariants(enable=True):
        with pytest.raises(UnsafeContentError, match="NeverAllowed"):
            ldc.load_plain_tensors(path)
        # before: the user's own load in this thread raised NotImplementedError: Cannot copy out of meta tensor
        assert torch.equal(torch.load(other, weights_only=True)["a"], torch.ones(1))


def test_a_nested_tensor_torch_refuses_is_named_as_such_not_offered_for_allow_listing():
    """From torch 2.15 the weights-only unpickler refuses a nested tensor's rebuild itself, before the loaders'
    own check names the layout: the refusal says what the file holds instead of offering to allow-list it."""
    from lightning_distckpt.storage.safe_pickle import _refusal

    said = _refusal(pickle.UnpicklingError("Weights only load failed. Unsupported global: GLOBAL "
                                           "torch._utils._rebuild_nested_tensor was not an allowed global"))
    assert "holds a nested tensor; dense (strided) tensors only" in said
    assert "extra_safe_globals" not in said and "add_safe_globals" not in said
    other = _refusal(pickle.UnpicklingError("Unsupported global: GLOBAL mymodule.Thing"))
    assert "extra_safe_globals=[mymodule.Thing]" in other
