"""Simulated time: devices (hfl.simulation.devices), the virtual clock and round policies
(hfl.simulation.clock), asynchronous buffered aggregation (hfl.simulation.fedbuff)."""
