"""Model building blocks: attention over the paged KV cache, shard-ready linears, RoPE, norms."""
