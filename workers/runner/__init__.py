"""One rank's step: input batch, model runner, CUDA graphs, KV cache allocation and memory profiling."""
