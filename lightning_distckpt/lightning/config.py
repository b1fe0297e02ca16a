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
import os
import typing
from dataclasses import dataclass, field, fields
from typing import Any, List, Mapping, Optional, Sequence, Tuple, Union

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
            (e.g. ``assume_ok_unexpected``, ``log_all``, ``raise_all``, ``ignore_all``).
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
    strict: str = StrictHandling.ASSUME_OK_UNEXPECTED.value
    loader: Optional[str] = None
    async_save: bool = False
    max_staging_bytes: Optional[int] = None
    background_snapshot: bool = False
    safe_globals: List[str] = field(default_factory=list)
    cast: str = SAME_KIND
    allow_shape_mismatch: bool = False
    tiers: Optional[TiersConfig] = None

    def __post_init__(self) -> None:
        try:
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
        if isinstance(self.tiers, Mapping):  # built in Python with a dict for the section
            self.tiers = TiersConfig(**self.tiers)
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
        return StrictHandling.parse(self.strict)

    @property
    def storage_options(self) -> StorageOptions:
        return self.storage

    @property
    def safe_global_types(self) -> Tuple[Any, ...]:
        """The types ``safe_globals`` names, imported (the config is the user's own, trusted)."""
        return tuple(_import_global(name) for name in self.safe_globals)


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
    :class:`~lightning_distckpt.lightning.FabricDistCheckpointStrategy`."""

    tensor_parallel_size: int = 1
    checkpoint: DistCheckpointConfig = field(default_factory=DistCheckpointConfig)

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")


def _user_config(schema: type, cfg: Any, what: str) -> Any:
    """The user's settings as omegaconf can merge them: a YAML file read, a mapping as it is."""
    if cfg is None:
        return {}
    if isinstance(cfg, (str, os.PathLike)):
        source = os.fspath(cfg)
        if not os.path.isfile(source):
            example = "{'tensor_parallel_size': 2}" if schema.__name__ == "StrategyConfig" else "{'async_save': True}"
            raise ConfigError(f"{what} config file {source} does not exist (a str or path names a YAML file; give "
                              f"settings as a mapping, e.g. {example}, or a {schema.__name__})")
        try:
            return OmegaConf.load(source)
        except Exception as e:  # YAML syntax, unreadable file: say which file
            raise ConfigError(f"invalid {what} config {source}: {e}") from None
    if isinstance(cfg, (Mapping, DictConfig)):
        return cfg
    raise ConfigError(f"{what} config must be a YAML path, a mapping or a {schema.__name__}, got {type(cfg).__name__}")


def _load(schema: type, cfg: Any, what: str) -> Any:
    if isinstance(cfg, schema):
        return cfg
    source = os.fspath(cfg) if isinstance(cfg, (str, os.PathLike)) else "<config>"
    user = _user_config(schema, cfg, what)
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), user))
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
    """A :class:`DistCheckpointConfig` from a YAML path, a mapping, a DictConfig or one already built.

    Raises:
        ConfigError: naming the unknown key or the bad value.
    """
    if isinstance(cfg, StrategyConfig):
        return cfg.checkpoint
    return _load(DistCheckpointConfig, cfg, "checkpoint")


def load_strategy_config(cfg: ConfigLike = None) -> StrategyConfig:
    """A :class:`StrategyConfig` (``tensor_parallel_size`` + ``checkpoint:`` section) from YAML or a mapping."""
    return _load(StrategyConfig, cfg, "strategy")
