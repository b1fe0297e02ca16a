"""The data model: sharded state dict entries, errors and key handling. Pure data, no I/O."""
