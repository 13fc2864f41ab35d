"""Multi-process start-up shared by the entry points: ``jax.distributed.initialize`` wiring.

One process per host (GPU node or TPU VM); every process runs the same command. The processes
find each other through a coordinator (process 0's address):

  * SLURM, Open MPI and Cloud TPU pods are detected by JAX itself: pass ``--distributed`` only
    (see ``launch/slurm_gpu.sbatch`` and ``launch/tpu_pod.sh``);
  * anywhere else, pass ``--coordinator_address=HOST:PORT --num_processes=N --process_id=I``
    (or set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID).

``--cpu_devices=N`` gives each process N CPU devices (tests and laptops; collectives over gloo).
All of this must run before anything touches a JAX backend.
"""

from __future__ import annotations

import os

from absl import flags

flags.DEFINE_bool("distributed", False, "initialise multi-process JAX (auto-detects SLURM, Open MPI, TPU pods)")
flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0 (implies --distributed)")
flags.DEFINE_integer("num_processes", None, "number of processes (implies --distributed)")
flags.DEFINE_integer("process_id", None, "this process's index in [0, num_processes)")
flags.DEFINE_integer("cpu_devices", 0, "CPU devices per process (0: JAX's default); for tests and laptops")

FLAGS = flags.FLAGS


def setup() -> None:
    """Configures devices and joins the other processes, as the flags and environment say."""
    import jax

    if FLAGS.cpu_devices:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", FLAGS.cpu_devices)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    address = FLAGS.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    n_proc = FLAGS.num_processes or _env_int("JAX_NUM_PROCESSES")
    proc_id = FLAGS.process_id if FLAGS.process_id is not None else _env_int("JAX_PROCESS_ID")
    if not (FLAGS.distributed or address or n_proc):
        return
    if address or n_proc:
        missing = [name for name, val in (("--coordinator_address", address), ("--num_processes", n_proc),
                                          ("--process_id", proc_id)) if val is None]
        if missing:
            raise ValueError(f"multi-process start needs {', '.join(missing)} (or the JAX_* variables)")
        jax.distributed.initialize(coordinator_address=address, num_processes=n_proc, process_id=proc_id)
    else:
        jax.distributed.initialize()  # cluster auto-detection


def _env_int(name: str) -> int | None:
    val = os.environ.get(name)
    return int(val) if val else None
