"""The server model shared by the benchmark (`sluice.bench`) and the local stack's model servers
(`sluice.devstack.modelserver`): one vLLM engine iteration by iteration (`engine`) on hardware x model profiles
(`profiles`). Imports neither of them."""
