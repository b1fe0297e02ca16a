"""``DistCheckpointModelParallelStrategy``: Lightning's ``ModelParallelStrategy`` (FSDP2 and tensor
parallelism through DTensor) saving and loading our distributed checkpoints instead of DCP.

The module is parallelized in ``LightningModule.configure_model`` as under the stock strategy
(``fully_shard`` over ``self.device_mesh["data_parallel"]``, ``parallelize_module`` over
``self.device_mesh["tensor_parallel"]``). A checkpoint holds Lightning's usual dict:

* ``state_dict``: ``get_model_state_dict`` (sharded): each DTensor is one sharded tensor keyed
  ``state_dict/<fqn>`` (global shape and offset from its mesh and placements, replicas stored
  once); a plain tensor (a buffer, an unsharded parameter) is stored once, from rank 0.
* ``optimizer_states``: ``get_optimizer_state_dict`` (keyed by parameter name), each DTensor
  moment keyed ``optimizer_states/<i>/state/<fqn>/<name>``; scalars and param groups are common state.
* everything else (loops, callbacks, schedulers, hyper-parameters): common state.

Keys depend only on the module's names, never on the mesh, so a checkpoint resumes under any world size, DP x TP
split or placement. Read whole (``DistCheckpointIO``, ``convert``) it is the stock Trainer dict.

A checkpoint directory Lightning's own ``ModelParallelStrategy`` wrote (DCP files and ``meta.pt``) is
read as that strategy reads it (resharded by ``torch.distributed.checkpoint``, ``meta.pt`` weights-only),
so a stock run moves to this strategy with ``ckpt_path=<its checkpoint>``; later saves are ours.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import os
from datetime import timedelta
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.tensor import DTensor, Replicate
from torch.optim import Optimizer

from ..comm import get_comm
from ..core.dtensors import dtensor_key, dtensor_to_sharded, restore_dtensor
from ..core.errors import CheckpointingError
from ..core.mapping import ShardedTensor
from ..core.plain_tensors import shard_tensors
from ..core.tree_walk import copy_containers, map_paths
from ..optim.restore_checks import load_checked
from ..registration import is_placeholder
from ..storage.paths import checkpoint_location
from .foreign import fabric_writer, foreign_writer
from .async_warmup import AsyncWarmupMixin, Held, staged_share
from .collectives import TrainerCollectivesMixin
from .restore_source import RestoreSource
from .config import DistCheckpointConfig, load_checkpoint_config
from .sharded import AFTER_READING, build_on_all_ranks, describe_source, tree_or_failing
from .sharded_only import sharded_only
from .stock import (REST_KEY, ModuleEntry, OptimizerEntry, StoredLayout, is_tree_path_layout, place_stored_tensors,
                    rekey_template, restore_param_keys)
from .strategy import warn_async_link_last
from .tiers import is_tier_marker, with_tier_callback
from .tiers_restore import load_model_parallel_recovery
from .snapshot_fence import BackgroundSnapshotMixin
from .tp_strategy import AsyncCommitHooksMixin, SavedTogetherMixin
from .tree import (KIND_MODEL_PARALLEL, MANIFEST_KEY, leave_out, manifest, put_value, rank_zero_tensors, value_at,
                   without_manifest)

log = logging.getLogger(__name__)

STRATEGY_NAME = "model_parallel_distckpt"
Path = Tuple[Union[str, int], ...]


def shard_tree(node: Any, path: Path, rank: int, dtensors: Dict[Path, DTensor],
               replicas: Optional[List[Tuple[Dict[Any, Any], Any]]] = None) -> Any:
    """``node`` with each DTensor replaced by its ShardedTensor (keyed by its path, sharing the local tensor's
    memory; recorded in ``dtensors``) and each other tensor of 1-d or more by a whole one replicated on every rank
    (stored from rank 0: a save's ``replicas`` gets their places (dict, key) on other ranks, for ``leave_out``;
    FSDP2 keeps the parameters equal on every rank, not the buffers). Scalars and non-tensors stay common state.
    Dicts and lists are copied (a bounded walk, :mod:`~lightning_distckpt.core.tree_walk`: a tree nested too deep
    or containing itself is a FormatError naming the place); tuples are leaves."""
    seen: Dict[tuple, torch.Tensor] = {}
    plain: Dict[int, ShardedTensor] = {}  # the plain tensors' ShardedTensors by id

    def leaf(steps: Path, value: Any) -> Any:
        here = path + steps
        if isinstance(value, DTensor):
            dtensors[here] = value
            st = on_sub_mesh(dtensor_to_sharded(dtensor_key(here), value), value)
            data = one_local(seen, st.data)
            return st if data is st.data else dataclasses.replace(st, data=data)
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            st = ShardedTensor.from_rank_offsets(dtensor_key(here), one_local(seen, value.detach()), replica_id=rank)
            return plain.setdefault(id(st), st)
        return value

    def build(node: Any, keys: Optional[List[Any]], results: List[Any]) -> Any:
        out = copy_containers(node, keys, results)
        if replicas is not None and rank != 0 and isinstance(out, dict):  # in a list, any holder's
            replicas.extend((out, k) for k, v in out.items() if id(v) in plain)
        return out

    where = f"the checkpoint's {dtensor_key(path)!r}" if path else "the checkpoint"
    return map_paths(node, leaf, build, where=where, types=(dict, list))


def on_sub_mesh(st: ShardedTensor, dt: DTensor) -> ShardedTensor:
    """``st``, not main where ``dt``'s mesh lacks global rank 0: on a 2-D mesh FSDP2 shards a parameter left out of
    TP (a LayerNorm) over the ``data_parallel`` sub-mesh only, so each TP rank's sub-mesh holds the same shards
    as main (a save refused: "a main replica on ranks 2 and 3"). Every rank holds every parameter under these
    strategies: as a plain tensor's (main on rank 0), the sub-mesh with rank 0 writes it."""
    if bool(((ranks := dt.device_mesh.mesh) == 0).any()):
        return st
    rid = st.replica_id if isinstance(st.replica_id, tuple) else (st.replica_id,)
    return dataclasses.replace(st, replica_id=(int(ranks.min()), *rid))  # the sub-mesh's first rank: never 0


def one_local(seen: Dict[tuple, torch.Tensor], local: torch.Tensor) -> torch.Tensor:
    """``local``, or the tensor already taken for the same memory: a state dict detaches each entry anew, so a
    tied parameter's names (an embedding tied to the output layer) come as distinct tensors, and only one
    object for both lets a load see the tie (reading/tied.py: a key saved once fills its twin)."""
    if local.numel() == 0 or local.is_meta:  # no memory to tell them apart
        return local
    where = (local.device, local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape),
             local.stride(), local.dtype)
    return seen.setdefault(where, local)


def drop_unsaved_states(template: Dict[str, Any], optimizers: List[Path], stored: Any,
                        dtensors: Dict[Path, DTensor]) -> None:
    """For a non-strict load. torch keeps no optimizer state for a parameter before its first gradient (a
    layer not used yet, an expert no token went to), but the template of a fresh optimizer (torch's
    ``_init_optim_state``: one step on zero gradients) has state for every one. A strict load refuses such
    a checkpoint (as torch's ``set_optimizer_state_dict`` does); a non-strict one kept the template's, a
    step the parameter never took (Adam went on from step 2). A parameter of which the checkpoint (its
    ``stored`` tensor keys) holds no state is left out of the templates at ``optimizers`` (and of
    ``dtensors``): restored, it has none, as when it was saved."""
    for where in optimizers:
        state = value_at(template, where).get("state")
        if not isinstance(state, dict):
            continue
        for fqn in [f for f, names in state.items() if isinstance(names, dict)
                    and not any(dtensor_key(where + ("state", f, n)) in stored for n in names)]:
            del state[fqn]
            gone = where + ("state", fqn)
            for place in [p for p in dtensors if p[:len(gone)] == gone]:
                del dtensors[place]


class DistCheckpointModelParallelStrategy(TrainerCollectivesMixin, SavedTogetherMixin, AsyncWarmupMixin,
                                          BackgroundSnapshotMixin, AsyncCommitHooksMixin, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 + tensor parallel) with our checkpoint format. ``Trainer(strategy=
    DistCheckpointModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2), devices=4)``, or ``strategy=
    "model_parallel_distckpt"`` (DP = the nodes, TP = the devices per node, as stock's ``"auto"``).

    Args:
        data_parallel_size / tensor_parallel_size / process_group_backend / timeout / save_distributed_checkpoint: as
            :class:`~lightning.pytorch.strategies.ModelParallelStrategy`; only True taken: each rank saves its shards.
        checkpoint: checkpoint settings (:class:`DistCheckpointConfig`, mapping, or YAML path), e.g.
            ``{"async_save": True}``; a ``DistCheckpointIO`` plugin given to the Trainer takes precedence.
    """

    strategy_name = STRATEGY_NAME
    refuses_unused_weights = False  # as stock ModelParallelStrategy: a checkpoint's extra layer is left unread

    def __init__(self, data_parallel_size: Union[Literal["auto"], int] = "auto",
                 tensor_parallel_size: Union[Literal["auto"], int] = "auto",
                 checkpoint: Optional[Union[str, Dict[str, Any], DistCheckpointConfig]] = None,
                 process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = default_pg_timeout, save_distributed_checkpoint: bool = True) -> None:
        super().__init__(data_parallel_size, tensor_parallel_size, sharded_only(self, save_distributed_checkpoint),
                         process_group_backend, timeout)  # stock's order: (dp, tp, save_distributed_checkpoint, ...)
        self._checkpoint_config: DistCheckpointConfig = load_checkpoint_config(checkpoint)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Lightning's registration hook: ``strategy="model_parallel_distckpt"``."""
        if STRATEGY_NAME not in strategy_registry or is_placeholder(strategy_registry[STRATEGY_NAME]):
            strategy_registry.register(STRATEGY_NAME, cls, override=True,
                                       description="FSDP2 / tensor parallel with distributed checkpoints")

    def setup_environment(self) -> None:
        self.checkpoint_io  # fail early (before any process group exists) on a foreign CheckpointIO
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self._check_checkpoint_dirs(trainer)
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self.checkpoint_io.config.async_save:
            warn_async_link_last(trainer)

    # -- what Lightning puts in the checkpoint dict: DTensors, not gathered, not copied ------
    def lightning_module_state_dict(self) -> Dict[str, Any]:
        assert self.model is not None
        return get_model_state_dict(self.model, options=StateDictOptions())

    def optimizer_state(self, optimizer: Optimizer) -> Dict[str, Any]:
        assert self.model is not None
        return get_optimizer_state_dict(self.model, _raw(optimizer), options=StateDictOptions())

    def _raw_optimizers(self) -> List[Optimizer]:
        return [_raw(o) for o in self.optimizers]

    def _staged_bytes_estimate(self) -> Tuple[int, bool]:
        """What a save stages on this rank (see :func:`shard_tree`): the local shards of its DTensors
        (parameters and optimizer moments), each shared among the ranks holding a replica of it, and
        on rank 0 its plain tensors (rank 0 writes them); and whether any is on an accelerator."""
        assert self.lightning_module is not None
        tensors = [*self.lightning_module.parameters(), *self.lightning_module.buffers()]
        tensors += [v for o in self._raw_optimizers() for st in o.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0]
        held = [_held(t, self.global_rank, self.world_size) for t in tensors]  # plain ones: rank 0 writes them
        return staged_share([h for h in held if h[2] or h[1] > 1], self.checkpoint_io.config.balance_writes)

    # -- save and load ---------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Collective: every rank saves its shards of the model and optimizer state; the rest of
        ``checkpoint`` is common state. The path is rank 0's (as Lightning's ModelParallelStrategy
        broadcasts it); a rank that cannot build its tree fails the save's handshake
        (:func:`~.sharded.failing_tree`)."""
        self.saving_together()
        path = os.fspath(self.broadcast(checkpoint_location(filepath, "filepath")))
        tree = tree_or_failing(lambda: self.checkpoint_tree(checkpoint))
        self.checkpoint_io.save_sharded(tree, path, storage_options=storage_options,
                                        background_snapshot=self.snapshot_selector())
        self.saved_together()

    def sharded_checkpoint(self, checkpoint: Dict[str, Any], what: str) -> Dict[str, Any]:
        """Collective: the tree :meth:`save_checkpoint` saves for Lightning's ``checkpoint`` dict (a
        failure on any rank raised on every rank; ``what`` names the save in errors)."""
        return build_on_all_ranks(what, lambda: self.checkpoint_tree(checkpoint))

    def checkpoint_tree(self, checkpoint: Dict[str, Any]) -> Dict[str, Any]:
        """This rank's tree for Lightning's ``checkpoint`` dict, built locally (no collective): the
        module's and optimizers' DTensor shards, the rest common state."""
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        tree = rank_zero_tensors(rest, self.global_rank)  # rank 0's, as stock saves them
        replicas: List[Tuple[Dict[Any, Any], Any]] = []
        for entry in ("state_dict", "optimizer_states"):
            if entry in checkpoint:
                tree[entry] = shard_tree(checkpoint[entry], (entry,), self.global_rank, {}, replicas)
        tree[MANIFEST_KEY] = manifest(tree, KIND_MODEL_PARALLEL, ordered_as=checkpoint)
        return leave_out(tree, replicas)  # plain tensors (buffers) rank 0's, as stock's full state dict saves them

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        options = self.checkpoint_io.config.tier_options
        if options is not None:  # tiers: a TierCheckpoint before ckpt_path resolves
            self._launcher = with_tier_callback(self._launcher, options)

    def template(self, optimizers: List[Optimizer], dtensors: Dict[Path, DTensor]) -> Dict[str, Any]:
        """The module's (and ``optimizers``') state as this strategy saves it, each DTensor recorded
        in ``dtensors`` by its path."""
        assert self.model is not None
        template: Dict[str, Any] = {"state_dict": get_model_state_dict(self.model)}
        if optimizers:
            template["optimizer_states"] = [get_optimizer_state_dict(self.model, o) for o in optimizers]
        return {k: shard_tree(v, (k,), self.global_rank, dtensors) for k, v in template.items()}

    def set_states(self, loaded: Dict[str, Any], optimizers: List[Optimizer]) -> Dict[str, Any]:
        """Collective: the loaded module and optimizer state into the model and ``optimizers``; returns the rest.
        Every state is set on every rank (torch's state-dict calls may communicate) and the outcome agreed: a
        rank that cannot take its state (a ``load_state_dict`` hook raising) fails every rank, not that rank
        alone while the others train on into a collective it never enters. The same words from a durable and a
        local-tier restore (Lightning's log names the checkpoint)."""
        assert self.model is not None
        options = StateDictOptions(strict=not self._strict_handling().skips_unexpected)
        error: Optional[Exception] = None
        try:
            set_model_state_dict(self.model, loaded.pop("state_dict"), options=options)
        except Exception as e:  # agreed below, after the optimizers
            error = e
        for i, (opt, state) in enumerate(zip(optimizers, loaded.pop("optimizer_states", []))):
            try:
                load_checked(opt, lambda: set_optimizer_state_dict(self.model, opt, state, options=options),
                             f"optimizer_states[{i}] ({type(opt).__name__})")
            except Exception as e:  # agreed below
                error = error or e
        get_comm().agree(f"restore of the loaded module and optimizer state {AFTER_READING}", error)
        return loaded

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Collective: every rank reads its shards into its parameters and optimizer state (under
        any mesh) and the common state. ``weights_only`` is accepted for the signature: loading is
        always safe."""
        path = os.fspath(self.broadcast(checkpoint_location(checkpoint_path, "checkpoint_path")))
        assert self.model is not None and self.lightning_module is not None
        if is_tier_marker(path):  # ckpt_path="last" with tiers: the newest recoverable step of any tier
            return load_model_parallel_recovery(self, path)
        extra = self.checkpoint_io.extra_safe_globals
        dcp = self.checkpoint_io.open_source(path) if is_lightning_dcp(path) else None
        if dcp is not None and describe_source(dcp, extra).by_trainer:
            # Lightning's own ModelParallelStrategy wrote it (DCP): read as the stock strategy reads it,
            # resharded to this mesh by torch.distributed.checkpoint; meta.pt is read weights-only.
            log.info("checkpoint %s: Lightning's ModelParallelStrategy (DCP) layout, read as the stock strategy "
                     "reads it; the next save is in lightning_distckpt's format", path)
            return super().load_checkpoint(path, **stock_weights_only(super().load_checkpoint))
        optimizers = self._raw_optimizers()  # none unless fitting (the stock strategy resets them)
        dtensors: Dict[Path, DTensor] = {}
        orders: List[List[str]] = []  # each optimizer's parameter names, in its order
        strict = self._strict_handling()

        def build() -> Tuple[StoredLayout, RestoreSource]:
            # Opened once (a DCP directory above already): who wrote it, the re-keyed template and the load share it.
            source = dcp if dcp is not None else self.checkpoint_io.open_source(path)
            saved = describe_source(source, extra)
            by_path = is_tree_path_layout(path, saved.kind)
            if (saved.kind != KIND_MODEL_PARALLEL and not by_path) or not saved.by_trainer:
                raise CheckpointingError(refusal(path, saved.kind, saved.by_trainer))
            template = self.template(optimizers, dtensors)
            if not by_path:
                if strict.skips_unexpected:
                    kept = range(len(template.get("optimizer_states", [])))
                    drop_unsaved_states(template, [("optimizer_states", i) for i in kept], source.index.tensors,
                                        dtensors)
                # Plain tensors (an optimizer's 0-d step) keyed by path as saves store them (strict loads name them)
                return StoredLayout(shard_tensors(template, self.global_rank), {}), source
            # A stock .ckpt or the plugin's directory: the same names, but optimizer state by index.
            orders.extend(_param_order(s) for s in template.get("optimizer_states", []))
            entries = [OptimizerEntry(f"optimizer_states/{i}", {"state": s["state"], "param_keys": order})
                       for i, (s, order) in enumerate(zip(template.get("optimizer_states", []), orders))]
            return rekey_template(source, template, {"state_dict": ModuleEntry("state_dict/", "state_dict/")},
                                  entries, ("state_dict/", "optimizer_states/"), extra), source

        layout, source = build_on_all_ranks(f"load from {path}", build)
        loaded = self._load_modules(layout.template, source, ["state_dict"], self._strict_loading(), strict=strict)
        loaded = without_manifest(loaded, path)  # its dicts' keys in the saved order, as torch.load gives them
        for where, dt in dtensors.items():  # the loaded local shards, back in their DTensors
            put_value(loaded, where, restore_dtensor(dt, value_at(loaded, where)))
        if REST_KEY in layout.template:
            loaded = place_stored_tensors(loaded, layout, path)
            loaded["optimizer_states"] = [_by_name(restore_param_keys(s, order, path))
                                          for s, order in zip(loaded.get("optimizer_states", []), orders)]
        return self.set_states(loaded, optimizers)

    def teardown(self) -> None:
        self.checkpoint_io.teardown()  # the stock strategy skips CheckpointIO.teardown: commit a pending save
        super().teardown()


def stock_weights_only(load: Any) -> Dict[str, bool]:
    """``weights_only=True`` for the stock strategy's ``load_checkpoint`` where it takes the argument
    (Lightning 2.6+); before that it has none, and reads meta.pt with ``torch.load``'s default
    (weights-only from torch 2.6 on)."""
    return {"weights_only": True} if "weights_only" in inspect.signature(load).parameters else {}


def is_lightning_dcp(path: str) -> bool:
    """A directory Lightning's ``ModelParallelStrategy`` (Trainer's or Fabric's) saved: DCP's ``.metadata``
    and Lightning's ``meta.pt`` (everything but the modules and optimizers), and no manifest of ours."""
    return (os.path.isfile(os.path.join(path, ".metadata")) and os.path.isfile(os.path.join(path, "meta.pt"))
            and not os.path.isfile(os.path.join(path, "metadata.json")))


def refusal(path: str, kind: Optional[str], by_trainer: bool,
            owner: str = "DistCheckpointModelParallelStrategy") -> str:
    """Why a checkpoint not written by ``owner`` is refused, and what to do instead."""
    if not by_trainer:
        writer = fabric_writer(kind)
    elif kind is None:
        writer = ("by a Trainer under a stock strategy (one torch.save .ckpt file)" if os.path.isfile(path)
                  else foreign_writer(path))
    elif kind == KIND_MODEL_PARALLEL:
        writer = "by a Trainer under DistCheckpointModelParallelStrategy"
    else:
        writer = {"plain": "by DistCheckpointIO under a rank-0 strategy (DDP / single device)",
                  "sharded": "by DistCheckpointStrategy"}.get(kind, f"by a writer of kind {kind!r}")
    return (f"checkpoint {path} was written {writer}, not by {owner}; "
            "resume it with the strategy that wrote it, or load its weights into this module with "
            "lightning_distckpt.load(template, path, key_map=...) in configure_model / on_fit_start")


def _param_order(optimizer_state: Dict[str, Any]) -> List[str]:
    """Parameter names in the optimizer's order (torch's state-dict API names them in param groups)."""
    return [p for g in optimizer_state["param_groups"] for p in g["params"] if isinstance(p, str)]


def _by_name(restored: Dict[str, Any]) -> Dict[str, Any]:
    return {"state": restored["state"], "param_groups": restored["param_groups"]}


def _held(t: torch.Tensor, rank: int, world_size: int) -> Held:
    """``t`` as :func:`shard_tree` describes it here: a DTensor's local shard, replicated over its ``Replicate()`` dims
    and a sub-mesh's copies (main at coordinates 0, on rank 0's sub-mesh); a plain tensor written by rank 0 alone."""
    if not isinstance(t, DTensor):
        return t.detach(), 1, rank == 0
    mesh, coordinate = t.device_mesh, t.device_mesh.get_coordinate()
    dims = [i for i, p in enumerate(t.placements) if isinstance(p, Replicate)]
    replicas = math.prod(mesh.size(i) for i in dims) * max(1, world_size // mesh.size())  # and the sub-mesh's copies
    return t.to_local(), replicas, bool((mesh.mesh == 0).any()) and (coordinate is None or
                                                                     all(coordinate[i] == 0 for i in dims))


def _raw(optimizer: Any) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


DistCheckpointModelParallelStrategy.register_strategies(StrategyRegistry)
