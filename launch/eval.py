"""Held-out loss of the latest checkpoint: nats/token and bits/byte, as one JSON line.

    python -m launch.eval --workdir=runs/k3_tiny [--batches=32]
"""

import json
import sys

from absl import app, flags, logging

from k3.config import ConfigError
from k3.data import DataError
from k3.checkpoints import load_for_inference
from k3.steps import RunError, evaluate

flags.DEFINE_string("workdir", None, "training workdir", required=True)
flags.DEFINE_integer("batches", 0, "validation batches (0 = the config's train.eval_batches)")


def main(argv):
    logging.set_verbosity(logging.WARNING)  # orbax reports every save step at INFO
    del argv
    try:
        cfg, run, state, _, val_source = load_for_inference(flags.FLAGS.workdir)
        if val_source is None:
            raise RunError("the run has no validation split (data.val_fraction = 0)")
        result = evaluate(run, state, val_source, flags.FLAGS.batches or cfg.train.eval_batches)
    except (RunError, DataError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps({"step": int(state["step"]), **result}))


if __name__ == "__main__":
    app.run(main)
