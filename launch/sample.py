"""Sample a continuation from the latest checkpoint (prefill, then cached decoding: `k3.decode`).

    python -m launch.sample --workdir=runs/k3_tiny --prompt="def main(" [--tokens=100 --temperature=0.8 --top_k=40]
"""

import math
import sys

from absl import flags, logging

from k3.config import ConfigError
from k3.data import DataError
from k3.decode import generate
from k3.checkpoints import load_for_inference
from k3.steps import RunError
from launch import cli

flags.DEFINE_string("workdir", None, "training workdir", required=True)
flags.DEFINE_string("prompt", "", "text to continue")
flags.DEFINE_integer("tokens", 64, "tokens to generate", lower_bound=1)
flags.DEFINE_float("temperature", 0.0, "0 = greedy", lower_bound=0.0)
flags.DEFINE_integer("top_k", 0, "sample from the k most likely tokens only (0 = all)", lower_bound=0)
flags.DEFINE_bool("stop_at_eos", True, "end the continuation at the end-of-document token")
# jax.random.key takes a signed 64-bit seed.
flags.DEFINE_integer("seed", 0, "sampling seed", lower_bound=-(2**63), upper_bound=2**63 - 1)
# lower_bound lets nan through (every comparison with it is false), and inf would sample uniformly.
flags.register_validator("temperature", math.isfinite, message="must be a finite number")


def main(argv):
    logging.set_verbosity(logging.WARNING)  # orbax reports every save step at INFO
    del argv
    f = flags.FLAGS
    try:
        cfg, run, state, tokenizer, _ = load_for_inference(f.workdir)
        prompt_ids = tokenizer.encode(f.prompt) if f.prompt else [tokenizer.eos_id]
        if not prompt_ids:
            raise RunError("the prompt encodes to no tokens")
    except (RunError, DataError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    stops = [tokenizer.eos_id] if f.stop_at_eos else []
    new = generate(run.graphdef, state["params"], state["rest"], [prompt_ids], f.tokens,
                   temperature=f.temperature, top_k=f.top_k, stop_tokens=stops, seed=f.seed)[0]
    print(f.prompt + tokenizer.decode(new))


if __name__ == "__main__":
    cli.run(main)
