"""Parallelism: process groups and collectives (`distributed`), the strategy object the loop
calls at named points (`strategy`), FSDP2 sharding (`fsdp`) and its settings (`settings`)."""
