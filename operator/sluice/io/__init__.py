"""I/O with the outside world: the Kubernetes API and Prometheus. Small modules, called by the runtime."""
