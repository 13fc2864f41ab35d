"""Sample a continuation from the latest checkpoint (full recompute per token).

    python -m launch.sample --workdir=runs/k3_tiny --prompt="def main(" [--tokens=100 --temperature=0.8]
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from flax import nnx

from k3.config import ConfigError
from k3.data import DataError
from k3.train import RunError, load_for_inference

flags.DEFINE_string("workdir", None, "training workdir", required=True)
flags.DEFINE_string("prompt", "", "text to continue")
flags.DEFINE_integer("tokens", 64, "tokens to generate")
flags.DEFINE_float("temperature", 0.0, "0 = greedy")
flags.DEFINE_integer("seed", 0, "sampling seed")


def generate(graphdef, params, rest, prompt_ids, n_new: int, temperature: float, seed: int, seq_len: int):
    """Token ids after the prompt. Recomputes the whole (left-truncated) window for every token."""
    ids = list(prompt_ids)

    @jax.jit
    def next_logits(params, rest, window):
        logits, _ = nnx.merge(graphdef, params, rest)(window[None])
        return logits[0]

    key = jax.random.key(seed)
    for _ in range(n_new):
        window = ids[-seq_len:]
        # Pad to a power of two so the number of compilations stays logarithmic in the length.
        width = 1 << max(0, (len(window) - 1).bit_length())
        padded = jnp.asarray(window + [0] * (width - len(window)), jnp.int32)
        logits = next_logits(params, rest, padded)[len(window) - 1].astype(jnp.float32)
        if temperature <= 0:
            nxt = int(jnp.argmax(logits))
        else:
            key, sub = jax.random.split(key)
            nxt = int(jax.random.categorical(sub, logits / temperature))
        ids.append(nxt)
    return ids[len(prompt_ids):]


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
    new = generate(run.graphdef, state["params"], state["rest"], prompt_ids, f.tokens, f.temperature,
                   f.seed, cfg.data.seq_len)
    print(f.prompt + tokenizer.decode(np.asarray(new).tolist()))


if __name__ == "__main__":
    app.run(main)
