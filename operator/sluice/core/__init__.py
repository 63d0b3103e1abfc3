"""The pure core: scoring, weights, protection, canary and status, as functions of
(spec, observed pods, signals, previous status, now). No I/O, no clock, no randomness."""
