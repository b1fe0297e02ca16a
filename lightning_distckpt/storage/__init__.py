"""Storage: the on-disk layout, tensorstore array I/O, safe object serialization, atomic commit."""
