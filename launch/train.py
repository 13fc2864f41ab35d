"""Pretrain from a config file; rerunning the same command on the same workdir resumes.

    python -m launch.train --config=experiments/configs/k3_tiny.py --workdir=runs/k3_tiny \
        [--config.steps=600 --config.data.source=text_dir --config.data.path=/my/texts ...]

On a mesh (``--config.mesh.fsdp=8 ...``) and across hosts (``--distributed``, see
`launch.distributed`), every process runs this same command.
"""

from absl import app, flags, logging

from k3.config import ConfigError
from k3.data import DataError
from launch import cli, distributed

cli.define_config_flag("config", "experiments/configs/k3_tiny.py", "config file")
flags.DEFINE_string("workdir", None, "run directory: checkpoints, metrics, tokenizer", required=True)
flags.DEFINE_string("compile_cache", None, "persistent XLA compilation cache directory: a restarted or "
                    "resumed run reuses the programs compiled before")


def main(argv):
    logging.set_verbosity(logging.WARNING)  # orbax reports every save step at INFO
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        distributed.setup()
    except ValueError as e:
        cli.fail(str(e))
    from k3.train import RunError, train  # after the backend is configured

    from k3.backends import use_compile_cache

    use_compile_cache(flags.FLAGS.compile_cache or "")

    try:
        last = train(flags.FLAGS.config, flags.FLAGS.workdir)
    except (RunError, DataError, ConfigError) as e:
        cli.fail(str(e))
    if last:
        summary = {k: last[k] for k in ("step", "loss", "val_loss", "val_bits_per_byte") if k in last}
        print("done:", " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))


if __name__ == "__main__":
    cli.run(main)
