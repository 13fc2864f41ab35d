"""Parameter counts and training FLOPs per token of a config, as one JSON object (`k3.params.report`).

    python -m launch.params --config=experiments/configs/k3_full.py [--seq_len=T]
"""

import json

from k3.config import ConfigError
from k3.params import report


def main(argv):
    del argv
    import sys

    from absl import flags

    try:
        print(json.dumps(report(flags.FLAGS.config, flags.FLAGS.seq_len or None), indent=2))
    except ConfigError as e:
        print(f"error: bad config: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "config file (experiments/configs/*.py)", lock_config=True)
    flags.DEFINE_integer("seq_len", 0, "context length for the attention FLOP term (0 = data.seq_len)")
    flags.mark_flags_as_required(["config"])
    app.run(main)
