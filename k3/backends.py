"""Implementation tables: a config value names an entry; 'auto' picks the entry for the platform.

Each swappable computation (KDA core, MoE expert matmuls, MLA attention) owns one `Table` keyed by
the config value. The layer looks its entry up once, at construction; `k3.config.validate` checks
the config values against the tables' keys, so a new backend is one `register` call and nothing
else lists the allowed names.

    ATTENTION = Table("model.mla.attention_impl", auto={"gpu": "flash"}, default="xla")

    @ATTENTION.register("xla")
    def xla_attention(q, k, v, segment_ids, scale): ...

An entry may be marked ``platforms=("gpu",)``: asking for it elsewhere is a `BackendError` that
names the setting and the portable fallback, raised before anything is traced.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import jax


class BackendError(ValueError):
    """A backend that does not exist, or that cannot run on this platform."""


# Set by `targeting`, per thread: the platform being compiled for, when not this process's.
_CONTEXT = threading.local()


def _targets() -> list[str]:
    return _CONTEXT.__dict__.setdefault("targets", [])


def platform() -> str:
    """'gpu', 'tpu' or 'cpu': the platform being compiled for (`targeting`), else the default JAX backend."""
    targets = _targets()
    if targets:
        return targets[-1]
    backend = jax.default_backend()
    return "gpu" if backend in ("gpu", "cuda", "rocm") else backend


COMPILE_CACHE_HELP = "persistent XLA compilation cache directory: a rerun of a model skips its compiles"


def use_compile_cache(path: str) -> None:
    """Keeps XLA's compiled programs under ``path`` (every program, however quick to compile), so a
    rerun, a resumed run or another benchmark of the same model skips compiling them again: the
    K3 1024:12 state build (mostly the initialiser's compile) took a second process on an H200 7.0 s
    instead of 128.0 s. '' does nothing."""
    if not path:
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


@contextlib.contextmanager
def targeting(where: str):
    """Resolve 'auto' (and check platform-only entries) for ``where`` instead of this process's
    backend, e.g. to compile a GPU step ahead of time on a CPU host (`experiments.aot_report`)."""
    if where not in ("gpu", "tpu", "cpu"):
        raise BackendError(f"unknown platform {where!r}; expected 'gpu', 'tpu' or 'cpu'")
    _targets().append(where)
    try:
        yield
    finally:
        _targets().pop()


class Table:
    """Named implementations of one computation, chosen by the config key ``setting``.

    auto: platform -> entry name for the value 'auto'; platforms missing from it use ``default``.
    """

    def __init__(self, setting: str, *, default: str, auto: dict[str, str] | None = None):
        self.setting, self.default, self.auto = setting, default, dict(auto or {})
        self._entries: dict[str, Callable] = {}
        self._platforms: dict[str, tuple[str, ...] | None] = {}

    def register(self, name: str, platforms: tuple[str, ...] | None = None):
        """Decorator: adds ``fn`` under ``name`` (runs only on ``platforms`` when given)."""
        def add(fn):
            if name in self._entries or name == "auto":
                raise BackendError(f"{self.setting}: backend {name!r} registered twice or reserved")
            self._entries[name], self._platforms[name] = fn, platforms
            return fn
        return add

    def choices(self) -> tuple[str, ...]:
        """Every value the config key accepts: 'auto' and the registered names."""
        return ("auto",) + tuple(self._entries)

    def resolve(self, name: str, where: str | None = None) -> str:
        """The entry name that ``name`` means on platform ``where`` (default: this process's)."""
        where = where or platform()
        if name == "auto":
            name = self.auto.get(where, self.default)
        if name not in self._entries:
            raise BackendError(f"{self.setting}={name!r} is not one of {self.choices()}")
        allowed = self._platforms[name]
        if allowed is not None and where not in allowed:
            raise BackendError(
                f"{self.setting}={name!r} runs only on {'/'.join(allowed)}, not on {where}; "
                f"use {self.setting}='auto' (here: {self.resolve('auto', where)!r}) or {self.default!r}")
        return name

    def get(self, name: str, where: str | None = None) -> Callable:
        """The implementation for config value ``name`` (see `resolve`)."""
        return self._entries[self.resolve(name, where)]
