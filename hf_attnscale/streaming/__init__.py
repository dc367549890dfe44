"""StreamingLLM: a KV cache of sink tokens plus a sliding window, with positions taken inside the cache."""
