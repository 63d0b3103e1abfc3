"""The routing-quality benchmark: simulated fleets (fleet_sim), Envoy-like strategies, sluice in the loop. A tool."""
