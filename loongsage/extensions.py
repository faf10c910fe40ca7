"""Extension points by config: wherever a config names a component (a reward, a filter, an
advantage estimator, a loss, a KL estimator, a window strategy, a rollout kind, a trainer backend,
a weight transport, an inference client, a tool, a task), it may instead give `module:attr`, or a
name registered with `@register(kind, name)` in a module of a custom folder (`custom_dirs`, default
`./custom`), imported before the config is read. Values are resolved and shape-checked when the
config is loaded, so a typo is a one-line config error naming the key, not a crash an hour in.

The interfaces themselves are documented in `loongsage/api.py`; docs/extending.md shows each point.
Resolution imports nothing heavy itself: built-in names are checked as names, and only a user's
`module:attr` is imported (with whatever it imports).
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator

_REGISTRY: dict[str, dict[str, Any]] = {}
_PATHS: list[str] = []  # folders user modules were found in: actors put them on sys.path too
_CUSTOM: list[str] = []  # custom folders imported: actors import them too (their registrations)


def _callable_with(n: int) -> Callable[[Any], str | None]:
    """A check that an object can be called with `n` positional arguments."""
    def check(obj: Any) -> str | None:
        if not callable(obj):
            return "is not callable"
        try:
            inspect.signature(obj).bind(*range(n))
        except TypeError:
            return f"cannot be called with {n} positional argument{'s' if n != 1 else ''}"
        except ValueError:  # builtins without a signature
            return None
        return None
    return check


def _has(*methods: str) -> Callable[[Any], str | None]:
    def check(obj: Any) -> str | None:
        missing = [m for m in methods if not callable(getattr(obj, m, None))]
        return f"lacks {', '.join(missing)}" if missing else None
    return check


# kind -> (what it is, shape check); the full contracts are in loongsage/api.py
KINDS: dict[str, tuple[str, Callable[[Any], str | None]]] = {
    "reward": ("a reward function (response_text, row) -> float", _callable_with(2)),
    "filter": ("a data filter (group) -> bool (keep)", _callable_with(1)),
    "advantage": ("an advantage estimator (rewards [groups, n]) -> advantages", _callable_with(1)),
    "policy_loss": ("a policy loss (inputs, loss_cfg, denominator) -> (loss, metrics)", _callable_with(3)),
    "kl_estimator": ("a KL estimator (logprobs, ref_logprobs) -> per-token KL", _callable_with(2)),
    "window": ("a window strategy class (capacity, collectable)", _has("capacity", "collectable")),
    "rollout": ("a rollout factory (setup) -> Rollout", _callable_with(1)),
    "trainer_backend": ("a TrainBackend class (cfg, model_path)", _callable_with(2)),
    "transport": ("a WeightTransport class", _has("begin", "deliver")),
    "client": ("an InferenceClient class (base_url, api_key)", _callable_with(2)),
    "tool": ("a tool factory () -> Tool", _callable_with(0)),
    "task": ("a TaskSpec", _has("reward", "generate")),
}


def register(kind: str, name: str | None = None):
    """Decorator: `@register("reward", "exact_match")` makes the name usable in configs."""
    if kind not in KINDS:
        raise ValueError(f"unknown extension kind {kind!r}; expected one of {sorted(KINDS)}")

    def deco(obj):
        _REGISTRY.setdefault(kind, {})[name or obj.__name__] = obj
        return obj
    return deco


def registered(kind: str) -> dict[str, Any]:
    return dict(_REGISTRY.get(kind, {}))


def resolve(spec: str | Any, kind: str) -> Any:
    """A registered name or `module:attr` -> the object, shape-checked; ValueError says why not."""
    if not isinstance(spec, str):
        return spec
    what, check = KINDS[kind]
    if spec in _REGISTRY.get(kind, {}):
        obj = _REGISTRY[kind][spec]
    elif ":" in spec:
        module, _, attr = spec.partition(":")
        try:
            mod = importlib.import_module(module)
        except Exception as exc:
            raise ValueError(f"{spec!r}: cannot import {module!r} ({type(exc).__name__}: {exc})") from None
        obj = mod
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise ValueError(f"{spec!r}: module {module!r} has no attribute {attr!r}") from None
            obj = getattr(obj, part)
        _remember_path(mod)
    else:
        known = sorted(_REGISTRY.get(kind, {}))
        raise ValueError(f"{spec!r} is neither a registered {kind} ({', '.join(known) or 'none registered'}) "
                         "nor 'module:attr'")
    problem = check(obj)
    if problem:
        raise ValueError(f"{spec!r} {problem}; expected {what}")
    return obj


def _remember_path(mod) -> None:
    """The folder an actor must have on sys.path to import `mod` too (site-packages ones need none)."""
    file = getattr(mod, "__file__", None)
    if not file:
        return
    root = Path(file).resolve().parent
    for _ in mod.__name__.split(".")[1:]:
        root = root.parent
    if "site-packages" not in root.parts and str(root) not in _PATHS and str(root) != str(Path(__file__).parents[1]):
        _PATHS.append(str(root))


class PluginKind(str):
    """Marks a config field as an extension point of this kind (shown as `plugin(kind)`)."""

    def __repr__(self) -> str:
        return f"plugin({str(self)})"


def plugin(kind: str, builtins: Iterable[str] = ()) -> Any:
    """A config field type: a built-in name, a registered name, or `module:attr` of `kind`."""
    names = tuple(builtins)

    def validate(value: str) -> str:
        if value in names:
            return value
        try:
            resolve(value, kind)
        except ValueError:
            if ":" not in value and value not in _REGISTRY.get(kind, {}):
                raise ValueError(f"unknown {kind} {value!r}; expected one of {', '.join(names + tuple(registered(kind)))}"
                                 " or 'module:attr'") from None
            raise
        return value
    return Annotated[str, PluginKind(kind), AfterValidator(validate)]


def load_custom(dirs: Iterable[str | Path]) -> list[str]:
    """Puts each existing folder on sys.path and imports its modules (so their `@register`s run);
    returns the modules imported. Safe to call again (modules are imported once)."""
    loaded = []
    for d in dirs:
        folder = Path(d).resolve()
        if not folder.is_dir():
            continue
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
        if str(folder) not in _CUSTOM:
            _CUSTOM.append(str(folder))
        for file in sorted(folder.glob("*.py")):
            if file.stem.startswith("_"):
                continue
            importlib.import_module(file.stem)
            loaded.append(file.stem)
    return loaded


def search_path() -> dict[str, list[str]]:
    """Where this process found user extensions: folders of `module:attr` modules, custom folders."""
    return {"paths": list(_PATHS), "custom": list(_CUSTOM)}


def use_search_path(found: dict[str, list[str]] | None) -> None:
    """In an actor: the controller's `search_path()`, so the same names resolve here."""
    if not found:
        return
    for p in found["paths"]:
        if p not in sys.path:
            sys.path.insert(0, p)
    load_custom(found["custom"])
