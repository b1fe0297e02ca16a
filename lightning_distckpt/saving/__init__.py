"""Save and load strategies: the synchronous parallel save, every-rank-reads load, the two-stage
data-parallel loader and async save."""
