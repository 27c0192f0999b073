"""etcd, the one place state lives.

* :mod:`worker.etcdclient`: the one etcd v3 client (transport, member failover, leases,
  transactions, TLS), used by the control plane's store and by the torchrun rendezvous;
* :mod:`service.etcd.kv`: the control plane's store (``KVStore``: compare-and-set writes,
  fenced by the leader's lease) and ``EtcdStore`` on the client;
* :mod:`service.etcd.election`: leader election on a lease, and the leader's address;
* :mod:`service.etcd.memory`: the same store in memory, for tests;
* :mod:`service.etcd.server`: the embedded single-member etcd ``elastrain serve`` starts.
"""
