"""MPI merge of node traces into one job file: loading, clock alignment, matching, wait states,
stragglers, reports and exports (docs/merge.md)."""
