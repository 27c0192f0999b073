"""Checkpoints of jobs under the service, one duty a module.

* :mod:`service.checkpoints.publish`: phase 2 of a save: take the ranks' reports, decide
  (``worker.checkpoint.commit.decide``), publish once, answer where a step stands;
* :mod:`service.checkpoints.registry`: the published checkpoints of each job, in etcd;
* :mod:`service.checkpoints.retention`: delete what the job's policy no longer keeps, only after
  the successor is published;
* :mod:`service.checkpoints.resume`: what a starting worker group loads, and its load plan;
* :mod:`service.checkpoints.adopt`: reconcile the registry with storage (after a crash);
* :mod:`service.checkpoints.results`: the typed answers (and the JSON etcd keeps);
* :class:`service.checkpoints.service.Checkpoints`: the four built on one job service, what the
  API and the reconciler are given.
"""
