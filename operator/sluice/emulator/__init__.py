"""The Kubernetes API emulator of the local stack (`python -m sluice.emulator.apiserver`): what kubectl, Helm,
kopf and the official client are answered as kube-apiserver answers them. A tool, never imported by the
operator."""
