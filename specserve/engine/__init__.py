"""The model runtime of the workers: loading models, KV caches, batched passes, kernels, the model thread."""
