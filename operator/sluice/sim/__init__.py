"""The models shared by the benchmark (`sluice.bench`) and the local stack (`sluice.devstack`): one vLLM engine
iteration by iteration (`engine`) on hardware x model profiles (`profiles`), which paces the local stack's model
servers, and Envoy's least-request balancer (`leastrequest`), which routes its load generator. Imports neither of
them."""
