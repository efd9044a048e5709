"""KV memory in numbers: `pagedllm plan` (what a budget holds for a model) and `pagedllm simulate` (how much of
the memory each allocation policy fills with token states on a replayed trace). See docs/kv-memory.md."""
