"""The per-node collector: sources -> bounded rings -> one node-local HDF5 trace (docs/trace-format.md)."""
