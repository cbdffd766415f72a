"""KV-aware request routing: a thin ingress reads each prompt, a Serve request router sends it to
the replica most likely to hold the prompt's prefix in its KV cache (see kv_router.py)."""
