"""Parallelism: process groups and collectives (`distributed`), the strategy object that owns
a launch's parallelism and that the loop calls at named points (`strategy`), how the ranks
agree on requests and stops (`agreement`), FSDP2 sharding (`fsdp`) and its settings
(`settings`)."""
