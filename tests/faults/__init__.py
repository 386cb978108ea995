"""Fault-injection tests: peers killed in the middle of operations,
malformed worker addresses, deadlines that must be kept."""
