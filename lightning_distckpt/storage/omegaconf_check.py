"""omegaconf containers in loaded state: data, never a way to run code when they are read.

The allow-list restores ``DictConfig`` / ``ListConfig`` (Lightning keeps hyper-parameters in them)
with their values as stored, and omegaconf resolves an interpolation each time its value is read.
One that calls a resolver, ``${oc.env:AWS_SECRET_ACCESS_KEY}`` or ``${eval:...}``, reads the
loading process's environment into the loaded values or runs whatever function the application
registered under that name (Hydra codebases register ``eval``; Lightning's ``load_from_checkpoint``
reads every hyper-parameter of a top-level DictConfig). So a stored value that calls a resolver is
refused when it is loaded (:class:`UnsafeContentError` naming it), unless the process says the
checkpoints it loads are trusted: ``LIGHTNING_DISTCKPT_ALLOW_RESOLVERS=1``. An interpolation that only
names another value (``${model.dim}``, what Hydra configs are made of) reads data and is kept.

A node whose parents form a cycle (omegaconf answers every read with a RecursionError) or nest
deeper than any config is a FormatError, whatever the setting.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Iterable, List, Optional

from ..core.errors import FormatError, UnsafeContentError
from ..core.tree_walk import MAX_DEPTH

ALLOW_RESOLVERS_ENV = "LIGHTNING_DISTCKPT_ALLOW_RESOLVERS"
_MAX_INTERPOLATION = 64 * 1024


def resolvers_allowed() -> bool:
    return os.environ.get(ALLOW_RESOLVERS_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def node_type() -> Optional[type]:
    """omegaconf's ``Node`` when omegaconf is imported (no node can have been loaded otherwise)."""
    if "omegaconf" not in sys.modules:
        return None
    from omegaconf.base import Node

    return Node


def check_nodes(nodes: Iterable[Any], where: str) -> None:
    """Every omegaconf node reachable from ``nodes`` (its content, children and parents, each once;
    read from their ``__dict__``: a hostile node's own accessors may recurse or resolve)."""
    from omegaconf.base import Node

    allow = resolvers_allowed()
    seen = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        state = vars(node)
        parent = _check_parents(node, Node, where)
        if parent is not None:
            stack.append(parent)
        value = state.get("_content", state.get("_val"))
        if isinstance(value, str) and not allow:
            _refuse_resolver(node, value, where)
        elif isinstance(value, dict):
            stack.extend(v for v in value.values() if isinstance(v, Node))
        elif isinstance(value, list):
            stack.extend(v for v in value if isinstance(v, Node))


def _check_parents(node: Any, node_cls: type, where: str) -> Any:
    """The node's parent, after checking that its chain of parents is made of nodes and ends
    within MAX_DEPTH steps (omegaconf walks it, recursively, on every read)."""
    up, chain = node, set()
    for _ in range(MAX_DEPTH + 1):
        chain.add(id(up))
        up = vars(up).get("_parent")
        if up is None:
            return vars(node).get("_parent")
        if id(up) in chain or not isinstance(up, node_cls):
            break
    raise FormatError(f"{where}: the omegaconf value at {_key_path(node)!r} has parents that form a cycle, "
                      f"nest more than {MAX_DEPTH} deep or are no omegaconf containers; refused")


def _refuse_resolver(node: Any, text: str, where: str) -> None:
    name = _resolver_called(text, where)
    if name is None:
        return
    shown = text if len(text) <= 120 else text[:117] + "..."
    raise UnsafeContentError(
        f"{where}: the omegaconf value at {_key_path(node)!r} is {shown!r}, an interpolation that calls the "
        f"resolver {name!r}: reading it would run that function or read this process's environment (loading "
        f"runs no code); refused. If the checkpoint is trusted, set {ALLOW_RESOLVERS_ENV}=1 to keep such "
        f"interpolations as they were saved")


def _resolver_called(text: str, where: str) -> Optional[str]:
    """The first resolver the interpolation ``text`` calls, as omegaconf's own grammar parses it;
    None for a plain string or one that names other values only."""
    if "${" not in text:  # the common case, without the parser
        return None
    if len(text) > _MAX_INTERPOLATION:  # the parser's time and memory grow with it; configs' are short
        raise FormatError(f"{where}: an omegaconf interpolation of {len(text)} characters (at most "
                          f"{_MAX_INTERPOLATION} are checked): {text[:120]!r}...; refused")
    from omegaconf import grammar_parser
    from omegaconf._utils import ValueKind, get_value_kind
    from omegaconf.errors import GrammarParseError
    from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser

    if get_value_kind(text) != ValueKind.INTERPOLATION:
        return None
    try:
        tree = grammar_parser.parse(text)
    except GrammarParseError:  # omegaconf cannot parse it either: reading it raises, runs nothing
        return None
    except RecursionError:
        raise FormatError(f"{where}: an omegaconf interpolation nested too deeply to parse: {text[:120]!r}") from None
    stack: List[Any] = [tree]
    while stack:  # the parse tree, without recursion: its depth is the string's nesting
        ctx = stack.pop()
        if isinstance(ctx, OmegaConfGrammarParser.InterpolationResolverContext):
            name = ctx.resolverName()
            return name.getText() if name is not None else "?"
        stack.extend(c for c in (getattr(ctx, "children", None) or ()) if hasattr(c, "children"))
    return None


def _key_path(node: Any) -> str:
    """``a.b[0]``-style place of ``node`` in its config, from the keys its metadata records."""
    keys: List[str] = []
    up = node
    for _ in range(MAX_DEPTH):
        meta = vars(up).get("_metadata")
        key = getattr(meta, "key", None)
        parent = vars(up).get("_parent")
        if parent is None or not hasattr(parent, "__dict__") or id(parent) == id(up):
            break
        keys.append(f"[{key}]" if isinstance(key, int) else f".{key}")
        up = parent
    return "".join(reversed(keys)).lstrip(".") or "<root>"
