"""Multi-host start-up: join a ``jax.distributed`` run from flags or the cluster environment.

Every process runs the same ``nnxtron train`` command. Either all three of
``--coordinator-address HOST:PORT --num-processes N --process-id I`` are given, or
``--distributed`` lets JAX detect them (SLURM, Open MPI, TPU VMs, Kubernetes...;
``JAX_COORDINATOR_ADDRESS`` is read too). CPU processes exchange collectives through gloo.
"""

from __future__ import annotations

from nnxtron.errors import UserError

INIT_TIMEOUT_S = 300
PEER_TIMEOUT_S = 60  # a process silent this long (JAX's heartbeat) is taken for dead; the others stop


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    detect: bool = False,
    peer_timeout: int = PEER_TIMEOUT_S,
) -> bool:
    """Join the distributed run described by the arguments; False (nothing done) when none
    is given and ``detect`` is off. Must run before anything touches a JAX backend."""
    given = [coordinator_address, num_processes, process_id]
    if not detect and all(v is None for v in given):
        return False
    if not detect and any(v is None for v in given):
        raise UserError(
            "--coordinator-address, --num-processes and --process-id go together; give all three, "
            "or --distributed to detect them from the cluster (SLURM, MPI, TPU, Kubernetes)"
        )
    if peer_timeout < 1:
        raise UserError(f"--peer-timeout must be at least 1 second, got {peer_timeout}")
    if num_processes is not None and num_processes < 1:
        raise UserError(f"--num-processes must be at least 1, got {num_processes}")
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise UserError(f"--process-id must be in [0, {num_processes}), got {process_id}")
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # only read by the CPU backend
    try:
        jax.distributed.initialize(
            coordinator_address,
            num_processes,
            process_id,
            initialization_timeout=INIT_TIMEOUT_S,
            heartbeat_timeout_seconds=peer_timeout,
        )
    except (RuntimeError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(
            f"could not join the distributed run ({first[:200]}); check the coordinator address, the process "
            "count and id, and that every process was started"
        ) from None
    return True
