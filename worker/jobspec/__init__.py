"""The JobSpec: one schema for a training job, read by the REST API, the CLI and the worker,
its bounds, its recovery field, and JSON read with limits (torch-free: the control plane
imports it)."""
