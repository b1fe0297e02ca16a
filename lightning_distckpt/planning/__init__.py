"""Planning: who writes and reads what. Plain data in, plain data out; no tensors, no files."""
