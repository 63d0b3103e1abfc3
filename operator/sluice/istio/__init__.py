"""Istio rendering: pure builders of the DestinationRule, VirtualService, ServiceEntry and EnvoyFilter objects."""
