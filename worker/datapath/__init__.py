"""The data path: datasets (built-in, token files, user factories), the global sampler, the
background feed of micro-batches, and the trace of what each rank loaded."""
