"""Model execution: Llama model, tensor-parallel layers, paged KV cache, runner, sampler, workers."""
