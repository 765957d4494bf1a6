"""Processes the benchmarks start: one per rank, each writing ``rank{r}.json`` into the folder it is given."""
