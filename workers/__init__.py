"""Model execution: Llama model, tensor-parallel layers, paged KV cache, runner, sampler, workers."""

# The parent of every logger in this package (each module's `logging.getLogger(__name__)`): its
# INFO lines say, once at load, what a process was timed to serve with. A Serve replica routes it
# (deployments/replica_logging.py), a TP rank's actor too (workers/executors/ray_worker.py).
WORKERS_LOGGER = __name__
