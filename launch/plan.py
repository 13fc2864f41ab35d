"""Command line of the memory and communication planner (`k3.plan`; its docstring has the model).

    python -m launch.plan --config=experiments/configs/k3_full.py --mesh=fsdp:16,expert:64 --device=h200 \
        [--batch=GLOBAL_SEQUENCES --seq=TOKENS --remat=full|none --mfu=0.4 --headroom=0.1] [--json]
    python -m launch.plan --config=experiments/configs/k3_full.py --suggest --devices=1024 --device=h200
"""

import json
import sys

import jax

from k3.plan import (DEVICES, PlanError, context_fsdp_overrides, format_plan, format_suggest, load_model,
                     parse_mesh, plan, suggest)


def _define_flags():
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "config file (experiments/configs/*.py)", lock_config=True)
    flags.DEFINE_string("mesh", "", "axis:size list, e.g. data:1,fsdp:64,expert:64 (missing axes = 1, one may be -1)")
    flags.DEFINE_integer("devices", 0, "device count: fills a -1 mesh axis; required by --suggest")
    flags.DEFINE_string("device", "h200", f"device kind: {', '.join(DEVICES)}")
    flags.DEFINE_integer("batch", 0, "global sequences per step (0 = data.batch_size)")
    flags.DEFINE_integer("seq", 0, "tokens per sequence (0 = data.seq_len)")
    flags.DEFINE_enum("remat", None, ["full", "none"], "override model.remat")
    flags.DEFINE_float("mfu", 0.4, "model-FLOP utilisation assumed for the compute time")
    flags.DEFINE_float("headroom", 0.10, "fraction of device memory left for XLA buffers and fragmentation")
    flags.DEFINE_bool("suggest", False, "search meshes of --devices devices and print the best that fit")
    flags.DEFINE_integer("top", 5, "meshes to print with --suggest")
    flags.DEFINE_float("suggest_capacity_factor", 1.25,
                       "with --suggest on a dropless config where nothing fits, search again at this "
                       "model.moe.capacity_factor (0 = never)")
    flags.DEFINE_string("suggest_contexts", "2,4,8",
                        "with --suggest, when no mesh with context=1 fits, search again with these context "
                        "sizes too ('' = never)")
    flags.DEFINE_bool("json", False, "print JSON instead of the table")
    flags.mark_flags_as_required(["config"])


def _fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def main(argv) -> None:
    """CLI entry point (see the module docstring)."""
    from absl import flags

    if len(argv) > 1:
        _fail(f"unexpected arguments: {' '.join(argv[1:])}")
    F = flags.FLAGS
    if F.device not in DEVICES:
        _fail(f"unknown device {F.device!r}; known devices: {', '.join(DEVICES)}")
    if not 0 <= F.headroom < 1 or not 0 < F.mfu <= 1:
        _fail("--headroom must be in [0, 1) and --mfu in (0, 1]")
    remat = None if F.remat is None else F.remat == "full"
    kw = dict(batch=F.batch or None, seq=F.seq or None, remat=remat, mfu=F.mfu, headroom=F.headroom)
    try:
        if F.suggest:
            if F.devices <= 0:
                _fail("--suggest needs --devices=N")
            mdl = load_model(F.config)
            stages = [("", {})]
            if F.config.model.moe.capacity_factor <= 0 and F.suggest_capacity_factor > 0:
                stages.append((f", with --config.model.moe.capacity_factor={F.suggest_capacity_factor}",
                               {"capacity_factor": F.suggest_capacity_factor}))
            contexts = tuple(int(c) for c in F.suggest_contexts.split(",") if c.strip())
            if contexts:
                extra = dict(stages[-1][1], contexts=(1,) + contexts)
                label = stages[-1][0] + f", context parallel in {{1,{','.join(map(str, contexts))}}}"
                ro = context_fsdp_overrides(F.config.mesh.rule_overrides)
                if ro:
                    extra["rule_overrides"] = ro
                    label += f" and --config.mesh.rule_overrides={ro}"
                stages.append((label, extra))
            texts, results = [], []
            for label, extra in stages:
                res = suggest(mdl, F.devices, F.device, **kw, **extra)
                texts.append(format_suggest(res, F.devices, F.device, F.top, label))
                results.append({"settings": label.lstrip(", ") or "config", "result": res})
                if res["fitting"]:
                    break
            if F.json:
                for r in results:
                    r["result"]["fitting"] = [_strip(p) for p in r["result"]["fitting"][:F.top]]
                    r["result"]["closest"] = [_strip(p) for p in r["result"]["closest"][:F.top]]
                print(json.dumps(results, indent=1))
            else:
                print("\n\n".join(texts))
            return
        if not F.mesh:
            _fail("pass --mesh=axis:size,... (or --suggest --devices=N)")
        sizes = parse_mesh(F.mesh, F.devices or None)
        p = plan(load_model(F.config), sizes, F.device, **kw)
    except PlanError as e:
        _fail(str(e))
    print(json.dumps(_strip(p), indent=1) if F.json else format_plan(p))


def _strip(p: dict) -> dict:
    """A plan without its bulky per-layer breakdown, for JSON."""
    return {k: v for k, v in p.items() if k != "per_layer"}


if __name__ == "__main__":
    from absl import app

    jax.config.update("jax_platforms", "cpu")  # shapes only: no accelerator is needed or touched
    _define_flags()
    app.run(main)
