"""KV transfer between engines through shared storage (vLLM's `kv_transfer_config`,
disaggregated prefill): config.py (the option), storage.py (one file per block and rank),
connector.py (the scheduler's side: lookups, loads and saves as plain data), block_io.py (the
worker's side: copies between the files and the KV cache)."""
