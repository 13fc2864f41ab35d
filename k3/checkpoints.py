"""A run's identity and its checkpoints: workdir checks, run.json, orbax saves and restores (with
corrupt checkpoints set aside), and loading a trained workdir for inference.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from k3 import sharding
from k3.config import renamed_setting, validate
from k3.data import build_datasets
from k3.steps import RunError, make_run, to_host

# ------------------------------------------------------------------------------------------------

IDENTITY_SECTIONS = ("model", "data", "optim", "seed")


# Knobs inside the identity sections that change how, not what, is computed.
NOT_IDENTITY = ("model.moe.ep_dispatch", "model.kda.impl", "model.mla.attention_impl", "model.remat",
                "model.remat_policy", "model.attn_res_impl", "model.kda.conv_impl", "model.ce_impl",
                "model.kda.decode_impl")


def run_identity(cfg) -> dict:
    """The parts of the config that define a run (``steps``, logging and mesh knobs may change on resume)."""
    d = json.loads(cfg.to_json()) if not isinstance(cfg, dict) else cfg
    out = {k: d[k] for k in IDENTITY_SECTIONS if k in d}
    for key in NOT_IDENTITY:
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.get(p, {})
        node.pop(leaf, None)
    return out


# Keys removed from the schema that never changed what a run computed; saved configs drop them.
RETIRED_KEYS = ("model.param_dtype", "model.style")


def with_schema_defaults(saved: dict) -> dict:
    """A saved config (JSON dict) with the keys added to the schema since it was written, at their
    defaults (which keep the behaviour of the code that wrote it), and without `RETIRED_KEYS`."""
    from k3.config import default_config

    saved = json.loads(json.dumps(saved))
    for key in RETIRED_KEYS:
        *parents, leaf = key.split(".")
        node = saved
        for p in parents:
            node = node.get(p, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(leaf, None)

    model = saved.get("model")
    if isinstance(model, dict) and "layer_loop" not in model:
        # Written before model.layer_loop: its layers were scanned unless scan_layers said otherwise.
        model["layer_loop"] = renamed_setting("model.scan_layers", bool(model.pop("scan_layers", True)))[1]

    def merge(default, given):
        if not isinstance(default, dict) or not isinstance(given, dict):
            return given
        return {**default, **{k: merge(default.get(k), v) for k, v in given.items()}}

    return merge(json.loads(default_config().to_json()), saved)


def settle_layer_loop(cfg, workdir: Path) -> None:
    """Makes ``cfg.model.layer_loop`` concrete, in place: 'auto' becomes the value of the run already
    in ``workdir`` (its checkpoints have that parameter layout, whatever platform resumes them),
    else what 'auto' means on this platform (`k3.model.LAYER_LOOPS`)."""
    from k3.model import resolve_layer_loop

    run_file = workdir / "run.json"
    if cfg.model.layer_loop == "auto" and run_file.is_file():
        try:
            saved = with_schema_defaults(json.loads(run_file.read_text())["identity"])["model"]["layer_loop"]
        except (ValueError, KeyError, TypeError):
            saved = "auto"  # a corrupt run.json, which `check_workdir` names
        cfg.model.layer_loop = saved
    resolve_layer_loop(cfg)


def _diff_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff_keys(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


def check_workdir(cfg, workdir: Path) -> bool:
    """Validates the workdir against this run; returns True when it holds this run's checkpoints.

    Refuses (RunError, nothing touched) a workdir whose run.json belongs to another run that has
    checkpoints, or that holds checkpoints without a run.json. A run.json without any checkpoint (a
    start that failed early) is replaced by this run's.
    """
    run_file = workdir / "run.json"
    has_ckpts = (workdir / "checkpoints").is_dir() and any((workdir / "checkpoints").iterdir())
    if run_file.exists():
        try:
            saved = json.loads(run_file.read_text())
        except json.JSONDecodeError as e:
            raise RunError(f"{run_file} is corrupt ({e}); refusing to touch workdir {workdir}") from e
        diff = _diff_keys(run_identity(with_schema_defaults(saved.get("identity") or {})), run_identity(cfg))
        if diff and not has_ckpts:
            return False  # a start that failed before its first checkpoint: nothing to protect
        if diff:
            raise RunError(f"workdir {workdir} holds another run's checkpoints (config differs in: "
                           f"{', '.join(diff[:8])}); use a new --workdir")
        return has_ckpts
    if has_ckpts:
        raise RunError(f"workdir {workdir} holds checkpoints but no run.json: not this run's; use a new --workdir")
    return False


def write_run_file(cfg, workdir: Path) -> None:
    """Records the run's identity and full config in workdir/run.json (atomic write)."""
    tmp = workdir / "run.json.tmp"
    tmp.write_text(json.dumps({"identity": run_identity(cfg), "config": json.loads(cfg.to_json())}, indent=1))
    os.replace(tmp, workdir / "run.json")


def checkpoint_manager(cfg, workdir: Path):
    """Orbax manager: keeps the last ``keep_ckpts`` plus every ``keep_period``-th step.

    Orbax writes each checkpoint to a temporary directory and renames it when complete, so a
    checkpoint interrupted by a crash is never listed.
    """
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.train.keep_ckpts, keep_period=cfg.train.keep_period or None,
        enable_async_checkpointing=cfg.train.async_ckpt, create=True)
    return ocp.CheckpointManager((workdir / "checkpoints").absolute(), options=options)


@jax.jit
def copy_tree(tree):
    """A private copy of every array of ``tree``, as one program: ``jnp.copy`` leaf by leaf would
    compile one program per distinct shape (each a GPU compile of its own)."""
    return jax.tree.map(jnp.copy, tree)


def save_checkpoint(mngr, state: dict, data_state: dict, cfg) -> None:
    """Saves the train state and the data iterator position at ``state['step']``."""
    import orbax.checkpoint as ocp

    step = int(to_host(state["step"]))
    meta = {"data": data_state, "step": step, "config": json.loads(cfg.to_json())}
    # The next train step donates ``state``; an async save may still be reading it (on CPU the host
    # "copy" can alias the device buffer), so save a private copy.
    state = copy_tree(state)
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))


def abstract_like(state):
    """Shapes, dtypes and shardings of a state: restoring into it lays a checkpoint saved on any
    mesh out on this run's mesh."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def _short_error(e: Exception, limit: int = 400) -> str:
    """The exception's first line, cut at a word boundary: enough to name the cause."""
    text = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def restore_checkpoint(mngr, abstract_state: dict, step: int | None = None):
    """(state, meta) of the latest (or given) complete checkpoint; RunError if it cannot be read."""
    import orbax.checkpoint as ocp

    step = mngr.latest_step() if step is None else step
    try:
        restored = mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
    except Exception as e:  # orbax raises many types for corrupt or mismatched trees
        raise RunError(f"checkpoint {mngr.directory}/{step} cannot be restored into this model "
                       f"(corrupt, or a different architecture): {_short_error(e)}") from e
    return restored["state"], restored["meta"]


_LOOP_NOISE = ("Traceback (most recent call last):", "asyncio/base_events.py", "_check_closed",
               "Event loop is closed")
_LOOP_NOISE_LINES = ("Traceback (most recent call last):", "self._check_closed()",
                     "raise RuntimeError('Event loop is closed')", "RuntimeError: Event loop is closed")


def _is_loop_noise(line: str) -> bool:
    """A line of those tracebacks, or a piece of one (several threads print them at once)."""
    s = line.strip()
    return (not s or any(n in line for n in _LOOP_NOISE)
            or any(full.startswith(s) or full.endswith(s) for full in _LOOP_NOISE_LINES))


@contextlib.contextmanager
def _without_closed_loop_noise():
    """Holds back stderr (the file descriptor) while a checkpoint is read, then writes it out without
    the 'Event loop is closed' tracebacks that orbax's reader threads print when a restore fails
    (their callbacks reach the asyncio loop the failure already closed). Everything else passes."""
    sys.stderr.flush()
    saved = os.dup(2)
    options = {"linger": 0.0}
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield options
        finally:
            time.sleep(options["linger"])
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(ln for ln in lines if not _is_loop_noise(ln)))
            sys.stderr.flush()


def restore_newest_good(cfg, workdir: Path, mngr, abstract_state: dict):
    """(state, meta, mngr) from the newest checkpoint that restores; older ones are tried in turn.

    Checkpoints newer than the one restored are moved, untouched, to ``workdir/checkpoints_bad/``
    (the run will write those step numbers again) and each is reported on stderr with its error.
    When none restores, nothing is moved and RunError lists every failure. With several processes
    only the newest is tried (moving directories that every process reads is not done behind their
    backs): a bad one is an error naming it.
    """
    failures = []
    for step in sorted(mngr.all_steps(), reverse=True):
        try:
            with _without_closed_loop_noise() as held:
                try:
                    state, meta = restore_checkpoint(mngr, abstract_state, step)
                except RunError:
                    held["linger"] = 0.5  # late reader callbacks of the failed read land in the filter
                    raise
        except RunError as e:
            if jax.process_count() > 1:
                raise
            failures.append((step, str(e)))
            continue
        if failures:
            mngr.close()
            bad_dir = workdir / "checkpoints_bad"
            bad_dir.mkdir(exist_ok=True)
            for bad, why in failures:
                target = bad_dir / str(bad)
                n = 1
                while target.exists():
                    target, n = bad_dir / f"{bad}.{n}", n + 1
                os.replace(workdir / "checkpoints" / str(bad), target)
                print(f"warning: skipped checkpoint {bad} (moved to {target}): {why}", file=sys.stderr)
            print(f"warning: resuming from checkpoint {step}", file=sys.stderr)
            mngr = checkpoint_manager(cfg, workdir)
        return state, meta, mngr
    raise RunError("no checkpoint in {} can be restored:\n  {}".format(
        workdir / "checkpoints", "\n  ".join(why for _, why in failures)))


# ------------------------------------------------------------------------------------------------
# Metrics
# ------------------------------------------------------------------------------------------------



def _check_writable(directory: Path, create: bool = True) -> None:
    """Proves a file can be written in ``directory`` (created first when ``create``; else its nearest
    existing ancestor is probed, and nothing is left behind); RunError naming it if not.

    A checkpoint directory that cannot be written would otherwise fail inside orbax's writer threads
    at the first save, after compilation and training time are spent.
    """
    target = directory
    if not create:
        while not target.exists() and target != target.parent:
            target = target.parent
        if not target.is_dir():
            raise RunError(f"cannot create {directory}: {target} is not a directory")
    try:
        if create:
            directory.mkdir(parents=True, exist_ok=True)
        probe = target / f".k3_write_test.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise RunError(f"cannot write to {directory}: {e.strerror or e}") from e


def _guarded_save(mngr, state, data_state, cfg, workdir: Path) -> None:
    """`save_checkpoint`, with a failed write turned into RunError naming the directory."""
    try:
        save_checkpoint(mngr, state, data_state, cfg)
    except Exception as e:  # orbax surfaces OS errors of its writers under several types
        raise RunError(f"writing a checkpoint to {workdir / 'checkpoints'} failed: {_short_error(e)}") from e


def _guarded_wait(mngr, workdir: Path) -> None:
    """Waits for pending asynchronous checkpoint writes; a failed one becomes RunError."""
    try:
        mngr.wait_until_finished()
    except Exception as e:  # noqa: BLE001 - see _guarded_save
        raise RunError(f"writing a checkpoint to {workdir / 'checkpoints'} failed: {_short_error(e)}") from e




def load_for_inference(workdir: str | os.PathLike):
    """(cfg, run, state, tokenizer, val_source) from the latest checkpoint of a training workdir."""
    import ml_collections

    workdir = Path(workdir)
    run_file = workdir / "run.json"
    if not run_file.exists():
        raise RunError(f"{workdir} has no run.json: not a training workdir")
    try:
        cfg = ml_collections.ConfigDict(with_schema_defaults(json.loads(run_file.read_text())["config"]))
    except (json.JSONDecodeError, KeyError) as e:
        raise RunError(f"{run_file} is corrupt: {e}") from e
    validate(cfg)
    sizes = [cfg.mesh[a] for a in sharding.MESH_AXES]
    if -1 not in sizes and math.prod(sizes) > jax.device_count():
        # Trained on a larger mesh than this machine has: the checkpoint restores onto one device.
        for a in sharding.MESH_AXES:
            cfg.mesh[a] = 1
    mngr = checkpoint_manager(cfg, workdir)
    if mngr.latest_step() is None:
        raise RunError(f"{workdir} has no complete checkpoint")
    _, val_source, tokenizer = build_datasets(cfg, workdir)
    run, state = make_run(cfg)
    state, _ = restore_checkpoint(mngr, abstract_like(state))
    return cfg, run, state, tokenizer, val_source


