"""The knobs users toggle, as omegaconf structured configs (YAML files in ``configs/``).

:class:`DistCheckpointConfig` is the schema: a YAML file, a dict or a DictConfig is merged into it
with ``OmegaConf.merge``, so an unknown key or a value of the wrong type fails with omegaconf's
error naming the key (and the file), and omitted keys keep their defaults. Choices (layout,
strictness) are checked when the merged config is turned into the dataclass.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import io
import os
import typing
from dataclasses import dataclass, field, fields
from typing import Any, List, Mapping, Optional, Sequence, Tuple, Union

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from ..core.errors import CheckpointingError, ConfigError
from ..core.strict import StrictHandling
from ..planning.load_plan import CAST_RULES, SAME_KIND
from ..storage.tensorstore_io import StorageOptions
from ..reading.loaders import LOADER_NAMES
from ..tiers import TierOptions

ConfigLike = Union["DistCheckpointConfig", "StrategyConfig", Mapping[str, Any], DictConfig, str, os.PathLike, None]


@dataclass
class TiersConfig:
    """The ``tiers:`` section: :class:`~lightning_distckpt.tiers.TierOptions`' fields (docs/tiers.md).
    A structured config of its own (TierOptions is frozen, which omegaconf cannot merge into); it is
    checked by building the TierOptions."""

    local_dir: str = MISSING
    local_every_n_steps: int = 50
    keep_local: int = 2
    replicas: int = 1
    durable_every_n_steps: Optional[int] = None
    node: Optional[str] = None
    ranks_per_node: Optional[int] = None
    max_staging_bytes: Optional[int] = None

    def options(self) -> TierOptions:
        """The :class:`TierOptions` these settings give (its checks raise ArgumentError naming the field)."""
        if self.local_dir == MISSING:  # built in Python without it: omegaconf's "???" is no directory to write into
            raise ConfigError("local_dir is required: the node-local directory the tier writes into")
        return TierOptions(**{f.name: getattr(self, f.name) for f in fields(self)})


@dataclass
class DistCheckpointConfig:
    """Everything that shapes how a distributed checkpoint is saved and loaded.

    Attributes:
        storage: how arrays are stored (the YAML ``storage:`` section holds
            :class:`~lightning_distckpt.StorageOptions`' fields).
        balance_writes: parallel save: spread the writes of replicated shards over the ranks that hold
            them (off: each shard's main replica writes it).
        validate_access_integrity: check before writing that the shards tile every tensor exactly once.
        strict: key-mismatch handling on load, a :class:`~lightning_distckpt.StrictHandling` value
            (e.g. ``assume_ok_unexpected``, ``log_all``, ``raise_all``, ``ignore_all``), in Megatron-Core's
            meaning. ``null`` (the default): ``assume_ok_unexpected``, and the strategies load a module as
            their stock ones do: with ``strict_loading`` / ``fabric.load(strict=True)``, a checkpoint's module
            weights the module does not ask for are refused too, except under the ModelParallel subclasses,
            which leave them unread as stock's do (docs/lightning.md "Strictness").
        loader: which loader reads checkpoints: ``every_rank`` (each rank reads what it needs),
            ``parallel`` (each unique chunk read once, exchanged), ``two_stage`` (read once per
            data-parallel group and broadcast within it; the strategies pass their DP group), or
            ``null`` for the library's default.
        async_save: save in the background; the next save (or the end of training) waits for it.
        max_staging_bytes: with ``async_save``, the most host memory (bytes per rank) a background
            save may add, 32 MiB of it left to the writer's buffers and the rest to the snapshot
            (``AsyncSaver(max_staging_bytes=...)``); a larger state is saved in waves and the save
            blocks until all but the last wave are written. ``null``: no limit (the whole state is
            staged).
        background_snapshot: with ``async_save``, under our strategies, the snapshot of the parameters
            and optimizer state is copied by the save's background thread while training goes on, and
            the strategy waits for it before the next optimizer step (the Trainer's also before the
            other hooks that may change them: epoch ends, validation, the end of training). A save then
            blocks for its planning only. Off: the copy is made before the save returns. See
            docs/loaders.md.
        safe_globals: further trusted types that common state and ShardedObjects may hold, by
            import path (``["io.BytesIO", "argparse.Namespace"]``), added to the plugin's
            ``extra_safe_globals`` (loading never unpickles anything else).
        cast: which dtype conversions a load makes when the module's dtype differs from the
            stored one: ``same_kind`` (floating <-> floating, integer <-> integer, complex <-> complex; others refused)
            or ``any`` (across kinds too, as ``Tensor.to`` converts); ``load(..., cast=)``.
        allow_shape_mismatch: load a tensor whose global shape in the checkpoint differs from the
            module's (a larger one zero-padded, a smaller one truncated; the number of axes must
            match), as ``ShardedTensor(..., allow_shape_mismatch=True)`` does; off: a mismatch is a
            ``ShardingError`` listing every such key.
        tiers: node-local checkpoints every few steps with partner copies, and ``ckpt_path="last"``
            resuming from the newest recoverable step in any tier (:class:`TiersConfig`, docs/tiers.md);
            ``null``: off.
    """

    storage: StorageOptions = field(default_factory=StorageOptions)
    balance_writes: bool = True
    validate_access_integrity: bool = True
    strict: Optional[str] = None  # None: as Lightning (see above); a mode the user set keeps Megatron-Core's meaning
    loader: Optional[str] = None
    async_save: bool = False
    max_staging_bytes: Optional[int] = None
    background_snapshot: bool = False
    safe_globals: List[str] = field(default_factory=list)
    cast: str = SAME_KIND
    allow_shape_mismatch: bool = False
    tiers: Optional[TiersConfig] = None

    def __post_init__(self) -> None:
        _check_types(self)
        try:
            if self.strict is not None:
                self.strict = StrictHandling.parse(self.strict).value
        except ValueError as e:
            # YAML's `strict: false` arrives as 'False': Lightning's words, not a mode's
            word = str(self.strict).strip()
            lightning = {"false": "log_all", "true": "raise_all"}.get(word.lower())
            hint = f" (Lightning's strict={word.capitalize()} is strict: {lightning})" if lightning else ""
            raise ConfigError(f"strict: {e}{hint}") from None
        for name in self.safe_globals:  # an unknown name fails here, naming it
            _import_global(name)
        if self.loader is not None and self.loader not in LOADER_NAMES:
            raise ConfigError(f"unknown loader {self.loader!r}; choose one of {list(LOADER_NAMES)} "
                              "or null (the default)")
        if self.max_staging_bytes is not None and self.max_staging_bytes < 0:
            raise ConfigError(f"max_staging_bytes must be null or >= 0 bytes, got {self.max_staging_bytes}")
        if self.background_snapshot and not self.async_save:
            raise ConfigError("background_snapshot: true needs async_save: true (a synchronous save has no background)")
        if self.cast not in CAST_RULES:
            raise ConfigError(f"cast must be one of {list(CAST_RULES)}, got {self.cast!r}")
        if self.tiers is not None:
            try:
                self.tiers.options()
            except CheckpointingError as e:  # ArgumentError / ArgumentTypeError: the field and the value
                raise ConfigError(f"tiers: {e}") from None

    @property
    def tier_options(self) -> Optional[TierOptions]:
        """The ``tiers:`` section as :class:`~lightning_distckpt.tiers.TierOptions`; None when off."""
        return None if self.tiers is None else self.tiers.options()

    @property
    def strict_handling(self) -> StrictHandling:
        """The configured mode; ``assume_ok_unexpected`` where ``strict`` is left at its default (None)."""
        return StrictHandling.ASSUME_OK_UNEXPECTED if self.strict is None else StrictHandling.parse(self.strict)

    @property
    def storage_options(self) -> StorageOptions:
        return self.storage

    @property
    def safe_global_types(self) -> Tuple[Any, ...]:
        """The types ``safe_globals`` names, imported (the config is the user's own, trusted)."""
        return tuple(_import_global(name) for name in self.safe_globals)


_BOOL_FIELDS = ("balance_writes", "validate_access_integrity", "async_save", "background_snapshot",
                "allow_shape_mismatch")


def _check_types(cfg: "DistCheckpointConfig") -> None:
    """The fields of a config built in Python, as omegaconf checks those of a YAML file: a bool is a bool
    (``async_save="false"`` is a true value, ``allow_shape_mismatch="no"`` would pad and truncate
    tensors), a size an int, a section its dataclass or a mapping of its keys (built here)."""
    for name in _BOOL_FIELDS:
        value = getattr(cfg, name)
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false (a bool), got {type(value).__name__} {value!r}")
    size = cfg.max_staging_bytes
    if size is not None and (isinstance(size, bool) or not isinstance(size, int)):
        raise ConfigError(f"max_staging_bytes must be null or an int of bytes, got {type(size).__name__} {size!r}")
    names = cfg.safe_globals
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"safe_globals must be a list of import paths (e.g. ['io.BytesIO']), got {names!r}")
    cfg.storage = _section("storage", cfg.storage, StorageOptions)
    if cfg.tiers is not None:
        cfg.tiers = _section("tiers", cfg.tiers, TiersConfig)


def _section(name: str, value: Any, schema: type) -> Any:
    """A section's dataclass: ``value`` itself, or built from a mapping of its keys (an unknown key named)."""
    if isinstance(value, schema):
        return value
    if not isinstance(value, (Mapping, DictConfig)):
        raise ConfigError(f"{name} must be a {schema.__name__} or a mapping of its keys, got {type(value).__name__}")
    keys = [f.name for f in fields(schema)]
    unknown = [str(k) for k in value if k not in keys]
    if unknown:
        raise ConfigError(f"{name}: unknown key {unknown[0]!r}; the keys of {name} are: {', '.join(keys)}")
    return schema(**value)


def _import_global(name: str) -> Any:
    """``"package.module.Type"`` -> the object, importing the longest module prefix that exists."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                value = getattr(value, attr)
        except AttributeError:
            break
        return value
    raise ConfigError(f"safe_globals: cannot import {name!r} (give a type's full import path, e.g. 'io.BytesIO')")


@dataclass
class StrategyConfig:
    """The settings of :class:`~lightning_distckpt.lightning.DistCheckpointStrategy` and
    :class:`~lightning_distckpt.lightning.FabricDistCheckpointStrategy`.

    Attributes:
        tensor_parallel_size: TP ranks per model replica (an int >= 1, else a ConfigError).
        checkpoint: the checkpoint settings; a mapping is read by :func:`load_checkpoint_config`.
    """

    tensor_parallel_size: int = 1
    checkpoint: DistCheckpointConfig = field(default_factory=DistCheckpointConfig)

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:  # 1.5 or "2" built in Python
            raise ConfigError(f"tensor_parallel_size must be an int >= 1, got {type(tp).__name__} {tp!r}")
        if not isinstance(self.checkpoint, DistCheckpointConfig):  # a mapping: as the strategies take it
            self.checkpoint = load_checkpoint_config(self.checkpoint)


def _user_config(schema: type, cfg: Any, what: str) -> Any:
    """The user's settings as omegaconf can merge them: a YAML file read, a mapping as it is."""
    if cfg is None:
        return {}
    if isinstance(cfg, (str, os.PathLike)):
        source = os.fspath(cfg)
        if os.path.exists(source) and not os.path.isfile(source):  # read as YAML, a FIFO would block
            kind = "a directory" if os.path.isdir(source) else "not a regular file (a FIFO, a device, ...)"
            raise ConfigError(f"{what} config {source} is {kind}: give a YAML file")
        if not os.path.isfile(source):
            example = "{'tensor_parallel_size': 2}" if schema.__name__ == "StrategyConfig" else "{'async_save': True}"
            raise ConfigError(f"{what} config file {source} does not exist (a str or path names a YAML file; give "
                              f"settings as a mapping, e.g. {example}, or a {schema.__name__})")
        try:
            return OmegaConf.load(io.BytesIO(_yaml_bytes(source)))
        except Exception as e:  # YAML syntax, unreadable file, aliases expanding past the bound: say which file
            raise ConfigError(f"invalid {what} config {source}: {e}") from None
    if isinstance(cfg, (Mapping, DictConfig)):
        return cfg
    raise ConfigError(f"{what} config must be a YAML path, a mapping or a {schema.__name__}, got {type(cfg).__name__}")


_MAX_CONFIG_BYTES = 1 << 20  # a config of ours is a few hundred bytes
_MAX_ALIAS_NODES = 1000  # nodes a document's aliases may expand it to (when more than 10x its own)


def _yaml_bytes(source: str) -> bytes:
    """The YAML file ``source``, read once, bounded: its bytes, and what its aliases expand to. A
    "billion laughs" (``&a [x, x]``, ``&b [*a, *a]``, ...) of a few hundred bytes is a tree of 2**n
    nodes, which omegaconf builds one by one (a 10,000-node document took 30 s; omegaconf before
    2.4 has no bound of its own and 2.4's is lifted by ``OMEGACONF_MAX_YAML_EXPANDED_NODES=none``)."""
    with open(source, "rb") as f:
        raw = f.read(_MAX_CONFIG_BYTES + 1)
    if len(raw) > _MAX_CONFIG_BYTES:
        raise ConfigError(f"larger than {_MAX_CONFIG_BYTES} bytes: no config")
    root = yaml.compose(raw, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # nodes only; an alias: its anchor
    sizes: dict = {}

    def size(node: Any) -> int:
        if id(node) not in sizes:
            sizes[id(node)] = 1 << 62  # a node inside itself (a recursive alias): past any bound
            kids = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else
                    node.value if isinstance(node, yaml.SequenceNode) else [])
            sizes[id(node)] = min(1 << 62, 1 + sum(size(k) for k in kids))
        return sizes[id(node)]

    expanded = 0 if root is None else size(root)
    if expanded > max(_MAX_ALIAS_NODES, 10 * len(sizes)):
        raise ConfigError(f"its aliases expand {len(sizes)} YAML nodes to {min(expanded, 10**18)} or more "
                          f"(a 'billion laughs'); write the values out")
    return raw


def _schema_node(schema: type) -> DictConfig:
    """``schema`` as the structured config the user's settings are merged into, every section writable.
    A frozen dataclass's section (``storage``: StorageOptions) comes out read-only, and omegaconf before
    2.4 refuses to merge into it ("Cannot set value of read-only config node"; 2.4 merges all the same);
    ``to_object`` still builds it as the frozen dataclass."""
    node = OmegaConf.structured(schema)
    pending = [node]
    while pending:
        section = pending.pop()
        OmegaConf.set_readonly(section, False)
        for key in section.keys():
            child = OmegaConf.select(section, str(key))  # None for a section left None (tiers), or ???
            if isinstance(child, DictConfig):
                pending.append(child)
    return node


def _load(schema: type, cfg: Any, what: str) -> Any:
    if isinstance(cfg, schema):
        return cfg
    source = os.fspath(cfg) if isinstance(cfg, (str, os.PathLike)) else "<config>"
    user = _user_config(schema, cfg, what)
    try:
        return OmegaConf.to_object(OmegaConf.merge(_schema_node(schema), user))
    except OmegaConfBaseException as e:
        # omegaconf's message names the key ("Key 'foo' not in 'DistCheckpointConfig'", with full_key).
        raise ConfigError(f"invalid {what} config {source}: {_with_key_hint(schema, e)}") from None
    except ValueError as e:  # a choice refused by a dataclass __post_init__ (StorageOptions' included)
        raise ConfigError(f"invalid {what} config {source}: {e}") from None
    except TypeError as e:  # a YAML whose top level is no mapping (a list): omegaconf cannot merge it
        raise ConfigError(f"invalid {what} config {source}: {e}; the config must be a mapping of keys") from None


def _config_keys(schema: type, prefix: str = "") -> List[str]:
    """Every key of ``schema`` as a dotted path (``storage.layout``), its sections' keys included."""
    keys = []
    for name, hint in typing.get_type_hints(schema).items():
        if name.startswith("_"):
            continue
        keys.append(prefix + name)
        inner = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]  # Optional[X] -> X
        if dataclasses.is_dataclass(inner[0]):
            keys += _config_keys(inner[0], f"{prefix}{name}.")
    return keys


def _with_key_hint(schema: type, error: Exception) -> str:
    """omegaconf's message, with the key meant when it names an unknown key and suggests none: the
    same name in another section (``layout`` -> ``storage.layout``), a close one, else the section's keys."""
    text, full_key = str(error), getattr(error, "full_key", None)
    if not isinstance(error, ConfigKeyError) or not full_key or "Did you mean" in text:
        return text
    section, _, name = str(full_key).rpartition(".")
    keys = _config_keys(schema)
    moved = [k for k in keys if k.rpartition(".")[2] == name and k != full_key]
    close = difflib.get_close_matches(name, [k.rpartition(".")[2] for k in keys], 1, 0.6)
    if name == "checkpoint" and not section and schema is DistCheckpointConfig:  # a strategy config's layout
        hint = ("A checkpoint config has its keys at the top level (only a strategy config, for "
                "DistCheckpointStrategy.from_config, nests them under checkpoint:).")
    elif moved:
        where = moved[0].rpartition(".")[0]
        hint = f"Did you mean: {moved[0]!r}? (that key belongs {f'under {where}:' if where else 'at the top level'})"
    elif close:
        hint = f"Did you mean: {next(k for k in keys if k.rpartition('.')[2] == close[0])!r}?"
    else:
        level = [k[len(section) + 1:] if section else k for k in keys
                 if k.rpartition(".")[0] == section]
        hint = f"The keys {('of ' + section) if section else 'at the top level'} are: {', '.join(level)}."
    first, _, rest = text.partition("\n")
    return f"{first}. {hint}" + (f"\n{rest}" if rest else "")


def unknown_argument(owner: str, key: str, value: Any, own: List[str], setting_form: str,
                     others: Sequence[str] = (), takes: str = "") -> str:
    """What is wrong with ``key=value`` given to ``owner`` (whose arguments are ``own`` and
    ``others``), and what to write instead: a checkpoint setting goes in ``owner`` + ``setting_form``
    (formatted with ``key`` and ``value``), anything else gets the closest argument name."""
    settings = [f.name for f in fields(DistCheckpointConfig)]
    if key in settings:
        return (f"{owner}({key}={value!r}): {key!r} is a checkpoint setting, not an argument; pass it as "
                f"{owner}{setting_form.format(key=key, value=value)} (or in a YAML file given instead)")
    close = difflib.get_close_matches(key, [*own, *settings], 1) or difflib.get_close_matches(key, list(others), 1)
    hint = f"; did you mean {close[0]!r}?" if close else "."
    return f"{owner} got an unexpected argument {key!r}{hint} " + (takes or f"It takes {', '.join(own)}.")


def load_checkpoint_config(cfg: ConfigLike = None) -> DistCheckpointConfig:
    """A :class:`DistCheckpointConfig` from ``cfg``: a YAML path, a mapping, a DictConfig, one already
    built, a :class:`StrategyConfig` (its ``checkpoint``) or None (the defaults).

    Raises:
        ConfigError: naming the unknown key or the bad value.
    """
    if isinstance(cfg, StrategyConfig):
        return cfg.checkpoint
    return _load(DistCheckpointConfig, cfg, "checkpoint")


def load_strategy_config(cfg: ConfigLike = None) -> StrategyConfig:
    """A :class:`StrategyConfig` (``tensor_parallel_size`` + ``checkpoint:`` section) from ``cfg``: a YAML
    path, a mapping, a DictConfig, one already built or None (the defaults).

    Raises:
        ConfigError: naming the unknown key or the bad value.
    """
    return _load(StrategyConfig, cfg, "strategy")
