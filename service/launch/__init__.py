"""How nodes run: one torchrun agent per node of a job, launched, watched and cancelled.

* :mod:`service.launch.protocol`: what the reconciler needs from a scheduler (``Scheduler``,
  ``NodeStatus``); the TorchX scheduler and the tests' fakes implement it.
* :mod:`service.launch.apps`: pure builders, (job, spec, node) -> the TorchX app, the Volcano Job
  a cluster would get, and the scheduler's settings.
* :mod:`service.launch.torchx_scheduler`: the I/O, through a TorchX runner (``local_cwd``
  processes or ``kubernetes`` jobs).
* :mod:`service.launch.node_exec`: the wrapper every local node runs under
  (``python -m service.launch.node_exec``), leaving its fate on disk.

Torch-free: the control plane imports this package.
"""
