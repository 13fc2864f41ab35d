"""Command-line plumbing shared by the entry points: config flags and one-line errors.

Every user error (an unknown or ill-typed ``--config.*`` override, a missing config file, a bad flag,
a run that cannot start or continue) ends the same way: one line ``error: ...`` on stderr and exit
status 2, with no traceback. ``fail`` leaves through ``os._exit``: an orbax writer thread blocked on a
failed write would otherwise keep the interpreter from exiting.
"""

from __future__ import annotations

import os
import re
import sys

from absl import app, flags


def fail(message: str, code: int = 2) -> None:
    """Prints ``error: message`` and exits at once (background threads are not waited for)."""
    print(f"error: {message}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _override_for(key: str, argv: list[str]) -> str | None:
    """The ``--config.a.b=...`` argument whose path mentions ``key``."""
    for arg in argv:
        m = re.match(r"--?\w+\.([\w.]+)(=.*)?$", arg)
        if m and key in m.group(1).split("."):
            return arg
    return None


def define_config_flag(name: str, default: str | None, help_string: str) -> None:
    """``ml_collections`` config-file flag; its overrides are parsed here (at definition), so their
    errors are reported as one line instead of an import-time traceback."""
    from ml_collections import config_flags

    try:
        config_flags.DEFINE_config_file(name, default, help_string, lock_config=True)
    except (AttributeError, KeyError) as e:
        _unknown_key(e)
    except (ValueError, TypeError) as e:
        fail(f"bad --{name} override: {e}")


def _unknown_key(e: Exception) -> None:
    """An override naming a key the (locked) config does not have."""
    m = re.search(r'Key "([\w.]+)" does not exist|instead of "([\w.]+)"\?', str(e))
    key = str(e).strip("'\" ")
    key = (m.group(1) or m.group(2)) if m else key.split("'")[1] if "'" in key else key
    arg = _override_for(key, sys.argv)
    from k3.config import renamed_hint

    fail(f"unknown config key {key!r}" + (f" in {arg}" if arg else "") + renamed_hint(key)
         + " (the keys are listed in k3/config.py)")


def _parse_flags(argv: list[str]) -> list[str]:
    try:
        argv = flags.FLAGS(argv)
    except flags.Error as e:
        fail(str(e).splitlines()[0])
    except (AttributeError, KeyError) as e:  # an override of a key the config file does not define
        _unknown_key(e)
    except OSError as e:  # an override read a config file that failed to load
        _config_load_failed(e)
    if "config" in flags.FLAGS:
        try:  # a config file that failed to load only raises when first read
            value = flags.FLAGS["config"].value
            if value is not None:
                value.keys()
        except Exception as e:  # noqa: BLE001 - a config file may raise anything while it loads
            _config_load_failed(e)
    return argv


def _config_load_failed(e: Exception) -> None:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    fail(f"cannot load the config file: {lines[-1] if lines else type(e).__name__}")


def run(main) -> None:
    """``absl.app.run(main)`` with flag and config errors reported by `fail`."""
    app.run(main, flags_parser=_parse_flags)
