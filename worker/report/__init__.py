"""What a worker tells the outside: its events (stdout, stderr, the run's log) and the
control plane's client."""
